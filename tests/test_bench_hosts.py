"""bench/bench_hosts.py's shard partition, through its main function: every
role in a namespace of its own, the bias shard's host cut off for 8 s; every
event produced is trained (replaying at most one window), no traceback, and
nothing of the run's hosts is left."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from commands import PROJECT

sys.path.insert(0, str(PROJECT / "bench"))
from bench_hosts import main, parser  # noqa: E402
from hosts import available  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.kafka]
if why := available():
    pytestmark.append(pytest.mark.skip(reason=why))


def namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.startswith("ctrps-")}


def test_a_shard_partition_trains_every_event_once() -> None:
    before = namespaces()
    out = asyncio.run(main(parser().parse_args(["--quick", "--drill", "shard_partition"])))
    r = out["shard_partition"]
    assert r["error"] == "", r
    assert r["produced"] > 0 and r["produced_after_fault"] > 0, r
    assert r["trained"] >= r["produced"], r  # at least once
    assert 0 <= r["replayed"] <= out["aim_replay_max"], r  # at most one window again
    assert r["tracebacks"] == 0, r
    assert r["resume_s"] is not None, r
    assert out["broker_address"].startswith("10."), out  # the broker's host, not loopback
    assert namespaces() <= before
