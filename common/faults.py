"""Test-only fault injection: one request fails at one stage of a rank's work.

``PDCLUSTER_FAULT="stage:rid[,stage:rid...]"`` in a node's environment makes ``inject(stage, rid)`` raise
``InjectedFault`` when that request reaches that stage. Unset (always, outside tests), ``inject`` is one dict lookup.

Stages: ``input`` (building the request), ``token`` (appending a sampled token: sampling results and stop checks),
``transfer`` (a finished KV transfer's callback), ``forward`` (the batch's forward: the rank's state is unknown
afterwards, so the rank dies).
"""

from __future__ import annotations

import os

FAULT_ENV = "PDCLUSTER_FAULT"
STAGES = ("input", "token", "transfer", "forward")


class InjectedFault(RuntimeError):
    """Raised by ``inject``; never raised unless ``PDCLUSTER_FAULT`` names the request."""


def _parse(spec: str) -> dict[str, frozenset[str]]:
    faults: dict[str, set[str]] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        stage, sep, rid = item.partition(":")
        if not sep or stage not in STAGES or not rid:
            raise ValueError(f"{FAULT_ENV}: {item!r} is not STAGE:RID with STAGE one of {', '.join(STAGES)}")
        faults.setdefault(stage, set()).add(rid)
    return {k: frozenset(v) for k, v in faults.items()}


_FAULTS = _parse(os.environ.get(FAULT_ENV, ""))


def inject(stage: str, rid: str) -> None:
    if _FAULTS and rid in _FAULTS.get(stage, ()):
        raise InjectedFault(f"injected {stage} fault for request {rid}")
