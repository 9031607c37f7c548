"""The OpenAPI 3.1 document of the HTTP API.

`openapi_document` describes every route: request bodies, and the body of
each success and error status. A serving replica (``ctrps serve --follow``)
serves its own variant (``replica=True``): `/v1/model` always carries the
served version and the follow state, and mutating routes answer 409. The
tests check every response the app gives against it with `validate` (`ps_core.schema`, re-exported here), which knows
exactly the keywords listed in `KEYWORDS` and refuses a schema using any
other, so a keyword the document starts to use can never be silently ignored.
The status board's schema (`ps_core.store.board`) and the exporter's reports
(`ps_core.net.shard_openapi`) are the shard's own, embedded as they are: the API
relays what the shard checks.
"""

from __future__ import annotations

from typing import Any

from ps_core.model.events import MAX_FEATURES, MAX_WEIGHT, REASONS
from ps_core.net.shard_openapi import COMPACTION_SCHEMA, EXPORT_LIST_SCHEMA, EXPORT_REPORT_SCHEMA
from ps_core.schema import KEYWORDS, SchemaError, validate
from ps_core.store.board import SOURCE_SCHEMA, STATUS_SCHEMA

__all__ = ["openapi_document", "validate", "response_schema", "KEYWORDS", "SchemaError"]


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


# What the handlers refuse as bad_features: neither features nor keys (or both null).
_FEATURES_OR_KEYS = [
    {"required": ["features"], "properties": {"features": {"type": "object"}}},
    {"required": ["keys"], "properties": {"keys": {"type": "array"}}},
]


def _nullable(name: str) -> dict[str, Any]:
    """The schema `name`, or null (which the handlers read as absent)."""
    return {"anyOf": [_ref(name), {"type": "null"}]}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_ERROR = _ref("Error")


def _closed(properties: dict[str, Any], *optional: str) -> dict[str, Any]:
    """An object with exactly these properties, all required but `optional`."""
    return {
        "type": "object",
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
        "properties": properties,
    }


def _errors(*statuses: int) -> dict[str, Any]:
    text = {
        400: "The body is not the request's shape (invalid_json, bad_request).",
        401: "Missing or wrong bearer token (unauthorized).",
        404: "Unknown model (unknown_model).",
        409: "A serving replica changes nothing (read_only_replica).",
        413: "The body is over the limit (too_large).",
        422: "Unusable content: no_events, too_many_events, or an event's validation reason.",
        502: "A shard refused the call (shard_error).",
        503: "A shard is unreachable (shard_unavailable); the detail names it. A serving "
        "replica: no export version loaded yet (no_version).",
    }
    out = {str(s): _json(_ERROR, text[s]) for s in statuses}
    out["default"] = _json(_ERROR, "Any other error (not_found, method_not_allowed, internal).")
    return out


