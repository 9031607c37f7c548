"""The shard's JSON bodies as models, and the OpenAPI 3.1 document of its
JSON routes (``GET /openapi.json`` on every shard's HTTP port), so they can be
fuzzed like the API's.

It documents the routes of `ps_core.net.server` and, on shard 0 with a
coordinator and exporter, of `ps_core.checkpoint.routes`: tables, stats,
status, snapshots, membership, restore, leases, offsets, exports. The
binary frame routes (``/v1/pull``, ``/v1/push``, ``/v1/push_pull``,
``/v1/changes``) are
left out: their bodies are `ps_core.net.codec` frames, not JSON, and the codec
has its own tests. `shard_document` keeps only the paths the app serves.

Each body is declared once, as a `msgspec.Struct` (`ps_core.bodies`): the
routes decode requests with the models (`decode`), and the document's
schemas are derived from them. The exporter's reports (`ExportReport`,
`Compaction`, `ExportList`) and the status board's models
(`ps_core.store.board`) are in the API's document too: the API relays them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from ..bodies import NUMERIC_PATTERN, components, ref
from ..parsing import MAX_INT
from ..store.board import PARTITION_KEY, StatusReport
from ..store.optim import MAX_HYPERPARAMETER, MIN_POSITIVE
from ..store.snapshot import MAX_VERSION
from ..store.table_config import MAX_DIM, MAX_INIT_SCALE

__all__ = [
    "shard_document",
    "json_response",
    "ok_response",
    "created_response",
    "parameter",
    "Error",
    "SnapshotRequest",
    "Admit",
    "Restore",
    "LeaseRequest",
    "LeaseRenewal",
    "Release",
    "ExportRequest",
    "ExportReportBody",
    "Compaction",
    "ExportList",
    "StatusAck",
    "StatusBoardBody",
    "MAX_WAIT_S",
    "NewModelName",
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
    """Every error: a stable code and a reason."""

    error: str
    detail: Annotated[str, Meta(min_length=1)]


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


Optimizer = SGDBody | AdaGradBody | FTRLBody | CoinBettingBody
OptimizerName = Literal["sgd", "adagrad", "ftrl", "coin"]
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


class TableStats(Struct, forbid_unknown_fields=True):
    features: Count
    bytes: Count
    pushes: Count
    pulls: Count
    version: Count
    config: Table
    lifecycle: TableLifecycle
    staleness: Staleness


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


class Stats(Struct):
    """This shard's figures; shard 0 adds sections of what it hosts (exports, cluster)."""

    shard_id: Count
    num_shards: Shards
    duplicate_pushes: Count
    wire: WireStatsBody
    tables: dict[str, TableStats]


# -- the status board ---------------------------------------------------------------


class StatusAck(Struct, forbid_unknown_fields=True):
    source: str
    received_at: float
    sources: Shards


class BoardEntry(Struct, forbid_unknown_fields=True):
    source: str
    received_at: float
    status: dict[str, Any]


class StatusBoardBody(Struct, forbid_unknown_fields=True):
    statuses: list[BoardEntry]


# -- cuts, membership, restore -------------------------------------------------------


class SnapshotRequest(Struct, forbid_unknown_fields=True):
    """Copy every table's rows for the cut `version` (a delta of `parent`)."""

    version: Version
    parent: Version | None


class SnapshotRows(Struct, forbid_unknown_fields=True):
    rows: CountsBy


class Dropped(Struct, forbid_unknown_fields=True):
    dropped: bool


class MembershipBody(Struct, forbid_unknown_fields=True):
    shard_id: Count
    num_shards: Shards
    boot_id: str
    joined: bool
    epoch: str
    version: Count
    clean: bool
    restores: bool


class Admit(Struct, forbid_unknown_fields=True):
    """Join the cluster under the coordinator's `epoch` at `version`."""

    epoch: Annotated[str, Meta(max_length=200)]
    version: Version


class Restore(Struct, forbid_unknown_fields=True):
    """Load `version` from the exports directory."""

    version: Version


class Refused(Struct, forbid_unknown_fields=True):
    file: str
    expected: str
    actual: str
    detail: str


