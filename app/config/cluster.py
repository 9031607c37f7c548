"""The settings of `ctrps cluster`: every role as its own process on loopback."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .common import bootstrap, check_composition, log_format
from .declared import SettingsError, load, setting
from .exports import (
    check_exports,
    check_exports_dir,
    check_exports_mode,
    export_interval,
    exports_dir,
    exports_mode,
    take_over_exports,
)
from .worker import WorkerSettings, update_mode, window_span

__all__ = ["ClusterSettings", "WORKER_FLAGS"]

WORKER_FLAGS = ("bootstrap", "shards", "topic", "window_seconds", "mode", "log_format")
"""The worker settings the cluster gives its workers as flags; the rest are
their own (defaults, or ``CTRPS_*`` in their environment)."""


@dataclass(frozen=True)
class ClusterSettings:
    """Settings of `ctrps cluster`: every role as its own process on loopback."""

    shards: int = setting(2, env="CTRPS_CLUSTER_SHARDS", flag="--shards", help="shard server processes")
    workers: int = setting(
        2, env="CTRPS_CLUSTER_WORKERS", flag="--workers", help="worker processes, one consumer group"
    )
    port: int = setting(8080, env="CTRPS_CLUSTER_PORT", flag="--port", help="API port; 0 picks a free one")
    produce_rate: float = setting(
        2000.0,
        env="CTRPS_CLUSTER_PRODUCE_RATE",
        flag="--produce-rate",
        help="synthetic events per second from a producer process; 0 (or --no-produce) starts none",
        off="--no-produce",
        off_value=0.0,
        off_help="start no producer",
        exclusive="produce",
    )
    window_seconds: float = window_span(2.0, "CTRPS_CLUSTER_WINDOW_SECONDS", "the workers' window span")
    mode: str = update_mode("CTRPS_CLUSTER_MODE", "the workers' update mode (as ctrps worker --mode)")
    partitions: int = setting(
        4, env="CTRPS_CLUSTER_PARTITIONS", flag="--partitions", help="partitions of the click topic"
    )
    duration_s: float = setting(
        0.0, env="CTRPS_CLUSTER_DURATION", flag="--duration", help="stop after S seconds; 0 = until Ctrl-C"
    )
    bootstrap: str = bootstrap("use this Kafka instead of a broker process", "(a broker process)")
    ready_timeout_s: float = setting(
        60.0, env="CTRPS_CLUSTER_READY_TIMEOUT", flag="--ready-timeout", help="seconds each role may take to be ready"
    )
    grace_s: float = setting(
        10.0, env="CTRPS_CLUSTER_GRACE", flag="--grace", help="seconds between SIGTERM and SIGKILL"
    )
    log_format: str = log_format("log line format (children too)")
    exports_dir: str = exports_dir("where model versions are written; empty turns exports off", "write no exports")
    export_interval_s: float = export_interval()
    exports_mode: int = exports_mode()
    take_over_exports: bool = take_over_exports()
    restart_backoff_s: float = setting(
        1.0,
        env="CTRPS_CLUSTER_RESTART_BACKOFF",
        flag="--restart-backoff",
        help="seconds before restarting a failed child, doubling with each restart in a row",
    )
    restart_backoff_max_s: float = setting(
        30.0,
        env="CTRPS_CLUSTER_RESTART_BACKOFF_MAX",
        flag="--restart-backoff-max",
        help="longest restart delay, seconds",
    )
    max_restarts: int = setting(
        5,
        env="CTRPS_CLUSTER_MAX_RESTARTS",
        flag="--max-restarts",
        help="restarts of one child within --restart-window before the cluster stops (exit 1); 0 = never restart",
    )
    restart_window_s: float = setting(
        300.0, env="CTRPS_CLUSTER_RESTART_WINDOW", flag="--restart-window", help="seconds the restarts are counted over"
    )

    def __post_init__(self) -> None:
        check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        check_exports(self.export_interval_s)
        check_exports_mode(self.exports_mode)
        check_exports_dir(self.exports_dir)
        if not 0 < self.restart_backoff_s <= self.restart_backoff_max_s < float("inf"):
            raise SettingsError("restart backoff must be > 0 and at most the largest backoff")
        if self.max_restarts < 0 or not 0 < self.restart_window_s < float("inf"):
            raise SettingsError("max restarts must be >= 0 and the restart window > 0 seconds")
        if not 1 <= self.shards <= 64 or not 1 <= self.workers <= 64:
            raise SettingsError("shards and workers must be in [1, 64]")
        if not 0 <= self.produce_rate < float("inf"):
            raise SettingsError("produce rate must be a number of events per second >= 0")
        if self.partitions < 1:
            raise SettingsError("partitions must be >= 1")
        if not 0 < self.ready_timeout_s < float("inf") or not 0 < self.grace_s < float("inf"):
            raise SettingsError("ready timeout and grace must be positive numbers of seconds")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ClusterSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        return load(cls, args, env)

    def worker_settings(self, bootstrap: str, shard_urls: list[str], topic: str) -> WorkerSettings:
        """What the cluster gives each of its workers (`WORKER_FLAGS`),
        checked here; each worker reads them back from its flags
        (`app.config.declared.to_argv`) into its `worker_config`."""
        return WorkerSettings(
            bootstrap=bootstrap,
            shards=tuple(shard_urls),
            topic=topic,
            window_seconds=self.window_seconds,
            mode=self.mode,
            log_format=self.log_format,
        )
