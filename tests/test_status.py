"""The status board on the shards, the presence pull, and the worker status
that training workers leave on the board (`app.status`).

The board is driven through `PSClient` both in process and over real shard
servers on 127.0.0.1, and through raw HTTP for the inputs a client would never
send; a rejected report must leave the board as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from msgspec import UnsetType

from app.status import (
    SecondsHistogram,
    default_worker_id,
    make_status_hook,
    summarize,
    worker_status,
)
from consumers.worker import WindowReport, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.errors import FrameError, StatusError
from ps_core.hashing import shard_of
from ps_core.model.metrics import evaluate
from ps_core.net import codec, op_encoders
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.wire import WireStats
from ps_core.shard import Shard, ShardSpec
from ps_core.store.board import MAX_SOURCE_CHARS, MAX_STATUS_BYTES, WorkerStatus, as_worker_status
from ps_core.store.table import SparseTable
from ps_core.store.table_config import MODES, TableConfig

EMB = TableConfig("emb", dim=3, optimizer={"name": "adagrad", "lr": 0.1}, init_scale=0.05, seed=5)

Connect = Callable[[int], Awaitable[tuple[PSClient, ControlClient, list[Shard], list[str]]]]


@pytest.fixture(params=["http", "local"])
async def connect(request: pytest.FixtureRequest, serve_shards: Any) -> AsyncIterator[Connect]:
    """A client over `n` shards (table `emb`), over HTTP or in process; the
    shard URLs are empty in process."""
    clients: list[PSClient | ControlClient] = []

    async def make(n: int) -> tuple[PSClient, ControlClient, list[Shard], list[str]]:
        """The data plane's client, the control plane's, the shards and their URLs."""
        if request.param == "http":
            shards, urls = await serve_shards(n, (EMB,))
            client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=2.0))
            control = ControlClient.connect(urls, retry=RetryPolicy(deadline_s=2.0))
        else:
            shards, urls = [Shard(ShardSpec(i, n), (EMB,)) for i in range(n)], []
            client, control = PSClient.local(shards), ControlClient.local(shards)
        clients.extend((client, control))
        return client, control, shards, urls

    yield make
    for c in clients:
        await c.close()


# -- the board ------------------------------------------------------------------


async def test_board_round_trip_keeps_the_latest_status_per_source(connect: Connect) -> None:
    client, control, shards, _ = await connect(2)
    assert await control.statuses() == []
    first = {"kind": "worker", "windows": 1, "last_window": {"window": 1, "auc": 0.5, "partitions": "0,1", "x": None}}
    got = await control.report_status("w1", as_worker_status(first))
    assert got.source == "w1" and got.sources == 1
    await control.report_status("w2", as_worker_status({"windows": 7}))
    await control.report_status("w1", as_worker_status({"windows": 3}))  # replaces w1's, moves it last
    board = await control.statuses()
    assert [(e.source, e.status) for e in board] == [("w2", {"windows": 7}), ("w1", {"windows": 3})]
    assert all(isinstance(e.received_at, float) for e in board)
    assert board[0].received_at <= board[1].received_at
    # The board is shard 0's; the other shards hold none.
    assert shards[1].statuses() == []


async def test_board_is_a_detached_copy(connect: Connect) -> None:
    client, control, _, _ = await connect(1)
    status: dict[str, Any] = {"lag_by_partition": {"0": 5}}
    report = as_worker_status(status)
    await control.report_status("w", report)
    status["lag_by_partition"]["0"] = 99  # the caller's objects change after the report
    assert not isinstance(report.lag_by_partition, UnsetType)
    report.lag_by_partition["0"] = 99
    (entry,) = await control.statuses()
    assert entry.status == {"lag_by_partition": {"0": 5}}


async def test_board_forgets_the_least_recently_reporting_source() -> None:
    shard = Shard(max_sources=3)
    for i in range(5):
        shard.report_status(f"w{i}", {"windows": i}, now=float(i))
    shard.report_status("w2", {"windows": 22}, now=9.0)
    assert [e["source"] for e in shard.statuses()] == ["w3", "w4", "w2"]
    shard.report_status("w5", {"windows": 5}, now=10.0)
    assert [(e["source"], e["status"]["windows"], e["received_at"]) for e in shard.statuses()] == [
        ("w4", 4, 4.0),
        ("w2", 22, 9.0),
        ("w5", 5, 10.0),
    ]


@pytest.mark.parametrize(
    ("source", "status", "match"),
    [
        ("", {}, r"length >= 1 - at `\$\.source`"),
        ("   ", {}, r"matching regex .* - at `\$\.source`"),
        ("x" * (MAX_SOURCE_CHARS + 1), {}, rf"length <= {MAX_SOURCE_CHARS} - at `\$\.source`"),
        (7, {}, r"Expected `str`, got `int` - at `\$\.source`"),
        ("w", [1, 2], r"Expected `object`, got `array` - at `\$\.status`"),
        ("w", "ok", r"Expected `object`, got `str` - at `\$\.status`"),
        ("w", {"last_window": {"blob": "x" * MAX_STATUS_BYTES}}, "exceeds"),
        ("w", {1: "int key"}, "not JSON"),
        ("w", {"big": 2**64}, "not JSON"),
        ("w", {"obj": object()}, "not JSON"),
    ],
)
def test_shard_rejects_bad_reports(source: object, status: object, match: str) -> None:
    shard = Shard()
    shard.report_status("keep", {"windows": 1}, now=1.0)
    before = shard.statuses()
    with pytest.raises(StatusError, match=match):
        shard.report_status(source, status)
    assert shard.statuses() == before


async def test_client_rejects_a_status_that_is_not_a_dict(connect: Connect) -> None:
    client, control, _, _ = await connect(1)
    with pytest.raises(StatusError):
        await control.report_status("w", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(StatusError, match="source"):
        await control.report_status("", as_worker_status({"windows": 1}))
    assert await control.statuses() == []


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b'{"source": "w"}', "required field `status`"),
        (b'{"source": "w", "status": {}, "extra": 1}', "extra"),
        (b'{"source": 5, "status": {}}', "Expected `str`, got `int` - at `$.source`"),
        (b'{"source": "w", "status": [1]}', "Expected `object`, got `array` - at `$.status`"),
        (b'{"source": "w", "status": null}', "Expected `object`, got `null` - at `$.status`"),
        (b'{"source": "w", "status": {"lag_by_partition": {"\\u00b3": 1}}}', "`key` in `$.status.lag_by_partition`"),
    ],
)
async def test_shard_server_rejects_bad_status_bodies(serve_shards: Any, body: bytes, detail: str) -> None:
    shards, urls = await serve_shards(1)
    shards[0].report_status("keep", {"windows": 1}, now=1.0)
    async with aiohttp.ClientSession() as http:
        async with http.post(urls[0] + "/v1/status", data=body) as resp:
            assert resp.status == 400
            err = orjson.loads(await resp.read())
        # A body that is not JSON is invalid_json, on every route.
        assert err["error"] == ("invalid_json" if detail == "not JSON" else "bad_status") and detail in err["detail"], (
            err
        )
        async with http.get(urls[0] + "/v1/status") as resp:
            assert resp.status == 200
            board = orjson.loads(await resp.read())
    assert board == {"statuses": [{"source": "keep", "received_at": 1.0, "status": {"windows": 1}}]}


# -- presence -------------------------------------------------------------------


async def test_pull_versioned_reports_presence_and_initial_values(connect: Connect) -> None:
    client, control, _, _ = await connect(2)
    rng = np.random.default_rng(3)
    keys = rng.integers(0, 2**64, 40, dtype=np.uint64)
    assert set(shard_of(keys, 2).tolist()) == {0, 1}
    trained = keys[::3]
    await client.push("emb", trained, np.full((trained.size, 3), 0.5, np.float32))
    got = await client.pull_versioned("emb", keys, presence=True)
    assert got.present is not None
    np.testing.assert_array_equal(got.present, np.isin(keys, trained))
    np.testing.assert_array_equal(got.weights, await client.pull("emb", keys))
    ref = SparseTable(EMB)
    np.testing.assert_array_equal(got.weights[~got.present], ref.initial_weights(keys[~got.present]))
    assert got.version == 1
    # Without presence, none is computed or sent.
    plain = await client.pull_versioned("emb", keys)
    assert plain.present is None
    np.testing.assert_array_equal(plain.weights, got.weights)
    # An empty pull still answers with the table's dim.
    empty = await client.pull_versioned("emb", np.zeros(0, np.uint64), presence=True)
    assert empty.weights.shape == (0, 3) and empty.present is not None and empty.present.size == 0


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9])
def test_presence_frames_round_trip(n: int) -> None:
    keys = np.arange(n, dtype=np.uint64)
    req = codec.decode(op_encoders.encode_pull("t", keys, presence=True), codec.Op.PULL)
    assert req.presence and req.present is None
    present = np.arange(n) % 3 == 0
    weights = np.ones((n, 2), np.float32)
    buf = op_encoders.encode_weights("t", weights, 4, present)
    assert len(buf) % 8 == 0
    reply = codec.decode(buf, codec.Op.WEIGHTS)
    assert reply.presence and reply.version == 4 and reply.present is not None
    np.testing.assert_array_equal(reply.present, present)
    assert not reply.present.flags.writeable
    plain = codec.decode(op_encoders.encode_weights("t", weights, 4), codec.Op.WEIGHTS)
    assert not plain.presence and plain.present is None


def test_presence_bytes_other_than_0_and_1_are_refused() -> None:
    buf = bytearray(op_encoders.encode_weights("t", np.ones((2, 1), np.float32), 1, np.array([True, False])))
    buf[-8] = 2  # the first presence byte
    with pytest.raises(FrameError, match="0 or 1"):
        codec.decode(bytes(buf))
    push = bytearray(op_encoders.encode_push("t", np.arange(2, dtype=np.uint64), np.ones((2, 1), np.float32)))
    push[6] = codec.FLAG_PRESENCE
    with pytest.raises(FrameError, match="only pulls carry presence"):
        codec.decode(bytes(push))


# -- worker status --------------------------------------------------------------


def window_report(window: int, seconds: float, lag: dict[int, int], dlq: dict[str, int]) -> WindowReport:
    p = np.array([0.2, 0.7, 0.4, 0.9])
    y = np.array([0.0, 1.0, 0.0, 1.0])
    return WindowReport(
        window=window,
        partitions=sorted(lag),
        events=4,
        records=4 + sum(dlq.values()),
        dlq=sum(dlq.values()),
        metrics=evaluate(p, y),
        events_per_s=100.0,
        lag=sum(lag.values()),
        seconds=seconds,
        lag_by_partition=lag,
        dlq_by_reason=dlq,
    )


def account(stats: WorkerStats, report: WindowReport) -> None:
    """What `Worker` does to its stats for a window."""
    stats.windows += 1
    stats.records += report.records
    stats.events_trained += report.events
    stats.dead_letters += report.dlq
    stats.dead_letters_by_reason.update(report.dlq_by_reason)
    stats.last = report


def test_seconds_histogram_buckets() -> None:
    h = SecondsHistogram(bounds=(1.0, 5.0))
    for s in (0.5, 1.0, 3.0, 5.0, 9.0):
        h.observe(s)
    assert h.to_dict() == {"bounds": [1.0, 5.0], "counts": [2, 2, 1], "sum": 18.5, "count": 5}


def test_worker_status_holds_totals_and_the_last_window() -> None:
    stats = WorkerStats()
    r1 = window_report(1, 0.4, {0: 3, 2: 1}, {"invalid_json": 2})
    account(stats, r1)
    r2 = window_report(2, 1.5, {0: 0, 2: 4}, {"bad_label": 1, "invalid_json": 1})
    account(stats, r2)
    status = worker_status(r2, stats, update_mode="async", started_at=12.0)
    assert orjson.loads(orjson.dumps(status)) == status  # JSON-ready as it is
    assert status["kind"] == "worker" and status["update_mode"] == "async"
    assert (status["windows"], status["records_consumed"], status["events_trained"]) == (2, 12, 8)
    assert status["dead_letters"] == 4
    assert status["dead_letters_by_reason"] == {"invalid_json": 3, "bad_label": 1}
    assert status["lag_by_partition"] == {"0": 0, "2": 4}
    assert status["last_window"]["window"] == 2 and status["last_window"]["seconds"] == 1.5
    assert status["last_window"]["auc"] == 1.0
    assert status["started_at"] == 12.0 and "window_seconds" not in status
    assert "model" not in status and worker_status(r2, stats, model="ctr")["model"] == "ctr"


async def test_status_hook_reports_to_the_board_and_summaries_add_up(connect: Connect) -> None:
    client, control, _, _ = await connect(2)
    stats_a, stats_b = WorkerStats(), WorkerStats()
    hook_a = make_status_hook(control, "a", stats_a)
    hook_b = make_status_hook(control, "b", stats_b)
    for report, stats, hook in [
        (window_report(1, 0.3, {0: 10, 1: 4}, {"invalid_json": 1}), stats_a, hook_a),
        (window_report(1, 2.0, {2: 7}, {}), stats_b, hook_b),
        (window_report(2, 0.7, {0: 2}, {"bad_label": 2}), stats_a, hook_a),  # a lost partition 1
        (window_report(2, 0.1, {1: 9, 2: 1}, {}), stats_b, hook_b),  # which b took over
    ]:
        account(stats, report)
        await hook(report)
    # A status that is not a worker's, and a worker status with junk fields:
    # the board refuses both (`ps_core.store.board`); a worker status of no windows yet.
    with pytest.raises(StatusError, match=r"Invalid enum value 'coordinator' - at `\$\.status\.kind`"):
        await control.report_status("coordinator", as_worker_status({"kind": "coordinator", "events_trained": 10**6}))
    with pytest.raises(StatusError, match=r"Expected `int`, got `str` - at `\$\.status\.events_trained`"):
        junk = {"kind": "worker", "events_trained": "many", "lag_by_partition": {"x": 1}}
        await control.report_status("junk", as_worker_status(junk))
    await control.report_status("junk", as_worker_status({"kind": "worker"}))
    board = await control.statuses()
    assert [e.source for e in board] == ["a", "b", "junk"]
    a = board[0].status
    assert a["window_seconds"] == {
        "bounds": list(SecondsHistogram().bounds),
        "counts": [0, 0, 0, 1, 1] + [0] * 8,
        "sum": 1.0,
        "count": 2,
    }
    s = summarize(board)
    assert [w.source for w in s.workers] == ["a", "b", "junk"]
    assert (s.records_consumed, s.events_trained, s.windows) == (
        stats_a.records + stats_b.records,
        stats_a.events_trained + stats_b.events_trained,
        4,
    )
    assert s.dead_letters_by_reason == dict(Counter({"invalid_json": 1, "bad_label": 2}))
    assert s.dead_letters == 3
    # Each partition's figure comes from the latest report naming it.
    assert s.lag_by_partition == {0: 2, 1: 9, 2: 1}
    assert s.lag == 12
    assert s.last_window is None  # the most recent worker status ("junk") has none
    assert s.update_mode is None
    without_junk = summarize(board[:2])
    assert without_junk.last_window is not None
    assert without_junk.last_window["seconds"] == 0.1  # b's, the most recent
    assert without_junk.update_mode == "async"


def test_worker_ids_are_unique_per_call() -> None:
    ids = {default_worker_id() for _ in range(20)}
    assert len(ids) == 20


# -- every stat a worker reports, against the board's schema ---------------------

# Each field of `WorkerStats` and the status field that reports it. A stat
# added to `WorkerStats` fails here until it is reported (and declared by the
# board's closed schema, `ps_core.store.board.WorkerStatus`) or listed in
# `NOT_REPORTED` with the reason.
REPORTED_AS = {
    "windows": "windows",
    "records": "records_consumed",
    "events_trained": "events_trained",
    "dead_letters": "dead_letters",
    "dead_letters_by_reason": "dead_letters_by_reason",
    "commits": "commits",
    "rewinds": "rewinds",
    "failed_commits": "failed_commits",
    "late_commit_failures": "late_commit_failures",
    "stale_offsets": "stale_offsets",
    "outages": "outages",
    "outage_seconds": "outage_seconds",
    "sync_steps": "sync_steps",
    "geo_rounds": "geo_rounds",
    "geo_full_refreshes": "geo_full_refreshes",
    "windows_replayed": "windows_replayed",
    "lag_growing_s": "lag_growing_seconds",
    "lag_warnings": "lag_warnings",
    "last": "last_window",
}
NOT_REPORTED = {
    "waiting_for": "what an outage waits for: no window closes (so no report is sent) while it lasts",
    "history": "the recent windows, kept in the process; the last one is reported",
}
MODE_ONLY = {"sync_steps": "sync", "geo_rounds": "geo", "geo_full_refreshes": "geo"}
"""Stats a worker of one update mode only reports."""


def every_stat() -> WorkerStats:
    """`WorkerStats` with every field set to a value of its own (none left at its default)."""
    report = window_report(3, 0.7, {0: 5, 17: 2}, {"invalid_json": 1})
    values: dict[str, Any] = {}
    for i, f in enumerate(dataclasses.fields(WorkerStats), start=1):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if f.name == "dead_letters_by_reason":
            values[f.name] = Counter({"invalid_json": i, "bad_label": 1})
        elif f.name == "stale_offsets":
            values[f.name] = Counter({("other_cluster", "committed"): i, ("uncovered", "replayed"): 1})
        elif f.name == "last":
            values[f.name] = report
        elif f.name == "history":
            values[f.name] = [report]
        elif isinstance(default, bool) or not isinstance(default, (int, float, str)):
            raise AssertionError(f"WorkerStats.{f.name}: teach every_stat() a value of its type")
        elif isinstance(default, str):
            values[f.name] = "the broker"
        else:
            values[f.name] = type(default)(i) + (0.25 if isinstance(default, float) else 0)
    return WorkerStats(**values)


def test_every_worker_stat_is_reported_or_listed_as_not() -> None:
    names = {f.name for f in dataclasses.fields(WorkerStats)}
    unlisted = names - set(REPORTED_AS) - set(NOT_REPORTED)
    assert not unlisted, f"WorkerStats fields neither reported nor listed in NOT_REPORTED: {sorted(unlisted)}"
    assert not (set(REPORTED_AS) | set(NOT_REPORTED)) - names, "listed fields WorkerStats no longer has"
    declared = set(WorkerStatus.__struct_fields__)
    assert set(REPORTED_AS.values()) <= declared, set(REPORTED_AS.values()) - declared


@pytest.mark.parametrize("mode", MODES)
def test_a_status_with_every_stat_of_each_mode_is_taken_by_the_board(mode: str) -> None:
    """What a worker of `mode` reports, every stat set, every optional part
    (histogram, wire, model) present: the board's closed schema takes it."""
    stats = every_stat()
    assert stats.last is not None
    histogram = SecondsHistogram()
    histogram.observe(0.7)
    wire = WireStats(**{f.name: i for i, f in enumerate(dataclasses.fields(WireStats), start=1)})
    status = worker_status(
        stats.last,
        stats,
        window_seconds=histogram,
        update_mode=mode,
        started_at=12.0,
        wire={"format": "push f16, pull f32", **wire.as_dict()},
        model="ctr",
    )
    for stat, key in REPORTED_AS.items():
        if MODE_ONLY.get(stat, mode) == mode:
            assert key in status, (mode, stat, key)
        else:
            assert key not in status, (mode, stat, key)  # another mode's count: absent, not 0
    assert status["update_mode"] == mode and status["rewinds"] == stats.rewinds
    assert status["lag_growing_seconds"] == stats.lag_growing_s
    board = Shard(ShardSpec(0, 1), ())
    encoded = orjson.loads(orjson.dumps(status))
    board.report_status("w", encoded)  # StatusError naming the field if the schema does not declare it
    assert board.statuses()[0]["status"] == encoded


