"""The HTTP prediction API's settings (`ctrps serve`, and the demo's API)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from ps_core.net.limits import PortLimits

from ..security import SecuritySettings, _secret_from
from .common import (
    FORMATS,
    MODELS,
    check_model_name,
    check_startup_timeout,
    check_urls,
    log_format,
    model,
    model_name,
    numeric,
    startup_timeout,
    urls,
    use_rpc,
)
from .declared import SettingsError, load, setting
from .limits import port_limits_from_env

__all__ = ["ApiSettings"]


@dataclass(frozen=True)
class ApiSettings:
    """Settings of the HTTP prediction API (`ctrps serve`, and the demo's API)."""

    shards: tuple[str, ...] = urls(
        "shard URLs, comma-separated, shard 0 first",
        exclusive="source",
        shown_default="(this or --follow)",
    )
    follow: str = setting(
        "",
        env="CTRPS_FOLLOW",
        flag="--follow",
        help="serve a model's exports as a read-only replica: exports/<model>, the exports root for its <model-name>/, "
        "or s3://bucket/prefix/<model> (AWS_* credentials; s3://bucket/prefix with --follow-all)",
        metavar="DIR",
        exclusive="source",
        shown_default="(this or --shards)",
    )
    follow_interval_s: float = setting(
        1.0, env="CTRPS_FOLLOW_INTERVAL", flag="--follow-interval", help="seconds between looks at DIR", metavar="S"
    )
    follow_all: bool = setting(
        False,
        env="CTRPS_FOLLOW_ALL",
        flag=None,
        off="--follow-all",
        off_value=True,
        help="with --follow an exports root (a directory or s3://bucket/prefix): serve every model under it, "
        "--model-name the default",
    )
    host: str = setting("127.0.0.1", env="CTRPS_API_HOST", flag="--host", help="listen address")
    port: int = setting(8080, env="CTRPS_API_PORT", flag="--port", help="listen port; 0 picks a free one")
    model: str = model("model kind (with --follow, the manifest's)")
    model_name: str = model_name("model name (with --follow, the manifest's)")
    numeric: str = numeric(
        "numeric feature values fed as sent (raw) or as sign(x) log1p(|x|) (log1p), /D divided by D, as the "
        "workers feed them; the model's declaration on the shards (or in the manifest) wins"
    )
    max_events: int = setting(10_000, env="CTRPS_MAX_EVENTS", flag="--max-events", help="most events per request")
    max_body_bytes: int = setting(
        16 * 1024 * 1024,
        env="CTRPS_MAX_BODY_BYTES",
        flag="--max-body-bytes",
        help="largest request body; larger ones get 413",
    )
    admin_token: str = field(default="", repr=False)
    """Bearer token required by mutating and admin routes; empty leaves them
    open (``CTRPS_ADMIN_TOKEN`` or ``CTRPS_ADMIN_TOKEN_FILE`` only: a flag
    would show in ``ps``)."""
    insecure: bool = False
    """Listen on a non-loopback host without an admin token (``--insecure``,
    ``CTRPS_INSECURE``); otherwise the API refuses to start there."""
    shard_deadline_s: float = setting(
        2.0, env="CTRPS_SHARD_DEADLINE", flag="--shard-deadline", help="seconds a shard call is retried before 503"
    )
    use_rpc: bool = use_rpc()
    startup_timeout_s: float = startup_timeout("each shard (with --follow: for DIR to exist)")
    log_format: str = log_format()
    history_interval_s: float = setting(
        2.0, env="CTRPS_HISTORY_INTERVAL", flag=None, help="seconds between the dashboard's samples of the cluster"
    )
    history_points: int = setting(
        1800, env="CTRPS_HISTORY_POINTS", flag=None, help="how many samples the dashboard keeps, the newest"
    )
    limits: PortLimits = PortLimits()
    """Limits of the API's port (``CTRPS_API_MAX_CONNECTIONS``, ``CTRPS_API_HEADER_TIMEOUT``,
    ``CTRPS_API_BODY_TIMEOUT``, ``CTRPS_API_IDLE_TIMEOUT``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} out of range")
        if not 0 < self.history_interval_s < float("inf") or self.history_points < 1:
            raise SettingsError("history interval must be a positive number of seconds and history points >= 1")
        if self.model not in MODELS:
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        check_model_name(self.model_name)
        check_urls(self.shards)
        if self.max_events < 1 or self.max_body_bytes < 1024:
            raise SettingsError("max events must be >= 1 and max body bytes >= 1024")
        if not 0 < self.shard_deadline_s < float("inf"):
            raise SettingsError("shard deadline must be a positive number of seconds")
        check_startup_timeout(self.startup_timeout_s)
        if self.log_format not in FORMATS:
            raise SettingsError("log format is text or json")
        if self.shards and self.follow:
            raise SettingsError("shards and follow are exclusive: serve shard servers or an export directory")
        if self.follow_all and not self.follow:
            raise SettingsError("--follow-all needs --follow: the exports root whose models to serve")
        if "://" in self.follow:
            check_follow_url(self.follow, self.follow_all)
        if not 0 < self.follow_interval_s < float("inf"):
            raise SettingsError("follow interval must be a positive number of seconds")

    def follows_store(self) -> bool:
        """Whether `follow` is a store's URL (``s3://bucket/prefix/<model>``, or
        with `follow_all` its root), not a directory."""
        return "://" in self.follow

    def check_exposed(self) -> None:
        """Refuse (`SettingsError`, exit 2) to listen on a non-loopback host
        with the admin routes open, unless `insecure`."""
        SecuritySettings(insecure=self.insecure).check_exposed(
            "the API", self.host, has_credentials=bool(self.admin_token), hint="set CTRPS_ADMIN_TOKEN (or _FILE)"
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ApiSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults; shard
        URLs or an export directory to follow are required (a flag for one
        overrides a variable for the other)."""
        flagged = load(cls, args, {}, admin_token="", insecure=False, limits=PortLimits())
        shards, follow = flagged.shards, flagged.follow
        if not shards and not follow:
            from_env = load(cls, None, env, admin_token="", insecure=False, limits=PortLimits())
            shards, follow = from_env.shards, from_env.follow
        if not shards and not follow:
            raise SettingsError(
                "no shards: pass --shards URL,URL,... or --follow exports/<model> (or set CTRPS_SHARDS or CTRPS_FOLLOW)"
            )
        return load(
            cls,
            args,
            env,
            shards=shards,
            follow=follow,
            admin_token=_secret_from(env, "CTRPS_ADMIN_TOKEN"),
            insecure=SecuritySettings.from_args(args, env).insecure,
            limits=port_limits_from_env(env, "CTRPS_API"),
        )


def check_follow_url(url: str, follow_all: bool) -> None:
    """A store's URL to follow names one model (``s3://bucket/prefix/<model>``),
    or with ``--follow-all`` the exports root (``s3://bucket/prefix``);
    `SettingsError` (exit 2) otherwise."""
    from ps_core.checkpoint.exportstore import ExportStoreError, model_at, store_for

    try:
        store_for(url) if follow_all else model_at(url)
    except (ValueError, ExportStoreError) as exc:  # another scheme, no model, or no obstore
        raise SettingsError(str(exc)) from None
