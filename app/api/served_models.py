"""The models an API serves: its own, and every other model of its cluster.

An API started for one model (``--model-name``, the default one) serves the
others its training cluster holds as well (`ps_core.checkpoint.registry`):
a request naming one the API has not met yet looks it up on shard 0 once,
builds its model from the declaration and starts a `Predictor` for it. The
dashboard's `History` of every model of the cluster (declared on shard 0, or
named by a worker on the status board; a replica's: every model it follows)
is sampled from the start, whether or not anyone asked for it: a watch task
looks for new models every `watch_every` seconds, up to `MAX_SAMPLED_MODELS`. A name the cluster does not hold is 404
``unknown_model``, and is not looked up again for a second, so a client
looping on a wrong name costs shard 0 one call a second. A serving replica
serves the model it follows, and with ``--follow-all`` every model of the
exports root, each read from its own `Follower`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.manifest import check_model_name
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import InvalidRequestError, NoCoordinatorError, PSError, UnknownModelError
from ps_core.model.models import Model
from ps_core.net.client import PSReader

from ..background import BackgroundLoop
from ..metrics import ApiMetrics
from .history import History, board_models
from .predictor import Predictor
from .views import ClusterView

if TYPE_CHECKING:
    from .follower import Follower

__all__ = ["ServedModels"]

LOOKUP_EVERY_S = 1.0
"""A name the cluster does not hold is asked again at most this often."""
MAX_REMEMBERED_MISSES = 1024
MAX_SAMPLED_MODELS = 32
"""Models the dashboard samples at most (each keeps up to ``history_points``
points): beyond, a model's history starts when a request names it."""

log = logging.getLogger("ctrps.api")

Discover = Callable[[Collection[str]], "dict[str, Follower]"]
"""A replica's look for models under its exports root (``--follow-all``):
given the names it follows, a follower for each model directory with a
version it does not follow (run in a thread: it reads the directory and each
new model's newest manifest)."""


