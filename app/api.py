"""The public HTTP API: predictions, weights, model information, the status
board, health, readiness, metrics and its OpenAPI document.

``create_app(settings, client, model)`` builds the aiohttp application over a
`PSClient` (shard servers or shards in this process) and the `Model` the
workers train; `ApiServer` serves it on a socket and `run_api` until an event
is set. State lives under `web.AppKey`s; nothing is global.

Routes (the OpenAPI document, ``GET /openapi.json``, has the schemas):

- ``POST /v1/predict`` ``{"events": [{"features": {...}} | {"keys": [...]}, ...]}``
  → ``{"predictions": [...], "model": name, "model_version": v}``;
- ``GET /v1/models``: the models served; ``POST /v1/models/{name}/predict``
  is ``/v1/predict`` of model `name` (another is 404 ``unknown_model``);
- ``POST /v1/weights`` ``{"features": {...}, "keys": [...]}`` → each
  feature's current weights, bias first, absent ones flagged;
- ``GET /v1/model``: configuration, size, training progress, lag;
- ``GET /v1/status``, ``POST /v1/status`` (admin): the status board;
- ``POST /v1/exports`` (admin) cuts and writes a model version now (through
  shard 0's exporter); ``GET /v1/exports`` lists the versions;
  ``POST /v1/exports/compact`` (admin) folds the newest chain into a base;
- ``GET /`` the dashboard, drawing ``GET /v1/history`` (`app.history`);
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /openapi.json``.

With a `Follower` (``ctrps serve --follow``) the app is a serving replica:
the client reads the follower's in-process shard, ``GET /v1/model`` adds the
served version and the follow state, ``/readyz`` waits for a loaded version,
and mutating routes answer 409 ``read_only_replica``.

Errors are ``{"error": code, "detail": reason}``, mapped from typed errors
(`app.errors`, `ps_core.errors`) in one place, the wrapper of every route;
handlers do not catch.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from importlib import resources
from typing import Any, TypedDict, Unpack

import msgspec
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ps_core.bodies import check, decode
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import list_versions
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import (
    CutInProgressError,
    ExportNotFoundError,
    InvalidRequestError,
    ModelConflictError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    StatusError,
    TableConfigError,
    TableConflictError,
    http_status,
)
from ps_core.model.models import Model, make_model
from ps_core.net.client import PSReader
from ps_core.net.limits import PortGuard, ServedPort, serve_limited
from ps_core.net.shard_openapi import ExportRequest
from ps_core.net.tls import HandshakeFailures, watch_handshakes
from ps_core.parsing import parse_number
from ps_core.store.board import StatusReport

from .api_bodies import WEIGHTS, CreateModelRequest, PredictRequest, predict_decoder
from .config.serve import ApiSettings
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
from .follower import Follower
from .history import History
from .logs import log_event
from .metrics import ApiMetrics
from .openapi import openapi_document
from .predictor import Predictor
from .security import is_loopback
from .served_models import Discover, ServedModels
from .startup import misplaced
from .status import summarize
from .views import ClusterView, ControlView, all_stats

__all__ = [
    "create_app",
    "ApiServer",
    "run_api",
    "SETTINGS",
    "CLIENT",
    "MODEL",
    "PREDICTOR",
    "METRICS",
    "HISTORY",
    "OPENAPI",
    "FOLLOWER",
]

log = logging.getLogger("ctrps.api")

SETTINGS = web.AppKey("settings", ApiSettings)
CLIENT = web.AppKey("client", PSReader)
"""The reader the app pulls weights with (instrumented: every call timed)."""
VIEW: web.AppKey[ClusterView] = web.AppKey("view")
"""The shards' stats and status board: the control plane's, or a replica's."""
CONTROL: web.AppKey[ControlClient | None] = web.AppKey("control")
"""The training cluster's control plane (exports, status reports); None on a replica."""
MODEL = web.AppKey("model", Model)
"""The API's own model: the one a request naming none means."""
PREDICTOR = web.AppKey("predictor", Predictor)
METRICS = web.AppKey("metrics", ApiMetrics)
HISTORY = web.AppKey("history", History)
SERVED = web.AppKey("served", ServedModels)
"""The dashboard's samples of the cluster, taken while the app runs."""
OPENAPI = web.AppKey("openapi", dict)
"""The OpenAPI document (a dict)."""
FOLLOWER = web.AppKey("follower", Follower)
"""Present on a serving replica: what it serves and how it follows the exports."""
_OPENAPI_BODY = web.AppKey("openapi_body", bytes)
_PREDICT: web.AppKey[msgspec.json.Decoder[PredictRequest]] = web.AppKey("predict_decoder")
"""`PredictRequest`'s decoder, bounded by `ApiSettings.max_events`."""
_ERROR_LOG = web.AppKey("error_log", dict)
_READINESS = web.AppKey("readiness", list)
"""``[last answer of /readyz: None (not asked yet), True or False]``."""

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


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status=status,
        content_type="application/json",
    )


