"""The checkpoint routes of a shard app: every shard's restore, and the
coordinator's routes on the shard that hosts it (shard 0), so workers reach it
through the shard URLs they already have. `checkpointed_shard_app` composes a
shard server's whole app.

- ``POST /v1/restore``: ``{"version": int}`` loads that version from the
  exports directory, unjoined until admitted (`ps_core.checkpoint.joining`);

- ``POST /v1/leases``: ``{"worker": str, "ttl_s": float}`` (``ttl_s``
  optional: at most, and by default, the coordinator's lease TTL) →
  ``{"lease_id": int, "epoch": str, "ttl_s": float}`` (the epoch changes when
  the coordinator restarts); waits while a cut is pausing (503
  ``cut_in_progress`` after ``wait_s``, default 30 s, its detail naming the
  lease the cut waits for);
  refused at once while the shards join or restore (503 ``cluster_not_ready``)
  or cannot agree on a version (409 ``no_common_version``, see `ps_core.checkpoint.membership`);
- ``POST /v1/leases/release``: ``{"lease_id": int, "offsets": {topic:
  {partition: next_offset}}, "stream": {"cluster_id", "group", "topics"}}``
  (``stream`` optional: where the offsets were read) → ``{"released": bool}``
  (False: it had expired);
- ``POST /v1/leases/renew``: ``{"lease_id": int}`` → ``{"renewed": bool}``:
  the lease lives its ``ttl_s`` again from now (False: it had expired);
- ``POST /v1/sync/join``, ``/v1/sync/leave``: ``{"worker": str, "model":
  str | null}`` → ``{"step": int}``, and ``POST /v1/sync/arrive``:
  ``{"worker", "deadline_s", "model"}`` → ``{"step": int}`` once the step
  closes: the sync mode's barrier of the model (`ps_core.checkpoint.barrier`;
  null: the default model's);
- ``GET /v1/offsets``: ``{"offsets": {...}, "stream": {...} | null,
  "restored": int}``, the latest committed offsets reported with released
  leases (after a restore: the cut's), the stream they were read from, and
  the version the shards' state was loaded from (0: started empty);
- with an exporter: ``POST /v1/exports`` (``{"kind": "base" | "delta"}``,
  optional) cuts and writes a version now, 201 with its report;
  ``GET /v1/exports``: ``{"model", "versions": [...], "last": report | null}``;
  ``POST /v1/exports/compact`` folds the newest chain into a base (and prunes).
  These are internal routes: the public ones, for people, are the API's.
  ``GET /v1/offsets``, ``GET /v1/exports`` and ``POST /v1/exports/compact``
  take ``?model=NAME`` (default: the default model); a release names its
  model in its body;
- with an exporter, the cluster's models (`ps_core.checkpoint.registry`):
  ``GET /v1/models`` → ``{"default", "models": [...]}``; ``POST /v1/models``
  (train scope, as table declarations) creates one, declaring its tables on every shard (201; 200 when
  it exists identically; 409 ``model_conflict`` otherwise);
  ``GET /v1/models/{name}``; ``DELETE /v1/models/{name}`` (admin) drops its
  tables on every shard and forgets its offsets, leaving its exports on disk;
- with an exporter, ``POST /v1/slots/move`` (admin): ``{"slots": [...],
  "to": int}`` or ``{"drain": int}`` moves slots between the running shards
  under the exporter's lock (`ps_core.checkpoint.moves`), answering the map
  after it and its steps.

On a shard app given a `TokenVerifier` these routes need tokens like every
other (`ps_core.net.server.ROUTE_SCOPES`): leases and offsets the train scope,
the exports listing read, an export or a compaction admin.

A shard app without these routes answers 404, which clients read as "no
coordinator" (`ps_core.errors.NoCoordinatorError`).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..bodies import decode
from ..errors import CutInProgressError, InvalidRequestError
from ..net import control_calls as calls
from ..net.control_messages import KnownOffsets, LeaseBody, Released, Renewed, SyncStep
from ..net.server import SHARD, create_shard_app, json_body, json_response
from ..shard import Shard
from .coordinator import Coordinator, parse_offsets
from .exporter import Exporter
from .joining import restore_version
from .manifest import check_model_name
from .moves import run_move
from .stream import StreamIdentity

__all__ = ["checkpointed_shard_app", "add_coordinator_routes", "COORDINATOR", "EXPORTER"]

COORDINATOR = web.AppKey("coordinator", Coordinator)
EXPORTER = web.AppKey("exporter", Exporter)

_COORDINATED = web.RouteTableDef()
"""The coordinator's routes."""
_EXPORTED = web.RouteTableDef()
"""The exporter's routes (with the coordinator's, on the shard hosting both)."""


