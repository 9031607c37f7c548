"""Many models in one cluster: the registry (`ps_core.checkpoint.registry`),
the coordinator's offsets per model, one directory per model in every cut,
restores of every model together, the shard's model routes and ``ctrps
model``, over real shards (in process and on loopback) and real files."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest
from conftest import ServeShards
from streams import bias_shows, brisk_worker_config, keyed_event, new_topic, produce, running
from waiting import until

from app.status import make_status_hook, summarize
from consumers.training import GeoTraining
from consumers.worker import Worker
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain, list_versions, read_manifest, version_dirs
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.joining import newest_loadable, restore_chains
from ps_core.checkpoint.registry import MODEL_FILE, ModelRegistry, ModelSpec
from ps_core.errors import (
    InvalidRequestError,
    ModeConflictError,
    ModelConflictError,
    TableConflictError,
    UnknownModelError,
)
from ps_core.model.featurizer import DEFAULT_NUMERIC, FeatureHasher, numeric_feed
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

PROJECT = Path(__file__).resolve().parents[1]
W = 10
"""The linear table's dim of a model of the default optimizer: 5 FTRL learners' weights, then their log-weights."""


def _spec(kind: str, name: str, **kwargs: object) -> ModelSpec:
    return ModelSpec.of(make_model(kind, name, **kwargs))


async def _train(client: PSClient, table: str, dim: int, keys: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    grads = rng.normal(size=(keys.size, dim)).astype(np.float32)
    counts = np.stack([np.ones(keys.size), rng.integers(0, 2, keys.size)], axis=1).astype(np.float32)
    routed = client.route(keys)
    await client.pull(table, routed)  # as a worker does: pull, then push the same keys
    await client.push(table, routed, grads, counts=counts, event_time=1_764_681_600.0 + seed)


def test_a_spec_round_trips_and_rebuilds_its_model() -> None:
    fm = _spec("fm", "feed", k=4, optimizer={"name": "adagrad", "lr": 0.1}, mode="geo")
    again = ModelSpec.from_dict(orjson.loads(orjson.dumps(fm.to_dict())))
    assert again == fm and again.kind == "fm" and again.mode == "geo"
    assert ModelSpec.from_recipe(orjson.loads(orjson.dumps(fm.recipe()))) == fm
    with pytest.raises(InvalidRequestError, match="model x"):
        ModelSpec.from_recipe({"name": "x", "optimizer": {"name": "ftrl", "alpha": -1}})
    model = again.build()
    assert model.table_names == ("feed_w", "feed_v") and model.tables() == fm.tables
    with pytest.raises(InvalidRequestError, match="type must be lr or fm"):
        ModelSpec.from_dict({**fm.to_dict(), "type": "gbdt"})
    with pytest.raises(InvalidRequestError, match="has no table feed_v"):
        ModelSpec.from_dict({**fm.to_dict(), "tables": fm.to_dict()["tables"][:1]})
    with pytest.raises(InvalidRequestError, match="bad model name"):
        ModelSpec.from_dict({**fm.to_dict(), "name": "../x"})
    with pytest.raises(InvalidRequestError, match="update_mode"):
        ModelSpec.from_dict({**fm.to_dict(), "update_mode": "async"})


def test_the_registry_creates_once_refuses_conflicts_and_survives_a_restart(tmp_path: Path) -> None:
    reg = ModelRegistry(tmp_path, "ctr")
    ads = _spec("lr", "ads")
    assert reg.create(ads) and not reg.create(ads)  # the same declaration again: no change
    assert (tmp_path / "ads" / MODEL_FILE).is_file()
    with pytest.raises(ModelConflictError, match="exists as lr"):
        reg.create(_spec("lr", "ads", optimizer={"name": "sgd", "lr": 0.1}))
    with pytest.raises(ModelConflictError, match="exists as lr"):
        reg.create(_spec("fm", "ads"))
    assert reg.names() == ["ctr", "ads"]
    assert reg.owner("ads_w") == "ads" and reg.owner("emb") == "ctr"  # a hand-declared table: the default's
    assert reg.split(["ads_w", "ctr_w", "x"]) == {"ctr": ["ctr_w", "x"], "ads": ["ads_w"]}
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / MODEL_FILE).write_text("{not json")
    again = ModelRegistry.load(tmp_path, "ctr")  # the broken one is logged and skipped
    assert again.names() == ["ctr", "ads"] and again.get("ads") == ads
    with pytest.raises(UnknownModelError):
        again.check("nope")
    assert again.delete("ads") == ads
    assert not (tmp_path / "ads" / MODEL_FILE).exists() and (tmp_path / "ads" / "model.json.deleted").exists()
    assert ModelRegistry.load(tmp_path, "ctr").names() == ["ctr"]
    with pytest.raises(UnknownModelError):
        again.delete("ads")


async def test_a_cut_writes_each_model_with_its_offsets_and_a_restore_loads_them_all(tmp_path: Path) -> None:
    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "ctr")
    control.serve_exports(exporter)
    ctr, ads = _spec("lr", "ctr"), _spec("fm", "ads", k=4)
    for spec in (ctr, ads):
        assert (await control.create_model(spec.declaration())).created
    assert [m.name for m in (await control.models()).models] == ["ctr", "ads"]
    # Each table as its declaration's model (`Table`), as a declaration answers.
    assert [(t.name, t.dim, t.mode) for t in (await control.model_info("ads")).tables] == [
        ("ads_w", W, "async"),
        ("ads_v", 4, "async"),
    ]
    keys = np.arange(1, 400, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    await _train(client, "ctr_w", W, keys[:300], 1)
    await _train(client, "ads_w", W, keys[100:], 2)
    await _train(client, "ads_v", 4, keys[100:], 3)
    # One topic, two consumer groups: each model's windows commit their own offsets.
    lease = (await control.acquire_lease("w1")).lease_id
    await control.release_lease(lease, {"clicks": {0: 10}})
    lease = (await control.acquire_lease("w2")).lease_id
    await control.release_lease(lease, {"clicks": {0: 99}}, model="ads")
    assert await control.coordinator_offsets() == {"clicks": {0: 10}}
    assert await control.coordinator_offsets("ads") == {"clicks": {0: 99}}
    with pytest.raises(UnknownModelError):
        await control.release_lease(lease, {"clicks": {0: 1}}, model="nope")

    base = await exporter.cut()
    assert base.kind == "base" and sorted(base.models) == ["ads", "ctr"]
    assert (base.rows, base.models["ads"]["rows"]) == (300, 2 * 299)
    ctr_m, ads_m = (read_manifest(version_dirs(tmp_path / m)[1]) for m in ("ctr", "ads"))
    assert set(ctr_m.tables) == {"ctr_w"} and set(ads_m.tables) == {"ads_w", "ads_v"}
    assert (ctr_m.offsets, ads_m.offsets) == ({"clicks": {0: 10}}, {"clicks": {0: 99}})
    assert ads_m.model_config["type"] == "fm"

    await _train(client, "ads_w", W, keys[:50], 4)
    lease = (await control.acquire_lease("w2")).lease_id
    await control.release_lease(lease, {"clicks": {0: 120}}, model="ads")
    delta = await exporter.cut()
    assert (delta.version, delta.kind, delta.rows, delta.models["ads"]["rows"]) == (2, "delta", 0, 50)
    assert (await control.exports("ads")).versions[-1].version == 2

    # A restart restores every model at one version, each with its own offsets.
    chains, refusals = newest_loadable(tmp_path / "ctr")
    assert chains is not None and not refusals and sorted(chains) == ["ads", "ctr"]
    restored = restore_chains(chains, 2, [0, 1])
    assert restored.version == 2 and restored.offsets == {"clicks": {0: 10}}
    assert chains["ads"][-1].manifest.offsets == {"clicks": {0: 120}}
    for got, had in zip(restored.shards, shards):
        for t in ("ctr_w", "ads_w", "ads_v"):
            assert len(got.tables[t]) == len(had.tables[t])
            np.testing.assert_array_equal(got.tables[t].pull(keys), had.tables[t].pull(keys))

    # A damaged file of one model makes the version unloadable for all: the one before loads.
    bad = next(p for p in version_dirs(tmp_path / "ads")[2].iterdir() if p.name.startswith("shard-"))
    bad.write_bytes(bad.read_bytes()[:-3] + b"xyz")
    chains, refusals = newest_loadable(tmp_path / "ctr")
    assert chains is not None and chains["ctr"][-1].version == 1 and len(refusals) == 1

    # Deleting a model drops its tables everywhere and keeps its files.
    deleted = await control.delete_model("ads")
    assert sorted(deleted.tables_dropped) == ["ads_v", "ads_w"] and deleted.exports == str(tmp_path / "ads")
    assert all("ads_w" not in s.tables for s in shards) and version_dirs(tmp_path / "ads")
    with pytest.raises(UnknownModelError):
        await control.model_info("ads")
    with pytest.raises(ModelConflictError, match="default model"):
        await control.delete_model("ctr")
    third = await exporter.cut()
    assert sorted(third.models) == ["ctr"] and third.kind == "base"  # the registry changed: a base


async def test_a_model_created_later_starts_its_directory_with_a_base(tmp_path: Path) -> None:
    coord = Coordinator()
    shards = [Shard(ShardSpec(0, 1))]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "ctr")
    control.serve_exports(exporter)
    await control.create_model(_spec("lr", "ctr").declaration())
    await _train(client, "ctr_w", W, np.arange(1, 20, dtype=np.uint64), 1)
    assert (await exporter.cut()).kind == "base"
    assert (await exporter.cut()).kind == "delta"
    await control.create_model(_spec("lr", "late").declaration())
    await _train(client, "late_w", W, np.arange(1, 5, dtype=np.uint64), 2)
    third = await exporter.cut()
    assert third.kind == "base" and [v.version for v in list_versions(tmp_path / "late")] == [3]
    assert (await exporter.cut()).kind == "delta"
    assert [v.version for v in latest_chain(tmp_path / "late")] == [3, 4]


@pytest.mark.slow
@pytest.mark.process
async def test_model_routes_over_http_and_ctrps_model(tmp_path: Path, serve_shards: ServeShards) -> None:
    shards, urls = await serve_shards(2, (), tmp_path)

    async def ctrps_model(*args: str, code: int = 0) -> dict[str, object]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            "model",
            *args,
            "--shard0",
            urls[0],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=PROJECT,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == code, err.decode()
        if code:
            assert "Traceback" not in err.decode() and len(err.decode().strip().splitlines()) == 1
            return {"stderr": err.decode()}
        got: dict[str, object] = orjson.loads(out)
        return got

    created = await ctrps_model("create", "ads", "--type", "fm", "--factors", "4", "--optimizer", "ftrl,alpha=0.1")
    assert created["created"] is True
    model = created["model"]
    assert isinstance(model, dict) and model["type"] == "fm" and model["tables"][0]["optimizer"]["alpha"] == 0.1
    assert all(s.tables["ads_v"].dim == 4 for s in shards)  # declared on every shard
    assert (await ctrps_model("create", "ads", "--type", "fm", "--factors", "4", "--optimizer", "ftrl,alpha=0.1"))[
        "created"
    ] is False
    conflict = await ctrps_model("create", "ads", "--type", "lr", code=1)
    assert "model_conflict" in conflict["stderr"]  # type: ignore[operator]
    listed = await ctrps_model("list")
    assert listed["default"] == "ctr" and [m["name"] for m in listed["models"]] == ["ctr", "ads"]  # type: ignore[union-attr,index]
    assert (await ctrps_model("show", "ads"))["type"] == "fm"
    missing = await ctrps_model("show", "nope", code=1)
    assert "unknown_model" in missing["stderr"]  # type: ignore[operator]
    bad = await ctrps_model("create", "x", "--optimizer", "ftrl,alpha=lots", code=2)
    assert "not a number" in bad["stderr"]  # type: ignore[operator]
    scaled = await ctrps_model("create", "scaled", "--numeric", "log1p/4")
    assert scaled["model"]["numeric"] == "log1p/4"  # type: ignore[index]
    async with ControlClient.connect(urls) as control:
        # The shards keep the model's tables as created: another mode is refused.
        with pytest.raises(ModeConflictError):
            await control.declare(make_model("fm", "ads", k=4, mode="sync").tables()[1])
        with pytest.raises(ModelConflictError):
            await control.create_model(_spec("fm", "ads", k=4, optimizer={"name": "sgd", "lr": 1.0}).declaration())
        # A table declared by hand with another optimizer: the model is not created.
        await control.declare(make_model("lr", "hand", optimizer={"name": "sgd", "lr": 1.0}).tables()[0])
        with pytest.raises(TableConflictError):
            await control.create_model(_spec("lr", "hand").declaration())
        with pytest.raises(UnknownModelError):
            await control.model_info("hand")
        for numeric in ("log1p/0", "sqrt"):  # refused by shard 0, in the schema or by the feed's check
            with pytest.raises(InvalidRequestError, match="numeric"):
                await control.create_model(msgspec.structs.replace(_spec("lr", "zero").declaration(), numeric=numeric))
        assert (await control.exports("ads")).model == "ads"
        with pytest.raises(UnknownModelError):
            await control.exports("nope")
    deleted = await ctrps_model("delete", "ads")
    assert sorted(deleted["tables_dropped"]) == ["ads_v", "ads_w"]  # type: ignore[arg-type]
    assert all("ads_w" not in s.tables for s in shards)


@pytest.mark.slow
async def test_one_worker_trains_several_models_on_one_decode(
    kafka_bootstrap: str, serve_shards: ServeShards, tmp_path: Path
) -> None:
    """``--also-train``: every event trained once per model, each in its own
    namespace and tables with the declaration it was created with, one commit,
    each model's offsets in its own cut, each model's progress on the board."""
    shards, urls = await serve_shards(2, (), tmp_path)
    topic, group = await new_topic(kafka_bootstrap, 2)
    n, bad = 600, 5
    values = [keyed_event(i) for i in range(n)] + [b"{not json"] * bad
    async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
        # "feed" is created first as an FM: the worker trains it as created.
        await control.create_model(_spec("fm", "feed", k=4, numeric="raw").declaration())
        config = brisk_worker_config(kafka_bootstrap, topic, group, 200, 64)
        worker = Worker(
            config, client, control, make_model("lr", "m"), also=[make_model("lr", "ads"), make_model("lr", "feed")]
        )
        worker.on_window = make_status_hook(control, "w", worker.stats, model="m")
        for a in worker.also:
            a.on_window = make_status_hook(control, f"w/{a.model.name}", a.stats, model=a.model.name)
        async with running(worker) as task:
            await produce(kafka_bootstrap, topic, values, 2)
            await until(
                lambda: all(bias_shows(shards, ns) >= n for ns in ("m", "ads", "feed")),
                60,
                what="every model",
                task=task,
            )
            await until(lambda: worker.stats.records >= n + bad, 30, what="the dead letters", task=task)
        assert [bias_shows(shards, ns) for ns in ("m", "ads", "feed")] == [n, n, n]  # once each
        assert [type(a.model).__name__ for a in worker.also] == ["LogisticRegression", "FactorizationMachine"]
        assert [a.model.numeric for a in worker.also] == [DEFAULT_NUMERIC, "raw"]  # the default; as created
        assert all("feed_v" in s.tables for s in shards)
        # Each model its own namespace: the same feature, three keys.
        keys = {FeatureHasher(ns).bias_key for ns in ("m", "ads", "feed")}
        assert len(keys) == 3
        assert worker.stats.events_trained == n and [a.stats.events_trained for a in worker.also] == [n, n]
        assert worker.stats.dead_letters == bad and all(a.stats.dead_letters == bad for a in worker.also)
        offsets = await control.coordinator_offsets("m")
        assert sum(offsets[topic].values()) == n + bad
        for name in ("ads", "feed"):
            assert await control.coordinator_offsets(name) == offsets
        board = await control.statuses()
        for name in ("m", "ads", "feed"):
            got = summarize(board, name)
            assert got.events_trained == n and got.last_window is not None, name
        cut = await control.export_now()
        assert sorted(cut.models) == ["ads", "ctr", "feed", "m"]
        for name in ("m", "ads", "feed"):
            manifest = read_manifest(version_dirs(tmp_path / name)[cut.version])
            assert manifest.offsets == offsets


async def test_a_replica_follows_every_model_of_an_exports_root(tmp_path: Path) -> None:
    """``ctrps serve --follow ROOT --follow-all``: each model from its own
    directory, predicting as the trainer's API did at the cut."""
    from aiohttp.test_utils import TestClient, TestServer

    from app.api import create_app
    from app.api.follower import Follower, followed_models, model_of_exports
    from app.api.state import SERVED
    from app.config.serve import ApiSettings

    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "ctr")
    control.serve_exports(exporter)
    ctr, ads = make_model("lr", "ctr"), make_model("fm", "ads", k=4, numeric="log1p")
    for model in (ctr, ads):
        await control.create_model(ModelSpec.of(model).declaration())
    rng = np.random.default_rng(3)
    events = [
        {"label": int(rng.random() < 0.3), "features": {"site": f"s{rng.integers(20)}", "n": float(rng.integers(50))}}
        for _ in range(200)
    ]
    probe = [{"features": e["features"]} for e in events[:8]]
    for model in (ctr, ads):
        batch, _ = model.hasher().featurize(events)
        plan = model.plan(batch)
        routed = client.route(plan.keys)
        w = {t: await client.pull(t, routed) for t in model.table_names}
        p = 1 / (1 + np.exp(-model.logits(batch, plan, w)))
        for t, g in model.gradients(batch, plan, w, (p - batch.labels) * batch.weights).items():
            await client.push(t, routed, g, counts=plan.counts(batch.labels))
    cut = await exporter.cut()
    (tmp_path / "notes").mkdir()  # neither a model.json nor versions: not a model
    found = followed_models(tmp_path, "ctr")
    assert list(found) == ["ctr", "ads"] and found["ads"] == tmp_path / "ads"

    live = TestClient(TestServer(create_app(ApiSettings(), client, ctr, control=control)))
    follower = Follower(tmp_path / "ctr", model_of_exports(tmp_path / "ctr", ctr), interval_s=3600)
    others = {"ads": Follower(tmp_path / "ads", model_of_exports(tmp_path / "ads", ctr), interval_s=3600)}
    app = create_app(ApiSettings(), follower.client, follower.model, follower=follower, followers=others)
    replica = TestClient(TestServer(app))
    async with live, replica:
        for name in ("ctr", "ads"):
            want = await (await live.post(f"/v1/models/{name}/predict", json={"events": probe})).json()
            answers: list[dict[str, Any]] = []

            async def served(name: str = name, answers: list[dict[str, Any]] = answers) -> bool:
                answers.append(await (await replica.post(f"/v1/models/{name}/predict", json={"events": probe})).json())
                return answers[-1].get("model_version") == cut.version

            # The followers' first polls run as the app starts.
            await until(served, 10, what=f"the replica to serve {name} at version {cut.version}")
            got = answers[-1]
            assert got.get("model") == name and got["model_version"] == cut.version, got
            np.testing.assert_allclose(got["predictions"], want["predictions"], rtol=1e-6)
        listed = await (await replica.get("/v1/models")).json()
        assert [(m["name"], m["type"]) for m in listed["models"]] == [("ctr", "lr"), ("ads", "fm")]
        assert app[SERVED].predictors["ads"].model.numeric == "log1p"  # from the manifest
        info = await (await replica.get("/v1/model?model=ads")).json()
        assert info["model"] == "ads" and info["served_version"] == cut.version
        assert info["follow"]["dir"] == str(tmp_path / "ads")
        versions = await (await replica.get("/v1/exports?model=ads")).json()
        assert versions["model"] == "ads" and [v["version"] for v in versions["versions"]] == [cut.version]
        gone = await replica.post("/v1/models/nope/predict", json={"events": probe})
        assert gone.status == 404 and (await gone.json())["error"] == "unknown_model"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "geo"])
