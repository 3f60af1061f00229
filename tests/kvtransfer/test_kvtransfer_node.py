"""The seam between the engine and the KV transfer layer: ``common`` never imports ``kvtransfer``; the manager
knows no role module; ``kvtransfer.node`` builds a rank's manager from a model runner; ``common.engine.mem.pages`` does
the page arithmetic both roles use."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.config import ServerArgs
from common.engine.mem.kv_pool import MHATokenToKVPool
from common.engine.mem.pages import num_pages, req_pages
from kvtransfer.args import KVArgs
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.node import make_kv_manager
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender

ROOT = Path(__file__).resolve().parents[2]


def imported_modules(path: Path) -> set[str]:
    """Every module an ``import`` anywhere in ``path`` names (TYPE_CHECKING and function-local ones included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_common_imports_nothing_of_kvtransfer() -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported_modules(p) if m.split(".")[0] == "kvtransfer")
                 for p in (ROOT / "common").rglob("*.py")}
    assert not {p: m for p, m in offenders.items() if m}


@pytest.mark.parametrize("module", ["manager", "room_record", "handle"])
def test_shared_kv_modules_import_no_role_module(module: str) -> None:
    imported = imported_modules(ROOT / "kvtransfer" / f"{module}.py")
    assert not imported & {"kvtransfer.sender", "kvtransfer.receiver", "kvtransfer.prefill_rooms", "kvtransfer.decode_rooms",
                             "kvtransfer.node"}


def tiny_runner(pool_heads: int, model_heads: int) -> SimpleNamespace:
    pool = MHATokenToKVPool(8, 4, torch.float32, pool_heads, 8, 2, "cpu")
    fingerprint = {"architecture": "TinyLlama", "num_layers": 2, "num_kv_heads": model_heads, "head_dim": 8}
    return SimpleNamespace(kv_pool=pool, draft_kv=None, model_config=SimpleNamespace(num_kv_heads=model_heads,
                                                                                     fingerprint=lambda: fingerprint))


def test_make_kv_manager_registers_the_tp_rank_with_the_model_total_of_kv_heads() -> None:
    args = ServerArgs(disaggregation_mode="decode", max_running_requests=4)
    runner = tiny_runner(pool_heads=2, model_heads=6)  # rank 1 of 3 holds 2 of the model's 6 KV heads
    mgr = make_kv_manager(args, runner, "decode", 0, tp_rank=1, tp_size=3)  # type: ignore[arg-type]
    try:
        assert isinstance(mgr.rooms, DecodeRooms) and mgr.mode == "decode" and mgr.bootstrap_addr is None
        layout = mgr.layout
        assert (layout.tp_rank, layout.tp_size, layout.total_kv_heads, layout.kv_heads) == (1, 3, 6, 2)
        assert mgr.instance_id.startswith("decode/dp0/tp1@")
        assert mgr.args.num_metadata_slots == 2 * 4 + 8
        assert mgr.args.k_buffers[0].data_ptr() == runner.kv_pool.k_buffer[0].data_ptr()  # shared, not copied
        assert dict(mgr.config.fingerprint)["serving_dtype"] == args.dtype
    finally:
        mgr.close()


def test_a_handle_refuses_a_manager_of_the_other_role() -> None:
    runner = tiny_runner(pool_heads=2, model_heads=2)
    mgr = make_kv_manager(ServerArgs(disaggregation_mode="decode"), runner, "decode", 0)  # type: ignore[arg-type]
    try:
        with pytest.raises(TypeError, match="needs a prefill KVManager"):
            KVSender(mgr, 7)
        receiver = KVReceiver(mgr, 8, "127.0.0.1:1")
        receiver.abort()
        assert receiver.failure() == "room 8: aborted by the decode scheduler"
        assert receiver.is_quiesced()  # no source ever got a TransferInfo
        receiver.clear()
        assert not mgr.rooms.rooms
    finally:
        mgr.close()


def test_model_bytes_per_page_counts_a_drafts_layers_with_every_kv_head() -> None:
    """A TP rank of 2 holding 2 of the target's 4 KV heads, with a draft's 3 layers of another geometry (1 of its 2
    KV heads, head dim 24): a page moves the target's and the draft's K and V, all heads of each."""
    pool = MHATokenToKVPool(8, 4, torch.bfloat16, 2, 16, 5, "cpu")
    draft = MHATokenToKVPool(8, 4, torch.bfloat16, 1, 24, 3, "cpu")
    args = KVArgs.from_pool(pool, tp_rank=1, tp_size=2, total_kv_heads=4, extra_total_kv_heads=2,
                            extra_layers=list(zip(draft.k_buffer, draft.v_buffer, strict=True)))
    assert len(args.groups()) == 2
    rank_page = sum(buf[4:8].nbytes for buf in (*pool.k_buffer, *pool.v_buffer, *draft.k_buffer, *draft.v_buffer))
    assert rank_page == 2 * 5 * args.item_len + 2 * 3 * args.group_args(1).item_len
    # the rank holds half of the target's heads and half of the draft's
    assert args.model_bytes_per_page == 2 * rank_page == 2 * 4 * (5 * 4 * 16 + 3 * 2 * 24) * 2


def test_page_numbers_of_a_request() -> None:
    assert [num_pages(n, 4) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    req_to_token = torch.zeros(2, 16, dtype=torch.int64)
    req_to_token[1, :10] = torch.tensor([20, 21, 22, 23, 8, 9, 10, 11, 36, 37])  # pages 5, 2, 9 (aligned)
    req = SimpleNamespace(req_pool_idx=1)
    assert req_pages(req_to_token, req, 0, 10, 4) == [5, 2, 9]  # type: ignore[arg-type]
    assert req_pages(req_to_token, req, 1, 10, 4) == [2, 9]  # type: ignore[arg-type]
    assert req_pages(req_to_token, req, 1, 8, 4) == [2]  # type: ignore[arg-type]
