"""Landing signals of the ``shm`` backend on CPU buffers (``landing_signal=on``; kvtransfer/backends/signals.py,
kvtransfer/landing.py): in-process managers over one Bootstrap service, 127.0.0.1, the prefill side's copies slowed down so that the
order of events is observable. A signalled chunk's ChunkDone leaves before its copy; decode takes the chunk (and
confirms the room) only once its signal is set; prefill's room succeeds (its pages may be freed) only after its
copies landed, even if decode confirmed early; a copy that fails after its announcement fails the room naming the
prefill rank; a side that cannot set the signals up falls back to ChunkDone after the landing, with a warning (CPU
pools by default too: ``auto`` leaves the signals to GPU pools)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
import torch

from common.errors import ConfigError
from common.kv_backends import check_options
from kvtransfer.backends import signals
from kvtransfer.backends.shm import ShmFileBackend
from kvtransfer.backends.workers import TransferError
from kvtransfer.bootstrap import BootstrapServer
from kvtransfer.decode_rooms import DecodeRooms
from kvtransfer.landing import LandingWatch
from kvtransfer.manager import KVManager
from kvtransfer.poll import KVPoll
from kvtransfer.prefill_rooms import PrefillRooms
from kvtransfer.receiver import KVReceiver
from kvtransfer.sender import KVSender
from kvtransfer.testing import DECODE_SEED, PAGE_SIZE, PREFILL_SEED, TOKEN, kv_config, make_args, plan_rooms

NUM_PAGES = 24
SLOW_S = 0.15  # each prefill copy sleeps this long first
WAIT_S = 10.0
# No heartbeat arrives within a run's wait: a confirmation must leave when its chunk landed, not with the next message.
QUIET = {"heartbeat_interval_s": 30.0}
ON = {"landing_signal": "on"}


class Trace:
    """Monotonic times of the events of one run: copies landed, ChunkDones arrived, chunks taken by decode."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fail_copies: bool = False) -> None:
        self.landed: dict[tuple[int, int], float] = {}
        self.arrived: dict[tuple[int, int], tuple[float, int]] = {}  # (room, chunk) -> (time, signal)
        self.taken: dict[tuple[int, int], float] = {}
        copy, chunk, take = ShmFileBackend._copy, LandingWatch.chunk, DecodeRooms._chunk_done

        def slow_copy(backend, job, mapping):
            time.sleep(SLOW_S)
            if fail_copies:
                raise TransferError("the test's copy failed")
            copy(backend, job, mapping)
            self.landed[(job.room, job.chunk_id)] = time.monotonic()

        def arrive(watch, rec, source, msg, now):
            self.arrived[(rec.room, msg.chunk_id)] = (time.monotonic(), msg.signal)
            chunk(watch, rec, source, msg, now)

        def taken(rooms, rec, source, msg, now):
            self.taken[(rec.room, msg.chunk_id)] = time.monotonic()
            take(rooms, rec, source, msg, now)

        monkeypatch.setattr(ShmFileBackend, "_copy", slow_copy)
        monkeypatch.setattr(LandingWatch, "chunk", arrive)
        monkeypatch.setattr(DecodeRooms, "_chunk_done", taken)


class Pair:
    """A prefill and a decode manager with the shm backend (CPU pools), each with its own backend options."""

    def __init__(self, prefill_options: dict[str, str], decode_options: dict[str, str], device: str = "cpu") -> None:
        self.server = BootstrapServer(TOKEN)
        self.addr = f"127.0.0.1:{self.server.start()}"
        self.src = make_args(PREFILL_SEED, NUM_PAGES, device=device)
        self.dst = make_args(DECODE_SEED, NUM_PAGES, device=device)
        self.prefill = KVManager(self.src, kv_config("shm", backend_options=prefill_options, **QUIET), PrefillRooms,
                                 bootstrap_addr=self.addr)
        self.decode = KVManager(self.dst, kv_config("shm", backend_options=decode_options, **QUIET), DecodeRooms)

    def run(self, chunks: int = 2, check: bool = True) -> tuple[KVSender, KVReceiver, float]:
        """One room of ``chunks`` chunks; returns the handles and when the sender reached a final state. ``check``:
        the pages are in place when the receiver reaches Success."""
        plan = plan_rooms(1, NUM_PAGES - 1, NUM_PAGES - 1, pages_per_room=6, seed=5, max_chunks=chunks)[0]
        sender, receiver = KVSender(self.prefill, plan.room), KVReceiver(self.decode, plan.room, self.addr)
        receiver.init(0)
        receiver.send_metadata(plan.dst_pages, plan.slot)
        _wait(lambda: sender.poll() >= KVPoll.WaitingForInput, "the sender's TransferInfo")
        sender.init(len(plan.src_pages), plan.slot)
        start = 0
        for k, n in enumerate(plan.chunks):
            last = k == len(plan.chunks) - 1
            sender.send(plan.src_pages[start:start + n], last=last, metadata=plan.metadata() if last else None)
            start += n
        done: dict[str, float] = {}
        end = time.monotonic() + 5.0
        while len(done) < 2 and time.monotonic() < end:
            for name, handle in (("sender", sender), ("receiver", receiver)):
                if name not in done and handle.poll().is_final:
                    done[name] = time.monotonic()
                    if check and name == "receiver" and receiver.poll() == KVPoll.Success:
                        self.check_pages(plan.src_pages, plan.dst_pages)  # landed before decode said Success
            time.sleep(0.0005)
        assert len(done) == 2, (sender.poll(), receiver.poll())
        return sender, receiver, done["sender"]

    def check_pages(self, src_pages: list[int], dst_pages: list[int]) -> None:
        for s, d in zip((*self.src.k_buffers, *self.src.v_buffers), (*self.dst.k_buffers, *self.dst.v_buffers),
                        strict=True):
            for sp, dp in zip(src_pages, dst_pages, strict=True):
                assert torch.equal(d[dp * PAGE_SIZE:(dp + 1) * PAGE_SIZE].cpu(),
                                   s[sp * PAGE_SIZE:(sp + 1) * PAGE_SIZE].cpu())

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()
        self.server.stop()


