"""The dashboard as a person sees it: headless Chromium on ``GET /`` of a live
API, over shard servers on 127.0.0.1 that two models train on.

Chromium is driven through its DevTools protocol (CDP) on a websocket, with
aiohttp: the page's console, its exceptions and every request it sends are
seen, and the DOM is read after layout (text boxes, drawn paths). Screenshots
go to ``artifacts/`` (gitignored) for a person to look at. Skipped only when
no ``chromium`` binary is on PATH (Debian's package; ``.ci/run`` installs it).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson
import pytest
from test_api import synthetic_events
from training import train_step
from waiting import until

from app.api import ApiServer
from app.api.history import History
from app.api.state import HISTORY, SERVED
from app.config.serve import ApiSettings
from app.status import make_status_hook
from consumers.worker import WindowReport, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.registry import ModelSpec
from ps_core.model.metrics import Metrics, evaluate
from ps_core.model.models import Model, make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium binary on PATH: install Debian's chromium package (.ci/run does)"
    ),
    pytest.mark.slow,  # a browser and a cluster
    pytest.mark.process,
]

PROJECT = Path(__file__).resolve().parent.parent
ARTIFACTS = PROJECT / "artifacts"
CHARTS = ("rate", "logloss", "auc", "copc", "dead", "lag", "features", "latency")
OTHER_WINDOWS, OTHER_EVENTS = 3, 70
"""The other model's worker trains 3 windows of 70 events and stops: its
header must then read 210, a total the API's own model never shows."""


