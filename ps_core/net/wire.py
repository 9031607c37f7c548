"""What a client's frames carry: value types, counts, key sets (`WireFormat`),
what they cost (`WireStats`) and error feedback (`ErrorFeedback`).

A client chooses its format per connection; a shard reads every format and
answers a pull in the type the pull asks for, so no shard setting is needed
and workers with different formats may share a model. Pushes always
accumulate in float32 on the shard, whatever they travelled in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from ..hashing import U64
from ..store.index import KeyIndex
from .quantize import PULL_VALUE_TYPES, VALUE_TYPES, Quantized, dequantize, quantize

__all__ = ["ErrorFeedback", "WireFormat", "WireStats", "ROUNDINGS", "F32_WIRE"]

F32 = npt.NDArray[np.float32]
ROUNDINGS = ("stochastic", "feedback")


@dataclass(frozen=True)
class WireFormat:
    """How one client's frames travel."""

    push: str = "f32"
    """Gradients of pushes: ``f32``, ``f16`` or ``int8`` (`ps_core.net.quantize`)."""
    pull: str = "f32"
    """Weights of pull replies: ``f32`` or ``f16``."""
    key_sets: bool = False
    """Pulls of a training step are remembered by the shard and the push that
    follows names them instead of resending its keys (`ps_core.shard.key_sets`)."""
    compact_counts: bool = False
    """Shows and clicks travel as the narrowest exact unsigned integers."""
    rounding: Literal["stochastic", "feedback"] = "stochastic"
    """Unbiased rounding of quantized gradients: each value rounds up or down
    at random, or (``feedback``) to the nearest, its error added to the
    key's next push (`ErrorFeedback`)."""
    feedback_rows: int = 1_000_000
    """Keys an error-feedback residual is kept for, per table and shard."""

    def __post_init__(self) -> None:
        if self.push not in VALUE_TYPES:
            raise ValueError(f"push values {self.push!r}: one of {', '.join(VALUE_TYPES)}")
        if self.pull not in PULL_VALUE_TYPES:
            raise ValueError(f"pull values {self.pull!r}: one of {', '.join(PULL_VALUE_TYPES)}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding {self.rounding!r}: one of {', '.join(ROUNDINGS)}")
        if self.feedback_rows < 1:
            raise ValueError("feedback_rows must be >= 1")

    @property
    def push_type(self) -> int:
        """The push value type's code in a frame."""
        return VALUE_TYPES.index(self.push)

    @property
    def pull_type(self) -> int:
        """The reply value type's code in a frame."""
        return PULL_VALUE_TYPES.index(self.pull)

    @property
    def is_exact(self) -> bool:
        """Float32 both ways: what a format 1 peer reads."""
        return self.push == "f32" and self.pull == "f32"

    def describe(self) -> str:
        """One line for logs and /v1/model: ``push f16, pull f16, key sets``."""
        parts = [f"push {self.push}", f"pull {self.pull}"]
        if self.push != "f32":
            parts.append(f"{self.rounding} rounding")
        if self.key_sets:
            parts.append("key sets")
        if self.compact_counts:
            parts.append("compact counts")
        return ", ".join(parts)


F32_WIRE = WireFormat()
"""Float32 both ways, no key sets: format 1 frames, the reference."""


@dataclass
class WireStats:
    """What one client's frames cost (summed over its shards)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    frames: int = 0
    values_clipped: int = 0
    """Gradients clipped to float16's range before sending."""
    key_set_pushes: int = 0
    """Pushes that named a key set instead of sending their keys."""
    key_set_misses: int = 0
    """Of those, the ones the shard no longer held, sent again with keys."""

    def add(self, other: WireStats) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class ErrorFeedback:
    """Per key, the rounding error of its last quantized push, added to its
    next one, so what the shard receives sums to what was computed.

    Bounded: when `max_rows` keys hold a residual, all residuals are dropped
    and counted (each is below one rounding step of its key)."""

    max_rows: int
    index: KeyIndex = field(default_factory=KeyIndex)
    residual: F32 = field(default_factory=lambda: np.zeros((0, 0), dtype=np.float32))
    resets: int = 0

    def quantize(self, keys: U64, grads: F32, vtype: int) -> Quantized:
        """`grads` (n, dim) plus the keys' residuals, rounded to the nearest
        of `vtype`; the new rounding errors become the residuals."""
        g = np.asarray(grads, dtype=np.float32)
        if g.ndim == 1:
            g = g.reshape(-1, 1)
        if self.index.size + int((self.index.lookup(keys) < 0).sum()) > self.max_rows:
            self.index = KeyIndex()
            self.residual = np.zeros((0, g.shape[1]), dtype=np.float32)
            self.resets += 1
        rows, _, _ = self.index.get_or_insert(keys)
        need = self.index.row_capacity
        if self.residual.shape[0] < need or self.residual.shape[1] != g.shape[1]:
            grown = np.zeros((max(need, 2 * self.residual.shape[0]), g.shape[1]), dtype=np.float32)
            if self.residual.shape[1] == g.shape[1]:
                grown[: self.residual.shape[0]] = self.residual
            self.residual = grown
        want = g + self.residual[rows]
        q = quantize(want, vtype, "nearest")
        sent = dequantize(memoryview(q.data), 0, vtype, want.size).reshape(want.shape)
        self.residual[rows] = want - sent
        return q
