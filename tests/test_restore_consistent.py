"""Restores are all-or-nothing across shards: every shard restores the same
version or the cluster refuses to train (``ctrps shard`` processes on
loopback, real export files, the embedded broker)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from streams import new_topic, shard_args, worker_config
from test_exporter import _train
from test_recovery import _events, _part_keys, _produce, _shows_in
from test_recovery import _train as _run_worker
from waiting import until

from app.api.views import ControlView
from app.metrics import ApiMetrics
from consumers.broker import free_port
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient, HttpControl, LocalControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.joining import load_shard
from ps_core.checkpoint.membership import Membership
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import ClusterNotReadyError, NoCommonVersionError, ShardNotJoinedError
from ps_core.model.models import LogisticRegression
from ps_core.net import op_encoders
from ps_core.net.client import PSClient
from ps_core.net.control_messages import MembershipBody
from ps_core.net.endpoint import RetryPolicy
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

PROJECT = Path(__file__).resolve().parents[1]
LR = TableConfig("m_w", 1, {"name": "ftrl", "alpha": 0.1, "beta": 1.0, "l1": 0.1, "l2": 1.0})
KEYS = np.arange(1, 3001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


class Shards:
    """``ctrps shard`` processes for shards 0..n-1 on fixed ports, each
    restartable alone; JSON logs per process start."""

    def __init__(self, n: int, exports: Path, logs: Path) -> None:
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.exports, self.logs = exports, logs
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.starts = [0] * n

    def start(self, i: int, restore: bool = True) -> None:
        no_restore = [] if restore else ["--no-restore"]
        args = [
            sys.executable,
            "-m",
            "app.cli",
            *shard_args(i, self.ports, self.exports, "--log-format", "json", *no_restore),
        ]
        self.starts[i] += 1
        with open(self.log_path(i), "wb") as log:
            self.procs[i] = subprocess.Popen(args, cwd=PROJECT, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def start_all(self, restore: bool = True) -> None:
        for i in range(len(self.ports)):
            self.start(i, restore)

    @contextlib.asynccontextmanager
    async def serving(self, restore: bool, deadline_s: float) -> AsyncIterator[tuple[PSClient, ControlClient]]:
        """Every shard started; both planes' clients of them, retrying for
        `deadline_s`, while the block runs; then every shard stopped."""
        self.start_all(restore)
        try:
            async with (
                PSClient.connect(self.urls, retry=RetryPolicy(deadline_s=deadline_s)) as client,
                ControlClient.connect(self.urls, retry=RetryPolicy(deadline_s=deadline_s)) as control,
            ):
                yield client, control
        finally:
            self.stop_all()

    def log_path(self, i: int) -> Path:
        return self.logs / f"shard{i}-{self.starts[i]}.log"

    def lines(self, i: int) -> list[dict[str, Any]]:
        out = []
        for raw in self.log_path(i).read_bytes().splitlines():
            try:
                out.append(orjson.loads(raw))
            except orjson.JSONDecodeError:
                out.append({"msg": raw.decode(errors="replace"), "raw": True})
        return out

    def stop(self, i: int, sig: int = signal.SIGTERM) -> None:
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(30)
        self.procs[i] = None

    def stop_all(self) -> None:
        for i in range(len(self.ports)):
            self.stop(i)

    def check_running(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"shard {i} exited: {self.log_path(i).read_text()[-2000:]}")


@pytest.fixture
def shards(tmp_path: Path) -> Shards:
    """Two shards exporting to tmp_path/exports, logging to tmp_path (not started)."""
    return Shards(2, tmp_path / "exports", tmp_path)


async def _memberships(control: ControlClient) -> list[MembershipBody]:
    return [await s.membership() for s in control.shards]


async def _joined(control: ControlClient, shards: Shards, timeout_s: float = 60) -> list[MembershipBody]:
    """Wait until every shard is joined under shard 0's epoch; their reports."""
    got: list[MembershipBody] = []

    async def all_joined() -> bool:
        nonlocal got
        shards.check_running()
        try:
            got = await _memberships(control)
            cluster = (await control.stats())[0].cluster
        except Exception:
            return False  # starting
        return bool(cluster.ready) and all(r.joined and r.epoch == cluster.epoch for r in got)

    await until(all_joined, timeout_s, what="every shard to join", poll_s=0.1)
    return got