async def test_a_report_the_board_refuses_is_one_line_saying_it_is_lost(
    connect: Connect, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook never fails training: a refused report is counted and logged
    as lost, naming the cause and the window; the next one taken says so."""
    _, control, _, _ = await connect(1)
    stats = WorkerStats()
    hook = make_status_hook(control, "w", stats, update_mode="geo", model="ctr")
    report = window_report(1, 0.2, {0: 1}, {})
    account(stats, report)
    hook.model = "not a name"  # not printable ASCII without blanks: the board refuses the whole status
    with caplog.at_level(logging.INFO, "ctrps.worker"):
        await hook(report)
        assert (hook.sent, hook.lost) == (0, 1) and await control.statuses() == []
        lost = [r for r in caplog.records if r.getMessage().startswith("status report lost")]
        assert len(lost) == 1 and lost[0].levelno == logging.WARNING
        fields = lost[0].fields  # type: ignore[attr-defined]
        assert "/v1/model, /metrics and dashboard" in lost[0].getMessage()
        assert fields["window"] == 1 and "StatusError" in fields["error"] and "$.status.model" in fields["error"]
        assert fields["lost_in_a_row"] == 1
        hook.model = "ctr"
        await hook(report)
        assert (hook.sent, hook.lost) == (1, 1)
        assert any(r.getMessage() == "status reports resumed" for r in caplog.records)
    assert (await control.statuses())[0].status["geo_full_refreshes"] == 0
