"""Export cuts end to end: coordinator pause, shard copies, files, restore."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from conftest import ServeShards
from waiting import until

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import ExportWriteError, SnapshotError
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

LR = TableConfig("m_w", 1, {"name": "ftrl", "alpha": 0.1, "beta": 1.0, "l1": 0.1, "l2": 1.0})
FM_V = TableConfig("m_v", 4, {"name": "adagrad", "lr": 0.05}, init_scale=0.01)


async def _train(client: PSClient, table: TableConfig, keys: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(keys.size, table.dim)).astype(np.float32)
    counts = np.stack([np.ones(keys.size), rng.integers(0, 2, keys.size)], axis=1).astype(np.float32)
    routed = client.route(keys)
    await client.pull(table.name, routed)  # as a worker does: pull, then push the same keys
    await client.push(table.name, routed, grads, counts=counts, event_time=1_764_681_600.0 + seed)


def _state(shards: list[Shard], table: str, keys: np.ndarray) -> dict[int, tuple[object, ...]]:
    """Every live key's row, weights, state and metadata, whichever shard holds it."""
    out: dict[int, tuple[object, ...]] = {}
    for s in shards:
        t = s.tables.get(table)
        if t is None:
            continue
        rows = t.index.lookup(keys)
        for k, r in zip(keys.tolist(), rows.tolist()):
            if r >= 0:
                out[k] = (
                    t.data[r].tolist(),
                    int(t.shows[r]),
                    int(t.clicks[r]),
                    int(t.last_seen[r]),
                    bool(t.changed()[r]),
                )
    return out


async def test_cuts_write_a_chain_that_restores_every_row_into_more_shards(tmp_path: Path) -> None:
    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2), (LR,)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "m")
    universe = np.arange(1, 3000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)

    await _train(client, LR, universe[:1000], 1)
    lease = (await control.acquire_lease("w")).lease_id
    await control.release_lease(lease, {"clicks": {0: 10, 1: 12}})
    base = await exporter.cut()
    assert (base.version, base.kind, base.parent, base.rows) == (1, "base", None, 1000)

    await _train(client, LR, universe[500:1500], 2)
    for s in shards:
        s.tables["m_w"].delete(universe[:100])  # evicted features are part of the next delta
    await control.declare(FM_V)  # a table born after the base: all its rows go in the next delta
    await _train(client, FM_V, universe[:300], 3)
    lease = (await control.acquire_lease("w")).lease_id
    await control.release_lease(lease, {"clicks": {0: 20, 1: 25}})
    d1 = await exporter.cut()
    assert (d1.version, d1.kind, d1.parent) == (2, "delta", 1)
    assert d1.rows == 1000 + 300  # keys 500..1499 changed; FM rows all new

    await _train(client, LR, universe[2000:2500], 4)
    d2 = await exporter.cut()
    assert (d2.version, d2.kind, d2.parent, d2.rows) == (3, "delta", 2, 500)
    assert d2.offsets == {"clicks": {0: 20, 1: 25}}
    assert [v.version for v in list_versions(tmp_path / "m")] == [1, 2, 3]

    chain = latest_chain(tmp_path / "m")
    restored = restore_shards(chain, 3)
    assert restored.version == 3 and restored.offsets == {"clicks": {0: 20, 1: 25}}
    for table in ("m_w", "m_v"):
        live = _state(shards, table, universe)
        assert live and _state(restored.shards, table, universe) == live
    # What changes after the cut is the next version's.
    await _train(client, LR, universe[:10], 5)
    assert all(s.tables["m_w"].version == 4 for s in shards)


async def test_a_failed_write_makes_the_next_cut_a_base(tmp_path: Path) -> None:
    coord = Coordinator()
    shards = [Shard(ShardSpec(0, 1), (LR,))]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the exports directory should be")
    exporter = Exporter(coord, control, blocked, "m")
    await _train(client, LR, np.arange(1, 50, dtype=np.uint64), 1)
    with pytest.raises(ExportWriteError) as failed:
        await exporter.cut()
    assert str(blocked) in str(failed.value) and failed.value.path == str(blocked / "m")
    assert exporter.failures == {"disk": 1}
    exporter.root = tmp_path / "exports"
    first = await exporter.cut()
    assert (first.version, first.kind, first.rows) == (2, "base", 49)  # version 1 is spent
    await _train(client, LR, np.arange(1, 5, dtype=np.uint64), 2)
    assert (await exporter.cut()).kind == "delta"


