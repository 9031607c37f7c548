"""The hasher's caches of what events look like: field hashes by name
(`FieldHashes`) and feature layouts (`Layouts`: a ``features`` object's names
in order → their field hashes and expected type codes), both bounded; and
the type codes of values, checked a class at a time (`split_values`)."""

from __future__ import annotations

from itertools import chain, compress, repeat
from operator import countOf
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

from ..hashing import U64, mix64
from .batch import I64
from .string_hashing import string_hashes

__all__ = [
    "T_STR",
    "T_NUM",
    "T_LIST",
    "T_NONE",
    "T_BOOL",
    "T_OTHER",
    "TYPE_CODE",
    "MAX_CACHED_FIELDS",
    "MAX_CACHED_SCHEMAS",
    "MAX_CACHED_SCHEMA_FIELDS",
    "FieldHashes",
    "Layouts",
    "type_codes",
    "Split",
    "split_values",
]

_NUMBER = frozenset({int, float})

T_STR, T_NUM, T_LIST, T_NONE, T_BOOL, T_OTHER = range(6)
TYPE_CODE: dict[type, int] = {
    str: T_STR,
    float: T_NUM,
    int: T_NUM,
    list: T_LIST,
    type(None): T_NONE,
    bool: T_BOOL,
}

MAX_CACHED_FIELDS = 65_536
"""Field names whose hashes a `FeatureHasher` keeps; later new names are hashed each time."""

MAX_CACHED_SCHEMAS = 4096
"""Feature layouts (see `Layouts`) a hasher keeps; later new layouts are resolved per call."""

MAX_CACHED_SCHEMA_FIELDS = 1 << 18
"""Field names in all cached layouts together: with names of at most
`_MAX_NAME_CHARS` characters on average, the cache stays under ~25 MB even
when requests choose every name (a few MB for real streams, which repeat names)."""

_MAX_NAME_CHARS = 32
"""A layout whose names average more characters than this is never cached."""


class FieldHashes(dict[str, int]):
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


class Layouts:
    """Feature layouts: the tuple of a ``features`` object's names, in order →
    the field hashes of its values, and the type codes its values had in the
    first event seen with it.

    Events of one producer come in a few layouts, so the field hashes of a
    chunk are one gather from `fh` instead of a dict lookup per value, and
    the type codes one gather from `codes`, which `FeatureHasher` then checks
    a class at a time. Bounded like `FieldHashes`: past `MAX_CACHED_SCHEMAS`
    layouts or `MAX_CACHED_SCHEMA_FIELDS` names, new layouts are resolved for
    the call only and not kept."""

    def __init__(self, fields: FieldHashes) -> None:
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
            codes = type_codes(list(chain.from_iterable(map(dict.values, firsts))))
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


def type_codes(values: list[Any]) -> npt.NDArray[np.int8]:
    """The `TYPE_CODE` of each value's exact type (`T_OTHER` if none)."""
    return np.fromiter(map(TYPE_CODE.get, map(type, values), repeat(T_OTHER)), dtype=np.int8, count=len(values))


Split: TypeAlias = tuple[I64, list[str], I64, "str | None"]
"""Positions of the strings, the strings, positions of the numbers; and the
strings joined for `joined_hashes` when the check built that anyway."""


def split_values(
    objs: npt.NDArray[np.object_], codes: npt.NDArray[np.int8], *, check: bool, json_types: bool = False
) -> Split:
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
        rare = np.flatnonzero(codes >= T_LIST)
        if rare.size:
            codes[rare] = type_codes(objs[rare].tolist())
    cat = np.flatnonzero(codes == T_STR)
    strs = objs[cat].tolist()
    num = np.flatnonzero(codes == T_NUM)
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
    codes[:] = type_codes(objs.tolist())
    return split_values(objs, codes, check=False)
