"""``freeze_startup_heap``: start-up's heap frozen, and a serving process's young-generation threshold raised."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from common.gc_freeze import SERVING_YOUNG_THRESHOLD, freeze_startup_heap


@pytest.fixture
def restore_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restore_gc")
def test_a_serving_process_collects_its_young_generation_less_often() -> None:
    _, g1, g2 = gc.get_threshold()
    held = [object()]  # a tracked container
    freeze_startup_heap(SERVING_YOUNG_THRESHOLD)
    assert gc.get_threshold() == (SERVING_YOUNG_THRESHOLD, g1, g2)
    assert gc.get_freeze_count() > 0
    assert not any(o is held for o in gc.get_objects())  # frozen objects are not in any generation


@pytest.mark.usefixtures("restore_gc")
def test_without_a_threshold_the_process_keeps_its_own() -> None:
    before = gc.get_threshold()
    freeze_startup_heap()
    assert gc.get_threshold() == before
