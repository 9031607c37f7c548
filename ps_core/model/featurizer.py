"""Feature hashing: validated events to feature ids, in one model's id space.

`FeatureHasher.featurize` validates events (see `events`) and turns them into
an `EventBatch`: the feature ids of every event in CSR form, their values,
labels, weights and event times. Feature ids are stable 64-bit hashes
(`FeatureHasher` documents the function), namespaced by model.

There is no Python loop per event or per value on the common path (every
Python-level step below is a C-level ``map`` over a column, or numpy):

- Field hashes come from a cache of layouts (`ps_core.model.layouts.Layouts`): the tuple of a
  features object's names, in order, keys precomputed field hashes and the
  type codes its first event had. A chunk's field hashes are one gather from
  that table. Values go straight from the dicts into one object array; the
  expected types are checked a class at a time (`ps_core.model.layouts.split_values`: every expected
  string exactly ``str``, every number int or float), falling back to a
  type lookup per value only when a check fails. The cache is bounded
  (`MAX_CACHED_SCHEMAS`, `MAX_CACHED_SCHEMA_FIELDS`); layouts past it are
  resolved per call, with the same ids.
- Categorical values are hashed together (`ps_core.model.string_hashing.string_hashes`: a multilinear hash
  of the code points, finished with fmix64), then every id is one fmix64
  over the chunk.
- Numbers, lists, booleans, nulls and pre-hashed keys are split out by type
  code; only multi-hot lists, booleans and wrong values are handled per value.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from itertools import chain
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt

from ..bodies import NUMERIC_PATTERN
from ..hashing import U64, mix64
from ..parsing import exact_ints
from .batch import F32, F64, I64, EventBatch
from .events import MAX_FEATURES, MAX_FLOAT32, MAX_VALUE, Checked, EventError, check_columns, check_each
from .layouts import (
    T_BOOL,
    T_LIST,
    T_NONE,
    T_OTHER,
    FieldHashes,
    Layouts,
    Split,
    split_values,
    type_codes,
)
from .string_hashing import collector_paused, joined_hashes, string_hashes

__all__ = ["FeatureHasher", "NUMERIC", "numeric_feed", "numeric_spec"]

NUMERIC = ("raw", "log1p")
"""How a model feeds numeric feature values: as sent (``raw``), or
``sign(x) log1p(|x|)`` (``log1p``: counts with long tails compressed, the
usual treatment of CTR count features); either divided by a positive number
D when written ``raw/D`` or ``log1p/D`` (`numeric_feed`). Part of a model's
declaration: training and serving must hash alike."""

DEFAULT_NUMERIC: Final = "log1p/16"
"""What a new model feeds unless told: ``log1p/16``, chosen by
`bench/studies/linear_defaults.py` (with FTRL's alpha and l1, over every stream
of `bench/bench_quality.py`). Numeric features then move the logit by steps
of a categorical feature's size or less: FTRL's per-coordinate steps are
the same in weight whatever a feature's scale, so a feature worth 3 moves
the logit 3 times as far as one worth 1. A declaration written before the
choice existed reads as ``raw``."""


def numeric_feed(numeric: str) -> tuple[bool, float]:
    """A model's `numeric` (`NUMERIC`) as whether it takes ``log1p`` and
    the number it divides by; `ValueError` naming the forms if it is none."""
    base, _, divisor = numeric.partition("/")
    if re.fullmatch(NUMERIC_PATTERN, numeric):
        d = float(divisor) if divisor else 1.0
        if d > 0:
            return base == "log1p", d
    raise ValueError(f"numeric {numeric!r} is not raw or log1p, optionally divided by a number > 0 (log1p/16)")


def numeric_spec(numeric: str) -> str:
    """`numeric` if it is a valid `NUMERIC` form (`numeric_feed`), as
    flags and variables read it."""
    numeric_feed(numeric)
    return numeric


_C_CAT = np.uint64(0x9E3779B97F4A7C15)
_C_NUM = np.uint64(0xD6E8FEB86659FD93)
_C_BIAS = np.uint64(0xA0761D6478BD642F)
_KEY_LIMIT = 2**64
_DICT = frozenset({dict})
_INT = frozenset({int})


class FeatureHasher:
    """Validates events and hashes their features into one model's id space.

    Feature ids (all arithmetic mod 2**64, ``H`` = `string_hashes`,
    ``ns = H(namespace)``, ``F = fmix64(H(field) ^ ns)``):

    - categorical ``field: "value"``: ``fmix64(F ^ H(value) * 0x9E3779B97F4A7C15)``,
      value 1; a list of strings is one such feature per element (multi-hot);
      ``true``/``false`` are the strings ``"true"``/``"false"``;
    - numeric ``field: x``: ``fmix64(F ^ 0xD6E8FEB86659FD93)``, value x, or
      ``sign(x) log1p(|x|)`` with ``numeric="log1p"`` (counts' long tails
      compressed), either divided by D with ``/D`` (`NUMERIC`);
    - pre-hashed ``keys: [k, ...]``: used as they are, value 1;
    - the bias: ``fmix64(ns ^ 0xA0761D6478BD642F)``, value 1, first in every event.

    ``null`` feature values are missing features and skipped.

    A hasher caches field-name hashes and feature layouts (the names of a
    ``features`` object in order), both bounded; it is not thread-safe.
    """

    def __init__(self, namespace: str, *, max_features: int = MAX_FEATURES, numeric: str = DEFAULT_NUMERIC) -> None:
        """`numeric`: how numeric values become feature values (`NUMERIC`)."""
        self._log1p, self._divisor = numeric_feed(numeric)
        self.namespace = namespace
        self.numeric = numeric
        self._ns = int(string_hashes([namespace])[0])
        self._fields = FieldHashes(self._ns)
        self._layouts = Layouts(self._fields)
        self.max_features = max_features
        self.bias_key = int(mix64(np.array([self._ns], dtype=np.uint64) ^ _C_BIAS)[0])

    def fed_values(self, x: npt.ArrayLike) -> F32:
        """Numeric feature values `x` as the model is fed them (`numeric`)."""
        v = np.asarray(x, dtype=np.float64)
        return _fed(v, self._log1p, self._divisor).astype(np.float32)

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
        json_types: bool = False,
    ) -> tuple[EventBatch, dict[int, EventError]]:
        """Validate and hash `events`.

        `groups[i]` is the group (message) of event i (default: each event its
        own group). Returns the batch of every event whose group had no error,
        and the first error of each failed group. `json_types`: the events
        come from a JSON parser (orjson), so their values are exactly str,
        int, float, bool, None, list or dict, never a subclass; the checks
        then skip a pass over the strings' types. The result is the same.
        """
        n = len(events)
        grp = list(range(n)) if groups is None else list(groups)
        with collector_paused():
            checked = check_columns(events, require_label, self.max_features)
            if checked is None:
                # Some event is invalid (or unusual): check them one by one to
                # find each failed group's first error, exactly.
                checked = check_each(events, require_label, self.max_features, grp)
            return self._hash(checked, grp, json_types)

    def _gather(
        self, present: list[Any], json_types: bool = False
    ) -> tuple[U64, npt.NDArray[np.object_], npt.NDArray[np.int8], Split, I64, list[str] | None]:
        """Field hashes, values (an object array) and exact type codes of the
        values of `present` (the non-empty features objects, in event order),
        and their lengths; plus the field names when they were built anyway
        (else they are built on demand, for an error message)."""
        if set(map(type, present)) <= _DICT:
            fhash, codes, lens = self._layouts.gather(present)
            m = int(lens.sum())
            # Straight from the dicts into the object array, no list between.
            objs = np.fromiter(chain.from_iterable(map(dict.values, present)), dtype=object, count=m)
            return fhash, objs, codes, split_values(objs, codes, check=True, json_types=json_types), lens, None
        # Dict subclasses: as they iterate, per value (rare: JSON gives dicts).
        fields: list[str] = []
        values: list[Any] = []
        for feats in present:
            fields.extend(feats)
            values.extend(feats.values())
        lens = np.fromiter(map(len, present), dtype=np.int64, count=len(present))
        m = len(values)
        fhash = np.fromiter(map(self._fields.__getitem__, fields), dtype=np.uint64, count=m)
        objs = np.empty(m, dtype=object)
        objs[:] = values
        codes = type_codes(values)
        return fhash, objs, codes, split_values(objs, codes, check=False), lens, fields

    def _hash(self, checked: Checked, grp: list[int], json_types: bool) -> tuple[EventBatch, dict[int, EventError]]:
        """The batch of validated events, in steps: the features' columns;
        ids and values of the categorical and numeric ones; the rare values
        and pre-hashed keys as extra features; then every event of a failed
        group left out, each remaining event's bias first."""
        n = len(checked.to_hash)
        cols = self._columns(checked.to_hash, json_types)
        fails = _Failures(checked.errors, grp, n)
        keys, vals = _ids(cols, fails, log1p=self._log1p, divisor=self._divisor)
        keep = cols.codes != T_NONE  # nulls are missing features
        extras = _Extras()
        _rare_values(cols, keep, fails, extras)
        if checked.prehashed:
            _prehashed(checked.prehashed, fails, extras)
        bad_event = fails.failed_events()
        good = np.flatnonzero(~bad_event)
        if fails.errors:
            keep &= ~bad_event[cols.event_of]
        if extras.keys:
            out_k, out_v, offsets = self._merged(cols, keys, vals, keep, extras, bad_event, good)
        else:
            out_k, out_v, offsets = self._in_order(cols, keys, vals, keep, good)
        batch = EventBatch(
            keys=out_k,
            values=out_v,
            offsets=offsets,
            labels=checked.labels[good],
            weights=checked.weights[good],
            ts=checked.ts[good],
            index=good.astype(np.int64),
        )
        return batch, fails.errors

    def _columns(self, to_hash: list[Any], json_types: bool) -> _Columns:
        """The values of the features objects `to_hash` (one per event, None
        for none), flattened in event order."""
        n = len(to_hash)
        present = list(filter(None, to_hash))  # drops None and empty objects, in C
        fhash, objs, codes, split, lens, names = self._gather(present, json_types)
        counts = np.zeros(n, dtype=np.int64)
        if len(present) == n:
            counts[:] = lens
        else:
            counts[np.fromiter(map(bool, to_hash), dtype=bool, count=n)] = lens
        return _Columns(fhash, objs, codes, split, counts, present, names)

    def _in_order(self, cols: _Columns, keys: U64, vals: F32, keep: npt.NDArray[np.bool_], good: I64) -> _CSR:
        """The CSR of the `good` events when there are no extras: the kept
        features are already in event order, so the bias is slotted in front
        of each event's run without sorting."""
        all_kept = bool(keep.all())
        per_event = cols.counts if all_kept else np.bincount(cols.event_of[keep], minlength=cols.counts.size)
        lens = per_event[good] + 1
        offsets = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
        out_k = np.empty(int(offsets[-1]), dtype=np.uint64)
        out_v = np.empty(out_k.size, dtype=np.float32)
        is_feature = np.ones(out_k.size, dtype=bool)
        is_feature[offsets[:-1]] = False
        out_k[offsets[:-1]] = self.bias_key
        out_v[offsets[:-1]] = 1.0
        out_k[is_feature] = keys if all_kept else keys[keep]
        out_v[is_feature] = vals if all_kept else vals[keep]
        return out_k, out_v, offsets

    def _merged(
        self,
        cols: _Columns,
        keys: U64,
        vals: F32,
        keep: npt.NDArray[np.bool_],
        extras: _Extras,
        bad_event: npt.NDArray[np.bool_],
        good: I64,
    ) -> _CSR:
        """The CSR of the `good` events with the extras: biases, kept features
        and extras of events that did not fail, grouped by event by a stable
        sort, which keeps the bias first in each, then the features, then the
        extras in the order they were found."""
        n = cols.counts.size
        ek = np.concatenate(extras.events)
        ok = ~bad_event[ek]
        in_cols = cols.counts if keep.all() else np.bincount(cols.event_of[keep], minlength=n)
        per_event = in_cols + np.bincount(ek[ok], minlength=n)
        extra_keys = np.concatenate(extras.keys)[ok]
        k = np.concatenate([np.full(good.size, self.bias_key, dtype=np.uint64), keys[keep], extra_keys])
        # Extras are all worth 1.
        v = np.concatenate([np.ones(good.size, dtype=np.float32), vals[keep], np.ones(extra_keys.size, np.float32)])
        order = np.argsort(np.concatenate([good, cols.event_of[keep], ek[ok]]), kind="stable")
        offsets = np.concatenate(([0], np.cumsum(per_event[good] + 1))).astype(np.int64)
        return k[order], v[order], offsets


