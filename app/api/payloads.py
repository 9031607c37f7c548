"""The HTTP API's request and response bodies, as models.

Each request body is one `msgspec.Struct` (`ps_core.bodies`): the handlers
decode with it (`predict_decoder`, `WEIGHTS`, `check_status_report`) and
`app.api.openapi.openapi_document` derives its schemas from the same models,
with every response body's.

An event's content is the hasher's to check (`ps_core.model.events`, the
same rules as training, each with its reason: 422): the request models take
events, features and keys as decoded JSON, and `Event` publishes the hasher's
rules, from its constants.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ps_core.bodies import NUMERIC_PATTERN, ref
from ps_core.model.events import MAX_FEATURES, MAX_FLOAT32, MAX_TS, MAX_VALUE, MAX_WEIGHT
from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.net.shard_bodies import (
    Count,
    CountsBy,
    LifecycleBody,
    NewModelName,
    Optimizer,
    OptimizerName,
)

__all__ = [
    "predict_decoder",
    "PredictRequest",
    "WeightsRequest",
    "Event",
    "WEIGHTS",
    "FEATURES_OR_KEYS",
]

# -- requests -------------------------------------------------------------------------

# A numeric value is kept as a float32 and must stay finite there; as the
# model is fed it (raw, log1p, divided) it is at most MAX_VALUE in magnitude.
FeatureValue = (
    str
    | Annotated[
        float,
        Meta(ge=-MAX_FLOAT32, le=MAX_FLOAT32, description=f"Fed to the model at most {MAX_VALUE:g} in magnitude."),
    ]
    | bool
    | list[str]
    | None
)
Features = Annotated[
    dict[str, FeatureValue],
    Meta(
        max_length=MAX_FEATURES,
        description="Strings are categorical (field=value), numbers numeric, lists of "
        "strings multi-hot, booleans the strings true/false; null is a missing feature.",
        examples=[{"site": "a3f09", "hour": "13", "price": 12.5, "tags": ["a", "b"]}],
    ),
]
Keys = Annotated[
    list[Annotated[int, Meta(ge=0, extra_json_schema={"maximum": 2**64 - 1})]],
    Meta(
        max_length=MAX_FEATURES,
        description=f"Pre-hashed uint64 feature ids, used as they are (at most {MAX_FEATURES} "
        "features and keys together).",
    ),
]
# As decoded JSON for the hasher, published with the rules above.
RawFeatures = Annotated[dict[str, Any], Meta(extra_json_schema=msgspec.json.schema(Features))]
RawKeys = Annotated[list[Any], Meta(extra_json_schema=msgspec.json.schema(Keys))]
ServedModel = Annotated[str | None, Meta(description="If given (not null), must be the served model.")]

# What the hasher refuses as bad_features: neither features nor keys (or both null).
FEATURES_OR_KEYS = [
    {"required": ["features"], "properties": {"features": {"type": "object"}}},
    {"required": ["keys"], "properties": {"keys": {"type": "array"}}},
]


class Event(Struct):
    """features and/or keys (at least one of them not null); other event
    fields (id, ts, label, weight) are validated as in training and otherwise ignored."""

    features: Features | None = None
    keys: Keys | None = None
    label: Literal[0, 1] | None = None
    ts: Annotated[float, Meta(ge=0, lt=MAX_TS, description="Seconds since the epoch.")] | None = None
    weight: Annotated[float, Meta(ge=0, le=MAX_WEIGHT)] | None = None


class PredictRequest(Struct, forbid_unknown_fields=True):
    """Events to score; `predict_decoder` bounds their number."""

    events: Annotated[list[Any], Meta(min_length=1, extra_json_schema={"items": ref("Event")})]
    model: ServedModel = None


def predict_decoder(max_events: int) -> msgspec.json.Decoder[PredictRequest]:
    """The decoder of `PredictRequest` bodies of at most `max_events` events."""
    bounded = msgspec.defstruct(
        "PredictRequest",
        [
            (
                "events",
                Annotated[
                    list[Any], Meta(min_length=1, max_length=max_events, extra_json_schema={"items": ref("Event")})
                ],
            )
        ],
        bases=(PredictRequest,),
        module=__name__,
    )
    return msgspec.json.Decoder(cast(type[PredictRequest], bounded))


class WeightsRequest(Struct, forbid_unknown_fields=True):
    """An event's features and/or pre-hashed keys to look up."""

    features: RawFeatures | None = None
    keys: RawKeys | None = None
    model: ServedModel = None


WEIGHTS = msgspec.json.Decoder(WeightsRequest)

# -- responses ------------------------------------------------------------------------


