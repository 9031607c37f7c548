"""The OpenAPI 3.1 document of a shard's JSON routes (``GET /openapi.json``
on every shard's HTTP port), so they can be fuzzed like the API's.

It documents the routes of `ps_core.net.server` and, on shard 0 with a
coordinator and exporter, of `ps_core.checkpoint.routes`: tables, stats,
status, snapshots, membership, restore, leases, offsets, exports. The
binary frame routes (``/v1/pull``, ``/v1/push``, ``/v1/push_pull``) are
left out: their bodies are `ps_core.net.codec` frames, not JSON, and the codec
has its own tests. `shard_document` keeps only the paths the app serves.

The exporter's reports (`EXPORT_REPORT_SCHEMA`, `COMPACTION_SCHEMA`,
`EXPORT_LIST_SCHEMA`) and the status board's schema (`ps_core.store.board`) are
embedded in the API's document too: the API relays them.
"""

from __future__ import annotations

from typing import Any

from ..parsing import MAX_INT
from ..store.board import PARTITION_KEY, SOURCE_SCHEMA, STATUS_SCHEMA
from ..store.optim import MAX_HYPERPARAMETER, MIN_POSITIVE
from ..store.table import MAX_DIM, MAX_INIT_SCALE, MAX_VERSION

__all__ = [
    "shard_document",
    "EXPORT_REPORT_SCHEMA",
    "COMPACTION_SCHEMA",
    "EXPORT_LIST_SCHEMA",
]


def _closed(properties: dict[str, Any], *optional: str) -> dict[str, Any]:
    """An object with exactly these properties, all required but `optional`."""
    return {
        "type": "object",
        "required": [k for k in properties if k not in optional],
        "additionalProperties": False,
        "properties": properties,
    }


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


count: dict[str, Any] = {"type": "integer", "minimum": 0}
counts_by: dict[str, Any] = {"type": "object", "additionalProperties": count}
string: dict[str, Any] = {"type": "string"}
boolean: dict[str, Any] = {"type": "boolean"}
version: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": MAX_VERSION}

EXPORT_REPORT_SCHEMA: dict[str, Any] = _closed(
    {
        "version": {"type": "integer", "minimum": 1},
        "kind": {"type": "string", "enum": ["base", "delta"]},
        "parent": {"type": ["integer", "null"]},
        "path": {"type": "string", "description": "The version's directory on shard 0."},
        "rows": count,
        "bytes": count,
        "offsets": {
            "type": "object",
            "description": "Next offset to consume per topic and partition: where workers resume.",
            "additionalProperties": counts_by,
        },
        "lease_wait_ms": {"type": "number", "minimum": 0},
        "pause_ms": {
            "type": "number",
            "minimum": 0,
            "description": "Leases refused: the wait plus the shards' copies.",
        },
        "write_ms": {"type": "number", "minimum": 0},
        "expired_leases": {"type": "array", "items": {"type": "string"}},
        "pruned": {"type": "array", "items": {"type": "integer"}},
        "stream": {
            **_closed(
                {
                    "cluster_id": string,
                    "group": string,
                    "topics": {"type": "array", "items": string},
                }
            ),
            "type": ["object", "null"],
            "description": "The stream the offsets were read from (Kafka cluster id, group, topics); "
            "null when no worker reported one.",
        },
    }
)

COMPACTION_SCHEMA: dict[str, Any] = _closed(
    {
        "version": {"type": "integer", "minimum": 1},
        "kind": {"type": "string", "enum": ["base"]},
        "compacted_from": {
            "type": "array",
            "items": {"type": "integer"},
            "description": "Empty when the newest version was a base already.",
        },
        "rows": count,
        "bytes": count,
        "pruned": {"type": "array", "items": {"type": "integer"}},
        "seconds": {"type": "number", "minimum": 0},
    }
)

EXPORT_LIST_SCHEMA: dict[str, Any] = _closed(
    {
        "model": {"type": "string"},
        "versions": {
            "type": "array",
            "items": _closed(
                {
                    "version": {"type": "integer", "minimum": 1},
                    "kind": {"type": "string", "enum": ["base", "delta"]},
                    "parent": {"type": ["integer", "null"]},
                    "created_at": {"type": "string", "description": "RFC 3339, UTC."},
                    "rows": count,
                    "bytes": count,
                }
            ),
        },
        "last": {
            "description": "The last export this process's coordinator wrote (null on a replica or before one).",
            "type": ["object", "null"],
        },
    }
)

_POSITIVE = {"type": "number", "minimum": MIN_POSITIVE, "maximum": MAX_HYPERPARAMETER}
_NON_NEGATIVE = {"type": "number", "minimum": 0, "maximum": MAX_HYPERPARAMETER}


def _optimizer(name: str, **params: dict[str, Any]) -> dict[str, Any]:
    return _closed({"name": {"type": "string", "enum": [name]}, **params}, *params)


