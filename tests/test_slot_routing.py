"""Routing by the slot map (`ps_core.slots`) over every transport: a shard
refuses keys of slots it does not own as ``moved`` (421, with its map's
epoch) and applies none of the call; a client given where the current map
is (`PSClient.slot_source`) takes the newer map and sends the refused keys
again, each applied once; a client whose map is newer than a shard's
waits a while for the shard to take it, then reports an outage."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from test_client import MakeClient, make_client

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.manifest import MANIFEST_NAME
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import MovedError, SlotsUnsettledError
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.slots import SlotMap
from ps_core.store.table_config import TableConfig

__all__ = ["make_client"]  # the fixture, used here by name

SGD = TableConfig("lr", dim=1, optimizer={"name": "sgd", "lr": 0.5})
KEYS = np.random.default_rng(11).integers(1, 2**64 - 1, size=400, dtype=np.uint64)


def _moved_map(to: int = 1) -> tuple[SlotMap, np.ndarray]:
    """Epoch 2 of two shards: the slots of shard 0's first 40 keys moved to
    shard `to`; and the keys of those slots."""
    even = SlotMap.even(2)
    mine = KEYS[even.owner_of(KEYS) == 0][:40]
    slots = sorted(set(even.slot_of(mine).tolist()))
    moved = even.moved({s: to for s in slots})
    return moved, KEYS[np.isin(even.slot_of(KEYS), slots)]


def _rows(shards: list[Shard]) -> dict[int, tuple[int, float]]:
    """Each key held: its shard and its weight."""
    out: dict[int, tuple[int, float]] = {}
    for s in shards:
        t = s.tables["lr"]
        held = KEYS[t.index.lookup(KEYS) >= 0]
        for k, w in zip(held.tolist(), t.pull(held)[:, 0].tolist()):
            assert k not in out, f"key {k} on two shards"
            out[k] = (s.spec.shard_id, w)
    return out


async def test_keys_of_a_moved_slot_are_refused_as_moved_and_nothing_is_applied(make_client: MakeClient) -> None:
    client, _, shards = await make_client(2, (SGD,))
    new, moved_keys = _moved_map()
    for s in shards:
        assert s.adopt_slot_map(new) and not s.adopt_slot_map(new)  # an epoch is taken once
    grads = np.ones((KEYS.size, 1), dtype=np.float32)
    with pytest.raises(MovedError) as refused:
        await client.push("lr", KEYS, grads)
    assert (refused.value.code, refused.value.status, refused.value.epoch) == ("moved", 421, 2)
    assert "at slot map epoch 2" in refused.value.detail and "not shard 0 of 2" in refused.value.detail
    assert len(shards[0].tables["lr"]) == 0  # shard 0's part was refused whole
    with pytest.raises(MovedError):
        await client.pull("lr", moved_keys)
    with pytest.raises(MovedError):
        await client.push_pull("lr", KEYS[:0], grads[:0], pull_keys=moved_keys)


@pytest.mark.parametrize("call", ["push", "push_pull", "routed"])
async def test_a_client_with_an_older_map_takes_the_newer_one_and_each_key_is_applied_once(
    make_client: MakeClient, call: str
) -> None:
    client, control, shards = await make_client(2, (SGD,))
    new, moved_keys = _moved_map()
    for s in shards:
        s.adopt_slot_map(new)
    client.slot_source = control.slot_map
    grads = np.ones((KEYS.size, 1), dtype=np.float32)
    if call == "push":
        assert await client.push("lr", KEYS, grads) == KEYS.size
    elif call == "push_pull":
        applied, weights = await client.push_pull("lr", KEYS, grads, pull_keys=KEYS)
        assert applied == KEYS.size
        np.testing.assert_array_equal(weights[:, 0], np.full(KEYS.size, -0.5, dtype=np.float32))
    else:  # a worker's pull, then the push of the same route
        routed = client.route(KEYS)
        await client.pull("lr", routed)
        assert await client.push("lr", routed, grads) == KEYS.size
    assert client.slot_map == new and client.reroutes == 1  # a kept route is split again without asking
    rows = _rows(shards)
    assert sorted(rows) == sorted(KEYS.tolist())
    assert {k: s for k, (s, _) in rows.items()} == dict(zip(KEYS.tolist(), new.owner_of(KEYS).tolist()))
    assert {w for _, w in rows.values()} == {-0.5}  # every key's one gradient, once
    assert {rows[k][0] for k in moved_keys.tolist()} == {1}
    np.testing.assert_array_equal((await client.pull("lr", KEYS))[:, 0], np.full(KEYS.size, -0.5, np.float32))


async def test_a_destination_that_never_takes_its_slots_is_waited_for_then_refused(make_client: MakeClient) -> None:
    client, control, shards = await make_client(2, (SGD,))
    new, moved_keys = _moved_map()
    assert shards[0].adopt_slot_map(new)  # shard 0 gave the slots away; shard 1 never took them
    client.slot_source = control.slot_map
    client.settle_s = 1.0  # a move's destination takes its slots within milliseconds; this one never does
    with pytest.raises(SlotsUnsettledError) as unsettled:
        await client.push("lr", moved_keys, np.ones((moved_keys.size, 1), dtype=np.float32))
    # It waited (how many times depends on the machine's speed), then gave up: an outage, retriable.
    assert unsettled.value.retriable and "did not agree within 1 s" in unsettled.value.detail
    assert (
        "refused keys at epoch 1, this client routes by epoch 2 and shard 0 answers epoch 2" in unsettled.value.detail
    )
    refused = unsettled.value.__cause__
    assert isinstance(refused, MovedError) and refused.epoch == 1
    assert client.slot_map == new and client.settle_waits >= 1
    assert sum(len(s.tables["lr"]) for s in shards) == 0
    with pytest.raises(ValueError, match="a slot map of 3 shards for a client of 2"):
        client.use_slot_map(SlotMap.even(3, epoch=5))


async def test_a_client_ahead_of_every_shard_follows_the_cluster_back(make_client: MakeClient) -> None:
    """A cluster restored from a cut taken before slots moved holds that
    cut's older map on every shard: its clients go back to it."""
    client, control, shards = await make_client(2, (SGD,))
    new, moved_keys = _moved_map()
    assert client.use_slot_map(new) and not client.use_slot_map(SlotMap.even(2))
    client.slot_source = control.slot_map  # every shard holds the even map
    assert await client.push("lr", moved_keys, np.ones((moved_keys.size, 1), dtype=np.float32)) == moved_keys.size
    assert client.slot_map == SlotMap.even(2) and client.reroutes == 1
    assert len(shards[0].tables["lr"]) == moved_keys.size  # where the even map puts them


