"""``ctrps shard --exports-dir s3://bucket/prefix`` (moto's server, the
`s3_endpoint` fixture): shard 0 claims the bucket and exports cuts into it,
and every shard restores at start from the bucket's newest loadable
version, into the shard count it cut with or another one; a damaged version
there is passed over in one line as on a disk; a bucket that cannot be
reached stops a shard's start in one line (exit 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
import pytest
from commands import PROJECT, ctrps
from s3_server import S3Endpoint
from test_export_store import s3_env
from test_exporter import _train
from test_exporter_s3 import bucket  # noqa: F401  (the fixture)
from test_restore_consistent import KEYS, LR, Shards, _declared, _joined, _lease_works, _no_tracebacks

from ps_core.checkpoint.export_files import latest_chain
from ps_core.checkpoint.exportstore import S3ExportStore, StoredModel, store_for
from ps_core.checkpoint.owner import HAND_STARTED, OWNER_FILE
from ps_core.checkpoint.registry import ModelSpec
from ps_core.checkpoint.restore import restore_shards
from ps_core.model.models import make_model
from ps_core.net.client import PSClient

pytestmark = [pytest.mark.slow, pytest.mark.process]

TRAINED = KEYS[:2000]


ADS = ModelSpec.of(make_model("lr", "ads", optimizer=dict(LR.optimizer)))
"""A second model of the cluster, created through the control plane."""


async def _two_cuts(shards: Shards, *, second_model: bool = False) -> np.ndarray:
    """Shards trained, a base and a delta cut into their exports; what they
    serve for every key (trained or not) once the delta is cut. With
    `second_model`, `ADS` is created and trained too, on other keys."""
    async with shards.serving(restore=False, deadline_s=2) as (client, control):
        await _declared(control, shards)
        if second_model:
            assert (await control.create_model(ADS.declaration())).created
        for step, kind in enumerate(("base", "delta"), start=1):
            await _train(client, LR, TRAINED[(step - 1) * 1000 : step * 1000 + 500], step)
            if second_model:
                await _train(client, ADS.tables[0], TRAINED[-300 * step :], 10 + step)
            lease = await control.acquire_lease("w", wait_s=5)
            await control.release_lease(lease.lease_id, {"clicks": {0: 100 * step, 1: 10 * step}})
            assert (await control.export_now(kind)).version == step
        return await client.pull(LR.name, KEYS)


def _restored(shards: Shards, i: int) -> dict[str, object]:
    lines = [line for line in shards.lines(i) if line.get("msg") == "restore"]
    assert len(lines) == 1, lines
    return lines[0]


async def test_shards_on_a_bucket_export_there_and_restart_into_another_shard_count(
    bucket: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "two").mkdir()
    (tmp_path / "three").mkdir()
    two = Shards(2, bucket, tmp_path / "two")  # type: ignore[arg-type]
    served = await _two_cuts(two, second_model=True)
    store = store_for(bucket)
    assert isinstance(store, S3ExportStore)
    owner = orjson.loads(store.read_object(OWNER_FILE) or b"null")
    assert owner["owner"] == HAND_STARTED and owner["by"] == "ctrps shard"
    chain = latest_chain(StoredModel(store, "m"), verify=True)
    assert [(v.version, v.kind) for v in chain] == [(1, "base"), (2, "delta")]
    exported_rows = sum(len(s.tables[LR.name]) for s in restore_shards(chain, 1).shards)
    assert exported_rows == TRAINED.size
    # The second model: its declaration and versions beside the first's.
    assert store.object_size("ads/model.json")
    ads_chain = latest_chain(StoredModel(store, "ads"), verify=True)
    assert [v.version for v in ads_chain] == [1, 2]
    ads_served = await PSClient.local(restore_shards(ads_chain, 1).shards).pull("ads_w", KEYS)
    assert np.count_nonzero(ads_served) > 0

    three = Shards(3, bucket, tmp_path / "three")  # type: ignore[arg-type]
    async with three.serving(restore=True, deadline_s=2) as (client, control):
        reports = await _joined(control, three)
        assert [r.version for r in reports] == [2, 2, 2]
        await _lease_works(control)
        assert await control.coordinator_offsets() == {"clicks": {0: 200, 1: 20}}
        # `ctrps export --list`'s call: the bucket's versions, as cut.
        listed = await control.exports()
        assert [(v.version, v.kind, v.parent) for v in listed.versions] == [(1, "base", None), (2, "delta", 1)]
        assert [v.rows for v in listed.versions] == [v.manifest.rows() for v in chain]
        held = [s.tables[LR.name].features for s in await control.stats()]
        # Row for row what the two shards served at the cut, now from three.
        np.testing.assert_array_equal(await client.pull(LR.name, KEYS), served)
        assert [m.name for m in (await control.models()).models] == ["m", "ads"]
        np.testing.assert_array_equal(await client.pull("ads_w", KEYS), ads_served)
    restores = [_restored(three, i) for i in range(3)]
    assert [(r["version"], r["chain"], r["shard_id"]) for r in restores] == [(2, "1,2", i) for i in range(3)]
    assert {r["models"] for r in restores} == {"m,ads"}
    ads_rows = sum(len(s.tables["ads_w"]) for s in restore_shards(ads_chain, 1).shards)
    assert ads_rows == 600  # the last 300 and 600 keys trained
    assert sum(int(r["rows"]) for r in restores) == exported_rows + ads_rows  # type: ignore[call-overload]
    assert exported_rows == sum(held)
    for i in range(3):
        _no_tracebacks(three, i)
    assert not (PROJECT / "s3:").exists()  # nothing written to a local path named after the URL


async def test_a_damaged_version_in_the_bucket_is_passed_over_in_one_line(
    bucket: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "cut").mkdir()
    (tmp_path / "again").mkdir()
    await _two_cuts(Shards(2, bucket, tmp_path / "cut"))  # type: ignore[arg-type]
    store = store_for(bucket)
    assert isinstance(store, S3ExportStore)
    key = store.key("m", 2, "shard-1.m_w.npz")
    raw = bytearray(store.read_bytes("m", 2, "shard-1.m_w.npz"))
    raw[len(raw) // 2] ^= 0x01
    store.write_object(key, bytes(raw), replace=True)
    expected_v1 = restore_shards(latest_chain(StoredModel(store, "m"), upto=1, verify=True), 2)

    again = Shards(2, bucket, tmp_path / "again")  # type: ignore[arg-type]
    async with again.serving(restore=True, deadline_s=2) as (client, control):
        reports = await _joined(control, again)
        assert [r.version for r in reports] == [1, 1]
        want = await PSClient.local(expected_v1.shards).pull(LR.name, KEYS)
        np.testing.assert_array_equal(await client.pull(LR.name, KEYS), want)
    for i in range(2):
        refused = [line for line in again.lines(i) if line.get("msg") == "version refused"]
        assert len(refused) == 1, refused
        assert refused[0]["file"] == store.url_of(key)
        assert (_restored(again, i)["version"], _restored(again, i)["chain"]) == (1, "1")


async def test_a_shard_restarted_alone_has_the_cluster_reload_the_buckets_version(
    bucket: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    two = Shards(2, bucket, tmp_path)  # type: ignore[arg-type]
    served = await _two_cuts(two)
    async with two.serving(restore=True, deadline_s=5) as (client, control):
        await _joined(control, two)
        await _train(client, LR, TRAINED[:500], 9)  # past the cut, on both shards
        assert not np.array_equal(await client.pull(LR.name, KEYS), served)
        two.stop(1)
        two.start(1)  # it loads version 2; shard 0 trained past it: the coordinator has it reload version 2
        reports = await _joined(control, two)
        assert [(r.version, r.clean) for r in reports] == [(2, True), (2, True)]
        np.testing.assert_array_equal(await client.pull(LR.name, KEYS), served)
    reloaded = [line for line in two.lines(0) if line.get("msg") == "restore" and line.get("by") == "coordinator"]
    assert [(line["version"], line["chain"]) for line in reloaded] == [(2, "1,2")]
    assert [line["version"] for line in two.lines(0) if line.get("msg") == "cluster restore"] == [2]


@pytest.mark.parametrize(
    ("args", "cause"),
    [
        (("--model-name", "m"), "cannot be written"),  # shard 0, its exporter's bucket probed at start
        (("--shard-id", "1", "--num-shards", "2", "--model-name", "m"), "cannot be read"),  # its restore's listing
    ],
)
def test_a_bucket_that_cannot_be_reached_stops_the_shard_in_one_line(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], cause: str
) -> None:
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    s3_env(s3_endpoint, monkeypatch)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint.url)
    url = f"s3://no-such-bucket-{s3_endpoint.bucket}/exports"
    done = ctrps("shard", "--port", "0", "--exports-dir", url, *args)
    assert done.returncode == 1, done.stderr
    errors = [line for line in done.stderr.splitlines() if url in line]
    assert len(errors) == 1 and f"exports {url} {cause}: " in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (PROJECT / "s3:").exists()