def _error(code: str, detail: str, status: int) -> web.Response:
    return _json({"error": code, "detail": detail}, status)


def _ps_error(exc: PSError) -> web.Response:
    if isinstance(exc, _CALLER_ERRORS):
        resp = _error(exc.code, exc.detail, exc.status)
        if isinstance(exc, UnauthorizedError):
            resp.headers["WWW-Authenticate"] = 'Bearer realm="ctrps"'
        return resp
    return _error("shard_error", f"a shard refused the call: {exc.code}: {exc.detail}", http_status("shard_error"))


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        limit = request.app[SETTINGS].max_body_bytes
        return _error("too_large", f"the body is over the limit of {limit} bytes", http_status("too_large"))
    if isinstance(exc, web.HTTPNotFound):
        return _error(
            "not_found", f"no route {request.method} {request.path}; see /openapi.json", http_status("not_found")
        )
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        resp = _error(
            "method_not_allowed",
            f"{request.path} takes {allowed}, not {request.method}",
            http_status("method_not_allowed"),
        )
        resp.headers["Allow"] = allowed
        return resp
    return _error(exc.reason.lower().replace(" ", "_"), exc.text or exc.reason, exc.status)


def _answering(handler: Handler, route: str, guard: PortGuard | None, count: Callable[[str, int], None]) -> Handler:
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
                resp = _error("internal", f"{type(exc).__name__}: {exc}", http_status("internal"))
            count(route, resp.status)
            if resp.status >= 500 and isinstance(resp, web.Response) and route != "/readyz":
                # /readyz logs its own changes of state (`_note_readiness`): a probe
                # polls it every few seconds, and each 503 is the same news.
                _log_server_error(request.app, route, resp)
            return resp
        finally:
            if guard is not None:
                guard.end(conn)

    return answer


async def _not_found(request: web.Request) -> web.Response:
    raise web.HTTPNotFound()


async def _not_allowed(request: web.Request) -> web.Response:
    resource = request.match_info.route.resource
    allowed = {r.method for r in resource or ()} - {"*", "HEAD"}
    raise web.HTTPMethodNotAllowed(request.method, allowed)


def _log_server_error(app: web.Application, route: str, resp: web.Response) -> None:
    """One line per kind of server error and route every few seconds: a shard
    outage under load must not become a line per request."""
    body = orjson.loads(resp.body) if isinstance(resp.body, bytes) else {}
    key = (route, resp.status, body.get("error"))
    now = time.monotonic()
    last: dict[tuple[Any, ...], float] = app[_ERROR_LOG]
    if now - last.get(key, -_ERROR_LOG_INTERVAL_S) >= _ERROR_LOG_INTERVAL_S:
        last[key] = now
        log.warning(
            "request failed",
            extra={"fields": {"route": route, "status": resp.status, **body}},
        )


async def _raw_body(request: web.Request) -> bytes:
    """The request body, not blank; 413 over the size limit (aiohttp raises it)."""
    raw = await request.read()
    if not raw.strip():
        raise BodyNotJSONError("the body is empty; send a JSON object")
    return raw


