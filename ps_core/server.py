"""The shard's HTTP/1.1 server (aiohttp): routes decode, call the `Shard`
handlers, encode. No logic lives here. On ``ctrps shard``'s port, simple
frame requests are answered before they reach this app, alike
(`ps_core.http1_server`); the app serves every other request.

Routes:

- ``POST /v1/pull``, ``POST /v1/push``, ``POST /v1/push_pull`` (a push then
  a pull of one table in one request): binary frames (`ps_core.codec`),
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
  one ``.npz`` body (`ps_core.export.snapshots_to_bytes`), handed over once;
  ``DELETE /v1/snapshots/{version}``: drop those copies (an aborted cut),
  ``{"dropped": bool}``, idempotent;
- ``GET /v1/membership``: the shard's boot id, whether it is joined (under
  which coordinator epoch), the version its state was restored or cut at and
  whether anything was pushed since; ``POST /v1/membership/admit``
  (``{"epoch": str, "version": int}``) joins it; ``POST /v1/restore``
  (``{"version": int}``) has it load that version from its exports
  directory (leaving the cluster until admitted), answering the version
  loaded or the refusal naming a damaged file (`ps_core.joining`);
- ``GET /healthz``: liveness, the shard's id and count, and ``rpc_port``: the
  port of its TCP RPC for pulls and pushes (`ps_core.rpc`), or null.

Errors are JSON ``{"error": code, "detail": reason}`` with the status of the
`PSError` raised, mapped once in `error_middleware`.
"""

from __future__ import annotations

from typing import Awaitable, Callable

import orjson
from aiohttp import web

from . import codec
from .errors import PSError, SnapshotError, StatusError, TableConfigError
from .export import snapshots_to_bytes
from .joining import restore_version
from .shard import Shard
from .table import TableConfig

__all__ = ["create_shard_app", "SHARD", "FRAME_CONTENT_TYPE", "DEFAULT_MAX_BODY"]

