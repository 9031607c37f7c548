"""The dashboard: the history the API samples (`app.api.history`, ``GET
/v1/history``) and the page that draws it (``GET /``), against real shards in
this process and on loopback.

The sampler is driven deterministically: `History.sample()` called directly
with an injected clock, or the app's own task at a tiny interval with a
bounded wait for a condition. The page's script runs under node (when
installed) over a minimal DOM and the app's real responses.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import io
import logging
import math
import re
import shutil
import time
import tomllib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import waiting
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from documents import validate
from test_api import report_windows, synthetic_events, train, window_report

import app.api.served_models
from app.api import ApiServer, create_app
from app.api.history import LIVE_WORKER_S, History, latency_between, window_quality
from app.api.openapi import openapi_document, response_schema
from app.api.served_models import ServedModels
from app.api.state import HISTORY, SERVED
from app.api.views import ControlView
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.demo import DemoSettings
from app.config.serve import ApiSettings
from app.demo import _announce
from app.metrics import ApiMetrics, ClusterSnapshot
from app.status import WorkerView, make_status_hook
from consumers.worker import WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import PSError, ShardUnavailableError
from ps_core.model.models import Model, make_model
from ps_core.net.client import PSClient
from ps_core.net.control_messages import BoardEntry
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import create_shard_app
from ps_core.shard import Shard, ShardSpec

# The history's points change between turns of the loop: check every one.
until = functools.partial(waiting.until, poll_s=0.002)

PROJECT = Path(__file__).resolve().parent.parent
PAGE = PROJECT / "app" / "api" / "static" / "dashboard.html"


class FakeClock:
    """Seconds since the epoch that move only when told."""

    # Not a whole number: JavaScript would print 1700000000.0 as 1700000000.
    def __init__(self, t: float = 1_700_000_000.25) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def local_cluster(kind: str = "lr", shards: int = 2) -> tuple[PSClient, ControlClient, Model, list[Shard]]:
    model = make_model(kind, "ctr")
    held = [Shard(ShardSpec(i, shards), model.tables()) for i in range(shards)]
    return PSClient.local(held), ControlClient.local(held), model, held


def view_of(control: ControlClient) -> ControlView:
    """What the API's history samples: the cluster's stats and board."""
    return ControlView(control, ApiMetrics())


def table_sizes(model: Model, shards: list[Shard]) -> dict[str, int]:
    return {t: sum(len(s.tables[t]) for s in shards) for t in model.table_names}


class Http:
    """The app in process; every JSON answer is checked against its OpenAPI document."""

    def __init__(self, http: TestClient) -> None:  # type: ignore[type-arg]
        self.http = http
        self.doc = openapi_document()

    async def get(self, path_and_query: str) -> tuple[int, Any]:
        async with self.http.get(path_and_query) as resp:
            status, ctype, raw = resp.status, resp.content_type, await resp.read()
        assert ctype == "application/json", (status, ctype, raw[:200])
        body = orjson.loads(raw)
        path = path_and_query.partition("?")[0]
        schema = response_schema(self.doc, path, "GET", status)
        assert validate(body, schema, self.doc) == [], (path_and_query, status, body)
        return status, body


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Any]]:
    """Serves `create_app(settings, client, model)` in process; the app, then
    `client`, closed at teardown."""
    opened: list[tuple[TestClient, PSClient]] = []  # type: ignore[type-arg]

    async def start(
        client: PSClient, control: ControlClient, model: Model, history: History | None = None, **settings: Any
    ) -> tuple[web.Application, Http]:
        app = create_app(ApiSettings(**settings), client, model, control=control)
        if history is not None:
            app[HISTORY] = history  # before the app starts: its task is this one's
        http = TestClient(TestServer(app))
        await http.start_server()
        opened.append((http, client))
        return app, Http(http)

    yield start
    for http, client in opened:
        await http.close()
        await client.close()


# -- the history ----------------------------------------------------------------------


async def test_each_sample_is_a_point_and_events_per_s_comes_from_each_workers_reports() -> None:
    client, control, model, shards = local_cluster("fm")
    clock = FakeClock()
    history = History(view_of(control), model, interval_s=2.0, max_points=100, clock=clock)
    first = await history.sample()
    assert first is not None and first.t == clock.t
    assert (first.events_trained, first.events_per_s, first.lag, first.dead_letters) == (0, None, 0, 0)
    assert (first.logloss, first.auc, first.copc) == (None, None, None)
    assert first.features == {"ctr_w": 0, "ctr_v": 0}

    rng = np.random.default_rng(1)
    await train(client, model, synthetic_events(rng, 150), rounds=1)
    await report_windows(control, "w-a", [window_report(1, 150, {0: 4, 1: 3}, {"bad_label": 2})])
    clock.t += 2.0
    second = await history.sample()
    assert second is not None
    # One report of w-a: no rate yet (its events may have taken any time).
    assert second.events_trained == 150 and second.events_per_s is None
    assert second.features == table_sizes(model, shards) and second.features["ctr_w"] > 100
    assert (second.lag, second.dead_letters) == (7, 2)
    last = (await control.statuses())[0].status["last_window"]
    assert (second.logloss, second.auc, second.copc) == (last["logloss"], last["auc"], last["copc"])

    # w-a's next window, then w-b's first: w-a's 150 events in the 2 s between its reports.
    await report_windows(control, "w-a", [window_report(i, 150, {0: 4, 1: 3}, {}) for i in (1, 2)])
    clock.t += 2.0
    third = await history.sample()
    assert third is not None and third.events_trained == 300 and third.events_per_s == pytest.approx(75.0)
    await report_windows(control, "w-b", [window_report(1, 60, {2: 1}, {})])
    clock.t += 4.0
    fourth = await history.sample()
    assert fourth is not None and fourth.events_trained == 360
    assert fourth.events_per_s == pytest.approx(75.0)  # w-b has reported once: not counted yet
    assert [p.t for p in history.points()] == [first.t, second.t, third.t, fourth.t]
    assert history.points(since=third.t) == [fourth]
    assert history.points(since=fourth.t) == []
    assert history.points(since=0.0) == [first, second, third, fourth]
    await client.close()


async def test_events_per_s_holds_steady_with_windows_longer_than_the_sample_interval() -> None:
    # A sample every 2 s, a window of 300 events every 6 s: between two
    # samples the total moves one sample in three. A rate between samples
    # would read 0, 0, 150, 0, 0, 150...; over the reports it is 50 throughout.
    client, control, model, _ = local_cluster()
    clock = FakeClock()
    history = History(view_of(control), model, interval_s=2.0, max_points=1000, clock=clock)
    windows: list[int] = []

    async def run(sizes: list[int]) -> list[float | None]:
        rates = []
        for size in sizes:
            windows.append(size)
            await report_windows(control, "w", [window_report(i, n, {0: 0}, {}) for i, n in enumerate(windows, 1)])
            for _ in range(3):
                clock.t += 2.0
                point = await history.sample()
                assert point is not None and point.events_trained == sum(windows)
                rates.append(point.events_per_s)
        return rates

    steady = await run([300] * 12)
    assert steady[:3] == [None] * 3  # one report so far
    assert steady[3:] == [pytest.approx(50.0)] * 33
    # Twice the events per window: the rate climbs to the new one over SPAN_S
    # (30 s: five windows), never down, then holds it.
    faster = await run([600] * 8)
    assert all(a <= b + 1e-9 for a, b in zip(faster, faster[1:])), faster
    assert 50.0 < faster[0] < 100.0 and faster[-9:] == [pytest.approx(100.0)] * 9
    # The worker stops: its rate holds while its silence is ordinary, then it counts 0.
    quiet = []
    for _ in range(20):
        clock.t += 2.0
        point = await history.sample()
        assert point is not None
        quiet.append(point.events_per_s)
    assert quiet[:12] == [pytest.approx(100.0)] * 12 and quiet[-5:] == [0.0] * 5
    await client.close()


async def test_the_history_keeps_the_newest_max_points() -> None:
    client, control, model, _ = local_cluster()
    clock = FakeClock()
    history = History(view_of(control), model, interval_s=1.0, max_points=3, clock=clock)
    for i in range(1, 6):
        await report_windows(control, "w", [window_report(n, 10 * n, {0: 0}, {}) for n in range(1, i + 1)])
        clock.t += 1.0
        await history.sample()
    points = history.points()
    assert len(points) == 3
    # Totals are cumulative: 10, 30, 60, 100, 150.
    assert [p.events_trained for p in points] == [60, 100, 150]
    # Rates over the reports kept, whether their points were dropped or not: 140 events in 4 s.
    assert [p.events_per_s for p in points] == [pytest.approx(50 / 2), pytest.approx(90 / 3), pytest.approx(140 / 4)]
    await client.close()


async def test_events_per_s_is_unknown_when_the_board_forgets_or_a_worker_restarts_its_totals() -> None:
    client, control, model, shards = local_cluster()
    clock = FakeClock()
    history = History(view_of(control), model, interval_s=1.0, max_points=10, clock=clock)
    for n in (1, 2):
        await report_windows(control, "w", [window_report(i, 50, {0: 0}, {}) for i in range(1, n + 1)])
        clock.t += 1.0
        point = await history.sample()
    assert point is not None and point.events_per_s == pytest.approx(50.0)
    # The same worker id, its totals back to one window: its reports start again.
    await report_windows(control, "w", [window_report(1, 50, {0: 0}, {})])
    clock.t += 1.0
    restarted = await history.sample()
    assert restarted is not None and restarted.events_trained == 50 and restarted.events_per_s is None
    # Shard 0 restarted: its board is empty, so the total falls to 0.
    control2 = ControlClient.local([Shard(ShardSpec(0, 2), model.tables()), shards[1]])
    history.view = view_of(control2)
    clock.t += 1.0
    fell = await history.sample()
    assert fell is not None and fell.events_trained == 0 and fell.events_per_s is None
    same_time = await history.sample()
    assert same_time is not None and same_time.events_per_s is None
    await client.close()
    await control2.close()


def view(source: str, received_at: float, **window: Any) -> WorkerView:
    return WorkerView(source, received_at, {"kind": "worker", "last_window": window})


def test_window_quality_weighs_live_workers_by_their_events() -> None:
    now = 1000.0
    got = window_quality(
        [
            view("stale", now - LIVE_WORKER_S - 1, events=1000, logloss=9.0, auc=0.1, copc=9.0),
            view("a", now - 5, events=300, logloss=0.4, auc=0.7, copc=1.2),
            view("b", now, events=100, logloss=0.2, auc=0.9, copc=0.8),
            view("empty", now, events=0, logloss=0.0, auc=0.0, copc=0.0),
            view("junk", now, events="many", logloss="x", auc=None),
        ]
    )
    assert got["logloss"] == pytest.approx((300 * 0.4 + 100 * 0.2) / 400)
    assert got["auc"] == pytest.approx((300 * 0.7 + 100 * 0.9) / 400)
    assert got["copc"] == pytest.approx((300 * 1.2 + 100 * 0.8) / 400)
    # A window without a metric (NaN becomes null on the board) leaves it out.
    partial = window_quality([view("a", now, events=10, logloss=0.3, auc=None, copc=math.inf)])
    assert partial == {"logloss": 0.3, "auc": None, "copc": None}
    assert window_quality([]) == {"logloss": None, "auc": None, "copc": None}


async def test_an_unreachable_shard_skips_samples_logs_once_and_recovers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = make_model("lr", "ctr")
    shard = Shard(ShardSpec(0, 1), model.tables())
    runner = web.AppRunner(create_shard_app(shard), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    retry = RetryPolicy(deadline_s=0.2)
    control = ControlClient.connect([f"http://127.0.0.1:{port}"], retry=retry)
    history = History(view_of(control), model, interval_s=1.0, max_points=10, clock=FakeClock())
    # The API's look for models to sample, through the same shard 0.
    local = PSClient.local([shard])
    served = ServedModels(model, local, view_of(control), control)
    try:
        assert await history.sample() is not None and history.error is None
        await runner.cleanup()
        with caplog.at_level(logging.INFO):
            assert await history.sample() is None
            await served.watch_models()
            # The same outage in other words (a failure's text says how long
            # and how many attempts it waited, which vary with the machine's
            # load): still one line each.
            retry.deadline_s = 0.3
            assert await history.sample() is None
            await served.watch_models()
            assert history.error is not None and "shard_unavailable" in history.error
            assert f"127.0.0.1:{port}" in history.error
            assert len(history.points()) == 1
            # The same shard back on the same port.
            runner = web.AppRunner(create_shard_app(shard), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
            assert await history.sample() is not None and history.error is None
            await served.watch_models()
        lines = [r.getMessage() for r in caplog.records if r.name == "ctrps.history"]
        assert lines == ["history sample failed", "history sampling resumed"]
        assert len(history.points()) == 2
        watch = [r for r in caplog.records if r.name == "ctrps.api"]
        assert [r.getMessage() for r in watch] == ["looking for models to sample failed"]  # once for the outage
        assert "shard_unavailable" in watch[0].fields["error"]  # type: ignore[attr-defined]
    finally:
        await local.close()
        await control.close()
        await runner.cleanup()


def test_the_predict_latency_between_two_readings_is_a_mean_and_interpolated_percentiles() -> None:
    metrics = ApiMetrics("ctr")
    start = metrics.predict_latency("ctr")
    assert start == (0.0, 0.0, ())
    for _ in range(98):
        metrics.predicted("ctr", 1, 0.004)  # the 5 ms bucket
    metrics.predicted("ctr", 1, 0.3)
    metrics.predicted("ctr", 1, 0.3)  # the 0.5 s bucket, above 0.25 s
    metrics.predicted("other", 1, 9.0)
    after = metrics.predict_latency("ctr")
    assert after[0] == 100 and after[2][-1] == (math.inf, 100)
    mean, p50, p99 = latency_between(start, after)
    assert mean == pytest.approx((98 * 4 + 2 * 300) / 100)
    # The 50th of 100 is in the (2, 5] ms bucket of 98: 50/98 of its way, as histogram_quantile says.
    assert p50 == pytest.approx(2.0 + 3.0 * 50 / 98)
    # The 99th of 100 is the first of the 2 between 0.25 and 0.5 s: halfway.
    assert p99 == pytest.approx(375.0)
    assert latency_between(after, after) == (None, None, None)
    metrics.predicted("ctr", 1, 20.0)  # beyond the last finite bound (10 s)
    mean, p50, p99 = latency_between(after, metrics.predict_latency("ctr"))
    assert mean == pytest.approx(20_000.0) and p50 == p99 == 10_000.0
    assert metrics.predict_latency("other")[0] == 1
    # Reading a model never asked creates no series in /metrics.
    assert metrics.predict_latency("never") == (0.0, 0.0, ())
    assert 'model="never"' not in metrics.render(ClusterSnapshot(stats=[None], board=None)).decode()


class Outage:
    """A cluster view whose board read fails while `down`."""

    def __init__(self, inner: ControlView) -> None:
        self.inner, self.num_shards, self.down = inner, inner.num_shards, False

    async def stats_each(self) -> list[dict[str, Any] | PSError]:
        return await self.inner.stats_each()

    async def statuses(self) -> list[BoardEntry]:
        if self.down:
            raise ShardUnavailableError("shard 0 is unreachable")
        return await self.inner.statuses()


async def test_each_point_has_the_predict_latency_of_the_last_span() -> None:
    client, control, model, _ = local_cluster()
    metrics = ApiMetrics("ctr")
    view = Outage(view_of(control))
    clock = FakeClock()
    latency = functools.partial(metrics.predict_latency, "ctr")
    history = History(view, model, interval_s=2.0, max_points=100, clock=clock, predict_latency=latency)
    metrics.predicted("ctr", 4, 0.008)  # after the history started: in its first point
    metrics.predicted("other", 4, 1.0)  # another model's: never in this one's
    first = await history.sample()
    assert first is not None and first.predict_mean_ms == pytest.approx(8.0)
    assert first.predict_p50_ms is not None and 5.0 < first.predict_p50_ms <= first.predict_p99_ms <= 10.0
    # Samples without requests still show those of the last SPAN_S (30 s): a
    # line, not a dot per sample that happened to see a request.
    for _ in range(14):
        clock.t += 2.0
        quiet = await history.sample()
        assert quiet is not None and quiet.predict_mean_ms == pytest.approx(8.0)
    clock.t += 2.0
    metrics.predicted("ctr", 1, 0.004)
    moved_on = await history.sample()  # 30 s after the first: its requests are out
    assert moved_on is not None and moved_on.predict_mean_ms == pytest.approx(4.0)
    assert moved_on.predict_p50_ms is not None and 2.0 < moved_on.predict_p50_ms <= 5.0
    # A failed sample keeps no point, and the next one still covers its requests.
    clock.t += 2.0
    metrics.predicted("ctr", 1, 0.002)
    view.down = True
    assert await history.sample() is None
    view.down = False
    clock.t += 2.0
    after = await history.sample()
    assert after is not None and after.predict_mean_ms == pytest.approx(3.0)
    clock.t += 31.0
    idle = await history.sample()
    assert idle is not None and (idle.predict_mean_ms, idle.predict_p50_ms, idle.predict_p99_ms) == (None, None, None)
    # Without the API's metrics, points carry no latency.
    bare = ServedModels(model, client, view, control).histories["ctr"]
    metrics.predicted("ctr", 1, 0.004)
    point = await bare.sample()
    assert point is not None and (point.predict_mean_ms, point.predict_p99_ms, point.workers) == (None, None, 0)
    await client.close()


def test_history_arguments_and_settings_are_checked() -> None:
    client, control, model, _ = local_cluster()
    for interval_s, max_points in ((0.0, 1), (-1.0, 1), (math.inf, 1), (math.nan, 1), (1.0, 0)):
        with pytest.raises(ValueError):
            History(view_of(control), model, interval_s=interval_s, max_points=max_points)
    args = build_parser().parse_args(["serve"])
    shards = {"CTRPS_SHARDS": "http://a:1"}
    s = ApiSettings.from_args(args, env={**shards, "CTRPS_HISTORY_INTERVAL": "0.5", "CTRPS_HISTORY_POINTS": "60"})
    assert (s.history_interval_s, s.history_points) == (0.5, 60)
    d = ApiSettings.from_args(args, env=shards)
    assert (d.history_interval_s, d.history_points) == (2.0, 1800)
    for env in ({"CTRPS_HISTORY_INTERVAL": "0"}, {"CTRPS_HISTORY_POINTS": "0"}, {"CTRPS_HISTORY_POINTS": "x"}):
        with pytest.raises(SettingsError):
            ApiSettings.from_args(args, env={**shards, **env})


# -- GET /v1/history, through the app's own sampler -------------------------------------


async def test_the_app_samples_while_it_runs_and_stops_on_shutdown(serve: Any) -> None:
    client, control, model, shards = local_cluster()
    app, api = await serve(client, control, model, history_interval_s=0.005, history_points=5)
    history = app[HISTORY]
    assert history.running
    await until(lambda: len(history.points()) >= 1)
    status, body = await api.get("/v1/history")
    assert status == 200
    assert (body["model"], body["interval_s"], body["max_points"], body["error"]) == ("ctr", 0.005, 5, None)
    assert body["points"][0]["events_trained"] == 0

    rng = np.random.default_rng(7)
    await train(client, model, synthetic_events(rng, 80), rounds=1)
    await report_windows(control, "w", [window_report(1, 80, {0: 2}, {})])
    # Once the last sample before the report has left, more than 5 were taken.
    await until(lambda: history.points()[0].events_trained == 80)
    status, body = await api.get("/v1/history")
    points = body["points"]
    assert len(points) == 5
    assert [p["events_per_s"] for p in points] == [None] * 5  # one report: no rate yet
    assert points[-1]["features"] == table_sizes(model, shards) and points[-1]["lag"] == 2
    assert points[-1]["logloss"] is not None and 0 <= points[-1]["auc"] <= 1

    await api.http.close()
    assert not history.running
    taken = history.points()  # a sampler that crashed instead would raise here
    assert taken and taken[-1].events_trained == 80


async def test_every_model_of_the_cluster_is_sampled_without_anyone_asking(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Shard 0 keeps the cluster's models, as `ctrps shard` does.
    coordinator = Coordinator()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
    exporter = Exporter(coordinator, control, tmp_path / "exports", "ctr")
    control.serve_exports(exporter)
    ctr, other, third = make_model("lr", "ctr"), make_model("lr", "other"), make_model("lr", "third")
    for model in (ctr, other):
        assert await exporter.create_model(ModelSpec.of(model))
    monkeypatch.setattr(app.api.served_models, "MAX_SAMPLED_MODELS", 3)
    api_app, api = await serve(client, control, ctr, history_interval_s=0.05, history_points=100)
    served = api_app[SERVED]
    # Workers of "other" and of "ghost" (a name no model was created with) report.
    for name, events in (("other", 70), ("ghost", 5)):
        stats = WorkerStats(windows=1, records=events, events_trained=events)
        await make_status_hook(control, f"w-{name}", stats, model=name)(window_report(1, events, {0: 0}, {}))

    def sampled(name: str, events: int) -> bool:
        h = served.histories.get(name)
        return h is not None and any(p.events_trained == events for p in h.points())

    # Nobody asked for "other": its history is sampled all the same.
    await until(lambda: sampled("other", 70), timeout_s=10, what="other's history with its worker's window")
    assert "other" not in served.predictors and "ghost" not in served.histories
    asked_at = time.time()
    status, body = await api.get("/v1/history?model=other")
    assert status == 200 and body["model"] == "other"
    assert body["points"][0]["t"] < asked_at and body["points"][-1]["events_trained"] == 70
    assert body["points"][-1]["workers"] == 1  # its own worker only
    # A model created while the API runs is found by the next look.
    assert await exporter.create_model(ModelSpec.of(third))
    await until(lambda: sampled("third", 0), timeout_s=10, what="the new model's history")
    # Beyond MAX_SAMPLED_MODELS none is started but by a request naming it.
    fourth = make_model("lr", "fourth")
    assert await exporter.create_model(ModelSpec.of(fourth))
    await served.watch_models()
    assert sorted(served.histories) == ["ctr", "other", "third"]
    status, body = await api.get("/v1/history?model=fourth")
    assert status == 200 and body["model"] == "fourth"
    await control.close()


async def test_the_first_sample_and_the_rate_through_the_app_are_exact(serve: Any) -> None:
    client, control, model, _ = local_cluster()
    clock = FakeClock()
    mine = History(view_of(control), model, interval_s=3600.0, max_points=10, clock=clock)
    app, api = await serve(client, control, model, history=mine)
    history = app[HISTORY]
    # The task samples once at start, then not for an hour: the rest is driven here.
    await until(lambda: len(history.points()) == 1)
    for n in (1, 2):
        await report_windows(control, "w", [window_report(i, 500, {0: 0}, {}) for i in range(1, n + 1)])
        clock.t += 2.5
        await history.sample()
    _, body = await api.get("/v1/history")
    points = body["points"]
    assert [(p["events_trained"], p["events_per_s"]) for p in points] == [(0, None), (500, None), (1000, 200.0)]
    status, newer = await api.get(f"/v1/history?since={points[0]['t']!r}")
    assert status == 200 and newer["points"] == points[1:]
    assert (await api.get(f"/v1/history?since={points[2]['t']!r}"))[1]["points"] == []
    for bad in ("x", "nan", "inf", ""):
        status, err = await api.get(f"/v1/history?since={bad}")
        assert (status, err["error"]) == (400, "bad_request") and "since" in err["detail"]


async def test_a_sampler_that_fails_keeps_running_logs_once_and_shows_the_error(
    serve: Any, caplog: pytest.LogCaptureFixture
) -> None:
    client, control, model, _ = local_cluster()
    calls = 0

    class Broken(History):
        async def sample(self) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("boom")

    broken = Broken(view_of(control), model, interval_s=0.01, max_points=5)
    with caplog.at_level(logging.WARNING, logger="ctrps.history"):
        _, api = await serve(client, control, model, history=broken)
        await until(lambda: calls >= 3)
    assert broken.running
    failed = [r for r in caplog.records if r.name == "ctrps.history"]
    assert len(failed) == 1 and failed[0].exc_info is None, failed
    status, got = await api.get("/v1/history")
    assert status == 200 and got["error"] == "RuntimeError: boom" and got["points"] == []
    await api.http.close()


# -- GET / --------------------------------------------------------------------------------


async def test_the_dashboard_is_one_self_contained_html_page(serve: Any) -> None:
    client, control, model, _ = local_cluster()
    app, api = await serve(client, control, model)
    async with api.http.get("/") as resp:
        assert resp.status == 200
        assert (resp.content_type, resp.charset) == ("text/html", "utf-8")
        csp = resp.headers["Content-Security-Policy"]
        page = await resp.text()
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert page == PAGE.read_text() and page.lstrip().lower().startswith("<!doctype html>")
    # Nothing from elsewhere: no absolute URL at all, no src attributes, no
    # stylesheet or font links, one inline script.
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""(?:src|href)\s*=\s*["']?(?:[a-z]+:)?//""", page, re.I)
    assert not re.search(r"\bsrc\s*=", page, re.I) and "@import" not in page and "url(" not in page
    assert re.findall(r"<link\b[^>]*>", page) == ['<link rel="icon" href="data:,">']
    assert page.count("<script") == 1 and "<script>" in page
    # Every URL the script fetches is a route of this app, relative to the page.
    fetched = set(re.findall(r'"\./(v1/[a-z/]+)"', _script(page)))
    assert fetched == {"v1/history", "v1/model", "v1/models"}
    served = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/" + f for f in fetched} <= served


