"""Data-plane backends, one module each; see ``base.py`` for the interface and ``kvtransfer.registry``."""
