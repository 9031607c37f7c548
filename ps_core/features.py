"""Click events: decoding, validation and feature hashing, shared by training
and serving.

A Kafka message holds one event as a JSON object, several as a JSON array, or
JSON lines (`decode_message`). An event is::

    {"id": "e-1", "ts": 1764681600.25, "label": 1, "weight": 1.0,
     "features": {"site": "a3f09", "hour": "13", "price": 12.5, "tags": ["a", "b"]},
     "keys": [1234, 99]}

`FeatureHasher.featurize` turns a list of events into an `EventBatch`: the
feature ids of every event in CSR form, their values, labels, weights and
event times. Feature ids are stable 64-bit hashes (`FeatureHasher.feature_ids`
documents the function), namespaced by model.

Hashing is vectorised: the per-event Python work is validating the event and
extending two flat lists (field names, values). Categorical values are hashed
as one numpy unicode array (a multilinear hash of the code points, finished
with fmix64); field names through a small cache.

Errors are per group (a group is a message): an event that fails validation
fails its whole group, which is left out of the batch and reported with a
reason, so a message is either trained whole or dead-lettered whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import numpy.typing as npt
import orjson

from .errors import PSError
from .hashing import U64, mix64

__all__ = [
    "flatten_groups",
    "EventError",
    "EventBatch",
    "FeatureHasher",
    "decode_message",
    "string_hashes",
    "REASONS",
]

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

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
    if not value or not value.strip():
        raise EventError("empty", "the message has no content")
    if len(value) > max_bytes:
        raise EventError("oversized", f"{len(value)} bytes > limit {max_bytes}")
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError as exc:
        if b"\n" not in value.strip():
            raise EventError("invalid_json", str(exc)) from None
        doc = None
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


# -- string hashing ------------------------------------------------------------

_MULTS = np.zeros(0, dtype=np.uint64)


def _multipliers(width: int) -> U64:
    global _MULTS
    if _MULTS.size < width:
        # Odd 64-bit multipliers, one per code-point position: a pure function
        # of the position, so hashes never depend on the batch.
        _MULTS = mix64(np.arange(1, max(width, 64) + 1, dtype=np.uint64), 0x2545F4914F6CDD1D) | np.uint64(1)
    return _MULTS[:width]


def string_hashes(strings: Sequence[str] | npt.NDArray[np.object_]) -> U64:
    """Stable 64-bit hashes of strings: ``fmix64(sum_i cp_i * M_i)`` over the
    code points ``cp_i`` with fixed odd multipliers ``M_i`` (mod 2**64).

    Vectorised: all strings are encoded as one buffer (a byte per code point
    when ASCII, else UTF-32). When they all have the same length, the buffer
    is a matrix and the hashes one matrix-vector product; otherwise each code
    point is multiplied by the multiplier of its position within its string
    and ``np.add.reduceat`` sums each string's run.
    """
    seq = strings.tolist() if isinstance(strings, np.ndarray) else strings
    n = len(seq)
    if n == 0:
        return np.zeros(0, dtype=np.uint64)
    # One buffer, each string followed by a NUL: boundaries come from the
    # buffer itself instead of a len() per string. ASCII (the usual alphabet
    # of ids) takes one byte per code point, a quarter of UTF-32 to scan.
    joined = "\0".join(seq) + "\0"
    cps: npt.NDArray[np.uint8] | npt.NDArray[np.uint32] = (
        np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
        if joined.isascii()
        else np.frombuffer(joined.encode("utf-32-le"), dtype="<u4")
    )
    width = cps.size // n
    if width * n == cps.size:
        grid = cps.reshape(n, width)
        # NULs exactly at the end of every row: all strings have length
        # width - 1 (hex ids, say), so each hash is one row times the
        # multipliers, with no per-code-point positions to compute.
        if not grid[:, -1].any() and grid[:, :-1].all():
            return mix64(grid.astype(np.uint64) @ _multipliers(width))
    ends = np.flatnonzero(cps == 0)
    if ends.size != n:  # some string holds a NUL: take lengths the slow way
        lens = np.fromiter(map(len, seq), dtype=np.int64, count=n)
        ends = np.cumsum(lens + 1) - 1
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    seg_lens = ends - starts + 1  # including the terminator, so never empty
    # Position of each code point within its own string; terminators are 0 and add nothing.
    rel = np.arange(cps.size, dtype=np.int64) - np.repeat(starts, seg_lens)
    prod = cps.astype(np.uint64) * _multipliers(int(seg_lens.max()))[rel]
    return mix64(np.add.reduceat(prod, starts))


# -- events → batches ----------------------------------------------------------


@dataclass(frozen=True)
class EventBatch:
    """Hashed events in CSR form: event i has ``keys[offsets[i]:offsets[i+1]]``."""

    keys: U64
    """Feature ids of all events, concatenated (the bias id first in each event)."""
    values: F32
    """The value of each feature occurrence (1 for categorical)."""
    offsets: I64
    """(n + 1,) start of each event's features in `keys`."""
    labels: F32
    """(n,) 0/1 labels (NaN where absent, e.g. predict requests)."""
    weights: F32
    """(n,) sample weights (1 by default)."""
    ts: F64
    """(n,) event times in seconds (NaN where absent)."""
    index: I64
    """(n,) position of each event in the `featurize` input (rejected ones skipped)."""

    @property
    def size(self) -> int:
        """Number of events."""
        return int(self.labels.size)

    def event_of_feature(self) -> I64:
        """(nnz,) the event each feature occurrence belongs to."""
        return np.repeat(np.arange(self.size, dtype=np.int64), np.diff(self.offsets))

    @staticmethod
    def concat(batches: Sequence[EventBatch], index_shifts: Sequence[int]) -> EventBatch:
        """Batches one after the other; `index_shifts[i]` is added to batch i's `index`."""
        if len(batches) == 1 and index_shifts[0] == 0:
            return batches[0]
        sizes = np.array([b.keys.size for b in batches], dtype=np.int64)
        key_shift = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        offsets = np.concatenate(
            [b.offsets[:-1] + key_shift[i] for i, b in enumerate(batches)] + [np.array([sizes.sum()])]
        ).astype(np.int64)
        return EventBatch(
            keys=np.concatenate([b.keys for b in batches]),
            values=np.concatenate([b.values for b in batches]),
            offsets=offsets,
            labels=np.concatenate([b.labels for b in batches]),
            weights=np.concatenate([b.weights for b in batches]),
            ts=np.concatenate([b.ts for b in batches]),
            index=np.concatenate([b.index + shift for b, shift in zip(batches, index_shifts)]),
        )

    def slice(self, start: int, stop: int) -> EventBatch:
        """Events ``start:stop`` as views of this batch (no copy)."""
        o0, o1 = int(self.offsets[start]), int(self.offsets[stop])
        return EventBatch(
            keys=self.keys[o0:o1],
            values=self.values[o0:o1],
            offsets=self.offsets[start : stop + 1] - o0,
            labels=self.labels[start:stop],
            weights=self.weights[start:stop],
            ts=self.ts[start:stop],
            index=self.index[start:stop],
        )

    def select(self, events: I64) -> EventBatch:
        """A batch of the given events (sorted positions in this batch)."""
        lens = np.diff(self.offsets)[events]
        starts = self.offsets[:-1][events]
        take = np.repeat(starts - np.concatenate(([0], np.cumsum(lens)[:-1])), lens) + np.arange(
            int(lens.sum()), dtype=np.int64
        )
        return EventBatch(
            keys=self.keys[take],
            values=self.values[take],
            offsets=np.concatenate(([0], np.cumsum(lens))).astype(np.int64),
            labels=self.labels[events],
            weights=self.weights[events],
            ts=self.ts[events],
            index=self.index[events],
        )