async def test_the_slot_map_is_served_and_read_back(make_client: MakeClient) -> None:
    _, control, shards = await make_client(2, (SGD,))
    assert await control.slot_map() == SlotMap.even(2)
    new, _ = _moved_map()
    shards[0].adopt_slot_map(new)
    got = await control.slot_map()
    assert got == new and not got.is_even
    with pytest.raises(ValueError, match="a slot map of 3 shards for shard 0 of 2"):
        shards[0].adopt_slot_map(SlotMap.even(3, epoch=9))


async def test_an_even_map_routes_as_the_shard_count_always_did() -> None:
    from ps_core.hashing import shard_of

    shards = [Shard(ShardSpec(i, 3), (SGD,)) for i in range(3)]
    client: Any = PSClient.local(shards)
    await client.push("lr", KEYS, np.ones((KEYS.size, 1), dtype=np.float32))
    for s in shards:
        held = KEYS[s.tables["lr"].index.lookup(KEYS) >= 0]
        assert (shard_of(held, 3) == s.spec.shard_id).all() and held.size
    assert all(t.routed for t in client.transports)  # the shards trust the client's split
    shards[1].adopt_slot_map(SlotMap.even(3, epoch=2))
    assert [t.routed for t in client.transports] == [True, False, True]  # until their maps differ


async def test_a_cut_records_its_slot_map_and_a_restore_puts_each_slot_where_it_was(tmp_path: Path) -> None:
    shards = [Shard(ShardSpec(i, 2), (SGD,)) for i in range(2)]
    coord = Coordinator()
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    client.slot_source = control.slot_map
    exporter = Exporter(coord, control, tmp_path, "m")
    await client.push("lr", KEYS, np.ones((KEYS.size, 1), dtype=np.float32))
    even = await exporter.cut()
    raw = orjson.loads((Path(even.path) / MANIFEST_NAME).read_bytes())
    assert raw["format_version"] == 2 and raw["slot_map"] == {"epoch": 1, "num_shards": 2, "slots": 4096, "even": True}

    new, moved_keys = _moved_map()
    for s in shards:  # the slots' rows moved by hand, as a move will
        rows = s.tables["lr"].index.lookup(moved_keys)
        held = moved_keys[rows >= 0]
        if s.spec.shard_id == 0:
            shards[1].tables["lr"].load_rows(held, *_row_arrays(s, held))
            s.tables["lr"].delete(held)
        s.adopt_slot_map(new)
    # A base: what a delta carries of a move is the moves' to define.
    second = await exporter.cut("base")
    raw = orjson.loads((Path(second.path) / MANIFEST_NAME).read_bytes())
    assert raw["format_version"] == 3 and raw["slot_map"] == new.to_dict()
    chain = latest_chain(tmp_path / "m", verify=True)
    assert chain[-1].manifest.slot_map == new
    same = restore_shards(chain, 2)
    assert [s.slot_map for s in same.shards] == [new, new]
    assert _rows(same.shards) == _rows(shards)  # each key on the shard its slot was on
    other = restore_shards(chain, 3)
    assert [s.slot_map for s in other.shards] == [SlotMap.even(3)] * 3
    assert {k: w for k, (_, w) in _rows(other.shards).items()} == {k: w for k, (_, w) in _rows(shards).items()}
    # A manifest written before there were slots: the even map of its shard count.
    old = dataclasses.replace(chain[0].manifest, slot_map=None)
    assert "slot_map" not in orjson.loads(old.to_json()) and old.cut_slots() == SlotMap.even(2)


def _row_arrays(shard: Shard, keys: np.ndarray) -> tuple[np.ndarray, ...]:
    """What `SparseTable.load_rows` takes of `keys`' rows on `shard` (a base copy's arrays)."""
    snap = shard.tables["lr"].base_copy(0)
    pick = np.flatnonzero(np.isin(snap.keys, keys))
    order = np.argsort(snap.keys[pick])
    pick = pick[order][np.searchsorted(snap.keys[pick][order], keys)]
    return tuple(a[pick] for a in (snap.data, snap.updated_at, snap.last_seen, snap.shows, snap.clicks))
