"""Settings: one frozen object per role, from CLI flags over ``CTRPS_*``
environment variables over defaults, handed down explicitly.

Each setting is declared once, as a field with its variable, flag and help
(`app.declared.setting`); the flags (`add_flags`), the parsing and the
precedence (`load`) come from the declarations, and so does the flag
reference (``tools/settings_reference.py``); the user guide's flag tables are
checked against them (``tests/test_settings_docs.py``). Nothing below `app`
reads the environment; roles get everything from here.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from consumers.kafka_security import KafkaSecurity
from consumers.worker import WorkerConfig
from ps_core.checkpoint.manifest import check_model_name
from ps_core.errors import TableConfigError
from ps_core.model.hasher import DEFAULT_NUMERIC, numeric_spec
from ps_core.model.ramp import DEFAULT_RAMP, RAMP_START
from ps_core.net.limits import PortLimits, RpcLimits
from ps_core.net.quantize import PULL_VALUE_TYPES, VALUE_TYPES
from ps_core.net.wire import ROUNDINGS, WireFormat
from ps_core.store.change_log import DEFAULT_LOG_KEYS
from ps_core.store.lifecycle import SPEC_KEYS, Lifecycle
from ps_core.store.read_table import PRECISIONS
from ps_core.store.table import MODES, TableConfig

from .declared import SettingsError, add_flags, given, load, setting
from .logs import LEVELS
from .security import SecuritySettings, _secret_from

__all__ = [
    "ShardSettings",
    "WorkerSettings",
    "BrokerSettings",
    "DemoSettings",
    "ClusterSettings",
    "ApiSettings",
    "parse_table_spec",
    "SettingsError",
    "LogSettings",
    "add_flags",
]


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
    """``NAME[,dim=D][,optimizer=ftrl|adagrad|sgd|coin][,init_scale=S][,seed=N][,RULE=V...][,HYPER=V...]``.

    A ``RULE`` is a lifecycle key (`ps_core.store.lifecycle.SPEC_KEYS`:
    ``admit``, ``ttl``, ``decay``, ``min_score``, ``max_rows``, ...); any other
    ``key=value`` is a hyperparameter of the optimizer, e.g.
    ``lr,optimizer=ftrl,alpha=0.05,l1=1,admit=count:3,ttl=604800,max_rows=50000000``
    or ``fm_v,dim=8,optimizer=adagrad,lr=0.05,init_scale=0.01`` or
    ``lr,optimizer=coin,wealth=2``.
    """
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise SettingsError(f"table spec {spec!r} must start with the table name")
    name, fields = parts[0], parts[1:]
    optimizer: dict[str, Any] = {"name": "ftrl"}
    kwargs: dict[str, Any] = {}
    rules: dict[str, str] = {}
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
            elif key in SPEC_KEYS:
                rules[key] = value
            else:
                optimizer[key] = float(value)
        except ValueError:
            raise SettingsError(f"table spec {spec!r}: {key}={value!r} is not a number") from None
    try:
        lifecycle = Lifecycle.from_spec(rules) if rules else None
        return TableConfig(name=name, optimizer=optimizer, lifecycle=lifecycle, **kwargs)
    except TableConfigError as exc:
        raise SettingsError(f"table spec {spec!r}: {exc.detail}") from None


def _env_number(env: Mapping[str, str], key: str, default: Any) -> Any:
    raw = env.get(key)
    if not raw:
        return default
    try:
        return type(default)(raw)
    except ValueError:
        raise SettingsError(
            f"{key}={raw!r} is not {'an integer' if isinstance(default, int) else 'a number'}"
        ) from None


def port_limits_from_env(env: Mapping[str, str], prefix: str) -> PortLimits:
    """An HTTP port's limits from ``{prefix}_MAX_CONNECTIONS``, ``_HEADER_TIMEOUT``,
    ``_BODY_TIMEOUT`` and ``_IDLE_TIMEOUT`` (seconds), over the defaults."""
    d = PortLimits()
    try:
        return PortLimits(
            max_connections=_env_number(env, f"{prefix}_MAX_CONNECTIONS", d.max_connections),
            header_timeout_s=_env_number(env, f"{prefix}_HEADER_TIMEOUT", d.header_timeout_s),
            body_timeout_s=_env_number(env, f"{prefix}_BODY_TIMEOUT", d.body_timeout_s),
            idle_timeout_s=_env_number(env, f"{prefix}_IDLE_TIMEOUT", d.idle_timeout_s),
        )
    except ValueError as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"{prefix}_*: {exc}") from None


def rpc_limits_from_env(env: Mapping[str, str]) -> RpcLimits:
    """The RPC port's limits from ``CTRPS_RPC_MAX_CONNECTIONS``, ``CTRPS_RPC_HELLO_TIMEOUT``,
    ``CTRPS_RPC_FRAME_TIMEOUT`` (seconds) and ``CTRPS_RPC_BUFFER_BUDGET_MB``."""
    d = RpcLimits()
    try:
        return RpcLimits(
            max_connections=_env_number(env, "CTRPS_RPC_MAX_CONNECTIONS", d.max_connections),
            hello_timeout_s=_env_number(env, "CTRPS_RPC_HELLO_TIMEOUT", d.hello_timeout_s),
            frame_timeout_s=_env_number(env, "CTRPS_RPC_FRAME_TIMEOUT", d.frame_timeout_s),
            buffer_budget_bytes=_env_number(env, "CTRPS_RPC_BUFFER_BUDGET_MB", d.buffer_budget_bytes >> 20) << 20,
        )
    except ValueError as exc:
        if isinstance(exc, SettingsError):
            raise
        raise SettingsError(f"CTRPS_RPC_*: {exc}") from None


_FORMATS = ("text", "json")
_MODELS = ("lr", "fm")
INHERITED = frozenset({"model", "mode"})
"""A worker's settings a model already declared on the cluster gives when
no flag or variable does."""


def _log_format(help: str = "log line format") -> Any:
    return setting("text", env="CTRPS_LOG_FORMAT", flag="--log-format", help=help, choices=_FORMATS)


def _urls(env: str, help: str, **how: Any) -> Any:
    return setting((), env=env, flag="--shards", help=help, **how)


# Settings several roles declare, each with its own help: one variable and
# flag for all of them.


def _bootstrap(help: str, shown_default: str) -> Any:
    return setting("", env="CTRPS_KAFKA_BOOTSTRAP", flag="--bootstrap", help=help, shown_default=shown_default)


def _model(help: str) -> Any:
    return setting("lr", env="CTRPS_MODEL", flag="--model", help=help, choices=_MODELS)


def _startup_timeout(what: str) -> Any:
    return setting(
        30.0,
        env="CTRPS_STARTUP_TIMEOUT_S",
        flag="--startup-timeout",
        help=f"seconds to wait at start for {what} to answer a first time (one line every 5 s says which "
        "address); past it, exit 1: an address that never answered is wrong. Once answered, outages are "
        "waited out as usual",
        metavar="SECONDS",
    )


def _check_startup_timeout(seconds: float) -> None:
    if not 0 < seconds < float("inf"):
        raise SettingsError("startup timeout must be a positive number of seconds")


def octal_mode(raw: str) -> int:
    """A file mode written in octal (``0600``, ``640``); ValueError otherwise."""
    return int(raw, 8)


def _exports_mode() -> Any:
    return setting(
        0o600,
        env="CTRPS_EXPORTS_MODE",
        flag="--exports-mode",
        help="octal mode of export files, their directories get x where r: 0600/0700 keeps the model to this "
        "user, 0640 lets the group's replicas read it",
        item=octal_mode,
        metavar="MODE",
        shown_default="0600",
    )


def _take_over_exports() -> Any:
    return setting(
        False,
        env="CTRPS_TAKE_OVER_EXPORTS",
        flag=None,
        off="--take-over-exports",
        off_value=True,
        help="make an exports directory another cluster owns this one's (its owner.json; else refused, exit 4)",
    )


def _check_exports_mode(mode: int) -> None:
    if mode & ~0o666 or mode & 0o600 != 0o600:
        raise SettingsError(
            f"exports mode {mode:04o} must let the owner read and write, with no x, setuid or sticky bit "
            "(0600, 0640, 0644, ...)"
        )


def _model_name(help: str) -> Any:
    return setting("ctr", env="CTRPS_MODEL_NAME", flag="--model-name", help=help)


def _numeric(help: str) -> Any:
    return setting(
        DEFAULT_NUMERIC, env="CTRPS_NUMERIC", flag="--numeric", help=help, item=numeric_spec, metavar="raw|log1p[/D]"
    )


def _use_rpc() -> Any:
    return setting(
        True, env="CTRPS_USE_RPC", flag=None, off="--no-rpc", help="reach the shards over HTTP only, not their TCP RPC"
    )


@dataclass(frozen=True)
class ShardSettings:
    """Settings of one shard server (`ctrps shard`)."""

    host: str = setting("127.0.0.1", env="CTRPS_SHARD_HOST", flag="--host", help="listen address")
    port: int = setting(7100, env="CTRPS_SHARD_PORT", flag="--port", help="listen port; 0 picks a free one")
    shard_id: int = setting(0, env="CTRPS_SHARD_ID", flag="--shard-id", help="this shard's number")
    num_shards: int = setting(1, env="CTRPS_NUM_SHARDS", flag="--num-shards", help="shards in the cluster")
    tables: tuple[TableConfig, ...] = setting(
        (),
        env="CTRPS_TABLES",
        flag="--table",
        help="declare a table: NAME[,dim=D][,optimizer=ftrl|adagrad|sgd|coin][,init_scale=S][,seed=N][,HYPER=V...]; "
        "repeatable (CTRPS_TABLES: specs joined by ;); with none, clients declare them",
        repeat=True,
        sep=";",
        item=parse_table_spec,
        metavar="SPEC",
    )
    max_body_mb: int = setting(512, env="CTRPS_MAX_BODY_MB", flag="--max-body-mb", help="largest request body, MiB")
    stats_interval_s: float = setting(
        60.0, env="CTRPS_STATS_INTERVAL", flag="--stats-interval", help="seconds between progress lines; 0 = off"
    )
    log_format: str = _log_format()
    shards: tuple[str, ...] = _urls(
        "CTRPS_SHARDS", "every shard's URL, shard 0 first: shard 0 hosts the coordinator through them"
    )
    exports_dir: str = setting(
        "exports",
        env="CTRPS_EXPORTS_DIR",
        flag="--exports-dir",
        help="where exports are written and restored from; empty: as --no-exports",
        off="--no-exports",
        off_value="",
        off_help="no exports, coordinator or restore",
        empty=True,
    )
    export_interval_s: float = setting(
        60.0,
        env="CTRPS_EXPORT_INTERVAL",
        flag="--export-interval",
        help="seconds between exports by shard 0; 0 = only when asked",
    )
    base_every: int = setting(10, env="CTRPS_BASE_EVERY", flag="--base-every", help="every Nth export is a base")
    keep_bases: int = setting(2, env="CTRPS_KEEP_BASES", flag="--keep-bases", help="bases kept with their deltas")
    model_name: str = _model_name("the model's directory under the exports")
    serving_precision: str = setting(
        "f32",
        env="CTRPS_SERVING_PRECISION",
        flag="--serving-precision",
        help="what exports' serving files hold the weights in: f32, f16, or int8 with a power-of-two scale per "
        "64 rows; replicas serve a version in its precision",
        choices=PRECISIONS,
    )
    exports_mode: int = _exports_mode()
    restore: bool = setting(
        True, env="CTRPS_RESTORE", flag=None, off="--no-restore", help="start empty even if an export exists"
    )
    exports_owner: str = setting(
        "",
        env="CTRPS_EXPORTS_OWNER",
        flag="--exports-owner",
        help="who shard 0 claims the exports directory as (its owner.json); empty: hand-started",
    )
    take_over_exports: bool = _take_over_exports()
    lease_ttl_s: float = setting(
        120.0, env="CTRPS_LEASE_TTL", flag="--lease-ttl", help="seconds a cut waits for one leased window"
    )
    rpc: bool = setting(True, env="CTRPS_RPC", flag=None, off="--no-rpc", help="serve pulls and pushes over HTTP only")
    rpc_port: int = setting(
        0, env="CTRPS_RPC_PORT", flag="--rpc-port", help="TCP RPC port for pulls and pushes; 0 picks a free one"
    )
    admit: str = setting(
        "none",
        env="CTRPS_ADMIT",
        flag="--admit",
        help="admission of new features into tables declared without a lifecycle: "
        "none, count:N (seen N times), prob:P (per occurrence), score:T (shows and clicks)",
    )
    click_coeff: float = setting(
        1.0, env="CTRPS_CLICK_COEFF", flag="--click-coeff", help="a click's weight in a score (admission and eviction)"
    )
    nonclick_coeff: float = setting(
        0.1, env="CTRPS_NONCLICK_COEFF", flag="--nonclick-coeff", help="a show without a click's weight in a score"
    )
    sketch_bytes: int = setting(
        4 << 20, env="CTRPS_SKETCH_BYTES", flag="--sketch-bytes", help="bytes of a count:N admission sketch per table"
    )
    ttl_s: float = setting(
        0.0, env="CTRPS_TTL", flag="--ttl", help="remove rows unseen for this many seconds of event time; 0 = never"
    )
    decay: float = setting(
        0.98, env="CTRPS_DECAY", flag="--decay", help="shows and clicks decay by this at each eviction pass"
    )
    min_score: float = setting(
        0.0, env="CTRPS_MIN_SCORE", flag="--min-score", help="remove rows whose decayed score falls below this; 0 = off"
    )
    max_rows: int = setting(
        0, env="CTRPS_MAX_ROWS", flag="--max-rows", help="rows per table on this shard; over it the lowest scores go"
    )
    low_water: float = setting(
        0.9, env="CTRPS_LOW_WATER", flag="--low-water", help="a table over --max-rows is cut back to this fraction"
    )
    embed_threshold: float = setting(
        0.0,
        env="CTRPS_EMBED_THRESHOLD",
        flag="--embed-threshold",
        help="lazy embeddings: a key gets a row in an embedding table (dim > 1) once its score "
        "in the linear table reaches this; 0 = off",
    )
    evict_interval_s: float = setting(
        60.0, env="CTRPS_EVICT_INTERVAL", flag="--evict-interval", help="seconds between eviction passes; 0 = none"
    )
    geo_change_log_keys: int = setting(
        DEFAULT_LOG_KEYS,
        env="CTRPS_GEO_CHANGE_LOG_KEYS",
        flag="--geo-change-log-keys",
        help="keys each geo table's change log holds (8 bytes each): geo workers read again only the rows others "
        "changed since their last round, or every row when the log no longer reaches back; 0 = no log",
    )
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
        if self.log_format not in _FORMATS:
            raise SettingsError("log format is text or json")
        if self.serving_precision not in PRECISIONS:
            raise SettingsError(f"serving precision {self.serving_precision!r} is not one of {', '.join(PRECISIONS)}")
        _check_exports_mode(self.exports_mode)
        if self.max_body_mb < 1:
            raise SettingsError("max body must be at least 1 MiB")
        if not self.stats_interval_s >= 0 or self.stats_interval_s == float("inf"):
            raise SettingsError("stats interval must be a finite number of seconds >= 0")
        if not self.evict_interval_s >= 0 or self.evict_interval_s == float("inf"):
            raise SettingsError("evict interval must be a finite number of seconds >= 0")
        if self.geo_change_log_keys < 0:
            raise SettingsError("geo change log keys must be >= 0")
        try:
            self.default_lifecycle()
        except TableConfigError as exc:
            raise SettingsError(exc.detail.removeprefix("lifecycle: ")) from None
        names = [t.name for t in self.tables]
        if len(set(names)) != len(names):
            raise SettingsError(f"a table is declared twice: {names}")
        _check_urls(self.shards)
        _check_model_name(self.model_name)

    def default_lifecycle(self) -> Lifecycle:
        """The lifecycle of tables declared without one (--admit, --ttl, ...):
        the settings named as `Lifecycle`'s fields."""
        return Lifecycle(**{f.name: getattr(self, f.name) for f in fields(Lifecycle) if hasattr(self, f.name)})

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ShardSettings:
        """Defaults overridden by ``CTRPS_*`` variables."""
        return cls.from_args(None, env)

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, env: Mapping[str, str] = os.environ) -> ShardSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        return load(
            cls, args, env, http_limits=port_limits_from_env(env, "CTRPS_SHARD"), rpc_limits=rpc_limits_from_env(env)
        )


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of one training worker (`ctrps worker`)."""

    bootstrap: str = _bootstrap("Kafka bootstrap servers (host:port); required", "(required)")
    shards: tuple[str, ...] = _urls(
        "CTRPS_SHARDS", "shard URLs, comma-separated, shard 0 first; required", shown_default="(required)"
    )
    topic: str = setting("clicks", env="CTRPS_TOPIC", flag="--topic", help="topic of click events")
    group: str = setting("ctrps", env="CTRPS_GROUP", flag="--group", help="consumer group")
    dlq_topic: str = setting(
        "", env="CTRPS_DLQ_TOPIC", flag="--dlq-topic", help="dead-letter topic", shown_default="<topic>.dlq"
    )
    window_seconds: float = setting(
        60.0, env="CTRPS_WINDOW_SECONDS", flag="--window-seconds", help="window span in event time"
    )
    window_events: int = setting(
        100_000, env="CTRPS_WINDOW_EVENTS", flag="--window-events", help="most events per window"
    )
    mini_batch: int = setting(256, env="CTRPS_MINI_BATCH", flag="--mini-batch", help="events per pull/push step")
    mini_batch_ramp: int = setting(
        DEFAULT_RAMP,
        env="CTRPS_MINI_BATCH_RAMP",
        flag="--mini-batch-ramp",
        help=f"async and geo modes: mini-batches start at {RAMP_START} events and grow by one per this many events "
        "trained, up to --mini-batch (a fresh model learns its bias and frequent features as fast as "
        "per-event updates would); 0 starts at --mini-batch",
    )
    model: str = _model("model kind")
    model_name: str = _model_name("model name: table prefix and feature namespace")
    numeric: str = _numeric(
        "numeric feature values fed as sent (raw) or as sign(x) log1p(|x|) (log1p), /D divided by D, for a "
        "model this worker creates; a created model keeps its own"
    )
    also_train: tuple[str, ...] = setting(
        (),
        env="CTRPS_ALSO_TRAIN",
        flag="--also-train",
        help="train this model too, on the same records, in this worker's --mode: one decode, one lease and "
        "one commit for all; repeatable (CTRPS_ALSO_TRAIN: names joined by ,). Each takes the type and optimizer "
        "it was created with (ctrps model create), else this worker's --model",
        repeat=True,
        sep=",",
        metavar="NAME",
    )
    mode: str = setting(
        "async",
        env="CTRPS_MODE",
        flag="--mode",
        help="update mode: push gradients applied as they arrive (async), summed over the workers and applied "
        "once per mini-batch step (sync), or train a local copy and push parameter differences every --geo-steps "
        "mini-batches (geo); every worker of a model must agree",
        choices=MODES,
    )
    geo_steps: int = setting(
        8, env="CTRPS_GEO_STEPS", flag="--geo-steps", help="geo: mini-batches trained locally between pushes"
    )
    sync_deadline_s: float = setting(
        5.0,
        env="CTRPS_SYNC_DEADLINE",
        flag="--sync-deadline",
        help="sync: seconds a step waits for the other workers after the first arrived; a worker later than "
        "that is dropped from the step (the quorum shrinks) and rejoins when it arrives",
    )
    geo_max_rows: int = setting(
        1_000_000,
        env="CTRPS_GEO_MAX_ROWS",
        flag="--geo-max-rows",
        help="geo: most rows of the local copy kept past a round (the least recently trained go first, down to 9/10 of it)",
    )
    max_staleness: int = setting(
        -1,
        env="CTRPS_MAX_STALENESS",
        flag="--max-staleness",
        help="async: down-weight a gradient computed from rows more than N pushes old by (1+N)/(1+staleness); "
        "-1 counts staleness without bounding it",
        shown_default="-1 (unbounded)",
    )
    decode_processes: int = setting(
        1,
        env="CTRPS_DECODE_PROCESSES",
        flag="--decode-processes",
        help="processes decoding events; 0 decodes in the event loop",
    )
    session_timeout_ms: int = setting(
        10_000,
        env="CTRPS_SESSION_TIMEOUT_MS",
        flag="--session-timeout-ms",
        help="Kafka session timeout: how soon a dead worker's partitions move",
    )
    log_format: str = _log_format()
    use_rpc: bool = _use_rpc()
    wire_push: str = setting(
        "f32",
        env="CTRPS_WIRE_PUSH",
        flag="--wire-push",
        help="value type of pushed gradients: f32 exact, f16, or int8 with a scale per 64 values "
        "(rounded without bias; the shards add them in float32)",
        choices=VALUE_TYPES,
    )
    wire_pull: str = setting(
        "f32",
        env="CTRPS_WIRE_PULL",
        flag="--wire-pull",
        help="value type of pulled weights: f32 exact or f16 (rounded to the nearest)",
        choices=PULL_VALUE_TYPES,
    )
    wire_rounding: str = setting(
        "stochastic",
        env="CTRPS_WIRE_ROUNDING",
        flag="--wire-rounding",
        help="how f16 and int8 pushes stay unbiased: stochastic rounding, or feedback (round to the nearest "
        "and add each key's rounding error to its next push)",
        choices=ROUNDINGS,
    )
    key_sets: bool = setting(
        True,
        env="CTRPS_KEY_SETS",
        flag=None,
        off="--no-key-sets",
        help="send every key with its push, rather than naming the key set the shard kept from the pull "
        "(needs shards that read frame format 2, as do the compressed value types)",
    )
    compact_counts: bool = setting(
        True,
        env="CTRPS_COMPACT_COUNTS",
        flag=None,
        off="--no-compact-counts",
        help="send shows and clicks as float32, not the narrowest exact integers (frame format 2)",
    )
    on_stale_offsets: str = setting(
        "committed",
        env="CTRPS_ON_STALE_OFFSETS",
        flag="--on-stale-offsets",
        help="resume offsets of another Kafka cluster or group, or outside a partition's range: "
        "resume at the group's commit (committed), at the first offset (earliest), "
        "or exit with code 4 (fail); the model's weights are kept",
        choices=("committed", "earliest", "fail"),
    )
    outage_deadline_s: float = setting(
        600.0,
        env="CTRPS_OUTAGE_DEADLINE_S",
        flag="--outage-deadline",
        help="give up (exit code 3) when a shard, the coordinator or the broker stays unreachable this long; 0 waits forever",
        metavar="SECONDS",
    )
    startup_timeout_s: float = _startup_timeout("each shard and the broker")
    lag_warn_s: float = setting(
        120.0,
        env="CTRPS_LAG_WARN_S",
        flag="--lag-warn-seconds",
        help="warn (once per this many seconds while it lasts) when the consumer lag has grown this long, "
        "naming the likely cause; 0 never warns",
        metavar="SECONDS",
    )
    metrics_port: int = setting(
        0,
        env="CTRPS_WORKER_METRICS_PORT",
        flag="--metrics-port",
        help="serve GET /metrics (the worker's own totals, its last window, its status reports sent and lost) "
        "on --metrics-host:PORT; 0 = not served",
        metavar="PORT",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        env="CTRPS_WORKER_METRICS_HOST",
        flag="--metrics-host",
        help="address --metrics-port listens on (0.0.0.0: every interface; the metrics name no secret)",
        metavar="ADDRESS",
    )

    inherit: frozenset[str] = field(default=frozenset(), compare=False)
    """Of ``model`` and ``mode``, those no flag or variable gave: a model
    already declared on the cluster sets them (`app.worker_role`). Empty when
    built in code: its values are meant as given."""

    def __post_init__(self) -> None:
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"metrics port {self.metrics_port} is not in [0, 65535]")
        if not self.metrics_host:
            raise SettingsError("metrics host is empty: pass --metrics-host ADDRESS (default 127.0.0.1)")
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
        for name in self.also_train:
            _check_model_name(name)
        names = [self.model_name, *self.also_train]
        if len(set(names)) != len(names):
            raise SettingsError(f"--also-train names a model twice, or the worker's own: {', '.join(names)}")
        if self.model not in _MODELS:
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        if not self.window_seconds > 0 or self.window_events < 1 or self.mini_batch < 1:
            raise SettingsError("window seconds, window events and mini-batch must be positive")
        if self.mini_batch_ramp < 0:
            raise SettingsError("mini-batch ramp must be >= 0 (0: no ramp)")
        if self.mode not in MODES:
            raise SettingsError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        try:
            self.wire()
        except ValueError as exc:  # a CTRPS_WIRE_* variable outside its choices
            raise SettingsError(f"wire format: {exc}") from None
        if not 0 < self.sync_deadline_s <= 60:
            raise SettingsError("sync deadline must be in (0, 60] seconds")
        if self.geo_steps < 1 or self.geo_max_rows < 1:
            raise SettingsError("geo steps and geo max rows must be >= 1")
        if self.max_staleness < -1 or self.max_staleness >= 2**31:
            raise SettingsError("max staleness must be -1 (unbounded) or a number of pushes in [0, 2**31)")
        if self.max_staleness >= 0 and self.mode != "async":
            raise SettingsError(f"--max-staleness bounds async updates; mode {self.mode} has no staleness bound")
        if self.decode_processes < 0:
            raise SettingsError("decode processes must be >= 0")
        if self.session_timeout_ms < 1000:
            raise SettingsError("session timeout must be at least 1000 ms")
        if self.log_format not in _FORMATS:
            raise SettingsError("log format is text or json")
        if not self.outage_deadline_s >= 0:
            raise SettingsError("outage deadline must be >= 0 seconds (0 waits forever)")
        _check_startup_timeout(self.startup_timeout_s)
        if not 0 <= self.lag_warn_s < float("inf"):
            raise SettingsError("lag warn seconds must be a finite number >= 0 (0 never warns)")

    @property
    def dlq(self) -> str:
        """The dead-letter topic in effect."""
        return self.dlq_topic or f"{self.topic}.dlq"

    @property
    def staleness_bound(self) -> int | None:
        """`max_staleness` as the model declares it (None: unbounded)."""
        return None if self.max_staleness < 0 else self.max_staleness

    def worker_config(self, kafka: KafkaSecurity = KafkaSecurity()) -> WorkerConfig:
        """The worker's `WorkerConfig`: every setting the two share by name,
        the dead-letter topic in effect, a heartbeat a fifth of the session."""
        shared = {f.name for f in fields(WorkerConfig)} & {f.name for f in fields(self)}
        return WorkerConfig(
            **{name: getattr(self, name) for name in shared if name != "dlq_topic"},
            dlq_topic=self.dlq,
            heartbeat_interval_ms=max(100, self.session_timeout_ms // 5),
            kafka=kafka,
        )

    def wire(self) -> WireFormat:
        """How the worker's pulls and pushes travel (`ps_core.net.wire`)."""
        return WireFormat(
            push=self.wire_push,
            pull=self.wire_pull,
            key_sets=self.key_sets,
            compact_counts=self.compact_counts,
            rounding=self.wire_rounding,  # type: ignore[arg-type]
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> WorkerSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults; the
        model's type and mode left to its declaration where neither gives them."""
        return load(cls, args, env, inherit=INHERITED - given(cls, args, env))


def _exports_dir() -> Any:
    return setting(
        "exports",
        env="CTRPS_EXPORTS_DIR",
        flag="--exports-dir",
        help="where model versions are written; empty turns exports off",
        off="--no-exports",
        off_value="",
        off_help="write no exports",
    )


def _export_interval() -> Any:
    return setting(
        60.0, env="CTRPS_EXPORT_INTERVAL", flag="--export-interval", help="seconds between exports; 0 = only when asked"
    )


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
    if log_format not in _FORMATS:
        raise SettingsError("log format is text or json")


def _broker_max_rss_mb(flag: str) -> Any:
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

    max_rss_mb: int = _broker_max_rss_mb("--max-rss-mb")
    metrics_port: int = setting(
        0,
        env="CTRPS_BROKER_METRICS_PORT",
        flag="--metrics-port",
        help="serve GET /metrics (the broker's resident memory) on 127.0.0.1:PORT; 0 = not served",
        metavar="PORT",
    )

    port: int = 0
    """The broker's listen port (its own ``--port`` flag; 0: a free one)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port {self.port} out of range")
        if self.max_rss_mb < 0:
            raise SettingsError("the broker's memory limit must be >= 0 MB (0: none)")
        if not 0 <= self.metrics_port <= 65535:
            raise SettingsError(f"metrics port {self.metrics_port} is not in [0, 65535]")

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, env: Mapping[str, str] = os.environ) -> BrokerSettings:
        """Flags (where given) over ``CTRPS_*`` variables over defaults."""
        return load(cls, args, env, port=getattr(args, "port", None) or 0)


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
    window_seconds: float = setting(
        1.0, env="CTRPS_DEMO_WINDOW_SECONDS", flag="--window-seconds", help="the worker's window span, seconds"
    )
    bootstrap: str = _bootstrap("use this Kafka instead of the embedded broker", "(embedded broker)")
    seed: int = setting(
        0, env="CTRPS_DEMO_SEED", flag="--seed", help="seed of the synthetic stream and its hidden model"
    )
    broker_max_rss_mb: int = _broker_max_rss_mb("--broker-max-rss-mb")
    log_format: str = _log_format()
    exports_dir: str = _exports_dir()
    export_interval_s: float = _export_interval()
    exports_mode: int = _exports_mode()
    admin_token: str = field(default="", repr=False)
    """The API's admin token (``CTRPS_ADMIN_TOKEN`` or ``CTRPS_ADMIN_TOKEN_FILE``); empty: the
    demo makes one for the run, unless `insecure`."""
    insecure: bool = False
    """Let the API listen on a non-loopback host without an admin token, and leave its admin
    routes open (``--insecure``, ``CTRPS_INSECURE``)."""

    def __post_init__(self) -> None:
        _check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        _check_exports(self.export_interval_s)
        _check_exports_mode(self.exports_mode)
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
    window_seconds: float = setting(
        2.0, env="CTRPS_CLUSTER_WINDOW_SECONDS", flag="--window-seconds", help="the workers' window span"
    )
    mode: str = setting(
        "async",
        env="CTRPS_CLUSTER_MODE",
        flag="--mode",
        help="the workers' update mode (as ctrps worker --mode)",
        choices=MODES,
    )
    partitions: int = setting(
        4, env="CTRPS_CLUSTER_PARTITIONS", flag="--partitions", help="partitions of the click topic"
    )
    duration_s: float = setting(
        0.0, env="CTRPS_CLUSTER_DURATION", flag="--duration", help="stop after S seconds; 0 = until Ctrl-C"
    )
    bootstrap: str = _bootstrap("use this Kafka instead of a broker process", "(a broker process)")
    ready_timeout_s: float = setting(
        60.0, env="CTRPS_CLUSTER_READY_TIMEOUT", flag="--ready-timeout", help="seconds each role may take to be ready"
    )
    grace_s: float = setting(
        10.0, env="CTRPS_CLUSTER_GRACE", flag="--grace", help="seconds between SIGTERM and SIGKILL"
    )
    log_format: str = _log_format("log line format (children too)")
    exports_dir: str = _exports_dir()
    export_interval_s: float = _export_interval()
    exports_mode: int = _exports_mode()
    take_over_exports: bool = _take_over_exports()
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
        _check_composition(self.duration_s, self.port, self.window_seconds, self.log_format)
        _check_exports(self.export_interval_s)
        _check_exports_mode(self.exports_mode)
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


@dataclass(frozen=True)
class ApiSettings:
    """Settings of the HTTP prediction API (`ctrps serve`, and the demo's API)."""

    shards: tuple[str, ...] = _urls(
        "CTRPS_SHARDS",
        "shard URLs, comma-separated, shard 0 first",
        exclusive="source",
        shown_default="(this or --follow)",
    )
    follow: str = setting(
        "",
        env="CTRPS_FOLLOW",
        flag="--follow",
        help="serve a model's exports as a read-only replica: exports/<model>, or the exports root for its <model-name>/",
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
        help="with --follow an exports root: serve every model under it, --model-name the default",
    )
    host: str = setting("127.0.0.1", env="CTRPS_API_HOST", flag="--host", help="listen address")
    port: int = setting(8080, env="CTRPS_API_PORT", flag="--port", help="listen port; 0 picks a free one")
    model: str = _model("model kind (with --follow, the manifest's)")
    model_name: str = _model_name("model name (with --follow, the manifest's)")
    numeric: str = _numeric(
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
    use_rpc: bool = _use_rpc()
    startup_timeout_s: float = _startup_timeout("each shard (with --follow: for DIR to exist)")
    log_format: str = _log_format()
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
        if self.model not in _MODELS:
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        _check_model_name(self.model_name)
        _check_urls(self.shards)
        if self.max_events < 1 or self.max_body_bytes < 1024:
            raise SettingsError("max events must be >= 1 and max body bytes >= 1024")
        if not 0 < self.shard_deadline_s < float("inf"):
            raise SettingsError("shard deadline must be a positive number of seconds")
        _check_startup_timeout(self.startup_timeout_s)
        if self.log_format not in _FORMATS:
            raise SettingsError("log format is text or json")
        if self.shards and self.follow:
            raise SettingsError("shards and follow are exclusive: serve shard servers or an export directory")
        if self.follow_all and not self.follow:
            raise SettingsError("--follow-all needs --follow: the exports root whose models to serve")
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


@dataclass(frozen=True)
class LogSettings:
    """How every command logs; read before the role's own settings, so that
    even a settings error is reported in the chosen format. Its flags are the
    top-level ``--log-level`` and ``--kafka-log-level``, and each command's
    ``--log-format``."""

    log_format: str = _log_format()
    level: str = setting(
        "info",
        env="CTRPS_LOG_LEVEL",
        flag="--log-level",
        help="least severe level logged",
        item=str.lower,
        choices=LEVELS,
    )
    kafka_level: str = setting(
        "",
        env="CTRPS_KAFKA_LOG_LEVEL",
        flag="--kafka-log-level",
        help="the Kafka client's level (debug with --log-level debug)",
        item=str.lower,
        choices=LEVELS,
        shown_default="warning",
    )

    def __post_init__(self) -> None:
        if self.log_format not in _FORMATS:
            raise SettingsError(f"log format {self.log_format!r} is not text or json")
        for key, value in (("log level", self.level), ("kafka log level", self.kafka_level)):
            if value and value.lower() not in LEVELS:
                raise SettingsError(f"{key} {value!r} is not one of {', '.join(LEVELS)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> LogSettings:
        """Flags (where the command has them and they were given) over ``CTRPS_*`` over defaults."""
        got = load(cls, args, env)
        return cls(got.log_format, got.level.lower(), got.kafka_level.lower())
