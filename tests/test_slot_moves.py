"""Live slot moves (`ps_core.checkpoint.moves`, `ps_core.shard.slot_moves`)
over every transport: slots move between running shards while a client
pushes, and every push is applied exactly once on the shard that owns its
key's slot; the rows arrive as they left; a cut after a move restores every
row where the map says; a move a shard cannot take part in changes nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from streams import bias_shows, new_topic, produce, running, worker_config
from test_client import MakeClient, make_client
from test_geo import _round as geo_round

from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient, LocalControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.joining import load_shard
from ps_core.checkpoint.moves import MoveFailedError, move_slots
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import MoveRefusedError, ShardUnavailableError
from ps_core.model.geo import GeoCopy
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.shard import Shard, ShardSpec
from ps_core.slots import SlotMap
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table_config import TableConfig
from ps_core.synthetic import SyntheticStream

__all__ = ["make_client"]  # the fixture, used here by name

SGD = TableConfig("lr", dim=1, optimizer={"name": "sgd", "lr": 0.5})
KEYS = np.random.default_rng(17).integers(1, 2**64 - 1, size=3000, dtype=np.uint64)


def _held(shards: list[Shard]) -> dict[int, tuple[int, float, float]]:
    """Each key held: its shard, its weight and its shows; a key held twice fails."""
    out: dict[int, tuple[int, float, float]] = {}
    for s in shards:
        t = s.tables["lr"]
        snap = t.rows_where(lambda keys: np.ones(keys.size, dtype=bool))  # every live row
        for k, w, shows in zip(snap.keys.tolist(), snap.data[:, 0].tolist(), (snap.shows * t.count_scale).tolist()):
            assert k not in out, f"key {k} on shards {out[k][0]} and {s.spec.shard_id}"
            out[k] = (s.spec.shard_id, w, shows)
    return out


async def test_slots_move_while_a_client_pushes_and_every_push_is_applied_once(make_client: MakeClient) -> None:
    client, control, shards = await make_client(2, (SGD,))
    client.slot_source = control.slot_map
    rng = np.random.default_rng(3)
    pushes = [rng.choice(KEYS, 400, replace=False) for _ in range(60)]
    counts = np.zeros(KEYS.size)
    index = {k: i for i, k in enumerate(KEYS.tolist())}

    async def pushing() -> None:
        for keys in pushes:
            ones = np.ones((keys.size, 1), dtype=np.float32)
            await client.push("lr", keys, ones, counts=np.hstack([ones, np.zeros_like(ones)]))
            counts[[index[k] for k in keys.tolist()]] += 1
            await asyncio.sleep(0)

    moving = SlotMap.even(2).slots_of(0)[:1024]
    pusher = asyncio.create_task(pushing())
    await asyncio.sleep(0)
    steps = await move_slots(control, moving.tolist(), 1, batch=256)
    await pusher
    assert [(s.source, s.to, s.slots) for s in steps] == [(0, 1, 256)] * 4
    assert [s.epoch for s in steps] == [2, 3, 4, 5]
    final = await control.slot_map()
    assert final.epoch == 5 and [s.slot_map for s in shards] == [final, final]
    assert (np.array(final.owners)[moving] == 1).all() and final.load().tolist() == [2048 - 1024, 2048 + 1024]
    held = _held(shards)
    pushed = KEYS[counts > 0]
    assert sorted(held) == sorted(pushed.tolist())
    owner = dict(zip(pushed.tolist(), final.owner_of(pushed).tolist()))
    for k, (shard, w, shows) in held.items():
        n = counts[index[k]]
        assert (shard, w, shows) == (owner[k], np.float32(-0.5) * np.float32(n), n), k
    assert all(not s.slot_moves.held for s in shards)  # the copies dropped once each step was done
    assert client.reroutes >= 1  # pushes met the moves: refused, then sent by the newer map


async def test_moved_rows_arrive_as_they_left(make_client: MakeClient) -> None:
    client, control, shards = await make_client(2, (SGD,))
    ones = np.ones((KEYS.size, 1), dtype=np.float32)
    await client.push("lr", KEYS, ones, counts=np.hstack([ones, ones]), event_time=1_764_681_600.0)
    before = shards[0].tables["lr"].rows_where(lambda keys: np.ones(keys.size, dtype=bool))
    slots = SlotMap.even(2).slots_of(0)
    [step] = await move_slots(control, slots.tolist(), 1, batch=4096)
    assert (step.rows, step.slots) == (before.rows, 2048) and len(shards[0].tables["lr"]) == 0
    after = shards[1].tables["lr"]
    rows = after.index.lookup(before.keys)
    assert (rows >= 0).all()
    moved = after.rows_where(lambda keys: np.isin(keys, before.keys))
    order = np.argsort(moved.keys)
    want = np.argsort(before.keys)
    for name in ("keys", "data", "last_seen", "shows", "clicks"):
        np.testing.assert_array_equal(getattr(moved, name)[order], getattr(before, name)[want], err_msg=name)
    client.slot_source = control.slot_map
    np.testing.assert_array_equal((await client.pull("lr", KEYS))[:, 0], np.full(KEYS.size, -0.5, np.float32))


async def test_a_move_a_shard_cannot_take_part_in_changes_nothing(make_client: MakeClient) -> None:
    _, control, shards = await make_client(2, (SGD,))
    with pytest.raises(MoveRefusedError, match="no shard 2"):
        await move_slots(control, [0], 2)
    with pytest.raises(MoveRefusedError, match=r"slots are in \[0, 4096\)"):
        await move_slots(control, [4096], 1)
    even = SlotMap.even(2)
    with pytest.raises(MoveRefusedError, match="only slots it owns"):
        await control.shards[1].hand_off([0], even.moved({0: 0}))  # slot 0 is shard 0's
    with pytest.raises(MoveRefusedError, match="not newer"):
        await control.shards[0].hand_off([0], SlotMap.even(2))
    with pytest.raises(MoveRefusedError, match="gives or takes slots of shard 1"):
        await control.shards[1].adopt_slot_map(even.moved({0: 1}))
    assert [s.slot_map for s in shards] == [even, even]
    assert await move_slots(control, even.slots_of(1)[:3].tolist(), 1) == []  # already there


async def test_a_delta_cut_after_a_move_restores_every_row_where_the_map_says(tmp_path: Path) -> None:
    shards = [Shard(ShardSpec(i, 2), (SGD,)) for i in range(2)]
    coord = Coordinator()
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    client.slot_source = control.slot_map
    exporter = Exporter(coord, control, tmp_path, "m")
    ones = np.ones((KEYS.size, 1), dtype=np.float32)
    await client.push("lr", KEYS, ones, counts=np.hstack([ones, ones]))
    assert (await exporter.cut()).kind == "base"
    slots = SlotMap.even(2).slots_of(0)[::2]
    # Under the exporter's lock, as the coordinator's moves run: no cut sees a slot in flight.
    await move_slots(control, slots.tolist(), 1, lock=exporter.lock)
    # And the other way: a delta's deletion on one shard and its row on another, in either order.
    await move_slots(control, SlotMap.even(2).slots_of(1)[::3].tolist(), 0, lock=exporter.lock)
    await client.push("lr", KEYS[:100], ones[:100], counts=np.hstack([ones[:100], ones[:100]]))
    delta = await exporter.cut()
    assert delta.kind == "delta"
    chain = latest_chain(tmp_path / "m", verify=True)
    assert [v.version for v in chain] == [1, 2] and chain[-1].manifest.slot_map == shards[0].slot_map
    live = _held(shards)
    same = restore_shards(chain, 2)
    assert [s.slot_map for s in same.shards] == [shards[0].slot_map] * 2
    assert _held(same.shards) == live  # every row, on the shard of its slot
    other = restore_shards(chain, 3)
    assert {k: v[1:] for k, v in _held(other.shards).items()} == {k: v[1:] for k, v in live.items()}


async def test_a_cluster_restored_to_a_cut_before_a_move_takes_that_cuts_map(tmp_path: Path) -> None:
    shards = [Shard(ShardSpec(i, 2), (SGD,)) for i in range(2)]
    coord = Coordinator()
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "m")
    ones = np.ones((KEYS.size, 1), dtype=np.float32)
    await client.push("lr", KEYS, ones, counts=np.hstack([ones, ones]))
    cut = await exporter.cut()
    at_cut = _held(shards)
    await move_slots(control, SlotMap.even(2).slots_of(0)[:500].tolist(), 1)  # 2 steps of 256 and 244
    assert shards[0].slot_map.epoch == 3
    for shard in shards:  # what the coordinator's cluster restore has each shard do
        fresh, _ = load_shard(shard.spec, tmp_path / "m", cut.version, (SGD,))
        shard.replace_state(fresh, cut.version)
    assert [s.slot_map for s in shards] == [SlotMap.even(2)] * 2 and _held(shards) == at_cut
    client.slot_source = control.slot_map
    assert await client.push("lr", KEYS[:50], ones[:50]) == 50  # its client follows the cluster back
    assert client.slot_map == SlotMap.even(2)


async def test_geo_deltas_are_added_exactly_across_moves() -> None:
    """Geo workers push parameter differences the shards add: across slot
    moves in between their rounds, the shards end at the sum of them all."""
    config = TableConfig("w", 2, {"name": "sgd", "lr": 0.1}, init_scale=0.0, mode="geo")
    shards = [Shard(ShardSpec(i, 2), (config,)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards)
    client.slot_source = control.slot_map
    copies = [GeoCopy([config]), GeoCopy([config])]
    rng = np.random.default_rng(13)
    universe = KEYS[:300]
    total = np.zeros((universe.size, 2))
    index = {k: i for i, k in enumerate(universe.tolist())}
    plan = {10: (SlotMap.even(2).slots_of(0)[:700], 1), 25: (SlotMap.even(2).slots_of(1)[:300], 0)}
    for r in range(40):
        if r in plan:
            slots, to = plan[r]
            await move_slots(control, slots.tolist(), to)
        keys = np.sort(rng.choice(universe, size=int(rng.integers(1, 80)), replace=False))
        grads = rng.normal(size=(keys.size, 2)).astype(np.float32)
        await geo_round(copies[r % 2], client, keys, grads, 0.5)
        total[[index[k] for k in keys.tolist()]] += grads
    assert shards[0].slot_map.epoch == 6 and client.reroutes >= 1  # 3 steps of up to 256 slots, then 2
    np.testing.assert_allclose(await client.pull("w", universe), -0.1 * 0.5 * total, rtol=1e-4, atol=1e-5)


async def test_a_sync_step_open_on_the_source_holds_the_move_until_it_closes() -> None:
    config = TableConfig("s", 1, {"name": "sgd", "lr": 0.5}, mode="sync")
    shards = [Shard(ShardSpec(i, 2), (config,)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards)
    client.slot_source = control.slot_map
    await client.push("s", KEYS, np.ones((KEYS.size, 1), dtype=np.float32))  # held for the step's close
    slots = SlotMap.even(2).slots_of(0)[:100].tolist()
    with pytest.raises(MoveRefusedError, match="hold an open sync step"):
        await move_slots(control, slots, 1)
    assert [s.slot_map.epoch for s in shards] == [1, 1]  # nothing changed
    assert sum(s.apply_step(1) for s in shards) == KEYS.size
    await move_slots(control, slots, 1)
    np.testing.assert_array_equal((await client.pull("s", KEYS))[:, 0], np.full(KEYS.size, -0.5, np.float32))
    assert sum(len(s.tables["s"]) for s in shards) == KEYS.size


@pytest.mark.slow
async def test_a_worker_trains_every_event_once_while_slots_move_back_and_forth(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A worker reads the broker and trains while the bias's slot and a
    thousand others move from shard to shard: every event applied once."""
    topic, group = await new_topic(kafka_bootstrap, 2, hex_digits=10)
    n = 12_000
    await produce(kafka_bootstrap, topic, [orjson.dumps(e) for e in SyntheticStream(seed=4).batch(n)], 2)
    coord = Coordinator(lease_ttl_s=30)
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    client.slot_source = control.slot_map
    exporter = Exporter(coord, control, tmp_path, "m")
    model = LogisticRegression("m")
    worker = Worker(worker_config(kafka_bootstrap, topic, group, 1000), client, control, model)
    bias = np.array([model.hasher().bias_key], dtype=np.uint64)
    slots = sorted({int(SlotMap.even(2).slot_of(bias)[0]), *range(0, 2000, 2)})
    moves = 0
    async with running(worker) as training:
        async with asyncio.timeout(90):
            while worker.stats.records < n:
                assert not training.done(), training
                owner = int(shards[0].slot_map.owner_of(bias)[0])
                await move_slots(control, slots, 1 - owner, lock=exporter.lock)
                moves += 1
                await asyncio.sleep(0.05)  # the moves' pace, not a wait-for
    # The first move comes before the worker's first push, which the shards
    # refuse: its client takes the newer map (a reroute); later ones meet
    # its windows as they come.
    assert moves >= 1 and worker.stats.records == n
    assert bias_shows(shards) == n  # every event applied once, wherever the bias's slot was
    assert client.reroutes >= 1


