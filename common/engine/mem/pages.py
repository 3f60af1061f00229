"""Page arithmetic over the paged KV pool: page counts and a request's page numbers (the bytes a page moves in a
transfer: ``kvtransfer.args.KVArgs.model_bytes_per_page``).

Invariant relied on (the allocator's alignment): slot % page_size == position % page_size, so the first slot of
each page-aligned position run names its page (slot // page_size).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.engine.req import Req


def num_pages(num_tokens: int, page_size: int) -> int:
    """Pages needed to hold ``num_tokens`` positions."""
    return -(-num_tokens // page_size)


def req_pages(req_to_token: torch.Tensor, req: Req, first_page: int, num_tokens: int, page_size: int) -> list[int]:
    """Page numbers holding positions [first_page * page_size, num_tokens) of ``req``."""
    row = req_to_token[req.req_pool_idx]
    return (row[first_page * page_size : num_tokens : page_size] // page_size).tolist()

