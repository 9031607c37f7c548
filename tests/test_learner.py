"""`Learner`: a model learnt in this process without Kafka or shards, as a
worker's async training would learn it from the same events."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumers.synthetic import SyntheticStream
from consumers.training import AsyncTraining
from consumers.worker import WorkerStats
from ps_core import Learner
from ps_core.errors import InvalidRequestError
from ps_core.model.batch import EventBatch
from ps_core.model.hasher import FeatureHasher
from ps_core.model.learner import FEATURIZE_EVENTS
from ps_core.model.models import make_model
from ps_core.model.ramp import RAMP_START, MiniBatchRamp
from ps_core.net.client import PSClient
from ps_core.net.shard import Shard


class _NoWindow:
    last_ts_ms = 0


@pytest.mark.parametrize("kind", ["lr", "fm"])
async def test_a_learner_learns_what_a_worker_learns(kind: str) -> None:
    events = SyntheticStream(seed=4).batch(6000)
    learner = Learner(kind, mini_batch=128)
    got = learner.learn(events)
    # The worker's own loop over in-process shards, on the same events.
    model = make_model(kind, "ctr")
    shard = Shard(tables=model.tables())
    training = AsyncTraining(PSClient.local([shard]), model, WorkerStats(), 128)
    batch, _ = FeatureHasher("ctr").featurize(events)

    async def pieces() -> AsyncIterator[EventBatch]:
        yield batch

    want = await training.train(pieces(), _NoWindow())  # type: ignore[arg-type]
    assert got.events == want.events == 6000
    assert got.logloss == pytest.approx(want.logloss, rel=1e-6) and got.auc == pytest.approx(want.auc, abs=1e-6)
    probe = SyntheticStream(seed=4).batch(6100)[6000:]
    for e in probe:
        e.pop("label")
    p = learner.predict(probe)
    assert p.shape == (100,) and ((p > 0) & (p < 1)).all()
    assert learner.events_learnt == 6000 and got.auc > 0.6  # better than chance after 6,000 events


def test_refused_events_are_skipped_and_named() -> None:
    learner = Learner()
    m = learner.learn([{"features": {"a": "x"}, "label": 1}, {"features": {"a": "y"}}, {"label": 0}])
    assert m.events == 1 and set(learner.refused) == {1, 2}
    assert "label" in learner.refused[1]
    with pytest.raises(InvalidRequestError, match="event 0"):
        learner.predict([{"features": "not an object"}])
    np.testing.assert_array_equal(learner.predict([]), np.empty(0))
    with pytest.raises(ValueError, match="mini_batch"):
        Learner(mini_batch=0)


def test_events_are_featurized_a_chunk_at_a_time_as_all_at_once() -> None:
    events = SyntheticStream(seed=5).batch(2 * FEATURIZE_EVENTS + 100)
    bad = [FEATURIZE_EVENTS + 3, 2 * FEATURIZE_EVENTS + 7]  # in the second and the third chunk
    for i in bad:
        del events[i]["label"]
    learner = Learner()
    got, got_errors = learner._featurize(events)
    want, want_errors = FeatureHasher("ctr").featurize(events)
    for field in ("keys", "values", "offsets", "labels", "weights", "ts", "index"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    assert {i: e.detail for i, e in got_errors.items()} == {i: e.detail for i, e in want_errors.items()}
    m = learner.learn(events)
    assert m.events == len(events) - 2 and sorted(learner.refused) == bad
    events[bad[1]]["features"] = "not an object"
    with pytest.raises(InvalidRequestError, match=f"event {bad[1]}"):
        learner.predict(events)


def test_a_refusal_past_the_first_chunk_is_keyed_and_named_by_its_place() -> None:
    events = SyntheticStream(seed=7).batch(2 * FEATURIZE_EVENTS + 100)
    place = 2 * FEATURIZE_EVENTS + 7  # in the third chunk, at 7 of it
    events[place]["features"]["I1"] = float("nan")
    learner = Learner()
    learner.learn(events)
    assert list(learner.refused) == [place]
    assert learner.refused[place].startswith(f"bad_value: event {place}: "), learner.refused
    with pytest.raises(InvalidRequestError) as refused:
        learner.predict(events)
    assert refused.value.detail.startswith(f"bad_value: event {place}: "), refused.value.detail


def test_a_fresh_model_learns_sooner_with_its_mini_batches_ramping() -> None:
    events = SyntheticStream(seed=6).batch(4000)
    fixed = Learner(ramp=0).learn(events)
    ramped = Learner().learn(events)  # 1 event a mini-batch at first, growing by one per 64 learnt
    # Its bias and frequent features move per few events, not per 256.
    assert ramped.logloss < fixed.logloss - 0.01


@pytest.mark.parametrize(
    ("ratio", "learnt", "size"), [(0, 0, 256), (64, 0, 1), (64, 640, 10), (64, 10**9, 256), (1, 3, 3), (4, 2, 1)]
)
def test_ramp_sizes(ratio: int, learnt: int, size: int) -> None:
    assert MiniBatchRamp(256, ratio).next_size(learnt) == size
    with pytest.raises(ValueError, match="ramp ratio"):
        MiniBatchRamp(256, -1)


@given(st.integers(1, 4096), st.integers(0, 512), st.lists(st.integers(0, 10**7), min_size=2, max_size=20))
def test_ramp_sizes_never_shrink_and_stay_in_bounds(size: int, ratio: int, learnt: list[int]) -> None:
    ramp = MiniBatchRamp(size, ratio)
    got = [ramp.next_size(n) for n in sorted(learnt)]
    assert got == sorted(got) and all(min(size, RAMP_START) <= s <= size for s in got)
