"""Grammar abuse against a real ``pdcluster up`` P/D cluster (tiny model, loopback): a schema nested past the depth
cap is refused at once, schemas that take long to compile are stopped at ``--grammar-compile-timeout`` (the request
is answered 400 or 504 naming the limit, within a bound), and once they are answered an ordinary schema with bounded
strings is served and parses."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from common.ports import pick_free_port
from tests.engine.test_structured_output import slow_schema
from tests.model_fixtures import make_tiny_model

pytestmark = pytest.mark.slow  # four processes

READY_TIMEOUT_S = 240
READY = re.compile(r"pdcluster ready: OpenAI (http://\S+)/v1")
TIMEOUT_S = 2  # --grammar-compile-timeout of the nodes


def chat(url: str, model: str, schema: dict[str, Any] | str) -> tuple[int, str, float]:
    """(HTTP status, body, seconds) of one chat request under ``schema``."""
    schema = json.loads(schema) if isinstance(schema, str) else schema
    body = {"model": model, "messages": [{"role": "user", "content": "fill it in"}], "max_tokens": 96,
            "temperature": 1.0, "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), time.monotonic() - t0


def test_expensive_grammars_are_bounded_and_the_cluster_keeps_serving(tmp_path: Path) -> None:
    model = make_tiny_model("llama")
    out_path = tmp_path / "up.out"
    cmd = [sys.executable, "-m", "common.app.cli", "up", "--model-path", str(model), "--http-port",
           str(pick_free_port()), "--grpc-port", str(pick_free_port()), "--log-dir", str(tmp_path / "logs"),
           "--max-total-tokens", "4096", "--grammar-compile-timeout", str(TIMEOUT_S), "--grammar-compile-workers",
           "1"]
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (ready := READY.search(text := out_path.read_text())) is None:
            assert proc.poll() is None, f"pdcluster up exited with {proc.returncode}:\n{text[-4000:]}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s:\n{text[-4000:]}"
            time.sleep(0.2)
        url = ready.group(1)
        deep: dict[str, Any] = {"type": "integer"}
        for _ in range(400):
            deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
        with ThreadPoolExecutor(4) as pool:
            flood = [pool.submit(chat, url, model.name, s)
                     for s in (deep, *(slow_schema(f"t{k}_") for k in range(3)))]
            (deep_status, deep_body, deep_s), *slow = [f.result(timeout=180) for f in flood]
        assert deep_status == 400 and "at most 64 are allowed" in deep_body and deep_s < 5, (deep_status, deep_body)
        for status, body, seconds in slow:
            # Stopped at the deadline (400), or waited that long for the node's one worker (504; the router tries
            # again, 503 once every attempt waited): never a compile that runs on to its end.
            assert status in (400, 503, 504) and "--grammar-compile-timeout" in body, (status, body)
            assert seconds < 10 * TIMEOUT_S + 20, seconds
        schema = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["name", "n"]}
        status, body, seconds = chat(url, model.name, schema)
        assert status == 200 and seconds < 30, (status, body, seconds)
        choice = json.loads(body)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
