"""``tcp`` striping: a large job is cut into stripes of consecutive pages, each on its own connection and thread.

``stripe_bytes`` is made tiny so the tests' small jobs stripe (the default only stripes jobs of >= 8 MiB).
"""

from __future__ import annotations

import argparse

import pytest
import torch

from common.config import ServerArgs, add_server_args, server_args_from_cli
from common.errors import ConfigError
from common.kv_backends import KV_TRANSFER_BACKENDS, int_option
from kvtransfer.backends.staging import DEFAULT_SEGMENT_BYTES, expand_pages
from kvtransfer.node import kv_transfer_config
from kvtransfer.pages import PageRun, split_runs
from kvtransfer.testing import (
    PAGE_SIZE,
    kv_config,
    make_args,
    transfer_interleaved_rooms,
)
from tests.kvtransfer import test_kvtransfer_faults as faults
from tests.kvtransfer import test_kvtransfer_staged as staged
from tests.kvtransfer.test_kvtransfer_backends_extra import Pair

PAGE_BYTES = 4 * PAGE_SIZE * 2 * 8 * 2  # 4 buffers (2 layers, K and V), 2 heads x 8 dims, bf16
STRIPED = {"backend_options": {"streams": "3", "stripe_bytes": str(2 * PAGE_BYTES)}}
EVERY_JOB = {"backend_options": {"streams": "3", "stripe_bytes": "1"}}  # every job of >= 2 pages stripes
STRIPED_STAGED = {"backend_options": {"streams": "2", "stripe_bytes": "1", "stage": "always",
                                      "stage_bytes": str(2 * PAGE_BYTES)}}
NUM_PAGES = 64 * 5 + 16
pytestmark = pytest.mark.usefixtures("no_threads_left")


def _pages(buf: torch.Tensor, page: int) -> torch.Tensor:
    return buf[page * PAGE_SIZE:(page + 1) * PAGE_SIZE]


def _all(args) -> tuple[torch.Tensor, ...]:
    return (*args.k_buffers, *args.v_buffers)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 6, 7])
def test_split_runs_keeps_every_page_in_order_in_near_equal_stripes(parts: int) -> None:
    runs = [PageRun(7, 20, 3), PageRun(3, 40, 1), PageRun(40, 2, 3)]
    stripes = split_runs(runs, parts)
    assert len(stripes) == parts
    sizes = [sum(r.num_pages for r in s) for s in stripes]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    flat = [r for s in stripes for r in s]
    assert expand_pages([(r.src_page, r.num_pages) for r in flat]) == [7, 8, 9, 3, 40, 41, 42]
    assert expand_pages([(r.dst_page, r.num_pages) for r in flat]) == [20, 21, 22, 40, 2, 3, 4]
    assert all(r.num_pages > 0 for r in flat)
    with pytest.raises(ValueError, match="8 stripes"):
        split_runs(runs, 8)
    assert split_runs([], 1) == [()]
    assert split_runs([PageRun(1, 1, 0), PageRun(5, 6, 3)], 2) == [(PageRun(5, 6, 2),), (PageRun(7, 8, 1),)]


def test_only_jobs_of_two_stripes_stripe_and_every_stream_gets_its_own_connection() -> None:
    src, dst = make_args(1, 48), make_args(2, 48)
    before = [b.clone() for b in _all(dst)]
    pair = Pair("tcp", src, dst, **STRIPED)
    try:
        backend = pair.prefill
        one_page = pair.job(1, 0, [5], [30])
        three = pair.job(1, 1, [6, 7, 8], [31, 32, 33])
        big = pair.job(1, 2, list(range(10, 20)), list(range(1, 11)))
        assert [len(backend._stripes(j)) for j in (one_page, three, big)] == [1, 1, 3]  # type: ignore[attr-defined]
        for job in (one_page, three, big):
            pair.prefill.submit(job)
        assert pair.events.wait(3) == [(one_page, None), (three, None), (big, None)]
        assert len(pair.decode._accepted) == 3  # type: ignore[attr-defined]
        moved = dict(zip([5, 6, 7, 8, *range(10, 20)], [30, 31, 32, 33, *range(1, 11)], strict=True))
        for s, d, old in zip(_all(src), _all(dst), before, strict=True):
            for sp, dp in moved.items():
                assert torch.equal(_pages(d, dp), _pages(s, sp))
            for p in set(range(dst.num_pages)) - set(moved.values()):
                assert torch.equal(_pages(d, p), _pages(old, p))
    finally:
        pair.close()


@pytest.mark.parametrize("overrides", [EVERY_JOB, STRIPED_STAGED], ids=["striped", "striped-staged"])
def test_64_interleaved_rooms_land_byte_exact_on_several_streams(overrides: dict) -> None:
    def several_connections(decode_mgr) -> None:
        assert len(decode_mgr.backend._accepted) >= 2

    transfer_interleaved_rooms("tcp", overrides, seed=7, num_pages=NUM_PAGES, check=several_connections)


def test_striped_head_slices_land_and_jobs_complete_in_submission_order() -> None:
    staged.head_slices_land_and_jobs_complete_in_order({"backend_options": {"streams": "4", "stripe_bytes": "1"}},
                                                       stripes=4)


