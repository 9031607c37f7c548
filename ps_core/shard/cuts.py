"""The export cuts a shard takes part in (`HeldCuts`).

At an export cut, a shard copies its tables' rows (`take`, the cut's pause)
and holds the copies until the coordinator fetches them (`pop`), after the
pause.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from ..errors import CutNotJoinedError, SnapshotError
from ..store.snapshot import SnapshotKind, TableSnapshot
from .join_state import JoinState
from .tables import ShardTables

__all__ = ["HeldCuts"]


class HeldCuts:
    """The copies of `tables` held per cut version, until fetched."""

    MAX_PENDING = 4
    """Cuts held for fetching; older ones are dropped (their coordinator is gone)."""

    def __init__(self, tables: ShardTables, join: JoinState) -> None:
        self._tables = tables
        self._join = join
        # version -> the copies of a cut, until the coordinator fetches them.
        self._held: OrderedDict[int, list[TableSnapshot]] = OrderedDict()

    def take(self, version: int, parent: int | None) -> dict[str, int]:
        """Copy every table's rows for cut `version` (a base when `parent` is
        None, else a delta on `parent`); returns rows per table.

        A table never cut before (declared since the last base) gives all its
        rows in a delta: upserts of rows the parent lacks.
        """
        if version < 1 or (parent is not None and not 0 < parent < version):
            raise SnapshotError(f"cut {version} with parent {parent} is not a cut")
        member = self._join
        if not member.joined:
            raise CutNotJoinedError(
                f"shard {member.spec.shard_id} is not joined (it holds version {member.state_version}): "
                "a cut of it could mix versions"
            )
        # A copy held under this version is a stale one (an aborted attempt,
        # or a stray request): the coordinator never reuses a number, so this
        # request is the one that counts. Refusing it would block every cut.
        self._held.pop(version, None)
        kind: SnapshotKind = "base" if parent is None else "delta"
        tables = self._tables.by_name.values()
        for t in tables:  # all checks before any table is cut
            if parent is not None and t.last_snapshot > parent:
                raise SnapshotError(
                    f"table {t.config.name} was cut at version {t.last_snapshot}, after parent {parent}"
                )
        snaps = []
        for t in tables:
            # The cut's version is the coordinator's, and the table resumes after it.
            snap = t.snapshot(None if parent is None else t.last_snapshot, version)
            snaps.append(replace(snap, kind=kind, parent=parent))
        self._held[version] = snaps
        member.mark_state(version)
        while len(self._held) > self.MAX_PENDING:
            self._held.popitem(last=False)
        return {s.table: s.rows for s in snaps}

    def drop(self, version: int) -> bool:
        """Forget the copies of cut `version` (an aborted cut); True when
        held. Idempotent: dropping what is not held is no error."""
        return self._held.pop(version, None) is not None

    def clear(self) -> None:
        """Forget every copy held (they belong to a state replaced by a restore)."""
        self._held.clear()

    @property
    def pending(self) -> list[int]:
        """Versions of the copies held, not yet fetched, oldest first."""
        return list(self._held)

    def pop(self, version: int) -> list[TableSnapshot]:
        """The copies of cut `version`, handed over once."""
        try:
            return self._held.pop(version)
        except KeyError:
            raise SnapshotError(f"shard {self._join.spec.shard_id} holds no cut {version}") from None
