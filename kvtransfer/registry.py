"""Backend name -> implementing class (``common.kv_backends``'s table), imported lazily (a backend's heavy imports
load only when chosen)."""

from __future__ import annotations

import importlib

from common.kv_backends import KV_TRANSFER_BACKENDS
from kvtransfer.backends.base import KVBackend


def backend_class(name: str) -> type[KVBackend]:
    """The class registered as ``name``; unknown names raise ValueError listing the choices."""
    try:
        target = KV_TRANSFER_BACKENDS[name].ref
    except KeyError:
        choices = ", ".join(sorted(KV_TRANSFER_BACKENDS))
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {choices}") from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not issubclass(cls, KVBackend):
        raise TypeError(f"{target} is not a KVBackend")
    return cls
