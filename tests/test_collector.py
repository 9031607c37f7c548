"""consumers.collector: the young-generation threshold while workers run."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from consumers.collector import YOUNG_THRESHOLD, fewer_collections


@pytest.fixture(autouse=True)
def thresholds() -> Iterator[tuple[int, int, int]]:
    """Each test starts from known thresholds and leaves the process's as it found them."""
    saved = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.set_threshold(*saved)


def test_raises_the_young_threshold_inside_and_restores_it_after() -> None:
    with fewer_collections():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_overlapping_blocks_restore_when_the_last_one_leaves() -> None:
    first, second = fewer_collections(), fewer_collections(20_000)
    first.__enter__()
    second.__enter__()  # the first one's setting stands
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    first.__exit__(None, None, None)  # left out of order: the second still runs
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    second.__exit__(None, None, None)
    assert gc.get_threshold() == (700, 10, 10)


def test_restores_after_an_error_and_never_lowers_a_higher_threshold() -> None:
    gc.set_threshold(50_000, 5, 5)
    with pytest.raises(RuntimeError), fewer_collections():
        assert gc.get_threshold() == (50_000, 5, 5)
        raise RuntimeError("the worker failed")
    assert gc.get_threshold() == (50_000, 5, 5)


def test_a_disabled_threshold_stays_disabled() -> None:
    gc.set_threshold(0, 10, 10)  # automatic collection off
    with fewer_collections():
        assert gc.get_threshold()[0] == 0
    assert gc.get_threshold() == (0, 10, 10)
