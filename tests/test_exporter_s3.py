"""The exporter on an S3 bucket (moto's server, the `s3_endpoint` fixture):
the cuts it writes there read back as the same cuts written to a directory;
a cut whose upload fails midway leaves no version and the next one is
written; retention prunes the bucket as it prunes a directory; the bucket
has one owner (``owner.json``) as a directory has."""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pytest
from s3_server import S3Endpoint
from test_export_store import s3_env
from test_exporter import FM_V, LR, _state, _train

from app.config.cluster import ClusterSettings
from app.config.declared import SettingsError
from app.config.demo import DemoSettings
from app.config.shard import ShardSettings
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.export_report import ExportReport
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.exportstore import (
    BinaryWriter,
    ExportStore,
    S3ExportStore,
    StoredModel,
    VersionUpload,
    store_for,
)
from ps_core.checkpoint.joining import newest_loadable, restore_chains
from ps_core.checkpoint.manifest import MANIFEST_NAME
from ps_core.checkpoint.owner import OWNER_FILE, ExportsOwnedError, claim_exports
from ps_core.checkpoint.registry import MODEL_FILE, ModelRegistry, ModelSpec
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import ExportCorruptError, ExportWriteError, InvalidRequestError
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

pytestmark = [pytest.mark.slow, pytest.mark.process]

UNIVERSE = np.arange(1, 2000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)


@pytest.fixture
def bucket(s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A fresh ``s3://`` exports location in the session's bucket, the
    server's credentials and endpoint as the only AWS environment."""
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    s3_env(s3_endpoint, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    yield f"s3://{s3_endpoint.bucket}/run-{secrets.token_hex(4)}/exports"


@dataclass
class Run:
    exporter: Exporter
    shards: list[Shard]
    reports: list[ExportReport]


async def _cuts(root: Path | str, kinds: list[str], keep_bases: int = 2) -> Run:
    """A 2-shard cluster trained the same way before each cut of `kinds`,
    exported to `root` (a directory or an ``s3://`` URL)."""
    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2), (LR,)) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, root, "m", keep_bases=keep_bases)
    reports = []
    for i, kind in enumerate(kinds):
        await _train(client, LR, UNIVERSE[i * 300 : i * 300 + 600], i + 1)
        if i == 1:
            await control.declare(FM_V)  # a table born after the base
            await _train(client, FM_V, UNIVERSE[:200], 99)
        lease = (await control.acquire_lease("w")).lease_id
        await control.release_lease(lease, {"clicks": {0: 10 * (i + 1), 1: 11 * (i + 1)}})
        reports.append(await exporter.cut(kind))
    return Run(exporter, shards, reports)


def _files(chain: list[object]) -> list[tuple[int, str, str, int, str]]:
    """Each version's kind and files (name, size, SHA-256): the bytes written."""
    return [
        (v.version, v.kind, f.name, f.bytes, f.sha256)  # type: ignore[attr-defined]
        for v in chain
        for f in v.manifest.files + v.manifest.serving_files  # type: ignore[attr-defined]
    ]


def _keys(store: S3ExportStore, head: str) -> list[str]:
    import obstore

    return [m["path"] for batch in obstore.list(store.client, head, chunk_size=1000) for m in batch]


