"""The cluster spec and the Ray placement plan, without a cluster: profiles, ports, command lines that parse with
the real CLI parser, and placement groups / pinning per role."""

from __future__ import annotations

import pytest

from common.cli import build_parser
from common.errors import ConfigError
from deploy.ray.cli import spec_from_args
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
