"""A long-tail stream through the real broker and a worker into a `ctrps
shard` capped by ``--max-rows``: the rows stay at the cap (give or take one
eviction interval's inserts) and progressive AUC stays with an unbounded run."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from commands import ctrps_process
from streams import new_topic, produce, running, worker_config
from waiting import until

from consumers.broker import free_port
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard
from ps_core.synthetic import SyntheticStream

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

N = 40_000
WINDOW = 2_000
PARTITIONS = 2
EVICT_EVERY_S = 0.1


def progressive_auc(worker: Worker) -> float:
    """AUC of each event predicted before it was learnt, windows weighted by events."""
    hist = worker.stats.history
    ev = np.array([r.events for r in hist], dtype=np.float64)
    return float((ev * [r.metrics.auc for r in hist]).sum() / ev.sum())


async def test_a_capped_shard_holds_its_rows_and_learns_as_well(kafka_bootstrap: str) -> None:
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS, hex_digits=10)
    stream = SyntheticStream(seed=5, fresh=0.05)
    await produce(kafka_bootstrap, topic, (orjson.dumps(e) for e in stream.batch(N)), PARTITIONS)

    # Unbounded, in process.
    free = [Shard()]
    worker = Worker(
        worker_config(kafka_bootstrap, topic, group, WINDOW),
        PSClient.local(free),
        ControlClient.local(free),
        LogisticRegression("m"),
    )
    async with running(worker) as task:
        await until(lambda: worker.stats.events_trained >= N, 120, what="the unbounded run", task=task)
    unbounded_rows = len(free[0].tables["m_w"])
    unbounded_auc = progressive_auc(worker)

    cap = unbounded_rows // 3
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["shard", "--port", str(port), "--no-exports", "--stats-interval", "0"]
    args += ["--max-rows", str(cap), "--evict-interval", str(EVICT_EVERY_S)]
    async with (
        ctrps_process(*args),
        PSClient.connect([url]) as client,
        ControlClient.connect([url]) as control,
    ):
        await until(_answers(control), 30, what="the shard to answer", poll_s=0.1)
        worker = Worker(
            worker_config(kafka_bootstrap, topic, group + "-capped", WINDOW), client, control, LogisticRegression("m")
        )
        rows: list[int] = []
        async with running(worker) as task:

            async def trained() -> bool:
                (stats,) = await control.stats()
                table = stats.tables.get("m_w")
                if table is not None:
                    rows.append(table.features)
                return worker.stats.events_trained >= N

            await until(trained, 120, what="the capped run", task=task, poll_s=0.02)
        (stats,) = await control.stats()
    table = stats.tables["m_w"]
    life = table.lifecycle
    assert life.lifecycle.max_rows == cap
    evicted = life.evicted["max_rows"]
    assert evicted > 0 and life.eviction_passes > 10
    # Each pass cuts the table back under the cap; between two passes it grows
    # by what the worker inserts meanwhile, and exceeds the cap by no more.
    assert 0 < life.most_over_cap <= life.inserted_before_most_over_cap, life
    # What the shard answered while it trained: never more than the worst pass found.
    passes = life.eviction_passes
    assert max(rows[: len(rows) * 9 // 10]) <= cap + life.most_over_cap, (max(rows), passes)
    assert progressive_auc(worker) >= unbounded_auc - 0.01, (progressive_auc(worker), unbounded_auc)


def _answers(control: ControlClient):  # type: ignore[no-untyped-def]
    async def answers() -> bool:
        try:
            await control.stats()
        except Exception:
            return False  # the process is starting
        return True

    return answers
