"""A shard server is SIGKILLed mid-stream; every shard recovers from the
latest cut and the workers replay from its offsets: nothing lost, nothing
applied twice relative to the cut (real broker, shard processes, files)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from streams import new_topic, produce, shard_args, worker_config
from waiting import until

from consumers.broker import free_port
from consumers.decode import decode_records
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.restore import restore_shards
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.metrics import auc
from ps_core.model.models import LogisticRegression, sigmoid
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.shard import Shard, ShardSpec
from ps_core.synthetic import SyntheticStream

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

PROJECT = Path(__file__).resolve().parents[1]
PARTITIONS = 2
N = 16_000


def _events() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The stream, each event tagged with its partition (a feature, so the
    shards count applications per partition), and later held-out events."""
    stream = SyntheticStream(seed=11)
    events = stream.batch(N)
    for i, ev in enumerate(events):
        ev["features"]["part"] = str(i % PARTITIONS)
    return events, stream.batch(4000)


async def _produce(bootstrap: str, topic: str, events: list[dict[str, Any]]) -> None:
    await produce(bootstrap, topic, [orjson.dumps(ev) for ev in events], PARTITIONS)


def _start_shards(
    ports: list[int], exports: Path, log_dir: Path, tag: str, restore: bool
) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i in range(len(ports)):
        args = [sys.executable, "-m", "app.cli", *shard_args(i, ports, exports, *([] if restore else ["--no-restore"]))]
        with open(log_dir / f"shard{i}-{tag}.log", "wb") as log:
            procs.append(subprocess.Popen(args, cwd=PROJECT, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
    return procs


async def _healthy(control: ControlClient, timeout_s: float = 30) -> None:
    async def answers() -> bool:
        try:
            await control.stats()
        except Exception:
            return False  # processes starting
        return True

    await until(answers, timeout_s, what="every shard to answer", poll_s=0.1)


async def _train(worker: Worker, done: Callable[[], bool], timeout_s: float = 60) -> BaseException | None:
    """Run `worker` until done() or it fails; returns its failure, if any."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        try:
            await until(lambda: done() or task.done(), timeout_s, what="the worker to finish")
        except AssertionError as exc:
            # Where it stood, for a failure that does not reproduce alone.
            s = worker.stats
            raise AssertionError(
                f"{exc}: trained {s.events_trained}, windows {s.windows}, commits {s.commits}, "
                f"outages {s.outages}, waiting for {s.waiting_for!r}, rewinds {s.rewinds}"
            ) from None
    finally:
        stop.set()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as exc:
            return exc
    return None


def _part_keys() -> np.ndarray:
    h = FeatureHasher("m")
    return h.feature_ids(["part"] * PARTITIONS, [str(p) for p in range(PARTITIONS)])


def _shows_in(shards: list[Shard], keys: np.ndarray) -> list[int]:
    from ps_core.hashing import shard_of

    owner = shard_of(keys, len(shards))
    out = []
    for k, s in zip(keys.tolist(), owner.tolist()):
        t = shards[s].tables["m_w"]
        row = t.index.lookup(np.array([k], dtype=np.uint64))[0]
        out.append(int(t.shows[row]) if row >= 0 else 0)
    return out


async def _held_out_auc(client: PSClient, held_out: list[dict[str, Any]]) -> float:
    model = LogisticRegression("m")
    decoded = decode_records([orjson.dumps(e) for e in held_out], "m", 1 << 20)
    plan = model.plan(decoded.batch)
    weights = {t: await client.pull(t, plan.keys) for t in model.table_names}
    p = sigmoid(model.logits(decoded.batch, plan, weights))
    return auc(p, np.array([e["label"] for e in held_out]))


async def test_a_killed_shard_recovers_from_the_cut_and_the_replay_loses_nothing(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    events, held_out = _events()
    topic, group = await new_topic(kafka_bootstrap, PARTITIONS, hex_digits=10)
    await _produce(kafka_bootstrap, topic, events)
    produced = [sum(1 for i in range(N) if i % PARTITIONS == p) for p in range(PARTITIONS)]
    exports = tmp_path / "exports"
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = worker_config(kafka_bootstrap, topic, group, 1000, session_timeout_ms=3000, heartbeat_interval_ms=500)
    part_keys = _part_keys()

    shards = _start_shards(ports, exports, tmp_path, "first", restore=False)
    try:
        async with (
            PSClient.connect(urls, retry=RetryPolicy(deadline_s=1.0)) as client,
            ControlClient.connect(urls, retry=RetryPolicy(deadline_s=1.0)) as control,
        ):
            await _healthy(control)
            # Train about a third, cut (through `ctrps export`), train on,
            # then shard 1 dies mid-stream.
            worker = Worker(config, client, control, LogisticRegression("m"))
            assert await _train(worker, lambda: worker.stats.events_trained >= N // 3) is None
            assert worker.leased
            cut = subprocess.run(
                [sys.executable, "-m", "app.cli", "export", "--shard0", urls[0], "--kind", "base"],
                cwd=PROJECT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert cut.returncode == 0, cut.stderr
            report = orjson.loads(cut.stdout)
            # A partition with no commit yet (fetches need not reach every
            # partition in the first third) is replayed from its start.
            cut_offsets = report["offsets"].get(topic, {})
            at_cut = [cut_offsets.get(str(p), 0) for p in range(PARTITIONS)]
            assert 0 < sum(at_cut) < N

            worker = Worker(config, client, control, LogisticRegression("m"))
            killed = False

            def kill_mid_stream() -> bool:
                nonlocal killed
                if not killed and worker.stats.events_trained >= 4000:
                    shards[1].send_signal(signal.SIGKILL)
                    killed = True
                # The worker waits for shard 1 (training and committing
                # nothing), and is stopped while it waits.
                return killed and urls[1] in worker.stats.waiting_for

            failure = await _train(worker, kill_mid_stream, timeout_s=60)
            assert killed and failure is None, failure
            assert worker.stats.outages == 1 and worker.stats.windows_replayed == 1, worker.stats
    finally:
        for p in shards:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in shards:
            p.wait(30)

    # The group committed past the cut before the failure.
    versions = list_versions(exports / "m")
    assert [v.version for v in versions] == [1]

    # Every shard recovers from the latest cut; a new worker of the same
    # group replays from the cut's offsets.
    shards = _start_shards(ports, exports, tmp_path, "second", restore=True)
    try:
        async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
            await _healthy(control)
            offsets = await control.coordinator_offsets()
            assert [offsets.get(topic, {}).get(p, 0) for p in range(PARTITIONS)] == at_cut
            worker = Worker(config, client, control, LogisticRegression("m"))
            assert await _train(worker, lambda: worker.stats.records >= N - sum(at_cut)) is None
            assert worker.stats.records == N - sum(at_cut)
            assert worker.stats.events_trained == N - sum(at_cut)
            recovered_auc = await _held_out_auc(client, held_out)
            # A new cut of the recovered shards (versions go on after the
            # newest on disk; the first after a start is a base).
            after = await control.export_now()
            assert (after.version, after.kind) == (2, "base")
            assert after.offsets == {topic: {str(p): n for p, n in enumerate(produced)}}
    finally:
        for p in shards:
            p.send_signal(signal.SIGTERM)
        for p in shards:
            p.wait(30)

    # Per partition, applications (the shows of the partition's feature)
    # equal what was produced: none lost, none applied twice.
    recovered = restore_shards(latest_chain(exports / "m"), 2)
    assert recovered.version == 2
    assert _shows_in(recovered.shards, part_keys) == produced

    # The same stream without a failure, once through.
    local = [Shard(ShardSpec(i, 2)) for i in range(2)]
    baseline = Worker(
        worker_config(kafka_bootstrap, topic, f"g-{uuid.uuid4().hex[:8]}", 1000),
        PSClient.local(local),
        ControlClient.local(local),
        LogisticRegression("m"),
    )
    assert await _train(baseline, lambda: baseline.stats.records >= N) is None
    assert _shows_in(local, part_keys) == produced
    baseline_auc = await _held_out_auc(PSClient.local(local), held_out)
    assert abs(recovered_auc - baseline_auc) <= 0.01, (recovered_auc, baseline_auc)
