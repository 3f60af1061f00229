"""Which device a scheduler rank runs on, and how much of it the KV cache may take.

GPU placement of one node (SGLang's ``--base-gpu-id``): rank (dp ``d``, tp ``t``) uses
``cuda:(base_gpu_id + d * tp_size + t)``, so a node occupies the ``dp_size * tp_size`` consecutive GPUs starting at
``base_gpu_id``. Every process that touches a rank's device resolves it here.
"""

from __future__ import annotations

import logging
import os

import psutil
import torch

from common.config import ServerArgs
from common.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_KV_TOKENS = 4 * 1024 * 1024
# Device memory kept free beyond the static budget: activations, the sampler's [bs, vocab] temporaries and the
# CUDA allocator's fragmentation (SGLang keeps a similar margin out of --mem-fraction-static's complement).
CUDA_RESERVE_BYTES = 1 << 30
CPU_RESERVE_FRACTION = 0.1  # of the host's RAM, left to everything else when the KV budget is capped


def gpu_id(args: ServerArgs, dp_rank: int, tp_rank: int = 0) -> int:
    """The GPU ordinal of rank (``dp_rank``, ``tp_rank``) on its host. A TP group spanning ``--nnodes`` hosts
    numbers each host's share of its ranks from ``--base-gpu-id`` (host R holds TP ranks ``tp_ranks_here``)."""
    local = args.tp_ranks_here
    return args.base_gpu_id + dp_rank * len(local) + tp_rank - local.start


def rank_device(args: ServerArgs, dp_rank: int, tp_rank: int = 0) -> torch.device:
    """The torch device of one scheduler rank; a clear ``ConfigError`` when the GPU it needs is not visible."""
    if args.device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda but torch sees no CUDA device (CPU-only torch build, or no GPU visible); "
                          "use --device cpu")
    visible = torch.cuda.device_count()
    need = args.base_gpu_id + args.dp_size * len(args.tp_ranks_here)
    if need > visible:
        per_host = f" / --nnodes {args.nnodes}" if args.nnodes > 1 else ""
        raise ConfigError(
            f"this node needs GPUs {args.base_gpu_id}..{need - 1} (--base-gpu-id {args.base_gpu_id}, "
            f"--dp-size {args.dp_size} x --tp-size {args.tp_size}{per_host}) but only {visible} are visible "
            "(CUDA_VISIBLE_DEVICES); lower --dp-size, --tp-size or --base-gpu-id"
        )
    return torch.device("cuda", gpu_id(args, dp_rank, tp_rank))


def bind_rank_device(args: ServerArgs, dp_rank: int, tp_rank: int = 0) -> torch.device:
    """Resolve the rank's device and make it current (CUDA), so no library call lands on ``cuda:0`` by default."""
    device = rank_device(args, dp_rank, tp_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def kv_cache_bytes(args: ServerArgs, device: torch.device) -> int:
    """Bytes the KV cache of a rank may take when ``--max-total-tokens`` is unset. Call after loading the weights.

    CPU: ``--mem-fraction-static`` of the host's total RAM, so a restarted node gets the pool it had whatever the
    memory happens to be free at that moment; capped (with a warning) by the RAM available less
    ``CPU_RESERVE_FRACTION`` of the total, when that is less. CUDA: this process's weights + KV cache take
    ``--mem-fraction-static`` of the device's total memory, so the KV cache gets that budget minus what the process
    already holds (the weights), capped by the device's free memory less ``CUDA_RESERVE_BYTES``. Each process
    counts only its own memory, so nodes sharing a GPU each get their fraction whatever their start order.
    """
    frac = args.mem_fraction
    if device.type != "cuda":
        mem = psutil.virtual_memory()
        want = int(mem.total * frac)
        room = int(mem.available - mem.total * CPU_RESERVE_FRACTION)
        if room < want:
            logger.warning("KV cache: --mem-fraction-static %g of %.1f GiB of RAM is %.2f GiB, but only %.2f GiB is "
                           "available (keeping %d%% free): the pool is smaller than on an idle host; set "
                           "--max-total-tokens for a fixed size", frac, mem.total / 2**30, want / 2**30,
                           max(room, 0) / 2**30, int(CPU_RESERVE_FRACTION * 100))
            want = max(room, 0)
        return want
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)
    budget = int(total * frac) - held
    room = free - CUDA_RESERVE_BYTES
    if min(budget, room) <= 0:
        raise ConfigError(
            f"no GPU memory left for the KV cache on {device}: --mem-fraction-static {frac} of "
            f"{total / 2**30:.1f} GiB minus {held / 2**30:.1f} GiB of weights leaves {budget / 2**30:.2f} GiB, "
            f"{free / 2**30:.1f} GiB free; raise --mem-fraction-static or set --max-total-tokens"
        )
    return min(budget, room)


def ship(parts: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host tensors of one dtype -> the same tensors on ``device`` through ONE host-to-device copy.

    The parts are packed into one pinned host buffer (CUDA) and copied without blocking; the results are views of
    one device buffer. On CPU the parts come back as they are (no copy at all).
    """
    if device.type == "cpu":
        return parts
    sizes = [p.numel() for p in parts]
    if sum(sizes) == 0:
        return [torch.empty(p.shape, dtype=p.dtype, device=device) for p in parts]
    host = torch.cat([p.reshape(-1) for p in parts])
    if device.type == "cuda":
        # NOTE: pin_memory() comes from torch's caching host allocator, which keeps the buffer alive until the
        # non-blocking copy that reads it has finished.
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split(sizes))


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. under ``taskset`` or a container's cpuset)."""
    return len(os.sched_getaffinity(0))


def cpu_threads_per_rank(args: ServerArgs, cores: tuple[int, ...] | None = None) -> int:
    """Torch intra-op threads of a scheduler rank: ``--torch-num-threads``, else the size of its core set
    (``cores``; any rank's, the largest, when not given) under ``--cpu-omp-threads-bind``, else this host's cores
    split over the node's ranks on it."""
    if args.torch_num_threads:
        return args.torch_num_threads
    if cores is not None:
        return len(cores)
    if args.rank_core_sets:
        return max(map(len, args.rank_core_sets))
    return max(1, usable_cores() // (args.dp_size * len(args.tp_ranks_here)))


def bind_rank_cores(args: ServerArgs, dp_rank: int, tp_rank: int) -> tuple[int, ...] | None:
    """Under ``--cpu-omp-threads-bind``: pin the calling thread (Linux affinity is per thread) to the rank's core
    set and return the set; None without the flag. Called before the rank starts its other threads (torch's among
    them), which inherit it: in a rank process, its whole."""
    sets = args.rank_core_sets
    if not sets:
        return None
    here = args.tp_ranks_here
    cores = sets[dp_rank * len(here) + (tp_rank - here.start)]
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:
        raise ConfigError(f"--cpu-omp-threads-bind: cannot run DP rank {dp_rank} TP rank {tp_rank} on core(s) "
                          f"{list(cores)} ({e.strerror}): name cores this host (or its container's cpuset) offers; "
                          f"this process runs on {sorted(os.sched_getaffinity(0))}") from e
    return cores

