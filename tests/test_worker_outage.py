"""Workers outliving outages, with real processes and servers: a shard server
stopped and started again on its port, the broker killed and started again,
a worker that gives up after its deadline, decode processes that die with a
SIGKILLed worker, and a record batch the consumer cannot decode."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from aiokafka import AIOKafkaProducer
from aiokafka.record.default_records import DefaultRecordBase
from aiokafka.record.util import calc_crc32c
from prometheus_client.parser import text_string_to_metric_families
from streams import applications, bias_shows, brisk_worker_config, committed, keyed_event, new_topic, produce, running
from waiting import until

from app.api import create_app
from app.config.serve import ApiSettings
from app.status import make_status_hook
from consumers import worker as worker_module
from consumers.broker import EmbeddedBroker, free_port
from consumers.outage import UndecodableBatchError
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.routes import add_coordinator_routes
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import ShardSite, create_shard_app, start_shard_site
from ps_core.shard import Shard, ShardSpec

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

PARTITIONS = 4
ROOT = Path(__file__).resolve().parent.parent


async def _produce(bootstrap: str, topic: str, lo: int, hi: int) -> None:
    await produce(bootstrap, topic, (keyed_event(i) for i in range(lo, hi)), PARTITIONS, first=lo)


def _every_applied(shards: list[Shard], lo: int, hi: int) -> bool:
    return bool((applications(shards, lo, hi) >= 1).all())


class _ShardServers:
    """Shard servers on fixed loopback ports that a test can stop and start
    again on the same port, keeping each shard's state (the process of a
    shard server that lost its network, not one that restarted empty)."""

    def __init__(self, n: int, coordinator: Coordinator | None = None) -> None:
        self.coordinator = coordinator
        """Hosted by shard 0 (kept across its restarts: same epoch), if given."""
        self.shards = [Shard(ShardSpec(i, n)) for i in range(n)]
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.servers: list[ShardSite | None] = [None] * n

    async def start(self, i: int) -> None:
        app = create_shard_app(self.shards[i])
        if i == 0 and self.coordinator is not None:
            add_coordinator_routes(app, self.coordinator)
        self.servers[i] = await start_shard_site(app, "127.0.0.1", self.ports[i])

    async def stop(self, i: int) -> None:
        server, self.servers[i] = self.servers[i], None
        if server is not None:
            await server.cleanup()

    @asynccontextmanager
    async def clients(self, deadline_s: float) -> AsyncIterator[tuple[PSClient, ControlClient]]:
        """Both planes' clients of the servers (HTTP only), retrying for `deadline_s`."""
        retry = RetryPolicy(deadline_s=deadline_s)
        async with (
            PSClient.connect(self.urls, retry=retry, rpc=False) as client,
            ControlClient.connect(self.urls, retry=retry) as control,
        ):
            yield client, control

    async def __aenter__(self) -> _ShardServers:
        for i in range(len(self.shards)):
            await self.start(i)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for i in range(len(self.shards)):
            await self.stop(i)


