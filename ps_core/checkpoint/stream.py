"""The identity of the stream a model was trained from.

Offsets mean something only in the stream they were read from: the same
topic name on another Kafka cluster (or on the same in-memory broker after a
restart) holds other records at the same offsets. Workers report the stream
they train from with the offsets they commit; the coordinator keeps it with
its offsets, a cut writes it into the export's manifest, and a restore hands
it back, so a worker can tell whether the offsets it is given belong to the
broker in front of it.

Pure data (no Kafka here): the worker learns the cluster id from the broker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..net.control_messages import Stream

__all__ = ["StreamIdentity", "stream_mismatch"]


@dataclass(frozen=True)
class StreamIdentity:
    """Where a model's offsets were read: cluster, consumer group, topics."""

    cluster_id: str
    """The Kafka cluster id (``DescribeCluster`` / metadata)."""
    group: str
    """The workers' consumer group."""
    topics: tuple[str, ...] = ()
    """Topics the offsets cover (sorted)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON form: ``{"cluster_id", "group", "topics": [...]}``."""
        return {"cluster_id": self.cluster_id, "group": self.group, "topics": list(self.topics)}

    @classmethod
    def from_dict(cls, raw: object) -> StreamIdentity:
        """Parse the JSON form; `ValueError` on anything else."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"stream must be an object, got {type(raw).__name__}")
        cluster, group, topics = raw.get("cluster_id"), raw.get("group"), raw.get("topics", [])
        if not isinstance(cluster, str) or not cluster or len(cluster) > 200:
            raise ValueError("stream.cluster_id must be a non-empty string of at most 200 characters")
        if not isinstance(group, str) or len(group) > 300:
            raise ValueError("stream.group must be a string of at most 300 characters")
        if not isinstance(topics, list) or not all(isinstance(t, str) for t in topics) or len(topics) > 1000:
            raise ValueError("stream.topics must be a list of strings")
        return cls(cluster, group, tuple(sorted(set(topics))))

    def to_body(self) -> Stream:
        """The control plane's model of it (a release's, the coordinator's offsets')."""
        return Stream(self.cluster_id, self.group, list(self.topics))

    @classmethod
    def from_body(cls, body: Stream) -> StreamIdentity:
        """From the control plane's model (its fields checked by it)."""
        return cls(body.cluster_id, body.group, tuple(sorted(set(body.topics))))

    def with_topics(self, topics: tuple[str, ...] | list[str] | set[str]) -> StreamIdentity:
        """The same stream covering `topics` too."""
        return StreamIdentity(self.cluster_id, self.group, tuple(sorted(set(self.topics) | set(topics))))


def stream_mismatch(recorded: StreamIdentity | None, actual: StreamIdentity) -> str | None:
    """Why offsets recorded for `recorded` do not belong to `actual`:
    ``"cluster"`` or ``"group"``, or None when they may (unknown `recorded`
    included: an export older than stream identities). Topics are compared
    through the offsets themselves, which are keyed by topic."""
    if recorded is None:
        return None
    if recorded.cluster_id != actual.cluster_id:
        return "cluster"
    if recorded.group != actual.group:
        return "group"
    return None
