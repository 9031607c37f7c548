"""`Learner`: a model learnt in this process without Kafka or shards, as a
worker's async training would learn it from the same events."""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from commands import as_a_user, ctrps_process
from hypothesis import given
from hypothesis import strategies as st
from site_pages import guide_section
from training import FTRL
from waiting import until

from consumers.training import AsyncTraining
from consumers.worker import WorkerStats
from ps_core import Learner
from ps_core.checkpoint.owner import LEARNER, ExportsOwnedError, claim_exports, read_owner
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import ExportNotFoundError, InvalidRequestError
from ps_core.model import models
from ps_core.model.batch import EventBatch
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.learner import FEATURIZE_EVENTS
from ps_core.model.models import make_model
from ps_core.model.ramp import RAMP_START, MiniBatchRamp
from ps_core.net.client import PSClient
from ps_core.shard import Shard
from ps_core.store.table import SparseTable
from ps_core.synthetic import SyntheticStream


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


# The pill's loss overflows float32 in the gradients' cast, as it would in a
# worker (where numpy warns): that is what the worker must catch.
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
async def test_a_mixture_worker_leaves_out_an_untrainable_event_and_its_loss() -> None:
    """A mixture's learners weigh each event by its weight, losses included
    (the bias row's log-weights): an event whose loss overflows (weight
    1000 on a feature a restored model holds near float32's largest) is
    left out whole, and the model learns as from the other events alone."""
    model = make_model("lr", "m", optimizer={"name": "ftrl_mix", "alpha_1": 0.02, "alpha_2": 0.2, "l1_2": 2.0})
    hasher = FeatureHasher("m")
    good = SyntheticStream(seed=3).batch(100)
    pill = {"label": 0, "weight": 1000, "keys": [7], "features": {"site": "x"}}

    async def learnt(events: list[dict[str, Any]]) -> tuple[AsyncTraining, Shard]:
        shard = Shard(tables=model.tables())
        table = shard.tables["m_w"]
        huge = table.optimizer.rows_from_weights(np.array([[5e37, 2e38, 0, 0]], dtype=np.float32))
        table.load_rows(np.array([7], dtype=np.uint64), huge, [0], [0], [0], [0])
        training = AsyncTraining(PSClient.local([shard]), model, WorkerStats(), 16, ramp=0)
        batch, errors = hasher.featurize(events)
        assert not errors

        async def pieces() -> AsyncIterator[EventBatch]:
            yield batch

        await training.train(pieces(), _NoWindow())  # type: ignore[arg-type]
        return training, shard

    # In the last mini-batch (of 16 events): the others are the same.
    (with_pill, shard), (_, alone) = await learnt(good[:98] + [pill] + good[98:]), await learnt(good)
    assert [i for i, _ in with_pill.untrainable] == [98]
    keys = model.plan(hasher.featurize(good)[0]).keys
    got = shard.tables["m_w"].pull(keys)
    np.testing.assert_array_equal(got, alone.tables["m_w"].pull(keys))
    assert np.isfinite(got).all() and np.count_nonzero(got[:, 2:].any(axis=1)) == 1  # the bias's log-weights


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


def _unlabelled(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "label"} for e in events]


def _state_by_key(table: SparseTable) -> tuple[bytes, bytes]:
    """A table's live keys and their rows (weights and optimizer state), in key order."""
    n = table.index.num_rows
    live = np.flatnonzero(table.index.row_live[:n])
    keys = table.index.row_keys[live]
    order = np.argsort(keys)
    return keys[order].tobytes(), table.data[live[order]].tobytes()


COIN = {"name": "coin"}
COIN_EMBEDDINGS = {"name": "coin", "wealth": 0.1, "scale": 1.0}
"""Coin embeddings with a smaller stake than the default's: with a stake of
1 the first bets put embeddings near ±0.5 and the interactions swamp the
linear part (log loss above the constant model's on the synthetic stream)."""


MIX = {"name": "ftrl_mix", "alpha_1": 0.02, "alpha_2": 0.2, "l1_2": 2.0}
"""A mixture of 2 FTRL learners: its linear table of dim 4."""


def _constant_logloss(events: list[dict[str, Any]]) -> float:
    """The log loss of the best constant prediction (the stream's click rate)."""
    p = float(np.mean([e["label"] for e in events]))
    return -(p * np.log(p) + (1 - p) * np.log(1 - p))


def test_a_coin_learner_learns_the_synthetic_stream() -> None:
    events = SyntheticStream(seed=12).batch(10000)
    learner = Learner("lr", optimizer=COIN)
    assert learner.tables["ctr_w"].config.optimizer == {"name": "coin", "wealth": 4.0, "lipschitz": 1.0, "scale": 0.125}
    got = learner.learn(events)
    assert got.logloss < _constant_logloss(events) - 0.02 and got.auc > 0.7, got


