"""Click events: decoding a message into events and validating them.

A Kafka message holds one event as a JSON object, several as a JSON array, or
JSON lines (`decode_message`). An event is::

    {"id": "e-1", "ts": 1764681600.25, "label": 1, "weight": 1.0,
     "features": {"site": "a3f09", "hour": "13", "price": 12.5, "tags": ["a", "b"]},
     "keys": [1234, 99]}

Validation is column-wise (`check_columns`): each of label, ts, weight,
features and keys is gathered for all events with ``map(dict.get, ...)``, and
its exact types and values are checked at once, with no Python loop per
event. If anything may fail, the per-event checks (`check_each`) run instead
and find each failed group's first error. Either gives a `Checked`, which
`FeatureHasher` hashes the same way.

Errors are per group (a group is a message): an event that fails validation
fails its whole group, which is left out of the batch and reported with a
reason, so a message is either trained whole or dead-lettered whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress, repeat
from operator import is_not
from typing import Any, NamedTuple

import numpy as np
import orjson

from ..errors import PSError
from .batch import F32, F64

__all__ = [
    "MAX_FEATURES",
    "MAX_FLOAT32",
    "MAX_TS",
    "MAX_VALUE",
    "MAX_WEIGHT",
    "REASONS",
    "Checked",
    "EventError",
    "check_columns",
    "check_each",
    "decode_message",
    "message_events",
]

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
    "untrainable",
)
"""Every reason an event or message is rejected for (DLQ reasons);
``untrainable`` is the worker's, for an event whose gradients were not finite
(`consumers.training`)."""


class EventError(PSError, code="bad_event", status=422):
    """An event or message is malformed; `reason` is one of `REASONS`."""

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


_NONE_TYPE = type(None)
# Exact types the column-wise checks accept; anything else (bool, str, a
# subclass) sends the call to the per-event checks, which name the error.
_NUMBER = frozenset({int, float})
_NUMBER_OR_NONE = frozenset({int, float, _NONE_TYPE})
_ONLY_NONE = frozenset({_NONE_TYPE})
_LABEL_VALUES = frozenset({0, 1, None})
_FEATURES_TYPES = frozenset({dict, _NONE_TYPE})
_KEYS_TYPES = frozenset({list, _NONE_TYPE})
_DICT = frozenset({dict})
MAX_FEATURES = 4096
"""Most features (fields and pre-hashed keys together) of one event, by default."""
MAX_FLOAT32 = 3.4e38
"""Largest numeric feature value as sent, in magnitude: it is kept as a
float32 (whose largest is 3.4028235e38) and must stay finite there."""
MAX_WEIGHT = 1e6
"""Largest event weight. With `MAX_VALUE` it bounds what one feature
occurrence adds to a linear gradient, ``|(p - y) * weight * x| <= 1e12``,
so a key's summed gradient and its square (what AdaGrad and FTRL
accumulate) stay finite in float32 for up to 1.8e7 occurrences of the key in
one mini-batch (the default 256 events of at most 4,096 features: 1e6)."""
MAX_VALUE = 1e6
"""Largest numeric feature value as a model is fed it (after ``log1p`` or a
divisor: `ps_core.model.featurizer.numeric_feed`), in magnitude; see `MAX_WEIGHT`."""
MAX_TS = 2**32
"""Event times are seconds in [0, MAX_TS), as the shards keep them (uint32)."""


class Checked(NamedTuple):
    """Validated events, ready to hash."""

    labels: F32
    """(n,) labels, NaN where absent."""
    weights: F32
    """(n,) weights, 1 where absent."""
    ts: F64
    """(n,) event times, NaN where absent."""
    to_hash: list[Any]
    """Each event's ``features`` object to hash (None: nothing, or the event failed)."""
    prehashed: list[tuple[int, list[Any]]]
    """(event, its ``keys`` list) of each event with keys."""
    errors: dict[int, EventError]
    """The first error of each failed group, in the order groups failed."""


