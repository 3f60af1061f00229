"""Regenerate the ``pdcluster.v1`` package from ``proto/pdcluster/v1/*.proto``.

    python proto/gen.py          # write *_pb2.py, *_pb2.pyi, *_pb2_grpc.py beside the .proto files
    python proto/gen.py --check  # exit 1 if the checked-in files differ from what the .proto files generate
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent  # proto/
PKG = ROOT / "pdcluster" / "v1"


def generate(out_dir: Path) -> None:
    sources = sorted(str(p.relative_to(ROOT)) for p in PKG.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", *sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


def generated_names(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*_pb2*.py*")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify the generated files are up to date")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = Path(tmp) / "pdcluster" / "v1"
        if args.check:
            stale = sorted(
                name for name in generated_names(fresh) | generated_names(PKG)
                if not (PKG / name).exists() or not (fresh / name).exists()
                or not filecmp.cmp(PKG / name, fresh / name, shallow=False)
            )
            if stale:
                print(f"generated code is stale: {', '.join(stale)}; run: python proto/gen.py", file=sys.stderr)
                return 1
            return 0
        for name in generated_names(PKG):
            (PKG / name).unlink()
        for name in generated_names(fresh):
            shutil.copyfile(fresh / name, PKG / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
