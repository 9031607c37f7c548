"""``ctrps dlq`` over the embedded broker: the newest dead letters, newest
first, with their reason and source; a reason filter; JSON lines; and the
failures (no broker address, no such topic) as one line each."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from aiokafka import AIOKafkaProducer
from streams import new_topic

from consumers.dlq import DeadLetter, DeadLetterQueue

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

PROJECT = Path(__file__).resolve().parents[1]


def ctrps(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def _send(bootstrap: str, dlq: str, letters: list[DeadLetter]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for d in letters:  # one at a time: their write times keep this order
            await DeadLetterQueue(producer, dlq).send_all([d])
    finally:
        await producer.stop()


async def test_dlq_prints_the_newest_dead_letters_first(kafka_bootstrap: str) -> None:
    topic, _ = await new_topic(kafka_bootstrap, 2)
    dlq = topic + ".dlq"
    letters = [
        DeadLetter(b"{not json" if i % 2 else b'{"label": 7}', "invalid_json" if i % 2 else "bad_label",
                   f"message {i}", topic, i % 2, 100 + i)
        for i in range(6)
    ]  # fmt: skip
    await _send(kafka_bootstrap, dlq, letters)

    out = ctrps("dlq", "--bootstrap", kafka_bootstrap, "--topic", dlq, "--limit", "4", "--json")
    assert out.returncode == 0, out.stderr
    got = [orjson.loads(line) for line in out.stdout.splitlines()]
    assert [g["source"]["offset"] for g in got] == [105, 104, 103, 102]  # newest first
    assert got[0] == {
        "written_at": got[0]["written_at"],
        "reason": "invalid_json",
        "detail": "message 5",
        "source": {"topic": topic, "partition": 1, "offset": 105},
        "dlq": {"partition": got[0]["dlq"]["partition"], "offset": got[0]["dlq"]["offset"]},
        "value": "{not json",
    }

    only = ctrps("dlq", "--topic", dlq, "--reason", "bad_label", CTRPS_KAFKA_BOOTSTRAP=kafka_bootstrap)
    assert only.returncode == 0, only.stderr
    lines = only.stdout.splitlines()
    assert lines[-1] == f"3 dead letter(s) of {dlq}, newest first"
    assert "bad_label" in lines[0] and f"{topic}[0]@104" in lines[0] and "b'{\"label\": 7}'" in lines[2]

    # The topic from CTRPS_TOPIC: <topic>.dlq.
    by_env = ctrps("dlq", "--limit", "1", CTRPS_KAFKA_BOOTSTRAP=kafka_bootstrap, CTRPS_TOPIC=topic)
    assert by_env.returncode == 0 and f"{topic}[1]@105" in by_env.stdout


async def test_dlq_failures_are_one_line(kafka_bootstrap: str) -> None:
    none = ctrps("dlq")
    assert none.returncode == 2 and "no Kafka broker" in none.stderr and "Traceback" not in none.stderr
    missing = ctrps("dlq", "--bootstrap", kafka_bootstrap, "--topic", "no-such-topic.dlq")
    assert missing.returncode == 1 and "Traceback" not in missing.stderr
    assert "no topic 'no-such-topic.dlq'" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1
    help_ = ctrps("dlq", "--help")
    assert help_.returncode == 0 and "examples:" in help_.stdout
