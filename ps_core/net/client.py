"""The parameter-server client: ``await pull(table, keys)``, ``await push(table, keys, grads)``.

`PSClient` routes each key with `shard_of`, sends one request per shard
concurrently, and reassembles the answers in the caller's order. It talks to
shards through a `ShardTransport`: `HttpTransport` (HTTP keep-alive through
aiohttp, binary frames for pulls and pushes; retried with backoff up to a
deadline on connection errors, then `ShardUnavailableError` naming the
shard), `TcpTransport` (the same, but pulls and pushes over the shard's TCP
RPC, `ps_core.net.rpc`: the default of `PSClient.connect`) or `LocalTransport`
(a `Shard` object in this process, no encoding: for the demo and tests). All
behave the same.

Credentials and TLS: `PSClient.connect(urls, token=..., ssl=...)` presents
the token (`ps_core.net.auth`) on every HTTP request and in the RPC's hello, and
verifies ``https://`` shards (and their RPC, then TLS too) with the client
context `ssl`. A refused token raises `AuthError` (401) or `ForbiddenError`
(403), a server certificate that does not verify `TlsVerifyError`: neither
is retried, since waiting does not fix a configuration.

Every push carries a request id; a shard acknowledges a retried id without
applying it twice, so retrying after a lost ack is safe.

`push_pull` sends one mini-batch's push and the next one's pull in one request
per shard (the shard applies the push, then answers the pull), halving a
training loop's requests.

Besides pull and push: `pull_versioned` (weights with the tables' open
version and, if asked, whether each key has a row), and the status board of
shard 0 (`report_status`, `statuses`), where workers leave their progress for
processes that do not train.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import ssl as ssl_
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import numpy.typing as npt
import orjson

from ..checkpoint.coordinator import Coordinator, Offsets, parse_offsets
from ..checkpoint.joining import restore_version
from ..checkpoint.stream import StreamIdentity
from ..errors import (
    ExportNotFoundError,
    FrameError,
    LeaseError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    StatusError,
    TlsVerifyError,
    error_from_body,
)
from ..hashing import U64
from ..store.table import F32, TableConfig, TableSnapshot
from . import codec
from .auth import bearer
from .routing import split_by_shard
from .rpc import RpcConnection
from .server import FRAME_CONTENT_TYPE
from .shard import Shard

__all__ = [
    "PSClient",
    "Pulled",
    "Routed",
    "ShardTransport",
    "HttpTransport",
    "TcpTransport",
    "LocalTransport",
    "RetryPolicy",
    "ResumePoint",
]


@dataclass(frozen=True)
class Pulled:
    """The answer of `PSClient.pull_versioned` (or of one shard to it)."""

    weights: F32
    """(n, dim) weights, in the order of the keys asked for."""
    version: int
    """The table's open export version (the smallest over the shards asked)."""
    present: npt.NDArray[np.bool_] | None
    """(n,) whether each key has a row (absent keys read their initial
    value); None unless presence was asked for."""


class LeaseGrant(NamedTuple):
    """A lease granted by the coordinator."""

    lease_id: int
    """What `release_lease` names."""
    epoch: str
    """The coordinator's life (`ps_core.checkpoint.coordinator.Coordinator.epoch`)."""


class ResumePoint(NamedTuple):
    """Where the coordinator says the shards' state ends, and in which stream."""

    offsets: Offsets
    """Next offset to consume per topic and partition."""
    stream: StreamIdentity | None
    """The stream they were read from (None: not known, e.g. an older export)."""


def _resume_point(got: Any) -> ResumePoint:
    """A ``GET /v1/offsets`` answer as a `ResumePoint`."""
    raw = got.get("stream")
    try:
        stream = StreamIdentity.from_dict(raw) if raw is not None else None
    except ValueError as exc:
        raise LeaseError(f"bad stream in the coordinator's answer: {exc}") from None
    return ResumePoint(parse_offsets(got["offsets"]), stream)


class ExportService(Protocol):
    """What shard 0's transport needs of an in-process exporter
    (`ps_core.checkpoint.exporter.Exporter`)."""

    async def export_json(self, kind: str | None = None) -> dict[str, Any]: ...

    def exports_json(self) -> dict[str, Any]: ...

    async def compact(self) -> dict[str, Any]: ...


