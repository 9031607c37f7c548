"""Click events: one Kafka message's events (`decode_message`) and why an
event or message is refused (`EventError`, one of `REASONS`).

A Kafka message holds one event as a JSON object, several as a JSON array, or
JSON lines. An event is::

    {"id": "e-1", "ts": 1764681600.25, "label": 1, "weight": 1.0,
     "features": {"site": "a3f09", "hour": "13", "price": 12.5, "tags": ["a", "b"]},
     "keys": [1234, 99]}

Its fields are validated and hashed by `ps_core.model.hasher.FeatureHasher`.
"""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import PSError

__all__ = ["EventError", "REASONS", "decode_message", "message_events"]

REASONS = (
    "empty",
    "oversized",
    "invalid_json",
    "not_an_object",
    "missing_label",
    "bad_label",
    "bad_ts",
    "bad_weight",
    "bad_features",
    "bad_value",
    "bad_keys",
)
"""Every reason an event or message is rejected for (DLQ reasons)."""


class EventError(PSError):
    """An event or message is malformed; `reason` is one of `REASONS`."""

    code = "bad_event"
    status = 422

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def decode_message(value: bytes | None, max_bytes: int = 1 << 20) -> list[dict[str, Any]]:
    """The events of one message: a JSON object, a JSON array of objects, or
    JSON lines. Raises `EventError` (empty, oversized, invalid_json, not_an_object)."""
    if not value:
        raise EventError("empty", "the message has no content")
    if len(value) > max_bytes:
        if not value.strip():  # blank is "empty" whatever its size
            raise EventError("empty", "the message has no content")
        raise EventError("oversized", f"{len(value)} bytes > limit {max_bytes}")
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        # Stripping copies the message, so only a failed parse pays for it.
        stripped = value.strip()
        if not stripped:
            raise EventError("empty", "the message has no content") from None
        if b"\n" not in stripped:
            raise EventError("invalid_json", str(exc)) from None
        doc = None
    return message_events(doc, value)


def message_events(doc: Any, value: bytes) -> list[dict[str, Any]]:
    """The events of a message `value` (at most the size limit) that parsed as
    one JSON document `doc`; a `doc` of None (JSON ``null``, or a failed parse
    of several lines) reads `value` as JSON lines. Raises like `decode_message`."""
    if doc is None:
        lines = [ln for ln in value.split(b"\n") if ln.strip()]
        try:
            events = [orjson.loads(ln) for ln in lines]
        except orjson.JSONDecodeError as exc:
            raise EventError("invalid_json", f"JSON lines: {exc}") from None
    elif isinstance(doc, list):
        events = doc
    else:
        events = [doc]
    if not events:
        raise EventError("empty", "an empty array holds no events")
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise EventError("not_an_object", f"event {i} is {type(ev).__name__}, not an object")
    return events