_CSR: TypeAlias = tuple[U64, F32, I64]
"""Keys, values and offsets of a batch."""


class _Columns:
    """The values of a chunk's features objects, flattened in event order:
    value j belongs to event ``event_of[j]``."""

    __slots__ = ("fhash", "objs", "codes", "cat", "strs", "num", "joined", "counts", "event_of", "_present", "_names")

    def __init__(
        self,
        fhash: U64,
        objs: npt.NDArray[np.object_],
        codes: npt.NDArray[np.int8],
        split: Split,
        counts: I64,
        present: list[dict[str, Any]],
        names: list[str] | None,
    ) -> None:
        self.fhash = fhash
        """Each value's field hash."""
        self.objs = objs
        """The values."""
        self.codes = codes
        """Each value's exact type code."""
        self.cat, self.strs, self.num, self.joined = split
        self.counts = counts
        """(n,) values of each event."""
        self.event_of = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        self._present = present
        self._names = names

    def field(self, j: int) -> str:
        """The field name of value `j`."""
        # Names are only needed to word an error: built then, once.
        if self._names is None:
            self._names = list(chain.from_iterable(self._present))
        return self._names[j]


class _Failures:
    """The errors of a chunk: the first of each failed group, in the order
    groups failed, and the events that failed."""

    __slots__ = ("errors", "grp", "bad_event")

    def __init__(self, errors: dict[int, EventError], grp: list[int], n: int) -> None:
        self.errors = errors
        self.grp = grp
        self.bad_event = np.zeros(n, dtype=bool)

    def fail(self, event: int, reason: str, detail: str) -> None:
        """Event `event` fails; its group keeps its first error."""
        self.bad_event[event] = True
        self.errors.setdefault(self.grp[event], EventError(reason, f"event {event}: {detail}"))

    def failed_events(self) -> npt.NDArray[np.bool_]:
        """Every event of a failed group, whatever failed in it."""
        if self.errors:
            self.bad_event |= np.fromiter(map(self.errors.__contains__, self.grp), dtype=bool, count=len(self.grp))
        return self.bad_event


