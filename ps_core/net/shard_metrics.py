"""Prometheus families of shards' and ports' figures, from a shard's stats
(`ps_core.shard.Shard.stats`, ``GET /v1/stats``).

One set of families, written once per exposition, whoever writes it:

- a shard's own ``GET /metrics`` (`ps_core.net.server`): its figures, labelled
  with its number;
- the API's ``/metrics`` (`app.metrics`): every shard's, relayed from their
  stats at each scrape, with the API's own port beside them.

The shard figures: whether it answered (``ctrps_shard_up``), per table its
rows, bytes, pushes and pulls, eviction and admission, push staleness, a geo
table's change log; refused credentials; key sets; and shard 0's exporter,
membership and sync barrier figures when it hosts them. The port figures
(`port_families`):

- ``ctrps_port_open_connections{role, shard, port}``: connections open now;
- ``ctrps_port_refused_total{role, shard, port, reason}``: connections closed
  or requests refused under the port's limits (``cap``, ``head_timeout``,
  ``body_timeout``, ``hello_timeout``, ``frame_timeout``, ``overloaded``);
- ``ctrps_port_buffered_frame_bytes{role, shard}``: bytes of RPC frames
  announced and not yet whole (the buffer budget in use);
- ``ctrps_tls_handshake_failures_total{role, shard, reason}``: refused TLS
  handshakes by OpenSSL's reason.

``role`` is ``api`` or ``shard``; ``shard`` is the shard's number (empty for
the API). A family name is written once per exposition: Prometheus's text
format (and ``promtool check metrics``) refuses a second ``HELP`` line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = [
    "PortRow",
    "ShardRow",
    "by_key",
    "counter_by",
    "num",
    "port_families",
    "shard_families",
    "exposition",
    "Families",
]

_Family = TypeVar("_Family", GaugeMetricFamily, CounterMetricFamily, HistogramMetricFamily)

ShardRow = tuple[str, Mapping[str, Any] | None]
"""A shard's number (as its label) and its stats, None where it did not answer."""
PortRow = tuple[str, str, Mapping[str, Any] | None]
"""(role, shard, ports stats): ``{"http": PortGuard.stats(), "rpc": RpcServer.stats(), "tls": ...}``."""


def shard_families(rows: Sequence[ShardRow], ports: Iterable[PortRow] = ()) -> Iterator[Metric]:
    """The families of the shards of `rows`, each family once, with the port
    rows of `ports` (the API's own) beside the shards' own ports; shard 0's
    exporter, membership and sync families when its row has those sections."""
    up = GaugeMetricFamily("ctrps_shard_up", "Whether the shard answered at this scrape.", labels=["shard"])
    table = _table_families()
    for i, stats in rows:
        up.add_metric([i], 0.0 if stats is None else 1.0)
        for name, t in (stats or {}).get("tables", {}).items():
            _add_table(table, i, name, t)
    shard = _shard_wide_families(rows)
    yield up
    yield from (table[k] for k in ("features", "max_rows", "size", "pushes", "pulls"))
    yield shard["duplicates"]
    yield from (table[k] for k in ("evicted", "freed", "pause", "admission", "staleness", "down_weighted"))
    yield from (shard[k] for k in ("refused", "held", "sets_gone", "reply_clipped", "slots", "epoch", "moved"))
    yield from (table[k] for k in ("log_keys", "log_incomplete"))
    yield from port_families([*ports, *(("shard", i, (stats or {}).get("ports")) for i, stats in rows)])
    yield from _shard0_families(next((stats for i, stats in rows if i == "0"), None))


