"""Every backend, across processes: rooms land byte for byte, untouched pages stay untouched, metadata arrives."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from common.kv_backends import KV_TRANSFER_BACKENDS
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
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

AVAILABLE = [backend_param(name) for name, backend in KV_TRANSFER_BACKENDS.items()
             if importlib.util.find_spec(backend.ref.partition(":")[0])]
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


@pytest.mark.parametrize("backend", [backend_param("tcp"), backend_param("shm")])
def test_destination_page_0_is_skipped(backend: str) -> None:
    """Destination page 0 marks a page the decode rank holds already (a shared prompt): nothing moves for it, a
    chunk made only of such pages is not sent, and the room still lands whole (chunk counts agree, metadata
    arrives, even with no page to move); every other destination page is byte-exact and nothing else is touched, page 0 included."""
    plans = []
    for i, plan in enumerate(plan_rooms(8, NUM_PAGES, NUM_PAGES, pages_per_room=5, seed=11)):
        dst = list(plan.dst_pages)
        if i % 2 == 0:
            dst[: plan.chunks[0]] = [0] * plan.chunks[0]  # a whole chunk held already
        dst[-2] = 0  # and one page inside the last chunks
        if i == 1:
            dst = [0] * len(dst)  # every page held: the last chunk goes as an empty job, with the metadata
        plans.append(replace(plan, dst_pages=dst))
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
        written = {d for plan in plans for d in plan.dst_pages if d}
        for src_buf, dst_buf, old in zip(
            (*src.k_buffers, *src.v_buffers), (*args.k_buffers, *args.v_buffers), before, strict=True
        ):
            for plan in plans:
                for s, d in zip(plan.src_pages, plan.dst_pages, strict=True):
                    if d:
                        assert torch.equal(_pages(dst_buf, d), _pages(src_buf, s)), (plan.room, s, d)
            for page in range(args.num_pages):
                if page not in written:
                    assert torch.equal(_pages(dst_buf, page), _pages(old, page)), f"page {page} was touched"
        for receiver in receivers.values():
            receiver.clear()
    finally:
        mgr.close()
        child.kill()


DRAFT = (1, 1, 24)  # a draft model's layer group: 1 layer of 1 KV head x 24 (the target's: HEADS x HEAD_DIM)


@pytest.mark.parametrize("backend", AVAILABLE)
def test_a_layer_group_of_another_geometry_lands_byte_exact(backend: str) -> None:
    """Layers of two slot geometries (a STANDALONE draft's after the target's, the draft's as leading slices of a
    larger pool) move by one backend per group, each room's chunks whole in both (``backends.grouped``)."""
    plans = plan_rooms(8, NUM_PAGES, NUM_PAGES, pages_per_room=5, seed=5)
    child = Child(RoleSpec("prefill", backend, plans, num_pages=NUM_PAGES, args_overrides={"draft": DRAFT},
                           linger_s=5))
    args = make_args(DECODE_SEED, NUM_PAGES, draft=DRAFT)
    assert len(args.groups()) == 2
    mgr = KVManager(args, kv_config(backend), DecodeRooms)
    try:
        before = [b.clone() for b in (*args.k_buffers, *args.v_buffers)]
        receivers = start_receivers(mgr, plans, child.bootstrap_addr)
        result = wait_final(receivers, 30)
        assert all(state == KVPoll.Success for state, _ in result.values()), result
        prefill_result, _ = child.result()
        assert all(state == KVPoll.Success for state, _ in prefill_result.values()), prefill_result
        src = make_args(PREFILL_SEED, NUM_PAGES, draft=DRAFT)
        written = {d for plan in plans for d in plan.dst_pages}
        for src_buf, dst_buf, old in zip(
            (*src.k_buffers, *src.v_buffers), (*args.k_buffers, *args.v_buffers), before, strict=True
        ):
            for plan in plans:
                for s, d in zip(plan.src_pages, plan.dst_pages, strict=True):
                    if backend != "fake":
                        assert torch.equal(_pages(dst_buf, d), _pages(src_buf, s)), (plan.room, s, d)
            for page in range(args.num_pages):
                if page not in written or backend == "fake":
                    assert torch.equal(_pages(dst_buf, page), _pages(old, page)), f"page {page} was touched"
        for receiver in receivers.values():
            receiver.clear()
    finally:
        mgr.close()
        child.kill()
