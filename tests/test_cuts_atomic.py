"""Cuts are atomic across shards: a cut that fails on any shard (unreachable,
a full disk, a stray snapshot request) is aborted on every shard, logged in
one line, counted, and the next export succeeds (real shard servers on
loopback, real files, a real tmpfs)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest
from test_exporter import _state, _train
from waiting import until

from app.api.views import ControlView
from app.metrics import ApiMetrics
from consumers.broker import free_port
from ps_core.checkpoint.control import ControlClient, HttpControl, LocalControl, ShardControl
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.restore import restore_shards
from ps_core.checkpoint.routes import checkpointed_shard_app
from ps_core.errors import CutAbortedError, ExportWriteError
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import ShardSite, start_shard_site
from ps_core.net.shard_bodies import ExporterStats
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

LR = TableConfig("m_w", 1, {"name": "ftrl", "alpha": 0.1, "beta": 1.0, "l1": 0.1, "l2": 1.0})
KEYS = np.arange(1, 2001, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


class Cluster:
    """Two shard servers on fixed loopback ports; shard 1 can be stopped and
    started again (the same state, as a process that was unreachable and
    came back); shard 0 hosts coordinator and exporter, reaching shard 1 over
    HTTP as ``ctrps shard --shards`` does."""

    def __init__(self, exports: Path) -> None:
        self.shards = [Shard(ShardSpec(i, 2), (LR,)) for i in range(2)]
        self.ports = [free_port(), free_port()]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers: list[ShardSite | None] = [None, None]
        self.coordinator = Coordinator()
        self.session: aiohttp.ClientSession | None = None
        self.exports = exports

    async def start(self) -> None:
        self.session = aiohttp.ClientSession()
        shards: list[ShardControl] = [
            LocalControl(self.shards[0], self.coordinator),
            HttpControl(1, self.urls[1], self.session, RetryPolicy(deadline_s=0.5)),
        ]
        self.exporter = Exporter(
            self.coordinator, ControlClient(shards), self.exports, "m", cut_timeout_s=5, abort_timeout_s=2
        )
        self.shards[0].add_stats("exports", self.exporter.stats)
        for i in range(2):
            await self.start_shard(i)

    async def start_shard(self, i: int) -> None:
        if i == 0:
            app = checkpointed_shard_app(self.shards[0], coordinator=self.coordinator, exporter=self.exporter)
        else:
            app = checkpointed_shard_app(self.shards[i])
        self.servers[i] = await start_shard_site(app, "127.0.0.1", self.ports[i])

    async def stop_shard(self, i: int) -> None:
        server = self.servers[i]
        assert server is not None
        await server.cleanup()
        self.servers[i] = None

    async def close(self) -> None:
        for i, server in enumerate(self.servers):
            if server is not None:
                await self.stop_shard(i)
        assert self.session is not None
        await self.session.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    c = Cluster(tmp_path / "exports")
    await c.start()
    try:
        yield c
    finally:
        await c.close()


def _aborted(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ctrps.export" and r.levelno == logging.WARNING]


def _restores_to_live(exports: Path, shards: list[Shard]) -> int:
    chain = latest_chain(exports / "m", verify=True)
    restored = restore_shards(chain, 2)
    assert _state(restored.shards, "m_w", KEYS) == _state(shards, "m_w", KEYS)
    return restored.version


async def test_a_shard_unreachable_at_the_pause_aborts_the_cut_everywhere(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with PSClient.connect(cluster.urls) as client, ControlClient.connect(cluster.urls) as control:
        await _train(client, LR, KEYS[:1000], 1)
        first = await control.export_now()
        assert (first.version, first.kind) == (1, "base")
        await _train(client, LR, KEYS[500:1500], 2)

        await cluster.stop_shard(1)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ctrps.export"):
            with pytest.raises(CutAbortedError) as failed:
                await cluster.exporter.cut()
        assert "cut 2 aborted" in str(failed.value) and "shard 1" in str(failed.value)
        # Shard 0 cut and dropped its copy again; leases are granted.
        assert cluster.shards[0].pending_snapshots == []
        lines = _aborted(caplog)
        assert len(lines) == 1 and lines[0].exc_info is None
        fields = lines[0].fields  # type: ignore[attr-defined]
        assert (fields["version"], fields["reason"], fields["shards"]) == (2, "unreachable", "1")
        assert fields["not_aborted_on"] == "1"
        assert cluster.exporter.failures == {"unreachable": 1}
        lease = await control.acquire_lease("w", wait_s=1)
        await control.release_lease(lease.lease_id, {})

        await cluster.start_shard(1)
        # Version 2 is spent; the next cut is a base, and everything restores.
        after = await control.export_now()
        assert (after.version, after.kind) == (3, "base")
        await _train(client, LR, KEYS[1500:], 3)
        delta = await control.export_now()
        assert (delta.version, delta.kind, delta.parent) == (4, "delta", 3)
        assert [v.version for v in list_versions(cluster.exports / "m")] == [1, 3, 4]
        assert _restores_to_live(cluster.exports, cluster.shards) == 4
        # The failure is counted where metrics read shard 0's figures.
        stats = (await control.stats())[0].exports
        assert isinstance(stats, ExporterStats)
        assert stats.failures == {"unreachable": 1} and stats.exports == 3
        metrics = ApiMetrics()
        exposition = (await metrics.scrape(ControlView(control, metrics))).decode()
        assert 'ctrps_export_failures_total{reason="unreachable"} 1.0' in exposition
        assert "ctrps_exports_total 3.0" in exposition


async def test_a_shard_lost_between_the_pause_and_the_fetch(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    async with PSClient.connect(cluster.urls) as client, ControlClient.connect(cluster.urls) as control:
        await _train(client, LR, KEYS[:1000], 1)
        await control.export_now()
        await _train(client, LR, KEYS[1000:], 2)

        # The shard vanishes right after the pause, before its copy is fetched.
        real_cut = cluster.coordinator.cut

        async def cut_then_lose_shard_1(*args: object, **kwargs: object) -> object:
            done = await real_cut(*args, **kwargs)  # type: ignore[arg-type]
            assert cluster.shards[1].pending_snapshots == [2]
            await cluster.stop_shard(1)
            return done

        cluster.coordinator.cut = cut_then_lose_shard_1  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="ctrps.export"):
            with pytest.raises(CutAbortedError):
                await cluster.exporter.cut()
        cluster.coordinator.cut = real_cut  # type: ignore[method-assign]
        lines = _aborted(caplog)
        assert len(lines) == 1 and lines[0].fields["reason"] == "fetch"  # type: ignore[attr-defined]
        assert not list((cluster.exports / "m").glob(".tmp-*"))

        await cluster.start_shard(1)
        # Shard 1 could not be told to drop version 2: it still holds it,
        # and that stale copy blocks nothing.
        assert cluster.shards[1].pending_snapshots == [2]
        after = await control.export_now()
        assert (after.version, after.kind) == (3, "base")
        assert [v.version for v in list_versions(cluster.exports / "m")] == [1, 3]
        assert _restores_to_live(cluster.exports, cluster.shards) == 3


async def test_a_stray_snapshot_request_does_not_block_cuts(cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    async with PSClient.connect(cluster.urls) as client, ControlClient.connect(cluster.urls) as control:
        await _train(client, LR, KEYS[:1000], 1)
        assert (await control.export_now()).version == 1
        await _train(client, LR, KEYS[1000:], 2)
        # Someone asks shard 1 for the coordinator's next version by hand.
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{cluster.urls[1]}/v1/snapshots", json={"version": 2, "parent": 1}) as r:
                assert r.status == 200
        with caplog.at_level(logging.WARNING, logger="ctrps.export"):
            # Shard 1's tables moved on past the parent: the delta is refused,
            # aborted, and tried again at once as a base, which succeeds.
            cut = await control.export_now()
        assert (cut.version, cut.kind) == (3, "base")
        assert [r.fields["reason"] for r in _aborted(caplog)] == ["refused"]  # type: ignore[attr-defined]
        await _train(client, LR, KEYS[:10], 3)
        for version in (4, 5):
            got = await control.export_now()
            assert (got.version, got.kind) == (version, "delta")
        assert cluster.shards[1].pending_snapshots == []
        assert _restores_to_live(cluster.exports, cluster.shards) == 5


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.process
async def test_a_full_disk_fails_one_cut_and_the_next_succeeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with _tmpfs(tmp_path / f"exports-{uuid.uuid4().hex[:6]}", "2m") as exports:
        cluster = Cluster(exports)
        await cluster.start()
        try:
            async with PSClient.connect(cluster.urls) as client, ControlClient.connect(cluster.urls) as control:
                await _train(client, LR, KEYS, 1)
                assert (await control.export_now()).version == 1
                await _train(client, LR, KEYS[:1500], 2)
                # Fill the filesystem to within a few kilobytes.
                filler = exports / "filler"
                with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
                    while True:
                        f.write(b"\0" * 4096)
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="ctrps.export"):
                    with pytest.raises(ExportWriteError) as failed:
                        await cluster.exporter.cut()
                lines = _aborted(caplog)
                assert len(lines) == 1 and lines[0].exc_info is None
                fields = lines[0].fields  # type: ignore[attr-defined]
                assert fields["reason"] == "disk" and fields["version"] == 2
                assert str(exports / "m") in fields["path"] and "No space left" in fields["error"]
                assert failed.value.path == fields["path"] and fields["path"] in str(failed.value)
                # Nothing partial is left, and the last good chain still reads.
                assert sorted(p.name for p in (exports / "m").iterdir()) == ["0000000001"]
                assert cluster.exporter.failures == {"disk": 1}
                # Over HTTP, the error is typed and names the path.
                async with aiohttp.ClientSession() as http:
                    async with http.post(f"{cluster.urls[0]}/v1/exports") as r:
                        body = orjson.loads(await r.read())
                        assert (r.status, body["error"]) == (507, "export_write_failed")
                        assert str(exports / "m") in body["detail"]

                filler.unlink()
                after = await control.export_now()
                assert (after.version, after.kind) == (4, "base")
                assert _restores_to_live(exports, cluster.shards) == 4
        finally:
            await cluster.close()


async def test_a_shard_not_joined_copies_nothing_and_the_cut_is_aborted(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    async with PSClient.connect(cluster.urls) as client, ControlClient.connect(cluster.urls) as control:
        await _train(client, LR, KEYS, 1)
        assert (await control.export_now()).version == 1
        # Shard 1 restarted (not yet admitted): its state may be another
        # version than shard 0's, so a cut of it would mix versions.
        cluster.shards[1].leave("restarted")
        with caplog.at_level(logging.WARNING, logger="ctrps.export"):
            with pytest.raises(CutAbortedError):
                await cluster.exporter.cut()
        assert [r.fields["reason"] for r in _aborted(caplog)] == ["not_joined"]  # type: ignore[attr-defined]
        assert cluster.shards[0].pending_snapshots == [] and cluster.shards[1].pending_snapshots == []
        assert [v.version for v in list_versions(cluster.exports / "m")] == [1]
        cluster.shards[1].admit("", cluster.shards[1].state_version)
        after = await control.export_now()
        assert (after.version, after.kind) == (3, "base")
        assert _restores_to_live(cluster.exports, cluster.shards) == 3


async def test_a_lease_whose_caller_gave_up_during_a_cut_is_not_left_active(cluster: Cluster) -> None:
    """A worker's lease request that times out while a cut pauses must not
    leave a lease granted to nobody: the next cut would wait for it until its
    TTL (two minutes by default)."""
    held = await cluster.coordinator.acquire("window")  # a window in flight: the cut waits for it
    release = asyncio.Event()

    async def snapshot(version: int, kind: str) -> None:
        await release.wait()

    cut = asyncio.create_task(cluster.coordinator.cut(snapshot))
    await until(lambda: not cluster.coordinator._open.is_set(), 5, what="the cut's pause")
    assert cluster.session is not None
    with pytest.raises(asyncio.TimeoutError):  # the caller gives up before the coordinator answers
        async with cluster.session.post(
            cluster.urls[0] + "/v1/leases",
            json={"worker": "late", "wait_s": 30},
            timeout=aiohttp.ClientTimeout(total=0.5),
        ) as resp:
            await resp.read()
    # Shard 0 has seen the caller leave before the cut lets the request on,
    # as it would a caller that left long before the cut ends.
    site = cluster.servers[0]
    assert site is not None
    await until(lambda: site.guard.open_connections == 0, 5, what="shard 0 to see the caller leave")
    await cluster.coordinator.release(held.lease_id, {})
    release.set()
    await asyncio.wait_for(cut, 10)
    # The late request is never left holding a lease: the next cut does not
    # wait for one (it would until the lease's TTL).
    await until(lambda: cluster.coordinator.active_leases == 0, 5, what="no lease left active")

    async def no_wait(version: int, kind: str) -> None:
        return None

    after = await asyncio.wait_for(cluster.coordinator.cut(no_wait), 5)
    assert after.lease_wait_s < 1.0 and after.expired_leases == []
