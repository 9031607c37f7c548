"""The ``ctrps`` command line: one subcommand per role."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Callable, Coroutine, Sequence

import uvloop

from .logs import configure_logging
from .produce_cli import add_produce_parser, run_produce
from .settings import SettingsError, ShardSettings, WorkerSettings

__all__ = ["main", "build_parser"]

_SHARD_EXAMPLE = """\
example:
  ctrps shard --port 7100 --shard-id 0 --num-shards 2 \\
      --table lr,optimizer=ftrl,alpha=0.05,beta=1,l1=1,l2=1
  ctrps shard --port 7101 --shard-id 1 --num-shards 2   # tables declared by clients

Every flag falls back to a CTRPS_* variable (CTRPS_SHARD_PORT, CTRPS_SHARD_ID,
CTRPS_NUM_SHARDS, CTRPS_TABLES="lr,optimizer=ftrl;fm_v,dim=8,optimizer=adagrad", ...).
"""

_BROKER_EXAMPLE = """\
example:
  ctrps broker --port 9092 --topic clicks:4 --topic clicks.dlq:1
  # then: CTRPS_KAFKA_BOOTSTRAP=127.0.0.1:9092 ...

Runs the embedded Tansu broker (memory only) until Ctrl-C or SIGTERM.
"""

_WORKER_EXAMPLE = """\
example:
  ctrps broker --port 9092 &
  ctrps shard --port 7100 --shard-id 0 --num-shards 2 &
  ctrps shard --port 7101 --shard-id 1 --num-shards 2 &
  ctrps worker --bootstrap 127.0.0.1:9092 \\
      --shards http://127.0.0.1:7100,http://127.0.0.1:7101 --window-seconds 5

Every flag falls back to a CTRPS_* variable (CTRPS_KAFKA_BOOTSTRAP, CTRPS_SHARDS,
CTRPS_TOPIC, CTRPS_WINDOW_SECONDS, ...). One log line per window.
"""

_SERVE_EXAMPLE = """\
example:
  ctrps serve --shards http://127.0.0.1:7100,http://127.0.0.1:7101 --port 8080
  curl -s localhost:8080/v1/predict -d '{"events": [{"features": {"site": "a3f09", "hour": "13"}}]}'