def test_a_lost_stripe_fails_its_job_after_the_others_land_and_the_next_job_reopens_that_stream() -> None:
    src, dst = make_args(1, 48), make_args(2, 48)
    pair = Pair("tcp", src, dst, **STRIPED)
    receive_chunk = pair.decode._receive_chunk  # type: ignore[attr-defined]

    def drop_third_stripe_of_room_2(sock, header):
        if header.room == 2 and header.dst_runs[0][0] == 26:  # pages 20..28 stripe as 20-22, 23-25, 26-28
            raise OSError("injected: the third stream's connection is reset mid-job")
        return receive_chunk(sock, header)

    pair.decode._receive_chunk = drop_third_stripe_of_room_2  # type: ignore[attr-defined]
    try:
        second = pair.job(2, 0, list(range(10, 19)), list(range(20, 29)))
        pair.prefill.submit(second)
        done = pair.events.wait(1)
        assert done[0][0] is second and "lost" in (done[0][1] or ""), done
        for s, d in zip(_all(src), _all(dst), strict=True):  # the other two stripes landed before the report
            for p in range(10, 16):
                assert torch.equal(_pages(d, p + 10), _pages(s, p))
        third = pair.job(3, 0, list(range(30, 39)), list(range(30, 39)))
        pair.prefill.submit(third)
        assert pair.events.wait(2)[1] == (third, None)
        for s, d in zip(_all(src), _all(dst), strict=True):
            for p in range(30, 39):
                assert torch.equal(_pages(d, p), _pages(s, p))
    finally:
        pair.close()


@pytest.mark.slow
def test_receiver_killed_mid_striped_transfer_fails_sender_within_deadline() -> None:
    faults.receiver_killed_mid_transfer("tcp", **STRIPED)


@pytest.mark.parametrize("options, message", [
    ({"streams": "0"}, "streams must be an integer between 1 and 8, got '0'"),
    ({"streams": "9"}, "between 1 and 8"),
    ({"streams": "two"}, "got 'two'"),
    ({"stripe_bytes": "0"}, "stripe_bytes must be an integer >= 1"),
    ({"stage_bytes": "16M"}, "stage_bytes must be an integer >= 1, got .16M."),
    ({"stage": "sometimes"}, "stage must be one of auto, always, got 'sometimes'"),
])
def test_bad_stripe_settings_are_refused_naming_the_setting(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Pair("tcp", make_args(1, 8), make_args(2, 8), backend_options=options)


def test_option_defaults_are_the_table_s_and_the_stager_s() -> None:
    defaults = {k: o.default for k, o in KV_TRANSFER_BACKENDS["tcp"].options.items()}
    assert defaults == {"stage": "auto", "stage_bytes": str(DEFAULT_SEGMENT_BYTES), "streams": "2",
                        "stripe_bytes": str(4 << 20)}
    assert int_option("tcp", {}, "streams") == 2 and int_option("tcp", {"streams": "5"}, "streams") == 5


def test_kv_transfer_options_come_from_the_cli_and_unknown_ones_are_refused() -> None:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    ns = parser.parse_args(["--kv-transfer-option", "streams=4", "--kv-transfer-option", "stripe_bytes=65536"])
    args = server_args_from_cli(ns)
    assert args.kv_transfer_options == {"streams": "4", "stripe_bytes": "65536"}
    config = kv_transfer_config(args, {"architecture": "TinyLlama"})
    assert dict(config.backend_options) == {"streams": "4", "stripe_bytes": "65536"}
    mooncake = ServerArgs(kv_transfer_backend="mooncake", kv_transfer_option=("mooncake_protocol=rdma",))
    assert mooncake.kv_transfer_options == {"mooncake_protocol": "rdma"}
    with pytest.raises(ConfigError, match="'streams' is not a setting of the shm KV transfer backend; it takes "
                                          "landing_signal"):
        ServerArgs(kv_transfer_backend="shm", kv_transfer_option=("streams=2",))
    with pytest.raises(ConfigError, match="'streams' is not a setting of the fake KV transfer backend; it takes none"):
        ServerArgs(kv_transfer_backend="fake", kv_transfer_option=("streams=2",))
    with pytest.raises(ConfigError, match="it takes stage, stage_bytes, streams, stripe_bytes"):
        ServerArgs(kv_transfer_option=("stream=2",))
    with pytest.raises(ConfigError, match="must be KEY=VALUE, got 'streams'"):
        ServerArgs(kv_transfer_option=("streams",))
    with pytest.raises(ConfigError, match="given twice"):
        ServerArgs(kv_transfer_option=("streams=2", "streams=3"))
    with pytest.raises(ConfigError, match="backend_options 'ucx_tls' is not a setting of the tcp KV transfer"):
        kv_config("tcp", backend_options={"ucx_tls": "tcp"})
    with pytest.raises(ConfigError, match="--kv-transfer-option streams must be an integer between 1 and 8, got 'x'"):
        ServerArgs(kv_transfer_option=("streams=x",))  # refused with the flags, before any model loads
    with pytest.raises(ConfigError, match="mooncake_protocol must be one of tcp, rdma, got 'ib'"):
        ServerArgs(kv_transfer_backend="mooncake", kv_transfer_option=("mooncake_protocol=ib",))
