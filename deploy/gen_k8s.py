"""Write the Kubernetes files that come from the cluster spec (``python -m deploy.gen_k8s [--check]``).

- ``deploy/k8s/base/flags.env`` holds every flag of the base spec; ``deploy/k8s/overlays/<profile>/flags.env`` only
  what the profile changes (kustomize merges it into the base ConfigMap). Keys: ``MODEL_PATH``, ``SHARED_<FLAG>``
  (both node roles) and ``<ROLE>_<FLAG>``; containers read them as ``--flag=$(KEY)``.
- ``deploy/k8s/base/spec/`` and ``deploy/k8s/overlays/<profile>/spec/``: kustomize Components with the spec's
  images, args, ports, replicas, grace periods, resources and /dev/shm sizes (``deploy.k8s_spec``).
- ``deploy/k8s/components/multinode-lws/lws-<role>.yaml``: the node Deployments' pod templates as LeaderWorkerSets.
- ``deploy/k8s/components/monitoring/dashboard.json``: the Grafana dashboard (``deploy.dashboard``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from deploy.dashboard import dashboard
from deploy.k8s_spec import component, env_key, leader_worker_set
from deploy.spec import NODE_ROLES, ROLES, ClusterSpec, load_spec, profile_names

K8S_DIR = Path(__file__).with_name("k8s")
HEADER = "# Generated from deploy/cluster_spec.yaml by `python -m deploy.gen_k8s`; do not edit.\n"
__all__ = ["env_key", "flag_env", "generated_files", "main"]


def flag_env(spec: ClusterSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    if spec.model_path:
        env["MODEL_PATH"] = spec.model_path
    env |= {env_key("shared", k): str(v) for k, v in spec.shared.items()}
    for role in ROLES:
        flags = spec.role(role).flags if role == "router" else spec.role_flags(role)
        env |= {env_key(role, k): str(v) for k, v in flags.items()}
    return env


def _yaml(doc: object) -> str:
    return HEADER + yaml.safe_dump(doc, sort_keys=False, width=120)


def generated_files() -> dict[Path, str]:
    base_spec = load_spec()
    base = flag_env(base_spec)
    env_files = {K8S_DIR / "base" / "flags.env": base}
    files = {K8S_DIR / "base" / "spec" / "kustomization.yaml": _yaml(component(base_spec))}
    for profile in profile_names():
        spec = load_spec(profile=profile)
        env = flag_env(spec)
        env_files[K8S_DIR / "overlays" / profile / "flags.env"] = {k: v for k, v in env.items() if base.get(k) != v}
        files[K8S_DIR / "overlays" / profile / "spec" / "kustomization.yaml"] = _yaml(component(spec))
    for role in NODE_ROLES:
        deployment = next(d for d in yaml.safe_load_all((K8S_DIR / "base" / f"{role}.yaml").read_text())
                          if d["kind"] == "Deployment")
        lws = leader_worker_set(deployment)
        files[K8S_DIR / "components" / "multinode-lws" / f"lws-{role}.yaml"] = _yaml(lws)
    files[K8S_DIR / "components" / "monitoring" / "dashboard.json"] = json.dumps(dashboard(), indent=1) + "\n"
    files |= {path: HEADER + "".join(f"{k}={v}\n" for k, v in env.items()) for path, env in env_files.items()}
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if a file is out of date instead of writing it")
    ns = p.parse_args(argv)
    stale = []
    for path, text in generated_files().items():
        if path.exists() and path.read_text() == text:
            continue
        if ns.check:
            stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run `python -m deploy.gen_k8s`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