async def _json_body(request: web.Request) -> Any:
    """The request body as JSON."""
    try:
        return orjson.loads(await _raw_body(request))
    except orjson.JSONDecodeError as exc:
        raise BodyNotJSONError(f"the body is not JSON: {exc}") from None


def _decode(decoder: msgspec.json.Decoder[Any], raw: bytes) -> Any:
    """`raw` decoded by a model's `decoder`: invalid_json when it is not
    JSON, bad_request naming the field when it is not the model's shape."""
    return decode(decoder, raw, BadRequestError, BodyNotJSONError)


def _predict_body(decoder: msgspec.json.Decoder[PredictRequest], raw: bytes) -> PredictRequest:
    """A predict body, parsed by orjson and checked by its model.

    orjson's key cache makes each field name one object in every request, and
    the hasher's layout cache compares names by identity first; msgspec's
    smaller cache left a tenth of Criteo's names new objects per request
    (featurizing 1,000 events took 5.2 ms instead of 4.5). A body orjson
    refuses is msgspec's to judge (it takes 1e400, which the model then
    refuses): the error path only."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        body: PredictRequest = _decode(decoder, raw)
        return body
    checked: PredictRequest = check(obj, decoder.type, BadRequestError)
    return checked


def _events_error(request: web.Request, raw: bytes, exc: BadRequestError) -> PSError:
    """Why a predict body failed its model: no events or too many (422, as
    the document says) when that was it, else `exc`. The error path only."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:  # JSON to msgspec, not to orjson (e.g. 1e400)
        return exc
    events = body.get("events") if isinstance(body, dict) else None
    if isinstance(events, list) and not events:
        return NoEventsError("events is empty; send at least one event")
    limit = request.app[SETTINGS].max_events
    if isinstance(events, list) and len(events) > limit:
        return TooManyEventsError(f"{len(events)} events in one request; the limit is {limit}")
    return exc


async def _predictor(request: web.Request, name: str | None) -> Predictor:
    """The predictor of model `name` (None: the API's own); 404
    ``unknown_model`` when neither the API nor its cluster holds it."""
    return await request.app[SERVED].predictor(name)


def _require_admin(request: web.Request) -> None:
    """401 unless the bearer token matches `ApiSettings.admin_token` (when set)."""
    token = request.app[SETTINGS].admin_token
    if not token:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise UnauthorizedError("this route needs an Authorization: Bearer <token> header")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise UnauthorizedError("the bearer token is not the server's admin token")


# -- routes ---------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    return _json({"default": request.app[MODEL].name, "models": await request.app[SERVED].listing()})


async def create_model(request: web.Request) -> web.Response:
    """``POST /v1/models`` (admin): create a model on the cluster."""
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica creates no models: ask the trainer's API or shard 0")
    body = _decode(_CREATE_MODEL, await _raw_body(request))
    kwargs: dict[str, Any] = {"mode": body.mode, "max_staleness": body.max_staleness, "numeric": body.numeric}
    if body.max_staleness is not None and body.mode != "async":
        raise BadRequestError("max_staleness is for mode async")
    if body.optimizer is not None:
        kwargs["optimizer"] = _optimizer(body.optimizer)
    if body.type == "fm":  # the embedding fields are fm's: an lr model ignores them
        kwargs["k"] = body.factors
        if body.embedding_optimizer is not None:
            kwargs["embedding_optimizer"] = _optimizer(body.embedding_optimizer)
    # What the document's schema cannot say is the caller's 400 too, not a
    # 500 or a shard's refusal (502): optimizer settings the shards refuse
    # together (ftrl with neither beta nor l2), whatever make_model refuses.
    try:
        model = make_model(body.type, body.name, **kwargs)
        out = await control.create_model(ModelSpec.of(model).recipe())
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None
    except (InvalidRequestError, TableConfigError) as exc:
        raise BadRequestError(exc.detail) from None
    return _json(out, status=201 if out["created"] else 200)


