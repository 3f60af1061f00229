"""GPU placement without a GPU: the rank -> GPU formula, start-up errors, ``up --device cuda`` placement and flags,
and the KV budget formula (``torch.cuda`` calls replaced by fakes)."""

from __future__ import annotations

import argparse

import pytest
import torch

import common.device as device_mod
from common.cli import build_parser
from common.config import ServerArgs
from common.device import CUDA_RESERVE_BYTES, gpu_id, kv_cache_bytes, rank_device
from common.errors import ConfigError
from common.up import LocalCluster, place_nodes, placement_lines


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


def test_up_gives_each_node_its_own_gpus_when_there_are_enough() -> None:
    places = place_nodes(["prefill-0", "decode-0", "decode-1"], dp_size=2, num_gpus=8, mem_fraction=0.8)
    assert [(p.base_gpu_id, p.mem_fraction_static, p.shares_with) for p in places] == [
        (0, 0.8, ()), (2, 0.8, ()), (4, 0.8, ())]
    lines = placement_lines({p.name: p for p in places}, 2)
    assert lines[0] == "GPU placement: each node has its own GPU(s)"
    assert "decode-0" in lines[2] and "cuda:2, cuda:3 (its own" in lines[2]


def test_up_shares_gpus_and_splits_memory_when_there_are_too_few() -> None:
    places = place_nodes(["prefill-0", "decode-0", "decode-1"], dp_size=1, num_gpus=2, mem_fraction=0.8)
    assert [(p.base_gpu_id, p.mem_fraction_static) for p in places] == [(0, 0.4), (1, 0.8), (0, 0.4)]
    assert places[0].shares_with == ("decode-1",) and places[1].shares_with == ()
    one = place_nodes(["prefill-0", "decode-0"], dp_size=1, num_gpus=1, mem_fraction=0.85)
    assert [(p.base_gpu_id, p.mem_fraction_static) for p in one] == [(0, 0.425), (0, 0.425)]
    assert placement_lines({p.name: p for p in one}, 1)[0].startswith("GPU placement: nodes share GPUs")
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
    flags = gpu._node_flags()
    assert flags[flags.index("--device") + 1] == "cuda"
    with pytest.raises(RuntimeError, match=r"nccl cannot pair two nodes on one GPU.*shm or tcp"):
        LocalCluster(_up_ns("--model-path", model, "--log-dir", str(tmp_path), "--device", "cuda",
                            "--num-gpus", "1", "--kv-transfer-backend", "nccl"))