class Cdp:
    """One DevTools protocol session: a page's websocket, commands answered
    by id, events kept in order of arrival."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.events: list[dict[str, Any]] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = orjson.loads(msg.data)
            waiter = self._waiting.pop(data.get("id", -1), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(data)
            elif "method" in data:
                self.events.append(data)
        for waiter in self._waiting.values():  # the browser went away: fail the callers now
            if not waiter.done():
                waiter.set_exception(ConnectionError("the DevTools websocket closed"))

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one command; its result (an error answer raises)."""
        n = next(self._ids)
        waiter = self._waiting[n] = asyncio.get_running_loop().create_future()
        await self.ws.send_str(orjson.dumps({"id": n, "method": method, "params": params}).decode())
        answer = await asyncio.wait_for(waiter, timeout=15)
        assert "error" not in answer, (method, answer["error"])
        result: dict[str, Any] = answer["result"]
        return result

    async def evaluate(self, expression: str) -> Any:
        """The JSON value of `expression` in the page."""
        got = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in got, got["exceptionDetails"]
        return got["result"].get("value")

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser-logged errors (a CSP
        refusal, a failed load) so far."""
        out = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                out.append(str(p["exceptionDetails"].get("exception", {}).get("description", p["exceptionDetails"])))
            elif e["method"] == "Runtime.consoleAPICalled" and p["type"] in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(f"{p['entry']['source']}: {p['entry']['text']} {p['entry'].get('url', '')}")
        return out

    def requests(self, start: int = 0) -> list[str]:
        """The URLs the page requested, from event `start` on (path and query)."""
        urls = [
            urlsplit(e["params"]["request"]["url"])
            for e in self.events[start:]
            if e["method"] == "Network.requestWillBeSent"
        ]
        return [u.path + (f"?{u.query}" if u.query else "") for u in urls if u.scheme == "http"]

    async def screenshot(self, path: Path) -> None:
        """The whole page as a PNG at `path`."""
        size = (await self.call("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.call("Page.captureScreenshot", format="png", clip=clip, captureBeyondViewport=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


@contextlib.asynccontextmanager
async def chromium(profile: Path) -> AsyncIterator[Cdp]:
    """Headless Chromium on about:blank, its DevTools on a free loopback port;
    a CDP session on its page, with the domains this test listens to enabled."""
    assert CHROMIUM is not None
    profile.mkdir()
    log = (profile.parent / "chromium.log").open("wb")
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        # Chromium refuses root with its sandbox, and containers seldom allow it;
        # the page is our own, on loopback.
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--no-default-browser-check",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--window-size=1280,800",  # a laptop's screen
        f"--user-data-dir={profile}",
        "--remote-debugging-port=0",
        "about:blank",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    session = aiohttp.ClientSession()
    cdp: Cdp | None = None
    try:
        # Chromium writes the port it picked to this file once DevTools listens.
        active = profile / "DevToolsActivePort"

        def listening() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"chromium exited with {proc.returncode}: see {log.name}")
            return active.is_file() and len(active.read_text().splitlines()) >= 2

        await until(listening, timeout_s=20, what="chromium's DevTools port")
        port = int(active.read_text().splitlines()[0])
        async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            targets = await resp.json()
        page = next(t for t in targets if t["type"] == "page")
        ws = await session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024)
        cdp = Cdp(ws)
        for domain in ("Page", "Runtime", "Log", "Network"):
            await cdp.call(f"{domain}.enable")
        yield cdp
    finally:
        if cdp is not None:
            with contextlib.suppress(Exception):  # it may be gone already
                await cdp.call("Browser.close")
            await cdp.close()
        elif proc.returncode is None:
            proc.terminate()
        await session.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout=5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        log.close()


async def next_sample(history: History) -> None:
    """Return once `history` has taken a point after those it holds now."""

    def newest() -> float:
        points = history.points()
        return points[-1].t if points else 0.0

    seen = newest()
    await until(lambda: newest() > seen, timeout_s=10, what="the next sample")


async def train_window(client: PSClient, model: Model, events: list[dict[str, Any]]) -> Metrics:
    """One window as the worker trains it: predicted before training (the
    progressive metrics), then one pull → gradients → push."""
    batch, errors = model.hasher().featurize(events)
    assert not errors
    return evaluate(await train_step(client, model, batch), batch.labels)


async def run_worker(
    client: PSClient,
    control: ControlClient,
    model: Model,
    events: int,
    windows: int | None,
    pace: History,
    every: int = 1,
) -> None:
    """A training worker of `model` reporting to the board after each window
    (its status hook): `windows` of `events` (None: until cancelled), one per
    `every` samples of `pace` (1: each point of the API's history sees a new
    window; more: windows longer than the sample interval)."""
    stats = WorkerStats()
    hook = make_status_hook(control, f"worker-{model.name}", stats, model=model.name)
    rng = np.random.default_rng(len(model.name))  # another stream per model
    for n in itertools.count(1):
        if windows is not None and n > windows:
            return
        batch = synthetic_events(rng, events)
        metrics = await train_window(client, model, batch)
        lag = {0: max(0, 4000 - 300 * n), 1: max(0, 2500 - 200 * n)}
        dlq = {"bad_label": 1} if n % 3 == 0 else {}
        report = WindowReport(
            window=n,
            partitions=[0, 1],
            events=events,
            records=events + sum(dlq.values()),
            dlq=sum(dlq.values()),
            metrics=metrics,
            events_per_s=events / 0.25,
            lag=sum(lag.values()),
            seconds=0.25,
            lag_by_partition=lag,
            dlq_by_reason=dlq,
        )
        stats.windows += 1
        stats.records += report.records
        stats.events_trained += events
        stats.dead_letters += report.dlq
        stats.dead_letters_by_reason.update(dlq)
        await hook(report)
        for _ in range(every):
            await next_sample(pace)


async def predict_traffic(url: str, models: tuple[str, ...], pace: History, every: int = 1) -> None:
    """Predict requests for every model, a few per `every` samples of `pace`, until cancelled."""
    events = synthetic_events(np.random.default_rng(9), 5)
    for e in events:
        e.pop("label")
    async with aiohttp.ClientSession() as session:
        while True:
            for name in models:
                for _ in range(3):
                    async with session.post(f"{url}/v1/models/{name}/predict", json={"events": events}) as resp:
                        assert resp.status == 200, await resp.text()
            for _ in range(every):
                await next_sample(pace)


# Everything the test reads of the page, after layout: per chart its axis
# titles, drawn paths (points per series) and tick labels with their boxes.
SNAPSHOT = r"""
(() => {
  // Asked while the page still loads (its later elements and script not
  // there yet): nothing to read yet.
  if (document.readyState !== "complete") return null;
  const picker = document.getElementById("picker");
  if (picker === null) return null;
  const text = (id) => document.getElementById(id).textContent;
  const charts = {};
  for (const fig of document.querySelectorAll("main figure")) {
    const id = fig.querySelector("div").id.replace(/-chart$/, "");
    const svg = fig.querySelector("svg");
    if (svg === null) { charts[id] = null; continue; }
    const box = svg.getBoundingClientRect();
    const labels = [...svg.querySelectorAll("text")].map((t) => {
      const r = t.getBoundingClientRect();
      return { text: t.textContent, cls: t.getAttribute("class") || "",
               box: [r.left, r.top, r.right, r.bottom], height: r.height };
    });
    charts[id] = {
      caption: fig.querySelector("figcaption span").textContent,
      // An ellipsis: the caption and its latest value do not fit side by side.
      clipped: fig.querySelector("figcaption span").scrollWidth > fig.querySelector("figcaption span").clientWidth,
      now: text(id + "-now"),
      titles: labels.filter((l) => l.cls === "axis-title").map((l) => l.text),
      labels,
      box: [box.left, box.top, box.right, box.bottom],
      paths: [...svg.querySelectorAll("path.series")].map((p) => ({
        name: p.textContent, points: (p.getAttribute("d").match(/[ML]/g) || []).length,
        runs: (p.getAttribute("d").match(/M/g) || []).length,
      })),
      ref: svg.querySelectorAll("line.ref").length,
    };
  }
  const last = state.points.length ? state.points[state.points.length - 1] : null;
  return {
    search: location.search,
    model: text("model"),
    picker: { value: picker.value, disabled: picker.disabled, options: [...picker.options].map((o) => o.value) },
    header: Object.fromEntries(["workers", "trained", "features", "lag", "dead", "mode", "version", "eps", "p99"].map((k) => [k, text(k)])),
    height: document.documentElement.scrollHeight,
    width: document.documentElement.clientWidth,
    rates: state.points.map((p) => p.events_per_s),
    status: { text: text("status"), cls: document.getElementById("status").className },
    points: state.points.length,
    last,
    charts,
  };
})()
"""


async def snapshot(cdp: Cdp) -> dict[str, Any] | None:
    got: dict[str, Any] | None = await cdp.evaluate(SNAPSHOT)
    return got


def drawn(page: dict[str, Any] | None, model: str, *, trained: str | None = None) -> bool:
    """Whether the page shows `model` with every chart drawn from several points."""
    if page is None or page["model"] != model or page["status"]["cls"] != "ok":
        return False
    if trained is not None and page["header"]["trained"] != trained:
        return False
    return all(
        c is not None and c["paths"] and max(p["points"] for p in c["paths"]) >= 3 for c in page["charts"].values()
    )


def check_readable(page: dict[str, Any]) -> None:
    """Every chart: axis titles with units, number and HH:MM:SS tick labels,
    none overlapping another or leaving the chart, none tiny."""
    units = {
        "rate": "events / s",
        "logloss": "log loss (nats / event)",
        "auc": "AUC (0 to 1)",
        "copc": "COPC (ratio)",
        "dead": "records (total)",
        "lag": "records behind",
        "features": "features (rows)",
        "latency": "latency (ms)",
    }
    assert set(page["charts"]) == set(CHARTS)
    for name, chart in page["charts"].items():
        assert not chart["clipped"], (name, chart["caption"], chart["now"])
        assert chart["titles"] == [units[name], "time (HH:MM:SS, local)"], (name, chart["titles"])
        ticks = [
            lbl
            for lbl in chart["labels"]
            if lbl["cls"] == "" and lbl["text"] not in {p["name"] for p in chart["paths"]}
        ]
        times = [t["text"] for t in ticks if ":" in t["text"]]
        numbers = [t["text"] for t in ticks if ":" not in t["text"]]
        assert times and all(len(t) == 8 and t[2] == t[5] == ":" for t in times), (name, times)
        assert len(numbers) >= 2, (name, numbers)
        for n in numbers:
            float(n.rstrip("kMG"))  # a plain number, with a k/M/G suffix at most
        left, top, right, bottom = chart["box"]
        boxes = [lbl["box"] for lbl in chart["labels"]]
        for lbl in chart["labels"]:
            x0, y0, x1, y1 = lbl["box"]
            assert left - 0.5 <= x0 and x1 <= right + 0.5 and top - 0.5 <= y0 and y1 <= bottom + 0.5, (name, lbl)
            assert lbl["height"] >= 10, (name, lbl)  # CSS pixels: readable at 100 %
        for a, b in itertools.combinations(boxes, 2):
            apart = a[2] <= b[0] + 0.5 or b[2] <= a[0] + 0.5 or a[3] <= b[1] + 0.5 or b[3] <= a[1] + 0.5
            assert apart, (name, a, b, [lbl["text"] for lbl in chart["labels"] if lbl["box"] in (a, b)])
    assert page["charts"]["copc"]["ref"] == 1  # the 1.0 line
    assert [p["name"] for p in page["charts"]["latency"]["paths"]] == ["p50", "p99"]


def check_fits_a_laptop(page: dict[str, Any]) -> None:
    """At 1280 px wide the whole page is about a laptop screen tall: a compact grid."""
    assert page["width"] == 1280, page["width"]
    assert page["height"] <= 1100, page["height"]


def check_rate_holds(page: dict[str, Any]) -> None:
    """Events/s with windows longer than the sample interval: above 0 at every
    point from the worker's second report on, the headline as well (a rate
    between two samples would read 0 at two points in three)."""
    rates = [r for r in page["rates"] if r is not None]
    assert len(rates) >= 6 and min(rates) > 0, page["rates"]
    for shown in (page["header"]["eps"], page["charts"]["rate"]["now"]):
        assert int(shown.replace(",", "")) > 0, shown


def check_latency_is_a_line(page: dict[str, Any]) -> None:
    """Predict requests once every few samples: the latency percentiles are
    one unbroken line from the first request on, not a dot now and then."""
    for path in page["charts"]["latency"]["paths"]:
        assert path["runs"] == 1 and path["points"] >= 6, path
    assert page["header"]["p99"].endswith(" ms"), page["header"]["p99"]


def check_header_is_the_newest_point(page: dict[str, Any]) -> None:
    """The header's figures and each chart's latest value are one sample's."""
    last, header, charts = page["last"], page["header"], page["charts"]
    assert header["trained"] == f"{last['events_trained']:,}"
    assert header["workers"] == str(last["workers"]) == "1"
    assert header["lag"] == charts["lag"]["now"] == f"{last['lag']:,}"
    assert header["dead"] == charts["dead"]["now"] == f"{last['dead_letters']:,}"
    assert header["features"] == charts["features"]["now"] == f"{sum(last['features'].values()):,}"


