"""The slot map (`ps_core.slots`): the even map routes as ``shard_of``
always did, a moved slot's keys go to its new owner and no other key
moves, and the JSON form round-trips."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.hashing import shard_of
from ps_core.slots import SLOTS, SlotMap, slot_count

KEYS = np.random.default_rng(3).integers(0, 2**64, size=50_000, dtype=np.uint64)


@given(st.integers(1, 64), st.integers(1, 5000))
@settings(max_examples=60, deadline=None)
def test_the_even_map_routes_every_key_as_shard_of(num_shards: int, at_least: int) -> None:
    slots = slot_count(num_shards, at_least)
    assert slots % num_shards == 0 and slots >= at_least and slots - num_shards < max(at_least, 1)
    m = SlotMap.even(num_shards, slots)
    assert m.is_even
    want = shard_of(KEYS[:2000], num_shards)
    np.testing.assert_array_equal(m.owner_of(KEYS[:2000]), want)
    # The same through the slots themselves (the path a map that is not even takes).
    np.testing.assert_array_equal(np.array(m.owners)[m.slot_of(KEYS[:2000])], want)


def test_default_slots_are_a_multiple_of_the_shard_count_and_at_least_4096() -> None:
    assert [slot_count(n) for n in (1, 2, 3, 7, 4096, 5000)] == [4096, 4096, 4098, 4102, 4096, 5000]
    assert SlotMap.even(3).slots == 4098 and SlotMap.even(3).load().tolist() == [1366] * 3


@given(st.integers(2, 8), st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 8)), min_size=1, max_size=40))
@settings(max_examples=60, deadline=None)
def test_a_moved_slot_takes_its_keys_and_no_other(num_shards: int, moves: list[tuple[int, int]]) -> None:
    before = SlotMap.even(num_shards, 4096)
    grown = max(num_shards, max(s for _, s in moves) + 1)
    after = before.moved(moves, num_shards=grown)
    assert (after.epoch, after.num_shards) == (2, grown)
    slot = before.slot_of(KEYS)
    now, was = after.owner_of(KEYS), before.owner_of(KEYS)
    target = dict(moves)
    moved = np.isin(slot, list(target))
    np.testing.assert_array_equal(now[~moved], was[~moved])
    np.testing.assert_array_equal(now[moved], [target[int(s)] for s in slot[moved]])
    round_robin = 4096 % grown == 0 and (np.array(after.owners) == np.arange(4096) % grown).all()
    assert after.is_even == round_robin
    again = SlotMap.from_dict(after.to_dict())
    assert again == after and again.is_even == after.is_even
    np.testing.assert_array_equal(again.owner_of(KEYS), now)


def test_the_json_form_is_short_and_checked() -> None:
    even = SlotMap.even(4)
    assert even.to_dict() == {"epoch": 1, "num_shards": 4, "slots": SLOTS, "even": True}
    moved = even.moved({0: 3, 1: 3}, num_shards=5).moved({4095: 4})
    runs = moved.to_dict()["runs"]
    assert runs[:3] == [[0, 2, 3], [2, 3, 2], [3, 4, 3]] and runs[-1] == [4095, 4096, 4]
    assert moved.slots_of(4).tolist() == [4095] and moved.load().sum() == SLOTS
    for bad, why in [
        ({"epoch": 1, "num_shards": 3, "slots": 4096, "even": True}, "multiple of 3"),
        ({"epoch": 1, "num_shards": 2, "slots": 4, "runs": [[0, 2, 0], [3, 4, 1]]}, "in order"),
        ({"epoch": 1, "num_shards": 2, "slots": 4, "runs": [[0, 2, 0]]}, "up to 2"),
        ({"epoch": 1, "num_shards": 2, "slots": 4, "runs": [[0, 4, 2]]}, "not one of shards 0..1"),
        ({"epoch": True, "num_shards": 2, "slots": 4, "even": True}, "epoch is an integer"),
        ({"epoch": 0, "num_shards": 2, "slots": 4, "even": True}, "epoch is >= 1"),
        ([1, 2], "JSON object"),
    ]:
        with pytest.raises(ValueError, match=why):
            SlotMap.from_dict(bad)