def _script(page: str) -> str:
    scripts: list[str] = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(scripts) == 1
    return scripts[0]


def test_the_page_ships_with_the_package() -> None:
    config = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["app"]
    relative = PAGE.relative_to(PROJECT / "app").as_posix()
    assert any(fnmatch.fnmatch(relative, g) for g in globs), globs


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_demo_announces_the_dashboard(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    out = io.StringIO()
    async with PSClient.local([Shard()]) as client:
        async with ApiServer(
            ApiSettings(port=0), client, make_model("lr"), control=ControlClient.local([Shard()])
        ) as server:
            with caplog.at_level(logging.INFO, logger="ctrps.demo"):
                _announce(out, server, "127.0.0.1:9092", DemoSettings(port=0, log_format=fmt))
    ready = [r for r in caplog.records if r.getMessage() == "ready"]
    assert ready[0].fields["dashboard"] == server.url + "/"  # type: ignore[attr-defined]
    if fmt == "text":
        assert f"  dashboard  {server.url}/\n" in out.getvalue()


# -- the page's script, under node ----------------------------------------------------------

NODE = shutil.which("node")

# A browser's part, as little as the page uses: elements by id (those the
# page's HTML declares, so a missing id is null as in a browser), fetch
# answering from canned responses, the page's URL query, and a setTimeout
# that hands the next poll to this harness. Prints the elements after each
# poll, the URLs fetched and any unhandled rejection.
HARNESS = r"""
const fs = require("fs"), vm = require("vm");
const [pagePath, roundsPath] = process.argv.slice(2);
const html = fs.readFileSync(pagePath, "utf8");
const { search, rounds } = JSON.parse(fs.readFileSync(roundsPath, "utf8"));
const script = html.match(/<script>([\s\S]*?)<\/script>/)[1];
const elements = new Map();
for (const m of html.matchAll(/<[a-z][a-z0-9]*\b([^>]*?)\sid="([^"]+)"([^>]*)>/g)) {
  const hidden = /\shidden\b/.test(m[1] + " " + m[3]);
  elements.set(m[2], {
    textContent: "", innerHTML: "", className: "", value: "", hidden, addEventListener: () => {},
  });
}
let round = 0, next = null;
const urls = [], snapshots = [], errors = [];
process.on("unhandledRejection", (e) => errors.push(String((e && e.stack) || e)));
const sandbox = {
  console,
  document: { getElementById: (id) => elements.get(id) ?? null },
  setTimeout: (fn) => { next = fn; return 1; },
  clearTimeout: () => { next = null; },
  URLSearchParams,
  location: { search },
  history: { replaceState: () => {} },
  window: { addEventListener: () => {} },
  fetch: (url) => {
    urls.push(url);
    const r = rounds[round][url.split("?")[0]];
    if (!r) return Promise.reject(new TypeError("Failed to fetch " + url));
    return Promise.resolve({ ok: r.status < 400, status: r.status, json: async () => r.body });
  },
};
vm.createContext(sandbox);
vm.runInContext(script, sandbox, { filename: "dashboard.js" });
(async () => {
  for (round = 0; round < rounds.length; round++) {
    if (round > 0) { const fn = next; next = null; fn(); }
    for (let spins = 0; next === null; spins++) {
      if (spins > 10000) throw new Error("the poll never finished");
      await new Promise((resolve) => setImmediate(resolve));
    }
    snapshots.push(Object.fromEntries([...elements].map(([id, e]) => [id, e])));
    snapshots[snapshots.length - 1] = JSON.parse(JSON.stringify(snapshots[snapshots.length - 1]));
  }
  console.log(JSON.stringify({ urls, snapshots, errors }));
})().catch((e) => { console.error(e.stack); process.exit(1); });
"""


async def run_page(tmp_path: Path, rounds: list[dict[str, Any]], search: str = "") -> dict[str, Any]:
    """The page's script through `rounds` of polls (each: path → {status,
    body}), the page's URL query being `search`."""
    assert NODE is not None
    harness, data = tmp_path / "harness.js", tmp_path / "rounds.json"
    harness.write_text(HARNESS)
    data.write_bytes(orjson.dumps({"search": search, "rounds": rounds}))
    proc = await asyncio.create_subprocess_exec(
        NODE, str(harness), str(PAGE), str(data),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()
    result: dict[str, Any] = orjson.loads(out)
    assert result["errors"] == []
    return result


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.process
async def test_the_page_script_parses(tmp_path: Path) -> None:
    source = tmp_path / "dashboard.js"
    source.write_text(_script(PAGE.read_text()))
    proc = await asyncio.create_subprocess_exec(NODE, "--check", str(source), stderr=asyncio.subprocess.PIPE)  # type: ignore[arg-type]
    _, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    assert proc.returncode == 0, err.decode()


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.process
async def test_the_page_shows_an_empty_state_then_charts_from_the_apis_answers(serve: Any, tmp_path: Path) -> None:
    client, control, model, shards = local_cluster("fm")  # two tables: the features caption is their total
    clock, metrics = FakeClock(), ApiMetrics("ctr")
    latency = functools.partial(metrics.predict_latency, "ctr")
    mine = History(view_of(control), model, interval_s=3600.0, max_points=50, clock=clock, predict_latency=latency)
    app, api = await serve(client, control, model, history=mine)
    history = app[HISTORY]
    await until(lambda: len(history.points()) == 1)

    async def answers(history_path: str) -> dict[str, Any]:
        out = {}
        for path, url in (("./v1/history", history_path), ("./v1/model", "/v1/model"), ("./v1/models", "/v1/models")):
            status, body = await api.get(url)
            out[path] = {"status": status, "body": body}
        return out

    empty = await answers("/v1/history")
    since = history.points()[-1].t
    await train(client, model, synthetic_events(np.random.default_rng(3), 100), rounds=1)
    for n in (1, 2, 3):  # a window of 100 events per sample
        reports = [window_report(i, 100, {0: 3, 1: 1}, {"bad_label": 1} if i == 1 else {}) for i in range(1, n + 1)]
        await report_windows(control, "w-1", reports)
        metrics.predicted("ctr", 10, 0.003)
        clock.t += 2.0
        await history.sample()
    trained = await answers(f"/v1/history?since={since!r}")
    outage = {
        "./v1/history": {"status": 200, "body": {**trained["./v1/history"]["body"], "points": [],
                                                 "error": "shard_unavailable: shard 1 at http://h:1 is unreachable"}},
        "./v1/model": {"status": 503, "body": {"error": "shard_unavailable", "detail": "shard 1 is unreachable"}},
    }  # fmt: skip
    result = await run_page(tmp_path, [empty, trained, outage])
    first, second, third = result["snapshots"]

    # Before training: the explanation, the header, the picker, charts without data; no error.
    assert first["empty"]["hidden"] is False
    assert first["status"]["className"] == "ok", first["status"]
    assert first["interval"]["textContent"] == "3600"
    assert first["model"]["textContent"] == "ctr" and first["workers"]["textContent"] == "0"
    assert first["mode"]["textContent"] == "–" and first["version"]["textContent"] == "1"
    assert first["picker"]["value"] == "ctr" and first["picker"]["disabled"] is False
    assert first["picker"]["innerHTML"] == '<option value="ctr">ctr (default)</option>'
    for chart in ("logloss", "auc", "copc", "rate"):
        assert "no data yet" in first[f"{chart}-chart"]["innerHTML"], chart
    assert "no predictions served yet" in first["latency-chart"]["innerHTML"]
    assert first["latency-now"]["textContent"] == "none in the last 30 s"
    assert (first["eps"]["textContent"], first["p99"]["textContent"]) == ("–", "–")
    assert "<path" not in first["latency-chart"]["innerHTML"]
    assert "<path" in first["lag-chart"]["innerHTML"]  # a lag of 0 is data
    # Every chart names its axes, with the unit, even without data.
    for chart, unit in (("rate", "events / s"), ("lag", "records behind"), ("latency", "latency (ms)")):
        svg = first[f"{chart}-chart"]["innerHTML"]
        assert f">{unit}</text>" in svg and ">time (HH:MM:SS, local)</text>" in svg, chart

    # After training: the charts, the header from the newest point, and the
    # next request asked only for newer points, of the API's own model.
    history_urls = [u for u in result["urls"] if u.startswith("./v1/history")]
    assert history_urls[:2] == ["./v1/history", f"./v1/history?since={since!r}"]
    assert result["urls"].count("./v1/models") == 1  # listed once, not on every poll
    assert second["empty"]["hidden"] is True and second["status"]["className"] == "ok"
    assert "4 points" in second["status"]["textContent"]
    last = trained["./v1/history"]["body"]["points"][-1]
    assert second["sampled"]["textContent"] == time.strftime("%H:%M:%S", time.localtime(last["t"]))
    assert second["trained"]["textContent"] == "300" and second["workers"]["textContent"] == "1"
    # 100 events every 2 s, from the second report on.
    assert last["events_per_s"] == pytest.approx(50.0)
    assert second["eps"]["textContent"] == second["rate-now"]["textContent"] == "50"
    assert second["mode"]["textContent"] == "async" and second["dead"]["textContent"] == "1"
    assert second["dead-now"]["textContent"] == "1"
    n_features = sum(table_sizes(model, shards).values())
    assert second["features"]["textContent"] == second["features-now"]["textContent"] == f"{n_features:,}"
    assert second["lag-now"]["textContent"] == "4"
    assert second["logloss-now"]["textContent"] == f"{last['logloss']:.4f}"
    assert second["copc-now"]["textContent"] == f"{last['copc']:.3f}"
    # Requests of 3 ms: the mean is exact, the percentiles within their bucket (2 to 5 ms).
    assert last["predict_mean_ms"] == pytest.approx(3.0) and 2.0 < last["predict_p50_ms"] <= 5.0
    assert 2.0 < last["predict_p99_ms"] <= 5.0
    p50, p99 = last["predict_p50_ms"], last["predict_p99_ms"]
    assert second["latency-now"]["textContent"] == f"p50 {p50:.1f} · p99 {p99:.1f} ms"
    assert second["p99"]["textContent"] == f"{p99:.1f} ms"
    for chart in ("logloss", "auc", "copc", "rate", "dead", "lag", "features", "latency"):
        svg = second[f"{chart}-chart"]["innerHTML"]
        assert svg.startswith("<svg") and "<path" in svg and "no data yet" not in svg, chart
        # Time ticks as HH:MM:SS under the plot.
        assert re.search(r">\d\d:\d\d:\d\d</text>", svg), chart
    # The log loss line: a dot at the empty first sample is absent (null), then
    # three samples joined by two segments.
    d = re.search(r'd="([^"]*)"', second["logloss-chart"]["innerHTML"])
    assert d is not None and d.group(1).count("M") == 1 and d.group(1).count("L") == 2
    # COPC's reference line at 1.0, inside the range drawn.
    assert '<line class="ref"' in second["copc-chart"]["innerHTML"]
    assert re.findall(r"<title>([^<]*)</title></path>", second["latency-chart"]["innerHTML"]) == ["p50", "p99"]

    # An outage: said in the status line, the charts stay.
    assert third["status"]["className"] == "warn"
    assert "shard_unavailable" in third["status"]["textContent"] and "model:" in third["status"]["textContent"]
    assert third["logloss-chart"]["innerHTML"] == second["logloss-chart"]["innerHTML"]


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.process
async def test_the_page_polls_the_model_its_url_names(tmp_path: Path) -> None:
    listing = {
        "default": "ctr",
        "models": [
            {"name": n, "type": "lr", "tables": [f"{n}_w"], "update_mode": "async", "predict": f"/v1/models/{n}/predict",
             "default": n == "ctr"}
            for n in ("ctr", "a<b")
        ],
    }  # fmt: skip
    point = {
        "t": 1_700_000_000.25, "events_trained": 42, "events_per_s": None, "logloss": None, "auc": None,
        "copc": None, "lag": 0, "dead_letters": 0, "features": {"a<b_w": 7}, "workers": 1,
        "predict_mean_ms": None, "predict_p50_ms": None, "predict_p99_ms": None,
    }  # fmt: skip
    history = {"model": "a<b", "interval_s": 2.0, "max_points": 10, "error": None, "points": [point]}
    info = {"model": "a<b", "update_mode": "async", "model_version": 3, "events_trained": 42}
    answers = {
        "./v1/models": {"status": 200, "body": listing},
        "./v1/history": {"status": 200, "body": history},
        "./v1/model": {"status": 200, "body": info},
    }
    result = await run_page(tmp_path, [answers, answers], search="?model=a%3Cb&x=1")
    first, second = result["snapshots"]
    # Every poll names the model, escaped; the listing comes once.
    assert sorted(result["urls"]) == sorted(
        ["./v1/history?model=a%3Cb", "./v1/model?model=a%3Cb", "./v1/models"]
        + ["./v1/history?model=a%3Cb&since=1700000000.25", "./v1/model?model=a%3Cb"]
    )
    assert first["picker"]["value"] == "a<b"
    assert first["picker"]["innerHTML"] == (
        '<option value="ctr">ctr (default)</option><option value="a&lt;b">a&lt;b</option>'
    )
    assert (first["model"]["textContent"], first["trained"]["textContent"]) == ("a<b", "42")
    assert (first["features"]["textContent"], first["version"]["textContent"]) == ("7", "3")
    assert second["trained"]["textContent"] == "42" and second["status"]["className"] == "ok"