class Restored(Struct, forbid_unknown_fields=True):
    version: int | None
    chain: str | UnsetType = UNSET
    rows: Count | UnsetType = UNSET
    kept: bool | UnsetType = UNSET
    refused: Refused | UnsetType = UNSET


class ShardHealthBody(Struct, forbid_unknown_fields=True):
    status: Literal["ok"]
    shard_id: Count
    num_shards: Shards
    rpc_port: int | None


# -- leases and offsets ---------------------------------------------------------------


class LeaseRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A lease for `worker`, waiting at most `wait_s` for a cut to end."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    wait_s: Annotated[float, Meta(ge=0, le=MAX_WAIT_S)] = 30.0
    ttl_s: (
        Annotated[
            float,
            Meta(
                gt=0,
                le=MAX_WAIT_S,
                description="Seconds the lease lives unless renewed (null: the coordinator's lease TTL, also the most).",
            ),
        ]
        | None
    ) = None


class LeaseRenewal(Struct, forbid_unknown_fields=True):
    """Renew `lease_id`: it lives its time to live again from now."""

    lease_id: Annotated[int, Meta(ge=0, le=MAX_INT)]


class Renewed(Struct, forbid_unknown_fields=True):
    renewed: bool


class LeaseBody(Struct, forbid_unknown_fields=True):
    lease_id: Count
    epoch: str
    ttl_s: float


class Stream(Struct, forbid_unknown_fields=True):
    """The stream offsets were read from (ps_core.checkpoint.stream.StreamIdentity)."""

    cluster_id: Annotated[str, Meta(min_length=1, max_length=200)]
    group: Annotated[str, Meta(max_length=300)]
    topics: Annotated[list[str], Meta(max_length=1000)] = []


