"""The KV transfer backends, one table: each backend's name (``--kv-transfer-backend``), the class that implements it
(imported lazily by ``kvtransfer.registry``: a backend's heavy imports load only when chosen) and its settings
(``--kv-transfer-option KEY=VALUE``: names, defaults and checks).

The table is read by the node's config (``ServerArgs``: the backend's name is one of its keys, and a bad key or
value stops the node before any model loads), by the registry, and by the backends (``option``/``int_option``),
which take their defaults from it. A backend's module docstring says what its settings do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from common.errors import ConfigError

Check = Callable[[str], str | None]  # why the value is refused, or None


def _integer(low: int, high: int | None = None) -> Check:
    def check(value: str) -> str | None:
        number = int(value) if value.strip().lstrip("-").isdigit() else None
        if number is None or number < low or (high is not None and number > high):
            return f"an integer between {low} and {high}" if high is not None else f"an integer >= {low}"
        return None
    return check


def _one_of(*choices: str) -> Check:
    return lambda value: None if value in choices else f"one of {', '.join(choices)}"


def _text(value: str) -> str | None:
    return None


@dataclass(frozen=True)
class Option:
    default: str
    check: Check = _text


@dataclass(frozen=True)
class Backend:
    ref: str  # "module:Class" of its ``KVBackend``
    options: dict[str, Option]


KV_TRANSFER_BACKENDS: dict[str, Backend] = {
    "tcp": Backend("kvtransfer.backends.tcp:TcpBackend", {
        "stage": Option("auto", _one_of("auto", "always")),
        "stage_bytes": Option(str(16 << 20), _integer(1)),
        "streams": Option("2", _integer(1, 8)),
        "stripe_bytes": Option(str(4 << 20), _integer(1)),
    }),
    "nccl": Backend("kvtransfer.backends.nccl:NcclBackend", {"pack_bytes": Option("0", _integer(0))}),
    "ucx": Backend("kvtransfer.backends.ucx:UcxBackend", {
        # UCX's own default. "sm,tcp" (the default before) left out cma single-copy puts on one host (slower than raw
        # NIXL: benchmarks/pages/kv_transfer.md) and every RDMA transport on a cluster.
        "ucx_tls": Option("all"),
        "ucx_progress_mode": Option("blocking", _one_of("blocking", "polling", "thread", "thread-polling")),
    }),
    # NIXL's progress thread polls with this timeout (µs); 0 = NIXL's own busy polling, a core per agent when idle.
    "nixl": Backend("kvtransfer.backends.nixl:NixlBackend", {"progress_delay_us": Option("1000", _integer(0, 1_000_000))}),
    "mooncake": Backend("kvtransfer.backends.mooncake:MooncakeBackend", {
        "mooncake_protocol": Option("tcp", _one_of("tcp", "rdma")), "mooncake_device": Option("")}),
    # landing_signal: a chunk's ChunkDone leaves once its copy is enqueued and decode waits for its landing signal
    # (kvtransfer/backends/signals.py) where both ranks set the signals up, else ChunkDone follows the landing. off
    # (the default until a GPU run has proven the CUDA IPC event path: the GPU check's kvsig step), auto: GPU pools
    # only (on CPU pools they cost more than they save, benchmarks/pages/kv_transfer.md), on: CPU pools too.
    "shm": Backend("kvtransfer.backends.shm:ShmBackend", {
        "landing_signal": Option("off", _one_of("auto", "on", "off"))}),
    "fake": Backend("kvtransfer.backends.fake:FakeBackend", {}),
}


def check_options(backend: str, options: Mapping[str, str], flag: str = "--kv-transfer-option") -> None:
    """Every key is a setting of ``backend`` and every value passes its check; else ConfigError saying what to fix."""
    known = KV_TRANSFER_BACKENDS[backend].options if backend in KV_TRANSFER_BACKENDS else {}
    for key, value in options.items():
        if key not in known:
            takes = f"it takes {', '.join(known)}" if known else "it takes none"
            raise ConfigError(f"{flag} {key!r} is not a setting of the {backend} KV transfer backend; {takes}")
        why = known[key].check(value)
        if why is not None:
            raise ConfigError(f"{flag} {key} must be {why}, got {value!r}")


def parse_options(backend: str, items: Iterable[str], flag: str = "--kv-transfer-option") -> dict[str, str]:
    """``KEY=VALUE`` items as a checked dict; a malformed item or a repeated key raises ConfigError too."""
    options: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"{flag} must be KEY=VALUE, got {item!r}")
        if key in options:
            raise ConfigError(f"{flag} {key!r} given twice")
        options[key] = value.strip()
    check_options(backend, options, flag)
    return options


def option(backend: str, options: Mapping[str, str], key: str) -> str:
    """``key``'s value for ``backend``: the given one (checked) or the table's default."""
    check_options(backend, {key: options[key]} if key in options else {}, f"{backend} backend option")
    return options.get(key, KV_TRANSFER_BACKENDS[backend].options[key].default)


def int_option(backend: str, options: Mapping[str, str], key: str) -> int:
    return int(option(backend, options, key))