def _optimizer(given: object) -> dict[str, Any]:
    """An optimizer of a create request as a table declares it."""
    if isinstance(given, str):
        return {"name": given}
    out: dict[str, Any] = msgspec.to_builtins(given)
    return out


async def delete_model(request: web.Request) -> web.Response:
    """``DELETE /v1/models/{name}`` (admin): delete a model of the cluster."""
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica deletes no models: ask the trainer's API or shard 0")
    return _json(await control.delete_model(request.match_info["name"]))


async def model_predict(request: web.Request) -> web.Response:
    """``POST /v1/models/{name}/predict``: `predict` of model `name`."""
    return await predict(request, request.match_info["name"])


async def predict(request: web.Request, path_model: str | None = None) -> web.Response:
    t0 = time.perf_counter()
    app = request.app
    raw = await _raw_body(request)
    try:
        body = _predict_body(app[_PREDICT], raw)
    except BodyNotJSONError:
        raise
    except BadRequestError as exc:
        raise _events_error(request, raw, exc) from None
    if path_model is not None and body.model is not None and body.model != path_model:
        # As a server serving only the path's model would answer: 404.
        raise UnknownModelError(f"the body names model {body.model[:80]!r}, the path {path_model[:80]!r}")
    name = path_model or body.model
    # The API's own model without a lookup's coroutine: the common request.
    predictor = app[PREDICTOR] if name is None else await _predictor(request, name)
    events = body.events
    result = await predictor.predict(events)
    name = predictor.model.name
    resp = _json({"predictions": result.probabilities, "model": name, "model_version": result.version})
    app[METRICS].predicted(name, len(events), time.perf_counter() - t0)
    return resp


async def weights(request: web.Request) -> web.Response:
    body = _decode(WEIGHTS, await _raw_body(request))
    predictor = await _predictor(request, body.model)
    found = await predictor.weights(body.features, body.keys)
    tables = list(found.weights)
    per_table = [found.weights[t].tolist() for t in tables]
    rows = [
        {
            "feature": name,
            "key": key,
            "value": value,
            "present": present,
            "weights": dict(zip(tables, ws)),
        }
        # One lookup's features, each named: building the answer is per feature.
        for name, key, value, present, *ws in zip(
            found.names,
            found.keys.tolist(),
            found.values.tolist(),
            found.present.tolist(),
            *per_table,
        )
    ]
    return _json(
        {
            "model": predictor.model.name,
            "model_version": found.version,
            "tables": tables,
            "weights": rows,
        }
    )


def _lifecycle_info(per_shard: list[dict[str, Any]]) -> dict[str, Any]:
    """A table's lifecycle over its shards: the rules, what they did summed."""
    evicted: dict[str, int] = {}
    for s in per_shard:
        for rule, n in s["evicted"].items():
            evicted[rule] = evicted.get(rule, 0) + n
    pauses = [s["last_eviction_ms"] for s in per_shard if s["last_eviction_ms"] is not None]
    admission = [s.get("admission", {}) for s in per_shard]
    return {
        "rules": per_shard[0]["lifecycle"],
        "evicted": evicted,
        "eviction_passes": sum(s["eviction_passes"] for s in per_shard),
        "bytes_freed": sum(s["bytes_freed"] for s in per_shard),
        "last_eviction_ms": max(pauses) if pauses else None,
        "admitted": sum(a.get("admitted", 0) for a in admission),
        "dropped": sum(a.get("dropped", 0) for a in admission),
    }


def _staleness_info(per_shard: list[dict[str, Any]]) -> dict[str, Any]:
    """A table's push staleness summed over its shards."""
    count = sum(x["count"] for x in per_shard)
    return {
        "pushes": count,
        "mean": sum(x["sum"] for x in per_shard) / count if count else None,
        "down_weighted": sum(x["down_weighted"] for x in per_shard),
        "max_staleness": per_shard[0]["max_staleness"],
    }


