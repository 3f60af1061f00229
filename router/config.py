"""``RouterConfig``: the one frozen config of a router process, built once from CLI flags (or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common import env
from common.errors import ConfigError
from common.tls import TlsFiles

Role = Literal["prefill", "decode", "colocated"]
POLICIES = ("round_robin", "random", "power_of_two", "cache_aware")
MUX_TRANSPORTS = ("socket", "grpc")


@dataclass(frozen=True)
class WorkerSpec:
    """One worker given on the command line or registered at runtime."""

    address: str  # host:port of the Worker gRPC service
    role: Role
    bootstrap_port: int | None = None  # prefill only; None: asked from GetServerInfo

    @staticmethod
    def parse(text: str, role: Role) -> WorkerSpec:
        """``host:port`` or, for prefill, ``host:port:bootstrap_port`` (``grpc://`` prefix allowed)."""
        raw = text.removeprefix("grpc://")
        parts = raw.rsplit(":", 2) if raw.count(":") >= 2 else raw.rsplit(":", 1)
        flag = f"--{'worker' if role == 'colocated' else role}"
        if len(parts) < 2 or not parts[0] or not all(p.isdigit() for p in parts[1:]):
            raise ConfigError(
                f"{flag} {text!r}: expected HOST:PORT" + ("[:BOOTSTRAP_PORT]" if role == "prefill" else "")
            )
        if len(parts) == 3 and role != "prefill":
            raise ConfigError(f"{flag} {text!r}: only prefill workers take a bootstrap port (HOST:PORT)")
        host, port = parts[0], int(parts[1])
        bootstrap = int(parts[2]) if len(parts) == 3 else None
        for value in (port, bootstrap):
            if value is not None and not 0 < value < 65536:
                raise ConfigError(f"{flag} {text!r}: ports must be in 1..65535")
        return WorkerSpec(f"{host}:{port}", role, bootstrap)


@dataclass(frozen=True)
class RouterConfig:
    model_path: str | None = None  # local HF folder: tokenizer, chat template, config.json
    served_model_name: str | None = None  # default: the model folder's name
    host: str = "127.0.0.1"
    grpc_port: int = 30100  # 0: pick a free port (tests)
    http_port: int | None = 30101  # None: no HTTP gateway; 0: pick a free port
    workers: tuple[WorkerSpec, ...] = ()
    prefill_policy: str = "cache_aware"
    decode_policy: str = "power_of_two"
    # Failures.
    max_retries: int = 3  # extra attempts after ones that failed before producing a token
    # Times one request may move to another worker after its decode (or colocated) leg failed having produced
    # tokens; the next attempt continues from those tokens (router/core.py).
    max_migrations: int = 2
    retry_backoff_s: float = 0.05  # first backoff; doubles each retry, with jitter
    retry_backoff_max_s: float = 1.0
    request_timeout_s: float = 300.0  # whole-request deadline when the client sets none
    # How long a request is held while no decode worker's last report has room for it (router/core.py _plan);
    # then 429. Never past the request's deadline.
    admission_wait_s: float = 30.0
    drain_timeout_s: float = 30.0  # SIGTERM: how long requests in flight may go on before both legs are aborted
    cb_failure_threshold: int = 5  # consecutive failures that open a worker's circuit
    cb_open_s: float = 10.0  # open -> half-open after this long
    # Monitoring.
    health_interval_s: float = 2.0
    health_failure_threshold: int = 2  # consecutive failed health checks that mark a worker unhealthy
    load_interval_s: float = 0.25  # GetLoad poll period (policies use the cached reports)
    rpc_timeout_s: float = 2.0  # health, load, server-info and abort RPCs
    # Policies.
    cache_threshold: float = 0.5  # cache_aware: prefix match rate above which the match wins
    balance_abs_threshold: int = 32  # cache_aware: load gap (in-flight requests) that forces balancing ...
    balance_rel_threshold: float = 1.5  # ... when also max > rel * min
    # cache_aware: blocks remembered per worker DP rank (LRU), at most; each rank's own bound is its node's KV pool
    # in blocks (``total_kv_pages * page_size / prefix_block_tokens``). ~330 B of router memory per held block.
    prefix_tree_blocks: int = 1 << 16
    prefix_block_tokens: int = 16  # cache_aware: tokens per hashed block
    # Limits.
    max_inflight_requests: int = 4096  # requests the router serves at once (0: unbounded); more get HTTP 429
    max_request_bytes: int = 4 << 20
    max_n: int = 1
    # Prompts (text, or all chat message contents) over tokenize_inline_bytes UTF-8 bytes are tokenized in one of
    # tokenize_workers processes (router/tokenize_pool.py), never on the event loop; 0 workers: all inline.
    tokenize_workers: int = 2
    tokenize_inline_bytes: int = 4 << 10
    timing_keep: int = 1024  # /v1/requests/{id}/timing: last N requests ...
    timing_ttl_s: float = 300.0  # ... for at most this long
    default_max_tokens: int = 128  # gRPC requests without max_new_tokens (clamped to the context)
    # Replicas: bind the ports with SO_REUSEPORT so several router processes share them (the kernel spreads
    # connections); each replica is stateless apart from its /v1/requests/{id}/timing store.
    reuse_port: bool = False
    event_loop: str = "auto"  # common/event_loop.py: uvloop when installed, or "uvloop" / "asyncio"
    # Request legs: "socket" uses a node's Mux socket when its Mux stream offers one (common/mux_socket.py), "grpc"
    # keeps them on the gRPC Mux stream.
    mux_transport: str = "socket"
    # Admin RPCs and internal HTTP views need this bearer token (router/admin.py); "" refuses them all.
    admin_token: str = field(default_factory=env.admin_token, repr=False)
    # Generation and model calls need this bearer key (router/client_auth.py); "" leaves them open.
    api_key: str = field(default_factory=env.api_key, repr=False)
    # TLS (common/tls.py): the client listeners (HTTP and gRPC) serve tls.cert/tls.key; with tls.ca the channels to
    # nodes verify each node's certificate against it and present tls.cert/tls.key (mutual TLS).
    tls: TlsFiles = field(default_factory=TlsFiles)
    tls_server_name: str | None = None  # the name node certificates carry; None: the host the router dials

    @property
    def listener_tls(self) -> TlsFiles:
        """The client listeners' TLS: the router's certificate, no client certificates asked (clients use the API
        key); ``tls.ca`` is for the nodes only."""
        return TlsFiles(self.tls.cert, self.tls.key)

    def __post_init__(self) -> None:
        for name in ("prefill_policy", "decode_policy"):
            if getattr(self, name) not in POLICIES:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be one of {', '.join(POLICIES)}, got {getattr(self, name)!r}")
        if self.max_retries < 0:
            raise ConfigError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.max_migrations < 0:
            raise ConfigError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if self.request_timeout_s <= 0:
            raise ConfigError(f"--request-timeout must be > 0, got {self.request_timeout_s}")
        if self.admission_wait_s < 0:
            raise ConfigError(f"--admission-wait must be >= 0, got {self.admission_wait_s}")
        if self.drain_timeout_s < 0:
            raise ConfigError(f"--drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if self.max_inflight_requests < 0:
            raise ConfigError(f"--max-inflight-requests must be >= 0, got {self.max_inflight_requests}")
        if self.tokenize_workers < 0:
            raise ConfigError(f"--tokenize-workers must be >= 0, got {self.tokenize_workers}")
        if self.tokenize_inline_bytes < 0:
            raise ConfigError(f"--tokenize-inline-bytes must be >= 0, got {self.tokenize_inline_bytes}")
        if self.prefix_tree_blocks < 1 or self.prefix_block_tokens < 1:
            raise ConfigError(f"--prefix-tree-blocks must be >= 1, got {self.prefix_tree_blocks}")
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if self.mux_transport not in MUX_TRANSPORTS:
            raise ConfigError(f"--mux-transport must be one of {', '.join(MUX_TRANSPORTS)}, got {self.mux_transport!r}")
        self.tls.check()
        if self.tls_server_name is not None and not self.tls.mutual:
            raise ConfigError("--tls-server-name names the nodes' certificates: it needs --tls-ca (mutual TLS)")
        seen: set[str] = set()
        for w in self.workers:
            if w.address in seen:
                raise ConfigError(f"worker {w.address} is given twice; each address has one role")
            seen.add(w.address)
