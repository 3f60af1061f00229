"""Host/device separation, checked on CPU: the whole scheduler runs with the model, KV pool and every per-step
tensor on PyTorch's ``meta`` device (shapes only, no data) while its bookkeeping stays on the host.

``HostDeviceGuard`` fails any torch call that mixes a device (meta) tensor with a non-scalar host tensor — on a GPU
that is a crash ("Expected all tensors to be on the same device") or a hidden synchronous copy — and counts reads
of device data (``tolist``/``item``/``bool``/...): at most one per scheduler step (the sampled ids). Reads return
made-up values (token 5), so the test checks plumbing, not numbers; the CPU engine tests check numbers.

The attention backend is replaced by a meta-safe double that reads the ForwardBatch contract fields
(``req_to_token``, ``req_pool_indices``, ``out_cache_loc``, ``kv_pool``): the real backends are covered by their
own tests on real data.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import common.engine.model_runner as model_runner
from common.config import ServerArgs
from common.engine.forward_batch import ForwardBatch
from common.engine.io_struct import GenerateReqInput, TokenOut
from common.engine.mem.req_to_token_pool import ReqToTokenPool
from common.engine.sampling.params import SamplingParams
from common.engine.scheduler import Scheduler
from common.text.tokenizer import load_tokenizer
from tests.model_fixtures import make_tiny_model

META = torch.device("meta")
FAKE_TOKEN = 5
READS = {
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
}


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    if isinstance(x, dict):
        return [t for item in x.values() for t in _tensors(item)]
    return []


class HostDeviceGuard(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = _tensors(args) + _tensors(kwargs)
        on_device = [t for t in tensors if t.device.type == "meta"]
        if on_device and func in READS:
            self.reads += 1
            if func is torch.Tensor.tolist:
                return torch.full(on_device[0].shape, FAKE_TOKEN).tolist()
            raise AssertionError(f"{func.__name__} reads device data outside the step's one read")
        if func is torch.Tensor.to and on_device and _targets_host(args, kwargs):
            raise AssertionError("a device tensor is copied back to the host inside a step")
        host = [t for t in tensors if t.device.type == "cpu" and t.dim() > 0]
        if on_device and host:
            raise AssertionError(
                f"{getattr(func, '__name__', func)} mixes device tensors with host tensors of shape "
                f"{[tuple(t.shape) for t in host]}: build them on the device or ship them with the step's copy"
            )
        return func(*args, **kwargs)


def _targets_host(args: Any, kwargs: Any) -> bool:
    targets = [a for a in (*args[1:], kwargs.get("device")) if isinstance(a, (str, torch.device))]
    return any(torch.device(t).type == "cpu" for t in targets)


class MetaSafeAttention:
    """Writes the new K/V and gathers every request's keys through the contract fields; output = q."""

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        assert fb.req_to_token.device == META and fb.req_pool_indices.device == META
        fb.attn_metadata = fb.req_to_token.index_select(0, fb.req_pool_indices)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch) -> Any:
        fb.kv_pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        keys = fb.kv_pool.get_key_buffer(layer_id).index_select(0, fb.attn_metadata.reshape(-1))
        assert keys.device == META
        return q.reshape(q.shape[0], -1)


@pytest.fixture
def meta_scheduler(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(model_runner, "rank_device", lambda args, dp_rank, tp_rank=0: META)
    path = str(make_tiny_model("llama"))
    outs: list[TokenOut] = []
    args = ServerArgs(page_size=4, max_total_tokens=512, chunked_prefill_size=16, enable_mixed_chunk=True,
                      max_running_requests=8)
    sched = Scheduler(args, path, load_tokenizer(path), outs.extend)
    sched.runner.attn_backend = MetaSafeAttention()
    assert sched.runner.kv_pool.k_buffer[0].device == META
    return sched, outs


def _req(rid: str, ids: list[int], max_new: int, **params: Any) -> GenerateReqInput:
    sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **params)
    return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=sp, return_logprob=params.get("seed") == 3,
                            top_logprobs_num=2 if params.get("seed") == 3 else 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_steps_keep_host_and_device_apart(meta_scheduler: Any, overlap: bool) -> None:
    sched, outs = meta_scheduler
    sched.overlap = overlap
    forward_reads: list[int] = []
    if overlap:  # the forward runs on the forward thread; a TorchFunctionMode is per thread
        forward = sched.runner.launch

        def guarded_forward(b: Any) -> Any:
            with HostDeviceGuard() as g:
                result = forward(b)
            forward_reads.append(g.reads)
            return result

        sched.runner.launch = guarded_forward
    shared = list(range(10, 30))
    first = [
        _req("greedy", [*shared, 3, 4, 5], 6, temperature=0.0),
        _req("long", list(range(40, 80)), 4, temperature=0.0),  # 40 tokens: chunked prefill (chunk 16)
        _req("seeded", [7, 8, 9], 5, temperature=0.8, top_k=8, top_p=0.9, seed=3),  # logprobs + top logprobs
        _req("penalised", [11, 12], 5, temperature=0.0, repetition_penalty=1.3, min_new_tokens=2),
    ]
    # Arrives while the others decode: a mixed chunk with a radix cache hit.
    later = [_req("prefix-hit", [*shared, 6], 3, temperature=0.0)]
    guard = HostDeviceGuard()
    steps = 0
    with guard:
        for i in range(200):
            guard.reads = 0
            ran = sched.step(first if i == 0 else later if i == 3 else [])
            assert guard.reads <= 1, f"step {i} read device data {guard.reads} times"
            assert guard.reads == (1 if ran and not overlap else 0)
            steps += ran
            if i > 3 and sched.is_idle():
                break
    finished = {o.rid: o for o in outs if o.finish_reason is not None}
    assert set(finished) == {"greedy", "long", "seeded", "penalised", "prefix-hit"}, outs
    assert all(o.error is None for o in finished.values())
    tokens: dict[str, list[int]] = {}
    for o in outs:
        tokens.setdefault(o.rid, []).extend(o.token_ids)
    assert tokens["greedy"] == [FAKE_TOKEN] * 6 and len(tokens["seeded"]) == 5
    assert steps > 5
    assert not overlap or (forward_reads and set(forward_reads) == {1}), forward_reads
    # Every pool back at its free count.
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size
    sched.tree_cache.evict(sched.allocator.size)
    assert sched.allocator.available_size() == sched.allocator.size


