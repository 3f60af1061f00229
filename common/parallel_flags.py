"""The parallelism flags' combinations (SGLang's names; fields of ``ServerArgs``, ``common.config``): a multi-host
TP group (``--nnodes``, ``--node-rank``, ``--dist-init-addr``), CPU ranks' core sets (``--cpu-omp-threads-bind``) and
what a compiled decode step supports. Checked before any model loads; every value works or is refused here."""

from __future__ import annotations

from typing import Any

from common.errors import ConfigError


def check_parallel_flags(args: Any) -> None:
    """Refuse a parallel layout the node cannot run (``ServerArgs.__post_init__``)."""
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise ConfigError(f"--node-rank must be in [0, --nnodes) with --nnodes >= 1, got --nnodes {args.nnodes} "
                          f"--node-rank {args.node_rank}")
    if args.nnodes > 1:
        if not args.dist_init_addr:
            raise ConfigError(f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the "
                              "same on every node)")
        if args.dp_size != 1 or args.tp_size % args.nnodes:
            raise ConfigError(f"--nnodes {args.nnodes} spans one TP group over hosts: it needs --dp-size 1 and a "
                              f"--tp-size divisible by it, got --dp-size {args.dp_size} --tp-size {args.tp_size}")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {args.dist_init_addr!r}")
    if args.cpu_omp_threads_bind is not None:
        if args.device != "cpu":
            raise ConfigError(f"--cpu-omp-threads-bind binds CPU scheduler ranks to cores; it needs --device cpu, "
                              f"got --device {args.device}")
        ranks = args.dp_size * len(args.tp_ranks_here)
        if len(args.rank_core_sets) != ranks:
            raise ConfigError(f"--cpu-omp-threads-bind {args.cpu_omp_threads_bind!r} gives "
                              f"{len(args.rank_core_sets)} core set(s) for this node's {ranks} scheduler rank(s) "
                              "(--dp-size x its tp ranks): one '|'-separated set per rank")
    if args.enable_torch_compile and args.tp_size > 1:
        raise ConfigError(f"--enable-torch-compile supports --tp-size 1 only, got --tp-size {args.tp_size} "
                          "(the compiled decode step has no collectives)")
