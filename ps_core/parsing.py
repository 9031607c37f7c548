"""Strict parsing of the integers requests carry.

Python's ``int()`` is generous: it takes ``"٣"`` (an Arabic-Indic digit),
``" 3"``, ``"+3"``, ``"3_0"``, and ``int(3.7)`` truncates. A request field
that names a version, a lease or a partition must mean exactly one number,
so every route parses integers here instead:

- a text (a path segment, a query value, a JSON object key) is an integer
  when it is ASCII digits only, with no sign, blank, underscore or leading
  zero (``"0"`` itself excepted): `parse_int`;
- a JSON value is an integer when it is a JSON integer: not a boolean, not
  a float (``3.0`` included): `json_int`.

Both check bounds and raise `InvalidRequestError` (400), naming the field.
"""

from __future__ import annotations

import re

from .errors import InvalidRequestError, PSError

__all__ = ["parse_int", "json_int", "is_int_text", "MAX_INT", "INT_TEXT"]

MAX_INT = 2**63 - 1
"""The default upper bound: what a signed 64-bit field holds."""

INT_TEXT = "^(0|[1-9][0-9]{0,18})$"
"""The text of a non-negative integer, as a JSON Schema pattern."""

_INT_TEXT = re.compile(INT_TEXT[1:-1], re.ASCII)


def is_int_text(text: object) -> bool:
    """Whether `text` is a string of a non-negative integer in canonical
    ASCII form (what `parse_int` accepts, bounds aside)."""
    return isinstance(text, str) and _INT_TEXT.fullmatch(text) is not None


def parse_int(
    text: str,
    name: str,
    *,
    minimum: int = 0,
    maximum: int = MAX_INT,
    error: type[PSError] = InvalidRequestError,
) -> int:
    """`text` as an integer in ``[minimum, maximum]``; `error` (400 by
    default) naming `name` otherwise. Only ASCII digits: no sign, blank,
    exponent, base prefix, underscore or leading zero."""
    if not is_int_text(text):
        raise error(f"{name} must be a non-negative integer in ASCII digits, not {str(text)[:40]!r}")
    value = int(text)
    if not minimum <= value <= maximum:
        raise error(f"{name} must be in [{minimum}, {maximum}], not {value}")
    return value


def json_int(
    value: object,
    name: str,
    *,
    minimum: int = 0,
    maximum: int = MAX_INT,
    error: type[PSError] = InvalidRequestError,
) -> int:
    """`value` (decoded JSON) as an integer in ``[minimum, maximum]``: a
    JSON integer, not a boolean or a float; `error` naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be an integer, not {type(value).__name__} {str(value)[:40]}")
    if not minimum <= value <= maximum:
        raise error(f"{name} must be in [{minimum}, {maximum}], not {value}")
    return value
