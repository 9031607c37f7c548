"""Checking bodies against the OpenAPI documents, as a client would: a JSON
Schema validator (jsonschema_rs, schemathesis's) over a document's schemas;
the operations of a document that take a JSON body, and bodies that are one
JSON document followed by more bytes (which every such route refuses)."""

from __future__ import annotations

from typing import Any

import jsonschema_rs

__all__ = ["validate", "json_operations", "with_trailing_bytes", "TRAILING", "NOT_ONE_DOCUMENT"]


def validate(instance: Any, schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """Where `instance` breaks `schema` (its ``$ref``s resolved in `doc`'s
    components): one message per violation, empty when it conforms."""
    root = {**schema, "components": doc.get("components", {})}
    validator = jsonschema_rs.Draft202012Validator(root)
    return [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(instance)]


def json_operations(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """The operations of `doc` whose request body is JSON, as sorted
    (METHOD, path template) pairs."""
    return sorted(
        (method.upper(), path)
        for path, ops in doc["paths"].items()
        for method, op in ops.items()
        if method != "parameters" and "application/json" in op.get("requestBody", {}).get("content", {})
    )


TRAILING: tuple[bytes, ...] = (b"1 2", b"{} x", b'{"events":[]} {}', b"[] ]", b"null null", b'"a""b"')
"""Bodies that are a JSON document followed by more bytes, whatever the route."""

NOT_ONE_DOCUMENT = (b"\x00", b" x", b"}", b"\n{}", b"\r\n[]", b" \t0", b"\xff", b"/* */")
"""What, after a valid body, makes it more than one JSON document: a NUL, a
word, a stray bracket, a second document on its own line (NDJSON, which no
JSON route takes), a byte that is not UTF-8, a comment."""


def with_trailing_bytes(valid: bytes) -> list[bytes]:
    """`TRAILING`, and `valid` (one JSON document) followed by each of
    `NOT_ONE_DOCUMENT`, and by itself on a second line."""
    return [*TRAILING, *(valid + tail for tail in NOT_ONE_DOCUMENT), valid + b"\n" + valid]
