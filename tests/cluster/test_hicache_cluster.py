"""``pdcluster up --enable-hierarchical-cache`` (one prefill and one decode node, device pools of two prompts): a
prompt the next ones evicted from the prefill node's device comes back from its host tier, through the router. The
response counts the hit (``usage.prompt_tokens_details.cached_tokens``, ``pdcluster.timing.cached_tokens_host``)
and its greedy text is the first run's."""

from __future__ import annotations

import json
import random
import urllib.request
from typing import Any

import pytest

from tests.cluster.test_cluster_e2e import start_up, stop_up

pytestmark = pytest.mark.slow  # three processes


def test_a_returning_prompt_comes_back_from_the_prefill_nodes_host_tier(model_path) -> None:
    cluster = start_up(model_path, "--prefill", "1", "--decode", "1", "--enable-hierarchical-cache",
                       "--hicache-ratio", "2", "--max-total-tokens", "256")
    try:
        base = f"http://127.0.0.1:{cluster.http_port}/v1"
        with urllib.request.urlopen(f"{base}/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]

        def complete(ids: list[int]) -> dict[str, Any]:
            body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(f"{base}/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                out: dict[str, Any] = json.load(resp)
                return out

        rng = random.Random(52)
        prompts = [[rng.randrange(3, 250) for _ in range(100)] for _ in range(3)]  # 100 tokens each
        first = [complete(p) for p in prompts]
        again = complete(prompts[0])
        assert again["choices"][0]["text"] == first[0]["choices"][0]["text"]
        assert first[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and again["pdcluster"]["timing"].get("cached_tokens_host") == cached, again
    finally:
        stop_up(cluster)
    assert cluster.proc.returncode == 0, cluster.log.read_text()[-3000:]
