"""Serving replicas following a model's versions in an S3 bucket (moto's
server), ``ctrps serve --follow s3://bucket/prefix/<model>`` (or every
model of ``s3://bucket/prefix`` with ``--follow-all``): a trainer's
real versions, uploaded through the export store (files, then the manifest),
are served exactly as the same versions followed from a directory; a version
whose manifest is not uploaded is never served; a bucket that stops
answering is one warning naming it and the cause, counted, while the last
version keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import orjson
import pytest
from commands import ctrps, ctrps_process
from exposition import samples
from s3_server import S3Endpoint
from test_export_store import s3_env
from test_follow import PROBE, MakeReplica, Trainer, events, make_replica, trained, warnings_of
from waiting import until

from consumers.broker import free_port
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.exportstore import ExportStore, S3Options, StoredModel, VersionUpload, store_for
from ps_core.checkpoint.manifest import MANIFEST_NAME, version_dir_name
from ps_core.checkpoint.registry import ModelSpec
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

__all__ = ["make_replica"]  # the fixture, used here by name

pytestmark = [pytest.mark.slow, pytest.mark.process]

QUICK = S3Options(connect_timeout_s=1, max_retries=1, retry_timeout_s=2)
"""A store that gives up on an unreachable server within seconds."""


@pytest.fixture
def bucket(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """A fresh ``s3://`` exports root in the session's bucket, its endpoint
    and credentials in the AWS environment only."""
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    s3_env(s3_endpoint, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    yield f"s3://{s3_endpoint.bucket}/follow-{os.getpid()}-{tmp_path.name}"


async def _listening(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    """The ``listening`` line of a ``ctrps serve`` started with ``--log-format json``."""
    assert proc.stderr is not None
    while True:
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        assert line, "ctrps serve exited before listening"
        started: dict[str, Any] = orjson.loads(line)
        if started["msg"] == "listening":
            return started


def upload(store: ExportStore, trainer: Trainer, version: int, *, commit: bool = True) -> VersionUpload:
    """The trainer's local version `version`, byte for byte, into `store`:
    its files, then (with `commit`) its manifest, which makes it visible."""
    vdir = trainer.model_dir / version_dir_name(version)
    up = store.begin(trainer.model.name, version)
    for path in sorted(vdir.iterdir()):
        if path.name != MANIFEST_NAME:
            with up.open(path.name) as out:
                out.write(path.read_bytes())
    if commit:
        up.commit((vdir / MANIFEST_NAME).read_bytes())
    return up


async def test_a_replica_of_a_bucket_serves_what_a_replica_of_the_directory_serves(
    tmp_path: Path, bucket: str, make_replica: MakeReplica
) -> None:
    trainer = await trained(tmp_path, versions=1)
    store = store_for(bucket)
    upload(store, trainer, 1)
    local = await make_replica(trainer.model_dir, trainer.model)
    remote = await make_replica(StoredModel(store, trainer.model.name), trainer.model)
    await local.serves(trainer, 1)
    await remote.serves(trainer, 1)

    await trainer.train(events(np.random.default_rng(11), 150, sites=30))
    assert await trainer.cut() == 2
    upload(store, trainer, 2)
    assert await local.follower.poll() is True and await remote.follower.poll() is True
    await remote.serves(trainer, 2)  # a delta applied: the trainer's predictions at 2
    got, _ = await remote.predict(PROBE)
    expected, _ = await local.predict(PROBE)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=0)
    follow = remote.follower.info()["follow"]
    assert follow["dir"] == f"{bucket}/ctr" and follow["deltas_applied"] == 1 and follow["read_failures"] == 0
    status, listed = await remote.call("GET", "/v1/exports")
    assert status == 200 and [v["version"] for v in listed["versions"]] == [1, 2]


async def test_a_version_without_its_manifest_is_never_served(
    tmp_path: Path, bucket: str, make_replica: MakeReplica
) -> None:
    trainer = await trained(tmp_path, versions=1)
    store = store_for(bucket)
    upload(store, trainer, 1)
    replica = await make_replica(StoredModel(store, trainer.model.name), trainer.model)
    await replica.serves(trainer, 1)
    await trainer.train(events(np.random.default_rng(12), 150, sites=30))
    assert await trainer.cut() == 2
    pending = upload(store, trainer, 2, commit=False)  # every data file there, no manifest
    for _ in range(3):
        assert await replica.follower.poll() is False
        await replica.serves(trainer, 1)
    assert replica.follower.newest_version == 1 and replica.follower.error is None
    pending.commit((trainer.model_dir / version_dir_name(2) / MANIFEST_NAME).read_bytes())
    assert await replica.follower.poll() is True
    await replica.serves(trainer, 2)


class Gate:
    """A TCP forwarder to the S3 server, on a port of its own that the test
    opens and closes: closed, nothing listens there (connections refused)."""

    def __init__(self, target: str) -> None:
        self.target = urlsplit(target).port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: list[asyncio.StreamWriter] = []

    async def open(self) -> None:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._open:  # kept-alive connections too
            writer.close()
        self._open.clear()
        await self._server.wait_closed()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        self._open += [writer, up_writer]

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            except OSError:
                pass
            finally:
                dst.close()

        await asyncio.gather(copy(reader, up_writer), copy(up_reader, writer))


async def test_an_unreachable_bucket_is_one_warning_and_the_last_version_keeps_serving(
    tmp_path: Path,
    bucket: str,
    s3_endpoint: S3Endpoint,
    make_replica: MakeReplica,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The replica reaches the server through a `Gate`, closed for a while."""
    trainer = await trained(tmp_path, versions=1)
    store = store_for(bucket)
    upload(store, trainer, 1)
    gate = Gate(s3_endpoint.url)
    await gate.open()
    try:
        gated = store_for(bucket, S3Options(**{**vars(QUICK), "endpoint": f"http://127.0.0.1:{gate.port}"}))
        replica = await make_replica(StoredModel(gated, trainer.model.name), trainer.model)
        await replica.serves(trainer, 1)
        await gate.close()
        # Nothing answers: every look fails, the replica serves version 1.
        caplog.set_level(logging.INFO, logger="ctrps.follow")
        for polls in range(1, 4):
            assert await replica.follower.poll() is False
            await replica.serves(trainer, 1)
            assert replica.follower.info()["follow"]["read_failures"] == polls
            status, text = await replica.call("GET", "/metrics")
            assert samples(text, "ctrps_replica_read_failures_total") == [({"model": "ctr"}, polls)]
        (record,) = warnings_of(caplog)
        fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
        assert record.getMessage() == "export store unreachable: serving the last version"
        assert fields["dir"] == f"{bucket}/ctr" and fields["serving"] == 1
        assert fields["error"].startswith(f"{bucket}/ctr/: list failed") and "error sending request" in fields["error"]
        assert "\n" not in fields["error"]
        status, info = await replica.call("GET", "/v1/model")
        assert status == 200 and "list failed" in info["follow"]["error"]
        assert (await replica.call("GET", "/readyz"))[0] == 200
        status, body = await replica.call("GET", "/v1/exports")
        assert (status, body["error"]) == (503, "no_version") and "does not answer" in body["detail"]

        # The server answers again: the next version is served, the outage's end logged with its length.
        await trainer.train(events(np.random.default_rng(14), 150, sites=30))
        assert await trainer.cut() == 2
        upload(store, trainer, 2)
        await gate.open()
        assert await replica.follower.poll() is True
        await replica.serves(trainer, 2)
        (back,) = [r for r in caplog.records if r.getMessage() == "export store reachable again"]
        assert back.fields["down_s"] > 0 and back.fields["cause"] == fields["error"]  # type: ignore[attr-defined]
        assert replica.follower.error is None and replica.follower.read_failures == 3
        assert len(warnings_of(caplog)) == 1
    finally:
        await gate.close()


