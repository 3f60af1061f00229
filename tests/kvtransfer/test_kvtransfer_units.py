"""Unit tests of the KV transfer building blocks: states, page runs, head slicing, compatibility, messages."""

from __future__ import annotations

import grpc
import msgspec
import pytest
import torch

from kvtransfer.args import compat_problems, model_fingerprint
from kvtransfer.bootstrap import BootstrapClient, BootstrapError, BootstrapServer, RankEntry, RankTable
from kvtransfer.messages import PROTOCOL_VERSION, Abort, ChunkDone, Heartbeat, decode, encode
from kvtransfer.metadata import MetadataBuffers, MetadataRecord
from kvtransfer.pages import PageRun, coalesce_runs, copy_runs, dst_ranks_served, owned_heads, source_plan
from kvtransfer.poll import KVPoll, advance, reduce_polls
from kvtransfer.registry import backend_class
from kvtransfer.testing import TOKEN, make_args


def test_states_only_move_up_and_failed_is_sticky() -> None:
    assert advance(KVPoll.Bootstrapping, KVPoll.Transferring) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert advance(KVPoll.Transferring, KVPoll.Failed) == KVPoll.Failed
    assert advance(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed
    assert advance(KVPoll.Success, KVPoll.Failed) == KVPoll.Success


def test_min_reduction_across_ranks() -> None:
    assert reduce_polls([KVPoll.Success, KVPoll.Transferring, KVPoll.Success]) == KVPoll.Transferring
    assert reduce_polls([KVPoll.Success, KVPoll.Failed]) == KVPoll.Failed
    assert reduce_polls([4, 4]) == KVPoll.Success
    with pytest.raises(ValueError):
        reduce_polls([])


def test_runs_coalesce_only_where_both_sides_are_contiguous() -> None:
    assert coalesce_runs([7, 8, 9, 3, 4, 5], [20, 21, 22, 40, 41, 50]) == [
        PageRun(7, 20, 3),
        PageRun(3, 40, 2),
        PageRun(5, 50, 1),
    ]
    assert coalesce_runs([1, 2, 3], [5, 4, 3]) == [PageRun(1, 5, 1), PageRun(2, 4, 1), PageRun(3, 3, 1)]
    assert coalesce_runs([], []) == []
    with pytest.raises(ValueError, match="page count mismatch"):
        coalesce_runs([1, 2], [3])


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "heads"),
    [(1, 2, 8), (2, 1, 8), (2, 4, 8), (4, 2, 8), (1, 4, 2), (4, 1, 2), (2, 2, 8)],
)
def test_head_slices_rebuild_every_destination_rank(src_tp: int, dst_tp: int, heads: int) -> None:
    page, pages, hd = 4, 6, 3
    full = torch.randn((pages + 1) * page, heads, hd)
    src_bufs = [
        full[:, owned_heads(r, src_tp, heads).start : owned_heads(r, src_tp, heads).stop].contiguous()
        for r in range(src_tp)
    ]
    src_pages, dst_pages = [1, 2, 5], [4, 5, 2]
    for d in range(dst_tp):
        owned = owned_heads(d, dst_tp, heads)
        dst = torch.zeros((pages + 1) * page, len(owned), hd)
        for src_rank, heads_slice in source_plan(d, dst_tp, src_tp, heads):
            assert d in dst_ranks_served(src_rank, src_tp, dst_tp, heads)
            copy_runs(src_bufs[src_rank], dst, coalesce_runs(src_pages, dst_pages), page, heads_slice)
        for s, t in zip(src_pages, dst_pages, strict=True):
            assert torch.equal(
                dst[t * page : (t + 1) * page], full[s * page : (s + 1) * page, owned.start : owned.stop]
            )
        assert not dst[:page].any()  # untouched padding page


def test_compat_mismatch_names_both_values() -> None:
    p, d = (
        make_args(0, 8).layout({"weights": "a"}),
        make_args(0, 8, page_size=8, head_dim=16).layout({"weights": "b"}),
    )
    problems = compat_problems(p, d)
    assert "model weights: prefill=a decode=b" in problems
    assert "page_size: prefill=4 decode=8" in problems and "head_dim: prefill=8 decode=16" in problems
    assert compat_problems(p, p) == []
    fp = model_fingerprint("Llama", 2, 2, 8, torch.bfloat16, {"w": (2, 3)})
    assert fp != model_fingerprint("Llama", 2, 2, 8, torch.bfloat16, {"w": (3, 2)})


def test_layer_groups_are_described_compared_and_sliced_alike() -> None:
    """A draft model's layers of their own geometry form a group of the layout; pairs must hold the same groups,
    and between TP sizes every group's heads must split as the target's do (a slice then scales exactly)."""
    from kvtransfer.args import KVGroup, group_heads
    from kvtransfer.pages import HeadSlice

    one = make_args(0, 8, heads=4, draft=(2, 2, 24))
    assert [len(r) for r in one.groups()] == [2, 2] and one.num_layers == 2
    layout = one.layout({})
    assert layout.extra == [KVGroup(2, 2, 2, 24, one.group_args(1).item_len)]
    assert layout.group(1).head_dim == 24 and layout.group(1).num_layers == 2 and layout.group(0).extra == []
    assert compat_problems(layout, layout) == []
    plain = make_args(0, 8, heads=4).layout({})
    assert any("further layer groups" in p for p in compat_problems(plain, layout))
    # tp 1 -> tp 2: heads [4, 2] split alike; a draft of 1 KV head would not
    half = make_args(0, 8, heads=2, tp_size=2, draft=(2, 1, 24)).layout({})
    assert compat_problems(layout, half) == []
    assert group_heads(HeadSlice(2, 0, 2), 4, 2) == HeadSlice(1, 0, 1)
    assert group_heads(None, 4, 2) is None
    odd = make_args(0, 8, heads=4, draft=(2, 1, 24)).layout({})
    odd_half = make_args(0, 8, heads=2, tp_size=2, total_heads=4, draft=(2, 1, 24)).layout({})
    odd_half = msgspec.structs.replace(odd_half, extra=[KVGroup(2, 1, 1, 24, odd_half.extra[0].item_len)])
    assert any("start both nodes with one --tp-size" in p for p in compat_problems(odd, odd_half))


