"""Typed errors of the parameter server.

Every error a caller can act on is a `PSError` subclass with a stable `code`
(the ``error`` field of a JSON error body), the HTTP `status` the shard server
and the API map it to, and a `retriable` flag telling a client whether trying
again later can succeed. The mapping lives here, in one place; handlers raise
and never catch.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "PSError",
    "InvalidRequestError",
    "InvalidJSONError",
    "FrameError",
    "InvalidValuesError",
    "WrongShardError",
    "MovedError",
    "MoveRefusedError",
    "SlotsUnsettledError",
    "KeySetExpiredError",
    "FrameVersionError",
    "UnknownTableError",
    "TableConfigError",
    "TableConflictError",
    "StatusError",
    "UnknownModelError",
    "ModelConflictError",
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
    "http_status",
    "HTTP_CODES",
]


HTTP_CODES: dict[str, int] = {
    "not_found": 404,
    "method_not_allowed": 405,
    "too_large": 413,
    "internal": 500,
    "shard_error": 502,
}
"""Error codes a server answers with that no `PSError` carries: the HTTP
layer's own refusals, an unexpected failure, the API's relay of a shard's."""

_STATUS_BY_CODE: dict[str, tuple[int, str]] = {c: (s, "HTTP_CODES") for c, s in HTTP_CODES.items()}


def _register(code: str, status: int, owner: str) -> None:
    """`code` answers `status`: one status per code, wherever declared (an
    app's error may reuse a core code, never with another status)."""
    known = _STATUS_BY_CODE.setdefault(code, (status, owner))
    if known[0] != status:
        raise TypeError(f"{owner}: error code {code!r} is HTTP {known[0]} ({known[1]}), not {status}")


def http_status(code: str) -> int:
    """The HTTP status of the error `code`: the one mapping from codes to
    statuses (each `PSError` subclass's header, and `HTTP_CODES`). KeyError
    for a code nothing declares."""
    return _STATUS_BY_CODE[code][0]


class PSError(Exception):
    """Base of every parameter-server error. A subclass states its code,
    status and retriable flag in its header:
    ``class LeaseError(PSError, code="unknown_lease", status=404)``."""

    code = "ps_error"
    status = 500
    retriable = False

    def __init_subclass__(
        cls, *, code: str | None = None, status: int | None = None, retriable: bool | None = None, **kwargs: Any
    ) -> None:
        super().__init_subclass__(**kwargs)
        if code is not None:
            cls.code = code
        if status is not None:
            cls.status = status
        if retriable is not None:
            cls.retriable = retriable
        if code is not None:
            _register(code, cls.status, cls.__qualname__)

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def to_body(self) -> dict[str, Any]:
        """The JSON error body: ``{"error": code, "detail": reason}``."""
        return {"error": self.code, "detail": self.detail}

    @classmethod
    def from_body(cls, detail: str, body: dict[str, Any]) -> PSError:
        """The error a JSON error body of this code reports (`error_from_body`)."""
        return cls(detail)


class InvalidRequestError(PSError, code="bad_request", status=400):
    """A request is not its route's shape: a body that is not the JSON
    object documented, a field of the wrong type or out of bounds, an
    integer that is not ASCII digits (`ps_core.parsing`). Nothing was done."""


class FrameError(PSError, code="bad_frame", status=400):
    """A binary RPC frame is malformed: bad magic or version, truncated, or its
    counts do not match its length. Nothing was applied."""


class FrameVersionError(FrameError, code="unsupported_frame_version", status=400):
    """A shard does not read the frame format this client writes (a shard
    older than the worker's --wire-* flags need). Nothing was applied."""

    exit_code = 1  # a worker's flags and its shards' version disagree: one line, not a traceback


class InvalidValuesError(PSError, code="invalid_values", status=400):
    """Values in an otherwise well-formed request are unusable (NaN or infinite
    gradients, negative counts, a width that does not match the table).
    Nothing was applied."""