def _lines(caplog: pytest.LogCaptureFixture, start: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


@pytest.mark.timeout(300)
async def test_worker_rides_out_a_30s_shard_outage(kafka_bootstrap: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    window, outage_s = 300, 30.0
    async with _ShardServers(2) as servers:
        config = brisk_worker_config(
            kafka_bootstrap, topic, group, window, 100, outage_deadline_s=300, outage_log_every_s=2.0
        )
        async with servers.clients(deadline_s=2.0) as (client, control):
            model = LogisticRegression("m")
            worker = Worker(config, client, control, model)
            worker.on_window = make_status_hook(control, "w-out", worker.stats)
            async with running(worker) as task:
                await _produce(kafka_bootstrap, topic, 0, 2000)
                await until(lambda: worker.stats.events_trained >= 2000, 60, what="the first events", task=task)
                await servers.stop(1)
                # Events keep arriving while the shard is away.
                await _produce(kafka_bootstrap, topic, 2000, 6000)
                stopped_at = time.monotonic()
                await until(
                    lambda: servers.urls[1] in worker.stats.waiting_for,
                    60,
                    what="the worker to wait for shard 1",
                    task=task,
                )
                trained_in_outage = worker.stats.events_trained
                await until(
                    lambda: time.monotonic() - stopped_at >= outage_s,
                    outage_s + 5,
                    what="the outage to last",
                    task=task,
                )
                assert worker.stats.events_trained == trained_in_outage, "trained while a shard was away"
                await servers.start(1)
                await until(lambda: _every_applied(servers.shards, 0, 6000), 90, what="every event applied", task=task)
            # The outage is counted in the worker's status, and /metrics shows it.
            http = TestClient(TestServer(create_app(ApiSettings(), client, model, control=control)))
            await http.start_server()
            try:
                resp = await http.get("/metrics")
                text = await resp.text()
            finally:
                await http.close()
            metrics = {
                (m.name, tuple(sorted(m.labels.items()))): m.value
                for f in text_string_to_metric_families(text)
                for m in f.samples
            }
            w = (("model", "m"), ("worker", "w-out"))
            assert metrics[("ctrps_worker_outages_total", w)] == worker.stats.outages >= 1
            assert metrics[("ctrps_worker_windows_replayed_total", w)] == worker.stats.windows_replayed
            assert metrics[("ctrps_worker_outage_seconds_total", w)] >= outage_s - 10
            for outcome, n in (("committed", worker.stats.commits), ("failed", worker.stats.failed_commits)):
                key = (("model", "m"), ("outcome", outcome), ("worker", "w-out"))
                assert metrics[("ctrps_worker_commits_total", key)] == n
    applied = applications(servers.shards, 0, 6000)
    assert (applied >= 1).all(), f"lost: {np.flatnonzero(applied == 0)[:20]}"
    s = worker.stats
    assert s.outages >= 1 and s.windows_replayed >= 1 and s.outage_seconds >= outage_s - 10, s
    # Only windows that failed part-way are trained again, each at most once.
    assert int((applied - 1).sum()) <= s.windows_replayed * window, (int((applied - 1).sum()), s.windows_replayed)
    assert 6000 <= bias_shows(servers.shards) <= 6000 + s.windows_replayed * window
    waiting = _lines(caplog, f"waiting for shard 1 at {servers.urls[1]}")
    assert len(waiting) >= 5, waiting  # one every 2 s over ~30 s, not one per attempt
    assert len(waiting) <= 2 * (outage_s / 2.0) + 10, len(waiting)
    assert _lines(caplog, f"shard 1 at {servers.urls[1]} is back"), "no line when the shard came back"


async def test_leased_worker_rides_out_an_outage_of_shard_0_and_its_coordinator(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    window = 300
    coordinator = Coordinator()
    async with _ShardServers(2, coordinator) as servers:
        config = brisk_worker_config(
            kafka_bootstrap, topic, group, window, 100, outage_deadline_s=120, outage_log_every_s=1.0
        )
        async with servers.clients(deadline_s=1.0) as (client, control):
            worker = Worker(config, client, control, LogisticRegression("m"))
            async with running(worker) as task:
                await _produce(kafka_bootstrap, topic, 0, 1000)
                await until(
                    lambda: worker.leased and worker.stats.events_trained >= 1000,
                    60,
                    what="the first events",
                    task=task,
                )
                await servers.stop(0)
                await _produce(kafka_bootstrap, topic, 1000, 3000)
                await until(
                    lambda: servers.urls[0] in worker.stats.waiting_for,
                    60,
                    what="the worker to wait for shard 0",
                    task=task,
                )
                await until(
                    lambda: len(_lines(caplog, f"waiting for shard 0 at {servers.urls[0]}")) >= 3,
                    30,
                    what="a few waiting lines",
                    task=task,
                )
                await servers.start(0)
                await until(lambda: _every_applied(servers.shards, 0, 3000), 90, what="every event applied", task=task)
    applied = applications(servers.shards, 0, 3000)
    assert (applied >= 1).all(), f"lost: {np.flatnonzero(applied == 0)[:20]}"
    s = worker.stats
    assert s.outages >= 1 and s.rewinds == 0, s  # the same coordinator: nothing to rewind
    assert int((applied - 1).sum()) <= s.windows_replayed * window
    # The coordinator holds the committed offsets: every event's partition end.
    assert sum(coordinator.offsets().get(topic, {}).values()) == 3000


async def test_a_commit_the_group_coordinator_never_acknowledges_fails_its_window_which_is_trained_again(
    kafka_bootstrap: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A group coordinator that accepts the request and never answers while
    # the broker still takes connections cannot be made with the embedded
    # broker: the consumer's first commit is made to wait forever instead.
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    monkeypatch.setattr(worker_module, "COMMIT_TIMEOUT_S", 0.5)
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    shards = [Shard()]
    config = brisk_worker_config(kafka_bootstrap, topic, group, 300, 100, outage_deadline_s=60)
    worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), LogisticRegression("m"))
    hung: list[dict[Any, int]] = []
    async with running(worker) as task:
        await until(lambda: worker._consumer is not None, 30, what="the consumer", task=task)
        consumer = worker._consumer
        assert consumer is not None
        commit = consumer.commit

        async def first_commit_hangs(offsets: dict[Any, int]) -> None:
            if not hung:
                hung.append(offsets)
                await asyncio.Event().wait()
            await commit(offsets)

        consumer.commit = first_commit_hangs  # type: ignore[method-assign]
        await _produce(kafka_bootstrap, topic, 0, 1200)
        await until(lambda: sum(worker._committed.values()) >= 1200, 60, what="every offset committed", task=task)
    applied = applications(shards, 0, 1200)
    assert (applied >= 1).all(), f"lost: {np.flatnonzero(applied == 0)[:20]}"
    s = worker.stats
    assert hung and s.failed_commits == 1 and s.windows_replayed == 1, s
    assert int((applied - 1).sum()) <= 300  # only the window whose commit hung is trained twice
    assert await committed(kafka_bootstrap, group, topic, PARTITIONS) == {p: 300 for p in range(PARTITIONS)}
    (failed,) = [
        r
        for r in caplog.records
        if r.getMessage() == "window failed in an outage: not committed, its partitions resume from its first offsets"
    ]
    assert "not acknowledged within 0.5 s" in failed.fields["error"], failed.fields  # type: ignore[attr-defined]


@pytest.mark.timeout(300)
@pytest.mark.process
@pytest.mark.kafka
async def test_worker_rides_out_a_broker_restart(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="ctrps.worker")
    topic, group = "clicks", f"g-{uuid.uuid4().hex[:8]}"
    port = free_port()
    broker = EmbeddedBroker(port=port)
    await broker.start()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    try:
        bootstrap = broker.bootstrap
        await broker.create_topics({topic: PARTITIONS, topic + ".dlq": 1})
        config = brisk_worker_config(bootstrap, topic, group, 300, 100, outage_deadline_s=300, outage_log_every_s=2.0)
        worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), LogisticRegression("m"))
        async with running(worker) as task:
            await _produce(bootstrap, topic, 0, 2000)
            await until(lambda: _every_applied(shards, 0, 2000), 60, what="the first events", task=task)
            broker.stop()
            await until(
                lambda: worker.stats.waiting_for.startswith("the Kafka broker"),
                30,
                what="the worker to wait for the broker",
                task=task,
            )
            # The in-memory broker comes back empty on the same port: its
            # topics are created again, and its committed offsets are gone.
            # The same port at once: the broker binds it as a listener does,
            # so the old broker's connections in TIME_WAIT do not hold it.
            broker = EmbeddedBroker(port=port)
            await broker.start()
            await broker.create_topics({topic: PARTITIONS, topic + ".dlq": 1})
            await _produce(bootstrap, topic, 2000, 5000)
            # Events after the restart sit at offsets 0.. of the new topic.
            await until(
                lambda: _every_applied(shards, 2000, 5000),
                120,
                what="every event produced after the restart applied",
                task=task,
            )
    finally:
        broker.stop()
    assert worker.stats.outages >= 1
    assert _lines(caplog, f"waiting for the Kafka broker at {bootstrap}")
    assert _lines(caplog, f"the Kafka broker at {bootstrap} is back")
    # The restarted broker is another cluster: positions kept from the old
    # one would skip the new topic's first records (once the producer has
    # passed them) and commit past them.
    (moved,) = _lines(caplog, "the broker is another Kafka cluster now")
    assert f"now ({broker.cluster_id}, was " in moved, moved
    applied = applications(shards, 0, 5000)
    assert (applied >= 1).all(), f"lost: {np.flatnonzero(applied == 0)[:20]}"
    assert bias_shows(shards) >= 5000