async def test_a_destination_that_does_not_answer_leaves_the_slots_with_their_source(serve_shards: Any) -> None:
    """Shard 1's server stops before the move: its take-over fails, shard 0
    takes its rows back at the epoch after, and every slot is owned once."""
    shards, urls = await serve_shards(2, (SGD,))
    async with (
        PSClient.connect(urls, retry=RetryPolicy(deadline_s=1.0)) as client,
        ControlClient.connect(urls, retry=RetryPolicy(deadline_s=1.0)) as control,
    ):
        ones = np.ones((KEYS.size, 1), dtype=np.float32)
        await client.push("lr", KEYS, ones, counts=np.hstack([ones, ones]))
        before = _held(shards)
        await serve_shards.runners[1].cleanup()
        slots = SlotMap.even(2).slots_of(0)[:100].tolist()
        with pytest.raises(MoveFailedError, match="shard 1 did not take 100 slots of shard 0"):
            await move_slots(control, slots, 1)
        back = shards[0].slot_map
        assert back.epoch == 3 and back.owners == SlotMap.even(2).owners  # the map of before, at a new epoch
        assert shards[1].slot_map.epoch == 1 and not shards[0].slot_moves.held
        assert _held(shards) == before  # every row where it was, as it was


class _AnswerLost(LocalControl):
    """Shard 1 in process whose take-over is applied and whose answer is then
    lost, as a connection dropped just after the shard answered would: the
    test double for that failure only."""

    async def take_over(self, copies: Sequence[TableSnapshot], slot_map: SlotMap) -> int:
        await super().take_over(copies, slot_map)
        raise ShardUnavailableError("shard 1: connection reset by peer")


