"""Typed errors of the HTTP API, in the style of `ps_core.errors`.

Each is a `PSError`: a stable ``error`` code, an HTTP status and a detail; the
wrapper every API route is served through (`app.api`) turns any `PSError`
into ``{"error": code, "detail": reason}``. The split between statuses: 400 when the body is not the
request's shape (not JSON, not an object, wrong types, unknown or missing
fields); 422 when it is, but its content cannot be used (no events, too many,
an event that fails validation); 404 for an unknown route or model; 401 for a
missing or wrong admin token; 413 for a body over the limit; 503 (from
`ps_core`) when a shard cannot be reached, when a shard answers from another
place than the shard list gives it, or when a serving replica has no
version loaded yet; 409 for a mutating route on a serving replica.
"""

from __future__ import annotations

from ps_core.errors import PSError, UnknownModelError

__all__ = [
    "BadRequestError",
    "BodyNotJSONError",
    "NoEventsError",
    "TooManyEventsError",
    "InvalidEventError",
    "UnknownModelError",
    "UnauthorizedError",
    "ReadOnlyReplicaError",
    "NoVersionError",
    "ShardOrderError",
]


class BadRequestError(PSError, code="bad_request", status=400):
    """The body is JSON but not the request's shape: wrong types, unknown or
    missing fields."""


class BodyNotJSONError(BadRequestError, code="invalid_json"):
    """The body is not JSON (or holds NaN/Infinity literals)."""


class NoEventsError(PSError, code="no_events", status=422):
    """A request holds an empty list of events (or nothing to look up)."""


class TooManyEventsError(PSError, code="too_many_events", status=422):
    """A request holds more events than the server's limit (``--max-events``)."""


class InvalidEventError(PSError, status=422):
    """An event fails validation. The ``error`` code is the reason, one of
    `ps_core.model.events.REASONS` (``bad_value``, ``bad_keys``, ...), and the
    detail names the event by its position in the request."""

    def __init__(self, reason: str, event: int, detail: str) -> None:
        super().__init__(f"event {event}: {detail}")
        self.code = reason
        self.event = event


class UnauthorizedError(PSError, code="unauthorized", status=401):
    """An admin route was called without the bearer token the server requires."""


class ReadOnlyReplicaError(PSError, code="read_only_replica", status=409):
    """A mutating route was called on a serving replica (``ctrps serve
    --follow``): it serves exported versions and changes nothing."""


class NoVersionError(PSError, code="no_version", status=503, retriable=True):
    """A serving replica has not loaded an export version yet."""


class ShardOrderError(PSError, code="wrong_shard_order", status=503, retriable=True):
    """A shard answers from another place than the API's shard list gives
    it (a shard restarted with another id or count): every call would be
    refused as ``moved``."""