class ShardTransport(Protocol):
    """How a client reaches one shard."""

    shard_id: int

    async def pull(self, table: str, keys: U64) -> F32: ...

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled: ...

    async def push(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
    ) -> int: ...

    async def push_pull(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
        pull_keys: U64,
    ) -> tuple[int, F32]: ...

    async def declare(self, config: TableConfig) -> bool: ...

    async def stats(self) -> dict[str, Any]: ...

    async def report_status(self, source: str, status: dict[str, Any]) -> dict[str, Any]: ...

    async def statuses(self) -> list[dict[str, Any]]: ...

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]: ...

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]: ...

    async def drop_snapshot(self, version: int) -> bool: ...

    async def membership(self) -> dict[str, Any]: ...

    async def admit(self, epoch: str, version: int) -> dict[str, Any]: ...

    async def restore_version(self, version: int) -> dict[str, Any]: ...

    async def acquire_lease(self, worker: str, wait_s: float) -> LeaseGrant: ...

    async def release_lease(self, lease_id: int, offsets: Offsets, stream: StreamIdentity | None = None) -> bool: ...

    async def coordinator_offsets(self) -> Offsets: ...

    async def coordinator_resume(self) -> ResumePoint: ...

    async def export_now(self, kind: str | None) -> dict[str, Any]: ...

    async def exports(self) -> dict[str, Any]: ...

    async def compact_exports(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class LocalTransport:
    """A shard in this process: handlers called directly, no copies or frames."""

    def __init__(self, shard: Shard, coordinator: Coordinator | None = None, *, routed: bool = False) -> None:
        """`routed`: every key reaching this transport was split by `shard_of`
        for the shard's own spec (`PSClient.local` sets it when the shards'
        specs match their places), so the shard skips re-hashing pulled and
        pushed keys to check that it owns them (~15 us per call)."""
        self.shard = shard
        self.shard_id = shard.spec.shard_id
        self.coordinator = coordinator
        self.routed = routed
        self.exporter: ExportService | None = None
        """Set by whoever runs an exporter beside the coordinator (``ctrps demo``)."""

    async def pull(self, table: str, keys: U64) -> F32:
        return self.shard.handle_pull(table, keys, owned=self.routed)[0]

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled:
        weights, version = self.shard.handle_pull(table, keys)
        return Pulled(weights, version, self.shard.contains(table, keys) if presence else None)

    async def push(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
    ) -> int:
        return self.shard.handle_push(
            table, keys, grads, counts=counts, event_time=event_time, request_id=request_id, owned=self.routed
        )[0]

    async def push_pull(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
        pull_keys: U64,
    ) -> tuple[int, F32]:
        applied, weights, _ = self.shard.handle_push_pull(
            table,
            keys,
            grads,
            pull_keys,
            counts=counts,
            event_time=event_time,
            request_id=request_id,
            owned=self.routed,
        )
        return applied, weights

    async def declare(self, config: TableConfig) -> bool:
        return self.shard.declare(config)

    async def stats(self) -> dict[str, Any]:
        return self.shard.stats()

    async def report_status(self, source: str, status: dict[str, Any]) -> dict[str, Any]:
        return self.shard.report_status(source, status)

    async def statuses(self) -> list[dict[str, Any]]:
        return self.shard.statuses()

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]:
        return self.shard.take_snapshot(version, parent)

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]:
        return self.shard.pop_snapshot(version)

    async def drop_snapshot(self, version: int) -> bool:
        return self.shard.drop_snapshot(version)

    async def membership(self) -> dict[str, Any]:
        return self.shard.membership()

    async def admit(self, epoch: str, version: int) -> dict[str, Any]:
        self.shard.admit(epoch, version)
        return self.shard.membership()

    async def restore_version(self, version: int) -> dict[str, Any]:
        return await restore_version(self.shard, version)

    def _coordinator(self) -> Coordinator:
        if self.coordinator is None:
            raise NoCoordinatorError(f"shard {self.shard_id} hosts no coordinator")
        return self.coordinator

    async def acquire_lease(self, worker: str, wait_s: float) -> LeaseGrant:
        lease = await self._coordinator().acquire(worker, wait_s)
        return LeaseGrant(lease.lease_id, lease.epoch)

    async def release_lease(self, lease_id: int, offsets: Offsets, stream: StreamIdentity | None = None) -> bool:
        return await self._coordinator().release(lease_id, offsets, stream)

    async def coordinator_offsets(self) -> Offsets:
        return self._coordinator().offsets()

    async def coordinator_resume(self) -> ResumePoint:
        c = self._coordinator()
        return ResumePoint(c.offsets(), c.stream)

    def _exporter(self) -> ExportService:
        if self.exporter is None:
            raise NoCoordinatorError(f"shard {self.shard_id} runs no exporter")
        return self.exporter

    async def export_now(self, kind: str | None) -> dict[str, Any]:
        return await self._exporter().export_json(kind)

    async def exports(self) -> dict[str, Any]:
        return self._exporter().exports_json()

    async def compact_exports(self) -> dict[str, Any]:
        return await self._exporter().compact()

    async def close(self) -> None:
        return None


class RetryPolicy:
    """Backoff for connection errors: `first_delay_s` doubling to `max_delay_s`,
    giving up `deadline_s` after the first attempt."""

    def __init__(self, deadline_s: float = 10.0, first_delay_s: float = 0.02, max_delay_s: float = 1.0) -> None:
        self.deadline_s = deadline_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s


