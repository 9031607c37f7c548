"""The models a cluster holds: each created once with its type and tables.

A model is its type (``lr`` or ``fm``) and its tables' declarations
(`TableConfig`: optimizer, hyperparameters, update mode). The coordinator
keeps the registry; each model's declaration is also written to
``<exports>/<name>/model.json`` when it is created (a local directory's or a
bucket's, `ps_core.checkpoint.declarations`), so it survives restarts and
travels with the model's exports. Every table of the cluster belongs to
one model: the tables a registered model declares are its own, and any other
table (declared by hand, ``ctrps shard --table``) belongs to the shard's
default model (``--model-name``), as every table did before there were
several models.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import orjson

from ..bodies import check
from ..errors import InvalidRequestError, ModelConflictError, TableConfigError, UnknownModelError
from ..model.featurizer import DEFAULT_NUMERIC, numeric_feed
from ..model.models import Model, make_model, model_of_tables
from ..net.control_messages import ModelDeclaration, ModelEntry
from ..store.table_config import TableConfig
from .declarations import MODEL_FILE, Declarations, declarations_at
from .exportstore import ExportStore, ExportStoreError, LocalExportStore, StoredModel, store_for
from .manifest import check_model_name

__all__ = ["MODEL_FILE", "ModelSpec", "ModelRegistry"]

MAX_MODELS = 256
"""Models one cluster holds: each adds its tables to every shard and its
files to every cut."""

log = logging.getLogger("ctrps.models")


@dataclass(frozen=True)
class ModelSpec:
    """One model's declaration: its name, type and tables."""

    name: str
    kind: str
    """``lr`` or ``fm``."""
    tables: tuple[TableConfig, ...]
    created_at: float = field(default=0.0, compare=False)
    """Unix time it was created (not part of its identity)."""
    numeric: str = "raw"
    """How its numeric features are fed (`ps_core.model.featurizer.NUMERIC`); a
    declaration written before the choice existed reads as ``raw``."""

    @classmethod
    def of(cls, model: Model, created_at: float | None = None) -> ModelSpec:
        """The declaration of `model` (as its workers declare its tables)."""
        return cls(
            model.name,
            model.kind,
            model.tables(),
            time.time() if created_at is None else created_at,
            model.numeric,
        )

    def build(self) -> Model:
        """The model this declares (`ps_core.model.models.model_of_tables`)."""
        return model_of_tables(self.kind, self.name, self.tables, self.numeric)

    def recipe(self) -> dict[str, Any]:
        """What creates it (``POST /v1/models``' body: type, optimizers,
        embedding width, mode), the inverse of `from_recipe`."""
        w = self.tables[0]
        out: dict[str, Any] = {
            "name": self.name,
            "type": self.kind,
            "optimizer": dict(w.optimizer),
            "mode": w.mode,
            "numeric": self.numeric,
        }
        if w.max_staleness is not None:
            out["max_staleness"] = w.max_staleness
        if self.kind == "fm":
            v = self.tables[1]
            out |= {
                "embedding_optimizer": dict(v.optimizer),
                "factors": v.dim,
                "init_scale": v.init_scale,
                "seed": v.seed,
            }
        return out

    def declaration(self) -> ModelDeclaration:
        """Its `recipe` as the control plane sends it (``POST /v1/models``)."""
        out: ModelDeclaration = check(self.recipe(), ModelDeclaration, InvalidRequestError)
        return out

    @classmethod
    def from_recipe(cls, raw: Mapping[str, Any]) -> ModelSpec:
        """The model `raw` (a `recipe`) creates; `InvalidRequestError` for
        what a model cannot be built with (e.g. an optimizer's hyperparameters)."""
        name, kind = _name_and_type(raw.get("name"), raw.get("type", "lr"))
        kwargs: dict[str, Any] = {
            "mode": raw.get("mode", "async"),
            "max_staleness": raw.get("max_staleness"),
            "numeric": raw.get("numeric", DEFAULT_NUMERIC),
        }
        for key in ("optimizer", "embedding_optimizer"):
            opt = raw.get(key)
            if kind == "lr" and key == "embedding_optimizer":
                continue
            if isinstance(opt, str):
                opt = {"name": opt}
            if opt is not None:
                kwargs[key] = dict(opt)
        if kind == "fm":
            kwargs |= {
                k: raw[r] for k, r in (("k", "factors"), ("init_scale", "init_scale"), ("seed", "seed")) if r in raw
            }
        try:
            model = make_model(kind, name, **kwargs)  # its tables check the optimizers
        except (TableConfigError, ValueError, TypeError) as exc:
            raise InvalidRequestError(f"model {name}: {getattr(exc, 'detail', None) or exc}") from None
        return cls.of(model, created_at=float(raw.get("created_at") or 0.0))

    @property
    def mode(self) -> str:
        """The update mode of its tables."""
        return self.tables[0].mode

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tables)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the body of ``POST /v1/models`` and of ``model.json``)."""
        return {
            "name": self.name,
            "type": self.kind,
            "update_mode": self.mode,
            "numeric": self.numeric,
            "tables": [t.to_dict() for t in self.tables],
            "created_at": round(self.created_at, 3),
        }

    @classmethod
    def from_entry(cls, entry: ModelEntry) -> ModelSpec:
        """The declaration a model listing names (`from_dict` of its JSON form)."""
        return cls.from_dict(msgspec.to_builtins(entry))

    @classmethod
    def from_dict(cls, raw: object) -> ModelSpec:
        """Parse and check a declaration (`InvalidRequestError` naming what is wrong)."""
        if not isinstance(raw, dict):
            raise InvalidRequestError("a model declaration is a JSON object")
        unknown = set(raw) - {"name", "type", "update_mode", "numeric", "tables", "created_at"}
        if unknown:
            raise InvalidRequestError(f"unknown model fields: {sorted(unknown)}")
        name, kind = _name_and_type(raw.get("name"), raw.get("type"))
        tables = raw.get("tables")
        if not isinstance(tables, list) or not tables:
            raise InvalidRequestError("tables must be a non-empty list of table declarations")
        try:
            configs = tuple(TableConfig.from_dict(t) for t in tables)
        except TableConfigError as exc:
            raise InvalidRequestError(f"model {name}: {exc.detail}") from None
        created = raw.get("created_at") or 0.0
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise InvalidRequestError("created_at must be a number")
        numeric = raw.get("numeric") or "raw"
        try:
            numeric_feed(str(numeric))
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        spec = cls(name, kind, configs, float(created), str(numeric))
        try:
            spec.build()
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
        if raw.get("update_mode") not in (None, spec.mode):
            raise InvalidRequestError(f"update_mode {raw['update_mode']!r} is not its tables' mode {spec.mode!r}")
        return spec


def _name_and_type(name: object, kind: object) -> tuple[str, str]:
    """A declaration's name and type, checked (`InvalidRequestError`)."""
    if not isinstance(name, str):
        raise InvalidRequestError("name must be a string")
    try:
        check_model_name(name)
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None
    if kind not in ("lr", "fm"):
        raise InvalidRequestError(f"type must be lr or fm, got {kind!r}")
    return name, str(kind)


