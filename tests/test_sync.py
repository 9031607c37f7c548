"""Sync mode: the workers inside a window meet at every mini-batch step; the
shards hold the step's gradients and apply their sum once when it closes.
Each event's gradient is applied exactly once, two workers train exactly as
one worker over the union of their steps, a dead or late worker is dropped
from the quorum after the deadline, and the mode learns the stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from streams import applications, assert_applied_once, brisk_worker_config, committed, keyed_event, new_topic, produce
from test_geo import _progressive
from training import window_of
from waiting import until

from app.api.views import ControlView
from app.metrics import ApiMetrics
from consumers.decode import decode_records
from consumers.worker import Worker, WorkerConfig
from ps_core.checkpoint.barrier import SyncBarrier
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.errors import InvalidRequestError, InvalidValuesError
from ps_core.model.batch import EventBatch
from ps_core.model.models import Model, make_model, sigmoid
from ps_core.net.client import PSClient
from ps_core.shard import Push, Shard, ShardSpec
from ps_core.store.table_config import TableConfig
from ps_core.synthetic import SyntheticStream

PROJECT = Path(__file__).resolve().parent.parent


async def test_a_step_closes_when_every_member_arrived() -> None:
    b = SyncBarrier()
    first = b.join("a")
    b.join("b")
    a_task = asyncio.create_task(b.arrive("a", 5.0))
    await until(lambda: "a" in b.arrived, 5, what="a's arrival", poll_s=0.001)
    assert not a_task.done()  # b has not arrived
    assert await b.arrive("b", 5.0) == first == await a_task
    assert b.step == first + 1 and b.stats()["steps_closed"] == 1 and b.shrinks == 0
    # A member leaving closes the step the others wait in.
    a_task = asyncio.create_task(b.arrive("a", 5.0))
    await until(lambda: "a" in b.arrived, 5, what="a's arrival", poll_s=0.001)
    b.leave("b")
    assert await a_task == first + 1
    # Alone, a member's steps close at once.
    assert await b.arrive("a", 5.0) == first + 2


async def test_a_member_later_than_the_deadline_is_dropped_and_rejoins(caplog: pytest.LogCaptureFixture) -> None:
    b = SyncBarrier()
    b.join("a")
    b.join("slow")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    step = await b.arrive("a", 0.2)
    assert 0.15 < loop.time() - t0 < 2.0
    assert b.members == {"a"} and b.shrinks == 1 and b.dropped == {"slow": 1}
    assert [r.getMessage() for r in caplog.records if r.name == "ctrps.sync"] == [
        "sync step closed without members that did not arrive within the deadline"
    ]
    # The late member arrives: it is a member again, at the open step.
    late = asyncio.create_task(b.arrive("slow", 5.0))
    await until(lambda: "slow" in b.arrived, 5, what="the late member's arrival", poll_s=0.001)
    assert not late.done() and b.members == {"a", "slow"}
    assert await b.arrive("a", 5.0) == step + 1 == await late


def test_a_sync_shard_holds_pushes_until_the_step_is_applied_once() -> None:
    config = TableConfig("w", 1, {"name": "sgd", "lr": 0.5}, mode="sync")
    shard = Shard(ShardSpec(0, 1), (config,))
    keys = np.array([1, 2, 3], np.uint64)
    shard.handle_push(Push("w", keys, np.ones((3, 1), np.float32)))
    shard.handle_push(Push("w", keys[:2], np.ones((2, 1), np.float32), np.ones((2, 2), np.float32)))
    np.testing.assert_array_equal(shard.handle_pull("w", keys)[0], np.zeros((3, 1)))  # held, not applied
    with pytest.raises(InvalidValuesError):  # checked when held, not when applied
        shard.handle_push(Push("w", keys, np.full((3, 1), np.nan, np.float32)))
    assert shard.apply_step(10) == 3
    np.testing.assert_allclose(shard.handle_pull("w", keys)[0], [[-1.0], [-1.0], [-0.5]])
    assert shard.tables["w"].pushes == 1  # one optimizer step for the two pushes
    assert shard.apply_step(10) == 0 and shard.apply_step(9) == 0  # once per step, never an older one
    np.testing.assert_array_equal(shard.tables["w"].shows[shard.tables["w"].index.lookup(keys)], [1, 1, 0])


async def test_each_model_meets_at_its_own_barrier_and_applies_its_own_tables() -> None:
    # Two sync models on one cluster: a worker of "a" never waits for one of
    # "b", and a step of "a" applies a's tables only.
    tables = tuple(TableConfig(f"{m}_w", 1, {"name": "sgd", "lr": 1.0}, mode="sync") for m in ("a", "b"))
    shard = Shard(ShardSpec(0, 1), tables)
    coordinator = Coordinator()
    control = ControlClient.local([shard], coordinator)
    keys = np.array([7], np.uint64)
    await control.sync_join("x", "a")
    await control.sync_join("y", "b")  # inside its window, and slow
    for t in ("a_w", "b_w"):
        shard.handle_push(Push(t, keys, np.ones((1, 1), np.float32)))
    step = await asyncio.wait_for(control.sync_arrive("x", 5.0, "a"), 1.0)  # y is not a's member
    assert await control.sync_apply(step, ["a_w"]) == 1
    assert shard.handle_pull("a_w", keys)[0][0, 0] == -1.0
    assert shard.handle_pull("b_w", keys)[0][0, 0] == 0.0 and shard.tables["b_w"].held_keys == 1
    step_b = await asyncio.wait_for(control.sync_arrive("y", 5.0, "b"), 1.0)
    assert await control.sync_apply(step_b, ["b_w"]) == 1 and await control.sync_apply(step_b, ["b_w"]) == 0
    assert shard.handle_pull("b_w", keys)[0][0, 0] == -1.0
    stats = coordinator.sync_stats()
    assert stats["steps_closed"] == 2 and sorted(stats["models"]) == ["a", "b"]
    assert stats["members"] == ["x", "y"] and stats["models"]["a"]["members"] == ["x"]
    # A request naming no model meets at the default model's barrier.
    assert coordinator.barrier() is coordinator.barrier(coordinator.model)


def test_barriers_are_bounded_in_number(monkeypatch: pytest.MonkeyPatch) -> None:
    import ps_core.checkpoint.coordinator as coordinator_module

    monkeypatch.setattr(coordinator_module, "MAX_BARRIERS", 2)
    coordinator = Coordinator()
    first = coordinator.barrier("a")
    coordinator.barrier("b")
    assert coordinator.barrier("a") is first  # kept, not made again
    with pytest.raises(InvalidRequestError, match="sync barriers of 2 models exist already: not one for c"):
        coordinator.barrier("c")
    # Leaving a model's barrier that was never made makes none.
    assert coordinator.leave_barrier("w0", "never-joined") == 0
    assert set(coordinator.barriers) == {"a", "b"}
    first.join("w0")
    assert coordinator.leave_barrier("w0", "a") == first.step and "w0" not in first.members


def _crew(
    kind: str, n: int, mini_batch: int = 128, deadline_s: float = 5.0, optimizers: dict[str, Any] | None = None
) -> tuple[list[Worker], list[Shard], Model]:
    """`n` sync workers over 2 in-process shards whose shard 0 hosts a
    coordinator (and reports its barrier, as ``ctrps shard`` does);
    `optimizers`: the model's, if not its defaults."""
    model = make_model(kind, "m", mode="sync", **(optimizers or {}))
    shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
    coordinator = Coordinator()
    shards[0].add_stats("sync", coordinator.sync_stats)
    config = {"mini_batch": mini_batch, "decode_processes": 0, "mode": "sync", "sync_deadline_s": deadline_s}
    workers = [
        Worker(
            WorkerConfig("unused:9092", worker_id=f"w{i}", **config),
            PSClient.local(shards),
            ControlClient.local(shards, coordinator),
            model,
        )
        for i in range(n)
    ]
    return workers, shards, model