class _Backoff:
    """One call's attempts under a `RetryPolicy`: `failed` sleeps before the
    next attempt, or raises once the deadline has passed."""

    def __init__(self, retry: RetryPolicy) -> None:
        self._loop = asyncio.get_running_loop()
        self._retry = retry
        self._deadline = self._loop.time() + retry.deadline_s
        self._delay = retry.first_delay_s
        self.attempts = 1

    def remaining(self) -> float:
        """Seconds left for this attempt (at least a short minimum)."""
        return max(self._deadline - self._loop.time(), 0.05)

    async def failed(self, reason: str, unavailable: Callable[[int, str], Exception]) -> None:
        left = self._deadline - self._loop.time()
        if left <= 0:
            raise unavailable(self.attempts, reason)
        # The last sleep is cut to the deadline, then one final attempt.
        await asyncio.sleep(min(self._delay, left))
        self._delay = min(self._delay * 2, self._retry.max_delay_s)
        self.attempts += 1


class FrameConnection(Protocol):
    """A persistent connection carrying frame calls, pipelined and answered
    in order (`ps_core.net.rpc.RpcConnection`)."""

    @property
    def is_open(self) -> bool: ...

    def call(self, path: str, body: bytes) -> asyncio.Future[tuple[int, bytes]]: ...

    def abort(self) -> None: ...

    async def close(self) -> None: ...


