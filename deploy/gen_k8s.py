"""Write the Kubernetes ConfigMap env files from the cluster spec (``python -m deploy.gen_k8s [--check]``).

``deploy/k8s/base/flags.env`` holds every flag of the base spec; ``deploy/k8s/overlays/<profile>/flags.env`` only
what the profile changes (kustomize merges it into the base ConfigMap). Keys: ``MODEL_PATH``, ``SHARED_<FLAG>``
(both node roles) and ``<ROLE>_<FLAG>``; containers read them as ``--flag=$(KEY)`` (see base/*.yaml).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.spec import ROLES, ClusterSpec, load_spec, profile_names

K8S_DIR = Path(__file__).with_name("k8s")
HEADER = "# Generated from deploy/cluster_spec.yaml by `python -m deploy.gen_k8s`; do not edit.\n"


def env_key(scope: str, flag: str) -> str:
    return f"{scope}_{flag}".upper().replace("-", "_")


def flag_env(spec: ClusterSpec) -> dict[str, str]:
    env: dict[str, str] = {}
    if spec.model_path:
        env["MODEL_PATH"] = spec.model_path
    env |= {env_key("shared", k): str(v) for k, v in spec.shared.items()}
    for role in ROLES:
        env |= {env_key(role, k): str(v) for k, v in spec.role(role).flags.items()}
    return env


def env_files() -> dict[Path, str]:
    base = flag_env(load_spec())
    files = {K8S_DIR / "base" / "flags.env": base}
    for profile in profile_names():
        env = flag_env(load_spec(profile=profile))
        files[K8S_DIR / "overlays" / profile / "flags.env"] = {k: v for k, v in env.items() if base.get(k) != v}
    return {path: HEADER + "".join(f"{k}={v}\n" for k, v in env.items()) for path, env in files.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if a file is out of date instead of writing it")
    ns = p.parse_args(argv)
    stale = []
    for path, text in env_files().items():
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
