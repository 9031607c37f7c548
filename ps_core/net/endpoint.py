"""One shard server's HTTP endpoint, as both planes' clients reach it.

`ShardEndpoint` holds what a data transport and a control client share: the
shard's URL, the aiohttp session, its credentials (``Authorization: Bearer``)
and TLS context, and requests retried on connection errors, timeouts and
502/503/504 with backoff (`RetryPolicy`) up to a deadline, then
`ShardUnavailableError` naming the shard. A refused token (`AuthError`,
`ForbiddenError`) or a certificate that does not verify (`TlsVerifyError`)
is raised at once: waiting does not fix a configuration.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_
import time
from collections.abc import Callable, Collection, Sequence
from typing import Generic, Protocol, Self, TypeVar
from urllib.parse import urlsplit

import aiohttp
import orjson

from ..errors import ShardUnavailableError, TlsVerifyError, error_from_body
from .auth import bearer

__all__ = [
    "RetryPolicy",
    "Backoff",
    "ShardEndpoint",
    "RETRIED_STATUSES",
    "json_or_text",
    "not_joined",
    "retried_reason",
]


class RetryPolicy:
    """Backoff for connection errors: `first_delay_s` doubling to `max_delay_s`,
    giving up `deadline_s` after the first attempt."""

    def __init__(self, deadline_s: float = 10.0, first_delay_s: float = 0.02, max_delay_s: float = 1.0) -> None:
        self.deadline_s = deadline_s
        self.first_delay_s = first_delay_s
        self.max_delay_s = max_delay_s


class Backoff:
    """One call's attempts under a `RetryPolicy`: `failed` sleeps before the
    next attempt, or raises once the deadline has passed."""

    # One per data call: time.monotonic, not the loop's clock, since
    # asyncio.get_running_loop() is a getpid() system call on Python 3.11.
    def __init__(self, retry: RetryPolicy) -> None:
        self._retry = retry
        self.started = time.monotonic()
        """When the first attempt was sent."""
        self.deadline_s = retry.deadline_s
        self._deadline = self.started + retry.deadline_s
        self._delay = retry.first_delay_s
        self.attempts = 1

    def remaining(self) -> float:
        """Seconds left for this attempt (at least a short minimum)."""
        return max(self._deadline - time.monotonic(), 0.05)

    async def failed(self, reason: str, unavailable: Callable[[Backoff, str], Exception]) -> None:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise unavailable(self, reason)
        # The last sleep is cut to the deadline, then one final attempt.
        await asyncio.sleep(min(self._delay, left))
        self._delay = min(self._delay * 2, self._retry.max_delay_s)
        self.attempts += 1


class ShardEndpoint:
    """A shard server's HTTP endpoint: `request` retried under `retry`.

    `token` is presented on every request; `ssl`, a client context, verifies
    an ``https://`` shard (None: the system's CAs)."""

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

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        content_type: str = "",
        *,
        answered: Collection[str] = (),
    ) -> tuple[int, bytes]:
        """One request's (status, body) below 400; an error status raises the
        shard's typed error, after retries for the passing ones, except a
        retried status whose body names an error code in `answered` (the
        shard's own answer, which its caller waits out itself)."""
        backoff = Backoff(self._retry)
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
                    if resp.status not in RETRIED_STATUSES or _names(payload, answered):
                        raise error_from_body(resp.status, json_or_text(payload))
                    last: str = retried_reason(resp.status, payload)
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
        """How calls travel, for error messages."""
        return ""

    def _unavailable(self, backoff: Backoff, last: str) -> ShardUnavailableError:
        return ShardUnavailableError(
            f"shard {self.shard_id} at {self.url}{self._via()} {unanswered(backoff, last)}",
            shard_id=self.shard_id,
            url=self.url,
            since=backoff.started,
        )


def unanswered(backoff: Backoff, last: str) -> str:
    """Why a call gave up, in words: how long it waited since its first
    attempt, how many attempts, and whether the last one timed out waiting
    for an answer (a shard that accepts but does not answer: hung, or a
    link that drops everything) or was refused or failed (`last`)."""
    waited = time.monotonic() - backoff.started
    tries = f"{backoff.attempts} attempt{'s' if backoff.attempts != 1 else ''}"
    if last.startswith(("TimeoutError", "ServerTimeoutError", "ConnectionTimeoutError")):
        return f"did not answer: no answer for {waited:.1f}s ({tries}, deadline {backoff.deadline_s:g}s)"
    return f"unreachable for {waited:.1f}s ({tries}, deadline {backoff.deadline_s:g}s; last: {last})"


RETRIED_STATUSES = (502, 503, 504)
"""Replies of a proxy or balancer in front of a shard that may pass."""


def not_joined(body: object) -> bool:
    """Whether an error body says the shard waits to be admitted."""
    return isinstance(body, dict) and body.get("error") == "shard_not_joined"


def _names(payload: bytes, codes: Collection[str]) -> bool:
    """Whether an error body names one of `codes`."""
    if not codes:
        return False
    body = json_or_text(payload)
    return isinstance(body, dict) and body.get("error") in codes


def retried_reason(status: int, payload: bytes) -> str:
    """A retried reply, for the error raised once retries run out: the
    status, and the shard's own reason when it gave one (e.g. 503
    ``shard_not_joined``: it waits to be admitted)."""
    body = json_or_text(payload)
    if isinstance(body, dict) and "error" in body:
        return f"http {status} {body['error']}: {str(body.get('detail', ''))[:300]}"
    return f"http {status}"


def json_or_text(payload: bytes) -> object:
    """A reply body as JSON, or its first bytes as text."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return payload[:200].decode("utf-8", "replace")


class _PerShard(Protocol):
    shard_id: int

    async def close(self) -> None: ...


M = TypeVar("M", bound=_PerShard)


class ShardGroup(Generic[M]):
    """One member per shard, shards 0..S-1 in order, and the aiohttp session
    they share (closed with them, if given): the frame of both planes'
    clients. ``async with`` closes them."""

    def __init__(self, members: Sequence[M], *, session: aiohttp.ClientSession | None = None) -> None:
        if not members:
            raise ValueError("a client needs at least one shard")
        ids = [m.shard_id for m in members]
        if ids != list(range(len(ids))):
            raise ValueError(f"members must be shards 0..{len(ids) - 1} in order, got {ids}")
        self._members = list(members)
        self.num_shards = len(members)
        self._session = session

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close connections; safe to call more than once."""
        for m in self._members:
            await m.close()
        if self._session is not None and not self._session.closed:
            await self._session.close()
