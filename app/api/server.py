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
- ``GET /`` the dashboard, drawing ``GET /v1/history`` (`app.api.history`);
- ``GET /healthz``, ``GET /readyz``, ``GET /metrics``, ``GET /openapi.json``.

With a `Follower` (``ctrps serve --follow``) the app is a serving replica:
the client reads the follower's in-process shard, ``GET /v1/model`` adds the
served version and the follow state, ``/readyz`` waits for a loaded version,
and mutating routes answer 409 ``read_only_replica``.

Errors are ``{"error": code, "detail": reason}``, mapped from typed errors
(`app.api.errors`, `ps_core.errors`) in one place, the wrapper of every route;
handlers do not catch.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping
from typing import Any, TypedDict, Unpack

import orjson
from aiohttp import web

from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import Model
from ps_core.net.client import PSReader
from ps_core.net.limits import PortGuard, ServedPort, serve_limited
from ps_core.net.tls import HandshakeFailures, watch_handshakes

from ..config.serve import ApiSettings
from ..logs import log_event
from ..metrics import ApiMetrics
from ..security import is_loopback
from .answers import Handler, answering, not_allowed, not_found
from .follower import Follower
from .openapi import openapi_document
from .payloads import predict_decoder
from .routes import (
    compact_exports,
    create_model,
    dashboard,
    delete_model,
    export_now,
    healthz,
    history,
    list_exports,
    list_models,
    list_statuses,
    metrics,
    model_info,
    model_predict,
    openapi,
    predict,
    readyz,
    report_status,
    weights,
)
from .served_models import Discover, ServedModels
from .state import (
    CLIENT,
    CONTROL,
    ERROR_LOG,
    FOLLOWER,
    HISTORY,
    METRICS,
    MODEL,
    OPENAPI,
    OPENAPI_BODY,
    PREDICT_DECODER,
    PREDICTOR,
    READINESS,
    SERVED,
    SETTINGS,
    VIEW,
)
from .views import ControlView

__all__ = ["create_app", "ApiServer", "run_api", "Sources"]

log = logging.getLogger("ctrps.api")

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
    app[PREDICT_DECODER] = predict_decoder(settings.max_events)
    app[OPENAPI] = openapi_document(settings.max_events, replica=follower is not None)
    app[OPENAPI_BODY] = orjson.dumps(app[OPENAPI])
    app[ERROR_LOG] = {}
    app[READINESS] = [None]
    app.cleanup_ctx.append(_served_ctx)
    # Each path's methods; any other method is 405, any other path 404
    # (JSON, as every error: `answering`).
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
        for method, handler in {**methods, **head, "*": not_allowed}.items():
            app.router.add_route(method, path, answering(handler, path, guard, api_metrics.count_request))
    app.router.add_route("*", "/{path:.*}", answering(not_found, "unmatched", guard, api_metrics.count_request))
    return app


async def _follower_ctx(app: web.Application) -> Any:
    follower, served, name = app[FOLLOWER], app[SERVED], app[MODEL].name
    # Every model followed: the API's own and those of --follow-all, found later too.
    app[METRICS].watch_replica(
        lambda: {name: follower.read_failures} | {n: f.read_failures for n, f in served.followers.items()}
    )
    async with follower:
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
