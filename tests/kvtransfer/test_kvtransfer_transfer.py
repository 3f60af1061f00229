"""Every backend, across processes: rooms land byte for byte, untouched pages stay untouched, metadata arrives."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
from kvtransfer.receiver import DecodeRooms
from kvtransfer.registry import BACKENDS
from kvtransfer.testing import (
    DECODE_SEED,
    PAGE_SIZE,
    PREFILL_SEED,
    Child,
    RoleSpec,
    backend_param,
    kv_config,
    make_args,
    plan_rooms,
    start_receivers,
    wait_final,
)

AVAILABLE = [backend_param(name) for name, target in BACKENDS.items()
             if importlib.util.find_spec(target.partition(":")[0])]
NUM_PAGES = 64 * 5 + 16


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE : (page + 1) * PAGE_SIZE]


@pytest.mark.parametrize("backend", AVAILABLE)
def test_64_interleaved_chunked_rooms_land_byte_exact(backend: str) -> None:
    plans = plan_rooms(64, NUM_PAGES, NUM_PAGES, pages_per_room=5, seed=3)
    child = Child(RoleSpec("prefill", backend, plans, num_pages=NUM_PAGES, linger_s=5))
    args = make_args(DECODE_SEED, NUM_PAGES)
    mgr = KVManager(args, kv_config(backend), DecodeRooms)
    try:
        before = [b.clone() for b in (*args.k_buffers, *args.v_buffers)]
        receivers = start_receivers(mgr, plans, child.bootstrap_addr)
        result = wait_final(receivers, 30)
        assert all(state == KVPoll.Success for state, _ in result.values()), result
        for plan in plans:
            assert receivers[plan.room].metadata() == plan.metadata()
        prefill_result, prefill_quiesced = child.result()
        assert all(state == KVPoll.Success for state, _ in prefill_result.values()), prefill_result
        assert prefill_quiesced

        src = make_args(PREFILL_SEED, NUM_PAGES)
        written = {d for plan in plans for d in plan.dst_pages}
        for src_buf, dst_buf, old in zip(
            (*src.k_buffers, *src.v_buffers), (*args.k_buffers, *args.v_buffers), before, strict=True
        ):
            if backend != "fake":
                for plan in plans:
                    for s, d in zip(plan.src_pages, plan.dst_pages, strict=True):
                        assert torch.equal(_pages(dst_buf, d), _pages(src_buf, s)), (plan.room, s, d)
            for page in range(args.num_pages):
                if page not in written or backend == "fake":
                    assert torch.equal(_pages(dst_buf, page), _pages(old, page)), f"page {page} was touched"
        for receiver in receivers.values():
            assert receiver.is_quiesced()
            receiver.clear()
        assert not mgr.rooms.rooms
    finally:
        mgr.close()
        child.kill()
