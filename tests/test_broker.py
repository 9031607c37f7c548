"""The embedded broker: starts on a free port, answers Kafka clients, refuses a
taken port loudly, stops by PID, and takes producers back after a restart."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from commands import ctrps, ctrps_process
from streams import bias_shows, consume_all, keyed_event
from waiting import until

from consumers.broker import BrokerError, EmbeddedBroker, create_topics, free_port


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


@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.timeout(180)
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
            finally:
                os.kill(worker.pid, signal.SIGCONT)
            after = await asyncio.to_thread(ctrps, "produce", "synthetic", "--bootstrap", bootstrap, "--events", "3000")
            assert after.returncode == 0, after.stderr
            assert "sent=3000 " in after.stderr, after.stderr
            # The broker refused the first write to each partition once.
            assert "the broker refused a send with error -1: resending it" in after.stderr, after.stderr
            # The resent events and every later one are trained.
            await until(lambda: bias_shows(shards) >= 2000 + 4 + 3000, 90, what="the worker to train every event")
            assert worker.returncode is None
    finally:
        broker.stop()
