"""The training worker's settings (`ctrps worker`) and `worker_config`, the
one way from them to the `consumers.worker.WorkerConfig` a worker runs with:
the worker process, the demo's in-process worker and the cluster's worker
processes all go through it. The declarations the demo and the cluster share
with the worker (`window_span`, `update_mode`) are here too."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from consumers.kafka_security import KafkaSecurity
from consumers.worker import WorkerConfig
from ps_core.model.ramp import DEFAULT_RAMP, RAMP_START
from ps_core.net.quantize import PULL_VALUE_TYPES, VALUE_TYPES
from ps_core.net.wire import ROUNDINGS, WireFormat
from ps_core.store.table_config import MODES

from .common import (
    FORMATS,
    MODELS,
    bootstrap,
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
from .declared import SettingsError, given, load, setting

__all__ = ["WorkerSettings", "worker_config", "every_field", "window_span", "update_mode", "INHERITED"]

INHERITED = frozenset({"model", "mode"})
"""A worker's settings a model already declared on the cluster gives when
no flag or variable does."""


def window_span(default: float, env: str, help: str) -> Any:
    """``--window-seconds``: a worker's window span in event time (the
    worker's own, or the one the demo and the cluster give theirs)."""
    return setting(default, env=env, flag="--window-seconds", help=help)


def update_mode(env: str, help: str) -> Any:
    """``--mode``: a worker's update mode (`ps_core.store.table.MODES`)."""
    return setting("async", env=env, flag="--mode", help=help, choices=MODES)


@dataclass(frozen=True)
class WorkerSettings:
    """Settings of one training worker (`ctrps worker`)."""

    bootstrap: str = bootstrap("Kafka bootstrap servers (host:port); required", "(required)")
    shards: tuple[str, ...] = urls("shard URLs, comma-separated, shard 0 first; required", shown_default="(required)")
    topic: str = setting("clicks", env="CTRPS_TOPIC", flag="--topic", help="topic of click events")
    group: str = setting("ctrps", env="CTRPS_GROUP", flag="--group", help="consumer group")
    dlq_topic: str = setting(
        "", env="CTRPS_DLQ_TOPIC", flag="--dlq-topic", help="dead-letter topic", shown_default="<topic>.dlq"
    )
    window_seconds: float = window_span(60.0, "CTRPS_WINDOW_SECONDS", "window span in event time")
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
    in_flight: int = setting(
        1,
        env="CTRPS_IN_FLIGHT",
        flag="--in-flight",
        help="async: mini-batches in flight at once (mini-batch k+N's pull travels with mini-batch k's push, so N "
        "round trips to the shards overlap); raise it when the shards are far (tens of ms); capped at "
        "--max-staleness + 1, since this worker's own pushes are N-1 stale",
    )
    model: str = model("model kind")
    model_name: str = model_name("model name: table prefix and feature namespace")
    numeric: str = numeric(
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
    mode: str = update_mode(
        "CTRPS_MODE",
        "update mode: push gradients applied as they arrive (async), summed over the workers and applied "
        "once per mini-batch step (sync), or train a local copy and push parameter differences every --geo-steps "
        "mini-batches (geo); every worker of a model must agree",
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
    log_format: str = log_format()
    use_rpc: bool = use_rpc()
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
    startup_timeout_s: float = startup_timeout("each shard and the broker")
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
    already declared on the cluster sets them (`app.roles.worker`). Empty when
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
        check_urls(self.shards)
        check_model_name(self.model_name)
        for name in self.also_train:
            check_model_name(name)
        names = [self.model_name, *self.also_train]
        if len(set(names)) != len(names):
            raise SettingsError(f"--also-train names a model twice, or the worker's own: {', '.join(names)}")
        if self.model not in MODELS:
            raise SettingsError(f"model {self.model!r} is not lr or fm")
        if not self.window_seconds > 0 or self.window_events < 1 or self.mini_batch < 1:
            raise SettingsError("window seconds, window events and mini-batch must be positive")
        if self.mini_batch_ramp < 0:
            raise SettingsError("mini-batch ramp must be >= 0 (0: no ramp)")
        if not 1 <= self.in_flight <= 1024:
            raise SettingsError(f"in-flight must be in [1, 1024], not {self.in_flight}")
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
        if self.log_format not in FORMATS:
            raise SettingsError("log format is text or json")
        if not self.outage_deadline_s >= 0:
            raise SettingsError("outage deadline must be >= 0 seconds (0 waits forever)")
        check_startup_timeout(self.startup_timeout_s)
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
        model's type and mode left to its declaration where neither gives them.
        A worker process needs shard URLs; settings built in code may leave
        them empty for a worker on shards in its own process (the demo)."""
        settings = load(cls, args, env, inherit=INHERITED - given(cls, args, env))
        if not settings.shards:
            raise SettingsError("no shards: pass --shards URL,URL,... or set CTRPS_SHARDS")
        return settings


_DEFAULT = WorkerConfig(bootstrap="")
"""`WorkerConfig`'s own defaults, for the fields no setting gives."""

C = TypeVar("C")


def every_field(cls: type[C], values: Mapping[str, Any]) -> C:
    """`cls` (a dataclass) from `values`, which must name every one of its
    fields: a field added to `cls` and not mapped is a `TypeError` naming it,
    not a default taken silently (a name given that `cls` lacks is one too)."""
    missing = sorted({f.name for f in dataclasses.fields(cls)} - set(values))  # type: ignore[arg-type]
    if missing:
        raise TypeError(f"{cls.__name__} fields not mapped from the settings: {', '.join(missing)}")
    return cls(**values)


def worker_config(settings: WorkerSettings, kafka: KafkaSecurity = KafkaSecurity()) -> WorkerConfig:
    """The `WorkerConfig` of a worker with `settings`, its Kafka clients
    connecting as `kafka`: every field mapped by name here, the dead-letter
    topic in effect, a heartbeat a fifth of the session."""
    return every_field(
        WorkerConfig,
        {
            "bootstrap": settings.bootstrap,
            "topic": settings.topic,
            "group": settings.group,
            "dlq_topic": settings.dlq,
            "window_seconds": settings.window_seconds,
            "window_events": settings.window_events,
            "mini_batch": settings.mini_batch,
            "mini_batch_ramp": settings.mini_batch_ramp,
            "in_flight": settings.in_flight,
            "max_message_bytes": _DEFAULT.max_message_bytes,  # no setting: Kafka's own record bound
            "decode_processes": settings.decode_processes,
            "session_timeout_ms": settings.session_timeout_ms,
            "heartbeat_interval_ms": max(100, settings.session_timeout_ms // 5),
            "mode": settings.mode,
            "geo_steps": settings.geo_steps,
            "sync_deadline_s": settings.sync_deadline_s,
            "geo_max_rows": settings.geo_max_rows,
            "worker_id": _DEFAULT.worker_id,  # the worker names itself <host>-<pid>
            "on_stale_offsets": settings.on_stale_offsets,
            "outage_deadline_s": settings.outage_deadline_s,
            "outage_log_every_s": _DEFAULT.outage_log_every_s,  # no setting: a line every few seconds
            "lag_warn_s": settings.lag_warn_s,
            "kafka": kafka,
        },
    )