class ModelRegistry:
    """The cluster's models, kept by the coordinator and in each model's
    exports directory under `root`, a local directory or a bucket (None: in
    memory only, for a cluster that does not export)."""

    def __init__(self, root: Path | str | ExportStore | None, default: str, specs: Iterable[ModelSpec] = ()) -> None:
        """`default` owns every table no registered model declares; `specs`
        are models known without reading `root` (tests, the demo)."""
        if isinstance(root, LocalExportStore):
            root = root.root
        elif isinstance(root, str) and "://" in root:
            root = store_for(root)
        self.store = root if isinstance(root, ExportStore) else None
        """The bucket the declarations are in (None: a local `root` or none)."""
        self.root = Path(root) if root is not None and not isinstance(root, ExportStore) else None
        self.files: Declarations | None = declarations_at(root) if root is not None else None
        self.default = check_model_name(default)
        self._specs: dict[str, ModelSpec] = {s.name: s for s in specs}
        self.changes = 0
        """Models created or deleted since start: a cut after one is a base
        (a new model's directory needs one to start its chain)."""

    @classmethod
    def load(cls, root: Path | str | ExportStore | None, default: str) -> ModelRegistry:
        """The registry of the exports under `root` (a directory or a
        bucket): every model holding a `MODEL_FILE`. One that does not parse
        is logged and skipped (its files stay; the model is not served until
        it is created again). A bucket that cannot be listed or read is
        `ExportStoreError`, as its versions' listing is."""
        registry = cls(root, default)
        files = registry.files
        if files is None:
            return registry
        for name in files.names():
            try:
                spec = ModelSpec.from_dict(orjson.loads(files.read(name)))
            except ExportStoreError:
                raise  # a bucket that did not answer: not a declaration to skip
            except (OSError, orjson.JSONDecodeError, InvalidRequestError) as exc:
                detail = exc.detail if isinstance(exc, InvalidRequestError) else str(exc)
                log.warning("model declaration refused", extra={"fields": {"file": files.where(name), "error": detail}})
                continue
            if spec.name != name:
                log.warning(
                    "model declaration refused",
                    extra={"fields": {"file": files.where(name), "error": f"it declares model {spec.name!r}"}},
                )
                continue
            registry._specs[spec.name] = spec
        return registry

    def names(self) -> list[str]:
        """Every model: the default first, then the others by name."""
        others = sorted(n for n in self._specs if n != self.default)
        return [self.default, *others]

    def get(self, name: str) -> ModelSpec | None:
        """The declaration of model `name` (None: not declared; the default
        model may hold tables without one)."""
        return self._specs.get(name)

    def check(self, name: str) -> None:
        """`UnknownModelError` unless `name` is a model of this cluster."""
        if name != self.default and name not in self._specs:
            raise UnknownModelError(f"no model {name!r} in this cluster; models: {', '.join(self.names())}")

    def check_new(self, spec: ModelSpec) -> None:
        """`ModelConflictError` when `spec` cannot be created beside the
        models held (its tables are another's, or the registry is full);
        checked before its tables are declared. The same declaration again passes."""
        had = self._specs.get(spec.name)
        if had is not None and (
            had.kind != spec.kind or had.numeric != spec.numeric or not _same_tables(had.tables, spec.tables)
        ):
            raise ModelConflictError(
                f"model {spec.name} exists as {had.kind} (numeric {had.numeric}) with tables "
                f"{[t.to_dict() for t in had.tables]}; created again as {spec.kind} (numeric {spec.numeric}) "
                f"with {[t.to_dict() for t in spec.tables]}"
            )
        for other in self._specs.values():
            shared = set(other.table_names) & set(spec.table_names)
            if shared and other.name != spec.name:
                raise ModelConflictError(f"tables {sorted(shared)} belong to model {other.name}")
        if spec.name not in self._specs and len(self._specs) >= MAX_MODELS:
            raise ModelConflictError(f"this cluster holds {MAX_MODELS} models, its most: delete one first")

    def create(self, spec: ModelSpec) -> bool:
        """Declare `spec`; True when it is new. The same declaration again is
        no change (False); another one for the name, or tables another model
        declares, is `ModelConflictError`."""
        self.check_new(spec)
        if spec.name in self._specs:
            return False
        if not spec.created_at:
            spec = replace(spec, created_at=time.time())
        if self.files is not None:
            self.files.write(spec.name, orjson.dumps(spec.to_dict(), option=orjson.OPT_INDENT_2))
        self._specs[spec.name] = spec
        self.changes += 1
        return True

    def delete(self, name: str) -> ModelSpec:
        """Forget model `name` (`UnknownModelError` if not declared). Its
        exports stay where they are, without their `MODEL_FILE` (renamed
        ``model.json.deleted``), so a restart does not bring it back."""
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownModelError(f"no model {name!r} declared in this cluster")
        if self.files is not None:
            self.files.retire(name)
        del self._specs[name]
        self.changes += 1
        return spec

    def owner(self, table: str) -> str:
        """The model `table` belongs to."""
        for spec in self._specs.values():
            if table in spec.table_names:
                return spec.name
        return self.default

    def split(self, tables: Iterable[str]) -> dict[str, list[str]]:
        """`tables` by the model they belong to; every model appears (a model
        without tables yet maps to an empty list)."""
        out: dict[str, list[str]] = {n: [] for n in self.names()}
        for t in tables:
            out[self.owner(t)].append(t)
        return out

    def dirs(self) -> dict[str, Path | StoredModel]:
        """Each model's exports: its directory, or its model in the bucket
        (empty without a root)."""
        if self.store is not None:
            return {n: StoredModel(self.store, n) for n in self.names()}
        if self.root is None:
            return {}
        return {n: self.root / n for n in self.names()}


def _same_tables(had: tuple[TableConfig, ...], asked: tuple[TableConfig, ...]) -> bool:
    """Whether `asked` declares the tables `had` holds again (`TableConfig.accepts`)."""
    by_name: Mapping[str, TableConfig] = {t.name: t for t in asked}
    if sorted(by_name) != sorted(t.name for t in had):
        return False
    return all(t.accepts(by_name[t.name]) for t in had)


def model_dirs(root: Path | str | ExportStore, default: str) -> dict[str, Path | StoredModel]:
    """Each model's exports under `root`, a directory or a bucket (`ModelRegistry.load`)."""
    return ModelRegistry.load(root, default).dirs()
