"""Backend name -> implementing class, imported lazily (a backend's heavy imports load only when chosen)."""

from __future__ import annotations

import importlib

from kvtransfer.backends.base import KVBackend

BACKENDS: dict[str, str] = {
    "fake": "kvtransfer.backends.fake:FakeBackend",
    "tcp": "kvtransfer.backends.tcp:TcpBackend",
    "shm": "kvtransfer.backends.shm:ShmBackend",
    "nccl": "kvtransfer.backends.nccl:NcclBackend",
    "ucx": "kvtransfer.backends.ucx:UcxBackend",
    "nixl": "kvtransfer.backends.nixl:NixlBackend",
    "mooncake": "kvtransfer.backends.mooncake:MooncakeBackend",
}


def backend_class(name: str) -> type[KVBackend]:
    """The class registered as ``name``; unknown names raise ValueError listing the choices."""
    try:
        target = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown KV transfer backend {name!r}; choose one of {', '.join(sorted(BACKENDS))}") from None
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not issubclass(cls, KVBackend):
        raise TypeError(f"{target} is not a KVBackend")
    return cls
