"""Typed errors of the parameter server.

Every error a caller can act on is a `PSError` subclass with a stable `code`
(the ``error`` field of a JSON error body), the HTTP `status` the shard server
and the API map it to, and a `retriable` flag telling a client whether trying
again later can succeed. The mapping lives here, in one place; handlers raise
and never catch.
"""

from __future__ import annotations

__all__ = [
    "PSError",
    "FrameError",
    "InvalidValuesError",
    "WrongShardError",
    "UnknownTableError",
    "TableConfigError",
    "TableConflictError",
    "StatusError",
    "ShardUnavailableError",
    "LeaseError",
    "CutInProgressError",
    "NoCoordinatorError",
    "SnapshotError",
    "ExportCorruptError",
    "ExportNotFoundError",
    "error_from_body",
]


class PSError(Exception):
    """Base of every parameter-server error."""

    code = "ps_error"
    status = 500
    retriable = False

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def to_body(self) -> dict[str, str]:
        """The JSON error body: ``{"error": code, "detail": reason}``."""
        return {"error": self.code, "detail": self.detail}


class FrameError(PSError):
    """A binary RPC frame is malformed: bad magic or version, truncated, or its
    counts do not match its length. Nothing was applied."""

    code = "bad_frame"
    status = 400


class InvalidValuesError(PSError):
    """Values in an otherwise well-formed request are unusable (NaN or infinite
    gradients, negative counts, a width that does not match the table).
    Nothing was applied."""

    code = "invalid_values"
    status = 400


class WrongShardError(PSError):
    """Keys were sent to a shard that does not own them: the client and the
    shard disagree on the number of shards. Nothing was applied."""

    code = "wrong_shard"
    status = 400


class UnknownTableError(PSError):
    """The request names a table the shard has not declared."""

    code = "unknown_table"
    status = 404


class TableConfigError(PSError):
    """A table declaration is invalid (unknown optimizer, bad width or
    hyperparameter)."""

    code = "bad_table_config"
    status = 400


class TableConflictError(PSError):
    """A table is declared again with a configuration different from the one it
    has. Declarations are idempotent only for identical configurations."""

    code = "table_conflict"
    status = 409


class StatusError(PSError):
    """A status report for the shard's status board is malformed (not a JSON
    object of a source name and a status object, or too large). Nothing was
    stored."""

    code = "bad_status"
    status = 400


class ShardUnavailableError(PSError):
    """A shard could not be reached before the client's deadline.

    `shard_id` and `url` name the shard; retrying later may succeed."""

    code = "shard_unavailable"
    status = 503
    retriable = True

    def __init__(self, detail: str, *, shard_id: int = -1, url: str = "") -> None:
        super().__init__(detail)
        self.shard_id = shard_id
        self.url = url


class LeaseError(PSError):
    """A lease id that is not active (never granted) or a malformed lease request."""

    code = "unknown_lease"
    status = 404


class CutInProgressError(PSError):
    """A lease was not granted within its wait limit because a cut is pausing."""

    code = "cut_in_progress"
    status = 503
    retriable = True


class NoCoordinatorError(PSError):
    """The shards host no coordinator (shard 0 runs without exports)."""

    code = "no_coordinator"
    status = 404


class ExportCorruptError(PSError):
    """An export version fails its checks: a file is missing, or its size or
    SHA-256 differs from its manifest, or the manifest itself is unreadable.

    `file` names the file; `expected` and `actual` the checksums (or sizes,
    or ``"missing"``)."""

    code = "export_corrupt"
    status = 500

    def __init__(self, detail: str, *, file: str = "", expected: str = "", actual: str = "") -> None:
        super().__init__(detail)
        self.file = file
        self.expected = expected
        self.actual = actual


class ExportNotFoundError(PSError):
    """No export version (or no complete chain of them) matches the request."""

    code = "export_not_found"
    status = 404


class SnapshotError(PSError):
    """A snapshot request that does not fit the shard: an unknown or already
    fetched version, or labels that are not one cut's."""

    code = "bad_snapshot"
    status = 409


_BY_CODE: dict[str, type[PSError]] = {
    cls.code: cls
    for cls in (
        FrameError,
        InvalidValuesError,
        WrongShardError,
        UnknownTableError,
        TableConfigError,
        TableConflictError,
        StatusError,
        LeaseError,
        CutInProgressError,
        NoCoordinatorError,
        ExportCorruptError,
        ExportNotFoundError,
        SnapshotError,
    )
}


def error_from_body(status: int, body: object) -> PSError:
    """Rebuild the typed error a server reported as a JSON error body."""
    if isinstance(body, dict):
        code = str(body.get("error", ""))
        detail = str(body.get("detail", ""))
        cls = _BY_CODE.get(code)
        if cls is not None:
            return cls(detail)
        err = PSError(f"{code or 'http_' + str(status)}: {detail}")
    else:
        err = PSError(f"http {status}: {body!r}")
    err.status = status
    return err
