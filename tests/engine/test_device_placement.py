"""GPU placement without a GPU: the rank -> GPU formula, start-up errors, ``up --device cuda`` placement and flags,
and the KV budget formula (``torch.cuda`` calls replaced by fakes)."""

from __future__ import annotations

import argparse
import os
import re
import types

import pytest
import torch

import common.engine.device as device_mod
from common.app.cli import build_parser
from common.app.placement import place_nodes, placement_lines
from common.app.readiness import wait_nodes_serving
from common.app.up import LocalCluster
from common.config import ServerArgs
from common.engine.device import CUDA_RESERVE_BYTES, gpu_id, kv_cache_bytes, rank_device
from common.errors import ConfigError


def test_rank_gpu_formula() -> None:
    args = ServerArgs(device="cuda", base_gpu_id=2, dp_size=3)
    assert [gpu_id(args, d) for d in range(3)] == [2, 3, 4]
    assert rank_device(ServerArgs(), 0) == torch.device("cpu")


def test_device_flags_are_validated() -> None:
    with pytest.raises(ConfigError, match="--device must be one of cpu, cuda"):
        ServerArgs(device="cuda:1")
    with pytest.raises(ConfigError, match="--base-gpu-id"):
        ServerArgs(device="cuda", base_gpu_id=-1)
    ns = build_parser().parse_args(["serve", "--device", "cuda", "--base-gpu-id", "3"])
    assert (ns.device, ns.base_gpu_id) == ("cuda", 3)
    assert ServerArgs().mem_fraction == 0.1 and ServerArgs(device="cuda").mem_fraction == 0.85
    assert ServerArgs(device="cuda", mem_fraction_static=0.4).mem_fraction == 0.4


