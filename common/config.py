"""``ServerArgs``: the one frozen config of a serving process, parsed once from SGLang-style CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

from common import env
from common.cpu_cores import parse_core_sets
from common.errors import ConfigError
from common.event_loop import EVENT_LOOPS
from common.flags import above, add_flags, at_least, check_flags, config_values, flag, in_range, tcp_port
from common.hicache_flags import (
    IO_BACKENDS,
    MEM_LAYOUTS,
    PREFETCH_POLICIES,
    STORAGE_BACKENDS,
    WRITE_POLICIES,
    StorageOptions,
    check_hicache_flags,
    parse_storage_options,
)
from common.kv_backends import KV_TRANSFER_BACKENDS, parse_options
from common.parallel_flags import check_parallel_flags
from common.speculative import SPECULATIVE_ALGORITHMS, check_speculative_flags
from common.tls import TlsFiles

DisaggregationMode = Literal["null", "prefill", "decode"]
DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")  # SGLang's names (common.engine.schedule_policy)
DEVICES = ("cpu", "cuda")
DEFAULT_MEM_FRACTION = {"cpu": 0.1, "cuda": 0.85}
# A prefill node's batch delays only the prompts queued behind it: on CPU, where a forward's cost grows with its
# tokens from a few hundred on, small batches give the first prompts of a burst their first token sooner at the same
# prefill throughput and CPU per token (benchmarks/pages/serving_path.md, "Figures behind up's CPU defaults"). A
# colocated node's chunk also paces the decode steps that wait for it, and a GPU's forward is flat in tokens far
# beyond 2048: both keep 2048.
DEFAULT_CHUNK = 2048
CPU_PREFILL_NODE_CHUNK = 256
UNSPECIFIED_HOSTS = ("0.0.0.0", "::", "[::]", "")
TP_MIN_TIMEOUT_S = 60.0  # TP rendezvous and collectives: ranks loading their shards may skew by more than a watchdog


MODEL, SERVER, DISAGG, MEMORY, COMPILE, PARALLEL = (
    "model", "server", "disaggregation", "memory and scheduling", "compiled decode steps", "parallelism")
GRAMMAR = "constrained decoding"
HICACHE = "hierarchical cache"
SPECULATIVE = "speculative decoding"
GRAMMAR_BACKENDS = ("xgrammar", "none")
MUX_PORT_MEANING = ", 0 (any free port) or -1 (off)"


@dataclass(frozen=True)
class ServerArgs:
    """The node's flags, each declared once here (``common.flags``): the parser, ``up``'s pass-through and the
    flag tables of ``docs/flags.md`` are derived from these fields."""

    # Model.
    model_path: str | None = flag(None, "local Hugging Face model folder (default: the embedded model, generated "
                                  "once into the cache dir)", group=MODEL)
    dtype: str = flag("float32", "weights and KV cache dtype", group=MODEL, choices=DTYPES)
    load_format: str = flag("auto", "auto: the weights of the model folder's safetensors; dummy: seeded random "
                            "weights made on each rank's device from config.json alone (a folder of config and "
                            "tokenizer, e.g. make-model --size 8b: benchmarks at real shapes), the same on every "
                            "node, rank and run; also a STANDALONE draft model's", group=MODEL, choices=LOAD_FORMATS)
    device: str = flag("cpu", "where the model and KV cache live (pick the GPU with --base-gpu-id, not cuda:N)",
                       group=MODEL, choices=DEVICES)
    base_gpu_id: int = flag(0, "cuda: first GPU of this node; rank (dp d, tp t) uses GPU base-gpu-id + d * tp-size "
                            "+ t", group=MODEL, check=at_least(0))
    seed: int = flag(0, "seed of unseeded sampling", group=MODEL)
    attention_backend: str | None = flag(None, "attention kernels: triton (paged, default on CUDA) or torch "
                                         "(default on CPU)", group=MODEL, choices=ATTENTION_BACKENDS)
    # Server.
    host: str = flag("127.0.0.1", "bind address of every listener (0.0.0.0: all interfaces)", group=SERVER)
    advertise_host: str | None = flag(None, "address peers and the router are told (bootstrap, KV endpoints); "
                                      "default --host", group=SERVER)
    port: int = flag(30000, "gRPC pdcluster.v1.Worker port", group=SERVER, check=tcp_port())
    metrics_port: int | None = flag(None, "Prometheus /metrics HTTP port (off by default)", group=SERVER)
    # SGLang's HTTP worker surface (common/node/sglang_http.py), so the node serves behind sglang-router.
    sglang_http_port: int | None = flag(
        None, "serve SGLang's HTTP worker API (/generate with bootstrap_host/port/room, /health, /get_server_info, "
        "...) on this port, so sglang-router can route to this node; off by default", group=SERVER,
        check=tcp_port())
    api_key_file: str | None = flag(
        None, "--sglang-http-port: file whose first line is its API key (SGLang's worker --api-key: every path but "
        "/health* needs 'Authorization: Bearer <key>'; sglang-router --api-key sends it); default "
        "PDCLUSTER_API_KEY[_FILE], else the port is open", group=SERVER)
    # The Mux socket (common/wire/mux_socket.py): Worker.Mux's stream on plain TCP (TLS with the gRPC port's).
    mux_port: int = flag(0, "port of the Mux socket: the router's request legs on plain TCP (TLS when the gRPC port "
                         "has it) instead of gRPC frames; 0: any free port (offered to the router over gRPC); -1: off",
                         group=SERVER, check=tcp_port(-1, meaning=MUX_PORT_MEANING))
    log_level: str = flag("info", "log level of the node's processes (debug, info, warning, error)", group=SERVER)
    log_requests: bool = flag(False, "log each request's arrival and outcome (rid, room)", group=SERVER)
    event_loop: str = flag("auto", "the front process's event loop. auto: uvloop when installed, else asyncio's "
                           "loop", group=SERVER, choices=EVENT_LOOPS)
    # The Worker gRPC listener (common/tls.py).
    tls_cert: str | None = flag(None, "PEM certificate chain: the Worker gRPC port serves TLS", group=SERVER)
    tls_key: str | None = flag(None, "PEM private key of --tls-cert", group=SERVER)
    tls_ca: str | None = flag(None, "PEM CA bundle: mutual TLS, only callers with a certificate it signed (the "
                              "router) are served", group=SERVER)
    # Disaggregation.
    disaggregation_mode: DisaggregationMode = flag("null", "null: a colocated server; prefill or decode: one side "
                                                   "of a P/D pair", group=DISAGG)
    disaggregation_bootstrap_port: int = flag(8998, "prefill nodes: port of the Bootstrap service decode nodes "
                                              "resolve ranks through", group=DISAGG, check=tcp_port())
    kv_transfer_backend: str = flag("tcp", "KV data plane: tcp (anywhere), nccl (gloo on CPU), ucx, nixl (RDMA "
                                    "cluster; UCX_TLS), mooncake, shm (same host), fake", group=DISAGG,
                                    choices=tuple(KV_TRANSFER_BACKENDS))
    kv_transfer_option: tuple[str, ...] = flag(
        (), "a setting of the chosen backend, repeatable (common/kv_backends.py): tcp streams=4 (connections per "
        "peer), stripe_bytes, stage, stage_bytes; mooncake mooncake_protocol=rdma, mooncake_device; ucx ucx_tls, "
        "ucx_progress_mode; nixl progress_delay_us; nccl pack_bytes; shm landing_signal=on|off", group=DISAGG,
        metavar="KEY=VALUE")
    num_reserved_decode_tokens: int = flag(128, "decode nodes: KV headroom kept per active request before admitting "
                                           "a transfer", group=DISAGG, check=at_least(0))
    bootstrap_timeout: float = flag(30.0, "seconds a request may wait for its peer (handshake, destination pages)",
                                    group=DISAGG, check=above(0))
    waiting_timeout: float = flag(60.0, "seconds a decode request may wait for its first KV chunk", group=DISAGG,
                                  check=above(0))
    transfer_timeout: float = flag(60.0, "seconds a transfer may make no progress", group=DISAGG, check=above(0))
    request_timeout: float = flag(600.0, "upper bound of one request when the client sets no deadline",
                                  group=DISAGG, check=above(0))
    drain_timeout: float = flag(30.0, "SIGTERM: seconds in-flight requests may finish before the node stops",
                                group=DISAGG, check=at_least(0))
    watchdog_timeout: float = flag(300.0, "seconds a scheduler rank may go without completing a step (or an idle "
                                   "poll) before the node's /liveness (on --metrics-port) fails", group=DISAGG,
                                   check=above(0))
    # Memory and scheduling.
    page_size: int = flag(16, "tokens per KV page (on CPU, page-sized KV reads make decode attention ~2x faster "
                          "than 1)", group=MEMORY, check=at_least(1))
    max_total_tokens: int | None = flag(None, "KV cache size in tokens per DP rank (default: from "
                                        "--mem-fraction-static)", group=MEMORY)
    mem_fraction_static: float | None = flag(
        None, "when --max-total-tokens is unset. cpu: fraction of the host's total RAM for the KV cache, capped by what is available (default "
        f"{DEFAULT_MEM_FRACTION['cpu']}); cuda: fraction of the GPU's total memory for this rank's weights + KV "
        f"cache, the KV cache taking what the weights leave (default {DEFAULT_MEM_FRACTION['cuda']}; nodes sharing "
        "a GPU split it)", group=MEMORY, check=in_range(0.0, 0.95))
    max_running_requests: int = flag(256, "requests in the running batch per DP rank", group=MEMORY,
                                     check=at_least(1))
    max_queued_requests: int = flag(1024, "requests a DP rank may hold beyond --max-running-requests (bootstrap, "
                                    "waiting, transfer queues); more get RESOURCE_EXHAUSTED with a retry hint",
                                    group=MEMORY, check=at_least(0))
    disable_radix_cache: bool = flag(False, "no prefix sharing between requests (on a decode node: the choices of "
                                       "an n > 1 request each receive and hold the whole prompt)", group=MEMORY)
    chunked_prefill_size: int | None = flag(
        None, "tokens per prefill chunk, a multiple of --page-size; -1 disables chunking (default "
        f"{CPU_PREFILL_NODE_CHUNK} on a CPU prefill node, else {DEFAULT_CHUNK})", group=MEMORY)
    max_prefill_tokens: int = flag(16384, "prompt tokens one prefill batch may compute", group=MEMORY,
                                   check=at_least(1))
    enable_mixed_chunk: bool = flag(False, "run the running decode requests inside prefill batches", group=MEMORY)
    disable_overlap_schedule: bool = flag(False, "run each forward inline: no preparation of the next batch "
                                          "(colocated, decode) or result processing (prefill) while the forward "
                                          "runs", group=MEMORY)
    enable_overlap_schedule: bool = flag(False, "overlap on CPU even when this node's torch threads take every core "
                                         "(by default only when they leave one free, for the scheduler thread); "
                                         "with --speculative-algorithm on a prefill node only", group=MEMORY)
    stream_interval: int = flag(1, "output tokens a streaming request accumulates before they are sent (the first "
                                "is sent at once); a non-streaming request's come with its end", group=MEMORY,
                                check=at_least(1))
    schedule_conservativeness: float = flag(1.0, "> 1 reserves more KV for future tokens (fewer retractions)",
                                            group=MEMORY, check=above(0))
    # Waiting-queue order and priority scheduling (common.engine.schedule_policy; docs/scheduling.md).
    schedule_policy: str = flag("fcfs", "order of the waiting queue: fcfs, lpm (longest cached prefix first; fcfs "
                                "beyond 128 waiting), dfs-weight (radix subtrees by waiting weight), lof (longest "
                                "output first), random", group=MEMORY, choices=SCHEDULE_POLICIES)
    enable_priority_scheduling: bool = flag(False, "requests may carry a priority; every queue orders by it first, "
                                            "and a waiting request preempts running ones it beats by more than "
                                            "--priority-scheduling-preemption-threshold", group=MEMORY)
    schedule_low_priority_values_first: bool = flag(False, "with --enable-priority-scheduling: a smaller priority "
                                                    "value is more urgent (default: a larger one)", group=MEMORY)
    priority_scheduling_preemption_threshold: int = flag(10, "a waiting request preempts a running one only when its "
                                                         "priority beats it by more than this", group=MEMORY,
                                                         check=at_least(0))
    decode_log_interval: int = flag(40, "log a Decode batch line every N forward passes", group=MEMORY,
                                    check=at_least(1))
    torch_num_threads: int | None = flag(None, "torch threads per scheduler rank (default: cores / dp-size)",
                                         group=MEMORY, check=at_least(1))
    cpu_omp_threads_bind: str | None = flag(None, "CPU: the cores of each scheduler rank of this node, one set per "
                                            "rank separated by '|' (e.g. 0-3|4-7 with --dp-size 2); a rank and its "
                                            "torch threads run only on its set, and its torch threads default to "
                                            "the set's size (SGLang's SGLANG_CPU_OMP_THREADS_BIND)", group=MEMORY)
    # Hierarchical cache (common/engine/mem/hicache/; SGLang's flags, checked in common/hicache_flags.py).
    enable_hierarchical_cache: bool = flag(False, "a host-memory tier under the radix cache (prefill and colocated "
                                           "nodes: evicted prefixes are kept on the host and loaded back; decode "
                                           "nodes: retracted requests' KV is kept there and restored)", group=HICACHE)
    hicache_ratio: float = flag(2.0, "host pool size as a multiple of the device KV pool (when --hicache-size is 0)",
                                group=HICACHE, check=above(0))
    hicache_size: int = flag(0, "host pool size in GB per rank (0: --hicache-ratio)", group=HICACHE,
                             check=at_least(0))
    hicache_write_policy: str = flag("write_through", "when device pages are copied to the host: write_through (at "
                                     "insert), write_through_selective (on a node's second hit), write_back (at "
                                     "eviction)", group=HICACHE, choices=WRITE_POLICIES)
    hicache_io_backend: str = flag("kernel", "host<->device page copies: kernel (on CUDA one Triton gather/scatter for "
                                   "every layer; the torch path on CPU) or direct (torch index ops per layer)", group=HICACHE,
                                   choices=IO_BACKENDS)
    hicache_mem_layout: str = flag("layer_first", "host pool layout: layer_first (like the device pool) or "
                                   "page_first (each page's layers contiguous)", group=HICACHE, choices=MEM_LAYOUTS)
    hicache_load_timeout: float = flag(
        30.0, "seconds a request waits in the queue for its prefix to come back from the host or storage tier (a "
        "load; a wait_complete or timeout prefetch); then it computes the prefix instead", group=HICACHE,
        check=above(0))
    hicache_storage_backend: str | None = flag(
        None, "a storage tier under the host pool, shared by nodes of one model: file (a directory) or mooncake (a "
        "Mooncake store)", group=HICACHE, choices=STORAGE_BACKENDS)
    hicache_storage_prefetch_policy: str = flag(
        "best_effort", "a request whose prefix is being prefetched from storage: best_effort (is scheduled as "
        "usual), wait_complete (waits for the prefetch), timeout (waits up to prefetch_timeout_base + "
        "prefetch_timeout_per_ki_token per 1024 tokens)", group=HICACHE, choices=PREFETCH_POLICIES)
    hicache_storage_backend_extra_config: str | None = flag(
        None, "JSON object: prefetch_threshold (tokens), prefetch_timeout_base, prefetch_timeout_per_ki_token; file: "
        "file_path (default <cache dir>/hicache); mooncake: master_server_address (required), local_hostname, "
        "protocol, device_name, global_segment_size, local_buffer_size", group=HICACHE)
    # Constrained decoding (common/engine/sampling/grammar.py): json_schema / regex / ebnf requests.
    grammar_backend: str = flag("xgrammar", "engine of json_schema / regex / ebnf requests; none refuses them",
                                group=GRAMMAR, choices=GRAMMAR_BACKENDS)
    grammar_compile_timeout: float = flag(30.0, "seconds a grammar may compile (then its compile is stopped and the "
                                          "request refused) and a request may wait for a compile worker",
                                          group=GRAMMAR, check=above(0))
    grammar_compile_workers: int = flag(2, "grammar compile processes per scheduler rank (started on demand; one "
                                        "compile each at a time)", group=GRAMMAR, check=at_least(1))
    grammar_any_whitespace: bool = flag(False, "JSON schemas allow any whitespace between tokens (default: compact "
                                        "', ' and ': ' only, which keeps small models from looping on whitespace)",
                                        group=GRAMMAR)
    # Speculative decoding (common.speculative, common.engine.spec; docs/speculative.md).
    speculative_algorithm: str | None = flag(
        None, "draft tokens each decode step and verify them in one target forward: NGRAM (from the request's own "
        "prompt and output, no model), STANDALONE (a smaller draft model), EAGLE / EAGLE3 (a draft head over the "
        "target's hidden states; tree drafts with --speculative-eagle-topk > 1)",
        group=SPECULATIVE, choices=SPECULATIVE_ALGORITHMS)
    speculative_draft_model_path: str | None = flag(None, "STANDALONE: local folder of the draft model (the "
                                                    "target's tokenizer); EAGLE / EAGLE3: local folder of the draft "
                                                    "head (the public EAGLE checkpoint layouts)", group=SPECULATIVE)
    speculative_num_steps: int | None = flag(None, "draft tokens per request per step, the tree's depth for EAGLE "
                                             "(default 8 for NGRAM, 3 for STANDALONE, EAGLE and EAGLE3)",
                                             group=SPECULATIVE, check=at_least(1))
    speculative_eagle_topk: int | None = flag(None, "EAGLE / EAGLE3: branches per draft node (default 1: linear "
                                              "drafts; > 1: a tree)", group=SPECULATIVE, check=at_least(1))
    speculative_num_draft_tokens: int | None = flag(None, "tokens verified per request per step: "
                                                    "--speculative-num-steps + 1 with linear drafts; with a tree its "
                                                    "best nodes (default steps * topk + 1)", group=SPECULATIVE,
                                                    check=at_least(2))
    speculative_ngram_min_match_window_size: int | None = flag(
        None, "NGRAM: shortest suffix of the request's tokens matched against its earlier tokens (default 2)",
        group=SPECULATIVE, check=at_least(1))
    speculative_ngram_max_match_window_size: int | None = flag(
        None, "NGRAM: longest suffix matched; the longest match wins (default 12)", group=SPECULATIVE,
        check=at_least(1))
    # Compiled / captured steps (common.engine.graph_base): batches are padded to the next captured batch size.
    enable_torch_compile: bool = flag(False, "torch.compile the decode forward (with speculation: the verify and "
                                      "draft steps too) for batch sizes up to --torch-compile-max-bs (padded to "
                                      "the next bucket); compiled at start-up", group=COMPILE)
    torch_compile_max_bs: int = flag(32, "largest decode/verify/draft batch run compiled", group=COMPILE, check=at_least(1))
    cuda_graph_max_bs: int | None = flag(None, "cuda: largest decode / verify / draft batch replayed as a CUDA graph "
                                         "(default min(160, --max-running-requests))", group=COMPILE,
                                         check=at_least(1))
    disable_cuda_graph: bool = flag(False, "cuda: no CUDA graphs; decode (and speculation's verify and draft) steps "
                                    "launch their kernels one by one", group=COMPILE)
    # Parallelism.
    tp_size: int = flag(1, "tensor parallel ranks per DP replica: the model's heads, MLP and KV heads split over "
                        "them", group=PARALLEL, check=at_least(1))
    dp_size: int = flag(1, "data parallel scheduler ranks, each with its own KV pool", group=PARALLEL,
                        check=at_least(1))
    # Multi-host TP groups (SGLang's names).
    dist_init_addr: str | None = flag(None, "HOST:PORT of the TP rendezvous (node 0's; default a free local port); "
                                      "needed with --nnodes", group=PARALLEL)
    nnodes: int = flag(1, "hosts one TP group spans (with --dp-size 1)", group=PARALLEL)
    node_rank: int = flag(0, "this host's index in [0, --nnodes); node 0 serves the gRPC Worker and Bootstrap "
                          "services", group=PARALLEL)

    def __post_init__(self) -> None:
        check_flags(self)  # each flag's choices and check (declared on its field)
        parse_options(self.kv_transfer_backend, self.kv_transfer_option)
        check_hicache_flags(self)
        if self.attention_backend == "triton" and self.device != "cuda" and not env.triton_interpret():
            raise ConfigError(
                f"--attention-backend triton needs a CUDA device (got --device {self.device}); use "
                "--attention-backend torch on CPU (Triton's interpreter, TRITON_INTERPRET=1, is for tests only)"
            )
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ConfigError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other; "
                              "pass at most one")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and (chunk < self.page_size or chunk % self.page_size):
            raise ConfigError(
                f"--chunked-prefill-size ({chunk}) must be -1 or a positive multiple of --page-size ({self.page_size})"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens must be >= --page-size, got {self.max_total_tokens}")
        check_parallel_flags(self)
        check_speculative_flags(self)
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
    def use_radix_cache(self) -> bool:
        """Prefix sharing through a radix cache that keeps finished requests' KV: on unless --disable-radix-cache,
        and never on a decode node (its KV arrives from its prefill node: ``shares_decode_prompts``)."""
        return not self.disable_radix_cache and self.disaggregation_mode != "decode"

    @property
    def shares_decode_prompts(self) -> bool:
        """A decode node's requests with the same prompt (the choices of an ``n > 1`` request) share its full pages
        (``common.engine.mem.held_prefix_cache``): on unless --disable-radix-cache."""
        return not self.disable_radix_cache and self.disaggregation_mode == "decode"

    @property
    def hicache_storage(self) -> StorageOptions | None:
        """``--hicache-storage-backend`` with its extra config (None: no storage tier)."""
        if self.hicache_storage_backend is None:
            return None
        return parse_storage_options(self.hicache_storage_backend, self.hicache_storage_prefetch_policy,
                                     self.hicache_storage_backend_extra_config)

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
    def rank_core_sets(self) -> list[tuple[int, ...]]:
        """``--cpu-omp-threads-bind`` parsed: rank ``dp * len(tp_ranks_here) + i`` runs on set number that (empty: no
        binding)."""
        return parse_core_sets(self.cpu_omp_threads_bind) if self.cpu_omp_threads_bind is not None else []

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
        """Tokens per prefill chunk (None: unchunked): the flag, else the role's and device's default, rounded up
        to a whole page."""
        if self.chunked_prefill_size is not None:
            return None if self.chunked_prefill_size == -1 else self.chunked_prefill_size
        chunk = CPU_PREFILL_NODE_CHUNK if self.device == "cpu" and self.disaggregation_mode == "prefill" else DEFAULT_CHUNK
        return -(-chunk // self.page_size) * self.page_size

    def replace(self, **changes: object) -> ServerArgs:
        return dataclasses.replace(self, **changes)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ServerArgs)


def server_args_from_cli(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs(**config_values(ServerArgs, ns))
