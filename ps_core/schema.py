"""A validator for the part of JSON Schema the project's documents use.

The API's OpenAPI document (`app.openapi`), the shard's (`ps_core.net.shard_openapi`)
and the status board (`ps_core.store.board`) share it: the board refuses a report
with exactly the schema the documents publish, so the two cannot drift.

`validate` knows exactly the keywords in `KEYWORDS` and refuses a schema
using any other, so a keyword a document starts to use is never silently
ignored. Two rules are stricter than JSON Schema's, on purpose:

- ``integer`` is a number of an integer value that is exact: ``3.0`` is
  an integer as JSON Schema says, a float beyond ``2**53`` is not, nor is
  a boolean (`ps_core.parsing.json_int`, the handlers' rule);
- a ``pattern`` must be anchored (``^...$``) and matches the whole string
  with ASCII classes (Python's ``$`` would also match before a final newline).
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

from .parsing import MAX_EXACT

__all__ = ["validate", "KEYWORDS", "SchemaError"]

KEYWORDS = frozenset(
    {
        "$ref",
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "minLength",
        "maxLength",
        "enum",
        "pattern",
        "maxProperties",
        "propertyNames",
        "anyOf",
        "description",
        "examples",
    }
)
"""The JSON Schema keywords `validate` implements (the last two are annotations)."""


class SchemaError(ValueError):
    """A schema uses a keyword `validate` does not implement (or an unanchored pattern)."""


@cache
def _pattern(pattern: str) -> re.Pattern[str]:
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise SchemaError(f"pattern {pattern!r} must be anchored with ^ and $")
    return re.compile(pattern[1:-1], re.ASCII)


_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: (
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer() and abs(v) <= MAX_EXACT)
    ),
}


def validate(instance: Any, schema: dict[str, Any], doc: dict[str, Any] | None = None, path: str = "$") -> list[str]:
    """Where `instance` breaks `schema` (``$ref`` resolved in `doc`'s
    ``components.schemas``): one message per violation, empty when it
    conforms. Raises `SchemaError` for a keyword outside `KEYWORDS`."""
    unknown = set(schema) - KEYWORDS
    if unknown:
        raise SchemaError(f"{path}: unsupported schema keywords {sorted(unknown)}")
    if "$ref" in schema:
        if doc is None:
            raise SchemaError(f"{path}: a $ref without a document")
        name = schema["$ref"].removeprefix("#/components/schemas/")
        return validate(instance, doc["components"]["schemas"][name], doc, path)
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        if not any(_TYPES[t](instance) for t in allowed):
            return [f"{path}: {type(instance).__name__} {instance!r:.60} is not {'/'.join(allowed)}"]
    if "anyOf" in schema:
        branches = [validate(instance, s, doc, path) for s in schema["anyOf"]]
        if all(branches):
            errors.append(f"{path}: matches none of anyOf: " + " | ".join(b[0] for b in branches))
    if "enum" in schema and instance not in schema["enum"]:
        errors.append(f"{path}: {instance!r:.60} not in {schema['enum']}")
    if _TYPES["number"](instance):
        if "minimum" in schema and instance < schema["minimum"]:
            errors.append(f"{path}: {instance} < minimum {schema['minimum']}")
        if "exclusiveMinimum" in schema and instance <= schema["exclusiveMinimum"]:
            errors.append(f"{path}: {instance} <= exclusive minimum {schema['exclusiveMinimum']}")
        if "maximum" in schema and instance > schema["maximum"]:
            errors.append(f"{path}: {instance} > maximum {schema['maximum']}")
    if isinstance(instance, str):
        if len(instance) < schema.get("minLength", 0):
            errors.append(f"{path}: shorter than {schema['minLength']}")
        if "maxLength" in schema and len(instance) > schema["maxLength"]:
            errors.append(f"{path}: longer than {schema['maxLength']}")
        elif "pattern" in schema and _pattern(schema["pattern"]).fullmatch(instance) is None:
            errors.append(f"{path}: {instance!r:.60} does not match {schema['pattern']}")
    if isinstance(instance, list):
        if len(instance) < schema.get("minItems", 0):
            errors.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(instance) > schema["maxItems"]:
            # Not one message per item of an oversized list.
            return errors + [f"{path}: more than {schema['maxItems']} items"]
        if "items" in schema:
            for i, item in enumerate(instance):
                errors += validate(item, schema["items"], doc, f"{path}[{i}]")
    if isinstance(instance, dict):
        if "maxProperties" in schema and len(instance) > schema["maxProperties"]:
            return errors + [f"{path}: more than {schema['maxProperties']} properties"]
        props = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in instance:
                errors.append(f"{path}: missing {name!r}")
        names = schema.get("propertyNames")
        extra = schema.get("additionalProperties", True)
        for name, value in instance.items():
            if names is not None:
                bad = validate(name, names, doc, f"{path} key {name!r:.40}")
                if bad:
                    errors += bad
                    continue
            if name in props:
                errors += validate(value, props[name], doc, f"{path}.{name}")
            elif extra is False:
                errors.append(f"{path}: unexpected property {name!r:.60}")
            elif isinstance(extra, dict):
                errors += validate(value, extra, doc, f"{path}.{name}")
    return errors
