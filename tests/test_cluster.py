"""``ctrps cluster``: every role as its own process, as a user runs it; and its settings."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from app.cli import build_parser
from app.settings import ClusterSettings, SettingsError
from ps_core.export import list_versions
PROJECT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without CTRPS_* variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


def ctrps(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def cluster_args(*flags: str) -> Any:
    return build_parser().parse_args(["cluster", *flags])


# -- settings -------------------------------------------------------------------------


def test_cluster_help_shows_an_example() -> None:
    out = ctrps("cluster", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: ctrps cluster" in out.stdout and "examples:" in out.stdout
    assert "ctrps cluster --shards 4 --workers 3" in out.stdout
    for flag in ("--shards", "--workers", "--port", "--produce-rate", "--no-produce", "--duration"):
        assert flag in out.stdout


def test_cluster_settings_defaults_env_and_flags() -> None:
    assert ClusterSettings.from_args(cluster_args(), env={}) == ClusterSettings()
    env = {
        "CTRPS_CLUSTER_SHARDS": "3",
        "CTRPS_CLUSTER_WORKERS": "1",
        "CTRPS_CLUSTER_PORT": "9000",
        "CTRPS_CLUSTER_PRODUCE_RATE": "500",
        "CTRPS_CLUSTER_DURATION": "30",
        "CTRPS_KAFKA_BOOTSTRAP": "kafka:9092",
        "CTRPS_LOG_FORMAT": "json",
    }
    s = ClusterSettings.from_args(cluster_args(), env=env)
    assert (s.shards, s.workers, s.port, s.produce_rate, s.duration_s) == (3, 1, 9000, 500.0, 30.0)
    assert (s.bootstrap, s.log_format) == ("kafka:9092", "json")
    s = ClusterSettings.from_args(cluster_args("--workers", "4", "--no-produce", "--port", "0"), env=env)
    assert (s.shards, s.workers, s.port, s.produce_rate) == (3, 4, 0, 0.0)
    s = ClusterSettings.from_args(cluster_args("--produce-rate", "100"), env=env)
    assert s.produce_rate == 100.0


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--shards", "0"], {}, "shards and workers must be in [1, 64]"),
        (["--produce-rate", "-1"], {}, "produce rate must be"),
        (["--duration", "-5"], {}, "duration must be"),
        (["--port", "70000"], {}, "port 70000 out of range"),
        ([], {"CTRPS_CLUSTER_WORKERS": "two"}, "CTRPS_CLUSTER_WORKERS='two' is not a valid int"),
    ],
)
def test_bad_cluster_settings(flags: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ClusterSettings.from_args(cluster_args(*flags), env=env)


def test_produce_rate_and_no_produce_exclude_each_other() -> None:
    out = ctrps("cluster", "--produce-rate", "10", "--no-produce")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


def test_bad_cluster_flag_exits_2_without_a_traceback() -> None:
    out = ctrps("cluster", "--workers", "0")
    assert out.returncode == 2
    assert "ctrps cluster: shards and workers must be in [1, 64]" in out.stderr
    assert "Traceback" not in out.stderr


# -- the cluster, as processes ----------------------------------------------------------


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


async def wait_for_line(
    proc: asyncio.subprocess.Process, path: Path, match: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    """The first JSON line of `path` holding every item of `match`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        for obj in read_json_lines(path):
            if match.items() <= obj.items():
                return obj
        if proc.returncode is not None or loop.time() > deadline:
            pytest.fail(f"no line {match} (exit {proc.returncode}): {path.read_text()[-3000:]}")
        await asyncio.sleep(0.1)  # poll interval


def pid_gone(pid: int) -> bool:
    """The process no longer runs (or is a zombie its new parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


ROLES = {"broker", "shard-0", "shard-1", "api", "worker-0", "worker-1", "producer"}
EVENT = {"features": {"C1": "68fd1e64", "C2": "80e26c9b", "I1": 3.0}}


async def wait_for_training(
    proc: asyncio.subprocess.Process,
    session: aiohttp.ClientSession,
    api: str,
    workers: int,
    timeout_s: float,
) -> dict[str, Any]:
    """``GET /v1/model`` once `workers` workers have reported trained windows."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        async with session.get(api + "/v1/model") as resp:
            assert resp.status == 200, await resp.text()
            model: dict[str, Any] = await resp.json()
        if len(model["workers"]) >= workers and model["events_trained"] > 0:
            return model
        assert proc.returncode is None, f"the cluster exited with {proc.returncode}"
        assert loop.time() < deadline, f"not {workers} workers training after {timeout_s}s: {model}"
        await asyncio.sleep(0.2)  # poll interval


