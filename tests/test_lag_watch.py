"""The lag watch on its own clock: when a growing consumer lag is warned
about, how often, what the line says (rates, likely cause), and when it is
not (a steady lag, however large; a step; noise)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from streams import brisk_worker_config, keyed_event, new_topic, produce, running
from waiting import until

from app.api import create_app
from app.config.serve import ApiSettings
from app.status import make_status_hook
from consumers.lag_watch import LagNotice, LagWatch, WindowTimes
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.server import create_shard_app, start_shard_site
from ps_core.shard import Shard

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

PARTS = frozenset({0, 1})


class Feed:
    """A worker's windows: one per `step_s`, `consumed` records (all trained)
    per window while `arriving` records a second reach the broker."""

    def __init__(self, watch: LagWatch, step_s: float = 1.0) -> None:
        self.watch, self.step_s = watch, step_s
        self.t = 1000.0
        self.lag = 500
        self.records = 0
        self.notices: list[LagNotice] = []

    def run(self, seconds: float, arriving: float, consumed: int, times: WindowTimes | None = None) -> None:
        for _ in range(round(seconds / self.step_s)):
            self.window(self.lag + round(arriving * self.step_s) - consumed, consumed, times)

    def window(self, lag: int, consumed: int, times: WindowTimes | None = None) -> None:
        self.t += self.step_s
        self.lag = lag
        self.records += consumed
        w = times or WindowTimes(self.step_s, train_s=self.step_s, train_cpu_s=self.step_s)
        self.watch.window(w)
        got = self.watch.observe(self.t, self.lag, self.records, self.records, PARTS)
        if got is not None:
            self.notices.append(got)

    def warnings(self) -> list[LagNotice]:
        return [n for n in self.notices if n.level == logging.WARNING]


def test_a_lag_growing_past_the_warning_time_is_one_warning_naming_rates_and_cause() -> None:
    watch = LagWatch(warn_after_s=60)
    feed = Feed(watch)
    # Windows waited on the shards: 0.8 s of each 1 s window without CPU.
    slow = WindowTimes(1.0, decode_wait_s=0.05, train_s=0.9, train_cpu_s=0.1)
    feed.run(55, arriving=1000, consumed=400, times=slow)
    assert feed.notices == [] and 50 <= watch.growing_s < 60
    feed.run(10, arriving=1000, consumed=400, times=slow)
    (warning,) = feed.warnings()
    f = warning.fields
    assert 60 <= f["lag_growing_s"] <= 62
    # 600 records a second more arrive than are trained.
    assert f["lag"] - f["lag_was"] == pytest.approx(600 * f["lag_growing_s"], rel=0.05)
    assert f["events_per_s"] == pytest.approx(400, rel=0.05)
    assert f["arriving_per_s"] == pytest.approx(1000, rel=0.05)
    assert f["cause"] == "shards" and f["shards_share"] == pytest.approx(0.8, abs=0.05)
    assert f"{f['lag']} records behind (was {f['lag_was']})" in warning.message
    assert "training 400 events/s while records arrive at 1000/s" in warning.message
    assert "the shards or the link to them are slow" in warning.message
    assert watch.warnings == 1


def test_the_warning_repeats_once_per_period_and_its_end_is_one_line() -> None:
    watch = LagWatch(warn_after_s=20)
    feed = Feed(watch)
    feed.run(100, arriving=1000, consumed=400)
    # Growing from the first window on, for 99 s: warned at 20, 40, 60 and 80 s.
    assert len(feed.warnings()) == watch.warnings == 4
    assert [n.fields["lag_growing_s"] for n in feed.warnings()] == [20, 40, 60, 80]
    assert watch.growing_s == 99
    # Catching up: the lag falls below where it was a horizon (5 s) ago.
    feed.run(5, arriving=1000, consumed=5000)
    ends = [n for n in feed.notices if n.level == logging.INFO]
    assert len(ends) == 1 and "no longer growing" in ends[0].message
    assert ends[0].fields["lag_grew_s"] == 100
    assert watch.growing_s == 0 and watch.warnings == 4


def test_a_steady_lag_however_large_and_a_step_to_it_are_not_growth() -> None:
    watch = LagWatch(warn_after_s=30)
    feed = Feed(watch)
    feed.window(50_000, 1000)  # a step: a burst arrived at once
    for i in range(300):  # then as many arrive as are trained, with noise
        feed.window(50_000 + (137 * i) % 400 - 200, 1000)
    assert feed.notices == [] and watch.warnings == 0


def test_growth_through_noise_is_still_growth() -> None:
    # Each window's lag moves by more than the growth of one window (a
    # window's records are read in bursts), but it grows over the horizon.
    watch = LagWatch(warn_after_s=40)
    feed = Feed(watch)
    for i in range(60):
        feed.window(1000 + 50 * i + (300 if i % 2 else -300), 500)
    assert len(feed.warnings()) == 1


@pytest.mark.parametrize(
    ("times", "cause", "says"),
    [
        (WindowTimes(1.0, decode_wait_s=0.7, train_s=0.2, train_cpu_s=0.2), "decode", "--decode-processes"),
        (WindowTimes(1.0, train_s=0.95, train_cpu_s=0.9), "compute", "CPU is the limit"),
        (WindowTimes(1.0, train_s=0.2, train_cpu_s=0.2), "commit", "offset commit"),
        (WindowTimes(0.1, train_s=0.1, train_cpu_s=0.1), "fetch", "fetching from the broker"),
    ],
)
def test_the_likely_cause_is_the_stage_that_took_most_of_the_time(times: WindowTimes, cause: str, says: str) -> None:
    watch = LagWatch(warn_after_s=10)
    feed = Feed(watch)
    feed.run(12, arriving=1000, consumed=100, times=times)
    (warning,) = feed.warnings()
    assert warning.fields["cause"] == cause and says in warning.message


def test_a_window_longer_than_the_warning_time_is_not_taken_for_waiting_on_fetches() -> None:
    watch = LagWatch(warn_after_s=60)
    feed = Feed(watch, step_s=20)
    slow = WindowTimes(20.0, train_s=19.0, train_cpu_s=2.0)  # 85 % of each window off the CPU
    feed.run(40, arriving=1000, consumed=5000, times=slow)
    # Then one window runs for minutes; the lag is sampled meanwhile.
    watch.window_began(feed.t)
    notices = [
        watch.observe(feed.t + dt, feed.lag + 1000 * dt, feed.records, feed.records, PARTS) for dt in range(5, 200, 5)
    ]
    warnings = [n for n in notices if n is not None]
    assert len(warnings) == 3  # at 60, 120 and 180 s of growth
    for w in warnings:
        assert w.fields["cause"] == "shards" and w.fields["fetch_share"] == 0, w.fields
        assert w.fields["shards_share"] == pytest.approx(0.85, abs=0.01)


def test_off_and_a_new_assignment() -> None:
    off = LagWatch(warn_after_s=0)
    feed = Feed(off)
    feed.run(1000, arriving=1000, consumed=100)
    assert feed.notices == [] and off.growing_s == 0

    watch = LagWatch(warn_after_s=30)
    feed = Feed(watch)
    feed.run(25, arriving=1000, consumed=100)
    assert watch.growing_s >= 20
    # Another assignment: its lag counts other partitions, the growth restarts.
    t = feed.t + 1
    assert watch.observe(t, 10 * feed.lag, feed.records, feed.records, frozenset({2})) is None
    assert watch.growing_s == 0
    with pytest.raises(ValueError, match=">= 0"):
        LagWatch(warn_after_s=-1)


# -- a real worker behind a slow shard ----------------------------------------------


async def test_a_worker_behind_a_slow_shard_warns_that_its_lag_grows_and_metrics_show_it(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every pull and push waits 50 ms at the shard (a slow shard or link), so
    the worker trains well under the 4,000 events/s a producer sends: one
    warning names the shards, the metrics show the growth and the warning,
    and a line says when the lag stops growing."""
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    topic, group = await new_topic(kafka_bootstrap, 2)
    shard = Shard()

    @web.middleware
    async def slow(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path in ("/v1/pull", "/v1/push", "/v1/push_pull"):
            await asyncio.sleep(0.05)  # the slow link: the test's fault, not a wait for a condition
        resp: web.StreamResponse = await handler(request)
        return resp

    app = create_shard_app(shard)
    app.middlewares.append(slow)
    site = await start_shard_site(app, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{site.port}"
    config = brisk_worker_config(kafka_bootstrap, topic, group, 500, 50, mini_batch_ramp=0, lag_warn_s=2.0)
    try:
        async with (
            PSClient.connect([url], rpc=False) as client,
            ControlClient.connect([url]) as control,
        ):
            model = LogisticRegression("m")
            worker = Worker(config, client, control, model)
            worker.on_window = make_status_hook(control, "w-lag", worker.stats, model="m")
            http = TestClient(TestServer(create_app(ApiSettings(), client, model, control=control)))
            await http.start_server()

            async def lag_metrics() -> dict[str, float]:
                text = await (await http.get("/metrics")).text()
                return {
                    m.name: m.value
                    for f in text_string_to_metric_families(text)
                    for m in f.samples
                    if m.labels.get("worker") == "w-lag" and m.name.startswith("ctrps_worker_lag_")
                }

            def lines(start: str) -> list[logging.LogRecord]:
                return [r for r in caplog.records if r.getMessage().startswith(start)]

            try:
                async with running(worker) as task:
                    await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(200)), 2)
                    await until(lambda: worker.stats.events_trained >= 200, 60, what="the first events", task=task)
                    assert not lines("consumer lag")
                    sending = asyncio.create_task(
                        produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(200, 20_200)), 2, rate=4000)
                    )
                    await until(lambda: bool(lines("consumer lag growing")), 30, what="the warning", task=task)
                    (warning,) = lines("consumer lag growing")
                    fields = warning.fields  # type: ignore[attr-defined]
                    assert warning.levelno == logging.WARNING
                    assert fields["cause"] == "shards", warning.getMessage()
                    assert fields["lag_growing_s"] >= 2.0 and fields["lag"] > fields["lag_was"]
                    assert fields["events_per_s"] < fields["arriving_per_s"], fields
                    assert "the shards or the link to them are slow" in warning.getMessage()

                    async def shown() -> bool:
                        m = await lag_metrics()
                        return (
                            m.get("ctrps_worker_lag_warnings_total", 0) >= 1
                            and m.get("ctrps_worker_lag_growing_seconds", 0) >= 2.0
                        )

                    await until(shown, 30, what="the growth in /metrics", task=task)
                    await sending
                    await until(lambda: bool(lines("consumer lag no longer growing")), 30, what="the end", task=task)

                    async def ended() -> bool:
                        return (await lag_metrics()).get("ctrps_worker_lag_growing_seconds") == 0

                    await until(ended, 30, what="the gauge back at 0", task=task)
            finally:
                await http.close()
    finally:
        await site.cleanup()
    assert worker.stats.lag_warnings == len(lines("consumer lag growing")) >= 1
