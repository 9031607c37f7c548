"""Restores know what they resume: an export records the stream its offsets
were read from, and a worker never applies offsets of another stream (another
Kafka cluster, a restarted in-memory broker, a recreated topic) silently.
Real brokers (the session's and brokers of the tests' own), real files."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from conftest import ServeShards
from jsonlog import read_json_lines
from streams import bias_shows, produce, shard_args, worker_config
from waiting import until

from app.api.views import ControlView
from app.metrics import ApiMetrics
from app.status import make_status_hook
from consumers.broker import EmbeddedBroker, create_topics, free_port
from consumers.resume import StaleOffsetsError, cluster_id, partition_bounds
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain, list_versions, read_manifest
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.manifest import ExportManifest
from ps_core.checkpoint.restore import restore_shards
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.control_messages import ExportStream
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

PROJECT = Path(__file__).resolve().parents[1]
PARTITIONS = 2


async def _produce(bootstrap: str, topic: str, n: int, seed: int) -> None:
    """`n` synthetic events, alternating between the partitions."""
    await produce(bootstrap, topic, [orjson.dumps(e) for e in SyntheticStream(seed=seed).batch(n)], PARTITIONS)


def _config(bootstrap: str, topic: str, group: str, policy: str = "committed") -> WorkerConfig:
    return worker_config(
        bootstrap, topic, group, 100, session_timeout_ms=3000, heartbeat_interval_ms=500, on_stale_offsets=policy
    )


async def _train(worker: Worker, done: Callable[[], bool], timeout_s: float = 60) -> None:
    """Run `worker` until done(); its failure is raised."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop), name="worker")
    try:
        await until(done, timeout_s, what="the worker to train", task=task)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.shield(task), 30)


def _stale_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("stale offsets")]


async def _export_from(bootstrap: str, topic: str, group: str, exports: Path, n: int) -> Path:
    """Train `n` events of `topic` into fresh shards and export a base: the
    model of one stream. Returns the model directory."""
    shards = [Shard(ShardSpec(i, PARTITIONS)) for i in range(PARTITIONS)]
    coordinator = Coordinator()
    client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
    worker = Worker(_config(bootstrap, topic, group), client, control, LogisticRegression("m"))
    await _train(worker, lambda: bias_shows(shards) >= n)
    assert worker.stats.events_trained == n and not worker.stats.stale_offsets
    report = await Exporter(coordinator, control, exports, "m").cut("base")
    assert report.stream == StreamIdentity(await cluster_id(bootstrap), group, (topic,))
    return exports / "m"


def _restore(model_dir: Path) -> tuple[list[Shard], Coordinator]:
    """What `ctrps shard` does at start: every shard's slice of the newest
    chain, and a coordinator resuming from its offsets and their stream."""
    result = restore_shards(latest_chain(model_dir, verify=True), PARTITIONS)
    coordinator = Coordinator(last_version=result.version, offsets=result.offsets, stream=result.manifest.stream)
    return result.shards, coordinator


# -- the stream in the manifest, the coordinator and its routes --------------------------


def test_manifests_record_the_stream_and_older_ones_still_read(tmp_path: Path) -> None:
    stream = StreamIdentity("cluster-a", "ctrps", ("clicks",))
    shards = [Shard(ShardSpec(0, 1))]
    from ps_core.store.table_config import TableConfig

    shards[0].declare(TableConfig("m_w", 1, {"name": "ftrl"}))
    snaps = {0: [t.snapshot() for t in shards[0].tables.values()]}
    from ps_core.checkpoint.export_files import write_version

    path = write_version(tmp_path, "m", 1, None, snaps, {"clicks": {0: 5}}, {"name": "m"}, 1, stream=stream)
    manifest = read_manifest(path)
    assert manifest.stream == stream and manifest.offsets == {"clicks": {0: 5}}
    raw = orjson.loads((path / "manifest.json").read_bytes())
    assert raw["stream"] == {"cluster_id": "cluster-a", "group": "ctrps", "topics": ["clicks"]}
    # A manifest written before streams were recorded has no such field
    # (nor a checksum of its own, which came later).
    del raw["stream"], raw["manifest_sha256"]
    assert ExportManifest.from_json(orjson.dumps(raw)).stream is None
    raw["stream"] = None
    assert ExportManifest.from_json(orjson.dumps(raw)).stream is None


