"""Wheels a GPU machine without a package index needs, small enough to travel with the checkout.

    python -m deploy.gpu_wheels --dest .whl            # `make gpu-wheels` runs it after the core wheels

The device machines copy the checkout plus carried paths up to ``CARRY_LIMIT`` bytes, and have no package index
(../shared/GPU.md). NIXL's CUDA 13 wheel alone nearly fills that: most of its size is ``nixl_ep`` extensions built
for one torch minor each (``nixl_ep_cpp_torch2XX``), which the expert-parallel API loads and the KV transfer backend
never does. ``slim_wheel`` rewrites a wheel without some members; its ``RECORD`` keeps the hash and size of every
member left, so ``pip install`` of the slimmed wheel checks out like the original's.
"""

from __future__ import annotations

import argparse
import base64
import csv
import fnmatch
import hashlib
import io
import subprocess
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

CARRY_LIMIT = 64 * 2**20
# (distribution, members to leave out): the CUDA 13 build, the one the lent machines' torch (CUDA 13) selects
NIXL_WHEELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("nixl", ()),
    ("nixl-cu13", ("nixl_ep_cu13/nixl_ep_cpp_torch*.so",)),
)
WHEEL_PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                  "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


def _record_row(name: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [name, f"sha256={digest}", str(len(data))]


def slim_wheel(src: Path, dest_dir: Path, drop: tuple[str, ...]) -> tuple[Path, list[str]]:
    """``src`` rewritten into ``dest_dir`` (same file name) without the members matching ``drop`` (fnmatch
    patterns); returns the new wheel and the dropped names. Raises ValueError if a pattern matches nothing (the
    wheel's layout changed: the slimming would silently stop working)."""
    out = dest_dir / src.name
    dropped: list[str] = []
    with zipfile.ZipFile(src) as zin:
        names = zin.namelist()
        for pattern in drop:
            if not any(fnmatch.fnmatch(n, pattern) for n in names):
                raise ValueError(f"{src.name}: no member matches {pattern!r}; update deploy/gpu_wheels.py")
        record = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record is None:
            raise ValueError(f"{src.name} has no .dist-info/RECORD: not a wheel")
        rows: list[list[str]] = []
        with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
            for info in zin.infolist():
                if info.filename == record:
                    continue
                if any(fnmatch.fnmatch(info.filename, p) for p in drop):
                    dropped.append(info.filename)
                    continue
                data = zin.read(info)
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                if not info.is_dir():
                    rows.append(_record_row(info.filename, data))
            text = io.StringIO()
            csv.writer(text, lineterminator="\n").writerows([*rows, [record, "", ""]])
            zout.writestr(zin.getinfo(record), text.getvalue(), compress_type=zipfile.ZIP_DEFLATED)
    return out, dropped


def fetch_nixl(dest: Path) -> list[Path]:
    """NIXL's meta package and its CUDA 13 build, at this environment's NIXL version, slimmed into ``dest``."""
    version = metadata.version("nixl")
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        for dist, drop in NIXL_WHEELS:
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                            *WHEEL_PLATFORM, "-d", tmp, f"{dist}=={version}"], check=True, timeout=600)
            (src,) = [p for p in Path(tmp).glob("*.whl") if p.name.startswith(dist.replace("-", "_") + "-")]
            out, dropped = slim_wheel(src, dest, drop)
            print(f"{out.name}: {src.stat().st_size / 2**20:.1f} -> {out.stat().st_size / 2**20:.1f} MiB"
                  + (f" (left out {len(dropped)}: {', '.join(Path(d).name for d in dropped)})" if dropped else ""))
            written.append(out)
    return written


def checkout_bytes() -> int:
    """Bytes of the tracked files: they travel beside the carried wheels."""
    names = subprocess.run(["git", "ls-files", "-z"], check=True, capture_output=True, timeout=60).stdout
    return sum(Path(n).stat().st_size for n in names.decode().split("\0") if n and Path(n).is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", type=Path, default=Path(".whl"))
    a = p.parse_args(argv)
    fetch_nixl(a.dest)
    total = sum(w.stat().st_size for w in a.dest.glob("*.whl")) + checkout_bytes()
    print(f"{a.dest}/ + checkout: {total / 2**20:.1f} MiB of the device tool's {CARRY_LIMIT / 2**20:.0f} MiB")
    if total > CARRY_LIMIT:
        print(f"over the limit: remove {a.dest}/nixl*.whl to carry the rest", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
