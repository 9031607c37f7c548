"""Feature hashing: events (`ps_core.model.events`) validated and turned into
an `EventBatch`, shared by training and serving.

`FeatureHasher.featurize` turns a list of events into an `EventBatch`: the
feature ids of every event in CSR form, their values, labels, weights and
event times. Feature ids are stable 64-bit hashes (`FeatureHasher.feature_ids`
documents the function), namespaced by model.

There is no Python loop per event or per value on the common path (every
Python-level step below is a C-level ``map`` over a column, or numpy):

- Validation is column-wise (`FeatureHasher._check_columns`): each of label,
  ts, weight, features and keys is gathered for all events with
  ``map(dict.get, ...)``, and its exact types and values are checked at once.
  If anything may fail, the per-event checks (`FeatureHasher._check_each`)
  run instead and find each failed group's first error exactly as before;
  the hashing below is the same either way.
- Field hashes come from a cache of layouts (`_Layouts`): the tuple of a
  features object's names, in order, keys precomputed field hashes and the
  type codes its first event had. A chunk's field hashes are one gather from
  that table. Values go straight from the dicts into one object array; the
  expected types are checked a class at a time (`_split`: every expected
  string exactly ``str``, every number int or float), falling back to a
  type lookup per value only when a check fails. The cache is bounded
  (`MAX_CACHED_SCHEMAS`, `MAX_CACHED_SCHEMA_FIELDS`); layouts past it are
  resolved per call, with the same ids.
- Categorical values are hashed together (`string_hashes`: a multilinear hash
  of the code points, finished with fmix64), then every id is one fmix64
  over the chunk.
- Numbers, lists, booleans, nulls and pre-hashed keys are split out by type
  code; only multi-hot lists, booleans and wrong values are handled per value.

Errors are per group (a group is a message): an event that fails validation
fails its whole group, which is left out of the batch and reported with a
reason, so a message is either trained whole or dead-lettered whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import countOf, is_not
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ..hashing import U64, mix64
from ..parsing import exact_ints
from .batch import F32, F64, I64, EventBatch
from .events import EventError

__all__ = ["FeatureHasher", "string_hashes", "MAX_FEATURES", "MAX_WEIGHT"]


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
    if len(seq) == 0:
        return np.zeros(0, dtype=np.uint64)
    # One buffer, each string followed by a NUL: boundaries come from the
    # buffer itself instead of a len() per string.
    return _joined_hashes("\0".join(seq) + "\0", seq)


def _joined_hashes(joined: str, seq: Sequence[str]) -> U64:
    """`string_hashes` of `seq` (not empty), given ``"\\0".join(seq) + "\\0"``."""
    n = len(seq)
    # ASCII (the usual alphabet of ids) takes one byte per code point, a
    # quarter of UTF-32 to scan.
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
        if not grid[:, -1].any() and np.count_nonzero(cps) == n * (width - 1):
            mults = _multipliers(width).tolist()
            # A column at a time: no (n, width) uint64 temporary, and the
            # terminator column (all 0) adds nothing.
            acc = grid[:, 0] * np.uint64(mults[0])
            for i in range(1, width - 1):
                acc += grid[:, i] * np.uint64(mults[i])
            return mix64(acc)
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
_INT = frozenset({int})
MAX_FEATURES = 4096
"""Most features (fields and pre-hashed keys together) of one event, by default."""
MAX_WEIGHT = 3.4e38
"""Largest event weight or numeric feature value, in magnitude: each is kept
as a float32 (whose largest is 3.4028235e38) and must stay finite there."""


MAX_CACHED_FIELDS = 65_536
"""Field names whose hashes a `FeatureHasher` keeps; later new names are hashed each time."""

MAX_CACHED_SCHEMAS = 4096
"""Feature layouts (see `_Layouts`) a hasher keeps; later new layouts are resolved per call."""

MAX_CACHED_SCHEMA_FIELDS = 1 << 18
"""Field names in all cached layouts together: with names of at most
`_MAX_NAME_CHARS` characters on average, the cache stays under ~25 MB even
when requests choose every name (a few MB for real streams, which repeat names)."""

_MAX_NAME_CHARS = 32
"""A layout whose names average more characters than this is never cached."""


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


class _Layouts:
    """Feature layouts: the tuple of a ``features`` object's names, in order →
    the field hashes of its values, and the type codes its values had in the
    first event seen with it.

    Events of one producer come in a few layouts, so the field hashes of a
    chunk are one gather from `fh` instead of a dict lookup per value, and
    the type codes one gather from `codes`, which `FeatureHasher` then checks
    a class at a time. Bounded like `_FieldHashes`: past `MAX_CACHED_SCHEMAS`
    layouts or `MAX_CACHED_SCHEMA_FIELDS` names, new layouts are resolved for
    the call only and not kept."""

    def __init__(self, fields: _FieldHashes) -> None:
        self._fields = fields
        self.ids: dict[tuple[str, ...], int] = {}
        self.count = 0  # layouts cached
        self.starts = np.zeros(64, dtype=np.int64)  # layout → its first slot in fh/codes
        self.lens = np.zeros(64, dtype=np.int64)
        self.fh = np.zeros(4096, dtype=np.uint64)
        self.codes = np.zeros(4096, dtype=np.int8)
        self.used = 0  # slots of fh/codes in use

    def _keep(
        self, names: list[tuple[str, ...]], lens: I64, fh: U64, codes: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.bool_]:
        """Cache those of the given new layouts that fit; returns which."""
        s, used = self.count, self.used
        # Names are the memory a layout holds: long ones are not kept at all.
        chars = np.fromiter((sum(map(len, key)) for key in names), dtype=np.int64, count=len(names))
        ok = chars <= _MAX_NAME_CHARS * lens
        ok &= used + np.cumsum(np.where(ok, lens, 0)) <= MAX_CACHED_SCHEMA_FIELDS
        ok &= np.cumsum(ok) <= MAX_CACHED_SCHEMAS - s
        k = int(ok.sum())
        if not k:
            return ok
        slots = np.repeat(ok, lens)
        klens = lens[ok]
        total = int(klens.sum())
        while s + k > self.starts.size:
            self.starts = np.concatenate((self.starts, np.zeros_like(self.starts)))
            self.lens = np.concatenate((self.lens, np.zeros_like(self.lens)))
        if used + total > self.fh.size:
            grow = max(self.fh.size, total)
            self.fh = np.concatenate((self.fh, np.zeros(grow, dtype=np.uint64)))
            self.codes = np.concatenate((self.codes, np.zeros(grow, dtype=np.int8)))
        self.fh[used : used + total] = fh[slots]
        self.codes[used : used + total] = codes[slots]
        self.starts[s : s + k] = used + np.cumsum(klens) - klens
        self.lens[s : s + k] = klens
        self.used = used + total
        self.count = s + k
        # Last: an entry is complete once visible.
        self.ids.update(zip(compress(names, ok.tolist()), range(s, s + k)))
        return ok

    def gather(self, present: list[dict[str, Any]]) -> tuple[U64, npt.NDArray[np.int8], I64]:
        """For the values of `present` (non-empty dicts) in order: field hashes
        and expected type codes; and the length of each dict."""
        names = list(map(tuple, present))  # C level; names hash once, then cached
        sid = np.fromiter(map(self.ids.get, names, repeat(-1)), dtype=np.int64, count=len(names))
        n_cached = self.count
        starts, lens = self.starts[:n_cached], self.lens[:n_cached]
        local_fh = np.zeros(0, dtype=np.uint64)
        local_codes = np.zeros(0, dtype=np.int8)
        if sid.size and int(sid.min()) < 0:
            miss = np.flatnonzero(sid < 0).tolist()
            first: dict[tuple[str, ...], int] = {}
            for j in miss:  # per event only for layouts not in the cache
                first.setdefault(names[j], j)
            new = list(first)
            new_lens = np.fromiter(map(len, new), dtype=np.int64, count=len(new))
            total = int(new_lens.sum())
            # All new layouts at once: field hashes and type codes in one map each.
            fh = np.fromiter(map(self._fields.__getitem__, chain.from_iterable(new)), dtype=np.uint64, count=total)
            firsts = map(present.__getitem__, first.values())
            codes = _type_codes(list(chain.from_iterable(map(dict.values, firsts))))
            kept = self._keep(new, new_lens, fh, codes)
            n_cached = self.count
            starts, lens = self.starts[:n_cached], self.lens[:n_cached]
            local_ids: dict[tuple[str, ...], int] = {}
            if not kept.all():
                # Past the bound: the rest serve this call only, as layouts
                # numbered after the cached ones, gathered from local tables.
                rest = ~kept
                local_names = list(compress(new, rest.tolist()))
                local_ids = dict(zip(local_names, range(n_cached, n_cached + len(local_names))))
                slots = np.repeat(rest, new_lens)
                local_fh, local_codes = fh[slots], codes[slots]
                local_lens = new_lens[rest]
                starts = np.concatenate((starts, np.cumsum(local_lens) - local_lens))
                lens = np.concatenate((lens, local_lens))
            ids = self.ids
            sid[miss] = [ids[names[j]] if names[j] in ids else local_ids[names[j]] for j in miss]
        ev_lens = lens[sid]
        m = int(ev_lens.sum())
        # Slot of each value: its layout's start plus its position in the dict.
        slot = np.repeat(starts[sid] - (np.cumsum(ev_lens) - ev_lens), ev_lens) + np.arange(m, dtype=np.int64)
        if not local_fh.size:
            return self.fh[slot], self.codes[slot], ev_lens
        local = np.repeat(sid >= n_cached, ev_lens)
        fhash = np.empty(m, dtype=np.uint64)
        codes = np.empty(m, dtype=np.int8)
        fhash[~local] = self.fh[slot[~local]]
        codes[~local] = self.codes[slot[~local]]
        fhash[local] = local_fh[slot[local]]
        codes[local] = local_codes[slot[local]]
        return fhash, codes, ev_lens


def _type_codes(values: list[Any]) -> npt.NDArray[np.int8]:
    """The `_TYPE_CODE` of each value's exact type (`_T_OTHER` if none)."""
    return np.fromiter(map(_TYPE_CODE.get, map(type, values), repeat(_T_OTHER)), dtype=np.int8, count=len(values))


