"""Strict parsing of the integers requests carry.

Python's ``int()`` is generous: it takes ``"٣"`` (an Arabic-Indic digit),
``" 3"``, ``"+3"``, ``"3_0"``, and ``int(3.7)`` truncates. A request field
that names a version, a lease or a partition must mean exactly one number,
so every route parses integers here instead:

- a text (a path segment, a query value, a JSON object key) is an integer
  when it is ASCII digits only, with no sign, blank, underscore or leading
  zero (``"0"`` itself excepted): `parse_int`;
- a JSON value is an integer when its value is one, as JSON Schema says
  (``3`` and ``3.0`` alike: JSON numbers are values, not texts) and it is
  exact: a float beyond ``2**53`` is not (``9.2e18`` stands for many
  integers), nor is a boolean or a string: `json_int`, `exact_ints`.

Both check bounds and raise `InvalidRequestError` (400), naming the field.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypedDict, Unpack

from .errors import InvalidRequestError, PSError

__all__ = [
    "parse_int",
    "parse_number",
    "json_int",
    "IntBounds",
    "exact_ints",
    "is_int_text",
    "MAX_INT",
    "MAX_EXACT",
    "INT_TEXT",
]

MAX_INT = 2**63 - 1
"""The default upper bound: what a signed 64-bit field holds."""

MAX_EXACT = 2**53
"""A float names exactly one integer up to here; past it, a float is refused as an integer."""

INT_TEXT = "^(0|[1-9][0-9]{0,18})$"
"""The text of a non-negative integer, as a JSON Schema pattern."""

_INT_TEXT = re.compile(INT_TEXT[1:-1], re.ASCII)


# A JSON number's text: float() also takes "١٢", " 1", "1_0", "inf" and "nan".
_NUMBER_TEXT = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?", re.ASCII)


def parse_number(text: str, name: str, *, error: type[PSError] = InvalidRequestError) -> float:
    """`text` as a finite number written as JSON writes one (ASCII digits,
    an optional sign, fraction and exponent); `error` naming `name` otherwise."""
    value = float(text) if len(text) <= 400 and _NUMBER_TEXT.fullmatch(text) else math.nan
    if not math.isfinite(value):
        raise error(f"{name} must be a finite number in ASCII digits, not {text[:40]!r}")
    return value


def is_int_text(text: object) -> bool:
    """Whether `text` is a string of a non-negative integer in canonical
    ASCII form (what `parse_int` accepts, bounds aside)."""
    return isinstance(text, str) and _INT_TEXT.fullmatch(text) is not None


class IntBounds(TypedDict, total=False):
    """The range an integer must lie in (`parse_int`, `json_int`), and the
    error raised, naming it, when it does not."""

    minimum: int
    """Default 0."""
    maximum: int
    """Default `MAX_INT`."""
    error: type[PSError]
    """Default `InvalidRequestError` (400)."""


def parse_int(text: str, name: str, **bounds: Unpack[IntBounds]) -> int:
    """`text` as an integer within `bounds`; their error naming `name`
    otherwise. Only ASCII digits: no sign, blank, exponent, base prefix,
    underscore or leading zero."""
    if not is_int_text(text):
        error = bounds.get("error", InvalidRequestError)
        raise error(f"{name} must be a non-negative integer in ASCII digits, not {str(text)[:40]!r}")
    return _bounded(int(text), name, bounds)


def json_int(value: object, name: str, **bounds: Unpack[IntBounds]) -> int:
    """`value` (decoded JSON) as an integer within `bounds`: a JSON integer,
    or a float of an integer value up to `MAX_EXACT`; not a boolean or a
    string; their error naming `name` otherwise."""
    whole = _whole(value)
    if whole is None:
        error = bounds.get("error", InvalidRequestError)
        raise error(f"{name} must be an integer, not {type(value).__name__} {str(value)[:40]}")
    return _bounded(whole, name, bounds)


def _bounded(value: int, name: str, bounds: IntBounds) -> int:
    lo, hi = bounds.get("minimum", 0), bounds.get("maximum", MAX_INT)
    if not lo <= value <= hi:
        raise bounds.get("error", InvalidRequestError)(f"{name} must be in [{lo}, {hi}], not {value}")
    return value


def _whole(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_EXACT:
        return int(value)
    return None


def exact_ints(values: list[Any]) -> list[Any]:
    """`values` with each float of an exact integer value (`json_int`'s
    rule) as that int; anything else as it was, for the caller to refuse."""
    if all(type(v) is int for v in values):
        return values
    out: list[Any] = []
    for v in values:
        whole = _whole(v) if isinstance(v, float) else None
        out.append(v if whole is None else whole)
    return out