def test_node_asking_for_more_gpus_than_visible_is_a_start_up_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert rank_device(ServerArgs(device="cuda", base_gpu_id=1), 0) == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match=r"needs GPUs 1\.\.2 .* only 2 are visible"):
        rank_device(ServerArgs(device="cuda", base_gpu_id=1, dp_size=2), 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        rank_device(ServerArgs(device="cuda"), 0)


def test_cuda_kv_budget_is_own_fraction_minus_own_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (60 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 3 * gib)
    dev = torch.device("cuda", 0)
    assert kv_cache_bytes(ServerArgs(device="cuda", mem_fraction_static=0.5), dev) == 37 * gib
    # Capped by what is free now (another node on the GPU holds the rest), less the reserve.
    assert kv_cache_bytes(ServerArgs(device="cuda", mem_fraction_static=0.9), dev) == 60 * gib - CUDA_RESERVE_BYTES
    with pytest.raises(ConfigError, match="no GPU memory left"):
        kv_cache_bytes(ServerArgs(device="cuda", mem_fraction_static=0.03), dev)
    assert device_mod.MAX_KV_TOKENS > 0


def test_cpu_kv_budget_is_a_fraction_of_total_ram_whatever_is_free_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A restarted node gets the pool it had (issue 34 saw 16,322 -> 9,774 -> 13,098 pages across restarts)."""
    gib = 2**30
    cpu, args = torch.device("cpu"), ServerArgs(mem_fraction_static=0.1)
    sizes = []
    for available in (20 * gib, 11 * gib, 15 * gib):  # what other processes left free at each start
        monkeypatch.setattr(device_mod.psutil, "virtual_memory",
                            lambda a=available: psutil_svmem(total=24 * gib, available=a))
        sizes.append(kv_cache_bytes(args, cpu))
    assert sizes == [int(2.4 * gib)] * 3
    # Only when the host is short does the pool shrink, leaving 10 % of RAM to the rest.
    monkeypatch.setattr(device_mod.psutil, "virtual_memory", lambda: psutil_svmem(total=24 * gib, available=4 * gib))
    assert kv_cache_bytes(args, cpu) == int(4 * gib - 2.4 * gib)


def psutil_svmem(total: int, available: int) -> object:
    return types.SimpleNamespace(total=total, available=available)


def test_up_gives_each_node_its_own_gpus_when_there_are_enough() -> None:
    places = place_nodes(["prefill-0", "decode-0", "decode-1"], dp_size=2, num_gpus=8, mem_fraction=0.8)
    assert [(p.base_gpu_id, p.mem_fraction_static, p.shares_with) for p in places] == [
        (0, 0.8, ()), (2, 0.8, ()), (4, 0.8, ())]
    lines = placement_lines({p.name: p for p in places})
    assert lines[0] == "GPU placement: each node has its own GPU(s)"
    assert "decode-0" in lines[2] and "cuda:2, cuda:3 (its own" in lines[2]


def test_up_shares_gpus_and_splits_memory_when_there_are_too_few() -> None:
    places = place_nodes(["prefill-0", "decode-0", "decode-1"], dp_size=1, num_gpus=2, mem_fraction=0.8)
    assert [(p.base_gpu_id, p.mem_fraction_static) for p in places] == [(0, 0.4), (1, 0.8), (0, 0.4)]
    assert places[0].shares_with == ("decode-1",) and places[1].shares_with == ()
    one = place_nodes(["prefill-0", "decode-0"], dp_size=1, num_gpus=1, mem_fraction=0.85)
    assert [(p.base_gpu_id, p.mem_fraction_static) for p in one] == [(0, 0.425), (0, 0.425)]
    assert placement_lines({p.name: p for p in one})[0].startswith("GPU placement: nodes share GPUs")
    with pytest.raises(ValueError, match="needs 4 GPUs per node"):
        place_nodes(["prefill-0"], dp_size=4, num_gpus=2, mem_fraction=0.8)


def _up_ns(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["up", *argv])


def test_up_default_backend_and_node_flags_follow_the_device(tmp_path) -> None:
    from tests.model_fixtures import make_tiny_model

    model = str(make_tiny_model("llama"))
    cpu = LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path)))
    assert cpu.backend == "tcp" and cpu.placement == {}
    gpu = LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path), "--device", "cuda",
                              "--num-gpus", "1"))
    assert gpu.backend == "shm"
    assert gpu.placement["decode-0"].base_gpu_id == 0 and gpu.placement["decode-0"].mem_fraction_static == 0.425
    flags = gpu._node_flags("prefill")
    assert flags[flags.index("--device") + 1] == "cuda"
    with pytest.raises(RuntimeError, match=r"nccl cannot pair two nodes on one GPU.*shm or tcp"):
        LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path), "--device", "cuda",
                            "--num-gpus", "1", "--kv-transfer-backend", "nccl"))


def test_up_places_tp_nodes_on_dp_times_tp_consecutive_gpus() -> None:
    tp = {"prefill-0": 2, "decode-0": 1, "decode-1": 1}
    places = place_nodes(list(tp), dp_size=2, num_gpus=8, mem_fraction=0.8, tp_size=tp)
    assert [(p.base_gpu_id, p.gpus, p.mem_fraction_static, p.shares_with) for p in places] == [
        (0, 4, 0.8, ()), (4, 2, 0.8, ()), (6, 2, 0.8, ())]
    assert "cuda:0, cuda:1, cuda:2, cuda:3 (its own" in placement_lines({p.name: p for p in places})[1]
    # Too few GPUs: round-robin from GPU 0; a node overlapping two others on one GPU gets a third of the memory.
    shared = place_nodes(["prefill-0", "decode-0", "decode-1", "decode-2"], dp_size=1, num_gpus=2, mem_fraction=0.9,
                         tp_size={"prefill-0": 2})
    assert [(p.base_gpu_id, p.gpus, p.mem_fraction_static) for p in shared] == [
        (0, 2, 0.3), (0, 1, 0.3), (1, 1, 0.45), (0, 1, 0.3)]
    assert shared[0].shares_with == ("decode-0", "decode-1", "decode-2") and shared[2].shares_with == ("prefill-0",)
    with pytest.raises(ValueError, match=r"prefill-0 needs 4 GPUs per node \(--dp-size 1 x --tp-size 4\)"):
        place_nodes(["prefill-0"], dp_size=1, num_gpus=2, mem_fraction=0.8, tp_size={"prefill-0": 4})


def _serve_args(cluster: LocalCluster, name: str) -> ServerArgs:
    from common.config import server_args_from_cli

    argv = cluster.node_args(name, port=5000, bootstrap=5001)
    assert argv[0] == "serve"
    return server_args_from_cli(build_parser().parse_args(argv))  # the node's own parser and checks


def test_up_passes_per_role_tp_to_the_node_command_lines(tmp_path, monkeypatch) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))  # the 2-core CI machine

    model = str(make_tiny_model("llama"))
    base = ("--model-path", model, "--log-dir", str(tmp_path), "--prefill", "1", "--decode", "2")
    both = LocalCluster(_up_ns(*base, "--tp-size", "2"))
    assert [_serve_args(both, n).tp_size for n in both.node_names] == [2, 2, 2]
    split = LocalCluster(_up_ns(*base, "--prefill-tp-size", "2", "--decode-tp-size", "1", "--colocated", "1",
                                "--tp-size", "4"))
    args = {n: _serve_args(split, n) for n in split.node_names}
    assert {n: a.tp_size for n, a in args.items()} == {"prefill-0": 2, "decode-0": 1, "decode-1": 1, "null-0": 4}
    assert args["prefill-0"].disaggregation_mode == "prefill" and args["null-0"].disaggregation_mode == "null"
    # CPU: 8 ranks on 2 cores: one torch thread each (at least one; a node's ranks must not take more than their share).
    assert {a.torch_num_threads for a in args.values()} == {1} and all(a.device == "cpu" for a in args.values())
    gpu = LocalCluster(_up_ns(*base, "--prefill-tp-size", "2", "--device", "cuda", "--num-gpus", "4"))
    gargs = {n: _serve_args(gpu, n) for n in gpu.node_names}
    assert {n: (a.base_gpu_id, a.tp_size, a.mem_fraction_static) for n, a in gargs.items()} == {
        "prefill-0": (0, 2, 0.85), "decode-0": (2, 1, 0.85), "decode-1": (3, 1, 0.85)}
    with pytest.raises(ConfigError, match="--decode-tp-size must be >= 1, got 0"):  # ClusterShape's check
        LocalCluster(_up_ns(*base, "--decode-tp-size", "0"))
    with pytest.raises(ValueError, match="needs 8 GPUs per node"):
        LocalCluster(_up_ns(*base, "--tp-size", "8", "--device", "cuda", "--num-gpus", "4"))


@pytest.mark.parametrize(("cores", "nodes", "want"), [
    (2, ("--colocated", "1", "--prefill", "0", "--decode", "0"), {"null-0": 2}),  # a lone node takes every core
    (2, (), {"prefill-0": 1, "decode-0": 1}),
    (8, (), {"prefill-0": 4, "decode-0": 4}),
    (8, ("--decode-tp-size", "2"), {"prefill-0": 2, "decode-0": 2}),
    (8, ("--dp-size", "2", "--colocated", "1"), {"prefill-0": 1, "decode-0": 1, "null-0": 1}),
    (8, ("--torch-num-threads", "3"), {"prefill-0": 3, "decode-0": 3}),  # given: as given
    (2, ("--decode-torch-num-threads", "2"), {"prefill-0": 1, "decode-0": 2}),  # a role's own, over the split
    (2, ("--torch-num-threads", "3", "--prefill-torch-num-threads", "1"), {"prefill-0": 1, "decode-0": 3}),
])
def test_up_splits_the_cores_over_every_rank(tmp_path, monkeypatch, cores: int, nodes: tuple[str, ...],
                                             want: dict[str, int]) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), *nodes))
    assert {n: _serve_args(cluster, n).torch_num_threads for n in cluster.node_names} == want


@pytest.mark.parametrize(("cores", "nodes", "passive"), [
    (2, ("--decode-torch-num-threads", "2"), True),  # 1 + 2 threads on 2 cores, a team of 2 among them
    (2, (), False),  # up's split: 1 + 1
    (2, ("--prefill", "2", "--decode", "2"), False),  # 4 ranks on 2 cores, but one thread each: no team spins
    (8, ("--torch-num-threads", "4"), False),  # 4 + 4 on 8 cores
])
def test_up_gives_oversubscribed_nodes_passive_openmp_waits(tmp_path, monkeypatch, cores: int, nodes: tuple[str, ...],
                                                            passive: bool) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), *nodes))
    assert ("OMP_WAIT_POLICY" in cluster.env) == passive
    line = cluster.oversubscription_line()
    assert (line is not None) == passive
    if passive:
        assert cluster.env["OMP_WAIT_POLICY"] == "PASSIVE"
        assert "2 scheduler rank(s) run 3 torch threads on 2 core(s)" in line and "PASSIVE" in line
        monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the caller's choice stands, and is named
        mine = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), *nodes))
        assert "OMP_WAIT_POLICY" not in mine.env and "OMP_WAIT_POLICY=ACTIVE" in (mine.oversubscription_line() or "")


def test_up_reports_the_start_up_error_of_a_node(tmp_path) -> None:
    import time

    from common.ports import pick_free_port
    from tests.model_fixtures import make_tiny_model

    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path),
                                  "--decode-tp-size", "2"))
    port = pick_free_port()
    # A flag set the node refuses at start-up (a multi-host group without its rendezvous address).
    args = [*cluster.node_args("decode-0", port, pick_free_port()), "--nnodes", "2"]
    child = cluster._spawn("decode-0", args, port)
    try:
        with pytest.raises(RuntimeError, match=r"(?s)decode-0 exited with code [1-9].*--dist-init-addr"):
            wait_nodes_serving([child], time.monotonic() + 120, cluster.node_tls)
    finally:
        cluster.stop()


def test_up_passes_scheduling_switches_to_every_node(tmp_path) -> None:
    from tests.model_fixtures import make_tiny_model

    model = str(make_tiny_model("llama"))
    cluster = LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path), "--enable-overlap-schedule",
                                  "--enable-torch-compile", "--torch-compile-max-bs", "8", "--disable-cuda-graph"))
    for name in cluster.node_names:
        args = _serve_args(cluster, name)
        assert args.enable_overlap_schedule and args.enable_torch_compile and args.disable_cuda_graph
        assert args.torch_compile_max_bs == 8 and not args.disable_overlap_schedule
    plain = LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path)))
    args = _serve_args(plain, "decode-0")
    assert not (args.enable_overlap_schedule or args.enable_torch_compile)
    assert args.disable_overlap_schedule == plain.inline_forwards()  # the host's cores decide (test below)


@pytest.mark.parametrize(("cores", "nodes", "inline"), [
    (2, (), True),  # P/D, a thread each: no core left for either rank's scheduler thread
    (2, ("--colocated", "1", "--prefill", "0", "--decode", "0"), True),  # one rank on both cores
    (8, ("--torch-num-threads", "2"), False),  # 2 + 2 torch threads + 2 scheduler threads: 6 of 8 cores
    (8, ("--torch-num-threads", "3"), False),  # 3 + 3 + 2: exactly 8
    (8, ("--torch-num-threads", "4"), True),  # 4 + 4 + 2 > 8
    (2, ("--enable-overlap-schedule",), False),  # a switch given stands
])
def test_up_runs_forwards_inline_when_scheduler_threads_have_no_core(tmp_path, monkeypatch, cores: int,
                                                                    nodes: tuple[str, ...], inline: bool) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), *nodes))
    assert cluster.inline_forwards() == inline
    for name in cluster.node_names:
        args = _serve_args(cluster, name)
        assert args.disable_overlap_schedule == inline and args.enable_overlap_schedule == ("--enable-overlap-schedule" in nodes)


@pytest.mark.parametrize(("cores", "nodes", "bind", "shared"), [
    (2, (), {"decode-0": "1"}, (0,)),  # P/D, a thread each: the decode rank alone on core 1
    (8, (), {"decode-0": "4,5,6,7"}, (0, 1, 2, 3)),
    (8, ("--torch-num-threads", "2"), {"decode-0": "5,6,7"}, (0, 1, 2, 3, 4)),  # overlap: + its scheduler thread
    (8, ("--decode", "2"), {"decode-0": "6,7", "decode-1": "4,5"}, (0, 1, 2, 3)),
    (8, ("--dp-size", "2"), {"decode-0": "6,7|4,5"}, (0, 1, 2, 3)),  # one set per rank
    (4, ("--prefill", "2"), {"decode-0": "3"}, (0, 1, 2)),
    (2, ("--colocated", "1", "--prefill", "0", "--decode", "0"), None, None),  # no decode rank to keep apart
    (2, ("--prefill", "0"), None, None),  # nothing else to keep off its cores
    (2, ("--decode-torch-num-threads", "2"), None, None),  # the decode rank would take every core
    (2, ("--cpu-bind", "none"), None, None),  # the last one given wins: up's default
])
def test_up_gives_each_decode_rank_cores_of_its_own(tmp_path, monkeypatch, cores: int, nodes: tuple[str, ...],
                                                    bind: dict[str, str] | None,
                                                    shared: tuple[int, ...] | None) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path),
                                  "--cpu-bind", "auto", *nodes))
    split = cluster.core_split
    assert (split.shared if split is not None else None) == shared
    got = {n: a.cpu_omp_threads_bind for n in cluster.node_names
           if (a := _serve_args(cluster, n)).cpu_omp_threads_bind is not None}
    assert got == (bind or {})
    lines = cluster.core_split_lines()
    assert bool(lines) == (bind is not None)
    if shared is not None:
        assert lines[-1].endswith(f"share core(s) {','.join(map(str, shared))}")


def test_up_leaves_cpu_placement_to_the_os_by_default(tmp_path, monkeypatch) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    cluster = LocalCluster(_up_ns("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path)))
    assert cluster.core_split is None and cluster.core_split_lines() == []
    assert _serve_args(cluster, "decode-0").cpu_omp_threads_bind is None


def test_up_cpu_bind_auto_says_when_it_does_nothing_and_refuses_gpus(tmp_path, monkeypatch) -> None:
    from tests.model_fixtures import make_tiny_model

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    base = ("--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), "--cpu-bind", "auto")
    split = LocalCluster(_up_ns(*base))
    assert split.core_split is not None and split.cpu_bind_note() is None
    lone = LocalCluster(_up_ns(*base, "--colocated", "1", "--prefill", "0", "--decode", "0"))
    assert lone.core_split is None and "leaves placement to the OS here" in (lone.cpu_bind_note() or "")
    assert LocalCluster(_up_ns(*base[:4])).cpu_bind_note() is None  # not asked for
    with pytest.raises(ValueError, match="--cpu-bind auto places CPU scheduler ranks on cores; with --device cuda"):
        LocalCluster(_up_ns(*base, "--device", "cuda", "--num-gpus", "2"))


@pytest.mark.parametrize(("bind", "error"), [
    ("0|1", "gives 2 core set(s) for this node's 1 scheduler rank"),
    ("0-x", "'0-x' is not a core number or a range"),
    ("3-1", "the range '3-1' runs backwards"),
    ("0,1,0", "names a core twice"),
])
def test_a_bad_cpu_omp_threads_bind_says_what_to_fix(bind: str, error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)):
        ServerArgs(cpu_omp_threads_bind=bind)
    with pytest.raises(ConfigError, match="to two ranks"):
        ServerArgs(cpu_omp_threads_bind="0-1|1", dp_size=2)
    with pytest.raises(ConfigError, match="needs --device cpu"):
        ServerArgs(cpu_omp_threads_bind="0", device="cuda")


BIND_PROBE = """
import os, sys
from common.config import ServerArgs
from common.engine.device import bind_rank_cores, cpu_threads_per_rank
from common.errors import ConfigError
args = ServerArgs(cpu_omp_threads_bind=sys.argv[1], dp_size=2)
try:
    cores = bind_rank_cores(args, 1, 0)
except ConfigError as e:
    print("error:", e)
else:
    print(sorted(os.sched_getaffinity(0)), cpu_threads_per_rank(args, cores))
"""


def test_a_rank_runs_on_its_core_set_with_as_many_torch_threads(tmp_path) -> None:
    import subprocess
    import sys

    last = max(os.sched_getaffinity(0))

    def probe(bind: str) -> str:  # in a child: the binding is the process's own, for good
        return subprocess.run([sys.executable, "-c", BIND_PROBE, bind], capture_output=True, text=True, timeout=120,
                              check=True).stdout.strip()

    assert probe(f"4000|{last}") == f"[{last}] 1"  # DP rank 1: the second set
    assert probe(f"{last}|4000-4001") == "error: --cpu-omp-threads-bind: cannot run DP rank 1 TP rank 0 on core(s) " \
        "[4000, 4001] (Invalid argument): name cores this host (or its container's cpuset) offers; this process " \
        f"runs on {sorted(os.sched_getaffinity(0))}"


ENGINE_PROBE = """
import os, sys, threading
from common.node.engine import Engine
with Engine(model_path=sys.argv[1], cpu_omp_threads_bind=sys.argv[2]) as engine:
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    sched = next(t for t in threading.enumerate() if t.name == "pdcluster-scheduler")
    print(sorted(os.sched_getaffinity(sched.native_id)), engine._num_threads, len(out.output_ids))
"""


def test_an_in_process_engine_runs_its_scheduler_on_the_leaders_core_set() -> None:
    import subprocess
    import sys

    from tests.model_fixtures import make_tiny_model

    last = max(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", ENGINE_PROBE, str(make_tiny_model("llama")), str(last)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"[{last}] 1 2"
