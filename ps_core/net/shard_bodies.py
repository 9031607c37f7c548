"""The shard's own JSON bodies as models: tables (their declarations,
optimizers and lifecycles), stats, health, errors, and the annotated types
the control plane's messages (`ps_core.net.control_messages`) share.

Each body is declared once, as a `msgspec.Struct` (`ps_core.bodies`): the
routes decode requests with the models, and the shard's OpenAPI document
(`ps_core.net.shard_openapi`) derives its schemas from them.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from ..parsing import MAX_INT
from ..store.board import PARTITION_KEY
from ..store.optim import MAX_HYPERPARAMETER, MIN_POSITIVE
from ..store.snapshot import MAX_VERSION
from ..store.table_config import MAX_DIM, MAX_INIT_SCALE

__all__ = [
    "Error",
    "Table",
    "TableDeclaration",
    "Declared",
    "Stats",
    "ShardHealthBody",
    "LifecycleBody",
    "Optimizer",
    "OptimizerName",
    "Count",
    "CountsBy",
    "NewModelName",
    "MAX_WAIT_S",
]

Count = Annotated[int, Meta(ge=0)]
Shards = Annotated[int, Meta(ge=1)]
CountsBy = dict[str, Count]
Version = Annotated[int, Meta(ge=0, le=MAX_VERSION)]
ExportVersion = Annotated[int, Meta(ge=1)]
Duration = Annotated[float, Meta(ge=0)]
Positive = Annotated[float, Meta(ge=MIN_POSITIVE, le=MAX_HYPERPARAMETER)]
NonNegative = Annotated[float, Meta(ge=0, le=MAX_HYPERPARAMETER)]
Kind = Literal["base", "delta"]
Topic = Annotated[str, Meta(min_length=1, max_length=249)]
Offset = Annotated[int, Meta(ge=0, le=MAX_INT)]
Offsets = Annotated[
    dict[Topic, dict[Annotated[str, Meta(pattern=PARTITION_KEY)], Offset]],
    Meta(description="Next offset per topic and partition (partitions in ASCII digits)."),
]

MAX_WAIT_S = 300.0
"""Longest a lease request may wait for a cut to end."""

ModelName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z",
        description="A model: 1-64 of [A-Za-z0-9_.-], starting with a letter, digit or underscore.",
    ),
]
NewModelName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=62,
        pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,61}\Z",
        description="A model to create: 1-62 of [A-Za-z0-9_.-], starting with a letter, digit or underscore "
        "(its tables, <name>_w and <name>_v, are table names: at most 64).",
    ),
]


class Error(Struct, forbid_unknown_fields=True):
    """Every error: a stable code and a reason; with ``moved``, the epoch of
    the slot map the shard answered by."""

    error: str
    detail: Annotated[str, Meta(min_length=1)]
    epoch: Annotated[int, Meta(ge=0)] | UnsetType = UNSET


# -- tables ------------------------------------------------------------------------


class SGDBody(Struct, tag_field="name", tag="sgd", forbid_unknown_fields=True):
    """Plain SGD (ps_core.store.optim.SGD)."""

    lr: Positive | UnsetType = UNSET
    l2: NonNegative | UnsetType = UNSET


class AdaGradBody(Struct, tag_field="name", tag="adagrad", forbid_unknown_fields=True):
    """AdaGrad (ps_core.store.optim.AdaGrad)."""

    lr: Positive | UnsetType = UNSET
    eps: Positive | UnsetType = UNSET
    initial_accumulator: NonNegative | UnsetType = UNSET


class FTRLBody(Struct, tag_field="name", tag="ftrl", forbid_unknown_fields=True):
    """FTRL-proximal (ps_core.store.optim.FTRL): beta or l2 positive."""

    alpha: Positive | UnsetType = UNSET
    beta: NonNegative | UnsetType = UNSET
    l1: NonNegative | UnsetType = UNSET
    l2: NonNegative | UnsetType = UNSET


class CoinBettingBody(Struct, tag_field="name", tag="coin", forbid_unknown_fields=True):
    """Parameter-free coin betting (ps_core.store.optim.CoinBetting): the
    bettor's initial stake, the floor of its gradient scale, and the scale
    of its bets in the logit."""

    wealth: Positive | UnsetType = UNSET
    lipschitz: Positive | UnsetType = UNSET
    scale: Positive | UnsetType = UNSET


class FTRLMixtureBody(Struct, tag_field="name", tag="ftrl_mix", forbid_unknown_fields=True):
    """A mixture of FTRL learners (ps_core.store.optim.FTRLMixture): learner
    i's alpha_i and l1_i (numbered from 1 without gaps; naming none takes the
    default learners), the shared beta and l2, and the cap, in nats, of how
    far a learner's loss may trail the best one's."""

    alpha_1: Positive | UnsetType = UNSET
    l1_1: NonNegative | UnsetType = UNSET
    alpha_2: Positive | UnsetType = UNSET
    l1_2: NonNegative | UnsetType = UNSET
    alpha_3: Positive | UnsetType = UNSET
    l1_3: NonNegative | UnsetType = UNSET
    alpha_4: Positive | UnsetType = UNSET
    l1_4: NonNegative | UnsetType = UNSET
    alpha_5: Positive | UnsetType = UNSET
    l1_5: NonNegative | UnsetType = UNSET
    alpha_6: Positive | UnsetType = UNSET
    l1_6: NonNegative | UnsetType = UNSET
    beta: NonNegative | UnsetType = UNSET
    l2: NonNegative | UnsetType = UNSET
    cap: Positive | UnsetType = UNSET


Optimizer = SGDBody | AdaGradBody | FTRLBody | CoinBettingBody | FTRLMixtureBody
OptimizerName = Literal["sgd", "adagrad", "ftrl", "coin", "ftrl_mix"]
"""An optimizer by name alone (its defaults); `OPTIMIZERS`' keys."""
TableName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}\Z")]


