"""Whether a shard is joined to the cluster, and at which state (`JoinState`).

The coordinator asks each shard's membership (`report`) and admits it at a
version (`admit`); an unjoined shard refuses pulls and pushes
(`ShardNotJoinedError`). A shard started to restore in a cluster of several
starts unjoined.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from ..errors import ShardNotJoinedError, SnapshotError
from .spec import ShardSpec

__all__ = ["JoinState", "RestoreAt"]

RestoreAt = object
"""Where a shard restores from: None, a model's exports directory (a
`Path`), or its place in a bucket (`ps_core.checkpoint.exportstore.StoredModel`).
Opaque to the shard: the checkpoint layer above it reads it (`joining`)."""


class JoinState:
    """Shard `spec`'s admission state; `pushes` counts the pushes its tables applied."""

    def __init__(
        self,
        spec: ShardSpec,
        pushes: Callable[[], int],
        *,
        restore_dir: RestoreAt = None,
        restores_at_start: bool = False,
    ) -> None:
        self.spec = spec
        self._pushes = pushes
        self._pushes_at_mark = 0
        self.boot_id = secrets.token_hex(8)
        """This shard object's life: a restarted shard process has a new one."""
        self.joined = True
        """Whether the coordinator admitted this shard into the cluster."""
        self.epoch = ""
        """The epoch of the coordinator that admitted it ("" from the start)."""
        self.state_version = 0
        """The export version this shard's state was at its last restore or
        cut (0: none); with `clean`, whether it still is exactly that."""
        self.hint = ""
        """What an unjoined shard's refusals add: what it waits for."""
        self.last_contact = 0.0
        """Monotonic time the coordinator last asked this shard's membership."""
        self.restore_dir = restore_dir
        """The model's exports directory, where the coordinator may ask this
        shard to load a version from (`ps_core.checkpoint.joining.restore_version`)."""
        self.restores_at_start = restores_at_start
        """Whether this shard was started to restore the newest export (not
        ``--no-restore``): holding nothing then means nothing loaded."""

    @property
    def clean(self) -> bool:
        """Nothing was pushed since the state was `state_version`."""
        return self._pushes() == self._pushes_at_mark

    def mark_state(self, version: int) -> None:
        """Declare the state to be exactly export `version` (restored, or cut)."""
        self.state_version = version
        self._pushes_at_mark = self._pushes()

    def report(self, *, now: float | None = None) -> dict[str, Any]:
        """What the coordinator decides admission on (JSON-ready); records the contact."""
        self.last_contact = time.monotonic() if now is None else now
        return {
            "shard_id": self.spec.shard_id,
            "num_shards": self.spec.num_shards,
            "boot_id": self.boot_id,
            "joined": self.joined,
            "epoch": self.epoch,
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
        self.joined, self.epoch = True, epoch

    def leave(self, reason: str = "") -> None:
        """Stop serving pulls and pushes until admitted again."""
        self.joined = False
        if reason:
            self.hint = reason

    def check_joined(self) -> None:
        """`ShardNotJoinedError` unless joined."""
        if not self.joined:
            raise ShardNotJoinedError(
                f"shard {self.spec.shard_id} is not joined to the cluster (it holds version "
                f"{self.state_version}){': ' + self.hint if self.hint else ''}"
            )
