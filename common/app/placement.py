"""Where ``pdcluster up``'s nodes run: GPUs of their own or shared (``place_nodes``), and on CPU the OpenMP wait
policy of ranks whose threads oversubscribe the cores (``omp_wait_env``)."""

from __future__ import annotations

from dataclasses import dataclass, field


def oversubscribed(rank_threads: list[int], cores: int) -> bool:
    """The ranks' torch threads outnumber the cores and some rank runs an OpenMP team (one thread never spins)."""
    return max(rank_threads, default=1) > 1 and sum(rank_threads) > cores


def omp_wait_env(rank_threads: list[int], cores: int, environ: dict[str, str]) -> dict[str, str]:
    """``OMP_WAIT_POLICY=PASSIVE`` for the nodes when their scheduler ranks' torch threads together oversubscribe the
    host's cores and some rank runs an OpenMP team ({} otherwise, or when the caller set the variable).

    Each rank's libgomp team sizes its waits as if it were alone on the host: a worker spins after every parallel
    region before it sleeps, CPU that another rank on the same cores needs. Passive waits serve more tokens for
    less CPU there (benchmarks/pages/serving_path.md, "Figures behind up's CPU defaults")."""
    if "OMP_WAIT_POLICY" in environ or not oversubscribed(rank_threads, cores):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


@dataclass(frozen=True)
class NodePlacement:
    name: str
    base_gpu_id: int
    mem_fraction_static: float
    shares_with: tuple[str, ...] = field(default=())
    gpus: int = 1  # the node's dp x tp consecutive GPUs from base_gpu_id


def place_nodes(names: list[str], dp_size: int, num_gpus: int, mem_fraction: float,
                tp_size: dict[str, int] | None = None) -> list[NodePlacement]:
    """GPUs of each node: ``dp_size`` x its tp (``tp_size[name]``, default 1) consecutive GPUs, its own when there
    are enough for every node; otherwise nodes are dealt round-robin from GPU 0 (a node that would run past the
    last GPU starts again at 0) and each splits the memory fraction by the node count of its busiest GPU."""
    widths = {n: dp_size * (tp_size or {}).get(n, 1) for n in names}
    for name, width in widths.items():
        if width > num_gpus:
            tp = (tp_size or {}).get(name, 1)
            raise ValueError(f"{name} needs {width} GPUs per node (--dp-size {dp_size} x --tp-size {tp}) but "
                             f"{num_gpus} are visible")
    bases, cursor = {}, 0
    for name in names:
        if sum(widths.values()) > num_gpus and cursor + widths[name] > num_gpus:
            cursor = 0
        bases[name], cursor = cursor, cursor + widths[name]
    gpus_of = {n: set(range(bases[n], bases[n] + widths[n])) for n in names}
    out = []
    for name in names:
        others = tuple(n for n in names if n != name and gpus_of[n] & gpus_of[name])
        busiest = max(1 + sum(g in gpus_of[n] for n in others) for g in gpus_of[name])
        fraction = mem_fraction if busiest == 1 else round(mem_fraction / busiest, 4)
        out.append(NodePlacement(name, bases[name], fraction, others, widths[name]))
    return out


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def placement_lines(placement: dict[str, NodePlacement]) -> list[str]:
    """What ``up`` tells the user about GPU placement (nothing on CPU)."""
    lines = []
    for p in placement.values():
        gpus = ", ".join(f"cuda:{p.base_gpu_id + g}" for g in range(p.gpus))
        how = (f"shared with {', '.join(p.shares_with)}" if p.shares_with else "its own")
        lines.append(f"  {p.name:<10} on {gpus} ({how}; --mem-fraction-static {p.mem_fraction_static})")
    if placement:
        shared = any(p.shares_with for p in placement.values())
        lines.insert(0, "GPU placement: nodes share GPUs, memory split between them" if shared
                     else "GPU placement: each node has its own GPU(s)")
    return lines
