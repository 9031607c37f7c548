"""The shard's HTTP server (aiohttp): routes decode, call the `Shard`
handlers, encode. No logic lives here. The data calls' fast path is the TCP
RPC (`ps_core.net.rpc`); this app serves them too, and every other call.

Routes:

- ``POST /v1/pull``, ``POST /v1/push``, ``POST /v1/push_pull`` (a push then
  a pull of one table in one request), ``POST /v1/changes`` (a geo table's
  keys changed since an earlier answer): binary frames (`ps_core.net.codec`),
  ``Content-Type: application/x-ctrps-frame``;
- ``POST /v1/tables``: declare a table (JSON `TableConfig`), 201 when created,
  200 when an identical table exists, 409 when a different one does;
  ``GET /v1/tables``: the declared tables;
- ``GET /v1/stats``: features, bytes and call counts per table;
- ``POST /v1/status``: report a source's status to the status board (JSON
  ``{"source": str, "status": {...}}``); ``GET /v1/status``: the board;
- ``POST /v1/snapshots``: ``{"version": int, "parent": int | null}``, copy
  the tables' rows for an export cut (the coordinator's pause), answering
  ``{"rows": {table: n}}``; ``GET /v1/snapshots/{version}``: those copies as
  one ``.npz`` body (`ps_core.net.snapshot_transfer.snapshots_to_bytes`), handed over once;
  ``DELETE /v1/snapshots/{version}``: drop those copies (an aborted cut),
  ``{"dropped": bool}``, idempotent;
- ``GET /v1/membership``: the shard's boot id, whether it is joined (under
  which coordinator epoch), the version its state was restored or cut at and
  whether anything was pushed since; ``POST /v1/membership/admit``
  (``{"epoch": str, "version": int}``) joins it; ``POST /v1/restore``
  (``{"version": int}``) has it load that version from its exports
  directory (leaving the cluster until admitted), answering the version
  loaded or the refusal naming a damaged file (`ps_core.checkpoint.joining`);
- ``GET /v1/slots``: the shard's slot map (`ps_core.slots`); ``PUT
  /v1/slots`` has it take a newer one; a slot move's steps
  (`ps_core.shard.slot_moves`): ``POST /v1/slots/hand_off``
  (``{"slots", "slot_map"}``) answers the slots' rows as one ``.npz`` body,
  ``POST /v1/slots/take_over`` takes such a body, ``DELETE
  /v1/slots/held/{epoch}`` drops the copies handed off;
- ``GET /metrics``: the shard's own figures in Prometheus text
  (`ps_core.net.shard_metrics`: tables' rows, bytes, pushes and pulls, change
  logs, ports, refused credentials; shard 0: exports, membership, sync), the
  families the API relays for every shard; it needs a token of scope read as
  ``GET /v1/stats`` does (a scraper sends it as a bearer token);
- ``GET /healthz``: liveness, the shard's id and count, and ``rpc_port``: the
  port of its TCP RPC for pulls and pushes (`ps_core.net.rpc`), or null;
- ``GET /openapi.json``: the OpenAPI document of the JSON routes this app
  serves (`ps_core.net.shard_openapi`).

JSON bodies are decoded with their models (`ps_core.net.shard_bodies`,
`ps_core.net.control_messages`: the same that the document publishes): integers are JSON integers (not ``3.0``,
``2.5``, ``true``, ``"3"`` or ``9.2e18``) within bounds (versions fit a
uint32), and no unknown field is taken; a path's integers are ASCII digits
(`ps_core.parsing`). Anything else is 400 ``bad_request`` naming the field.

Errors are JSON ``{"error": code, "detail": reason}`` with the status of the
`PSError` raised, mapped once in `error_middleware`.

Credentials: given a `TokenVerifier`, every route but ``/healthz`` and ``/openapi.json`` needs an
``Authorization: Bearer <token>`` of the route's scope (`ROUTE_SCOPES`, the
coordinator's routes included); a missing or wrong token is answered 401
``unauthorized``, one of too low a scope 403 ``forbidden``, each counted in
the shard's stats (``auth.refused``) and logged without the token
(`ps_core.net.auth.Refusals`). ``GET /openapi.json`` is open as well (it describes the routes,
it holds no state). Without a verifier the app is open.
"""