class KeySetExpiredError(PSError, code="key_set_expired", status=409):
    """A push named a key set the shard no longer holds (used, expired or
    evicted, or the shard restarted). Nothing was applied: send the push
    again with its keys (`ps_core.net.transports` does)."""


class WrongShardError(PSError, code="wrong_shard", status=400):
    """Keys were sent to a shard that does not own them: the client and the
    shard disagree on the number of shards. Nothing was applied."""


class MovedError(WrongShardError, code="moved", status=421):
    """Keys of slots the shard does not own at its slot map's `epoch`
    (`ps_core.slots`): the client's map is older than the shard's, or the
    shard's is older than the client's. Nothing was applied; a client with
    an older map refreshes it and sends the keys again."""

    def __init__(self, detail: str, epoch: int = 0) -> None:
        super().__init__(detail)
        self.epoch = epoch
        """The slot map epoch the shard answered at."""

    def to_body(self) -> dict[str, Any]:
        return {**super().to_body(), "epoch": self.epoch}

    @classmethod
    def from_body(cls, detail: str, body: dict[str, Any]) -> PSError:
        epoch = body.get("epoch")
        return cls(detail, epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else 0)


class SlotsUnsettledError(PSError, code="slots_unsettled", status=503, retriable=True):
    """A shard kept refusing keys as `moved` while the client and the shards
    held different slot maps, longer than a move's steps take (a move cut
    short): an outage, waited out and tried again."""


class MoveRefusedError(PSError, code="move_refused", status=409):
    """A slot move a shard cannot take part in now: a map that is not the
    next one, slots it does not own, or a sync step open. Nothing changed."""


class UnknownTableError(PSError, code="unknown_table", status=404):
    """The request names a table the shard has not declared."""


class TableConfigError(PSError, code="bad_table_config", status=400):
    """A table declaration is invalid (unknown optimizer, bad width or
    hyperparameter)."""


class TableConflictError(PSError, code="table_conflict", status=409):
    """A table is declared again with a configuration different from the one it
    has. Declarations are idempotent only for identical configurations."""

    exit_code = 1  # a worker started with other flags than its model's: one line, not a traceback


class ModeConflictError(TableConflictError, code="mode_conflict", status=409):
    """A worker declares a model's tables with another update mode (or
    staleness bound) than the model was created with: all workers of a model
    must agree, so a worker with another mode is refused."""


class UnknownModelError(PSError, code="unknown_model", status=404):
    """The request names a model the cluster (or the server answering) does
    not hold."""

    exit_code = 1


class ModelConflictError(PSError, code="model_conflict", status=409):
    """A model is created again with another type or configuration than it
    has, or its tables are claimed by another model. Creation is idempotent
    only for the same configuration."""

    exit_code = 1


class StatusError(PSError, code="bad_status", status=400):
    """A status report for the shard's status board is malformed (not a JSON
    object of a source name and a status object, or too large). Nothing was
    stored."""


class ShardUnavailableError(PSError, code="shard_unavailable", status=503, retriable=True):
    """A shard could not be reached before the client's deadline.

    `shard_id` and `url` name the shard; retrying later may succeed. `since`
    is when the call's first attempt was sent (`time.monotonic`, None when
    not known): an outage began no later than that."""

    def __init__(self, detail: str, *, shard_id: int = -1, url: str = "", since: float | None = None) -> None:
        super().__init__(detail)
        self.shard_id = shard_id
        self.url = url
        self.since = since


class LeaseError(PSError, code="unknown_lease", status=404):
    """A lease id that is not active (never granted) or a malformed lease request."""


class CutInProgressError(PSError, code="cut_in_progress", status=503, retriable=True):
    """A lease was not granted within its wait limit because a cut is pausing."""


class NoCoordinatorError(PSError, code="no_coordinator", status=404):
    """The shards host no coordinator (shard 0 runs without exports)."""

    exit_code = 1  # only fatal where a coordinator is required (a sync worker, ctrps export)