def _table_families() -> dict[str, Any]:
    """The per-table families, empty, by key (Any: each kind takes its own samples)."""

    def per_table(kind: type[_Family], name: str, doc: str, *more: str) -> _Family:
        # Every table figure is per shard and table, some by one label more.
        return kind(name, doc, labels=["shard", "table", *more])

    return {
        "features": per_table(GaugeMetricFamily, "ctrps_table_features", "Features (rows) per table and shard."),
        "max_rows": per_table(
            GaugeMetricFamily,
            "ctrps_table_max_rows",
            "A table's row cap (lifecycle max_rows) per shard; only for tables that have one.",
        ),
        "size": per_table(GaugeMetricFamily, "ctrps_table_bytes", "Bytes allocated per table and shard."),
        "pushes": per_table(CounterMetricFamily, "ctrps_table_pushes", "Pushes a table applied (HTTP and RPC)."),
        "pulls": per_table(CounterMetricFamily, "ctrps_table_pulls", "Pulls a table answered (HTTP and RPC)."),
        "evicted": per_table(
            CounterMetricFamily,
            "ctrps_table_evicted_rows",
            "Rows removed by eviction, by rule (ttl, score, max_rows).",
            "rule",
        ),
        "freed": per_table(
            CounterMetricFamily,
            "ctrps_table_evicted_bytes",
            "Bytes of the rows removed by eviction (reused by new rows).",
        ),
        "pause": per_table(
            GaugeMetricFamily, "ctrps_table_eviction_pause_ms", "How long the last eviction pass held the table."
        ),
        "admission": per_table(
            CounterMetricFamily,
            "ctrps_table_admission",
            "Keys without a row a push met: admitted (given one) or dropped (their update with them).",
            "outcome",
        ),
        "staleness": per_table(
            HistogramMetricFamily,
            "ctrps_table_push_staleness",
            "How stale the async pushes a table applied were: pushes applied between the pull a gradient "
            "was computed from and its push.",
        ),
        "down_weighted": per_table(
            CounterMetricFamily,
            "ctrps_table_pushes_down_weighted",
            "Async pushes scaled down for being staler than the model's max_staleness.",
        ),
        "log_keys": per_table(
            GaugeMetricFamily,
            "ctrps_table_change_log_keys",
            "Keys a geo table's change log holds (what geo workers ask at each round's end).",
        ),
        "log_incomplete": per_table(
            CounterMetricFamily,
            "ctrps_table_change_log_incomplete",
            "Geo workers' questions a table's change log could not answer whole (it no longer reached back, "
            "or the worker asked another incarnation): the worker read every row again.",
        ),
    }


def _add_table(f: Mapping[str, Any], i: str, name: str, t: Mapping[str, Any]) -> None:
    """Table `name` of shard `i`, from its stats `t`, into the families `f` (by key)."""
    f["features"].add_metric([i, name], float(t["features"]))
    f["size"].add_metric([i, name], float(t["bytes"]))
    f["pushes"].add_metric([i, name], num(t.get("pushes")))
    f["pulls"].add_metric([i, name], num(t.get("pulls")))
    changes = t.get("change_log")
    if isinstance(changes, dict):
        f["log_keys"].add_metric([i, name], num(changes.get("keys")))
        f["log_incomplete"].add_metric([i, name], num(changes.get("incomplete")))
    stale = t.get("staleness")
    if isinstance(stale, dict) and isinstance(stale.get("buckets"), dict):
        cumulative, buckets = 0.0, []
        for bound, n in stale["buckets"].items():
            cumulative += num(n)
            buckets.append((bound, cumulative))
        f["staleness"].add_metric([i, name], buckets, num(stale.get("sum")))
        f["down_weighted"].add_metric([i, name], num(stale.get("down_weighted")))
    life = t.get("lifecycle")
    if not isinstance(life, dict):
        return
    declared = life.get("lifecycle")
    cap = declared.get("max_rows") if isinstance(declared, dict) else None
    if num(cap) > 0:
        f["max_rows"].add_metric([i, name], num(cap))
    for rule, n in life.get("evicted", {}).items():
        f["evicted"].add_metric([i, name, str(rule)], num(n))
    f["freed"].add_metric([i, name], num(life.get("bytes_freed")))
    if life.get("last_eviction_ms") is not None:
        f["pause"].add_metric([i, name], num(life["last_eviction_ms"]))
    for outcome in ("admitted", "dropped"):
        if outcome in life.get("admission", {}):
            f["admission"].add_metric([i, name, outcome], num(life["admission"][outcome]))