def _schemas(max_events: int, replica: bool) -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    counts_by = {"type": "object", "additionalProperties": count}
    string, number, integer = {"type": "string"}, {"type": "number"}, {"type": "integer"}
    key = {"type": "integer", "minimum": 0, "maximum": 2**64 - 1}
    window = {"type": "object", "additionalProperties": {"type": ["number", "string", "null"]}}
    return {
        "Error": _closed(
            {
                "error": {"type": "string", "description": "A stable code, e.g. " + ", ".join(REASONS[:3])},
                "detail": {"type": "string", "minLength": 1},
            }
        ),
        "Features": {
            "type": "object",
            "description": "Strings are categorical (field=value), numbers numeric, lists of "
            "strings multi-hot, booleans the strings true/false; null is a missing feature.",
            "maxProperties": MAX_FEATURES,
            "additionalProperties": {
                "type": ["string", "number", "boolean", "array", "null"],
                "items": string,
                # A numeric value is kept as a float32 and must stay finite there.
                "minimum": -MAX_WEIGHT,
                "maximum": MAX_WEIGHT,
            },
            "examples": [{"site": "a3f09", "hour": "13", "price": 12.5, "tags": ["a", "b"]}],
        },
        "Keys": {
            "type": "array",
            "description": "Pre-hashed uint64 feature ids, used as they are "
            f"(at most {MAX_FEATURES} features and keys together).",
            "maxItems": MAX_FEATURES,
            "items": key,
        },
        "Event": {
            "type": "object",
            "description": "features and/or keys (at least one of them not null); other event "
            "fields (id, ts, label, weight) are validated as in training and otherwise ignored.",
            "properties": {
                "features": _nullable("Features"),
                "keys": _nullable("Keys"),
                "label": {"type": ["integer", "number", "null"], "enum": [0, 1, None]},
                "ts": {"type": ["number", "null"], "description": "Seconds since the epoch."},
                "weight": {"type": ["number", "null"], "minimum": 0, "maximum": MAX_WEIGHT},
            },
            "anyOf": _FEATURES_OR_KEYS,
        },
        "PredictRequest": _closed(
            {
                "events": {"type": "array", "minItems": 1, "maxItems": max_events, "items": _ref("Event")},
                "model": {"type": ["string", "null"], "description": "If given (not null), must be the served model."},
            },
            "model",
        ),
        "PredictResponse": _closed(
            {
                "predictions": {
                    "type": "array",
                    "items": {"type": "number", "minimum": 0, "maximum": 1},
                    "description": "Click probability of each event, in request order.",
                },
                "model": string,
                "model_version": {
                    "type": "integer",
                    "description": "Open export version of the weights read; on a serving "
                    "replica, the export version served.",
                },
            }
        ),
        "WeightsRequest": _closed(
            {
                "features": _nullable("Features"),
                "keys": _nullable("Keys"),
                "model": {"type": ["string", "null"], "description": "If given (not null), must be the served model."},
            },
            "features",
            "keys",
            "model",
        )
        | {"anyOf": _FEATURES_OR_KEYS},
        "FeatureWeights": _closed(
            {
                "feature": {
                    "type": ["string", "null"],
                    "description": "field=value, field (numeric), (bias), or null for a pre-hashed key.",
                },
                "key": key,
                "value": number,
                "present": {
                    "type": "boolean",
                    "description": "False: never trained; the weights are its initial value.",
                },
                "weights": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": number},
                },
            }
        ),
        "WeightsResponse": _closed(
            {
                "model": string,
                "model_version": integer,
                "tables": {"type": "array", "items": string},
                "weights": {"type": "array", "items": _ref("FeatureWeights")},
            }
        ),
        "TableInfo": _closed(
            {
                "declared": {"type": "boolean", "description": "Whether the shards hold the table."},
                "features": count,
                "bytes": count,
                "dim": {"type": "integer", "minimum": 1},
                "optimizer": {"type": "object"},
                "version": integer,
            },
            "version",
        ),
        "ModelInfo": _closed(
            {
                "model": string,
                "config": {"type": "object"},
                "update_mode": {"type": ["string", "null"]},
                "tables": {"type": "object", "additionalProperties": _ref("TableInfo")},
                "features": count,
                "bytes": count,
                "events_trained": count,
                "records_consumed": count,
                "windows": count,
                "dead_letters": _closed({"total": count, "by_reason": counts_by}),
                "last_window": {**window, "type": ["object", "null"]},
                "lag": _closed({"total": count, "by_partition": counts_by}),
                "workers": {
                    "type": "array",
                    "items": _closed({"source": string, "received_at": number, "age_s": number}),
                },
                "model_version": {"type": ["integer", "null"]},
                "last_export_version": {
                    "type": ["integer", "null"],
                    "description": "null until exports exist.",
                },
                "shards": {"type": "integer", "minimum": 1},
                "served_version": {
                    "type": ["integer", "null"],
                    "description": "A serving replica's export version; null until one is loaded.",
                },
                "follow": _ref("FollowInfo"),
            },
            # Only a serving replica reports what it serves.
            *(() if replica else ("served_version", "follow")),
        ),
        "FollowInfo": _closed(
            {
                "dir": {"type": "string", "description": "The model's export directory followed."},
                "interval_s": {"type": "number", "description": "Seconds between polls."},
                "base_version": {
                    "type": ["integer", "null"],
                    "description": "The base of the chain served.",
                },
                "newest_version": {
                    "type": ["integer", "null"],
                    "description": "The newest version directory seen at the last poll.",
                },
                "created_at": {
                    "type": ["string", "null"],
                    "description": "When the served version was cut (ISO 8601 UTC).",
                },
                "loaded_at": {**number, "type": ["number", "null"]},
                "last_poll_at": {**number, "type": ["number", "null"]},
                "last_load_ms": {
                    "type": ["number", "null"],
                    "minimum": 0,
                    "description": "Reading and hashing the last version (in a thread).",
                },
                "last_apply_ms": {
                    "type": ["number", "null"],
                    "minimum": 0,
                    "description": "The event loop's time applying the last delta or swapping a base in.",
                },
                "deltas_applied": count,
                "bases_loaded": count,
                "error": {
                    "type": ["string", "null"],
                    "description": "Why the last poll refused a version (file and checksums), else null.",
                },
            }
        ),
        "WorkerStatus": STATUS_SCHEMA,
        "StatusReport": _closed({"source": SOURCE_SCHEMA, "status": _ref("WorkerStatus")}),
        "ExportReport": EXPORT_REPORT_SCHEMA,
        "Compaction": COMPACTION_SCHEMA,
        "ExportList": EXPORT_LIST_SCHEMA,
        "StatusAck": _closed({"source": string, "received_at": number, "sources": {"type": "integer", "minimum": 1}}),
        "StatusBoard": _closed(
            {
                "statuses": {
                    "type": "array",
                    "items": _closed({"source": string, "received_at": number, "status": {"type": "object"}}),
                }
            }
        ),
        "HistoryPoint": _closed(
            {
                "t": {"type": "number", "description": "When sampled, seconds since the epoch."},
                "events_trained": count,
                "events_per_s": {
                    "type": ["number", "null"],
                    "minimum": 0,
                    "description": "Since the previous sample; null for the first or when the total fell.",
                },
                "logloss": {**number, "type": ["number", "null"]},
                "auc": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
                "copc": {**number, "type": ["number", "null"]},
                "lag": count,
                "dead_letters": count,
                "features": {**counts_by, "description": "Per table of the model, summed over shards."},
            }
        ),
        "History": _closed(
            {
                "model": string,
                "interval_s": {"type": "number", "description": "Seconds between samples."},
                "max_points": {"type": "integer", "minimum": 1},
                "error": {
                    "type": ["string", "null"],
                    "description": "Why the latest sample failed; null after a success.",
                },
                "points": {"type": "array", "items": _ref("HistoryPoint"), "description": "Oldest first."},
            }
        ),
        "Health": _closed({"status": {"type": "string", "enum": ["ok"]}}),
        "Ready": _closed(
            {"status": {"type": "string", "enum": ["ready"]}, "shards": {"type": "integer", "minimum": 1}}
        ),
    }


