"""The HTTP API's bodies as models, and its OpenAPI 3.1 document.

Each request body is one `msgspec.Struct` (`ps_core.bodies`): the handlers
decode with it (`predict_decoder`, `WEIGHTS`, `check_status_report`) and
`openapi_document` derives its schemas from the same models, with every
response body's. A serving replica (``ctrps serve --follow``) serves its own
variant (``replica=True``): `/v1/model` always carries the served version and
the follow state, and mutating routes answer 409. The status board's models
(`ps_core.store.board`), the exporter's reports and the error body
(`ps_core.net.shard_openapi`) are the shard's own: the API relays what the
shard checks.

An event's content is the hasher's to check (`ps_core.model.events`, the
same rules as training, each with its reason: 422): the request models take
events, features and keys as decoded JSON, and `Event` publishes the hasher's
rules, from its constants.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from ps_core.bodies import NUMERIC_PATTERN, components, ref
from ps_core.model.events import MAX_FEATURES, MAX_FLOAT32, MAX_TS, MAX_VALUE, MAX_WEIGHT
from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.net.control_messages import (
    Compaction,
    ExportList,
    ExportReportBody,
    ExportRequest,
    StatusAck,
    StatusBoardBody,
)
from ps_core.net.shard_bodies import Count, CountsBy, Error, LifecycleBody, NewModelName, Optimizer, OptimizerName
from ps_core.net.shard_openapi import FTRL_RULE, created_response, json_response, ok_response, parameter
from ps_core.store.board import StatusReport

__all__ = [
    "openapi_document",
    "response_schema",
    "path_template",
    "predict_decoder",
    "PredictRequest",
    "WeightsRequest",
    "Event",
    "WEIGHTS",
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
_FEATURES_OR_KEYS = [
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
    dir: Annotated[str, Meta(description="The model's export directory followed.")]
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
    error: Annotated[
        str | None, Meta(description="Why the last poll refused a version (file and checksums), else null.")
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


_ERROR = ref("Error")


def _errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "The body is not the request's shape (invalid_json, bad_request).",
        401: "Missing or wrong bearer token (unauthorized).",
        404: "Unknown model (unknown_model).",
        409: "A serving replica changes nothing (read_only_replica).",
        413: "The body is over the limit (too_large).",
        422: "Unusable content: no_events, too_many_events, or an event's validation reason.",
        502: "A shard refused the call (shard_error).",
        503: "A shard is unreachable (shard_unavailable), or answers from another place than "
        "the shard list gives it (wrong_shard_order); the detail names it. A serving "
        "replica: no export version loaded yet (no_version).",
    }
    out = {str(s): json_response(_ERROR, text[s]) for s in statuses}
    out["default"] = json_response(_ERROR, "Any other error (not_found, method_not_allowed, internal).")
    return out


def _schemas(max_events: int, replica: bool) -> dict[str, Any]:
    schemas = components(
        (
            Error,
            Event,
            predict_decoder(max_events).type,
            PredictResponse,
            WeightsRequest,
            WeightsResponse,
            ReplicaModelInfo if replica else ModelInfo,
            ModelList,
            CreateModelRequest,
            ModelCreated,
            ModelDeleted,
            StatusReport,
            StatusAck,
            StatusBoardBody,
            ExportRequest,
            ExportReportBody,
            Compaction,
            ExportList,
            HistoryBody,
            Health,
            Ready,
        )
    )
    # The one rule no field's type states; the hasher refuses its breach as bad_features.
    schemas["Event"]["anyOf"] = schemas["WeightsRequest"]["anyOf"] = _FEATURES_OR_KEYS
    schemas["FTRL"]["anyOf"] = FTRL_RULE  # as the shard's document states it
    # A staleness bound is for async models only (the mode defaults to async).
    schemas["CreateModelRequest"]["allOf"] = [
        {
            "if": {"required": ["max_staleness"], "properties": {"max_staleness": {"type": "integer"}}},
            "then": {"properties": {"mode": {"const": "async"}}},
        }
    ]
    return schemas


def _op(
    summary: str,
    ok: dict[str, Any],
    *errors: int,
    body: str | None = None,
    body_required: bool = True,
    admin: bool = False,
    own: dict[int, str] | None = None,
) -> dict[str, Any]:
    """An operation: its success responses `ok`, the errors of `errors`
    (`_errors`' texts) and of `own` (status: text of its own), the request
    model `body`; `admin` routes need the admin token."""
    out: dict[str, Any] = {"summary": summary}
    if admin:
        out["security"] = [{"bearer": []}]
    if body is not None:
        out["requestBody"] = {"required": body_required, "content": {"application/json": {"schema": ref(body)}}}
    mine = {str(status): json_response(_ERROR, text) for status, text in (own or {}).items()}
    out["responses"] = {**ok, **mine, **_errors(*errors)}
    return out


def _text(content_type: str, description: str) -> dict[str, Any]:
    return {"200": {"description": description, "content": {content_type: {"schema": {"type": "string"}}}}}


_NO_EXPORTER = "Shard 0 hosts no exporter (no_coordinator)."


def openapi_document(max_events: int = 10_000, *, replica: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API (`max_events` bounds a predict
    request); with `replica`, of a serving replica (``ctrps serve --follow``)."""
    read_only = (409,) if replica else ()
    model = parameter(
        "model",
        "query",
        "A model served (GET /v1/models; default: the API's own); another is 404 unknown_model.",
        {"type": "string"},
    )
    since = parameter(
        "since", "query", "Only points taken after this time (seconds since the epoch).", {"type": "number"}
    )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "ctrps",
            "version": "1",
            "description": "Predictions and model information from an online-learning "
            "parameter server for sparse CTR models. Errors are "
            '{"error": code, "detail": reason}.',
        },
        "paths": {
            "/v1/predict": {
                "post": _op(
                    "Click probabilities of events, from the current weights.",
                    ok_response("PredictResponse", "One probability per event."),
                    *(400, 404, 413, 422, 502, 503),
                    body="PredictRequest",
                )
            },
            "/v1/weights": {
                "post": _op(
                    "Current weights of an event's features or of pre-hashed keys.",
                    ok_response("WeightsResponse", "The bias first, then each feature."),
                    *(400, 404, 413, 422, 502, 503),
                    body="WeightsRequest",
                )
            },
            "/v1/models": {
                "get": _op(
                    "The models this server serves, with their predict routes.",
                    ok_response("ModelList", "The API's own first, then by name."),
                    *(502, 503),
                ),
                "post": _op(
                    "Create a model on the cluster (admin): its tables declared on every shard.",
                    created_response("ModelCreated", "Exists already, identically."),
                    *(400, 401, *read_only, 413, 502, 503),
                    body="CreateModelRequest",
                    admin=True,
                    own={
                        404: _NO_EXPORTER,
                        409: "The model exists with another type or configuration, or its tables do "
                        "(model_conflict, table_conflict, mode_conflict).",
                    },
                ),
            },
            "/v1/models/{name}": {
                "delete": {
                    **_op(
                        "Delete a model (admin): its tables dropped on every shard, its exports left on disk.",
                        ok_response("ModelDeleted", "Deleted."),
                        *(401, *read_only, 502, 503),
                        admin=True,
                        own={
                            404: "No such model (unknown_model), or shard 0 hosts no exporter (no_coordinator).",
                            409: "The cluster's default model is not deleted (model_conflict).",
                        },
                    ),
                    "parameters": [parameter("name", "path", "A model of the cluster.", {"type": "string"})],
                }
            },
            "/v1/models/{name}/predict": {
                "post": {
                    **_op(
                        "Click probabilities of events, from the current weights of model `name`.",
                        ok_response("PredictResponse", "One probability per event."),
                        *(400, 404, 413, 422, 502, 503),
                        body="PredictRequest",
                    ),
                    "parameters": [
                        parameter(
                            "name",
                            "path",
                            "A served model (GET /v1/models); another is 404 unknown_model.",
                            {"type": "string"},
                        )
                    ],
                }
            },
            "/v1/model": {
                "get": {
                    "parameters": [model],
                    **_op(
                        "Model configuration, size, training progress and lag.",
                        ok_response("ModelInfo", "The model as trained so far."),
                        *(404, 502, 503),
                    ),
                }
            },
            "/v1/status": {
                "get": _op(
                    "The status board: the latest status of each worker.",
                    ok_response("StatusBoard", "Least recently reported first."),
                    *(502, 503),
                ),
                "post": _op(
                    "Report a status to the board (admin).",
                    ok_response("StatusAck", "Stored."),
                    *(400, 401, *read_only, 413, 502, 503),
                    body="StatusReport",
                    admin=True,
                ),
            },
            "/v1/exports": {
                "get": {
                    "parameters": [model],
                    **_op(
                        "A model's export versions on disk, oldest first.",
                        ok_response("ExportList", "The versions, and the last export's report."),
                        *(502, 503),
                        own={404: _NO_EXPORTER + " Or no such model (unknown_model)."},
                    ),
                },
                "post": _op(
                    "Cut and write a model version now (admin): a consistent cut of every shard.",
                    ok_response("ExportReport", "Written.", 201),
                    *(401, *read_only, 413, 502, 503),
                    body="ExportRequest",
                    body_required=False,
                    admin=True,
                    own={
                        400: 'The body is not {} or {"kind": "base" | "delta"} (invalid_json, bad_request).',
                        404: _NO_EXPORTER,
                    },
                ),
            },
            "/v1/exports/compact": {
                "post": {
                    "parameters": [model],
                    **_op(
                        "Fold a model's newest chain into a base of its newest version, then prune (admin).",
                        ok_response("Compaction", "The base written, what it folds and what was pruned."),
                        *(401, *read_only, 502, 503),
                        admin=True,
                        own={404: "Shard 0 hosts no exporter (no_coordinator), no such model, or no version."},
                    ),
                }
            },
            "/v1/history": {
                "get": {
                    "parameters": [since, model],
                    **_op(
                        "The dashboard's samples of the cluster, kept in this process.",
                        ok_response("History", "The newest max_points samples."),
                        own={400: "since is not a finite number (bad_request)."},
                    ),
                }
            },
            "/": {
                "get": _op(
                    "The dashboard: one self-contained HTML page drawing /v1/history.",
                    _text("text/html", "An HTML page with inline script and style."),
                )
            },
            "/healthz": {"get": _op("Liveness: the process answers.", ok_response("Health", "Alive."))},
            "/readyz": {
                "get": _op(
                    "Readiness: every shard answers, each in its place of the shard list.",
                    ok_response("Ready", "Every shard answered."),
                    503,
                )
            },
            "/metrics": {
                "get": _op(
                    "Prometheus metrics (text format).", _text("text/plain", "Prometheus text exposition format.")
                )
            },
            "/openapi.json": {
                "get": _op(
                    "This document.",
                    {"200": json_response({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1.")},
                )
            },
        },
        "components": {
            "schemas": _schemas(max_events, replica),
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "CTRPS_ADMIN_TOKEN, when the server has one.",
                }
            },
        },
    }


def response_schema(
    doc: dict[str, Any], path: str, method: str, status: int, content_type: str = "application/json"
) -> dict[str, Any]:
    """The schema `doc` gives for a response (the operation's ``default``
    response when the status is not listed). KeyError if the document has
    no such operation or content type."""
    responses = doc["paths"][path_template(doc, path)][method.lower()]["responses"]
    response = responses.get(str(status)) or responses["default"]
    schema: dict[str, Any] = response["content"][content_type]["schema"]
    return schema


def path_template(doc: dict[str, Any], path: str) -> str:
    """The path of `doc` that `path` is an instance of (`path` itself when none is)."""
    paths = doc["paths"]
    return path if path in paths else next((t for t in paths if _matches(t, path)), path)


def _matches(template: str, path: str) -> bool:
    """Whether `path` is an instance of a path `template` (``{name}`` segments match any one segment)."""
    t, p = template.split("/"), path.split("/")
    return len(t) == len(p) and all(a == b or (a.startswith("{") and a.endswith("}") and b) for a, b in zip(t, p))
