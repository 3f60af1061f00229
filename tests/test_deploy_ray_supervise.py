"""The Ray deployer's GPU defaults and its liveness supervision, without a cluster: GPUs per rank come from the spec
(and a cuda profile with 0 is refused), and the restart decision over a mocked probe (consecutive failures, then a
grace period while the restarted node loads). The restart on a real Ray cluster: tests/test_deploy_ray.py."""

from __future__ import annotations

import pytest

from common.app.cli import build_parser
from common.errors import ConfigError
from deploy.ray.cli import spec_from_args
from deploy.ray.deployer import LivenessTracker, gpus_per_rank, supervise_once
from deploy.spec import load_spec


def test_gpus_per_rank_default_from_the_spec() -> None:
    assert gpus_per_rank(load_spec(profile="gpu-single-node")) == {"prefill": 1, "decode": 1}
    assert gpus_per_rank(load_spec(profile="cpu-dev")) == {"prefill": 0, "decode": 0}
    assert gpus_per_rank(load_spec(profile="prod"), 2) == {"prefill": 2, "decode": 2}


def test_ray_up_refuses_a_gpu_profile_with_zero_gpus_per_rank() -> None:
    ns = build_parser().parse_args(["ray", "up", "--profile", "gpu-single-node", "--gpus-per-rank", "0"])
    assert ns.gpus_per_rank == 0
    with pytest.raises(ConfigError, match="--gpus-per-rank 0 with a device-cuda spec"):
        gpus_per_rank(spec_from_args(ns), ns.gpus_per_rank)
    assert build_parser().parse_args(["ray", "up"]).gpus_per_rank is None  # default: the spec's


def test_restart_after_consecutive_failures_then_grace() -> None:
    tracker = LivenessTracker(failures_to_restart=3, restart_grace_s=100.0)
    live = {"pdcluster-prefill-0": True, "pdcluster-decode-0": False}
    restarted: list[str] = []

    def round_at(t: float) -> list[str]:
        return supervise_once(sorted(live), live.__getitem__, restarted.append, tracker, now=t)

    assert round_at(1000.0) == [] and round_at(1010.0) == []
    assert round_at(1020.0) == ["pdcluster-decode-0"] and restarted == ["pdcluster-decode-0"]
    for t in (1030.0, 1040.0, 1050.0, 1110.0):  # loading after the restart: not restarted again
        assert round_at(t) == []
    assert round_at(1121.0) == [] and round_at(1131.0) == [] and round_at(1141.0) == ["pdcluster-decode-0"]
    assert "pdcluster-prefill-0" not in restarted


def test_a_success_resets_the_failure_count() -> None:
    tracker = LivenessTracker(failures_to_restart=2, restart_grace_s=0.0)
    results = iter([False, True, False, True, False, False])
    restarted: list[str] = []
    for t in range(6):
        supervise_once(["n"], lambda _n: next(results), restarted.append, tracker, now=float(t))
    assert restarted == ["n"]


def test_supervise_command_parses() -> None:
    ns = build_parser().parse_args(["ray", "supervise", "--address", "h:6379", "--supervise-period", "5"])
    assert (ns.ray_command, ns.address, ns.supervise_period) == ("supervise", "h:6379", 5.0)