async def test_one_worker_trains_several_models_in_sync_and_geo_mode(
    kafka_bootstrap: str, serve_shards: ServeShards, tmp_path: Path, mode: str
) -> None:
    """``--also-train`` in sync and geo mode: each model trains in the
    worker's mode (sync: at its own barrier; geo: its own local copy), every
    event counted once per model, one commit for both."""
    shards, urls = await serve_shards(2, (), tmp_path)
    topic, group = await new_topic(kafka_bootstrap, 2)
    n = 600
    async with PSClient.connect(urls) as client, ControlClient.connect(urls) as control:
        config = brisk_worker_config(kafka_bootstrap, topic, group, 200, 64, mode=mode, geo_steps=2)
        worker = Worker(
            config, client, control, make_model("lr", "m", mode=mode), also=[make_model("fm", "ads", mode=mode)]
        )
        async with running(worker) as task:
            await produce(kafka_bootstrap, topic, (keyed_event(i) for i in range(n)), 2)
            await until(
                lambda: all(bias_shows(shards, ns) >= n for ns in ("m", "ads")), 60, what="both models", task=task
            )
        assert [bias_shows(shards, ns) for ns in ("m", "ads")] == [n, n]  # once each
        assert worker.stats.events_trained == n == worker.also[0].stats.events_trained
        assert sum((await control.coordinator_offsets("ads"))[topic].values()) == n
        if mode == "sync":
            assert worker.stats.sync_steps > 0 and worker.also[0].stats.sync_steps > 0
            # Each model's steps applied to its own tables, on every shard.
            assert all(sorted(s.sync_steps) == ["ads_v", "ads_w", "m_w"] for s in shards)
            assert all(t.held_keys == 0 for s in shards for t in s.tables.values())
        else:
            assert worker.geo is not None and worker.stats.geo_rounds > 0 and worker.also[0].stats.geo_rounds > 0
            also = worker.also[0].training
            assert isinstance(also, GeoTraining) and also.copy is not worker.geo and len(also.copy) > 0