def check_columns(events: Sequence[dict[str, Any]], require_label: bool, max_features: int) -> Checked | None:
    """Every event checked at once, a column at a time in C-level maps;
    None if some event may fail (then `check_each` decides)."""
    n = len(events)
    if not n or set(map(type, events)) != _DICT:
        return None
    get = dict.get
    labs = list(map(get, events, repeat("label")))
    label_types = set(map(type, labs))
    if not label_types <= (_NUMBER if require_label else _NUMBER_OR_NONE):
        return None
    if not set(labs) <= _LABEL_VALUES:  # exact int/float here, so no bools
        return None
    if _NONE_TYPE in label_types:
        labels = np.array(labs, dtype=np.float32)  # None → NaN
    else:
        labels = np.fromiter(labs, dtype=np.float32, count=n)
    wl = list(map(get, events, repeat("weight")))
    try:
        ts = _number_column(list(map(get, events, repeat("ts"))), n, MAX_TS)
        # Weights are mostly absent: then there is no column to convert.
        w = None if wl.count(None) == n else _number_column(wl, n, MAX_WEIGHT, top_inclusive=True)
    except OverflowError:  # an int beyond float range: the per-event checks raise as before
        return None
    if ts is None or (w is None and wl.count(None) != n):
        return None
    if w is None:
        weights = np.ones(n, dtype=np.float32)
    else:
        weights = w.astype(np.float32)
        absent = np.isnan(w)  # only where absent: NaN itself was refused
        if absent.any():
            weights[absent] = 1
    feats: list[Any] = list(map(get, events, repeat("features")))
    keys: list[Any] = list(map(get, events, repeat("keys")))
    ftypes, ktypes = set(map(type, feats)), set(map(type, keys))
    if not ftypes <= _FEATURES_TYPES or not ktypes <= _KEYS_TYPES:
        return None
    if _NONE_TYPE in ftypes:
        has_f = np.fromiter(map(is_not, feats, repeat(None)), dtype=bool, count=n)
        nf = np.zeros(n, dtype=np.int64)
        nf[has_f] = np.fromiter(map(len, compress(feats, has_f.tolist())), dtype=np.int64, count=int(has_f.sum()))
    else:
        has_f = None
        nf = np.fromiter(map(len, feats), dtype=np.int64, count=n)
    prehashed: list[tuple[int, list[Any]]] = []
    if ktypes != _ONLY_NONE:
        has_k = np.fromiter(map(is_not, keys, repeat(None)), dtype=bool, count=n)
        if has_f is not None and not (has_f | has_k).all():
            return None  # an event with neither
        sel = has_k.tolist()
        prehashed = list(compress(enumerate(keys), sel))
        nf[has_k] += np.fromiter(map(len, compress(keys, sel)), dtype=np.int64, count=len(prehashed))
    elif has_f is not None:
        return None
    if int(nf.max()) > max_features:
        return None
    return Checked(labels, weights, ts, feats, prehashed, {})


def _number_column(col: list[Any], n: int, top: float, *, top_inclusive: bool = False) -> F64 | None:
    """`ts` (in [0, `MAX_TS`)) or `weight` (in [0, `MAX_WEIGHT`]) of every
    event as float64, NaN where absent; None if some present value is wrong."""
    types = set(map(type, col))
    if types == _ONLY_NONE:
        return np.full(n, np.nan)
    if not types <= _NUMBER_OR_NONE:
        return None
    x = np.array(col, dtype=np.float64)  # None → NaN
    ok = (x >= 0) & ((x <= top) if top_inclusive else (x < top))  # NaN and infinities fail
    absent = col.count(None) if _NONE_TYPE in types else 0
    return x if int(np.count_nonzero(ok)) == n - absent else None


def check_each(events: Sequence[dict[str, Any]], require_label: bool, max_features: int, grp: list[int]) -> Checked:
    """The per-event checks: the first error of each failed group, in event order."""
    n = len(events)
    errors: dict[int, EventError] = {}
    to_hash: list[Any] = [None] * n
    labels = np.full(n, np.nan, dtype=np.float32)
    weights = np.ones(n, dtype=np.float32)
    ts = np.full(n, np.nan, dtype=np.float64)
    prehashed: list[tuple[int, list[Any]]] = []
    for i, ev in enumerate(events):
        try:
            if not isinstance(ev, dict):
                raise EventError("not_an_object", f"event is {type(ev).__name__}")
            lab = ev.get("label")
            if lab is None:
                if require_label:
                    raise EventError("missing_label", "training events need a 0/1 label")
            elif lab in (0, 1) and not isinstance(lab, (bool, str)):
                labels[i] = lab
            else:
                raise EventError("bad_label", f"label must be 0 or 1, got {lab!r}")
            t = ev.get("ts")
            if t is not None:
                if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < MAX_TS:
                    raise EventError("bad_ts", f"ts must be a number of seconds in [0, 2**32), got {t!r}")
                ts[i] = t
            w = ev.get("weight")
            if w is not None:
                if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w <= MAX_WEIGHT:
                    raise EventError("bad_weight", f"weight must be a number in [0, {MAX_WEIGHT:.6g}], got {w!r}")
                weights[i] = w
            feats = ev.get("features")
            keys = ev.get("keys")
            if feats is None and keys is None:
                raise EventError("bad_features", "an event needs features or keys")
            if feats is not None and not isinstance(feats, dict):
                raise EventError("bad_features", f"features must be an object, got {type(feats).__name__}")
            if keys is not None and not isinstance(keys, list):
                raise EventError("bad_keys", "keys must be a list of uint64 integers")
            nf = len(feats) if feats is not None else 0
            if nf + (len(keys) if keys is not None else 0) > max_features:
                raise EventError("bad_features", f"more than {max_features} features")
        except EventError as exc:
            errors.setdefault(grp[i], exc)
            continue
        # Recorded only once the event passed, so a failed event hashes nothing.
        to_hash[i] = feats
        if keys is not None:
            prehashed.append((i, keys))
    return Checked(labels, weights, ts, to_hash, prehashed, errors)