async def _declared(control: ControlClient, shards: Shards) -> None:
    """Wait until every shard is joined, then declare the table LR."""
    await _joined(control, shards)
    await control.declare(LR)


def _no_tracebacks(shards: Shards, i: int) -> None:
    text = shards.log_path(i).read_text()
    assert "Traceback" not in text, text[-3000:]


async def _lease_works(control: ControlClient) -> None:
    lease = await control.acquire_lease("probe", wait_s=5)
    await control.release_lease(lease.lease_id, {})


@pytest.mark.process
async def test_a_flipped_byte_is_refused_alike_and_every_shard_restores_the_older_version(shards: Shards) -> None:
    exports = shards.exports
    async with shards.serving(restore=False, deadline_s=2) as (client, control):
        await _declared(control, shards)
        for step, kind in enumerate(("base", "delta", "base", "delta"), start=1):
            await _train(client, LR, KEYS[(step - 1) * 500 : step * 500 + 500], step)
            lease = await control.acquire_lease("w", wait_s=5)
            await control.release_lease(lease.lease_id, {"clicks": {0: 100 * step, 1: 10 * step}})
            assert (await control.export_now(kind)).version == step
    # One flipped byte in shard 1's file of the newest base (version 3).
    damaged = exports / "m" / "0000000003" / "shard-1.m_w.npz"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    damaged.write_bytes(bytes(raw))
    expected_v2 = restore_shards(latest_chain(exports / "m", upto=2, verify=True), 2)

    async with shards.serving(restore=True, deadline_s=2) as (client, control):
        reports = await _joined(control, shards)
        assert [r.version for r in reports] == [2, 2]
        await _lease_works(control)
        assert await control.coordinator_offsets() == {"clicks": {0: 200, 1: 20}}
        # Both shards serve version 2 exactly (version 3's rows are absent).
        want = await PSClient.local(expected_v2.shards).pull("m_w", KEYS)
        np.testing.assert_array_equal(await client.pull("m_w", KEYS), want)
        for i in range(2):
            refused = [l for l in shards.lines(i) if l.get("msg") == "version refused"]
            assert len(refused) == 1, refused
            assert refused[0]["file"] == str(damaged)
            assert refused[0]["expected"] != refused[0]["actual"]
            assert len(refused[0]["expected"]) == len(refused[0]["actual"]) == 64  # both SHA-256
            restored = [l for l in shards.lines(i) if l.get("msg") == "restore"]
            assert [(l["version"], l["chain"], l["shard_id"]) for l in restored] == [(2, "1,2", i)]
            _no_tracebacks(shards, i)