async def test_the_dashboard_in_chromium_draws_both_models_and_switches_between_them(tmp_path: Path) -> None:
    # Two shards in this process, shard 0 keeping the cluster's models as
    # `ctrps shard` does: the API finds "other" through the control plane.
    coordinator = Coordinator()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
    exporter = Exporter(coordinator, control, tmp_path / "exports", "ctr")
    control.serve_exports(exporter)
    ctr, other = make_model("lr", "ctr"), make_model("lr", "other")
    settings = ApiSettings(port=0, history_interval_s=0.25, history_points=400)
    tasks: list[asyncio.Task[None]] = []
    try:
        for model in (ctr, other):
            assert await exporter.create_model(ModelSpec.of(model))
        async with ApiServer(settings, client, ctr, control=control) as server:
            pace = server.app[HISTORY]
            tasks += [
                # Windows three samples long: the events/s must not saw-tooth to 0 between them.
                asyncio.create_task(run_worker(client, control, ctr, 500, None, pace, every=3), name="worker-ctr"),
                asyncio.create_task(
                    run_worker(client, control, other, OTHER_EVENTS, OTHER_WINDOWS, pace), name="worker-other"
                ),
                # Predictions once every four samples: the latency chart must still be a line.
                asyncio.create_task(predict_traffic(server.url, ("ctr", "other"), pace, every=4), name="predict"),
            ]
            ctr_task, other_task, traffic = tasks
            await until(other_task.done, timeout_s=15, what="the other model's windows", task=ctr_task)
            other_task.result()
            # The API samples the other model without anyone asking: its history
            # was started before any page or request named it.
            other_history = server.app[SERVED].histories["other"]

            def enough(history: History, events: int | None = None) -> bool:
                full = [
                    p
                    for p in history.points()
                    if p.logloss is not None
                    and p.predict_mean_ms is not None
                    and (events is None or p.events_trained == events)
                ]
                return len(full) >= 6

            await until(
                lambda: enough(pace),
                timeout_s=10,
                what="six points of ctr with windows and predict latency",
                task=traffic,
            )
            total = OTHER_WINDOWS * OTHER_EVENTS
            await until(
                lambda: enough(other_history, total),
                timeout_s=10,
                what="six points of other with its windows and predict latency",
                task=traffic,
            )

            async with chromium(tmp_path / "profile") as cdp:
                await cdp.call("Page.navigate", url=f"{server.url}/")
                page: dict[str, Any] | None = None

                async def shown(model: str, trained: str | None = None) -> bool:
                    nonlocal page
                    page = await snapshot(cdp)
                    return drawn(page, model, trained=trained)

                await until(lambda: shown("ctr"), timeout_s=10, what="the charts of ctr", task=ctr_task)
                assert page is not None
                assert page["picker"] == {"value": "ctr", "disabled": False, "options": ["ctr", "other"]}
                assert page["search"] == "" and page["header"]["mode"] == "async"
                check_readable(page)
                check_header_is_the_newest_point(page)
                check_fits_a_laptop(page)
                check_rate_holds(page)
                check_latency_is_a_line(page)
                await cdp.screenshot(ARTIFACTS / "dashboard-ctr.png")

                # Pick the other model as a person does: the select changes, then its change event.
                switched_at = len(cdp.events)
                await cdp.evaluate(
                    '(() => { const p = document.getElementById("picker"); p.value = "other";'
                    'p.dispatchEvent(new Event("change")); })()'
                )
                await until(
                    lambda: shown("other", f"{total:,}"), timeout_s=10, what="the charts of other", task=traffic
                )
                assert page is not None
                assert page["search"] == "?model=other" and page["picker"]["value"] == "other"
                check_readable(page)
                check_header_is_the_newest_point(page)
                # Every poll since names it: no answer for ctr could have been drawn.
                polled = [u for u in cdp.requests(switched_at) if u.partition("?")[0] in ("/v1/history", "/v1/model")]
                assert all("model=other" in u for u in polled), polled
                assert any(u.startswith("/v1/history?model=other") for u in polled), polled
                assert any(u.startswith("/v1/model?model=other") for u in polled), polled
                await cdp.screenshot(ARTIFACTS / "dashboard-other.png")

                # A reload keeps the choice: it is in the URL.
                reloaded_at = len(cdp.events)
                await cdp.call("Page.reload")
                await until(
                    lambda: shown("other", f"{total:,}"), timeout_s=10, what="other after a reload", task=traffic
                )
                first = next(u for u in cdp.requests(reloaded_at) if u.startswith("/v1/history"))
                assert first == "/v1/history?model=other", first
                assert cdp.errors() == []
            assert ctr_task.done() is False and traffic.done() is False  # neither failed meanwhile
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        await control.close()
    for shot in ("dashboard-ctr.png", "dashboard-other.png"):
        assert (ARTIFACTS / shot).read_bytes().startswith(b"\x89PNG")