def _shard_wide_families(rows: Sequence[ShardRow]) -> dict[str, Metric]:
    """The shards' figures not per table, by key: refused credentials, key sets, duplicate pushes."""
    refused = CounterMetricFamily(
        "ctrps_shard_auth_refused",
        "Requests and RPC connections a shard refused for their credentials, by reason (missing, wrong, scope).",
        labels=["shard", "reason"],
    )
    held = GaugeMetricFamily(
        "ctrps_shard_key_sets", "Key sets a shard keeps from pulls for the pushes that name them.", labels=["shard"]
    )
    sets_gone = CounterMetricFamily(
        "ctrps_shard_key_sets_expired",
        "Pushes that named a key set the shard no longer held (the worker sent them again with keys).",
        labels=["shard"],
    )
    reply_clipped = CounterMetricFamily(
        "ctrps_shard_reply_values_clipped",
        "Weights clipped to float16's range in float16 replies.",
        labels=["shard"],
    )
    slots = GaugeMetricFamily(
        "ctrps_shard_slots", "Slots a shard owns (of the cluster's: ps_core.slots).", labels=["shard"]
    )
    epoch = GaugeMetricFamily("ctrps_shard_slot_map_epoch", "The epoch of a shard's slot map.", labels=["shard"])
    moved = CounterMetricFamily(
        "ctrps_shard_slot_rows_moved",
        "Rows slot moves carried, into a shard (in) or out of it (out).",
        labels=["shard", "direction"],
    )
    duplicates = CounterMetricFamily(
        "ctrps_shard_duplicate_pushes",
        "Pushes sent again (a retry) that the shard had applied already: acknowledged, not applied twice.",
        labels=["shard"],
    )
    for i, stats in rows:
        auth = (stats or {}).get("auth")
        for reason, n in by_key(auth.get("refused") if isinstance(auth, dict) else None):
            refused.add_metric([i, reason], n)
        wire = (stats or {}).get("wire")
        sets = wire.get("key_sets") if isinstance(wire, dict) else None
        if isinstance(sets, dict) and isinstance(wire, dict):
            held.add_metric([i], num(sets.get("sets")))
            sets_gone.add_metric([i], num(sets.get("expired")))
            reply_clipped.add_metric([i], num(wire.get("reply_values_clipped")))
        if stats is not None and "duplicate_pushes" in stats:
            duplicates.add_metric([i], num(stats["duplicate_pushes"]))
        owned = (stats or {}).get("slots")
        if isinstance(owned, dict):
            slots.add_metric([i], num(owned.get("owned")))
            epoch.add_metric([i], num(owned.get("epoch")))
            moved.add_metric([i, "in"], num(owned.get("rows_in")))
            moved.add_metric([i, "out"], num(owned.get("rows_out")))
    return {
        "slots": slots,
        "epoch": epoch,
        "moved": moved,
        "refused": refused,
        "held": held,
        "sets_gone": sets_gone,
        "reply_clipped": reply_clipped,
        "duplicates": duplicates,
    }


