"""``benchmarks/schedule_policy.py --pd``'s pieces: the load generator sends a request's priority through the
OpenAI API's extra field, and the node-log totals the benchmark reads (cached, computed and recomputed tokens,
preemptions) are parsed from the nodes' own line formats."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.loadgen.clients import OpenAIClient
from benchmarks.loadgen.workload import RequestSpec
from benchmarks.schedule_policy import log_counts
from common.engine.scheduler_metrics import DecodeStats, PrefillStats, format_decode_line, format_prefill_line
from common.ports import pick_free_port


async def _bodies_sent(specs: list[RequestSpec]) -> list[dict[str, Any]]:
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.Response:
        bodies.append(await request.json())
        return web.json_response({"id": "c", "object": "text_completion", "created": 0, "model": "m",
                                  "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}})

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = pick_free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = OpenAIClient(f"http://127.0.0.1:{port}/v1", model="m", timeout_s=10, stream=False)
    try:
        results = [await client.send(s, 0.0) for s in specs]
    finally:
        await client.close()
        await runner.cleanup()
    assert all(r.ok for r in results), [r.error for r in results]
    return bodies


def test_openai_client_sends_the_priority_only_when_the_spec_has_one() -> None:
    specs = [RequestSpec(0, [5, 6], 1, priority=100), RequestSpec(1, [5, 6], 1, priority=0), RequestSpec(2, [5], 1)]
    bodies = asyncio.run(asyncio.wait_for(_bodies_sent(specs), 30))
    assert [b.get("priority", "absent") for b in bodies] == [100, 0, "absent"]
    assert all(b["ignore_eos"] is True for b in bodies), json.dumps(bodies)


def test_log_counts_reads_the_nodes_line_formats(tmp_path: Path) -> None:
    lines = [format_prefill_line(PrefillStats(2, 100, 28, 0.5, 0, 3)),
             format_prefill_line(PrefillStats(1, 7, 64, 0.5, 1, 0)),
             "Priority preemption: rid=a (priority 100) retracted 2 running requests (rid=b priority 0, rid=c "
             "priority 0)",
             format_decode_line(DecodeStats(4, 40, 0.1, 3, 12.0)),
             format_decode_line(DecodeStats(4, 40, 0.1, 0, 12.0))]
    log = tmp_path / "node.log"
    log.write_text("\n".join(f"[2026-11-27 03:00:00 TP0] {line}" for line in lines) + "\n")
    assert log_counts(log) == {"new_tokens": 107, "cached_tokens": 92, "preempted": 2, "retracted": 3}
    assert log_counts(tmp_path / "absent.log") == {"new_tokens": 0, "cached_tokens": 0, "preempted": 0,
                                                    "retracted": 0}
