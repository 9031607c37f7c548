"""bench/hosts.py: hosts in network namespaces on one bridge reach each other
by their addresses; a cut stops them and a restore brings them back; a
partition cuts two hosts from each other alone; a tbf limit slows a bulk
transfer; nothing of a run is left after it."""

from __future__ import annotations

import ipaddress
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from commands import PROJECT

sys.path.insert(0, str(PROJECT / "bench"))
from hosts import Hosts, available  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.process]
if why := available():
    pytestmark.append(pytest.mark.skip(reason=why))

PORT = 5601
_SINK = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("listening", flush=True)
while True:
    c, _ = s.accept()
    n = 0
    while chunk := c.recv(1 << 16):
        n += len(chunk)
    c.sendall(str(n).encode())
    c.close()
"""
_SEND = """
import socket, sys, time
t0 = time.monotonic()
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"x" * int(sys.argv[3]))
c.shutdown(socket.SHUT_WR)
got = int(c.recv(64))
assert got == int(sys.argv[3]), got
print(time.monotonic() - t0)
"""


@contextmanager
def sink(hosts: Hosts, host: str) -> Iterator[None]:
    """A TCP server in `host` on its address that counts what it is sent."""
    proc = subprocess.Popen(
        hosts.cmd(host, [sys.executable, "-c", _SINK, hosts.address[host], str(PORT)]),
        stdout=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"listening\n"
        yield
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert proc.stdout is not None
        proc.stdout.close()


def send(hosts: Hosts, src: str | None, dst: str, nbytes: int = 1, timeout_s: float = 2.0) -> float | None:
    """Seconds to send `nbytes` from `src` (None: the root namespace) to
    `dst`'s sink and hear back; None when the connection fails."""
    argv = [sys.executable, "-c", _SEND, hosts.address[dst], str(PORT), str(nbytes), str(timeout_s)]
    done = subprocess.run(hosts.cmd(src, argv) if src else argv, capture_output=True, text=True, timeout=timeout_s + 60)
    return float(done.stdout) if done.returncode == 0 else None


def until_sends(hosts: Hosts, src: str | None, dst: str, timeout_s: float = 15.0) -> float:
    """Seconds until a send from `src` to `dst` succeeds (fails the test past `timeout_s`)."""
    t0 = time.monotonic()
    while send(hosts, src, dst) is None:
        assert time.monotonic() - t0 < timeout_s, f"{src} does not reach {dst} within {timeout_s}s"
    return time.monotonic() - t0


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    with Hosts(["a", "b", "c"]) as h:
        yield h
    assert not h.leftovers()


def test_hosts_reach_each_other_and_a_cut_stops_them(hosts: Hosts) -> None:
    assert len(set(hosts.address.values())) == 3
    assert all(ipaddress.ip_address(a) in hosts.subnet for a in hosts.address.values())
    with sink(hosts, "a"):
        until_sends(hosts, "b", "a")
        until_sends(hosts, None, "a")  # the root namespace, over the bridge's gateway address

        hosts.cut("a")
        t0 = time.monotonic()
        assert send(hosts, "b", "a", timeout_s=2.0) is None
        assert send(hosts, None, "a", timeout_s=2.0) is None
        assert time.monotonic() - t0 < 20  # both attempts bounded by their timeouts (and start-up)

        hosts.restore("a")
        assert until_sends(hosts, "b", "a") < 15


def test_a_partition_cuts_two_hosts_alone(hosts: Hosts) -> None:
    with sink(hosts, "a"):
        until_sends(hosts, "b", "a")
        hosts.partition("a", "b")
        assert send(hosts, "b", "a", timeout_s=2.0) is None
        assert send(hosts, "c", "a") is not None  # the others still reach it
        assert send(hosts, None, "a") is not None
        hosts.heal("a", "b")
        until_sends(hosts, "b", "a")


def test_a_limit_slows_a_bulk_transfer(hosts: Hosts) -> None:
    nbytes, mbit = 4_000_000, 16  # 2 s at the limit
    with sink(hosts, "a"):
        until_sends(hosts, "b", "a")
        free = send(hosts, "b", "a", nbytes, timeout_s=30)
        assert free is not None
        hosts.limit("b", mbit)
        limited = send(hosts, "b", "a", nbytes, timeout_s=30)
        hosts.unlimit("b")
        again = send(hosts, "b", "a", nbytes, timeout_s=30)
    assert limited is not None and again is not None
    # tbf's rate, with generous margins: no faster than 1.5x the limit,
    # at least 4x slower than the same transfer without it.
    assert nbytes * 8 / limited / 1e6 < 1.5 * mbit, limited
    assert limited > 4 * max(free, again), (free, limited, again)


def test_nothing_is_left_after_exit() -> None:
    with Hosts(["x", "y"]) as h:
        assert len(h.leftovers()) == 5  # 2 namespaces, 2 veths, the bridge
    assert h.leftovers() == []
    assert not any(ns.startswith(f"ctrps-{h.run}") for ns in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split())  # fmt: skip
    assert h.run not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_an_exception_inside_removes_everything_and_ends_its_processes() -> None:
    with pytest.raises(KeyboardInterrupt), Hosts(["x"]) as h:
        left = subprocess.Popen(h.cmd("x", ["sleep", "600"]), start_new_session=True)
        # Running in the namespace, as a process its starter did not stop is
        # (raised at once, `ip netns exec` may not have entered it yet).
        deadline = time.monotonic() + 10
        while (
            str(left.pid)
            not in subprocess.run(
                ["ip", "netns", "pids", h.namespace["x"]], capture_output=True, text=True, check=False
            ).stdout.split()
        ):
            assert time.monotonic() < deadline and left.poll() is None, "the process never entered its namespace"
            time.sleep(0.01)  # poll interval; the deadline bounds it
        raise KeyboardInterrupt  # as Ctrl-C would
    try:
        assert h.leftovers() == []
        assert left.wait(timeout=10) == -signal.SIGKILL
    finally:  # a failure here leaves no process behind for the tests after it
        if left.poll() is None:
            left.kill()
            left.wait(10)
