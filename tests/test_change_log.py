"""A geo table's change log: which keys changed since a worker's last
question, its own pushes left out, bounded; the question and its answer on
the wire (frames over HTTP and the RPC); a shard that predates the log."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import pytest
from test_api import samples, window_report

from app.metrics import ApiMetrics, ClusterSnapshot
from app.status import summarize, worker_status
from consumers.worker import WorkerStats
from ps_core.errors import FrameError, ModeConflictError, UnknownTableError
from ps_core.net import codec, op_encoders
from ps_core.net.change_feed import ChangeFeed
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.store.change_log import ENTRY_KEYS, ChangeLog
from ps_core.store.table_config import TableConfig

GEO = TableConfig("w", 1, {"name": "sgd", "lr": 0.1}, init_scale=0.0, mode="geo")


def _keys(*k: int) -> np.ndarray:
    return np.array(k, dtype=np.uint64)


def test_an_answer_holds_what_others_changed_since_the_question() -> None:
    log = ChangeLog()
    first = log.since(0, 0, ())
    assert not first.complete and first.keys.size == 0  # no earlier answer
    log.record(_keys(5, 3), request_id=11)  # before the cursor: never reported
    cursor = log.since(first.seq, first.incarnation, ())
    assert cursor.complete and cursor.keys.tolist() == [3, 5]  # the first answer's seq was 0
    log.record(_keys(7, 3, 7), request_id=12)  # mine
    log.record(_keys(9, 3), request_id=13)  # another worker's
    log.record(_keys(1))  # a removal: nobody's own
    got = log.since(cursor.seq, cursor.incarnation, [12])
    assert got.complete and got.keys.tolist() == [1, 3, 9] and got.seq == cursor.seq + 3
    again = log.since(got.seq, got.incarnation, [])
    assert again.complete and again.keys.size == 0 and again.seq == got.seq


def test_a_log_past_its_bound_or_reset_answers_incomplete() -> None:
    log = ChangeLog(max_keys=5 + 2 * ENTRY_KEYS)  # 5 keys in two entries
    log.record(_keys(1, 2))
    a = log.since(log.seq, log.incarnation, ())
    log.record(_keys(3, 4, 5))
    assert log.since(a.seq, a.incarnation, ()).keys.tolist() == [3, 4, 5]
    log.record(_keys(6, 7))  # 7 keys in three entries: the oldest goes, which `a` had seen
    assert log.since(a.seq, a.incarnation, ()).complete
    log.record(_keys(8))  # and now one `a` had not
    late = log.since(a.seq, a.incarnation, ())
    assert not late.complete and late.keys.size == 0 and log.keys_held == 3
    b = log.since(late.seq, late.incarnation, ())
    assert b.complete
    log.reset()  # rows replaced: no earlier answer holds
    assert not log.since(b.seq, b.incarnation, ()).complete
    assert log.stats() == {"entries": 0, "keys": 0, "incomplete": 2}
    with pytest.raises(ValueError, match="max_keys"):
        ChangeLog(max_keys=-1)


def test_many_tiny_entries_are_bounded_too() -> None:
    log = ChangeLog(max_keys=100 * (1 + ENTRY_KEYS))
    for k in range(1, 1001):
        log.record(_keys(k))
    assert log.stats()["entries"] == 100 and log.keys_held == 100


def test_changes_frames_round_trip() -> None:
    ask = codec.decode(op_encoders.encode_changes("w", 41, 7, _keys(2, 9)), codec.Op.CHANGES)
    assert (ask.clock, ask.incarnation, ask.keys.tolist(), ask.complete) == (41, 7, [2, 9], False)
    assert ask.format_version == 1 and ask.dim == 0
    for complete in (True, False):
        for keys in (_keys(), _keys(4), _keys(1, 1 << 63, 2**64 - 1)):
            raw = op_encoders.encode_changes_reply("w", keys, 99, 5, complete=complete)
            got = codec.decode(raw, codec.Op.CHANGES_REPLY)
            assert (got.keys.tolist(), got.clock, got.incarnation, got.complete) == (keys.tolist(), 99, 5, complete)
    # The complete flag belongs to a changes reply alone.
    with pytest.raises(FrameError, match="changes reply"):
        codec.decode(codec.encode(codec.Op.PULL, "w", keys=_keys(1), complete=True))
    with pytest.raises(FrameError, match="implies"):
        codec.decode(op_encoders.encode_changes("w", 1, 1, _keys(2, 9))[:-8])


@pytest.mark.parametrize("rpc", [True, False], ids=["rpc", "http"])
async def test_a_shard_server_answers_changes(serve_shards: Any, rpc: bool) -> None:
    async_table = TableConfig("a", 1, {"name": "sgd", "lr": 0.1})
    _, urls = await serve_shards(2, (GEO, async_table), rpc=rpc)
    async with PSClient.connect(urls, rpc=rpc) as a, PSClient.connect(urls, rpc=rpc) as b:
        fa, fb = ChangeFeed(a, ["w"]), ChangeFeed(b, ["w"])
        assert await fa.read() is None and await fb.read() is None  # no earlier answer
        keys = np.arange(1, 40, dtype=np.uint64)
        rid = a.new_request_id()
        await a.push("w", keys, np.ones((keys.size, 1), np.float32), request_id=rid)
        fa.pushed("w", rid)
        got_a, got_b = await fa.read(), await fb.read()
        assert got_a is not None and got_a.size == 0  # its own push is left out
        assert got_b is not None and got_b.tolist() == keys.tolist()
        assert fb.changed_keys == keys.size and fa.incomplete == fb.incomplete == 1
        with pytest.raises(ModeConflictError, match="only a geo table keeps a change log"):
            await a.changes("a", [(0, 0), (0, 0)], [])


async def test_an_unknown_table_is_the_shards_answer_not_an_older_shard(serve_shards: Any) -> None:
    _, urls = await serve_shards(1, (GEO,))
    async with PSClient.connect(urls, rpc=False) as client:
        feed = ChangeFeed(client, ["nope"])
        with pytest.raises(UnknownTableError):
            await feed.read()
        assert feed.supported  # a 404 with a typed error is not a missing route


async def test_a_shard_without_a_change_log_leaves_every_row_to_be_read(caplog: pytest.LogCaptureFixture) -> None:
    # A shard older than the log refuses the frame's op, as `codec.decode` does.
    shard = Shard(ShardSpec(0, 1), (GEO,))

    def older(*_: object) -> Any:
        raise FrameError("unknown op 7")

    shard.handle_changes = older
    feed = ChangeFeed(PSClient.local([shard]), ["w"])
    with caplog.at_level(logging.WARNING, logger="ctrps.geo"):
        assert await feed.read() is None and await feed.read() is None
    assert not feed.supported and feed.incomplete == 2
    assert [r.getMessage() for r in caplog.records] == [
        "shards keep no geo change log (older than this worker): every row is read again each round"
    ]


async def test_an_incomplete_answer_after_a_complete_one_is_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    shard = Shard(ShardSpec(0, 1), (GEO,), change_log_keys=2)
    a, b = PSClient.local([shard]), PSClient.local([shard])
    feed = ChangeFeed(a, ["w"])
    with caplog.at_level(logging.WARNING, logger="ctrps.geo"):
        assert await feed.read() is None  # the first answer: not worth a line
        assert caplog.records == []
        assert (await feed.read()) is not None
        await b.push("w", _keys(1, 2, 3), np.ones((3, 1), np.float32))  # more than the log holds
        assert await feed.read() is None and await feed.read() is not None
        await b.push("w", _keys(4, 5, 6), np.ones((3, 1), np.float32))
        assert await feed.read() is None  # within the minute: no second line
    assert feed.incomplete == 3
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["geo change log answered incomplete"]
    assert shard.stats()["tables"]["w"]["change_log"] == {"entries": 0, "keys": 0, "incomplete": 3}


def test_metrics_count_the_logs_and_the_workers_full_refreshes() -> None:
    shard = Shard(ShardSpec(0, 1), (GEO,))
    shard.tables["w"].changes.record(_keys(1, 2, 3), request_id=5)  # type: ignore[union-attr]
    shard.handle_changes("w", 0, 0, ())  # no earlier answer: incomplete
    stats = WorkerStats(events_trained=10, geo_rounds=4, geo_full_refreshes=1)
    status = worker_status(window_report(1, 10, {0: 0}, {}), stats, update_mode="geo", model="m")
    board = [{"source": "w-a", "received_at": time.time(), "status": status}]
    text = ApiMetrics("m").render(ClusterSnapshot([shard.stats()], summarize(board, "m"), model="m")).decode()
    m = samples(text)
    assert m[("ctrps_table_change_log_keys", (("shard", "0"), ("table", "w")))] == 3
    assert m[("ctrps_table_change_log_incomplete_total", (("shard", "0"), ("table", "w")))] == 1
    assert m[("ctrps_worker_geo_full_refreshes_total", (("model", "m"), ("worker", "w-a")))] == 1
