"""Workers sharing a group, and a worker killed mid-stream: nothing lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from typing import Any

import numpy as np
import orjson
import pytest
from streams import all_running, applications, brisk_worker_config, committed, group_of, keyed_event, new_topic, produce
from waiting import until

from consumers.worker import Worker
from ps_core.model.models import LogisticRegression
from ps_core.shard import Shard, ShardSpec

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

PARTITIONS = 4


async def _produce(bootstrap: str, topic: str, lo: int, hi: int, rate: float | None = None) -> None:
    await produce(bootstrap, topic, (keyed_event(i) for i in range(lo, hi)), PARTITIONS, first=lo, rate=rate)


async def _committed(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    return await committed(bootstrap, group, topic, PARTITIONS)


async def _wait(cond: Any, timeout_s: float, what: str) -> None:
    await until(cond, timeout_s, what=what, poll_s=0.1)


async def test_two_workers_share_partitions_and_apply_every_event(kafka_bootstrap: str) -> None:
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    n = 6000
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    model = LogisticRegression("m")
    workers = group_of(brisk_worker_config(kafka_bootstrap, topic, group, 400, 128), shards, model)
    async with all_running(workers, 30):
        # Both members join before the events arrive, so both get partitions.
        await _wait(lambda: _assigned(workers), 30, "both workers to get partitions")
        await _produce(kafka_bootstrap, topic, 0, n)
        await _wait(lambda: _all_committed(kafka_bootstrap, group, topic, n), 60, "every event committed")
    parts = [set(p for r in w.stats.history for p in r.partitions) for w in workers]
    assert parts[0] and parts[1], parts
    assert not parts[0] & parts[1], f"a partition was consumed by both: {parts}"
    applied = applications(shards, 0, n)
    assert (applied == 1).all(), (
        f"missing {np.flatnonzero(applied == 0)[:10]}, twice {np.flatnonzero(applied > 1)[:10]}"
    )
    assert sum(w.stats.events_trained for w in workers) == n


async def _assigned(workers: list[Worker]) -> bool:
    return all(w._consumer is not None and len(w._consumer.assignment()) > 0 for w in workers)


async def _all_committed(bootstrap: str, group: str, topic: str, n: int) -> bool:
    committed = await _committed(bootstrap, group, topic)
    return sum(committed.values()) >= n


@pytest.mark.process
async def test_sigkilled_worker_loses_nothing(kafka_bootstrap: str, serve_shards: Any) -> None:
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS)
    n, window = 12000, 300
    shards, urls = await serve_shards(2)
    cmd = [
        sys.executable,
        "-m",
        "app.cli",
        "worker",
        "--bootstrap",
        kafka_bootstrap,
        "--shards",
        ",".join(urls),
        "--topic",
        topic,
        "--group",
        group,
        "--window-seconds",
        "1",
        "--window-events",
        str(window),
        "--mini-batch",
        "100",
        "--model-name",
        "m",
        "--decode-processes",
        "0",
        "--session-timeout-ms",
        "3000",
        "--log-format",
        "json",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    second = None
    try:
        producing = asyncio.create_task(_produce(kafka_bootstrap, topic, 0, n, rate=4000))
        # Kill it once it has committed some windows, while events still arrive.
        await _wait(lambda: _some_committed(kafka_bootstrap, group, topic, 1500), 60, "first commits")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        at_kill = sum((await _committed(kafka_bootstrap, group, topic)).values())
        assert at_kill < n, "the worker finished before it was killed: nothing was tested"
        second = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        await producing
        await _wait(lambda: _all_committed(kafka_bootstrap, group, topic, n), 90, "every event committed")
        second.send_signal(signal.SIGTERM)
        assert second.wait(30) == 0
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
        logged = first.stderr.read() if first.stderr is not None else b""
        if first.stderr is not None:
            first.stderr.close()
    # The killed worker logged one JSON line per window with the fields.
    windows = [orjson.loads(line) for line in logged.splitlines() if b'"msg":"window"' in line]
    assert windows, logged[-2000:]
    for w in windows:
        assert {"window", "partitions", "events", "dlq", "logloss", "auc", "copc", "window_events_per_s", "lag"} <= set(
            w
        )
    assert sum(w["events"] for w in windows) <= n
    applied = applications(shards, 0, n)
    assert (applied >= 1).all(), f"lost events: {np.flatnonzero(applied == 0)[:20]}"
    twice = int((applied - 1).sum())
    # At most the killed worker's uncommitted window of each partition is replayed.
    assert twice <= PARTITIONS * window, twice


async def _some_committed(bootstrap: str, group: str, topic: str, at_least: int) -> bool:
    return sum((await _committed(bootstrap, group, topic)).values()) >= at_least