async def test_the_coordinator_drops_the_old_streams_offsets_when_workers_report_a_new_one(
    serve_shards: ServeShards, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, urls = await serve_shards(2, exports=tmp_path)
    old, new = StreamIdentity("cluster-a", "g", ("clicks",)), StreamIdentity("cluster-b", "g", ("clicks",))
    async with ControlClient.connect(urls) as control:
        lease = (await control.acquire_lease("w1")).lease_id
        await control.release_lease(lease, {"clicks": {0: 900, 1: 800}}, stream=old)
        # Shards started empty: restored version 0.
        assert await control.coordinator_resume() == ({"clicks": {0: 900, 1: 800}}, old, 0)
        # A release without offsets says nothing of the stream.
        lease = (await control.acquire_lease("w1")).lease_id
        await control.release_lease(lease, {}, stream=new)
        assert (await control.coordinator_resume()).stream == old
        with caplog.at_level(logging.WARNING, logger="ctrps.coordinator"):
            lease = (await control.acquire_lease("w2")).lease_id
            await control.release_lease(lease, {"clicks": {0: 40}}, stream=new)
        point = await control.coordinator_resume()
        assert point == ({"clicks": {0: 40}}, new, 0)  # partition 1's offset was the old stream's
        assert await control.coordinator_offsets() == {"clicks": {0: 40}}
        [line] = [r for r in caplog.records if r.getMessage().startswith("stream changed")]
        fields = line.fields  # type: ignore[attr-defined]
        assert (fields["old_cluster_id"], fields["cluster_id"]) == ("cluster-a", "cluster-b")
        # A later cut records the new stream's offsets only.
        report = await control.export_now()
        assert report.offsets == {"clicks": {"0": 40}}
        assert report.stream == ExportStream("cluster-b", "g", ["clicks"])
    [version] = list_versions(tmp_path / "ctr")
    assert version.manifest.stream == new and version.manifest.offsets == {"clicks": {0: 40}}


async def test_partition_bounds_are_right_where_tansus_end_offsets_are_not(kafka_bootstrap: str) -> None:
    """The end is a fetch's high watermark: Tansu 0.6 answers ListOffsets
    (latest) with the last batch's base offset + 1."""
    topic = f"bounds-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: 3})
    await _produce(kafka_bootstrap, topic, 600, seed=1)  # batched: several records a batch
    tps = [TopicPartition(topic, p) for p in range(3)]
    assert await partition_bounds(kafka_bootstrap, tps) == {tps[0]: (0, 300), tps[1]: (0, 300), tps[2]: (0, 0)}


# -- a model exported from one stream, a worker on another broker --------------------------


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["committed", "earliest", "fail"])
@pytest.mark.process
async def test_a_model_of_another_cluster_is_never_resumed_silently(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture, policy: str
) -> None:
    topic, group = f"clicks-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
    await _produce(kafka_bootstrap, topic, 3000, seed=1)
    model_dir = await _export_from(kafka_bootstrap, topic, group, tmp_path / "exports", 3000)
    a_cluster = await cluster_id(kafka_bootstrap)

    # Another broker, the same topic and group: fewer events, so the cut's
    # offsets (1500 a partition) are beyond its partitions' ends as well.
    async with EmbeddedBroker() as other:
        assert other.cluster_id != a_cluster and await cluster_id(other.bootstrap) == other.cluster_id
        await create_topics(other.bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
        await _produce(other.bootstrap, topic, 1000, seed=2)
        # The group has a commit of its own there on partition 0.
        consumer = AIOKafkaConsumer(bootstrap_servers=other.bootstrap, group_id=group, enable_auto_commit=False)
        await consumer.start()
        consumer.assign([TopicPartition(topic, 0)])
        await consumer.commit({TopicPartition(topic, 0): 200})
        await consumer.stop()

        shards, coordinator = _restore(model_dir)
        assert bias_shows(shards) == 3000
        client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
        worker = Worker(_config(other.bootstrap, topic, group, policy), client, control, LogisticRegression("m"))
        worker.on_window = make_status_hook(control, "w-stale", worker.stats)
        caplog.set_level(logging.WARNING, logger="ctrps.worker")
        if policy == "fail":
            with pytest.raises(StaleOffsetsError) as failed:
                await _train(worker, lambda: False, timeout_s=30)
            assert failed.value.exit_code == 4
            line = str(failed.value)
            assert "\n" not in line and a_cluster in line and other.cluster_id in line, line
            assert "0:1500[0,500)" in line and "1:1500[0,500)" in line, line
            assert worker.stats.stale_offsets == {("cluster", "fail"): 2}
            assert worker.stats.events_trained == 0 and bias_shows(shards) == 3000
            assert _stale_lines(caplog) == []  # the error is the one line (the CLI prints it)
            return
        # earliest: every event of the new stream; committed: partition 0
        # from the group's commit there, partition 1 (no commit) from its start.
        expected = 1000 if policy == "earliest" else 1000 - 200
        await _train(worker, lambda: bias_shows(shards) >= 3000 + expected)
        assert worker.stats.events_trained == expected
        assert bias_shows(shards) == 3000 + expected  # the weights were kept: trained on top
        assert worker.stats.stale_offsets == {("cluster", policy): 2}
        [line] = _stale_lines(caplog)
        fields = line.fields  # type: ignore[attr-defined]
        assert (fields["reason"], fields["action"]) == ("cluster", policy)
        assert (fields["expected_cluster_id"], fields["cluster_id"]) == (a_cluster, other.cluster_id)
        resumed_p0 = 0 if policy == "earliest" else 200
        assert fields["partitions"] == f"0:1500[0,500)->{resumed_p0} 1:1500[0,500)->0"
        assert "weights are kept" in line.getMessage()
        # Counted in /metrics, through the status board.
        metrics = ApiMetrics("ctr")
        exposition = (await metrics.scrape(ControlView(control, metrics))).decode()
        assert (
            f'ctrps_worker_stale_offsets_total{{action="{policy}",model="ctr",reason="cluster",worker="w-stale"}} 2.0'
            in exposition
        ), [l for l in exposition.splitlines() if "stale" in l]
        # The next cut is the new stream's alone.
        report = await Exporter(coordinator, control, tmp_path / "exports", "m").cut()
        assert report.offsets == {topic: {0: 500, 1: 500}}
        assert report.stream == StreamIdentity(other.cluster_id, group, (topic,))


@pytest.mark.slow
async def test_offsets_beyond_the_end_of_a_recreated_topic_are_detected(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topic, group = f"clicks-{uuid.uuid4().hex[:8]}", f"g-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
    await _produce(kafka_bootstrap, topic, 2000, seed=3)
    model_dir = await _export_from(kafka_bootstrap, topic, group, tmp_path / "exports", 2000)
    # The topic is deleted and created again (same cluster, same group): 1000
    # offsets a partition in the cut, 100 in the topic.
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([topic])
    finally:
        await admin.close()

    async def gone() -> bool:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            return topic not in await admin.list_topics()
        finally:
            await admin.close()

    await until(gone, 20, what="the topic to be deleted")
    await create_topics(kafka_bootstrap, {topic: PARTITIONS})
    await _produce(kafka_bootstrap, topic, 200, seed=4)

    shards, coordinator = _restore(model_dir)
    client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
    worker = Worker(_config(kafka_bootstrap, topic, group), client, control, LogisticRegression("m"))
    caplog.set_level(logging.WARNING, logger="ctrps.worker")
    await _train(worker, lambda: bias_shows(shards) >= 2200)
    assert worker.stats.events_trained == 200 and bias_shows(shards) == 2200
    assert worker.stats.stale_offsets == {("beyond_end", "committed"): 2}
    [line] = _stale_lines(caplog)
    assert line.fields["reason"] == "beyond_end"  # type: ignore[attr-defined]
    assert line.fields["partitions"] == "0:1000[0,100)->0 1:1000[0,100)->0"  # type: ignore[attr-defined]


# -- the embedded broker restarted under running shards and a worker ---------------------


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.kafka
async def test_events_after_a_broker_restart_are_all_trained(
    serve_shards: ServeShards, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    topic, group = "clicks", f"g-{uuid.uuid4().hex[:8]}"
    shards, urls = await serve_shards(2, exports=tmp_path / "exports")
    broker = EmbeddedBroker(port=port)
    await broker.start()
    stop = asyncio.Event()
    task: asyncio.Task[None] | None = None
    try:
        await broker.create_topics({topic: PARTITIONS, topic + ".dlq": 1})
        first_cluster = broker.cluster_id
        async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
            worker = Worker(_config(broker.bootstrap, topic, group), client, control, LogisticRegression("m"))
            task = asyncio.create_task(worker.run(stop), name="worker")
            await _produce(broker.bootstrap, topic, 2000, seed=5)
            await until(lambda: bias_shows(shards) >= 2000, 60, what="the first events", task=task)
            await until(lambda: worker.stats.commits > 0 and not worker._builder, 30, what="the commits", task=task)
            assert (await control.coordinator_resume("m")).stream == StreamIdentity(first_cluster, group, (topic,))

            # The broker dies and comes back on the same port: memory only,
            # so it is empty, a new cluster, its offsets start at 0 again.
            broker._proc.popen.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            broker._proc.popen.wait(10)  # type: ignore[union-attr]
            broker.stop()
            broker = EmbeddedBroker(port=port)
            await broker.start()
            assert broker.cluster_id != first_cluster
            await broker.create_topics({topic: PARTITIONS, topic + ".dlq": 1})
            caplog.set_level(logging.WARNING, logger="ctrps.worker")
            await _produce(broker.bootstrap, topic, 3000, seed=6)
            # All of them, though the cut-off offsets (1000 a partition) are
            # inside the new partitions (1500 each).
            await until(lambda: bias_shows(shards) >= 5000, 90, what="the events after the restart", task=task)

            async def released() -> bool:  # the last window's pushes land before its commit
                return (await control.coordinator_offsets("m")) == {topic: {0: 1500, 1: 1500}}

            await until(released, 30, what="the last commits", task=task)
            point = await control.coordinator_resume("m")
            assert point.stream == StreamIdentity(broker.cluster_id, group, (topic,))
        # One line per assignment that met the old cluster's offsets, counting
        # both partitions: while the group rejoins the new broker it may be
        # assigned twice before its first commit there (the exact count of
        # events trained, checked below, shows nothing was trained twice).
        lines = _stale_lines(caplog)
        assert lines and worker.stats.stale_offsets == {("cluster", "committed"): PARTITIONS * len(lines)}
        for line in lines:
            assert line.fields["expected_cluster_id"] == first_cluster  # type: ignore[attr-defined]
            assert line.fields["cluster_id"] == broker.cluster_id  # type: ignore[attr-defined]
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 30)
        broker.stop()
    assert bias_shows(shards) == 5000


# -- `ctrps worker --on-stale-offsets fail`, as a process ---------------------------------


@pytest.mark.process
async def test_the_worker_process_refuses_stale_offsets_with_exit_code_4(
    kafka_bootstrap: str, serve_shards: ServeShards, tmp_path: Path
) -> None:
    topic = f"clicks-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
    await _produce(kafka_bootstrap, topic, 100, seed=7)
    _, urls = await serve_shards(2, exports=tmp_path / "exports")
    async with ControlClient.connect(urls) as control:
        # What a worker of another cluster left with the coordinator.
        lease = (await control.acquire_lease("elsewhere")).lease_id
        await control.release_lease(
            lease, {topic: {0: 40, 1: 40}}, stream=StreamIdentity("other-cluster", "ctrps", (topic,))
        )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "worker", "--bootstrap", kafka_bootstrap, "--shards", ",".join(urls),
        "--topic", topic, "--on-stale-offsets", "fail", "--decode-processes", "0",
        cwd=PROJECT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 4, text
    assert "Traceback" not in text, text
    lines = [l for l in text.splitlines() if "stale offsets" in l]
    assert len(lines) == 1, text
    mine = await cluster_id(kafka_bootstrap)
    assert "other-cluster" in lines[0] and mine in lines[0] and "0:40[0,50)" in lines[0], lines[0]


def test_on_stale_offsets_setting_flag_over_environment_over_default() -> None:
    from app.cli import build_parser
    from app.config.declared import SettingsError
    from app.config.worker import WorkerSettings

    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:7100"]
    parse = build_parser().parse_args
    assert WorkerSettings.from_args(parse(base), env={}).on_stale_offsets == "committed"
    env = {"CTRPS_ON_STALE_OFFSETS": "earliest"}
    assert WorkerSettings.from_args(parse(base), env=env).on_stale_offsets == "earliest"
    assert WorkerSettings.from_args(parse([*base, "--on-stale-offsets", "fail"]), env=env).on_stale_offsets == "fail"
    with pytest.raises(SettingsError, match="on-stale-offsets 'latest'"):
        WorkerSettings.from_args(parse(base), env={"CTRPS_ON_STALE_OFFSETS": "latest"})
    with pytest.raises(ValueError, match="on_stale_offsets"):
        WorkerConfig("k:9092", on_stale_offsets="latest")


# -- the README's pipeline, every role a process, across a broker restart ---------------


class _Procs:
    """Role processes of one test, logging JSON to files; stopped by SIGTERM."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        path = self.log_dir / f"{name}.log"
        with path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app.cli", *args, "--log-format", "json"],
                cwd=PROJECT, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        self.procs.append((proc, path))
        return proc, path

    async def line(self, proc: subprocess.Popen[bytes], path: Path, msg: str, timeout_s: float = 60) -> dict[str, Any]:
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{path.name} exited {proc.returncode}: {path.read_text()[-2000:]}")
            found[:] = [o for o in read_json_lines(path) if o.get("msg") == msg]
            return bool(found)

        await until(seen, timeout_s, what=f"{msg!r} in {path.name}", poll_s=0.1)
        return found[0]

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in reversed(self.procs):
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs = []


async def _worker_totals(control: ControlClient) -> tuple[int, dict[str, Any]]:
    """Events trained over the board's workers, and the stale-offset counts."""
    trained, stale = 0, {}
    for entry in await control.statuses():
        status = entry.status
        if status.get("kind") == "worker":
            trained += int(status.get("events_trained", 0))
            for reason, actions in status.get("stale_offsets", {}).items():
                stale.setdefault(reason, {}).update(actions)
    return trained, stale


@pytest.mark.slow
@pytest.mark.process
async def test_the_pipeline_restored_after_a_broker_restart_trains_every_new_event(tmp_path: Path) -> None:
    """`ctrps broker`, two `ctrps shard` and a `ctrps worker` as in the README;
    an export; everything stopped; a new broker (memory: empty, a new cluster)
    and the shards restoring the export: the worker trains every new event,
    says so in one line, and the next export is the new stream's."""
    procs = _Procs(tmp_path)
    ports = [free_port(), free_port()]
    urls = ",".join(f"http://127.0.0.1:{p}" for p in ports)
    exports = tmp_path / "exports"

    def start_shards(tag: str) -> list[tuple[subprocess.Popen[bytes], Path]]:
        return [procs.start(f"shard{i}-{tag}", *shard_args(i, ports, exports)) for i in range(len(ports))]

    def start_worker(tag: str, bootstrap: str) -> tuple[subprocess.Popen[bytes], Path]:
        return procs.start(f"worker-{tag}", "worker", "--bootstrap", bootstrap, "--shards", urls,
                           "--model-name", "m", "--window-seconds", "1", "--window-events", "100",
                           "--decode-processes", "0", "--session-timeout-ms", "3000")  # fmt: skip

    async def trained_reaches(control: ControlClient, n: int) -> None:
        async def done() -> bool:
            return (await _worker_totals(control))[0] >= n

        await until(done, 90, what=f"{n} events trained", poll_s=0.2)

    try:
        broker, broker_log = procs.start("broker-1", "broker", "--port", str(free_port()))
        first = await procs.line(broker, broker_log, "ready")
        shards = start_shards("1")
        for proc, path in shards:
            await procs.line(proc, path, "listening")
        start_worker("1", first["bootstrap"])
        await _produce(first["bootstrap"], "clicks", 2000, seed=8)
        async with ControlClient.connect(urls.split(",")) as control:
            await trained_reaches(control, 2000)

            async def all_released() -> bool:
                return (await control.coordinator_offsets()).get("clicks") == {0: 1000, 1: 1000}

            await until(all_released, 30, what="the commits")
            cut = await control.export_now()
            assert cut.stream == ExportStream(first["cluster_id"], "ctrps", ["clicks"])
        procs.stop_all()

        broker, broker_log = procs.start("broker-2", "broker", "--port", str(free_port()))
        second = await procs.line(broker, broker_log, "ready")
        assert second["cluster_id"] != first["cluster_id"]
        shards = start_shards("2")
        for proc, path in shards:
            restored = await procs.line(proc, path, "restore")
            assert restored["version"] == cut.version and restored["cluster_id"] == first["cluster_id"]
        # Fewer events than the cut's offsets, and partitions 2 and 3 too.
        await _produce(second["bootstrap"], "clicks", 1000, seed=9)
        worker, worker_log = start_worker("2", second["bootstrap"])
        async with ControlClient.connect(urls.split(",")) as control:
            await trained_reaches(control, 1000)
            trained, stale = await _worker_totals(control)
            assert trained == 1000 and stale == {"cluster": {"committed": 2}}, (trained, stale)

            async def new_stream_released() -> bool:
                return (await control.coordinator_offsets()).get("clicks") == {0: 500, 1: 500}

            await until(new_stream_released, 30, what="the new stream's commits")
            after = await control.export_now()
            assert after.offsets == {"clicks": {"0": 500, "1": 500}}
            assert after.stream is not None and after.stream.cluster_id == second["cluster_id"]
        lines = [o for o in read_json_lines(worker_log) if str(o.get("msg", "")).startswith("stale offsets")]
        assert len(lines) == 1, worker_log.read_text()[-3000:]
        assert (lines[0]["expected_cluster_id"], lines[0]["cluster_id"]) == (first["cluster_id"], second["cluster_id"])
        assert lines[0]["partitions"] == "0:1000[0,500)->0 1:1000[0,500)->0"
        assert "Traceback" not in worker_log.read_text()
    finally:
        procs.stop_all()


@pytest.mark.slow
async def test_offsets_of_another_group_are_not_applied_silently(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    topic = f"clicks-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
    await _produce(kafka_bootstrap, topic, 1000, seed=10)
    model_dir = await _export_from(kafka_bootstrap, topic, "group-a", tmp_path / "exports", 1000)
    shards, coordinator = _restore(model_dir)
    worker = Worker(_config(kafka_bootstrap, topic, "group-b", "earliest"), PSClient.local(shards),
                    ControlClient.local(shards, coordinator), LogisticRegression("m"))  # fmt: skip
    caplog.set_level(logging.WARNING, logger="ctrps.worker")
    await _train(worker, lambda: bias_shows(shards) >= 2000)
    assert worker.stats.events_trained == 1000 and worker.stats.stale_offsets == {("group", "earliest"): 2}
    [line] = _stale_lines(caplog)
    fields = line.fields  # type: ignore[attr-defined]
    assert (fields["expected_group"], fields["group"], fields["reason"]) == ("group-a", "group-b", "group")


async def test_a_coordinator_restored_from_an_older_export_adopts_the_first_reported_stream() -> None:
    """An export written before streams were recorded: its offsets are kept
    (checked against partition bounds only) and the first stream reported
    becomes theirs."""
    coordinator = Coordinator(offsets={"clicks": {0: 10, 1: 20}})
    assert coordinator.stream is None
    lease = await coordinator.acquire("w")
    stream = StreamIdentity("c", "g", ("clicks",))
    await coordinator.release(lease.lease_id, {"clicks": {0: 15}}, stream)
    assert coordinator.offsets() == {"clicks": {0: 15, 1: 20}} and coordinator.stream == stream
    assert coordinator.stream_changes == 0
