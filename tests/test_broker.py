"""The embedded broker: starts on a free port, answers Kafka clients, refuses a
taken port loudly, stops by PID, and takes producers back after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import uuid
from typing import Any

import aiohttp
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from commands import PROJECT, clean_env, ctrps, ctrps_process
from prometheus_client.parser import text_string_to_metric_families
from streams import bias_shows, consume_all, keyed_event
from waiting import until

from consumers.broker import PORT_BAND_VAR, BrokerError, EmbeddedBroker, PortBandError, create_topics, free_port
from consumers.broker_memory import BrokerMemory
from consumers.dlq import DeadLetter, DeadLetterQueue, read_headers
from consumers.producer import produce


async def test_produce_and_consume_through_the_session_broker(kafka_bootstrap: str) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: 3})
    await create_topics(kafka_bootstrap, {topic: 3})  # idempotent
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        for i in range(30):
            await producer.send(topic, b"m%d" % i, partition=i % 3)
        await producer.flush()
    finally:
        await producer.stop()
    records = await consume_all(kafka_bootstrap, topic, 30, timeout_s=20)
    assert sorted(r.value for r in records) == sorted(b"m%d" % i for i in range(30))
    assert {r.partition for r in records} == {0, 1, 2}


@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.process
@pytest.mark.kafka
async def test_taken_port_is_refused_and_stop_ends_the_process() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(BrokerError, match="is in use"):
            await EmbeddedBroker(port=taken).start()
    broker = EmbeddedBroker()
    async with broker:
        pid = broker.pid
        assert broker.bootstrap.startswith("127.0.0.1:")
        os.kill(pid, 0)  # running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    broker.stop()  # idempotent


async def _resend_before_the_topic_exists(bootstrap: str, topic: str, partitions: int) -> None:
    """What a producer that was sending when the broker died does as it comes
    back: its in-flight batches, resent at once to the same address (the
    client keeps the old metadata), reach the empty broker before any topic
    is created. A raw produce request, as the client's resend is one."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        (node,) = client.cluster.brokers()
        batches = []
        for p in range(partitions):
            builder = DefaultRecordBatchBuilder(2, 0, False, -1, -1, -1, 1 << 20)
            builder.append(0, timestamp=None, key=None, value=keyed_event(10_000 + p), headers=[])
            batches.append((p, bytes(builder.build())))
        await client.send(node.nodeId, ProduceRequest(None, 1, 5000, [(topic, batches)]))
    finally:
        await client.close()


