"""``pdcluster up``: a whole local cluster on 127.0.0.1 — a router, N prefill and M decode nodes — as child
processes of this one. Prints the endpoints and a ready line; Ctrl-C (or SIGTERM) stops every child it started.
Once ready it supervises them (common/app/supervisor.py): a child that dies - node or router - is reported with its
exit code and log tail and restarted on the same ports with backoff, up to ``--max-restarts`` in a row.

Nodes are started with ``pdcluster serve`` and the router with ``pdcluster router``: the same commands a user
runs by hand, so this is only a launcher. Each child's output goes to ``--log-dir`` (default: a temp dir). Every node
flag and every router flag ``up`` does not set itself is forwarded as given (``common/app/up_args.py``); on the
embedded model the router reads tool calls in its chat template's format unless ``--tool-call-parser`` says
otherwise, so ``make up`` answers ``tools`` with the default ``tool_choice`` instead of a 400.

Tensor parallelism: ``--tp-size`` for every node, ``--prefill-tp-size`` / ``--decode-tp-size`` per role over it;
each node runs ``--dp-size`` x its tp scheduler rank processes. A tp the model cannot split is the node's own
start-up error, which ``up`` reports with the node's log.

``--device cuda``: each node takes its dp x tp consecutive GPUs (``--base-gpu-id``) of its own when the host has
enough; otherwise nodes share GPUs round-robin and each gets ``--mem-fraction-static`` divided by the number of
nodes on its busiest GPU. KV moves over ``shm`` (CUDA IPC) by default there: every node of ``up`` is on one host.
On CPU the host's cores are split evenly over every scheduler rank ``up`` starts (each node's dp x tp; at least one
torch thread each) unless ``--torch-num-threads`` (every node) or ``--prefill-torch-num-threads`` /
``--decode-torch-num-threads`` (per role, over it) is given: a lone colocated node uses every core, and the nodes'
ranks together do not oversubscribe them. Given threads that do (ranks with OpenMP teams among them) get a warning,
and the nodes passive OpenMP waits unless ``OMP_WAIT_POLICY`` is set (``omp_wait_env``). When the ranks' torch threads
leave no core for each rank's scheduler thread, the nodes run their forwards inline (``inline_forwards``) unless an
overlap switch is given. ``--cpu-bind auto`` keeps each decode rank on cores of its own and everything else off them
(``common/cpu_cores.py split_cores``; opt-in: see ``split_cores``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from common import env
from common.app.cluster_flags import ClusterShape
from common.app.demo import run_demo
from common.app.placement import (
    NodePlacement,
    omp_wait_env,
    oversubscribed,
    place_nodes,
    placement_lines,
    visible_gpus,
)
from common.app.readiness import READY_TIMEOUT_S, wait_http_health, wait_nodes_serving
from common.app.supervisor import Child, RestartPolicy, Supervisor
from common.app.up_args import (
    EMBEDDED_TOOL_CALL_PARSER,
    UP_DERIVES,
    UP_SETS_FOR_ROUTER,
    node_tp_size,
    router_config,
    router_shares,
)
from common.config import ServerArgs
from common.cpu_cores import CoreSplit, format_core_list, split_cores
from common.flags import config_values, flag_argv
from common.hicache_flags import DECODE_REFUSES
from common.ports import pick_free_port
from common.speculative import DRAFT_MODEL_ALGORITHMS, SPECULATIVE_FLAGS
from common.text.tokenizer import resolve_model_path
from common.tls import TlsFiles
from common.wire.security import CLUSTER_TOKEN_ENV, generate_cluster_token

SUPERVISE_INTERVAL_S = 0.5
DEFAULT_BACKEND = {"cpu": "tcp", "cuda": "shm"}
CUDA_MEM_FRACTION = 0.85


def cluster_env() -> dict[str, str]:
    """The cluster secret handed to every child: the caller's if set, else a fresh one for this cluster."""
    return {CLUSTER_TOKEN_ENV: env.cluster_token() or generate_cluster_token()}


