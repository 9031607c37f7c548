"""The status board's schema: what a source may report (`Shard.report_status`).

Workers report one JSON object per window (`app.status.worker_status`); the
API and its metrics read the board back (`app.status.summarize`). A report
is stored only when it matches `WorkerStatus`, a closed model with
bounded sizes and values, so nothing stored can break a reader:

- counts are JSON integers in ``[0, 2**53)`` (exact as a float: what a
  dashboard or Prometheus reads back), seconds and times numbers in
  ``[0, 1e10]``;
- partition keys are ASCII digits without a leading zero, below 10**9
  (``"3"``, never ``"³"``, ``"03"`` or ``" 3"``), at most `MAX_PARTITIONS`
  of them; reasons and other names are printable ASCII of at most 64
  characters (they become metric labels), at most 64 of them;
- a `note` is free text of at most `MAX_NOTE_CHARS` characters without
  control characters (an operator's "maintenance"; never a metric label);
- the whole status is at most `MAX_STATUS_BYTES` encoded and at most three
  levels deep (the model is closed: no field outside it).

The API's OpenAPI document and the shard's publish this very model's schema
(`app.api.openapi`, `ps_core.net.shard_openapi`; `ps_core.bodies`).
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

import orjson
from msgspec import UNSET, Meta, Struct, UnsetType

from ..bodies import check
from ..errors import StatusError

__all__ = [
    "WorkerStatus",
    "StatusReport",
    "Source",
    "WindowSeconds",
    "MAX_STATUS_BYTES",
    "MAX_SOURCE_CHARS",
    "MAX_COUNT",
    "MAX_SECONDS",
    "MAX_PARTITIONS",
    "MAX_NOTE_CHARS",
    "PARTITION_KEY",
    "check_report",
    "as_worker_status",
]

MAX_STATUS_BYTES = 64 * 1024
"""Largest status object the board stores (encoded as JSON)."""
MAX_SOURCE_CHARS = 200
"""Longest source name on the board."""
MAX_COUNT = 2**53 - 1
"""Largest count a status may carry: every integer up to it is exact as a float."""
MAX_SECONDS = 1e10
"""Largest time (seconds since the epoch: the year 2286) or duration a status may carry."""
MAX_PARTITIONS = 4096
"""Most partitions one status may name."""
MAX_NAMES = 64
"""Most reasons (or fields of a window) one map of a status may hold."""
MAX_NOTE_CHARS = 200
"""Longest free-text note a status may carry."""

PARTITION_KEY = r"^(0|[1-9][0-9]{0,8})\Z"
"""A partition number as a JSON object key: ASCII digits, no sign or leading zero."""

Name = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[!-~]+\Z")]
Count = Annotated[int, Meta(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
V = TypeVar("V")
ByName = Annotated[dict[Name, V], Meta(max_length=MAX_NAMES)]
CountsBy = ByName[Count]
PartitionKey = Annotated[str, Meta(pattern=PARTITION_KEY)]
WindowValue = Annotated[float, Meta(ge=-1e15, le=1e15)] | Annotated[str, Meta(max_length=8 * MAX_PARTITIONS)] | None

Source = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=MAX_SOURCE_CHARS,
        pattern=r"^[!-~]+\Z",
        description="Who reports, e.g. a worker's host-pid-random id: printable ASCII, no blanks.",
    ),
]


class WindowSeconds(Struct, forbid_unknown_fields=True):
    """The histogram of window durations (app.status.SecondsHistogram)."""

    bounds: Annotated[list[Seconds], Meta(max_length=64)]
    counts: Annotated[list[Count], Meta(max_length=65)]
    sum: Annotated[float, Meta(ge=0, le=1e15)]
    count: Count


class WireReport(Struct, forbid_unknown_fields=True):
    """What a worker's pull and push frames cost (ps_core.net.wire.WireStats) and their format."""

    format: Annotated[str, Meta(max_length=200)] | UnsetType = UNSET
    bytes_sent: Count | UnsetType = UNSET
    bytes_received: Count | UnsetType = UNSET
    frames: Count | UnsetType = UNSET
    values_clipped: Count | UnsetType = UNSET
    key_set_pushes: Count | UnsetType = UNSET
    key_set_misses: Count | UnsetType = UNSET


