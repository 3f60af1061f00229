"""The KV page-copy kernels move 16-byte vectors, not one element at a time (checked on the PTX, no GPU needed).

The kernels load each buffer's base address from a table, so Triton cannot see its alignment; without the
``ALIGNED`` hint every bf16 element is its own 2-byte load and store (slower on an H200:
benchmarks/pages/kv_transfer.md). Triton compiles for sm_90 here with the ``ptxas`` its wheel ships.
"""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from common.engine.kernels import kv_pages_triton  # noqa: E402

ROW_ARG = 5  # ``row`` (elements per page): a real launch specializes it as a multiple of 16, as here


def _memory_ops(fn: object, signature: dict[str, str], constexprs: dict[str, object]) -> set[str]:
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs={(ROW_ARG,): [["tt.divisibility", 16]]})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx))


DIRECT = {"SrcPtrs": "*i64", "DstPtrs": "*i64", "Ids": "*i64", "Like": "*bf16", "num_pages": "i32", "row": "i32",
          "BLOCK": "constexpr", "ALIGNED": "constexpr"}
STAGED = {"BufPtrs": "*i64", "PageIds": "*i64", "Staging": "*bf16", "Like": "*bf16", "num_pages": "i32",
          "row": "i32", "GATHER": "constexpr", "BLOCK": "constexpr", "ALIGNED": "constexpr"}


@pytest.mark.parametrize("kernel", ["copy", "gather", "scatter"])
def test_aligned_page_copies_are_16_byte_vectors(kernel: str) -> None:
    if kernel == "copy":
        ops = _memory_ops(kv_pages_triton._copy_pages_direct, DIRECT, {"BLOCK": 4096, "ALIGNED": True})
    else:
        ops = _memory_ops(kv_pages_triton._copy_pages, STAGED,
                          {"BLOCK": 4096, "ALIGNED": True, "GATHER": kernel == "gather"})
    assert "ld.global.v4.b32" in ops and "st.global.v4.b32" in ops, ops
    assert "ld.global.b16" not in ops and "st.global.b16" not in ops, ops  # no element-wise moves left


def test_unaligned_buffers_take_the_element_wise_kernel() -> None:
    ops = _memory_ops(kv_pages_triton._copy_pages_direct, DIRECT, {"BLOCK": 4096, "ALIGNED": False})
    assert "st.global.b16" in ops, ops  # the fallback is still correct for any address
    pool = torch.zeros(64, 2, 8, dtype=torch.bfloat16)
    assert kv_pages_triton._aligned([pool, pool[16:]], row=16 * 2 * 8)
    assert not kv_pages_triton._aligned([pool, pool.view(-1)[1:]], row=16 * 2 * 8)  # a base 2 bytes in
    assert not kv_pages_triton._aligned([pool], row=3)  # a page of 6 bytes: page starts are not 16-aligned
