"""Triton attention over the paged KV pool (the CUDA path): the ``TorchAttentionBackend`` interface, no gathers.

Per forward, ``init_forward_metadata`` picks one kernel for the whole batch and builds its few device operands:

    every extend_len == 1 (decode, or 1-token extends): paged decode attention, split-K: a grid of ``num_kv_splits``
                                                        programs per request and kv head (a host int: the batch
                                                        size's ``grid_kv_splits``, cut to what the longest
                                                        request needs), of which each request uses one per
                                                        ``MIN_KEYS_PER_SPLIT`` keys (decided on the device);
    otherwise (prefill, mixed chunk + decodes):         paged extend attention, decodes as 1-token extends;
                                                        ``q_start`` = exclusive cumsum of ``extend_lens`` (device);
                                                        with ``fb.custom_mask`` (a draft tree's verify) the
                                                        kernel's tree form: ``mask_start`` = exclusive cumsum of
                                                        ``extend_lens ** 2``.

Both kernels read every key, cached prefix and new token alike, from ``req_to_token`` rows (token ``i`` of a request
at slot ``req_to_token[row, i]``), so layers never copy K/V; ``forward`` writes the new K/V to the pool first.
No host<->device sync happens after ``init_forward_metadata``. Triton is imported when the backend is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.forward_batch import ForwardBatch

MAX_KV_SPLITS = 16
# Splits a grid offers each request however large the batch: a long request among many short ones is still spread
# over several programs instead of holding one for its whole context while the rest of the device idles.
MIN_GRID_SPLITS = 4


@dataclass
class TritonAttnMetadata:
    decode: bool
    num_kv_splits: int  # decode only
    q_start: torch.Tensor | None  # extend only: int64 [bs], first row of each request in q
    max_extend_len: int
    custom_mask: torch.Tensor | None = None  # extend only: uint8 view of ``fb.custom_mask``
    mask_start: torch.Tensor | None = None  # with custom_mask: int64 [bs], each request's first mask entry


class TritonAttentionBackend:
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        sliding_window: int | None = None,
        device: str | torch.device = "cuda",
    ) -> None:
        assert num_heads % num_kv_heads == 0
        from common.engine.kernels.decode_attention import MIN_KEYS_PER_SPLIT, decode_attention
        from common.engine.kernels.extend_attention import extend_attention

        self._decode_attention = decode_attention
        self.min_keys_per_split = MIN_KEYS_PER_SPLIT
        self._extend_attention = extend_attention
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.scale = head_dim**-0.5
        device = torch.device(device)
        # Programs that keep the device busy; under the CPU interpreter any small number exercises the splits.
        if device.type == "cuda":
            self.target_programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
        else:
            self.target_programs = 8

    def grid_kv_splits(self, bs: int) -> int:
        """The grid's splits per (request, kv head) for a batch of ``bs``: enough programs to fill the device, at
        least ``MIN_GRID_SPLITS``, at most ``MAX_KV_SPLITS`` (what a CUDA graph of that batch size fixes)."""
        by_occupancy = -(-self.target_programs // (bs * self.num_kv_heads))
        return max(1, min(MAX_KV_SPLITS, max(MIN_GRID_SPLITS, by_occupancy)))

    def num_kv_splits(self, seq_lens: list[int]) -> int:
        """``grid_kv_splits`` cut to what the longest request uses (one split per ``MIN_KEYS_PER_SPLIT`` keys), so a
        batch of short requests launches no programs that would find no keys. Each request uses the same splits as
        under the uncut grid."""
        longest = max(seq_lens)
        if self.sliding_window is not None:
            longest = min(longest, self.sliding_window)
        return max(1, min(self.grid_kv_splits(len(seq_lens)), -(-longest // self.min_keys_per_split)))

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        ext = fb.extend_lens_cpu
        if all(n == 1 for n in ext):
            fb.attn_metadata = TritonAttnMetadata(True, self.num_kv_splits(fb.seq_lens_cpu), None, 1)
        else:
            q_start = torch.cumsum(fb.extend_lens, 0) - fb.extend_lens
            md = TritonAttnMetadata(False, 1, q_start, max(ext))
            if fb.custom_mask is not None:
                squares = fb.extend_lens * fb.extend_lens
                md.custom_mask = fb.custom_mask.view(torch.uint8)
                md.mask_start = torch.cumsum(squares, 0) - squares
            fb.attn_metadata = md

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, fb: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] of the new tokens. Writes k/v to the pool at
        ``fb.out_cache_loc``, then returns attention output [T, heads * head_dim]."""
        fb.kv_pool.set_kv_buffer(layer_id, fb.out_cache_loc, k, v)
        k_buf = fb.kv_pool.get_key_buffer(layer_id)
        v_buf = fb.kv_pool.get_value_buffer(layer_id)
        md: TritonAttnMetadata = fb.attn_metadata
        if q.stride(-1) != 1:
            q = q.contiguous()
        if md.decode:
            out = self._decode_attention(
                q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, fb.seq_lens, self.scale,
                md.num_kv_splits, self.sliding_window,
                out=q.new_empty(q.shape[0], self.num_heads, self.head_dim), page_size=fb.kv_pool.page_size,
            )
        else:
            assert md.q_start is not None
            out = self._extend_attention(
                q, k_buf, v_buf, fb.req_to_token, fb.req_pool_indices, md.q_start, fb.prefix_lens,
                fb.extend_lens, md.max_extend_len, self.scale, self.sliding_window,
                out=q.new_empty(q.shape[0], self.num_heads, self.head_dim),
                custom_mask=md.custom_mask, mask_start=md.mask_start,
                positions=fb.positions if md.custom_mask is not None else None,
            )
        return out.view(q.shape[0], -1)
