"""``pdcluster ray up|down|status``: deploy the cluster spec onto a Ray cluster as actors.

    pdcluster ray up --address local --prefill 1 --decode 1 [--dp-size 2] [--tp-size 2 | --prefill-tp-size 2]
                     [--model-path DIR] [--profile cpu-dev]
    pdcluster ray status --address ADDR
    pdcluster ray supervise --address ADDR     (restarts node actors that fail /liveness; until Ctrl-C)
    pdcluster ray down --address ADDR
"""

from __future__ import annotations

import argparse
import contextlib
import json

from common.app.cluster_flags import SHAPE, ClusterShape
from common.config import ServerArgs
from common.flags import add_flags, arg_group, config_values
from deploy.spec import SPEC_PATH, load_spec

# Node flags ``ray up`` takes (declared in ``ServerArgs``): given, each overrides the spec's value for every node.
RAY_NODE_FLAGS = ("model_path", "dp_size", "tp_size", "kv_transfer_backend", "max_total_tokens")
OVER_SPEC = "over the spec: "


def add_ray_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="ray_command", required=True)
    for name, help_text in (("up", "deploy router, prefill and decode actors"), ("down", "drain and remove them"),
                            ("status", "health of every actor"),
                            ("supervise", "probe every node's liveness periodically and restart hung ones")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--address", default="auto",
                       help="Ray cluster address (ray://host:10001, host:6379, auto), or 'local' to start one here")
        s.add_argument("--namespace", default="pdcluster", help="Ray namespace of the deployment's named actors")
        if name == "supervise" or name == "up":
            s.add_argument("--supervise-period", type=float, default=10.0,
                           help="seconds between liveness rounds (up: with --address local)")
        if name != "up":
            continue
        s.add_argument("--spec", default=str(SPEC_PATH), help="cluster spec YAML")
        s.add_argument("--profile", default=None, help="a profile of the spec (e.g. cpu-dev, gpu-single-node)")
        # The cluster's shape and the node flags, declared once (ClusterShape, ServerArgs); a flag left off keeps
        # the spec's value. A --model-path must be present on every Ray node.
        add_flags(s, ClusterShape, only_given=True, group_prefix=OVER_SPEC, show_defaults=False)
        arg_group(s, OVER_SPEC + SHAPE).add_argument("--routers", type=int, default=None, help="router replicas")
        add_flags(s, ServerArgs, only=RAY_NODE_FLAGS, only_given=True, group_prefix=OVER_SPEC + "every node: ",
                  show_defaults=False)
        s.add_argument("--pin", choices=("resources", "labels", "none"), default="resources",
                       help="role pinning: custom resource 'prefill'/'decode', node label pdcluster.io/role, none")
        s.add_argument("--node-cpus", type=float, default=1.0, help="Ray CPUs reserved per node replica")
        s.add_argument("--gpus-per-rank", type=int, default=None,
                       help="GPUs per TP rank (default: the spec's resources.gpus_per_rank; a cuda spec needs >= 1)")
        s.add_argument("--start-timeout", type=float, default=300.0)


def spec_from_args(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The spec, with what the command line gave over it (each flag checked as ``up`` and the nodes check it)."""
    spec = load_spec(ns.spec, ns.profile)
    shape = config_values(ClusterShape, ns)
    node = config_values(ServerArgs, ns)
    ClusterShape(**shape)
    ServerArgs(**node)
    counts = {k: v for k, v in (("prefill", shape.get("prefill")), ("decode", shape.get("decode")),
                                ("router", ns.routers)) if v is not None}
    tp_size, model_path = node.pop("tp_size", None), node.pop("model_path", None)
    tp = {role: size for role in ("prefill", "decode")
          if (size := _first_set(shape.get(f"{role}_tp_size"), tp_size)) is not None}
    return spec.with_counts(**counts).with_tp(**tp).with_flags(model_path=model_path, **node)


def _first_set(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def run_ray(ns: argparse.Namespace) -> int:
    import ray

    from deploy.ray import deployer

    spec = spec_from_args(ns) if ns.ray_command == "up" else None  # a bad flag stops it before Ray starts
    if ns.address == "local":
        ray.init(namespace=ns.namespace, include_dashboard=False)
    else:
        ray.init(address=ns.address, namespace=ns.namespace)
    try:
        if ns.ray_command == "up":
            opts = deployer.RayOptions(namespace=ns.namespace, pin=ns.pin, node_cpus=ns.node_cpus,
                                       gpus_per_rank=ns.gpus_per_rank, start_timeout_s=ns.start_timeout)
            assert spec is not None
            out: object = deployer.up(spec, opts)
        elif ns.ray_command == "down":
            out = {"removed": deployer.down(ns.namespace)}
        elif ns.ray_command == "supervise":
            _supervise_until_interrupted(ns.namespace, ns.supervise_period)
            return 0
        else:
            out = deployer.status(ns.namespace)
        print(json.dumps(out, indent=2, default=str))
        if ns.address == "local" and ns.ray_command == "up":
            _serve_until_interrupted(ns.namespace, ns.supervise_period)
    finally:
        ray.shutdown()
    return 0


def _supervise_until_interrupted(namespace: str, period_s: float) -> None:
    import signal
    import threading

    from deploy.ray import deployer

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    supervisor = threading.Thread(target=deployer.supervise_forever, args=(namespace, stop, period_s), daemon=True)
    supervisor.start()
    print("serving and supervising node liveness; Ctrl-C to stop", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        stop.wait()
    stop.set()
    supervisor.join(60)


def _serve_until_interrupted(namespace: str, period_s: float) -> None:
    """With ``--address local`` the Ray cluster lives in this process: keep it up (restarting hung nodes) until
    Ctrl-C, then tear down."""
    from deploy.ray import deployer

    _supervise_until_interrupted(namespace, period_s)
    deployer.down(namespace)