def test_also_train_settings() -> None:
    from app.cli import build_parser
    from app.config.declared import SettingsError
    from app.config.worker import WorkerSettings

    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:1"]
    s = WorkerSettings.from_args(build_parser().parse_args([*base, "--also-train", "a", "--also-train", "b"]), env={})
    assert s.also_train == ("a", "b")
    s = WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_ALSO_TRAIN": "a, b"})
    assert s.also_train == ("a", "b")
    for flags, message in (
        (["--also-train", "ctr"], "names a model twice"),
        (["--also-train", "a", "--also-train", "a"], "names a model twice"),
        (["--also-train", "../x"], "bad model name"),
    ):
        with pytest.raises(SettingsError, match=message):
            WorkerSettings.from_args(build_parser().parse_args([*base, *flags]), env={})
    s = WorkerSettings.from_args(build_parser().parse_args([*base, "--also-train", "a", "--mode", "geo"]), env={})
    assert s.also_train == ("a",) and s.mode == "geo"
    with pytest.raises(ValueError, match="model a's tables are declared for mode async, the worker runs mode sync"):
        Worker(
            brisk_worker_config("k:9092", "t", "g", 10, 10, mode="sync"),
            PSClient.local([Shard()]),
            ControlClient.local([Shard()]),
            make_model("lr", "m", mode="sync"),
            also=[make_model("lr", "a")],
        )
    with pytest.raises(ValueError, match="model m's tables are declared for mode geo, the worker runs mode sync"):
        Worker(
            brisk_worker_config("k:9092", "t", "g", 10, 10, mode="sync"),
            PSClient.local([Shard()]),
            ControlClient.local([Shard()]),
            make_model("lr", "m", mode="geo"),
        )


