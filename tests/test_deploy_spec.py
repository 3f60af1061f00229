"""The cluster spec and the Ray placement plan, without a cluster: profiles, ports, command lines that parse with
the real CLI parser, and placement groups / pinning per role."""

from __future__ import annotations

import dataclasses

import pytest

from common.app.cli import build_parser
from common.config import server_args_from_cli
from common.errors import ConfigError
from deploy.ray.actors import rank_devices_env
from deploy.ray.cli import spec_from_args
from deploy.ray.deployer import check_one_host_groups
from deploy.ray.placement import ROLE_LABEL, plan_role
from deploy.spec import load_spec, profile_names


def test_profiles_load_and_ports_are_disjoint_per_replica() -> None:
    assert {"cpu-dev", "gpu-single-node", "prod"} <= set(profile_names())
    spec = load_spec(profile="prod").with_counts(prefill=3, decode=3)
    ports = [p for role in ("prefill", "decode") for i in range(3)
             for p in vars(spec.ports(role, i)).values() if p is not None]
    assert len(ports) == len(set(ports))


def test_profile_may_not_add_keys(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "spec.yaml"
    text = (load_spec.__globals__["SPEC_PATH"]).read_text() + "  typo:\n    shared: {page-sise: 4}\n"
    path.write_text(text)
    with pytest.raises(ConfigError, match="page-sise"):
        load_spec(path, profile="typo")


def test_ray_up_flags_override_the_spec_and_parse() -> None:
    ns = build_parser().parse_args(["ray", "up", "--prefill", "2", "--decode", "3", "--dp-size", "2",
                                    "--model-path", "/m"])
    spec = spec_from_args(ns)
    assert (spec.role("prefill").replicas, spec.role("decode").replicas) == (2, 3)
    for role in ("prefill", "decode"):
        for i in range(spec.role(role).replicas):
            parsed = build_parser().parse_args(spec.node_argv(role, "10.0.0.1", i))
            assert (parsed.dp_size, parsed.model_path, parsed.disaggregation_mode) == (2, "/m", role)
            assert parsed.port == spec.ports(role, i).grpc
    assert build_parser().parse_args(spec.router_argv("10.0.0.1")).model_path == "/m"


def test_placement_tp1_spreads_one_group_per_role() -> None:
    groups, places = plan_role("decode", 3, 1, cpus_per_rank=2, gpus_per_rank=1)
    assert [g.strategy for g in groups] == ["SPREAD"] and len(groups[0].bundles) == 3
    assert groups[0].bundles[0] == {"CPU": 2, "GPU": 1.0, "decode": 0.01}
    assert [p.bundle for p in places] == [0, 1, 2] and all(p.resources == {"decode": 0.01} for p in places)


def test_placement_tp_gt1_packs_each_replica_and_labels_pin() -> None:
    groups, places = plan_role("prefill", 2, 4, gpus_per_rank=1, pin="labels")
    assert [g.strategy for g in groups] == ["STRICT_PACK", "STRICT_PACK"]
    assert all(len(g.bundles) == 4 and "prefill" not in g.bundles[0] for g in groups)
    assert groups[0].bundle_label_selector == [{ROLE_LABEL: "prefill"}] * 4
    assert [p.group for p in places] == [g.name for g in groups]


def test_placement_tp2_is_one_strict_pack_group_of_two_rank_bundles() -> None:
    groups, places = plan_role("prefill", 1, 2, cpus_per_rank=0.5, gpus_per_rank=1)
    assert [(g.name, g.strategy, len(g.bundles)) for g in groups] == [("pdcluster-prefill-0", "STRICT_PACK", 2)]
    assert groups[0].bundles == [{"CPU": 0.5, "GPU": 1.0, "prefill": 0.01}] * 2
    (place,) = places
    assert (place.group, place.bundle, place.rank_bundles, place.num_gpus) == ("pdcluster-prefill-0", 0, (1,), 1.0)
    cpu_groups, _ = plan_role("decode", 2, 2, cpus_per_rank=0.5)
    assert all("GPU" not in b for g in cpu_groups for b in g.bundles) and len(cpu_groups) == 2
    with pytest.raises(ValueError, match=">= 1 rank"):
        plan_role("decode", 1, 0)


def test_rank_gpus_follow_bundle_order_on_one_machine() -> None:
    slots = [{"node_id": "n1", "gpu_ids": ["5"]}, {"node_id": "n1", "gpu_ids": ["2"]}]
    assert rank_devices_env(["7"], slots, "n1") == {"CUDA_VISIBLE_DEVICES": "7,5,2"}
    assert rank_devices_env([], [{"node_id": "n1", "gpu_ids": []}], "n1") == {}  # CPU: nothing to pin
    with pytest.raises(RuntimeError, match="STRICT_PACK"):
        rank_devices_env(["0"], [{"node_id": "n2", "gpu_ids": ["1"]}], "n1")


def test_spec_tp_per_role_reaches_ray_command_lines_and_gpus() -> None:
    ns = build_parser().parse_args(["ray", "up", "--tp-size", "2", "--decode-tp-size", "1", "--model-path", "/m"])
    spec = spec_from_args(ns)
    assert (spec.role("prefill").tp, spec.role("decode").tp) == (2, 1)
    assert (spec.ranks("prefill"), spec.ranks("decode")) == (2, 1)
    for role, tp in (("prefill", 2), ("decode", 1)):
        args = server_args_from_cli(build_parser().parse_args(spec.node_argv(role, "10.0.0.1")))
        assert (args.tp_size, args.nnodes, args.dist_init_addr) == (tp, 1, None)
    gpu = load_spec(profile="gpu-single-node").with_tp(prefill=4)
    assert (gpu.gpus("prefill"), gpu.gpus("decode")) == (4, 1)


def test_spec_multinode_role_gpus_per_pod_and_command_lines() -> None:
    spec = load_spec(profile="gpu-multinode")
    r = spec.role("decode")
    assert r.nnodes > 1 and spec.gpus("decode") == r.resources.gpus_per_rank * r.tp // r.nnodes
    ranks = []
    for rank in range(r.nnodes):
        argv = spec.node_argv("decode", "10.0.0.9", node_rank=rank, leader="leader.ns")
        args = server_args_from_cli(build_parser().parse_args(argv))
        assert (args.nnodes, args.node_rank, args.dist_init_addr) == (
            r.nnodes, rank, f"leader.ns:{spec.ports('decode').dist_init}")
        ranks += list(args.tp_ranks_here)
    assert ranks == list(range(r.tp))
    with pytest.raises(ConfigError, match="needs the leader's address"):
        spec.node_argv("decode", "10.0.0.9")
    with pytest.raises(ConfigError, match="one STRICT_PACK placement group"):
        check_one_host_groups(spec)
    check_one_host_groups(load_spec(profile="gpu-single-node").with_tp(prefill=8))


@pytest.mark.parametrize(("yaml_role", "match"), [
    ("tp: 3, nnodes: 2", "divisible"),  # the node's own --nnodes rule, reached through its parser
    ("tp: 0", "must be >= 1"),
])
def test_spec_refuses_bad_parallelism(tmp_path, yaml_role: str, match: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "spec.yaml"
    text = load_spec.__globals__["SPEC_PATH"].read_text() + f"  bad:\n    roles:\n      decode: {{{yaml_role}}}\n"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_spec(path, profile="bad")


def test_spec_derives_topology_flags_never_takes_them() -> None:
    spec = load_spec()
    decode = spec.role("decode")
    for flag, key in (("tp-size", "tp"), ("node-rank", "nnodes"), ("dist-init-addr", "nnodes")):
        roles = {**spec.roles, "decode": dataclasses.replace(decode, flags={**decode.flags, flag: "1"})}
        with pytest.raises(ConfigError, match=f"decode.flags.{flag}: set decode.{key} instead"):
            dataclasses.replace(spec, roles=roles)
        with pytest.raises(ConfigError, match=f"shared.{flag}: set roles.<role>.{key} instead"):
            dataclasses.replace(spec, shared={**spec.shared, flag: "1"})