class HttpTransport:
    """A shard server reached over HTTP keep-alive (aiohttp) with binary frames.

    Every call goes through the aiohttp session, retried on connection
    errors, timeouts and 502/503/504 with backoff up to the deadline, then
    `ShardUnavailableError`; a retried push keeps its request id. `token`
    is presented on every request (``Authorization: Bearer``); `ssl`, a
    client context, verifies an ``https://`` shard (None: the system's CAs).
    """

    def __init__(
        self,
        shard_id: int,
        url: str,
        session: aiohttp.ClientSession,
        retry: RetryPolicy,
        *,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
    ) -> None:
        self.shard_id = shard_id
        self.url = url.rstrip("/")
        self._session = session
        self._retry = retry
        parts = urlsplit(self.url)
        self._host = parts.hostname or "127.0.0.1"
        self._tls = parts.scheme == "https"
        self._token = token
        self._headers = bearer(token)
        self._ssl: ssl_.SSLContext | bool = ssl if ssl is not None else True
        self._conn: FrameConnection | None = None
        self._opening = asyncio.Lock()

    async def _request(
        self, method: str, path: str, body: bytes | None = None, content_type: str = ""
    ) -> tuple[int, bytes]:
        backoff = _Backoff(self._retry)
        while True:
            try:
                headers = {"Content-Type": content_type, **self._headers} if content_type else self._headers
                async with self._session.request(
                    method,
                    self.url + path,
                    data=body,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=backoff.remaining()),
                    ssl=self._ssl,
                ) as resp:
                    payload = await resp.read()
                    if resp.status < 400:
                        return resp.status, payload
                    if resp.status not in _RETRIED_STATUSES:
                        raise error_from_body(resp.status, _json_or_text(payload))
                    last: str = _retried_reason(resp.status, payload)
            except aiohttp.ClientConnectorCertificateError as exc:
                raise self._unverified(exc.certificate_error) from None
            except (TimeoutError, aiohttp.ClientConnectionError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await backoff.failed(last, self._unavailable)

    def _unverified(self, exc: Exception) -> TlsVerifyError:
        reason = getattr(exc, "verify_message", "") or str(exc)
        return TlsVerifyError(
            f"shard {self.shard_id} at {self.url}{self._via()}: its TLS certificate did not verify "
            f"({reason}); check --tls-ca"
        )

    def _via(self) -> str:
        """How frame calls travel, for error messages."""
        return ""

    def _unavailable(self, attempts: int, last: str) -> ShardUnavailableError:
        return ShardUnavailableError(
            f"shard {self.shard_id} at {self.url}{self._via()} unreachable after {attempts} attempts "
            f"in {self._retry.deadline_s:.1f}s ({last})",
            shard_id=self.shard_id,
            url=self.url,
        )

    async def _open(self) -> FrameConnection | None:
        """A new connection for frame calls; None to send them through aiohttp."""
        return None

    async def _connection(self) -> FrameConnection | None:
        """The open frame connection (opened if needed), or None for aiohttp."""
        async with self._opening:
            if self._conn is None or not self._conn.is_open:
                self._conn = await self._open()
            return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
        self._conn = None

    async def _frame_request(self, path: str, body: bytes) -> bytes:
        """A frame's round trip: POSTed to `path`, the reply frame back."""
        backoff = _Backoff(self._retry)
        while True:
            try:
                conn = self._conn
                if conn is None or not conn.is_open:
                    conn = await self._connection()
                    if conn is None:
                        _, reply = await self._request("POST", path, body, FRAME_CONTENT_TYPE)
                        return reply
                status, payload = await asyncio.wait_for(conn.call(path, body), backoff.remaining())
            except ssl_.SSLCertVerificationError as exc:
                raise self._unverified(exc) from None
            except (TimeoutError, OSError) as exc:  # ConnectionError is an OSError
                last = f"{type(exc).__name__}: {exc}"
                # A timed-out call's reply may still come: drop the connection
                # so that no later call reads it as its own.
                self._drop()
            else:
                if status < 400:
                    return payload
                reply_body = _json_or_text(payload)
                if status not in _RETRIED_STATUSES or _not_joined(reply_body):
                    # A shard waiting to be admitted is not retried: a push
                    # held back until after a cluster restore would land on
                    # the restored state, and its window is replayed anyway.
                    raise error_from_body(status, reply_body)
                last = _retried_reason(status, payload)
            await backoff.failed(last, self._unavailable)

    async def pull(self, table: str, keys: U64) -> F32:
        reply = await self._frame_request("/v1/pull", codec.encode_pull(table, keys))
        frame = codec.decode(reply, codec.Op.WEIGHTS)
        assert frame.values is not None
        return frame.values

    async def pull_versioned(self, table: str, keys: U64, presence: bool) -> Pulled:
        body = codec.encode_pull(table, keys, presence=presence)
        reply = await self._frame_request("/v1/pull", body)
        frame = codec.decode(reply, codec.Op.WEIGHTS)
        assert frame.values is not None
        if presence and frame.present is None:
            raise FrameError(f"shard {self.shard_id} answered a presence pull without presence")
        return Pulled(frame.values, frame.version, frame.present)

    async def push(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
    ) -> int:
        body = codec.encode_push(table, keys, grads, counts=counts, event_time=event_time, request_id=request_id)
        reply = await self._frame_request("/v1/push", body)
        return codec.decode(reply, codec.Op.ACK).count

    async def push_pull(
        self,
        table: str,
        keys: U64,
        grads: F32,
        counts: F32 | None,
        event_time: float,
        request_id: int,
        pull_keys: U64,
    ) -> tuple[int, F32]:
        body = codec.encode_push_pull(
            table,
            keys,
            grads,
            pull_keys,
            counts=counts,
            event_time=event_time,
            request_id=request_id,
        )
        # Retried like a push, with the same body and so the same request id:
        # a shard that applied the push answers the pull without applying again.
        reply = await self._frame_request("/v1/push_pull", body)
        frame = codec.decode(reply, codec.Op.PUSH_PULL_REPLY)
        assert frame.values is not None
        if frame.count != pull_keys.size:
            raise FrameError(f"shard {self.shard_id} answered {frame.count} rows for {pull_keys.size} pull keys")
        return frame.applied, frame.values

    async def declare(self, config: TableConfig) -> bool:
        status, _ = await self._request("POST", "/v1/tables", orjson.dumps(config.to_dict()), "application/json")
        return status == 201

    async def stats(self) -> dict[str, Any]:
        _, reply = await self._request("GET", "/v1/stats")
        out: dict[str, Any] = orjson.loads(reply)
        return out

    async def report_status(self, source: str, status: dict[str, Any]) -> dict[str, Any]:
        body = orjson.dumps({"source": source, "status": status})
        _, reply = await self._request("POST", "/v1/status", body, "application/json")
        out: dict[str, Any] = orjson.loads(reply)
        return out

    async def statuses(self) -> list[dict[str, Any]]:
        _, reply = await self._request("GET", "/v1/status")
        out: list[dict[str, Any]] = orjson.loads(reply)["statuses"]
        return out

    async def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]:
        body = orjson.dumps({"version": version, "parent": parent})
        _, reply = await self._request("POST", "/v1/snapshots", body, "application/json")
        rows: dict[str, int] = orjson.loads(reply)["rows"]
        return rows

    async def fetch_snapshot(self, version: int) -> list[TableSnapshot]:
        _, reply = await self._request("GET", f"/v1/snapshots/{version}")
        return codec.snapshots_from_bytes(reply)

    async def drop_snapshot(self, version: int) -> bool:
        _, reply = await self._request("DELETE", f"/v1/snapshots/{version}")
        return bool(orjson.loads(reply)["dropped"])

    async def membership(self) -> dict[str, Any]:
        _, reply = await self._request("GET", "/v1/membership")
        out: dict[str, Any] = orjson.loads(reply)
        return out

    async def admit(self, epoch: str, version: int) -> dict[str, Any]:
        body = orjson.dumps({"epoch": epoch, "version": version})
        _, reply = await self._request("POST", "/v1/membership/admit", body, "application/json")
        out: dict[str, Any] = orjson.loads(reply)
        return out

    async def restore_version(self, version: int) -> dict[str, Any]:
        body = orjson.dumps({"version": version})
        _, reply = await self._request("POST", "/v1/restore", body, "application/json")
        out: dict[str, Any] = orjson.loads(reply)
        return out

    async def _coordinator_request(self, method: str, path: str, body: object = None) -> Any:
        try:
            _, reply = await self._request(
                method, path, None if body is None else orjson.dumps(body), "application/json"
            )
        except PSError as exc:
            if exc.status == 404 and not isinstance(exc, (LeaseError, NoCoordinatorError, ExportNotFoundError)):
                # The route is not there: this shard serves no coordinator.
                raise NoCoordinatorError(f"shard {self.shard_id} at {self.url} hosts no coordinator") from None
            raise
        return orjson.loads(reply)

    async def acquire_lease(self, worker: str, wait_s: float) -> LeaseGrant:
        got = await self._coordinator_request("POST", "/v1/leases", {"worker": worker, "wait_s": wait_s})
        return LeaseGrant(int(got["lease_id"]), str(got["epoch"]))

    async def release_lease(self, lease_id: int, offsets: Offsets, stream: StreamIdentity | None = None) -> bool:
        body: dict[str, Any] = {
            "lease_id": lease_id,
            "offsets": {t: {str(p): o for p, o in ps.items()} for t, ps in offsets.items()},
        }
        if stream is not None:
            body["stream"] = stream.to_dict()
        return bool((await self._coordinator_request("POST", "/v1/leases/release", body))["released"])

    async def coordinator_offsets(self) -> Offsets:
        return parse_offsets((await self._coordinator_request("GET", "/v1/offsets"))["offsets"])

    async def coordinator_resume(self) -> ResumePoint:
        return _resume_point(await self._coordinator_request("GET", "/v1/offsets"))

    async def export_now(self, kind: str | None) -> dict[str, Any]:
        out: dict[str, Any] = await self._coordinator_request(
            "POST", "/v1/exports", {} if kind is None else {"kind": kind}
        )
        return out

    async def exports(self) -> dict[str, Any]:
        out: dict[str, Any] = await self._coordinator_request("GET", "/v1/exports")
        return out

    async def compact_exports(self) -> dict[str, Any]:
        out: dict[str, Any] = await self._coordinator_request("POST", "/v1/exports/compact", {})
        return out

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.close()
            self._conn = None


