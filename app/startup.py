"""What a role checks of its addresses before it relies on them.

An address that never answered is a configuration error more likely than an
outage. A long-running role (``ctrps worker``, ``ctrps serve``) waits for
each dependency's first answer under its start-up deadline
(``--startup-timeout``, `consumers.outage.StartupWatch`: a line every few
seconds naming the address, then exit 1); only what answered once is waited
for under the outage deadline. A one-shot command (``ctrps export``,
``ctrps model``) asks once, within a few seconds (`shard0_answers`).

Every shard URL must reach the shard its place names: shard i of the list's
length, as its ``GET /healthz`` reports. A list in another order, or of
another length, is `ShardListError` (exit 2), naming which URL is which shard.
"""

from __future__ import annotations

import asyncio
import errno
import ssl as ssl_
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import orjson
from aiokafka.errors import KafkaConnectionError

from consumers.broker import BrokerError, broker_listening, wait_for_metadata
from consumers.kafka_security import KafkaSecurity
from consumers.outage import StartupWatch
from ps_core.errors import ShardUnavailableError, TlsVerifyError
from ps_core.net.endpoint import RETRIED_STATUSES

from .failures import EXIT_FAILURE, EXIT_USAGE, ExpectedFailure

__all__ = [
    "ShardListError",
    "NoAnswerError",
    "ONE_SHOT_TIMEOUT_S",
    "check_shards",
    "misplaced",
    "shard0_answers",
    "await_broker",
    "broker_answers",
    "await_path",
    "unless_stopped",
]

ONE_SHOT_TIMEOUT_S = 5.0
"""How long a one-shot command waits for its first answer (a refused
connection fails at once)."""

_T = TypeVar("_T")


class ShardListError(ExpectedFailure):
    """The shard URLs do not reach shards 0..S-1 in order (exit 2: the
    ``--shards`` list is wrong)."""

    exit_code = EXIT_USAGE


class NoAnswerError(ExpectedFailure):
    """A one-shot command's address did not answer (exit 1)."""

    exit_code = EXIT_FAILURE


async def shard_identity(
    session: aiohttp.ClientSession, place: int, url: str, ssl: ssl_.SSLContext | None, timeout_s: float
) -> tuple[int, int]:
    """``(shard_id, num_shards)`` as the shard at `url` (listed at `place`)
    reports them. No answer (refused, timed out, a proxy's 502/503/504) is
    `ShardUnavailableError`, an outage to wait for; an answer that is not a
    shard server's is `ShardListError`."""
    try:
        async with session.get(
            url.rstrip("/") + "/healthz",
            timeout=aiohttp.ClientTimeout(total=timeout_s),
            ssl=ssl if ssl is not None else True,
        ) as resp:
            status, payload = resp.status, await resp.read()
    except aiohttp.ClientConnectorCertificateError as exc:
        # A configuration error, not waited for (exit 2, as any shard call says it).
        reason = getattr(exc.certificate_error, "verify_message", "") or str(exc.certificate_error)
        raise TlsVerifyError(
            f"shard {place} at {url}: its TLS certificate did not verify ({reason}); check --tls-ca"
        ) from None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        raise ShardUnavailableError(
            f"shard {place} at {url}: {_why(exc, timeout_s)}", shard_id=place, url=url
        ) from None
    if status in RETRIED_STATUSES:
        raise ShardUnavailableError(f"shard {place} at {url}: http {status}", shard_id=place, url=url)
    try:
        body: Any = orjson.loads(payload)
        return int(body["shard_id"]), int(body["num_shards"])
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        raise ShardListError(
            f"{url} (shard {place} as listed) is not a shard server: GET /healthz answered {status} without a shard id"
        ) from None