class PredictResponse(Struct, forbid_unknown_fields=True):
    predictions: Annotated[
        list[Annotated[float, Meta(ge=0, le=1)]],
        Meta(description="Click probability of each event, in request order."),
    ]
    model: str
    model_version: Annotated[
        int,
        Meta(description="Open export version of the weights read; on a serving replica, the export version served."),
    ]


class FeatureWeights(Struct, forbid_unknown_fields=True):
    feature: Annotated[
        str | None, Meta(description="field=value, field (numeric), (bias), or null for a pre-hashed key.")
    ]
    key: Annotated[int, Meta(ge=0, extra_json_schema={"maximum": 2**64 - 1})]
    value: Annotated[
        float,
        Meta(description="What the model multiplies: 1, or a number as fed (sign(x) log1p(|x|) / 16 under log1p/16)."),
    ]
    present: Annotated[bool, Meta(description="False: never trained; the weights are its initial value.")]
    weights: dict[str, list[float]]


class WeightsResponse(Struct, forbid_unknown_fields=True):
    model: str
    model_version: int
    tables: list[str]
    weights: list[FeatureWeights]


class TableLifecycleInfo(Struct, forbid_unknown_fields=True):
    """The table's lifecycle rules and, summed over shards, what they did."""

    rules: LifecycleBody
    evicted: Annotated[CountsBy, Meta(description="Rows removed, by rule.")]
    eviction_passes: Count
    bytes_freed: Count
    last_eviction_ms: Annotated[float, Meta(ge=0, description="The longest last pass over shards.")] | None
    admitted: Count
    dropped: Annotated[Count, Meta(description="Key updates dropped: no row, not admitted.")]


class StalenessInfo(Struct, forbid_unknown_fields=True):
    """How stale the table's async pushes were, over its shards (pushes
    applied between a gradient's pull and its push)."""

    pushes: Annotated[Count, Meta(description="Pushes whose staleness was counted.")]
    mean: Annotated[float, Meta(ge=0)] | None
    down_weighted: Annotated[Count, Meta(description="Pushes scaled down past max_staleness.")]
    max_staleness: Count | None


class TableInfo(Struct, forbid_unknown_fields=True):
    declared: Annotated[bool, Meta(description="Whether the shards hold the table.")]
    features: Count
    bytes: Count
    dim: Annotated[int, Meta(ge=1)]
    optimizer: dict[str, Any]
    mode: Annotated[Literal["async", "sync", "geo"], Meta(description="How workers update it.")]
    version: int | UnsetType = UNSET
    lifecycle: TableLifecycleInfo | UnsetType = UNSET
    staleness: StalenessInfo | UnsetType = UNSET


class DeadLetters(Struct, forbid_unknown_fields=True):
    total: Count
    by_reason: CountsBy


class Lag(Struct, forbid_unknown_fields=True):
    total: Count
    by_partition: CountsBy


class WorkerSeen(Struct, forbid_unknown_fields=True):
    source: str
    received_at: float
    age_s: float


class FollowInfo(Struct, forbid_unknown_fields=True):
    dir: Annotated[str, Meta(description="The model's exports followed: a directory or s3://bucket/prefix/<model>.")]
    interval_s: Annotated[float, Meta(description="Seconds between polls.")]
    base_version: Annotated[int | None, Meta(description="The base of the chain served.")]
    newest_version: Annotated[int | None, Meta(description="The newest version directory seen at the last poll.")]
    created_at: Annotated[str | None, Meta(description="When the served version was cut (ISO 8601 UTC).")]
    loaded_at: float | None
    last_poll_at: float | None
    last_load_ms: Annotated[
        Annotated[float, Meta(ge=0)] | None, Meta(description="Reading and hashing the last version (in a thread).")
    ]
    last_apply_ms: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(description="The event loop's time applying the last delta or swapping a base in."),
    ]
    deltas_applied: Count
    bases_loaded: Count
    read_failures: Annotated[
        int, Meta(ge=0, description="Reads that failed: a version refused, or the export store not answering.")
    ]
    error: Annotated[
        str | None,
        Meta(
            description="Why the last poll refused a version (file and checksums) or the export store did not answer, else null."
        ),
    ]


class ModelSummary(Struct, forbid_unknown_fields=True):
    """One model this server serves."""

    name: str
    type: Annotated[str | None, Meta(description="lr or fm (null: a default model never created as one).")]
    tables: list[str]
    update_mode: Annotated[str | None, Meta(description="async, sync or geo: how its workers update it.")]
    predict: Annotated[str, Meta(description="Its predict route.")]
    default: Annotated[bool, Meta(description="The API's own model: the one a request naming none means.")]


class ModelList(Struct, forbid_unknown_fields=True):
    """The models this server serves: its own, and every model its cluster holds."""

    default: str
    models: list[ModelSummary]


