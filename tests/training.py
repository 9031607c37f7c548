"""A worker's training step, written out over a PS client, for tests (and
benchmarks) that train shards without running a worker."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from consumers.windows import Window
from ps_core.model.batch import EventBatch
from ps_core.model.models import Model, sigmoid
from ps_core.net.client import PSClient

__all__ = ["FTRL", "train_step", "window_of"]

FTRL: dict[str, Any] = {"name": "ftrl", "alpha": 0.2, "beta": 0.1, "l1": 0.5, "l2": 1.0}
"""One FTRL learner, a linear table of dim 1: the linear optimizer of new
models until 2026-12-07 (since, a mixture of 5), for tests of FTRL's own math
and of models made before."""


async def train_step(client: PSClient, model: Model, batch: EventBatch) -> npt.NDArray[np.float64]:
    """One async training step on `batch`: pull its weights, predict, push
    the gradients (with the batch's shows and clicks). Returns the
    predictions, made before the push (as progressive metrics take them)."""
    plan = model.plan(batch)
    routed = client.route(plan.keys)
    w = {t: await client.pull(t, routed) for t in model.table_names}
    p = sigmoid(model.logits(batch, plan, w))
    grads = model.gradients(batch, plan, w, (p - batch.labels) * batch.weights)
    for t, g in grads.items():
        await client.push(t, routed, g, counts=plan.counts(batch.labels))
    return p


def window_of(values: list[bytes | None]) -> Window:
    """A closed window of `values` as partition 0's records from offset 0
    (no broker: a test or benchmark hands it to a worker's training)."""
    n = len(values)
    return Window(
        seq=1,
        values=values,
        partitions=[("clicks", 0)],
        record_partition=np.zeros(n, dtype=np.int32),
        offsets=np.arange(n, dtype=np.int64),
        next_offsets={("clicks", 0): n},
        first_ts_ms=0,
        last_ts_ms=0,
    )
