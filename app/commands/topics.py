"""``ctrps topics create``: create the click and dead-letter topics on a Kafka.

What a deployment runs once before its workers (the Kubernetes Job
``ctrps-topics``, the compose service ``topics``): it waits for the broker,
creates each ``NAME:PARTITIONS`` that does not exist, and checks that each
has at least the partitions asked (a topic made earlier with fewer leaves
workers idle: Kafka gives each partition to one worker of the group).
Exit codes: 0 every topic is there with its partitions; 1 the broker did not
answer within --timeout, or a topic has fewer partitions than asked (the line
names it); 2 a usage error (no broker address, a malformed --topic).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence

from consumers.broker import BrokerError, create_topics, topic_partitions, wait_for_metadata

from ..config.declared import SettingsError
from ..logs import log_event
from .kafka_flags import add_kafka_security_flags, kafka_security_from
from .parsers import Subcommands, add_command, subcommands

__all__ = ["add_topics_parser", "parse_topics", "run_topics"]

log = logging.getLogger("ctrps.topics")

_TOPICS = """\
create the Kafka topics the workers read and write

Manage the topics of a Kafka (an external one, or `ctrps broker`).

examples:
  ctrps topics create --bootstrap kafka:9092 --topic clicks:8 --topic clicks.dlq:1
"""

_CREATE = """\
create topics (NAME:PARTITIONS) that do not exist; check the partitions of those that do

Create each --topic that does not exist, waiting up to --timeout for the
broker; a topic that exists keeps its partitions, and fewer than asked is
an error (Kafka's own tools add partitions: kafka-topics --alter).

examples:
  ctrps topics create --bootstrap kafka:9092 --topic clicks:8 --topic clicks.dlq:1
  CTRPS_KAFKA_BOOTSTRAP=kafka:9092 ctrps topics create --topic clicks:8 --timeout 300

Exit codes: 0 done; 1 no answer from the broker within --timeout, or a
topic with fewer partitions than asked; 2 a usage error.
"""


def parse_topics(specs: Sequence[str]) -> dict[str, int]:
    """``NAME:PARTITIONS`` strings as name → partitions; `SettingsError` on a malformed one."""
    topics: dict[str, int] = {}
    for spec in specs:
        name, _, parts = spec.partition(":")
        if not name or not parts.isdigit() or int(parts) < 1:
            raise SettingsError(f"topic {spec!r} is not NAME:PARTITIONS")
        topics[name] = int(parts)
    return topics


def add_topics_parser(sub: Subcommands) -> None:
    """The ``topics`` command and its ``create`` subcommand."""
    topics = add_command(sub, "topics", _TOPICS)
    create = add_command(subcommands(topics, "topics_command", "SUBCOMMAND"), "create", _CREATE)
    create.add_argument("--bootstrap", help="Kafka bootstrap servers (default: CTRPS_KAFKA_BOOTSTRAP)")
    create.add_argument(
        "--topic", action="append", default=[], metavar="NAME:PARTITIONS", help="a topic to create; repeatable"
    )
    create.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the broker to answer (default 60)"
    )
    create.add_argument("--log-format", choices=("text", "json"), help="log line format")
    add_kafka_security_flags(create)


async def run_topics(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    """Run ``ctrps topics create``; 0, or an expected failure raised (one
    line and its exit code at the command's top level)."""
    bootstrap = args.bootstrap or env.get("CTRPS_KAFKA_BOOTSTRAP")
    if not bootstrap:
        raise SettingsError("no Kafka broker: pass --bootstrap HOST:PORT or set CTRPS_KAFKA_BOOTSTRAP")
    if not args.topic:
        raise SettingsError("no topic: pass --topic NAME:PARTITIONS (repeatable)")
    if not args.timeout > 0:
        raise SettingsError("--timeout must be > 0")
    wanted = parse_topics(args.topic)
    security = kafka_security_from(args, env)
    # A broker still starting (a Job beside a new Kafka) is waited for, not an error.
    await wait_for_metadata(bootstrap, args.timeout, security)
    await create_topics(bootstrap, wanted, security=security)
    have = await topic_partitions(bootstrap, list(wanted), security)
    short = {name: have.get(name, 0) for name, n in wanted.items() if have.get(name, 0) < n}
    if short:
        # The broker is configured otherwise than asked: BrokerError, exit 1.
        raise BrokerError(
            "; ".join(f"topic {name} has {have_n} partition(s), {wanted[name]} asked" for name, have_n in short.items())
            + ": add partitions with Kafka's tools (kafka-topics --alter --partitions N)"
        )
    log_event(log, "topics ready", bootstrap=bootstrap, topics=",".join(f"{k}:{have[k]}" for k in wanted))
    return 0