async def test_a_take_over_whose_answer_is_lost_completes_the_move() -> None:
    shards = [Shard(ShardSpec(i, 2), (SGD,)) for i in range(2)]
    control = ControlClient([LocalControl(shards[0]), _AnswerLost(shards[1])])
    client = PSClient.local(shards)
    ones = np.ones((KEYS.size, 1), dtype=np.float32)
    await client.push("lr", KEYS, ones)
    before = {k: w for k, (_, w, _) in _held(shards).items()}
    slots = SlotMap.even(2).slots_of(0)[:200].tolist()
    [step] = await move_slots(control, slots, 1)
    final = shards[0].slot_map
    assert step.epoch == final.epoch == shards[1].slot_map.epoch == 2 and not shards[0].slot_moves.held
    held = _held(shards)  # each key on one shard (two would fail): the destination's, not given back
    assert {k: w for k, (_, w, _) in held.items()} == before
    assert {k: s for k, (s, _, _) in held.items()} == dict(zip(KEYS.tolist(), final.owner_of(KEYS).tolist()))


class _GoneAfterHandOff(LocalControl):
    """Shard 0 in process that stops answering once it handed its slots off,
    as a source killed mid-move would: the test double for that failure only."""

    gone = False

    async def hand_off(self, slots: Sequence[int], slot_map: SlotMap) -> list[TableSnapshot]:
        copies = await super().hand_off(slots, slot_map)
        self.gone = True
        return copies

    async def release_slots(self, epoch: int) -> bool:
        if self.gone:
            raise ShardUnavailableError("shard 0: connection refused")
        return await super().release_slots(epoch)


async def test_a_source_gone_after_its_hand_off_still_ends_the_move_on_the_destination(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shards = [Shard(ShardSpec(i, 3), (SGD,)) for i in range(3)]
    control = ControlClient([_GoneAfterHandOff(shards[0]), LocalControl(shards[1]), LocalControl(shards[2])])
    client = PSClient.local(shards)
    ones = np.ones((KEYS.size, 1), dtype=np.float32)
    await client.push("lr", KEYS, ones)
    before = {k: w for k, (_, w, _) in _held(shards).items()}
    moving = SlotMap.even(3).slots_of(0)[:100].tolist()
    with caplog.at_level(logging.WARNING, logger="ctrps.moves"):
        [step] = await move_slots(control, moving, 1)
    assert step.epoch == 2 and [s.slot_map.epoch for s in shards] == [2, 2, 2]
    assert {k: w for k, (_, w, _) in _held(shards).items()} == before  # the rows came through the coordinator
    [line] = [r for r in caplog.records if r.name == "ctrps.moves" and r.levelno == logging.WARNING]
    assert line.getMessage() == "slot move: the source did not drop its copies"