def test_guard_catches_a_device_table_indexed_by_host_tensors() -> None:
    """The guard fails the pattern that crashed on the GPU: a device table combined with host index tensors."""
    table = torch.zeros(4, 8, dtype=torch.int64, device=META)
    cols = torch.tensor([2, 0])
    with HostDeviceGuard(), pytest.raises(AssertionError, match="mixes device tensors with host tensors"):
        locs = table[torch.tensor([0, 1]), cols.clamp(min=0)]
        torch.where(cols >= 0, locs, -1)


def test_device_mirror_receives_exactly_the_host_writes() -> None:
    """The mirror (here a second CPU tensor standing in for the device) equals the host table after each sync."""
    pool = ReqToTokenPool(4, 16, "cpu")
    pool.mirrored = True
    pool.device_req_to_token = torch.zeros_like(pool.req_to_token)

    def sync() -> None:
        updates = pool.take_updates()
        if updates is not None:
            pool.device_req_to_token.view(-1)[updates[0]] = updates[1]
        assert torch.equal(pool.device_req_to_token, pool.req_to_token)
        assert pool.take_updates() is None

    rows = pool.alloc(3)
    assert rows is not None
    pool.write(rows[0], 0, torch.arange(100, 105))
    pool.write(rows[1], 2, [7, 8, 9])
    sync()
    pool.write_points([rows[0], rows[1]], [5, 5], torch.tensor([42, 43]))
    pool.free(rows[0])
    again = pool.alloc(1)
    assert again == [rows[0]]
    pool.write(again[0], 0, [1, 2, 3, 4, 5, 6])  # the same positions written twice before a sync: last wins
    sync()


class SeparateMirrorPool(ReqToTokenPool):
    """A pool whose 'device' mirror is a second CPU tensor: attention then reads only what was shipped."""

    def __init__(self, size: int, max_context_len: int, device: Any = "cpu") -> None:
        super().__init__(size, max_context_len, device)
        self.mirrored = True
        self.device_req_to_token = torch.full_like(self.req_to_token, -7)  # stale values would index garbage


@pytest.mark.parametrize(("page_size", "disable_radix", "max_total"), [(16, False, 4096), (4, False, 4096),
                                                                        (1, True, 400)])
def test_mirror_fed_only_by_shipped_updates_gives_the_same_tokens(
    engine_factory: Any, monkeypatch: pytest.MonkeyPatch, page_size: int, disable_radix: bool, max_total: int
) -> None:
    """Every write of the host table reaches the mirror: with a separate mirror, chunked prefill, prefix hits,
    mixed batches and retraction give the same greedy tokens as the shared table, and before every forward the
    mirror rows of the batch equal the host rows."""
    rng = torch.Generator().manual_seed(5)
    shared = torch.randint(10, 1000, (70,), generator=rng).tolist()
    prompts = [shared + torch.randint(10, 1000, (n,), generator=rng).tolist() for n in (3, 30, 1, 55)]
    prompts += [torch.randint(10, 1000, (n,), generator=rng).tolist() for n in (20, 90, 45)]
    args = {"page_size": page_size, "chunked_prefill_size": 32, "enable_mixed_chunk": True,
            "disable_radix_cache": disable_radix, "max_total_tokens": max_total, "max_running_requests": 8}
    params = {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}
    path = make_tiny_model("llama")
    reference = [o.output_ids for o in engine_factory(path, **args).generate(input_ids=prompts,
                                                                             sampling_params=params)]

    monkeypatch.setattr(model_runner, "ReqToTokenPool", SeparateMirrorPool)
    checked = []
    original = model_runner.ModelRunner._forward_batch

    def checked_forward_batch(self: Any, b: Any) -> ForwardBatch:
        fb = original(self, b)
        pool = self.req_to_token_pool
        for row, n in zip(b.req_pool_indices, b.seq_lens, strict=True):
            assert torch.equal(pool.device_req_to_token[row, :n], pool.req_to_token[row, :n]), (row, n)
        checked.append(len(b.reqs))
        return fb

    monkeypatch.setattr(model_runner.ModelRunner, "_forward_batch", checked_forward_batch)
    engine = engine_factory(path, **args)
    assert isinstance(engine.scheduler.req_to_token_pool, SeparateMirrorPool)
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    assert [o.output_ids for o in outs] == reference
    assert len(checked) > 10
