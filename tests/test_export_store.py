"""Export stores (`ps_core.checkpoint.exportstore`): the same behaviour from a
local directory and from an S3 bucket (moto's server, the `s3_endpoint`
fixture): a committed version is listed and reads back byte for byte; one
whose manifest was never written is not listed; a version is written once;
deleting removes it; bad locations and unreachable or refusing servers fail
in bounded time with one line naming where and why."""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from s3_server import S3Endpoint, moto_server
from test_export import MODEL_CONFIG, TABLES, assert_same_rows, cut, delete, make_shards, push, rows_of

from consumers.broker import free_port
from ps_core.checkpoint.export_files import (
    latest_chain,
    list_versions,
    load_version,
    read_manifest,
    store_manifest,
    store_versions,
    verify_version,
    write_version,
    write_version_to,
)
from ps_core.checkpoint.exportstore import (
    ExportStore,
    ExportStoreError,
    LocalExportStore,
    S3ExportStore,
    S3Options,
    StoredModel,
    StoredVersion,
    VersionSource,
    store_for,
    stored_version,
)
from ps_core.checkpoint.manifest import MANIFEST_NAME
from ps_core.checkpoint.restore import restore_shards
from ps_core.errors import ExportCorruptError, ExportNotFoundError
from ps_core.shard import Shard
from ps_core.store.snapshot import TableSnapshot
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

S3 = pytest.param("s3", marks=[pytest.mark.slow, pytest.mark.process])
MODEL = "ctr"
BIG = 11 << 20
"""Past obstore's 10 MB write buffer: a multipart upload."""