async def model_info(request: web.Request) -> web.Response:
    _only_query(request, "model")
    model = await request.app[SERVED].model(request.query.get("model"))
    view = request.app[SERVED].view_of(model.name)
    stats, board_raw = await asyncio.gather(all_stats(view), view.statuses())
    board = summarize(board_raw, model.name)
    tables: dict[str, Any] = {}
    versions = []
    for config in model.tables():
        on_shards = [s["tables"][config.name] for s in stats if config.name in s["tables"]]
        info: dict[str, Any] = {
            "declared": len(on_shards) == len(stats),
            "features": sum(t["features"] for t in on_shards),
            "bytes": sum(t["bytes"] for t in on_shards),
            "dim": config.dim,
            # What the shards hold is the truth; the model's declaration until then.
            "optimizer": on_shards[0]["config"]["optimizer"] if on_shards else config.optimizer,
        }
        info["mode"] = on_shards[0]["config"].get("mode", "async") if on_shards else config.mode
        if on_shards:
            info["version"] = min(t["version"] for t in on_shards)
            versions.append(info["version"])
            info["lifecycle"] = _lifecycle_info([t["lifecycle"] for t in on_shards])
            if all("staleness" in t for t in on_shards):
                info["staleness"] = _staleness_info([t["staleness"] for t in on_shards])
        tables[config.name] = info
    now = time.time()
    return _json(
        {
            "model": model.name,
            "config": model.config(),
            "update_mode": board.update_mode,
            "tables": tables,
            "features": sum(t["features"] for t in tables.values()),
            "bytes": sum(t["bytes"] for t in tables.values()),
            "events_trained": board.events_trained,
            "records_consumed": board.records_consumed,
            "windows": board.windows,
            "dead_letters": {"total": board.dead_letters, "by_reason": board.dead_letters_by_reason},
            "last_window": board.last_window,
            "lag": {
                "total": board.lag,
                "by_partition": {str(p): n for p, n in board.lag_by_partition.items()},
            },
            "workers": [
                {"source": w.source, "received_at": w.received_at, "age_s": max(0.0, now - w.received_at)}
                for w in board.workers
            ],
            "model_version": min(versions) if versions else None,
            "last_export_version": await _last_export(request.app, model.name),
            "shards": view.num_shards,
        }
        | _replica_info(request.app, model.name)
    )


async def _last_export(app: web.Application, model: str) -> int | None:
    """The newest export version on disk of `model`, from shard 0's exporter (None
    without one, or with none written yet; a replica reports its own)."""
    control = app[CONTROL]
    if control is None:
        return None
    try:
        versions = (await control.exports(None if model == app[MODEL].name else model))["versions"]
    except (NoCoordinatorError, UnknownModelError):
        return None
    return int(versions[-1]["version"]) if versions else None


async def export_now(request: web.Request) -> web.Response:
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica cuts no exports: ask the trainer's API or shard 0")
    # No body is the exporter's schedule, as {} is.
    kind = _decode(_EXPORT, raw).kind if (raw := await request.read()).strip() else None
    return _json(await control.export_now(kind), status=201)


async def compact_exports(request: web.Request) -> web.Response:
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica compacts nothing: ask the trainer's API or shard 0")
    return _json(await control.compact_exports(await _query_model(request)))


async def list_exports(request: web.Request) -> web.Response:
    follower, control = request.app.get(FOLLOWER), request.app[CONTROL]
    if follower is None and control is not None:
        return _json(await control.exports(await _query_model(request)))
    assert follower is not None  # create_app has one or the other
    name = await _query_model(request)
    if name is not None:
        follower = request.app[SERVED].followers[name]
    # A replica lists the versions it follows; the trainer's last report is not its to know.
    found = await asyncio.to_thread(list_versions, follower.model_dir) if follower.model_dir.is_dir() else []
    versions = [v.to_json() for v in found]
    return _json({"model": follower.model.name, "versions": versions, "last": None})