class ServedModels:
    """The API's predictors (and dashboard histories), one per model served."""

    def __init__(
        self,
        default: Model,
        client: PSReader[Any],
        view: ClusterView,
        control: ControlClient | None,
        *,
        on_batch: Callable[[int, int], None] | None = None,
        history_interval_s: float = 5.0,
        history_points: int = 720,
        metrics: ApiMetrics | None = None,
        followers: Mapping[str, Follower] | None = None,
        discover: Discover | None = None,
    ) -> None:
        """`control` None: a replica, serving `default` and the models of
        `followers` (each read from its follower, which this object starts
        and stops), and with `discover` those created later under its root,
        looked for when a request names a model it does not follow or lists
        them (at most once a second); `metrics`: the API's, whose predict
        latency each model's history charts (None: none)."""
        self.default = default
        self._client, self._view, self._control = client, view, control
        self.followers: dict[str, Follower] = dict(followers or {})
        """Other models a replica follows, by name."""
        self._stack = contextlib.AsyncExitStack()
        self._on_batch = on_batch
        self._metrics = metrics
        self._history_args = (history_interval_s, history_points)
        self.predictors: dict[str, Predictor] = {default.name: Predictor(client, default, on_batch=on_batch)}
        self.histories: dict[str, History] = {default.name: self._history(default)}
        self._missed: dict[str, float] = {}
        self._started = False
        self._discover_fn = discover
        self._looked_at = -LOOKUP_EVERY_S
        self._watch = _ModelWatch(self, min(10.0, 5 * history_interval_s))
        self._watch_cause: tuple[str, str | None] | None = None
        """What the last failed look for models was logged by (None: the last look worked)."""

    def view_of(self, name: str) -> ClusterView:
        """Where model `name`'s stats and board are read (a followed model: its follower's)."""
        follower = self.followers.get(name)
        return self._view if follower is None else follower.view

    def _history(self, model: Model) -> History:
        interval_s, points = self._history_args
        latency = None if self._metrics is None else functools.partial(self._metrics.predict_latency, model.name)
        view = self.view_of(model.name)
        return History(view, model, interval_s=interval_s, max_points=points, predict_latency=latency)

    async def __aenter__(self) -> ServedModels:
        for follower in self.followers.values():
            await self._stack.enter_async_context(follower)
        for p in self.predictors.values():
            await p.start()
        for h in self.histories.values():
            await h.start()
        self._started = True
        await self._watch.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._started = False
        await self._watch.stop()
        for p in self.predictors.values():
            await p.stop()
        for h in self.histories.values():
            await h.stop()
        await self._stack.aclose()

    def served_name(self, name: str | None) -> str:
        return self.default.name if name is None else name

    async def model(self, name: str | None) -> Model:
        """Model `name` (None: the default one); `UnknownModelError` when
        neither this API nor its cluster holds it."""
        return (await self.predictor(name)).model

    async def predictor(self, name: str | None) -> Predictor:
        """The predictor of model `name` (None: the default one), started on first use."""
        if name is None:
            return self.predictors[self.default.name]
        found = self.predictors.get(name)
        if found is not None:
            return found
        model = await self._look_up(name)
        found = self.predictors.get(name)  # another request may have looked it up meanwhile
        if found is None:
            follower = self.followers.get(name)
            client = self._client if follower is None else follower.client
            found = self.predictors[name] = Predictor(client, model, on_batch=self._on_batch)
            history = self.histories.get(name)  # the watch's, already sampling
            if history is None:
                history = self.histories[name] = self._history(model)
                if self._started:
                    await history.start()
            if self._started:
                await found.start()
        return found

    async def history(self, name: str | None) -> History:
        """The dashboard history of model `name` (None: the default one)."""
        await self.predictor(name)
        return self.histories[self.served_name(name)]

    async def watch_models(self) -> None:
        """Start a history for every model of the cluster not sampled yet (one
        step of the watch task). A look that fails is logged once per cause."""
        try:
            names = await self._cluster_models()
        except PSError as exc:
            self.watch_failed(f"{exc.code}: {exc.detail}", cause=(exc.code, getattr(exc, "url", None)))
            return
        self._watch_cause = None
        for name in sorted(names - self.histories.keys()):
            if len(self.histories) >= MAX_SAMPLED_MODELS:
                return
            try:
                model = self.predictors[name].model if name in self.predictors else await self._look_up(name)
            except UnknownModelError:  # named on the board, never created
                continue
            if name not in self.histories:  # a request may have started it meanwhile
                history = self.histories[name] = self._history(model)
                if self._started:
                    await history.start()

    def watch_failed(self, error: str, cause: tuple[str, str | None] | None = None) -> None:
        """Log why a look for models failed, once per cause (the histories
        already sampled go on). `cause` (by default the text) is what tells
        one cause from another: a shard's unavailability reads differently
        at every look (how long, how many attempts)."""
        cause = (error, None) if cause is None else cause
        if cause != self._watch_cause:
            log.warning("looking for models to sample failed", extra={"fields": {"error": error}})
        self._watch_cause = cause

    async def _cluster_models(self) -> set[str]:
        if self._control is None:
            await self._discover()
            return set(self.followers)
        named = board_models(await self._control.statuses())
        with contextlib.suppress(NoCoordinatorError):  # a shard 0 that keeps no models
            declared = await self._control.models()
            named |= {m.name for m in declared.models if m.type is not None}
        return named

    def _unknown(self, name: str, why: str = "") -> UnknownModelError:
        served = ", ".join(sorted(self.predictors))
        return UnknownModelError(f"model {name[:80]!r} is not served here{why}; serving: {served}")

    async def _look_up(self, name: str) -> Model:
        if self._control is None:
            follower = self.followers.get(name)
            if follower is None and await self._discover():
                follower = self.followers.get(name)
            if follower is None:
                raise self._unknown(name, " (a replica serves the models it follows)")
            return follower.model
        try:
            check_model_name(name)
        except ValueError:
            raise self._unknown(name) from None
        now = time.monotonic()
        if now - self._missed.get(name, -LOOKUP_EVERY_S) < LOOKUP_EVERY_S:
            raise self._unknown(name)
        try:
            info = await self._control.model_info(name)
            if info.type is None:
                raise UnknownModelError(f"model {name} holds tables but was never created")
            return ModelSpec.from_entry(info).build()
        except (UnknownModelError, NoCoordinatorError, InvalidRequestError):
            if len(self._missed) >= MAX_REMEMBERED_MISSES:
                self._missed.pop(next(iter(self._missed)))
            self._missed[name] = now
            raise self._unknown(name) from None

    async def _discover(self) -> bool:
        """``--follow-all``: follow the models created under the root since
        the last look, at most once a second; whether any was added. A look
        that fails is one log line; the models followed stay served."""
        find = self._discover_fn
        now = time.monotonic()
        if find is None or now - self._looked_at < LOOKUP_EVERY_S:
            return False
        self._looked_at = now
        try:
            found = await asyncio.to_thread(find, {self.default.name, *self.followers})
        except Exception as exc:  # an unreadable root or model directory
            log.warning("looking for new models failed", extra={"fields": {"error": f"{type(exc).__name__}: {exc}"}})
            return False
        for name, follower in found.items():
            if name in self.followers:  # found by a look that overlapped
                continue
            if self._started:
                await self._stack.enter_async_context(follower)
            self.followers[name] = follower
            log.info("following a new model", extra={"fields": {"model": name, "path": str(follower.path)}})
        return bool(found)

    async def listing(self) -> list[dict[str, Any]]:
        """Every model served, as ``GET /v1/models`` lists them: the cluster's
        (when it keeps models) with the default one first."""
        if self._control is None:
            await self._discover()
        names = [self.default.name, *sorted(n for n in self.followers if n != self.default.name)]
        declared: dict[str, dict[str, Any]] = {n: _entry(f.model) for n, f in self.followers.items()}
        if self._control is not None:
            with contextlib.suppress(NoCoordinatorError):
                got = await self._control.models()
                for m in got.models:
                    if m.type is not None or m.name == self.default.name:
                        declared[m.name] = msgspec.to_builtins(m)
                names += sorted(n for n in declared if n != self.default.name)
        out = []
        for n in names:
            model = self.predictors[n].model if n in self.predictors else None
            info = declared.get(n)
            out.append(
                {
                    "name": n,
                    "type": model.kind if model is not None else info.get("type") if info else None,
                    "tables": list(model.table_names)
                    if model is not None
                    else [t["name"] for t in info["tables"]]
                    if info
                    else [],
                    "update_mode": model.mode if model is not None else info.get("update_mode") if info else None,
                    "predict": f"/v1/models/{n}/predict",
                    "default": n == self.default.name,
                }
            )
        return out


class _ModelWatch(BackgroundLoop):
    """`ServedModels.watch_models` every `every_s` seconds."""

    task_name = "ctrps-model-watch"

    def __init__(self, served: ServedModels, every_s: float) -> None:
        self.served, self.every_s = served, every_s

    async def _run(self) -> None:
        while True:
            try:
                await self.served.watch_models()
            except Exception as exc:  # a bug: logged once, the histories sampled meanwhile
                self.served.watch_failed(f"{type(exc).__name__}: {exc}"[:500])
            await asyncio.sleep(self.every_s)


def _entry(model: Model) -> dict[str, Any]:
    return {
        "name": model.name,
        "type": model.kind,
        "tables": [t.to_dict() for t in model.tables()],
        "update_mode": model.mode,
    }
