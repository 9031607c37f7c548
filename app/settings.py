"""Settings: one frozen object per role, from CLI flags over ``CTRPS_*``
environment variables over defaults, handed down explicitly.

Nothing below `app` reads the environment; roles get everything from here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from ps_core.checkpoint.manifest import check_model_name
from ps_core.errors import TableConfigError
from ps_core.net.limits import PortLimits, RpcLimits
from ps_core.store.table import TableConfig

from .logs import LEVELS
from .security import SecuritySettings, _secret_from

__all__ = [
    "ShardSettings",
    "WorkerSettings",
    "DemoSettings",
    "ClusterSettings",
    "ApiSettings",
    "parse_table_spec",
    "SettingsError",
    "LogSettings",
]


class SettingsError(ValueError):
    """A flag or environment variable has an unusable value: a usage error,
    reported as one line with exit code 2 (see `app.failures`)."""

    exit_code = 2


def _check_urls(urls: tuple[str, ...]) -> None:
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


def _check_model_name(name: str) -> None:
    """A model name is one path component (its directory under the exports)."""
    try:
        check_model_name(name)
    except ValueError as exc:
        raise SettingsError(f"model name: {exc}") from None


def parse_table_spec(spec: str) -> TableConfig:
    """``NAME[,dim=D][,optimizer=ftrl|adagrad|sgd][,init_scale=S][,seed=N][,HYPER=V...]``.

    Any other ``key=value`` is a hyperparameter of the optimizer, e.g.
    ``lr,optimizer=ftrl,alpha=0.05,l1=1`` or ``fm_v,dim=8,optimizer=adagrad,lr=0.05,init_scale=0.01``.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise SettingsError(f"table spec {spec!r} must start with the table name")
    name, fields = parts[0], parts[1:]
    optimizer: dict[str, Any] = {"name": "ftrl"}
    kwargs: dict[str, Any] = {}
    for f in fields:
        key, sep, value = f.partition("=")
        if not sep:
            raise SettingsError(f"table spec {spec!r}: {f!r} is not key=value")
        try:
            if key == "dim":
                kwargs["dim"] = int(value)
            elif key == "seed":
                kwargs["seed"] = int(value)
            elif key == "init_scale":
                kwargs["init_scale"] = float(value)
            elif key == "optimizer":
                optimizer["name"] = value
            else:
                optimizer[key] = float(value)
        except ValueError:
            raise SettingsError(f"table spec {spec!r}: {key}={value!r} is not a number") from None
    try:
        return TableConfig(name=name, optimizer=optimizer, **kwargs)
    except TableConfigError as exc:
        raise SettingsError(f"table spec {spec!r}: {exc.detail}") from None


def _env_int(env: Mapping[str, str], key: str, default: int) -> int:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r} is not an integer") from None


def _env_float(env: Mapping[str, str], key: str, default: float) -> float:
    raw = env.get(key)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{key}={raw!r} is not a number") from None


def port_limits_from_env(env: Mapping[str, str], prefix: str) -> PortLimits:
    """An HTTP port's limits from ``{prefix}_MAX_CONNECTIONS``, ``_HEADER_TIMEOUT``,
    ``_BODY_TIMEOUT`` and ``_IDLE_TIMEOUT`` (seconds), over the defaults."""
    d = PortLimits()
    try:
        return PortLimits(
            max_connections=_env_int(env, f"{prefix}_MAX_CONNECTIONS", d.max_connections),
            header_timeout_s=_env_float(env, f"{prefix}_HEADER_TIMEOUT", d.header_timeout_s),
            body_timeout_s=_env_float(env, f"{prefix}_BODY_TIMEOUT", d.body_timeout_s),
            idle_timeout_s=_env_float(env, f"{prefix}_IDLE_TIMEOUT", d.idle_timeout_s),
        )
    except ValueError as exc:
        raise SettingsError(f"{prefix}_*: {exc}") from None


def rpc_limits_from_env(env: Mapping[str, str]) -> RpcLimits:
    """The RPC port's limits from ``CTRPS_RPC_MAX_CONNECTIONS``, ``CTRPS_RPC_HELLO_TIMEOUT``,
    ``CTRPS_RPC_FRAME_TIMEOUT`` (seconds) and ``CTRPS_RPC_BUFFER_BUDGET_MB``."""
    d = RpcLimits()
    try:
        return RpcLimits(
            max_connections=_env_int(env, "CTRPS_RPC_MAX_CONNECTIONS", d.max_connections),
            hello_timeout_s=_env_float(env, "CTRPS_RPC_HELLO_TIMEOUT", d.hello_timeout_s),
            frame_timeout_s=_env_float(env, "CTRPS_RPC_FRAME_TIMEOUT", d.frame_timeout_s),
            buffer_budget_bytes=_env_int(env, "CTRPS_RPC_BUFFER_BUDGET_MB", d.buffer_budget_bytes >> 20) << 20,
        )
    except ValueError as exc:
        raise SettingsError(f"CTRPS_RPC_*: {exc}") from None