class LifecycleBody(Struct, forbid_unknown_fields=True):
    """A table's admission and eviction rules (`ps_core.store.lifecycle`);
    a field left out takes its default, 0 turns a rule off."""

    admit: Annotated[str, Meta(pattern=r"^(none|(count|prob|score):[0-9][0-9.eE+-]*)\Z")] | UnsetType = UNSET
    click_coeff: NonNegative | UnsetType = UNSET
    nonclick_coeff: NonNegative | UnsetType = UNSET
    ttl_s: Annotated[float, Meta(ge=0, le=MAX_INT)] | UnsetType = UNSET
    decay: Annotated[float, Meta(gt=0, le=1)] | UnsetType = UNSET
    min_score: NonNegative | UnsetType = UNSET
    max_rows: Annotated[int, Meta(ge=0, le=MAX_INT)] | UnsetType = UNSET
    low_water: Annotated[float, Meta(gt=0, lt=1)] | UnsetType = UNSET
    sketch_bytes: Annotated[int, Meta(ge=0, le=MAX_INT)] | UnsetType = UNSET
    embed_threshold: NonNegative | UnsetType = UNSET
    embed_from: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{0,64}\Z")] | UnsetType = UNSET


Mode = Annotated[Literal["async", "sync", "geo"], Meta(description="How workers update the model (TableConfig.mode).")]


class Table(Struct, forbid_unknown_fields=True):
    """A declared table; its optimizer with the defaults filled in, its
    lifecycle when it has rules."""

    name: TableName
    dim: Annotated[int, Meta(ge=1, le=MAX_DIM)]
    optimizer: Optimizer
    init_scale: Annotated[float, Meta(ge=0, le=MAX_INIT_SCALE)]
    seed: Annotated[int, Meta(ge=0, le=MAX_INT)]
    lifecycle: LifecycleBody | UnsetType = UNSET
    mode: Mode = "async"
    max_staleness: Annotated[int, Meta(ge=0, le=2**31 - 1)] | UnsetType = UNSET


class TableDeclaration(Struct, forbid_unknown_fields=True):
    """A table to declare; a field left out takes `TableConfig`'s default."""

    name: TableName
    dim: Annotated[int, Meta(ge=1, le=MAX_DIM)] | UnsetType = UNSET
    optimizer: OptimizerName | Optimizer | UnsetType = UNSET
    init_scale: Annotated[float, Meta(ge=0, le=MAX_INIT_SCALE)] | UnsetType = UNSET
    seed: Annotated[int, Meta(ge=0, le=MAX_INT)] | UnsetType = UNSET
    lifecycle: LifecycleBody | UnsetType = UNSET
    mode: Mode | UnsetType = UNSET
    max_staleness: Annotated[int, Meta(ge=0, le=2**31 - 1)] | UnsetType = UNSET


class Declared(Struct, forbid_unknown_fields=True):
    created: bool
    table: Table


class AdmissionBody(Struct, forbid_unknown_fields=True):
    """Keys given a row by a push, and key updates dropped for want of one."""

    admitted: Count
    dropped: Count
    sketch_bytes: Count | UnsetType = UNSET
    sketch_agings: Count | UnsetType = UNSET


class TableLifecycle(Struct, forbid_unknown_fields=True):
    """A table's lifecycle and what it did since start."""

    lifecycle: LifecycleBody
    evicted: dict[str, Count]
    eviction_passes: Count
    most_over_cap: Annotated[Count, Meta(description="The most rows over max_rows a pass found.")]
    inserted_before_most_over_cap: Annotated[
        Count, Meta(description="Rows inserted between that pass and the one before it.")
    ]
    embed_gated: Annotated[Count, Meta(description="Key updates dropped by the lazy-embedding gate.")]
    bytes_freed: Count
    last_eviction_ms: Annotated[float, Meta(ge=0)] | None
    last_eviction_bytes_freed: Count | None
    admission: AdmissionBody | UnsetType = UNSET