async def _train_together(workers: list[Worker], parts: list[list[bytes | None]]) -> list[Any]:
    """Each worker trains its part as one window, all at once, every worker a
    member from the first step (so step k holds every worker's k-th mini-batch)."""
    for w in workers:
        await w.control.sync_join(w.worker_id, "m")

    async def train(w: Worker, values: list[bytes | None]) -> Any:
        batch = decode_records(values, "m", 1 << 20).batch

        async def one() -> AsyncIterator[EventBatch]:
            yield batch

        return await w.training.train(one(), window_of(values))

    return list(await asyncio.gather(*(train(w, v) for w, v in zip(workers, parts))))


COIN = {"name": "coin", "wealth": 0.1}
MIX = {"name": "ftrl_mix", "alpha_1": 0.02, "alpha_2": 0.2, "l1_2": 2.0}


@pytest.mark.parametrize(
    ("kind", "optimizers"),
    [
        ("lr", {}),
        ("fm", {}),
        pytest.param("fm", {"optimizer": COIN, "embedding_optimizer": COIN}, id="fm-coin"),
        pytest.param("lr", {"optimizer": MIX}, id="lr-ftrl_mix"),
        pytest.param("fm", {"optimizer": MIX}, id="fm-ftrl_mix"),
    ],
)
async def test_two_workers_train_exactly_as_one_over_their_steps_together(
    kind: str, optimizers: dict[str, Any]
) -> None:
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=9).batch(2048)]
    parts = [values[:1024], values[1024:]]
    workers, shards, model = _crew(kind, 2, optimizers=optimizers)
    await _train_together(workers, parts)
    assert [w.stats.sync_steps for w in workers] == [8, 8]

    # The reference: one worker whose step k is both workers' k-th
    # mini-batches, at the same weights, summed into one push.
    ref_shards = [Shard(ShardSpec(i, 2), make_model(kind, "m", **optimizers).tables()) for i in range(2)]
    ref = PSClient.local(ref_shards)
    batches = [decode_records(p, "m", 1 << 20).batch for p in parts]
    for k in range(8):
        subs = [b.slice(128 * k, 128 * (k + 1)) for b in batches]
        plans = [model.plan(s) for s in subs]
        keys = np.concatenate([p.keys for p in plans])
        pulled = {t: await ref.pull(t, keys) for t in model.table_names}
        grads: dict[str, list[np.ndarray]] = {t: [] for t in model.table_names}
        counts = []
        at = 0
        for sub, plan in zip(subs, plans):
            w = {t: v[at : at + plan.keys.size] for t, v in pulled.items()}
            at += plan.keys.size
            p = sigmoid(model.logits(sub, plan, w))
            for t, g in model.gradients(sub, plan, w, (p - sub.labels) * sub.weights).items():
                grads[t].append(g)
            counts.append(plan.counts(sub.labels))
        for t in model.table_names:
            await ref.push(t, keys, np.concatenate(grads[t]), counts=np.concatenate(counts))
    probe = np.unique(np.concatenate([model.plan(b).keys for b in batches]))
    got = PSClient.local(shards)
    for t in model.table_names:
        np.testing.assert_allclose(await got.pull(t, probe), await ref.pull(t, probe), rtol=1e-5, atol=1e-6)
    assert all(t.held_keys == 0 for s in shards for t in s.tables.values())
    if model.mixture is not None:  # the learners' losses were summed too: on the bias row alone
        log_weights = (await got.pull(model.table_names[0], probe))[:, model.mixture.learners :]
        assert np.count_nonzero(log_weights.any(axis=1)) == 1