Every flag falls back to a CTRPS_* variable (CTRPS_SHARDS, CTRPS_API_PORT,
CTRPS_MODEL, CTRPS_MODEL_NAME, CTRPS_MAX_EVENTS, ...). Set CTRPS_ADMIN_TOKEN to
require "Authorization: Bearer <token>" on admin routes (POST /v1/status).
"""

_DEMO_EXAMPLE = """\
example:
  ctrps demo
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ctrps",
        description="ctrps: an online-learning parameter server for sparse CTR models.",
        epilog="example:\n  ctrps shard --help",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    shard = sub.add_parser(
        "shard",
        help="serve one shard of the sparse tables over HTTP",
        description="Serve one shard of the sparse tables (binary pull/push RPC, stats, health).",
        epilog=_SHARD_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    shard.add_argument("--host", help="listen address (default 127.0.0.1)")
    shard.add_argument("--port", type=int, help="listen port; 0 picks a free one (default 7100)")
    shard.add_argument("--shard-id", type=int, help="this shard's number (default 0)")
    shard.add_argument("--num-shards", type=int, help="shards in the cluster (default 1)")
    shard.add_argument(
        "--table",
        action="append",
        metavar="SPEC",
        help="declare a table: NAME[,dim=D][,optimizer=ftrl|adagrad|sgd][,init_scale=S]"
        "[,seed=N][,HYPER=V...]; repeatable",
    )
    shard.add_argument("--max-body-mb", type=int, help="largest request body, MiB (default 512)")
    shard.add_argument(
        "--stats-interval", type=float, help="seconds between progress lines; 0 = off (default 60)"
    )
    shard.add_argument("--log-format", choices=("text", "json"), help="log line format")

    worker = sub.add_parser(
        "worker",
        help="train from the Kafka click stream, pushing to shard servers",
        description="A training worker: consume click events in micro-batch windows, "
        "predict them first (progressive validation), train, commit.",
        epilog=_WORKER_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    worker.add_argument("--bootstrap", help="Kafka bootstrap servers (host:port)")
    worker.add_argument("--shards", help="shard URLs, comma-separated, shard 0 first")
    worker.add_argument("--topic", help="topic of click events (default clicks)")
    worker.add_argument("--group", help="consumer group (default ctrps)")
    worker.add_argument("--dlq-topic", help="dead-letter topic (default <topic>.dlq)")
    worker.add_argument("--window-seconds", type=float, help="window span in event time (default 60)")
    worker.add_argument("--window-events", type=int, help="most events per window (default 100000)")
    worker.add_argument("--mini-batch", type=int, help="events per pull/push step (default 256)")
    worker.add_argument("--model", choices=("lr", "fm"), help="model kind (default lr)")
    worker.add_argument("--model-name", help="model name (default ctr)")
    worker.add_argument("--decode-processes", type=int, help="decoding processes (default 1)")
    worker.add_argument(
        "--session-timeout-ms", type=int, help="Kafka session timeout (default 10000)"
    )
    worker.add_argument("--log-format", choices=("text", "json"), help="log line format")

    broker = sub.add_parser(
        "broker",
        help="run the embedded Kafka-protocol broker (development and tests)",
        description="Run the embedded Kafka-protocol broker on 127.0.0.1 and create topics.",
        epilog=_BROKER_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    broker.add_argument("--port", type=int, default=0, help="listen port (default: a free one)")
    broker.add_argument(
        "--topic",
        action="append",
        default=[],
        metavar="NAME:PARTITIONS",
        help="create a topic; repeatable (default clicks:4 and clicks.dlq:1)",
    )
    broker.add_argument("--log-format", choices=("text", "json"), default="text")

    serve = sub.add_parser(
        "serve",
        help="serve the HTTP prediction API from shard servers",
        description="The HTTP API: predictions, weights, model info, health, metrics "
        "(GET /openapi.json describes it), reading the current weights from the shards.",
        epilog=_SERVE_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("--shards", help="shard URLs, comma-separated, shard 0 first")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port; 0 picks a free one (default 8080)")
    serve.add_argument("--model", choices=("lr", "fm"), help="model kind (default lr)")
    serve.add_argument("--model-name", help="model name (default ctr)")
    serve.add_argument("--max-events", type=int, help="most events per request (default 10000)")
    serve.add_argument(
        "--max-body-bytes", type=int, help="largest request body (default 16777216)"
    )
    serve.add_argument(
        "--shard-deadline", type=float, help="seconds a shard call is retried before 503 (default 2)"
    )
    serve.add_argument("--log-format", choices=("text", "json"), help="log line format")

    add_produce_parser(sub)

    sub.add_parser(
        "demo",
        help="one-command demo (arrives with the app)",
        description="The one-command demo: embedded broker, producer, shards, worker and API.",
        epilog=_DEMO_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _parse_topics(specs: Sequence[str]) -> dict[str, int]:
    topics: dict[str, int] = {}
    for spec in specs:
        name, _, parts = spec.partition(":")
        if not name or not parts.isdigit() or int(parts) < 1:
            raise ValueError(f"topic {spec!r} is not NAME:PARTITIONS")
        topics[name] = int(parts)
    return topics


def _role(args: argparse.Namespace) -> tuple[str, Callable[[], Coroutine[Any, Any, None]]]:
    """The log format and the coroutine of a long-running role, from its flags.

    Raises `SettingsError` or `ValueError` on unusable flags."""
    if args.command == "shard":
        shard = ShardSettings.from_args(args)
        from .shard_role import run_shard

        return shard.log_format, lambda: run_shard(shard)
    if args.command == "worker":
        worker = WorkerSettings.from_args(args)
        from .worker_role import run_worker

        return worker.log_format, lambda: run_worker(worker)
    if args.command == "serve":
        from .serve_role import run_serve
        from .settings import ApiSettings

        api = ApiSettings.from_args(args)
        return api.log_format, lambda: run_serve(api)
    if args.command == "broker":
        topics = _parse_topics(args.topic or ["clicks:4", "clicks.dlq:1"])
        from .broker_role import run_broker

        return args.log_format, lambda: run_broker(args.port, topics)
    raise ValueError(f"unknown command {args.command!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ctrps`` console script."""
    args = build_parser().parse_args(argv)
    if args.command == "produce":
        return int(uvloop.run(run_produce(args)))
    if args.command == "demo":
        print(
            "ctrps demo is not yet available: it arrives with the HTTP prediction API. "
            "Meanwhile README.md shows the pipeline with ctrps broker, shard, worker and produce.",
            file=sys.stderr,
        )
        return 3
    try:
        log_format, role = _role(args)
    except (SettingsError, ValueError) as exc:
        print(f"ctrps {args.command}: {exc}", file=sys.stderr)
        return 2
    configure_logging(log_format)
    uvloop.run(role())
    return 0


if __name__ == "__main__":
    sys.exit(main())