from __future__ import annotations

import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .. import bodies
from ..errors import (
    AuthError,
    ForbiddenError,
    InvalidJSONError,
    InvalidRequestError,
    PSError,
    StatusError,
    TableConfigError,
    http_status,
)
from ..parsing import parse_int
from ..shard import Shard
from ..store.board import StatusReport
from ..store.snapshot import MAX_VERSION
from ..store.table_config import TableConfig
from . import codec
from . import control_calls as calls
from .auth import Refusals, Scope, TokenVerifier, check, token_from_header
from .control_calls import CONTROL_CALLS
from .control_messages import (
    Dropped,
    SlotMapTaken,
    SnapshotRows,
    SyncApplied,
    TableDropped,
    TakenOver,
    slot_map_of,
)
from .frame_handler import handle_frame
from .limits import PortGuard, PortLimits, ServedPort, serve_limited
from .shard_metrics import exposition, shard_families
from .shard_openapi import shard_document
from .snapshot_transfer import slot_rows_from_bytes, slot_rows_to_bytes, snapshots_to_bytes

__all__ = [
    "create_shard_app",
    "json_document",
    "json_body",
    "json_response",
    "refusal_body",
    "start_shard_site",
    "ShardSite",
    "ROUTE_SCOPES",
    "SHARD",
    "FRAME_CONTENT_TYPE",
    "DEFAULT_MAX_BODY",
]

log = logging.getLogger("ctrps.shard.auth")

SHARD = web.AppKey("shard", Shard)
_ROUTES = web.RouteTableDef()
"""A shard server's routes, declared beside their handlers (`create_shard_app`)."""
RPC_PORT: web.AppKey[int | None] = web.AppKey("rpc_port")
VERIFIER: web.AppKey[TokenVerifier | None] = web.AppKey("verifier")
REFUSALS = web.AppKey("refusals", Refusals)
FRAME_CONTENT_TYPE = "application/x-ctrps-frame"
DEFAULT_MAX_BODY = 512 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
T = TypeVar("T")