def _spawn_worker(
    bootstrap: str, shards: list[str], *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """``ctrps worker`` as a child process, its stderr piped."""
    cmd = [sys.executable, "-m", "app.cli", "worker", "--bootstrap", bootstrap, "--shards", ",".join(shards),
           "--model-name", "m", "--window-seconds", "0.5", *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill `proc` if it still runs (a test that failed before it exited)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def _stderr(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stderr is not None
    with proc.stderr:
        return proc.stderr.read().decode()


async def _wait_exit(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    await until(lambda: proc.poll() is not None, timeout_s, what=f"{proc.args!r} to exit", poll_s=0.1)
    return int(proc.returncode)


async def _exit_and_stderr(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, str]:
    """`proc`'s exit code once it exits within `timeout_s`, and all it wrote to stderr."""
    try:
        code = await _wait_exit(proc, timeout_s)
    finally:
        _kill(proc)
    return code, _stderr(proc)


@pytest.mark.process
@pytest.mark.kafka
async def test_worker_whose_broker_went_away_gives_up_after_its_deadline_with_exit_3(serve_shards: Any) -> None:
    """The outage deadline is for a broker that answered once (one that never
    did is a wrong address: tests/test_addresses.py)."""
    _, urls = await serve_shards(2)
    broker = EmbeddedBroker()
    await broker.start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "CTRPS_OUTAGE_DEADLINE_S": "4"}
    try:
        await broker.create_topics({"clicks": 1, "clicks.dlq": 1})
        bootstrap = broker.bootstrap
        proc = _spawn_worker(bootstrap, urls, "--decode-processes", "0", env=env)
        try:
            seen = await _stderr_shows(proc, b" assigned", what="the worker's assignment")
            broker.stop()
            code = await _wait_exit(proc, 60)
        finally:
            _kill(proc)
        err = _all_stderr(proc, seen)
    finally:
        broker.stop()
    assert code == 3, err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert any(f"waiting for the Kafka broker at {bootstrap}" in line for line in lines), err
    gave_up = [line for line in lines if "gave up waiting for the Kafka broker" in line]
    assert len(gave_up) == 1 and "error" in gave_up[0], err
    assert lines[-1] == gave_up[0], err


@pytest.mark.process
async def test_worker_with_a_shard_never_there_exits_1_at_its_startup_timeout_not_its_outage_deadline(
    kafka_bootstrap: str,
) -> None:
    away = f"http://127.0.0.1:{free_port()}"
    proc = _spawn_worker(
        kafka_bootstrap, [away], "--outage-deadline", "600", "--startup-timeout", "3",
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    code, err = await _exit_and_stderr(proc, 60)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert f"waiting for shard 0 at {away} to answer" in err, err
    assert err.strip().splitlines()[-1].count(f"shard 0 at {away} never answered") == 1, err


def _children(pid: int) -> set[int]:
    """Live processes whose parent is `pid` (from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.add(int(entry))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _read_some(proc: subprocess.Popen[bytes]) -> list[bytes]:
    """What a child wrote to its (non-blocking) stderr pipe so far."""
    assert proc.stderr is not None
    got = proc.stderr.read()
    return [got] if got else []


async def _stderr_shows(proc: subprocess.Popen[bytes], *wanted: bytes, what: str) -> list[bytes]:
    """What `proc` wrote to its stderr (made non-blocking) until it shows
    every one of `wanted`; fails if it exits first."""
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    seen: list[bytes] = []

    def shown() -> bool:
        seen.extend(_read_some(proc))
        if proc.poll() is not None:
            raise AssertionError(f"the worker exited with {proc.returncode}: {b''.join(seen).decode()}")
        text = b"".join(seen)
        return all(w in text for w in wanted)

    await until(shown, 60, what=what, poll_s=0.1)
    return seen


def _all_stderr(proc: subprocess.Popen[bytes], seen: list[bytes]) -> str:
    """`seen` (from `_stderr_shows`) and the rest of `proc`'s stderr, to its end."""
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), True)
    return b"".join(seen).decode() + _stderr(proc)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.process
async def test_decode_processes_end_with_a_sigkilled_worker(kafka_bootstrap: str, serve_shards: Any) -> None:
    topic, _ = await new_topic(kafka_bootstrap, PARTITIONS)
    _, urls = await serve_shards(1)
    proc = _spawn_worker(kafka_bootstrap, urls, "--topic", topic, "--decode-processes", "1")
    assert proc.stderr is not None
    os.set_blocking(proc.stderr.fileno(), False)
    decoders: set[int] = set()
    logged: list[bytes] = []
    try:

        def decoding() -> bool:
            # Its children: multiprocessing's resource tracker, then the decode
            # process; a window trained, so the decode process is past its
            # start (one still starting ends anyway, at its pipe's end of file).
            decoders.update(_children(proc.pid))
            if proc.poll() is not None:
                raise AssertionError(f"the worker exited with {proc.returncode}")
            logged.extend(_read_some(proc))
            return any(b"spawn_main" in _cmdline(p) for p in decoders) and b"ctrps.worker: window" in b"".join(logged)

        await _produce(kafka_bootstrap, topic, 0, 100)
        await until(decoding, 60, what="a window decoded by the worker's decode process", poll_s=0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        await until(
            lambda: not any(_alive(p) for p in decoders),
            15,
            what=f"decode processes {sorted(decoders)} to end",
            poll_s=0.1,
        )
    finally:
        _kill(proc)
        for p in decoders:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        proc.stderr.close()


async def _send_corrupt_batch(bootstrap: str, topic: str, partition: int, n: int, codec: int | None = None) -> int:
    """A record batch of `n` events whose CRC does not match its bytes (one
    byte of a record flipped after the batch was built), or with `codec`, a
    valid CRC over attributes naming that compression codec: returns its offset."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        batch = producer.create_batch()
        for i in range(n):
            batch.append(key=None, value=keyed_event(90_000 + i), timestamp=None)
        buf = bytearray(batch._build())
        if codec is None:
            buf[-3] ^= 0xFF  # inside the last record's value
        else:
            at, crc_at = DefaultRecordBase.ATTRIBUTES_OFFSET, DefaultRecordBase.CRC_OFFSET
            (attributes,) = struct.unpack_from(">h", buf, at)
            struct.pack_into(">h", buf, at, (attributes & ~0x07) | codec)
            struct.pack_into(">I", buf, crc_at, calc_crc32c(bytes(buf[at:])))
        batch._buffer = buf
        meta = await (await producer.send_batch(batch, topic, partition=partition))
        return int(meta.offset)
    finally:
        await producer.stop()


async def test_an_undecodable_batch_stops_the_worker_naming_it_and_nothing_is_committed_past_it(
    kafka_bootstrap: str,
) -> None:
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    shards = [Shard(ShardSpec(0, 1))]
    config = brisk_worker_config(kafka_bootstrap, topic, group, 150, 50)
    worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), LogisticRegression("m"))
    task = asyncio.create_task(worker.run(asyncio.Event()), name="worker")
    try:
        await _produce(kafka_bootstrap, topic, 0, 400)  # offsets 0..99 of each partition
        await until(lambda: worker._committed.get((topic, 2)) == 100, 60, what="the first events committed", task=task)
        bad_offset = await _send_corrupt_batch(kafka_bootstrap, topic, 2, 5)
        assert bad_offset == 100
        await _produce(kafka_bootstrap, topic, 400, 800)  # behind the bad batch on partition 2 too
        with pytest.raises(UndecodableBatchError) as raised:
            await asyncio.wait_for(asyncio.shield(task), 90)
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    err = raised.value
    assert (err.topic, err.partition, err.offset, err.exact) == (topic, 2, bad_offset, True), str(err)
    assert f"{topic}/2 at offset {bad_offset}" in str(err) and err.exit_code == 1
    offsets = await committed(kafka_bootstrap, group, topic, PARTITIONS)
    assert offsets[2] == bad_offset, offsets  # everything before it, nothing past it
    assert all(off >= 100 for off in offsets.values()), offsets
    # Whatever was committed was applied. Event i sits in partition i % 4 at
    # offset i // 4 (the first 400) or 100 + (i - 400) // 4 (partition 2's
    # sit 5 further, behind the bad batch, and none of them is committed).
    applied = applications(shards, 0, 800)
    for p, off in offsets.items():
        ids = [i for i in range(800) if i % PARTITIONS == p and (i // 4 if i < 400 else 100 + (i - 400) // 4) < off]
        assert (applied[ids] >= 1).all(), (p, off)


@pytest.mark.process
async def test_an_undecodable_batch_is_one_line_and_exit_1_from_ctrps_worker(
    kafka_bootstrap: str, serve_shards: Any
) -> None:
    topic, _ = await new_topic(kafka_bootstrap, 1)
    await _send_corrupt_batch(kafka_bootstrap, topic, 0, 3)
    _, urls = await serve_shards(1)
    proc = _spawn_worker(kafka_bootstrap, urls, "--topic", topic, "--decode-processes", "0")
    code, err = await _exit_and_stderr(proc, 90)
    assert code == 1, err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1].count(f"record batch of {topic}/0 at offset 0 cannot be decoded") == 1, err


@pytest.mark.process
async def test_sigterm_while_waiting_for_the_broker_stops_the_worker_at_once(serve_shards: Any) -> None:
    _, urls = await serve_shards(1)
    nothing = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = _spawn_worker(nothing, urls, "--decode-processes", "0", "--startup-timeout", "600", env=env)
    try:
        seen = await _stderr_shows(
            proc, b"waiting for the Kafka broker", b"giving up after 600s (--startup-timeout)", what="the waiting line"
        )
        proc.send_signal(signal.SIGTERM)
        code = await _wait_exit(proc, 20)
    finally:
        _kill(proc)
    err = _all_stderr(proc, seen)
    assert code == 0, err
    assert "Traceback" not in err, err


async def test_a_batch_the_codec_cannot_read_is_named_by_partition_and_offset(kafka_bootstrap: str) -> None:
    """A batch marked zstd that is not compressed. The codec's error names no
    partition (a CRC error does): the fetch that raised is found instead."""
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    await _produce(kafka_bootstrap, topic, 0, 40)  # offsets 0..9 of each partition
    bad_offset = await _send_corrupt_batch(kafka_bootstrap, topic, 1, 3, codec=4)  # zstd, not compressed
    config = brisk_worker_config(kafka_bootstrap, topic, group, 150, 50)
    worker = Worker(
        config, PSClient.local(one := [Shard(ShardSpec(0, 1))]), ControlClient.local(one), LogisticRegression("m")
    )
    with pytest.raises(UndecodableBatchError) as raised:
        await asyncio.wait_for(worker.run(asyncio.Event()), 90)
    err = raised.value
    assert (err.topic, err.partition, err.offset, err.exact) == (topic, 1, bad_offset, True), str(err)
    # Without a zstd library aiokafka's UnsupportedCodecError, with one the library's own error.
    assert err.reason, err
    assert (await committed(kafka_bootstrap, group, topic, PARTITIONS))[1] <= bad_offset
