"""Parsers of public CTR data sets into events (the event format is in
docs/architecture.md, "Events and feature ids").

Each parser turns one row into an event dict ``{"id", ["ts",] "label", "features"}``
or raises `FormatError`; `iter_file` reads a whole file (plain or ``.gz``) and
yields the error *instead of* raising, so a producer can skip bad rows and report
how many were skipped and why (`FormatError.reason` is a short stable code,
``str(error)`` the readable message with the line number).

Formats:

- ``criteo`` — Criteo display-ads TSV, 40 columns: label, I1..I13 (integers or
  empty), C1..C26 (hashed categoricals, usually 8 hex characters, or empty).
  Integers become categorical buckets as the Kaggle-winning solution did
  (floor(ln(x)²) for x > 2): ``"I5": "b12"`` for a bucket, ``"I5": "v2"`` for a
  small value kept as itself (x ≤ 2, including negatives such as ``"v-1"``);
  the two prefixes keep a bucket number from colliding with a raw value.
  Criteo has no time column, so events carry no ``ts`` (workers then window by
  count); ``id`` is ``<prefix><line number>``.
- ``avazu`` — Avazu CSV with a header row, one record per line: ``click`` is the
  label, ``hour`` (YYMMDDHH, UTC) becomes ``ts`` (seconds) and also the
  categorical feature ``hour`` = HH (hour of day), ``id`` is the event id, and
  every other column is a categorical feature.
- ``jsonl`` — one event object per line, passed through after light checks
  (label 0/1, features an object or keys a list, ts a number); an ``id`` is
  added (``<prefix><line number>``) only when the line has none.

Empty fields are omitted from ``features``. Blank lines are not events and are
ignored in every format. Line numbers count physical lines from 1 (Avazu's
header is line 1).
"""

from __future__ import annotations

import calendar
import csv
import gzip
import io
import math
from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "FORMATS",
    "FormatError",
    "criteo_int_bucket",
    "parse_criteo_line",
    "parse_avazu_row",
    "parse_jsonl_line",
    "iter_file",
]

FORMATS = ("criteo", "avazu", "jsonl")

CRITEO_NUMERIC = tuple(f"I{i}" for i in range(1, 14))
CRITEO_CATEGORICAL = tuple(f"C{i}" for i in range(1, 27))
_CRITEO_COLUMNS = 1 + len(CRITEO_NUMERIC) + len(CRITEO_CATEGORICAL)
_AVAZU_SPECIAL = frozenset({"id", "click", "hour"})


class FormatError(ValueError):
    """A row that cannot become an event.

    `reason` is a short code for counting (``column_count``, ``label_not_integer``,
    ``label_not_0_or_1``, ``missing_label``, ``bad_integer``, ``bad_hour``,
    ``not_json``, ``not_an_object``, ``bad_features``, ``bad_ts``, ``bad_id``,
    ``not_utf8``); `detail` says what was wrong; `lineno` is the line number.
    """

    def __init__(self, reason: str, detail: str, lineno: int | None = None) -> None:
        self.reason = reason
        self.detail = detail
        self.lineno = lineno
        super().__init__(f"line {lineno}: {detail}" if lineno is not None else detail)

    def __reduce__(self) -> tuple[Any, ...]:
        return (FormatError, (self.reason, self.detail, self.lineno))


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "…")


def _label(raw: str, lineno: int) -> int:
    if raw == "0":
        return 0
    if raw == "1":
        return 1
    try:
        value = int(raw)
    except ValueError:
        detail = f"label {_short(raw)} is not an integer"
        raise FormatError("label_not_integer", detail, lineno) from None
    raise FormatError("label_not_0_or_1", f"label {value} is not 0 or 1", lineno)


def criteo_int_bucket(x: int) -> str:
    """The categorical string for a Criteo integer: ``b<floor(ln(x)²)>`` or ``v<x>``."""
    if x > 2:
        return f"b{int(math.log(x) ** 2)}"
    return f"v{x}"


