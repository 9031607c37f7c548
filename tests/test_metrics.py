"""Every role's ``/metrics``, and a worker's status from the worker to what
an operator reads.

For each update mode a real ``ctrps worker`` role (`app.roles.worker.run_worker`,
with ``--metrics-port``) trains from the real broker against two shard
servers on loopback (shard 0 with its coordinator); its status is followed to
the API (`app.api.ApiServer`): ``/v1/model``, ``/metrics`` and the dashboard's
``/v1/history``; and the worker's, the shards' and the API's expositions each
pass ``promtool check metrics`` (skipped where promtool is absent).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from commands import PROJECT, clean_env
from exposition import assert_promtool_passes, needs_promtool, samples
from streams import keyed_event, new_topic, produce
from waiting import json_when_ok, until

from app.api import ApiServer
from app.config.declared import SettingsError
from app.config.serve import ApiSettings
from app.config.worker import WorkerSettings
from app.failures import ExpectedFailure
from app.metrics import ApiMetrics, ClusterSnapshot
from app.roles.worker import run_worker
from consumers.broker import free_port
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.auth import Scope, bearer, derive_token, new_secret
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import MODES

pytestmark = pytest.mark.slow  # real processes for seconds each: make test-fast leaves them out

EVENTS = 600


async def _text(http: aiohttp.ClientSession, url: str) -> bytes:
    async with http.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        assert resp.status == 200, (url, resp.status, await resp.text())
        assert resp.headers["Content-Type"].startswith("text/plain; version="), resp.headers
        return await resp.read()


def _total(text: bytes, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    return sum(v for got, v in samples(text, name) if labels.items() <= got.items())


@needs_promtool
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.process
async def test_a_workers_status_reaches_every_reader_and_every_exposition_passes_promtool(
    kafka_bootstrap: str, serve_shards: Any, tmp_path: Path, mode: str
) -> None:
    shards, urls = await serve_shards(2, (), tmp_path, rpc=True)
    topic, group = await new_topic(kafka_bootstrap, 2)
    await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(EVENTS)), 2)
    metrics_port = free_port()
    settings = WorkerSettings(
        bootstrap=kafka_bootstrap,
        shards=tuple(urls),
        topic=topic,
        group=group,
        model_name="m",
        mode=mode,
        window_events=200,
        mini_batch=64,
        geo_steps=2,
        decode_processes=0,
        session_timeout_ms=6000,
        metrics_port=metrics_port,
    )
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop), name="worker")
    model = make_model("lr", "m", mode=mode)
    try:
        async with (
            PSClient.connect(urls) as client,
            ControlClient.connect(urls) as control,
            ApiServer(ApiSettings(port=0, history_interval_s=0.2), client, model, control=control) as api,
            aiohttp.ClientSession() as http,
        ):

            async def trained() -> bool:
                info = await json_when_ok(http, f"{api.url}/v1/model?model=m")
                return info is not None and info["events_trained"] >= EVENTS

            await until(trained, 90, what=f"the API to report the {mode} worker's {EVENTS} events", task=worker)
            info = await json_when_ok(http, f"{api.url}/v1/model?model=m")
            assert info["update_mode"] == mode and len(info["workers"]) == 1, info
            assert info["windows"] >= 3 and info["last_window"]["events"] > 0

            # The dashboard draws /v1/history (events, workers) and /v1/model (the mode).
            async def sampled() -> bool:
                got = await json_when_ok(http, f"{api.url}/v1/history?model=m")
                return got is not None and bool(got["points"]) and got["points"][-1]["events_trained"] >= EVENTS

            await until(sampled, 30, what="a dashboard sample of the events trained", task=worker)
            point = (await json_when_ok(http, f"{api.url}/v1/history?model=m"))["points"][-1]
            assert point["workers"] == 1 and point["features"]["m_w"] > 0

            exposed = await _text(http, f"{api.url}/metrics")
            assert_promtool_passes(exposed)
            assert _total(exposed, "ctrps_events_trained_total", model="m") == EVENTS
            assert _total(exposed, "ctrps_worker_info", model="m", update_mode=mode) == 1
            assert _total(exposed, "ctrps_port_open_connections", role="api") >= 1  # this very scrape
            assert _total(exposed, "ctrps_table_pushes_total", table="m_w") > 0

            # The worker's own, on its --metrics-port.
            own = await _text(http, f"http://127.0.0.1:{metrics_port}/metrics")
            assert_promtool_passes(own)
            assert _total(own, "ctrps_events_trained_total", model="m") == EVENTS
            assert _total(own, "ctrps_worker_info", model="m", update_mode=mode) == 1
            assert _total(own, "ctrps_worker_status_reports_total", outcome="sent") == info["windows"]
            assert _total(own, "ctrps_worker_status_reports_total", outcome="lost") == 0
            steps = {"sync": "ctrps_worker_sync_steps_total", "geo": "ctrps_worker_geo_rounds_total"}
            if mode in steps:
                assert _total(own, steps[mode]) > 0 and _total(exposed, steps[mode]) > 0
            for other in set(steps) - {mode}:  # another mode's count: not written at all
                assert not samples(own, steps[other]) and not samples(exposed, steps[other])

            # Each shard's own, the same families as the API relays.
            pushed = log_keys = 0.0
            for i, url in enumerate(urls):
                # The worker may still push (a geo round's last differences): the
                # figures lie between the table's counts before and after the
                # scrape. (A geo worker pushes changed rows only: with FTRL's L1
                # few rows change in a short stream, and a shard may get none.)
                table = shards[i].tables["m_w"]
                before = (table.pushes, len(table))
                text = await _text(http, f"{url}/metrics")
                assert_promtool_passes(text)
                assert _total(text, "ctrps_shard_up", shard=str(i)) == 1
                pushes = _total(text, "ctrps_table_pushes_total", shard=str(i), table="m_w")
                rows = _total(text, "ctrps_table_features", shard=str(i), table="m_w")
                assert before[0] <= pushes <= table.pushes and before[1] <= rows <= len(table)
                pushed += pushes
                log_keys += _total(text, "ctrps_table_change_log_keys", shard=str(i), table="m_w")
            assert pushed > 0
            assert (log_keys > 0) if mode == "geo" else (log_keys == 0)  # only a geo table keeps a change log
            assert samples(await _text(http, f"{urls[0]}/metrics"), "ctrps_cluster_ready") == []  # one shard 0 only
    finally:
        stop.set()
        await asyncio.wait_for(worker, 60)


@needs_promtool
@pytest.mark.process
def test_the_apis_exposition_writes_each_family_once() -> None:
    """The API's own port and the shards' are one family each (promtool
    refused a second HELP line of ``ctrps_port_open_connections``)."""
    shard = Shard(ShardSpec(0, 1), make_model("lr", "m").tables())
    stats = shard.stats() | {"ports": {"http": {"open_connections": 2, "refused_total": 1}, "tls": {}}}
    metrics = ApiMetrics("m")
    metrics.watch_port(lambda: {"http": {"open_connections": 1, "refused_total": 0}, "tls": {}})
    text = metrics.render(ClusterSnapshot([stats], None, model="m"))
    assert_promtool_passes(text)
    assert text.count(b"# HELP ctrps_port_open_connections ") == 1
    assert {(lab["role"], v) for lab, v in samples(text, "ctrps_port_open_connections")} == {("api", 1), ("shard", 2)}


def test_worker_metrics_settings() -> None:
    base = WorkerSettings(bootstrap="127.0.0.1:9092", shards=("http://127.0.0.1:7100",))
    assert (base.metrics_port, base.metrics_host) == (0, "127.0.0.1")
    with pytest.raises(SettingsError, match=r"metrics port 70000 is not in \[0, 65535\]"):
        dataclasses.replace(base, metrics_port=70000)
    with pytest.raises(SettingsError, match="metrics host is empty"):
        dataclasses.replace(base, metrics_host="")


async def test_a_worker_metrics_port_in_use_is_one_line_naming_it() -> None:
    """The worker's port cannot be bound: an expected failure (one line, exit
    1) naming the port, before the worker joins its group."""
    busy = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = busy.sockets[0].getsockname()[1]
    settings = WorkerSettings(
        bootstrap="127.0.0.1:1", shards=("http://127.0.0.1:1",), metrics_port=port, decode_processes=0
    )
    try:
        with pytest.raises(ExpectedFailure, match=rf"cannot serve the worker's metrics on 127.0.0.1:{port}: "):
            await asyncio.wait_for(run_worker(settings), 30)
    finally:
        busy.close()
        await busy.wait_closed()


@needs_promtool
@pytest.mark.process
async def test_a_shard_process_serves_its_metrics_to_a_read_token_only(tmp_path: Path) -> None:
    """``ctrps shard`` with a cluster secret: ``/metrics`` needs a token of
    scope read (as ``/v1/stats``); a scrape without one is refused and
    counted; its exposition names its ports and passes promtool."""
    secret, port = new_secret(), free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "shard", "--port", str(port), "--no-exports", "--stats-interval", "0",
        cwd=PROJECT, env=clean_env(CTRPS_CLUSTER_SECRET=secret), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                if proc.returncode is not None:
                    raise AssertionError(f"ctrps shard exited {proc.returncode}")
                return await json_when_ok(http, f"{url}/healthz") is not None

            await until(healthy, 30, what="the shard to answer", poll_s=0.1)
            async with http.get(f"{url}/metrics") as resp:
                assert resp.status == 401 and (await resp.json())["error"] == "unauthorized"
            async with http.get(f"{url}/metrics", headers=bearer(derive_token(secret, Scope.READ))) as resp:
                assert resp.status == 200
                text = await resp.read()
        assert_promtool_passes(text)
        assert _total(text, "ctrps_port_open_connections", role="shard", shard="0", port="http") >= 1
        assert _total(text, "ctrps_shard_auth_refused_total", shard="0", reason="missing") == 1
        assert samples(text, "ctrps_shard_up") == [({"shard": "0"}, 1.0)]
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
