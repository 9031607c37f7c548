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
from s3_server import S3Endpoint
from test_export_store import s3_env

from ps_core.checkpoint.export_files import write_version, write_version_to
from ps_core.checkpoint.exportstore import store_for
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


async def test_show_reads_a_version_from_a_bucket_as_from_a_directory(
    tmp_path: Path, s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same cuts written to a directory and to an S3 bucket (moto's
    server) show the same; the bucket's credentials and endpoint come from
    the AWS environment only. A version or a model not there, or a location
    that names no model, is one line."""
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    s3_env(s3_endpoint, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    url = f"s3://{s3_endpoint.bucket}/show-{os.getpid()}-{tmp_path.name}"
    store = store_for(url)
    model = LogisticRegression("ctr")
    shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
    client = PSClient.local(shards)
    rng = np.random.default_rng(3)
    config = {"name": "ctr", "tables": [t.to_dict() for t in model.tables()]}
    dim = model.tables()[0].dim
    for version, parent in ((1, None), (2, 1)):
        keys = np.unique(rng.integers(0, 2**64, 400, dtype=np.uint64))
        await client.push("ctr_w", keys, rng.normal(0, 1, (keys.size, dim)).astype(np.float32))
        snaps = {s.spec.shard_id: [t.snapshot(parent) for t in s.tables.values()] for s in shards}
        args = (version, parent, snaps, {"clicks": {0: 100 * version}}, config, 2)
        write_version(tmp_path, "ctr", *args, serving_precision="f16")
        write_version_to(store, "ctr", *args, serving_precision="f16")

    local = ctrps("export", "--show", "2", "--dir", str(tmp_path / "ctr"), "--top", "5")
    remote = ctrps("export", "--show", "2", "--dir", f"{url}/ctr/", "--top", "5")
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    shown, expected = orjson.loads(remote.stdout), orjson.loads(local.stdout)
    assert shown["chain"] == [1, 2] and len(shown["tables"]["ctr_w"]["top"]) == 5
    assert {k: v for k, v in shown.items() if k != "created_at"} == {
        k: v for k, v in expected.items() if k != "created_at"
    }

    for argv, code, line in (
        (("--show", "7", "--dir", f"{url}/ctr"), 1, f"no version 7 in {url}/ctr (the newest at or below it is 2)"),
        (("--show", "1", "--dir", f"{url}/other"), 1, f"no export version <= 1 in {url}/other"),
        (("--show", "1", "--dir", f"s3://{s3_endpoint.bucket}"), 2, "name the model's, s3://bucket/prefix/<model>"),
        (("--show", "1", "--dir", "gs://bucket/ctr"), 2, "scheme 'gs' is not supported"),
    ):
        out = ctrps("export", *argv)
        assert out.returncode == code, out.stderr
        assert line in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
