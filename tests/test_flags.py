"""Flags declared once (``common.flags``): the parsers, ``up``'s pass-through and ``docs/flags.md`` all come from the
config dataclasses' fields, so a new flag is one field."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.app import flag_docs
from common.app.cli import build_parser
from common.app.up import UP_DERIVES, UP_SETS_PER_NODE, LocalCluster
from common.config import ServerArgs, server_args_from_cli
from common.errors import ConfigError
from common.flags import flag_fields
from common.speculative import SPECULATIVE_FLAGS
from router.cli import config_from_args
from router.config import RouterConfig

# RouterConfig fields set in code or built by router.cli from flags of its own (workers, keys, TLS files).
ROUTER_NON_FLAGS = {"http_port", "workers", "retry_backoff_max_s", "health_failure_threshold", "rpc_timeout_s",
                    "prefix_block_tokens", "timing_keep", "timing_ttl_s", "default_max_tokens",
                    "admin_token", "api_key", "tls"}


def test_docs_flags_md_is_generated_from_the_parsers() -> None:
    assert flag_docs.main(["--check"]) == 0, "docs/flags.md is stale: run `python -m common.app.flag_docs`"
    text = flag_docs.render()
    for ff in flag_fields(ServerArgs) + flag_fields(RouterConfig):
        assert f"`{ff.option}`" in text


def test_every_node_field_is_a_flag_and_router_fields_are_flags_or_listed() -> None:
    assert {f.name for f in dataclasses.fields(ServerArgs)} == {ff.dest for ff in flag_fields(ServerArgs)}
    router_flags = {ff.dest for ff in flag_fields(RouterConfig)}
    assert {f.name for f in dataclasses.fields(RouterConfig)} - router_flags == ROUTER_NON_FLAGS


def _other_value(ff) -> object:
    """A valid value of ``ff`` other than its default."""
    if ff.kind is bool:
        return True
    if ff.choices:
        return next(c for c in ff.choices if c != ff.default)
    if ff.repeatable:
        return ("streams=3",)
    if ff.kind is int:
        return (ff.default or 0) + 16
    if ff.kind is float:
        return 0.5 if ff.default is None else ff.default * 2
    return "debug" if ff.dest == "log_level" else "/tmp/x"


PASS_THROUGH = [ff for ff in flag_fields(ServerArgs)
                if ff.dest not in UP_SETS_PER_NODE + UP_DERIVES
                and ff.dest not in ("device", "attention_backend", "enable_overlap_schedule")]


# Flags that need another flag beside them (and the value they are given).
COMPANIONS = {"speculative_draft_model_path": ["--speculative-algorithm", "STANDALONE"],
              **{f: ["--speculative-algorithm", "NGRAM"] for f in SPECULATIVE_FLAGS if f != "speculative_draft_model_path"}}
VALUES = {"speculative_eagle_topk": 1, "speculative_ngram_min_match_window_size": 3}


@pytest.mark.parametrize("ff", PASS_THROUGH, ids=lambda ff: ff.option)
def test_up_forwards_each_node_flag_it_is_given(ff, tmp_path) -> None:
    from tests.model_fixtures import make_tiny_model

    value = VALUES.get(ff.dest, _other_value(ff))
    argv = ["up", "--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path),
            *COMPANIONS.get(ff.dest, [])]
    if ff.kind is bool:
        argv.append(ff.option)
    else:
        for item in value if ff.repeatable else (value,):
            argv += [ff.option, str(item)]
    cluster = LocalCluster(build_parser().parse_args(argv))
    node = server_args_from_cli(build_parser().parse_args(cluster.node_args("decode-0", port=5000, bootstrap=5001)))
    assert getattr(node, ff.dest) == value
    assert getattr(ServerArgs(), ff.dest) != value
    prefill = server_args_from_cli(build_parser().parse_args(cluster.node_args("prefill-0", port=5002, bootstrap=5001)))
    speculative = ff.dest.startswith("speculative_")  # decode steps only: a prefill node refuses the flags
    assert getattr(prefill, ff.dest) == (getattr(ServerArgs(), ff.dest) if speculative else value)


def test_up_refuses_a_bad_node_flag_before_starting_anything(tmp_path) -> None:
    ns = build_parser().parse_args(["up", "--log-dir", str(tmp_path), "--chunked-prefill-size", "100"])
    with pytest.raises(ConfigError, match="--chunked-prefill-size"):
        LocalCluster(ns)


@pytest.mark.parametrize(("cls", "changes", "message"), [
    (ServerArgs, {"page_size": 0}, "--page-size must be >= 1"),
    (ServerArgs, {"dtype": "int8"}, "--dtype must be one of float32"),
    (ServerArgs, {"mux_port": -2}, "--mux-port must be a TCP port, 0 (any free port) or -1 (off)"),
    (ServerArgs, {"kv_transfer_backend": "rdma"}, "--kv-transfer-backend must be one of"),
    (RouterConfig, {"request_timeout_s": 0.0}, "--request-timeout must be > 0"),
    (RouterConfig, {"prefill_policy": "fastest"}, "--prefill-policy must be one of"),
])
def test_a_config_built_in_code_is_checked_like_the_cli_and_the_error_names_the_flag(cls, changes, message) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls(**changes)


def test_router_flags_round_trip_through_the_parser() -> None:
    p = argparse.ArgumentParser()
    from router.cli import add_router_args

    add_router_args(p)
    cfg = config_from_args(p.parse_args(["--retry-backoff", "0.2", "--cb-open-seconds", "3", "--reuse-port",
                                         "--decode", "127.0.0.1:5000", "--http-port", "-1"]))
    assert (cfg.retry_backoff_s, cfg.cb_open_s, cfg.reuse_port, cfg.http_port) == (0.2, 3.0, True, None)
    assert [w.address for w in cfg.workers] == ["127.0.0.1:5000"]


def test_each_flag_group_is_one_section_per_command() -> None:
    """A group's flags are listed together: a title made twice (by the flag declarations and by a CLI's own
    arguments) would split it into two sections."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "flags.md").read_text()
    for command in re.split(r"^## ", page, flags=re.M)[1:]:
        titles = re.findall(r"^### (.+)$", command, flags=re.M)
        assert len(titles) == len(set(titles)), (command.splitlines()[0], titles)
    router = page.split("## `pdcluster router`")[1].split("\n## ")[0]
    assert "### openai api" in router and "`--tool-call-parser`" in router.split("### openai api")[1].split("###")[0]


@pytest.mark.parametrize(("flags", "chunk"), [
    ({"disaggregation_mode": "prefill"}, 256),  # a CPU prefill node: small batches, sooner first tokens
    ({"disaggregation_mode": "prefill", "page_size": 48}, 288),  # rounded up to a whole page
    ({"disaggregation_mode": "null"}, 2048),  # a colocated node's chunk paces its decode steps too
    ({"disaggregation_mode": "decode"}, 2048),
    ({"disaggregation_mode": "prefill", "device": "cuda"}, 2048),
    ({"disaggregation_mode": "prefill", "chunked_prefill_size": 4096}, 4096),  # the flag wins
    ({"disaggregation_mode": "prefill", "chunked_prefill_size": -1}, None),
])
def test_chunked_prefill_size_defaults_by_role_and_device(flags, chunk) -> None:
    assert ServerArgs(**flags).chunk_size == chunk
