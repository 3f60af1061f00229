"""Sampling: request parameters (``params``, imported by the router: no torch), batched penalties and sampler,
stop conditions. Import the submodules; this package imports nothing, so reading ``params`` costs no torch."""