@pytest.mark.process
async def test_no_version_every_shard_can_load_refuses_leases_with_one_line(shards: Shards) -> None:
    exports = shards.exports
    async with shards.serving(restore=False, deadline_s=2) as (client, control):
        await _declared(control, shards)
        for step, kind in enumerate(("base", "delta"), start=1):
            await _train(client, LR, KEYS[: step * 1000], step)
            assert (await control.export_now(kind)).version == step
    damaged = exports / "m" / "0000000001" / "shard-0.m_w.npz"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 3] ^= 0x80
    damaged.write_bytes(bytes(raw))

    async with shards.serving(restore=True, deadline_s=1) as (client, control):

        async def refused() -> bool:
            shards.check_running()
            return any(l.get("msg") == "no common version: leases refused" for l in shards.lines(0))

        await until(refused, 60, what="the coordinator to refuse", poll_s=0.1)
        with pytest.raises(NoCommonVersionError) as failed:
            await control.acquire_lease("w", wait_s=1)
        assert str(damaged) in str(failed.value) and "--no-restore" in str(failed.value)
        assert [r.joined for r in await _memberships(control)] == [False, False]
        lines = [l for l in shards.lines(0) if l.get("msg") == "no common version: leases refused"]
        assert len(lines) == 1 and lines[0]["level"] == "error"
        cluster = (await control.stats())[0].cluster
        assert not cluster.ready and cluster.versions_refused == 2

        # Moving the damaged versions aside is what the line says to do:
        # with nothing left to load, the shards join empty.
        for name in ("0000000001", "0000000002"):
            (exports / "m" / name).rename(exports / "m" / f"damaged-{name}")
        reports = await _joined(control, shards)
        assert [r.version for r in reports] == [0, 0]
        await _lease_works(control)
        for i in range(2):
            _no_tracebacks(shards, i)