class TcpTransport(HttpTransport):
    """A shard server whose pulls and pushes travel over its TCP RPC
    (`ps_core.net.rpc`: the same frames, no HTTP), everything else over HTTP.

    The RPC port is read from the shard's ``GET /healthz`` on first use and
    again after a connection fails (a restarted shard may listen on another).
    A shard that advertises none is reached over HTTP alone. Calls share one
    connection (pipelined) and are retried as `HttpTransport` retries them.
    """

    # Per instance once set (class-level until then: no __init__ of its own).
    rpc_port: int | None = None
    """The shard's RPC port, once read from its ``/healthz``."""
    uses_rpc: bool | None = None
    """Whether data calls go over the RPC (None until the shard was asked)."""

    def _via(self) -> str:
        return " (rpc)" if self.uses_rpc else ""

    async def _open(self) -> FrameConnection | None:
        if self.uses_rpc is False:
            return await super()._open()
        if self.rpc_port is None:
            _, reply = await self._request("GET", "/healthz")
            health = _json_or_text(reply)
            port = health.get("rpc_port") if isinstance(health, dict) else None
            if not isinstance(port, int) or isinstance(port, bool):
                self.uses_rpc = False
                return await super()._open()
            self.rpc_port = port
        # The RPC of an https:// shard is TLS too, verified the same way.
        tls = None
        if self._tls:
            tls = self._ssl if isinstance(self._ssl, ssl_.SSLContext) else ssl_.create_default_context()
        conn = await RpcConnection.open(
            self._host, self.rpc_port, token=self._token, ssl=tls, server_hostname=self._host
        )
        self.uses_rpc = True
        return conn

    def _drop(self) -> None:
        super()._drop()
        if self.uses_rpc:
            self.rpc_port = None


_RETRIED_STATUSES = (502, 503, 504)
"""Replies of a proxy or balancer in front of a shard that may pass."""


def _not_joined(body: object) -> bool:
    return isinstance(body, dict) and body.get("error") == "shard_not_joined"


def _retried_reason(status: int, payload: bytes) -> str:
    """A retried reply, for the error raised once retries run out: the
    status, and the shard's own reason when it gave one (e.g. 503
    ``shard_not_joined``: it waits to be admitted)."""
    body = _json_or_text(payload)
    if isinstance(body, dict) and "error" in body:
        return f"http {status} {body['error']}: {str(body.get('detail', ''))[:300]}"
    return f"http {status}"


