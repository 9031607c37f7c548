"""A restore whose cut does not cover what the group committed never resumes
silently: the events between are trained again, or the worker says what the
model lacks (``ctrps shard`` processes on loopback, real export files, the
embedded broker, the real worker in this process)."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from streams import new_topic, worker_config
from test_recovery import _events, _part_keys, _produce, _shows_in
from test_recovery import _train as _run_worker
from test_restore_consistent import Shards, _joined
from waiting import until

from consumers.resume import uncovered
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import latest_chain, read_manifest, write_version
from ps_core.checkpoint.manifest import CHECKSUM_FIELD, ExportManifest
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import ExportCorruptError
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

PARTITIONS = 2


@pytest.fixture
def shards(tmp_path: Path) -> Shards:
    """Two shards exporting to tmp_path/exports, logging to tmp_path (not started)."""
    return Shards(2, tmp_path / "exports", tmp_path)


class Stream:
    """The test stream produced once to a fresh topic, and its group."""

    def __init__(self, bootstrap: str, topic: str, group: str, produced: list[int]) -> None:
        self.bootstrap, self.topic, self.group, self.produced = bootstrap, topic, group, produced

    def worker(self, control: ControlClient, client: PSClient) -> Worker:
        config = worker_config(self.bootstrap, self.topic, self.group, 1000)
        return Worker(config, client, control, LogisticRegression("m"))


async def _stream(bootstrap: str) -> Stream:
    events, _ = _events()
    topic, group = await new_topic(bootstrap, PARTITIONS, hex_digits=10)
    await _produce(bootstrap, topic, events)
    produced = [sum(1 for i in range(len(events)) if i % PARTITIONS == p) for p in range(PARTITIONS)]
    return Stream(bootstrap, topic, group, produced)


async def _committed(control: ControlClient, topic: str) -> list[int]:
    known = (await control.coordinator_offsets()).get(topic, {})
    return [known.get(p, 0) for p in range(PARTITIONS)]


async def _train_until(worker: Worker, trained: int) -> None:
    assert await _run_worker(worker, lambda: worker.stats.events_trained >= trained) is None


async def _train_all(worker: Worker, control: ControlClient, s: Stream) -> None:
    """Run `worker` until the coordinator holds every partition's end as committed."""
    done = asyncio.Event()

    async def watch() -> None:
        while await _committed(control, s.topic) != s.produced:
            await asyncio.sleep(0.1)  # poll interval; bounded by _run_worker's deadline
        done.set()

    watcher = asyncio.create_task(watch())
    try:
        assert await _run_worker(worker, done.is_set, timeout_s=90) is None
    finally:
        watcher.cancel()


def _shows(exports: Path) -> list[int]:
    """Events in the model per partition: the shows of each partition's
    feature row, read from the newest export's files."""
    recovered = restore_shards(latest_chain(exports / "m", verify=True), 2)
    return _shows_in(recovered.shards, _part_keys())


def _gap_lines(caplog: pytest.LogCaptureFixture, start: str) -> list[Any]:
    return [r for r in caplog.records if r.name == "ctrps.worker" and r.getMessage().startswith(start)]


def _ranges(record: Any) -> dict[int, tuple[int, int]]:
    """``"0:[0,1500) 1:[0,1500)"`` → {0: (0, 1500), 1: (0, 1500)}."""
    out = {}
    for item in str(record.fields["partitions"]).split():
        p, _, rng = item.partition(":")
        lo, hi = rng.strip("[)").split(",")
        out[int(p)] = (int(lo), int(hi))
    return out


