"""CPU core sets: a node's ``--cpu-omp-threads-bind`` (one set per scheduler rank, SGLang's
``SGLANG_CPU_OMP_THREADS_BIND`` syntax: ``"0-3|4-7"``) and how ``up`` splits a host's cores between its decode ranks
and every other process of the cluster (``split_cores``)."""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


def parse_core_list(text: str) -> tuple[int, ...]:
    """``"0-3,8"`` -> (0, 1, 2, 3, 8): comma-separated cores or inclusive ranges, each core once."""
    cores: list[int] = []
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise ConfigError(f"--cpu-omp-threads-bind: {part.strip()!r} is not a core number or a range like 0-3")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ConfigError(f"--cpu-omp-threads-bind: the range {part.strip()!r} runs backwards")
        cores.extend(range(first, last + 1))
    if len(set(cores)) != len(cores):
        raise ConfigError(f"--cpu-omp-threads-bind: {text!r} names a core twice")
    return tuple(cores)


def parse_core_sets(spec: str) -> list[tuple[int, ...]]:
    """``"0-3|4-7"`` -> one core set per rank; the ranks' sets must not overlap (ranks bound to one core would take
    turns on it, each assuming it has it)."""
    sets = [parse_core_list(part) for part in spec.split("|")]
    seen: set[int] = set()
    for cores in sets:
        if seen & set(cores):
            raise ConfigError(f"--cpu-omp-threads-bind: {spec!r} gives core(s) {sorted(seen & set(cores))} to two ranks")
        seen |= set(cores)
    return sets


def format_core_list(cores: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, cores))


@dataclass(frozen=True)
class CoreSplit:
    """``up``'s CPU placement: each decode node's ranks' own cores, and the cores every other process shares."""

    decode: dict[str, list[tuple[int, ...]]]  # decode node -> one core set per rank
    shared: tuple[int, ...]  # the router, every node front, the prefill and colocated ranks

    def bind_flag(self, node: str) -> str | None:
        sets = self.decode.get(node)
        return None if sets is None else "|".join(map(format_core_list, sets))


def split_cores(cores: list[int], decode_rank_threads: dict[str, list[int]], other_nodes: int) -> CoreSplit | None:
    """Give each decode rank as many cores of its own as ``decode_rank_threads`` asks (its torch threads, and its
    scheduler thread where that overlaps the forward), from the top of ``cores``; the rest
    are shared by everything else. None where that does not apply: no decode node, nothing else to keep off them
    (no prefill or colocated node), or the decode ranks' threads would leave no core for the rest.

    Why: a decode rank's step bounds a P/D cluster on a small host, and every process the scheduler puts on its cores
    (the prefill rank's chunks, the router, the fronts) lengthens the step of the whole batch. Opt-in: on a 2-core
    host it was no faster than the OS's own placement (benchmarks/pages/serving_path.md)."""
    wanted = sum(sum(threads) for threads in decode_rank_threads.values())
    if not decode_rank_threads or other_nodes < 1 or wanted >= len(cores):
        return None
    ordered = sorted(cores)
    free = len(ordered)
    decode: dict[str, list[tuple[int, ...]]] = {}
    for node, threads in decode_rank_threads.items():
        sets = []
        for n in threads:
            sets.append(tuple(ordered[free - n:free]))
            free -= n
        decode[node] = sets
    return CoreSplit(decode, tuple(ordered[:free]))