class WorkerStatus(Struct, forbid_unknown_fields=True):
    """What app.status.worker_status reports (every field optional, no other field).

    A worker's report with a field not declared here is refused whole, so its
    window is on no board: every stat `worker_status` copies must be declared
    (tests/test_status.py builds one with every stat of each update mode)."""

    kind: Literal["worker"] | UnsetType = UNSET
    model: Name | UnsetType = UNSET
    update_mode: Name | UnsetType = UNSET
    reported_at: Seconds | UnsetType = UNSET
    started_at: Seconds | UnsetType = UNSET
    windows: Count | UnsetType = UNSET
    records_consumed: Count | UnsetType = UNSET
    events_trained: Count | UnsetType = UNSET
    dead_letters: Count | UnsetType = UNSET
    dead_letters_by_reason: CountsBy | UnsetType = UNSET
    commits: Count | UnsetType = UNSET
    failed_commits: Count | UnsetType = UNSET
    late_commit_failures: Count | UnsetType = UNSET
    stale_offsets: (
        Annotated[
            ByName[CountsBy],
            Meta(description="Partitions whose resume offset was not applied as given, by reason and action."),
        ]
        | UnsetType
    ) = UNSET
    outages: Count | UnsetType = UNSET
    outage_seconds: Seconds | UnsetType = UNSET
    windows_replayed: Count | UnsetType = UNSET
    lag_growing_seconds: (
        Annotated[Seconds, Meta(description="Seconds the worker's consumer lag had been growing (0: it was not).")]
        | UnsetType
    ) = UNSET
    lag_warnings: (
        Annotated[Count, Meta(description="Warnings that the worker's consumer lag kept growing.")] | UnsetType
    ) = UNSET
    rewinds: (
        Annotated[Count, Meta(description="Times a restarted coordinator made the worker resume from its offsets.")]
        | UnsetType
    ) = UNSET
    sync_steps: Annotated[Count, Meta(description="Sync: mini-batch steps the worker took part in.")] | UnsetType = (
        UNSET
    )
    geo_rounds: Annotated[Count, Meta(description="Geo: pushes of the local copy's differences.")] | UnsetType = UNSET
    geo_full_refreshes: (
        Annotated[
            Count,
            Meta(
                description="Geo: rounds after which every row of the local copy was read again (no complete change log)."
            ),
        ]
        | UnsetType
    ) = UNSET
    wire: WireReport | UnsetType = UNSET
    last_window: (
        Annotated[
            ByName[WindowValue],
            Meta(description="The last window's figures (consumers.worker.WindowReport.fields, and seconds)."),
        ]
        | UnsetType
    ) = UNSET
    lag_by_partition: (
        Annotated[
            dict[PartitionKey, Count],
            Meta(
                max_length=MAX_PARTITIONS,
                description="Records behind per partition (keys: partition numbers in ASCII digits).",
            ),
        ]
        | UnsetType
    ) = UNSET
    window_seconds: WindowSeconds | UnsetType = UNSET
    note: (
        Annotated[
            str,
            Meta(
                max_length=MAX_NOTE_CHARS,
                pattern=r"^[^\x00-\x1f\x7f]*\Z",
                description="Free text from whoever reports, e.g. an operator's `maintenance`: no control characters.",
            ),
        ]
        | UnsetType
    ) = UNSET


class StatusReport(Struct, forbid_unknown_fields=True):
    """A status reported to the board by its source."""

    source: Source
    status: WorkerStatus


def check_report(source: object, status: object, encoded_size: int) -> None:
    """`StatusError` (400) unless `source` and `status` (a decoded JSON
    object of `encoded_size` bytes) match the board's models; its detail
    names the field."""
    check(source, Source, StatusError, "$.source")
    if encoded_size > MAX_STATUS_BYTES:
        raise StatusError(f"status of {encoded_size} bytes exceeds {MAX_STATUS_BYTES}")
    check(status, WorkerStatus, StatusError, "$.status")


def as_worker_status(status: object) -> WorkerStatus:
    """`status` (a JSON object) as the `WorkerStatus` the board takes: its
    JSON form checked, as the board checks what it is sent (NaN and the
    infinities are null there); `StatusError` naming the field otherwise."""
    try:
        doc = orjson.loads(orjson.dumps(status))
    except TypeError as exc:  # orjson's error for non-string keys, objects, huge ints
        raise StatusError(f"status is not JSON: {exc}") from None
    out: WorkerStatus = check(doc, WorkerStatus, StatusError, "$.status")
    return out
