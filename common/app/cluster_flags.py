"""``ClusterShape``: the flags of the commands that start a whole cluster, declared once: ``pdcluster up`` takes them
(defaults below) and ``pdcluster ray up`` over its cluster spec (a flag left off keeps the spec's value)."""

from __future__ import annotations

from dataclasses import dataclass

from common.flags import at_least, check_flags, flag

SHAPE = "cluster shape"


@dataclass(frozen=True)
class ClusterShape:
    prefill: int = flag(1, "number of prefill nodes", group=SHAPE, check=at_least(0))
    decode: int = flag(1, "number of decode nodes", group=SHAPE, check=at_least(0))
    prefill_tp_size: int | None = flag(None, "prefill nodes' tp (default --tp-size)", group=SHAPE, check=at_least(1))
    decode_tp_size: int | None = flag(None, "decode nodes' tp (default --tp-size)", group=SHAPE, check=at_least(1))

    def __post_init__(self) -> None:
        check_flags(self)
