"""Flags declared once (``common.flags``): the parsers, ``up``'s pass-through and ``docs/flags.md`` all come from the
config dataclasses' fields, so a new flag is one field."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from common.app import flag_docs
from common.app.cli import build_parser
from common.app.up import LocalCluster
from common.app.up_args import UP_DERIVES, UP_SETS_FOR_ROUTER, UP_SETS_PER_NODE, router_shares
from common.config import ServerArgs, server_args_from_cli
from common.errors import ConfigError
from common.flags import declared_by, flag_fields
from common.speculative import SPECULATIVE_FLAGS
from router.cli import config_from_args
from router.config import RouterConfig

# RouterConfig fields set in code or built by router.cli from flags of its own (workers, keys, TLS files).
ROUTER_NON_FLAGS = {"http_port", "workers", "retry_backoff_max_s", "health_failure_threshold", "rpc_timeout_s",
                    "prefix_block_tokens", "timing_keep", "timing_ttl_s", "default_max_tokens",
                    "admin_token", "api_keys", "tls"}


def test_docs_flags_md_is_generated_from_the_parsers_of_every_command() -> None:
    assert flag_docs.main(["--check"]) == 0, "docs/flags.md is stale: run `python -m common.app.flag_docs`"
    text = flag_docs.render()
    for ff in flag_fields(ServerArgs) + flag_fields(RouterConfig):
        assert f"`{ff.option}`" in text
    commands = [name for name, _, _ in flag_docs.commands(build_parser())]
    assert {"pdcluster serve", "pdcluster router", "pdcluster up", "pdcluster ray up", "pdcluster generate",
            "pdcluster make-model", "pdcluster bench"} <= set(commands)
    for name, _, parser in flag_docs.commands(build_parser()):
        section = text.split(f"## `{name}`\n")[1].split("\n## ")[0]
        for action in parser._actions:
            if action.dest != "help":
                assert f"`{action.option_strings[0]}`" in section, (name, action.option_strings)


# One flag, declared once: every option of every command comes from one declaration, a flag field (``common.flags``)
# or an argument added by hand. A name may be declared again only by a field of another process's config (each
# process declares its own; ``up`` hands one value to both: ``router_shares``), or where it means something else.
ROOT = Path(__file__).resolve().parents[1]
PROCESS_OF = {"common.config.ServerArgs": "node", "router.config.RouterConfig": "router",
              "router.config.ClientSecurity": "router"}
OTHER_MEANING = {  # (option, file of the argument added by hand) -> what it means there
    ("--prefill", "router/cli.py"): "a prefill worker's address (up, ray up: how many prefill nodes)",
    ("--decode", "router/cli.py"): "a decode worker's address (up, ray up: how many decode nodes)",
    ("--grpc-port", "common/app/up_args.py"): "the gRPC port of the router up starts (its own default)",
    ("--http-port", "common/app/up_args.py"): "the HTTP port of the router up starts (its own default)",
    ("--seed", "common/app/cli.py"): "make-model: the random weights' seed",
    ("--seed", "benchmarks/bench.py"): "bench: the workload's seed",
    ("--out", "benchmarks/bench.py"): "bench: the results' path prefix (make-model: the model folder)",
    ("--api-key", "benchmarks/bench.py"): "bench: the key the client sends",
    ("--tls-ca", "benchmarks/bench.py"): "bench: the CA the client trusts the router's certificate with",
    ("--request-timeout", "benchmarks/bench.py"): "bench: the client's timeout",
}


def declarations(parsers: list[argparse.ArgumentParser], sites: dict[int, str]) -> dict[str, set[str]]:
    """Option -> where it is declared: ``module.Class.field`` for a flag field, else ``path:line`` of the
    ``add_argument`` call (``sites``, by action id)."""
    found: dict[str, set[str]] = defaultdict(set)
    for parser in parsers:
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    found[option].add(declared_by(action) or sites[id(action)])
    return found


def declared_twice(found: dict[str, set[str]]) -> list[str]:
    twice = []
    for option, where in sorted(found.items()):
        rest = {w for w in where if (option, w.partition(":")[0]) not in OTHER_MEANING}
        processes = [PROCESS_OF.get(w.rsplit(".", 1)[0]) for w in rest]
        if len(rest) > 1 and (None in processes or len(set(processes)) < len(processes)):
            twice.append(f"{option}: {sorted(rest)}")
    return twice


def record_sites(monkeypatch: pytest.MonkeyPatch) -> dict[int, str]:
    """Where each argument added from now on was added (the first caller outside argparse and common/flags.py)."""
    sites: dict[int, str] = {}
    add = argparse._ActionsContainer.add_argument
    skip = {argparse.__file__, str(ROOT / "common" / "flags.py")}

    def recorded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        action = add(self, *args, **kwargs)
        frame = sys._getframe(1)
        while frame.f_code.co_filename in skip:
            frame = frame.f_back  # type: ignore[assignment]
        path = Path(frame.f_code.co_filename)
        sites[id(action)] = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{frame.f_lineno}"
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", recorded)
    return sites


def test_every_flag_of_every_command_is_declared_once(monkeypatch) -> None:
    sites = record_sites(monkeypatch)
    found = declarations([p for _, _, p in flag_docs.commands(build_parser())], sites)
    assert len(found) > 150 and declared_by(build_parser()._actions[0]) is None
    assert declared_twice(found) == []
    for option, path in OTHER_MEANING:  # no stale exception: each names an argument that is there
        assert any(w.startswith(path + ":") for w in found[option]), (option, path)


def test_a_flag_declared_twice_is_seen(monkeypatch) -> None:
    """A hand-written copy of a flag field (as ``ray up`` had of seven node flags), or of another hand-written
    argument (as ``up`` had of the router's security flags), is found; each process's own field is not."""
    from common.config import add_server_args

    sites = record_sites(monkeypatch)
    node, copy, router = argparse.ArgumentParser(), argparse.ArgumentParser(), argparse.ArgumentParser()
    add_server_args(node)
    copy.add_argument("--dp-size", type=int)
    copy.add_argument("--admin-token")
    from router.cli import add_router_args

    add_router_args(router)
    twice = declared_twice(declarations([node, copy, router], sites))
    assert [t.split(":")[0] for t in twice] == ["--admin-token", "--dp-size"], twice


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
                and ff.dest not in ("device", "attention_backend", "enable_overlap_schedule")
                and not ff.dest.startswith("hicache_")]  # they need --enable-hierarchical-cache: the test below


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
    # decode steps only: a prefill node refuses NGRAM's flags; a draft model's (STANDALONE's) runs there too
    speculative = ff.dest.startswith("speculative_") and COMPANIONS.get(ff.dest, [""])[-1] != "STANDALONE"
    assert getattr(prefill, ff.dest) == (getattr(ServerArgs(), ff.dest) if speculative else value)


def test_up_gives_decode_nodes_only_the_hicache_flags_they_take(tmp_path) -> None:
    from tests.model_fixtures import make_tiny_model

    argv = ["up", "--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path),
            "--enable-hierarchical-cache", "--hicache-ratio", "3", "--hicache-storage-backend", "file",
            "--hicache-write-policy", "write_back"]
    cluster = LocalCluster(build_parser().parse_args(argv))
    nodes = {name: server_args_from_cli(build_parser().parse_args(cluster.node_args(name, port=5000, bootstrap=5001)))
             for name in ("prefill-0", "decode-0")}
    assert nodes["prefill-0"].hicache_storage_backend == "file" and nodes["prefill-0"].hicache_ratio == 3
    assert nodes["decode-0"].hicache_storage_backend is None and nodes["decode-0"].hicache_ratio == 3
    assert nodes["decode-0"].enable_hierarchical_cache and nodes["decode-0"].hicache_write_policy == "write_through"


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


ROUTER_PASS_THROUGH = [ff for ff in flag_fields(RouterConfig) if ff.dest not in (*UP_SETS_FOR_ROUTER, *router_shares())
                       and ff.dest != "tls_server_name"]  # that one needs up's --tls-ca (mutual TLS)


def test_up_forwards_every_router_flag_it_is_given_and_a_shared_flag_to_router_and_nodes(tmp_path) -> None:
    from router.cli import add_router_args
    from tests.model_fixtures import make_tiny_model

    argv = ["up", "--model-path", str(make_tiny_model("llama")), "--log-dir", str(tmp_path), "--request-timeout", "77"]
    for ff in ROUTER_PASS_THROUGH:
        argv += [ff.option] if ff.kind is bool else [ff.option, str(_other_value(ff))]
    cluster = LocalCluster(build_parser().parse_args(argv))
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    router = config_from_args(parser.parse_args(cluster.router_args()[1:]))
    assert {ff.dest: getattr(router, ff.dest) for ff in ROUTER_PASS_THROUGH} == \
        {ff.dest: _other_value(ff) for ff in ROUTER_PASS_THROUGH}
    assert all(getattr(RouterConfig(), ff.dest) != _other_value(ff) for ff in ROUTER_PASS_THROUGH)
    node = server_args_from_cli(build_parser().parse_args(cluster.node_args("decode-0", port=5000, bootstrap=5001)))
    assert router.request_timeout_s == node.request_timeout == 77.0


def test_up_reads_the_embedded_models_tool_calls_unless_told_otherwise(tmp_path, monkeypatch) -> None:
    """The embedded model's chat template asks for <tool_call> blocks: a ``make up`` cluster answers ``tools`` with
    the default tool_choice (auto) instead of a 400; another model gets no parser it may not speak."""
    from common.app import up
    from common.model_gen.tokenizer import CHAT_TEMPLATE
    from tests.model_fixtures import make_tiny_model

    assert "<tool_call>" in CHAT_TEMPLATE  # what qwen25 (hermes) reads
    tiny = str(make_tiny_model("llama"))
    monkeypatch.setattr(up, "resolve_model_path", lambda path: path or tiny)  # the embedded one, not generated here
    base = ["up", "--log-dir", str(tmp_path)]
    embedded = LocalCluster(build_parser().parse_args(base)).router_args()
    assert embedded[embedded.index("--tool-call-parser") + 1] == "qwen25"
    told = LocalCluster(build_parser().parse_args([*base, "--tool-call-parser", "llama3"])).router_args()
    assert told[told.index("--tool-call-parser") + 1] == "llama3" and told.count("--tool-call-parser") == 1
    assert "--tool-call-parser" not in LocalCluster(build_parser().parse_args([*base, "--model-path", tiny])).router_args()
