"""One shard of the parameter server, as pure handlers (no sockets).

A `Shard` owns the slice ``shard_of(key, num_shards) == shard_id`` of every
table. The HTTP server (`ps_core.net.server`) and the in-process transport
(`ps_core.net.transports.LocalTransport`) both call these handlers, so the same checks
and effects hold whichever way a request arrives. Handlers run to completion
without awaiting: one request's effects are never interleaved with another's.

At an export cut, a shard copies its tables' rows (`take_snapshot`, the
cut's pause) and holds the copies until the coordinator fetches them
(`pop_snapshot`), after the pause.

A shard also keeps a small status board: the latest status (a JSON object)
reported by each source, e.g. each training worker, so that processes which do
not train (the API, its metrics) can read the workers' progress. Clients report
to shard 0 (`PSClient.report_status`).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import orjson

from ..errors import (
    CutNotJoinedError,
    FrameError,
    InvalidValuesError,
    ModeConflictError,
    ShardNotJoinedError,
    SnapshotError,
    StatusError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)
from ..hashing import shard_of
from ..store.board import MAX_SOURCE_CHARS, MAX_STATUS_BYTES, check_report
from ..store.change_log import DEFAULT_LOG_KEYS, Changes
from ..store.eviction import Eviction
from ..store.lifecycle import Lifecycle
from ..store.snapshot import SnapshotKind, TableSnapshot
from ..store.storage import F32
from ..store.table import SparseTable
from ..store.table_config import TableConfig
from . import codec
from .key_sets import KeySets
from .quantize import Quantized, quantize

__all__ = ["Shard", "ShardSpec", "Push", "MAX_STATUS_BYTES", "MAX_SOURCE_CHARS"]


class Push(NamedTuple):
    """One shard's part of a push: what `Shard.handle_push` applies."""

    table: str
    """The table pushed to."""
    keys: npt.NDArray[np.uint64]
    """(n,) keys, this shard's own."""
    grads: F32
    """(n, dim) gradients."""
    counts: F32 | None = None
    """(n, 2) shows and clicks, or None."""
    event_time: float = 0.0
    """Sets the rows' ``last_seen`` (0: now)."""
    request_id: int = 0
    """The push's id: a shard applies one id once (0: no id)."""
    base_clock: int = 0
    """The table clock of the pull its gradients were computed from (0:
    unknown); the shard counts the staleness (`ps_core.store.staleness`)."""
    keys_ref: int = 0
    """The id of the key set a shard server remembered from the pull of
    these keys (0: none): the frame names it instead of carrying `keys`."""


def _mode_of(config: TableConfig) -> str:
    """A table's mode as a worker's flags say it (``async, max_staleness 8``)."""
    return config.mode if config.max_staleness is None else f"{config.mode}, max_staleness {config.max_staleness}"


@dataclass(frozen=True)
class ShardSpec:
    """Where a shard sits in the cluster."""

    shard_id: int
    """This shard's number, in ``[0, num_shards)``."""
    num_shards: int
    """How many shards split the key space."""

    def __post_init__(self) -> None:
        if self.num_shards < 1 or not 0 <= self.shard_id < self.num_shards:
            raise ValueError(f"shard id {self.shard_id} not in [0, {self.num_shards})")