Hyperparameters = OptimizerName | Optimizer
"""An optimizer by name (its defaults), or with its hyperparameters: the
shard's own declaration of one (`ps_core.net.shard_openapi`)."""


class CreateModelRequest(Struct, forbid_unknown_fields=True):
    """A model to create on the cluster (``ctrps model create``'s flags)."""

    name: NewModelName
    type: Literal["lr", "fm"] = "lr"
    optimizer: Hyperparameters | None = None
    embedding_optimizer: Hyperparameters | None = None
    factors: Annotated[int, Meta(ge=1, le=1024)] = 8
    mode: Literal["async", "sync", "geo"] = "async"
    max_staleness: Annotated[int, Meta(ge=0, le=1_000_000)] | None = None
    numeric: Annotated[
        str,
        Meta(
            pattern=NUMERIC_PATTERN.removesuffix("$") + r"\Z",
            description="Numeric features fed as sent (raw), or as sign(x) log1p(|x|) (log1p); /D divides them by "
            "D > 0.",
        ),
    ] = DEFAULT_NUMERIC


class ModelCreated(Struct, forbid_unknown_fields=True):
    created: bool
    model: dict[str, Any]


class ModelDeleted(Struct, forbid_unknown_fields=True):
    deleted: dict[str, Any]
    tables_dropped: list[str]
    exports: str | None


class ModelInfo(Struct, forbid_unknown_fields=True, kw_only=True):
    """The model as trained so far."""

    model: str
    config: dict[str, Any]
    update_mode: str | None
    tables: dict[str, TableInfo]
    features: Count
    bytes: Count
    events_trained: Count
    records_consumed: Count
    windows: Count
    dead_letters: DeadLetters
    last_window: dict[str, float | str | None] | None
    lag: Lag
    workers: list[WorkerSeen]
    model_version: int | None
    last_export_version: Annotated[int | None, Meta(description="null until exports exist.")]
    shards: Annotated[int, Meta(ge=1)]
    # Only a serving replica reports what it serves (`ReplicaModelInfo`).
    served_version: (
        Annotated[int | None, Meta(description="A serving replica's export version; null until one is loaded.")]
        | UnsetType
    ) = UNSET
    precision: (
        Annotated[
            Literal["f32", "f16", "int8"],
            Meta(description="What a serving replica holds the weights in (its exports' serving precision)."),
        ]
        | UnsetType
    ) = UNSET
    follow: FollowInfo | UnsetType = UNSET


# A serving replica's, under the same name in its document.
ReplicaModelInfo = msgspec.defstruct(
    "ModelInfo",
    [
        (
            "served_version",
            Annotated[int | None, Meta(description="A serving replica's export version; null until one is loaded.")],
        ),
        (
            "precision",
            Annotated[
                Literal["f32", "f16", "int8"],
                Meta(description="What a serving replica holds the weights in (its exports' serving precision)."),
            ],
        ),
        ("follow", FollowInfo),
    ],
    bases=(ModelInfo,),
    kw_only=True,
    module=__name__,
)


class HistoryPointBody(Struct, forbid_unknown_fields=True):
    t: Annotated[float, Meta(description="When sampled, seconds since the epoch.")]
    events_trained: Count
    events_per_s: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(
            description="Over the last 30 s of the workers' reports (several windows), summed over workers; "
            "null until a worker has reported twice."
        ),
    ]
    logloss: float | None
    auc: Annotated[float, Meta(ge=0, le=1)] | None
    copc: float | None
    lag: Count
    dead_letters: Count
    features: Annotated[CountsBy, Meta(description="Per table of the model, summed over shards.")]
    workers: Annotated[Count, Meta(description="Workers of the model on the status board.")]
    predict_mean_ms: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(description="Mean latency (ms) of the model's predict requests over the last 30 s; null: none."),
    ]
    predict_p50_ms: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(description="Their median latency (ms), estimated from the latency histogram's buckets; null: none."),
    ]
    predict_p99_ms: Annotated[
        Annotated[float, Meta(ge=0)] | None,
        Meta(description="Their p99 latency (ms), estimated from the latency histogram's buckets; null: none."),
    ]


class HistoryBody(Struct, forbid_unknown_fields=True):
    model: str
    interval_s: Annotated[float, Meta(description="Seconds between samples.")]
    max_points: Annotated[int, Meta(ge=1)]
    error: Annotated[str | None, Meta(description="Why the latest sample failed; null after a success.")]
    points: Annotated[list[HistoryPointBody], Meta(description="Oldest first.")]


class Health(Struct, forbid_unknown_fields=True):
    status: Literal["ok"]


class Ready(Struct, forbid_unknown_fields=True):
    status: Literal["ready"]
    shards: Annotated[int, Meta(ge=1)]
