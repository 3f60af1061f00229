"""``RouterConfig``: the one frozen config of a router process, built once from CLI flags (or by tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common import env
from common.errors import ConfigError
from common.event_loop import EVENT_LOOPS
from common.flags import Check, above, at_least, check_flags, flag, tcp_port
from common.tls import TlsFiles
from router.tool_calls import TOOL_CALL_PARSERS

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


ROUTING, FAILURES, LIMITS, PROCESS, SECURITY = "routing", "failures", "limits", "process", "client security"
TOKENIZER = "tokenizer cache"


def int32() -> Check:
    low, high = env.PRIORITY_RANGE
    return lambda v: None if v is None or low <= v <= high else f"must be an integer in [{low}, {high}], got {v}"


@dataclass(frozen=True)
class ClientSecurity:
    """The flags that build ``RouterConfig.api_keys`` and ``RouterConfig.tls`` (``router.cli``), declared once:
    ``pdcluster up`` takes them too (``common/app/up_args.py``) and hands them to its router (the CA, certificate and
    key file to its nodes as well)."""

    api_key: str | None = flag(None, "bearer key of generation and model calls (visible in ps: prefer --api-key-file "
                               "or PDCLUSTER_API_KEY[_FILE]; up hands it to its router through the environment); "
                               "default: PDCLUSTER_API_KEY / PDCLUSTER_API_KEY_FILE, else open", group=SECURITY)
    api_key_file: str | None = flag(None, "file of API keys, one per line, each optionally followed by max_priority=N "
                                    "(that key's priority ceiling, over --max-client-priority); up also gives the "
                                    "first to the nodes' SGLang HTTP ports", group=SECURITY)
    tls_cert: str | None = flag(None, "PEM certificate chain: the router's HTTP and gRPC listeners serve TLS",
                                group=SECURITY)
    tls_key: str | None = flag(None, "PEM private key of --tls-cert", group=SECURITY)
    tls_ca: str | None = flag(None, "PEM CA bundle: mutual TLS to the nodes (their certificates must chain to it; "
                              "the router presents --tls-cert; up gives every node the same files)", group=SECURITY)

    def __post_init__(self) -> None:
        check_flags(self)

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def api_keys(self) -> tuple[env.ClientKey, ...]:
        """--api-key, else --api-key-file, else PDCLUSTER_API_KEY / PDCLUSTER_API_KEY_FILE, else () (open)."""
        if self.api_key is not None and self.api_key_file is not None:
            raise ConfigError("give --api-key or --api-key-file, not both")
        if self.api_key is not None:
            return (env.ClientKey(self.api_key),) if self.api_key else ()
        if self.api_key_file is not None:
            return env.read_key_file(self.api_key_file, "--api-key-file")
        return env.api_keys()


@dataclass(frozen=True)
class RouterConfig:
    """The router's flags, each declared once here (``common.flags``; ``ClientSecurity`` declares the keys and TLS files
    and ``router.cli`` the few flags that build a field from several values: workers, HTTP port). Fields without
    ``flag()`` are set in code."""

    model_path: str | None = flag(None, "local HF model folder (tokenizer, chat template, config.json); default: the "
                                  "embedded model")
    served_model_name: str | None = flag(None, "model name clients use (default: the folder's name)")
    host: str = flag("127.0.0.1", "bind address of the gRPC and HTTP listeners")
    grpc_port: int = flag(30100, "pdcluster.v1.Router gRPC port (0: any free port)", check=tcp_port())
    http_port: int | None = 30101  # None: no HTTP gateway; 0: pick a free port (``--http-port``, -1: off)
    workers: tuple[WorkerSpec, ...] = ()
    tool_call_parser: str | None = flag(None, "how chat outputs are read into tool_calls under tool_choice auto: "
                                        "llama3 (JSON object) or hermes / qwen25 (<tool_call> blocks); unset: "
                                        "tool_choice auto is refused", group="openai api",
                                        choices=TOOL_CALL_PARSERS)
    prefill_policy: str = flag("cache_aware", "how a prefill worker is picked", group=ROUTING, choices=POLICIES)
    decode_policy: str = flag("power_of_two", "how a decode worker is picked", group=ROUTING, choices=POLICIES)
    cache_threshold: float = flag(0.5, "cache_aware: prefix match rate above which the match wins", group=ROUTING)
    balance_abs_threshold: int = flag(32, "cache_aware: load gap (in-flight requests) that forces balancing ...",
                                      group=ROUTING)
    balance_rel_threshold: float = flag(1.5, "... when also max > rel * min", group=ROUTING)
    # cache_aware: each rank's own bound is its node's KV pool in blocks (``total_kv_pages * page_size /
    # prefix_block_tokens``). ~330 B of router memory per held block.
    prefix_tree_blocks: int = flag(1 << 16, "cache_aware: most prefix blocks remembered per worker rank (each also "
                                   "bounded by its KV pool)", group=ROUTING, check=at_least(1))
    prefix_block_tokens: int = 16  # cache_aware: tokens per hashed block
    # Failures.
    max_retries: int = flag(3, "extra attempts after attempts that failed before producing a token", group=FAILURES,
                            check=at_least(0))
    # The next attempt continues from the tokens so far (router/core.py).
    max_migrations: int = flag(2, "times a request whose decode/colocated leg failed after producing tokens "
                               "continues on another worker from those tokens (0: fail it)", group=FAILURES,
                               check=at_least(0))
    retry_backoff_s: float = flag(0.05, "first retry backoff, seconds; doubles each retry, with jitter",
                                  group=FAILURES, name="retry-backoff", check=at_least(0))
    retry_backoff_max_s: float = 1.0
    request_timeout_s: float = flag(300.0, "deadline of a request without a client deadline, seconds",
                                    group=FAILURES, name="request-timeout", check=above(0))
    # router/core.py _plan: a request is held while no decode worker's last report has room for it.
    admission_wait_s: float = flag(30.0, "seconds a request waits for a decode worker to report room for it (never "
                                   "sent to one whose last report says it cannot admit); then 429, never past its "
                                   "deadline", group=FAILURES, name="admission-wait", check=at_least(0))
    drain_timeout_s: float = flag(30.0, "SIGTERM: seconds requests in flight may go on (new ones get 503 / "
                                  "UNAVAILABLE) before the rest are aborted; a second SIGTERM cuts it short",
                                  group=FAILURES, name="drain-timeout", check=at_least(0))
    cb_failure_threshold: int = flag(5, "consecutive failures that open a worker's circuit", group=FAILURES,
                                     check=at_least(1))
    cb_open_s: float = flag(10.0, "seconds a worker's open circuit stays open before half-open", group=FAILURES,
                            name="cb-open-seconds", check=above(0))
    # Monitoring.
    health_interval_s: float = flag(2.0, "seconds between health checks of a worker", group=FAILURES,
                                    name="health-interval", check=above(0))
    health_failure_threshold: int = 2  # consecutive failed health checks that mark a worker unhealthy
    load_interval_s: float = flag(0.25, "GetLoad poll period, seconds (policies use the cached reports)",
                                  group=FAILURES, name="load-interval", check=above(0))
    rpc_timeout_s: float = 2.0  # health, load, server-info and abort RPCs
    # Limits.
    max_inflight_requests: int = flag(4096, "requests served at once (0: unbounded); beyond it HTTP 429 / "
                                      "RESOURCE_EXHAUSTED with Retry-After", group=LIMITS, check=at_least(0))
    max_request_bytes: int = flag(4 << 20, "largest request body or message, bytes", group=LIMITS, check=at_least(1))
    max_n: int = flag(8, "most choices (n) one OpenAI request may ask for; each choice is served as its own request "
                      "(seed + i)", group=LIMITS, check=at_least(1))
    # Prompts (text, or all chat message contents) over tokenize_inline_bytes UTF-8 bytes are tokenized in one of
    # tokenize_workers processes (router/tokenize_pool.py), never on the event loop.
    tokenize_workers: int = flag(2, "processes that tokenize prompts over --tokenize-inline-bytes off the event loop "
                                 "(0: all inline)", group=LIMITS, check=at_least(0))
    tokenize_inline_bytes: int = flag(4 << 10, "prompts up to this many UTF-8 bytes are tokenized on the event loop",
                                      group=LIMITS, check=at_least(0))
    # Tokenizer caches (router/tokenize_cache.py), named as sglang-router's. L0 lives in the router process (prompts
    # tokenized inline); L1 there and in each tokenize worker, each bounded by --tokenizer-cache-l1-max-memory.
    tokenizer_cache_enable_l0: bool = flag(False, "cache the token ids of whole prompts (exact text, up to 8192 "
                                           "characters, least recently used dropped first)", group=TOKENIZER)
    tokenizer_cache_l0_max_entries: int = flag(10_000, "prompts the L0 cache holds", group=TOKENIZER,
                                               check=at_least(1))
    tokenizer_cache_enable_l1: bool = flag(False, "cache the token ids of prompt pieces that end at a special token "
                                           "(a system prompt, earlier chat turns): a prompt encodes only its new "
                                           "pieces; refused for tokenizers where that could change the ids",
                                           group=TOKENIZER)
    tokenizer_cache_l1_max_memory: int = flag(50 << 20, "bytes the L1 cache holds, per process (the router and each "
                                              "tokenize worker)", group=TOKENIZER, check=at_least(1))
    timing_keep: int = 1024  # /v1/requests/{id}/timing: last N requests ...
    timing_ttl_s: float = 300.0  # ... for at most this long
    default_max_tokens: int = 128  # gRPC requests without max_new_tokens (clamped to the context)
    # Replicas: bind the ports with SO_REUSEPORT so several router processes share them (the kernel spreads
    # connections); each replica is stateless apart from its /v1/requests/{id}/timing store.
    reuse_port: bool = flag(False, "bind with SO_REUSEPORT (set by --replicas)", group=PROCESS)
    event_loop: str = flag("auto", "auto: uvloop when installed, else asyncio's loop", group=PROCESS,
                           choices=EVENT_LOOPS)
    mux_transport: str = flag("socket", "request legs to a node: socket (its Mux socket when it offers one, else its "
                              "gRPC Mux stream) or grpc (always the gRPC stream, e.g. through a proxy that passes "
                              "only HTTP/2)", group=PROCESS, choices=MUX_TRANSPORTS)
    # Admin RPCs and internal HTTP views need this bearer token (router/admin.py); "" refuses them all.
    admin_token: str = field(default_factory=env.admin_token, repr=False)
    # Generation and model calls need one of these bearer keys, or the admin token (router/client_auth.py); none
    # leaves them open. A key may carry its own priority ceiling (router/priority_policy.py).
    api_keys: tuple[env.ClientKey, ...] = field(default_factory=env.api_keys, repr=False)
    max_client_priority: int | None = flag(None, "the most urgent priority a client may ask for (a larger value is "
                                           "more urgent, a smaller one when the decode nodes run "
                                           "--schedule-low-priority-values-first); a key of --api-key-file may "
                                           "carry its own (max_priority=N); the admin token has none; unset: no "
                                           "ceiling", group=SECURITY, check=int32())
    client_priority_over: str = flag("refuse", "a request more urgent than its client's ceiling: refuse (HTTP 400 / "
                                     "INVALID_ARGUMENT naming the ceiling) or clamp (served at the ceiling)",
                                     group=SECURITY, choices=("refuse", "clamp"))
    # TLS (common/tls.py): the client listeners (HTTP and gRPC) serve tls.cert/tls.key; with tls.ca the channels
    # to nodes verify each node's certificate against it and present tls.cert/tls.key (mutual TLS).
    tls: TlsFiles = field(default_factory=TlsFiles)
    tls_server_name: str | None = flag(None, "name the nodes' certificates carry (default: the host of each node's "
                                       "address)", group=SECURITY)

    @property
    def listener_tls(self) -> TlsFiles:
        """The client listeners' TLS: the router's certificate, no client certificates asked (clients use the API
        key); ``tls.ca`` is for the nodes only."""
        return TlsFiles(self.tls.cert, self.tls.key)

    def __post_init__(self) -> None:
        check_flags(self)  # each flag's choices and check (declared on its field)
        if self.prefix_block_tokens < 1:
            raise ConfigError(f"prefix_block_tokens must be >= 1, got {self.prefix_block_tokens}")
        self.tls.check()
        for size, on in (("l0_max_entries", self.tokenizer_cache_enable_l0),
                         ("l1_max_memory", self.tokenizer_cache_enable_l1)):
            name = f"tokenizer_cache_{size}"
            if not on and getattr(self, name) != RouterConfig.__dataclass_fields__[name].default:
                level = size[:2]
                raise ConfigError(f"--tokenizer-cache-{size.replace('_', '-')} sizes the {level.upper()} cache, "
                                  f"which is off: add --tokenizer-cache-enable-{level}, or drop it")
        if self.tls_server_name is not None and not self.tls.mutual:
            raise ConfigError("--tls-server-name names the nodes' certificates: it needs --tls-ca (mutual TLS)")
        seen: set[str] = set()
        for w in self.workers:
            if w.address in seen:
                raise ConfigError(f"worker {w.address} is given twice; each address has one role")
            seen.add(w.address)