def parse_criteo_line(line: str, lineno: int, *, id_prefix: str = "criteo-") -> dict[str, Any]:
    """One Criteo TSV line (label, I1..I13, C1..C26) as an event; see the module docstring."""
    cols = line.rstrip("\r\n").split("\t")
    if len(cols) != _CRITEO_COLUMNS:
        raise FormatError(
            "column_count",
            f"expected {_CRITEO_COLUMNS} tab-separated columns (label, I1..I13, C1..C26), got {len(cols)}",
            lineno,
        )
    label = _label(cols[0], lineno)
    features: dict[str, Any] = {}
    for name, raw in zip(CRITEO_NUMERIC, cols[1:14]):
        if raw:
            try:
                features[name] = criteo_int_bucket(int(raw))
            except ValueError:
                raise FormatError("bad_integer", f"{name} value {_short(raw)} is not an integer", lineno) from None
    for name, raw in zip(CRITEO_CATEGORICAL, cols[14:]):
        if raw:
            features[name] = raw
    return {"id": f"{id_prefix}{lineno}", "label": label, "features": features}


@lru_cache(maxsize=4096)
def _avazu_hour(raw: str) -> float:
    """YYMMDDHH (UTC, 20YY) → epoch seconds; hours repeat for thousands of rows, so cached."""
    if len(raw) != 8 or not raw.isdigit():
        raise ValueError(raw)
    year, month, day, hour = (int(raw[i : i + 2]) for i in (0, 2, 4, 6))
    if not (1 <= month <= 12 and 0 <= hour <= 23):
        raise ValueError(raw)
    if not 1 <= day <= calendar.monthrange(2000 + year, month)[1]:
        raise ValueError(raw)
    return float(calendar.timegm((2000 + year, month, day, hour, 0, 0)))


def parse_avazu_row(
    row: Mapping[Any, Any],
    header: Sequence[str],
    lineno: int,
    *,
    id_prefix: str = "avazu-",
) -> dict[str, Any]:
    """One Avazu record (column name → value, as from `csv.DictReader` or zip with
    the header) as an event; `header` gives the columns and their order.

    A row with too few or too many columns (a missing key, a ``None`` value or a
    ``None`` key, which is how `csv.DictReader` marks them) is a ``column_count`` error.
    """
    extra = row.get(None)
    n_extra = len(extra) if isinstance(extra, list) else int(extra is not None)
    n_missing = sum(1 for h in header if row.get(h) is None)
    if n_extra or n_missing:
        got = len(header) - n_missing + n_extra
        detail = f"expected {len(header)} comma-separated columns, got {got}"
        raise FormatError("column_count", detail, lineno)
    label = _label(row["click"], lineno)
    hour: str = row["hour"]
    try:
        ts = _avazu_hour(hour)
    except ValueError:
        raise FormatError("bad_hour", f"hour {_short(hour)} is not a valid YYMMDDHH (UTC) time", lineno) from None
    features: dict[str, Any] = {"hour": hour[6:8]}
    for name in header:
        value = row[name]
        if value and name not in _AVAZU_SPECIAL:
            features[name] = value
    event_id = row.get("id") or f"{id_prefix}{lineno}"
    return {"id": event_id, "ts": ts, "label": label, "features": features}


def parse_jsonl_line(line: str | bytes, lineno: int, *, id_prefix: str = "jsonl-") -> dict[str, Any]:
    """One JSON-lines event, checked lightly and passed through (an ``id`` is added
    when missing). The label must be 0 or 1; ``features`` an object (or ``keys`` a
    list of ids); ``ts``, when present, a number."""
    try:
        event = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise FormatError("not_json", f"not valid JSON: {exc}", lineno) from None
    if not isinstance(event, dict):
        detail = f"expected a JSON object, got {type(event).__name__}"
        raise FormatError("not_an_object", detail, lineno)
    if "label" not in event:
        raise FormatError("missing_label", "no label", lineno)
    label = event["label"]
    integral = isinstance(label, int) or (isinstance(label, float) and label.is_integer())
    if isinstance(label, bool) or not integral:
        detail = f"label {_short(repr(label))} is not an integer"
        raise FormatError("label_not_integer", detail, lineno)
    if label not in (0, 1):
        raise FormatError("label_not_0_or_1", f"label {label} is not 0 or 1", lineno)
    event["label"] = int(label)
    features = event.get("features")
    if features is None and "keys" not in event:
        raise FormatError("bad_features", "neither features nor keys", lineno)
    if features is not None and not isinstance(features, dict):
        raise FormatError("bad_features", "features is not an object", lineno)
    if "keys" in event and not isinstance(event["keys"], list):
        raise FormatError("bad_features", "keys is not a list", lineno)
    ts = event.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise FormatError("bad_ts", f"ts {_short(repr(ts))} is not a number", lineno)
    if "id" not in event:
        event["id"] = f"{id_prefix}{lineno}"
    elif isinstance(event["id"], bool) or not isinstance(event["id"], (str, int)):
        raise FormatError("bad_id", "id is not a string or an integer", lineno)
    return event


