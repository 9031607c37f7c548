"""The embedded broker: starts on a free port, answers Kafka clients, refuses a
taken port loudly, and stops by PID."""

from __future__ import annotations

import os
import socket
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from streams import consume_all

from consumers.broker import BrokerError, EmbeddedBroker, create_topics


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
