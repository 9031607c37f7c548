"""The broker's settings (`ctrps broker`, and the demo's embedded broker's
memory limit)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .declared import SettingsError, load, setting

__all__ = ["BrokerSettings", "broker_max_rss_mb"]


def broker_max_rss_mb(flag: str) -> Any:
    """``--max-rss-mb`` (broker) or ``--broker-max-rss-mb`` (demo) / ``CTRPS_BROKER_MAX_RSS_MB``."""
    return setting(
        2048,
        env="CTRPS_BROKER_MAX_RSS_MB",
        flag=flag,
        help="resident memory of the embedded broker past which a warning line (once a minute) and "
        "ctrps_broker_over_limit say so; it keeps every record; 0 = no limit",
        metavar="MB",
    )


@dataclass(frozen=True)
class BrokerSettings:
    """Settings of `ctrps broker` besides its port and topics: its memory
    limit, and where it serves its metrics."""

    max_rss_mb: int = broker_max_rss_mb("--max-rss-mb")
    metrics_port: int = setting(
        0,
        env="CTRPS_BROKER_METRICS_PORT",
        flag="--metrics-port",
        help="serve GET /metrics (the broker's resident memory) on 127.0.0.1:PORT; 0 = not served",
        metavar="PORT",
    )

    host: str = setting(
        "127.0.0.1",
        env="CTRPS_BROKER_HOST",
        flag="--host",
        help="address to listen on (0.0.0.0: every interface, as in a container)",
        metavar="HOST",
    )
    advertised_host: str = setting(
        "",
        env="CTRPS_BROKER_ADVERTISED_HOST",
        flag="--advertised-host",
        help="host name the broker tells clients to connect to (a container's Service name)",
        shown_default="<host>",
        metavar="HOST",
    )

    port: int = 0
    """The broker's listen port (its own ``--port`` flag; 0: a free one)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} out of range")
        if self.host in ("0.0.0.0", "::") and not self.advertised_host:
            raise SettingsError(f"--host {self.host} needs --advertised-host: the name clients can reach it by")
        if self.max_rss_mb < 0:
            raise SettingsError("the broker's memory limit must be >= 0 MB (0: none)")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"metrics port {self.metrics_port} is not in [0, 65535]")

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, env: Mapping[str, str] = os.environ) -> BrokerSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        return load(cls, args, env, port=getattr(args, "port", None) or 0)
