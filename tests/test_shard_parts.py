"""The parts a `Shard` composes (`ps_core.shard`), each driven alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ps_core.errors import CutNotJoinedError, ShardNotJoinedError, SnapshotError, StatusError, WrongShardError
from ps_core.hashing import shard_of
from ps_core.shard import Push, Shard, ShardSpec
from ps_core.shard.cuts import HeldCuts
from ps_core.shard.handlers import DataHandlers
from ps_core.shard.join_state import JoinState
from ps_core.shard.status_board import StatusBoard
from ps_core.shard.tables import ShardTables
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.table_config import TableConfig

LR = TableConfig("lr", 1, {"name": "sgd", "lr": 1.0})
SYNC = TableConfig("s", 1, {"name": "sgd", "lr": 1.0}, mode="sync")
KEYS = np.arange(1, 9, dtype=np.uint64)


def _grads(n: int = KEYS.size) -> np.ndarray:
    return np.ones((n, 1), dtype=np.float32)


def _parts(*configs: TableConfig, dedup_window: int = 4096) -> tuple[ShardTables, JoinState, DataHandlers, HeldCuts]:
    spec = ShardSpec(0, 1)
    tables = ShardTables(spec, configs)
    join = JoinState(spec, tables.pushes)
    return tables, join, DataHandlers(tables, join, dedup_window=dedup_window), HeldCuts(tables, join)


def test_the_board_forgets_the_least_recently_reported_source_first() -> None:
    board = StatusBoard(max_sources=2)
    board.report("a", {"windows": 1}, now=1.0)
    board.report("b", {"windows": 2}, now=2.0)
    board.report("a", {"windows": 3}, now=3.0)  # a is now the newest
    summary = board.report("c", {"windows": 4}, now=4.0)
    assert summary == {"source": "c", "received_at": 4.0, "sources": 2}
    assert [(e["source"], e["status"]["windows"]) for e in board.entries()] == [("a", 3), ("c", 4)]


def test_the_board_keeps_a_detached_copy_and_stores_nothing_it_refuses() -> None:
    board = StatusBoard()
    status = {"windows": 1}
    board.report("w", status, now=1.0)
    status["windows"] = 99
    assert board.entries()[0]["status"] == {"windows": 1}
    with pytest.raises(StatusError, match="not JSON"):
        board.report("x", {1: 2})
    assert [e["source"] for e in board.entries()] == ["w"]


def test_join_state_is_clean_until_its_tables_are_pushed_to_and_admits_only_that_state() -> None:
    pushes = [0]
    join = JoinState(ShardSpec(1, 2), lambda: pushes[0], restore_dir=Path("/x"), restores_at_start=True)
    join.mark_state(3)
    assert join.clean
    pushes[0] = 1
    assert not join.clean
    with pytest.raises(SnapshotError, match="holds version 3 and trained since, not version 3"):
        join.admit("e1", 3)
    join.mark_state(4)
    join.admit("e1", 4)
    report = join.report(now=7.5)
    assert report == {
        "shard_id": 1,
        "num_shards": 2,
        "boot_id": join.boot_id,
        "joined": True,
        "epoch": "e1",
        "version": 4,
        "clean": True,
        "restores": True,
    }
    assert join.last_contact == 7.5


def test_a_left_shard_says_what_it_waits_for() -> None:
    join = JoinState(ShardSpec(0, 1), lambda: 0)
    join.check_joined()
    join.leave("waiting for the coordinator")
    with pytest.raises(ShardNotJoinedError, match="holds version 0\\): waiting for the coordinator"):
        join.check_joined()


def test_cuts_are_refused_unjoined_bounded_and_handed_over_once() -> None:
    tables, join, handlers, cuts = _parts(LR)
    handlers.handle_push(Push("lr", KEYS, _grads()))
    join.leave()
    with pytest.raises(CutNotJoinedError):
        cuts.take(1, None)
    join.joined = True
    assert cuts.take(1, None) == {"lr": KEYS.size}
    assert join.state_version == 1 and join.clean
    for v in range(2, 2 + HeldCuts.MAX_PENDING):
        cuts.take(v, v - 1)
    assert cuts.pending == list(range(2, 2 + HeldCuts.MAX_PENDING))  # cut 1 dropped
    assert [s.kind for s in cuts.pop(2)] == ["delta"]
    with pytest.raises(SnapshotError, match="holds no cut 2"):
        cuts.pop(2)
    assert cuts.drop(3) and not cuts.drop(3)
    with pytest.raises(SnapshotError, match="after parent 1"):
        cuts.take(9, 1)  # the table was cut at 5 since


def test_tables_reconfigure_sets_the_default_lifecycle_and_what_a_restore_declares_again() -> None:
    tables = ShardTables(ShardSpec(0, 1), (LR,))
    lifecycle = Lifecycle(ttl_s=60.0)
    tables.reconfigure((LR, SYNC), lifecycle)
    assert tables.default_lifecycle == lifecycle
    assert [c.name for c in tables.configured] == ["lr", "s"]
    assert tables.table("lr").config.lifecycle == lifecycle  # restored without one: takes the default
    assert tables.drop("s") and [c.name for c in tables.configured] == ["lr"]


def test_tables_refuse_keys_of_other_shards() -> None:
    tables = ShardTables(ShardSpec(1, 2), (LR,))
    keys = np.arange(1, 200, dtype=np.uint64)
    tables.check_owned(keys[shard_of(keys, 2) == 1])
    with pytest.raises(WrongShardError, match="not shard 1 of 2"):
        tables.check_owned(keys)


def test_the_dedup_window_forgets_the_oldest_push_id() -> None:
    tables, _, handlers, _ = _parts(LR, dedup_window=2)
    for rid in (1, 2, 3):
        handlers.handle_push(Push("lr", KEYS, _grads(), request_id=rid))
    handlers.handle_push(Push("lr", KEYS, _grads(), request_id=3))  # remembered: not applied
    assert handlers.duplicate_pushes == 1 and tables.table("lr").pushes == 3
    handlers.handle_push(Push("lr", KEYS, _grads(), request_id=1))  # forgotten: applied again
    assert handlers.duplicate_pushes == 1 and tables.table("lr").pushes == 4
    handlers.forget_pushes()
    handlers.handle_push(Push("lr", KEYS, _grads(), request_id=3))
    assert tables.table("lr").pushes == 5


def test_a_sync_step_is_applied_once() -> None:
    tables, join, handlers, _ = _parts(SYNC)
    handlers.handle_push(Push("s", KEYS, _grads()))
    assert tables.table("s").pull(KEYS).sum() == 0  # held until the step closes
    assert handlers.apply_step(1) == KEYS.size
    assert handlers.apply_step(1) == 0 and handlers.sync_steps == {"s": 1}
    join.leave()
    with pytest.raises(ShardNotJoinedError):
        handlers.apply_step(2)


def test_a_shard_restored_from_an_export_reports_it_and_a_replaced_state_forgets_its_cuts() -> None:
    shard = Shard(ShardSpec(0, 1), (LR,))
    shard.add_stats("ports", lambda: {"http": 1})
    assert shard.stats()["ports"] == {"http": 1}
    shard.restored(2, Path("/exports/m"))
    assert shard.restore_dir == Path("/exports/m") and shard.membership()["restores"]
    shard.take_snapshot(3, 2)
    fresh = Shard(ShardSpec(0, 1), (LR,))
    fresh.handle_push(Push("lr", KEYS, _grads()))
    shard.replace_state(fresh, 5)
    assert shard.pending_snapshots == [] and shard.state_version == 5 and shard.membership()["clean"]
    assert shard.table("lr") is fresh.table("lr")
    with pytest.raises(ValueError, match="a restore of"):
        shard.replace_state(Shard(ShardSpec(0, 2)), 6)
