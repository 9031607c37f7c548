"""``ctrps dlq``: read the dead-letter topic, newest first.

Each dead letter is printed with why it was refused and where it came from
(reason, detail, source topic, partition and offset) and its original bytes
(their start, marked truncated with the original size, for a message too
large for one dead-letter record); ``--json`` prints one JSON object per
line instead (the bytes as text, and as base64 when they are not UTF-8;
``truncated_from_bytes`` on a truncated one). Exit codes: 0 (also when there
is none); 1 the topic does not exist or the broker did not answer in time
(nothing at its address: at once); 2 a usage error (no broker address, an
unknown --reason). Each failure is one line.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import orjson

from consumers.broker import wait_for_metadata
from consumers.dlq_reader import ReadLetter, newest_dead_letters
from ps_core.model.events import REASONS

from ..config.declared import SettingsError
from ..startup import broker_answers
from .kafka_flags import add_kafka_security_flags, kafka_security_from
from .parsers import Subcommands, add_command

__all__ = ["add_dlq_parser", "run_dlq"]

_DLQ = """\
read the dead-letter topic: why each message was refused, newest first

Print the newest dead letters: reason, detail, source topic, partition and
offset, when the worker refused it, and the original bytes.

examples:
  ctrps dlq --bootstrap 127.0.0.1:9092                      # clicks.dlq, newest 20
  ctrps dlq --bootstrap 127.0.0.1:9092 --reason invalid_json --limit 5
  ctrps dlq --bootstrap 127.0.0.1:9092 --topic views.dlq --json | jq .detail

--topic falls back to CTRPS_DLQ_TOPIC, then to <CTRPS_TOPIC or clicks>.dlq.
"""
_SHOWN_BYTES = 300


def add_dlq_parser(sub: Subcommands) -> None:
    """The ``dlq`` subcommand."""
    p = add_command(sub, "dlq", _DLQ)
    p.add_argument("--bootstrap", help="Kafka bootstrap servers (default: CTRPS_KAFKA_BOOTSTRAP)")
    p.add_argument("--topic", help="the dead-letter topic (default: CTRPS_DLQ_TOPIC, else <topic>.dlq)")
    p.add_argument("--limit", type=int, default=20, help="newest dead letters to print (default 20)")
    p.add_argument("--reason", help="only this reason (e.g. invalid_json, missing_label), among the newest read")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument(
        "--timeout",
        type=float,
        default=20.0,
        help="seconds to wait for the broker's answers (default 20; nothing at --bootstrap: exit 1 within 3 s)",
    )
    add_kafka_security_flags(p)


async def run_dlq(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    """Run ``ctrps dlq`` with parsed `args`; returns the exit code (an
    expected failure is raised, one line at the command's top level)."""
    bootstrap = args.bootstrap or env.get("CTRPS_KAFKA_BOOTSTRAP")
    if not bootstrap:
        raise SettingsError("no Kafka broker: pass --bootstrap HOST:PORT or set CTRPS_KAFKA_BOOTSTRAP")
    if args.limit < 1 or not args.timeout > 0:
        raise SettingsError("--limit must be >= 1 and --timeout > 0")
    topic = args.topic or env.get("CTRPS_DLQ_TOPIC") or f"{env.get('CTRPS_TOPIC') or 'clicks'}.dlq"
    if args.reason is not None and args.reason not in REASONS:
        raise SettingsError(f"--reason {args.reason!r} is not a dead letter's reason: one of {', '.join(REASONS)}")
    security = kafka_security_from(args, env)
    await broker_answers(bootstrap)  # a wrong address: one line at once, not --timeout
    await wait_for_metadata(bootstrap, args.timeout, security)
    letters = await newest_dead_letters(
        bootstrap, topic, args.limit, reason=args.reason, security=security, timeout_s=args.timeout
    )
    out = sys.stdout
    for d in letters:
        out.write((orjson.dumps(_as_json(d)).decode() + "\n") if args.json else _as_text(d))
    if not args.json:
        out.write(f"{len(letters)} dead letter(s) of {topic}, newest first\n")
    return 0


def _when(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _as_json(d: ReadLetter) -> dict[str, Any]:
    out: dict[str, Any] = {
        "written_at": _when(d.written_ms),
        "reason": d.reason,
        "detail": d.detail,
        "source": {"topic": d.source_topic, "partition": d.source_partition, "offset": d.source_offset},
        "dlq": {"partition": d.partition, "offset": d.offset},
    }
    if d.original_bytes is not None:  # the value is the original's start
        out["truncated_from_bytes"] = d.original_bytes
    try:
        out["value"] = d.value.decode("utf-8")
    except UnicodeDecodeError:
        out["value_base64"] = base64.b64encode(d.value).decode("ascii")
    return out


def _as_text(d: ReadLetter) -> str:
    shown = d.value[:_SHOWN_BYTES]
    more = f" … ({len(d.value)} bytes)" if len(d.value) > _SHOWN_BYTES else ""
    if d.original_bytes is not None:
        more += f" [truncated: the original was {d.original_bytes} bytes]"
    return (
        f"{_when(d.written_ms)}  {d.reason}  {d.source_topic}[{d.source_partition}]@{d.source_offset}\n"
        f"  {d.detail}\n"
        f"  {shown!r}{more}\n"
    )