async def _query_model(request: web.Request) -> str | None:
    """The ``model`` query parameter; None for the API's own model (the
    default model of its cluster's shard 0 need not share its name)."""
    _only_query(request, "model")
    name = request.query.get("model")
    if name is not None:
        await request.app[SERVED].model(name)  # 404 unknown_model for a model not served
    return None if name is None or name == request.app[MODEL].name else name


def _only_query(request: web.Request, *allowed: str) -> None:
    """400 for a query parameter the route does not take (a typo must not be ignored)."""
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise BadRequestError(f"unknown query parameters: {', '.join(k[:40] for k in unknown[:5])}")


def _replica_info(app: web.Application, model: str) -> dict[str, Any]:
    """On a serving replica, what it serves of `model` (`Follower.info`); else nothing."""
    follower = app.get(FOLLOWER)
    if follower is None:
        return {}
    return app[SERVED].followers.get(model, follower).info()


async def list_statuses(request: web.Request) -> web.Response:
    return _json({"statuses": await request.app[VIEW].statuses()})


async def report_status(request: web.Request) -> web.Response:
    _require_admin(request)
    body = await _json_body(request)
    # Checked here too, so a replica refuses a bad report as bad_request before read_only_replica.
    check(body, StatusReport, BadRequestError)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError(
            "this server is a read-only replica of its exports: status reports go to the training cluster"
        )
    ack = await control.report_status(body["source"], body["status"])
    return _json(ack)


_EXPORT = msgspec.json.Decoder(ExportRequest)
_CREATE_MODEL = msgspec.json.Decoder(CreateModelRequest)


async def healthz(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


def _note_readiness(app: web.Application, ready: bool, detail: str = "") -> None:
    """One line when readiness changes (a warning when it is lost), none
    while it stays the same."""
    state: list[bool | None] = app[_READINESS]
    if state[0] is ready:
        return
    before, state[0] = state[0], ready
    if ready:
        if before is not None:
            log_event(log, "ready again")
    else:
        log.warning("not ready", extra={"fields": {"detail": detail}})


async def readyz(request: web.Request) -> web.Response:
    try:
        follower = request.app.get(FOLLOWER)
        if follower is not None:
            follower.check_ready()
        view = request.app[VIEW]
        each = await view.stats_each()
        down = [r for r in each if isinstance(r, PSError)]
        if down:
            raise ShardUnavailableError("; ".join(r.detail for r in down))
        # A shard restarted with another id or count refuses every call as
        # wrong_shard: not ready, naming which place holds which shard.
        stats = [r for r in each if isinstance(r, dict)]
        wrong = misplaced(
            [
                (f"place {i}", int(r.get("shard_id", i)), int(r.get("num_shards", len(stats))))
                for i, r in enumerate(stats)
            ]
        )
        if wrong:
            raise ShardOrderError(f"the shards do not match the shard list: {wrong}")
    except PSError as exc:
        _note_readiness(request.app, False, f"{exc.code}: {exc.detail}")
        raise
    _note_readiness(request.app, True)
    return _json({"status": "ready", "shards": view.num_shards})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[METRICS].scrape(request.app[VIEW])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_OPENAPI_BODY], content_type="application/json")


@functools.cache
def _dashboard_page() -> bytes:
    return resources.files("app").joinpath("static", "dashboard.html").read_bytes()


# The page loads nothing but itself and the API's JSON: the browser enforces
# it, so a stray external reference fails visibly instead of phoning out.
_DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


async def dashboard(request: web.Request) -> web.Response:
    return web.Response(body=_dashboard_page(), content_type="text/html", charset="utf-8", headers=_DASHBOARD_HEADERS)


async def history(request: web.Request) -> web.Response:
    _only_query(request, "since", "model")
    raw = request.query.get("since")
    since = None if raw is None else parse_number(raw, "since (seconds since the epoch)", error=BadRequestError)
    h = await request.app[SERVED].history(request.query.get("model"))
    return _json(
        {
            "model": h.model.name,
            "interval_s": h.interval_s,
            "max_points": h.max_points,
            "error": h.error,
            "points": h.points(since),
        }
    )


