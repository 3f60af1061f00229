"""Mock workers in numbers: a fleet of ``MockWorker``s sharing one ``MockHub`` in this process, and the model folder
(tokenizer + ``config.json``) a router in front of them loads.

``python -m common.testing.mock_fleet --prefill 1 --decode 1 --colocated 1 --service-time 0.02`` runs a fleet in one
process and prints its addresses as one JSON line (used by ``benchmarks/router_overhead.py``); SIGINT/SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
from pathlib import Path
from typing import Any

from common.testing.mock_config import MockConfig
from common.testing.mock_requests import MockHub
from common.testing.mock_worker import MockWorker

# -- a model folder the router can load (tokenizer + config.json) ---------------------------------------------
_MODEL_DIR: Path | None = None


def make_model_dir(out: Path, vocab_size: int = 1536, context_len: int = 2048) -> Path:
    from common.model_gen.tokenizer import write_tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer_files(out, vocab_size, context_len)
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": ids["vocab_size"],
                "max_position_embeddings": context_len,
                "bos_token_id": ids["<s>"],
                "eos_token_id": ids["</s>"],
            }
        )
    )
    return out


def shared_model_dir() -> Path:
    """One tokenizer folder per process (training the tokenizer takes ~0.5 s)."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        _MODEL_DIR = make_model_dir(Path(tempfile.mkdtemp(prefix="pdcluster-router-test-")) / "mock-model")
    return _MODEL_DIR


# -- a fleet in one process -----------------------------------------------------------------------------------
async def start_fleet(prefill: int, decode: int, colocated: int, **kw: Any) -> list[MockWorker]:
    hub = MockHub()
    workers = [
        MockWorker(MockConfig(role=role, **kw), hub)
        for role, n in (("prefill", prefill), ("decode", decode), ("colocated", colocated))
        for _ in range(n)
    ]
    for w in workers:
        await w.start()
    return workers


async def _main(ns: argparse.Namespace) -> None:
    workers = await start_fleet(
        ns.prefill,
        ns.decode,
        ns.colocated,
        service_time=ns.service_time,
        itl=ns.itl,
        dp_size=ns.dp_size,
        chunk_tokens=ns.chunk_tokens,
    )
    print(
        json.dumps(
            {
                role: [w.address for w in workers if w.cfg.role == role]
                for role in ("prefill", "decode", "colocated")
            }
        ),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for w in workers:
        await w.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="run a mock Worker fleet on 127.0.0.1")
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=1)
    ap.add_argument("--colocated", type=int, default=0)
    ap.add_argument("--service-time", type=float, default=0.02)
    ap.add_argument("--itl", type=float, default=0.0)
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--chunk-tokens", type=int, default=1, help="tokens per streamed chunk")
    asyncio.run(_main(ap.parse_args()))
