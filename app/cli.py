"""The ``ctrps`` command line: one subcommand per role."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .commands.parsers import add_command, subcommands

# The roles, their settings and their libraries are imported where a command
# needs them, not here: a worker's decode processes are spawned, and a spawned
# process imports its parent's main module (this one, under ``python -m
# app.cli``) before it decodes anything; importing every role here made each
# of them load aiohttp, aiokafka and the whole library (about 0.7 s and 35 MB
# more than decoding needs; `tests/test_packaging.py`).

__all__ = ["main", "build_parser"]

_SHARD = """\
serve one shard of the sparse tables over HTTP

Serve one shard of the sparse tables (binary pull/push RPC, stats, health).

example:
  ctrps shard --port 7100 --shard-id 0 --num-shards 2 \\
      --shards http://127.0.0.1:7100,http://127.0.0.1:7101 --exports-dir ./exports
  ctrps shard --port 7101 --shard-id 1 --num-shards 2   # tables declared by clients
  ctrps shard --port 7100 --no-exports \\
      --table lr,optimizer=ftrl,alpha=0.05,beta=1,l1=1,l2=1

Shard 0 hosts the coordinator (leases, cuts) and exports every
--export-interval seconds to <exports-dir>/<model>/, one directory per model;
at start every shard restores its slice of the newest export there
(--no-restore starts empty).

Every flag falls back to a CTRPS_* variable (CTRPS_SHARD_PORT, CTRPS_SHARD_ID,
CTRPS_NUM_SHARDS,
CTRPS_TABLES="lr,optimizer=ftrl;fm_v,dim=8,optimizer=adagrad", ...).
"""

_BROKER = """\
run the embedded Kafka-protocol broker (development and tests)

Run the embedded Kafka-protocol broker on 127.0.0.1 and create topics.

example:
  ctrps broker --port 9092 --topic clicks:4 --topic clicks.dlq:1
  # then: CTRPS_KAFKA_BOOTSTRAP=127.0.0.1:9092 ...
  ctrps broker --host 0.0.0.0 --advertised-host ctrps-broker --port 9092   # in a pod

Runs the embedded Tansu broker (memory only) until Ctrl-C or SIGTERM. It
keeps every record it is sent (no retention): it grows by about 0.7-0.9 KB
per event, past --max-rss-mb it warns once a minute; --metrics-port serves
its resident memory. For long runs use a Kafka with retention.
"""

_WORKER = """\
train from the Kafka click stream, pushing to shard servers

A training worker: consume click events in micro-batch windows, predict them
first (progressive validation), train, commit.

example:
  ctrps broker --port 9092 &
  ctrps shard --port 7100 --shard-id 0 --num-shards 2 &
  ctrps shard --port 7101 --shard-id 1 --num-shards 2 &
  ctrps worker --bootstrap 127.0.0.1:9092 \\
      --shards http://127.0.0.1:7100,http://127.0.0.1:7101 --window-seconds 5

Training three models on the same records, one decode (create them first
with `ctrps model create` to give them their own type and optimizer):
  ctrps worker --bootstrap 127.0.0.1:9092 --model-name ctr \
      --also-train ads --also-train feed --shards http://127.0.0.1:7100,http://127.0.0.1:7101

Training a model in geo mode instead (every worker of a model must run its
mode: start each of them so):
  ctrps worker --bootstrap 127.0.0.1:9092 --mode geo --geo-steps 8 \\
      --shards http://127.0.0.1:7100,http://127.0.0.1:7101

Every flag falls back to a CTRPS_* variable (CTRPS_KAFKA_BOOTSTRAP,
CTRPS_SHARDS, CTRPS_TOPIC, CTRPS_WINDOW_SECONDS, ...). One log line per
window.
"""

_SERVE = """\
serve the HTTP prediction API from shard servers

The HTTP API: predictions, weights, model info, health, metrics (GET
/openapi.json describes it), reading the current weights from the shards.

example:
  ctrps serve --shards http://127.0.0.1:7100,http://127.0.0.1:7101 --port 8080
  curl -s localhost:8080/v1/predict -d '{"events": [{"features": {"C1": "f53fd833", "I2": 10}}]}'
  ctrps serve --follow exports/ctr --port 8081   # a replica: the exports, in memory
  ctrps serve --follow exports --follow-all --port 8082   # a replica of every model

With --follow the API serves the newest export of exports/<model> (base and
deltas) from memory, without the shards, and applies each new delta as it
appears (checked every --follow-interval seconds; the model comes from the
manifest). GET /v1/model shows the version served; /readyz waits for one.