# -- the application ------------------------------------------------------------


class Sources(TypedDict, total=False):
    """Where an API's weights and cluster view come from (`create_app`'s
    keyword arguments, which `ApiServer` passes on)."""

    control: ControlClient | None
    follower: Follower | None
    followers: Mapping[str, Follower] | None
    discover: Discover | None


def create_app(
    settings: ApiSettings,
    client: PSReader[Any],
    model: Model,
    *,
    control: ControlClient | None = None,
    follower: Follower | None = None,
    followers: Mapping[str, Follower] | None = None,
    discover: Discover | None = None,
    guard: PortGuard | None = None,
) -> web.Application:
    """The API over the shards of `client`, serving `model`: a training
    cluster's with its `control` plane, or a serving replica of `follower`'s
    exports (`client` is then ``follower.client``); one of the two. `guard`
    holds the deadlines of the port it is served on (`ApiServer`'s).

    The caller keeps `client` and `control` (and closes them); the app only
    reads through them. The predictor's batching task and the dashboard's
    sampling task start and stop with the app; so does `follower`'s polling."""
    if (control is None) == (follower is None):
        raise ValueError("the API serves either a training cluster (control) or a replica (follower)")
    app = web.Application(client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    if follower is not None:
        app[FOLLOWER] = follower
        app.cleanup_ctx.append(_follower_ctx)
    app[MODEL] = model
    app[METRICS] = api_metrics = ApiMetrics(model.name)
    app[CONTROL] = control
    if control is not None:
        app[VIEW] = ControlView(control, api_metrics)
    elif follower is not None:
        app[VIEW] = follower.view
    app[CLIENT] = api_metrics.instrument(client)
    app[SERVED] = served = ServedModels(
        model,
        app[CLIENT],
        app[VIEW],
        control,
        on_batch=api_metrics.on_batch,
        history_interval_s=settings.history_interval_s,
        history_points=settings.history_points,
        metrics=api_metrics,
        followers=followers if follower is not None else None,
        discover=discover if follower is not None else None,
    )
    # The API's own model's, kept under their keys (tests replace the history before start).
    app[PREDICTOR] = served.predictors[model.name]
    app[HISTORY] = served.histories[model.name]
    app[_PREDICT] = predict_decoder(settings.max_events)
    app[OPENAPI] = openapi_document(settings.max_events, replica=follower is not None)
    app[_OPENAPI_BODY] = orjson.dumps(app[OPENAPI])
    app[_ERROR_LOG] = {}
    app[_READINESS] = [None]
    app.cleanup_ctx.append(_served_ctx)
    # Each path's methods; any other method is 405, any other path 404
    # (JSON, as every error: `_answering`).
    routes: dict[str, dict[str, Handler]] = {
        "/": {"GET": dashboard},
        "/v1/history": {"GET": history},
        "/v1/predict": {"POST": predict},
        "/v1/models": {"GET": list_models, "POST": create_model},
        "/v1/models/{name}": {"DELETE": delete_model},
        "/v1/models/{name}/predict": {"POST": model_predict},
        "/v1/weights": {"POST": weights},
        "/v1/model": {"GET": model_info},
        "/v1/status": {"GET": list_statuses, "POST": report_status},
        "/v1/exports": {"GET": list_exports, "POST": export_now},
        "/v1/exports/compact": {"POST": compact_exports},
        "/healthz": {"GET": healthz},
        "/readyz": {"GET": readyz},
        "/metrics": {"GET": metrics},
        "/openapi.json": {"GET": openapi},
    }
    for path, methods in routes.items():
        head = {"HEAD": methods["GET"]} if "GET" in methods else {}
        for method, handler in {**methods, **head, "*": _not_allowed}.items():
            app.router.add_route(method, path, _answering(handler, path, guard, api_metrics.count_request))
    app.router.add_route("*", "/{path:.*}", _answering(_not_found, "unmatched", guard, api_metrics.count_request))
    return app


async def _follower_ctx(app: web.Application) -> Any:
    async with app[FOLLOWER]:
        yield


async def _served_ctx(app: web.Application) -> Any:
    served, name = app[SERVED], app[MODEL].name
    served.predictors[name], served.histories[name] = app[PREDICTOR], app[HISTORY]
    async with served:
        yield


class ApiServer:
    """The API on a TCP socket: ``async with ApiServer(...) as server`` (or
    ``await start()`` / ``await stop()``, idempotent); `url` once started."""

    def __init__(
        self,
        settings: ApiSettings,
        client: PSReader[Any],
        model: Model,
        *,
        ssl_context: ssl.SSLContext | None = None,
        **sources: Unpack[Sources],
    ) -> None:
        """`create_app`'s arguments; `ssl_context`, a server context
        (`ps_core.net.tls.server_context`): serve HTTPS."""
        self.settings = settings
        self.ssl_context = ssl_context
        self.guard = PortGuard("api", settings.limits)
        """The port's limits and counters (connections, deadlines)."""
        self.app = create_app(settings, client, model, guard=self.guard, **sources)
        self.handshakes = HandshakeFailures()
        """The port's refused TLS handshakes, by reason."""
        if ssl_context is not None:
            watch_handshakes(ssl_context, self.handshakes)
        self.app[METRICS].watch_port(lambda: {"http": self.guard.stats(), "tls": self.handshakes.stats()})
        self._runner: web.AppRunner | None = None
        self._served: ServedPort | None = None
        self.url = ""
        """``http(s)://host:port`` with the port actually bound (``--port 0``)."""

    async def start(self) -> str:
        """Listen; returns the URL. Refuses (`SettingsError`) a non-loopback
        host with the admin routes open, unless ``insecure``."""
        if self._runner is not None:
            return self.url
        self.settings.check_exposed()
        runner = web.AppRunner(self.app, access_log=None, handle_signals=False, **self.settings.limits.runner_kwargs())
        await runner.setup()
        self._runner = runner
        try:
            self._served = await serve_limited(
                runner, self.guard, self.settings.host, self.settings.port, ssl_context=self.ssl_context
            )
        except BaseException:
            self._runner = None
            await runner.cleanup()
            raise
        scheme = "https" if self.ssl_context is not None else "http"
        self.url = f"{scheme}://{self.settings.host}:{self._served.port}"
        return self.url

    async def stop(self) -> None:
        """Stop listening and release the app's resources."""
        runner, self._runner = self._runner, None
        served, self._served = self._served, None
        if served is not None:
            await served.close()
        elif runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> ApiServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def run_api(
    settings: ApiSettings,
    client: PSReader[Any],
    model: Model,
    stop: asyncio.Event,
    *,
    control: ControlClient | None = None,
    follower: Follower | None = None,
    followers: Mapping[str, Follower] | None = None,
    discover: Discover | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> None:
    """Serve the API until `stop` is set, logging where it listens (a
    serving replica of `follower`'s exports when given; HTTPS with `ssl_context`)."""
    async with ApiServer(
        settings,
        client,
        model,
        control=control,
        follower=follower,
        followers=followers,
        discover=discover,
        ssl_context=ssl_context,
    ) as server:
        log_event(
            log,
            "listening",
            url=server.url,
            model=model.name,
            shards=client.num_shards,
            follow=None if follower is None else str(follower.path),
            also_follows=",".join(sorted(followers or {})) or "-",
            max_events=settings.max_events,
            admin_token="set" if settings.admin_token else "none",
        )
        if not settings.admin_token and not is_loopback(settings.host):
            # Only with --insecure: `start` refuses this otherwise.
            log.warning(
                "admin routes are open (--insecure): set CTRPS_ADMIN_TOKEN",
                extra={"fields": {"host": settings.host}},
            )
        await stop.wait()
    log_event(log, "stopped", url=server.url)