def test_help_prose_fits_80_columns() -> None:
    """Every command's --help is readable in an 80-column terminal: prose is
    wrapped; only example command lines (and argparse's own usage and flag
    columns) may run longer."""
    from app.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.choices and "shard" in a.choices)  # the subcommands
    for name, command in sub.choices.items():
        text = command.format_help()
        long = [
            line
            for line in text.splitlines()
            if len(line) > 80
            and not line.lstrip().startswith(("ctrps ", "curl ", "--", "export ", "CTRPS_", "[", "-"))
            and not line.startswith(("usage:", " " * 6))
        ]
        assert long == [], (name, long)


def test_numeric_values_fed_as_log1p_keep_their_ids() -> None:
    event = {"label": 0, "features": {"I1": 10.0, "I2": -3.0, "c": "x"}}
    raw, _ = FeatureHasher("m", numeric="raw").featurize([event])
    logs, _ = FeatureHasher("m", numeric="log1p").featurize([event])
    eighths, _ = FeatureHasher("m", numeric="log1p/8").featurize([event])
    halves, _ = FeatureHasher("m", numeric="raw/2.5").featurize([event])
    np.testing.assert_array_equal(raw.keys, logs.keys)
    np.testing.assert_array_equal(raw.keys, eighths.keys)
    np.testing.assert_allclose(raw.values, [1, 10, -3, 1])
    np.testing.assert_allclose(logs.values, [1, np.log1p(10), -np.log1p(3), 1], rtol=1e-6)
    np.testing.assert_allclose(eighths.values, [1, np.log1p(10) / 8, -np.log1p(3) / 8, 1], rtol=1e-6)
    np.testing.assert_allclose(halves.values, [1, 4, -1.2, 1], rtol=1e-6)  # only numbers are divided
    for bad in ("sqrt", "log1p/0", "log1p/-2", "log1p/", "log1p/x", "log1p/8\n", "Log1p", "raw/1e3"):
        with pytest.raises(ValueError, match="numeric"):
            FeatureHasher("m", numeric=bad)
        with pytest.raises(ValueError, match="numeric"):
            make_model("lr", "m", numeric=bad)
    # What /v1/weights reports: a number as the model is fed it.
    np.testing.assert_allclose(FeatureHasher("m").fed_values([10.0, -3.0]), eighths.values[1:3] / 2)
    assert FeatureHasher("m", numeric="raw").fed_values([10.0, -3.0]).tolist() == [10.0, -3.0]
    spec = _spec("lr", "m", numeric="log1p")
    assert ModelSpec.from_dict(orjson.loads(orjson.dumps(spec.to_dict()))).build().numeric == "log1p"
    assert ModelSpec.from_recipe(spec.recipe()) == spec
    old = {k: v for k, v in spec.to_dict().items() if k != "numeric"}  # a declaration from before the choice
    assert ModelSpec.from_dict(old).numeric == "raw"
    with pytest.raises(InvalidRequestError, match="numeric"):
        ModelSpec.from_dict({**spec.to_dict(), "numeric": "log1p/0"})
    # A new model's default is log1p/16, also in a recipe that names none.
    assert _spec("lr", "m").numeric == DEFAULT_NUMERIC == "log1p/16"
    assert ModelSpec.from_recipe({k: v for k, v in spec.recipe().items() if k != "numeric"}).numeric == "log1p/16"
    reg = ModelRegistry(None, "ctr")
    reg.create(_spec("lr", "m", numeric="raw"))
    with pytest.raises(ModelConflictError, match="numeric"):
        reg.create(spec)