def _model_of(request: web.Request) -> str | None:
    """The ``model`` query parameter (None: the default model); 404
    ``unknown_model`` for one the cluster does not hold."""
    unknown = sorted(set(request.query) - {"model"})
    if unknown:
        raise InvalidRequestError(f"unknown query parameters: {', '.join(k[:40] for k in unknown[:5])}")
    name = request.query.get("model")
    if name is None:
        return None
    try:
        check_model_name(name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    if EXPORTER in request.app:
        request.app[EXPORTER].registry.check(name)
    return name


@calls.ACQUIRE_LEASE.route(_COORDINATED)
async def acquire(request: web.Request) -> web.Response:
    body = await json_body(request, calls.ACQUIRE_LEASE.decoder)
    coordinator = request.app[COORDINATOR]
    lease = await coordinator.acquire(body.worker, body.wait_s, body.ttl_s)
    if request.transport is None or request.transport.is_closing():
        # The caller gave up while this waited for a cut: a lease nobody
        # holds would stall the next cut until it expires.
        await coordinator.release(lease.lease_id)
        raise CutInProgressError("the caller left before the lease was granted")
    return json_response(LeaseBody(lease.lease_id, lease.epoch, lease.ttl_s))


@calls.RENEW_LEASE.route(_COORDINATED)
async def renew(request: web.Request) -> web.Response:
    body = await json_body(request, calls.RENEW_LEASE.decoder)
    return json_response(Renewed(request.app[COORDINATOR].renew(body.lease_id)))


@calls.RELEASE_LEASE.route(_COORDINATED)
async def release(request: web.Request) -> web.Response:
    body = await json_body(request, calls.RELEASE_LEASE.decoder)
    # The model checked every key and offset; this turns partition keys into ints.
    offsets = parse_offsets(body.offsets, error=InvalidRequestError)
    stream = None if body.stream is None else StreamIdentity.from_body(body.stream)
    if EXPORTER in request.app:
        for name in (body.model, *body.also):
            if name is not None:
                request.app[EXPORTER].registry.check(name)
    released = await request.app[COORDINATOR].release(body.lease_id, offsets, stream, body.model, body.also)
    return json_response(Released(released))


@calls.OFFSETS.route(_COORDINATED)
async def offsets(request: web.Request) -> web.Response:
    model = _model_of(request)
    coordinator = request.app[COORDINATOR]
    known, stream = coordinator.offsets(model), coordinator.stream_of(model)
    return json_response(
        KnownOffsets(
            {t: {str(p): o for p, o in ps.items()} for t, ps in known.items()},
            stream.to_body() if stream is not None else None,
            coordinator.restored,
        )
    )


@calls.SYNC_JOIN.route(_COORDINATED)
async def sync_join(request: web.Request) -> web.Response:
    body = await json_body(request, calls.SYNC_JOIN.decoder)
    return json_response(SyncStep(request.app[COORDINATOR].barrier(body.model).join(body.worker)))


@calls.SYNC_LEAVE.route(_COORDINATED)
async def sync_leave(request: web.Request) -> web.Response:
    body = await json_body(request, calls.SYNC_LEAVE.decoder)
    return json_response(SyncStep(request.app[COORDINATOR].leave_barrier(body.worker, body.model)))


@calls.SYNC_ARRIVE.route(_COORDINATED)
async def sync_arrive(request: web.Request) -> web.Response:
    body = await json_body(request, calls.SYNC_ARRIVE.decoder)
    barrier = request.app[COORDINATOR].barrier(body.model)
    return json_response(SyncStep(await barrier.arrive(body.worker, body.deadline_s)))


@calls.EXPORT_NOW.route(_EXPORTED)
async def export_now(request: web.Request) -> web.Response:
    raw = await request.read()
    # No body is the exporter's schedule, as {} is.
    kind = decode(calls.EXPORT_NOW.decoder, raw, InvalidRequestError).kind if raw.strip() else None
    return json_response(await request.app[EXPORTER].export_json(kind), status=201)


@calls.MOVE_SLOTS.route(_EXPORTED)
async def move(request: web.Request) -> web.Response:
    body = await json_body(request, calls.MOVE_SLOTS.decoder)
    exporter = request.app[EXPORTER]
    return json_response(await run_move(exporter.client, body, exporter.lock))


@calls.EXPORTS.route(_EXPORTED)
async def list_exports(request: web.Request) -> web.Response:
    return json_response(request.app[EXPORTER].exports_json(_model_of(request)))


@calls.COMPACT.route(_EXPORTED)
async def compact_exports(request: web.Request) -> web.Response:
    return json_response(await request.app[EXPORTER].compact(_model_of(request)))


@calls.MODELS.route(_EXPORTED)
async def list_models(request: web.Request) -> web.Response:
    return json_response(request.app[EXPORTER].models_json())


@calls.MODEL_INFO.route(_EXPORTED)
async def get_model(request: web.Request) -> web.Response:
    return json_response(request.app[EXPORTER].model_json(request.match_info["name"]))


@calls.CREATE_MODEL.route(_EXPORTED)
async def create_model(request: web.Request) -> web.Response:
    body = await json_body(request, calls.CREATE_MODEL.decoder)
    out = await request.app[EXPORTER].create_model_json(body)
    return json_response(out, status=201 if out.created else 200)


@calls.DELETE_MODEL.route(_EXPORTED)
async def delete_model(request: web.Request) -> web.Response:
    return json_response(await request.app[EXPORTER].delete_model(request.match_info["name"]))


def add_coordinator_routes(app: web.Application, coordinator: Coordinator, exporter: Exporter | None = None) -> None:
    """Serve `coordinator` (and `exporter`, if any) from `app`, a shard app
    that has not started yet."""
    app[COORDINATOR] = coordinator
    app.router.add_routes(_COORDINATED)
    if exporter is not None:
        app[EXPORTER] = exporter
        app.router.add_routes(_EXPORTED)


async def restore(request: web.Request) -> web.Response:
    body = await json_body(request, calls.RESTORE.decoder)
    return json_response(await restore_version(request.app[SHARD], body.version))


def checkpointed_shard_app(
    shard: Shard,
    *,
    coordinator: Coordinator | None = None,
    exporter: Exporter | None = None,
    **kwargs: Any,
) -> web.Application:
    """A shard server's app: `ps_core.net.server.create_shard_app(shard,
    **kwargs)` with the restore route, and the coordinator's (and
    exporter's) routes when this shard hosts them."""
    app = create_shard_app(shard, **kwargs)
    app.router.add_route(calls.RESTORE.method, calls.RESTORE.path, restore)
    if coordinator is not None:
        add_coordinator_routes(app, coordinator, exporter)
    return app