def openapi_document(max_events: int = 10_000, *, replica: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API (`max_events` bounds a predict
    request); with `replica`, of a serving replica (``ctrps serve --follow``)."""
    schemas = _schemas(max_events, replica)
    read_only = (409,) if replica else ()

    def body(name: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": _ref(name)}}}

    admin: list[dict[str, list[str]]] = [{"bearer": []}]
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
                "post": {
                    "summary": "Click probabilities of events, from the current weights.",
                    "requestBody": body("PredictRequest"),
                    "responses": {
                        "200": _json(_ref("PredictResponse"), "One probability per event."),
                        **_errors(400, 404, 413, 422, 502, 503),
                    },
                }
            },
            "/v1/weights": {
                "post": {
                    "summary": "Current weights of an event's features or of pre-hashed keys.",
                    "requestBody": body("WeightsRequest"),
                    "responses": {
                        "200": _json(_ref("WeightsResponse"), "The bias first, then each feature."),
                        **_errors(400, 404, 413, 422, 502, 503),
                    },
                }
            },
            "/v1/model": {
                "get": {
                    "summary": "Model configuration, size, training progress and lag.",
                    "responses": {
                        "200": _json(_ref("ModelInfo"), "The model as trained so far."),
                        **_errors(502, 503),
                    },
                }
            },
            "/v1/status": {
                "get": {
                    "summary": "The status board: the latest status of each worker.",
                    "responses": {
                        "200": _json(_ref("StatusBoard"), "Least recently reported first."),
                        **_errors(502, 503),
                    },
                },
                "post": {
                    "summary": "Report a status to the board (admin).",
                    "security": admin,
                    "requestBody": body("StatusReport"),
                    "responses": {
                        "200": _json(_ref("StatusAck"), "Stored."),
                        **_errors(400, 401, *read_only, 413, 502, 503),
                    },
                },
            },
            "/v1/exports": {
                "get": {
                    "summary": "The export versions on disk, oldest first.",
                    "responses": {
                        "200": _json(_ref("ExportList"), "The versions, and the last export's report."),
                        "404": _json(_ERROR, "Shard 0 hosts no exporter (no_coordinator)."),
                        **_errors(502, 503),
                    },
                },
                "post": {
                    "summary": "Cut and write a model version now (admin): a consistent cut of every shard.",
                    "security": admin,
                    "requestBody": {
                        "required": False,
                        "content": {
                            "application/json": {
                                "schema": _closed({"kind": {"type": "string", "enum": ["base", "delta"]}}, "kind")
                            }
                        },
                    },
                    "responses": {
                        "201": _json(_ref("ExportReport"), "Written."),
                        "400": _json(
                            _ERROR, 'The body is not {} or {"kind": "base" | "delta"} (invalid_json, bad_request).'
                        ),
                        "404": _json(_ERROR, "Shard 0 hosts no exporter (no_coordinator)."),
                        **_errors(401, *read_only, 413, 502, 503),
                    },
                },
            },
            "/v1/exports/compact": {
                "post": {
                    "summary": "Fold the newest chain into a base of its newest version, then prune (admin).",
                    "security": admin,
                    "responses": {
                        "200": _json(_ref("Compaction"), "The base written, what it folds and what was pruned."),
                        "404": _json(_ERROR, "Shard 0 hosts no exporter (no_coordinator), or there is no version."),
                        **_errors(401, *read_only, 502, 503),
                    },
                }
            },
            "/v1/history": {
                "get": {
                    "summary": "The dashboard's samples of the cluster, kept in this process.",
                    "parameters": [
                        {
                            "name": "since",
                            "in": "query",
                            "required": False,
                            "description": "Only points taken after this time (seconds since the epoch).",
                            "schema": {"type": "number"},
                        }
                    ],
                    "responses": {
                        "200": _json(_ref("History"), "The newest max_points samples."),
                        "400": _json(_ERROR, "since is not a finite number (bad_request)."),
                        **_errors(),
                    },
                }
            },
            "/": {
                "get": {
                    "summary": "The dashboard: one self-contained HTML page drawing /v1/history.",
                    "responses": {
                        "200": {
                            "description": "An HTML page with inline script and style.",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        },
                        **_errors(),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness: the process answers.",
                    "responses": {"200": _json(_ref("Health"), "Alive."), **_errors()},
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: every shard answers.",
                    "responses": {
                        "200": _json(_ref("Ready"), "Every shard answered."),
                        **_errors(503),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics (text format).",
                    "responses": {
                        "200": {
                            "description": "Prometheus text exposition format.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        },
                        **_errors(),
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {
                        "200": _json({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1."),
                        **_errors(),
                    },
                }
            },
        },
        "components": {
            "schemas": schemas,
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
    responses = doc["paths"][path][method.lower()]["responses"]
    response = responses.get(str(status)) or responses["default"]
    schema: dict[str, Any] = response["content"][content_type]["schema"]
    return schema
