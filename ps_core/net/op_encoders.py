"""One encoder per request and reply of the shard RPC: the frame of each op
(`ps_core.net.codec` holds the layout and the generic `encode` and `decode`).

Each names what its op carries, checks what the frame's length cannot (a
push_pull's sections of different rows), and says where a value travels
(a push's base clock, a changes request's sequence number)."""

from __future__ import annotations

from typing import Any, TypedDict, Unpack

import numpy as np
import numpy.typing as npt

from ..errors import FrameError
from .codec import Op, encode
from .quantize import Quantized

__all__ = [
    "encode_pull",
    "encode_push",
    "PushFields",
    "encode_weights",
    "encode_ack",
    "encode_push_pull",
    "encode_push_pull_reply",
    "encode_changes",
    "encode_changes_reply",
]


def encode_pull(
    table: str, keys: npt.NDArray[np.uint64], *, presence: bool = False, reply_vtype: int = 0, remember: int = 0
) -> bytes:
    """A pull request: the keys whose weights are wanted (and, with
    `presence`, whether each has a row); `reply_vtype`, the type the
    weights should travel in; `remember`, an id to keep the keys under for
    the push that follows (format 2)."""
    return encode(
        Op.PULL,
        table,
        keys=keys,
        presence=presence,
        reply_vtype=reply_vtype,
        remember=bool(remember),
        request_id=remember,
    )


class PushFields(TypedDict, total=False):
    """A push section's optional fields (`encode_push`, `encode_push_pull`)."""

    counts: npt.NDArray[np.float32] | None
    """Shows and clicks per key, (n, 2)."""
    event_time: float
    request_id: int
    base_clock: int
    """The table clock the gradients were computed at."""
    dim: int | None
    """Needed by quantized gradients."""
    keys_ref: int
    """The id of the remembered key set `keys` are, sent instead of the keys."""
    compact: bool
    """Narrow the counts."""


def _push_section(push: PushFields) -> dict[str, Any]:
    # `encode` calls the base clock `clock`, as every op that carries one does.
    section: dict[str, Any] = dict(push)
    section["clock"] = section.pop("base_clock", 0)
    return section


def encode_push(
    table: str, keys: npt.NDArray[np.uint64], grads: npt.NDArray[np.float32] | Quantized, **push: Unpack[PushFields]
) -> bytes:
    """A push request: keys, gradients (n, dim) and the `PushFields`."""
    return encode(Op.PUSH, table, keys=keys, values=grads, **_push_section(push))


def encode_weights(
    table: str,
    weights: npt.NDArray[np.float32] | Quantized,
    version: int,
    present: npt.NDArray[np.bool_] | None = None,
    clock: int = 0,
    *,
    rows: int | None = None,
    dim: int | None = None,
) -> bytes:
    """A pull reply: weights (n, dim) in the order of the request's keys, and
    the presence of each key when the pull asked for it; `clock`, the
    table's clock at the read. Quantized weights need `rows` and `dim`."""
    return encode(Op.WEIGHTS, table, values=weights, version=version, present=present, clock=clock, count=rows, dim=dim)


def encode_ack(table: str, applied: int, version: int) -> bytes:
    """A push reply: how many distinct keys were applied."""
    return encode(Op.ACK, table, count=applied, version=version)


def encode_push_pull(
    table: str,
    keys: npt.NDArray[np.uint64],
    grads: npt.NDArray[np.float32] | Quantized,
    pull_keys: npt.NDArray[np.uint64],
    *,
    reply_vtype: int = 0,
    remember: bool = False,
    **push: Unpack[PushFields],
) -> bytes:
    """A push_pull request: push `keys` with `grads` (n, dim) and the
    `PushFields`, then pull
    `pull_keys`. Either part may be empty; an empty push is skipped by the
    shard (its dim is not checked). `pull_keys` given as the very `keys`
    object is sent as flag bit 2, not as a second copy of the keys.
    `reply_vtype` and `remember` (under `request_id`) as for `encode_pull`."""
    counts = push.get("counts")
    rows = grads_rows = np.asarray(keys).size
    if not isinstance(grads, Quantized):
        g = np.asarray(grads)
        grads_rows = g.shape[0] if g.ndim else 0
    if grads_rows != rows or (counts is not None and np.asarray(counts).size != 2 * rows):
        # The length check cannot catch sections that disagree with each
        # other in a well-formed frame, so refuse to write one.
        raise FrameError(
            f"push section of {rows} keys, {grads_rows} gradient rows"
            + ("" if counts is None else f", {np.asarray(counts).size // 2} rows of counts")
        )
    same = pull_keys is keys  # the caller pulls what it pushes: say so, not the keys again
    return encode(
        Op.PUSH_PULL,
        table,
        keys=keys,
        pull_keys=None if same else pull_keys,
        pull_pushed=same,
        values=grads,
        reply_vtype=reply_vtype,
        remember=remember,
        **_push_section(push),
    )


def encode_push_pull_reply(
    table: str,
    applied: int,
    weights: npt.NDArray[np.float32] | Quantized,
    version: int,
    clock: int = 0,
    *,
    rows: int | None = None,
    dim: int | None = None,
) -> bytes:
    """A push_pull reply: distinct keys the push applied, and the pull's
    weights (m, dim) in the order of its keys, read at table clock `clock`.
    Quantized weights need `rows` and `dim`."""
    return encode(
        Op.PUSH_PULL_REPLY, table, values=weights, version=version, applied=applied, clock=clock, count=rows, dim=dim
    )


def encode_changes(table: str, since: int, incarnation: int, own: npt.NDArray[np.uint64]) -> bytes:
    """A changes request: the keys changed after sequence number `since` of
    the change log's `incarnation` (0: none yet), but by the pushes whose
    request ids are `own`."""
    return encode(Op.CHANGES, table, keys=own, version=incarnation, request_id=since)


def encode_changes_reply(
    table: str, keys: npt.NDArray[np.uint64], seq: int, incarnation: int, *, complete: bool
) -> bytes:
    """A changes reply: the changed `keys`, the log's sequence number and
    incarnation now, and whether the keys are `complete`."""
    return encode(Op.CHANGES_REPLY, table, keys=keys, version=incarnation, request_id=seq, complete=complete)
