"""Move a verified tree's accepted path to consecutive positions in the KV pool.

The verify wrote draft j's KV at the slot of position ``committed + 1 + j`` (rows in node order). The accepted path
``p_1 .. p_m`` (draft indices, increasing: a parent precedes its children) must end at positions
``committed + 1 .. committed + m``, where the request's next steps read it::

    slots:  [root | d_0 | d_1 | d_2 | d_3 ...]     path (d_1, d_3):  slot(d_1) -> slot of d_0, slot(d_3) -> slot of d_1

``p_i >= i - 1`` and the copy reads every source before writing any destination, so no source is overwritten
before it is read. Only the slot contents move; ``req_to_token`` and page ownership stay as they are.
"""

from __future__ import annotations

import torch

from common.engine.mem.kv_pool import MHATokenToKVPool


def path_moves(slots: list[int], path: list[int]) -> tuple[list[int], list[int]]:
    """(sources, destinations) for one request: ``slots`` its verify rows' slots (root first), ``path`` its accepted
    draft indices. Drafts already in place are left out."""
    src, dst = [], []
    for i, j in enumerate(path):
        if j != i:
            src.append(slots[1 + j])
            dst.append(slots[1 + i])
    return src, dst


def compact_path_kv(pools: list[MHATokenToKVPool], src: list[int], dst: list[int]) -> None:
    """Copy slot ``src[i]`` to ``dst[i]`` in every layer of ``pools``."""
    if not src:
        return
    device = pools[0].device
    s, d = torch.tensor(src, device=device), torch.tensor(dst, device=device)
    for pool in pools:
        for buf in (*pool.k_buffer, *pool.v_buffer):
            buf[d] = buf[s]  # NOTE: buf[s] is a copy: every source is read before any destination is written
