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
    "InvalidRequestError",
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
    "ExportWriteError",
    "CutAbortedError",
    "ShardNotJoinedError",
    "CutNotJoinedError",
    "ClusterNotReadyError",
    "NoCommonVersionError",
    "AuthError",
    "ForbiddenError",
    "TlsVerifyError",
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


class InvalidRequestError(PSError):
    """A request is not its route's shape: a body that is not the JSON
    object documented, a field of the wrong type or out of bounds, an
    integer that is not ASCII digits (`ps_core.parsing`). Nothing was done."""

    code = "bad_request"
    status = 400


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


class ExportWriteError(PSError):
    """An export's files could not be written (disk full, permissions: any
    `OSError`). `path` names what failed; no partial version is left behind,
    the shards' copies are dropped and the next cut is a base."""

    code = "export_write_failed"
    status = 507
    retriable = True
    exit_code = 1

    def __init__(self, detail: str, *, path: str = "") -> None:
        super().__init__(detail)
        self.path = path


class CutAbortedError(PSError):
    """A cut failed on at least one shard (unreachable, refused, too slow)
    and was aborted on every shard it reached: leases reopened, copies
    dropped, its version never used again. The next cut is a base."""

    code = "cut_aborted"
    status = 500  # not 503: transports retry those, and a retry would cut again
    retriable = True
    exit_code = 1


class CutNotJoinedError(SnapshotError):
    """A cut asked of a shard the coordinator has not admitted: its state
    may be another version than the other shards', so it copies nothing."""

    code = "cut_shard_not_joined"
    status = 409


class ShardNotJoinedError(PSError):
    """The shard restored its state but the coordinator has not admitted it
    into the cluster yet (or is restoring every shard to one version): it
    serves no pulls or pushes until then. Retrying later may succeed."""

    code = "shard_not_joined"
    status = 503
    retriable = True


class ClusterNotReadyError(PSError):
    """The coordinator grants no lease (and cuts nothing) while a shard is
    not joined or every shard is being restored to one version."""

    code = "cluster_not_ready"
    status = 503
    retriable = True


class NoCommonVersionError(PSError):
    """No export version loads on every shard: the cluster refuses to train
    rather than mix versions (exit code 4: refused to resume)."""

    code = "no_common_version"
    status = 409
    retriable = False
    exit_code = 4


class AuthError(PSError):
    """The shard refused the credentials: no token, or one that is not this
    cluster's. A configuration error: never retried (set CTRPS_SHARD_TOKEN or
    CTRPS_CLUSTER_SECRET)."""

    code = "unauthorized"
    status = 401
    exit_code = 2  # a settings error: the token or secret given is not the cluster's


class ForbiddenError(AuthError):
    """The token is valid but of too low a scope for the call (a read token
    pushing, a train token cutting a snapshot). Never retried."""

    code = "forbidden"
    status = 403


class TlsVerifyError(PSError):
    """The server's TLS certificate did not verify against the CA this
    client trusts (--tls-ca), or names another host. Never retried."""

    code = "tls_verify_failed"
    status = 495
    exit_code = 2


_BY_CODE: dict[str, type[PSError]] = {
    cls.code: cls
    for cls in (
        InvalidRequestError,
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
        ExportWriteError,
        CutAbortedError,
        CutNotJoinedError,
        ShardNotJoinedError,
        ClusterNotReadyError,
        NoCommonVersionError,
        AuthError,
        ForbiddenError,
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