Every flag falls back to a CTRPS_* variable (CTRPS_SHARDS, CTRPS_FOLLOW,
CTRPS_FOLLOW_INTERVAL, CTRPS_API_PORT, CTRPS_MODEL, CTRPS_MODEL_NAME,
CTRPS_MAX_EVENTS, ...). Set CTRPS_ADMIN_TOKEN (or CTRPS_ADMIN_TOKEN_FILE) to
require "Authorization: Bearer <token>" on the routes that change things:
POST /v1/status (a report to the status board), POST /v1/exports (cut and
write a version now) and POST /v1/exports/compact (fold the newest chain into
a base). Predictions, weights, model info, metrics and the dashboard stay
open. On a non-loopback --host the API refuses to start without a token (or
--insecure).
"""

_DEMO = """\
the one-command demo: broker, producer, shards, worker and API in one process

The one-command demo: embedded broker, synthetic producer, shards, a worker and
the HTTP API in one process; one progress line per window.

examples:
  ctrps demo                                   # until Ctrl-C; API on http://127.0.0.1:8080
  ctrps demo --duration 60 --port 0 --shards 4 --rate 10000 --log-format json

Nothing else to start: the embedded Kafka-protocol broker (or the one at
CTRPS_KAFKA_BOOTSTRAP), a synthetic producer, in-process shards, a worker and
the HTTP API. Flags fall back to CTRPS_DEMO_DURATION, CTRPS_DEMO_PORT,
CTRPS_DEMO_SHARDS, CTRPS_DEMO_RATE, ... One line per window. Admin routes
need "Authorization: Bearer <token>": CTRPS_ADMIN_TOKEN, or else a token made
for the run, shown in the banner (--insecure leaves them open); a
non-loopback --host needs CTRPS_ADMIN_TOKEN (or --insecure).
"""

_CLUSTER = """\
every role as its own process on loopback, supervised

Run broker, shards, API, workers and a producer as child processes on
127.0.0.1; stop them all on Ctrl-C or when one dies.

examples:
  ctrps cluster                                # broker, 2 shards, API, 2 workers, producer
  ctrps cluster --shards 4 --workers 3 --port 8081 --produce-rate 5000 --duration 120
  CTRPS_KAFKA_BOOTSTRAP=kafka:9092 ctrps cluster --no-produce

Every role is its own process (ctrps broker/shard/serve/worker/produce) on
127.0.0.1, started in that order, each line of output prefixed with its role,
e.g. [shard-0]. Ctrl-C stops them in reverse order; they end with the
cluster even if it is killed. Admin routes need "Authorization: Bearer
<token>": CTRPS_ADMIN_TOKEN, or else a token made for the run (printed once,
and in the file the ready line names). A --port already taken: exit 1.
Flags fall back to CTRPS_CLUSTER_SHARDS, CTRPS_CLUSTER_WORKERS, ...
"""


_TOKEN = """\
print the shard token of a scope, derived from the cluster secret

Print the token of one scope (read: pulls and listings; train: pushes, leases,
reports; admin: snapshots, exports, membership, restores), derived from
CTRPS_CLUSTER_SECRET or the file named by CTRPS_CLUSTER_SECRET_FILE. Give it to
a role as CTRPS_SHARD_TOKEN (or CTRPS_SHARD_TOKEN_FILE).

example:
  export CTRPS_CLUSTER_SECRET_FILE=/run/secrets/ctrps-cluster   # what the shards hold
  CTRPS_SHARD_TOKEN=$(ctrps token --scope train) ctrps worker --shards https://shard-0:7100
  ctrps token --scope read > /run/secrets/ctrps-read-token       # for a serving API

