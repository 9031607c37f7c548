"""Serving replicas (`app.api.follower`, ``ctrps serve --follow``): a trainer's
real shards cut real export versions into tmp_path; the replica's API, in
process (aiohttp test_utils) or as ``ctrps serve --follow``, must answer
exactly the trainer's predictions at the version it serves, refuse damaged
versions (one log line naming the file and both checksums) while serving
the previous one, reload on a gap, and swap a new base in.

The follower's background poll runs once at start and then waits an hour:
the tests drive `Follower.poll` themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import shutil
import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from commands import ctrps_process
from documents import validate
from training import FTRL
from waiting import until

import app.api.follower as follower_module
from app.api import create_app
from app.api.follower import Follower, follow_dir, model_from_manifest, model_of_exports
from app.api.openapi import openapi_document, response_schema
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.serve import ApiSettings
from ps_core.checkpoint.export_files import latest_chain, list_versions, load_version, read_manifest, write_version
from ps_core.checkpoint.restore import apply_version, restore_shards
from ps_core.errors import InvalidValuesError
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.models import FactorizationMachine, LogisticRegression, Model, make_model, sigmoid
from ps_core.net.client import PSClient
from ps_core.replica import ReplicaTables
from ps_core.shard import Shard, ShardSpec
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

TOKEN = "replica-token"
F64 = npt.NDArray[np.float64]


# -- a trainer: real shards, trained through the client, cut into versions ------------


def events(rng: np.random.Generator, n: int, *, sites: int = 20) -> list[dict[str, Any]]:
    """Labelled events with categorical, numeric and multi-hot features."""
    out = []
    for _ in range(n):
        site = int(rng.integers(0, sites))
        out.append(
            {
                "label": int(rng.random() < (0.7 if site % 3 == 0 else 0.2)),
                "features": {
                    "site": f"s{site}",
                    "ad": f"a{int(rng.integers(0, 40))}",
                    "price": round(float(rng.uniform(0.5, 3.0)), 3),
                    "tags": [f"t{int(t)}" for t in rng.choice(6, size=2, replace=False)],
                },
            }
        )
    return out


@dataclass
class Trainer:
    """Shards a model trains on, and the versions cut from them into ``root/<model>``."""

    root: Path
    model: Model
    shards: list[Shard]
    client: PSClient
    last: int = 0
    expected: dict[int, F64] = field(default_factory=dict)
    """The trainer's own predictions of `PROBE` at each version it cut."""
    precision: str = "f32"
    """What the versions' serving files hold the weights in."""

    @classmethod
    def new(cls, root: Path, kind: str = "lr", num_shards: int = 2, **optimizers: Any) -> Trainer:
        """`optimizers`: the model's (`make_model`), if not its defaults."""
        model = make_model(kind, "ctr", **optimizers)
        shards = [Shard(ShardSpec(i, num_shards), model.tables()) for i in range(num_shards)]
        return cls(root, model, shards, PSClient.local(shards))

    @property
    def model_dir(self) -> Path:
        return self.root / self.model.name

    async def train(self, batch: list[dict[str, Any]], rounds: int = 2) -> None:
        """The worker's step (pull, gradients, push) on `batch`."""
        b, errors = self.model.hasher().featurize(batch)
        assert not errors
        for _ in range(rounds):
            plan = self.model.plan(b)
            w = {t: await self.client.pull(t, plan.keys) for t in self.model.table_names}
            p = sigmoid(self.model.logits(b, plan, w))
            grads = self.model.gradients(b, plan, w, (p - b.labels) * b.weights)
            for t, g in grads.items():
                await self.client.push(t, plan.keys, g, counts=plan.counts(b.labels))

    def evict(self, batch: list[dict[str, Any]], *, keep_bias: bool = False) -> None:
        """Delete the features of `batch` from every table (an eviction);
        with `keep_bias`, all but the bias (a mixture's keeps its
        learners' log-weights)."""
        b, _ = self.model.hasher().featurize(batch, require_label=False)
        gone = np.unique(b.keys)
        if keep_bias:
            gone = np.setdiff1d(gone, b.keys[b.offsets[:-1]])
        for shard in self.shards:
            for table in shard.tables.values():
                table.delete(gone)

    async def predict(self, probe: list[dict[str, Any]]) -> F64:
        """What the model predicts from the trainer's shards now."""
        b, _ = self.model.hasher().featurize(probe, require_label=False)
        plan = self.model.plan(b)
        w = {t: await self.client.pull(t, plan.keys) for t in self.model.table_names}
        return sigmoid(self.model.logits(b, plan, w))

    def snapshots(self, base: bool) -> dict[int, list[TableSnapshot]]:
        """A cut of every table (the coordinator's pause)."""
        return {
            s.spec.shard_id: [t.snapshot(None if base else self.last) for t in s.tables.values()] for s in self.shards
        }

    async def cut(self, base: bool = False) -> int:
        """Cut a base or a delta, write it (atomic rename) and remember the
        trainer's predictions at it."""
        version = self.shards[0].tables[self.model.table_names[0]].version
        # As the exporter writes a created model's: its numeric too.
        config = {
            "name": self.model.name,
            "tables": [t.to_dict() for t in self.model.tables()],
            "numeric": self.model.numeric,
        }
        write_version(
            self.root,
            self.model.name,
            version,
            None if base else self.last,
            self.snapshots(base),
            {"clicks": {0: version * 10}},
            config,
            len(self.shards),
            serving_precision=self.precision,
        )
        self.last = version
        self.expected[version] = await self.predict(PROBE)
        return version