def json_response(body: object, status: int = 200) -> web.Response:
    """A JSON response: a model (`msgspec.Struct`, a control call's reply)
    encoded by msgspec, anything else by orjson."""
    raw = msgspec.json.encode(body) if isinstance(body, msgspec.Struct) else orjson.dumps(body)
    return web.Response(body=raw, status=status, content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map typed errors to JSON error bodies; the one place that does."""
    try:
        return await handler(request)
    except PSError as exc:
        return json_response(exc.to_body(), status=exc.status)
    except web.HTTPRequestEntityTooLarge as exc:
        return json_response({"error": "too_large", "detail": exc.text or "body too large"}, http_status("too_large"))
    except web.HTTPMethodNotAllowed as exc:
        # RFC 9110: a 405 names the methods the route takes.
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = json_response(
            {"error": "method_not_allowed", "detail": f"{request.path} takes {allowed}, not {request.method}"},
            http_status("method_not_allowed"),
        )
        resp.headers["Allow"] = allowed
        return resp
    except web.HTTPException as exc:
        if exc.status >= 400:
            return json_response(
                {"error": exc.reason.lower().replace(" ", "_"), "detail": exc.text or exc.reason},
                exc.status,
            )
        raise


ROUTE_SCOPES: dict[tuple[str, str], Scope | None] = {call.key: call.scope for call in CONTROL_CALLS}
"""The scope each route needs (None: open), declared with the route: the
control plane's with their calls (`ps_core.net.control_calls`), the others
by `_route`. A request no route matches needs a valid token of any scope,
so its 404 says nothing to a stranger."""


def _route(method: str, path: str, scope: Scope | None) -> Callable[[Handler], Handler]:
    """Declare a route of this app (not a control call's) and the scope it needs (None: open)."""
    ROUTE_SCOPES[(method, path)] = scope
    return _ROUTES.get(path) if method == "GET" else _ROUTES.route(method, path)


def refusal_body(reason: str, needs: Scope, granted: Scope | None) -> tuple[int, dict[str, str]]:
    """The status and JSON error body of a refusal (`ps_core.net.auth.check`'s reason)."""
    if reason == "scope":
        held = granted.label if granted is not None else "none"
        return ForbiddenError.status, {
            "error": ForbiddenError.code,
            "detail": f"this call needs a token of scope {needs.label}, the one presented is {held}",
        }
    detail = (
        "no token presented (Authorization: Bearer <token>)"
        if reason == "missing"
        else "the token presented is not valid for this cluster"
    )
    return AuthError.status, {"error": AuthError.code, "detail": detail}


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a request whose token does not grant its route's scope."""
    verifier = request.app[VERIFIER]
    if verifier is None:
        return await handler(request)
    route = request.match_info.route.resource
    # aiohttp answers HEAD with a GET route's handler (which runs whole: a
    # HEAD of a snapshot would hand it over): it needs the GET's scope.
    method = "GET" if request.method == "HEAD" else request.method
    key = (method, route.canonical if route is not None else "")
    needs = ROUTE_SCOPES.get(key, Scope.READ)
    if needs is None:
        return await handler(request)
    reason, granted = check(verifier, token_from_header(request.headers.get("Authorization")), needs)
    if not reason:
        return await handler(request)
    request.app[REFUSALS].refuse(
        reason, plane="http", peer=str(request.remote), what=f"{request.method} {request.path}", needs=needs
    )
    status, body = refusal_body(reason, needs, granted)
    resp = json_response(body, status)
    if status == 401:
        resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


async def _frame(request: web.Request, op: int) -> web.Response:
    reply = handle_frame(request.app[SHARD], await request.read(), expect_op=op)
    return web.Response(body=reply, content_type=FRAME_CONTENT_TYPE)


@_route("POST", "/v1/pull", Scope.READ)
async def pull(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PULL)


@_route("POST", "/v1/push", Scope.TRAIN)
async def push(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PUSH)


@_route("POST", "/v1/push_pull", Scope.TRAIN)
async def push_pull(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PUSH_PULL)


@_route("POST", "/v1/changes", Scope.TRAIN)
async def changes(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.CHANGES)


@calls.DECLARE.route(_ROUTES)
async def declare_table(request: web.Request) -> web.Response:
    body = await json_body(request, calls.DECLARE.decoder, TableConfigError)
    # Unset fields are left out, so the table's defaults fill them in.
    config = TableConfig.from_dict(msgspec.to_builtins(body))
    created = request.app[SHARD].declare(config)
    table = request.app[SHARD].table(config.name)
    return json_response({"created": created, "table": table.config.to_dict()}, status=201 if created else 200)


_TABLE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@calls.DROP_TABLE.route(_ROUTES)
async def drop_table(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if not _TABLE_NAME.fullmatch(name):
        raise InvalidRequestError(f"{name[:80]!r} is not a table name: 1-64 of [A-Za-z0-9_.-]")
    return json_response(TableDropped(request.app[SHARD].drop(name)))


@_route("GET", "/v1/tables", Scope.READ)
async def list_tables(request: web.Request) -> web.Response:
    shard = request.app[SHARD]
    return json_response({name: t.config.to_dict() for name, t in shard.tables.items()})


async def json_document(request: web.Request) -> Any:
    """The body as one JSON document (any JSON value, for the caller to
    check); `InvalidJSONError` when it is not one."""
    try:
        return orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise InvalidJSONError(f"the body is not JSON: {exc}") from None


async def json_body(
    request: web.Request, decoder: msgspec.json.Decoder[T], error: type[PSError] = InvalidRequestError
) -> T:
    """The body decoded by `decoder` (a model's); `error` (400) naming the field otherwise."""
    return bodies.decode(decoder, await request.read(), error)


@calls.REPORT_STATUS.route(_ROUTES)
async def report_status(request: web.Request) -> web.Response:
    raw = await json_document(request)
    # The shard checks the report again (a report in process comes that way only);
    # here the route refuses any other body (not an object, other fields) with the same model.
    bodies.check(raw, StatusReport, StatusError)
    return json_response(request.app[SHARD].report_status(raw["source"], raw["status"]))


@calls.STATUSES.route(_ROUTES)
async def list_statuses(request: web.Request) -> web.Response:
    return json_response({"statuses": request.app[SHARD].statuses()})


@calls.TAKE_SNAPSHOT.route(_ROUTES)
async def take_snapshot(request: web.Request) -> web.Response:
    body = await json_body(request, calls.TAKE_SNAPSHOT.decoder)
    return json_response(SnapshotRows(request.app[SHARD].take_snapshot(body.version, body.parent)))


def _version(request: web.Request) -> int:
    return parse_int(request.match_info["version"], "version", maximum=MAX_VERSION)


@calls.FETCH_SNAPSHOT.route(_ROUTES)
async def fetch_snapshot(request: web.Request) -> web.Response:
    snaps = request.app[SHARD].pop_snapshot(_version(request))
    # Encoding is file-speed work on the event loop; cuts are minutes apart.
    return web.Response(body=snapshots_to_bytes(snaps), content_type="application/octet-stream")


@calls.DROP_SNAPSHOT.route(_ROUTES)
async def drop_snapshot(request: web.Request) -> web.Response:
    return json_response(Dropped(request.app[SHARD].drop_snapshot(_version(request))))


@calls.SLOT_MAP.route(_ROUTES)
async def slot_map(request: web.Request) -> web.Response:
    return json_response(request.app[SHARD].slot_map.to_dict())


@calls.ADOPT_SLOT_MAP.route(_ROUTES)
async def adopt_slot_map(request: web.Request) -> web.Response:
    body = await json_body(request, calls.ADOPT_SLOT_MAP.decoder)
    return json_response(SlotMapTaken(request.app[SHARD].slot_moves.adopt(slot_map_of(body))))


@calls.HAND_OFF.route(_ROUTES)
async def hand_off(request: web.Request) -> web.Response:
    body = await json_body(request, calls.HAND_OFF.decoder)
    shard = request.app[SHARD]
    new = slot_map_of(body.slot_map)
    copies = shard.slot_moves.hand_off(body.slots, new)
    return web.Response(body=slot_rows_to_bytes(copies, new), content_type="application/octet-stream")


@calls.TAKE_OVER.route(_ROUTES)
async def take_over(request: web.Request) -> web.Response:
    copies, new = slot_rows_from_bytes(await request.read())
    return json_response(TakenOver(request.app[SHARD].slot_moves.take_over(copies, new)))


@calls.RELEASE_SLOTS.route(_ROUTES)
async def release_slots(request: web.Request) -> web.Response:
    epoch = parse_int(request.match_info["epoch"], "epoch", maximum=MAX_VERSION)
    return json_response(Dropped(request.app[SHARD].slot_moves.release(epoch) > 0))


@calls.MEMBERSHIP.route(_ROUTES)
async def membership(request: web.Request) -> web.Response:
    return json_response(request.app[SHARD].membership())


@calls.ADMIT.route(_ROUTES)
async def admit(request: web.Request) -> web.Response:
    body = await json_body(request, calls.ADMIT.decoder)
    request.app[SHARD].admit(body.epoch, body.version)
    return json_response(request.app[SHARD].membership())


@calls.SYNC_APPLY.route(_ROUTES)
async def apply_step(request: web.Request) -> web.Response:
    body = await json_body(request, calls.SYNC_APPLY.decoder)
    return json_response(SyncApplied(request.app[SHARD].apply_step(body.step, body.tables)))


@calls.STATS.route(_ROUTES)
async def stats(request: web.Request) -> web.Response:
    return json_response(request.app[SHARD].stats())


@_route("GET", "/metrics", Scope.READ)  # the stats' figures: as closed as /v1/stats
async def metrics(request: web.Request) -> web.Response:
    shard = request.app[SHARD]
    text = exposition(shard_families([(str(shard.spec.shard_id), shard.stats())]))
    return web.Response(body=text, headers={"Content-Type": CONTENT_TYPE_LATEST})


# Open: the document describes routes (public in the source), holds no
# state, and fuzzers and clients read it before they hold a token.
@_route("GET", "/openapi.json", None)
async def openapi(request: web.Request) -> web.Response:
    # Built per request from the router: shard 0's coordinator routes are
    # added after the app is created, and the document names only those served.
    served = {(r.method, r.resource.canonical) for r in request.app.router.routes() if r.resource is not None}
    return json_response(shard_document(served))


@_route("GET", "/healthz", None)  # probes
async def healthz(request: web.Request) -> web.Response:
    spec = request.app[SHARD].spec
    return json_response(
        {
            "status": "ok",
            "shard_id": spec.shard_id,
            "num_shards": spec.num_shards,
            "rpc_port": request.app[RPC_PORT],
        }
    )


def create_shard_app(
    shard: Shard,
    *,
    max_body: int = DEFAULT_MAX_BODY,
    rpc_port: int | None = None,
    verifier: TokenVerifier | None = None,
    refusals: Refusals | None = None,
) -> web.Application:
    """The aiohttp application serving `shard`; `rpc_port`, the port of its
    TCP RPC (`ps_core.net.rpc`) if it has one, is advertised by ``/healthz``.

    With `verifier`, every route but ``/healthz`` needs a token of its scope
    (`ROUTE_SCOPES`); refusals are counted in `refusals` (pass the RPC
    server's to count both planes together) and the shard's stats."""
    app = web.Application(client_max_size=max_body, middlewares=[error_middleware, auth_middleware])
    app[SHARD] = shard
    app[RPC_PORT] = rpc_port
    app[VERIFIER] = verifier
    app[REFUSALS] = refusals = refusals or Refusals(log)
    if verifier is not None:
        shard.add_stats("auth", refusals.stats)
    app.router.add_routes(_ROUTES)
    return app


class ShardSite:
    """A shard app listening on one port under its limits; `cleanup` stops it
    (safe twice)."""

    def __init__(self, served: ServedPort, guard: PortGuard) -> None:
        self._served = served
        self.guard = guard
        """The port's limits and counters (connections, deadlines)."""
        self.port: int = served.port
        """The port it listens on (the one the OS chose when asked for 0)."""
        self._closed = False

    async def cleanup(self) -> None:
        """Stop listening and close every connection."""
        if self._closed:
            return
        self._closed = True
        await self._served.close()


async def start_shard_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context: ssl.SSLContext | None = None,
    limits: PortLimits | None = None,
) -> ShardSite:
    """Serve `app` (a `create_shard_app`, not yet set up) on `host`:`port`
    (0 picks a free port) under `limits` (connections, head, body and idle
    deadlines: `ps_core.net.limits`), over TLS with `ssl_context`."""
    guard = PortGuard("shard", limits or PortLimits())
    guard.install(app)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, **guard.limits.runner_kwargs())
    await runner.setup()
    try:
        served = await serve_limited(runner, guard, host, port, ssl_context=ssl_context)
    except BaseException:  # e.g. the port in use
        await runner.cleanup()
        raise
    return ShardSite(served, guard)