@dataclass(frozen=True)
class ShardSettings:
    """Settings of one shard server (`ctrps shard`)."""

    host: str = "127.0.0.1"
    """Address to listen on (``CTRPS_SHARD_HOST``)."""
    port: int = 7100
    """Port to listen on; 0 picks a free one (``CTRPS_SHARD_PORT``)."""
    shard_id: int = 0
    """This shard's number (``CTRPS_SHARD_ID``)."""
    num_shards: int = 1
    """Shards in the cluster (``CTRPS_NUM_SHARDS``)."""
    tables: tuple[TableConfig, ...] = field(default_factory=tuple)
    """Tables declared at start (``CTRPS_TABLES``, specs joined by ``;``); with
    none, the shard accepts declarations from clients."""
    max_body_mb: int = 512
    """Largest request body accepted, MiB (``CTRPS_MAX_BODY_MB``)."""
    stats_interval_s: float = 60.0
    """Seconds between progress log lines; 0 disables (``CTRPS_STATS_INTERVAL``)."""
    log_format: str = "text"
    """``text`` or ``json`` (``CTRPS_LOG_FORMAT``)."""
    shards: tuple[str, ...] = ()
    """Every shard's URL, shard 0 first (``CTRPS_SHARDS``): shard 0 reaches the
    others through them to host the coordinator when there are several."""
    exports_dir: str = "exports"
    """Where versions are written and restored from (``CTRPS_EXPORTS_DIR``);
    empty turns exports, the coordinator and restores off."""
    export_interval_s: float = 60.0
    """Seconds between exports by shard 0; 0 exports only when asked (``CTRPS_EXPORT_INTERVAL``)."""
    base_every: int = 10
    """Every Nth export is a base (``CTRPS_BASE_EVERY``)."""
    keep_bases: int = 2
    """Bases kept by retention, with the deltas that follow them (``CTRPS_KEEP_BASES``)."""
    model_name: str = "ctr"
    """The model's name: its directory under the exports (``CTRPS_MODEL_NAME``)."""
    restore: bool = True
    """Load this shard's slice of the newest export at start (``CTRPS_RESTORE``, 0 or 1)."""
    lease_ttl_s: float = 120.0
    """How long a cut waits for one leased window (``CTRPS_LEASE_TTL``)."""
    rpc: bool = True
    """Serve pulls and pushes on a TCP RPC port besides HTTP (``CTRPS_RPC``, 0 or 1)."""
    rpc_port: int = 0
    """The TCP RPC's port; 0 picks a free one. ``/healthz`` advertises it, and
    clients find it there (``CTRPS_RPC_PORT``)."""
    http_limits: PortLimits = PortLimits()
    """Limits of the HTTP port (``CTRPS_SHARD_MAX_CONNECTIONS``, ``CTRPS_SHARD_HEADER_TIMEOUT``, ...)."""
    rpc_limits: RpcLimits = RpcLimits()
    """Limits of the RPC port (``CTRPS_RPC_MAX_CONNECTIONS``, ``CTRPS_RPC_HELLO_TIMEOUT``, ...)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} out of range")
        if not 0 <= self.rpc_port <= 65535:
            raise SettingsError(f"rpc port {self.rpc_port} out of range")
        if self.shards and len(self.shards) != self.num_shards:
            raise SettingsError(f"{len(self.shards)} shard URLs for {self.num_shards} shards")
        if not 0 <= self.export_interval_s < float("inf") or self.base_every < 1 or self.keep_bases < 1:
            raise SettingsError("export interval must be >= 0 s, base-every and keep-bases >= 1")
        if not 0 < self.lease_ttl_s < float("inf"):
            raise SettingsError("lease ttl must be a positive number of seconds")
        if self.num_shards < 1 or not 0 <= self.shard_id < self.num_shards:
            raise SettingsError(f"shard id {self.shard_id} not in [0, {self.num_shards})")
        if self.log_format not in ("text", "json"):
            raise SettingsError("log format is text or json")
        if self.max_body_mb < 1:
            raise SettingsError("max body must be at least 1 MiB")
        if not self.stats_interval_s >= 0 or self.stats_interval_s == float("inf"):
            raise SettingsError("stats interval must be a finite number of seconds >= 0")
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise SettingsError(f"a table is declared twice: {names}")
        _check_urls(self.shards)
        _check_model_name(self.model_name)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ShardSettings:
        """Defaults overridden by ``CTRPS_*`` variables."""
        d = cls()
        tables = tuple(parse_table_spec(s) for s in env.get("CTRPS_TABLES", "").split(";") if s.strip())
        return cls(
            host=env.get("CTRPS_SHARD_HOST") or d.host,
            port=_env_int(env, "CTRPS_SHARD_PORT", d.port),
            shard_id=_env_int(env, "CTRPS_SHARD_ID", d.shard_id),
            num_shards=_env_int(env, "CTRPS_NUM_SHARDS", d.num_shards),
            tables=tables,
            max_body_mb=_env_int(env, "CTRPS_MAX_BODY_MB", d.max_body_mb),
            stats_interval_s=_env_float(env, "CTRPS_STATS_INTERVAL", d.stats_interval_s),
            log_format=env.get("CTRPS_LOG_FORMAT") or d.log_format,
            shards=_env_list(env, "CTRPS_SHARDS"),
            exports_dir=env.get("CTRPS_EXPORTS_DIR", d.exports_dir),
            export_interval_s=_env_float(env, "CTRPS_EXPORT_INTERVAL", d.export_interval_s),
            base_every=_env_int(env, "CTRPS_BASE_EVERY", d.base_every),
            keep_bases=_env_int(env, "CTRPS_KEEP_BASES", d.keep_bases),
            model_name=env.get("CTRPS_MODEL_NAME") or d.model_name,
            restore=_pick(None, env, "CTRPS_RESTORE", d.restore, _parse_bool),
            lease_ttl_s=_env_float(env, "CTRPS_LEASE_TTL", d.lease_ttl_s),
            rpc=_pick(None, env, "CTRPS_RPC", d.rpc, _parse_bool),
            rpc_port=_env_int(env, "CTRPS_RPC_PORT", d.rpc_port),
            http_limits=port_limits_from_env(env, "CTRPS_SHARD"),
            rpc_limits=rpc_limits_from_env(env),
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> ShardSettings:
        """Flags (where given) over `from_env`."""
        base = cls.from_env(env)
        tables = tuple(parse_table_spec(s) for s in args.table) if args.table else base.tables
        return cls(
            host=args.host if args.host is not None else base.host,
            port=args.port if args.port is not None else base.port,
            shard_id=args.shard_id if args.shard_id is not None else base.shard_id,
            num_shards=args.num_shards if args.num_shards is not None else base.num_shards,
            tables=tables,
            max_body_mb=args.max_body_mb if args.max_body_mb is not None else base.max_body_mb,
            stats_interval_s=(args.stats_interval if args.stats_interval is not None else base.stats_interval_s),
            log_format=args.log_format if args.log_format is not None else base.log_format,
            shards=tuple(u for u in (args.shards or "").split(",") if u) or base.shards,
            exports_dir="" if args.no_exports else _flag(args.exports_dir, base.exports_dir),
            export_interval_s=_flag(args.export_interval, base.export_interval_s),
            base_every=_flag(args.base_every, base.base_every),
            keep_bases=_flag(args.keep_bases, base.keep_bases),
            model_name=_flag(args.model_name, base.model_name),
            restore=False if args.no_restore else base.restore,
            lease_ttl_s=_flag(args.lease_ttl, base.lease_ttl_s),
            rpc=False if args.no_rpc else base.rpc,
            rpc_port=_flag(args.rpc_port, base.rpc_port),
            http_limits=base.http_limits,
            rpc_limits=base.rpc_limits,
        )


def _flag(value: Any, default: Any) -> Any:
    """A flag's value when it was given, else `default`."""
    return default if value is None else value