async def test_a_member_that_never_arrives_holds_each_step_no_longer_than_the_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=4).batch(512)]
    (w0, w1), shards, model = _crew("lr", 2, deadline_s=0.2)
    await w1.control.sync_join("w1", "m")  # inside a window, then stuck
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await _train_together([w0], [values])
    # The first step waited 0.2 s and dropped w1; the other three did not wait.
    assert 0.15 < loop.time() - t0 < 3.0
    assert w0.stats.sync_steps == 4 and w0.stats.events_trained == 512
    shrunk = [r for r in caplog.records if r.name == "ctrps.sync"]
    assert len(shrunk) == 1 and shrunk[0].fields["dropped"] == "w1"  # type: ignore[attr-defined]
    metrics = ApiMetrics()
    exposition = (await metrics.scrape(ControlView(w0.control, metrics))).decode()
    assert "ctrps_sync_quorum_shrinks_total 1.0" in exposition
    assert 'ctrps_sync_members_dropped_total{worker="w1"} 1.0' in exposition
    assert "ctrps_sync_steps_total 4.0" in exposition and "ctrps_sync_members 0.0" in exposition
    # Alone after the drop, w0 trained exactly as a lone worker.
    (alone,), alone_shards, _ = _crew("lr", 1)
    await _train_together([alone], [values])
    keys = model.plan(decode_records(values, "m", 1 << 20).batch).keys
    np.testing.assert_array_equal(
        await PSClient.local(shards).pull("m_w", keys), await PSClient.local(alone_shards).pull("m_w", keys)
    )


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lr", "fm"])
async def test_sync_and_geo_learn_the_stream_as_well_as_async(kind: str) -> None:
    """Two workers in each mode over the same 120k events: the progressive
    AUC of the stream's second half within 0.01 of async's."""
    values: list[bytes | None] = [orjson.dumps(e) for e in SyntheticStream(seed=5).batch(120_000)]
    reference, _ = await _progressive("async", kind, values, 2)
    geo, _ = await _progressive("geo", kind, values, 2)
    workers, _, _ = _crew(kind, 2, mini_batch=256)
    windows = []
    for start in range(0, len(values), 4000):  # windows of 2000 per worker, trained together
        windows += await _train_together(workers, [values[start : start + 2000], values[start + 2000 : start + 4000]])
    late = windows[len(windows) // 2 :]
    sync = sum(m.auc * m.events for m in late) / sum(m.events for m in late)
    assert geo > reference - 0.01 and sync > reference - 0.01, (reference, geo, sync)


@pytest.mark.slow
async def test_two_sync_workers_over_the_broker_apply_every_event_once(kafka_bootstrap: str) -> None:
    partitions, n = 4, 4000
    topic, group = await new_topic(kafka_bootstrap, partitions)
    model = make_model("lr", "m", mode="sync")
    shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
    coordinator = Coordinator()
    workers = [
        Worker(
            brisk_worker_config(kafka_bootstrap, topic, group, 400, 128, mode="sync", worker_id=f"w{i}"),
            PSClient.local(shards),
            ControlClient.local(shards, coordinator),
            model,
        )
        for i in range(2)
    ]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]

    async def all_committed() -> bool:
        return sum((await committed(kafka_bootstrap, group, topic, partitions)).values()) >= n

    try:
        await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(n)), partitions)
        await until(all_committed, 60, what="every event committed", poll_s=0.1)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert_applied_once(shards, workers, n)
    assert coordinator.barrier("m").steps_closed >= n // (2 * 128)
    assert coordinator.barrier("m").members == set()  # both left at their windows' ends
    assert all(t.held_keys == 0 for s in shards for t in s.tables.values())


