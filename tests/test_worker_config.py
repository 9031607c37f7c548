"""`worker_config`: the one way from settings to a `WorkerConfig`. Every
field is mapped (a field added to `WorkerConfig` and not mapped fails), and a
value given by flag or by variable reaches the `WorkerConfig` of a worker
process, of the demo's worker and of the cluster's workers alike."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import pytest

from app.cli import build_parser
from app.cluster import worker_argv
from app.config.cluster import ClusterSettings
from app.config.declared import declared, to_argv
from app.config.demo import DemoSettings
from app.config.worker import WorkerSettings, every_field, worker_config
from app.demo import worker_settings_of
from consumers.kafka_security import KafkaSecurity
from consumers.worker import WorkerConfig

URLS = ("http://127.0.0.1:7100", "http://127.0.0.1:7101")

# Every setting a WorkerConfig field reads, away from its default (and valid).
AWAY = {
    "bootstrap": "k:9092",
    "topic": "views",
    "group": "g2",
    "dlq_topic": "views.dead",
    "window_seconds": 7.5,
    "window_events": 500,
    "mini_batch": 32,
    "mini_batch_ramp": 8,
    "in_flight": 3,
    "decode_processes": 0,
    "session_timeout_ms": 20_000,
    "mode": "geo",
    "geo_steps": 3,
    "sync_deadline_s": 9.0,
    "geo_max_rows": 1234,
    "on_stale_offsets": "fail",
    "outage_deadline_s": 30.0,
    "lag_warn_s": 0.0,
}

Path = Callable[[Sequence[str], Mapping[str, str]], WorkerConfig]
"""Flags and variables to the WorkerConfig of one way of starting a worker."""

# The WorkerConfig fields no setting of the same name gives, and whence.
NOT_BY_NAME = {"dlq_topic", "heartbeat_interval_ms", "max_message_bytes", "worker_id", "outage_log_every_s", "kafka"}


def test_every_workerconfig_field_is_mapped_from_its_setting() -> None:
    settings = WorkerSettings(shards=URLS, **AWAY)
    kafka = KafkaSecurity(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", sasl_username="u", sasl_password="p")
    config = worker_config(settings, kafka)
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    by_name = names - NOT_BY_NAME
    # A WorkerConfig field added since is neither: it must be mapped (and this test told).
    assert by_name <= {f.name for f, _, _ in declared(WorkerSettings)}, sorted(by_name)
    default = WorkerConfig(bootstrap="")
    for name in sorted(by_name):
        assert getattr(config, name) == getattr(settings, name) != getattr(default, name), name
    assert config.dlq_topic == "views.dead" and config.kafka == kafka
    assert config.heartbeat_interval_ms == 4000  # a fifth of the session
    assert worker_config(WorkerSettings(shards=URLS, bootstrap="k:9092", topic="t")).dlq_topic == "t.dlq"


def test_a_field_left_unmapped_or_unknown_is_refused_by_name() -> None:
    @dataclasses.dataclass(frozen=True)
    class Grown(WorkerConfig):
        max_poll_records: int = 500

    values = dataclasses.asdict(worker_config(WorkerSettings(shards=URLS, bootstrap="k:9092")))
    values["kafka"] = KafkaSecurity()
    with pytest.raises(TypeError, match="Grown fields not mapped from the settings: max_poll_records"):
        every_field(Grown, values)
    assert every_field(Grown, {**values, "max_poll_records": 7}).max_poll_records == 7
    with pytest.raises(TypeError, match="unexpected keyword argument 'surplus'"):
        every_field(WorkerConfig, {**values, "surplus": 1})


def _worker(argv: Sequence[str], env: Mapping[str, str]) -> WorkerConfig:
    """The WorkerConfig a `ctrps worker` process builds from `argv` and `env`."""
    return worker_config(WorkerSettings.from_args(build_parser().parse_args(argv), env))


def _demo(flags: Sequence[str], env: Mapping[str, str]) -> WorkerConfig:
    demo = DemoSettings.from_args(build_parser().parse_args(["demo", *flags]), env)
    return worker_config(worker_settings_of(demo, "k:9092"))


def _cluster(flags: Sequence[str], env: Mapping[str, str]) -> WorkerConfig:
    cluster = ClusterSettings.from_args(build_parser().parse_args(["cluster", *flags]), env)
    # A worker child reads its flags; its environment has the cluster's variables too.
    return _worker(worker_argv(cluster, "k:9092", list(URLS)), env)


@pytest.mark.parametrize(
    ("path", "window_env", "mode_env"),
    [
        (lambda f, e: _worker(["worker", "--bootstrap", "k:9092", "--shards", URLS[0], *f], e), "CTRPS_WINDOW_SECONDS", "CTRPS_MODE"),
        (_demo, "CTRPS_DEMO_WINDOW_SECONDS", None),
        (_cluster, "CTRPS_CLUSTER_WINDOW_SECONDS", "CTRPS_CLUSTER_MODE"),
    ],
    ids=["worker", "demo", "cluster"],
)  # fmt: skip
def test_a_flag_and_a_variable_reach_the_workerconfig(path: Path, window_env: str, mode_env: str | None) -> None:
    assert path(["--window-seconds", "3.5"], {}).window_seconds == 3.5
    assert path([], {window_env: "4.5"}).window_seconds == 4.5
    assert path(["--window-seconds", "3.5"], {window_env: "4.5"}).window_seconds == 3.5  # the flag wins
    if mode_env is not None:
        assert path(["--mode", "geo"], {}).mode == "geo"
        assert path([], {mode_env: "sync"}).mode == "sync"


def test_the_clusters_workers_are_started_with_its_values_given() -> None:
    cluster = ClusterSettings(window_seconds=2.5, mode="async", log_format="json")
    args = build_parser().parse_args(worker_argv(cluster, "k:9092", list(URLS)))
    worker = WorkerSettings.from_args(args, {})
    assert (worker.bootstrap, worker.shards, worker.topic) == ("k:9092", URLS, "clicks")
    assert (worker.window_seconds, worker.mode, worker.log_format) == (2.5, "async", "json")
    # --mode is given even at its default: a declared model's mode does not replace it.
    assert worker.inherit == {"model"}


def test_to_argv_reads_back_as_the_same_settings() -> None:
    settings = WorkerSettings(
        shards=URLS, also_train=("b", "c"), model="fm", model_name="m", numeric="raw", max_staleness=-1, **AWAY
    )
    names = tuple(f.name for f, s, _ in declared(WorkerSettings) if s.flag is not None)
    argv = to_argv(settings, names)
    assert argv.count("--also-train") == 2  # a repeated flag, once per item
    assert WorkerSettings.from_args(build_parser().parse_args(["worker", *argv]), {}) == settings
    with pytest.raises(ValueError, match="use_rpc has no flag"):
        to_argv(settings, ("use_rpc",))
