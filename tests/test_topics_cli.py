"""``ctrps topics create`` against the session broker: new topics get their
partitions, a second run changes nothing, a topic with fewer partitions than
asked is one error line (exit 1), a missing address or malformed --topic is a
usage error (exit 2); and ``ctrps broker --advertised-host`` tells clients
the name it is given (a broker in a pod names its Service)."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient
from commands import ctrps, ctrps_process
from streams import new_topic

from consumers.broker import free_port, topic_partitions

pytestmark = [pytest.mark.slow, pytest.mark.process]


async def test_topics_create_makes_each_topic_with_its_partitions(kafka_bootstrap: str) -> None:
    name = f"clicks-{uuid.uuid4().hex[:8]}"
    args = ["topics", "create", "--bootstrap", kafka_bootstrap, "--topic", f"{name}:3", "--topic", f"{name}.dlq:1"]
    first = ctrps(*args)
    assert first.returncode == 0, first.stderr
    assert await topic_partitions(kafka_bootstrap, [name, f"{name}.dlq"]) == {name: 3, f"{name}.dlq": 1}
    again = ctrps(*args)  # a Job run twice: nothing to do, still 0
    assert again.returncode == 0, again.stderr
    assert f"topics={name}:3,{name}.dlq:1" in again.stderr


async def test_topics_create_refuses_a_topic_with_fewer_partitions(kafka_bootstrap: str) -> None:
    topic, _ = await new_topic(kafka_bootstrap, 2)
    out = ctrps("topics", "create", "--bootstrap", kafka_bootstrap, "--topic", f"{topic}:4")
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert f"topic {topic} has 2 partition(s), 4 asked" in line and "kafka-topics --alter" in line
    assert await topic_partitions(kafka_bootstrap, [topic]) == {topic: 2}


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--topic", "clicks:1"], "no Kafka broker"),
        (["--bootstrap", "127.0.0.1:9", "--topic", "clicks"], "is not NAME:PARTITIONS"),
        (["--bootstrap", "127.0.0.1:9"], "no topic"),
    ],
)
def test_topics_create_usage_errors_are_one_line_and_exit_2(args: list[str], said: str) -> None:
    out = ctrps("topics", "create", *args)
    assert out.returncode == 2
    [line] = out.stderr.strip().splitlines()
    assert said in line


def test_topics_create_without_a_broker_fails_in_one_line_after_its_timeout() -> None:
    out = ctrps("topics", "create", "--bootstrap", f"127.0.0.1:{free_port()}", "--topic", "c:1", "--timeout", "1")
    assert out.returncode == 1
    [line] = out.stderr.strip().splitlines()
    assert "no metadata from" in line


@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.timeout(120)
@pytest.mark.kafka
async def test_the_broker_tells_clients_its_advertised_host() -> None:
    port = free_port()
    args = ["--port", str(port), "--advertised-host", "localhost", "--topic", "c:2", "--log-format", "json"]
    async with ctrps_process("broker", *args) as proc:
        assert proc.stderr is not None
        line: dict[str, Any] = {}
        while line.get("msg") != "ready":
            line = orjson.loads(await asyncio.wait_for(proc.stderr.readline(), timeout=30))
        assert line["bootstrap"] == f"localhost:{port}"
        admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{port}")
        await admin.start()
        try:
            cluster = await admin.describe_cluster()
        finally:
            await admin.close()
        assert [(b["host"], b["port"]) for b in cluster["brokers"]] == [("localhost", port)]
        assert await topic_partitions(f"127.0.0.1:{port}", ["c"]) == {"c": 2}


def test_a_broker_on_every_interface_needs_the_name_it_is_reached_by() -> None:
    out = ctrps("broker", "--host", "0.0.0.0", "--port", str(free_port()))
    assert out.returncode == 2
    assert "needs --advertised-host" in out.stderr.strip().splitlines()[-1]