def test_a_free_port_is_one_no_outgoing_connection_can_take() -> None:
    """Ports handed to servers come from below the kernel's ephemeral range
    (where connections get their source ports), are never handed out twice,
    and are bindable."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports), sorted(p for p in ports if not 1024 <= p < low)
    for port in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_free_port_comes_from_the_band_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PORT_BAND_VAR, "23000-23099")
    assert all(23000 <= free_port() <= 23099 for _ in range(50))
    for bad in ("23000", "x-y", "900-2000", "23099-23000", "23000-70000"):
        monkeypatch.setenv(PORT_BAND_VAR, bad)
        with pytest.raises(PortBandError, match=PORT_BAND_VAR) as refused:
            free_port()
        assert refused.value.exit_code == 2  # a settings error: one line, exit 2


@pytest.mark.process
def test_a_malformed_port_band_is_one_line_and_exit_2_from_ctrps() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "broker"],
        cwd=PROJECT,
        env=clean_env(**{PORT_BAND_VAR: "abc"}),
        capture_output=True,
        text=True,
        timeout=30,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and PORT_BAND_VAR in lines[0], done.stderr


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.timeout(180)
@pytest.mark.process
@pytest.mark.kafka
async def test_producers_are_taken_back_after_a_broker_restart_with_a_worker_running(serve_shards: Any) -> None:
    shards, urls = await serve_shards(2)
    port = free_port()
    broker = EmbeddedBroker(port=port)
    await broker.start()
    topics = {"clicks": 4, "clicks.dlq": 1}
    try:
        await broker.create_topics(topics)
        bootstrap = broker.bootstrap
        async with ctrps_process(
            "worker", "--bootstrap", bootstrap, "--shards", ",".join(urls), "--model-name", "m",
            "--window-seconds", "0.5", "--decode-processes", "0",
        ) as worker:  # fmt: skip
            before = await asyncio.to_thread(
                ctrps, "produce", "synthetic", "--bootstrap", bootstrap, "--events", "2000"
            )
            assert before.returncode == 0, before.stderr
            await until(lambda: bias_shows(shards) >= 2000, 60, what="the worker to train the first events")
            # The worker is frozen while the broker dies and comes back, so
            # that its own metadata requests, which create missing topics,
            # do not come first: then the resent batches meet no topic.
            os.kill(worker.pid, signal.SIGSTOP)
            try:
                os.kill(broker.pid, signal.SIGKILL)
                broker.stop()
                broker = EmbeddedBroker(port=port)
                await broker.start()
                await _resend_before_the_topic_exists(bootstrap, "clicks", 4)
                await broker.create_topics(topics)  # as `ctrps broker` does as it starts
                after = await asyncio.to_thread(
                    ctrps, "produce", "synthetic", "--bootstrap", bootstrap, "--events", "3000"
                )
            finally:
                # A worker frozen across a restart of a memory broker sees no
                # outage and keeps the old cluster's positions until its group
                # rejoins (architecture: "a broker back as another cluster"):
                # a new worker trains what the new broker holds.
                os.kill(worker.pid, signal.SIGKILL)
            assert after.returncode == 0, after.stderr
            assert "sent=3000 " in after.stderr, after.stderr
            # The broker refused the first write to each partition once.
            assert "the broker refused a send with error -1: resending it" in after.stderr, after.stderr
        async with ctrps_process(
            "worker", "--bootstrap", bootstrap, "--shards", ",".join(urls), "--model-name", "m",
            "--window-seconds", "0.5", "--decode-processes", "0",
        ) as worker:  # fmt: skip
            # The resent events and every later one are trained.
            await until(lambda: bias_shows(shards) >= 2000 + 4 + 3000, 90, what="the worker to train every event")
            assert worker.returncode is None
    finally:
        broker.stop()


@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.process
@pytest.mark.kafka
async def test_dead_letters_are_taken_back_after_a_broker_restart() -> None:
    """A worker's dead letters meet the same once-per-partition refusal as a
    producer's sends: they are resent, not the window's failure."""
    broker = EmbeddedBroker(port=free_port())
    await broker.start()
    try:
        await _resend_before_the_topic_exists(broker.bootstrap, "clicks.dlq", 1)
        await broker.create_topics({"clicks.dlq": 1})
        producer = AIOKafkaProducer(bootstrap_servers=broker.bootstrap)
        await producer.start()
        try:
            letters = [DeadLetter(b"{", "invalid_json", "unexpected end", "clicks", 0, i) for i in range(3)]
            await DeadLetterQueue(producer, "clicks.dlq").send_all(letters)
        finally:
            await producer.stop()
        records = await consume_all(broker.bootstrap, "clicks.dlq", 1 + 3)
        offsets = sorted(int(read_headers(r.headers)["ctrps-source-offset"]) for r in records[1:])
        assert offsets[:3] == [0, 1, 2], offsets
    finally:
        broker.stop()


async def _gauges(url: str) -> dict[str, float]:
    """The ``ctrps_broker_*`` gauges at `url` (a /metrics page)."""
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("ctrps_broker_")
    }


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.timeout(120)
@pytest.mark.process
@pytest.mark.kafka
async def test_the_broker_role_says_it_keeps_every_record_and_serves_its_memory_against_a_limit() -> None:
    port, metrics_port = free_port(), free_port()
    args = ["--port", str(port), "--metrics-port", str(metrics_port), "--max-rss-mb", "1", "--log-format", "json"]
    async with ctrps_process("broker", *args) as proc:
        assert proc.stderr is not None
        lines: list[dict[str, Any]] = []
        while not lines or lines[-1]["msg"] != "ready":
            lines.append(orjson.loads(await asyncio.wait_for(proc.stderr.readline(), timeout=30)))
        ready = lines[-1]
        (memory_only,) = [ln for ln in lines if "keeps every record in memory" in ln["msg"]]
        assert memory_only["level"] == "warning" and "bytes per event" in memory_only["msg"], memory_only
        assert ready["max_rss_mb"] == 1 and ready["metrics"] == f"http://127.0.0.1:{metrics_port}/metrics"
        first = await _gauges(ready["metrics"])
        assert first["ctrps_broker_resident_limit_bytes"] == 2**20
        assert first["ctrps_broker_resident_bytes"] > 2**20 and first["ctrps_broker_over_limit"] == 1, first
        # Every record stays: 40,000 events of ~640 bytes add over 20 MB.
        events = ({"id": i, "label": 0, "features": {"site": "x" * 600}} for i in range(40_000))
        report = await produce(ready["bootstrap"], "clicks", events)
        assert report.sent == 40_000
        grown = (await _gauges(ready["metrics"]))["ctrps_broker_resident_bytes"] - first["ctrps_broker_resident_bytes"]
        assert grown > 20e6, grown
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), timeout=30)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    logged = lines + [orjson.loads(ln) for ln in rest.splitlines() if ln.strip()]
    # Past the limit from its first check; at most once a minute.
    (over,) = [ln for ln in logged if ln["msg"].startswith("the embedded broker holds more memory than its limit")]
    assert over["level"] == "warning" and over["limit_mb"] == 1 and over["resident_mb"] >= 1, over


def test_the_over_limit_warning_comes_at_most_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    # This process's own memory, read from /proc as the broker's is.
    memory = BrokerMemory(os.getpid, 2**20, clock=lambda: now[0])
    unlimited = BrokerMemory(os.getpid, 0)
    for t in (0.0, 5.0, 59.0, 60.0, 61.0, 119.0, 120.0):
        now[0] = t
        memory.check()
        unlimited.check()
    assert memory.warnings == 3 and unlimited.warnings == 0
    assert len([r for r in caplog.records if r.getMessage().startswith("the embedded broker holds more")]) == 3
    assert BrokerMemory(lambda: None, 1).resident() is None  # no broker process: no figure, no warning
