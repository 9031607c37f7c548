"""Where a shard sits in the cluster (`ShardSpec`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ShardSpec"]


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