class Shard:
    """The tables of one shard and the handlers that read and update them."""

    def __init__(
        self,
        spec: ShardSpec = ShardSpec(0, 1),
        tables: Iterable[TableConfig] = (),
        *,
        dedup_window: int = 4096,
        max_sources: int = 256,
        lifecycle: Lifecycle | None = None,
        change_log_keys: int = DEFAULT_LOG_KEYS,
    ) -> None:
        """`dedup_window` push ids are remembered for retry dedup; the status
        board keeps the latest status of the `max_sources` most recent
        sources; `lifecycle` is that of tables declared without one;
        `change_log_keys`, what each geo table's change log holds at most
        (`ps_core.store.change_log`)."""
        self.change_log_keys = change_log_keys
        self.spec = spec
        self.default_lifecycle = lifecycle
        """The lifecycle of tables declared without one (None: `NO_LIFECYCLE`)."""
        self.tables: dict[str, SparseTable] = {}
        self._dedup_window = dedup_window
        # request_id -> applied count of recent pushes, so that a client's retry
        # of a push whose ack was lost is acknowledged without applying twice.
        self._recent_pushes: OrderedDict[int, int] = OrderedDict()
        self.duplicate_pushes = 0
        """Retried pushes recognised by request id and not applied again."""
        self._max_sources = max_sources
        # source -> (received_at, status), least recently reported first.
        self._statuses: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        # version -> the copies of a cut, until the coordinator fetches them.
        self._snapshots: OrderedDict[int, list[TableSnapshot]] = OrderedDict()
        self.extra_stats: dict[str, Callable[[], dict[str, Any]]] = {}
        """Sections added to `stats` by what this shard's process hosts
        (shard 0: ``exports``, the exporter's counters; ``cluster``, the
        coordinator's view of the shards), so metrics reach them through the
        shard's stats like every other figure."""
        self.boot_id = secrets.token_hex(8)
        """This shard object's life: a restarted shard process has a new one."""
        self.joined = True
        """Whether the coordinator admitted this shard into the cluster. An
        unjoined shard refuses pulls and pushes (`ShardNotJoinedError`); a
        shard started to restore in a cluster of several starts unjoined."""
        self.joined_epoch = ""
        """The epoch of the coordinator that admitted it ("" from the start)."""
        self.state_version = 0
        """The export version this shard's state was at its last restore or
        cut (0: none); with `clean`, whether it still is exactly that."""
        self.not_joined_hint = ""
        """What an unjoined shard's refusals add: what it waits for."""
        self.last_contact = 0.0
        """Monotonic time the coordinator last asked this shard's membership."""
        self._pushes_at_mark = 0
        self.restores_at_start = False
        """Whether this shard was started to restore the newest export (not
        ``--no-restore``): holding nothing then means nothing loaded."""
        self.restore_dir: Path | None = None
        """The model's exports directory, where the coordinator may ask this
        shard to load a version from (`ps_core.checkpoint.joining.restore_version`)."""
        self.sync_steps: dict[str, int] = {}
        """The last sync step applied, per table (`apply_step`)."""
        self.key_sets = KeySets()
        """Pulled key sets kept for the pushes that name them (`ps_core.net.key_sets`)."""
        self.reply_values_clipped = 0
        """Weights clipped to float16's range in replies asked in float16."""
        tables = tuple(tables)
        self.configured_tables = tables
        """The tables this shard was started with (declared again after a restore)."""
        for config in tables:
            self.declare(config)

    # -- membership ------------------------------------------------------------
    def _pushes(self) -> int:
        return sum(t.pushes for t in self.tables.values())

    @property
    def clean(self) -> bool:
        """Nothing was pushed since the state was `state_version`."""
        return self._pushes() == self._pushes_at_mark

    def mark_state(self, version: int) -> None:
        """Declare the state to be exactly export `version` (restored, or cut)."""
        self.state_version = version
        self._pushes_at_mark = self._pushes()

    def membership(self, *, now: float | None = None) -> dict[str, Any]:
        """What the coordinator decides admission on (JSON-ready); records
        the contact."""
        self.last_contact = time.monotonic() if now is None else now
        return {
            "shard_id": self.spec.shard_id,
            "num_shards": self.spec.num_shards,
            "boot_id": self.boot_id,
            "joined": self.joined,
            "epoch": self.joined_epoch,
            "version": self.state_version,
            "clean": self.clean,
            "restores": self.restores_at_start,
        }

    def admit(self, epoch: str, version: int) -> None:
        """Join the cluster of coordinator `epoch` at `version`, which must
        be this shard's state (`SnapshotError` otherwise: the coordinator
        decided on another version than the one loaded)."""
        if version != self.state_version or not self.clean:
            raise SnapshotError(
                f"shard {self.spec.shard_id} holds version {self.state_version}"
                f"{'' if self.clean else ' and trained since'}, not version {version}"
            )
        self.joined, self.joined_epoch = True, epoch

    def leave(self, reason: str = "") -> None:
        """Stop serving pulls and pushes until admitted again (the coordinator
        is about to restore every shard to one version)."""
        self.joined = False
        if reason:
            self.not_joined_hint = reason

    def replace_state(self, other: Shard, version: int) -> None:
        """Take `other`'s tables (a restore of `version`, built aside) in one
        step; the copies held and the push ids remembered belong to the old
        state and are dropped. The same object keeps serving, so servers and
        transports holding it see the new state at once."""
        if other.spec != self.spec:
            raise ValueError(f"a restore of {other.spec} into shard {self.spec}")
        self.tables = other.tables
        self._snapshots.clear()
        self._recent_pushes.clear()
        self.mark_state(version)

    def _check_joined(self) -> None:
        if not self.joined:
            raise ShardNotJoinedError(
                f"shard {self.spec.shard_id} is not joined to the cluster (it holds version "
                f"{self.state_version}){': ' + self.not_joined_hint if self.not_joined_hint else ''}"
            )

    # -- tables --------------------------------------------------------------
    def declare(self, config: TableConfig) -> bool:
        """Create a table, or accept an identical re-declaration.

        Returns True when the table was created. A declaration that differs
        from the existing table's is a `TableConflictError`, never an overwrite.
        """
        existing = self.tables.get(config.name)
        if existing is not None:
            had, asked = existing.config, config
            if (had.mode, had.max_staleness) != (asked.mode, asked.max_staleness):
                raise ModeConflictError(
                    f"table {config.name} is updated in mode {_mode_of(had)}; a worker declared it with mode "
                    f"{_mode_of(asked)}: every worker of a model must run the same --mode (and --max-staleness)"
                )
            if not existing.config.accepts(config):
                raise TableConflictError(
                    f"table {config.name} exists with {existing.config.to_dict()}, "
                    f"declared again with {config.to_dict()}"
                )
            return False
        if config.lifecycle is None and self.default_lifecycle is not None:
            config = replace(config, lifecycle=self._default_for(config))
        table = self.tables[config.name] = SparseTable(config, change_log_keys=self.change_log_keys)
        self._gate(table)
        return True

    def _default_for(self, config: TableConfig) -> Lifecycle | None:
        """The shard's default lifecycle as it applies to `config` (lazy
        embeddings only for tables of dim > 1)."""
        lc = self.default_lifecycle
        if lc is not None and lc.embed_threshold and config.dim < 2:
            return replace(lc, embed_threshold=0.0)
        return lc

    def _gate(self, table: SparseTable) -> None:
        """Wire `table`'s lazy-embedding gate to its gating table, looked up at
        each push (it may be declared later, or swapped by a restore)."""
        lc = table.lifecycle
        if not lc.embed_threshold or table.dim < 2:
            table.gate = None
            return
        source, threshold, tables = lc.embed_source(table.config.name), lc.embed_threshold, self.tables

        def gate(keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
            scoring = tables.get(source)
            if scoring is None:
                return np.zeros(keys.size, dtype=bool)
            return scoring.key_scores(keys) >= threshold

        table.gate = gate

    def configure(self, config: TableConfig) -> bool:
        """`declare`, except that a table restored with another lifecycle
        takes this one (the shard's configuration is the operator's latest
        word; rows stay as they are). Returns True when anything changed."""
        existing = self.tables.get(config.name)
        lifecycle = config.lifecycle if config.lifecycle is not None else self._default_for(config)
        if existing is None or existing.config.lifecycle == lifecycle:
            return self.declare(config)
        if not replace(existing.config, lifecycle=lifecycle).accepts(config):
            return self.declare(config)  # another shape: the conflict, worded
        existing.set_lifecycle(lifecycle)
        self._gate(existing)
        return True

    def drop(self, name: str) -> bool:
        """Remove table `name` and its rows (a deleted model's); True when it
        was held. Idempotent. Key sets naming it stop resolving when used
        (the push finds no table: `UnknownTableError`)."""
        self.configured_tables = tuple(t for t in self.configured_tables if t.name != name)
        return self.tables.pop(name, None) is not None

    def table(self, name: str) -> SparseTable:
        """The table called `name`, or `UnknownTableError`."""
        try:
            return self.tables[name]
        except KeyError:
            raise UnknownTableError(
                f"no table {name!r} on shard {self.spec.shard_id}; declared: {sorted(self.tables)}"
            ) from None

    def _check_owned(self, keys: npt.NDArray[np.uint64]) -> None:
        if self.spec.num_shards == 1 or keys.size == 0:
            return
        wrong = shard_of(keys, self.spec.num_shards) != self.spec.shard_id
        if wrong.any():
            raise WrongShardError(
                f"{int(wrong.sum())} of {keys.size} keys belong to other shards, not shard "
                f"{self.spec.shard_id} of {self.spec.num_shards} (first: {int(keys[wrong][0])})"
            )

    # -- handlers ------------------------------------------------------------
    def handle_pull(self, table: str, keys: npt.NDArray[np.uint64], *, owned: bool = False) -> tuple[F32, int]:
        """Weights of `keys` and the table's open version.

        `owned` (here and in the push handlers): the caller split the keys
        with `shard_of` for this shard's own spec (an in-process client, see
        `PSClient.local`), so they are not hashed again to check ownership.
        """
        if not self.joined:
            self._check_joined()
        t = self.table(table)
        if not owned:
            self._check_owned(keys)
        return t.pull(keys), t.version

    def contains(self, table: str, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Whether each key has a row in `table` (one vectorised index lookup)."""
        if not self.joined:
            self._check_joined()
        t = self.table(table)
        self._check_owned(keys)
        out: npt.NDArray[np.bool_] = t.index.lookup(keys) >= 0
        return out

    def handle_push(self, push: Push, *, owned: bool = False) -> tuple[int, int]:
        """Apply `push`; returns (distinct keys applied, open version).

        A push whose nonzero `request_id` was applied recently is acknowledged
        with its earlier result and not applied again. `owned`: the caller
        split the keys for this shard's spec, so they are not checked again.
        """
        if not self.joined:
            self._check_joined()
        t = self.table(push.table)
        grads = push.grads
        if grads.ndim != 2 or grads.shape[1] != t.dim:
            raise InvalidValuesError(
                f"table {push.table} has dim {t.dim}, the push carries dim "
                f"{grads.shape[1] if grads.ndim == 2 else grads.ndim}"
            )
        if not owned:
            self._check_owned(push.keys)
        # Checked after validation, so a malformed request never reads as a
        # duplicate of an earlier good one.
        request_id = push.request_id
        if request_id and request_id in self._recent_pushes:
            self.duplicate_pushes += 1
            return self._recent_pushes[request_id], t.version
        staleness = t.staleness.of(t.clock, push.base_clock) if t.config.mode == "async" else None
        factor = t.staleness.factor(staleness)
        if factor != 1.0:
            grads = grads * np.float32(factor)
        if t.config.mode == "sync":  # applied with the other workers' when the step closes
            applied = t.hold(push.keys, grads, counts=push.counts, event_time=push.event_time or None)
        else:
            applied = t.push(push.keys, grads, counts=push.counts, event_time=push.event_time or None)
        if t.config.mode == "async":  # counted once applied: a refused push is not
            t.staleness.record(staleness)
        elif t.changes is not None:
            t.changes.record(push.keys, request_id)
        if request_id:
            self._recent_pushes[request_id] = applied
            if len(self._recent_pushes) > self._dedup_window:
                self._recent_pushes.popitem(last=False)
        return applied, t.version

    def handle_push_pull(
        self, push: Push, pull_keys: npt.NDArray[np.uint64], *, owned: bool = False, push_owned: bool = False
    ) -> tuple[int, F32, int]:
        """Apply `push`, then pull: (distinct keys applied, weights of
        `pull_keys`, open version), as `handle_push` then `handle_pull`.

        Both parts are checked before the push is applied, so a request that
        fails changes nothing. An empty part is skipped: an empty push is not
        checked and remembers no request id; an empty pull answers (0, dim)
        without counting as a pull. A retried `request_id` is not applied
        again, but its pull is answered. `push_owned`: only the push's keys
        are known to be this shard's (a key set it checked when pulled).
        """
        if not self.joined:
            self._check_joined()
        t = self.table(push.table)
        # The pull's only checks, done first: a bad pull must not leave the
        # push applied. handle_push checks its part before changing anything.
        if not owned:
            self._check_owned(pull_keys)
        applied = self.handle_push(push, owned=owned or push_owned)[0] if push.keys.size else 0
        if not pull_keys.size:
            # Not t.pull: that would also push the table's remembered pull
            # lookups (which the next push of those keys reuses) out of line.
            return applied, np.empty((0, t.dim), dtype=np.float32), t.version
        return applied, t.pull(pull_keys), t.version

    def handle_changes(self, table: str, since: int, incarnation: int, own: Iterable[int]) -> Changes:
        """A geo table's keys changed after its change log's number `since`
        (of `incarnation`) by pushes other than those with request ids in
        `own`, and by removals (`ps_core.store.change_log`)."""
        if not self.joined:
            self._check_joined()
        t = self.table(table)
        if t.changes is None:
            raise ModeConflictError(
                f"table {table} is updated in mode {_mode_of(t.config)}: only a geo table keeps a change log"
            )
        return t.changes.since(since, incarnation, own)

    def handle_frame(self, body: bytes | bytearray | memoryview, expect_op: int | None = None) -> bytes:
        """Decode a pull, push or push_pull frame, apply it, encode the reply
        (in the value type the request asked for)."""
        frame = codec.decode(body, expect_op)
        if frame.op == codec.Op.PULL:
            assert frame.keys is not None
            weights, version = self.handle_pull(frame.table, frame.keys)
            present = self.contains(frame.table, frame.keys) if frame.presence else None
            if frame.remember:
                self.key_sets.remember(frame.request_id, frame.table, frame.keys)
            values, rows, dim = self._reply_values(weights, frame.reply_value_type)
            clock = self.tables[frame.table].clock
            return codec.encode_weights(frame.table, values, version, present, clock, rows=rows, dim=dim)
        # A named key set's keys were checked as this shard's when pulled.
        if frame.op == codec.Op.PUSH:
            applied, version = self.handle_push(self._push_of(frame), owned=bool(frame.keys_ref))
            return codec.encode_ack(frame.table, applied, version)
        if frame.op == codec.Op.PUSH_PULL:
            push = self._push_of(frame)
            pull_keys = push.keys if frame.pull_pushed else frame.pull_keys
            assert pull_keys is not None
            applied, weights, version = self.handle_push_pull(push, pull_keys, push_owned=bool(frame.keys_ref))
            if frame.remember:
                self.key_sets.remember(frame.request_id, frame.table, pull_keys)
            values, rows, dim = self._reply_values(weights, frame.reply_value_type)
            clock = self.tables[frame.table].clock
            return codec.encode_push_pull_reply(frame.table, applied, values, version, clock, rows=rows, dim=dim)
        if frame.op == codec.Op.CHANGES:
            assert frame.keys is not None
            got = self.handle_changes(frame.table, frame.clock, frame.incarnation, frame.keys.tolist())
            return codec.encode_changes_reply(frame.table, got.keys, got.seq, got.incarnation, complete=got.complete)
        raise FrameError(f"op {frame.op} is a reply, not a request")

    def _push_of(self, frame: codec.Frame) -> Push:
        """The push a PUSH or PUSH_PULL frame carries, its keys taken from
        the key set it names if it names one."""
        keys = frame.keys
        if frame.keys_ref:
            keys = self.key_sets.take(frame.keys_ref, frame.table, frame.count)
        assert keys is not None and frame.values is not None
        return Push(frame.table, keys, frame.values, frame.counts, frame.event_time, frame.request_id, frame.clock)

    def _reply_values(self, weights: F32, vtype: int) -> tuple[F32 | Quantized, int, int]:
        """A reply's weights in the type its request asked for (rounded to
        the nearest; values beyond float16's range clipped and counted), with
        their rows and dim."""
        rows, dim = weights.shape
        if not vtype:
            return weights, rows, dim
        q = quantize(weights, vtype, "nearest")
        self.reply_values_clipped += q.clipped
        return q, rows, dim

    # -- export cuts -------------------------------------------------------------
    MAX_PENDING_SNAPSHOTS = 4
    """Cuts held for fetching; older ones are dropped (their coordinator is gone)."""

    def take_snapshot(self, version: int, parent: int | None) -> dict[str, int]:
        """Copy every table's rows for cut `version` (a base when `parent` is
        None, else a delta on `parent`); returns rows per table.

        A table never cut before (declared since the last base) gives all its
        rows in a delta: upserts of rows the parent lacks.
        """
        if version < 1 or (parent is not None and not 0 < parent < version):
            raise SnapshotError(f"cut {version} with parent {parent} is not a cut")
        if not self.joined:
            raise CutNotJoinedError(
                f"shard {self.spec.shard_id} is not joined (it holds version {self.state_version}): "
                "a cut of it could mix versions"
            )
        # A copy held under this version is a stale one (an aborted attempt,
        # or a stray request): the coordinator never reuses a number, so this
        # request is the one that counts. Refusing it would block every cut.
        self._snapshots.pop(version, None)
        kind: SnapshotKind = "base" if parent is None else "delta"
        for t in self.tables.values():  # all checks before any table is cut
            if parent is not None and t.last_snapshot > parent:
                raise SnapshotError(
                    f"table {t.config.name} was cut at version {t.last_snapshot}, after parent {parent}"
                )
        snaps = []
        for t in self.tables.values():
            # The cut's version is the coordinator's, and the table resumes after it.
            snap = t.snapshot(None if parent is None else t.last_snapshot, version)
            snaps.append(replace(snap, kind=kind, parent=parent))
        self._snapshots[version] = snaps
        self.mark_state(version)
        while len(self._snapshots) > self.MAX_PENDING_SNAPSHOTS:
            self._snapshots.popitem(last=False)
        return {s.table: s.rows for s in snaps}

    def drop_snapshot(self, version: int) -> bool:
        """Forget the copies of cut `version` (an aborted cut); True when
        held. Idempotent: dropping what is not held is no error."""
        return self._snapshots.pop(version, None) is not None

    @property
    def pending_snapshots(self) -> list[int]:
        """Versions of the copies held, not yet fetched, oldest first."""
        return list(self._snapshots)

    def pop_snapshot(self, version: int) -> list[TableSnapshot]:
        """The copies of cut `version`, handed over once."""
        try:
            return self._snapshots.pop(version)
        except KeyError:
            raise SnapshotError(f"shard {self.spec.shard_id} holds no cut {version}") from None

    # -- status board ----------------------------------------------------------
    def report_status(self, source: object, status: object, *, now: float | None = None) -> dict[str, Any]:
        """Store `status` (a JSON object) as the latest of `source`.

        The board keeps the latest status of the `max_sources` sources that
        reported most recently; an older source is forgotten first. Returns
        the stored entry's summary. Raises `StatusError` (nothing stored)
        unless `source` and `status` match the board's schema
        (`ps_core.store.board`): a short printable source, a closed object of
        bounded counts and times, at most `MAX_STATUS_BYTES` encoded.
        """
        try:
            encoded = orjson.dumps(status)
        except TypeError as exc:  # orjson's error for non-string keys, objects, huge ints
            raise StatusError(f"status is not JSON: {exc}") from None
        check_report(source, status, len(encoded))
        assert isinstance(source, str)
        received = time.time() if now is None else now
        # Stored as decoded from its encoding: a detached copy, as over HTTP.
        self._statuses[source] = (received, orjson.loads(encoded))
        self._statuses.move_to_end(source)
        while len(self._statuses) > self._max_sources:
            self._statuses.popitem(last=False)
        return {"source": source, "received_at": received, "sources": len(self._statuses)}

    def statuses(self) -> list[dict[str, Any]]:
        """The board: ``{"source", "received_at", "status"}`` per source, the
        least recently reported first (JSON-ready)."""
        return [{"source": src, "received_at": at, "status": status} for src, (at, status) in self._statuses.items()]

    def evict(self) -> dict[str, Eviction]:
        """One eviction pass over every table with eviction rules (see
        `SparseTable.evict`); runs to completion, so never within a cut's copy."""
        return {name: t.evict() for name, t in self.tables.items() if t.lifecycle.evicts}

    def apply_step(self, step: int, tables: Sequence[str] | None = None) -> int:
        """Sync mode: apply what each sync table of `tables` (None: every one)
        holds as one push, once for `step` (a closed step of its model's
        barrier, `ps_core.checkpoint.barrier`): every worker of the step
        asks, the first one applies. A table's steps only grow, so a late call
        for an older step applies nothing to it. Names of tables this shard
        does not hold, or not in sync mode, are passed over (a model's table
        may be declared on its shards one after the other). Returns the
        distinct keys updated."""
        if not self.joined:
            self._check_joined()
        names = self.tables.keys() if tables is None else tables
        applied = 0
        for name in names:
            t = self.tables.get(name)
            if t is None or t.config.mode != "sync" or step <= self.sync_steps.get(name, 0):
                continue
            self.sync_steps[name] = step
            applied += t.apply_held()
        return applied

    def stats(self) -> dict[str, Any]:
        """Features, bytes and call counts per table (JSON-ready)."""
        return {
            "shard_id": self.spec.shard_id,
            "num_shards": self.spec.num_shards,
            "duplicate_pushes": self.duplicate_pushes,
            "wire": {"key_sets": self.key_sets.stats(), "reply_values_clipped": self.reply_values_clipped},
            "tables": {
                name: {
                    "features": len(t),
                    "bytes": t.memory_bytes(),
                    "pushes": t.pushes,
                    "pulls": t.pulls,
                    "version": t.version,
                    "config": t.config.to_dict(),
                    "lifecycle": t.lifecycle_stats(),
                    "staleness": t.staleness.stats(),
                    **({} if t.changes is None else {"change_log": t.changes.stats()}),
                }
                for name, t in self.tables.items()
            },
            **{name: section() for name, section in self.extra_stats.items()},
        }