class LocalCluster:
    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        ClusterShape(**config_values(ClusterShape, ns))  # its checks (node counts, tp sizes)
        self.node_given = config_values(ServerArgs, ns)  # the node flags given to up, forwarded to every node
        ServerArgs(**self.node_given)  # the nodes' own checks, before anything starts
        router_cls = router_config()
        self.router_given = {k: v for k, v in config_values(router_cls, ns).items() if k not in UP_SETS_FOR_ROUTER}
        self.router_given |= {r: self.node_given[n] for r, n in router_shares().items() if n in self.node_given}
        if self.node_given.get("model_path") is None:  # the embedded model: its chat template's tool-call format
            self.router_given.setdefault("tool_call_parser", EMBEDDED_TOOL_CALL_PARSER)
        router_cls(**self.router_given, tls=TlsFiles(ns.tls_cert, ns.tls_key, ns.tls_ca))  # its checks, before any start
        self.device = self.node_given.get("device", ServerArgs.device)
        self.model_path = str(resolve_model_path(self.node_given.get("model_path")))
        self.log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="pdcluster-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.sglang_ports: dict[str, int] = {}  # --sglang-http: each node's SGLang HTTP port
        self.backend = self.node_given.get("kv_transfer_backend") or DEFAULT_BACKEND[self.device]
        self.node_names = [f"{role}-{i}" for role, count in
                           (("prefill", ns.prefill), ("decode", ns.decode), ("null", ns.colocated))
                           for i in range(count)]
        self.tp_size = {name: node_tp_size(ns, name.rsplit("-", 1)[0]) for name in self.node_names}
        self.placement: dict[str, NodePlacement] = {}
        if self.device == "cuda":
            gpus = ns.num_gpus if ns.num_gpus is not None else visible_gpus()
            if gpus < 1:
                raise RuntimeError("--device cuda but no GPU is visible; use --device cpu")
            frac = self.node_given.get("mem_fraction_static") or CUDA_MEM_FRACTION
            self.placement = {p.name: p for p in place_nodes(self.node_names, self.node_given.get("dp_size", 1),
                                                              gpus, frac, self.tp_size)}
            if self.backend == "nccl" and any(p.shares_with for p in self.placement.values()):
                raise RuntimeError("--kv-transfer-backend nccl cannot pair two nodes on one GPU (NCCL refuses "
                                   "duplicate GPUs); use shm or tcp, or give each node its own GPU")
        self.env = cluster_env()
        self.cores = len(os.sched_getaffinity(0))
        self.core_split: CoreSplit | None = None
        if ns.cpu_bind == "auto" and self.device != "cpu":
            raise ValueError(f"--cpu-bind auto places CPU scheduler ranks on cores; with --device {self.device} each "
                             "node's ranks have GPUs of their own: drop it")
        if ns.cpu_bind == "auto":
            dp = self.node_given.get("dp_size", 1)
            own = 0 if self.inline_forwards() else 1  # an overlapping rank's scheduler thread gets a core too
            decode = {n: [self.torch_threads(n) + own] * (dp * self.tp_size[n]) for n in self.node_names
                      if n.startswith("decode-")}
            self.core_split = split_cores(sorted(os.sched_getaffinity(0)), decode, len(self.node_names) - len(decode))
        if self.device == "cpu":
            self.env |= omp_wait_env(self.rank_threads(), self.cores, dict(os.environ))
        self.api_key_file = str(Path(ns.api_key_file).resolve()) if ns.api_key_file else None
        self.api_key = ns.api_key or (env.read_secret_file(ns.api_key_file, "--api-key-file") if ns.api_key_file
                                      else env.api_key())
        if self.api_key:  # the router takes every key of a key file through --api-key-file; the nodes the first
            self.env["PDCLUSTER_API_KEY"] = self.api_key
        self.tls = TlsFiles(ns.tls_cert, ns.tls_key, ns.tls_ca).check()
        self.node_tls = self.tls.grpc_channel_credentials() if self.tls.mutual else None

    @property
    def http_base(self) -> str:
        return f"{'https' if self.tls.enabled else 'http'}://127.0.0.1:{self.ns.http_port}"

    def tls_flags(self, role: str) -> list[str]:
        """The router serves its listeners with the pair; with a CA, nodes require it of the router (mTLS)."""
        if role != "router" and not self.tls.mutual:
            return []
        files = (("--tls-cert", self.tls.cert), ("--tls-key", self.tls.key), ("--tls-ca", self.tls.ca))
        return [x for flag, path in files if path is not None for x in (flag, str(Path(path).resolve()))]

    def _spawn(self, name: str, args: list[str], grpc_port: int, metrics_port: int | None = None) -> Child:
        log = self.log_dir / f"{name}.log"
        log.write_bytes(b"")
        child = Child(name, [sys.executable, "-m", "common.app.cli", *args],
                      {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}, log, grpc_port, metrics_port,
                      affinity=self.core_split.shared if self.core_split is not None else None)
        child.launch()
        self.children.append(child)
        return child

    def rank_threads(self) -> list[int]:
        """Torch threads of every scheduler rank of every node (dp x tp ranks per node)."""
        dp = self.node_given.get("dp_size", 1)
        return [self.torch_threads(name) for name in self.node_names for _ in range(dp * self.tp_size[name])]

    def inline_forwards(self) -> bool:
        """CPU, neither overlap switch given: whether the nodes run each forward inline (``--disable-overlap-schedule``)
        because the ranks' scheduler threads would have no core of their own (every rank's torch threads plus one
        scheduler thread per rank outnumber the cores). A node alone decides that for itself; only ``up`` sees the
        other nodes' ranks on the same cores. Inline, such a cluster serves more tokens for less CPU
        (benchmarks/pages/serving_path.md, "Figures behind up's CPU defaults")."""
        if self.device != "cpu" or self.node_given.get("enable_overlap_schedule") \
                or self.node_given.get("disable_overlap_schedule"):
            return False
        threads = self.rank_threads()
        return sum(threads) + len(threads) > self.cores

    def oversubscription_line(self) -> str | None:
        """What ``up`` says when the CPU ranks' threads are ``oversubscribed`` (None otherwise)."""
        threads = self.rank_threads()
        if self.device != "cpu" or not oversubscribed(threads, self.cores):
            return None
        waits = "passive OpenMP waits (OMP_WAIT_POLICY=PASSIVE)" if self.env.get("OMP_WAIT_POLICY") == "PASSIVE" \
            else f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
        return (f"warning: {len(threads)} scheduler rank(s) run {sum(threads)} torch threads on {self.cores} core(s); "
                f"the nodes get {waits}; without --*torch-num-threads up splits the cores over the ranks")

    def torch_threads(self, name: str) -> int:
        """Torch threads of each scheduler rank of node ``name``: its role's ``--<role>-torch-num-threads``, else
        ``--torch-num-threads``, else the host's cores over every rank of every node (dp x tp each), at least 1."""
        given = getattr(self.ns, f"{name.rsplit('-', 1)[0]}_torch_num_threads", None) \
            or self.node_given.get("torch_num_threads")
        if given:
            return given
        ranks = self.node_given.get("dp_size", 1) * sum(self.tp_size.values())
        return max(1, self.cores // max(1, ranks))

    def _node_flags(self, role: str) -> list[str]:
        given = self.node_given
        # A decode node's host tier takes no write policy or storage flags (common/hicache_flags.py). Speculative
        # decoding speculates decode steps: a prefill node is not given its flags (it refuses them), except those of a
        # draft (STANDALONE's model, EAGLE's head), which runs over the prompt there (its KV goes to the decode node).
        skip = set(UP_DERIVES)
        if role == "decode":
            skip.update(DECODE_REFUSES)
        if role == "prefill" and given.get("speculative_algorithm") not in DRAFT_MODEL_ALGORITHMS:
            skip.update(("speculative_algorithm", *SPECULATIVE_FLAGS))
        forwarded = {k: v for k, v in given.items() if k not in skip}
        if self.device == "cpu" and given.get("mem_fraction_static") is not None:
            forwarded["mem_fraction_static"] = given["mem_fraction_static"]  # GPU nodes get their placement's share
        flags = ["--model-path", self.model_path, "--host", "127.0.0.1", "--kv-transfer-backend", self.backend]
        return flags + flag_argv(ServerArgs, forwarded) + self.tls_flags("node")

    def node_args(self, name: str, port: int, bootstrap: int, metrics: int | None = None) -> list[str]:
        """``pdcluster serve`` arguments of node ``name`` (``<role>-<i>``; role ``null``: colocated)."""
        role = name.rsplit("-", 1)[0]
        args = ["serve", *self._node_flags(role), "--tp-size", str(self.tp_size[name]),
                "--torch-num-threads", str(self.torch_threads(name)), "--port", str(port),
                "--disaggregation-mode", role, "--disaggregation-bootstrap-port", str(bootstrap)]
        place = self.placement.get(name)
        if place is not None:
            args += ["--base-gpu-id", str(place.base_gpu_id), "--mem-fraction-static", str(place.mem_fraction_static)]
        if metrics is not None:
            args += ["--metrics-port", str(metrics)]
        if self.inline_forwards():
            args.append("--disable-overlap-schedule")
        if self.core_split is not None and (bind := self.core_split.bind_flag(name)) is not None:
            args += ["--cpu-omp-threads-bind", bind]
        return args

    def cpu_bind_note(self) -> str | None:
        """What ``up`` says when ``--cpu-bind auto`` was asked for and the layout leaves it nothing to do."""
        if self.ns.cpu_bind != "auto" or self.core_split is not None:
            return None
        return (f"note: --cpu-bind auto leaves placement to the OS here: it needs a decode node beside another node, "
                f"and decode ranks whose cores leave at least one of the {self.cores} to the rest")

    def core_split_lines(self) -> list[str]:
        """What ``up`` tells the user about CPU placement (nothing unless it splits the cores)."""
        split = self.core_split
        if split is None:
            return []
        lines = ["CPU placement (--cpu-bind auto):"]
        for node, sets in split.decode.items():
            ranks = "; ".join(f"rank {i} on core(s) {format_core_list(cores)}" for i, cores in enumerate(sets))
            lines.append(f"  {node:<10} {ranks} (its own)")
        lines.append(f"  the router, every node front and the other ranks share core(s) {format_core_list(split.shared)}")
        return lines

    def router_args(self) -> list[str]:
        """``pdcluster router`` arguments, but its workers."""
        args = ["router", "--model-path", self.model_path, "--host", "127.0.0.1", "--grpc-port",
                str(self.ns.grpc_port), "--http-port", str(self.ns.http_port), *self.tls_flags("router"),
                *flag_argv(router_config(), self.router_given)]
        return args + (["--api-key-file", self.api_key_file] if self.api_key_file is not None else [])

    def start(self) -> None:
        router = self.router_args()
        nodes: list[Child] = []
        for name in self.node_names:
            role = name.rsplit("-", 1)[0]
            port, bootstrap = pick_free_port(), pick_free_port()
            metrics = pick_free_port() if self.ns.metrics else None
            args = self.node_args(name, port, bootstrap, metrics)
            if self.ns.sglang_http:
                self.sglang_ports[name] = pick_free_port()
                args += ["--sglang-http-port", str(self.sglang_ports[name])]
            nodes.append(self._spawn(name, args, port, metrics))
            flag = {"prefill": "--prefill", "decode": "--decode", "null": "--worker"}[role]
            router += [flag, f"127.0.0.1:{port}" + (f":{bootstrap}" if role == "prefill" else "")]
        deadline = time.monotonic() + READY_TIMEOUT_S
        wait_nodes_serving(nodes, deadline, self.node_tls)
        child = self._spawn("router", router, self.ns.grpc_port)
        wait_http_health(child, self.http_base, deadline, self.tls.enabled)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every child (router first, so no new work reaches the nodes), then SIGKILL stragglers and
        whatever their process groups left behind. Called only where no restart can start (the supervisor's
        caller has left its loop)."""
        for child in reversed(self.children):
            child.terminate()
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            child.wait(max(0.1, deadline - time.monotonic()))
            child.kill_group()
            child.wait(5)


def run_up(ns: argparse.Namespace) -> int:
    try:
        cluster = LocalCluster(ns)
        policy = RestartPolicy(max_restarts=ns.max_restarts)
    except (ValueError, RuntimeError) as e:  # placement: more GPUs than visible, nccl on a shared GPU
        print(f"pdcluster up: {e}", file=sys.stderr, flush=True)
        return 2
    # NOTE: a signal interrupts start-up and the demo at once (KeyboardInterrupt); while supervising it only sets
    # the flag, so no stop lands between a restart's Popen and its bookkeeping (no orphaned child).
    stop_requested = False
    interruptible = True

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop_requested
        stop_requested = True
        if interruptible:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        tp = ", ".join(f"{role} tp {node_tp_size(ns, role)}" for role, count in
                       (("prefill", ns.prefill), ("decode", ns.decode), ("null", ns.colocated)) if count)
        print(f"starting: {ns.prefill} prefill + {ns.decode} decode node(s) on {cluster.device} ({tp}), model "
              f"{cluster.model_path}, KV over {cluster.backend}; logs in {cluster.log_dir}", flush=True)
        for line in placement_lines(cluster.placement) + cluster.core_split_lines():
            print(line, flush=True)
        for line in (cluster.oversubscription_line(), cluster.cpu_bind_note()):
            if line is not None:
                print(line, file=sys.stderr, flush=True)
        if cluster.inline_forwards():
            threads = cluster.rank_threads()
            print(f"{len(threads)} scheduler rank(s) with {sum(threads)} torch thread(s) on {cluster.cores} core(s): "
                  "each runs its forwards inline (--disable-overlap-schedule; --enable-overlap-schedule overrides)",
                  flush=True)
        try:
            cluster.start()
        except (RuntimeError, TimeoutError) as e:  # a node or the router failed to start: its log says why
            print(f"pdcluster up failed: {e}", file=sys.stderr, flush=True)
            return 1
        for child in cluster.children:
            metrics = f"  metrics http://127.0.0.1:{child.metrics_port}/metrics" if child.metrics_port else ""
            sglang = cluster.sglang_ports.get(child.name)
            metrics += f"  sglang http://127.0.0.1:{sglang}" if sglang else ""
            print(f"  {child.name:<10} pid {child.pid:<7} grpc 127.0.0.1:{child.grpc_port}{metrics}", flush=True)
        security = ", ".join(x for x in ("TLS" if cluster.tls.enabled else "", "mTLS to nodes" if cluster.tls.mutual
                                         else "", "API key required" if cluster.api_key else "") if x)
        print(f"pdcluster ready: OpenAI {cluster.http_base}/v1  gRPC 127.0.0.1:{ns.grpc_port}  "
              f"{f'({security}) ' if security else ''}(Ctrl-C stops)", flush=True)
        if ns.demo:
            run_demo(cluster.http_base, Path(cluster.model_path).name, cluster.api_key, cluster.tls.ca)
        if ns.exit_after_demo:
            return 0
        interruptible = False
        supervisor = Supervisor(cluster.children, policy)
        while not stop_requested:
            supervisor.poll()
            if supervisor.given_up("router"):
                print("the router is down for good; stopping the cluster", file=sys.stderr, flush=True)
                return 1
            time.sleep(SUPERVISE_INTERVAL_S)
        print("stopping...", flush=True)
        return 0
    except KeyboardInterrupt:
        print("stopping...", flush=True)
        return 0
    finally:
        interruptible = False
        cluster.stop()
        print("pdcluster stopped", flush=True)