def _parse_bool(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _env_list(env: Mapping[str, str], key: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in env.get(key, "").split(",") if s.strip())


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of one training worker (`ctrps worker`)."""

    bootstrap: str = ""
    """Kafka bootstrap servers (``CTRPS_KAFKA_BOOTSTRAP``); required."""
    shards: tuple[str, ...] = ()
    """Shard server URLs, shard i at position i (``CTRPS_SHARDS``, comma-separated); required."""
    topic: str = "clicks"
    """Topic of click events (``CTRPS_TOPIC``)."""
    group: str = "ctrps"
    """Consumer group (``CTRPS_GROUP``)."""
    dlq_topic: str = ""
    """Dead-letter topic (``CTRPS_DLQ_TOPIC``); default ``<topic>.dlq``."""
    window_seconds: float = 60.0
    """Window span in event time (``CTRPS_WINDOW_SECONDS``)."""
    window_events: int = 100_000
    """Most events in a window (``CTRPS_WINDOW_EVENTS``)."""
    mini_batch: int = 256
    """Events per pull/push step (``CTRPS_MINI_BATCH``)."""
    model: str = "lr"
    """``lr`` or ``fm`` (``CTRPS_MODEL``)."""
    model_name: str = "ctr"
    """Model name: table prefix and feature-hash namespace (``CTRPS_MODEL_NAME``)."""
    decode_processes: int = 1
    """Processes decoding events (``CTRPS_DECODE_PROCESSES``); 0 decodes in the event loop."""
    session_timeout_ms: int = 10_000
    """Kafka session timeout: how soon a dead worker's partitions move (``CTRPS_SESSION_TIMEOUT_MS``)."""
    log_format: str = "text"
    """``text`` or ``json`` (``CTRPS_LOG_FORMAT``)."""
    use_rpc: bool = True
    """Pull and push over the shards' TCP RPC where they offer it; else HTTP
    only (``CTRPS_USE_RPC``, 0 or 1)."""
    on_stale_offsets: str = "committed"
    """Resume offsets of another stream (Kafka cluster or group), or beyond a
    partition's end or before its start (``CTRPS_ON_STALE_OFFSETS``):
    ``committed`` resumes at the group's commit (first offset where none),
    ``earliest`` at the partition's first offset, ``fail`` exits with code 4.
    The model's weights are kept either way."""
    outage_deadline_s: float = 600.0
    """Seconds one outage (a shard, the coordinator or the broker unreachable)
    is waited out before the worker gives up with exit code 3; 0 waits forever
    (``CTRPS_OUTAGE_DEADLINE_S``)."""

    def __post_init__(self) -> None:
        if self.on_stale_offsets not in ("committed", "earliest", "fail"):
            raise SettingsError(f"on-stale-offsets {self.on_stale_offsets!r} is not committed, earliest or fail")
        if not self.bootstrap:
            raise SettingsError(
                "no Kafka bootstrap: pass --bootstrap or set CTRPS_KAFKA_BOOTSTRAP "
                "(for development, `ctrps broker` starts one)"
            )
        if not self.shards:
            raise SettingsError("no shards: pass --shards URL,URL,... or set CTRPS_SHARDS")
        _check_urls(self.shards)
        _check_model_name(self.model_name)
        if self.model not in ("lr", "fm"):
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        if not self.window_seconds > 0 or self.window_events < 1 or self.mini_batch < 1:
            raise SettingsError("window seconds, window events and mini-batch must be positive")
        if self.decode_processes < 0:
            raise SettingsError("decode processes must be >= 0")
        if self.session_timeout_ms < 1000:
            raise SettingsError("session timeout must be at least 1000 ms")
        if self.log_format not in ("text", "json"):
            raise SettingsError("log format is text or json")
        if not self.outage_deadline_s >= 0:
            raise SettingsError("outage deadline must be >= 0 seconds (0 waits forever)")

    @property
    def dlq(self) -> str:
        """The dead-letter topic in effect."""
        return self.dlq_topic or f"{self.topic}.dlq"

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> WorkerSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        d = cls.__dataclass_fields__

        def pick(flag: Any, key: str, name: str, conv: Any = str) -> Any:
            return _pick(flag, env, key, d[name].default, conv)

        shards = tuple(s for s in (args.shards or "").split(",") if s) or _env_list(env, "CTRPS_SHARDS")
        return cls(
            bootstrap=pick(args.bootstrap, "CTRPS_KAFKA_BOOTSTRAP", "bootstrap"),
            shards=shards,
            topic=pick(args.topic, "CTRPS_TOPIC", "topic"),
            group=pick(args.group, "CTRPS_GROUP", "group"),
            dlq_topic=pick(args.dlq_topic, "CTRPS_DLQ_TOPIC", "dlq_topic"),
            window_seconds=pick(args.window_seconds, "CTRPS_WINDOW_SECONDS", "window_seconds", float),
            window_events=pick(args.window_events, "CTRPS_WINDOW_EVENTS", "window_events", int),
            mini_batch=pick(args.mini_batch, "CTRPS_MINI_BATCH", "mini_batch", int),
            model=pick(args.model, "CTRPS_MODEL", "model"),
            model_name=pick(args.model_name, "CTRPS_MODEL_NAME", "model_name"),
            decode_processes=pick(args.decode_processes, "CTRPS_DECODE_PROCESSES", "decode_processes", int),
            session_timeout_ms=pick(args.session_timeout_ms, "CTRPS_SESSION_TIMEOUT_MS", "session_timeout_ms", int),
            log_format=pick(args.log_format, "CTRPS_LOG_FORMAT", "log_format"),
            use_rpc=False if args.no_rpc else pick(None, "CTRPS_USE_RPC", "use_rpc", _parse_bool),
            on_stale_offsets=pick(args.on_stale_offsets, "CTRPS_ON_STALE_OFFSETS", "on_stale_offsets"),
            outage_deadline_s=pick(args.outage_deadline, "CTRPS_OUTAGE_DEADLINE_S", "outage_deadline_s", float),
        )


def _pick(flag: Any, env: Mapping[str, str], key: str, default: Any, conv: Any = str) -> Any:
    """A flag when given, else the variable `key` when set and not empty, else `default`."""
    if flag is not None:
        return flag
    raw = env.get(key)
    if raw:
        try:
            return conv(raw)
        except ValueError:
            raise SettingsError(f"{key}={raw!r} is not a valid {conv.__name__}") from None
    return default


def _export_args(
    args: argparse.Namespace, env: Mapping[str, str], exports_dir: str, interval_s: float
) -> dict[str, Any]:
    """``exports_dir`` and ``export_interval_s`` of a composition (demo, cluster)."""
    return {
        "exports_dir": "" if args.no_exports else _pick(args.exports_dir, env, "CTRPS_EXPORTS_DIR", exports_dir),
        "export_interval_s": _pick(args.export_interval, env, "CTRPS_EXPORT_INTERVAL", interval_s, float),
    }


def _check_exports(interval_s: float) -> None:
    if not 0 <= interval_s < float("inf"):
        raise SettingsError("export interval must be a finite number of seconds >= 0")


def _check_composition(duration_s: float, port: int, window_seconds: float, log_format: str) -> None:
    """Checks shared by `DemoSettings` and `ClusterSettings`."""
    if not 0 <= duration_s < float("inf"):
        raise SettingsError("duration must be a finite number of seconds >= 0 (0: until Ctrl-C)")
    if not 0 <= port <= 65535:
        raise SettingsError(f"port {port} out of range")
    if not 0 < window_seconds < float("inf"):
        raise SettingsError("window seconds must be a positive number")
    if log_format not in ("text", "json"):
        raise SettingsError("log format is text or json")


@dataclass(frozen=True)
class DemoSettings:
    """Settings of the one-command demo (`ctrps demo`): broker, producer,
    shards, a worker and the API in one process."""

    duration_s: float = 0.0
    """Stop after this many seconds; 0 runs until Ctrl-C/SIGTERM (``CTRPS_DEMO_DURATION``)."""
    host: str = "127.0.0.1"
    """Address of the HTTP API (``CTRPS_DEMO_HOST``)."""
    port: int = 8080
    """Port of the HTTP API; 0 picks a free one (``CTRPS_DEMO_PORT``)."""
    shards: int = 2
    """In-process shards (``CTRPS_DEMO_SHARDS``)."""
    rate: float = 5000.0
    """Synthetic events per second (``CTRPS_DEMO_RATE``)."""
    window_seconds: float = 1.0
    """The worker's window span (``CTRPS_DEMO_WINDOW_SECONDS``)."""
    bootstrap: str = ""
    """Kafka bootstrap servers (``CTRPS_KAFKA_BOOTSTRAP``); empty starts the embedded broker."""
    seed: int = 0
    """Seed of the synthetic stream and its hidden model (``CTRPS_DEMO_SEED``)."""
    log_format: str = "text"
    """``text`` or ``json`` (``CTRPS_LOG_FORMAT``)."""
    exports_dir: str = "exports"
    """Where versions of the model are written (``CTRPS_EXPORTS_DIR``); empty turns exports off."""
    export_interval_s: float = 60.0
    """Seconds between exports; 0 exports only when asked (``CTRPS_EXPORT_INTERVAL``)."""
    admin_token: str = field(default="", repr=False)
    """The API's admin token (``CTRPS_ADMIN_TOKEN`` or ``CTRPS_ADMIN_TOKEN_FILE``); empty leaves admin routes open."""
    insecure: bool = False
    """Let the API listen on a non-loopback host without an admin token (``--insecure``, ``CTRPS_INSECURE``)."""

    def __post_init__(self) -> None:
        _check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        _check_exports(self.export_interval_s)
        if not 1 <= self.shards <= 64:
            raise SettingsError(f"shards must be in [1, 64], not {self.shards}")
        if not 0 < self.rate < float("inf"):
            raise SettingsError("rate must be a positive number of events per second")
        if self.seed < 0:
            raise SettingsError("seed must be >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> DemoSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        d = cls()
        return cls(
            duration_s=_pick(args.duration, env, "CTRPS_DEMO_DURATION", d.duration_s, float),
            host=_pick(args.host, env, "CTRPS_DEMO_HOST", d.host),
            port=_pick(args.port, env, "CTRPS_DEMO_PORT", d.port, int),
            shards=_pick(args.shards, env, "CTRPS_DEMO_SHARDS", d.shards, int),
            rate=_pick(args.rate, env, "CTRPS_DEMO_RATE", d.rate, float),
            window_seconds=_pick(args.window_seconds, env, "CTRPS_DEMO_WINDOW_SECONDS", d.window_seconds, float),
            bootstrap=_pick(args.bootstrap, env, "CTRPS_KAFKA_BOOTSTRAP", d.bootstrap),
            seed=_pick(args.seed, env, "CTRPS_DEMO_SEED", d.seed, int),
            log_format=_pick(args.log_format, env, "CTRPS_LOG_FORMAT", d.log_format),
            **_export_args(args, env, d.exports_dir, d.export_interval_s),
            admin_token=_secret_from(env, "CTRPS_ADMIN_TOKEN"),
            insecure=SecuritySettings.from_args(args, env).insecure,
        )


@dataclass(frozen=True)
class ClusterSettings:
    """Settings of `ctrps cluster`: every role as its own process on loopback."""

    shards: int = 2
    """Shard server processes (``CTRPS_CLUSTER_SHARDS``)."""
    workers: int = 2
    """Worker processes, one consumer group (``CTRPS_CLUSTER_WORKERS``)."""
    port: int = 8080
    """Port of the HTTP API; 0 picks a free one (``CTRPS_CLUSTER_PORT``).
    The other roles get free ports."""
    produce_rate: float = 2000.0
    """Synthetic events per second from a producer process; 0 starts none
    (``--no-produce``; ``CTRPS_CLUSTER_PRODUCE_RATE``)."""
    window_seconds: float = 2.0
    """The workers' window span (``CTRPS_CLUSTER_WINDOW_SECONDS``)."""
    partitions: int = 4
    """Partitions of the click topic, created at start (``CTRPS_CLUSTER_PARTITIONS``)."""
    duration_s: float = 0.0
    """Stop after this many seconds; 0 runs until Ctrl-C/SIGTERM (``CTRPS_CLUSTER_DURATION``)."""
    bootstrap: str = ""
    """Kafka bootstrap servers (``CTRPS_KAFKA_BOOTSTRAP``); empty starts a broker process."""
    ready_timeout_s: float = 60.0
    """How long each role may take to become ready (``CTRPS_CLUSTER_READY_TIMEOUT``)."""
    grace_s: float = 10.0
    """How long a child may take to stop after SIGTERM before SIGKILL (``CTRPS_CLUSTER_GRACE``)."""
    log_format: str = "text"
    """``text`` or ``json``, for the cluster and every child (``CTRPS_LOG_FORMAT``)."""
    exports_dir: str = "exports"
    """Where versions of the model are written (``CTRPS_EXPORTS_DIR``); empty turns exports off."""
    export_interval_s: float = 60.0
    """Seconds between exports; 0 exports only when asked (``CTRPS_EXPORT_INTERVAL``)."""
    restart_backoff_s: float = 1.0
    """Delay before restarting a child that exited on its own, doubling with
    each restart in a row (``CTRPS_CLUSTER_RESTART_BACKOFF``)."""
    restart_backoff_max_s: float = 30.0
    """The longest restart delay (``CTRPS_CLUSTER_RESTART_BACKOFF_MAX``)."""
    max_restarts: int = 5
    """Restarts of one child allowed within `restart_window_s`; one more
    stops the cluster, exit 1. 0: any child exiting stops the cluster
    (``CTRPS_CLUSTER_MAX_RESTARTS``)."""
    restart_window_s: float = 300.0
    """The window of `max_restarts`, seconds (``CTRPS_CLUSTER_RESTART_WINDOW``)."""

    def __post_init__(self) -> None:
        _check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        _check_exports(self.export_interval_s)
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
        d = cls()
        rate = 0.0 if args.no_produce else args.produce_rate
        return cls(
            shards=_pick(args.shards, env, "CTRPS_CLUSTER_SHARDS", d.shards, int),
            workers=_pick(args.workers, env, "CTRPS_CLUSTER_WORKERS", d.workers, int),
            port=_pick(args.port, env, "CTRPS_CLUSTER_PORT", d.port, int),
            produce_rate=_pick(rate, env, "CTRPS_CLUSTER_PRODUCE_RATE", d.produce_rate, float),
            window_seconds=_pick(args.window_seconds, env, "CTRPS_CLUSTER_WINDOW_SECONDS", d.window_seconds, float),
            partitions=_pick(args.partitions, env, "CTRPS_CLUSTER_PARTITIONS", d.partitions, int),
            duration_s=_pick(args.duration, env, "CTRPS_CLUSTER_DURATION", d.duration_s, float),
            bootstrap=_pick(args.bootstrap, env, "CTRPS_KAFKA_BOOTSTRAP", d.bootstrap),
            ready_timeout_s=_pick(args.ready_timeout, env, "CTRPS_CLUSTER_READY_TIMEOUT", d.ready_timeout_s, float),
            grace_s=_pick(args.grace, env, "CTRPS_CLUSTER_GRACE", d.grace_s, float),
            log_format=_pick(args.log_format, env, "CTRPS_LOG_FORMAT", d.log_format),
            **_export_args(args, env, d.exports_dir, d.export_interval_s),
            restart_backoff_s=_pick(
                args.restart_backoff, env, "CTRPS_CLUSTER_RESTART_BACKOFF", d.restart_backoff_s, float
            ),
            restart_backoff_max_s=_pick(
                args.restart_backoff_max,
                env,
                "CTRPS_CLUSTER_RESTART_BACKOFF_MAX",
                d.restart_backoff_max_s,
                float,
            ),  # fmt: skip
            max_restarts=_pick(args.max_restarts, env, "CTRPS_CLUSTER_MAX_RESTARTS", d.max_restarts, int),
            restart_window_s=_pick(args.restart_window, env, "CTRPS_CLUSTER_RESTART_WINDOW", d.restart_window_s, float),
        )


@dataclass(frozen=True)
class ApiSettings:
    """Settings of the HTTP prediction API (`ctrps serve`, and the demo's API)."""

    shards: tuple[str, ...] = ()
    """Shard server URLs, shard i at position i (``CTRPS_SHARDS``); `ctrps serve`
    requires them or `follow`, an API over in-process shards (the demo) has none."""
    follow: str = ""
    """A model's export directory, ``exports/<model>``, to serve as a replica
    instead of shard servers (``CTRPS_FOLLOW``; `ctrps serve --follow`)."""
    follow_interval_s: float = 1.0
    """Seconds between looks at the followed directory (``CTRPS_FOLLOW_INTERVAL``)."""
    host: str = "127.0.0.1"
    """Address to listen on (``CTRPS_API_HOST``)."""
    port: int = 8080
    """Port to listen on; 0 picks a free one (``CTRPS_API_PORT``)."""
    model: str = "lr"
    """``lr`` or ``fm``: the model the workers train (``CTRPS_MODEL``)."""
    model_name: str = "ctr"
    """Model name: table prefix and feature-hash namespace (``CTRPS_MODEL_NAME``)."""
    max_events: int = 10_000
    """Most events in one request (``CTRPS_MAX_EVENTS``)."""
    max_body_bytes: int = 16 * 1024 * 1024
    """Largest request body; larger ones get 413 (``CTRPS_MAX_BODY_BYTES``)."""
    admin_token: str = field(default="", repr=False)
    """Bearer token required by mutating and admin routes; empty leaves them
    open (``CTRPS_ADMIN_TOKEN`` or ``CTRPS_ADMIN_TOKEN_FILE`` only: a flag
    would show in ``ps``)."""
    insecure: bool = False
    """Listen on a non-loopback host without an admin token (``--insecure``,
    ``CTRPS_INSECURE``); otherwise the API refuses to start there."""
    shard_deadline_s: float = 2.0
    """How long a shard call is retried before 503 (``CTRPS_SHARD_DEADLINE``)."""
    use_rpc: bool = True
    """Pull over the shards' TCP RPC where they offer it; else HTTP only (``CTRPS_USE_RPC``, 0 or 1)."""
    log_format: str = "text"
    """``text`` or ``json`` (``CTRPS_LOG_FORMAT``)."""
    history_interval_s: float = 2.0
    """Seconds between the dashboard's samples of the cluster (``CTRPS_HISTORY_INTERVAL``)."""
    history_points: int = 1800
    """How many samples the dashboard keeps, the newest (``CTRPS_HISTORY_POINTS``)."""
    limits: PortLimits = PortLimits()
    """Limits of the API's port (``CTRPS_API_MAX_CONNECTIONS``, ``CTRPS_API_HEADER_TIMEOUT``,
    ``CTRPS_API_BODY_TIMEOUT``, ``CTRPS_API_IDLE_TIMEOUT``)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} out of range")
        if not 0 < self.history_interval_s < float("inf") or self.history_points < 1:
            raise SettingsError("history interval must be a positive number of seconds and history points >= 1")
        if self.model not in ("lr", "fm"):
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        _check_model_name(self.model_name)
        _check_urls(self.shards)
        if self.max_events < 1 or self.max_body_bytes < 1024:
            raise SettingsError("max events must be >= 1 and max body bytes >= 1024")
        if not 0 < self.shard_deadline_s < float("inf"):
            raise SettingsError("shard deadline must be a positive number of seconds")
        if self.log_format not in ("text", "json"):
            raise SettingsError("log format is text or json")
        if self.shards and self.follow:
            raise SettingsError("shards and follow are exclusive: serve shard servers or an export directory")
        if not 0 < self.follow_interval_s < float("inf"):
            raise SettingsError("follow interval must be a positive number of seconds")

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
        d = cls()
        shards = tuple(s for s in (args.shards or "").split(",") if s)
        follow = args.follow or ""
        if not shards and not follow:
            shards, follow = _env_list(env, "CTRPS_SHARDS"), env.get("CTRPS_FOLLOW", "")
        if not shards and not follow:
            raise SettingsError(
                "no shards: pass --shards URL,URL,... or --follow exports/<model> (or set CTRPS_SHARDS or CTRPS_FOLLOW)"
            )
        return cls(
            shards=shards,
            follow=follow,
            follow_interval_s=_pick(args.follow_interval, env, "CTRPS_FOLLOW_INTERVAL", d.follow_interval_s, float),
            host=_pick(args.host, env, "CTRPS_API_HOST", d.host),
            port=_pick(args.port, env, "CTRPS_API_PORT", d.port, int),
            model=_pick(args.model, env, "CTRPS_MODEL", d.model),
            model_name=_pick(args.model_name, env, "CTRPS_MODEL_NAME", d.model_name),
            max_events=_pick(args.max_events, env, "CTRPS_MAX_EVENTS", d.max_events, int),
            max_body_bytes=_pick(args.max_body_bytes, env, "CTRPS_MAX_BODY_BYTES", d.max_body_bytes, int),
            admin_token=_secret_from(env, "CTRPS_ADMIN_TOKEN"),
            insecure=SecuritySettings.from_args(args, env).insecure,
            shard_deadline_s=_pick(args.shard_deadline, env, "CTRPS_SHARD_DEADLINE", d.shard_deadline_s, float),
            use_rpc=False if args.no_rpc else _pick(None, env, "CTRPS_USE_RPC", d.use_rpc, _parse_bool),
            log_format=_pick(args.log_format, env, "CTRPS_LOG_FORMAT", d.log_format),
            # Environment only: `ctrps serve` has no flags for these.
            history_interval_s=_pick(None, env, "CTRPS_HISTORY_INTERVAL", d.history_interval_s, float),
            history_points=_pick(None, env, "CTRPS_HISTORY_POINTS", d.history_points, int),
            limits=port_limits_from_env(env, "CTRPS_API"),
        )


@dataclass(frozen=True)
class LogSettings:
    """How every command logs; read before the role's own settings, so that
    even a settings error is reported in the chosen format."""

    log_format: str = "text"
    """``text`` or ``json`` (``--log-format``, ``CTRPS_LOG_FORMAT``)."""
    level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error`` (``--log-level``, ``CTRPS_LOG_LEVEL``)."""
    kafka_level: str = ""
    """The Kafka client's level (``--kafka-log-level``, ``CTRPS_KAFKA_LOG_LEVEL``);
    empty: WARNING, or DEBUG when `level` is ``debug``."""

    def __post_init__(self) -> None:
        if self.log_format not in ("text", "json"):
            raise SettingsError(f"log format {self.log_format!r} is not text or json")
        for key, value in (("log level", self.level), ("kafka log level", self.kafka_level)):
            if value and value.lower() not in LEVELS:
                raise SettingsError(f"{key} {value!r} is not one of {', '.join(LEVELS)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> LogSettings:
        """Flags (where the command has them and they were given) over ``CTRPS_*`` over defaults."""
        d = cls()
        return cls(
            log_format=_pick(getattr(args, "log_format", None), env, "CTRPS_LOG_FORMAT", d.log_format),
            level=_pick(getattr(args, "log_level", None), env, "CTRPS_LOG_LEVEL", d.level).lower(),
            kafka_level=_pick(
                getattr(args, "kafka_log_level", None), env, "CTRPS_KAFKA_LOG_LEVEL", d.kafka_level
            ).lower(),
        )