async def test_ctrps_serve_follows_a_bucket(tmp_path: Path, bucket: str) -> None:
    trainer = await trained(tmp_path, versions=1)
    store = store_for(bucket)
    upload(store, trainer, 1)
    url = f"{bucket}/ctr"
    async with ctrps_process(
        "serve", "--follow", url, "--port", "0", "--follow-interval", "0.05", "--log-format", "json"
    ) as proc:
        started = await _listening(proc)
        assert started["follow"] == url and started["model"] == "ctr"
        async with aiohttp.ClientSession() as http:
            for version in (1, 2):
                if version == 2:
                    await trainer.train(events(np.random.default_rng(13), 150, sites=30))
                    assert await trainer.cut() == 2
                    upload(store, trainer, 2)
                got: list[float] = []

                async def serves(version: int = version, got: list[float] = got) -> bool:
                    async with http.post(started["url"] + "/v1/predict", data=orjson.dumps({"events": PROBE})) as r:
                        body = orjson.loads(await r.read())
                    if r.status == 200 and body["model_version"] == version:
                        got.extend(body["predictions"])
                    return bool(got)

                await until(serves, 30, what=f"the replica serving version {version}", poll_s=0.05)
                np.testing.assert_allclose(got, trainer.expected[version], rtol=1e-12, atol=0)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


async def _lr_and_fm_on(bucket: str, probe: list[dict[str, Any]]) -> tuple[Exporter, PSClient, dict[str, Any]]:
    """A cluster in process exporting models ``ctr`` (LR) and ``ads`` (FM)
    to `bucket`, trained and cut once; its exporter, its client, and what its
    own API predicts of `probe` per model."""
    from aiohttp.test_utils import TestClient, TestServer

    from app.api import create_app
    from app.config.serve import ApiSettings

    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, bucket, "ctr")
    control.serve_exports(exporter)
    ctr, ads = make_model("lr", "ctr"), make_model("fm", "ads", k=4, numeric="log1p")
    for model in (ctr, ads):
        await control.create_model(ModelSpec.of(model).declaration())
        await _learn(client, model, events(np.random.default_rng(5), 200))
    assert (await exporter.cut()).version == 1
    want = {}
    async with TestClient(TestServer(create_app(ApiSettings(), client, ctr, control=control))) as live:
        for name in ("ctr", "ads"):
            want[name] = (await (await live.post(f"/v1/models/{name}/predict", json={"events": probe})).json())[
                "predictions"
            ]
    return exporter, client, want