_TABLE = _closed(
    {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "dim": {"type": "integer", "minimum": 1, "maximum": MAX_DIM},
        "optimizer": {
            "description": "An optimizer and its hyperparameters (ps_core.store.optim), defaults filled in.",
            "anyOf": [
                _optimizer("sgd", lr=_POSITIVE, l2=_NON_NEGATIVE),
                _optimizer("adagrad", lr=_POSITIVE, eps=_POSITIVE, initial_accumulator=_NON_NEGATIVE),
                {
                    **_optimizer("ftrl", alpha=_POSITIVE, beta=_NON_NEGATIVE, l1=_NON_NEGATIVE, l2=_NON_NEGATIVE),
                    # beta or l2 positive (each defaults to 1): a fresh row divides by beta / alpha + l2.
                    "anyOf": [
                        {"properties": {"beta": {"minimum": MIN_POSITIVE}}},
                        {"properties": {"l2": {"minimum": MIN_POSITIVE}}},
                    ],
                },
            ],
        },
        "init_scale": {"type": "number", "minimum": 0, "maximum": MAX_INIT_SCALE},
        "seed": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
    }
)

_SCHEMAS: dict[str, Any] = {
    "Error": _closed({"error": string, "detail": {"type": "string", "minLength": 1}}),
    "Table": _TABLE,
    "TableDeclaration": {
        **_TABLE,
        "required": ["name"],
        "properties": {
            **_TABLE["properties"],
            "optimizer": {
                "description": "A name, or an object of a name and hyperparameters (the rest defaulted).",
                "anyOf": [
                    {"type": "string", "enum": ["sgd", "adagrad", "ftrl"]},
                    *({**o, "required": ["name"]} for o in _TABLE["properties"]["optimizer"]["anyOf"]),
                ],
            },
        },
    },
    "Declared": _closed({"created": boolean, "table": _ref("Table")}),
    "Tables": {"type": "object", "additionalProperties": _ref("Table")},
    "Stats": {
        "type": "object",
        "required": ["shard_id", "num_shards", "duplicate_pushes", "tables"],
        "properties": {
            "shard_id": count,
            "num_shards": {"type": "integer", "minimum": 1},
            "duplicate_pushes": count,
            "tables": {
                "type": "object",
                "additionalProperties": _closed(
                    {
                        "features": count,
                        "bytes": count,
                        "pushes": count,
                        "pulls": count,
                        "version": count,
                        "config": _ref("Table"),
                    }
                ),
            },
        },
        "description": "Shard 0 adds sections of what it hosts (exports, cluster).",
    },
    "StatusReport": _closed({"source": SOURCE_SCHEMA, "status": STATUS_SCHEMA}),
    "StatusAck": _closed(
        {"source": string, "received_at": {"type": "number"}, "sources": {"type": "integer", "minimum": 1}}
    ),
    "StatusBoard": _closed(
        {
            "statuses": {
                "type": "array",
                "items": _closed({"source": string, "received_at": {"type": "number"}, "status": {"type": "object"}}),
            }
        }
    ),
    "SnapshotRequest": _closed({"version": version, "parent": {**version, "type": ["integer", "null"]}}),
    "SnapshotRows": _closed({"rows": counts_by}),
    "Dropped": _closed({"dropped": boolean}),
    "Membership": _closed(
        {
            "shard_id": count,
            "num_shards": {"type": "integer", "minimum": 1},
            "boot_id": string,
            "joined": boolean,
            "epoch": string,
            "version": count,
            "clean": boolean,
            "restores": boolean,
        }
    ),
    "Admit": _closed({"epoch": {"type": "string", "maxLength": 200}, "version": version}),
    "Restore": _closed({"version": version}),
    "Restored": {
        "type": "object",
        "required": ["version"],
        "additionalProperties": False,
        "properties": {
            "version": {"type": ["integer", "null"]},
            "chain": string,
            "rows": count,
            "kept": boolean,
            "refused": _closed({"file": string, "expected": string, "actual": string, "detail": string}),
        },
    },
    "Health": _closed(
        {
            "status": {"type": "string", "enum": ["ok"]},
            "shard_id": count,
            "num_shards": {"type": "integer", "minimum": 1},
            "rpc_port": {"type": ["integer", "null"]},
        }
    ),
    "LeaseRequest": _closed(
        {
            "worker": {"type": "string", "minLength": 1, "maxLength": 200},
            "wait_s": {"type": "number", "minimum": 0, "maximum": 300},
        },
        "wait_s",
    ),
    "Lease": _closed({"lease_id": count, "epoch": string, "ttl_s": {"type": "number"}}),
    "Offsets": {
        "type": "object",
        "description": "Next offset per topic and partition (partitions in ASCII digits).",
        "propertyNames": {"type": "string", "minLength": 1, "maxLength": 249},
        "additionalProperties": {
            "type": "object",
            "propertyNames": {"type": "string", "pattern": PARTITION_KEY},
            "additionalProperties": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
        },
    },
    "Stream": _closed(
        {
            "cluster_id": {"type": "string", "minLength": 1, "maxLength": 200},
            "group": {"type": "string", "maxLength": 300},
            "topics": {"type": "array", "maxItems": 1000, "items": string},
        },
        "topics",
    ),
    "Release": _closed(
        {
            "lease_id": {"type": "integer", "minimum": 0, "maximum": MAX_INT},
            "offsets": _ref("Offsets"),
            "stream": {**_ref("Stream")},
        },
        "offsets",
        "stream",
    ),
    "Released": _closed({"released": boolean}),
    "KnownOffsets": _closed({"offsets": _ref("Offsets"), "stream": {"type": ["object", "null"]}}),
    "ExportRequest": _closed({"kind": {"type": "string", "enum": ["base", "delta"]}}, "kind"),
    "ExportReport": EXPORT_REPORT_SCHEMA,
    "Compaction": COMPACTION_SCHEMA,
    "ExportList": EXPORT_LIST_SCHEMA,
}