async def test_cuts_to_a_bucket_read_back_as_the_same_cuts_to_a_directory(tmp_path: Path, bucket: str) -> None:
    kinds = ["base", "delta", "delta"]
    local, remote = await _cuts(tmp_path / "exports", kinds), await _cuts(bucket, kinds)
    assert [(r.version, r.kind, r.parent, r.rows) for r in remote.reports] == [
        (r.version, r.kind, r.parent, r.rows) for r in local.reports
    ]
    assert remote.reports[-1].path == f"{bucket}/m/0000000003"
    assert not (Path.cwd() / "s3:").exists()  # nothing written to a local path named after the URL
    on_disk = latest_chain(tmp_path / "exports" / "m", verify=True)
    on_bucket = latest_chain(StoredModel(remote.exporter.store, "m"), verify=True)  # type: ignore[arg-type]
    assert [v.version for v in on_bucket] == [1, 2, 3]
    assert _files(on_bucket) == _files(on_disk)
    restored = restore_shards(on_bucket, 3)
    assert restored.offsets == {"clicks": {0: 30, 1: 33}}
    for table in ("m_w", "m_v"):
        live = _state(remote.shards, table, UNIVERSE)
        assert live and _state(restored.shards, table, UNIVERSE) == live
    assert [v.version for v in remote.exporter.versions()] == [1, 2, 3]


class _FailOnFile(ExportStore):
    """The real bucket store, but the upload of the `nth` file (1-based) of
    every version fails as a dropped connection would: the test double for
    the failure only, every other request is the server's."""

    def __init__(self, real: S3ExportStore, nth: int) -> None:
        self.real, self.nth, self.url = real, nth, real.url

    def begin(self, model: str, version: int, *, file_mode: int = 0o600) -> VersionUpload:
        upload, real, nth = self.real.begin(model, version, file_mode=file_mode), self.real, self.nth
        opened = 0

        class Failing(VersionUpload):
            def open(self, name: str) -> BinaryWriter:
                nonlocal opened
                opened += 1
                if opened == nth:
                    real.fail(
                        "upload", real.key(model, version, name), ConnectionResetError("connection reset by peer")
                    )
                return upload.open(name)

            def commit(self, manifest: bytes) -> str:
                return upload.commit(manifest)

            def abort(self) -> None:
                upload.abort()

        return Failing()

    def versions(self, model: str) -> dict[int, str]:
        return self.real.versions(model)

    def size(self, model: str, version: int, name: str) -> int | None:
        return self.real.size(model, version, name)

    def read_bytes(self, model: str, version: int, name: str) -> bytes:
        return self.real.read_bytes(model, version, name)

    def iter_bytes(self, model: str, version: int, name: str, chunk: int = 1 << 20) -> Iterator[bytes]:
        return self.real.iter_bytes(model, version, name, chunk)

    def top_level(self) -> list[str]:
        return self.real.top_level()

    def delete_version(self, model: str, version: int) -> bool:
        return self.real.delete_version(model, version)


