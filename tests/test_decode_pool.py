"""The decode pool: its pipes are widened, and it still runs jobs."""

from __future__ import annotations

import concurrent.futures
import fcntl
import multiprocessing

import orjson
import pytest

from consumers.decode import decode_records
from consumers.decode_pool import PIPE_BYTES, start_decode_pool, widen_pipes

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


def test_a_pool_whose_pipes_cannot_be_found_is_left_as_it_is() -> None:
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    queue = pool._call_queue  # type: ignore[attr-defined]
    try:
        pool._call_queue = None  # type: ignore[attr-defined]  # as if the executor changed
        assert widen_pipes(pool) is False
    finally:
        pool._call_queue = queue  # type: ignore[attr-defined]
        pool.shutdown()