def _why(exc: BaseException, timeout_s: float) -> str:
    """Why a look got no answer, in words."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g}s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        if exc.os_error.errno == errno.ECONNREFUSED:
            return "connection refused (nothing listens there)"
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    return f"{type(exc).__name__}: {exc}"


def misplaced(found: Sequence[tuple[str, int, int]]) -> str:
    """What is wrong with shards listed as `found` (each ``(name, shard_id,
    num_shards)`` in list order), in words; empty when place i holds shard i
    of the list's length."""
    n = len(found)
    if all((sid, count) == (i, n) for i, (_, sid, count) in enumerate(found)):
        return ""
    which = ", ".join(f"{name} is shard {sid} of {count}" for name, sid, count in found)
    return f"{n} shard URL(s) listed, in place order: {which}; list every shard's URL, shard 0 first"


async def check_shards(urls: Sequence[str], watch: StartupWatch, ssl: ssl_.SSLContext | None = None) -> None:
    """Wait (under `watch`) until each of `urls` answers, then check that
    they are shards 0..S-1 in order (`ShardListError` otherwise)."""
    found: list[tuple[str, int, int]] = []
    async with aiohttp.ClientSession() as session:
        for place, url in enumerate(urls):
            got: list[tuple[int, int]] = []

            async def probe(place: int = place, url: str = url, got: list[tuple[int, int]] = got) -> None:
                got.append(await shard_identity(session, place, url, ssl, timeout_s=2.0))

            await watch.first_answer(f"shard {place} at {url}", probe)
            found.append((url, *got[-1]))
    wrong = misplaced(found)
    if wrong:
        raise ShardListError(f"--shards does not match the shards: {wrong}")


async def shard0_answers(url: str, ssl: ssl_.SSLContext | None = None, timeout_s: float = ONE_SHOT_TIMEOUT_S) -> None:
    """One look at shard 0 at `url`, for a one-shot command: `NoAnswerError`
    when nothing answers within `timeout_s` (at once when refused);
    `ShardListError` when the server there is not shard 0."""
    async with aiohttp.ClientSession() as session:
        try:
            sid, count = await shard_identity(session, 0, url, ssl, timeout_s)
        except ShardUnavailableError as exc:
            raise NoAnswerError(f"{exc.detail}; check --shard0 or CTRPS_SHARDS") from None
    if sid != 0:
        raise ShardListError(f"{url} is shard {sid} of {count}, not shard 0: pass shard 0's URL as --shard0")


async def await_broker(bootstrap: str, security: KafkaSecurity, watch: StartupWatch) -> None:
    """Wait (under `watch`) until the broker at `bootstrap` answers a
    metadata request. A refused TLS handshake or login is raised at once."""

    async def probe() -> None:
        if not await broker_listening(bootstrap):
            raise KafkaConnectionError(f"nothing listening at {bootstrap}")
        try:
            await wait_for_metadata(bootstrap, 3.0, security)
        except BrokerError as exc:  # it listens, but answers no metadata (yet)
            raise KafkaConnectionError(str(exc)) from None

    await watch.first_answer(f"the Kafka broker at {bootstrap}", probe)


async def broker_answers(bootstrap: str, timeout_s: float = 3.0) -> None:
    """One look at the broker at `bootstrap`, for a one-shot command:
    `NoAnswerError` when no server there accepts a connection within
    `timeout_s` (at once when refused)."""
    if not await broker_listening(bootstrap, timeout_s):
        raise NoAnswerError(
            f"the Kafka broker at {bootstrap} does not answer: connection refused or no answer within "
            f"{timeout_s:g}s; check --bootstrap or CTRPS_KAFKA_BOOTSTRAP"
        )


async def await_path(path: Path, watch: StartupWatch) -> None:
    """Wait (under `watch`) until `path` exists."""

    async def probe() -> None:
        if not await asyncio.to_thread(path.exists):
            raise FileNotFoundError(f"{path} does not exist")

    await watch.first_answer(f"the directory {path}", probe)


async def unless_stopped(stop: asyncio.Event, work: Callable[[], Awaitable[_T]]) -> bool:
    """Run `work()` unless `stop` is set first; whether it ran to its end."""
    task = asyncio.ensure_future(work())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return False
    task.result()
    return True
