"""``pdcluster up --demo``: example requests through the cluster's OpenAI API once it is ready."""

from __future__ import annotations

import json
import logging
import ssl


def run_demo(base_url: str, model_name: str, api_key: str = "", tls_ca: str | None = None) -> None:
    from openai import DefaultHttpxClient, OpenAI

    for name in ("httpx", "httpx2"):  # one INFO line per HTTP request would drown the demo's text
        logging.getLogger(name).setLevel(logging.WARNING)

    http_client = DefaultHttpxClient(verify=ssl.create_default_context(cafile=tls_ca)) if tls_ca else None
    client = OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "unused", timeout=60, http_client=http_client)
    completion = client.completions.create(model=model_name, prompt="The quick brown fox", max_tokens=24,
                                           temperature=0)
    print(f"\n[completions] {completion.choices[0].text!r}")
    print(f"  usage: {json.dumps(completion.usage.model_dump())}")
    print("[chat, streamed] ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Tell me about disaggregated serving."}],
        max_tokens=32, temperature=0.7, stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print("\n")