def test_an_fm_with_coin_embeddings_learns_them() -> None:
    events = SyntheticStream(seed=12).batch(10000)
    learner = Learner("fm", embedding_optimizer=COIN_EMBEDDINGS)
    v = learner.tables["ctr_v"]
    got = learner.learn(events)
    assert got.logloss < _constant_logloss(events) - 0.05 and got.auc > 0.75, got
    plan = learner.model.plan(learner.hasher.featurize(events[:500])[0])
    moved = np.abs(v.pull(plan.keys) - v.initial_weights(plan.keys)).max(axis=1)
    assert (moved > 1e-3).mean() > 0.5  # the embeddings learnt, not only the linear part


@pytest.mark.parametrize(
    ("kind", "optimizers"),
    [
        ("lr", {}),
        ("fm", {}),
        pytest.param("lr", {"optimizer": COIN}, id="lr-coin"),
        pytest.param("fm", {"optimizer": COIN, "embedding_optimizer": COIN_EMBEDDINGS}, id="fm-coin"),
        pytest.param("lr", {"optimizer": MIX}, id="lr-ftrl_mix"),
        pytest.param("fm", {"optimizer": MIX}, id="fm-ftrl_mix"),
    ],
)
def test_a_saved_learner_loads_and_learns_on_as_it_would_have(
    kind: str, optimizers: dict[str, Any], tmp_path: Path
) -> None:
    stream = SyntheticStream(seed=7)
    first, then, probe = stream.batch(3000), stream.batch(2000), _unlabelled(stream.batch(200))
    learner = Learner(kind, mini_batch=64, **optimizers)
    learner.learn(first)
    path = learner.save(tmp_path)
    assert path == tmp_path / "ctr" / "0000000001" and (path / "manifest.json").is_file()
    loaded = Learner.load(tmp_path)
    assert type(loaded.model) is type(learner.model) and loaded.events_learnt == 3000
    assert loaded.model.tables() == learner.model.tables()  # optimizers and their state's layout
    for name, table in learner.tables.items():  # every row's state, bit for bit
        assert _state_by_key(loaded.tables[name]) == _state_by_key(table)
    assert loaded.sizes == learner.sizes
    np.testing.assert_array_equal(loaded.predict(probe), learner.predict(probe))
    # Learning goes on from the same state with the same mini-batches.
    went_on, reloaded_went_on = learner.learn(then), loaded.learn(then)
    np.testing.assert_array_equal(loaded.predicted, learner.predicted)
    assert reloaded_went_on == went_on
    np.testing.assert_array_equal(loaded.predict(probe), learner.predict(probe))
    # A second save is the next version, and the one a load reads.
    assert loaded.save(tmp_path) == tmp_path / "ctr" / "0000000002"
    again = Learner.load(tmp_path / "ctr")
    np.testing.assert_array_equal(again.predict(probe), learner.predict(probe))


def test_a_learner_saves_only_where_no_cluster_owns_the_exports_unless_it_takes_over(tmp_path: Path) -> None:
    learner = Learner()
    learner.learn(SyntheticStream(seed=5).batch(300))
    claim_exports(tmp_path, "cluster-a", "ctrps cluster")
    with pytest.raises(ExportsOwnedError, match="belongs to 'cluster-a'"):
        learner.save(tmp_path)
    assert not (tmp_path / "ctr").exists()
    assert learner.save(tmp_path, take_over=True) == tmp_path / "ctr" / "0000000001"
    record = read_owner(tmp_path)
    assert record is not None and (record.owner, record.taken_from) == (LEARNER, "cluster-a")
    assert learner.save(tmp_path) == tmp_path / "ctr" / "0000000002"  # its own now


def test_loading_where_nothing_was_saved_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(ExportNotFoundError, match=str(tmp_path / "ctr")):
        Learner.load(tmp_path)