class _Extras:
    """Features found apart from the chunk's columns (multi-hot lists,
    booleans, pre-hashed keys), all worth 1: arrays of ids, each with the
    event of each id."""

    __slots__ = ("keys", "events")

    def __init__(self) -> None:
        self.keys: list[U64] = []
        self.events: list[I64] = []

    def add(self, keys: U64, events: I64) -> None:
        """Ids `keys` of events `events`."""
        self.keys.append(keys)
        self.events.append(events)


def _ids(cols: _Columns, fails: _Failures, *, log1p: bool = False, divisor: float = 1.0) -> tuple[U64, F32]:
    """The id and value of every value in `cols`; right for strings and
    numbers (the only ones kept from the columns). A number not finite as a
    float32, or fed beyond `MAX_VALUE`, fails its event; with `log1p` a
    number x is ``sign(x) log1p(|x|)``, then divided by `divisor`."""
    m = cols.objs.size
    vals = np.ones(m, dtype=np.float32)
    # What each value's field hash is mixed with: H(value) * C for a
    # categorical, the numeric constant otherwise (ignored unless numeric),
    # so all ids come from one fmix64 over the chunk.
    salt = np.full(m, _C_NUM, dtype=np.uint64)
    # The object array lets numpy pick values by type in C, not per value.
    if cols.cat.size:
        hv = string_hashes(cols.strs) if cols.joined is None else joined_hashes(cols.joined, cols.strs)
        salt[cols.cat] = hv * _C_CAT
    if cols.num.size:
        num = cols.num
        x = cols.objs[num].astype(np.float64)
        finite = np.isfinite(x) & (np.abs(x) <= MAX_FLOAT32)
        x = _fed(np.where(finite, x, 0), log1p, divisor)
        # What the model is fed is bounded too: its gradients stay finite (`MAX_VALUE`).
        fed_ok = np.abs(x) <= MAX_VALUE
        good = finite & fed_ok
        if not good.all():
            for k in np.flatnonzero(~good).tolist():  # the failures only
                j = int(num[k])
                why = f"fed as {x[k]:.6g}, beyond +-{MAX_VALUE:.6g}" if finite[k] else "not a finite float32"
                fails.fail(int(cols.event_of[j]), "bad_value", f"{cols.field(j)}={cols.objs[j]!r} is {why}")
            x = np.where(good, x, 0)
        vals[num] = x.astype(np.float32)
    return mix64(cols.fhash ^ salt), vals


