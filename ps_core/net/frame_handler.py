"""A shard's binary frames, served: decode, call the shard's handlers, encode
the reply (`handle_frame`).

The HTTP server (`server`) and the TCP RPC (`rpc`) both answer frames
through it. It runs to completion without awaiting, as the handlers do.
"""

from __future__ import annotations

from ..errors import FrameError
from ..shard.handlers import Push
from ..shard.shard import Shard
from ..store.storage import F32
from . import codec, op_encoders
from .frame import Frame
from .quantize import Quantized, quantize

__all__ = ["handle_frame"]


def handle_frame(shard: Shard, body: bytes | bytearray | memoryview, expect_op: int | None = None) -> bytes:
    """Decode a pull, push, push_pull or changes frame, apply it to `shard`,
    encode the reply (in the value type the request asked for)."""
    frame = codec.decode(body, expect_op)
    if frame.op == codec.Op.PULL:
        assert frame.keys is not None
        weights, version = shard.handle_pull(frame.table, frame.keys)
        present = shard.contains(frame.table, frame.keys) if frame.presence else None
        if frame.remember:
            shard.key_sets.remember(frame.request_id, frame.table, frame.keys)
        values, rows, dim = _reply_values(shard, weights, frame.reply_value_type)
        clock = shard.tables[frame.table].clock
        return op_encoders.encode_weights(frame.table, values, version, present, clock, rows=rows, dim=dim)
    # A named key set's keys were checked as this shard's when pulled.
    if frame.op == codec.Op.PUSH:
        applied, version = shard.handle_push(_push_of(shard, frame), owned=bool(frame.keys_ref))
        return op_encoders.encode_ack(frame.table, applied, version)
    if frame.op == codec.Op.PUSH_PULL:
        push = _push_of(shard, frame)
        pull_keys = push.keys if frame.pull_pushed else frame.pull_keys
        assert pull_keys is not None
        applied, weights, version = shard.handle_push_pull(push, pull_keys, push_owned=bool(frame.keys_ref))
        if frame.remember:
            shard.key_sets.remember(frame.request_id, frame.table, pull_keys)
        values, rows, dim = _reply_values(shard, weights, frame.reply_value_type)
        clock = shard.tables[frame.table].clock
        return op_encoders.encode_push_pull_reply(frame.table, applied, values, version, clock, rows=rows, dim=dim)
    if frame.op == codec.Op.CHANGES:
        assert frame.keys is not None
        got = shard.handle_changes(frame.table, frame.clock, frame.incarnation, frame.keys.tolist())
        return op_encoders.encode_changes_reply(frame.table, got.keys, got.seq, got.incarnation, complete=got.complete)
    raise FrameError(f"op {frame.op} is a reply, not a request")


def _push_of(shard: Shard, frame: Frame) -> Push:
    """The push a PUSH or PUSH_PULL frame carries, its keys taken from the
    key set it names if it names one."""
    keys = frame.keys
    if frame.keys_ref:
        keys = shard.key_sets.take(frame.keys_ref, frame.table, frame.count)
    assert keys is not None and frame.values is not None
    return Push(frame.table, keys, frame.values, frame.counts, frame.event_time, frame.request_id, frame.clock)


def _reply_values(shard: Shard, weights: F32, vtype: int) -> tuple[F32 | Quantized, int, int]:
    """A reply's weights in the type its request asked for (rounded to the
    nearest; values beyond float16's range clipped and counted), with their
    rows and dim."""
    rows, dim = weights.shape
    if not vtype:
        return weights, rows, dim
    q = quantize(weights, vtype, "nearest")
    shard.count_clipped(q.clipped)
    return q, rows, dim
