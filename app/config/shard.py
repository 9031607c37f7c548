"""The shard server's settings (`ctrps shard`): its ports, tables and their
lifecycle, its exports and its port limits."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ps_core.checkpoint.serving_files import PRECISIONS
from ps_core.errors import TableConfigError
from ps_core.net.limits import PortLimits, RpcLimits
from ps_core.store.change_log import DEFAULT_LOG_KEYS
from ps_core.store.lifecycle import SPEC_KEYS, Lifecycle
from ps_core.store.table_config import TableConfig

from .common import FORMATS, check_model_name, check_urls, log_format, model_name, urls
from .declared import SettingsError, load, setting
from .exports import (
    check_exports_location,
    check_exports_mode,
    export_interval,
    exports_dir,
    exports_mode,
    take_over_exports,
)
from .limits import port_limits_from_env, rpc_limits_from_env

__all__ = ["ShardSettings", "parse_table_spec"]


def parse_table_spec(spec: str) -> TableConfig:
    """``NAME[,dim=D][,optimizer=ftrl|adagrad|sgd|coin|ftrl_mix][,init_scale=S][,seed=N][,RULE=V...][,HYPER=V...]``.

    A ``RULE`` is a lifecycle key (`ps_core.store.lifecycle.SPEC_KEYS`:
    ``admit``, ``ttl``, ``decay``, ``min_score``, ``max_rows``, ...); any other
    ``key=value`` is a hyperparameter of the optimizer, e.g.
    ``lr,optimizer=ftrl,alpha=0.05,l1=1,admit=count:3,ttl=604800,max_rows=50000000``
    or ``fm_v,dim=8,optimizer=adagrad,lr=0.05,init_scale=0.01`` or
    ``lr,optimizer=coin,wealth=2`` or ``lr,dim=4,optimizer=ftrl_mix,alpha_1=0.02,alpha_2=0.2``
    (a mixture of K learners has dim 2K).
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
        help="declare a table: NAME[,dim=D][,optimizer=ftrl|adagrad|sgd|coin|ftrl_mix][,init_scale=S][,seed=N][,HYPER=V...]; "
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
    log_format: str = log_format()
    shards: tuple[str, ...] = urls("every shard's URL, shard 0 first: shard 0 hosts the coordinator through them")
    exports_dir: str = exports_dir(
        "where exports are written and restored from: a directory, or s3://bucket/prefix (AWS_* credentials); "
        "empty: as --no-exports",
        "no exports, coordinator or restore",
        empty=True,
    )
    export_interval_s: float = export_interval("seconds between exports by shard 0; 0 = only when asked")
    base_every: int = setting(10, env="CTRPS_BASE_EVERY", flag="--base-every", help="every Nth export is a base")
    keep_bases: int = setting(2, env="CTRPS_KEEP_BASES", flag="--keep-bases", help="bases kept with their deltas")
    model_name: str = model_name("the model's directory under the exports")
    serving_precision: str = setting(
        "f32",
        env="CTRPS_SERVING_PRECISION",
        flag="--serving-precision",
        help="what exports' serving files hold the weights in: f32, f16, or int8 with a power-of-two scale per "
        "64 rows; replicas serve a version in its precision",
        choices=PRECISIONS,
    )
    exports_mode: int = exports_mode()
    restore: bool = setting(
        True, env="CTRPS_RESTORE", flag=None, off="--no-restore", help="start empty even if an export exists"
    )
    exports_owner: str = setting(
        "",
        env="CTRPS_EXPORTS_OWNER",
        flag="--exports-owner",
        help="who shard 0 claims the exports directory as (its owner.json); empty: hand-started",
    )
    take_over_exports: bool = take_over_exports()
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
        if self.log_format not in FORMATS:
            raise SettingsError("log format is text or json")
        if self.serving_precision not in PRECISIONS:
            raise SettingsError(f"serving precision {self.serving_precision!r} is not one of {', '.join(PRECISIONS)}")
        check_exports_mode(self.exports_mode)
        check_exports_location(self.exports_dir)
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
        check_urls(self.shards)
        check_model_name(self.model_name)

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
