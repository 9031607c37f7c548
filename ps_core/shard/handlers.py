"""A shard's data handlers: pulls, pushes, change feeds and sync steps (`DataHandlers`).

Handlers run to completion without awaiting: one request's effects are never
interleaved with another's. The HTTP server, the RPC and the in-process
transport all call them, so the same checks and effects hold whichever way a
request arrives.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from ..errors import InvalidValuesError, ModeConflictError
from ..store.change_log import Changes
from ..store.eviction import Eviction
from ..store.storage import F32
from .join_state import JoinState
from .tables import ShardTables, mode_of

__all__ = ["DataHandlers", "Push"]


class Push(NamedTuple):
    """One shard's part of a push: what `DataHandlers.handle_push` applies."""

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


class DataHandlers:
    """The handlers over `tables`, refused while `join` is not joined."""

    def __init__(self, tables: ShardTables, join: JoinState, *, dedup_window: int = 4096) -> None:
        """`dedup_window` push ids are remembered for retry dedup."""
        self._tables = tables
        self._join = join
        self._dedup_window = dedup_window
        # request_id -> applied count of recent pushes, so that a client's retry
        # of a push whose ack was lost is acknowledged without applying twice.
        self._recent_pushes: OrderedDict[int, int] = OrderedDict()
        self.duplicate_pushes = 0
        """Retried pushes recognised by request id and not applied again."""
        self.sync_steps: dict[str, int] = {}
        """The last sync step applied, per table (`apply_step`)."""

    def forget_pushes(self) -> None:
        """Forget the push ids remembered (they belong to a state replaced by a restore)."""
        self._recent_pushes.clear()

    def handle_pull(self, table: str, keys: npt.NDArray[np.uint64], *, owned: bool = False) -> tuple[F32, int]:
        """Weights of `keys` and the table's open version.

        `owned` (here and in the push handlers): the caller split the keys
        with `shard_of` for this shard's own spec (an in-process client, see
        `PSClient.local`), so they are not hashed again to check ownership.
        """
        if not self._join.joined:
            self._join.check_joined()
        t = self._tables.table(table)
        if not owned:
            self._tables.check_owned(keys)
        return t.pull(keys), t.version

    def contains(self, table: str, keys: npt.NDArray[np.uint64]) -> npt.NDArray[np.bool_]:
        """Whether each key has a row in `table` (one vectorised index lookup)."""
        if not self._join.joined:
            self._join.check_joined()
        t = self._tables.table(table)
        self._tables.check_owned(keys)
        out: npt.NDArray[np.bool_] = t.index.lookup(keys) >= 0
        return out

    def handle_push(self, push: Push, *, owned: bool = False) -> tuple[int, int]:
        """Apply `push`; returns (distinct keys applied, open version).

        A push whose nonzero `request_id` was applied recently is acknowledged
        with its earlier result and not applied again. `owned`: the caller
        split the keys for this shard's spec, so they are not checked again.
        """
        if not self._join.joined:
            self._join.check_joined()
        t = self._tables.table(push.table)
        grads = push.grads
        if grads.ndim != 2 or grads.shape[1] != t.dim:
            raise InvalidValuesError(
                f"table {push.table} has dim {t.dim}, the push carries dim "
                f"{grads.shape[1] if grads.ndim == 2 else grads.ndim}"
            )
        if not owned:
            self._tables.check_owned(push.keys)
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
        if not self._join.joined:
            self._join.check_joined()
        t = self._tables.table(push.table)
        # The pull's only checks, done first: a bad pull must not leave the
        # push applied. handle_push checks its part before changing anything.
        if not owned:
            self._tables.check_owned(pull_keys)
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
        if not self._join.joined:
            self._join.check_joined()
        t = self._tables.table(table)
        if t.changes is None:
            raise ModeConflictError(
                f"table {table} is updated in mode {mode_of(t.config)}: only a geo table keeps a change log"
            )
        return t.changes.since(since, incarnation, own)

    def evict(self) -> dict[str, Eviction]:
        """One eviction pass over every table with eviction rules (see
        `SparseTable.evict`); runs to completion, so never within a cut's copy."""
        return {name: t.evict() for name, t in self._tables.by_name.items() if t.lifecycle.evicts}

    def apply_step(self, step: int, tables: Sequence[str] | None = None) -> int:
        """Sync mode: apply what each sync table of `tables` (None: every one)
        holds as one push, once for `step` (a closed step of its model's
        barrier, `ps_core.checkpoint.barrier`): every worker of the step
        asks, the first one applies. A table's steps only grow, so a late call
        for an older step applies nothing to it. Names of tables this shard
        does not hold, or not in sync mode, are passed over (a model's table
        may be declared on its shards one after the other). Returns the
        distinct keys updated."""
        if not self._join.joined:
            self._join.check_joined()
        held = self._tables.by_name
        names = held.keys() if tables is None else tables
        applied = 0
        for name in names:
            t = held.get(name)
            if t is None or t.config.mode != "sync" or step <= self.sync_steps.get(name, 0):
                continue
            self.sync_steps[name] = step
            applied += t.apply_held()
        return applied