def _shard0_families(stats0: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Shard 0's exporter and coordinator figures (absent when it hosts none)."""
    sections = {k: v for k, v in (stats0 or {}).items() if isinstance(v, dict)}
    for section, kind, name, doc, key in _SHARD0_VALUES:
        if section in sections and sections[section].get(key) is not None:
            raw = sections[section][key]
            # A flag reads as 0 or 1, a list as its length, anything else as a number.
            value = float(raw) if isinstance(raw, bool) else float(len(raw)) if isinstance(raw, list) else num(raw)
            yield kind(name, doc, value=value)
    for section, name, doc, label, key in _SHARD0_COUNTS_BY:
        if section in sections:
            yield counter_by(name, doc, label, sections[section].get(key))


# Shard 0's single figures: (status section, family, name, help, field).
_SHARD0_VALUES: tuple[tuple[str, type[CounterMetricFamily | GaugeMetricFamily], str, str, str], ...] = (
    ("exports", CounterMetricFamily, "ctrps_exports", "Export versions written by shard 0's exporter.", "exports"),
    (
        "exports",
        GaugeMetricFamily,
        "ctrps_export_age_seconds",
        "Seconds since shard 0's exporter last wrote a version (since it started, before its first).",
        "age_s",
    ),
    (
        "exports",
        GaugeMetricFamily,
        "ctrps_export_interval_seconds",
        "Seconds between periodic exports (0: only when asked).",
        "interval_s",
    ),
    (
        "cluster",
        CounterMetricFamily,
        "ctrps_cluster_restores",
        "Times every shard was made to load one export version together.",
        "cluster_restores",
    ),
    (
        "cluster",
        CounterMetricFamily,
        "ctrps_versions_refused",
        "Export versions a shard refused to load (a damaged file).",
        "versions_refused",
    ),
    (
        "cluster",
        GaugeMetricFamily,
        "ctrps_cluster_ready",
        "Whether every shard is joined at one version (leases granted).",
        "ready",
    ),
    ("cluster", GaugeMetricFamily, "ctrps_cluster_version", "The export version the shards were joined at.", "version"),
    ("sync", CounterMetricFamily, "ctrps_sync_steps", "Sync steps the coordinator's barrier closed.", "steps_closed"),
    (
        "sync",
        CounterMetricFamily,
        "ctrps_sync_quorum_shrinks",
        "Sync steps closed without a member that did not arrive within the deadline.",
        "shrinks",
    ),
    ("sync", GaugeMetricFamily, "ctrps_sync_members", "Workers inside a window, taking part in sync steps.", "members"),
)
# Shard 0's counts by a label: (status section, name, help, label, field).
_SHARD0_COUNTS_BY = (
    (
        "exports",
        "ctrps_export_failures",
        "Failed export cuts (aborted on every shard) and writes, by reason.",
        "reason",
        "failures",
    ),
    ("sync", "ctrps_sync_members_dropped", "Times a worker was dropped from a sync step.", "worker", "dropped"),
)


def num(v: object) -> float:
    """A status field as a sample value (0 when it is not a number)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    try:
        return float(v)
    except OverflowError:  # an integer beyond a float's range
        return math.copysign(math.inf, v)


def by_key(raw: object) -> list[tuple[str, float]]:
    """A status's counts by key (reason, worker, ...) as (label, sample value);
    none when it is not a mapping."""
    return [(str(k), num(n)) for k, n in raw.items()] if isinstance(raw, dict) else []


def counter_by(name: str, doc: str, label: str, raw: object) -> CounterMetricFamily:
    """A counter of one `label`, a sample per key of the counts `raw` (`_by_key`)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in by_key(raw):
        family.add_metric([key], n)
    return family


_REASONS = {
    "refused_total": "cap",
    "head_timeouts_total": "head_timeout",
    "body_timeouts_total": "body_timeout",
    "hello_timeouts_total": "hello_timeout",
    "frame_timeouts_total": "frame_timeout",
    "overloaded_total": "overloaded",
}


def port_families(rows: Iterable[tuple[str, str, Mapping[str, Any] | None]]) -> Iterator[Metric]:
    """The families of `rows`: (role, shard, ports stats) each; a shard that
    sent no (or a malformed) ``ports`` section adds nothing."""
    labels = ["role", "shard"]
    open_ = GaugeMetricFamily("ctrps_port_open_connections", "Connections open on the port.", labels=[*labels, "port"])
    refused = CounterMetricFamily(
        "ctrps_port_refused",
        "Connections a port closed, or requests it refused, under its limits, by reason.",
        labels=[*labels, "port", "reason"],
    )
    buffered = GaugeMetricFamily(
        "ctrps_port_buffered_frame_bytes",
        "Bytes of RPC frames announced and not yet whole (the buffer budget in use).",
        labels=labels,
    )
    handshakes = CounterMetricFamily(
        "ctrps_tls_handshake_failures", "Refused TLS handshakes, by OpenSSL's reason.", labels=[*labels, "reason"]
    )
    for role, shard, ports in rows:
        if not isinstance(ports, dict):
            continue
        for port in ("http", "rpc"):
            stats = ports.get(port)
            if not isinstance(stats, dict):
                continue
            open_.add_metric([role, shard, port], num(stats.get("open_connections")))
            for key, reason in _REASONS.items():
                if key in stats:
                    refused.add_metric([role, shard, port, reason], num(stats[key]))
            if port == "rpc":
                buffered.add_metric([role, shard], num(stats.get("buffered_frame_bytes")))
        tls = ports.get("tls")
        failures = tls.get("handshake_failures") if isinstance(tls, dict) else None
        for reason, n in (failures if isinstance(failures, dict) else {}).items():
            handshakes.add_metric([role, shard, str(reason)], num(n))
    yield from (open_, refused, buffered, handshakes)


class Families(Collector):
    """Families made once, as a collector: `prometheus_client.generate_latest`
    renders any collector (no registry needed)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def exposition(families: Iterable[Metric]) -> bytes:
    """Prometheus text of `families`."""
    return generate_latest(Families(families))
