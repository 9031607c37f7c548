"""How every route of the API answers: the wrapper each is served through
(`answering`: the port's deadlines, typed errors mapped to JSON error bodies
in this one place, requests counted, server errors logged at a bounded rate),
the JSON replies, and the request body read and decoded."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson
from aiohttp import web

from ps_core.bodies import decode
from ps_core.errors import (
    CutInProgressError,
    ExportNotFoundError,
    ModelConflictError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    StatusError,
    TableConflictError,
    http_status,
)
from ps_core.net.limits import PortGuard

from .errors import (
    BadRequestError,
    BodyNotJSONError,
    InvalidEventError,
    NoEventsError,
    NoVersionError,
    ReadOnlyReplicaError,
    ShardOrderError,
    TooManyEventsError,
    UnauthorizedError,
    UnknownModelError,
)
from .state import ERROR_LOG, SETTINGS

__all__ = [
    "Handler",
    "answering",
    "json_reply",
    "error_reply",
    "not_found",
    "not_allowed",
    "raw_body",
    "json_body",
    "decode_body",
]

log = logging.getLogger("ctrps.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Errors a caller of the API can act on; any other PSError comes from a
# shard refusing what this server sent, which is this server's problem (502).
_CALLER_ERRORS = (
    BadRequestError,
    InvalidEventError,
    NoEventsError,
    TooManyEventsError,
    UnauthorizedError,
    UnknownModelError,
    ShardUnavailableError,
    StatusError,
    ReadOnlyReplicaError,
    NoVersionError,
    ShardOrderError,
    NoCoordinatorError,
    # Shard 0's exporter answers for the export routes: nothing to compact
    # (404), a cut already pausing the cluster (503, retry).
    ExportNotFoundError,
    CutInProgressError,
    # Creating a model: it exists otherwise, or its tables do (409).
    ModelConflictError,
    TableConflictError,
)
_ERROR_LOG_INTERVAL_S = 10.0


def json_reply(body: object, status: int = 200) -> web.Response:
    """`body` as JSON; a model (`msgspec.Struct`, a control call's reply) as its JSON form."""
    if isinstance(body, msgspec.Struct):
        body = msgspec.to_builtins(body)
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
    )


def error_reply(code: str, detail: str, status: int) -> web.Response:
    return json_reply({"error": code, "detail": detail}, status)


def _ps_error(exc: PSError) -> web.Response:
    if isinstance(exc, _CALLER_ERRORS):
        resp = error_reply(exc.code, exc.detail, exc.status)
        if isinstance(exc, UnauthorizedError):
            resp.headers["WWW-Authenticate"] = 'Bearer realm="ctrps"'
        return resp
    return error_reply("shard_error", f"a shard refused the call: {exc.code}: {exc.detail}", http_status("shard_error"))


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[SETTINGS].max_body_bytes
        return error_reply("too_large", f"the body is over the limit of {limit} bytes", http_status("too_large"))
    if isinstance(exc, web.HTTPNotFound):
        return error_reply(
            "not_found", f"no route {request.method} {request.path}; see /openapi.json", http_status("not_found")
        )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = error_reply(
            "method_not_allowed",
            f"{request.path} takes {allowed}, not {request.method}",
            http_status("method_not_allowed"),
        )
        resp.headers["Allow"] = allowed
        return resp
    return error_reply(exc.reason.lower().replace(" ", "_"), exc.text or exc.reason, exc.status)


def answering(handler: Handler, route: str, guard: PortGuard | None, count: Callable[[str, int], None]) -> Handler:
    """`handler` as the API serves it: its port's deadlines (given `guard`),
    typed errors mapped to JSON error bodies (the one place that does), and
    each request counted by `route` and status (`count`).

    One coroutine per route, not aiohttp middlewares: their machinery adds
    two frames per request, about 2 µs of a single-event predict's ~70
    (`bench/bench_predict.py`)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        conn = None if guard is None else guard.begin(request)
        try:
            try:
                called = handler
                if guard is not None and guard.body_pending(request):
                    # Inside the mapping: a body over the limit is a JSON 413 whether
                    # it came with its head or after, and one that times out a 408.
                    called = await guard.read_body(request, handler)
                resp = await called(request)
            except PSError as exc:
                resp = _ps_error(exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = _http_error(request, exc)
            except Exception as exc:
                log.exception("unhandled error", extra={"fields": {"path": request.path}})
                resp = error_reply("internal", f"{type(exc).__name__}: {exc}", http_status("internal"))
            count(route, resp.status)
            if resp.status >= 500 and isinstance(resp, web.Response) and route != "/readyz":
                # /readyz logs its own changes of state (`app.api.routes._note_readiness`): a probe
                # polls it every few seconds, and each 503 is the same news.
                _log_server_error(request.app, route, resp)
            return resp
        finally:
            if guard is not None:
                guard.end(conn)

    return answer


async def not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound()


async def not_allowed(request: web.Request) -> web.Response:
    resource = request.match_info.route.resource
    allowed = {r.method for r in resource or ()} - {"*", "HEAD"}
    raise web.HTTPMethodNotAllowed(request.method, allowed)


def _log_server_error(app: web.Application, route: str, resp: web.Response) -> None:
    """One line per kind of server error and route every few seconds: a shard
    outage under load must not become a line per request."""
    body = orjson.loads(resp.body) if isinstance(resp.body, bytes) else {}
    key = (route, resp.status, body.get("error"))
    now = time.monotonic()
    last: dict[tuple[Any, ...], float] = app[ERROR_LOG]
    if now - last.get(key, -_ERROR_LOG_INTERVAL_S) >= _ERROR_LOG_INTERVAL_S:
        last[key] = now
        log.warning(
            "request failed",
            extra={"fields": {"route": route, "status": resp.status, **body}},
        )


async def raw_body(request: web.Request) -> bytes:
    """The request body, not blank; 413 over the size limit (aiohttp raises it)."""
    raw = await request.read()
    if not raw.strip():
        raise BodyNotJSONError("the body is empty; send a JSON object")
    return raw


async def json_body(request: web.Request) -> Any:
    """The request body as JSON."""
    try:
        return orjson.loads(await raw_body(request))
    except orjson.JSONDecodeError as exc:
        raise BodyNotJSONError(f"the body is not JSON: {exc}") from None


def decode_body(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    """`raw` decoded by a model's `decoder`: invalid_json when it is not
    JSON, bad_request naming the field when it is not the model's shape."""
    return decode(decoder, raw, BadRequestError, BodyNotJSONError)
