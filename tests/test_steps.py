"""Training steps planned ahead equal the plan, routing and counts the worker
would compute for each mini-batch itself."""

from __future__ import annotations

import numpy as np
import pytest

from ps_core.client import PSClient
from ps_core.features import FeatureHasher
from ps_core.models import LogisticRegression
from ps_core.shard import Shard, ShardSpec
from ps_core.steps import plan_steps


def _events(n: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        feats: dict[str, object] = {f"c{j}": f"v{rng.zipf(1.5) % 50}" for j in range(int(rng.integers(0, 6)))}
        if rng.random() < 0.5:
            feats["x"] = float(rng.normal())
        ev: dict[str, object] = {"label": int(rng.random() < 0.3), "features": feats}
        if rng.random() < 0.8:
            ev["ts"] = 1_700_000_000 + i * 0.5
        out.append(ev)
    return out


@pytest.mark.parametrize("num_shards, mini_batch", [(1, 7), (2, 16), (3, 64), (4, 1000)])
def test_steps_match_the_workers_own_plan(num_shards: int, mini_batch: int) -> None:
    batch, errors = FeatureHasher("m").featurize(_events(300, num_shards))
    assert not errors
    model = LogisticRegression("m")
    client = PSClient.local([Shard(ShardSpec(i, num_shards)) for i in range(num_shards)])
    steps = plan_steps(batch, mini_batch, num_shards)
    assert [s.start for s in steps] == list(range(0, 300, mini_batch))
    assert steps[-1].stop == 300
    for step in steps:
        sub = batch.slice(step.start, step.stop)
        plan = model.plan(sub)
        routed = client.route(plan.keys)
        np.testing.assert_array_equal(step.keys, plan.keys)
        np.testing.assert_array_equal(step.inverse, plan.inverse)
        np.testing.assert_array_equal(step.counts, plan.counts(sub.labels))
        if routed.order is None:
            assert step.order is None
        else:
            assert step.order is not None
            np.testing.assert_array_equal(step.order, routed.order)
        assert [(int(a), int(b)) for a, b in zip(step.bounds[:-1], step.bounds[1:])] == [
            (p.start, p.stop) for p in routed.parts
        ]
        ts = sub.ts[np.isfinite(sub.ts)]
        if ts.size:
            assert step.event_time == ts.max()
        else:
            assert np.isnan(step.event_time)


def test_shifted_moves_only_the_event_range() -> None:
    batch, _ = FeatureHasher("m").featurize(_events(40, 9))
    step = plan_steps(batch, 16, 2)[1]
    moved = step.shifted(100)
    assert (moved.start, moved.stop) == (116, 132)
    assert moved.keys is step.keys and moved.counts is step.counts


def test_bad_arguments_are_refused() -> None:
    batch, _ = FeatureHasher("m").featurize(_events(4, 1))
    with pytest.raises(ValueError):
        plan_steps(batch, 0, 2)
    with pytest.raises(ValueError):
        plan_steps(batch, 8, 0)
