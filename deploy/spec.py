"""The cluster spec (``deploy/cluster_spec.yaml``): roles, counts, ports, flags, images, resources and grace periods
shared by the Ray deployer and the Kubernetes manifests. ``load_spec(profile=...)`` returns one frozen
``ClusterSpec``; command lines, pod resources and Ray GPU counts come from it."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from common.errors import ConfigError

SPEC_PATH = Path(__file__).with_name("cluster_spec.yaml")
NODE_ROLES = ("prefill", "decode")
ROLES = ("router", *NODE_ROLES)
FlagValue = str | int | float
PRESTOP_S = 5  # the node pods' preStop sleep (discovery drops a terminating pod first)
SHUTDOWN_MARGIN_S = 25  # after the drain: ranks stop, transfers close
ROUTER_SHUTDOWN_MARGIN_S = 10  # after the router's drain: abort RPCs of the requests it cut short, listeners close
# Flags the spec derives from a node role's topology (key: the role key that sets it), never set as flags.
TOPOLOGY_FLAGS = {"tp-size": "tp", "nnodes": "nnodes", "node-rank": "nnodes", "dist-init-addr": "nnodes"}
_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?$")
_UNITS = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9,
          "T": 10**12}


def quantity_bytes(text: str) -> int:
    """A Kubernetes memory quantity (``4Gi``, ``512Mi``, ``1000000``) in bytes."""
    m = _QUANTITY.match(str(text))
    if m is None:
        raise ConfigError(f"cluster spec: {text!r} is not a memory quantity (e.g. 4Gi, 512Mi)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass(frozen=True)
class Resources:
    """One replica's pod resources (requests == limits: Guaranteed QoS). ``shm`` is the /dev/shm size, memory-
    backed so it counts against ``memory``; GPUs per pod are ``gpus_per_rank`` x tp x dp-size / nnodes."""

    cpu: str
    memory: str
    shm: str | None = None
    gpus_per_rank: int = 0


PORTS_PER_REPLICA = 5  # a node replica's ports: gRPC, bootstrap, metrics, dist-init, mux


@dataclass(frozen=True)
class Ports:
    """Where one replica listens. Nodes: grpc, bootstrap (prefill only), metrics, mux (the Mux socket the router's
    request legs use), and dist_init (the TP rendezvous on the leader pod) when the role spans nnodes > 1 hosts.
    Router: grpc, http."""

    grpc: int
    bootstrap: int | None = None
    metrics: int | None = None
    http: int | None = None
    dist_init: int | None = None
    mux: int | None = None


@dataclass(frozen=True)
class RoleSpec:
    name: str
    replicas: int
    port_base: int
    flags: dict[str, FlagValue] = field(default_factory=dict)
    resources: Resources = Resources(cpu="1", memory="1Gi")
    grace_period: int | None = None  # seconds; None: preStop + the role's --drain-timeout + a shutdown margin
    tp: int = 1  # TP ranks per DP replica of a node (its --tp-size); the router's is unused
    nnodes: int = 1  # hosts (pods) one node's TP group spans: --nnodes, with --dp-size 1 and tp divisible by it


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str | None
    shared: dict[str, FlagValue]
    roles: dict[str, RoleSpec]
    replica_port_stride: int = 10
    profile: str | None = None
    images: dict[str, str] = field(default_factory=lambda: {"cpu": "pdcluster", "cuda": "pdcluster"})

    def __post_init__(self) -> None:
        if set(self.roles) != set(ROLES):
            raise ConfigError(f"cluster spec: roles must be exactly {', '.join(ROLES)}, got {sorted(self.roles)}")
        for role in self.roles.values():
            if role.replicas < 0:
                raise ConfigError(f"cluster spec: {role.name}.replicas must be >= 0, got {role.replicas}")
            for key, value in role.flags.items():
                _check_flag(f"{role.name}.flags", key, value)
        for key, value in self.shared.items():
            _check_flag("shared", key, value)
        self._check_parallelism()
        self._check_resources()
        if self.replica_port_stride < PORTS_PER_REPLICA:
            raise ConfigError(f"cluster spec: replica_port_stride must be >= {PORTS_PER_REPLICA} (a node replica "
                              f"listens on port_base + 0..{PORTS_PER_REPLICA - 1}), got {self.replica_port_stride}")
        bases = sorted(r.port_base for r in self.roles.values())
        width = self.replica_port_stride * max(r.replicas for r in self.roles.values())
        if any(b - a < width for a, b in itertools.pairwise(bases)):
            raise ConfigError(f"cluster spec: port bases {bases} overlap for these replica counts")

    def _check_parallelism(self) -> None:
        """Per-role tp and nnodes: explicit role keys, never flags; each node role's command line (node rank 0 of
        its group) must pass the node's own ``ServerArgs`` checks, so the spec refuses what ``serve`` would."""
        from common.config import add_server_args, server_args_from_cli  # the node's parser: one set of rules

        for key in TOPOLOGY_FLAGS:
            if key in self.shared:
                raise ConfigError(f"cluster spec: shared.{key}: set roles.<role>.{TOPOLOGY_FLAGS[key]} instead")
        for name in NODE_ROLES:
            role = self.roles[name]
            for key in TOPOLOGY_FLAGS:
                if key in role.flags:
                    raise ConfigError(f"cluster spec: {name}.flags.{key}: set {name}.{TOPOLOGY_FLAGS[key]} instead")
            if role.tp < 1 or role.nnodes < 1:
                raise ConfigError(f"cluster spec: {name}.tp and {name}.nnodes must be >= 1, got tp {role.tp} "
                                  f"nnodes {role.nnodes}")
            parser = argparse.ArgumentParser(exit_on_error=False)
            add_server_args(parser)
            argv = self.node_argv(name, "127.0.0.1", node_rank=0, leader="leader")[1:]
            try:
                server_args_from_cli(parser.parse_args(argv))
            except (ConfigError, argparse.ArgumentError, SystemExit) as e:
                raise ConfigError(f"cluster spec{f' (profile {self.profile})' if self.profile else ''}: {name}: "
                                  f"{e}") from None

    def _check_resources(self) -> None:
        if set(self.images) != {"cpu", "cuda"}:
            raise ConfigError(f"cluster spec: images must name exactly cpu and cuda, got {sorted(self.images)}")
        for name in NODE_ROLES:
            res, where = self.roles[name].resources, f"cluster spec{f' (profile {self.profile})' if self.profile else ''}"
            if self.device == "cuda" and res.gpus_per_rank < 1:
                raise ConfigError(f"{where}: {name}.resources.gpus_per_rank is {res.gpus_per_rank} but device is "
                                  "cuda; give every rank a GPU (gpus_per_rank >= 1) or set device: cpu")
            if self.device == "cpu" and res.gpus_per_rank != 0:
                raise ConfigError(f"{where}: {name}.resources.gpus_per_rank must be 0 with device cpu")
            if res.shm is not None and quantity_bytes(res.shm) >= quantity_bytes(res.memory):
                raise ConfigError(f"{where}: {name}.resources.shm ({res.shm}) must be below its memory limit "
                                  f"({res.memory}): /dev/shm is memory-backed and counts against it")
        for role in self.roles.values():
            quantity_bytes(role.resources.memory)
            if role.grace_period is not None and role.grace_period < 1:
                raise ConfigError(f"cluster spec: {role.name}.grace_period must be >= 1 s")

    @property
    def device(self) -> str:
        return str(self.shared.get("device", "cpu"))

    def role(self, name: str) -> RoleSpec:
        return self.roles[name]

    def image(self, role: str) -> str:
        """Node pods run the image of the spec's device; the router (no model weights on a device) the CPU one."""
        return self.images[self.device if role in NODE_ROLES else "cpu"]

    def ranks(self, role: str) -> int:
        """Scheduler rank processes of one node replica (all its hosts together): tp x dp-size."""
        return self.roles[role].tp * int(self.node_flags(role).get("dp-size", 1))

    def ranks_per_pod(self, role: str) -> int:
        """Rank processes on each host (pod) of one node replica: its share of the TP group."""
        return self.ranks(role) // self.roles[role].nnodes

    def gpus(self, role: str) -> int:
        """GPUs of one pod of a node role: gpus_per_rank x tp x dp-size / nnodes."""
        return self.roles[role].resources.gpus_per_rank * self.ranks_per_pod(role)

    def grace_period(self, role: str) -> int:
        """terminationGracePeriodSeconds: explicit, or preStop + --drain-timeout + the role's shutdown after it
        (a node's ranks; the router's abort RPCs)."""
        explicit = self.roles[role].grace_period
        if explicit is not None:
            return explicit
        if role == "router":
            return int(PRESTOP_S + float(self.router_flags().get("drain-timeout", 30)) + ROUTER_SHUTDOWN_MARGIN_S)
        drain = float(self.node_flags(role).get("drain-timeout", 30))
        return int(PRESTOP_S + drain + SHUTDOWN_MARGIN_S)

    def with_gpus_per_rank(self, gpus_per_rank: int) -> ClusterSpec:
        """The spec with every node role's GPUs per rank overridden (``pdcluster ray up --gpus-per-rank``)."""
        roles = {k: dataclasses.replace(r, resources=dataclasses.replace(r.resources, gpus_per_rank=gpus_per_rank))
                 if k in NODE_ROLES else r for k, r in self.roles.items()}
        return dataclasses.replace(self, roles=roles)

    def with_tp(self, **tp: int) -> ClusterSpec:
        """The spec with other TP sizes per node role (``pdcluster ray up --prefill-tp-size 2``)."""
        roles = {k: dataclasses.replace(r, tp=tp.get(k, r.tp)) for k, r in self.roles.items()}
        return dataclasses.replace(self, roles=roles)

    def with_counts(self, **replicas: int) -> ClusterSpec:
        """The spec with other replica counts (``pdcluster ray up --prefill N --decode M``)."""
        roles = {k: dataclasses.replace(r, replicas=replicas.get(k, r.replicas)) for k, r in self.roles.items()}
        return dataclasses.replace(self, roles=roles)

    def with_flags(self, model_path: str | None = None, **shared: FlagValue) -> ClusterSpec:
        """The spec with overridden node flags (``--dp-size`` goes to both node roles, others to ``shared``)."""
        roles = dict(self.roles)
        new_shared = dict(self.shared)
        for key, value in shared.items():
            flag = key.replace("_", "-")
            if flag == "dp-size":
                for name in NODE_ROLES:
                    roles[name] = dataclasses.replace(roles[name], flags={**roles[name].flags, flag: value})
            else:
                new_shared[flag] = value
        return dataclasses.replace(
            self, shared=new_shared, roles=roles, model_path=model_path if model_path else self.model_path
        )

    def with_port_bases(self, **bases: int) -> ClusterSpec:
        """The spec with other port bases (tests pick free ranges)."""
        roles = {k: dataclasses.replace(r, port_base=bases.get(k, r.port_base)) for k, r in self.roles.items()}
        return dataclasses.replace(self, roles=roles)

    def ports(self, role: str, replica: int = 0) -> Ports:
        base = self.roles[role].port_base + replica * self.replica_port_stride
        if role == "router":
            return Ports(grpc=base, http=base + 1)
        return Ports(grpc=base, bootstrap=base + 1 if role == "prefill" else None, metrics=base + 2,
                     dist_init=base + 3 if self.roles[role].nnodes > 1 else None, mux=base + 4)

    def role_flags(self, role: str) -> dict[str, FlagValue]:
        """A node role's own flags: its ``flags`` and its ``--tp-size`` (and ``--nnodes`` when > 1)."""
        r = self.roles[role]
        flags: dict[str, FlagValue] = {**r.flags, "tp-size": r.tp}
        if r.nnodes > 1:
            flags["nnodes"] = r.nnodes
        return flags

    def node_flags(self, role: str) -> dict[str, FlagValue]:
        """Every spec flag of a node role (shared first, the role's own win), without host/ports/node rank."""
        flags = {**self.shared, **self.role_flags(role)}
        if self.model_path:
            flags["model-path"] = self.model_path
        return flags

    def router_flags(self) -> dict[str, FlagValue]:
        flags = dict(self.roles["router"].flags)
        if self.model_path:
            flags["model-path"] = self.model_path
        return flags

    def node_argv(self, role: str, host: str, replica: int = 0, *, node_rank: int = 0,
                  leader: str | None = None) -> list[str]:
        """``pdcluster serve`` arguments of one node replica (after the ``pdcluster`` program name). A role spanning
        nnodes > 1 hosts also gets this host's ``--node-rank`` and ``--dist-init-addr`` = ``leader`` (the host of
        node rank 0) with the replica's rendezvous port."""
        p = self.ports(role, replica)
        argv = ["serve", "--host", host, "--port", str(p.grpc), "--metrics-port", str(p.metrics),
                "--mux-port", str(p.mux)]
        if p.bootstrap is not None:
            argv += ["--disaggregation-bootstrap-port", str(p.bootstrap)]
        if p.dist_init is not None:
            if leader is None:
                raise ConfigError(f"{role} spans {self.roles[role].nnodes} hosts: its command line needs the "
                                  "leader's address")
            argv += [f"--dist-init-addr={leader}:{p.dist_init}", f"--node-rank={node_rank}"]
        return argv + flags_to_argv(self.node_flags(role))

    def router_argv(self, host: str, replica: int = 0) -> list[str]:
        """``pdcluster router`` arguments; workers come from discovery (RegisterWorker), not flags."""
        p = self.ports("router", replica)
        argv = ["router", "--host", host, "--grpc-port", str(p.grpc), "--http-port", str(p.http)]
        return argv + flags_to_argv(self.router_flags())


