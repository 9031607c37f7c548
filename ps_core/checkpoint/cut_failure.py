"""Why an export cut failed: the failed shards and their causes, and a
delta a shard refused (`ps_core.checkpoint.exporter` raises and reports them)."""

from __future__ import annotations

__all__ = ["CutFailed", "DeltaRefused", "describe_failure"]


class CutFailed(Exception):
    """The snapshot step failed on some shards (inside the coordinator's cut)."""

    def __init__(
        self, version: int, kind: str, reason: str, by_shard: dict[int, BaseException], timeout_s: float
    ) -> None:
        super().__init__(reason)
        self.version, self.kind, self.reason, self.by_shard = version, kind, reason, by_shard
        self.timeout_s = timeout_s
        """The cut timeout a shard's copy (or the fetch) ran into, if it did (`describe_failure`)."""

    def why(self) -> str:
        """Each failed shard and its cause."""
        return "; ".join(describe_failure(i, e, self.timeout_s) for i, e in sorted(self.by_shard.items()))

    def detail(self, after_s: float) -> str:
        return (
            f"cut {self.version} aborted on every shard {after_s:.1f}s after it began "
            f"({self.reason}: {self.why()}); the next cut is a base"
        )


class DeltaRefused(Exception):
    """A shard refused a delta: the cut is tried again at once as a base."""


def describe_failure(shard_id: int, exc: BaseException, timeout_s: float) -> str:
    """One shard's failure in a line: no answer within the cut timeout, or its error."""
    what = f"shard {shard_id}" if shard_id >= 0 else "a shard"
    if isinstance(exc, TimeoutError):
        return f"{what}: no answer within the cut timeout ({timeout_s:g}s)"
    return f"{what}: {getattr(exc, 'detail', None) or exc or type(exc).__name__}"