@pytest.mark.slow
@pytest.mark.process
async def test_a_sigkilled_sync_worker_stalls_the_other_no_longer_than_the_deadline(
    kafka_bootstrap: str, serve_shards: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    partitions, n = 4, 8000
    topic, group = await new_topic(kafka_bootstrap, partitions)
    shards, urls = await serve_shards(2, tuple(make_model("lr", "m", mode="sync").tables()), tmp_path)
    cmd = [
        sys.executable, "-m", "app.cli", "worker", "--bootstrap", kafka_bootstrap, "--shards", ",".join(urls),
        "--topic", topic, "--group", group, "--window-seconds", "1", "--window-events", "400",
        "--mini-batch", "100", "--model-name", "m", "--decode-processes", "0", "--session-timeout-ms", "3000",
        "--mode", "sync", "--sync-deadline", "1", "--log-format", "json",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / f"worker{i}.log" for i in range(2)]
    files = [log.open("wb") for log in logs]
    procs = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env, cwd=PROJECT) for f in files]

    async def some_committed(k: int) -> bool:
        for p, log in zip(procs[1:], logs[1:]):
            assert p.poll() is None, log.read_text()[-3000:]
        return sum((await committed(kafka_bootstrap, group, topic, partitions)).values()) >= k

    try:
        producing = asyncio.create_task(
            produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(n)), partitions, rate=2000)
        )
        await until(lambda: some_committed(1500), 60, what="first commits", poll_s=0.1)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        await producing
        # The survivor goes on: the dead member is dropped after the deadline,
        # its partitions move to the survivor after the session timeout.
        await until(lambda: some_committed(n), 60, what="every event committed by the survivor", poll_s=0.1)
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for f in files:
            f.close()
    # Killed inside a window, it was dropped from a step after the deadline,
    # in one line each time (killed between windows, it was no member: the
    # survivor's steps never waited for it).
    shrunk = [r.getMessage() for r in caplog.records if r.name == "ctrps.sync"]
    assert all("did not arrive within the deadline" in m for m in shrunk), shrunk
    # Every event applied at least once (the killed worker's last window is
    # replayed by the survivor), and the barrier closed steps without it.
    applied = applications(shards, 0, n)
    assert (applied >= 1).all(), f"missing {np.flatnonzero(applied == 0)[:10]}"
    assert all(t.held_keys == 0 for s in shards for t in s.tables.values())
