"""``deploy/monitoring/``: the alert rules pass ``promtool check rules`` and
their tests (``promtool test rules alerts_test.yml``: each rule firing and
not); the scrape config passes ``promtool check config``; the Grafana
dashboard is a dashboard whose every expression parses; and every metric the
rules and the dashboard name is a family of a real exposition — a worker
(``--metrics-port``), two shard servers (shard 0 with its exporter), the
API and the broker role, started in-process as tests/test_metrics.py does.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml
from exposition import PROMTOOL, needs_promtool
from prometheus_client.parser import text_string_to_metric_families
from streams import keyed_event, new_topic, produce
from test_metrics import _text
from waiting import json_when_ok, until

from app.api import ApiServer
from app.config.broker import BrokerSettings
from app.config.serve import ApiSettings
from app.config.worker import WorkerSettings
from app.roles.broker import run_broker
from app.roles.worker import run_worker
from consumers.broker import free_port
from ps_core.checkpoint.control import ControlClient, LocalControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.shard_metrics import exposition, shard_families
from ps_core.shard import Shard, ShardSpec
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.table_config import TableConfig

MONITORING = Path(__file__).resolve().parent.parent / "deploy" / "monitoring"
ALERTS = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMETHEUS_OWN = {"up"}
"""Series Prometheus writes itself, in no exposition."""
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def _promtool(*args: str | Path) -> None:
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, timeout=60)
    assert done.returncode == 0, (done.stdout + done.stderr).decode()


def _rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    return rules


def _dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = orjson.loads(DASHBOARD.read_bytes())
    return doc


def _dashboard_exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: ctrps's own by their
    prefix, and Prometheus's own (``up``) standing alone."""
    ours = set(re.findall(r"\bctrps_[a-z0-9_]+", expr))
    return ours | {n for n in PROMETHEUS_OWN if re.search(rf"(?<![\w.\"]){n}(?![\w(])", expr)}


def exposed_names(text: bytes) -> set[str]:
    """The series names `text`'s families declare (a family without samples
    yet, as dead letters before the first, counts: it is declared)."""
    return {
        f.name + suffix
        for f in text_string_to_metric_families(text.decode())
        for suffix in _SUFFIXES.get(f.type, ("",))
    }


@needs_promtool
@pytest.mark.slow  # runs promtool
def test_the_alert_rules_pass_promtool_and_their_tests() -> None:
    _promtool("check", "rules", ALERTS)
    _promtool("test", "rules", MONITORING / "alerts_test.yml")
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "alerts_test.yml").read_text()))
    assert tested == {r["alert"] for r in _rules()}  # every rule has its tests


def test_every_rule_says_what_it_is_and_whose_metrics_it_reads() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule
        # `component`: whose exposition carries the metrics (none for Prometheus's own `up`).
        assert ("component" in rule["labels"]) == bool(metric_names(rule["expr"]) - PROMETHEUS_OWN), rule


@needs_promtool
@pytest.mark.slow  # runs promtool
def test_the_scrape_config_passes_promtool(tmp_path: Path) -> None:
    token = tmp_path / "read-token"
    token.write_text("a-read-token\n")
    config = (MONITORING / "prometheus.yml").read_text().replace("/etc/prometheus/read-token", str(token))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(ALERTS, tmp_path / "alerts.yml")
    _promtool("check", "config", tmp_path / "prometheus.yml")


def test_the_dashboard_is_a_grafana_dashboard_on_a_datasource_variable() -> None:
    doc = _dashboard()
    assert doc["uid"] and doc["title"] and isinstance(doc["schemaVersion"], int)
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource" and variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert [i["name"] for i in doc["__inputs"]] == ["DS_PROMETHEUS"]
    assert len({p["id"] for p in doc["panels"]}) == len(doc["panels"]) > 0
    for panel in doc["panels"]:
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, panel["title"]
        assert all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]


@needs_promtool
@pytest.mark.slow  # runs promtool
def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    """Each expression as a recording rule of a throwaway file: promtool parses it."""
    rules = [{"record": f"ctrps:dashboard_{i}", "expr": e} for i, e in enumerate(_dashboard_exprs())]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool("check", "rules", path)
    path.write_text(yaml.safe_dump({"groups": [{"name": "bad", "rules": [{"record": "x", "expr": "rate(up[5m]"}]}]}))
    with pytest.raises(AssertionError, match="parse error"):  # the check does refuse what does not parse
        _promtool("check", "rules", path)


