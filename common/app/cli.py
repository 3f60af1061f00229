"""``pdcluster`` command line: one subcommand per role. Role packages are imported only by their subcommand."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from common.config import add_server_args, server_args_from_cli
from common.env import log_level
from common.errors import PdclusterError
from common.refs import load_ref

# name -> (module:function that adds the subcommand's flags, module:function that runs it)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("common.config:add_server_args", "common.app.cli:run_serve", "run one node (colocated, prefill or decode)"),
    "router": ("router.cli:add_router_args", "router.cli:run_router", "run the router (gRPC + OpenAI HTTP)"),
    "up": ("common.app.up_args:add_up_args", "common.app.up:run_up", "start a local cluster: router + prefill + decode nodes"),
    "ray": ("deploy.ray.cli:add_ray_args", "deploy.ray.cli:run_ray", "deploy router, prefill and decode on Ray"),
    "generate": ("common.app.cli:add_generate_args", "common.app.cli:run_generate", "generate a completion in-process"),
    "bench": ("benchmarks.bench:add_bench_args", "benchmarks.bench:run_bench", "load-test the router (OpenAI or gRPC)"),
    "make-model": ("common.app.cli:add_make_model_args", "common.app.cli:run_make_model", "build a random HF model offline"),
}


def add_make_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arch", choices=("llama", "qwen2", "qwen3", "mistral"), default=None, help="default: llama")
    p.add_argument("--size", choices=("tiny", "small", "1b", "8b"), default=None,
                   help="default: small; 1b: Llama-3.2-1B-shaped, random bf16 weights (~2 GB); 8b: Llama-3.1-8B-shaped, "
                        "config and tokenizer only (serve it with --load-format dummy); for GPU benchmarks")
    p.add_argument("--no-weights", action="store_true",
                   help="config and tokenizer only, no model.safetensors: serve the folder with --load-format dummy")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--eagle-head", choices=("EAGLE", "EAGLE3"), default=None,
                   help="write a random EAGLE / EAGLE3 draft head for the model at --target instead of a model")
    p.add_argument("--target", default=None, help="with --eagle-head: the target model's folder")


def run_make_model(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from common.errors import ConfigError

    if ns.eagle_head is not None:
        if ns.target is None:
            raise ConfigError("--eagle-head needs --target, the folder of the model it drafts for")
        if ns.arch is not None or ns.size is not None:
            raise ConfigError("--arch/--size describe a model; a draft head takes its shapes from --target")
        from common.model_gen.make_eagle import make_eagle_head

        try:
            print(make_eagle_head(Path(ns.target), Path(ns.out), ns.eagle_head, seed=ns.seed))
        except ValueError as e:
            raise ConfigError(str(e)) from e
        return 0
    if ns.target is not None:
        raise ConfigError("--target is the model a draft head is for; pass it with --eagle-head")
    from common.model_gen.make_model import make_model

    path = make_model(ns.arch or "llama", ns.size or "small", Path(ns.out), seed=ns.seed,
                      weights=False if ns.no_weights else None)
    print(path)
    return 0


def add_generate_args(p: argparse.ArgumentParser) -> None:
    add_server_args(p)
    r = p.add_argument_group("request")
    r.add_argument("--prompt", required=True, help="the prompt text")
    r.add_argument("--max-new-tokens", type=int, default=32, help="most output tokens")
    r.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    r.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    r.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    r.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens even past EOS")
    r.add_argument("--json", action="store_true", help="print token ids, text and finish reason as JSON")


def run_generate(ns: argparse.Namespace) -> int:
    from common.node.engine import Engine

    args = server_args_from_cli(ns)
    with Engine(args) as engine:
        out = engine.generate(
            prompt=ns.prompt,
            sampling_params={
                "max_new_tokens": ns.max_new_tokens,
                "temperature": ns.temperature,
                "top_p": ns.top_p,
                "top_k": ns.top_k,
                "ignore_eos": ns.ignore_eos,
            },
        )
    assert not isinstance(out, list)
    if ns.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids,
            "output_token_ids": out.output_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
        }))
    else:
        print(out.text)
    return 0


def run_serve(ns: argparse.Namespace) -> int:
    from common import event_loop
    from common.node.serve import serve

    args = server_args_from_cli(ns)
    return event_loop.run(serve(args), args.event_loop)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdcluster", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_ref, run_ref, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        load_ref(add_ref)(p)
        p.set_defaults(_run=run_ref)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        return int(load_ref(ns._run)(ns) or 0)  # type: ignore[arg-type]
    except PdclusterError as e:
        print(f"pdcluster {ns.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