@pytest.fixture
def make_pair() -> Iterator:
    pairs: list[Pair] = []

    def make(prefill: dict[str, str] | None = None, decode: dict[str, str] | None = None) -> Pair:
        pairs.append(Pair(ON if prefill is None else prefill, ON if decode is None else decode))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def _wait(predicate, what: str) -> None:
    end = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def _quiesced(*handles: KVSender | KVReceiver) -> None:
    _wait(lambda: all(h.is_quiesced() for h in handles), "both rooms quiesced")


def test_chunk_done_leaves_before_the_copy_and_decode_takes_the_chunk_after_it_landed(monkeypatch, make_pair) -> None:
    trace = Trace(monkeypatch)
    pair = make_pair()
    sender, receiver, sender_done = pair.run(chunks=2)
    assert sender.poll() == KVPoll.Success and receiver.poll() == KVPoll.Success, (sender.failure(),
                                                                                   receiver.failure())
    assert sorted(trace.arrived) == sorted(trace.landed) == sorted(trace.taken) and len(trace.landed) == 2
    for chunk, landed in trace.landed.items():
        arrived, signal = trace.arrived[chunk]
        assert signal > 0 and arrived < landed, (chunk, signal, arrived, landed)  # announced while copying
        assert trace.taken[chunk] >= landed, chunk  # decode waited for the signal
    assert sender_done >= max(trace.landed.values())
    _quiesced(sender, receiver)


def test_prefill_succeeds_only_after_its_copies_landed_even_if_decode_confirms_early(monkeypatch, make_pair) -> None:
    trace = Trace(monkeypatch)
    monkeypatch.setattr(signals.HostSignalReader, "landed", lambda reader, seq: True)  # a decode that does not wait
    pair = make_pair()
    sender, receiver, sender_done = pair.run(chunks=1, check=False)
    assert sender.poll() == KVPoll.Success, sender.failure()
    assert min(t for t, _ in trace.arrived.values()) < max(trace.landed.values()) <= sender_done
    _quiesced(sender, receiver)


def test_a_copy_failed_after_its_announcement_fails_the_room_naming_the_prefill_rank(monkeypatch, make_pair) -> None:
    trace = Trace(monkeypatch, fail_copies=True)
    pair = make_pair()
    sender, receiver, _ = pair.run(chunks=1)
    assert sender.poll() == KVPoll.Failed and receiver.poll() == KVPoll.Failed
    assert pair.prefill.instance_id in receiver.failure(), receiver.failure()
    assert all(signal > 0 for _, signal in trace.arrived.values()) and not trace.taken
    _quiesced(sender, receiver)


def test_the_signal_word_says_landed_failed_or_overwritten(tmp_path) -> None:
    ring = signals.HostSignalRing(tmp_path, "pdcluster-kv-", size=4)
    reader = signals.HostSignalReader(ring.describe())
    try:
        seqs = [ring.next() for _ in range(6)]
        assert not reader.landed(seqs[0])
        ring.set(seqs[0], True)
        ring.set(seqs[1], False)
        assert reader.landed(seqs[0])
        with pytest.raises(TransferError, match="failed on the prefill side"):
            reader.landed(seqs[1])
        ring.set(seqs[4], True)  # the slot of seq 1 again
        with pytest.raises(TransferError, match="overwritten"):
            reader.landed(seqs[0])
    finally:
        reader.close()
        ring.close()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("side", ["decode off", "prefill cannot make", "decode cannot map", "cpu default"])
def test_without_signals_chunk_done_follows_the_landing_with_a_warning(monkeypatch, make_pair, caplog,
                                                                       side: str) -> None:
    def refuse(*args, **kwargs):
        raise OSError("refused by the test")

    if side == "prefill cannot make":
        monkeypatch.setattr(signals.HostSignalRing, "__init__", refuse)
    elif side == "decode cannot map":
        monkeypatch.setattr(signals.HostSignalReader, "__init__", refuse)
    trace = Trace(monkeypatch)
    caplog.set_level(logging.WARNING, logger="kvtransfer.backends.shm")
    pair = make_pair(decode={"landing_signal": "off"} if side == "decode off" else None) if side != "cpu default" \
        else make_pair({}, {})
    sender, receiver, _ = pair.run(chunks=2)
    assert sender.poll() == KVPoll.Success and receiver.poll() == KVPoll.Success
    for chunk, landed in trace.landed.items():
        arrived, signal = trace.arrived[chunk]
        assert signal == 0 and arrived >= landed, (chunk, signal)
    if side not in ("decode off", "cpu default"):
        assert "landing signals" in caplog.text, caplog.text
    _quiesced(sender, receiver)
    with pytest.raises(ConfigError, match="landing_signal must be one of auto, on, off"):
        check_options("shm", {"landing_signal": "yes"})