def _json_or_text(payload: bytes) -> object:
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload[:200].decode("utf-8", "replace")


@dataclass(frozen=True)
class Routed:
    """Keys split by shard (`PSClient.route`), reusable for a pull and a push."""

    keys: U64
    """The keys, in the caller's order."""
    order: npt.NDArray[np.intp] | None
    """Permutation grouping the keys by shard (None with one shard)."""
    parts: list[slice]
    """Each shard's slice of the grouped keys."""
    by_shard: U64
    """The keys grouped by shard (``keys[order]``)."""


class PSClient:
    """Pull and push whole key batches across all shards.

    Use ``async with PSClient.connect(urls) as client`` for shard servers or
    ``PSClient.local(shards)`` for shards in this process.
    """

    def __init__(
        self,
        transports: Sequence[ShardTransport],
        *,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if not transports:
            raise ValueError("a client needs at least one shard")
        ids = [t.shard_id for t in transports]
        if ids != list(range(len(ids))):
            raise ValueError(f"transports must be shards 0..{len(ids) - 1} in order, got {ids}")
        self.transports = list(transports)
        self.num_shards = len(transports)
        self._session = session
        # A random base keeps request ids of different clients apart.
        self._request_ids = itertools.count(secrets.randbits(62) + 1)

    @classmethod
    def connect(
        cls,
        urls: Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        connections_per_shard: int = 16,
        rpc: bool = True,
        token: str = "",
        ssl: ssl_.SSLContext | None = None,
    ) -> PSClient:
        """A client for shard servers at `urls` (shard i at urls[i]).

        With `rpc` (the default), pulls and pushes go over a shard's TCP RPC
        when it offers one (`TcpTransport`); without, everything is HTTP
        through an aiohttp pool of `connections_per_shard` per shard.
        `token` is presented to every shard (`ps_core.net.auth`; "" for none);
        `ssl`, a client context (`ps_core.net.tls.client_context`), verifies
        ``https://`` shards and their RPC.
        Must be called with an event loop running (it opens a connection pool).
        """
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=connections_per_shard, limit=0),
            skip_auto_headers=("User-Agent",),
        )
        policy = retry or RetryPolicy()
        kind = TcpTransport if rpc else HttpTransport
        transports = [kind(i, u, session, policy, token=token, ssl=ssl) for i, u in enumerate(urls)]
        return cls(transports, session=session)

    @classmethod
    def local(cls, shards: Sequence[Shard], coordinator: Coordinator | None = None) -> PSClient:
        """A client over shards in this process; `coordinator`, if given, is
        reached through shard 0 as a shard server would host it.

        Where shard i's spec is ``ShardSpec(i, len(shards))``, the client's
        routing is the shard's ownership, and the shard does not check it
        again; a shard placed or counted otherwise checks every key (and
        refuses those it does not own, as a shard server would)."""
        n = len(shards)
        return cls(
            [
                LocalTransport(
                    s, coordinator if i == 0 else None, routed=(s.spec.shard_id, s.spec.num_shards) == (i, n)
                )
                for i, s in enumerate(shards)
            ]
        )

    async def __aenter__(self) -> PSClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close connections; safe to call more than once."""
        for t in self.transports:
            await t.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()

    # -- routing -------------------------------------------------------------
    def route(self, keys: npt.ArrayLike) -> Routed:
        """Split `keys` by shard once, for a pull and a push of the same keys."""
        k = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
        order, bounds = split_by_shard(k, self.num_shards)
        parts = [slice(int(bounds[i]), int(bounds[i + 1])) for i in range(self.num_shards)]
        return Routed(k, order, parts, k if order is None else k[order])

    async def pull(self, table: str, keys: npt.ArrayLike | Routed) -> F32:
        """Weights (n, dim) of `keys` (or a `route` of them), in their order."""
        r = keys if isinstance(keys, Routed) else self.route(keys)
        jobs = _pull_jobs(r)
        results = await _fan_out([self.transports[i].pull(table, r.by_shard[p]) for i, p in jobs])
        return _reassemble(r, results)

    async def pull_versioned(self, table: str, keys: npt.ArrayLike | Routed, *, presence: bool = False) -> Pulled:
        """Like `pull`, with the table's open version and, with `presence`,
        whether each key has a row (an index lookup on the shard, no insert)."""
        r = keys if isinstance(keys, Routed) else self.route(keys)
        jobs = _pull_jobs(r)
        results: list[Pulled] = await _fan_out(
            [self.transports[i].pull_versioned(table, r.by_shard[p], presence) for i, p in jobs]
        )
        present = None
        if presence:
            present = _reassemble(r, [x.present for x in results if x.present is not None])
        return Pulled(
            _reassemble(r, [x.weights for x in results]),
            min(x.version for x in results),
            present,
        )

    async def push(
        self,
        table: str,
        keys: npt.ArrayLike | Routed,
        grads: npt.ArrayLike,
        *,
        counts: npt.ArrayLike | None = None,
        event_time: float = 0.0,
        request_id: int | None = None,
    ) -> int:
        """Apply gradients (n, dim) of `keys`; returns distinct keys applied.

        `counts` (n, 2) adds shows and clicks; `event_time` sets ``last_seen``.
        Returns when every shard involved has acknowledged. A push spanning
        several shards is not atomic: if one shard fails, the others keep their
        part. To retry such a push safely, pass the same `request_id` again
        (see `new_request_id`); shards that applied it acknowledge without
        applying twice.
        """
        r = keys if isinstance(keys, Routed) else self.route(keys)
        k, g, c = _push_arrays(r, grads, counts)
        if k.size == 0:
            return 0
        rid = self.new_request_id() if request_id is None else request_id
        coros = [
            self.transports[i].push(table, k[p], g[p], None if c is None else c[p], event_time, rid)
            for i, p in enumerate(r.parts)
            if p.stop > p.start
        ]
        return sum(await _fan_out(coros))

    async def push_pull(
        self,
        table: str,
        push_keys: npt.ArrayLike | Routed,
        grads: npt.ArrayLike,
        *,
        pull_keys: npt.ArrayLike | Routed,
        counts: npt.ArrayLike | None = None,
        event_time: float = 0.0,
        request_id: int | None = None,
    ) -> tuple[int, F32]:
        """Push gradients of `push_keys`, then pull `pull_keys`, in one
        request per shard; returns (distinct keys applied, weights (m, dim) of
        `pull_keys` in their order).

        The same as ``await push(table, push_keys, grads, ...)`` then ``await
        pull(table, pull_keys)``: each shard applies its part of the push
        before answering its part of the pull, so the pull sees the push. In a
        training loop, push mini-batch i and pull mini-batch i+1 (each a
        `route`); either may be empty. A shard with only a push part or only a
        pull part still gets one request. Requests are retried with their
        request id, as a push's are; like a push, it is not atomic across
        shards: pass the same `request_id` again to retry it whole.
        """
        pr = push_keys if isinstance(push_keys, Routed) else self.route(push_keys)
        qr = pull_keys if isinstance(pull_keys, Routed) else self.route(pull_keys)
        for name, r in (("push_keys", pr), ("pull_keys", qr)):
            if len(r.parts) != self.num_shards:
                raise ValueError(f"{name} were routed for {len(r.parts)} shards, this client has {self.num_shards}")
        k, g, c = _push_arrays(pr, grads, counts)
        rid = self.new_request_id() if request_id is None else request_id
        jobs = [i for i, (p, q) in enumerate(zip(pr.parts, qr.parts)) if p.stop > p.start or q.stop > q.start]
        # Nothing at all to send still asks shard 0, which answers with the
        # table's dim (and an unknown table's error), as an empty pull does.
        results: list[tuple[int, F32]] = await _fan_out(
            [
                self.transports[i].push_pull(
                    table,
                    k[pr.parts[i]],
                    g[pr.parts[i]],
                    None if c is None else c[pr.parts[i]],
                    event_time,
                    rid,
                    qr.by_shard[qr.parts[i]],
                )
                for i in jobs or [0]
            ]
        )
        # Every reply's weights have the table's dim, empty or not, so all
        # concatenate (in shard order) into the pull's grouped order.
        return sum(a for a, _ in results), _reassemble(qr, [w for _, w in results])

    def new_request_id(self) -> int:
        """A fresh push id, unique to this client."""
        return next(self._request_ids)

    async def declare(self, config: TableConfig) -> bool:
        """Declare a table on every shard; True if any shard created it."""
        return any(await _fan_out([t.declare(config) for t in self.transports]))

    async def stats(self) -> list[dict[str, Any]]:
        """Each shard's stats, in shard order."""
        return await _fan_out([t.stats() for t in self.transports])

    async def report_status(self, source: str, status: dict[str, Any]) -> dict[str, Any]:
        """Leave `status` (a JSON object) on the status board of shard 0 as
        the latest of `source`; replaces that source's previous status."""
        if not isinstance(status, dict):
            raise StatusError(f"status must be a dict, got {type(status).__name__}")
        return await self.transports[0].report_status(source, status)

    async def statuses(self) -> list[dict[str, Any]]:
        """The status board of shard 0: ``{"source", "received_at",
        "status"}`` per source, the least recently reported first."""
        return await self.transports[0].statuses()

    def serve_exports(self, exporter: ExportService) -> None:
        """Answer `export_now`/`exports` with an in-process exporter, as shard
        0's server does with its own (in-process deployments: ``ctrps demo``)."""
        first = self.transports[0]
        if not isinstance(first, LocalTransport):
            raise ValueError("only an in-process shard 0 serves an in-process exporter")
        first.exporter = exporter

    # -- export cuts -----------------------------------------------------------
    async def take_snapshots(self, version: int, parent: int | None) -> list[dict[str, int]]:
        """Every shard copies its rows for cut `version` (the cut's pause);
        rows per table, in shard order."""
        return await _fan_out([t.take_snapshot(version, parent) for t in self.transports])

    async def fetch_snapshots(self, version: int) -> dict[int, list[TableSnapshot]]:
        """The copies of cut `version` from every shard, by shard id (once)."""
        got = await _fan_out([t.fetch_snapshot(version) for t in self.transports])
        return {t.shard_id: snaps for t, snaps in zip(self.transports, got)}

    # -- the coordinator, hosted by shard 0 ------------------------------------
    async def acquire_lease(self, worker: str, wait_s: float = 5.0) -> LeaseGrant:
        """A lease for one window and the coordinator's epoch
        (`NoCoordinatorError` when shard 0 hosts none); `CutInProgressError`
        after `wait_s` of a cut's pause. Keep `wait_s` inside the retry
        deadline, so a lease granted late is never granted to nobody."""
        return await self.transports[0].acquire_lease(worker, wait_s)

    async def release_lease(self, lease_id: int, offsets: Offsets, stream: StreamIdentity | None = None) -> bool:
        """End a lease with the offsets its window committed, read from
        `stream`; False if it had expired."""
        return await self.transports[0].release_lease(lease_id, offsets, stream)

    async def coordinator_offsets(self) -> Offsets:
        """The coordinator's committed offsets: where workers resume after a restore."""
        return await self.transports[0].coordinator_offsets()

    async def coordinator_resume(self) -> ResumePoint:
        """The coordinator's offsets and the stream they were read from
        (`StreamIdentity`; None when not known)."""
        return await self.transports[0].coordinator_resume()

    async def export_now(self, kind: str | None = None) -> dict[str, Any]:
        """Cut and write a version now (`ps_core.checkpoint.exporter.ExportReport` as JSON);
        `NoCoordinatorError` when shard 0 runs no exporter."""
        return await self.transports[0].export_now(kind)

    async def exports(self) -> dict[str, Any]:
        """``{"model", "versions", "last"}`` from shard 0's exporter."""
        return await self.transports[0].exports()

    async def compact_exports(self) -> dict[str, Any]:
        """Have shard 0's exporter fold the newest chain into a base (and prune)."""
        return await self.transports[0].compact_exports()


