"""An exports directory belongs to one cluster (``<exports-dir>/owner.json``).

Shard 0 claims it before it restores or exports; another owner's shard 0 is
refused in one line (exit 4) unless ``--take-over-exports``; ``ctrps
cluster`` with its own broker exports into a directory of its own run, and
on an outside Kafka claims ``--exports-dir`` as its stream. Every pipeline
here is real processes on one directory."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from commands import PROJECT, clean_env, ctrps
from jsonlog import read_json_lines
from test_cluster import admin_headers, kill_cluster, start_cluster, wait_for_line

from ps_core import Learner
from ps_core.checkpoint.export_files import list_versions
from ps_core.checkpoint.owner import HAND_STARTED, OWNER_FILE, ExportsOwnedError, claim_exports, read_owner
from ps_core.errors import ExportCorruptError
from ps_core.synthetic import SyntheticStream

pytestmark = pytest.mark.slow  # real processes for seconds each: make test-fast leaves them out


def _listing(root: Path) -> list[str]:
    """Every path under `root` but the owner record: what a refused start must not touch."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != OWNER_FILE)


def _pipeline_exports(root: Path, owner: str) -> Learner:
    """A version of an earlier pipeline of `owner` in ``<root>/ctr`` (as its
    shard 0 would have cut it)."""
    learner = Learner("lr")
    learner.learn(SyntheticStream(seed=3).batch(500))
    learner.save(root)
    claim_exports(root, owner, "ctrps shard", take_over=True)
    return learner


async def _shard(log: Path, exports: Path, *flags: str) -> asyncio.subprocess.Process:
    with log.open("wb") as err:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "shard", "--port", "0", "--exports-dir", str(exports),
            "--export-interval", "0", "--log-format", "json", *flags,
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stderr=err,
        )  # fmt: skip


async def _stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    return await asyncio.wait_for(proc.wait(), 30)


