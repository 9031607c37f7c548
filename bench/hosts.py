"""Hosts on one machine, for drills across a network: each host a network
namespace with its own address, joined by a veth pair to one bridge.

`Hosts(["broker", "shard-0", ...])` creates, for one run:

- a bridge ``cb<run>`` in the root namespace, holding the gateway address
  (``.1`` of the run's /24): the process that makes the hosts (a benchmark,
  a test) reaches every host over it without running in a namespace itself,
  and a cut host drops out of its reach too, as it would across a network;
- per host, a namespace ``ctrps-<run>-<host>``, loopback up, and a veth pair:
  ``eth0`` inside (the host's address, ``.10`` onwards) and ``cv<run><i>`` on
  the bridge;
- a private /24 in 10.0.0.0/8 that no address or route of this machine
  overlaps, so the run sends only to addresses it created.

``<run>`` is six random hex digits: runs at once never share a name. A host is
``cut`` (its bridge-side veth down: no packet in or out) and ``restore``d,
``limit``ed (a tbf qdisc on both ends of its veth: egress inside, egress
towards it on the bridge side) and ``unlimit``ed, or ``partition``ed from
another host alone (blackhole routes both ways, the rest of the network
untouched) and ``heal``ed. Processes run in a host with ``cmd(host, argv)``.

`close` (the context manager's exit, also on an exception or Ctrl-C, and at
interpreter exit as a last resort) deletes every veth, namespace and the
bridge, and `leftovers` lists any that remain. The kernel needs root and the
``ip`` and ``tc`` commands: `available` says why not, for a skip.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import random
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Iterable, Sequence
from types import TracebackType

__all__ = ["Hosts", "available", "free_subnet"]

_HOST_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,30}$")
_TIMEOUT_S = 10.0
"""Any one ``ip``/``tc`` command: they answer in milliseconds."""


def available() -> str | None:
    """Why hosts cannot be made here (a skip's reason), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is missing (iproute2)"
    return None


def _run(*argv: str, check: bool = True) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _taken() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine's root namespace has an address or a route in."""
    nets = []
    for line in _run("ip", "-o", "-4", "addr").splitlines() + _run("ip", "-4", "route").splitlines():
        for word in line.split():
            try:
                nets.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    return [n for n in nets if isinstance(n, ipaddress.IPv4Network) and n.prefixlen > 0]


def free_subnet(rng: random.Random | None = None, tries: int = 200) -> ipaddress.IPv4Network:
    """A random /24 between 10.64.0.0 and 10.254.255.0 that overlaps no address or route of this machine."""
    rng = rng or random.Random()
    taken = _taken()
    for _ in range(tries):
        net = ipaddress.IPv4Network(f"10.{rng.randint(64, 254)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError(f"no free private /24 in {tries} tries")


class Hosts:
    """Network namespaces joined by a bridge, one per host name; see the module."""

    def __init__(self, names: Sequence[str]) -> None:
        if len(set(names)) != len(names) or not names or len(names) > 200:
            raise ValueError(f"host names must be 1..200 distinct names: {list(names)}")
        for name in names:
            if not _HOST_NAME.match(name):
                raise ValueError(f"host name {name!r}: lowercase letters, digits and '-'")
        why = available()
        if why:
            raise RuntimeError(why)
        self.run = uuid.uuid4().hex[:6]
        self.names = list(names)
        self.bridge = f"cb{self.run}"
        self.subnet = free_subnet()
        hosts = list(self.subnet.hosts())
        self.gateway = str(hosts[0])
        """The root namespace's address on the bridge."""
        self.address = {name: str(hosts[9 + i]) for i, name in enumerate(names)}
        self.namespace = {name: f"ctrps-{self.run}-{name}" for name in names}
        self.veth = {name: f"cv{self.run}{i}" for i, name in enumerate(names)}
        """Each host's bridge-side veth (the root namespace's end)."""
        self._made: list[tuple[str, str]] = []  # ("ns"|"link", name), in creation order
        self._closed = False
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise

    def _create(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run("ip", "addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for i, name in enumerate(self.names):
            ns, veth, peer = self.namespace[name], self.veth[name], f"cp{self.run}{i}"
            _run("ip", "netns", "add", ns)
            self._made.append(("ns", ns))
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer)
            self._made.append(("link", veth))
            _run("ip", "link", "set", peer, "netns", ns)
            _run("ip", "-n", ns, "link", "set", peer, "name", "eth0")
            _run("ip", "-n", ns, "addr", "add", f"{self.address[name]}/{self.subnet.prefixlen}", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")

    # -- use --------------------------------------------------------------------------

    def cmd(self, host: str, argv: Iterable[str]) -> tuple[str, ...]:
        """`argv` run in `host`'s namespace (``ip netns exec`` execs it: same pid)."""
        return ("ip", "netns", "exec", self.namespace[host], *argv)

    def cut(self, host: str) -> None:
        """Take `host` off the network: its bridge-side veth down."""
        _run("ip", "link", "set", self.veth[host], "down")

    def restore(self, host: str) -> None:
        """Put `host` back on the network."""
        _run("ip", "link", "set", self.veth[host], "up")

    def limit(self, host: str, mbit: float) -> None:
        """`host`'s link to `mbit` megabits a second each way: a tbf qdisc on
        its own egress (eth0) and on the bridge's egress towards it."""
        rate = f"{int(mbit * 1000)}kbit"
        # A burst of ~4 ms at the rate (at least a few frames), a queue of 50 ms:
        # a shaped link, not one that drops everything past one frame.
        burst = f"{max(16_000, int(mbit * 1e6 / 8 * 0.004))}b"
        tbf = ("root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        _run("ip", "netns", "exec", self.namespace[host], "tc", "qdisc", "replace", "dev", "eth0", *tbf)
        _run("tc", "qdisc", "replace", "dev", self.veth[host], *tbf)

    def unlimit(self, host: str) -> None:
        """`host`'s link at full speed again."""
        _run("ip", "netns", "exec", self.namespace[host], "tc", "qdisc", "del", "dev", "eth0", "root", check=False)
        _run("tc", "qdisc", "del", "dev", self.veth[host], "root", check=False)

    def partition(self, a: str, b: str) -> None:
        """Cut `a` and `b` from each other alone (blackhole routes both ways):
        each still reaches every other host and the gateway."""
        for here, there in ((a, b), (b, a)):
            _run("ip", "-n", self.namespace[here], "route", "add", "blackhole", f"{self.address[there]}/32")

    def heal(self, a: str, b: str) -> None:
        """Undo `partition(a, b)`."""
        for here, there in ((a, b), (b, a)):
            _run(
                "ip", "-n", self.namespace[here], "route", "del", "blackhole", f"{self.address[there]}/32", check=False
            )

    def link_bytes(self, host: str) -> tuple[int, int]:
        """Bytes `host` received and sent so far (its bridge-side veth's counters, reversed)."""
        stats = f"/sys/class/net/{self.veth[host]}/statistics"
        with open(f"{stats}/tx_bytes") as tx, open(f"{stats}/rx_bytes") as rx:
            return int(tx.read()), int(rx.read())

    # -- removal ----------------------------------------------------------------------

    def close(self) -> None:
        """Delete every veth, namespace and the bridge; safe to call again.
        Deleting a veth end deletes its peer at once (a namespace's deletion
        would leave it to the kernel, later)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        errors = []
        # A process still in a namespace (one its starter failed to stop) would
        # outlive it: every one is this run's, SIGKILLed before the namespace goes.
        for kind, name in self._made:
            if kind == "ns":
                for pid in _run("ip", "netns", "pids", name, check=False).split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
        for kind, name in reversed(self._made):
            argv = ("ip", "link", "del", name) if kind == "link" else ("ip", "netns", "del", name)
            try:
                _run(*argv)
            except Exception as exc:  # keep removing the rest
                errors.append(str(exc))
        deadline = time.monotonic() + _TIMEOUT_S
        while self.leftovers() and time.monotonic() < deadline:
            time.sleep(0.05)  # the kernel finishes a namespace's links asynchronously
        left = self.leftovers()
        if left:  # an error about a thing already gone (deleted by hand) does not matter
            raise RuntimeError(f"hosts of run {self.run} not removed: {left} ({'; '.join(errors)})")

    def leftovers(self) -> list[str]:
        """This run's namespaces and links that still exist."""
        spaces = _run("ip", "netns", "list", check=False).split()
        links = re.findall(r"^\d+: ([^:@]+)", _run("ip", "-o", "link", check=False), flags=re.M)
        return [s for s in spaces if s.startswith(f"ctrps-{self.run}-")] + [link for link in links if self.run in link]

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Hosts:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