class ExportCorruptError(PSError, code="export_corrupt", status=500):
    """An export version fails its checks: a file is missing, or its size or
    SHA-256 differs from its manifest, or the manifest itself is unreadable.

    `file` names the file; `expected` and `actual` the checksums (or sizes,
    or ``"missing"``)."""

    def __init__(self, detail: str, *, file: str = "", expected: str = "", actual: str = "") -> None:
        super().__init__(detail)
        self.file = file
        self.expected = expected
        self.actual = actual


class ExportNotFoundError(PSError, code="export_not_found", status=404):
    """No export version (or no complete chain of them) matches the request."""


class SnapshotError(PSError, code="bad_snapshot", status=409):
    """A snapshot request that does not fit the shard: an unknown or already
    fetched version, or labels that are not one cut's."""


class ExportWriteError(PSError, code="export_write_failed", status=507, retriable=True):
    """An export's files could not be written (disk full, permissions: any
    `OSError`). `path` names what failed; no partial version is left behind,
    the shards' copies are dropped and the next cut is a base."""

    exit_code = 1

    def __init__(self, detail: str, *, path: str = "") -> None:
        super().__init__(detail)
        self.path = path


class CutAbortedError(PSError, code="cut_aborted", status=500, retriable=True):
    """A cut failed on at least one shard (unreachable, refused, too slow)
    and was aborted on every shard it reached: leases reopened, copies
    dropped, its version never used again. The next cut is a base."""

    exit_code = 1


class CutNotJoinedError(SnapshotError, code="cut_shard_not_joined", status=409):
    """A cut asked of a shard the coordinator has not admitted: its state
    may be another version than the other shards', so it copies nothing."""


class ShardNotJoinedError(PSError, code="shard_not_joined", status=503, retriable=True):
    """The shard restored its state but the coordinator has not admitted it
    into the cluster yet (or is restoring every shard to one version): it
    serves no pulls or pushes until then. Retrying later may succeed."""


class ClusterNotReadyError(PSError, code="cluster_not_ready", status=503, retriable=True):
    """The coordinator grants no lease (and cuts nothing) while a shard is
    not joined or every shard is being restored to one version."""


class NoCommonVersionError(PSError, code="no_common_version", status=409, retriable=False):
    """No export version loads on every shard: the cluster refuses to train
    rather than mix versions (exit code 4: refused to resume)."""

    exit_code = 4


class AuthError(PSError, code="unauthorized", status=401):
    """The shard refused the credentials: no token, or one that is not this
    cluster's. A configuration error: never retried (set CTRPS_SHARD_TOKEN or
    CTRPS_CLUSTER_SECRET)."""

    exit_code = 2  # a settings error: the token or secret given is not the cluster's


class ForbiddenError(AuthError, code="forbidden", status=403):
    """The token is valid but of too low a scope for the call (a read token
    pushing, a train token cutting a snapshot). Never retried."""


class TlsVerifyError(PSError, code="tls_verify_failed", status=495):
    """The server's TLS certificate did not verify against the CA this
    client trusts (--tls-ca), or names another host. Never retried."""

    exit_code = 2


class InvalidJSONError(InvalidRequestError, code="invalid_json"):
    """A JSON route's body is not one JSON document: malformed, blank,
    nested too deeply, or a document followed by more bytes (a second
    document, a NUL); whatever the route's own code for a wrong shape."""


_BY_CODE: dict[str, type[PSError]] = {
    cls.code: cls
    for cls in (
        InvalidRequestError,
        InvalidJSONError,
        FrameError,
        InvalidValuesError,
        WrongShardError,
        MovedError,
        MoveRefusedError,
        SlotsUnsettledError,
        UnknownTableError,
        TableConfigError,
        ModeConflictError,
        TableConflictError,
        StatusError,
        UnknownModelError,
        ModelConflictError,
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
        KeySetExpiredError,
        FrameVersionError,
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
            return cls.from_body(detail, body)
        err = PSError(f"{code or 'http_' + str(status)}: {detail}")
    else:
        err = PSError(f"http {status}: {body!r}")
    err.status = status
    return err