_T_STR, _T_NUM, _T_LIST, _T_NONE, _T_BOOL, _T_OTHER = range(6)
_TYPE_CODE: dict[type, int] = {
    str: _T_STR,
    float: _T_NUM,
    int: _T_NUM,
    list: _T_LIST,
    type(None): _T_NONE,
    bool: _T_BOOL,
}
_C_CAT = np.uint64(0x9E3779B97F4A7C15)
_C_NUM = np.uint64(0xD6E8FEB86659FD93)
_C_BIAS = np.uint64(0xA0761D6478BD642F)
_KEY_LIMIT = 2**64


MAX_CACHED_FIELDS = 65_536
"""Field names whose hashes a `FeatureHasher` keeps; later new names are hashed each time."""


class _FieldHashes(dict[str, int]):
    """field name → ``fmix64(H(field) ^ namespace)``, computed on first use.

    Bounded: requests may name any fields (a predict API is open to the
    world), and an unbounded cache would let them grow the process."""

    def __init__(self, namespace: int) -> None:
        super().__init__()
        self._ns = np.uint64(namespace)

    def __missing__(self, field: str) -> int:
        h = int(mix64(string_hashes([field]) ^ self._ns)[0])
        if len(self) < MAX_CACHED_FIELDS:
            self[field] = h
        return h