def flags_to_argv(flags: dict[str, FlagValue]) -> list[str]:
    return [f"--{key}={value}" for key, value in flags.items()]


def _check_flag(where: str, key: str, value: object) -> None:
    if key.startswith("-") or not key or key in ("host", "port", "grpc-port", "http-port", "metrics-port",
                                                             "mux-port"):
        raise ConfigError(f"cluster spec: {where}: {key!r} is not a flag name the spec may set")
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"cluster spec: {where}.{key} must be a string or number (valued flags only), got {value!r}")


def _merge(base: dict[str, Any], over: dict[str, Any], where: str) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if key not in base:
            raise ConfigError(f"cluster spec: profile sets {where}{key}, which the base spec does not have")
        out[key] = _merge(base[key], value, f"{where}{key}.") if isinstance(value, dict) else value
    return out


def load_spec(path: Path | str = SPEC_PATH, profile: str | None = None) -> ClusterSpec:
    """The spec at ``path``, with ``profile``'s overrides applied when given."""
    raw = yaml.safe_load(Path(path).read_text())
    profiles = raw.pop("profiles", {}) or {}
    if profile is not None:
        if profile not in profiles:
            raise ConfigError(f"cluster spec has no profile {profile!r}; profiles: {', '.join(sorted(profiles))}")
        raw = _merge(raw, profiles[profile] or {}, "")
    roles = {
        name: RoleSpec(name, int(r["replicas"]), int(r["port_base"]), dict(r.get("flags") or {}),
                       _resources(name, r.get("resources") or {}), r.get("grace_period"), int(r.get("tp", 1)),
                       int(r.get("nnodes", 1)))
        for name, r in raw["roles"].items()
    }
    return ClusterSpec(
        model_path=raw.get("model_path"),
        shared=dict(raw.get("shared") or {}),
        roles=roles,
        replica_port_stride=int(raw.get("replica_port_stride", 10)),
        profile=profile,
        images=dict(raw.get("images") or {}),
    )


def _resources(role: str, raw: dict[str, Any]) -> Resources:
    unknown = set(raw) - {f.name for f in dataclasses.fields(Resources)}
    if unknown or "cpu" not in raw or "memory" not in raw:
        raise ConfigError(f"cluster spec: {role}.resources needs cpu and memory (optional shm, gpus_per_rank); "
                          f"unknown: {sorted(unknown)}")
    return Resources(cpu=str(raw["cpu"]), memory=str(raw["memory"]), shm=raw.get("shm"),
                     gpus_per_rank=int(raw.get("gpus_per_rank", 0)))


def profile_names(path: Path | str = SPEC_PATH) -> list[str]:
    return sorted((yaml.safe_load(Path(path).read_text()).get("profiles") or {}).keys())