class Staleness(Struct, forbid_unknown_fields=True):
    """How stale the async pushes a table applied were (pushes applied
    between a gradient's pull and its push)."""

    buckets: Annotated[
        dict[str, Count], Meta(description="Pushes per upper bound of staleness (inclusive), '+Inf' last.")
    ]
    count: Count
    sum: Count
    unknown: Annotated[Count, Meta(description="Pushes without a usable base clock (geo pushes, older clients).")]
    down_weighted: Annotated[Count, Meta(description="Pushes scaled down for exceeding max_staleness.")]
    max_staleness: Count | None


class ChangeLogStats(Struct, forbid_unknown_fields=True):
    """A geo table's change log (ps_core.store.change_log)."""

    entries: Count
    keys: Count
    incomplete: Annotated[Count, Meta(description="Answers that could not name every key changed since asked.")]


class TableStats(Struct, forbid_unknown_fields=True):
    features: Count
    bytes: Count
    pushes: Count
    pulls: Count
    version: Count
    config: Table
    lifecycle: TableLifecycle
    staleness: Staleness
    change_log: ChangeLogStats | UnsetType = UNSET


class KeySetStats(Struct, forbid_unknown_fields=True):
    """The key sets kept from pulls for the pushes that name them (ps_core.shard.key_sets)."""

    sets: Count
    keys: Count
    remembered: Count
    used: Count
    expired: Count
    dropped: Count


class WireStatsBody(Struct, forbid_unknown_fields=True):
    key_sets: KeySetStats
    reply_values_clipped: Annotated[Count, Meta(description="Weights clipped to float16's range in replies.")]


class SlotStats(Struct, forbid_unknown_fields=True):
    """The shard's slots (ps_core.slots) and the rows slot moves carried."""

    epoch: Annotated[int, Meta(ge=1, description="The epoch of the shard's slot map.")]
    owned: Annotated[Count, Meta(description="Slots the shard owns.")]
    slots: Annotated[int, Meta(ge=1, description="Slots of the cluster.")]
    rows_in: Annotated[Count, Meta(description="Rows taken over from other shards since start.")]
    rows_out: Annotated[Count, Meta(description="Rows handed off to other shards since start.")]
    held: Annotated[Count, Meta(description="Rows handed off and still held (a move in progress).")]


class AuthStats(Struct, forbid_unknown_fields=True):
    """Requests refused for their token, by reason (ps_core.net.auth)."""

    refused: CountsBy


class ExporterStats(Struct, forbid_unknown_fields=True):
    """Shard 0's exporter (ps_core.checkpoint.exporter)."""

    exports: Count
    failures: CountsBy
    last_version: int | None
    cuts_spent: Count
    # Last, with defaults: a shard 0 of an older version sends neither.
    age_s: (
        Annotated[
            float,
            Meta(ge=0, description="Seconds since the last export (since the exporter started, before its first)."),
        ]
        | None
    ) = None
    interval_s: (
        Annotated[float, Meta(ge=0, description="Seconds between periodic exports; 0: only when asked.")] | None
    ) = None


class BarrierStats(Struct, forbid_unknown_fields=True):
    """One model's sync barrier (ps_core.checkpoint.barrier)."""

    step: Count
    members: list[str]
    steps_closed: Count
    shrinks: Count
    dropped: CountsBy


class SyncStats(Struct, forbid_unknown_fields=True):
    """Every model's sync barrier on shard 0's coordinator, summed and by model."""

    steps_closed: Count
    shrinks: Count
    members: list[str]
    dropped: CountsBy
    models: dict[str, BarrierStats]


class ClusterStats(Struct, forbid_unknown_fields=True):
    """Shard 0's view of the cluster's membership (ps_core.checkpoint.membership)."""

    ready: bool
    version: Count
    epoch: str
    cluster_restores: Count
    versions_refused: Count
    refusal: str | None
    joined: Annotated[list[bool | None], Meta(description="Per shard: a member (null: it did not answer).")]


class Stats(Struct):
    """This shard's figures; a shard server adds its ports and refusals, and
    shard 0 the sections of what it hosts (exports, sync, cluster)."""

    shard_id: Count
    num_shards: Shards
    duplicate_pushes: Count
    wire: WireStatsBody
    tables: dict[str, TableStats]
    slots: SlotStats | UnsetType = UNSET
    auth: AuthStats | UnsetType = UNSET
    exports: ExporterStats | UnsetType = UNSET
    sync: SyncStats | UnsetType = UNSET
    cluster: ClusterStats | UnsetType = UNSET
    ports: (
        Annotated[
            dict[str, dict[str, int | CountsBy]],
            Meta(description="Per port (http, rpc, tls): its connections and what its limits refused."),
        ]
        | UnsetType
    ) = UNSET


class ShardHealthBody(Struct, forbid_unknown_fields=True):
    status: Literal["ok"]
    shard_id: Count
    num_shards: Shards
    rpc_port: int | None
