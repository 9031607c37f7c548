"""Decoding a window's records into a hashed `EventBatch`, in a worker process.

`decode_records` is a pure, picklable function: the worker runs it in a
process pool so that the per-event Python work (JSON decoding, validation)
uses another core and never blocks the event loop.

It is the per-event Python budget of the whole system (docs/measurements.md,
"The worker"), so the common case (every record one JSON object within the size limit) runs in
C-level maps over the chunk: one `orjson.loads` per record and nothing else
per record in Python. Any other record (an array, JSON lines, an error) goes
through `decode_message`/`message_events` for exactly their events or reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import orjson

from ps_core.model.batch import EventBatch
from ps_core.model.events import EventError, decode_message, message_events
from ps_core.model.featurizer import DEFAULT_NUMERIC, FeatureHasher
from ps_core.model.string_hashing import collector_paused

__all__ = ["Decoded", "Rejected", "decode_records"]


@dataclass(frozen=True)
class Rejected:
    """A record that failed to decode or validate."""

    index: int
    """Its position in the window."""
    reason: str
    """One of `ps_core.model.events.REASONS`."""
    detail: str
    """Explanation."""


@dataclass(frozen=True)
class Decoded:
    """The result of decoding a window's records."""

    batch: EventBatch
    """Events of every good record; `batch.index` maps events to `record_of`."""
    record_of: list[int]
    """For each event given to the hasher, the record (window position) it came from."""
    rejected: list[Rejected]
    """Records that go to the dead-letter queue, in window order."""
    seconds: float = 0.0
    """CPU-side time the decoding took (wall clock in the decoding process)."""
    also: tuple[EventBatch, ...] = ()
    """The same events hashed into each further namespace asked for (a
    worker training several models), in the order asked; the JSON was parsed
    and validated once."""


@lru_cache(maxsize=8)
def _hasher(namespace: str, numeric: str = DEFAULT_NUMERIC) -> FeatureHasher:
    # One hasher per process and namespace keeps its field-name cache warm.
    return FeatureHasher(namespace, numeric=numeric)


_FAILED = object()
"""Stands for a record `orjson.loads` refused (or a None record), or one not
parsed at all: `decode_message` then gives its events or reason."""


def _parse_all(values: list[bytes | None]) -> list[Any]:
    """`orjson.loads` of each record, `_FAILED` where it raised, with no
    Python-level work per record that parses."""
    docs: list[Any] = []
    loads: Any = orjson.loads  # a None record raises, as a bad one does
    it = map(loads, values)
    while True:
        try:
            # list.extend keeps what the map yielded before it raised, and the
            # map resumes after the record that raised.
            docs.extend(it)
            return docs
        except (orjson.JSONDecodeError, TypeError):
            docs.append(_FAILED)


def decode_records(
    values: list[bytes | None],
    namespace: str,
    max_bytes: int,
    also: tuple[tuple[str, str], ...] = (),
    numeric: str = DEFAULT_NUMERIC,
) -> Decoded:
    """Decode, validate and hash records; a record is trained whole or rejected
    whole. The events are hashed into `namespace` (numeric values as
    `numeric` says) and each ``(namespace, numeric)`` of `also`
    (`Decoded.also`): one parse for every model a worker trains."""
    t0 = time.perf_counter()
    # Parsed events hold no reference cycles, but a chunk allocates thousands
    # of containers, and each collector pass would walk every young event
    # dict (~5% of the chunk's time): paused while decoding.
    with collector_paused():
        return _decode(values, namespace, max_bytes, t0, also, numeric)


def _decode(
    values: list[bytes | None],
    namespace: str,
    max_bytes: int,
    t0: float,
    also: tuple[tuple[str, str], ...],
    numeric: str,
) -> Decoded:
    n = len(values)
    events: list[dict[str, Any]] = []
    record_of: list[int] = []
    rejected: list[Rejected] = []
    if max(map(len, filter(None, values)), default=0) > max_bytes:
        # Some record is too big: never parse it, take each record on its own.
        docs: list[Any] = [_FAILED] * n
    else:
        docs = _parse_all(values)
    if n and set(map(type, docs)) == {dict}:
        # The common case: one object per record, so event i is record i.
        events = docs
        record_of = list(range(n))
    else:
        for i, (value, doc) in enumerate(zip(values, docs)):
            try:
                if type(doc) is dict:
                    evs = [doc]
                elif doc is _FAILED:  # the error's reason, or JSON lines
                    evs = decode_message(value, max_bytes)
                else:
                    assert value is not None  # a None record does not parse
                    evs = message_events(doc, value)
            except EventError as exc:
                rejected.append(Rejected(i, exc.reason, exc.detail))
                continue
            events.extend(evs)
            record_of.extend([i] * len(evs))
    # Every event here is orjson's: exact JSON types, which spares a type check.
    batch, errors = _hasher(namespace, numeric).featurize(events, groups=record_of, json_types=True)
    rejected.extend(Rejected(g, e.reason, e.detail) for g, e in errors.items())
    rejected.sort(key=lambda r: r.index)
    # Validation does not depend on the namespace: the same events pass, in
    # the same order, so every batch's `index` and `record_of` agree.
    more = tuple(_hasher(ns, num).featurize(events, groups=record_of, json_types=True)[0] for ns, num in also)
    return Decoded(batch, record_of, rejected, time.perf_counter() - t0, more)
