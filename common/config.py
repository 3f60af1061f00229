"""``ServerArgs``: the one frozen config of a serving process, parsed once from SGLang-style CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

from common import env
from common.errors import ConfigError
from common.kv_options import parse_options
from common.tls import TlsFiles

DisaggregationMode = Literal["null", "prefill", "decode"]
KV_TRANSFER_BACKENDS = ("tcp", "nccl", "ucx", "nixl", "mooncake", "shm", "fake")
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")
DEVICES = ("cpu", "cuda")
GRAMMAR_BACKENDS = ("xgrammar", "none")
DEFAULT_MEM_FRACTION = {"cpu": 0.1, "cuda": 0.85}
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]", "")
TP_MIN_TIMEOUT_S = 60.0  # TP rendezvous and collectives: ranks loading their shards may skew by more than a watchdog


@dataclass(frozen=True)
class ServerArgs:
    model_path: str | None = None  # None: the embedded default model, generated once into the cache dir
    host: str = "127.0.0.1"  # bind address only
    advertise_host: str | None = None  # what peers and the router are told; None = --host
    port: int = 30000
    metrics_port: int | None = None
    # SGLang's HTTP worker surface (common/server/sglang_http.py): /generate, /health, /get_server_info, ... so the
    # node serves behind sglang-router; None: off.
    sglang_http_port: int | None = None
    # The Mux socket (common/mux_socket.py): Worker.Mux's stream on plain TCP (TLS with the gRPC port's), offered to
    # routers on the gRPC Mux stream; 0: any free port on --host; -1: off (request legs stay on gRPC).
    mux_port: int = 0
    disaggregation_mode: DisaggregationMode = "null"
    disaggregation_bootstrap_port: int = 8998
    kv_transfer_backend: str = "tcp"
    kv_transfer_option: tuple[str, ...] = ()  # KEY=VALUE settings of the backend (common/kv_options.py)
    dtype: str = "float32"
    device: str = "cpu"
    base_gpu_id: int = 0  # rank (dp d, tp t) uses cuda:(base_gpu_id + d * tp_size + t); see common.device
    seed: int = 0
    attention_backend: str | None = None  # None: triton on CUDA, torch elsewhere (see resolved_attention_backend)
    # Memory.
    page_size: int = 16  # on CPU, page-sized KV reads make decode attention ~2x faster than page_size 1
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None  # None: DEFAULT_MEM_FRACTION of the device
    max_running_requests: int = 256
    # Requests a DP rank holds beyond --max-running-requests (bootstrap, waiting, transfer queues); the front answers
    # RESOURCE_EXHAUSTED with a retry hint beyond it.
    max_queued_requests: int = 1024
    disable_radix_cache: bool = False
    # Scheduling.
    chunked_prefill_size: int = 2048  # -1 disables chunking
    max_prefill_tokens: int = 16384
    enable_mixed_chunk: bool = False
    disable_overlap_schedule: bool = False  # run forwards inline instead of overlapped on a forward thread
    enable_overlap_schedule: bool = False  # overlap on CPU even where the ranks' torch threads fill every core
    schedule_conservativeness: float = 1.0
    num_reserved_decode_tokens: int = 128
    decode_log_interval: int = 40
    # Constrained decoding (common/sampling/grammar.py): json_schema / regex / ebnf requests.
    grammar_backend: str = "xgrammar"  # "none": such requests are refused with INVALID_ARGUMENT
    grammar_compile_timeout: float = 30.0  # a request whose grammar is not compiled by then fails
    grammar_any_whitespace: bool = False  # JSON schemas: any whitespace between tokens (default: ", " and ": ")
    torch_num_threads: int | None = None
    # Compiled decode steps (common.graph_runner): decode batches are padded to the next captured/compiled batch size.
    enable_torch_compile: bool = False  # torch.compile the decode forward per batch-size bucket (any device)
    torch_compile_max_bs: int = 32  # largest compiled decode batch; larger batches run eager
    cuda_graph_max_bs: int | None = None  # largest captured decode batch; None: min(160, --max-running-requests)
    disable_cuda_graph: bool = False  # cuda: run decode steps eagerly instead of replaying CUDA graphs
    # Parallelism.
    tp_size: int = 1
    dp_size: int = 1
    # Multi-host TP groups (SGLang's names): the rendezvous of every TP group of this node ("host:port"; None: a
    # free local port picked by the front), how many hosts one group spans, and this host's index among them.
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    # Deadlines (seconds) of the disaggregation states.
    bootstrap_timeout: float = 30.0
    waiting_timeout: float = 60.0
    transfer_timeout: float = 60.0
    request_timeout: float = 600.0  # upper bound of one request on a node when the client set no deadline
    drain_timeout: float = 30.0  # SIGTERM: how long in-flight requests may finish before they are aborted
    watchdog_timeout: float = 300.0  # liveness fails when a scheduler rank has not stepped for this long
    log_level: str = "info"
    log_requests: bool = False  # one log line per request on arrival and on finish (rid, room, outcome)
    # The Worker gRPC listener (common/tls.py): TLS with tls_cert/tls_key; with tls_ca, only callers presenting a
    # certificate signed by it (the router) are served.
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if self.disaggregation_mode not in ("null", "prefill", "decode"):
            raise ConfigError(f"--disaggregation-mode must be null, prefill or decode, got {self.disaggregation_mode!r}")
        if self.kv_transfer_backend not in KV_TRANSFER_BACKENDS:
            raise ConfigError(
                f"--kv-transfer-backend must be one of {', '.join(KV_TRANSFER_BACKENDS)}, got {self.kv_transfer_backend!r}"
            )
        parse_options(self.kv_transfer_backend, self.kv_transfer_option)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.attention_backend == "triton" and self.device != "cuda" and not env.triton_interpret():
            raise ConfigError(
                f"--attention-backend triton needs a CUDA device (got --device {self.device}); use "
                "--attention-backend torch on CPU (Triton's interpreter, TRITON_INTERPRET=1, is for tests only)"
            )
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ConfigError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other; "
                              "pass at most one")
        if self.page_size < 1:
            raise ConfigError(f"--page-size must be >= 1, got {self.page_size}")
        if self.chunked_prefill_size != -1 and (
            self.chunked_prefill_size < self.page_size or self.chunked_prefill_size % self.page_size
        ):
            raise ConfigError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be -1 or a positive multiple of "
                f"--page-size ({self.page_size})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens must be >= --page-size, got {self.max_total_tokens}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r} "
                              "(pick the GPU with --base-gpu-id, not cuda:N)")
        if self.base_gpu_id < 0:
            raise ConfigError(f"--base-gpu-id must be >= 0, got {self.base_gpu_id}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 0.95:
            raise ConfigError(f"--mem-fraction-static must be in (0, 0.95], got {self.mem_fraction_static}")
        if self.watchdog_timeout <= 0:
            raise ConfigError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.max_queued_requests < 0:
            raise ConfigError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        for name in ("max_running_requests", "max_prefill_tokens", "tp_size", "dp_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank must be in [0, --nnodes) with --nnodes >= 1, got --nnodes {self.nnodes} "
                              f"--node-rank {self.node_rank}")
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ConfigError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT (node 0's address, the "
                                  "same on every node)")
            if self.dp_size != 1 or self.tp_size % self.nnodes:
                raise ConfigError(f"--nnodes {self.nnodes} spans one TP group over hosts: it needs --dp-size 1 and a "
                                  f"--tp-size divisible by it, got --dp-size {self.dp_size} --tp-size {self.tp_size}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")
        for name in ("port", "disaggregation_bootstrap_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"--{name.replace('_', '-')} must be a TCP port, got {getattr(self, name)}")
        if self.sglang_http_port is not None and not 0 <= self.sglang_http_port < 65536:
            raise ConfigError(f"--sglang-http-port must be a TCP port, got {self.sglang_http_port}")
        if not -1 <= self.mux_port < 65536:
            raise ConfigError(f"--mux-port must be a TCP port, 0 (any free port) or -1 (off), got {self.mux_port}")
        if self.torch_compile_max_bs < 1:
            raise ConfigError(f"--torch-compile-max-bs must be >= 1, got {self.torch_compile_max_bs}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ConfigError(f"--cuda-graph-max-bs must be >= 1 (or unset), got {self.cuda_graph_max_bs}")
        if self.enable_torch_compile and self.tp_size > 1:
            raise ConfigError(f"--enable-torch-compile supports --tp-size 1 only, got --tp-size {self.tp_size} "
                              "(the compiled decode step has no collectives)")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise ConfigError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}, "
                              f"got {self.grammar_backend!r}")
        if self.grammar_compile_timeout <= 0:
            raise ConfigError(f"--grammar-compile-timeout must be > 0 seconds, got {self.grammar_compile_timeout}")
        if self.schedule_conservativeness <= 0:
            raise ConfigError("--schedule-conservativeness must be > 0")
        self.tls  # noqa: B018  (TlsFiles checks which --tls-* flags go together; the files at start-up)
        if self.is_disaggregated and self.advertised_host in UNSPECIFIED_HOSTS:
            raise ConfigError(
                f"--host {self.host} binds every interface but peers cannot reach {self.advertised_host}: set "
                "--advertise-host to an address they can (e.g. the pod IP), or bind that address with --host")

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def advertised_host(self) -> str:
        """The address peers and the router are told (bootstrap, KV control and data endpoints)."""
        return self.advertise_host or self.host

    @property
    def kv_transfer_options(self) -> dict[str, str]:
        return parse_options(self.kv_transfer_backend, self.kv_transfer_option)

    @property
    def is_disaggregated(self) -> bool:
        return self.disaggregation_mode != "null"

    @property
    def resolved_attention_backend(self) -> str:
        """The attention backend the model runs: the flag, else triton on CUDA and torch elsewhere."""
        if self.attention_backend is not None:
            return self.attention_backend
        return "triton" if self.device == "cuda" else "torch"

    @property
    def use_cuda_graph(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA unless --disable-cuda-graph (TP groups run eagerly)."""
        return self.device == "cuda" and not self.disable_cuda_graph and self.tp_size == 1

    @property
    def resolved_cuda_graph_max_bs(self) -> int:
        """``--cuda-graph-max-bs``, else min(160, --max-running-requests) (SGLang's default on large GPUs)."""
        if self.cuda_graph_max_bs is not None:
            return self.cuda_graph_max_bs
        return min(160, self.max_running_requests)

    @property
    def tp_ranks_here(self) -> range:
        """TP ranks of each DP replica that run on this host (all of them unless --nnodes > 1)."""
        per = self.tp_size // self.nnodes
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    @property
    def tp_timeout_s(self) -> float:
        """A TP group's rendezvous and collective timeout: ``--watchdog-timeout``, but at least TP_MIN_TIMEOUT_S (a
        dead rank closes its connections at once; the timeout only ends a wait on a live, stuck peer)."""
        return max(self.watchdog_timeout, TP_MIN_TIMEOUT_S)

    @property
    def mem_fraction(self) -> float:
        """``--mem-fraction-static``, or the device's default when unset."""
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        return DEFAULT_MEM_FRACTION[self.device]

    @property
    def chunk_size(self) -> int | None:
        return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    d = ServerArgs()
    g = parser.add_argument_group("model")
    g.add_argument("--model-path", default=d.model_path, help="local Hugging Face model folder (default: embedded model)")
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weights and KV cache dtype")
    g.add_argument("--device", default=d.device, choices=DEVICES, help="where the model and KV cache live")
    g.add_argument("--base-gpu-id", type=int, default=d.base_gpu_id,
                   help="cuda: first GPU of this node; DP rank d uses GPU base-gpu-id + d * tp-size")
    g.add_argument("--seed", type=int, default=d.seed, help="seed of unseeded sampling")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS,
                   help="attention kernels: triton (paged, default on CUDA) or torch (default on CPU)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address of every listener (0.0.0.0: all interfaces)")
    g.add_argument("--advertise-host", default=d.advertise_host,
                   help="address peers and the router are told (bootstrap, KV endpoints); default --host")
    g.add_argument("--port", type=int, default=d.port, help="gRPC pdcluster.v1.Worker port")
    g.add_argument("--metrics-port", type=int, default=d.metrics_port, help="Prometheus /metrics HTTP port (off by default)")
    g.add_argument("--sglang-http-port", type=int, default=d.sglang_http_port,
                   help="serve SGLang's HTTP worker API (/generate with bootstrap_host/port/room, /health, "
                        "/get_server_info, ...) on this port, so sglang-router can route to this node; off by default")
    g.add_argument("--mux-port", type=int, default=d.mux_port,
                   help="port of the Mux socket: the router's request legs on plain TCP (TLS when the gRPC port has "
                        "it) instead of gRPC frames; 0: any free port (offered to the router over gRPC); -1: off")
    g.add_argument("--log-level", default=d.log_level)
    g.add_argument("--log-requests", action="store_true", help="log each request's arrival and outcome (rid, room)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate chain: the Worker gRPC port serves TLS")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle: mutual TLS, only callers with a certificate it signed (the router) are served")
    g = parser.add_argument_group("disaggregation")
    g.add_argument("--disaggregation-mode", default=d.disaggregation_mode, choices=("null", "prefill", "decode"))
    g.add_argument("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port,
                   help="prefill nodes: port of the Bootstrap service decode nodes resolve ranks through")
    g.add_argument("--kv-transfer-backend", default=d.kv_transfer_backend, choices=KV_TRANSFER_BACKENDS,
                   help="KV data plane: tcp (anywhere), nccl (gloo on CPU), ucx, nixl (RDMA cluster; UCX_TLS), "
                        "shm (same host), fake")
    g.add_argument("--kv-transfer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting of the chosen backend, repeatable: tcp streams=4 (connections per peer), "
                        "stripe_bytes, stage, stage_bytes; mooncake mooncake_protocol=rdma, mooncake_device; "
                        "ucx ucx_tls, ucx_progress_mode; nccl pack_bytes")
    g.add_argument("--num-reserved-decode-tokens", type=int, default=d.num_reserved_decode_tokens,
                   help="decode nodes: KV headroom kept per active request before admitting a transfer")
    g.add_argument("--bootstrap-timeout", type=float, default=d.bootstrap_timeout,
                   help="seconds a request may wait for its peer (handshake, destination pages)")
    g.add_argument("--waiting-timeout", type=float, default=d.waiting_timeout,
                   help="seconds a decode request may wait for its first KV chunk")
    g.add_argument("--transfer-timeout", type=float, default=d.transfer_timeout,
                   help="seconds a transfer may make no progress")
    g.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="upper bound of one request when the client sets no deadline")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="SIGTERM: seconds in-flight requests may finish before the node stops")
    g.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                   help="seconds a scheduler rank may go without completing a step (or an idle poll) before the "
                        "node's /liveness (on --metrics-port) fails")
    g = parser.add_argument_group("memory and scheduling")
    g.add_argument("--page-size", type=int, default=d.page_size, help="tokens per KV page")
    g.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens,
                   help="KV cache size in tokens per DP rank (default: from --mem-fraction-static)")
    g.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static,
                   help="when --max-total-tokens is unset. cpu: fraction of available host RAM for the KV cache "
                        f"(default {DEFAULT_MEM_FRACTION['cpu']}); cuda: fraction of the GPU's total memory for "
                        "this rank's weights + KV cache, the KV cache taking what the weights leave "
                        f"(default {DEFAULT_MEM_FRACTION['cuda']}; nodes sharing a GPU split it)")
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests,
                   help="requests in the running batch per DP rank")
    g.add_argument("--max-queued-requests", type=int, default=d.max_queued_requests,
                   help="requests a DP rank may hold beyond --max-running-requests; more get RESOURCE_EXHAUSTED")
    g.add_argument("--disable-radix-cache", action="store_true", help="no prefix sharing between requests")
    g.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                   help="tokens per prefill chunk, a multiple of --page-size; -1 disables chunking")
    g.add_argument("--max-prefill-tokens", type=int, default=d.max_prefill_tokens,
                   help="prompt tokens one prefill batch may compute")
    g.add_argument("--enable-mixed-chunk", action="store_true",
                   help="run the running decode requests inside prefill batches")
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="run each forward inline: no preparation of the next batch (colocated, decode) or result "
                        "processing (prefill) while the forward runs")
    g.add_argument("--enable-overlap-schedule", action="store_true",
                   help="overlap on CPU even when this node's torch threads take every core (by default a CPU node "
                        "overlaps only when they leave one free: the scheduler thread needs a core of its own)")
    g.add_argument("--schedule-conservativeness", type=float, default=d.schedule_conservativeness,
                   help="> 1 reserves more KV for future tokens (fewer retractions)")
    g.add_argument("--decode-log-interval", type=int, default=d.decode_log_interval,
                   help="log a Decode batch line every N forward passes")
    g.add_argument("--torch-num-threads", type=int, default=d.torch_num_threads,
                   help="torch threads per scheduler rank (default: cores / dp-size)")
    g = parser.add_argument_group("constrained decoding")
    g.add_argument("--grammar-backend", default=d.grammar_backend, choices=GRAMMAR_BACKENDS,
                   help="engine of json_schema / regex / ebnf requests; none refuses them")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                   help="seconds a request waits for its grammar to compile before it fails")
    g.add_argument("--grammar-any-whitespace", action="store_true",
                   help="JSON schemas allow any whitespace between tokens (default: compact ', ' and ': ' only, "
                        "which keeps small models from looping on whitespace)")
    g = parser.add_argument_group("compiled decode steps")
    g.add_argument("--enable-torch-compile", action="store_true",
                   help="torch.compile the decode forward for batch sizes up to --torch-compile-max-bs (padded to "
                        "the next bucket); compiled at start-up")
    g.add_argument("--torch-compile-max-bs", type=int, default=d.torch_compile_max_bs,
                   help="largest decode batch run compiled")
    g.add_argument("--cuda-graph-max-bs", type=int, default=d.cuda_graph_max_bs,
                   help="cuda: largest decode batch replayed as a CUDA graph (default min(160, "
                        "--max-running-requests))")
    g.add_argument("--disable-cuda-graph", action="store_true",
                   help="cuda: no CUDA graphs; decode steps launch their kernels one by one")
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tp-size", type=int, default=d.tp_size,
                   help="tensor parallel ranks per DP replica: the model's heads, MLP and KV heads split over them")
    g.add_argument("--dp-size", type=int, default=d.dp_size, help="data parallel scheduler ranks, each with its own KV pool")
    g.add_argument("--dist-init-addr", default=d.dist_init_addr,
                   help="HOST:PORT of the TP rendezvous (node 0's; default a free local port); needed with --nnodes")
    g.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts one TP group spans (with --dp-size 1)")
    g.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's index in [0, --nnodes); node 0 serves the gRPC Worker and Bootstrap services")


def server_args_from_cli(ns: argparse.Namespace) -> ServerArgs:
    names = {f.name for f in dataclasses.fields(ServerArgs)}
    values = {k: v for k, v in vars(ns).items() if k in names}
    if "kv_transfer_option" in values:
        values["kv_transfer_option"] = tuple(values["kv_transfer_option"])
    return ServerArgs(**values)