def test_messages_are_tagged_versioned_and_reject_garbage() -> None:
    msg = ChunkDone(
        instance_id="p",
        epoch=3,
        room=9,
        chunk_id=1,
        num_pages=2,
        num_chunks=2,
        metadata=MetadataRecord(room=9, first_token=5),
    )
    assert decode(encode(msg)) == msg
    assert decode(encode(Heartbeat(instance_id="p", epoch=1))).version == PROTOCOL_VERSION
    assert isinstance(decode(encode(Abort(instance_id="d", epoch=1, room=1, reason="x"))), Abort)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\x93\x01\x02\x03")


def test_metadata_slot_round_trip_and_clear() -> None:
    bufs = MetadataBuffers(4)
    record = MetadataRecord(
        room=2**62 + 5,
        first_token=17,
        logprob=-0.5,
        cached_tokens=3,
        top_ids=(1, 2),
        top_logprobs=(-0.5, -1.5),
    )
    bufs.write(2, record)
    assert bufs.read(2) == record and bufs.room_of(2) == record.room
    bufs.clear(2)
    assert bufs.room_of(2) == 0


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"choose one of .*fake.*shm.*tcp"):
        backend_class("rdma")
    assert backend_class("fake").__name__ == "FakeBackend"


def test_bootstrap_re_registration_replaces_and_readiness_counts_distinct_ranks() -> None:
    table = RankTable()
    assert table.register(0, 0, 1, 2, RankEntry("tcp://a", "p0", 1)) == (1, 2)
    assert table.register(0, 0, 1, 2, RankEntry("tcp://a", "p0", 2)) == (1, 2)  # restart: no inflated count
    with pytest.raises(BootstrapError):
        table.topology()
    table.register(0, 1, 1, 2, RankEntry("tcp://b", "p1", 1))
    assert table.topology() == (1, 2) and table.rank(0, 0).epoch == 2


def test_bootstrap_service_over_grpc() -> None:
    server = BootstrapServer(TOKEN)
    port = server.start()
    client = BootstrapClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(BootstrapError) as exc:
            client.topology()
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE
        client.register(0, 0, 1, 1, RankEntry("tcp://x:1", "prefill/dp0/tp0", 7), TOKEN)
        assert client.topology() == (1, 1)
        assert client.rank(0, 0) == RankEntry("tcp://x:1", "prefill/dp0/tp0", 7)
        with pytest.raises(BootstrapError) as exc:
            client.rank(0, 3)
        assert exc.value.code == grpc.StatusCode.NOT_FOUND
    finally:
        client.close()
        server.stop()


def test_decode_confirms_rooms_completed_together_in_one_status() -> None:
    """Rooms whose last chunks the control thread handled in one pass are confirmed to their prefill rank by one
    Status (``DecodeRooms.flush``), not one each."""
    import threading
    from types import SimpleNamespace

    from kvtransfer.args import KVTransferConfig
    from kvtransfer.backends.base import PeerKey
    from kvtransfer.decode_rooms import DecodeRooms, RecvRoom, Source
    from kvtransfer.messages import Status
    from kvtransfer.pages import HeadSlice

    config = KVTransferConfig(backend="fake", cluster_token=TOKEN)
    sent: list[tuple[PeerKey, object]] = []
    mgr = SimpleNamespace(lock=threading.RLock(), stamp=lambda: {"instance_id": "d", "epoch": 1},
                          send_to=lambda key, msg: sent.append((key, msg)), metadata=MetadataBuffers(4), config=config)
    rooms = DecodeRooms(mgr)  # type: ignore[arg-type]
    peer, other = SimpleNamespace(key=PeerKey("p", 1)), SimpleNamespace(key=PeerKey("q", 1))
    for slot, (room, src) in enumerate(((7, peer), (9, peer), (11, other))):
        rec = rooms.rooms[room] = RecvRoom(room=room, config=config, now=0.0, metadata_slot=slot,
                                          sources=[Source(0, HeadSlice(0, 0, 1), key=src.key)])
        rec.advance(KVPoll.WaitingForInput, 0.0)
    for room, src in ((7, peer), (9, peer), (11, other)):  # the last chunk of each, handled in one pass
        rooms.handle(ChunkDone(instance_id="p", epoch=1, room=room, chunk_id=0, num_pages=1, num_chunks=1,
                               metadata=MetadataRecord(room=room, first_token=5)), src)  # type: ignore[arg-type]
    assert all(rooms.rooms[r].state == KVPoll.Success for r in (7, 9, 11)) and not sent
    rooms.flush()
    got = {key.instance_id: (msg.room, msg.rooms, msg.state) for key, msg in sent if isinstance(msg, Status)}
    assert got == {"p": (7, [9], KVPoll.Success), "q": (11, [], KVPoll.Success)} and len(sent) == 2
    rooms.flush()
    assert len(sent) == 2  # nothing left to confirm