async def test_a_restored_cut_without_offsets_replays_what_the_group_committed(
    kafka_bootstrap: str, shards: Shards, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _stream(kafka_bootstrap)
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    shards.start_all(restore=True)  # an empty directory: they join holding nothing
    try:
        async with (
            PSClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as client,
            ControlClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as control,
        ):
            await _joined(control, shards)
            # The newest export is cut before the worker's first commit: no offsets.
            cut = await control.export_now()
            assert cut.version == 1 and not read_manifest(shards.exports / "m" / "0000000001").offsets
            await _train_until(s.worker(control, client), 7000)
            before = await _committed(control, s.topic)
            assert all(before)
            # Shard 1 dies before the next cut: the cluster restores version 1.
            shards.stop(1, signal.SIGKILL)
            shards.start(1, restore=True)
            reports = await _joined(control, shards)
            assert [r.version for r in reports] == [1, 1]
            worker = s.worker(control, client)
            await _train_all(worker, control, s)
            await control.export_now()
        shards.check_running()
    finally:
        shards.stop_all()
    lines = _gap_lines(caplog, "restore gap replayed")
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert _ranges(lines[0]) == {p: (0, c) for p, c in enumerate(before)}
    assert lines[0].fields["events"] == sum(before) and f"{sum(before)} are trained again" in lines[0].getMessage()
    assert worker.stats.stale_offsets[("uncovered", "replayed")] == PARTITIONS
    # Every event is in the model: those the restore threw away were trained again.
    shows = _shows(shards.exports)
    assert all(p <= n <= p + 1000 for n, p in zip(shows, s.produced)), (shows, s.produced)


async def test_no_restore_after_no_common_version_says_what_the_model_lacks(
    kafka_bootstrap: str, shards: Shards, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _stream(kafka_bootstrap)
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    shards.start_all(restore=True)
    try:
        async with (
            PSClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as client,
            ControlClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as control,
        ):
            await _joined(control, shards)
            await _train_until(s.worker(control, client), 3000)
            before = await _committed(control, s.topic)
            assert sum(before) >= 3000
            # Killed before the first export: no version every shard can
            # load; the runbook's way out starts every shard empty.
            shards.stop(1, signal.SIGKILL)
            shards.start(1, restore=True)

            async def refused() -> bool:
                shards.check_running()
                return any(l.get("msg") == "no common version: leases refused" for l in shards.lines(0))

            await until(refused, 60, what="the coordinator to refuse", poll_s=0.1)
            shards.stop_all()
            shards.start_all(restore=False)
            await _joined(control, shards)
            worker = s.worker(control, client)
            await _train_all(worker, control, s)
            await control.export_now()
        shards.check_running()
    finally:
        shards.stop_all()
    lines = _gap_lines(caplog, "the shards started empty")
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    lost = _ranges(lines[0])
    assert lost == {p: (0, c) for p, c in enumerate(before) if c}
    assert f"{sum(before)} events the group committed are not in the model" in lines[0].getMessage()
    # What the line says the model lacks is exactly what it lacks.
    shows = _shows(shards.exports)
    assert [n + lost.get(p, (0, 0))[1] for p, n in enumerate(shows)] == s.produced, (shows, lost, s.produced)


async def test_a_changed_digit_in_the_newest_manifest_is_refused_and_nothing_is_lost(
    kafka_bootstrap: str, shards: Shards, caplog: pytest.LogCaptureFixture
) -> None:
    s = await _stream(kafka_bootstrap)
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    shards.start_all(restore=True)
    try:
        async with (
            PSClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as client,
            ControlClient.connect(shards.urls, retry=RetryPolicy(deadline_s=1.0)) as control,
        ):
            await _joined(control, shards)
            worker = s.worker(control, client)
            # A worker stopping finishes what it buffered: each trains a few windows.
            await _train_until(worker, 1000)
            assert (await control.export_now()).version == 1
            at_v1 = await _committed(control, s.topic)
            await _train_until(s.worker(control, client), 1000)
            assert (await control.export_now()).version == 2
            await _train_until(s.worker(control, client), 1)
            before = await _committed(control, s.topic)
            assert sum(before) < sum(s.produced)
            # One digit of partition 0's offset in the newest manifest changes.
            path = shards.exports / "m" / "0000000002" / "manifest.json"
            text = path.read_text()
            raw = json.loads(text)
            tampered = max(raw["offsets"][s.topic], key=lambda p: raw["offsets"][s.topic][p])
            raw["offsets"][s.topic][tampered] += 1000
            path.write_text(json.dumps(raw, indent=2) + "\n")
            for i in range(2):
                shards.stop(i, signal.SIGKILL)
            shards.start_all(restore=True)
            reports = await _joined(control, shards)
            assert [r.version for r in reports] == [1, 1]
            assert await _committed(control, s.topic) == at_v1
            worker = s.worker(control, client)
            await _train_all(worker, control, s)
            await control.export_now()
        shards.check_running()
    finally:
        shards.stop_all()
    for i in range(2):
        refused = [l for l in shards.lines(i) if l.get("msg") == "version refused"]
        assert [(l["file"], l["expected"]) for l in refused] == [(str(path), raw[CHECKSUM_FIELD])], refused
    lines = _gap_lines(caplog, "restore gap replayed")
    assert len(lines) == 1
    assert _ranges(lines[0]) == {p: (a, b) for p, (a, b) in enumerate(zip(at_v1, before)) if a < b}
    shows = _shows(shards.exports)
    assert all(p <= n <= p + 1000 for n, p in zip(shows, s.produced)), (shows, s.produced)


def test_a_manifest_checks_its_own_checksum_and_older_ones_without_one_still_read(tmp_path: Path) -> None:
    shard = Shard(ShardSpec(0, 1))
    shard.declare(TableConfig("m_w", 1, {"name": "ftrl"}))
    path = write_version(
        tmp_path, "m", 1, None, {0: [t.snapshot() for t in shard.tables.values()]}, {"t": {0: 5457}}, {}, 1
    )
    raw = orjson.loads((path / "manifest.json").read_bytes())
    assert len(raw[CHECKSUM_FIELD]) == 64 and read_manifest(path).offsets == {"t": {0: 5457}}
    raw["offsets"]["t"]["0"] = 6457
    with pytest.raises(ExportCorruptError) as info:
        ExportManifest.from_json(orjson.dumps(raw), "v1/manifest.json")
    err = info.value
    assert err.file == "v1/manifest.json" and err.expected == raw[CHECKSUM_FIELD] and len(err.actual) == 64
    assert err.expected != err.actual and err.actual in err.detail and err.expected in err.detail
    # Written before manifests carried a checksum: read as before.
    del raw[CHECKSUM_FIELD]
    assert ExportManifest.from_json(orjson.dumps(raw)).offsets == {"t": {0: 6457}}


def test_what_the_group_committed_past_the_state_is_replayed_refused_or_reported() -> None:
    # The cut's offset behind the commit: replayed from the cut.
    gap = uncovered(0, 40, 100, 0, 3, "committed")
    assert gap is not None and (gap.action, gap.resume_at, gap.events) == ("replayed", 40, 60)
    assert uncovered(0, 100, 100, 0, 3, "committed") is None
    assert uncovered(0, 40, 100, 50, 3, "committed") is None  # before the start: a stale offset
    assert uncovered(0, None, None, 0, 3, "committed") is None  # the group never committed
    assert uncovered(0, None, 100, 0, None, "committed") is None  # a coordinator that does not say
    # A restored cut that holds none of the partition: replayed from 0 while held.
    gap = uncovered(1, None, 100, 0, 3, "committed")
    assert gap is not None and (gap.action, gap.resume_at, gap.range()) == ("replayed", 0, "1:[0,100)")
    gap = uncovered(1, None, 100, 30, 3, "committed")
    assert gap is not None and gap.action == "refused" and gap.range() == "1:[0,100) (not held: [0,30))"
    gap = uncovered(1, None, 100, 30, 3, "earliest")
    assert gap is not None and (gap.action, gap.resume_at) == ("replayed", 30)
    # Shards started empty: the commit stands, the model lacks what it covers.
    gap = uncovered(1, None, 100, 0, 0, "committed")
    assert gap is not None and (gap.action, gap.resume_at, gap.events) == ("lost", 100, 100)
