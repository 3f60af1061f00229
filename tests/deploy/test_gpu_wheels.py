"""deploy/gpu_wheels.py: a slimmed wheel leaves the named members out and its RECORD still vouches for the rest."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import zipfile
from pathlib import Path

import pytest

from deploy.gpu_wheels import slim_wheel

RECORD = "pkg-1.0.dist-info/RECORD"


def _wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
        z.writestr(RECORD, "stale,sha256=x,1\n")
    return path


def _digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def test_slim_wheel_drops_members_and_rewrites_record(tmp_path: Path) -> None:
    members = {"pkg/__init__.py": b"x = 1\n", "pkg/ext_torch212.so": b"\0" * 4096, "pkg/ext_torch213.so": b"\1" * 99,
               "pkg-1.0.dist-info/METADATA": b"Name: pkg\n"}
    src = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", members)
    (tmp_path / "out").mkdir()
    out, dropped = slim_wheel(src, tmp_path / "out", ("pkg/ext_torch*.so",))

    assert out.name == src.name
    assert sorted(dropped) == ["pkg/ext_torch212.so", "pkg/ext_torch213.so"]
    with zipfile.ZipFile(out) as z:
        assert sorted(z.namelist()) == sorted(["pkg/__init__.py", "pkg-1.0.dist-info/METADATA", RECORD])
        rows = list(csv.reader(io.StringIO(z.read(RECORD).decode())))
        for name, digest, size in rows:
            if name == RECORD:
                assert (digest, size) == ("", "")
            else:
                assert digest == _digest(z.read(name)) and int(size) == len(members[name])
    assert sorted(r[0] for r in rows) == sorted(z_name for z_name in [*members, RECORD] if "ext_torch" not in z_name)


def test_slim_wheel_refuses_a_pattern_that_matches_nothing(tmp_path: Path) -> None:
    src = _wheel(tmp_path / "pkg-1.0-py3-none-any.whl", {"pkg/__init__.py": b""})
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match=r"no member matches 'pkg/gone\.so'"):
        slim_wheel(src, tmp_path / "out", ("pkg/gone.so",))