SHARD = web.AppKey("shard", Shard)
RPC_PORT: web.AppKey[int | None] = web.AppKey("rpc_port")
FRAME_CONTENT_TYPE = "application/x-ctrps-frame"
DEFAULT_MAX_BODY = 512 * 1024 * 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(body: object, status: int = 200) -> web.Response:
    """A JSON response encoded with orjson."""
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json"
    )


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Map typed errors to JSON error bodies; the one place that does."""
    try:
        return await handler(request)
    except PSError as exc:
        return json_response(exc.to_body(), status=exc.status)
    except web.HTTPRequestEntityTooLarge as exc:
        return json_response({"error": "too_large", "detail": exc.text or "body too large"}, 413)
    except web.HTTPException as exc:
        if exc.status >= 400:
            return json_response(
                {"error": exc.reason.lower().replace(" ", "_"), "detail": exc.text or exc.reason},
                exc.status,
            )
        raise


async def _frame(request: web.Request, op: int) -> web.Response:
    reply = request.app[SHARD].handle_frame(await request.read(), expect_op=op)
    return web.Response(body=reply, content_type=FRAME_CONTENT_TYPE)


async def pull(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PULL)


async def push(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PUSH)


async def push_pull(request: web.Request) -> web.Response:
    return await _frame(request, codec.Op.PUSH_PULL)


async def declare_table(request: web.Request) -> web.Response:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise TableConfigError(f"body is not JSON: {exc}") from None
    created = request.app[SHARD].declare(TableConfig.from_dict(raw))
    table = request.app[SHARD].table(str(raw["name"]))
    return json_response(
        {"created": created, "table": table.config.to_dict()}, status=201 if created else 200
    )


async def list_tables(request: web.Request) -> web.Response:
    shard = request.app[SHARD]
    return json_response({name: t.config.to_dict() for name, t in shard.tables.items()})


async def report_status(request: web.Request) -> web.Response:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise StatusError(f"body is not JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != {"source", "status"}:
        fields = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise StatusError(f'body must be {{"source": ..., "status": {{...}}}}, got {fields}')
    return json_response(request.app[SHARD].report_status(raw["source"], raw["status"]))


async def list_statuses(request: web.Request) -> web.Response:
    return json_response({"statuses": request.app[SHARD].statuses()})


async def take_snapshot(request: web.Request) -> web.Response:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SnapshotError(f"body is not JSON: {exc}") from None
    version, parent = (raw.get("version"), raw.get("parent")) if isinstance(raw, dict) else (None, None)
    if not isinstance(version, int) or isinstance(version, bool) or not (
        parent is None or (isinstance(parent, int) and not isinstance(parent, bool))
    ):
        raise SnapshotError('body must be {"version": int, "parent": int or null}')
    return json_response({"rows": request.app[SHARD].take_snapshot(version, parent)})


async def fetch_snapshot(request: web.Request) -> web.Response:
    try:
        version = int(request.match_info["version"])
    except ValueError:
        raise SnapshotError(f"version {request.match_info['version']!r} is not an integer") from None
    snaps = request.app[SHARD].pop_snapshot(version)
    # Encoding is file-speed work on the event loop; cuts are minutes apart.
    return web.Response(body=snapshots_to_bytes(snaps), content_type="application/octet-stream")


async def drop_snapshot(request: web.Request) -> web.Response:
    try:
        version = int(request.match_info["version"])
    except ValueError:
        raise SnapshotError(f"version {request.match_info['version']!r} is not an integer") from None
    return json_response({"dropped": request.app[SHARD].drop_snapshot(version)})


async def _int_fields(request: web.Request, *names: str) -> dict[str, object]:
    try:
        raw = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise SnapshotError(f"body is not JSON: {exc}") from None
    if not isinstance(raw, dict) or set(raw) != set(names):
        raise SnapshotError(f"body must be an object of {', '.join(names)}")
    return raw


async def membership(request: web.Request) -> web.Response:
    return json_response(request.app[SHARD].membership())


async def admit(request: web.Request) -> web.Response:
    raw = await _int_fields(request, "epoch", "version")
    epoch, version = raw["epoch"], raw["version"]
    if not isinstance(epoch, str) or not isinstance(version, int) or isinstance(version, bool):
        raise SnapshotError('body must be {"epoch": str, "version": int}')
    request.app[SHARD].admit(epoch, version)
    return json_response(request.app[SHARD].membership())


async def restore(request: web.Request) -> web.Response:
    raw = await _int_fields(request, "version")
    version = raw["version"]
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise SnapshotError('body must be {"version": int >= 0}')
    return json_response(await restore_version(request.app[SHARD], version))


async def stats(request: web.Request) -> web.Response:
    return json_response(request.app[SHARD].stats())


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
    shard: Shard, *, max_body: int = DEFAULT_MAX_BODY, rpc_port: int | None = None
) -> web.Application:
    """The aiohttp application serving `shard`; `rpc_port`, the port of its
    TCP RPC (`ps_core.rpc`) if it has one, is advertised by ``/healthz``."""
    app = web.Application(client_max_size=max_body, middlewares=[error_middleware])
    app[SHARD] = shard
    app[RPC_PORT] = rpc_port
    app.router.add_post("/v1/pull", pull)
    app.router.add_post("/v1/push", push)
    app.router.add_post("/v1/push_pull", push_pull)
    app.router.add_post("/v1/tables", declare_table)
    app.router.add_get("/v1/tables", list_tables)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/status", report_status)
    app.router.add_get("/v1/status", list_statuses)
    app.router.add_post("/v1/snapshots", take_snapshot)
    app.router.add_get("/v1/snapshots/{version}", fetch_snapshot)
    app.router.add_delete("/v1/snapshots/{version}", drop_snapshot)
    app.router.add_get("/v1/membership", membership)
    app.router.add_post("/v1/membership/admit", admit)
    app.router.add_post("/v1/restore", restore)
    app.router.add_get("/healthz", healthz)
    return app