async def test_periodic_exports_over_shard_servers(tmp_path: Path, serve_shards: ServeShards) -> None:
    shards, urls = await serve_shards(2, (LR,))
    coord = Coordinator(base_every=3)
    async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
        exporter = Exporter(coord, control, tmp_path, "m")
        await _train(client, LR, np.arange(1, 400, dtype=np.uint64), 1)
        stop = asyncio.Event()
        task = asyncio.create_task(exporter.run(0.05, stop))
        await until(lambda: coord.last_version >= 4, 10, what="4 exports", task=task)
        stop.set()
        await task
        kinds = [(v.version, v.kind) for v in list_versions(tmp_path / "m")]
        assert kinds[:4] == [(1, "base"), (2, "delta"), (3, "delta"), (4, "base")]
        restored = restore_shards(latest_chain(tmp_path / "m"), 1)
        keys = np.arange(1, 400, dtype=np.uint64)
        assert _state(restored.shards, "m_w", keys) == _state(shards, "m_w", keys)
        # A cut's copies are handed over once; a bad request is refused.
        with pytest.raises(SnapshotError):
            await control.fetch_snapshots(1)
        with pytest.raises(SnapshotError):
            await control.take_snapshots(99, 99)


@pytest.mark.slow
async def test_cuts_during_steady_training_wait_only_for_leased_windows(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Cuts every 50 ms while a worker trains: each waits at most for the
    window being applied, and the last one holds exactly what was trained."""
    import orjson
    from streams import new_topic, produce, worker_config

    from consumers.worker import Worker
    from ps_core.model.models import LogisticRegression
    from ps_core.synthetic import SyntheticStream

    topic, group = await new_topic(kafka_bootstrap, 2, hex_digits=10)
    n = 12_000
    await produce(kafka_bootstrap, topic, [orjson.dumps(e) for e in SyntheticStream(seed=2).batch(n)], 2)

    coord = Coordinator(lease_ttl_s=30)
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "ctr")
    worker = Worker(worker_config(kafka_bootstrap, topic, group, 1000), client, control, LogisticRegression("ctr"))
    stop = asyncio.Event()
    training = asyncio.create_task(worker.run(stop))
    reports = []
    async with asyncio.timeout(90):
        while worker.stats.records < n:
            assert not training.done(), training
            reports.append(await exporter.cut())
            await asyncio.sleep(0.05)  # the cut interval: pacing the cuts, not a wait-for
    stop.set()
    await training
    reports.append(await exporter.cut())

    window_s = max(r.seconds for r in worker.stats.history)
    during = [r for r in reports[:-1] if r.lease_wait_s > 0.001]
    assert during, "no cut met a window being applied"
    # A cut waits for the window in flight, never for more than one.
    assert all(r.lease_wait_s <= window_s + 0.5 for r in reports), ([r.lease_wait_s for r in reports], window_s)
    # The shards' part of the pause is the copy: small next to the wait.
    assert all(r.pause_s - r.lease_wait_s < 0.5 for r in reports)
    assert reports[-1].offsets == {topic: {0: n // 2, 1: n // 2}}
    restored = restore_shards(latest_chain(tmp_path / "ctr"), 2)
    keys = np.concatenate([s.tables["ctr_w"].index.row_keys[: s.tables["ctr_w"].index.num_rows] for s in shards])
    assert _state(restored.shards, "ctr_w", keys) == _state(shards, "ctr_w", keys)


@pytest.mark.slow
@pytest.mark.process
async def test_ctrps_export_cuts_lists_and_compacts_through_shard_0(tmp_path: Path, serve_shards: ServeShards) -> None:
    import subprocess
    import sys

    import orjson

    shards, urls = await serve_shards(2, (LR,), tmp_path)

    async def ctrps_export(*args: str) -> dict[str, object]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            "export",
            "--shard0",
            urls[0],
            *args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        got: dict[str, object] = orjson.loads(out)
        return got

    async with PSClient.connect(urls) as client:
        await _train(client, LR, np.arange(1, 200, dtype=np.uint64), 1)
        assert (await ctrps_export())["kind"] == "base"
        await _train(client, LR, np.arange(100, 300, dtype=np.uint64), 2)
        delta = await ctrps_export("--kind", "delta")
        assert (delta["version"], delta["parent"], delta["rows"]) == (2, 1, 200)
        folded = await ctrps_export("--compact")
        assert (folded["version"], folded["kind"], folded["compacted_from"]) == (2, "base", [1, 2])
        listed = await ctrps_export("--list")
        assert [(v["version"], v["kind"]) for v in listed["versions"]] == [(1, "base"), (2, "base")]  # type: ignore[attr-defined]
        keys = np.arange(1, 300, dtype=np.uint64)
        assert _state(restore_shards(latest_chain(tmp_path / "ctr"), 1).shards, "m_w", keys) == _state(
            shards, "m_w", keys
        )
