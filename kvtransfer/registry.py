"""Backend name -> implementing class (``common.kv_backends``'s table), imported lazily (a backend's heavy imports
load only when chosen)."""

from __future__ import annotations

import importlib

from common.kv_backends import KV_TRANSFER_BACKENDS
from kvtransfer.args import KVArgs, KVTransferConfig, Mode
from kvtransfer.backends.base import BackendEvents, KVBackend, PeerKey
from kvtransfer.backends.grouped import GroupedBackend


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


def make_backend(args: KVArgs, config: KVTransferConfig, mode: Mode, events: BackendEvents, local: PeerKey
                 ) -> KVBackend:
    """``config.backend`` over ``args``: one backend, or one per layer group (``GroupedBackend``) when the layers
    differ in slot geometry."""
    cls = backend_class(config.backend)
    if len(args.groups()) > 1:
        return GroupedBackend(args, config, mode, events, local, cls)
    return cls(args, config, mode, events, local)
