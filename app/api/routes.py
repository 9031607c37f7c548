"""The API's route handlers, one coroutine per route and method (`app.api`
maps the paths to them): predictions and weights, the models, model
information, the status board, exports, health, readiness, metrics, the
OpenAPI document and the dashboard. Each reads the app's state
(`app.api.state`) and raises typed errors; `app.api.answers.answering`
maps those to replies."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from importlib import resources
from typing import Any

import msgspec
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from ps_core.bodies import check
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import (
    InvalidRequestError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    TableConfigError,
)
from ps_core.model.models import make_model
from ps_core.net.control_messages import ExportRequest, StatusBoardBody
from ps_core.parsing import parse_number
from ps_core.store.board import StatusReport

from ..logs import log_event
from ..startup import misplaced
from ..status import summarize
from .answers import decode_body, json_body, json_reply, raw_body
from .errors import (
    BadRequestError,
    BodyNotJSONError,
    NoEventsError,
    ReadOnlyReplicaError,
    ShardOrderError,
    TooManyEventsError,
    UnauthorizedError,
    UnknownModelError,
)
from .payloads import WEIGHTS, CreateModelRequest, PredictRequest
from .predictor import Predictor
from .state import (
    CONTROL,
    FOLLOWER,
    METRICS,
    MODEL,
    OPENAPI_BODY,
    PREDICT_DECODER,
    PREDICTOR,
    READINESS,
    SERVED,
    SETTINGS,
    VIEW,
)
from .views import all_stats

log = logging.getLogger("ctrps.api")


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
        body: PredictRequest = decode_body(decoder, raw)
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
    return json_reply({"default": request.app[MODEL].name, "models": await request.app[SERVED].listing()})


async def create_model(request: web.Request) -> web.Response:
    """``POST /v1/models`` (admin): create a model on the cluster."""
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica creates no models: ask the trainer's API or shard 0")
    body = decode_body(_CREATE_MODEL, await raw_body(request))
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
        out = await control.create_model(ModelSpec.of(model).declaration())
    except ValueError as exc:
        raise BadRequestError(str(exc)) from None
    except (InvalidRequestError, TableConfigError) as exc:
        raise BadRequestError(exc.detail) from None
    return json_reply(out, status=201 if out.created else 200)


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
    return json_reply(await control.delete_model(request.match_info["name"]))


async def model_predict(request: web.Request) -> web.Response:
    """``POST /v1/models/{name}/predict``: `predict` of model `name`."""
    return await predict(request, request.match_info["name"])


async def predict(request: web.Request, path_model: str | None = None) -> web.Response:
    t0 = time.perf_counter()
    app = request.app
    raw = await raw_body(request)
    try:
        body = _predict_body(app[PREDICT_DECODER], raw)
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
    resp = json_reply({"predictions": result.probabilities, "model": name, "model_version": result.version})
    app[METRICS].predicted(name, len(events), time.perf_counter() - t0)
    return resp


async def weights(request: web.Request) -> web.Response:
    body = decode_body(WEIGHTS, await raw_body(request))
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
    return json_reply(
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
    return json_reply(
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
        versions = (await control.exports(None if model == app[MODEL].name else model)).versions
    except (NoCoordinatorError, UnknownModelError):
        return None
    return versions[-1].version if versions else None


async def export_now(request: web.Request) -> web.Response:
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica cuts no exports: ask the trainer's API or shard 0")
    # No body is the exporter's schedule, as {} is.
    kind = decode_body(_EXPORT, raw).kind if (raw := await request.read()).strip() else None
    return json_reply(await control.export_now(kind), status=201)


async def compact_exports(request: web.Request) -> web.Response:
    _require_admin(request)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError("a serving replica compacts nothing: ask the trainer's API or shard 0")
    return json_reply(await control.compact_exports(await _query_model(request)))


async def list_exports(request: web.Request) -> web.Response:
    follower, control = request.app.get(FOLLOWER), request.app[CONTROL]
    if follower is None and control is not None:
        return json_reply(await control.exports(await _query_model(request)))
    assert follower is not None  # create_app has one or the other
    name = await _query_model(request)
    if name is not None:
        follower = request.app[SERVED].followers[name]
    # A replica lists the versions it follows; the trainer's last report is not its to know.
    found = await asyncio.to_thread(follower.versions)
    versions = [v.to_json() for v in found]
    return json_reply({"model": follower.model.name, "versions": versions, "last": None})


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
    return json_reply(StatusBoardBody(await request.app[VIEW].statuses()))


async def report_status(request: web.Request) -> web.Response:
    _require_admin(request)
    body = await json_body(request)
    # Checked here too, so a replica refuses a bad report as bad_request before read_only_replica.
    report: StatusReport = check(body, StatusReport, BadRequestError)
    control = request.app[CONTROL]
    if control is None:
        raise ReadOnlyReplicaError(
            "this server is a read-only replica of its exports: status reports go to the training cluster"
        )
    ack = await control.report_status(report.source, report.status)
    return json_reply(ack)


_EXPORT = msgspec.json.Decoder(ExportRequest)
_CREATE_MODEL = msgspec.json.Decoder(CreateModelRequest)


async def healthz(request: web.Request) -> web.Response:
    return json_reply({"status": "ok"})


def _note_readiness(app: web.Application, ready: bool, detail: str = "") -> None:
    """One line when readiness changes (a warning when it is lost), none
    while it stays the same."""
    state: list[bool | None] = app[READINESS]
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
        # moved: not ready, naming which place holds which shard.
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
    return json_reply({"status": "ready", "shards": view.num_shards})


async def metrics(request: web.Request) -> web.Response:
    body = await request.app[METRICS].scrape(request.app[VIEW])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(request: web.Request) -> web.Response:
    return web.Response(body=request.app[OPENAPI_BODY], content_type="application/json")


@functools.cache
def _dashboard_page() -> bytes:
    return resources.files("app.api").joinpath("static", "dashboard.html").read_bytes()


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
    return json_reply(
        {
            "model": h.model.name,
            "interval_s": h.interval_s,
            "max_points": h.max_points,
            "error": h.error,
            "points": h.points(since),
        }
    )