PROBE = events(np.random.default_rng(99), 40) + [{"features": {"site": "never-seen", "price": 1.0}}]


async def trained(root: Path, kind: str = "lr", versions: int = 3) -> Trainer:
    """A trainer that cut a base (1) and `versions - 1` deltas, with evictions."""
    trainer = Trainer.new(root, kind)
    rng = np.random.default_rng(7)
    await trainer.train(events(rng, 300) + PROBE[:10])
    await trainer.cut(base=True)
    for _ in range(versions - 1):
        batch = events(rng, 150, sites=30)
        await trainer.train(batch)
        trainer.evict(batch[:5])
        await trainer.cut()
    return trainer


# -- the replica, in process ------------------------------------------------------------


@dataclass
class Replica:
    """A replica's app in process; every answer is checked against the
    OpenAPI document it serves."""

    http: TestClient  # type: ignore[type-arg]
    follower: Follower
    doc: dict[str, Any]
    seen: set[tuple[str, str, int]] = field(default_factory=set)

    async def call(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        data = None if body is None else orjson.dumps(body)
        async with self.http.request(method, path, data=data, headers=headers) as resp:
            raw, status, ctype = await resp.read(), resp.status, resp.content_type
        if ctype != "application/json":
            return status, raw.decode()
        parsed = orjson.loads(raw)
        schema = response_schema(self.doc, path.partition("?")[0], method, status)
        assert validate(parsed, schema, self.doc) == [], (method, path, status, parsed)
        self.seen.add((method, path, status))
        return status, parsed

    async def predict(self, probe: list[dict[str, Any]]) -> tuple[F64, int]:
        status, got = await self.call("POST", "/v1/predict", {"events": probe})
        assert status == 200, got
        return np.array(got["predictions"]), got["model_version"]

    async def serves(self, trainer: Trainer, version: int) -> None:
        """The replica serves `version`: the trainer's predictions at it, and says so."""
        assert self.follower.served_version == version
        got, model_version = await self.predict(PROBE)
        assert model_version == version
        np.testing.assert_allclose(got, trainer.expected[version], rtol=1e-12, atol=0)
        status, info = await self.call("GET", "/v1/model")
        assert status == 200
        assert info["served_version"] == info["last_export_version"] == info["model_version"] == version


MakeReplica = Callable[..., Awaitable[Replica]]


@pytest.fixture
async def make_replica() -> AsyncIterator[MakeReplica]:
    opened: list[TestClient] = []  # type: ignore[type-arg]

    async def make(model_dir: Path, model: Model | None = None, **settings: Any) -> Replica:
        served = model_of_exports(model_dir, make_model("lr", "ctr")) if model is None else model
        follower = Follower(model_dir, served, interval_s=3600)
        app = create_app(ApiSettings(**settings), follower.client, served, follower=follower)
        http = TestClient(TestServer(app))
        await http.start_server()
        opened.append(http)
        replica = Replica(http, follower, openapi_document(replica=True))
        status, doc = await replica.call("GET", "/openapi.json")
        assert status == 200 and doc == replica.doc
        await follower.poll()  # after the start's own poll, whichever ran first
        return replica

    yield make
    for http in opened:
        await http.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ctrps.follow" and r.levelno >= logging.WARNING]


async def _serving(root: Path, make_replica: MakeReplica, versions: int) -> tuple[Trainer, Replica]:
    """A trainer that cut `versions` versions into `root`, and a replica
    following it that serves the last of them."""
    trainer = await trained(root, versions=versions)
    replica = await make_replica(trainer.model_dir, trainer.model)
    await replica.serves(trainer, versions)
    return trainer, replica


# -- following ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lr", "fm"])
async def test_replica_predicts_as_the_trainer_at_each_version(
    tmp_path: Path, make_replica: MakeReplica, kind: str
) -> None:
    trainer = Trainer.new(tmp_path, kind)
    replica = await make_replica(trainer.model_dir, trainer.model)
    # Nothing exported yet: alive, not ready, and it says why.
    assert (await replica.call("GET", "/healthz"))[0] == 200
    status, body = await replica.call("GET", "/readyz")
    assert (status, body["error"]) == (503, "no_version") and str(trainer.model_dir) in body["detail"]
    assert (await replica.call("POST", "/v1/predict", {"events": PROBE}))[1]["error"] == "no_version"
    status, info = await replica.call("GET", "/v1/model")
    assert status == 200 and info["served_version"] is None and "no export version" in info["follow"]["error"]

    rng = np.random.default_rng(3)
    await trainer.train(events(rng, 300) + PROBE[:10])
    assert await trainer.cut(base=True) == 1
    assert await replica.follower.poll() is True
    await replica.serves(trainer, 1)
    assert (await replica.call("GET", "/readyz"))[0] == 200
    for version in (2, 3):
        batch = events(rng, 150, sites=30)
        await trainer.train(batch)
        trainer.evict(batch[:5])  # deletions travel in the delta
        assert await trainer.cut() == version
        assert not np.allclose(trainer.expected[version], trainer.expected[version - 1])
        assert await replica.follower.poll() is True
        await replica.serves(trainer, version)
    assert await replica.follower.poll() is False  # nothing new
    status, info = await replica.call("GET", "/v1/model")
    follow = info["follow"]
    assert (follow["base_version"], follow["newest_version"], follow["deltas_applied"], follow["bases_loaded"]) == (
        1,
        3,
        2,
        1,
    )
    assert follow["error"] is None and follow["dir"] == str(trainer.model_dir)
    assert info["config"] == trainer.model.config() and info["shards"] == 1
    # The replica holds exactly the trainer's rows (2 shards re-hashed into 1).
    for name in trainer.model.table_names:
        assert info["tables"][name]["features"] == sum(len(s.tables[name]) for s in trainer.shards)
        assert info["tables"][name]["version"] == 3
    status, w = await replica.call("POST", "/v1/weights", {"features": PROBE[0]["features"]})
    keys = np.array([row["key"] for row in w["weights"]], dtype=np.uint64)
    assert status == 200 and w["model_version"] == 3
    for name in trainer.model.table_names:
        np.testing.assert_array_equal(
            [row["weights"][name] for row in w["weights"]], await trainer.client.pull(name, keys)
        )


async def test_a_replica_started_on_a_chain_loads_it_whole(tmp_path: Path, make_replica: MakeReplica) -> None:
    trainer = await trained(tmp_path, "fm", versions=3)
    replica = await make_replica(trainer.model_dir)  # the model from the manifest
    assert isinstance(replica.follower.model, FactorizationMachine)
    await replica.serves(trainer, 3)
    status, info = await replica.call("GET", "/v1/model")
    assert (info["follow"]["bases_loaded"], info["follow"]["deltas_applied"]) == (1, 0)


MIX = {"name": "ftrl_mix"}
"""The 5 default FTRL learners: a linear table of 10 weights a key, the bias
row's last 5 its learners' log-weights, in units of 32 nats (the default
cap), which share the bias row's int8 exponent."""


@pytest.mark.parametrize(
    ("kind", "optimizers"),
    [("lr", {"optimizer": FTRL}), ("fm", {"optimizer": FTRL}), ("lr", {"optimizer": MIX}), ("fm", {"optimizer": MIX})],
    ids=["lr-ftrl", "fm-ftrl", "lr-ftrl_mix", "fm-ftrl_mix"],
)
@pytest.mark.parametrize(("precision", "tolerance", "per_value"), [("f16", 1e-3, 2), ("int8", 1e-2, 1)])
async def test_a_replica_serves_a_quantized_export_close_to_the_float32_trainer(
    tmp_path: Path,
    make_replica: MakeReplica,
    kind: str,
    optimizers: dict[str, Any],
    precision: str,
    tolerance: float,
    per_value: int,
) -> None:
    """Stated tolerance: a float16 replica predicts within 0.001 of the
    float32 trainer, an int8 one within 0.01 (absolute, on probabilities),
    through a base and deltas with deletions; it holds 8 bytes of key and
    `per_value` of weight per value (int8: and one exponent per bucket).
    A mixture's too, whose bias row holds its learners' log-weights."""
    trainer = Trainer.new(tmp_path, kind, **optimizers)
    trainer.precision = precision
    replica = await make_replica(trainer.model_dir, trainer.model)
    rng = np.random.default_rng(3)
    await trainer.train(events(rng, 300) + PROBE[:10])
    await trainer.cut(base=True)
    for version in (1, 2, 3):
        if version > 1:
            batch = events(rng, 150, sites=30)
            await trainer.train(batch)
            trainer.evict(batch[:5], keep_bias=True)  # a mixture's bias row holds its log-weights
            await trainer.cut()
        assert await replica.follower.poll() is True
        got, model_version = await replica.predict(PROBE)
        assert model_version == version
        gap = np.abs(got - trainer.expected[version])
        assert gap.max() <= tolerance, (version, gap.max())
        if trainer.model.mixture is not None:  # its learners' log-weights, kept and served
            b, _ = trainer.model.hasher().featurize(PROBE[:1], require_label=False)
            bias = (await trainer.client.pull("ctr_w", b.keys[:1]))[0, trainer.model.mixture.learners :]
            assert np.ptp(bias) > 0.1, bias
        assert gap.max() > 0  # rounded indeed: not the float32 weights
    status, info = await replica.call("GET", "/v1/model")
    assert info["precision"] == precision
    for name, table in replica.follower.transport.shard.tables.items():
        assert table.precision == precision and len(table) == sum(len(s.tables[name]) for s in trainer.shards)
        assert info["tables"][name]["bytes"] == table.memory_bytes()
        st = table.state
        assert table.memory_bytes() - st.exps.nbytes - st.directory.nbytes == len(table) * (8 + per_value * table.dim)
    manifest = read_manifest(list_versions(trainer.model_dir)[-1].path)
    assert manifest.serving_precision == precision
    with np.load(list_versions(trainer.model_dir)[-1].path / manifest.serving_files[0].name) as npz:
        members = sorted(npz.files)
    assert members == (["deleted", "keys", "weights"] if precision == "f16" else ["codes", "deleted", "exps", "keys"])


async def test_a_replica_reads_and_holds_weights_only(tmp_path: Path, make_replica: MakeReplica) -> None:
    # FM: a linear table of the default mixture of 5 FTRL learners and an
    # AdaGrad embedding table, both with state.
    trainer = await trained(tmp_path, "fm")
    for info in list_versions(trainer.model_dir):
        manifest = read_manifest(info.path)
        assert len(manifest.serving_files) == len(manifest.files)
        for entry in manifest.serving_files:
            with np.load(info.path / entry.name) as npz:
                assert sorted(npz.files) == ["deleted", "keys", "weights"]
                assert npz["weights"].shape == (entry.rows, manifest.tables[entry.table].dim)
        # What a replica is sent: the serving files and manifests, no optimizer state.
        for entry in manifest.files:
            (info.path / entry.name).unlink()
    replica = await make_replica(trainer.model_dir, trainer.model)
    await replica.serves(trainer, trainer.last)
    shard = replica.follower.transport.shard
    for name, table in shard.tables.items():
        # weights, nothing else: 8 bytes of key and 4 of weight per value a key
        assert table.values.dtype == np.float32 and table.values.shape == (len(table), table.dim)
        assert table.memory_bytes() - table.state.directory.nbytes == len(table) * (8 + 4 * table.dim)
        held = trainer.shards[0].tables[name]
        # The trainers' optimizer state: z, n and m per learner (the weights
        # derived from them); AdaGrad's weight and sum of squares per column.
        assert held.width == {"ctr_w": 3 * 5, "ctr_v": 2 * held.dim}[name]
    status, info = await replica.call("GET", "/v1/model")
    assert info["tables"]["ctr_w"]["optimizer"]["name"] == "ftrl_mix"  # as the trainers declared it
    assert info["tables"]["ctr_w"]["dim"] == 10 and shard.tables["ctr_w"].dim == 10
    assert info["tables"]["ctr_v"]["optimizer"]["name"] == "adagrad"


@pytest.mark.parametrize(
    ("damage", "then"), [("flip", "replaced"), ("truncate", "newer_base"), ("missing", "replaced")]
)
async def test_a_damaged_version_is_refused_once_and_the_previous_one_keeps_serving(
    tmp_path: Path, make_replica: MakeReplica, caplog: pytest.LogCaptureFixture, damage: str, then: str
) -> None:
    trainer, replica = await _serving(tmp_path, make_replica, 2)
    await trainer.train(events(np.random.default_rng(4), 200, sites=30))
    assert await trainer.cut() == 3
    vdir = trainer.model_dir / "0000000003"
    # The replica reads the serving files (weights): damage one of those.
    entry = next(f for f in read_manifest(vdir).serving_files if f.rows > 0)
    path = vdir / entry.name
    good = path.read_bytes()
    expected = entry.sha256
    if damage == "flip":
        bad = bytearray(good)
        bad[len(bad) // 2] ^= 0x01
        path.write_bytes(bad)
        actual = hashlib.sha256(bad).hexdigest()
    elif damage == "truncate":
        path.write_bytes(good[:100])
        expected, actual = f"{entry.bytes} bytes", "100 bytes"
    else:
        path.unlink()
        actual = "missing"

    caplog.set_level(logging.INFO, logger="ctrps.follow")
    for _ in range(3):  # retried at every poll, logged once
        assert await replica.follower.poll() is False
        await replica.serves(trainer, 2)
    (record,) = warnings_of(caplog)
    fields = record.fields  # type: ignore[attr-defined]
    assert record.getMessage() == "export version refused"
    assert (fields["file"], fields["expected"], fields["actual"]) == (str(path), expected, actual)
    assert (fields["version"], fields["serving"]) == (3, 2)
    assert str(path) in fields["detail"] and actual in fields["detail"]
    status, info = await replica.call("GET", "/v1/model")
    assert str(path) in info["follow"]["error"] and info["follow"]["newest_version"] == 3
    assert (await replica.call("GET", "/readyz"))[0] == 200  # still serving version 2

    if then == "replaced":
        path.write_bytes(good)
        assert await replica.follower.poll() is True
        await replica.serves(trainer, 3)
    else:  # a newer base moves the replica past the damaged delta
        await trainer.train(events(np.random.default_rng(5), 100))
        assert await trainer.cut(base=True) == 4
        assert await replica.follower.poll() is True
        await replica.serves(trainer, 4)
        assert replica.follower.info()["follow"]["base_version"] == 4
    assert replica.follower.error is None
    assert len(warnings_of(caplog)) == 1


async def test_a_gap_reloads_the_chain_from_the_base(
    tmp_path: Path, make_replica: MakeReplica, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, replica = await _serving(tmp_path, make_replica, 2)
    # Another trainer restored from version 1 goes on, numbering after the
    # newest version: its next delta, version 3, applies to 1, not to 2.
    restored = restore_shards(latest_chain(trainer.model_dir, upto=1), 2)
    fork = Trainer(tmp_path, trainer.model, restored.shards, PSClient.local(restored.shards), last=1)
    await fork.train(events(np.random.default_rng(8), 200, sites=30))
    snaps = {i: [dataclasses.replace(s, version=3) for s in part] for i, part in fork.snapshots(base=False).items()}
    config = {"name": "ctr", "tables": [t.to_dict() for t in trainer.model.tables()], "numeric": trainer.model.numeric}
    write_version(tmp_path, "ctr", 3, 1, snaps, {"clicks": {0: 30}}, config, 2)
    fork.expected[3] = await fork.predict(PROBE)

    caplog.set_level(logging.INFO, logger="ctrps.follow")
    assert await replica.follower.poll() is True
    await replica.serves(fork, 3)
    info = replica.follower.info()["follow"]
    assert (info["base_version"], info["bases_loaded"]) == (1, 2)
    assert any("follows 1, not the served version 2" in r.getMessage() for r in caplog.records)
    assert warnings_of(caplog) == []


async def test_a_new_base_is_swapped_in_and_the_old_shard_is_left_as_it_was(
    tmp_path: Path, make_replica: MakeReplica
) -> None:
    trainer, replica = await _serving(tmp_path, make_replica, 2)
    old = replica.follower.transport.shard
    b, _ = FeatureHasher("ctr").featurize(PROBE, require_label=False)
    keys = np.unique(b.keys)
    before = old.handle_pull("ctr_w", keys)[0].copy()
    rng = np.random.default_rng(6)
    await trainer.train(events(rng, 200, sites=30))
    assert await trainer.cut(base=True) == 3
    await trainer.train(events(rng, 100, sites=30))
    assert await trainer.cut() == 4
    assert await replica.follower.poll() is True
    await replica.serves(trainer, 4)
    assert replica.follower.transport.shard is not old
    # A request that was reading the old shard finishes on version 2.
    np.testing.assert_array_equal(old.handle_pull("ctr_w", keys)[0], before)
    info = replica.follower.info()["follow"]
    assert (info["base_version"], info["bases_loaded"], info["deltas_applied"]) == (3, 2, 0)


async def test_concurrent_requests_each_read_one_version(tmp_path: Path, make_replica: MakeReplica) -> None:
    """FM reads two tables per request: while deltas are applied and a base
    swapped in, every answer must be exactly one version's predictions."""
    trainer = await trained(tmp_path, "fm", versions=1)
    replica = await make_replica(trainer.model_dir, trainer.model)
    rng = np.random.default_rng(12)
    for base in [False] * 6 + [True, False, False]:
        await trainer.train(events(rng, 120, sites=30))
        await trainer.cut(base=base)
    poll = asyncio.create_task(replica.follower.poll())
    answers: list[tuple[F64, int]] = []

    async def user() -> None:
        while not poll.done():  # requests in flight all along the poll
            answers.append(await replica.predict(PROBE))

    await asyncio.gather(*(user() for _ in range(8)))
    assert poll.result() is True and replica.follower.served_version == 10
    answers.append(await replica.predict(PROBE))
    for got, version in answers:
        np.testing.assert_allclose(got, trainer.expected[version], rtol=1e-12, atol=0)
    # Deltas 2-7 are applied in place, then the chain 8-10 swapped in.
    versions = {version for _, version in answers}
    assert versions <= {1, 2, 3, 4, 5, 6, 7, 10} and 10 in versions and len(versions) >= 2


async def test_mutating_routes_answer_409_and_the_replica_document_holds(
    tmp_path: Path, make_replica: MakeReplica
) -> None:
    trainer = await trained(tmp_path, versions=1)
    replica = await make_replica(trainer.model_dir, admin_token=TOKEN)
    routes = {
        (r.method, r.resource.canonical)
        for r in replica.http.app.router.routes()
        if r.resource is not None and r.method not in ("HEAD", "*")
    }
    assert routes == {(m.upper(), p) for p, ops in replica.doc["paths"].items() for m in ops}
    report = {"source": "ops", "status": {"kind": "worker", "windows": 1}}
    status, body = await replica.call("POST", "/v1/status", report, {"Authorization": f"Bearer {TOKEN}"})
    assert (status, body["error"]) == (409, "read_only_replica") and "read-only replica" in body["detail"]
    assert (await replica.call("POST", "/v1/status", report))[0] == 401  # the token still comes first
    # No write path at all: the reader the API pulls through, and its one
    # transport, have no push, no push-pull and no control plane.
    for reader in (replica.follower.client, replica.follower.transport):
        assert not {"push", "push_pull", "declare", "report_status", "export_now"} & set(dir(reader))
    status, board = await replica.call("GET", "/v1/status")
    assert (status, board) == (200, {"statuses": []})
    for path in ("/metrics", "/v1/history", "/"):
        assert (await replica.call("GET", path))[0] == 200
    # The training API's document has no 409 and leaves the replica's fields optional.
    plain = openapi_document()
    assert "409" not in plain["paths"]["/v1/status"]["post"]["responses"]
    assert "409" in replica.doc["paths"]["/v1/status"]["post"]["responses"]
    assert {"served_version", "follow"} <= set(replica.doc["components"]["schemas"]["ModelInfo"]["required"])
    assert not {"served_version", "follow"} & set(plain["components"]["schemas"]["ModelInfo"]["required"])


async def test_a_version_of_another_model_is_refused(
    tmp_path: Path, make_replica: MakeReplica, caplog: pytest.LogCaptureFixture
) -> None:
    trainer, replica = await _serving(tmp_path, make_replica, 1)
    other = Trainer.new(tmp_path, "fm")
    for shard in other.shards:  # numbered after version 1
        for t in shard.tables.values():
            t.mark_exported(1)
    await other.train(events(np.random.default_rng(2), 50))
    assert await other.cut(base=True) == 2
    caplog.set_level(logging.INFO, logger="ctrps.follow")
    assert await replica.follower.poll() is False
    await replica.serves(trainer, 1)
    (record,) = warnings_of(caplog)
    assert "FactorizationMachine" in record.fields["detail"] and "restart" in record.fields["detail"]  # type: ignore[attr-defined]


async def test_the_poll_task_is_owned_by_the_app(
    tmp_path: Path, make_replica: MakeReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = await trained(tmp_path, versions=1)
    replica = await make_replica(trainer.model_dir, trainer.model)
    task = replica.follower._task
    assert task is not None and not task.done()

    # A failure that is no version's fault ends the task, and readiness says so.
    def broken(model_dir: Path) -> dict[int, Path]:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(follower_module, "version_dirs", broken)
    failing = Follower(trainer.model_dir, trainer.model, interval_s=0.01)
    async with failing:
        assert failing._task is not None
        await asyncio.wait([failing._task], timeout=10)
        with pytest.raises(RuntimeError, match="disk on fire"):
            failing.check_ready()
    assert failing._task is None
    await replica.http.close()
    assert replica.follower._task is None and task.cancelled()


# -- the pieces ------------------------------------------------------------------------------


def test_model_from_manifest_infers_the_kind_from_the_tables(tmp_path: Path) -> None:
    def manifest(tables: tuple[TableConfig, ...], config: dict[str, Any], model: str = "ctr") -> Any:
        shard = Shard(ShardSpec(0, 1), tables)
        write_version(tmp_path, model, 1, None, {0: [t.snapshot(None) for t in shard.tables.values()]}, {}, config, 1)
        out = read_manifest(tmp_path / model / "0000000001")
        shutil.rmtree(tmp_path / model)
        return out

    lr = LogisticRegression("ctr", optimizer={"name": "ftrl", "alpha": 0.1})
    got = model_from_manifest(manifest(lr.tables(), {"name": "ctr"}))
    assert isinstance(got, LogisticRegression) and got.tables() == lr.tables()
    fm = FactorizationMachine("m1", k=4, embedding_optimizer={"name": "adagrad", "lr": 0.1}, init_scale=0.02, seed=3)
    for config in ({}, {"model": "fm"}, {"kind": "FactorizationMachine", "name": "m1"}):
        got = model_from_manifest(manifest(fm.tables(), config, model="exports-m1"))
        assert isinstance(got, FactorizationMachine) and got.tables() == fm.tables() and got.name == "m1"
    with pytest.raises(ValueError, match="model_config names 'lr', its tables are fm"):
        model_from_manifest(manifest(fm.tables(), {"model": "lr"}))
    with pytest.raises(ValueError, match="no model in tables"):
        model_from_manifest(manifest((TableConfig("lr"), TableConfig("fm_v", 4)), {}))
    with pytest.raises(ValueError, match="not those of a lr model"):
        model_from_manifest(manifest((TableConfig("ctr_w", 2),), {}))
    # A mixture's linear table (dim 2K) is its linear part, whatever K.
    for mixed in (LogisticRegression("ctr", optimizer=MIX), FactorizationMachine("ctr", k=4, optimizer=MIX)):
        got = model_from_manifest(manifest(mixed.tables(), {"name": "ctr"}))
        assert type(got) is type(mixed) and got.tables() == mixed.tables() and got.mixture is not None
    # Embeddings of a mixture (a table of 2K passes for one): not a model's.
    odd = (TableConfig("ctr_w", 1), TableConfig("ctr_v", 10, {"name": "ftrl_mix"}))
    with pytest.raises(ValueError, match="ctr_v: ftrl_mix mixes the linear table's learners"):
        model_from_manifest(manifest(odd, {}))
    # An empty directory: the given model.
    assert model_of_exports(tmp_path / "nothing", lr) is lr


async def test_a_delta_is_merged_beside_the_served_tables_then_swapped_in(tmp_path: Path) -> None:
    """A delta's merge touches every row held, so it runs beside the served
    tables (in a thread); until it is installed, reads see the version before."""
    table = SparseTable(TableConfig("ctr_w", 1, {"name": "sgd", "lr": 1.0}))
    keys = np.arange(1, 1001, dtype=np.uint64)
    table.push(keys, np.ones(1000))
    base = write_version(tmp_path, "ctr", 1, None, {0: [table.snapshot(None)]}, {}, {"name": "ctr"}, 1)
    table.push(keys[:10], np.ones(10))
    table.delete(keys[10:20])
    delta = write_version(tmp_path, "ctr", 2, 1, {0: [table.snapshot(1)]}, {}, {"name": "ctr"}, 1)
    replica = ReplicaTables()
    replica.apply(load_version(base, serving=True), serving=True)
    before = replica.handle_pull("ctr_w", keys)[0].copy()
    staged = replica.stage(load_version(delta, serving=True), serving=True)
    np.testing.assert_array_equal(replica.handle_pull("ctr_w", keys)[0], before)  # not yet
    assert replica.version == 1
    replica.install(staged)
    assert replica.version == 2 and len(replica.tables["ctr_w"]) == 990
    np.testing.assert_array_equal(replica.handle_pull("ctr_w", keys)[0], table.pull(keys))
    with pytest.raises(ValueError, match="delta of 1; the replica holds 2"):
        replica.stage(load_version(delta, serving=True), serving=True)


def test_apply_version_checks_before_it_changes_anything(tmp_path: Path) -> None:
    config = TableConfig("t", 1, {"name": "sgd", "lr": 0.5})
    src = Shard(ShardSpec(0, 1), (config,))
    table = src.tables["t"]
    table.push(np.arange(1, 11, dtype=np.uint64), np.ones(10))
    write_version(tmp_path, "m", 1, None, {0: [table.snapshot(None)]}, {}, {}, 1)
    table.push(np.arange(5, 16, dtype=np.uint64), np.ones(11))
    table.delete(np.array([1, 2], dtype=np.uint64))
    write_version(tmp_path, "m", 2, 1, {0: [table.snapshot(1)]}, {}, {}, 1)
    base, delta = load_version(tmp_path / "m" / "0000000001"), load_version(tmp_path / "m" / "0000000002")

    replica = Shard()
    with pytest.raises(ValueError, match="delta of 1; table t on shard 0 holds version 0"):
        apply_version([replica], delta)
    assert replica.tables == {}
    apply_version([replica], base)
    with pytest.raises(ValueError, match="which holds rows"):
        apply_version([replica], base)
    snap = delta.snapshots[0][0]
    poisoned = dataclasses.replace(snap, data=np.full_like(snap.data, np.nan))
    with pytest.raises(InvalidValuesError, match="NaN"):
        apply_version([replica], dataclasses.replace(delta, snapshots={0: [poisoned]}))
    assert replica.tables["t"].last_snapshot == 1 and len(replica.tables["t"]) == 10
    apply_version([replica], delta)
    keys = np.arange(1, 16, dtype=np.uint64)
    np.testing.assert_array_equal(replica.handle_pull("t", keys)[0], src.handle_pull("t", keys)[0])
    assert (len(replica.tables["t"]), replica.tables["t"].version) == (13, 3)


async def test_follow_dir_takes_a_model_directory_or_an_exports_root(tmp_path: Path) -> None:
    # A replica started on an empty exports root finds <model>/ once it appears.
    follower = Follower(tmp_path / "exports", make_model("lr", "ctr"))
    assert await follower.poll() is False and follower.model_dir == tmp_path / "exports"
    trainer = await trained(tmp_path / "exports", versions=1)
    assert await follower.poll() is True and follower.model_dir == trainer.model_dir
    assert follow_dir(trainer.model_dir, "ctr") == trainer.model_dir
    assert follow_dir(tmp_path / "exports", "ctr") == trainer.model_dir
    assert follow_dir(tmp_path / "exports", "other") == tmp_path / "exports"
    assert follow_dir(tmp_path / "nothing", "ctr") == tmp_path / "nothing"


def test_serve_follow_settings_and_flags() -> None:
    parse = build_parser().parse_args
    s = ApiSettings.from_args(parse(["serve", "--follow", "exports/ctr", "--follow-interval", "0.25"]), env={})
    assert (s.follow, s.follow_interval_s, s.shards) == ("exports/ctr", 0.25, ())
    env = {"CTRPS_FOLLOW": "x/ctr", "CTRPS_FOLLOW_INTERVAL": "2"}
    s = ApiSettings.from_args(parse(["serve"]), env=env)
    assert (s.follow, s.follow_interval_s) == ("x/ctr", 2.0)
    # A flag for one source overrides a variable for the other.
    s = ApiSettings.from_args(parse(["serve", "--shards", "http://a:1"]), env=env)
    assert (s.shards, s.follow) == (("http://a:1",), "")
    with pytest.raises(SettingsError, match="exclusive"):
        ApiSettings.from_args(parse(["serve"]), env={**env, "CTRPS_SHARDS": "http://a:1"})
    with pytest.raises(SettingsError, match="--follow exports/<model>"):
        ApiSettings.from_args(parse(["serve"]), env={})
    with pytest.raises(SettingsError, match="follow interval"):
        ApiSettings(follow="x", follow_interval_s=0.0)
    with pytest.raises(SystemExit):
        parse(["serve", "--shards", "http://a:1", "--follow", "x"])


# -- ctrps serve --follow ----------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
async def test_ctrps_serve_follow_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    trainer = await trained(tmp_path, versions=2)
    # The exports root: the replica follows its ctr/ (the default model name).
    async with ctrps_process(
        "serve", "--follow", str(tmp_path), "--port", "0", "--follow-interval", "0.05", "--log-format", "json"
    ) as proc:
        assert proc.stderr is not None
        lines: list[dict[str, Any]] = []

        async def read_until(msg: str) -> dict[str, Any]:
            assert proc.stderr is not None
            while True:
                line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
                assert line, f"ctrps serve exited before {msg!r}: {lines}"
                lines.append(orjson.loads(line))
                if lines[-1]["msg"] == msg:
                    return lines[-1]

        async def wait_for_version(http: aiohttp.ClientSession, url: str, version: int) -> list[float]:
            got: list[float] = []

            async def serves() -> bool:
                async with http.post(url + "/v1/predict", data=orjson.dumps({"events": PROBE})) as resp:
                    body = orjson.loads(await resp.read())
                if resp.status == 200 and body["model_version"] == version:
                    got.extend(body["predictions"])
                return bool(got)

            await until(serves, 30, what=f"the replica serving version {version}", poll_s=0.05)
            return got

        started = await read_until("listening")
        assert started["follow"] == str(tmp_path) and started["model"] == "ctr"
        url = started["url"]
        async with aiohttp.ClientSession() as http:
            got = await wait_for_version(http, url, 2)
            np.testing.assert_allclose(got, trainer.expected[2], rtol=1e-12, atol=0)
            async with http.get(url + "/readyz") as resp:
                assert resp.status == 200
            await trainer.train(events(np.random.default_rng(21), 100, sites=30))
            assert await trainer.cut() == 3
            got = await wait_for_version(http, url, 3)
            np.testing.assert_allclose(got, trainer.expected[3], rtol=1e-12, atol=0)
            async with http.get(url + "/v1/model") as resp:
                info = orjson.loads(await resp.read())
            assert info["served_version"] == 3 and info["follow"]["interval_s"] == 0.05
            assert info["follow"]["dir"] == str(trainer.model_dir)
        proc.send_signal(signal.SIGTERM)
        await read_until("stopped")
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


def test_serve_help_shows_the_follow_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "ctrps serve --follow exports/ctr" in out and "--follow-interval" in out and "CTRPS_FOLLOW" in out
