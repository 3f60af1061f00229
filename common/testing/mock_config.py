"""``MockConfig``: what a mock worker (``mock_worker.MockWorker``) is: its role, pacing, load and server-info reports,
faults and security."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.tls import TlsFiles

MODE = {"prefill": "prefill", "decode": "decode", "colocated": "null"}


@dataclass
class MockConfig:
    role: str
    service_time: float = 0.0  # prefill (or colocated generate) time to first token, seconds
    itl: float = 0.0  # seconds between output chunks
    chunk_tokens: int = 1  # tokens per streamed chunk
    dp_size: int = 1
    page_size: int = 16
    context_len: int = 2048
    vocab_size: int = 1536
    total_kv_pages: int = 4096
    free_kv_pages: int | None = None  # report this many free pages on every rank (None: total - in use)
    admissible_tokens: int | None = None  # decode: report this admission budget on every rank (None: unset)
    preempt_priority: int | None = None  # decode: report this preemption bound on every rank (None: unset)
    max_requests_per_rank: int = 0  # ServerInfo's request limit per DP rank (0: none reported; not enforced)
    schedule_low_priority_values_first: bool = False  # reported in ServerInfo (the router's hold order)
    model_name: str = "mock-model"
    report_bootstrap_port: bool = True
    pair_timeout: float = 5.0
    fail_prefill: int = 0  # fail the next N Prefill calls (-1: every one) with ``fail_code``
    fail_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    fail_message: str = "injected prefill failure"
    die_before_first_token: int = 0  # the next N Decode/Generate calls fail before any token (-1: every one)
    die_after_tokens: int | None = None  # Decode/Generate fail after streaming this many tokens ...
    die_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE  # ... with this status
    die_before_finished: bool = False  # Decode/Generate stream every token, then fail instead of sending Finished
    kv_peer_fault: int = 0  # the next N Decode calls fail once paired, blaming their KV peer (as a real decode does)
    hang: bool = False  # never answer Prefill/Decode/Generate (until cancelled)
    tls: TlsFiles | None = None  # serve the Worker port over (m)TLS, as a node with --tls-cert/--tls-key[/--tls-ca]
    secret: str | None = None  # cluster secret its membership proofs use (None: the environment's)
    serve_mux: bool = True  # False: answer Worker.Mux UNIMPLEMENTED, as a node built before Mux does
    mux_socket: bool = True  # offer a Mux socket (common/wire/mux_socket.py) on the Mux stream, as a node does by default