async def test_a_cut_failing_midway_on_the_bucket_leaves_no_version_and_the_next_is_written(
    bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    run = await _cuts(bucket, ["base"])
    exporter = run.exporter
    real = exporter.store
    assert isinstance(real, S3ExportStore)
    exporter.store = _FailOnFile(real, 3)  # shard-0's data and serving files go up, shard-1's fails
    await _train(PSClient.local(run.shards), LR, UNIVERSE[:50], 7)
    with caplog.at_level(logging.WARNING, logger="ctrps.export"), pytest.raises(ExportWriteError) as failed:
        await exporter.cut()
    key = f"{bucket}/m/0000000002/shard-1.m_w.npz"
    assert key in str(failed.value)
    lines = [r for r in caplog.records if r.name == "ctrps.export" and r.levelno == logging.WARNING]
    assert len(lines) == 1, [r.__dict__.get("fields") for r in lines]
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["reason"] == "disk" and key in fields["error"] and "connection reset by peer" in fields["error"]
    assert exporter.failures == {"disk": 1}
    assert sorted(real.versions("m")) == [1]
    assert _keys(real, "m/0000000002/") == []  # the files uploaded before the failure were removed
    assert [v.version for v in list_versions(StoredModel(real, "m"))] == [1]

    # What a crash mid-upload leaves (no abort ran): objects without a manifest.
    with real.begin("m", 2).open("shard-0.m_w.npz") as leftover:
        leftover.write(b"half a file")
    assert _keys(real, "m/0000000002/") == ["m/0000000002/shard-0.m_w.npz"]

    exporter.store = real
    nxt = await exporter.cut()
    assert (nxt.version, nxt.kind) == (3, "base")  # version 2 is spent; a base follows a failed write
    assert sorted(real.versions("m")) == [1, 3]
    assert _keys(real, "m/0000000002/") == []  # retention swept the crash's leftover
    restored = restore_shards(latest_chain(StoredModel(real, "m"), verify=True), 1)
    assert _state(restored.shards, "m_w", UNIVERSE) == _state(run.shards, "m_w", UNIVERSE)


async def test_retention_prunes_the_bucket_as_it_prunes_a_directory(tmp_path: Path, bucket: str) -> None:
    kinds = ["base", "delta", "base", "delta", "base", "delta"]
    local, remote = await _cuts(tmp_path / "exports", kinds), await _cuts(bucket, kinds)
    assert [r.pruned for r in remote.reports] == [r.pruned for r in local.reports]
    assert remote.reports[4].pruned == [1, 2]  # the third base: the first chain goes
    store = remote.exporter.store
    assert isinstance(store, S3ExportStore)
    kept = [v.version for v in list_versions(tmp_path / "exports" / "m")]
    assert kept == [3, 4, 5, 6] and sorted(store.versions("m")) == kept
    gone = [k for v in (1, 2) for k in _keys(store, f"m/{v:010d}/")]
    assert gone == []  # every object of a pruned version, not only its manifest
    assert all(store.size("m", v, MANIFEST_NAME) for v in kept)
    chain = latest_chain(StoredModel(store, "m"), verify=True)
    assert [v.version for v in chain] == [5, 6]
    assert _state(restore_shards(chain, 2).shards, "m_w", UNIVERSE) == _state(remote.shards, "m_w", UNIVERSE)

    with pytest.raises(
        InvalidRequestError, match=r"^compaction of exports on object storage \(s3://.*/m\) is not supported$"
    ):
        await remote.exporter.compact()
    assert sorted(store.versions("m")) == kept


def test_a_bucket_is_claimed_by_one_owner_until_taken_over(bucket: str) -> None:
    mine, took = claim_exports(bucket, "cluster-a", "ctrps shard")
    assert (mine.owner, took) == ("cluster-a", False)
    store = store_for(bucket)
    assert isinstance(store, S3ExportStore)
    assert orjson.loads(store.read_object(OWNER_FILE) or b"null")["owner"] == "cluster-a"
    again, took = claim_exports(bucket, "cluster-a", "ctrps shard")  # its restart
    assert (again.since, took) == (mine.since, False)
    with pytest.raises(ExportsOwnedError) as refused:
        claim_exports(bucket, "cluster-b", "ctrps shard")
    assert f"exports {bucket} belongs to 'cluster-a'" in str(refused.value) and "\n" not in str(refused.value)
    taken, took = claim_exports(bucket, "cluster-b", "ctrps shard", take_over=True)
    assert (taken.owner, taken.taken_from, took) == ("cluster-b", "cluster-a", True)
    assert orjson.loads(store.read_object(OWNER_FILE) or b"null")["owner"] == "cluster-b"
    store.write_object(OWNER_FILE, b"{not json", replace=True)
    with pytest.raises(ExportCorruptError, match=f"{bucket}/{OWNER_FILE}: not JSON"):
        claim_exports(bucket, "cluster-b", "ctrps shard")


@pytest.mark.parametrize("settings", [DemoSettings, ClusterSettings])
def test_the_demo_and_cluster_refuse_an_exports_url_in_one_line_until_they_restore_from_it(
    settings: type[object],
) -> None:
    with pytest.raises(SettingsError) as refused:
        settings(exports_dir="s3://bucket/prefix")
    assert str(refused.value) == (
        "exports dir 's3://bucket/prefix': exports on object storage are not restored from by ctrps demo "
        "or cluster yet; give a local directory"
    )
    settings(exports_dir="exports")  # a local directory as ever


def test_a_shard_takes_a_bucket_and_refuses_another_url_in_one_line() -> None:
    assert ShardSettings(exports_dir="s3://bucket/prefix").exports_dir == "s3://bucket/prefix"
    for url in ("gs://bucket/prefix", "s3:///prefix"):
        with pytest.raises(SettingsError) as refused:
            ShardSettings(exports_dir=url)
        assert str(refused.value) == f"exports dir {url!r}: give a local directory or s3://bucket/prefix"
    ShardSettings(exports_dir="exports")  # a local directory as ever


async def test_a_bucket_holds_several_models_and_restores_them_together(bucket: str) -> None:
    """As a directory does: each model's declaration beside its versions, a
    restart that finds them, a restore of every model at one version into
    another shard count, a damaged file of one model that makes the version
    fall back for all, and a deleted model's declaration kept aside."""
    coord = Coordinator()
    shards = [Shard(ShardSpec(i, 2), ()) for i in range(2)]
    client, control = PSClient.local(shards), ControlClient.local(shards, coord)
    exporter = Exporter(coord, control, bucket, "m")
    control.serve_exports(exporter)
    ads = ModelSpec.of(make_model("fm", "ads", k=4))
    for spec in (ModelSpec.of(make_model("lr", "m")), ads):
        assert await exporter.create_model(spec)
    store = exporter.store
    assert isinstance(store, S3ExportStore)
    assert store.object_size(f"ads/{MODEL_FILE}")  # beside the model's versions, not on a local disk
    w = ads.tables[0]
    await _train(client, dataclasses.replace(LR, name="m_w", dim=w.dim, optimizer=w.optimizer), UNIVERSE[:300], 1)
    for table, seed in zip(ads.tables, (2, 3)):
        await _train(client, table, UNIVERSE[100:], seed)
    lease = (await control.acquire_lease("w")).lease_id
    await control.release_lease(lease, {"clicks": {0: 99}}, model="ads")
    assert (await exporter.cut()).models.keys() == {"m", "ads"}
    await _train(client, ads.tables[0], UNIVERSE[:50], 4)
    second = await exporter.cut()
    assert (second.kind, second.models["ads"]["rows"]) == ("delta", 50)

    # A restart finds both models in the bucket and restores them together.
    again = ModelRegistry.load(bucket, "m")
    assert again.names() == ["m", "ads"] and again.get("ads") == ads
    chains, refusals = newest_loadable(StoredModel(store, "m"))
    assert chains is not None and not refusals and sorted(chains) == ["ads", "m"]
    assert chains["ads"][-1].manifest.offsets == {"clicks": {0: 99}}
    restored = restore_chains(chains, 3, [0, 1, 2])
    for table in ("m_w", "ads_w", "ads_v"):
        live = _state(shards, table, UNIVERSE)
        assert live and _state(restored.shards, table, UNIVERSE) == live

    # A damaged file of one model makes its version unloadable for every model.
    key = next(k for k in _keys(store, "ads/0000000002/") if k.rpartition("/")[2].startswith("shard-"))
    store.write_object(key, b"damaged", replace=True)
    chains, refusals = newest_loadable(StoredModel(store, "m"))
    assert chains is not None and chains["m"][-1].version == 1 and len(refusals) == 1

    # A broken declaration is logged and skipped; a deleted model's is kept aside.
    store.write_object(f"broken/{MODEL_FILE}", b"{not json", replace=True)
    assert ModelRegistry.load(bucket, "m").names() == ["m", "ads"]
    deleted = await exporter.delete_model("ads")
    assert deleted.exports == f"{bucket}/ads"  # its versions stay
    assert store.object_size(f"ads/{MODEL_FILE}") is None and store.object_size(f"ads/{MODEL_FILE}.deleted")
    assert ModelRegistry.load(bucket, "m").names() == ["m"]