async def _learn(client: PSClient, model: Any, batch: list[dict[str, Any]]) -> None:
    """One step of a worker's training of `model` on `batch`."""
    featurized, _ = model.hasher().featurize(batch)
    plan = model.plan(featurized)
    routed = client.route(plan.keys)
    w = {t: await client.pull(t, routed) for t in model.table_names}
    p = 1 / (1 + np.exp(-model.logits(featurized, plan, w)))
    for t, g in model.gradients(featurized, plan, w, (p - featurized.labels) * featurized.weights).items():
        await client.push(t, routed, g, counts=plan.counts(featurized.labels))


async def test_ctrps_serve_follows_every_model_of_a_bucket(bucket: str) -> None:
    """``--follow s3://bucket/prefix --follow-all``: each model of the
    bucket served as the cluster's own API served it at the cut, and a model
    created later found when a request names it."""
    probe = [{"features": e["features"]} for e in PROBE[:8]]
    exporter, client, want = await _lr_and_fm_on(bucket, probe)
    args = ("--follow", bucket, "--follow-all", "--model-name", "ctr", "--follow-interval", "0.05")
    async with ctrps_process("serve", *args, "--port", "0", "--log-format", "json") as proc:
        started = await _listening(proc)
        url = started["url"]
        async with aiohttp.ClientSession() as http:

            async def predicts(name: str, version: int) -> list[float] | None:
                async with http.post(f"{url}/v1/models/{name}/predict", data=orjson.dumps({"events": probe})) as r:
                    body = orjson.loads(await r.read())
                ok = r.status == 200 and body.get("model_version") == version
                return list(body["predictions"]) if ok else None

            for name in ("ctr", "ads"):
                got: list[list[float]] = []

                async def served(name: str = name, got: list[list[float]] = got) -> bool:
                    got.extend(p for p in [await predicts(name, 1)] if p is not None)
                    return bool(got)

                await until(served, 30, what=f"the replica serving {name} at version 1", poll_s=0.05)
                np.testing.assert_allclose(got[0], want[name], rtol=1e-6)
            async with http.get(f"{url}/v1/models") as r:
                listed = orjson.loads(await r.read())
            assert [(m["name"], m["type"]) for m in listed["models"]] == [("ctr", "lr"), ("ads", "fm")]

            late = make_model("lr", "late")
            assert await exporter.create_model(ModelSpec.of(late))
            await _learn(client, late, events(np.random.default_rng(6), 100))
            assert (await exporter.cut()).version == 2

            async def found() -> bool:
                return await predicts("late", 2) is not None

            await until(found, 30, what="the replica serving the model created after it started", poll_s=0.1)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (("--follow", "gs://bkt/exports", "--follow-all"), "scheme 'gs' is not supported"),
        (("--follow", "s3://bkt"), "name the model's, s3://bucket/prefix/<model>"),
        (("--follow", "gs://bkt/ctr"), "scheme 'gs' is not supported"),
    ],
)
def test_serve_refuses_a_store_url_it_cannot_follow(argv: tuple[str, ...], line: str) -> None:
    out = ctrps("serve", *argv, "--port", "0")
    assert out.returncode == 2, out.stderr
    assert line in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


async def test_ctrps_serve_starts_on_an_unreachable_bucket_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing listens at the endpoint: the replica starts on the flags'
    model, is not ready, and reports the outage once while it lasts."""
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    for name, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    url = "s3://nowhere/exports/ctr"
    args = ("serve", "--follow", url, "--port", "0", "--follow-interval", "0.05", "--log-format", "json")
    async with ctrps_process(*args) as proc:
        assert proc.stderr is not None
        seen: list[dict[str, Any]] = []

        async def read_until(msg: str) -> dict[str, Any]:
            assert proc.stderr is not None
            while True:
                line = await asyncio.wait_for(proc.stderr.readline(), timeout=60)
                assert line, f"ctrps serve exited before {msg!r}: {seen}"
                seen.append(orjson.loads(line))
                if seen[-1]["msg"] == msg:
                    return seen[-1]

        started = await read_until("listening")
        outage = await read_until("export store unreachable: serving the last version")
        assert outage["dir"] == url and outage["serving"] is None
        assert outage["error"].startswith(f"{url}/: list failed") and "error sending request" in outage["error"]
        async with aiohttp.ClientSession() as http:

            async def failures() -> bool:
                async with http.get(started["url"] + "/metrics") as resp:
                    got = samples(await resp.read(), "ctrps_replica_read_failures_total")
                return bool(got) and got[0][1] >= 3

            await until(failures, 60, what="three failed polls counted", poll_s=0.05)
            async with http.get(started["url"] + "/readyz") as resp:
                assert resp.status == 503
        proc.send_signal(signal.SIGTERM)
        await read_until("stopped")
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
    messages = [line["msg"] for line in seen]
    assert messages.count("export store unreachable: serving the last version") == 1
    assert "export store unreachable at start: serving the flags' model" in messages
