"""Prometheus families of the ports' limits and TLS: what each port holds and
what it refused.

The API exposes its own port's counters (`PortCollector`) and relays each
shard's (the ``ports`` section of ``GET /v1/stats``: its HTTP port, its RPC,
its TLS handshakes), so one scrape shows every port of the cluster:

- ``ctrps_port_open_connections{role, shard, port}``: connections open now;
- ``ctrps_port_refused_total{role, shard, port, reason}``: connections closed
  or requests refused under the port's limits (``cap``, ``head_timeout``,
  ``body_timeout``, ``hello_timeout``, ``frame_timeout``, ``overloaded``);
- ``ctrps_port_buffered_frame_bytes{role, shard}``: bytes of RPC frames
  announced and not yet whole (the buffer budget in use);
- ``ctrps_tls_handshake_failures_total{role, shard, reason}``: refused TLS
  handshakes by OpenSSL's reason.

``role`` is ``api`` or ``shard``; ``shard`` is the shard's number (empty for
the API).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["PortCollector", "port_families"]

PortStats = dict[str, Any]
"""``{"http": PortGuard.stats(), "rpc": RpcServer.stats(), "tls": HandshakeFailures.stats()}``."""

_REASONS = {
    "refused_total": "cap",
    "head_timeouts_total": "head_timeout",
    "body_timeouts_total": "body_timeout",
    "hello_timeouts_total": "hello_timeout",
    "frame_timeouts_total": "frame_timeout",
    "overloaded_total": "overloaded",
}


def _num(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def port_families(rows: Iterable[tuple[str, str, PortStats | None]]) -> Iterator[Metric]:
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
            open_.add_metric([role, shard, port], _num(stats.get("open_connections")))
            for key, reason in _REASONS.items():
                if key in stats:
                    refused.add_metric([role, shard, port, reason], _num(stats[key]))
            if port == "rpc":
                buffered.add_metric([role, shard], _num(stats.get("buffered_frame_bytes")))
        tls = ports.get("tls")
        failures = tls.get("handshake_failures") if isinstance(tls, dict) else None
        for reason, n in (failures if isinstance(failures, dict) else {}).items():
            handshakes.add_metric([role, shard, str(reason)], _num(n))
    yield from (open_, refused, buffered, handshakes)


class PortCollector(Collector):
    """The API's own port, read at each scrape from `stats`."""

    def __init__(self, stats: Callable[[], PortStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        yield from port_families([("api", "", self._stats())])
