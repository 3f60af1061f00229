"""The fixed-size metadata record that travels with a request's last chunk, and the decode-side slots it lands in.

One slot per in-flight request (``KVArgs.num_metadata_slots``). A slot holds the room it was written for; the
receiver checks it against its own room before use (a mismatch is context corruption, never silently accepted)
and zeroes the slot when the room is cleared, so a stale record can never validate for a later room.

Extension (EAGLE speculation, ``KVArgs.draft_state_dims`` = (topk, hidden) on both nodes, else (0, 0)): the draft
head's state after the prompt (its top-k at the last prompt position and its feature there), so the decode node
drafts from its first step. Records without it (empty fields) stay valid: a node without a head sends none.
STANDALONE speculation: ``draft_kv_len``, the prompt positions whose draft-model KV travelled with the target's pages
(as more layers, ``KVArgs.from_pool(extra_layers=...)``); 0 from a node without the draft model.
"""

from __future__ import annotations

import threading

import msgspec
import numpy as np

MAX_TOP_LOGPROBS = 20

SLOT_FIELDS = [
    ("room", np.uint64),
    ("first_token", np.int32),
    ("logprob", np.float32),
    ("cached_tokens", np.int32),
    ("num_top", np.int32),
    ("draft_kv_len", np.int32),
    ("top_ids", np.int32, (MAX_TOP_LOGPROBS,)),
    ("top_logprobs", np.float32, (MAX_TOP_LOGPROBS,)),
]
SLOT_DTYPE = np.dtype(SLOT_FIELDS)


class MetadataRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Prefill facts decode needs to continue the request."""

    room: int  # the bootstrap room it belongs to (validated by the receiver)
    first_token: int  # the token prefill sampled
    logprob: float = 0.0  # its logprob
    cached_tokens: int = 0  # prompt tokens prefill found in its prefix cache
    top_ids: tuple[int, ...] = ()  # top logprobs of the first position, if asked (<= MAX_TOP_LOGPROBS)
    top_logprobs: tuple[float, ...] = ()
    # EAGLE's draft state after the prompt (the extension above); empty without a draft head
    draft_topk_ids: tuple[int, ...] = ()
    draft_topk_p: tuple[float, ...] = ()
    draft_hidden: bytes = b""  # float32 little-endian, the head's hidden size
    draft_kv_len: int = 0  # STANDALONE: the draft model's KV of prompt positions [0, draft_kv_len) came with the pages

    def __post_init__(self) -> None:
        if len(self.top_ids) != len(self.top_logprobs) or len(self.top_ids) > MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs: need equal lengths <= {MAX_TOP_LOGPROBS}, got "
                             f"{len(self.top_ids)} ids and {len(self.top_logprobs)} values")


class MetadataBuffers:
    """``num_slots`` fixed-size records; written by the control thread, read by the scheduler thread.
    ``draft_state_dims`` (topk, hidden): room for the EAGLE extension ((0, 0): none)."""

    def __init__(self, num_slots: int, draft_state_dims: tuple[int, int] = (0, 0)) -> None:
        self.draft_topk, self.draft_hidden = draft_state_dims
        fields = list(SLOT_FIELDS)
        if self.draft_topk:
            fields += [("has_draft", np.bool_), ("draft_topk_ids", np.int64, (self.draft_topk,)),
                       ("draft_topk_p", np.float32, (self.draft_topk,)),
                       ("draft_hidden", np.float32, (self.draft_hidden,))]
        self.slots = np.zeros(num_slots, dtype=np.dtype(fields))
        self._lock = threading.Lock()

    def write(self, slot: int, record: MetadataRecord) -> None:
        """Raises ``ValueError`` when the record's draft state does not have this node's dimensions."""
        hidden = np.frombuffer(record.draft_hidden, dtype="<f4")
        has_draft = bool(record.draft_topk_ids)
        if has_draft and (not self.draft_topk or len(record.draft_topk_ids) != self.draft_topk
                          or len(record.draft_topk_p) != self.draft_topk or len(hidden) != self.draft_hidden):
            raise ValueError(f"room {record.room}: a draft state of top-{len(record.draft_topk_ids)} and hidden "
                             f"{len(hidden)}, this node holds top-{self.draft_topk} and hidden {self.draft_hidden}")
        n = len(record.top_ids)
        with self._lock:
            row = self.slots[slot]
            row["room"], row["first_token"], row["logprob"] = record.room, record.first_token, record.logprob
            row["cached_tokens"], row["num_top"], row["draft_kv_len"] = record.cached_tokens, n, record.draft_kv_len
            row["top_ids"][:n], row["top_logprobs"][:n] = record.top_ids, record.top_logprobs
            if self.draft_topk:
                row["has_draft"] = has_draft
                if has_draft:
                    row["draft_topk_ids"], row["draft_topk_p"] = record.draft_topk_ids, record.draft_topk_p
                    row["draft_hidden"] = hidden

    def read(self, slot: int) -> MetadataRecord:
        with self._lock:
            row = self.slots[slot].copy()
        n = int(row["num_top"])
        draft = bool(self.draft_topk and row["has_draft"])
        return MetadataRecord(room=int(row["room"]), first_token=int(row["first_token"]),
                              logprob=float(row["logprob"]), cached_tokens=int(row["cached_tokens"]),
                              top_ids=tuple(int(x) for x in row["top_ids"][:n]),
                              top_logprobs=tuple(float(x) for x in row["top_logprobs"][:n]),
                              draft_topk_ids=tuple(int(x) for x in row["draft_topk_ids"]) if draft else (),
                              draft_topk_p=tuple(float(x) for x in row["draft_topk_p"]) if draft else (),
                              draft_hidden=row["draft_hidden"].astype("<f4").tobytes() if draft else b"",
                              draft_kv_len=int(row["draft_kv_len"]))

    def room_of(self, slot: int) -> int:
        with self._lock:
            return int(self.slots[slot]["room"])

    def clear(self, slot: int) -> None:
        with self._lock:
            self.slots[slot] = np.zeros((), dtype=self.slots.dtype)