def _fed(x: F64, log1p: bool, divisor: float) -> F64:
    """Numbers `x` as a model fed (`numeric_feed`) them."""
    if log1p:
        x = signed_log1p(x)
    return x / divisor if divisor != 1.0 else x


def signed_log1p(x: F64) -> F64:
    """``sign(x) log1p(|x|)``: what a ``log1p`` model feeds for a number x."""
    out: F64 = np.sign(x) * np.log1p(np.abs(x))
    return out


def _rare_values(cols: _Columns, keep: npt.NDArray[np.bool_], fails: _Failures, extras: _Extras) -> None:
    """Multi-hot lists and booleans become extras; a value of another type
    fails its event. None of them stays in the columns (`keep`)."""
    codes = cols.codes
    rare = np.flatnonzero(codes >= T_LIST)
    if rare.size:  # nulls were dropped already; lists, booleans and other types stay
        rare = rare[codes[rare] != T_NONE]
    keep[rare] = False
    for j in rare:  # rare, so per value
        e = int(cols.event_of[j])
        v = cols.objs[j]
        if codes[j] == T_BOOL:
            v = ["true" if v else "false"]
        elif codes[j] == T_OTHER or not all(isinstance(s, str) for s in v):
            fails.fail(
                e,
                "bad_value",
                f"{cols.field(int(j))} has a {type(v).__name__} value; expected string, number or list of strings",
            )
            continue
        if v:
            hv = string_hashes(v)
            extras.add(mix64(np.uint64(cols.fhash[j]) ^ (hv * _C_CAT)), np.full(len(v), e, dtype=np.int64))


