"""A table's feature lifecycle: which new features get a row, and which rows leave.

A click stream brings new feature ids every minute, most of them seen once:
were every id pushed given a row forever, a shard's memory would grow with
the stream. A `Lifecycle` (declared with the table, stored in manifests) says

- **admission**, for a key without a row (`Admission`):

  - ``none``: every pushed key gets a row (the default);
  - ``count:N``: a row once the key has been seen N times, counted in a
    count-min sketch (`CountSketch`, a fixed number of bytes per table, so
    memory does not grow with the candidates);
  - ``prob:P``: a row with probability P per occurrence (memory-free);
  - ``score:T``: the CTR-accessor rule, score = (shows − clicks) ·
    nonclick_coeff + clicks · click_coeff of the push: a row at once when
    the score reaches T, never when it is 0, with probability score / T in
    between.

  Until admitted, a key reads as its initial value and its pushes are
  dropped (and counted).

- **lazy embeddings** (`embed_threshold`): an FM's embedding table gives
  a key a row only once the key's score in the linear table reaches the
  threshold; before, the key reads as zeros (only its linear weight counts).

- **eviction**, run by the shard in the background (`SparseTable.evict`):

  - ``ttl``: rows unseen (``last_seen``, event time) for longer than `ttl_s`
    seconds before the newest event time the table has seen;
  - decayed score: at each pass shows and clicks decay by `decay`, and rows
    whose score falls below `min_score` go;
  - ``max_rows``: over it, the lowest-score rows go until the table is back
    to `low_water` · `max_rows`.

Every figure here is a pure function of the pushes: no wall clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import TableConfigError
from ..hashing import U64, mix64

__all__ = ["Lifecycle", "Admission", "CountSketch", "score", "ADMIT_KINDS", "NO_LIFECYCLE"]

F32 = npt.NDArray[np.float32]
ADMIT_KINDS = ("none", "count", "prob", "score")
MAX_ADMIT_COUNT = 255
"""The largest N of ``count:N`` (the sketch's counters are bytes)."""
_SKETCH_DEPTH = 2
_SKETCH_SALT = 0x5EC7C0DE


@dataclass(frozen=True)
class Lifecycle:
    """The admission and eviction rules of one table (0 turns a rule off)."""

    admit: str = "none"
    """``none``, ``count:N``, ``prob:P`` or ``score:T``."""
    click_coeff: float = 1.0
    """A click's weight in a score."""
    nonclick_coeff: float = 0.1
    """A show without a click's weight in a score."""
    ttl_s: float = 0.0
    """Rows unseen for longer than this many seconds of event time are removed."""
    decay: float = 0.98
    """Shows and clicks are multiplied by this at each eviction pass (with `min_score`)."""
    min_score: float = 0.0
    """Rows whose decayed score falls below this are removed."""
    max_rows: int = 0
    """Rows per table per shard; over it, the lowest scores go."""
    low_water: float = 0.9
    """A table over `max_rows` is cut back to this fraction of it."""
    sketch_bytes: int = 4 << 20
    """Bytes of the ``count:N`` sketch per table per shard."""
    embed_threshold: float = 0.0
    """Lazy embeddings, for a table of dim > 1 (an FM's ``_v``): a key gets a
    row only once its score in `embed_from` reaches this; until then it reads
    as zeros, so it contributes only its linear weight."""
    embed_from: str = ""
    """The table whose rows' scores gate `embed_threshold` (on the same
    shard); empty: this table's name with ``_v`` replaced by ``_w``."""

    def __post_init__(self) -> None:
        kind, value = _parse_admit(self.admit)
        object.__setattr__(self, "admit", kind if kind == "none" else f"{kind}:{_fmt(value)}")
        for name in ("click_coeff", "nonclick_coeff", "ttl_s", "min_score", "embed_threshold"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise TableConfigError(f"lifecycle: {name} must be a finite number >= 0")
            object.__setattr__(self, name, float(v))
        if not 0 < self.decay <= 1:
            raise TableConfigError("lifecycle: decay must be in (0, 1]")
        if not 0 < self.low_water < 1:
            raise TableConfigError("lifecycle: low_water must be in (0, 1)")
        for name in ("max_rows", "sketch_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise TableConfigError(f"lifecycle: {name} must be an integer >= 0")
        if kind == "count" and self.sketch_bytes < 1024:
            raise TableConfigError("lifecycle: sketch_bytes must be at least 1024 for count admission")
        if not isinstance(self.embed_from, str) or len(self.embed_from) > 64:
            raise TableConfigError("lifecycle: embed_from must be a table name")
        object.__setattr__(self, "decay", float(self.decay))
        object.__setattr__(self, "low_water", float(self.low_water))

    @property
    def admit_kind(self) -> str:
        return _parse_admit(self.admit)[0]

    @property
    def admit_value(self) -> float:
        return _parse_admit(self.admit)[1]

    def embed_source(self, table: str) -> str:
        """The table gating `table`'s lazy embeddings."""
        if self.embed_from:
            return self.embed_from
        return table[: -len("_v")] + "_w" if table.endswith("_v") else table + "_w"

    @property
    def evicts(self) -> bool:
        """Whether any eviction rule is on."""
        return bool(self.ttl_s or self.min_score or self.max_rows)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (in declarations and manifests)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: object) -> Lifecycle:
        """From a decoded JSON object; unknown fields are errors."""
        if not isinstance(raw, dict):
            raise TableConfigError("lifecycle is a JSON object")
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise TableConfigError(f"unknown lifecycle fields: {sorted(unknown)}")
        return cls(**raw)

    @classmethod
    def from_spec(cls, items: dict[str, str]) -> Lifecycle:
        """From a table spec's ``key=value`` items (`SPEC_KEYS` names them)."""
        kwargs: dict[str, Any] = {}
        for key, value in items.items():
            name, kind = SPEC_KEYS[key]
            try:
                kwargs[name] = value if kind is str else kind(value)
            except ValueError:
                raise TableConfigError(f"lifecycle: {key}={value!r} is not {_KIND_WORDS[kind]}") from None
        return cls(**kwargs)


SPEC_KEYS: dict[str, tuple[str, type]] = {
    "admit": ("admit", str),
    "click_coeff": ("click_coeff", float),
    "nonclick_coeff": ("nonclick_coeff", float),
    "ttl": ("ttl_s", float),
    "decay": ("decay", float),
    "min_score": ("min_score", float),
    "max_rows": ("max_rows", int),
    "low_water": ("low_water", float),
    "sketch_bytes": ("sketch_bytes", int),
    "embed": ("embed_threshold", float),
    "embed_from": ("embed_from", str),
}
"""Table-spec keys (``lr,admit=count:3,ttl=604800``) → `Lifecycle` field and type."""
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string"}


def _fmt(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def _parse_admit(spec: object) -> tuple[str, float]:
    if not isinstance(spec, str):
        raise TableConfigError("lifecycle: admit must be a string: none, count:N, prob:P or score:T")
    kind, sep, raw = spec.strip().partition(":")
    if kind == "none" and not sep:
        return "none", 0.0
    if kind not in ADMIT_KINDS[1:] or not sep:
        raise TableConfigError(f"lifecycle: admit {spec!r} is not none, count:N, prob:P or score:T")
    try:
        value = float(raw)
    except ValueError:
        raise TableConfigError(f"lifecycle: admit {spec!r}: {raw!r} is not a number") from None
    if kind == "count" and not (value.is_integer() and 1 <= value <= MAX_ADMIT_COUNT):
        raise TableConfigError(f"lifecycle: admit {spec!r}: N must be an integer in [1, {MAX_ADMIT_COUNT}]")
    if kind == "prob" and not 0 < value <= 1:
        raise TableConfigError(f"lifecycle: admit {spec!r}: P must be in (0, 1]")
    if kind == "score" and not 0 < value < float("inf"):
        raise TableConfigError(f"lifecycle: admit {spec!r}: T must be a positive number")
    return kind, value


def score(lifecycle: Lifecycle, shows: npt.ArrayLike, clicks: npt.ArrayLike, scale: float = 1.0) -> F32:
    """(shows − clicks) · nonclick_coeff + clicks · click_coeff of counts
    `shows` and `clicks` times `scale`, never below 0; float32 (a table's
    counts are, and a pass over a table's rows reads each once)."""
    s = np.asarray(shows, dtype=np.float32)
    c = np.asarray(clicks, dtype=np.float32)
    # shows·nc + clicks·(cc − nc), both times scale: two products, one sum.
    out = s * np.float32(lifecycle.nonclick_coeff * scale)
    out += c * np.float32((lifecycle.click_coeff - lifecycle.nonclick_coeff) * scale)
    np.maximum(out, 0.0, out=out)
    return out


class CountSketch:
    """A count-min sketch of byte counters, `depth` rows of `width`, with
    conservative update (a key's cells rise only to its new estimate, which
    keeps over-counting by collisions low). An estimate is never below the
    true count (until aging); counters saturate at 255.

    Aging keeps the counts recent: once the increments since the last aging
    reach ten times the width, every counter is halved (TinyLFU's reset), so
    a key seen twice a month apart does not pass ``count:2`` by its history.
    """

    def __init__(self, nbytes: int, *, depth: int = _SKETCH_DEPTH) -> None:
        width = 1 << max(8, (max(1, nbytes // depth)).bit_length() - 1)
        self.depth = depth
        self.width = width
        self.cells = np.zeros((depth, width), dtype=np.uint8)
        self.increments = 0
        """Increments since the last aging."""
        self.agings = 0

    @property
    def nbytes(self) -> int:
        return int(self.cells.nbytes)

    def _positions(self, keys: U64) -> npt.NDArray[np.int64]:
        mask = np.uint64(self.width - 1)
        return np.stack([(mix64(keys, _SKETCH_SALT + i) & mask).view(np.int64) for i in range(self.depth)])

    def estimate(self, keys: U64) -> npt.NDArray[np.uint8]:
        """Each key's count (an upper bound)."""
        pos = self._positions(keys)
        est: npt.NDArray[np.uint8] = np.take_along_axis(self.cells, pos, axis=1).min(axis=0)
        return est

    def add(self, keys: U64, amounts: npt.ArrayLike) -> npt.NDArray[np.uint8]:
        """Count `amounts` more of each of `keys` (distinct); returns the new estimates."""
        pos = self._positions(keys)
        cur = np.take_along_axis(self.cells, pos, axis=1).min(axis=0)
        inc = np.asarray(amounts, dtype=np.float64)
        new: npt.NDArray[np.uint8] = np.minimum(cur + np.minimum(inc, 255.0), 255.0).astype(np.uint8)
        for i in range(self.depth):  # per sketch row, a handful
            np.maximum.at(self.cells[i], pos[i], new)
        self.increments += int(inc.sum())
        if self.increments >= 10 * self.width:
            self.cells >>= 1
            self.increments //= 2
            self.agings += 1
        return new

    def state(self) -> npt.NDArray[np.uint8]:
        """The counters, for a checkpoint."""
        return self.cells.copy()

    def load(self, cells: npt.ArrayLike) -> None:
        """Counters from a checkpoint (a sketch of the same shape)."""
        a = np.asarray(cells, dtype=np.uint8)
        if a.shape != self.cells.shape:
            raise ValueError(f"a sketch of shape {a.shape}, expected {self.cells.shape}")
        self.cells[...] = a


class Admission:
    """Decides which keys without a row get one, per a table's `Lifecycle`
    (its ``admit`` rule).

    The random rules draw from a generator seeded by the table's seed, so a
    replay of the same pushes admits the same keys."""

    def __init__(self, lifecycle: Lifecycle, *, seed: int) -> None:
        self.lifecycle = lifecycle
        self.kind = lifecycle.admit_kind
        self.value = lifecycle.admit_value
        self.sketch = CountSketch(lifecycle.sketch_bytes) if self.kind == "count" else None
        self._rng = np.random.default_rng([seed, 0xAD417])
        self.admitted = 0
        """Keys given a row by a push."""
        self.dropped = 0
        """Key updates dropped because the key has no row and was not admitted."""

    @property
    def active(self) -> bool:
        """Whether any key may be refused."""
        return self.kind != "none"

    def decide(self, keys: U64, counts: F32 | None) -> npt.NDArray[np.bool_]:
        """Which of `keys` (distinct, without a row) get one now, given their
        pushes' shows and clicks `counts` (n, 2), or None (each key shown once)."""
        n = keys.size
        shows = np.ones(n) if counts is None else counts[:, 0].astype(np.float64)
        clicks = np.zeros(n) if counts is None else counts[:, 1].astype(np.float64)
        ok = np.ones(n, dtype=bool)
        if self.kind == "count":
            assert self.sketch is not None
            ok = self.sketch.add(keys, shows) >= self.value
        elif self.kind == "prob":
            # P per occurrence: at least one of `shows` occurrences admits.
            ok = self._rng.random(n) < 1.0 - (1.0 - self.value) ** shows
        elif self.kind == "score":
            ok = self._by_score(score(self.lifecycle, shows, clicks), self.value)
        got = int(np.count_nonzero(ok))
        self.admitted += got
        self.dropped += n - got
        return ok

    def _by_score(self, s: F32, threshold: float) -> npt.NDArray[np.bool_]:
        draw = self._rng.random(s.size)
        out: npt.NDArray[np.bool_] = (s >= threshold) | ((s > 0) & (draw < s / threshold))
        return out

    def stats(self) -> dict[str, int]:
        """Counters for the shard's stats."""
        out = {"admitted": self.admitted, "dropped": self.dropped}
        if self.sketch is not None:
            out["sketch_bytes"] = self.sketch.nbytes
            out["sketch_agings"] = self.sketch.agings
        return out


NO_LIFECYCLE = Lifecycle()
"""Every key admitted, no row evicted: a table's lifecycle unless declared."""