def s3_env(endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's credentials as the only AWS settings in the environment."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint.env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(params=["local", S3])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ExportStore]:
    """A store of each kind; the S3 one under a fresh prefix of the session's bucket."""
    if request.param == "local":
        yield store_for(tmp_path / "exports")
        return
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    endpoint: S3Endpoint = request.getfixturevalue("s3_endpoint")
    s3_env(endpoint, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint.url)
    yield store_for(f"s3://{endpoint.bucket}/run-{secrets.token_hex(4)}/exports")


def upload(store: ExportStore, version: int, files: dict[str, bytes], manifest: bytes | None) -> str | None:
    """Write a version's files, then its manifest unless None (an upload cut
    short before it); returns where the version is when committed."""
    up = store.begin(MODEL, version)
    for name, data in files.items():
        with up.open(name) as f:
            # Two writes: the stream is written piecewise, as the .npz writer does.
            f.write(data[: len(data) // 2])
            f.write(memoryview(data)[len(data) // 2 :])
    return None if manifest is None else up.commit(manifest)


def test_a_committed_version_is_listed_and_reads_back_byte_for_byte(store: ExportStore) -> None:
    files = {"shard-0.t.npz": os.urandom(BIG), "shard-1.t.npz": os.urandom(1000), "empty.npz": b""}
    assert store.versions(MODEL) == {}
    where = upload(store, 7, files, b'{"version": 7}')
    assert store.versions(MODEL) == {7: where}
    assert where == store.location(MODEL, 7)
    for name, data in {**files, MANIFEST_NAME: b'{"version": 7}'}.items():
        assert store.size(MODEL, 7, name) == len(data)
        assert store.read_bytes(MODEL, 7, name) == data
        pieces = list(store.iter_bytes(MODEL, 7, name, chunk=1 << 20))
        assert b"".join(pieces) == data
    assert len(list(store.iter_bytes(MODEL, 7, "shard-0.t.npz", chunk=1 << 20))) > 1
    assert store.size(MODEL, 7, "nothing.npz") is None
    with pytest.raises(FileNotFoundError):
        store.read_bytes(MODEL, 7, "nothing.npz")
    assert store.versions("other") == {}


def test_a_version_without_its_manifest_is_not_visible(store: ExportStore) -> None:
    upload(store, 1, {"shard-0.t.npz": b"a" * 100}, b"1")
    # Cut short after its data files: never listed, and its number is free.
    upload(store, 2, {"shard-0.t.npz": b"b" * 100}, None)
    assert set(store.versions(MODEL)) == {1}
    assert store.size(MODEL, 2, MANIFEST_NAME) is None

    # The manifest write fails: the version stays invisible, and abort clears it.
    up = store.begin(MODEL, 3)
    with up.open("shard-0.t.npz") as f:
        f.write(b"c" * 100)
    with pytest.raises((TypeError, ExportStoreError)):
        up.commit(None)  # type: ignore[arg-type]
    up.abort()
    assert set(store.versions(MODEL)) == {1}
    assert store.size(MODEL, 3, "shard-0.t.npz") is None

    # A later complete upload of the same number is what becomes visible.
    upload(store, 2, {"shard-0.t.npz": b"d" * 10}, b"2")
    assert set(store.versions(MODEL)) == {1, 2}
    assert store.read_bytes(MODEL, 2, "shard-0.t.npz") == b"d" * 10


def test_a_version_is_written_once(store: ExportStore) -> None:
    upload(store, 1, {"shard-0.t.npz": b"first"}, b"first manifest")
    with pytest.raises(FileExistsError, match="version 1 exists"):
        store.begin(MODEL, 1)
    # Two writers that both began before either committed: the second's
    # manifest is refused and the first's stays.
    a, b = store.begin(MODEL, 2), store.begin(MODEL, 2)
    a.commit(b"manifest a")
    with pytest.raises(FileExistsError, match="version 2 exists"):
        b.commit(b"manifest b")
    assert store.read_bytes(MODEL, 2, MANIFEST_NAME) == b"manifest a"
    assert store.read_bytes(MODEL, 1, MANIFEST_NAME) == b"first manifest"
    assert set(store.versions(MODEL)) == {1, 2}


def test_delete_removes_a_version(store: ExportStore) -> None:
    for v in (1, 2):
        upload(store, v, {"shard-0.t.npz": os.urandom(100), "shard-1.t.npz": b"x"}, b"m")
    assert store.delete_version(MODEL, 1) is True
    assert set(store.versions(MODEL)) == {2}
    for name in ("shard-0.t.npz", "shard-1.t.npz", MANIFEST_NAME):
        assert store.size(MODEL, 1, name) is None
        assert store.size(MODEL, 2, name) is not None
    assert store.delete_version(MODEL, 1) is False
    # The number is free again.
    upload(store, 1, {"shard-0.t.npz": b"again"}, b"m")
    assert store.read_bytes(MODEL, 1, "shard-0.t.npz") == b"again"


def snapshots(version: int) -> dict[int, list[TableSnapshot]]:
    """A base of two tables on two shards, the same on every call."""
    out: dict[int, list[TableSnapshot]] = {}
    for shard in (0, 1):
        tables = [SparseTable(TableConfig("lr", 1)), SparseTable(TableConfig("fm_v", 4))]
        keys = np.arange(shard, 40_000, 2, dtype=np.uint64)
        for t in tables:
            t.push(keys, np.linspace(0, 1, keys.size * t.dim).reshape(keys.size, t.dim))
        out[shard] = [t.snapshot(None, version=version) for t in tables]
    return out


def test_a_version_written_to_a_store_is_the_local_one_byte_for_byte(store: ExportStore, tmp_path: Path) -> None:
    """`write_version_to` a store writes the files `write_version` writes on
    disk; the store's listing and manifest read them back."""
    snaps = snapshots(3)
    local = write_version(tmp_path / "reference", MODEL, 3, None, snaps, {"clicks": {0: 9}}, {"name": MODEL}, 2)
    where = write_version_to(store, MODEL, 3, None, snaps, {"clicks": {0: 9}}, {"name": MODEL}, 2)
    reference = verify_version(local)
    listed = store_versions(store, MODEL)
    assert [w for w, _ in listed] == [where]
    manifest = store_manifest(store, MODEL, 3)
    assert listed[0][1] == manifest
    assert (manifest.files, manifest.serving_files, manifest.offsets) == (
        reference.files,
        reference.serving_files,
        reference.offsets,
    )
    for entry in manifest.files + manifest.serving_files:
        assert store.read_bytes(MODEL, 3, entry.name) == (local / entry.name).read_bytes(), entry.name
    with pytest.raises(FileExistsError, match="version 3 exists"):
        write_version_to(store, MODEL, 3, None, snaps, {}, {"name": MODEL}, 2)
    if isinstance(store, LocalExportStore):
        assert Path(where) == store.root / MODEL / "0000000003"
        assert read_manifest(Path(where)) == manifest
        assert load_version(Path(where)).snapshots.keys() == {0, 1}


def test_a_manifest_that_does_not_read_is_not_listed(store: ExportStore) -> None:
    upload(store, 1, {}, b"not json")
    upload(store, 2, {}, store_manifest_bytes(store, 1))
    assert store_versions(store, MODEL) == []
    with pytest.raises(ExportCorruptError, match="manifest.json"):
        store_manifest(store, MODEL, 1)
    with pytest.raises(ExportCorruptError, match="manifest.json: missing"):
        store_manifest(store, MODEL, 5)


def store_manifest_bytes(store: ExportStore, version: int) -> bytes:
    """A valid manifest of another version than `version` + 1 names."""
    local = write_version_to(store, "src", version, None, snapshots(version), {}, {"name": "src"}, 2)
    assert local
    return store.read_bytes("src", version, MANIFEST_NAME)


def test_locations_pick_their_store_and_other_schemes_fail_in_one_line(tmp_path: Path) -> None:
    local = store_for(tmp_path)
    assert isinstance(local, LocalExportStore) and local.root == tmp_path
    assert isinstance(store_for(str(tmp_path / "x")), LocalExportStore)
    for bad, why in (("gs://bucket/p", "scheme 'gs' is not supported"), ("file:///tmp/x", "scheme 'file'")):
        with pytest.raises(ValueError, match=why) as err:
            store_for(bad)
        assert "\n" not in str(err.value) and bad in str(err.value)
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    s3 = store_for("s3://bucket/a/b/")
    assert isinstance(s3, S3ExportStore) and (s3.bucket, s3.prefix) == ("bucket", "a/b")
    assert s3.location(MODEL, 3, "f.npz") == "s3://bucket/a/b/ctr/0000000003/f.npz"
    with pytest.raises(ValueError, match="needs a bucket"):
        store_for("s3:///prefix")


def test_an_unreachable_server_fails_in_bounded_time_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    port = free_port()  # nothing listens there
    opts = S3Options(endpoint=f"http://127.0.0.1:{port}", connect_timeout_s=1, max_retries=2, retry_timeout_s=3)
    store = S3ExportStore("bkt", "p", opts)
    for call, key, op in (
        (lambda: store.versions(MODEL), "s3://bkt/p/ctr/:", "list failed"),
        (lambda: store.begin(MODEL, 4), "s3://bkt/p/ctr/0000000004/manifest.json:", "head failed"),
        (lambda: store.read_bytes(MODEL, 4, "a.npz"), "s3://bkt/p/ctr/0000000004/a.npz:", "get failed"),
    ):
        started = time.monotonic()
        with pytest.raises(ExportStoreError) as err:
            call()
        assert time.monotonic() - started < 15
        line = str(err.value)
        assert "\n" not in line and line.startswith(key) and op in line and "error sending request" in line


@pytest.mark.slow
@pytest.mark.process
def test_refused_credentials_fail_in_one_line_naming_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto checking signatures after the bucket is made: the fixture's keys
    are not in its records, as a wrong key is not in S3's."""
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    pytest.importorskip("moto.server", reason="moto is not installed")
    with moto_server(server_env={"INITIAL_NO_AUTH_ACTION_COUNT": "1"}) as endpoint:
        s3_env(endpoint, monkeypatch)
        store = S3ExportStore(endpoint.bucket, "p", S3Options(endpoint=endpoint.url, retry_timeout_s=5))
        started = time.monotonic()
        with pytest.raises(ExportStoreError) as err:
            store.versions(MODEL)
        assert time.monotonic() - started < 15
        line = str(err.value)
        assert "\n" not in line and line.startswith(f"s3://{endpoint.bucket}/p/ctr/: list failed")
        assert "403" in line and "InvalidAccessKeyId" in line
        with pytest.raises(ExportStoreError, match="head failed: PermissionDeniedError"):
            store.begin(MODEL, 1)


# -- reading through a store: the readers a restore uses ------------------------------


def chain_into(store: ExportStore, reference: Path) -> tuple[list[Shard], dict[int, list[TableSnapshot]]]:
    """Base 1, delta 2 (updates, deletions, re-inserts), delta 3, of two
    shards training both tables (FTRL and Adagrad state), written through
    `store` and, the same cuts, into the local `reference` root; returns the
    source shards (at open version 4) and the last cut's snapshots."""
    rng = np.random.default_rng(11)
    shards = make_shards(2)
    universe = np.unique(rng.integers(0, 2**64, size=2100, dtype=np.uint64))[:2000]
    steps: list[tuple[slice, slice | None]] = [(slice(0, 1200), None), (slice(900, 1600), slice(0, 200))]
    steps.append((slice(1500, 2000), slice(1200, 1250)))
    for version, (trained, gone) in enumerate(steps, start=1):
        push(shards, universe[trained], rng, 1_000.0 * version)
        if gone is not None:
            delete(shards, universe[gone])
        parent = None if version == 1 else version - 1
        snaps = cut(shards, parent)
        offsets = {"clicks": {0: 10 * version, 1: 11 * version}}
        write_version_to(store, MODEL, version, parent, snaps, offsets, MODEL_CONFIG, 2)
        write_version(reference, MODEL, version, parent, snaps, offsets, MODEL_CONFIG, 2)
    return shards, snaps


def overwrite(store: ExportStore, version: int, name: str, data: bytes) -> None:
    """Replace a stored file's bytes behind the store's back (damage)."""
    if isinstance(store, LocalExportStore):
        (store.model_dir(MODEL) / f"{version:010d}" / name).write_bytes(data)
        return
    import obstore

    assert isinstance(store, S3ExportStore)
    obstore.put(store.client, store.key(MODEL, version, name), data)


def test_a_stored_version_reads_back_row_for_row(store: ExportStore, tmp_path: Path) -> None:
    """`load_version` of (store, model, version): every array of every
    snapshot as written (keys, weights with their optimizer state, metadata,
    deletions), and its serving files; from a bucket, one GET per file."""
    _, snaps = chain_into(store, tmp_path / "reference")
    source = stored_version(store, MODEL, 3)
    if isinstance(store, S3ExportStore):
        assert isinstance(source, StoredVersion) and source.where().startswith("s3://")
    counted = CountingReads(source)
    loaded = load_version(counted)
    assert loaded.manifest == verify_version(source) == store_manifest(store, MODEL, 3)
    for shard, written in snaps.items():
        got = {s.table: s for s in loaded.snapshots[shard]}
        for s in written:
            assert (got[s.table].version, got[s.table].kind, got[s.table].config) == (3, "delta", s.config)
            for name in TableSnapshot.ARRAYS:
                a, b = getattr(s, name), getattr(got[s.table], name)
                assert a.dtype == b.dtype, name
                np.testing.assert_array_equal(a, b, err_msg=name)
    files = [f.name for f in loaded.manifest.files]
    # Every file read whole once (its size and SHA-256 checked on those
    # bytes). Unverified, a bucket's are still one GET each (no HEAD first);
    # a local directory's are stat'ed and opened in place, as ever.
    assert (counted.reads, counted.sizes) == ([MANIFEST_NAME, *files], [])
    unverified = CountingReads(source)
    assert load_version(unverified, verify=False).manifest == loaded.manifest
    if isinstance(store, S3ExportStore):
        assert (unverified.reads, unverified.sizes) == ([MANIFEST_NAME, *files], [])
    else:
        assert (unverified.reads, unverified.sizes) == ([MANIFEST_NAME], files)
    served = load_version(source, serving=True)
    reference = load_version(tmp_path / "reference" / MODEL / "0000000003", serving=True)
    assert served.manifest.tables == reference.manifest.tables
    for shard, snapshots in reference.snapshots.items():
        for s, w in zip(served.snapshots[shard], snapshots, strict=True):
            assert s.table == w.table
            for name in TableSnapshot.ARRAYS:
                np.testing.assert_array_equal(getattr(s, name), getattr(w, name), err_msg=name)


class CountingReads(VersionSource):
    """A source that records which of its files are read or sized, reading
    them from the real one."""

    def __init__(self, inner: VersionSource) -> None:
        self.inner = inner
        self.remote = inner.remote
        self.reads: list[str] = []
        self.sizes: list[str] = []

    @property
    def version(self) -> int | None:
        return self.inner.version

    def where(self, name: str | None = None) -> str:
        return self.inner.where(name)

    def sibling(self, version: int) -> str:
        return self.inner.sibling(version)

    def size(self, name: str) -> int | None:
        self.sizes.append(name)
        return self.inner.size(name)

    def read(self, name: str) -> bytes:
        self.reads.append(name)
        return self.inner.read(name)

    def local(self, name: str) -> Path | None:
        return self.inner.local(name)


def test_the_latest_chain_of_a_store_restores_as_the_local_one(store: ExportStore, tmp_path: Path) -> None:
    source, _ = chain_into(store, tmp_path / "reference")
    model = StoredModel(store, MODEL)
    local = latest_chain(tmp_path / "reference" / MODEL, verify=True)
    chain = latest_chain(model, verify=True)
    assert [(c.version, c.kind, c.parent) for c in chain] == [(1, "base", None), (2, "delta", 1), (3, "delta", 2)]
    # The same files (sizes and SHA-256s) as the local chain of the same cuts.
    assert [c.manifest.files for c in chain] == [c.manifest.files for c in local]
    assert [c.location for c in chain] == [store.location(MODEL, v) for v in (1, 2, 3)]
    assert [i.manifest for i in list_versions(model)] == [c.manifest for c in chain]
    restored, expected = restore_shards(chain, 3), restore_shards(local, 3)
    assert restored.offsets == expected.offsets == {"clicks": {0: 30, 1: 33}}
    for cfg in TABLES:
        assert_same_rows(rows_of(restored.shards, cfg.name), rows_of(expected.shards, cfg.name))
        assert_same_rows(rows_of(restored.shards, cfg.name), rows_of(source, cfg.name))
    older = restore_shards(latest_chain(model, upto=2, verify=True), 1)
    for cfg in TABLES:
        assert_same_rows(
            rows_of(older.shards, cfg.name),
            rows_of(restore_shards(latest_chain(tmp_path / "reference" / MODEL, upto=2), 1).shards, cfg.name),
        )
    if isinstance(store, S3ExportStore):
        with pytest.raises(ValueError, match="is not a local directory"):
            _ = chain[0].path


def test_a_changed_byte_in_a_stored_file_fails_naming_it_and_both_checksums(store: ExportStore, tmp_path: Path) -> None:
    chain_into(store, tmp_path / "reference")
    entry = next(f for f in store_manifest(store, MODEL, 3).files if f.name == "shard-1.lr.npz")
    raw = bytearray(store.read_bytes(MODEL, 3, entry.name))
    raw[len(raw) // 2] ^= 0x01
    overwrite(store, 3, entry.name, bytes(raw))
    actual = hashlib.sha256(raw).hexdigest()
    where = store.location(MODEL, 3, entry.name)
    model = StoredModel(store, MODEL)
    for attempt in (
        lambda: verify_version(stored_version(store, MODEL, 3)),
        lambda: load_version(stored_version(store, MODEL, 3)),
        lambda: restore_shards(latest_chain(model), 2),
        lambda: latest_chain(model, verify=True),
    ):
        with pytest.raises(ExportCorruptError) as info:
            attempt()
        err = info.value
        assert (err.file, err.expected, err.actual) == (where, entry.sha256, actual)
        assert err.detail == f"{where}: sha256 {actual}, manifest expects {entry.sha256}"
    if isinstance(store, S3ExportStore):
        assert where.startswith(f"{store.url}/{MODEL}/0000000003/")
    assert [c.version for c in latest_chain(model, verify=True, fallback=True)] == [1, 2]
    # A missing parent is named where it would be.
    assert store.delete_version(MODEL, 1)
    with pytest.raises(ExportCorruptError, match="has parent 1, which is missing") as gone:
        latest_chain(model, upto=2)
    assert gone.value.file == store.location(MODEL, 1)


def test_an_upload_cut_before_its_manifest_is_invisible_to_readers(store: ExportStore, tmp_path: Path) -> None:
    """Version 4's data files are all in the store, its manifest never came:
    no listing and no chain sees it, and the chain ends at 3."""
    shards, _ = chain_into(store, tmp_path / "reference")
    model = StoredModel(store, MODEL)
    push(shards, np.arange(1, 100, dtype=np.uint64), np.random.default_rng(1), 9.0)
    staged = write_version(tmp_path / "staged", MODEL, 4, 3, cut(shards, 3), {}, MODEL_CONFIG, 2)
    cut_short = store.begin(MODEL, 4)
    for entry in read_manifest(staged).files + read_manifest(staged).serving_files:
        with cut_short.open(entry.name) as f:
            f.write((staged / entry.name).read_bytes())
    assert [i.version for i in list_versions(model)] == [1, 2, 3]
    assert [w for w, _ in store_versions(store, MODEL)] == [store.location(MODEL, v) for v in (1, 2, 3)]
    assert [c.version for c in latest_chain(model, verify=True)] == [1, 2, 3]
    assert [c.version for c in latest_chain(model, upto=4)] == [1, 2, 3]
    with pytest.raises(ExportCorruptError, match="manifest.json: missing"):
        load_version(stored_version(store, MODEL, 4))
    with pytest.raises(ExportNotFoundError, match=f"no export version <= 0 in {store.url}"):
        latest_chain(model, upto=0)