@pytest.mark.parametrize(
    ("made_with", "name", "dim", "width"),
    [
        pytest.param(None, "ftrl_mix", 10, 15, id="mixture"),  # today's: 5 learners, [z, n, m] each
        pytest.param(FTRL, "ftrl", 1, 2, id="ftrl"),  # the default before: [z, n]
    ],
)
def test_a_saved_model_keeps_its_optimizer_when_the_default_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, made_with: dict[str, Any] | None, name: str, dim: int, width: int
) -> None:
    """A model is stored with its optimizer spelt out: restored after the
    default linear optimizer changed, it is still the one it was made with
    (a model of today's default, a mixture, and one of the FTRL default
    before it, restored under today's)."""
    with monkeypatch.context() as then:
        if made_with is not None:
            then.setattr(models, "DEFAULT_LINEAR_OPTIMIZER", made_with)
        learner = Learner("fm")  # the defaults of the day
        learner.learn(SyntheticStream(seed=3).batch(500))
    learner.save(tmp_path)
    spec = ModelSpec.of(learner.model)
    declaration, recipe = orjson.loads(orjson.dumps(spec.to_dict())), spec.recipe()
    before = {t.name: t.optimizer for t in learner.model.tables()}
    assert before["ctr_w"]["name"] == name and learner.model.tables()[0].dim == dim
    if made_with is None:
        monkeypatch.setattr(models, "DEFAULT_LINEAR_OPTIMIZER", COIN)
        monkeypatch.setattr(models, "DEFAULT_EMBEDDING_OPTIMIZER", COIN)
    now = make_model("fm", "ctr").tables()[0].optimizer["name"]
    assert now != name and now == ("coin" if made_with is None else "ftrl_mix")  # new models differ
    loaded = Learner.load(tmp_path)
    assert {t.name: t.optimizer for t in loaded.model.tables()} == before
    assert loaded.tables["ctr_w"].optimizer.name == name and loaded.tables["ctr_w"].width == width
    assert _state_by_key(loaded.tables["ctr_w"]) == _state_by_key(learner.tables["ctr_w"])
    assert {t.name: t.optimizer for t in ModelSpec.from_dict(declaration).tables} == before
    assert {t.name: t.optimizer for t in ModelSpec.from_recipe(recipe).tables} == before


@pytest.mark.parametrize(
    "optimizers",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"optimizer": COIN, "embedding_optimizer": COIN_EMBEDDINGS}, id="coin", marks=pytest.mark.slow),
        pytest.param({"optimizer": MIX}, id="ftrl_mix", marks=pytest.mark.slow),
    ],
)
@pytest.mark.process
async def test_ctrps_serve_follow_serves_a_saved_learner_as_it_predicts(
    tmp_path: Path, optimizers: dict[str, Any]
) -> None:
    stream = SyntheticStream(seed=9)
    probe = _unlabelled(stream.batch(50))
    learner = Learner("fm", mini_batch=128, **optimizers)
    learner.learn(stream.batch(4000))
    learner.save(tmp_path)
    async with ctrps_process(
        "serve", "--follow", str(tmp_path), "--port", "0", "--follow-interval", "0.05", "--log-format", "json"
    ) as proc:
        assert proc.stderr is not None
        url = None
        while url is None:
            line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
            assert line, "ctrps serve exited before listening"
            record = orjson.loads(line)
            url = record.get("url") if record["msg"] == "listening" else None
        served: dict[int, list[float]] = {}

        async def serves(http: aiohttp.ClientSession, version: int) -> bool:
            async with http.post(f"{url}/v1/predict", data=orjson.dumps({"events": probe})) as resp:
                body = orjson.loads(await resp.read())
            if resp.status == 200 and body["model_version"] == version:
                served[version] = body["predictions"]
            return version in served

        async with aiohttp.ClientSession() as http:
            await until(lambda: serves(http, 1), 30, what="the replica serving version 1")
            np.testing.assert_allclose(served[1], learner.predict(probe), rtol=1e-12, atol=0)
            learner.learn(stream.batch(2000))
            learner.save(tmp_path)
            await until(lambda: serves(http, 2), 30, what="the replica serving version 2")
            np.testing.assert_allclose(served[2], learner.predict(probe), rtol=1e-12, atol=0)
            assert not np.allclose(served[1], served[2])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


@pytest.mark.process
def test_the_guide_keeps_and_reloads_a_learner_as_written(tmp_path: Path) -> None:
    section = guide_section("pipeline.md", "Your own data")
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2 and "Learner.load" in blocks[1]
    stream = SyntheticStream(seed=11).batch(3000)
    (tmp_path / "clicks.jsonl").write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in stream))
    done = as_a_user(tmp_path, "-c", blocks[1])  # it stands alone, as the guide's test runs it
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith(str(Path("my-exports/ctr/0000000002")))
    kept = Learner.load(tmp_path / "my-exports")
    # As one Learner that never stopped: 2,000, then the last 1,000.
    events = [orjson.loads(orjson.dumps(e)) for e in stream]
    unbroken = Learner("lr")
    for part in (events[:-1000], events[-1000:]):
        unbroken.learn(part)
    assert kept.events_learnt == unbroken.events_learnt == 3000
    probe = _unlabelled(stream[:100])
    np.testing.assert_array_equal(kept.predict(probe), unbroken.predict(probe))
