"""``pdcluster up``'s command line: its own flags, the cluster's shape (``cluster_flags.ClusterShape``, shared with
``pdcluster ray up``), and which node and router flags it forwards (declared once, in the nodes' ``ServerArgs`` and
the router's ``RouterConfig`` and ``ClientSecurity``) and which it sets itself."""

from __future__ import annotations

import argparse

from common.app.cluster_flags import SHAPE, ClusterShape
from common.app.supervisor import RestartPolicy
from common.config import ServerArgs
from common.flags import add_flags, arg_group, flag_fields
from common.refs import load_ref

# Node flags ``up`` sets per node, or cluster-wide through flags of its own (ports, modes, placement, TLS): every
# other flag of ``ServerArgs`` is a pass-through, declared once there and forwarded to every node as given.
UP_SETS_PER_NODE = ("host", "advertise_host", "port", "metrics_port", "sglang_http_port", "mux_port",
                    "disaggregation_mode", "disaggregation_bootstrap_port", "base_gpu_id", "dist_init_addr", "nnodes",
                    "node_rank", "tls_cert", "tls_key", "tls_ca", "cpu_omp_threads_bind",
                    "api_key_file")  # up's own --api-key-file reaches every process as PDCLUSTER_API_KEY
# Router flags ``up`` sets (its own --grpc-port, the resolved model, the bind address): every other flag of the
# router's config is a pass-through to the router, declared once there; a flag both configs declare
# (``router_shares``: --drain-timeout, --event-loop, --request-timeout) reaches the router and every node.
UP_SETS_FOR_ROUTER = ("host", "grpc_port", "model_path")
# The router's --tool-call-parser for the embedded model (when no other is given): its chat template
# (common/model_gen/tokenizer.py) asks for Qwen 2.5's <tool_call> blocks.
EMBEDDED_TOOL_CALL_PARSER = "qwen25"
ROUTER_CONFIG = "router.config:RouterConfig"  # references (common.refs): common imports no role package
ROUTER_SECURITY = "router.config:ClientSecurity"  # the router's keys and TLS files: up hands them to it (and nodes)


def router_config() -> type:
    return load_ref(ROUTER_CONFIG)  # type: ignore[no-any-return]


def router_security() -> type:
    return load_ref(ROUTER_SECURITY)  # type: ignore[no-any-return]


def router_shares() -> dict[str, str]:
    """The router's fields whose flag a node has too (same option): router field -> node field."""
    node = {ff.option: ff.dest for ff in flag_fields(ServerArgs)}
    return {ff.dest: node[ff.option] for ff in flag_fields(router_config())
            if ff.option in node and ff.dest not in UP_SETS_FOR_ROUTER}
# Pass-through flags ``up`` also reads: it forwards what it derives from them (resolved model path, the backend's
# per-device default, each role's tp, each GPU node's memory share, the host's cores split over the CPU ranks by default).
UP_DERIVES = ("model_path", "kv_transfer_backend", "tp_size", "mem_fraction_static", "torch_num_threads")


def add_up_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--grpc-port", type=int, default=50051, help="router gRPC port")
    p.add_argument("--http-port", type=int, default=8000, help="router OpenAI HTTP port")
    add_flags(p, ClusterShape)
    arg_group(p, SHAPE).add_argument("--colocated", type=int, default=0,
                                     help="number of colocated (mode null) nodes")
    p.add_argument("--num-gpus", type=int, default=None, help="cuda: GPUs to place nodes on (default: all visible)")
    p.add_argument("--prefill-torch-num-threads", type=_positive, default=None,
                   help="CPU: torch threads of each prefill rank (default --torch-num-threads, else the cores split)")
    p.add_argument("--decode-torch-num-threads", type=_positive, default=None,
                   help="CPU: torch threads of each decode rank (default --torch-num-threads, else the cores split)")
    p.add_argument("--cpu-bind", choices=("none", "auto"), default="none",
                   help="CPU P/D: auto gives each decode rank cores of its own (its torch threads', plus one for its "
                        "scheduler thread when it overlaps; the nodes' --cpu-omp-threads-bind) and every other "
                        "process of the cluster the rest, where that leaves at least one; none (default) leaves "
                        "placement to the OS")
    p.add_argument("--log-dir", default=None, help="where each process writes its log")
    p.add_argument("--metrics", action="store_true", help="give every node a Prometheus /metrics port")
    p.add_argument("--sglang-http", action="store_true",
                   help="give every node an SGLang HTTP worker port (--sglang-http-port; the API key, if any, guards "
                        "it)")
    p.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                   help="restarts in a row of one dead child (node or router; backoff 1 s doubling to 30 s, reset "
                        "after 60 s up) before up gives up on it and serves without it; 0: never restart. Giving "
                        "up on the router stops the cluster")
    p.add_argument("--demo", action="store_true", help="once ready, send example requests through the OpenAI API")
    p.add_argument("--exit-after-demo", action="store_true", help="stop the cluster after the demo requests")
    add_flags(p, ServerArgs, exclude=UP_SETS_PER_NODE, only_given=True, group_prefix="every node: ")
    add_flags(p, router_config(), exclude=(*UP_SETS_FOR_ROUTER, *router_shares()), only_given=True,
              group_prefix="router: ")
    add_flags(p, router_security(), group_prefix="router: ")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def node_tp_size(ns: argparse.Namespace, role: str) -> int:
    """A node's tp: its role's ``--<role>-tp-size``, else ``--tp-size``, else 1 (colocated nodes: ``--tp-size``)."""
    own = getattr(ns, f"{role}_tp_size", None)
    return own if own is not None else getattr(ns, "tp_size", ServerArgs.tp_size)