def _prehashed(prehashed: list[tuple[int, list[Any]]], fails: _Failures, extras: _Extras) -> None:
    """The pre-hashed keys of each event as extras; an event with a key not
    an integer in [0, 2**64) fails."""
    # A float of an exact integer value is that integer, as JSON Schema says.
    prehashed = [(e, exact_ints(k)) for e, k in prehashed]
    klists = [k for _, k in prehashed]
    flat = list(chain.from_iterable(klists))
    if set(map(type, flat)) <= _INT:
        try:
            # One array for all events; numpy refuses ints outside [0, 2**64).
            ka = np.array(flat, dtype=np.uint64)
        except OverflowError:
            pass
        else:
            # One block: the stable sort by event puts each event's keys
            # after its other features, as one block per event would.
            lens = np.fromiter(map(len, klists), dtype=np.int64, count=len(klists))
            extras.add(ka, np.repeat(np.array([e for e, _ in prehashed], dtype=np.int64), lens))
            return
    for e, klist in prehashed:  # some key is wrong: find which events, one by one
        try:
            if not all(type(k) is int and 0 <= k < _KEY_LIMIT for k in klist):
                raise ValueError
            kb = np.array(klist, dtype=np.uint64)
        except (ValueError, OverflowError, TypeError):
            fails.fail(e, "bad_keys", "keys must be integers in [0, 2**64)")
            continue
        extras.add(kb, np.full(kb.size, e, dtype=np.int64))
