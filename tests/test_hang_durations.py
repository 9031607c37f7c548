"""A shard process that hangs (SIGSTOP, then SIGCONT) is reported with the
true duration and cause: the worker's outage counts from the request that
went unanswered, not from when its deadline ran out, and says the shard did
not answer (not that it refused); an aborted cut says how long after it
began, where the time went (the wait for leased windows, the copy, the
drops) and that the shard did not answer. Shard 1 is a real ``ctrps shard``
process; shard 0, with the coordinator and exporter, runs in the test."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from commands import PROJECT, clean_env
from streams import brisk_worker_config, keyed_event, new_topic, produce, running, shard_args
from test_recovery import _healthy
from waiting import until

from consumers.broker import free_port
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient, HttpControl, LocalControl, ShardControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.routes import checkpointed_shard_app
from ps_core.errors import CutAbortedError
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import start_shard_site
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

DEADLINE_S = 1.0
"""The exporter's request deadline to shard 1 (``ctrps shard`` uses 10 s)."""


@dataclass
class Cluster:
    shard0: Shard
    coordinator: Coordinator
    exporter: Exporter
    urls: list[str]
    process: subprocess.Popen[bytes]
    """Shard 1."""


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    exports = tmp_path / "exports"
    args = [sys.executable, "-m", "app.cli", *shard_args(1, ports, exports, "--no-restore")]
    with open(tmp_path / "shard1.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    session = aiohttp.ClientSession()
    shard0, coordinator = Shard(ShardSpec(0, 2)), Coordinator()
    peers: list[ShardControl] = [
        LocalControl(shard0, coordinator),
        HttpControl(1, urls[1], session, RetryPolicy(deadline_s=DEADLINE_S)),
    ]
    exporter = Exporter(coordinator, ControlClient(peers), exports, "m", cut_timeout_s=5, abort_timeout_s=2)
    site = await start_shard_site(
        checkpointed_shard_app(shard0, coordinator=coordinator, exporter=exporter), "127.0.0.1", ports[0]
    )
    try:
        async with ControlClient.connect(urls) as control:
            await _healthy(control)
        yield Cluster(shard0, coordinator, exporter, urls, proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        await site.cleanup()
        await session.close()


def _lines(caplog: pytest.LogCaptureFixture, start: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(start)]


async def test_a_hung_shard_is_back_after_the_time_it_hung_and_did_not_answer(
    cluster: Cluster, kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    hang_s, deadline_s = 6.0, 3.0
    topic, group = await new_topic(kafka_bootstrap, 2)
    config = brisk_worker_config(kafka_bootstrap, topic, group, 300, 50, outage_deadline_s=120, outage_log_every_s=1.0)
    retry = RetryPolicy(deadline_s=deadline_s)
    url1 = cluster.urls[1]
    async with (
        PSClient.connect(cluster.urls, retry=retry) as client,
        ControlClient.connect(cluster.urls, retry=retry) as control,
    ):
        worker = Worker(config, client, control, LogisticRegression("m"))
        async with running(worker) as task:
            await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(500)), 2)
            await until(lambda: worker.stats.events_trained >= 500, 60, what="the first events", task=task)
            # Events keep coming, so the worker is talking to shard 1 when it hangs.
            sending = asyncio.create_task(
                produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(500, 40_500)), 2, rate=2000)
            )
            try:
                trained = worker.stats.events_trained
                await until(lambda: worker.stats.events_trained > trained + 500, 30, what="events flowing", task=task)
                os.kill(cluster.process.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                await until(lambda: url1 in worker.stats.waiting_for, 30, what="the worker to wait", task=task)
                await until(lambda: time.monotonic() - stopped >= hang_s, hang_s + 5, what="the hang", task=task)
                os.kill(cluster.process.pid, signal.SIGCONT)
                hung = time.monotonic() - stopped
                back = f"shard 1 at {url1} is back after"
                await until(lambda: bool(_lines(caplog, back)), 30, what="the line saying it is back", task=task)
            finally:
                sending.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sending
    (line,) = _lines(caplog, back)
    waited = line.fields["waited_s"]  # type: ignore[attr-defined]
    # From the unanswered request (sent at most a brisk window after the
    # hang began) to the probe that saw it back (at most a second after).
    assert hung - 0.5 <= waited <= hung + deadline_s + 1.5, (waited, hung)
    assert line.getMessage() == f"{back} {waited:.0f}s: resuming"
    (failed,) = _lines(caplog, "window failed in an outage")
    error = failed.fields["error"]  # type: ignore[attr-defined]
    assert f"shard 1 at {url1}" in error and "did not answer: no answer for 3." in error, error
    waiting = _lines(caplog, f"waiting for shard 1 at {url1}: unreachable for")
    # The first waiting line already counts the deadline the request waited.
    assert waiting[0].fields["waited_s"] >= deadline_s - 0.1, waiting[0].fields  # type: ignore[attr-defined]
    assert worker.stats.outage_seconds >= hung - 0.5


async def test_a_cut_aborted_on_a_hung_shard_says_how_long_after_it_began_and_why(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    await LocalControl(cluster.shard0, cluster.coordinator).declare(TableConfig("m_w", 1))
    held_s = 1.0
    # A leased window the cut must wait for, released a second into the cut.
    lease = await cluster.coordinator.acquire("w")

    async def window_ends() -> None:
        await asyncio.sleep(held_s)  # the window's length: the test's fault, not a wait for a condition
        await cluster.coordinator.release(lease.lease_id, {})

    os.kill(cluster.process.pid, signal.SIGSTOP)
    began = time.monotonic()
    ending = asyncio.create_task(window_ends())
    with caplog.at_level(logging.WARNING, logger="ctrps.export"):
        with pytest.raises(CutAbortedError) as aborted:
            await cluster.exporter.cut()
    took = time.monotonic() - began
    await ending
    (line,) = [r for r in caplog.records if r.name == "ctrps.export" and r.getMessage() == "export cut aborted"]
    f = line.fields  # type: ignore[attr-defined]
    assert f["reason"] == "unreachable" and f["shards"] == "1" and f["step"] == "copy", f
    # The copy waited its full deadline for an answer; the drop waited too.
    assert "shard 1:" in f["error"] and "did not answer: no answer for 1." in f["error"], f["error"]
    assert f["lease_wait_s"] >= held_s - 0.1 and f["step_s"] >= DEADLINE_S - 0.1, f
    assert f["not_aborted_on"] == "1" and "did not answer" in f["abort_error"], f
    assert f["lease_wait_s"] + f["step_s"] + f["abort_s"] <= f["after_s"] + 0.2
    # after_s is rounded to a tenth: up to 0.05 s over the time measured here.
    assert took - 0.3 <= f["after_s"] <= took + 0.05, (f, took)
    said = str(aborted.value)
    assert "cut 1 aborted on every shard " in said and "s after it began (unreachable: shard 1:" in said, said
    assert float(said.split("every shard ")[1].split("s after")[0]) >= f["after_s"] - 0.1, said

    os.kill(cluster.process.pid, signal.SIGCONT)
    report = await cluster.exporter.cut()
    assert report.kind == "base"


SESSION_S = 15.0
"""The workers' group session timeout in the killed-holder test: also their
leases' time to live. Long enough that the new worker (a process starting)
asks for a lease while the cut still waits for the dead one."""


def _worker(cluster: Cluster, bootstrap: str, topic: str, group: str, log: Path) -> subprocess.Popen[bytes]:
    """A ``ctrps worker`` process of `group` on the cluster, its output in `log`."""
    argv = [
        sys.executable, "-m", "app.cli", "worker", "--bootstrap", bootstrap, "--shards", ",".join(cluster.urls),
        "--topic", topic, "--group", group, "--model-name", "m", "--window-seconds", "0.5",
        "--decode-processes", "0", "--session-timeout-ms", str(int(SESSION_S * 1000)),
    ]  # fmt: skip
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=out, stderr=out)


async def test_a_worker_killed_holding_a_lease_holds_a_cut_only_for_its_session(
    cluster: Cluster, kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A worker SIGKILLed while its window holds a lease (its pull hangs on a
    stopped shard): the cut waits for that lease only until the worker's
    session timeout after its last renewal, the next worker trains within
    that plus the broker's join, and its waiting line names the lease."""
    topic, group = await new_topic(kafka_bootstrap, 4)
    producing = asyncio.create_task(
        produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(60_000)), 4, rate=800)
    )
    first = _worker(cluster, kafka_bootstrap, topic, group, tmp_path / "first.log")
    second: subprocess.Popen[bytes] | None = None
    coordinator = cluster.coordinator
    try:
        await until(lambda: coordinator.leases_granted >= 4, 60, what="the first worker training", poll_s=0.1)
        os.kill(cluster.process.pid, signal.SIGSTOP)  # its next window's pulls hang, the lease held
        await until(
            lambda: any(time.monotonic() - lease.granted_at > 1.0 for lease in coordinator.held()),
            10,
            what="a lease held by a hung window",
            poll_s=0.05,
        )
        (held,) = coordinator.held()
        # Renewed while the worker lives (every third of its session): it
        # ends a session after its last renewal, not at the coordinator's TTL.
        await until(
            lambda: coordinator.held()[0].expires_at > held.expires_at, SESSION_S, what="a renewal", poll_s=0.02
        )
        first.kill()
        await asyncio.to_thread(first.wait, 10)
        killed = time.monotonic()
        (dead,) = coordinator.held()
        assert dead.ttl_s == SESSION_S and dead.expires_at <= killed + SESSION_S, dead
        os.kill(cluster.process.pid, signal.SIGCONT)
        cutting = asyncio.create_task(cluster.exporter.cut())
        second = _worker(cluster, kafka_bootstrap, topic, group, tmp_path / "second.log")
        report = await asyncio.wait_for(cutting, SESSION_S + 5)
        assert report.expired_leases == [dead.worker], report
        assert time.monotonic() <= dead.expires_at + 2.0
        # The broker holds a join for half the session once the dead member
        # is dropped; then the new worker trains.
        await until(
            lambda: b"info  ctrps.worker: window window=" in (tmp_path / "second.log").read_bytes(),
            max(0.0, killed + SESSION_S * 1.5 + 8 - time.monotonic()),
            what="the new worker training",
            poll_s=0.2,
        )
    finally:
        producing.cancel()
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                # Shard 0 answers from this event loop: never block it.
                await asyncio.to_thread(p.wait, 30)
        with contextlib.suppress(asyncio.CancelledError):
            await producing
    said = (tmp_path / "second.log").read_text()
    waiting = [line for line in said.splitlines() if "waiting for a cut to finish for " in line]
    assert waiting, said[-3000:]
    assert f"a cut waits for the lease worker {dead.worker} holds since " in waiting[0], waiting[0]
    assert "unreachable" not in said and "did not answer" not in said, said[-3000:]