_ERRORS = {
    400: "The request is not the route's shape (bad_request, bad_status, bad_table_config).",
    404: "Nothing to act on (unknown_lease, export_not_found).",
    409: "Refused in the cluster's current state (table_conflict, bad_snapshot, cut_shard_not_joined).",
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
) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": summary, "responses": {**ok}}
    if not open_:
        # With a cluster secret, every route but /healthz and /openapi.json
        # needs a token of its scope (ps_core.net.server.ROUTE_SCOPES).
        out["security"] = [{"bearer": []}]
        errors = (*errors, 401, 403)
    for status in sorted(set(errors)):
        out["responses"][str(status)] = _json(_ref("Error"), _ERRORS[status])
    out["responses"]["default"] = _json(_ref("Error"), "Any other error (not_found, method_not_allowed).")
    if body is not None:
        out["requestBody"] = {
            "required": not optional_body,
            "content": {"application/json": {"schema": _ref(body)}},
        }
    return out


def _ok(schema: str, description: str, status: int = 200) -> dict[str, Any]:
    return {str(status): _json(_ref(schema), description)}


_VERSION_PARAM = {
    "name": "version",
    "in": "path",
    "required": True,
    "description": "The cut's version, in ASCII digits.",
    "schema": {"type": "integer", "minimum": 0, "maximum": MAX_VERSION},
}

_PATHS: dict[str, dict[str, Any]] = {
    "/v1/tables": {
        "get": _op("The declared tables.", _ok("Tables", "By name.")),
        "post": _op(
            "Declare a table: 201 created, 200 an identical one exists.",
            {**_ok("Declared", "Created.", 201), **_ok("Declared", "Declared already, identically.")},
            400,
            409,
            413,
            body="TableDeclaration",
        ),
    },
    "/v1/stats": {"get": _op("Features, bytes and calls per table.", _ok("Stats", "This shard's figures."))},
    "/v1/status": {
        "get": _op("The status board.", _ok("StatusBoard", "Least recently reported first.")),
        "post": _op("Report a status to the board.", _ok("StatusAck", "Stored."), 400, 413, body="StatusReport"),
    },
    "/v1/snapshots": {
        "post": _op(
            "Copy every table's rows for a cut.",
            _ok("SnapshotRows", "Rows per table."),
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
        "delete": _op("Drop the copies of a cut (idempotent).", _ok("Dropped", "Whether they were held."), 400),
    },
    "/v1/membership": {"get": _op("What the coordinator admits the shard on.", _ok("Membership", "This shard."))},
    "/v1/membership/admit": {
        "post": _op("Join the cluster at a version.", _ok("Membership", "Joined."), 400, 409, 413, body="Admit"),
    },
    "/v1/restore": {
        "post": _op(
            "Load a version from the exports directory (the shard leaves the cluster until admitted).",
            _ok("Restored", "Loaded, or refused naming the file that does not check."),
            400,
            404,
            413,
            body="Restore",
        ),
    },
    "/healthz": {"get": _op("Liveness.", _ok("Health", "Alive."), open_=True)},
    "/openapi.json": {
        "get": _op(
            "This document.",
            {"200": _json({"type": "object", "required": ["openapi", "paths"]}, "OpenAPI 3.1.")},
            open_=True,
        ),
    },
    "/v1/leases": {
        "post": _op(
            "A lease for one window of training.", _ok("Lease", "Granted."), 400, 409, 413, 503, body="LeaseRequest"
        ),
    },
    "/v1/leases/release": {
        "post": _op(
            "Release a lease with its committed offsets.",
            _ok("Released", "False: it had expired."),
            400,
            404,
            413,
            body="Release",
        ),
    },
    "/v1/offsets": {"get": _op("The latest committed offsets.", _ok("KnownOffsets", "And their stream."))},
    "/v1/exports": {
        "get": _op("The export versions on disk.", _ok("ExportList", "Oldest first.")),
        "post": _op(
            "Cut and write a version now.",
            _ok("ExportReport", "Written.", 201),
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
        "post": _op("Fold the newest chain into a base, then prune.", _ok("Compaction", "Written."), 404, 500),
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
            "description": "A shard's JSON routes (frame routes are binary and left out). "
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
