"""The decode pool: its pipes are widened, it still runs jobs, and its
processes load what decoding needs, not the whole command."""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from commands import PROJECT, clean_env

from consumers.decode import decode_records
from consumers.decode_pool import PIPE_BYTES, start_decode_pool, widen_pipes

# The `ctrps` console script's shape (it imports `app.entry` at its top), starting
# a pool: a spawned process re-runs the parent's main script before its first
# job, so this is all a decode process of a `ctrps worker` imports.
CONSOLE_SCRIPT = """\
import sys
from app.entry import main
if __name__ == "__main__":
    from consumers.decode import decode_records
    from consumers.decode_pool import start_decode_pool
    pool = start_decode_pool(1)
    decoded = pool.submit(decode_records, [b'{"label": 1, "features": {"f": "v"}}'], "m", 1 << 20).result(60)
    assert decoded.batch.size == 1, decoded
    print(" ".join(pool.submit(eval, "sorted(__import__('sys').modules)").result(60)))
    pool.shutdown()
"""

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", None)


@pytest.mark.skipif(F_GETPIPE_SZ is None, reason="pipe sizes are a Linux feature")
def test_the_job_and_result_pipes_are_widened_and_jobs_run() -> None:
    pool = start_decode_pool(1)
    try:
        for queue in (pool._call_queue, pool._result_queue):  # type: ignore[attr-defined]
            assert fcntl.fcntl(queue._reader.fileno(), F_GETPIPE_SZ) == PIPE_BYTES
        # A job bigger than a default 64 KiB pipe, through the wide pipes.
        values: list[bytes | None] = [
            orjson.dumps({"label": i % 2, "features": {"f": f"v{i}", "pad": "x" * 400}}) for i in range(400)
        ]
        decoded = pool.submit(decode_records, values, "m", 1 << 20).result(timeout=60)
        assert decoded.batch.size == 400 and not decoded.rejected
    finally:
        pool.shutdown()


@pytest.mark.process
def test_a_pool_whose_pipes_cannot_be_found_is_left_as_it_is() -> None:
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    queue = pool._call_queue  # type: ignore[attr-defined]
    try:
        pool._call_queue = None  # type: ignore[attr-defined]  # as if the executor changed
        assert widen_pipes(pool) is False
    finally:
        pool._call_queue = queue  # type: ignore[attr-defined]
        pool.shutdown()


@pytest.mark.process
def test_a_decode_process_of_the_command_loads_neither_aiohttp_nor_the_checkpoints(tmp_path: Path) -> None:
    script = tmp_path / "ctrps"
    script.write_text(CONSOLE_SCRIPT)
    env = clean_env(PYTHONPATH=str(PROJECT))  # this tree's code, in the script and its children
    done = subprocess.run(
        [sys.executable, str(script)], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert {"consumers.decode", "app.entry"} <= loaded  # the job ran, after the script's imports
    heavy = ("aiohttp", "aiokafka", "ps_core.checkpoint", "ps_core.net", "consumers.broker", "app.cli")
    assert not {m for m in loaded for h in heavy if m == h or m.startswith(h + ".")}