_Split: TypeAlias = tuple[I64, list[str], I64, "str | None"]
"""Positions of the strings, the strings, positions of the numbers; and the
strings joined for `_joined_hashes` when the check built that anyway."""


def _split(
    objs: npt.NDArray[np.object_], codes: npt.NDArray[np.int8], *, check: bool, json_types: bool = False
) -> _Split:
    """The strings and numbers among values `objs` with type `codes`; with
    `check`, the codes are only expected ones (a layout's) and are first made
    exact, in place.

    The check goes a class at a time, in C: the values expected to be strings
    must all be exactly `str` and those expected to be numbers exactly int or
    float; values expected to be anything else (null, list, bool: rare) get
    their codes looked up. Only if a class fails are all codes looked up.
    With `json_types` (values as a JSON parser makes them, so no str
    subclass), the strings are checked by joining them for hashing, which
    raises on any non-string: no pass over their types.
    """
    if check:
        rare = np.flatnonzero(codes >= _T_LIST)
        if rare.size:
            codes[rare] = _type_codes(objs[rare].tolist())
    cat = np.flatnonzero(codes == _T_STR)
    strs = objs[cat].tolist()
    num = np.flatnonzero(codes == _T_NUM)
    if not check:
        return cat, strs, num, None
    joined = None
    if json_types:
        try:
            joined = "\0".join(strs) + "\0"
            strings_ok = True
        except TypeError:
            strings_ok = False
    else:
        strings_ok = countOf(map(type, strs), str) == len(strs)
    if strings_ok:
        nums = objs[num].tolist()
        if countOf(map(type, nums), float) == len(nums) or set(map(type, nums)) <= _NUMBER:
            return cat, strs, num, joined
    codes[:] = _type_codes(objs.tolist())
    return _split(objs, codes, check=False)