async def test_cluster_runs_every_role_trains_and_stops_on_sigint(tmp_path: Path) -> None:
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cluster", "--shards", "2", "--workers", "2",
            "--port", "0", "--produce-rate", "2000", "--window-seconds", "1",
            "--duration", "300", "--log-format", "json",  # the duration only bounds a broken run
            "--exports-dir", str(tmp_path / "exports"), "--export-interval", "1",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        started = {
            x["role"]: x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"
        }
        assert set(started) == ROLES
        # The broker role's own child, the Tansu binary, must stop with it.
        tansu = await wait_for_line(proc, out_log, {"role": "broker", "msg": "ready"}, 10)
        api = ready["api"]
        assert api.startswith("http://127.0.0.1:") and not api.endswith(":0")
        async with aiohttp.ClientSession() as session:
            model = await wait_for_training(proc, session, api, workers=2, timeout_s=90)
            assert model["events_trained"] > 0
            async with session.post(api + "/v1/predict", json={"events": [EVENT]}) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert 0.0 < body["predictions"][0] < 1.0
        # Shard 0 exports every second; the workers' leased windows put
        # their committed offsets in the versions.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            model_dir = tmp_path / "exports" / "ctr"
            versions = list_versions(model_dir) if model_dir.is_dir() else []
            if versions and any(v.manifest.offsets for v in versions):
                break
            assert loop.time() < deadline, f"no export with offsets: {versions}"
            await asyncio.sleep(0.2)  # poll interval
        assert versions[0].kind == "base" and versions[0].manifest.num_shards == 2
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0, err_log.read_text()[-3000:]
    for pid in [*started.values(), tansu["pid"]]:
        assert pid_gone(pid), f"{pid} outlived the cluster"
    stopped = {x["role"]: x["returncode"] for x in read_json_lines(err_log) if x.get("msg") == "stopped" and "role" in x}
    assert stopped == {role: 0 for role in ROLES}
    # Every child's lines carry its role; workers logged windows.
    lines = read_json_lines(out_log)
    assert {x["role"] for x in lines} == ROLES
    strays = [x for x in lines if x["msg"] == "output"]  # lines that were not JSON log lines
    assert not strays, strays[:5]
    assert any(x["role"] == "worker-1" and x["msg"] == "window" for x in lines)


async def test_a_killed_child_stops_the_cluster_with_status_1(tmp_path: Path) -> None:
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cluster", "--shards", "1", "--workers", "1",
            "--port", "0", "--no-produce", "--duration", "300", "--log-format", "json",
            "--exports-dir", str(tmp_path / "exports"),
            cwd=PROJECT, env=clean_env(CTRPS_DECODE_PROCESSES="0"), stdin=subprocess.DEVNULL,
            stdout=out, stderr=err,
        )  # fmt: skip
    try:
        await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        started = {x["role"]: x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"}
        assert set(started) == {"broker", "shard-0", "api", "worker-0"}
        os.kill(started["shard-0"], signal.SIGKILL)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 1
    assert all(pid_gone(pid) for pid in started.values())
    lines = read_json_lines(err_log)
    failed = [x for x in lines if x.get("msg") == "child exited unexpectedly"]
    assert [(x["role"], x["returncode"]) for x in failed] == [("shard-0", -9)]
    stopped = {x["role"]: x["returncode"] for x in lines if x.get("msg") == "stopped" and "role" in x}
    # A worker stopped while still importing dies of the SIGTERM itself: clean too.
    assert stopped.keys() == {"broker", "api", "worker-0"}
    assert stopped["broker"] == stopped["api"] == 0 and stopped["worker-0"] in (0, -signal.SIGTERM)
