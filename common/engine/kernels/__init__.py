"""Compute kernels: Triton on CUDA, each beside a pure-torch reference that is the CPU path and the test oracle."""