_Checked: TypeAlias = tuple[F32, F32, F64, list[Any], list[tuple[int, list[Any]]], dict[int, EventError]]
"""labels, weights, ts, each event's features to hash (None: nothing), pre-hashed keys, errors."""


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

    A hasher caches field-name hashes and feature layouts (the names of a
    ``features`` object in order), both bounded; it is not thread-safe.
    """

    def __init__(self, namespace: str, *, max_features: int = MAX_FEATURES) -> None:
        self.namespace = namespace
        self._ns = int(string_hashes([namespace])[0])
        self._fields = _FieldHashes(self._ns)
        self._layouts = _Layouts(self._fields)
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
        checked = self._check_columns(events, require_label)
        if checked is None:
            # Some event is invalid (or unusual): check them one by one to
            # find each failed group's first error, exactly.
            checked = self._check_each(events, require_label, grp)
        return self._hash(*checked, grp, json_types=json_types)

    def _check_columns(self, events: Sequence[dict[str, Any]], require_label: bool) -> _Checked | None:
        """Every event checked at once, a column at a time in C-level maps;
        None if some event may fail (then `_check_each` decides)."""
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
            ts = self._number_column(list(map(get, events, repeat("ts"))), n, finite=True)
            # Weights are mostly absent: then there is no column to convert.
            w = None if wl.count(None) == n else self._number_column(wl, n, finite=False)
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
        if int(nf.max()) > self.max_features:
            return None
        return labels, weights, ts, feats, prehashed, {}

    @staticmethod
    def _number_column(col: list[Any], n: int, *, finite: bool) -> F64 | None:
        """`ts` (finite) or `weight` (>= 0, at most `MAX_WEIGHT`: finite as a
        float32) of every event as float64, NaN where absent; None if some
        present value is wrong."""
        types = set(map(type, col))
        if types == _ONLY_NONE:
            return np.full(n, np.nan)
        if not types <= _NUMBER_OR_NONE:
            return None
        x = np.array(col, dtype=np.float64)  # None → NaN
        ok = np.isfinite(x) if finite else (x >= 0) & (x <= MAX_WEIGHT)  # NaN fails both
        absent = col.count(None) if _NONE_TYPE in types else 0
        return x if int(np.count_nonzero(ok)) == n - absent else None

    def _check_each(self, events: Sequence[dict[str, Any]], require_label: bool, grp: list[int]) -> _Checked:
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
                    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
                        raise EventError("bad_ts", f"ts must be a number of seconds, got {t!r}")
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
                if nf + (len(keys) if keys is not None else 0) > self.max_features:
                    raise EventError("bad_features", f"more than {self.max_features} features")
            except EventError as exc:
                errors.setdefault(grp[i], exc)
                continue
            # Recorded only once the event passed, so a failed event hashes nothing.
            to_hash[i] = feats
            if keys is not None:
                prehashed.append((i, keys))
        return labels, weights, ts, to_hash, prehashed, errors

    def _gather(
        self, present: list[Any], json_types: bool = False
    ) -> tuple[U64, npt.NDArray[np.object_], npt.NDArray[np.int8], _Split, I64, list[str] | None]:
        """Field hashes, values (an object array) and exact type codes of the
        values of `present` (the non-empty features objects, in event order),
        and their lengths; plus the field names when they were built anyway
        (else they are built on demand, for an error message)."""
        if set(map(type, present)) <= _DICT:
            fhash, codes, lens = self._layouts.gather(present)
            m = int(lens.sum())
            # Straight from the dicts into the object array, no list between.
            objs = np.fromiter(chain.from_iterable(map(dict.values, present)), dtype=object, count=m)
            return fhash, objs, codes, _split(objs, codes, check=True, json_types=json_types), lens, None
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
        codes = _type_codes(values)
        return fhash, objs, codes, _split(objs, codes, check=False), lens, fields

    def _hash(
        self,
        labels: F32,
        weights: F32,
        ts: F64,
        to_hash: list[Any],
        prehashed: list[tuple[int, list[Any]]],
        errors: dict[int, EventError],
        grp: list[int],
        *,
        json_types: bool = False,
    ) -> tuple[EventBatch, dict[int, EventError]]:
        n = len(to_hash)
        present = list(filter(None, to_hash))  # drops None and empty objects, in C
        fhash, objs, codes, (cat, strs, num, joined), lens, field_list = self._gather(present, json_types)
        counts = np.zeros(n, dtype=np.int64)
        if len(present) == n:
            counts[:] = lens
        else:
            counts[np.fromiter(map(bool, to_hash), dtype=bool, count=n)] = lens
        m = objs.size

        def field(j: int) -> str:
            # Names are only needed to word an error: built then, once.
            nonlocal field_list
            if field_list is None:
                field_list = list(chain.from_iterable(present))
            return field_list[j]

        event_of = np.repeat(np.arange(n, dtype=np.int64), counts)
        bad_event = np.zeros(n, dtype=bool)
        vals = np.ones(m, dtype=np.float32)
        keep = np.ones(m, dtype=bool)
        # What each value's field hash is mixed with: H(value) * C for a
        # categorical, the numeric constant otherwise (ignored unless numeric),
        # so all ids come from one fmix64 over the chunk.
        salt = np.full(m, _C_NUM, dtype=np.uint64)

        # The object array lets numpy pick values by type in C, not per value.
        if cat.size:
            hv = string_hashes(strs) if joined is None else _joined_hashes(joined, strs)
            salt[cat] = hv * _C_CAT
        if num.size:
            x = objs[num].astype(np.float64)
            finite = np.isfinite(x) & (np.abs(x) <= MAX_WEIGHT)
            if not finite.all():
                for j in num[~finite]:
                    self._fail(
                        errors,
                        grp,
                        bad_event,
                        int(event_of[j]),
                        "bad_value",
                        f"{field(j)}={objs[j]!r} is not a finite float32",
                    )
            vals[num] = np.where(finite, x, 0).astype(np.float32)
        keys = mix64(fhash ^ salt)
        keep[codes == _T_NONE] = False
        extra_keys: list[np.ndarray] = []
        extra_vals: list[np.ndarray] = []
        extra_event: list[np.ndarray] = []
        rare = np.flatnonzero(codes >= _T_LIST)
        if rare.size:  # nulls were dropped above; lists, booleans and other types stay
            rare = rare[codes[rare] != _T_NONE]
        for j in rare:  # multi-hot lists, booleans and wrong types: rare, so per value
            e = int(event_of[j])
            keep[j] = False
            v = objs[j]
            if codes[j] == _T_BOOL:
                v = ["true" if v else "false"]
            elif codes[j] == _T_OTHER or not all(isinstance(s, str) for s in v):
                self._fail(
                    errors,
                    grp,
                    bad_event,
                    e,
                    "bad_value",
                    f"{field(int(j))} has a {type(v).__name__} value; expected string, number or list of strings",
                )
                continue
            if v:
                hv = string_hashes(v)
                extra_keys.append(mix64(np.uint64(fhash[j]) ^ (hv * _C_CAT)))
                extra_vals.append(np.ones(len(v), dtype=np.float32))
                extra_event.append(np.full(len(v), e, dtype=np.int64))
        if prehashed:
            self._prehashed(prehashed, errors, grp, bad_event, extra_keys, extra_vals, extra_event)
        # Every event of a failed group goes, whatever failed in it.
        if errors:
            failed = np.fromiter((g in errors for g in grp), dtype=bool, count=n)
            bad_event |= failed
        good = np.flatnonzero(~bad_event)
        if errors:
            keep &= ~bad_event[event_of]
        all_kept = bool(keep.all())
        per_event = counts if all_kept else np.bincount(event_of[keep], minlength=n)
        if not extra_keys:
            # Common case: features are already in event order; slot the bias
            # in front of each event's run without sorting.
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

    def _prehashed(
        self,
        prehashed: list[tuple[int, list[Any]]],
        errors: dict[int, EventError],
        grp: list[int],
        bad_event: npt.NDArray[np.bool_],
        extra_keys: list[np.ndarray],
        extra_vals: list[np.ndarray],
        extra_event: list[np.ndarray],
    ) -> None:
        """Append the pre-hashed keys of each event as extra features."""
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
                extra_keys.append(ka)
                extra_vals.append(np.ones(ka.size, dtype=np.float32))
                extra_event.append(np.repeat(np.array([e for e, _ in prehashed], dtype=np.int64), lens))
                return
        for e, klist in prehashed:  # some key is wrong: find which events, one by one
            try:
                if not all(type(k) is int and 0 <= k < _KEY_LIMIT for k in klist):
                    raise ValueError
                kb = np.array(klist, dtype=np.uint64)
            except (ValueError, OverflowError, TypeError):
                self._fail(errors, grp, bad_event, e, "bad_keys", "keys must be integers in [0, 2**64)")
                continue
            extra_keys.append(kb)
            extra_vals.append(np.ones(kb.size, dtype=np.float32))
            extra_event.append(np.full(kb.size, e, dtype=np.int64))

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
