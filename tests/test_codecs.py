"""Every Kafka codec: record batches compressed with none, gzip, snappy, lz4
and zstd, by an independent client (confluent-kafka, i.e. librdkafka) and by
``ctrps produce --compression``, are trained by a real worker, every event.

Against the embedded broker (Tansu) every codec works both ways: Tansu stores
and serves the batches as the producer compressed them, so decoding is the
consumer's (aiokafka's, through cramjam for snappy, lz4 and zstd).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import orjson
import pytest
from streams import bias_shows, confluent_produce, running, worker_config
from waiting import until

from consumers.broker import create_topics
from consumers.producer import COMPRESSIONS
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

PROJECT = Path(__file__).resolve().parent.parent
N = 1500  # events per producer, per codec


def _needs_cramjam(bootstrap: str, topic: str, last: bool) -> str:
    """How a consumer without cramjam fares on partition 0 of `topic` ("ok"
    or the error's class name), reading its first record (confluent-kafka's)
    or its `last` (ours): proof that those batches really are compressed with
    a codec that needs cramjam."""
    script = (
        "import sys; sys.modules['cramjam'] = None\n"  # as if the codec extras were not installed
        "import asyncio\n"
        "from aiokafka import AIOKafkaConsumer, TopicPartition\n"
        "async def main():\n"
        f"    c = AIOKafkaConsumer(bootstrap_servers={bootstrap!r}, auto_offset_reset='earliest')\n"
        "    await c.start()\n"
        "    try:\n"
        f"        tp = TopicPartition({topic!r}, 0)\n"
        "        c.assign([tp])\n"
        f"        if {last!r}:\n"
        "            c.seek(tp, (await c.end_offsets([tp]))[tp] - 1)\n"
        "        await asyncio.wait_for(c.getone(), 20)\n"
        "        print('ok')\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__)\n"
        "    finally:\n"
        "        await c.stop()\n"
        "asyncio.run(main())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=PROJECT)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("codec", COMPRESSIONS)
async def test_a_worker_trains_every_event_of_every_codec(kafka_bootstrap: str, codec: str) -> None:
    topic = f"codec-{codec}-{uuid.uuid4().hex[:8]}"
    await create_topics(kafka_bootstrap, {topic: 2, topic + ".dlq": 1})
    # An independent client first, then ours, into the same topic.
    events = SyntheticStream(seed=11, vocab=300).batch(N)
    await asyncio.to_thread(
        confluent_produce, kafka_bootstrap, topic, [orjson.dumps(e) for e in events], 2,
        [int(e["ts"] * 1000) for e in events], {"compression.type": codec, "linger.ms": 20},
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "app.cli", "produce", "synthetic", "--events", str(N), "--seed", "12",
         "--topic", topic, "--bootstrap", kafka_bootstrap, "--compression", codec, "--log-format", "json"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=90,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    done = [orjson.loads(x) for x in out.stderr.splitlines() if '"msg":"done"' in x]
    assert len(done) == 1 and done[0]["sent"] == N, out.stderr
    assert f'"compression":"{codec}"' in out.stderr

    if codec in ("snappy", "lz4", "zstd"):
        for last in (False, True):
            assert await asyncio.to_thread(_needs_cramjam, kafka_bootstrap, topic, last) == "UnsupportedCodecError"
    else:  # gzip is the standard library's: readable without cramjam
        assert await asyncio.to_thread(_needs_cramjam, kafka_bootstrap, topic, True) == "ok"

    model = LogisticRegression("ctr")
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    config = worker_config(kafka_bootstrap, topic, f"g-{uuid.uuid4().hex[:8]}", 1000, window_seconds=1.0)
    worker = Worker(config, PSClient.local(shards), ControlClient.local(shards), model)
    async with running(worker, 30) as task:
        await until(lambda: worker.stats.events_trained >= 2 * N, 90, task=task,
                    what=f"{2 * N} events trained ({worker.stats})", poll_s=0.05)  # fmt: skip
    assert worker.stats.dead_letters == 0
    assert worker.stats.events_trained == 2 * N
    assert bias_shows(shards, "ctr") == 2 * N
