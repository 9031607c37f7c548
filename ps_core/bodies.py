"""Request and response bodies declared once, as `msgspec.Struct` models.

Each body of the JSON routes (the API's, `app.api.payloads`; the shard's,
`ps_core.net.shard_openapi`; the status board's, `ps_core.store.board`) is one
model: `decode` validates a request body against it (msgspec, in C: no
Python work per field), `check` an already decoded object (a report handed
over in process), and `components` turns models into the ``components.schemas``
of an OpenAPI document, so the document and the validation cannot drift.

msgspec's rules are strict where the project's are: an ``int`` field takes no
``true``, ``"3"``, ``2.5`` or ``9.2e18``, bounds are checked, an unknown field
of a closed model (``forbid_unknown_fields``) is refused, and each refusal
names the field's path (``$.status.windows``). One rule is JSON Schema's, as
the documents publish it, and not msgspec's: a float of an exact integer
value (``3.0``, up to ``2**53``) is that integer (`ps_core.parsing.json_int`);
a body msgspec refuses is tried once more with such floats as ints (the
error path only: a body of JSON integers decodes in one pass).

Patterns are written with ``\\Z``: msgspec matches them with `re.search`, where
``$`` also matches before a final newline; the document spells the same
pattern with ``$`` (end of input in JSON Schema's regular expressions).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

import msgspec

from .errors import InvalidJSONError, PSError
from .parsing import MAX_EXACT

__all__ = ["decode", "check", "components", "ref", "published_name", "REF_TEMPLATE", "NUMERIC_PATTERN"]

# 1-6 digits, not all 0: a regular expression of no look-ahead, which every
# JSON Schema tool (and the fuzzers' generators) reads.
_NONZERO = "|".join(f"{'0' * k}[1-9][0-9]{{0,{5 - k}}}" for k in range(6))
NUMERIC_PATTERN = rf"^(raw|log1p)(/((?:{_NONZERO})(\.[0-9]{{1,6}})?|0{{1,6}}\.(?:{_NONZERO})))?$"
"""The forms a model's ``numeric`` may take (`ps_core.model.featurizer.numeric_feed`):
D > 0 of 1-6 digits and at most 6 decimals; both documents publish it (a
divisor of 0 was theirs to take and the check's to refuse, and a fuzzer's
valid request refused)."""

T = TypeVar("T")

REF_TEMPLATE = "#/components/schemas/{name}"
"""Where the documents keep their models' schemas."""
_REF_PREFIX = REF_TEMPLATE.removesuffix("{name}")


def decode(
    decoder: msgspec.json.Decoder[T], raw: bytes, error: type[PSError], invalid: type[PSError] = InvalidJSONError
) -> T:
    """`raw` decoded and validated by `decoder`; `error` (a 400) naming the
    field otherwise, or `invalid` (400 invalid_json) when `raw` is not one
    JSON document.

    msgspec validates as it parses and looks past the document last, so a
    wrong-shaped document followed by more bytes (``{} x``) fails validation
    first: the second pass, untyped, is where such a body is found not JSON."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        pass
    except (msgspec.DecodeError, RecursionError) as exc:
        raise invalid(f"the body is not JSON: {_reason(exc)}") from None
    try:
        obj = msgspec.json.decode(raw)
    except msgspec.ValidationError as exc:  # a number out of range
        raise error(str(exc)) from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise invalid(f"the body is not JSON: {_reason(exc)}") from None
    converted: T = check(obj, decoder.type, error)
    return converted


def _reason(exc: Exception) -> str:
    # msgspec leaves nesting deeper than Python's recursion limit to Python.
    return "nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def check(obj: object, model: Any, error: type[PSError], path: str = "$") -> Any:
    """`obj` (decoded JSON, or Python objects of the same types) validated as
    `model` (a model or an annotated type); `error` naming the field
    otherwise, its path starting at `path` (where `obj` is in a body)."""
    try:
        return msgspec.convert(obj, model)
    except msgspec.ValidationError:
        pass
    try:
        return msgspec.convert(_whole(obj), model)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if path != "$":
            at = message.rfind("`$")  # the path msgspec names, from the root of `obj`
            message = f"{message} - at `{path}`" if at < 0 else message[: at + 1] + path + message[at + 2 :]
        raise error(message) from None


def _whole(node: Any, depth: int = 0) -> Any:
    """`node` with each float of an exact integer value as that int (a copy);
    past the depth of any model, as it is (the model refuses it anyway)."""
    if type(node) is float:
        return int(node) if node.is_integer() and abs(node) <= MAX_EXACT else node
    if depth > _MAX_DEPTH:
        return node
    if type(node) is dict:
        return {k: _whole(v, depth + 1) for k, v in node.items()}
    if type(node) is list:
        return [_whole(v, depth + 1) for v in node]
    return node


_MAX_DEPTH = 8


def ref(name: str) -> dict[str, str]:
    """A reference to the schema `name` of a document's components."""
    return {"$ref": REF_TEMPLATE.format(name=name)}


BODY_SUFFIX = "Body"
"""The suffix of a model's class name that its document leaves out: `LeaseBody`
is published as ``Lease``, so a body and the domain class it carries (a
`ps_core.checkpoint.coordinator.Lease`) never share a name in the code, and
the documents keep the names they have always published."""


def published_name(name: str) -> str:
    """The name under which the model class `name` appears in a document."""
    return name.removesuffix(BODY_SUFFIX)


def components(models: Iterable[Any]) -> dict[str, Any]:
    """The JSON Schemas of `models` and of every model they reference, by
    published name (`published_name`), as a document's ``components.schemas``."""
    _, schemas = msgspec.json.schema_components(list(models), ref_template=REF_TEMPLATE)
    out = {published_name(name): _document(schema) for name, schema in schemas.items()}
    if len(out) != len(schemas):  # two models of one published name: a document would lose one
        raise ValueError(f"models published under one name: {sorted(schemas)}")
    return out


def _document(node: Any, names: bool = False) -> Any:
    """`node` (a schema, or with `names` a map of property names to schemas)
    as the document shows it: without a title (it repeats the model's name),
    a reference by published name, a pattern ending in ``$`` (see the
    module's docstring)."""
    if isinstance(node, list):
        return [_document(v) for v in node]
    if not isinstance(node, dict):
        return node
    if names:
        return {k: _document(v) for k, v in node.items()}
    out = {k: _document(v, k == "properties") for k, v in node.items() if k != "title"}
    for k, v in out.items():  # a $ref, or a discriminator's mapping to one
        if isinstance(v, str) and v.startswith(_REF_PREFIX):
            out[k] = ref(published_name(v.removeprefix(_REF_PREFIX)))["$ref"]
    pattern = out.get("pattern")
    if isinstance(pattern, str) and pattern.endswith("\\Z"):
        out["pattern"] = pattern[:-2] + "$"
    return out
