"""A table's declaration (`TableConfig`): name, width, optimizer, initial
values, lifecycle and update mode; identical on every shard."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import TableConfigError
from ..parsing import json_int
from .lifecycle import NO_LIFECYCLE, Lifecycle
from .optim import AddDeltas, FTRLMixture, Optimizer, make_optimizer

__all__ = ["MODES", "MAX_DIM", "MAX_INIT_SCALE", "TableConfig"]

MODES = ("async", "sync", "geo")
"""Update modes a model may be declared with (docs/architecture.md, Update modes)."""
MAX_DIM = 4096
"""Most weights per key a table may have."""
MAX_INIT_SCALE = 1e3
"""Largest initial-weight scale (weights are float32, and an optimizer's
state is a multiple of them)."""


@dataclass(frozen=True)
class TableConfig:
    """The declaration of a table; identical on every shard."""

    name: str
    """Table name, as used in RPC frames (ASCII letters, digits, ``_.-``)."""
    dim: int = 1
    """Weights per key: 1 for a linear term, k for an FM embedding."""
    optimizer: dict[str, Any] = field(default_factory=lambda: {"name": "ftrl"})
    """``{"name": "sgd"|"adagrad"|"ftrl"|"coin"|"ftrl_mix", **hyperparameters}``."""
    init_scale: float = 0.0
    """Initial weights are uniform in ``[-init_scale, init_scale)``; 0 starts at zero."""
    seed: int = 0
    """Seed of the initial values (a pure function of key and seed)."""
    lifecycle: Lifecycle | None = None
    """Admission and eviction rules (`ps_core.store.lifecycle`); None in a
    declaration: the shard's default (a declared table always has one)."""
    mode: str = "async"
    """How the model's workers update it (`MODES`): ``async`` pushes
    gradients the shard applies as they arrive; ``sync`` pushes gradients the
    shard holds until the workers' step closes, then applies their sum
    (`SparseTable.hold`, `apply_held`); ``geo`` pushes parameter differences
    the shard adds (its rows hold weights only: `row_rule`)."""
    max_staleness: int | None = None
    """Async only: a gradient computed from rows more than this many pushes
    old is down-weighted by ``(1 + max_staleness) / (1 + staleness)``; None
    counts staleness without bounding it."""

    def __post_init__(self) -> None:
        name = self.name
        if not name or len(name) > 64 or not all(c.isalnum() or c in "_.-" for c in name):
            raise TableConfigError(f"bad table name {name!r}: 1-64 of [A-Za-z0-9_.-]")
        if not name.isascii():
            raise TableConfigError(f"bad table name {name!r}: ASCII only")
        if not isinstance(self.dim, int) or not 1 <= self.dim <= MAX_DIM:
            raise TableConfigError(f"table {name}: dim must be an integer in [1, {MAX_DIM}]")
        if not 0 <= self.init_scale <= MAX_INIT_SCALE:  # NaN fails too
            raise TableConfigError(f"table {name}: init_scale must be in [0, {MAX_INIT_SCALE:g}]")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise TableConfigError(f"table {name}: seed must be an integer in [0, 2**63)")
        # Normalise the optimizer spec (defaults filled in) so that two
        # declarations of the same table compare equal however they were written.
        optimizer = make_optimizer(dict(self.optimizer))
        object.__setattr__(self, "optimizer", optimizer.spec())
        wrong = optimizer.check_dim(self.dim)
        if wrong:
            raise TableConfigError(f"table {name}: {wrong}")
        if isinstance(optimizer, FTRLMixture) and self.init_scale:
            # Random starts would land in the mixture's log-weights too.
            raise TableConfigError(f"table {name}: a mixture of learners starts at zero (init_scale 0)")
        if self.lifecycle is not None and not isinstance(self.lifecycle, Lifecycle):
            raise TableConfigError(f"table {name}: lifecycle must be a Lifecycle")
        if self.lifecycle is not None and self.lifecycle.embed_threshold and not self.embeddings:
            raise TableConfigError(
                f"table {name}: lazy embeddings (embed_threshold) need an embedding table "
                "(dim > 1, no mixture of learners)"
            )
        if self.lifecycle == NO_LIFECYCLE:
            # The default says nothing: one form of it, so declarations compare equal.
            object.__setattr__(self, "lifecycle", None)
        if self.mode not in MODES:
            raise TableConfigError(f"table {name}: mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.max_staleness is not None:
            if self.mode != "async":
                raise TableConfigError(f"table {name}: max_staleness bounds async updates, not {self.mode}")
            if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int):
                raise TableConfigError(f"table {name}: max_staleness must be an integer")
            if not 0 <= self.max_staleness < 2**31:
                raise TableConfigError(f"table {name}: max_staleness must be in [0, 2**31)")

    @property
    def embeddings(self) -> bool:
        """Whether its rows are embeddings, which lazy embeddings gate: dim > 1,
        and not a mixture's linear table (2K weights: learners' and log-weights)."""
        return self.dim > 1 and self.optimizer["name"] != FTRLMixture.name

    def row_rule(self) -> Optimizer:
        """What the shard applies to a push and how its rows are laid out: the
        declared optimizer, or for a geo model `AddDeltas` (weights only; the
        optimizer runs on the workers' copies)."""
        if self.mode == "geo":
            return AddDeltas()
        return make_optimizer(self.optimizer)

    def accepts(self, declared: TableConfig) -> bool:
        """Whether `declared` declares this table again: the same fields, its
        lifecycle left out (None) or the same."""
        return self == declared or (declared.lifecycle is None and replace(self, lifecycle=None) == declared)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (the body of a declaration); the lifecycle only when set."""
        out: dict[str, Any] = {
            "name": self.name,
            "dim": self.dim,
            "optimizer": dict(self.optimizer),
            "init_scale": self.init_scale,
            "seed": self.seed,
        }
        if self.lifecycle is not None:
            out["lifecycle"] = self.lifecycle.to_dict()
        out["mode"] = self.mode
        if self.max_staleness is not None:
            out["max_staleness"] = self.max_staleness
        return out

    @classmethod
    def from_dict(cls, raw: object) -> TableConfig:
        """Build from a decoded JSON object; unknown or mistyped fields are errors."""
        if not isinstance(raw, dict):
            raise TableConfigError("a table declaration is a JSON object")
        unknown = set(raw) - {"name", "dim", "optimizer", "init_scale", "seed", "lifecycle", "mode", "max_staleness"}
        if unknown:
            raise TableConfigError(f"unknown table fields: {sorted(unknown)}")
        opt = raw.get("optimizer", {"name": "ftrl"})
        if isinstance(opt, str):
            opt = {"name": opt}
        if not isinstance(opt, dict):
            raise TableConfigError("optimizer is a name or an object with a name")
        dim, seed, scale = raw.get("dim", 1), raw.get("seed", 0), raw.get("init_scale", 0.0)
        # JSON integers by value (2.0 is 2), exact only (`ps_core.parsing`).
        dim = json_int(dim, "dim", minimum=1, maximum=MAX_DIM, error=TableConfigError)
        seed = json_int(seed, "seed", maximum=2**63 - 1, error=TableConfigError)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TableConfigError("init_scale must be a number")
        name = raw.get("name")
        if not isinstance(name, str):
            raise TableConfigError("name must be a string (it is required)")
        raw_lifecycle = raw.get("lifecycle")
        lifecycle = None if raw_lifecycle is None else Lifecycle.from_dict(raw_lifecycle)
        mode = raw.get("mode", "async")  # a declaration written before modes: async
        if not isinstance(mode, str):
            raise TableConfigError("mode must be a string")
        bound = raw.get("max_staleness")
        if bound is not None:
            bound = json_int(bound, "max_staleness", maximum=2**31 - 1, error=TableConfigError)
        return cls(name, dim, dict(opt), float(scale), seed, lifecycle, mode, bound)