def _push_arrays(r: Routed, grads: npt.ArrayLike, counts: npt.ArrayLike | None) -> tuple[U64, F32, F32 | None]:
    """A push's keys, gradients (n, dim) and counts (n, 2), checked against
    the keys and grouped by shard like ``r.by_shard``."""
    k = r.keys
    g = np.asarray(grads, dtype=np.float32)
    if g.ndim == 1:
        g = g.reshape(-1, 1)
    c = None if counts is None else np.asarray(counts, dtype=np.float32).reshape(-1, 2)
    if g.shape[0] != k.size:
        raise ValueError(f"{k.size} keys but {g.shape[0]} gradient rows")
    if c is not None and c.shape[0] != k.size:
        raise ValueError(f"{k.size} keys but {c.shape[0]} rows of counts")
    if r.order is not None and k.size:
        k, g = r.by_shard, g[r.order]
        c = None if c is None else c[r.order]
    return k, g, c


def _pull_jobs(r: Routed) -> list[tuple[int, slice]]:
    """The shards a pull asks, with their slices of ``r.by_shard``.

    An empty batch still asks shard 0, which answers with the table's dim."""
    return [(i, p) for i, p in enumerate(r.parts) if p.stop > p.start or (i == 0 and r.keys.size == 0)]


def _reassemble(r: Routed, parts: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """Per-shard answers (in shard order) back in the order of ``r.keys``."""
    got = parts[0] if len(parts) == 1 else np.concatenate(parts)
    if r.order is None:
        # A reply frame is a read-only view of the received bytes.
        return got if got.flags.writeable else got.copy()
    out = np.empty_like(got)
    out[r.order] = got
    return out


async def _fan_out(coros: Sequence[Any]) -> list[Any]:
    """Run coroutines concurrently; on the first failure cancel the rest and
    raise that failure itself (not an ExceptionGroup)."""
    if len(coros) == 1:
        return [await coros[0]]
    try:
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(c) for c in coros]
    except BaseExceptionGroup as group:
        first = group.exceptions[0]
        for exc in group.exceptions:
            if isinstance(exc, PSError):
                raise exc from None
        raise first from None
    return [t.result() for t in tasks]
