"""Checks and declarations several roles' settings share: one variable and
flag for each, with the role's own help."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from ps_core.checkpoint.manifest import check_model_name as _check_name
from ps_core.model.featurizer import DEFAULT_NUMERIC, numeric_spec

from .declared import SettingsError, setting

__all__ = [
    "FORMATS",
    "MODELS",
    "check_urls",
    "check_model_name",
    "check_startup_timeout",
    "check_composition",
    "log_format",
    "urls",
    "bootstrap",
    "model",
    "model_name",
    "numeric",
    "use_rpc",
    "startup_timeout",
]

FORMATS = ("text", "json")
MODELS = ("lr", "fm")


def check_urls(urls: tuple[str, ...]) -> None:
    """Every shard URL is ``http(s)://host[:port]``: caught here, at start,
    rather than as a client error on the first call."""
    for url in urls:
        try:
            parts = urlsplit(url)
            _ = parts.port  # raises ValueError on a port that is not a number in range
        except ValueError:
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingsError(f"shard URL {url!r} is not http://host:port")


def check_model_name(name: str) -> None:
    """A model name is one path component (its directory under the exports)."""
    try:
        _check_name(name)
    except ValueError as exc:
        raise SettingsError(f"model name: {exc}") from None


def check_startup_timeout(seconds: float) -> None:
    """A start-up timeout is a positive, finite number of seconds."""
    if not 0 < seconds < float("inf"):
        raise SettingsError("startup timeout must be a positive number of seconds")


def check_composition(duration_s: float, port: int, window_seconds: float, log_format: str) -> None:
    """Checks shared by `DemoSettings` and `ClusterSettings`."""
    if not 0 <= duration_s < float("inf"):
        raise SettingsError("duration must be a finite number of seconds >= 0 (0: until Ctrl-C)")
    if not 0 <= port <= 65535:
        raise SettingsError(f"port {port} out of range")
    if not 0 < window_seconds < float("inf"):
        raise SettingsError("window seconds must be a positive number")
    if log_format not in FORMATS:
        raise SettingsError("log format is text or json")


def log_format(help: str = "log line format") -> Any:
    """``--log-format`` / ``CTRPS_LOG_FORMAT``."""
    return setting("text", env="CTRPS_LOG_FORMAT", flag="--log-format", help=help, choices=FORMATS)


def urls(help: str, **how: Any) -> Any:
    """``--shards`` / ``CTRPS_SHARDS``: shard URLs, shard 0 first."""
    return setting((), env="CTRPS_SHARDS", flag="--shards", help=help, **how)


def bootstrap(help: str, shown_default: str) -> Any:
    """``--bootstrap`` / ``CTRPS_KAFKA_BOOTSTRAP``."""
    return setting("", env="CTRPS_KAFKA_BOOTSTRAP", flag="--bootstrap", help=help, shown_default=shown_default)


def model(help: str) -> Any:
    """``--model`` / ``CTRPS_MODEL``: the model kind."""
    return setting("lr", env="CTRPS_MODEL", flag="--model", help=help, choices=MODELS)


def model_name(help: str) -> Any:
    """``--model-name`` / ``CTRPS_MODEL_NAME``."""
    return setting("ctr", env="CTRPS_MODEL_NAME", flag="--model-name", help=help)


def numeric(help: str) -> Any:
    """``--numeric`` / ``CTRPS_NUMERIC``: how numeric feature values are fed."""
    return setting(
        DEFAULT_NUMERIC, env="CTRPS_NUMERIC", flag="--numeric", help=help, item=numeric_spec, metavar="raw|log1p[/D]"
    )


def use_rpc() -> Any:
    """``--no-rpc`` / ``CTRPS_USE_RPC`` of the shards' clients."""
    return setting(
        True, env="CTRPS_USE_RPC", flag=None, off="--no-rpc", help="reach the shards over HTTP only, not their TCP RPC"
    )


def startup_timeout(what: str) -> Any:
    """``--startup-timeout`` / ``CTRPS_STARTUP_TIMEOUT_S``."""
    return setting(
        30.0,
        env="CTRPS_STARTUP_TIMEOUT_S",
        flag="--startup-timeout",
        help=f"seconds to wait at start for {what} to answer a first time (one line every 5 s says which "
        "address); past it, exit 1: an address that never answered is wrong. Once answered, outages are "
        "waited out as usual",
        metavar="SECONDS",
    )
