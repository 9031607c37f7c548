"""The HTTP API's OpenAPI 3.1 document (`openapi_document`), and how to
read a response's schema from it (`response_schema`, `path_template`).

Its schemas are derived from the request and response models of
`app.api.payloads` (the handlers decode with the same models). A serving
replica (``ctrps serve --follow``) serves its own variant (``replica=True``):
`/v1/model` always carries the served version and the follow state, and
mutating routes answer 409. The status board's models (`ps_core.store.board`),
the exporter's reports and the error body (`ps_core.net.shard_openapi`) are
the shard's own: the API relays what the shard checks.
"""

from __future__ import annotations

from typing import Any

from ps_core.bodies import components, ref
from ps_core.net.control_messages import (
    Compaction,
    ExportList,
    ExportReportBody,
    ExportRequest,
    StatusAck,
    StatusBoardBody,
)
from ps_core.net.shard_bodies import Error
from ps_core.net.shard_openapi import (
    EMBEDDINGS_NO_MIXTURE,
    FTRL_RULE,
    MIXTURE_RULE,
    created_response,
    json_response,
    ok_response,
    parameter,
)
from ps_core.store.board import StatusReport

from .payloads import (
    FEATURES_OR_KEYS,
    CreateModelRequest,
    Event,
    Health,
    HistoryBody,
    ModelCreated,
    ModelDeleted,
    ModelInfo,
    ModelList,
    PredictResponse,
    Ready,
    ReplicaModelInfo,
    WeightsRequest,
    WeightsResponse,
    predict_decoder,
)

__all__ = ["openapi_document", "response_schema", "path_template"]


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
    schemas["Event"]["anyOf"] = schemas["WeightsRequest"]["anyOf"] = FEATURES_OR_KEYS
    schemas["FTRL"]["anyOf"] = FTRL_RULE  # as the shard's document states it
    schemas["FTRLMixture"].update(MIXTURE_RULE)
    # A staleness bound is for async models only (the mode defaults to async).
    schemas["CreateModelRequest"]["allOf"] = [
        {
            "if": {"required": ["max_staleness"], "properties": {"max_staleness": {"type": "integer"}}},
            "then": {"properties": {"mode": {"const": "async"}}},
        },
        EMBEDDINGS_NO_MIXTURE,
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
            **_prediction_paths(),
            **_model_paths(read_only, model),
            **_board_and_export_paths(read_only, model, since),
            **_site_paths(),
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


def _prediction_paths() -> dict[str, Any]:
    """The predict and weights routes of the API's own model."""
    return {
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
    }


def _model_paths(read_only: tuple[int, ...], model: dict[str, Any]) -> dict[str, Any]:
    """The models' routes: list, create, delete, predict by name, describe."""
    return {
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
    }


def _board_and_export_paths(read_only: tuple[int, ...], model: dict[str, Any], since: dict[str, Any]) -> dict[str, Any]:
    """The status board, the exports and the dashboard's history."""
    return {
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
    }


def _site_paths() -> dict[str, Any]:
    """The dashboard page, health, metrics and this document."""
    return {
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
            "get": _op("Prometheus metrics (text format).", _text("text/plain", "Prometheus text exposition format."))
        },
        "/openapi.json": {
            "get": _op(
                "This document.",
                {"200": json_response({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1.")},
            )
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