@pytest.mark.process
async def test_a_shard_restarted_alone_makes_the_cluster_restore_one_version_and_nothing_is_lost(
    kafka_bootstrap: str, shards: Shards
) -> None:
    events, _ = _events()
    n, partitions = len(events), 2
    topic, group = await new_topic(kafka_bootstrap, partitions, hex_digits=10)
    await _produce(kafka_bootstrap, topic, events)
    produced = [sum(1 for i in range(n) if i % partitions == p) for p in range(partitions)]
    config = worker_config(kafka_bootstrap, topic, group, 1000, session_timeout_ms=3000, heartbeat_interval_ms=500)
    shards.start_all(restore=True)  # an empty directory: they join holding nothing
    try:
        async with (
            PSClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as client,
            ControlClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as control,
        ):
            await _joined(control, shards)

            async def committed() -> list[int]:
                known = (await control.coordinator_offsets()).get(topic, {})
                return [known.get(p, 0) for p in range(partitions)]

            # Train a third, with both partitions committed, and cut.
            worker = Worker(config, client, control, LogisticRegression("m"))
            assert await _run_worker(worker, lambda: worker.stats.events_trained >= n // 3) is None
            assert all(await committed())
            cut = await control.export_now()
            assert (cut.version, cut.kind) == (1, "base")

            # Train on; mid-stream shard 1 dies and is started again alone.
            # The cluster restores one version on every shard, and workers
            # (a new one whenever one gave up; one that rides the restart out
            # rewinds) train everything after it.
            restarted = False
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    with contextlib.suppress(Exception):
                        restores = (await control.stats())[0].cluster.cluster_restores
                        if restarted and restores >= 1 and await committed() == produced:
                            done.set()
                    await asyncio.sleep(0.1)  # poll interval; the test bounds the whole by its rounds

            watcher = asyncio.create_task(watch())
            try:
                for _ in range(8):
                    worker = Worker(config, client, control, LogisticRegression("m"))

                    def step(worker: Worker = worker) -> bool:
                        nonlocal restarted
                        if not restarted and worker.stats.events_trained >= 4000:
                            shards.stop(1, signal.SIGKILL)
                            shards.start(1, restore=True)
                            restarted = True
                        return done.is_set()

                    await _run_worker(worker, step, timeout_s=90)
                    if done.is_set():
                        break
            finally:
                watcher.cancel()
            assert restarted and done.is_set()
            assert await committed() == produced
            reports = await _joined(control, shards)
            assert [r.version for r in reports] == [1, 1]  # both restored version 1, then trained
            cluster = (await control.stats())[0].cluster
            assert cluster.cluster_restores == 1
            metrics = ApiMetrics()
            exposition = (await metrics.scrape(ControlView(control, metrics))).decode()
            assert "ctrps_cluster_restores_total 1.0" in exposition
            assert "ctrps_cluster_ready 1.0" in exposition and "ctrps_cluster_version 1.0" in exposition
            restores = [l for l in shards.lines(0) if l.get("msg") == "cluster restore"]
            assert len(restores) == 1 and restores[0]["version"] == 1
            assert "trained past" in restores[0]["why"]
            for i in range(2):
                assert [l["version"] for l in shards.lines(i) if l.get("msg") == "restore"][-1] == 1
            final = await control.export_now()
        shards.check_running()
    finally:
        shards.stop_all()
    # Every produced event was applied at least once (the bias row's shows
    # per partition's feature count applications), at most one window more.
    recovered = restore_shards(latest_chain(shards.exports / "m", verify=True), 2)
    assert recovered.version == final.version
    shows = _shows_in(recovered.shards, _part_keys())
    assert all(p <= s <= p + 1000 for s, p in zip(shows, produced)), (shows, produced)
    for i in range(2):
        _no_tracebacks(shards, i)


@pytest.mark.process
async def test_shard_0_restarted_alone_and_a_shard_started_without_shard_0(shards: Shards) -> None:
    async with shards.serving(restore=True, deadline_s=1) as (client, control):
        await _declared(control, shards)
        await _train(client, LR, KEYS[:1500], 1)
        lease = await control.acquire_lease("w", wait_s=5)
        await control.release_lease(lease.lease_id, {"clicks": {0: 7}})
        assert (await control.export_now()).version == 1
        at_v1 = await client.pull("m_w", KEYS)
        lease = await control.acquire_lease("w", wait_s=5)
        await _train(client, LR, KEYS[1000:], 2)  # trained past version 1
        await control.release_lease(lease.lease_id, {"clicks": {0: 9}})
        old_epoch = (await control.stats())[0].cluster.epoch

        # Shard 0 (and its coordinator) restarts alone: its new
        # coordinator makes shard 1 load version 1 too.
        shards.stop(0, signal.SIGKILL)
        shards.start(0)
        reports = await _joined(control, shards)
        assert [r.version for r in reports] == [1, 1] and reports[1].epoch != old_epoch
        np.testing.assert_array_equal(await client.pull("m_w", KEYS), at_v1)
        assert await control.coordinator_offsets() == {"clicks": {0: 7}}
        restores = [l for l in shards.lines(0) if l.get("msg") == "cluster restore"]
        assert len(restores) == 1 and restores[0]["version"] == 1

        # Shard 1 started while shard 0 is down: it restores, but serves
        # nothing until a coordinator admits it, and says so.
        shards.stop(0)
        shards.stop(1)
        shards.start(1)

        async def waits() -> bool:
            shards.check_running()
            return any(l.get("msg") == "not joined" for l in shards.lines(1))

        await until(waits, 30, what="shard 1 to say it is not joined", poll_s=0.1)
        line = next(l for l in shards.lines(1) if l.get("msg") == "not joined")
        assert line["level"] == "warning" and "shard 0" in line["hint"] and line["version"] == 1
        async with aiohttp.ClientSession() as http:
            frame = op_encoders.encode_pull("m_w", KEYS[:10])
            async with http.post(f"{shards.urls[1]}/v1/pull", data=frame) as r:
                body = orjson.loads(await r.read())
                assert (r.status, body["error"]) == (503, "shard_not_joined")
                assert "version 1" in body["detail"]
        # Clients get it at once, typed (not retried into "unreachable"):
        # a push held back until after a restore would land on it.
        async with PSClient.connect(shards.urls[1:], retry=RetryPolicy(deadline_s=30)) as direct:
            with pytest.raises(ShardNotJoinedError):
                await asyncio.wait_for(direct.transports[0].pull("m_w", KEYS[:10]), 5)
        shards.start(0)
        reports = await _joined(control, shards)
        assert [r.version for r in reports] == [1, 1]
        # Both loaded version 1 and trained nothing since: admitted as they are.
        assert not [l for l in shards.lines(0) if l.get("msg") == "cluster restore"]
        np.testing.assert_array_equal(await client.pull("m_w", KEYS), at_v1)
        for i in range(2):
            _no_tracebacks(shards, i)


async def _two_versions(exports: Path) -> None:
    """Versions 1 (base) and 2 (delta) of model ``m`` over two shards, with offsets."""
    coord = Coordinator()
    live = [Shard(ShardSpec(i, 2), (LR,)) for i in range(2)]
    client, control = PSClient.local(live), ControlClient.local(live, coord)
    exporter = Exporter(coord, control, exports, "m")
    for step in (1, 2):
        await _train(client, LR, KEYS[: step * 1000], step)
        lease = await control.acquire_lease("w")
        await control.release_lease(lease.lease_id, {"clicks": {0: step * 10}})
        await exporter.cut()


def _slice(exports: Path, shard_id: int, version: int) -> Shard:
    shard, _ = load_shard(ShardSpec(shard_id, 2), exports / "m", version, (LR,))
    shard.restored(version, exports / "m")
    shard.leave("waiting for the coordinator")
    return shard


async def test_shards_that_loaded_different_versions_are_restored_to_the_newest_common_one(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    await _two_versions(exports)
    # Shard 1 came up when only version 1 was readable to it.
    shards = [_slice(exports, 0, 2), _slice(exports, 1, 1)]
    coord = Coordinator(last_version=2, version=2, offsets={"clicks": {0: 20}})
    membership = Membership(coord, ControlClient.local(shards, coord), exports / "m")
    with pytest.raises(ClusterNotReadyError):
        await coord.acquire("w")
    await membership.check()
    assert coord.ready and [s.state_version for s in shards] == [2, 2]
    assert all(s.joined and s.joined_epoch == coord.epoch for s in shards)
    assert membership.cluster_restores == 1 and coord.offsets() == {"clicks": {0: 20}}
    want = restore_shards(latest_chain(exports / "m", upto=2), 2).shards
    np.testing.assert_array_equal(
        await PSClient.local(shards).pull("m_w", KEYS), await PSClient.local(want).pull("m_w", KEYS)
    )

    # Version 2 turns out damaged for one shard after the others loaded it:
    # the refusal of any shard moves every shard to version 1.
    damaged = exports / "m" / "0000000002" / "shard-1.m_w.npz"
    raw = bytearray(damaged.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    damaged.write_bytes(bytes(raw))
    shards[1] = _slice(exports, 1, 1)
    coord2 = Coordinator(last_version=2, version=2, offsets={"clicks": {0: 20}})
    membership = Membership(coord2, ControlClient.local(shards, coord2), exports / "m")
    await membership.check()
    assert coord2.ready and [s.state_version for s in shards] == [1, 1]
    assert coord2.offsets() == {"clicks": {0: 10}} and membership.versions_refused == 1
    assert coord2.next_kind() == "base"


async def test_the_coordinator_waits_for_an_unreachable_shard_with_a_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shard0 = Shard(ShardSpec(0, 2), (LR,))
    coord = Coordinator()
    dead = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        client = ControlClient(
            [LocalControl(shard0, coord), HttpControl(1, dead, session, RetryPolicy(deadline_s=0.2))]
        )
        membership = Membership(coord, client, tmp_path / "m", urls=["local", dead], wait_log_s=3600)
        with caplog.at_level(logging.WARNING, logger="ctrps.join"):
            await membership.check()
            await membership.check()  # one line per wait_log_s, not per poll
        lines = [r for r in caplog.records if r.getMessage() == "waiting for shards to join"]
        assert len(lines) == 1 and dead in lines[0].fields["unreachable"]  # type: ignore[attr-defined]
        with pytest.raises(ClusterNotReadyError) as refused:
            await coord.acquire("w")
        assert "shard(s) 1" in str(refused.value)
        assert membership.stats()["joined"] == [False, None] and not membership.stats()["ready"]
