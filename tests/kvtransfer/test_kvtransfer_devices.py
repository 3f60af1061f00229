"""Device identity at the data plane, on CPU: pairs that cannot work fail their jobs with an error naming the fix."""

from __future__ import annotations

import threading
import time

import pytest

from kvtransfer.backends.base import PeerInfo, PeerKey, TransferJob
from kvtransfer.backends.devices import device_identity, memory_kind
from kvtransfer.pages import PageRun
from kvtransfer.registry import backend_class
from kvtransfer.testing import kv_config, make_args
from tests.kvtransfer.test_kvtransfer_backends_extra import Events


def _job(peer: PeerKey) -> TransferJob:
    return TransferJob(1, 0, peer, (PageRun(1, 1, 2),))


def _backends(name: str) -> tuple:
    cls, cfg = backend_class(name), kv_config(name)
    src, dst = make_args(1, 16), make_args(2, 16)
    events = Events()
    p_key, d_key = PeerKey("prefill/dp0/tp0", time.time_ns()), PeerKey("decode/dp0/tp0", time.time_ns())
    prefill = cls(src, cfg, "prefill", events, p_key)
    decode = cls(dst, cfg, "decode", Events(), d_key)
    return prefill, decode, events, p_key, d_key, src, dst


def test_cpu_identity_is_empty_and_kind_is_cpu() -> None:
    import torch

    assert device_identity(torch.device("cpu")) == "" and memory_kind(torch.device("cpu")) == "cpu"


def test_nccl_refuses_two_ranks_on_one_gpu_naming_shm_and_tcp() -> None:
    before = set(threading.enumerate())
    prefill, decode, events, p_key, d_key, src, dst = _backends("nccl")
    try:
        prefill._gpu = decode._gpu = "GPU-0000-same"  # as two ranks on one GPU would report
        d_info = PeerInfo(d_key, dst.layout({}), decode.endpoint())
        assert d_info.endpoint["gpu"] == "GPU-0000-same"
        prefill.add_peer(d_info)
        decode.add_peer(PeerInfo(p_key, src.layout({}), prefill.endpoint()))
        prefill.submit(_job(d_key))
        [(_, error)] = events.wait(1)
        assert error and "cannot pair two ranks on one GPU" in error, error
        assert "shm" in error and "tcp" in error and "decode/dp0/tp0" in error, error
        assert not [t for t in set(threading.enumerate()) - before if t.name.startswith(("kv-nccl-prefill", "kv-nccl-decode"))]
    finally:
        prefill.close()
        decode.close()


def test_nccl_refuses_a_peer_on_another_kind_of_memory() -> None:
    prefill, decode, events, _, d_key, _, dst = _backends("nccl")
    try:
        endpoint = {**decode.endpoint(), "memory": "cuda", "gpu": "GPU-other"}
        prefill.add_peer(PeerInfo(d_key, dst.layout({}), endpoint))
        prefill.submit(_job(d_key))
        [(_, error)] = events.wait(1)
        assert error and "cpu KV buffers" in error and "cuda buffers" in error and "tcp" in error, error
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("name", ["shm"])
def test_shm_on_cpu_refuses_a_gpu_peer_naming_tcp(name: str) -> None:
    prefill, decode, events, _, d_key, _, dst = _backends(name)
    try:
        prefill.add_peer(PeerInfo(d_key, dst.layout({}), {**decode.endpoint(), "memory": "cuda"}))
        prefill.submit(_job(d_key))
        [(_, error)] = events.wait(1)
        assert error and "GPU KV buffers" in error and "tcp" in error, error
    finally:
        prefill.close()
        decode.close()


def test_tcp_decode_endpoint_names_its_memory() -> None:
    _, decode, _, _, _, _, _ = _backends("tcp")
    try:
        assert decode.endpoint()["device"] == "cpu"
    finally:
        decode.close()


def test_shm_cuda_page_copy_is_byte_exact_on_cpu() -> None:
    """The copy CUDA IPC runs for whole pages (``page_copier``: one kernel on CUDA, ``PageCopier``; its torch
    reference here, and the kernel itself interpreted in tests/engine/test_triton_kernels.py): every page of every
    buffer lands at its destination page, no other page changes; page ids built from the job's runs in order."""
    import torch

    from common.engine.kernels.kv_pages import page_copier
    from kvtransfer.backends.shm_cuda import page_ids
    from kvtransfer.pages import coalesce_runs

    src, dst = make_args(1, 40), make_args(2, 40)
    s_bufs = [b for pair in zip(src.k_buffers, src.v_buffers, strict=True) for b in pair]
    d_bufs = [b for pair in zip(dst.k_buffers, dst.v_buffers, strict=True) for b in pair]
    before = [b.clone() for b in d_bufs]
    src_pages, dst_pages = [5, 6, 7, 20, 3, 33, 34], [30, 31, 32, 9, 1, 12, 2]
    job = TransferJob(1, 0, PeerKey("d", 1), tuple(coalesce_runs(src_pages, dst_pages)))
    assert page_ids(job).tolist() == [src_pages, dst_pages] and page_ids(job).dtype == torch.int64
    one_run = TransferJob(1, 0, PeerKey("d", 1), tuple(coalesce_runs([4, 5, 6], [8, 9, 10])))
    assert len(one_run.runs) == 1 and page_ids(one_run).tolist() == [[4, 5, 6], [8, 9, 10]]
    page_copier(s_bufs, d_bufs, src.page_size)(page_ids(job))
    ps = src.page_size
    for s, d, old in zip(s_bufs, d_bufs, before, strict=True):
        for sp, dp in zip(src_pages, dst_pages, strict=True):
            assert torch.equal(d[dp * ps:(dp + 1) * ps], s[sp * ps:(sp + 1) * ps])
        for p in set(range(dst.num_pages)) - set(dst_pages):
            assert torch.equal(d[p * ps:(p + 1) * ps], old[p * ps:(p + 1) * ps])
