"""``tcp``'s staged path (``kvtransfer.backends.staging``) forced onto CPU buffers: the byte path GPU buffers take.

Segments are made tiny (2 pages) so every chunk crosses several segments and both host buffers alternate.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.backends.base import PeerInfo, TransferJob
from kvtransfer.backends.staging import PageStager, expand_pages
from kvtransfer.pages import HeadSlice
from kvtransfer.testing import (
    PAGE_SIZE,
    kv_config,
    make_args,
    transfer_interleaved_rooms,
)
from tests.kvtransfer import test_kvtransfer_faults as faults
from tests.kvtransfer.test_kvtransfer_backends_extra import Pair

SEGMENT = 2 * 4 * PAGE_SIZE * 2 * 8 * 2  # two pages of 4 buffers (2 layers, K and V), 2 heads x 8 dims, bf16
STAGED = {"backend_options": {"stage": "always", "stage_bytes": str(SEGMENT)}}
NUM_PAGES = 64 * 5 + 16


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


def _all(args) -> tuple[torch.Tensor, ...]:
    return (*args.k_buffers, *args.v_buffers)


def test_stager_round_trip_matches_page_copies_across_segments() -> None:
    src, dst = make_args(1, 40, heads=4), make_args(2, 40, heads=4)
    before = [b.clone() for b in _all(dst)]
    sender, receiver = PageStager(src, 1000), PageStager(dst, 1000)
    src_pages, dst_pages = [5, 6, 7, 20, 3, 33, 34], [30, 31, 32, 9, 1, 12, 2]
    for heads, dst_heads in ((None, None), ((1, 2), (2, 2))):
        nh = 4 if heads is None else 2
        segment = sender.segment_pages(nh)
        assert segment < len(src_pages)  # several segments, both buffers used
        wire: list[bytes] = []

        def keep(view: memoryview, wire=wire) -> None:
            wire.append(bytes(view))  # the host buffer is reused by the segment after next

        sender.send(src_pages, heads, segment, keep)
        stream = iter(wire)

        def land(view: memoryview, stream=stream) -> None:
            view.cast("B")[:] = next(stream)

        receiver.receive(dst_pages, dst_heads, segment, land)
        for s, d, old in zip(_all(src), _all(dst), before, strict=True):
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                if heads is None:
                    assert torch.equal(_pages(d, dp), _pages(s, sp))
                else:
                    assert torch.equal(_pages(d, dp)[:, 2:4], _pages(s, sp)[:, 1:3])
            for p in set(range(dst.num_pages)) - set(dst_pages):
                assert torch.equal(_pages(d, p), _pages(old, p))
    assert expand_pages([(3, 2), (9, 1)]) == [3, 4, 9]


def test_64_interleaved_rooms_land_byte_exact_through_staging() -> None:
    transfer_interleaved_rooms("tcp", STAGED, seed=5, num_pages=NUM_PAGES)


def test_staged_head_slices_and_job_order() -> None:
    head_slices_land_and_jobs_complete_in_order(STAGED)


def head_slices_land_and_jobs_complete_in_order(config: dict, stripes: int = 1) -> None:
    """A head-sliced job (prefill tp 1 -> decode tp rank 1 of 2) then an empty one: both complete in order, the
    sliced heads land byte-exact, nothing else is touched. ``stripes``: how many stripes the sliced job is cut into."""
    src = make_args(1, 48, heads=4, total_heads=4)  # prefill tp=1 holds heads 0..3
    dst = make_args(2, 48, heads=2, total_heads=4)  # decode tp rank 1 of 2 holds heads 2..3
    before = [b.clone() for b in _all(dst)]
    pair = Pair("tcp", src, dst, **config)
    try:
        sliced = pair.job(3, 0, [5, 6, 7, 20, 21], [30, 31, 32, 9, 10], HeadSlice(2, 0, 2))
        assert len(pair.prefill._stripes(sliced)) == stripes  # type: ignore[attr-defined]
        empty = TransferJob(3, 1, pair.d_key, ())
        for job in (sliced, empty):
            pair.prefill.submit(job)
        assert pair.events.wait(2) == [(sliced, None), (empty, None)]
        for s, d, old in zip(_all(src), _all(dst), before, strict=True):
            for sp, dp in ((5, 30), (6, 31), (7, 32), (20, 9), (21, 10)):
                assert torch.equal(_pages(d, dp), _pages(s, sp)[:, 2:4])
            for p in set(range(dst.num_pages)) - {30, 31, 32, 9, 10}:
                assert torch.equal(_pages(d, p), _pages(old, p))
    finally:
        pair.close()


def test_staged_refusals_write_nothing_and_name_the_cause() -> None:
    dst = make_args(2, 48)
    before = [b.clone() for b in _all(dst)]
    pair = Pair("tcp", make_args(1, 48), dst, **STAGED)
    try:
        outside = pair.job(2, 0, [1, 2], [48, 49])  # page 49 is past the pool (pages 0..48)
        pair.prefill.submit(outside)
        done = pair.events.wait(1)
        assert "do not fit" in (done[0][1] or ""), done
    finally:
        pair.close()
    # a sender whose segments exceed the receiver's staging buffers is refused, not overrun
    big = {"backend_options": {"stage": "always", "stage_bytes": str(4 * SEGMENT)}}
    pair = Pair("tcp", make_args(1, 48), dst, **big)
    small = type(pair.decode)(dst, kv_config("tcp", **STAGED), "decode", pair.decode_events, pair.d_key)
    try:
        pair.decode.close()
        pair.decode = small
        pair.prefill.remove_peer(pair.d_key)
        pair.prefill.add_peer(PeerInfo(pair.d_key, dst.layout({}), small.endpoint()))
        small.add_peer(PeerInfo(pair.p_key, pair.src.layout({}), pair.prefill.endpoint()))
        oversized = pair.job(1, 0, list(range(1, 9)), list(range(1, 9)))
        pair.prefill.submit(oversized)
        done = pair.events.wait(1)
        assert "exceed" in (done[0][1] or "") and "stage_bytes" in (done[0][1] or ""), done
        assert all(torch.equal(b, o) for b, o in zip(_all(dst), before, strict=True))
    finally:
        pair.close()


@pytest.mark.slow
def test_receiver_killed_mid_staged_transfer_fails_sender_within_deadline() -> None:
    faults.receiver_killed_mid_transfer("tcp", **STAGED)