def _refused(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """The one error line of a refused start (exit 4)."""
    assert out.returncode == 4, out.stderr
    lines = [orjson.loads(line) for line in out.stderr.splitlines() if line.strip()]
    errors = [x for x in lines if x["level"] == "error"]
    assert len(errors) == 1 and errors[0]["exit_code"] == 4, lines
    assert not any(x["msg"] in ("restore", "listening") for x in lines), lines
    line: dict[str, Any] = errors[0]
    return line


@pytest.mark.process
async def test_a_second_pipeline_on_owned_exports_is_refused_in_one_line_until_it_takes_over(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    _pipeline_exports(exports, "pipeline-a")
    first = await _shard(tmp_path / "a.log", exports, "--exports-owner", "pipeline-a")
    try:
        claimed = await wait_for_line(first, tmp_path / "a.log", {"msg": "exports claimed"}, 30)
        assert claimed["owner"] == "pipeline-a"
        await wait_for_line(first, tmp_path / "a.log", {"msg": "listening"}, 30)
        before, owner = _listing(exports), read_owner(exports)
        # Another pipeline's shard 0, and a hand-started one, while the first runs.
        for flags in (["--exports-owner", "pipeline-b"], []):
            line = _refused(
                ctrps("shard", "--port", "0", "--exports-dir", str(exports), "--log-format", "json", *flags)
            )
            mine = flags[1] if flags else HAND_STARTED
            assert f"exports directory {exports} belongs to 'pipeline-a' (ctrps shard, pid {first.pid}" in line["msg"]
            assert f"not to {mine!r}" in line["msg"] and "--take-over-exports" in line["msg"]
        assert _listing(exports) == before and read_owner(exports) == owner
    finally:
        assert await _stop(first) == 0
    # Told to, the second takes it over: recorded, said, and it restores what is there.
    second = await _shard(tmp_path / "b.log", exports, "--exports-owner", "pipeline-b", "--take-over-exports")
    try:
        took = await wait_for_line(second, tmp_path / "b.log", {"msg": "took over the exports directory"}, 30)
        assert (took["level"], took["owner"], took["taken_from"]) == ("warning", "pipeline-b", "pipeline-a")
        restored = await wait_for_line(second, tmp_path / "b.log", {"msg": "restore"}, 30)
        assert restored["version"] == 1
        await wait_for_line(second, tmp_path / "b.log", {"msg": "listening"}, 30)  # its handler in place
    finally:
        assert await _stop(second) == 0
    record = read_owner(exports)
    assert record is not None and (record.owner, record.taken_from) == ("pipeline-b", "pipeline-a")


@pytest.mark.process
@pytest.mark.kafka
async def test_ctrps_cluster_exports_into_its_own_directory_and_leaves_a_pipelines_alone(tmp_path: Path) -> None:
    exports = tmp_path / "exports"
    earlier = _pipeline_exports(exports, HAND_STARTED)
    pipeline = await _shard(tmp_path / "p.log", exports)
    await wait_for_line(pipeline, tmp_path / "p.log", {"msg": "listening"}, 30)
    assert await _stop(pipeline) == 0
    before, owner = _listing(exports), read_owner(exports)
    assert owner is not None and owner.owner == HAND_STARTED

    err_log = tmp_path / "cluster.log"
    proc = await start_cluster(tmp_path, "--shards", "1", "--workers", "1", "--no-produce", "--export-interval", "0")
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        run = Path(ready["exports"])
        assert run.parent == exports and re.fullmatch(r"cluster-\d{8}T\d{6}Z-[0-9a-f]{6}", run.name), run
        async with aiohttp.ClientSession() as session:
            async with session.post(ready["api"] + "/v1/exports", json={}, headers=admin_headers(ready)) as resp:
                assert resp.status == 201, await resp.text()
                cut = await resp.json()
            async with session.get(ready["api"] + "/v1/exports") as resp:
                listed = await resp.json()
        assert Path(cut["path"]).parent == run / "ctr" and cut["version"] == 1

        # The API lists this run's versions only: not the earlier pipeline's version 1.
        def as_listed(model_dir: Path) -> Any:
            return orjson.loads(orjson.dumps([v.to_json() for v in list_versions(model_dir)]))

        assert listed["versions"] == as_listed(run / "ctr") != as_listed(exports / "ctr"), listed
        record = read_owner(run)
        assert record is not None and (record.owner, record.by) == (run.name, "ctrps cluster")
        # A hand-started shard 0 on the run's directory is refused while it runs.
        line = _refused(ctrps("shard", "--port", "0", "--exports-dir", str(run), "--log-format", "json"))
        assert f"belongs to {run.name!r} (ctrps cluster" in line["msg"]
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        await kill_cluster(proc, tmp_path)
    shards = [x for x in read_json_lines(tmp_path / "children.log") if x.get("msg") == "exports claimed"]
    assert [x["owner"] for x in shards] == [run.name]
    # The earlier pipeline's directory is as it was; started again, it restores its own version.
    assert sorted(set(_listing(exports)) - {p for p in _listing(exports) if p.startswith(run.name)}) == before
    assert read_owner(exports) == owner
    again = await _shard(tmp_path / "p2.log", exports)
    try:
        restored = await wait_for_line(again, tmp_path / "p2.log", {"msg": "restore"}, 30)
        assert restored["version"] == list_versions(exports / "ctr")[-1].version == 1
        # Its SIGTERM handler is in place once it listens: a stop before that is a kill.
        await wait_for_line(again, tmp_path / "p2.log", {"msg": "listening"}, 30)
    finally:
        assert await _stop(again) == 0
    assert Learner.load(exports).events_learnt == earlier.events_learnt


@pytest.mark.process
def test_a_cluster_on_an_outside_kafka_claims_the_directory_as_its_stream(tmp_path: Path, kafka_bootstrap: str) -> None:
    exports = tmp_path / "exports"
    claim_exports(exports, HAND_STARTED, "ctrps shard")
    before = _listing(exports)
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "cluster", "--port", "0", "--bootstrap", kafka_bootstrap,
         "--exports-dir", str(exports), "--log-format", "json", "--no-produce"],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    line = _refused(out)
    assert re.search(r"not to 'kafka \S+ group ctrps'", line["msg"]), line["msg"]
    assert not any(orjson.loads(x)["msg"] == "started" for x in out.stderr.splitlines() if x.strip())
    assert _listing(exports) == before
    # The stream's owner claims it again on its next run, and passes.
    owner = re.search(r"not to '([^']+)'", line["msg"])
    assert owner is not None
    exports2 = tmp_path / "exports2"
    first, _ = claim_exports(exports2, owner.group(1), "ctrps cluster")
    assert claim_exports(exports2, owner.group(1), "ctrps cluster") == (first, False)


def test_claims_race_to_one_owner_and_a_damaged_record_is_named(tmp_path: Path) -> None:
    root = tmp_path / "exports"
    won: list[str] = []
    refused: list[str] = []
    start = threading.Barrier(8)

    def claim(i: int) -> None:
        start.wait()
        try:
            won.append(claim_exports(root, f"owner-{i}", "ctrps shard")[0].owner)
        except ExportsOwnedError:
            refused.append(f"owner-{i}")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = read_owner(root)
    assert record is not None and len(refused) == 7 and won == [record.owner]
    assert [p.name for p in root.iterdir()] == [OWNER_FILE]  # no temporary left
    (root / OWNER_FILE).write_text("{not json")
    with pytest.raises(ExportCorruptError, match=re.escape(str(root / OWNER_FILE))):
        claim_exports(root, "anyone", "ctrps shard")
