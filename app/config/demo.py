"""The one-command demo's settings (`ctrps demo`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..security import SecuritySettings, _secret_from
from .broker import broker_max_rss_mb
from .common import bootstrap, check_composition, log_format
from .declared import SettingsError, load, setting
from .exports import check_exports, check_exports_dir, check_exports_mode, export_interval, exports_dir, exports_mode
from .worker import window_span

__all__ = ["DemoSettings"]


@dataclass(frozen=True)
class DemoSettings:
    """Settings of the one-command demo (`ctrps demo`): broker, producer,
    shards, a worker and the API in one process."""

    duration_s: float = setting(
        0.0, env="CTRPS_DEMO_DURATION", flag="--duration", help="stop after S seconds once ready; 0 = until Ctrl-C"
    )
    host: str = setting("127.0.0.1", env="CTRPS_DEMO_HOST", flag="--host", help="API listen address")
    port: int = setting(8080, env="CTRPS_DEMO_PORT", flag="--port", help="API port; 0 picks a free one")
    shards: int = setting(2, env="CTRPS_DEMO_SHARDS", flag="--shards", help="in-process shards")
    rate: float = setting(5000.0, env="CTRPS_DEMO_RATE", flag="--rate", help="synthetic events per second")
    window_seconds: float = window_span(1.0, "CTRPS_DEMO_WINDOW_SECONDS", "the worker's window span, seconds")
    bootstrap: str = bootstrap("use this Kafka instead of the embedded broker", "(embedded broker)")
    seed: int = setting(
        0, env="CTRPS_DEMO_SEED", flag="--seed", help="seed of the synthetic stream and its hidden model"
    )
    broker_max_rss_mb: int = broker_max_rss_mb("--broker-max-rss-mb")
    log_format: str = log_format()
    exports_dir: str = exports_dir("where model versions are written; empty turns exports off", "write no exports")
    export_interval_s: float = export_interval()
    exports_mode: int = exports_mode()
    admin_token: str = field(default="", repr=False)
    """The API's admin token (``CTRPS_ADMIN_TOKEN`` or ``CTRPS_ADMIN_TOKEN_FILE``); empty: the
    demo makes one for the run, unless `insecure`."""
    insecure: bool = False
    """Let the API listen on a non-loopback host without an admin token, and leave its admin
    routes open (``--insecure``, ``CTRPS_INSECURE``)."""

    def __post_init__(self) -> None:
        check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        check_exports(self.export_interval_s)
        check_exports_mode(self.exports_mode)
        check_exports_dir(self.exports_dir)
        if not 1 <= self.shards <= 64:
            raise SettingsError(f"shards must be in [1, 64], not {self.shards}")
        if not 0 < self.rate < float("inf"):
            raise SettingsError("rate must be a positive number of events per second")
        if self.seed < 0:
            raise SettingsError("seed must be >= 0")
        if self.broker_max_rss_mb < 0:
            raise SettingsError("the broker's memory limit must be >= 0 MB (0: none)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> DemoSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        return load(
            cls,
            args,
            env,
            admin_token=_secret_from(env, "CTRPS_ADMIN_TOKEN"),
            insecure=SecuritySettings.from_args(args, env).insecure,
        )
