"""``ctrps export --show VERSION``: a version's summary and the model's
largest weights at it, read from the files alone, with the features named
where known; a missing version or names file is one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from ps_core.checkpoint.export_files import write_version
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.models import LogisticRegression
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = [pytest.mark.slow, pytest.mark.process]

PROJECT = Path(__file__).resolve().parents[1]


def ctrps(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60
    )


async def test_show_prints_a_versions_summary_and_its_largest_weights(tmp_path: Path) -> None:
    model = LogisticRegression("ctr")  # the default: a mixture of 5 learners, dim 10
    k = model.tables()[0].dim // 2
    shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
    client = PSClient.local(shards)
    hasher = FeatureHasher("ctr")
    events = [{"features": {"site": f"s{i % 7}", "price": float(i % 3)}, "label": int(i % 7 == 0)} for i in range(200)]
    batch, _ = hasher.featurize(events)
    keys = np.unique(batch.keys)
    grads = np.zeros((keys.size, 2 * k), np.float32)
    grads[:, :k] = np.random.default_rng(1).normal(0, 1, keys.size)[:, None]  # each learner the same
    # The learners' losses on the bias row: its log-weights (up to 1) are no
    # feature's weight, larger than any learner's here; they are not ranked.
    bias = hasher.featurize([{"features": {}}], require_label=False)[0].keys[0]
    grads[keys == bias, k:] = np.arange(k) * 16.0
    await client.push("ctr_w", keys, grads)
    config = {"name": "ctr", "tables": [t.to_dict() for t in model.tables()]}
    snaps = {s.spec.shard_id: [t.snapshot(None) for t in s.tables.values()] for s in shards}
    write_version(tmp_path, "ctr", 1, None, snaps, {"clicks": {0: 200}}, config, 2)
    top3 = np.zeros((3, 2 * k), np.float32)
    top3[:, :k] = 50.0
    largest = keys[keys != bias][:3]
    await client.push("ctr_w", largest, top3)  # the 3 largest, in the delta
    snaps = {s.spec.shard_id: [t.snapshot(1) for t in s.tables.values()] for s in shards}
    write_version(tmp_path, "ctr", 2, 1, snaps, {"clicks": {0: 250}}, config, 2, serving_precision="f16")
    names = tmp_path / "sample.jsonl"
    names.write_bytes(b"\n".join(orjson.dumps(e) for e in events[:20]))

    out = ctrps("export", "--show", "2", "--dir", str(tmp_path / "ctr"), "--top", "4", "--names", str(names))
    assert out.returncode == 0, out.stderr
    shown = orjson.loads(out.stdout)
    assert (shown["version"], shown["kind"], shown["parent"], shown["chain"]) == (2, "delta", 1, [1, 2])
    assert shown["serving_precision"] == "f16" and shown["offsets"] == {"clicks": {"0": 250}}
    table = shown["tables"]["ctr_w"]
    assert table["features"] == keys.size and table["rows_in_this_version"] == 3
    model_weights = {int(k): float(w) for s in shards for k, w in zip(*_weights(s))}
    top = table["top"]
    assert len(top) == 4 and [abs(t["weights"][0]) for t in top] == sorted(
        (abs(t["weights"][0]) for t in top), reverse=True
    )
    assert {t["key"] for t in top[:3]} == set(largest.tolist())  # the delta's 50s, not the bias's log-weights
    for t in top:
        assert abs(t["weights"][0] - model_weights[t["key"]]) <= 2e-3 * max(1.0, abs(model_weights[t["key"]]))
    named = {t["feature"] for t in top if t["feature"] is not None}
    assert named and all(n == "(bias)" or n.startswith(("site=", "price")) for n in named)

    missing = ctrps("export", "--show", "7", "--dir", str(tmp_path / "ctr"))
    assert missing.returncode == 1 and "no version 7" in missing.stderr and "Traceback" not in missing.stderr
    no_names = ctrps("export", "--show", "2", "--dir", str(tmp_path / "ctr"), "--names", str(tmp_path / "none"))
    assert no_names.returncode == 2 and "--names" in no_names.stderr and "Traceback" not in no_names.stderr


def _weights(shard: Shard) -> tuple[np.ndarray, np.ndarray]:
    t = shard.tables["ctr_w"]
    rows = np.flatnonzero(t.index.row_live[: t.index.num_rows])
    return t.index.row_keys[rows], t.optimizer.weights(t.data[rows], 1)[:, 0]