def _open(path: Path) -> io.BufferedIOBase:
    if path.suffix == ".gz":
        return gzip.GzipFile(path, "rb")
    return path.open("rb")


def _is_blank(raw: bytes) -> bool:
    # Not bytes.strip(): a Criteo row whose fields are all empty is tabs only, and is
    # a bad row to report, not a blank line.
    return not raw.strip(b" \r\n")


def _lines(fh: io.BufferedIOBase) -> Iterator[tuple[int, str | FormatError]]:
    """(line number, text) for non-blank lines; undecodable lines become errors."""
    for lineno, raw in enumerate(fh, start=1):
        if _is_blank(raw):
            continue
        try:
            yield lineno, raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            detail = f"not UTF-8: {exc.reason} at byte {exc.start}"
            yield lineno, FormatError("not_utf8", detail, lineno)


def iter_file(path: str | Path, fmt: str) -> Iterator[dict[str, Any] | FormatError]:
    """Events of a file, with each bad row as a `FormatError` in its place.

    `fmt` is one of `FORMATS`; a ``.gz`` suffix means gzip. Raises `FormatError`
    (reason ``bad_header``) only for an Avazu file whose header lacks ``click`` or
    ``hour``, and `ValueError` for an unknown format; never for a bad row.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
    prefix = f"{path.name}:"
    with _open(path) as fh:
        if fmt == "jsonl":
            for lineno, raw in enumerate(fh, start=1):
                if _is_blank(raw):
                    continue
                try:
                    # orjson takes bytes and rejects invalid UTF-8 itself.
                    yield parse_jsonl_line(raw, lineno, id_prefix=prefix)
                except FormatError as exc:
                    yield exc
            return
        if fmt == "criteo":
            for lineno, line in _lines(fh):
                if isinstance(line, FormatError):
                    yield line
                    continue
                try:
                    yield parse_criteo_line(line, lineno, id_prefix=prefix)
                except FormatError as exc:
                    yield exc
            return
        yield from _iter_avazu(_lines(fh), prefix)


def _iter_avazu(lines: Iterator[tuple[int, str | FormatError]], prefix: str) -> Iterator[dict[str, Any] | FormatError]:
    header: list[str] | None = None
    for lineno, line in lines:
        if isinstance(line, FormatError):
            if header is None:
                raise FormatError("bad_header", f"header: {line.detail}", lineno)
            yield line
            continue
        line = line.rstrip("\r\n")
        # Avazu never quotes; the csv module is only needed when a line has quotes.
        values = line.split(",") if '"' not in line else next(csv.reader([line]))
        if header is None:
            header = [h.strip().lstrip("\ufeff") for h in values]
            missing = [h for h in ("click", "hour") if h not in header]
            if missing:
                raise FormatError("bad_header", f"the header has no {' or '.join(missing)} column", lineno)
            continue
        if len(values) != len(header):
            yield FormatError(
                "column_count",
                f"expected {len(header)} comma-separated columns, got {len(values)}",
                lineno,
            )
            continue
        try:
            yield parse_avazu_row(dict(zip(header, values)), header, lineno, id_prefix=prefix)
        except FormatError as exc:
            yield exc