class Release(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Release `lease_id` with the offsets its window committed."""

    lease_id: Annotated[int, Meta(ge=0, le=MAX_INT)]
    offsets: Offsets = {}
    stream: Stream | None = None
    model: Annotated[ModelName | None, Meta(description="Whose offsets these are (null: the default model's).")] = None
    also: Annotated[
        list[ModelName], Meta(max_length=256, description="Further models the window trained: their offsets too.")
    ] = []


class Released(Struct, forbid_unknown_fields=True):
    released: bool


_BARRIER_MODEL = Meta(description="The model whose barrier this is (null: the default model's).")


class SyncMember(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A sync worker joining or leaving its model's barrier."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    model: Annotated[ModelName | None, _BARRIER_MODEL] = None


class SyncArrive(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A sync worker has pushed its step; the first arrival's `deadline_s`
    bounds how long the step waits for the rest."""

    worker: Annotated[str, Meta(min_length=1, max_length=200)]
    deadline_s: Annotated[float, Meta(ge=0, le=60)] = 5.0
    model: Annotated[ModelName | None, _BARRIER_MODEL] = None


class SyncStep(Struct, forbid_unknown_fields=True):
    """A closed step (or, from a join, the open one)."""

    step: Annotated[int, Meta(ge=0, le=MAX_INT)]


class SyncApply(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Apply what the named sync tables hold for a closed step of their
    model's barrier."""

    step: Annotated[int, Meta(ge=0, le=MAX_INT)]
    tables: Annotated[
        Annotated[list[TableName], Meta(max_length=64)] | None,
        Meta(description="The model's tables (null: every sync table of the shard)."),
    ] = None


class SyncApplied(Struct, forbid_unknown_fields=True):
    """Distinct keys a shard's sync tables updated (0: the step was applied already)."""

    applied: Count


class KnownOffsets(Struct, forbid_unknown_fields=True):
    offsets: Offsets
    stream: dict[str, Any] | None
    restored: int
    """The export version the shards' state was loaded from (0: started empty)."""


# -- exports --------------------------------------------------------------------------


class ExportRequest(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The kind of version to cut; the exporter's schedule when absent."""

    kind: Kind | None = None


class ExportStream(Struct, forbid_unknown_fields=True):
    cluster_id: str
    group: str
    topics: list[str]


class ExportReportBody(Struct, forbid_unknown_fields=True):
    """A version written (ps_core.checkpoint.exporter)."""

    version: ExportVersion
    kind: Kind
    parent: int | None
    path: Annotated[str, Meta(description="The version's directory on shard 0.")]
    rows: Count
    bytes: Count
    offsets: Annotated[
        dict[str, CountsBy],
        Meta(description="Next offset to consume per topic and partition: where workers resume."),
    ]
    lease_wait_ms: Duration
    pause_ms: Annotated[float, Meta(ge=0, description="Leases refused: the wait plus the shards' copies.")]
    write_ms: Duration
    expired_leases: list[str]
    pruned: list[int]
    stream: Annotated[
        ExportStream | None,
        Meta(
            description="The stream the offsets were read from (Kafka cluster id, group, topics); "
            "null when no worker reported one."
        ),
    ]
    models: Annotated[
        dict[str, dict[str, Any]],
        Meta(description="Per model written: path, rows and bytes (the fields above are the model asked for)."),
    ] = {}


class Compaction(Struct, forbid_unknown_fields=True):
    """A base folding the newest chain (ps_core.checkpoint.exporter)."""

    model: ModelName
    version: ExportVersion
    kind: Literal["base"]
    compacted_from: Annotated[list[int], Meta(description="Empty when the newest version was a base already.")]
    rows: Count
    bytes: Count
    pruned: list[int]
    seconds: Duration


class VersionEntry(Struct, forbid_unknown_fields=True):
    version: ExportVersion
    kind: Kind
    parent: int | None
    created_at: Annotated[str, Meta(description="RFC 3339, UTC.")]
    rows: Count
    bytes: Count


class ExportList(Struct, forbid_unknown_fields=True):
    """The export versions on disk, oldest first."""

    model: str
    versions: list[VersionEntry]
    last: Annotated[
        dict[str, Any] | None,
        Meta(description="The last export this process's coordinator wrote (null on a replica or before one)."),
    ]


# -- models -----------------------------------------------------------------------------


class ModelDeclaration(Struct, forbid_unknown_fields=True):
    """A model to create: its type, optimizers and update mode (a field left
    out takes the model's default; the embedding fields are fm's and an lr
    model ignores them)."""

    name: NewModelName
    type: Literal["lr", "fm"] = "lr"
    optimizer: OptimizerName | Optimizer | UnsetType = UNSET
    embedding_optimizer: OptimizerName | Optimizer | UnsetType = UNSET
    factors: Annotated[int, Meta(ge=1, le=MAX_DIM)] = 8
    init_scale: Annotated[float, Meta(ge=0, le=MAX_INIT_SCALE)] = 0.01
    seed: Annotated[int, Meta(ge=0, le=MAX_INT)] = 0
    mode: Mode = "async"
    max_staleness: Annotated[int, Meta(ge=0, le=2**31 - 1)] | UnsetType = UNSET
    numeric: (
        Annotated[
            str,
            Meta(
                pattern=NUMERIC_PATTERN.removesuffix("$") + r"\Z",
                description="Numeric features fed as sent (raw), or as sign(x) log1p(|x|) (log1p); /D divides "
                "them by D > 0; absent: log1p/16, the default.",
            ),
        ]
        | UnsetType
    ) = UNSET


class ModelEntry(Struct, forbid_unknown_fields=True):
    """A model of the cluster (type null: the default model, holding tables
    declared by hand, not created as a model)."""

    name: ModelName
    type: Literal["lr", "fm"] | None
    tables: list[dict[str, Any]]
    update_mode: str | None = None
    created_at: float | None = None
    numeric: str | None = None


class ShardModelListBody(Struct, forbid_unknown_fields=True):
    default: ModelName
    models: list[ModelEntry]


class ShardModelCreatedBody(Struct, forbid_unknown_fields=True):
    created: bool
    model: ModelEntry


class ShardModelDeletedBody(Struct, forbid_unknown_fields=True):
    deleted: ModelEntry
    tables_dropped: list[str]
    exports: Annotated[str | None, Meta(description="Its exports directory, left in place.")]


class TableDropped(Struct, forbid_unknown_fields=True):
    dropped: bool


_MODELS = (
    Error,
    Table,
    TableDeclaration,
    Declared,
    Stats,
    StatusReport,
    StatusAck,
    StatusBoardBody,
    SnapshotRequest,
    SnapshotRows,
    Dropped,
    MembershipBody,
    Admit,
    Restore,
    Restored,
    ShardHealthBody,
    LeaseRequest,
    LeaseBody,
    Release,
    Released,
    LeaseRenewal,
    Renewed,
    SyncMember,
    SyncArrive,
    SyncStep,
    SyncApply,
    SyncApplied,
    KnownOffsets,
    ExportRequest,
    ExportReportBody,
    Compaction,
    ExportList,
    ModelDeclaration,
    ModelEntry,
    ShardModelListBody,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    TableDropped,
)


FTRL_RULE: list[dict[str, Any]] = [
    {"properties": {"beta": {"minimum": MIN_POSITIVE}}},
    {"properties": {"l2": {"minimum": MIN_POSITIVE}}},
]
"""The one rule of FTRL's no field states: a fresh row divides by
beta / alpha + l2, so beta or l2 (each defaulting to 1) must be positive."""


def _schemas() -> dict[str, Any]:
    schemas = components(_MODELS)
    schemas["Tables"] = {"type": "object", "additionalProperties": ref("Table")}
    # The one rule no field's type states: FTRL divides a fresh row by
    # beta / alpha + l2, so one of them (each defaulting to 1) must be positive.
    schemas["FTRL"]["anyOf"] = FTRL_RULE
    # Rules across fields: a staleness bound is for async tables only, and
    # lazy embeddings need embeddings (dim > 1).
    schemas["ModelDeclaration"]["allOf"] = [
        {"if": {"required": ["max_staleness"]}, "then": {"properties": {"mode": {"const": "async"}}}},
    ]
    schemas["TableDeclaration"]["allOf"] = [
        {"if": {"required": ["max_staleness"]}, "then": {"properties": {"mode": {"const": "async"}}}},
        {
            "if": {
                "required": ["lifecycle"],
                "properties": {
                    "lifecycle": {
                        "required": ["embed_threshold"],
                        "properties": {"embed_threshold": {"type": "number"}},
                    }
                },
            },
            "then": {"required": ["dim"], "properties": {"dim": {"minimum": 2}}},
        },
    ]
    return schemas


_SCHEMAS = _schemas()


# -- document helpers, shared with the API's document (app.openapi) ------------------


def json_response(schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A response whose body is JSON of `schema`."""
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def ok_response(schema: str, description: str, status: int = 200) -> dict[str, Any]:
    """The responses of one success `status` whose body is the component `schema`."""
    return {str(status): json_response(ref(schema), description)}


def created_response(schema: str, again: str) -> dict[str, Any]:
    """A create's successes: 201 created, 200 (`again`) when an identical one exists already."""
    return {**ok_response(schema, "Created.", 201), **ok_response(schema, again)}


def parameter(name: str, where: Literal["path", "query"], description: str, schema: dict[str, Any]) -> dict[str, Any]:
    """A route parameter; a path's is required (OpenAPI's rule), a query's optional."""
    return {"name": name, "in": where, "required": where == "path", "description": description, "schema": schema}


_ERRORS = {
    400: "The body is not one JSON document (invalid_json) or not the route's shape (bad_request, bad_status, "
    "bad_table_config).",
    404: "Nothing to act on (unknown_lease, export_not_found, unknown_model).",
    409: "Refused in the cluster's current state (table_conflict, bad_snapshot, cut_shard_not_joined, model_conflict).",
    401: "A cluster secret is set and no valid token was presented (unauthorized).",
    403: "The token presented is of too low a scope for this route (forbidden).",
    413: "The body is over the limit (too_large).",
    500: "A cut failed and was aborted on every shard (cut_aborted), or an export fails its checks (export_corrupt).",
    503: "Not now: a cut is pausing (cut_in_progress), the cluster is not ready (cluster_not_ready).",
    507: "The export could not be written (export_write_failed).",
}


def _op(
    summary: str,
    ok: dict[str, Any],
    *errors: int,
    body: str | None = None,
    optional_body: bool = False,
    open_: bool = False,
    params: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": summary, "responses": {**ok}}
    if params:
        out["parameters"] = params
    if not open_:
        # With a cluster secret, every route but /healthz and /openapi.json
        # needs a token of its scope (ps_core.net.server.ROUTE_SCOPES).
        out["security"] = [{"bearer": []}]
        errors = (*errors, 401, 403)
    for status in sorted(set(errors)):
        out["responses"][str(status)] = json_response(ref("Error"), _ERRORS[status])
    out["responses"]["default"] = json_response(ref("Error"), "Any other error (not_found, method_not_allowed).")
    if body is not None:
        out["requestBody"] = {
            "required": not optional_body,
            "content": {"application/json": {"schema": ref(body)}},
        }
    return out


_VERSION_PARAM = parameter(
    "version", "path", "The cut's version, in ASCII digits.", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}
)
_MODEL_NAME = {"type": "string", "minLength": 1, "maxLength": 64, "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"}
_MODEL_QUERY = parameter("model", "query", "The model (default: the shard's default model, --model-name).", _MODEL_NAME)
_NAME_PARAM = parameter("name", "path", "A model's name.", _MODEL_NAME)
_TABLE_PARAM = parameter("name", "path", "A table's name.", {"type": "string", "pattern": r"^[A-Za-z0-9_.-]{1,64}$"})

_PATHS: dict[str, dict[str, Any]] = {
    "/v1/tables": {
        "get": _op("The declared tables.", ok_response("Tables", "By name.")),
        "post": _op(
            "Declare a table: 201 created, 200 an identical one exists.",
            created_response("Declared", "Declared already, identically."),
            400,
            409,
            413,
            body="TableDeclaration",
        ),
    },
    "/v1/tables/{name}": {
        "parameters": [_TABLE_PARAM],
        "delete": _op(
            "Drop a table and its rows (idempotent).", ok_response("TableDropped", "Whether it was held."), 400
        ),
    },
    "/v1/models": {
        "get": _op("The cluster's models.", ok_response("ShardModelList", "The default model first.")),
        "post": _op(
            "Create a model: declare its tables on every shard; 201 created, 200 an identical one exists.",
            created_response("ShardModelCreated", "Exists already, identically."),
            400,
            409,
            413,
            503,
            body="ModelDeclaration",
        ),
    },
    "/v1/models/{name}": {
        "parameters": [_NAME_PARAM],
        "get": _op("One model.", ok_response("ModelEntry", "Its declaration."), 404),
        "delete": _op(
            "Delete a model: drop its tables on every shard; its exports stay on disk.",
            ok_response("ShardModelDeleted", "Deleted."),
            404,
            503,
        ),
    },
    "/v1/stats": {"get": _op("Features, bytes and calls per table.", ok_response("Stats", "This shard's figures."))},
    "/v1/status": {
        "get": _op("The status board.", ok_response("StatusBoard", "Least recently reported first.")),
        "post": _op(
            "Report a status to the board.", ok_response("StatusAck", "Stored."), 400, 413, body="StatusReport"
        ),
    },
    "/v1/snapshots": {
        "post": _op(
            "Copy every table's rows for a cut.",
            ok_response("SnapshotRows", "Rows per table."),
            400,
            409,
            413,
            body="SnapshotRequest",
        ),
    },
    "/v1/snapshots/{version}": {
        "parameters": [_VERSION_PARAM],
        "get": _op(
            "The copies of a cut, handed over once.",
            {
                "200": {
                    "description": "The tables' copies as one .npz archive.",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                }
            },
            400,
            409,
        ),
        "delete": _op("Drop the copies of a cut (idempotent).", ok_response("Dropped", "Whether they were held."), 400),
    },
    "/v1/membership": {
        "get": _op("What the coordinator admits the shard on.", ok_response("Membership", "This shard."))
    },
    "/v1/membership/admit": {
        "post": _op(
            "Join the cluster at a version.", ok_response("Membership", "Joined."), 400, 409, 413, body="Admit"
        ),
    },
    "/v1/restore": {
        "post": _op(
            "Load a version from the exports directory (the shard leaves the cluster until admitted).",
            ok_response("Restored", "Loaded, or refused naming the file that does not check."),
            400,
            404,
            413,
            body="Restore",
        ),
    },
    "/metrics": {
        "get": _op(
            "The shard's figures in Prometheus text format (ps_core.net.shard_metrics).",
            {
                "200": {
                    "description": "Prometheus text exposition format.",
                    "content": {"text/plain": {"schema": {"type": "string"}}},
                }
            },
        )
    },
    "/healthz": {"get": _op("Liveness.", ok_response("ShardHealth", "Alive."), open_=True)},
    "/openapi.json": {
        "get": _op(
            "This document.",
            {"200": json_response({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1.")},
            open_=True,
        ),
    },
    "/v1/leases": {
        "post": _op(
            "A lease for one window of training.",
            ok_response("Lease", "Granted."),
            400,
            409,
            413,
            503,
            body="LeaseRequest",
        ),
    },
    "/v1/leases/release": {
        "post": _op(
            "Release a lease with its committed offsets.",
            ok_response("Released", "False: it had expired."),
            400,
            404,
            413,
            body="Release",
        ),
    },
    "/v1/leases/renew": {
        "post": _op(
            "Renew a lease while its window trains.",
            ok_response("Renewed", "False: it had expired."),
            400,
            404,
            413,
            body="LeaseRenewal",
        ),
    },
    "/v1/offsets": {
        "get": _op(
            "The latest committed offsets of a model.",
            ok_response("KnownOffsets", "And their stream."),
            404,
            params=[_MODEL_QUERY],
        )
    },
    "/v1/sync/join": {
        "post": _op(
            "A sync worker joins the barrier.", ok_response("SyncStep", "The open step."), 400, 413, body="SyncMember"
        ),
    },
    "/v1/sync/leave": {
        "post": _op(
            "A sync worker leaves the barrier.", ok_response("SyncStep", "The open step."), 400, 413, body="SyncMember"
        ),
    },
    "/v1/sync/arrive": {
        "post": _op(
            "A sync worker pushed its step: answers when the step closes.",
            ok_response("SyncStep", "The step closed (every member arrived, or the deadline passed)."),
            400,
            413,
            body="SyncArrive",
        ),
    },
    "/v1/sync/apply": {
        "post": _op(
            "Apply the gradients held for a closed step (once per step and table).",
            ok_response("SyncApplied", "Keys updated."),
            400,
            413,
            body="SyncApply",
        ),
    },
    "/v1/exports": {
        "get": _op(
            "A model's export versions on disk.", ok_response("ExportList", "Oldest first."), 404, params=[_MODEL_QUERY]
        ),
        "post": _op(
            "Cut and write a version now.",
            ok_response("ExportReport", "Written.", 201),
            400,
            409,
            413,
            500,
            503,
            507,
            body="ExportRequest",
            optional_body=True,
        ),
    },
    "/v1/exports/compact": {
        "post": _op(
            "Fold a model's newest chain into a base, then prune.",
            ok_response("Compaction", "Written."),
            404,
            500,
            params=[_MODEL_QUERY],
        ),
    },
}


def shard_document(served: set[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The OpenAPI document of a shard; with `served` (``(METHOD, path)``
    pairs, from the app's router), only the operations the app serves."""
    paths: dict[str, Any] = {}
    for path, item in _PATHS.items():
        ops = {k: v for k, v in item.items() if k == "parameters" or served is None or (k.upper(), path) in served}
        if set(ops) - {"parameters"}:
            paths[path] = ops
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ctrps shard",
            "version": "1",
            "description": "A shard's JSON routes and its Prometheus metrics (frame routes are binary and left out). "
            'Errors are {"error": code, "detail": reason}.',
        },
        "paths": paths,
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token of the route's scope (read, train, admin) derived from "
                    "the cluster secret (`ctrps token --scope ...`), when the shard holds one.",
                }
            },
        },
    }