Exit 2 when no secret is set (or it is shorter than 16 bytes).
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``ctrps`` parser: every command and its flags."""
    from .commands.dlq import add_dlq_parser
    from .commands.export import add_export_parser
    from .commands.kafka_flags import add_kafka_security_flags
    from .commands.model import add_model_parser
    from .commands.produce import add_produce_parser
    from .commands.rebalance import add_rebalance_parser
    from .commands.topics import add_topics_parser
    from .config.broker import BrokerSettings
    from .config.cluster import ClusterSettings
    from .config.declared import add_flags
    from .config.demo import DemoSettings
    from .config.serve import ApiSettings
    from .config.shard import ShardSettings
    from .config.worker import WorkerSettings
    from .security import add_security_flags

    parser = argparse.ArgumentParser(
        prog="ctrps",
        description="ctrps: an online-learning parameter server for sparse CTR models.",
        epilog="example:\n  ctrps shard --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ctrps {_version()}")
    sub = subcommands(parser, "command", "COMMAND")

    shard = add_command(sub, "shard", _SHARD)
    add_flags(shard, ShardSettings)
    add_security_flags(shard)

    worker = add_command(sub, "worker", _WORKER)
    add_flags(worker, WorkerSettings)
    add_security_flags(worker, serves=False)
    add_kafka_security_flags(worker)

    broker = add_command(sub, "broker", _BROKER)
    broker.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    broker.add_argument(
        "--topic",
        action="append",
        default=[],
        metavar="NAME:PARTITIONS",
        help="create a topic; repeatable (default clicks:4 and clicks.dlq:1)",
    )
    broker.add_argument("--log-format", choices=("text", "json"), help="log line format")
    add_flags(broker, BrokerSettings)

    serve = add_command(sub, "serve", _SERVE)
    add_flags(serve, ApiSettings)
    add_security_flags(serve)

    add_produce_parser(sub)
    add_export_parser(sub)
    add_model_parser(sub)
    add_rebalance_parser(sub)
    add_dlq_parser(sub)
    add_topics_parser(sub)

    token = add_command(sub, "token", _TOKEN)
    token.add_argument("--scope", required=True, choices=("read", "train", "admin"), help="the token's scope")

    demo = add_command(sub, "demo", _DEMO)
    add_flags(demo, DemoSettings)
    demo.add_argument(
        "--insecure", action="store_true", default=None,
        help="let the API listen on a non-loopback --host without CTRPS_ADMIN_TOKEN",
    )  # fmt: skip
    add_kafka_security_flags(demo)

    cluster = add_command(sub, "cluster", _CLUSTER)
    add_flags(cluster, ClusterSettings)
    add_kafka_security_flags(cluster)
    _add_logging_flags(parser)
    return parser


def _add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` and ``--kafka-log-level`` (and ``--log-format`` where a
    command lacks it) on every command: each leaf of the subcommand tree,
    ``produce synthetic`` and ``produce file`` included."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subs:
        for action in subs:
            for child in set(action.choices.values()):
                _add_logging_flags(child)
        return
    from .config.declared import add_flags
    from .config.log import LogSettings

    has_format = any("--log-format" in a.option_strings for a in parser._actions)
    add_flags(parser, LogSettings, skip=("log_format",) if has_format else ())


def _role(args: argparse.Namespace) -> tuple[str, Callable[[], Coroutine[Any, Any, None]]]:
    """The log format and the coroutine of a long-running role, from its flags.

    Raises `SettingsError` on unusable flags."""
    from .commands.kafka_flags import kafka_security_from
    from .config.broker import BrokerSettings
    from .config.serve import ApiSettings
    from .config.shard import ShardSettings
    from .config.worker import WorkerSettings
    from .security import SecuritySettings

    if args.command == "shard":
        shard = ShardSettings.from_args(args)
        security = SecuritySettings.from_args(args)
        # Before anything starts: a shard exposed without credentials is a settings error.
        security.check_exposed("shard", shard.host, has_credentials=bool(security.cluster_secret))
        from .roles.shard import run_shard

        return shard.log_format, lambda: run_shard(shard, security=security)
    if args.command == "worker":
        worker = WorkerSettings.from_args(args)
        worker_security = SecuritySettings.from_args(args)
        kafka = kafka_security_from(args)
        from .roles.worker import run_worker

        return worker.log_format, lambda: run_worker(worker, security=worker_security, kafka=kafka)
    if args.command == "serve":
        from .roles.serve import run_serve

        api = ApiSettings.from_args(args)
        api_security = SecuritySettings.from_args(args)
        return api.log_format, lambda: run_serve(api, security=api_security)
    if args.command == "broker":
        from .commands.topics import parse_topics

        topics = parse_topics(args.topic or ["clicks:4", "clicks.dlq:1"])
        broker = BrokerSettings.from_args(args)
        from .roles.broker import run_broker

        return args.log_format, lambda: run_broker(broker.port, topics, settings=broker)
    raise ValueError(f"unknown command {args.command!r}")


def _compose(args: argparse.Namespace) -> int:
    """Run ``demo`` or ``cluster``: compositions of roles that return an exit status."""
    import uvloop

    from .commands.kafka_flags import kafka_security_from
    from .config.cluster import ClusterSettings
    from .config.demo import DemoSettings

    if args.command == "demo":
        demo = DemoSettings.from_args(args)
        demo_kafka = kafka_security_from(args)
        from .demo import run_demo

        return int(uvloop.run(run_demo(demo, kafka=demo_kafka)))
    cluster = ClusterSettings.from_args(args)
    kafka = kafka_security_from(args)
    from .cluster import run_cluster

    return int(uvloop.run(run_cluster(cluster, kafka=kafka)))


def _print_token(args: argparse.Namespace) -> int:
    """``ctrps token``: the scope's token on stdout (the secret never leaves)."""
    from ps_core.net.auth import Scope, derive_token

    from .config.declared import SettingsError
    from .security import SecuritySettings

    security = SecuritySettings.from_args(None)
    if not security.cluster_secret:
        raise SettingsError("no cluster secret: set CTRPS_CLUSTER_SECRET or CTRPS_CLUSTER_SECRET_FILE")
    sys.stdout.write(derive_token(security.cluster_secret, Scope.parse(args.scope)) + "\n")
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command; its exit status."""
    import uvloop

    from .commands.dlq import run_dlq
    from .commands.export import run_export
    from .commands.model import run_model
    from .commands.produce import run_produce
    from .commands.rebalance import run_rebalance
    from .commands.topics import run_topics

    if args.command == "produce":
        return int(uvloop.run(run_produce(args)))
    if args.command == "export":
        return int(uvloop.run(run_export(args)))
    if args.command == "model":
        return int(uvloop.run(run_model(args)))
    if args.command == "rebalance":
        return int(uvloop.run(run_rebalance(args)))
    if args.command == "dlq":
        return int(uvloop.run(run_dlq(args)))
    if args.command == "topics":
        return int(uvloop.run(run_topics(args)))
    if args.command == "token":
        return _print_token(args)
    if args.command in ("demo", "cluster"):
        return _compose(args)
    _, role = _role(args)
    uvloop.run(role())
    return 0


def _configure(args: argparse.Namespace) -> None:
    """Logging as the flags and ``CTRPS_LOG_*`` say; raises `SettingsError`
    (reported in text, the format not being known)."""
    from .config.log import LogSettings
    from .logs import configure_logging, parse_level

    configure_logging("text")
    logs = LogSettings.from_args(args)
    kafka = parse_level(logs.kafka_level) if logs.kafka_level else None
    configure_logging(logs.log_format, parse_level(logs.level), kafka)
    if args.command == "cluster":
        # Its children are `ctrps` commands that inherit its environment: they log alike.
        os.environ["CTRPS_LOG_LEVEL"] = logs.level
        if logs.kafka_level:
            os.environ["CTRPS_KAFKA_LOG_LEVEL"] = logs.kafka_level


def run_command(args: argparse.Namespace, run: Callable[[argparse.Namespace], int]) -> int:
    """``run(args)`` with the command's failures reported: an expected failure
    (`app.failures`) is one error line, ``str(exc)``, and its exit code; any
    other exception is a bug, logged with its traceback (in the chosen format),
    exit 1. Ctrl-C before a role's own handler is installed exits 130."""
    from .failures import EXIT_FAILURE, expected_failure

    log = logging.getLogger(f"ctrps {args.command}")  # lines read "ctrps shard: ..."
    try:
        _configure(args)
        return run(args)
    except KeyboardInterrupt:
        return 130
    except (Exception, asyncio.CancelledError) as exc:  # a stray cancellation is a bug too
        found = None if isinstance(exc, asyncio.CancelledError) else expected_failure(exc)
        if found is None:
            log.critical(
                "crashed: %s: %s",
                type(exc).__name__,
                exc,
                exc_info=exc,
                extra={"fields": {"exit_code": EXIT_FAILURE}},
            )
            return EXIT_FAILURE
        message, code = found
        log.error(message, extra={"fields": {"error": type(exc).__name__, "exit_code": code}})
        return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ctrps`` console script. ``ctrps`` alone prints
    the help (every command and an example) and exits 0."""
    parser = build_parser()
    given = sys.argv[1:] if argv is None else list(argv)
    if not given:
        parser.print_help()
        return 0
    args = parser.parse_args(given)  # usage errors: argparse's message, exit 2
    return run_command(args, _dispatch)


def _version() -> str:
    """The installed package's version (this checkout's pyproject when not installed)."""
    try:
        return importlib.metadata.version("ctrps")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
