"""The OpenAPI 3.1 document of the shard's JSON routes (``GET /openapi.json``
on every shard's HTTP port), so they can be fuzzed like the API's.

It documents the routes of `ps_core.net.server` and, on shard 0 with a
coordinator and exporter, of `ps_core.checkpoint.routes`: tables, stats,
status, snapshots, membership, restore, leases, offsets, exports. The
binary frame routes (``/v1/pull``, ``/v1/push``, ``/v1/push_pull``,
``/v1/changes``) are left out: their bodies are `ps_core.net.codec` frames,
not JSON, and the codec has its own tests; so is ``POST
/v1/slots/take_over``, whose body is a hand-off's ``.npz`` archive
(tests/test_slot_moves.py). `shard_document` keeps only the paths the app serves.

The schemas are derived from the bodies' models (`ps_core.net.shard_bodies`,
`ps_core.net.control_messages`), the ones the routes decode with. The
exporter's reports (`ExportReport`, `Compaction`, `ExportList`) and the
status board's models (`ps_core.store.board`) are in the API's document
too: the API relays them.
"""

from __future__ import annotations

from typing import Any, Literal

from ..bodies import components, ref
from ..store.board import StatusReport
from ..store.optim import MIN_POSITIVE, FTRLMixture
from ..store.snapshot import MAX_VERSION
from .control_messages import (
    Admit,
    Compaction,
    Dropped,
    ExportList,
    ExportReportBody,
    ExportRequest,
    HandOff,
    KnownOffsets,
    LeaseBody,
    LeaseRenewal,
    LeaseRequest,
    MembershipBody,
    ModelDeclaration,
    ModelEntry,
    MoveRequest,
    Release,
    Released,
    Renewed,
    Restore,
    Restored,
    ShardModelCreatedBody,
    ShardModelDeletedBody,
    ShardModelListBody,
    SlotMapBody,
    SlotMapTaken,
    SlotsMoved,
    SnapshotRequest,
    SnapshotRows,
    StatusAck,
    StatusBoardBody,
    SyncApplied,
    SyncApply,
    SyncArrive,
    SyncMember,
    SyncStep,
    TableDropped,
    TakenOver,
)
from .shard_bodies import Declared, Error, ShardHealthBody, Stats, Table, TableDeclaration

__all__ = ["shard_document", "json_response", "ok_response", "created_response", "parameter", "FTRL_RULE"]

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
    SlotMapBody,
    SlotMapTaken,
    HandOff,
    TakenOver,
    MoveRequest,
    SlotsMoved,
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


_LEARNERS = range(1, FTRLMixture.MAX_LEARNERS + 1)
MIXTURE_RULE: dict[str, Any] = {
    "dependentRequired": {
        **{f"l1_{i}": [f"alpha_{i}"] for i in _LEARNERS},
        **{f"alpha_{i}": [f"alpha_{i - 1}"] for i in _LEARNERS if i > 1},
    },
    "anyOf": FTRL_RULE,
}
"""What a mixture's fields do not state: its learners are numbered from 1
without gaps, an l1_i goes with its alpha_i, and beta or l2 is positive (as FTRL's)."""


def _is_mixture(learners: int | None) -> dict[str, Any]:
    """An optimizer that is a mixture of `learners` (None: of its default learners)."""
    if learners is None:
        named = {"not": {"required": ["alpha_1"]}}
        return {"anyOf": [{"const": FTRLMixture.name}, {"type": "object", **named, **_mixture_named()}]}
    last: dict[str, Any] = {"not": {"required": [f"alpha_{learners + 1}"]}} if learners < len(_LEARNERS) else {}
    return {"type": "object", "required": ["name", f"alpha_{learners}"], **_mixture_named(), **last}


def _mixture_named() -> dict[str, Any]:
    return {"properties": {"name": {"const": FTRLMixture.name}}}


def mixture_table_rules() -> list[dict[str, Any]]:
    """A table of a mixture of K learners has dim 2K (10 for the default
    five), starts at zero and takes no lazy embeddings."""
    rules: list[dict[str, Any]] = []
    default = len(FTRLMixture.DEFAULT_LEARNERS)
    for k in [None, *_LEARNERS]:
        dim = 2 * (default if k is None else k)
        rules.append(
            {
                "if": {"required": ["optimizer"], "properties": {"optimizer": _is_mixture(k)}},
                "then": {
                    "required": ["dim"],
                    "properties": {
                        "dim": {"const": dim},
                        "init_scale": {"const": 0},
                        "lifecycle": {"properties": {"embed_threshold": {"const": 0}}},
                    },
                },
            }
        )
    return rules


EMBEDDINGS_NO_MIXTURE: dict[str, Any] = {
    "if": {"required": ["type", "embedding_optimizer"], "properties": {"type": {"const": "fm"}}},
    "then": {
        "properties": {
            "embedding_optimizer": {
                "not": {
                    "anyOf": [
                        {"const": FTRLMixture.name},
                        {"type": "object", "properties": {"name": {"const": FTRLMixture.name}}, "required": ["name"]},
                    ]
                }
            }
        }
    },
}
"""An FM's embeddings are no mixture of learners (its log-weights are the
linear table's alone)."""


def _schemas() -> dict[str, Any]:
    schemas = components(_MODELS)
    schemas["FTRLMixture"].update(MIXTURE_RULE)
    schemas["Tables"] = {"type": "object", "additionalProperties": ref("Table")}
    # The one rule no field's type states: FTRL divides a fresh row by
    # beta / alpha + l2, so one of them (each defaulting to 1) must be positive.
    schemas["FTRL"]["anyOf"] = FTRL_RULE
    # Rules across fields: a staleness bound is for async tables only, and
    # lazy embeddings need embeddings (dim > 1).
    schemas["ModelDeclaration"]["allOf"] = [
        {"if": {"required": ["max_staleness"]}, "then": {"properties": {"mode": {"const": "async"}}}},
        EMBEDDINGS_NO_MIXTURE,
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
        *mixture_table_rules(),
    ]
    return schemas


_SCHEMAS = _schemas()


# -- document helpers, shared with the API's document (app.api.openapi) ------------------


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
    502: "A slot move's destination did not take the slots; the source took them back (move_failed).",
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


_EPOCH_PARAM = parameter(
    "epoch", "path", "The slot map epoch, in ASCII digits.", {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}
)
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
    "/v1/slots": {
        "get": _op("The slots this shard owns: its slot map, with the epoch.", ok_response("SlotMap", "Its map.")),
        "put": _op(
            "Take a newer slot map that leaves this shard's slots as they are (a move between other shards).",
            ok_response("SlotMapTaken", "Whether it was newer."),
            400,
            409,
            413,
            body="SlotMap",
        ),
    },
    "/v1/slots/hand_off": {
        "post": _op(
            "A slot move's first step: copy and remove the slots' rows, take the map that gives them away.",
            {
                "200": {
                    "description": "The slots' rows and the map, as one .npz archive.",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                }
            },
            400,
            409,
            413,
            body="HandOff",
        ),
    },
    "/v1/slots/move": {
        "post": _op(
            "Move slots between the running shards (shard 0, with an exporter): some slots to one shard, or every "
            "slot of a shard drained to the others.",
            ok_response("SlotsMoved", "The map after the move, and its steps."),
            400,
            409,
            413,
            502,
            body="MoveRequest",
        ),
    },
    "/v1/slots/held/{epoch}": {
        "parameters": [_EPOCH_PARAM],
        "delete": _op(
            "Drop the copies handed off at a map epoch (the move is done).",
            ok_response("Dropped", "Whether any were held."),
            400,
        ),
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
