"""Checking bodies against the OpenAPI documents, as a client would: a JSON
Schema validator (jsonschema_rs, schemathesis's) over a document's schemas."""

from __future__ import annotations

from typing import Any

import jsonschema_rs

__all__ = ["validate"]


def validate(instance: Any, schema: dict[str, Any], doc: dict[str, Any]) -> list[str]:
    """Where `instance` breaks `schema` (its ``$ref``s resolved in `doc`'s
    components): one message per violation, empty when it conforms."""
    root = {**schema, "components": doc.get("components", {})}
    validator = jsonschema_rs.Draft202012Validator(root)
    return [f"{e.instance_path}: {e.message}" for e in validator.iter_errors(instance)]