async def test_shard_0_exposes_its_export_age_and_a_table_its_row_cap(tmp_path: Path) -> None:
    """The figures the export-staleness and row-cap rules read: the age since
    the exporter started until a version is written, then since that version;
    a capped table's cap, none for a table without one."""
    shard = Shard(ShardSpec(0, 1), (TableConfig("capped", 1, lifecycle=Lifecycle(max_rows=1000)), TableConfig("free")))
    coordinator = Coordinator()
    exporter = Exporter(coordinator, ControlClient([LocalControl(shard, coordinator)]), tmp_path, "m")
    assert exporter.stats()["interval_s"] == 0

    async def aged() -> bool:
        return float(exporter.stats()["age_s"]) > 0.3

    await until(aged, 10, what="the exporter to be 0.3 s old")
    stop = asyncio.Event()
    started = asyncio.get_running_loop().time()
    run = asyncio.create_task(exporter.run(0.05, stop))

    async def exported() -> bool:
        return exporter.exports >= 1

    await until(exported, 30, what="a periodic export", task=run)
    stop.set()
    await run
    text = exposition(shard_families([("0", {**shard.stats(), "exports": exporter.stats()})]))
    families = {f.name: f.samples for f in text_string_to_metric_families(text.decode())}
    # Since the export (after `run` started), not since the exporter was made.
    [age] = families["ctrps_export_age_seconds"]
    assert age.value <= asyncio.get_running_loop().time() - started
    assert [s.value for s in families["ctrps_export_interval_seconds"]] == [0.05]
    caps = [(s.labels["table"], s.value) for s in families["ctrps_table_max_rows"]]
    assert caps == [("capped", 1000.0)]


@needs_promtool
@pytest.mark.process
@pytest.mark.slow  # real processes for seconds
async def test_every_metric_the_rules_and_dashboard_read_is_exposed_by_its_role(
    kafka_bootstrap: str, serve_shards: Any, tmp_path: Path
) -> None:
    capped = TableConfig("capped", 1, lifecycle=Lifecycle(max_rows=1000))
    _, urls = await serve_shards(2, (capped,), tmp_path / "exports", rpc=True)
    topic, group = await new_topic(kafka_bootstrap, 2)
    await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(400)), 2)
    metrics_port, broker_metrics_port = free_port(), free_port()
    settings = WorkerSettings(
        bootstrap=kafka_bootstrap, shards=tuple(urls), topic=topic, group=group, model_name="m",
        window_events=200, mini_batch=64, decode_processes=0, session_timeout_ms=6000, metrics_port=metrics_port,
    )  # fmt: skip
    stop = asyncio.Event()
    worker = asyncio.create_task(run_worker(settings, stop), name="worker")
    broker = asyncio.create_task(
        run_broker(free_port(), {}, stop, BrokerSettings(metrics_port=broker_metrics_port)), name="broker"
    )
    try:
        async with (
            PSClient.connect(urls) as client,
            ControlClient.connect(urls) as control,
            ApiServer(ApiSettings(port=0), client, make_model("lr", "m"), control=control) as api,
            aiohttp.ClientSession() as http,
        ):

            async def trained() -> bool:
                info = await json_when_ok(http, f"{api.url}/v1/model?model=m")
                return info is not None and info["events_trained"] >= 400

            await until(trained, 90, what="the API to report the worker's events", task=worker)
            async with http.post(f"{api.url}/v1/predict", json={"events": [orjson.loads(keyed_event(1))]}) as resp:
                assert resp.status == 200, await resp.text()  # the latency histogram gets a sample
            texts = {
                "worker": await _text(http, f"http://127.0.0.1:{metrics_port}/metrics"),
                "shard": await _text(http, f"{urls[0]}/metrics"),
                "api": await _text(http, f"{api.url}/metrics"),
            }
            broker_url = f"http://127.0.0.1:{broker_metrics_port}/metrics"

            async def broker_serves() -> bool:
                try:
                    async with http.get(broker_url) as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False  # not yet bound: the broker starts first

            await until(broker_serves, 60, what="the broker's metrics", task=broker)
            texts["broker"] = await _text(http, broker_url)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(worker, broker), 60)
    exposed = {role: exposed_names(text) for role, text in texts.items()}
    for rule in _rules():
        names = metric_names(rule["expr"]) - PROMETHEUS_OWN
        missing = names - exposed[rule["labels"]["component"]] if names else set()
        assert not missing, (rule["alert"], missing)
    every = set().union(*exposed.values())
    for expr in _dashboard_exprs():
        assert metric_names(expr) <= every, (expr, metric_names(expr) - every)
    assert "ctrps_export_age_seconds" in exposed["shard"] and "ctrps_table_max_rows" in exposed["api"]
