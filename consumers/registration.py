"""A worker's models on the cluster: their tables declared on the shards,
and each model created in the coordinator's registry, or its declaration
taken from there (a model created with ``ctrps model create`` trains with
the optimizer it was created with)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import ModeConflictError, ModelConflictError, NoCoordinatorError, UnknownModelError
from ps_core.model.models import Model

__all__ = ["Registration"]

log = logging.getLogger("ctrps.worker")


class Registration:
    """Registers a worker's models (its own first, then those trained beside
    it) through `control`; `key` is its own model's name as the coordinator
    keeps it once registered."""

    def __init__(self, control: ControlClient) -> None:
        self.control = control
        self.key: str | None = None
        """The model's name as the coordinator keeps it (None: not yet, or a
        coordinator without a model registry, which keeps one model's offsets)."""

    async def declare(self, models: Sequence[Model]) -> None:
        """Declare every table of `models` on the shards (again, for a shard that restarted)."""
        for model in models:
            for t in model.tables():
                await self.control.declare(t)

    async def register(self, models: Sequence[Model]) -> list[Model]:
        """Declare the models' tables and create each on the cluster, or take
        its declaration from there; returns the models as the cluster has
        them (the same objects where nothing changed). Another type of the
        first model, or another update mode of any, is `ModelConflictError`
        or `ModeConflictError` (one line, exit 1). A shard 0 without an
        exporter keeps no models: the tables are declared as given."""
        own, *beside = models
        try:
            own = await self.adopt(own, strict_type=True)
        except NoCoordinatorError:
            await self.declare(models)
            return list(models)
        adopted = [own, *[await self.adopt(m, strict_type=False) for m in beside]]
        await self.declare(adopted)
        for model in adopted:
            got = await self.control.create_model(ModelSpec.of(model).declaration())
            if got.created:
                log.info("model created", extra={"fields": {"model": model.name, "type": model.kind}})
        self.key = own.name
        return adopted

    async def adopt(self, model: Model, *, strict_type: bool) -> Model:
        """`model` as the cluster created it (its declaration), or `model`
        itself when nobody created it yet. Another update mode is
        `ModeConflictError`; with `strict_type`, another type is
        `ModelConflictError` (a model trained beside the worker's own takes
        the type it was created with)."""
        try:
            info = await self.control.model_info(model.name)
        except UnknownModelError:
            return model
        if info.type is None:
            return model
        spec = ModelSpec.from_entry(info)
        if strict_type and spec.kind != model.kind:
            raise ModelConflictError(
                f"model {model.name} was created as {spec.kind}; this worker was started with --model {model.kind}"
            )
        if spec.mode != model.mode:
            raise ModeConflictError(
                f"model {model.name} is updated in mode {spec.mode}; this worker was started with --mode "
                f"{model.mode}: every worker of a model runs its mode"
            )
        if ModelSpec.of(model) == spec:
            return model
        log.info(
            "model declaration taken from the cluster",
            extra={"fields": {"model": model.name, "tables": ",".join(t.name for t in spec.tables)}},
        )
        return spec.build()
