"""A worker's models on the cluster (`consumers.registration`), against real
shards, a real coordinator and exporter, in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumers.registration import Registration
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import ModeConflictError, ModelConflictError
from ps_core.model.models import FactorizationMachine, LogisticRegression
from ps_core.shard import Shard, ShardSpec


def _cluster(tmp_path: Path) -> tuple[list[Shard], ControlClient, Exporter]:
    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    coordinator = Coordinator()
    control = ControlClient.local(shards, coordinator)
    exporter = Exporter(coordinator, control, tmp_path / "exports", "m")
    control.serve_exports(exporter)
    return shards, control, exporter


async def test_without_a_registry_the_tables_are_declared_as_given() -> None:
    shards = [Shard(ShardSpec(0, 1))]
    own, beside = LogisticRegression("m"), FactorizationMachine("other")
    registration = Registration(ControlClient.local(shards))
    got = await registration.register([own, beside])
    assert got[0] is own and got[1] is beside and registration.key is None
    assert {"m_w", "other_w", "other_v"} <= set(shards[0].tables)


async def test_models_are_created_once_and_taken_as_created(tmp_path: Path) -> None:
    shards, control, exporter = _cluster(tmp_path)
    first = Registration(control)
    own = LogisticRegression("m")
    assert (await first.register([own]))[0] is own and first.key == "m"
    assert (await control.model_info("m")).type == own.kind
    # Created with another optimizer: a worker started with the defaults trains as created.
    assert await exporter.create_model(ModelSpec.of(LogisticRegression("n", optimizer={"name": "sgd", "lr": 0.1})))
    adopted = await Registration(control).adopt(LogisticRegression("n"), strict_type=True)
    assert ModelSpec.of(adopted) == ModelSpec.from_entry(await control.model_info("n"))
    assert ModelSpec.of(adopted) != ModelSpec.of(LogisticRegression("n"))


async def test_another_type_or_mode_than_created_is_refused(tmp_path: Path) -> None:
    _, control, _ = _cluster(tmp_path)
    await Registration(control).register([LogisticRegression("m")])
    with pytest.raises(ModelConflictError, match="was created as lr"):
        await Registration(control).register([FactorizationMachine("m")])
    with pytest.raises(ModeConflictError, match="updated in mode async"):
        await Registration(control).register([LogisticRegression("m", mode="geo")])
    # Beside the worker's own model, another type is taken as created.
    got = await Registration(control).register([LogisticRegression("x"), FactorizationMachine("m")])
    assert got[1].kind == "lr"
