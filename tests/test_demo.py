"""``ctrps demo``: one command, as a user runs it; and its settings."""

from __future__ import annotations

import asyncio
import io
import logging
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from commands import PROJECT, assert_help_shows, clean_env

from app.api import ApiServer
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.demo import DemoSettings
from app.config.serve import ApiSettings
from app.demo import _announce, example_event
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import list_versions
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard


def demo_args(*flags: str) -> Any:
    return build_parser().parse_args(["demo", *flags])


# -- settings -------------------------------------------------------------------------


@pytest.mark.process
def test_demo_help_shows_an_example() -> None:
    assert_help_shows(
        "demo", "ctrps demo --duration 60 --port 0", ("--duration", "--port", "--shards", "--rate", "--log-format")
    )


def test_demo_settings_defaults_env_and_flags() -> None:
    assert DemoSettings.from_args(demo_args(), env={}) == DemoSettings()
    env = {
        "CTRPS_DEMO_DURATION": "30",
        "CTRPS_DEMO_PORT": "9000",
        "CTRPS_DEMO_SHARDS": "4",
        "CTRPS_DEMO_RATE": "100",
        "CTRPS_KAFKA_BOOTSTRAP": "kafka:9092",
        "CTRPS_LOG_FORMAT": "json",
    }
    s = DemoSettings.from_args(demo_args(), env=env)
    assert (s.duration_s, s.port, s.shards, s.rate) == (30.0, 9000, 4, 100.0)
    assert (s.bootstrap, s.log_format) == ("kafka:9092", "json")
    s = DemoSettings.from_args(demo_args("--port", "0", "--rate", "50", "--log-format", "text"), env=env)
    assert (s.port, s.rate, s.shards, s.log_format) == (0, 50.0, 4, "text")


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--rate", "0"], {}, "rate must be a positive number"),
        (["--shards", "0"], {}, "shards must be in"),
        (["--window-seconds", "0"], {}, "window seconds must be a positive number"),
        (["--duration", "inf"], {}, "duration must be"),
        ([], {"CTRPS_DEMO_PORT": "http"}, "CTRPS_DEMO_PORT='http' is not an integer"),
        ([], {"CTRPS_LOG_FORMAT": "xml"}, "log format is text or json"),
    ],
)
def test_bad_demo_settings(flags: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        DemoSettings.from_args(demo_args(*flags), env=env)


@pytest.mark.slow
def test_example_event_is_part_of_the_streams_first_event() -> None:
    event = example_event(0)
    assert set(event) == {"features"}
    assert {"C1", "C2", "I1"} <= set(event["features"])
    assert example_event(0) == event and example_event(1) != event


# -- the demo, as a user runs it ----------------------------------------------------------

DURATION_S = 25.0
ADMIN_TOKEN = "the-demo-admin-token-of-this-test"
WINDOW_LINE = re.compile(r"ctrps\.demo: window .*? auc=(?P<auc>[-\d.na]+) .*?trained=(?P<trained>\d+)")
LOSSES = re.compile(r"ctrps\.demo: window .*? logloss=(?P<loss>[\d.]+) constant_logloss=(?P<constant>[\d.]+)")


async def wait_for_api(proc: asyncio.subprocess.Process, out_log: Path, timeout_s: float) -> str:
    """The API URL the demo printed, once it has printed it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (found := re.search(r"^  API +(http://127\.0\.0\.1:\d+)$", out_log.read_text(), re.M)):
        if proc.returncode is not None or loop.time() > deadline:
            pytest.fail(f"no API URL (exit {proc.returncode}): {out_log.read_text()[-2000:]}")
        await asyncio.sleep(0.05)  # poll interval
    return found.group(1)


async def predict(session: aiohttp.ClientSession, api: str, events: list[dict[str, Any]]) -> dict[str, Any]:
    async with session.post(api + "/v1/predict", json={"events": events}) as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_demo_serves_learns_and_stops_on_its_own(tmp_path: Path) -> None:
    out_log, err_log = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "demo", "--duration", str(DURATION_S), "--port", "0",
            "--exports-dir", str(tmp_path / "exports"), "--export-interval", "8",
            cwd=PROJECT, env=clean_env(CTRPS_ADMIN_TOKEN=ADMIN_TOKEN), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )  # fmt: skip
    loop = asyncio.get_running_loop()
    try:
        api = await wait_for_api(proc, out_log, 60)
        ready_at = loop.time()
        banner = out_log.read_text()
        assert f"curl -s {api}/v1/model" in banner and f"curl -s -XPOST {api}/v1/predict" in banner
        async with aiohttp.ClientSession() as session:
            events = [example_event(0), {"features": {"C1": "never-seen"}}]
            first = await predict(session, api, events)  # served at once, before any training
            assert len(first["predictions"]) == 2 and first["model"] == "ctr"
            # Training reaches the API through the status board.
            while True:
                async with session.get(api + "/v1/model") as resp:
                    model = await resp.json()
                if model["events_trained"] > 0 and model["features"] > 0:
                    break
                assert loop.time() < ready_at + DURATION_S, f"nothing trained: {model}"
                await asyncio.sleep(0.2)  # poll interval
            assert len(model["workers"]) == 1
            # The embedded broker's memory is on the API's /metrics, under its default limit.
            async with session.get(api + "/metrics") as resp:
                metrics = await resp.text()
            assert re.search(r"^ctrps_broker_resident_bytes [1-9]", metrics, re.M), metrics[-2000:]
            assert "\nctrps_broker_resident_limit_bytes 2.147483648e+09\n" in metrics
            assert "\nctrps_broker_over_limit 0.0\n" in metrics
            # The demo's admin routes take CTRPS_ADMIN_TOKEN, as `ctrps serve`'s do.
            async with session.post(api + "/v1/exports") as resp:
                assert resp.status == 401, await resp.text()
            async with session.post(api + "/v1/exports", headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401, await resp.text()
            async with session.post(api + "/v1/exports", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                assert resp.status == 201, await resp.text()
            later = await predict(session, api, events)
            assert all(0.0 < p < 1.0 for p in later["predictions"])
            assert later["predictions"] != first["predictions"]  # the weights moved
        try:
            rc = await asyncio.wait_for(proc.wait(), DURATION_S + 60)
        except TimeoutError:
            # What it was doing is in its log: keep it in the failure, since
            # pytest soon deletes this test's directory.
            pytest.fail(f"the demo did not stop after its duration; its log ends:\n{err_log.read_text()[-5000:]}")
        ran_s = loop.time() - ready_at
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    log = err_log.read_text()
    assert rc == 0, log[-3000:]
    assert DURATION_S - 1 <= ran_s <= DURATION_S + 30, ran_s
    windows = [(float(m["auc"]), int(m["trained"])) for m in WINDOW_LINE.finditer(log)]
    assert len(windows) >= 10, log[-3000:]
    aucs = [auc for auc, _ in windows]
    # Progressive AUC (each event predicted before it is learnt from) rises
    # above 0.7 and stays there; the ground truth's is about 0.86.
    assert max(aucs[1:]) > aucs[0] and max(aucs) > 0.8, aucs
    assert all(auc > 0.7 for auc in aucs[len(aucs) // 2 :]), aucs
    # Each line says what a constant predictor scores; the later windows beat it.
    losses = [(float(m["loss"]), float(m["constant"])) for m in LOSSES.finditer(log)]
    assert len(losses) == len(windows) and all(0 < c < 1 for _, c in losses), losses
    assert all(loss < constant for loss, constant in losses[len(losses) // 2 :]), losses
    trained = [n for _, n in windows]
    assert trained == sorted(trained) and trained[-1] >= 10 * 5000 // 2, trained
    assert "ctrps.demo: stopped" in log and "Traceback" not in log
    assert log.count("the embedded broker keeps every record in memory") == 1
    assert ADMIN_TOKEN not in log and ADMIN_TOKEN not in out_log.read_text()
    assert log.count("ctrps.worker: window") == 0  # one line per window: the demo's
    # It exported on its interval, into a directory of this run's own under
    # --exports-dir, named in its banner: a base, then deltas, each holding
    # the offsets its leased windows committed, read from its own broker.
    exports = _banner_exports(banner)
    assert exports.parent.parent == tmp_path / "exports" and exports.name == "ctr", exports
    assert re.fullmatch(r"demo-\d{8}T\d{6}Z-[0-9a-f]{6}", exports.parent.name), exports
    assert not (tmp_path / "exports" / "ctr").exists()  # nothing where shards restore from
    versions = list_versions(exports)
    assert [v.kind for v in versions][:2] == ["base", "delta"], versions
    offsets = [sum(p.values()) for v in versions for p in v.manifest.offsets.values()]
    assert offsets == sorted(offsets) and offsets[-1] > 0, offsets
    streams = {v.manifest.stream for v in versions[1:]}
    assert len(streams) == 1 and None not in streams, streams
    stream = streams.pop()
    assert stream is not None and stream.group == "ctrps-demo" and stream.cluster_id.startswith("ctrps-")

    # A second run with the same --exports-dir gets a directory of its own
    # and leaves the first run's versions alone.
    second = subprocess.run(
        [sys.executable, "-m", "app.cli", "demo", "--duration", "1", "--port", "0",
         "--exports-dir", str(tmp_path / "exports"), "--export-interval", "0"],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    other = _banner_exports(second.stdout)
    assert other != exports and other.parent.parent == tmp_path / "exports", (other, exports)
    assert [v.version for v in list_versions(exports)] == [v.version for v in versions]


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_without_a_token_the_demo_makes_one_for_its_admin_routes_and_keeps_exports_private(
    tmp_path: Path,
) -> None:
    """Loopback is every local user's: a demo given no CTRPS_ADMIN_TOKEN
    makes one, shows it in its banner (and a 0600 file), and its admin routes
    refuse any request without it; its exports are 0600 files in 0700
    directories; the token's file goes when the demo ends."""
    out_log, err_log = tmp_path / "stdout.log", tmp_path / "stderr.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "demo", "--duration", "120", "--port", "0",
            "--exports-dir", str(tmp_path / "exports"), "--export-interval", "0",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        api = await wait_for_api(proc, out_log, 60)
        found = re.search(r"^  admin +(\S+) \(this run's admin token, also in (\S+)\)$", out_log.read_text(), re.M)
        assert found, out_log.read_text()
        token, token_file = found.group(1), Path(found.group(2))
        assert token_file.read_text().strip() == token and len(token) >= 32
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(token_file.parent.stat().st_mode) == 0o700
        bearer = {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with session.post(api + "/v1/models", json={"name": "evil"}, headers=headers) as resp:
                    assert resp.status == 401, await resp.text()
                async with session.post(api + "/v1/exports", headers=headers) as resp:
                    assert resp.status == 401, await resp.text()
            async with session.post(api + "/v1/exports", headers=bearer) as resp:
                assert resp.status == 201, await resp.text()
                version = Path((await resp.json())["path"])
            async with session.get(api + "/v1/models") as resp:
                assert "evil" not in {m["name"] for m in (await resp.json())["models"]}
        assert stat.S_IMODE(version.stat().st_mode) == 0o700
        files = list(version.iterdir())
        assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0, err_log.read_text()[-3000:]
    assert not token_file.parent.exists()
    assert token not in err_log.read_text()  # the banner shows it once; no log line holds it


def _banner_exports(banner: str) -> Path:
    """The exports directory a demo's banner names."""
    found = re.search(r"^  exports +(\S+) \(this run's own; the demo never restores\)$", banner, re.M)
    assert found, banner
    return Path(found.group(1))


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_demo_announces_its_urls_and_curl_examples(fmt: str, caplog: pytest.LogCaptureFixture) -> None:
    """Text: a banner for people on stdout. JSON: only the ``ready`` line, holding the same."""
    out = io.StringIO()
    settings = DemoSettings(port=0, log_format=fmt)
    async with PSClient.local([Shard()]) as client:
        async with ApiServer(
            ApiSettings(port=0), client, make_model("lr"), control=ControlClient.local([Shard()])
        ) as server:
            with caplog.at_level(logging.INFO, logger="ctrps.demo"):
                _announce(out, server, "127.0.0.1:9092", settings, Path("exports/demo-x/ctr"))
    ready = [r for r in caplog.records if r.getMessage() == "ready"]
    assert len(ready) == 1
    fields = ready[0].fields  # type: ignore[attr-defined]
    assert fields["api"] == server.url and fields["metrics"] == server.url + "/metrics"
    assert fields["bootstrap"] == "127.0.0.1:9092" and fields["group"] == "ctrps-demo"
    assert fields["exports"] == "exports/demo-x/ctr"
    body = orjson.dumps({"events": [example_event(0)]}).decode()
    if fmt == "json":
        assert out.getvalue() == ""
        assert f"curl -s {server.url}/v1/model" in fields["examples"]
        assert any(body in e for e in fields["examples"])
    else:
        banner = out.getvalue()
        assert f"  API        {server.url}\n" in banner
        assert f"-d '{body}'" in banner and f"curl -s {server.url}/v1/model" in banner
        assert "  exports    exports/demo-x/ctr (this run's own; the demo never restores)\n" in banner
        assert "examples" not in fields


def test_export_settings_flags_over_environment() -> None:
    env = {"CTRPS_EXPORTS_DIR": "/tmp/x", "CTRPS_EXPORT_INTERVAL": "5"}
    s = DemoSettings.from_args(demo_args(), env)
    assert (s.exports_dir, s.export_interval_s) == ("/tmp/x", 5.0)
    s = DemoSettings.from_args(demo_args("--exports-dir", "e", "--export-interval", "0"), env)
    assert (s.exports_dir, s.export_interval_s) == ("e", 0.0)
    assert DemoSettings.from_args(demo_args("--no-exports"), env).exports_dir == ""
    with pytest.raises(SettingsError, match="export interval"):
        DemoSettings.from_args(demo_args("--export-interval", "-1"), {})
