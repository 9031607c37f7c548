"""Feature hashing: validated events to feature ids, in one model's id space.

`FeatureHasher.featurize` validates events (see `events`) and turns them into
an `EventBatch`: the feature ids of every event in CSR form, their values,
labels, weights and event times. Feature ids are stable 64-bit hashes
(`FeatureHasher` documents the function), namespaced by model.

There is no Python loop per event or per value on the common path (every
Python-level step below is a C-level ``map`` over a column, or numpy):

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
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterator, Sequence
from itertools import chain, compress, repeat
from operator import countOf
from typing import Any, Final, TypeAlias

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from ..bodies import NUMERIC_PATTERN
from ..hashing import U64, mix64
from ..parsing import exact_ints
from .batch import F32, F64, I64, EventBatch
from .events import MAX_FEATURES, MAX_FLOAT32, MAX_VALUE, Checked, EventError, check_columns, check_each

__all__ = ["FeatureHasher", "string_hashes", "NUMERIC", "numeric_feed", "numeric_spec"]

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


# -- string hashing ------------------------------------------------------------

_MULTS = np.zeros(0, dtype=np.uint64)


def _multipliers(width: int) -> U64:
    global _MULTS
    if _MULTS.size < width:
        # Odd 64-bit multipliers, one per code-point position: a pure function
        # of the position, so hashes never depend on the batch.
        _MULTS = mix64(np.arange(1, max(width, 64) + 1, dtype=np.uint64), 0x2545F4914F6CDD1D) | np.uint64(1)
    return _MULTS[:width]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector paused for the block (then as it was).

    Hashing a chunk allocates many containers, none in a cycle; each
    collector pass on the way would walk every object alive, and a caller
    holding millions of event dicts (a `Learner`'s list, a decode's parsed
    chunk) makes each pass cost more than the hashing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def string_hashes(strings: Sequence[str] | npt.NDArray[np.object_]) -> U64:
    """Stable 64-bit hashes of strings: ``fmix64(sum_i cp_i * M_i)`` over the
    code points ``cp_i`` with fixed odd multipliers ``M_i`` (mod 2**64).

    Vectorised, from one NUL-separated buffer of the strings' code points (a
    byte each when all are ASCII, else UTF-32): strings all of one length
    are its rows, hashed by a multiply-add per column; strings of at most
    `GRID_WIDTH` code points are windows of it, the rows of a matrix hashed
    alike up to each string's length; longer ones have each code point multiplied
    by the multiplier of its position within its string and summed per
    string by ``np.add.reduceat``.
    """
    seq = strings.tolist() if isinstance(strings, np.ndarray) else strings
    if len(seq) == 0:
        return np.zeros(0, dtype=np.uint64)
    # One buffer, each string followed by a NUL: boundaries come from the
    # buffer itself instead of a len() per string.
    return _joined_hashes("\0".join(seq) + "\0", seq)


GRID_WIDTH = 64
"""Longest strings hashed as a matrix of code points (`string_hashes`): the
matrix costs the longest string's width for every string, so a chunk with a
longer one takes the buffer path instead."""


def _joined_hashes(joined: str, seq: Sequence[str]) -> U64:
    """`string_hashes` of `seq` (not empty), given ``"\\0".join(seq) + "\\0"``:
    strings all of one length (hex ids, say) straight from that buffer as a
    matrix; else as windows of it (`_windows`); else the buffer."""
    cps = _code_points(joined)
    n = len(seq)
    width = cps.size // n
    if width * n == cps.size:
        grid = cps.reshape(n, width)
        # NULs exactly at the end of every row: all strings have length
        # width - 1, so each row is a string and its terminator.
        if not grid[:, -1].any() and np.count_nonzero(cps) == n * (width - 1):
            return _column_hashes(grid[:, : width - 1])
    ends = np.flatnonzero(cps == 0)
    if ends.size != n:  # some string holds a NUL: take lengths the slow way
        ends = np.cumsum(np.fromiter(map(len, seq), dtype=np.int64, count=n) + 1) - 1
    starts = np.empty(n, dtype=np.int64)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lens = ends - starts
    longest = int(lens.max())
    if longest <= GRID_WIDTH:
        return _column_hashes(_windows(cps, starts, max(longest, 1)), lens)
    return _buffer_hashes(cps, starts, lens)


def _code_points(joined: str) -> npt.NDArray[np.uint8] | npt.NDArray[np.uint32]:
    """The code points of `joined`: a byte each when ASCII (the usual
    alphabet of ids, a quarter of UTF-32 to scan), else UTF-32."""
    if joined.isascii():
        return np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    return np.frombuffer(joined.encode("utf-32-le"), dtype="<u4")


def _windows(
    cps: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], starts: I64, width: int
) -> npt.NDArray[np.uint8] | npt.NDArray[np.uint32]:
    """The `width` code points of the buffer `cps` from each of `starts`, as
    the rows of a matrix: a string, then its terminator and what follows."""
    padded = np.concatenate((cps, np.zeros(width, dtype=cps.dtype)))
    # One gather in C from windows of the buffer: no copy from each string object.
    return sliding_window_view(padded, width)[starts]


def _column_hashes(grid: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], lens: I64 | None = None) -> U64:
    """`H` of each row of code points: all of a row (zero padding adds
    nothing), or with `lens` its first ``lens[row]`` only."""
    n, width = grid.shape
    mults = _multipliers(max(width, 1)).tolist()
    short = width if lens is None else int(lens.min())
    acc = np.zeros(n, dtype=np.uint64)  # a column at a time: no (n, width) uint64 temporary
    for i in range(width):  # per column (at most GRID_WIDTH, or one length), not per string
        if i < short or lens is None:
            acc += grid[:, i] * np.uint64(mults[i])
        else:  # only the rows whose string is this long: the rest hold others' code points
            rows = np.flatnonzero(lens > i)
            acc[rows] += grid[rows, i] * np.uint64(mults[i])
    return mix64(acc)


def _buffer_hashes(cps: npt.NDArray[np.uint8] | npt.NDArray[np.uint32], starts: I64, lens: I64) -> U64:
    """`string_hashes` of the strings at `starts` (of `lens` code points) in
    the NUL-separated buffer `cps`."""
    seg_lens = lens + 1  # including the terminator, so never empty
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
_DICT = frozenset({dict})
_INT = frozenset({int})
_NUMBER = frozenset({int, float})


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
        self._fields = _FieldHashes(self._ns)
        self._layouts = _Layouts(self._fields)
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

    def _hash(self, checked: Checked, grp: list[int], json_types: bool) -> tuple[EventBatch, dict[int, EventError]]:
        """The batch of validated events, in steps: the features' columns;
        ids and values of the categorical and numeric ones; the rare values
        and pre-hashed keys as extra features; then every event of a failed
        group left out, each remaining event's bias first."""
        n = len(checked.to_hash)
        cols = self._columns(checked.to_hash, json_types)
        fails = _Failures(checked.errors, grp, n)
        keys, vals = _ids(cols, fails, log1p=self._log1p, divisor=self._divisor)
        keep = cols.codes != _T_NONE  # nulls are missing features
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
        split: _Split,
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
        hv = string_hashes(cols.strs) if cols.joined is None else _joined_hashes(cols.joined, cols.strs)
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
    rare = np.flatnonzero(codes >= _T_LIST)
    if rare.size:  # nulls were dropped already; lists, booleans and other types stay
        rare = rare[codes[rare] != _T_NONE]
    keep[rare] = False
    for j in rare:  # rare, so per value
        e = int(cols.event_of[j])
        v = cols.objs[j]
        if codes[j] == _T_BOOL:
            v = ["true" if v else "false"]
        elif codes[j] == _T_OTHER or not all(isinstance(s, str) for s in v):
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
