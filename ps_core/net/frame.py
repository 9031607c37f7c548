"""A decoded frame of the shard RPC: the fields its header and sections
carry, named (`ps_core.net.codec` decodes the bytes into one)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Frame"]


@dataclass(frozen=True)
class Frame:
    """A decoded frame; arrays are read-only views of the received bytes."""

    op: int
    """One of `ps_core.net.codec.Op`."""
    table: str
    """Table name."""
    count: int
    """n: keys, rows or applied keys (the layout: `ps_core.net.codec`)."""
    dim: int
    """Values per key (0 when there are none)."""
    keys: npt.NDArray[np.uint64] | None
    """(n,) uint64 keys of a request or a changes reply (a changes request:
    the request ids of the asker's own pushes), else None."""
    values: npt.NDArray[np.float32] | None
    """(n, dim) float32 values of a push or a weights reply, else None."""
    counts: npt.NDArray[np.float32] | None = None
    """(n, 2) float32 shows and clicks of a push, if sent."""
    event_time: float = 0.0
    """Event time of a push (seconds), 0 when unset."""
    version: int = 0
    """The table's open export version, in replies."""
    request_id: int = 0
    """A push's id for retry dedup; 0 when none."""
    presence: bool = False
    """A pull asks for presence; a weights reply carries `present`."""
    present: npt.NDArray[np.bool_] | None = None
    """(n,) whether each key has a row (weights reply with presence), else None."""
    pull_keys: npt.NDArray[np.uint64] | None = None
    """(m,) uint64 keys of a push_pull request's pull, else None."""
    applied: int = 0
    """Distinct keys a push_pull's push applied (push_pull reply), else 0."""
    clock: int = 0
    """Push and push_pull requests: the base clock (the table clock their
    gradients were read at); weights and push_pull replies: the table's clock
    at the read; 0 elsewhere or when unknown."""
    keys_ref: int = 0
    """A push naming a remembered key set: its id (`keys` is then None
    until the shard resolves it); else 0."""
    remember: bool = False
    """A pull or push_pull request asks the shard to keep its pull keys
    under `request_id`, for a push that names them."""
    value_type: int = 0
    """The values section's type (`ps_core.net.quantize.VALUE_TYPES`)."""
    reply_value_type: int = 0
    """A pull or push_pull request: the type its reply's weights should travel in."""
    format_version: int = 1
    """The frame's format version."""
    pull_pushed: bool = False
    """A push_pull request pulls the keys it pushes (flag bit 2)."""
    incarnation: int = 0
    """Changes request and reply: the change log's incarnation (`clock`
    holds the sequence number)."""
    complete: bool = False
    """A changes reply: its keys are every changed key (flag bit 5)."""