class FeatureHasher:
    """Validates events and hashes their features into one model's id space.

    Feature ids (all arithmetic mod 2**64, ``H`` = `string_hashes`,
    ``ns = H(namespace)``, ``F = fmix64(H(field) ^ ns)``):

    - categorical ``field: "value"``: ``fmix64(F ^ H(value) * 0x9E3779B97F4A7C15)``,
      value 1; a list of strings is one such feature per element (multi-hot);
      ``true``/``false`` are the strings ``"true"``/``"false"``;
    - numeric ``field: x``: ``fmix64(F ^ 0xD6E8FEB86659FD93)``, value x;
    - pre-hashed ``keys: [k, ...]``: used as they are, value 1;
    - the bias: ``fmix64(ns ^ 0xA0761D6478BD642F)``, value 1, first in every event.

    ``null`` feature values are missing features and skipped.
    """

    def __init__(self, namespace: str, *, max_features: int = 4096) -> None:
        self.namespace = namespace
        self._ns = int(string_hashes([namespace])[0])
        self._fields = _FieldHashes(self._ns)
        self.max_features = max_features
        self.bias_key = int(mix64(np.array([self._ns], dtype=np.uint64) ^ _C_BIAS)[0])

    def feature_ids(self, fields: Sequence[str], values: Sequence[str | None]) -> U64:
        """Ids of features given as (field, categorical value) pairs; a None
        value names the numeric feature `field`."""
        f = np.fromiter(map(self._fields.__getitem__, fields), dtype=np.uint64, count=len(fields))
        is_cat = np.fromiter((v is not None for v in values), dtype=bool, count=len(values))
        out = mix64(f ^ _C_NUM)
        cat = np.flatnonzero(is_cat)
        if cat.size:
            hv = string_hashes([str(values[i]) for i in cat.tolist()])
            out[cat] = mix64(f[cat] ^ (hv * _C_CAT))
        return out

    def featurize(
        self,
        events: Sequence[dict[str, Any]],
        *,
        require_label: bool = True,
        groups: Sequence[int] | None = None,
    ) -> tuple[EventBatch, dict[int, EventError]]:
        """Validate and hash `events`.

        `groups[i]` is the group (message) of event i (default: each event its
        own group). Returns the batch of every event whose group had no error,
        and the first error of each failed group.
        """
        n = len(events)
        grp = list(range(n)) if groups is None else list(groups)
        errors: dict[int, EventError] = {}
        fields: list[str] = []
        values: list[Any] = []
        counts = np.zeros(n, dtype=np.int64)
        labels = np.full(n, np.nan, dtype=np.float32)
        weights = np.ones(n, dtype=np.float32)
        ts = np.full(n, np.nan, dtype=np.float64)
        prehashed: list[tuple[int, list[Any]]] = []
        fext, vext = fields.extend, values.extend
        for i, ev in enumerate(events):
            # The per-event budget: checks and two list extends, nothing per feature.
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
                    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
                        raise EventError("bad_ts", f"ts must be a number of seconds, got {t!r}")
                    ts[i] = t
                w = ev.get("weight")
                if w is not None:
                    if not isinstance(w, (int, float)) or isinstance(w, bool) or not 0 <= w < math.inf:
                        raise EventError("bad_weight", f"weight must be a number >= 0, got {w!r}")
                    weights[i] = w
                feats = ev.get("features")
                keys = ev.get("keys")
                if feats is None and keys is None:
                    raise EventError("bad_features", "an event needs features or keys")
                if feats is not None and not isinstance(feats, dict):
                    raise EventError(
                        "bad_features", f"features must be an object, got {type(feats).__name__}"
                    )
                if keys is not None and not isinstance(keys, list):
                    raise EventError("bad_keys", "keys must be a list of uint64 integers")
                nf = len(feats) if feats is not None else 0
                if nf + (len(keys) if keys is not None else 0) > self.max_features:
                    raise EventError("bad_features", f"more than {self.max_features} features")
            except EventError as exc:
                errors.setdefault(grp[i], exc)
                continue
            # Extended only once the event passed, so nothing needs undoing.
            if feats:
                fext(feats)
                vext(feats.values())
                counts[i] = nf
            if keys is not None:
                prehashed.append((i, keys))
        return self._hash(events, fields, values, counts, labels, weights, ts, prehashed, grp, errors)

    def _hash(
        self,
        events: Sequence[dict[str, Any]],
        fields: list[str],
        values: list[Any],
        counts: I64,
        labels: F32,
        weights: F32,
        ts: F64,
        prehashed: list[tuple[int, list[Any]]],
        grp: list[int],
        errors: dict[int, EventError],
    ) -> tuple[EventBatch, dict[int, EventError]]:
        n = counts.size
        m = len(values)
        event_of = np.repeat(np.arange(n, dtype=np.int64), counts)
        try:
            codes = np.fromiter(map(_TYPE_CODE.__getitem__, map(type, values)), dtype=np.int8, count=m)
        except KeyError:
            codes = np.fromiter(
                (_TYPE_CODE.get(type(v), _T_OTHER) for v in values), dtype=np.int8, count=m
            )
        bad_event = np.zeros(n, dtype=bool)
        fhash = np.fromiter(map(self._fields.__getitem__, fields), dtype=np.uint64, count=m)
        keys = np.zeros(m, dtype=np.uint64)
        vals = np.ones(m, dtype=np.float32)
        keep = np.ones(m, dtype=bool)

        # An object array lets numpy pick values by type in C, not per value.
        objs = np.empty(m, dtype=object)
        objs[:] = values
        cat = np.flatnonzero(codes == _T_STR)
        if cat.size:
            hv = string_hashes(objs[cat])
            keys[cat] = mix64(fhash[cat] ^ (hv * _C_CAT))
        num = np.flatnonzero(codes == _T_NUM)
        if num.size:
            x = objs[num].astype(np.float64)
            finite = np.isfinite(x) & (np.abs(x) < 3.4e38)
            if not finite.all():
                for j in num[~finite]:
                    self._fail(errors, grp, bad_event, int(event_of[j]), "bad_value", f"{fields[j]}={values[j]!r} is not a finite float32")
            keys[num] = mix64(fhash[num] ^ _C_NUM)
            vals[num] = np.where(finite, x, 0).astype(np.float32)
        keep[codes == _T_NONE] = False
        extra_keys: list[np.ndarray] = []
        extra_vals: list[np.ndarray] = []
        extra_event: list[np.ndarray] = []
        rare = np.flatnonzero((codes == _T_LIST) | (codes == _T_BOOL) | (codes == _T_OTHER))
        for j in rare:  # multi-hot lists, booleans and wrong types: rare, so per value
            e = int(event_of[j])
            keep[j] = False
            v = values[j]
            if codes[j] == _T_BOOL:
                v = ["true" if v else "false"]
            elif codes[j] == _T_OTHER or not all(isinstance(s, str) for s in v):
                self._fail(errors, grp, bad_event, e, "bad_value", f"{fields[j]} has a {type(v).__name__} value; expected string, number or list of strings")
                continue
            if v:
                hv = string_hashes(v)
                extra_keys.append(mix64(np.uint64(fhash[j]) ^ (hv * _C_CAT)))
                extra_vals.append(np.ones(len(v), dtype=np.float32))
                extra_event.append(np.full(len(v), e, dtype=np.int64))
        for e, klist in prehashed:
            try:
                if not all(type(k) is int and 0 <= k < _KEY_LIMIT for k in klist):
                    raise ValueError
                ka = np.array(klist, dtype=np.uint64)
            except (ValueError, OverflowError, TypeError):
                self._fail(errors, grp, bad_event, e, "bad_keys", "keys must be integers in [0, 2**64)")
                continue
            extra_keys.append(ka)
            extra_vals.append(np.ones(ka.size, dtype=np.float32))
            extra_event.append(np.full(ka.size, e, dtype=np.int64))
        # Every event of a failed group goes, whatever failed in it.
        if errors:
            failed = np.fromiter((g in errors for g in grp), dtype=bool, count=n)
            bad_event |= failed
        good = np.flatnonzero(~bad_event)
        if errors:
            keep &= ~bad_event[event_of]
        per_event = np.bincount(event_of[keep], minlength=n)
        if not extra_keys:
            # Common case: features are already in event order; slot the bias
            # in front of each event's run without sorting.
            lens = per_event[good] + 1
            offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
            out_k = np.empty(int(offsets[-1]), dtype=np.uint64)
            out_v = np.empty(out_k.size, dtype=np.float32)
            is_bias = np.zeros(out_k.size, dtype=bool)
            is_bias[offsets[:-1]] = True
            out_k[is_bias] = self.bias_key
            out_v[is_bias] = 1.0
            out_k[~is_bias] = keys[keep]
            out_v[~is_bias] = vals[keep]
        else:
            ek = np.concatenate(extra_event)
            ok = ~bad_event[ek]
            per_event += np.bincount(ek[ok], minlength=n)
            k = np.concatenate(
                [np.full(good.size, self.bias_key, dtype=np.uint64), keys[keep]]
                + [a[ok[i : i + a.size]] for a, i in _runs(extra_keys)]
            )
            v = np.concatenate(
                [np.ones(good.size, dtype=np.float32), vals[keep]]
                + [a[ok[i : i + a.size]] for a, i in _runs(extra_vals)]
            )
            ev_of = np.concatenate([good, event_of[keep], ek[ok]])
            # Group by event; the stable sort keeps the bias first in each.
            order = np.argsort(ev_of, kind="stable")
            out_k, out_v = k[order], v[order]
            offsets = np.concatenate(([0], np.cumsum(per_event[good] + 1))).astype(np.int64)
        batch = EventBatch(
            keys=out_k,
            values=out_v,
            offsets=offsets,
            labels=labels[good],
            weights=weights[good],
            ts=ts[good],
            index=good.astype(np.int64),
        )
        return batch, errors

    @staticmethod
    def _fail(
        errors: dict[int, EventError],
        grp: list[int],
        bad_event: npt.NDArray[np.bool_],
        event: int,
        reason: str,
        detail: str,
    ) -> None:
        bad_event[event] = True
        errors.setdefault(grp[event], EventError(reason, f"event {event}: {detail}"))


def _runs(parts: list[np.ndarray]) -> list[tuple[np.ndarray, int]]:
    """Each array with the position where it starts in their concatenation."""
    out, pos = [], 0
    for a in parts:
        out.append((a, pos))
        pos += a.size
    return out


def flatten_groups(groups: Iterable[Sequence[dict[str, Any]]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Events of several messages as one list, with the message index of each."""
    events: list[dict[str, Any]] = []
    owner: list[int] = []
    for g, evs in enumerate(groups):
        events.extend(evs)
        owner.extend([g] * len(evs))
    return events, owner