async def test_the_api_serves_its_model_as_the_cluster_declared_it(tmp_path: Path) -> None:
    from app.roles.serve import as_declared

    coord = Coordinator()
    shards = [Shard(ShardSpec(0, 1))]
    control = ControlClient.local(shards, coord)
    flags = make_model("lr", "ctr", numeric="raw")
    assert (await as_declared(control, flags)).numeric == "raw"  # no exporter: the flags'
    exporter = Exporter(coord, control, tmp_path, "ctr")
    control.serve_exports(exporter)
    assert (await as_declared(control, flags)).numeric == "raw"  # not created: the flags'
    await control.create_model(_spec("lr", "ctr", numeric="log1p").declaration())
    assert (await as_declared(control, flags)).numeric == "log1p"


async def test_a_replica_following_every_model_serves_one_created_after_it_started(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``--follow-all`` is every model of the root, not only those there at
    start: a model created later is followed once a request names it (or
    lists the models); a damaged declaration is one log line, and the models
    followed stay served."""
    from aiohttp.test_utils import TestClient, TestServer

    from app.api import create_app
    from app.api.follower import Follower, model_of_exports
    from app.config.serve import ApiSettings
    from app.roles.serve import new_followers

    coord = Coordinator()
    shards = [Shard(ShardSpec(0, 1))]
    control = ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, tmp_path, "ctr")
    control.serve_exports(exporter)
    ctr = make_model("lr", "ctr")
    await control.create_model(ModelSpec.of(ctr).declaration())
    await exporter.cut()
    settings = ApiSettings(model_name="ctr", follow=str(tmp_path), follow_all=True)
    discover = functools.partial(new_followers, tmp_path, settings)
    assert await asyncio.to_thread(discover, {"ctr"}) == {}  # only the default model so far
    follower = Follower(tmp_path / "ctr", model_of_exports(tmp_path / "ctr", ctr), interval_s=0.1)
    app = create_app(settings, follower.client, follower.model, follower=follower, followers={}, discover=discover)
    probe = {"events": [{"features": {"site": "s1"}}]}
    async with TestClient(TestServer(app)) as replica:
        assert (await replica.post("/v1/models/ads/predict", json=probe)).status == 404
        ads = make_model("fm", "ads", k=4)
        await control.create_model(ModelSpec.of(ads).declaration())
        cut = await exporter.cut()

        async def served() -> bool:
            resp = await replica.post("/v1/models/ads/predict", json=probe)
            return resp.status == 200 and (await resp.json())["model_version"] == cut.version

        await until(served, 10, what="the replica to serve the new model")
        listed = await (await replica.get("/v1/models")).json()
        assert [(m["name"], m["type"]) for m in listed["models"]] == [("ctr", "lr"), ("ads", "fm")]
        # A model created and not yet cut is not followed: its type is known from its first version.
        await control.create_model(ModelSpec.of(make_model("lr", "later")).declaration())
        assert (tmp_path / "later" / MODEL_FILE).is_file()
        assert await asyncio.to_thread(discover, {"ctr", "ads"}) == {}


async def test_a_failed_look_for_new_models_is_one_line_and_the_followed_models_stay_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from app.api import create_app
    from app.api.follower import Follower
    from app.config.serve import ApiSettings

    def unreadable_root(known: Any) -> dict[str, Follower]:
        # An exports root this process may no longer read (root here reads all).
        raise PermissionError(13, "Permission denied", str(tmp_path))

    follower = Follower(tmp_path / "ctr", make_model("lr", "ctr"), interval_s=3600)
    app = create_app(
        ApiSettings(), follower.client, follower.model, follower=follower, followers={}, discover=unreadable_root
    )
    caplog.set_level(logging.INFO, logger="ctrps.api")
    async with TestClient(TestServer(app)) as replica:
        resp = await replica.post("/v1/models/ads/predict", json={"events": [{"features": {"site": "s1"}}]})
        assert resp.status == 404 and (await resp.json())["error"] == "unknown_model"
        listed = await (await replica.get("/v1/models")).json()  # within the second: not looked again
        assert [m["name"] for m in listed["models"]] == ["ctr"]
    failed = [r for r in caplog.records if r.getMessage() == "looking for new models failed"]
    assert len(failed) == 1 and "Permission denied" in failed[0].fields["error"]  # type: ignore[attr-defined]
    assert not [r for r in caplog.records if r.exc_info], "a traceback"


@pytest.mark.parametrize(
    ("numeric", "valid"),
    [("raw", True), ("log1p", True), ("log1p/16", True), ("raw/2.5", True), ("log1p/0.000001", True)]
    + [("log1p/999999.999999", True), ("log1p/0", False), ("log1p/0.0", False), ("log1p/1234567", False)]
    + [("log1p/", False), ("log1p/1.", False), ("log1p/.5", False), ("log1p/-1", False), ("log1p/1e3", False)]
    + [("raw/0.000000", False), ("log1p/000000.000000", False), ("log1p/016", True), ("raw/0.10", True)]
    + [("raw/0000001", False), ("raw/0.0000001", False)]
    + [("log1p/16\n", False), (" log1p", False), ("LOG1P", False), ("sqrt", False), ("", False)],
)
def test_the_documents_and_the_check_agree_on_numeric_feeds(numeric: str, valid: bool) -> None:
    """The pattern both documents publish (msgspec checks it) takes what
    `numeric_feed` takes, a divisor of 0 included: no valid request of the
    documents' is refused."""
    from app.api.payloads import CreateModelRequest
    from ps_core.net.control_messages import ModelDeclaration

    def schema_takes(model: type) -> bool:
        try:
            msgspec.convert({"name": "m", "numeric": numeric}, model)
            return True
        except msgspec.ValidationError:
            return False

    assert schema_takes(CreateModelRequest) == schema_takes(ModelDeclaration) == valid
    if valid:
        numeric_feed(numeric)
    else:
        with pytest.raises(ValueError, match="numeric"):
            numeric_feed(numeric)


@pytest.mark.slow
@pytest.mark.process
async def test_a_worker_takes_its_models_type_and_mode_unless_given(
    tmp_path: Path, serve_shards: ServeShards, kafka_bootstrap: str
) -> None:
    """A worker naming a created model takes its type and update mode where
    no flag or variable gives them; one given that differs is refused in one
    line (exit 1)."""
    from app.cli import build_parser
    from app.config.worker import WorkerSettings
    from app.roles.worker import _as_declared
    from consumers.broker import free_port
    from consumers.outage import OutageDeadlineError
    from ps_core.net.endpoint import RetryPolicy

    _, urls = await serve_shards(1, (), tmp_path)
    base = ["worker", "--bootstrap", kafka_bootstrap, "--shards", urls[0], "--model-name", "feed"]

    def settings(*flags: str, **env: str) -> WorkerSettings:
        return WorkerSettings.from_args(build_parser().parse_args([*base, *flags]), env=env)

    async def as_declared(s: WorkerSettings, control: ControlClient) -> WorkerSettings:
        got = await _as_declared(s, control, asyncio.Event())
        assert got is not None
        return got

    async with ControlClient.connect(urls) as control:
        plain = await as_declared(settings(), control)
        assert (plain.model, plain.mode) == ("lr", "async")  # nobody created feed: the flags' defaults
        await control.create_model(_spec("fm", "feed", k=4, mode="geo").declaration())
        taken = await as_declared(settings(), control)
        assert (taken.model, taken.mode) == ("fm", "geo")
        given = await as_declared(settings("--mode", "geo"), control)
        assert (given.model, given.mode) == ("fm", "geo")
        for kept in (settings("--model", "lr"), settings(CTRPS_MODEL="lr")):
            assert (await as_declared(kept, control)).model == "lr"  # given: left for the worker to refuse
        coded = WorkerSettings(bootstrap=kafka_bootstrap, shards=(urls[0],), model_name="feed")
        assert (await as_declared(coded, control)).model == "lr"  # built in code: as given

    # A shard 0 not answering is waited for: up to the outage deadline, or until stopped.
    nobody = f"http://127.0.0.1:{free_port()}"
    async with ControlClient.connect([nobody], retry=RetryPolicy(deadline_s=0.3)) as control:
        away = WorkerSettings.from_args(
            build_parser().parse_args(["worker", "--bootstrap", kafka_bootstrap, "--shards", nobody]), env={}
        )
        with pytest.raises(OutageDeadlineError, match=f"shard 0 at {nobody}"):
            await _as_declared(dataclasses.replace(away, outage_deadline_s=1.0), control, asyncio.Event())
        stop = asyncio.Event()
        waiting = asyncio.create_task(_as_declared(away, control, stop))
        stop.set()
        assert await asyncio.wait_for(waiting, 10) is None

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *base, "--model", "lr", "--decode-processes", "0",
        stderr=subprocess.PIPE, cwd=PROJECT,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 1, err.decode()
    [line] = [x for x in err.decode().splitlines() if " error " in x or "critical" in x]
    assert "model feed was created as fm; this worker was started with --model lr" in line, err.decode()
    assert "Traceback" not in err.decode()


@pytest.mark.process
def test_ctrps_model_finds_shard_0_where_a_shard_listens_by_default() -> None:
    """Without --shard0 or CTRPS_SHARDS, ``ctrps model`` asks the address
    ``ctrps shard`` listens at without flags (README's pipeline's shard 0)."""
    from commands import ctrps

    from app.commands.model import DEFAULT_SHARD0
    from app.config.shard import ShardSettings

    defaults = ShardSettings.from_env({})
    assert DEFAULT_SHARD0 == f"http://{defaults.host}:{defaults.port}" == "http://127.0.0.1:7100"
    out = ctrps("model", "list", "--timeout", "0.5")
    # Nothing there (unless a shard of this machine is): unreachable, named.
    assert out.returncode == 0 or (out.returncode == 1 and "shard 0 at http://127.0.0.1:7100" in out.stderr), out.stderr
    assert "no shard 0" not in out.stderr


@pytest.mark.slow
@pytest.mark.process
async def test_a_worker_whose_model_is_deleted_exits_in_one_line(
    kafka_bootstrap: str, serve_shards: ServeShards, tmp_path: Path
) -> None:
    """Deleting a model under its running worker: the worker says so in one
    line and exits 1 (no traceback), as the runbook's entry tells."""
    from commands import ctrps_process

    shards, urls = await serve_shards(2, (), tmp_path)
    topic, group = await new_topic(kafka_bootstrap, 2)
    async with ControlClient.connect(urls) as control:
        await control.create_model(_spec("lr", "ads").declaration())
        async with ctrps_process(
            "worker", "--bootstrap", kafka_bootstrap, "--shards", ",".join(urls), "--topic", topic,
            "--group", group, "--model-name", "ads", "--window-seconds", "0.3", "--decode-processes", "0",
        ) as worker:  # fmt: skip
            await produce(kafka_bootstrap, topic, [keyed_event(i) for i in range(200)], 2)
            await until(lambda: bias_shows(shards, "ads") > 0, 60, what="the worker to train")
            await control.delete_model("ads")
            await produce(kafka_bootstrap, topic, [keyed_event(i) for i in range(200, 400)], 2)
            assert worker.stderr is not None
            _, err = await asyncio.wait_for(worker.communicate(), 60)
    lines = err.decode().strip().splitlines()
    assert worker.returncode == 1, lines[-5:]
    assert "Traceback" not in err.decode(), lines[-20:]
    assert "model ads is gone from the shards" in lines[-1] and "deleted while this worker ran" in lines[-1], lines[-3:]
