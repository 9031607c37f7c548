"""The serve role: the HTTP API alone, reading weights from shard servers or,
as a serving replica, from a model's exports in memory, until signalled."""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections.abc import Collection
from pathlib import Path

from consumers.outage import StartupWatch
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.export_files import list_versions
from ps_core.checkpoint.exportstore import ExportStore, ExportStoreError, StoredModel, model_at, store_for
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import NoCoordinatorError, PSError, UnknownModelError
from ps_core.model.models import Model, make_model
from ps_core.net.auth import Scope
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy

from ..api.follower import Follower, follow_dir, followed_models, model_of_exports
from ..api.server import run_api
from ..config.serve import ApiSettings
from ..security import SecuritySettings
from ..signals import stop_on_signals
from ..startup import await_path, check_shards, unless_stopped

__all__ = ["run_serve", "as_declared"]

log = logging.getLogger("ctrps.api")


async def as_declared(control: ControlClient, model: Model) -> Model:
    """`model` as its cluster declared it (type, optimizers, numeric
    handling), so the API hashes events as the workers do; `model` itself
    when the cluster keeps no declaration of it. Shards not answering yet:
    one line, and the flags' model."""
    try:
        info = await control.model_info(model.name)
    except (UnknownModelError, NoCoordinatorError):
        return model
    except PSError as exc:
        log.warning(
            "model declaration not read: serving the flags' model",
            extra={"fields": {"model": model.name, "numeric": model.numeric, "error": exc.detail}},
        )
        return model
    if info.type is None:
        return model
    return ModelSpec.from_entry(info).build()


async def run_serve(
    settings: ApiSettings, stop: asyncio.Event | None = None, *, security: SecuritySettings | None = None
) -> None:
    """Serve the API over the shards at ``settings.shards`` until SIGTERM/SIGINT
    (or `stop`). A shard call is retried for ``settings.shard_deadline_s``,
    then the request gets 503 naming the shard. With ``settings.follow``,
    serve that export directory instead (`Follower`; an exports root means
    its ``<model_name>/``): the model is the newest manifest's, or the
    settings' while the directory holds no version. The shards (each in
    its place), or the directory, must answer (exist) within
    ``settings.startup_timeout_s`` (`app.startup`), else exit 1. Refuses (`SettingsError`)
    a non-loopback host without an admin token unless ``settings.insecure``.

    `security`: the API listens over TLS when given a certificate and key,
    and presents its shard token (the admin scope's when it holds the
    secret: its admin routes reach shard 0's exports) to ``https://``
    shards verified against its CA."""
    # Before anything connects or loads: an exposed API with open admin routes never starts.
    settings.check_exposed()
    stop = stop or asyncio.Event()
    security = security or SecuritySettings()
    served = security.server_tls()
    tls = security.client_tls()
    model = make_model(settings.model, settings.model_name, numeric=settings.numeric)
    with stop_on_signals(stop):
        if settings.follows_store():
            await _serve_store(settings, model, stop, served)
            return
        if settings.follow:
            path = Path(settings.follow)
            exists = StartupWatch(
                settings.startup_timeout_s, "--startup-timeout", log, awaited="exist", absent="does not exist"
            )
            if not await unless_stopped(stop, lambda: await_path(path, exists)):
                return
            model_dir = await asyncio.to_thread(follow_dir, path, settings.model_name)
            model = await asyncio.to_thread(model_of_exports, model_dir, model)
            await _serve_following(
                settings, Follower(path, model, interval_s=settings.follow_interval_s), path, stop, served
            )
            return
        watch = StartupWatch(settings.startup_timeout_s, "--startup-timeout", log)
        if not await unless_stopped(stop, lambda: check_shards(settings.shards, watch, ssl=tls)):
            return
        retry = RetryPolicy(deadline_s=settings.shard_deadline_s)
        token = security.token_for(Scope.ADMIN)
        async with (
            PSClient.connect(settings.shards, retry=retry, rpc=settings.use_rpc, token=token, ssl=tls) as client,
            ControlClient.connect(settings.shards, retry=retry, token=token, ssl=tls) as control,
        ):
            client.slot_source = control.slot_map  # where keys go after a shard answers `moved`
            model = await as_declared(control, model)
            await run_api(settings, client, model, stop, control=control, ssl_context=served)


async def _serve_store(settings: ApiSettings, model: Model, stop: asyncio.Event, served: ssl.SSLContext | None) -> None:
    """Serve a model of a bucket (``--follow s3://bucket/prefix/<model>``),
    or with ``--follow-all`` every model under its root, `model`'s name the
    default (`_serve_following`). A bucket that does not answer at start is
    one warning; the followers report it at each poll until it does."""
    if settings.follow_all:
        store = store_for(settings.follow)
        stored = StoredModel(store, model.name)
    else:
        found = model_at(settings.follow)
        assert isinstance(found, StoredModel)  # the settings checked the URL
        store, stored = found.store, found
    model = await asyncio.to_thread(_stored_model, stored, model)
    await _serve_following(
        settings, Follower(stored, model, interval_s=settings.follow_interval_s), store, stop, served
    )


async def _serve_following(
    settings: ApiSettings,
    follower: Follower,
    root: Path | ExportStore,
    stop: asyncio.Event,
    served: ssl.SSLContext | None,
) -> None:
    """The API over `follower`, and with ``--follow-all`` over every other
    model of the exports `root` (a directory or a bucket), each its own
    follower; models created later are found when a request names one or
    lists them. A bucket that does not answer at start is one warning: its
    other models are looked for again when asked."""
    others: dict[str, Follower] = {}
    discover = None
    if settings.follow_all:
        discover = functools.partial(new_followers, root, settings)
        try:
            others = await asyncio.to_thread(discover, {follower.model.name})
        except ExportStoreError as exc:
            log.warning(
                "export store unreachable at start: its other models are looked for again when asked",
                extra={"fields": {"follow": settings.follow, "error": str(exc)}},
            )
    async with follower.client as client:
        await run_api(
            settings,
            client,
            follower.model,
            stop,
            follower=follower,
            followers=others,
            discover=discover,
            ssl_context=served,
        )


def _stored_model(stored: StoredModel, default: Model) -> Model:
    """`model_of_exports` of a store's model; the flags' model, with one
    warning, when the store does not answer (the follower then reports the
    outage at each poll until it does)."""
    try:
        return model_of_exports(stored, default)
    except ExportStoreError as exc:
        log.warning(
            "export store unreachable at start: serving the flags' model",
            extra={"fields": {"follow": str(stored), "model": default.name, "error": str(exc)}},
        )
        return default


def new_followers(root: Path | ExportStore, settings: ApiSettings, known: Collection[str]) -> dict[str, Follower]:
    """A follower for each model under the exports `root` (a directory or a
    bucket) whose name is not in `known` and that holds a version
    (``--follow-all``), its model as its newest manifest declares it
    (blocking: reads the directory or the bucket, and the manifests)."""
    out: dict[str, Follower] = {}
    for name, mdir in followed_models(root, settings.model_name).items():
        # A model is followed from its first version: its manifest says what
        # it is (a model created and not yet cut is found on a later look).
        if name not in known and list_versions(mdir):
            other = model_of_exports(mdir, make_model(settings.model, name))
            out[name] = Follower(mdir, other, interval_s=settings.follow_interval_s)
    return out
