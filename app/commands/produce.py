"""``ctrps produce``: send the synthetic stream or a data file to Kafka.

Wired into ``app/cli.py`` by `add_produce_parser` (adds the ``produce``
subcommand with its ``synthetic`` and ``file`` sources) and `run_produce`
(runs it; returns the exit code). Also runnable alone:
``python -m app.commands.produce produce synthetic --events 1000``.

Exit codes: 0 done (or stopped by a signal); 1 the broker could not be
reached or refused a send, or no event of a file was usable; 2 a usage error
(no broker address, no such file, an unusable header); 3 the broker stopped
acknowledging for ``--delivery-timeout`` seconds (dead, hung or unreachable)
and the producer gave up. Each failure is one error line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from consumers.broker import BrokerError, create_topics, wait_for_metadata
from consumers.formats import FORMATS, FormatError, iter_file
from consumers.producer import COMPRESSIONS, EventSource, produce
from ps_core.synthetic import PROFILES, SyntheticStream, profile_stream

from ..config.declared import SettingsError
from ..logs import log_event
from ..signals import stop_on_signals
from ..startup import broker_answers
from .kafka_flags import add_kafka_security_flags, kafka_security_from
from .parsers import Subcommands, add_command, subcommands

__all__ = ["add_produce_parser", "run_produce"]

log = logging.getLogger("ctrps.produce")

_PRODUCE = """\
send synthetic events or a Criteo/Avazu/JSON-lines file to Kafka

Send click events to a Kafka topic: the synthetic stream or a data file.

examples:
  ctrps broker --port 9092 &                  # or any Kafka: set CTRPS_KAFKA_BOOTSTRAP
  ctrps produce synthetic --events 1000000 --rate 20000 --bootstrap 127.0.0.1:9092
  ctrps produce file --format criteo train.txt.gz --bootstrap 127.0.0.1:9092
"""

_SYNTHETIC = """\
the synthetic Criteo-like stream with a known ground truth

Send N events of the synthetic stream (deterministic for a seed).

examples:
  CTRPS_KAFKA_BOOTSTRAP=127.0.0.1:9092 ctrps produce synthetic --events 200000 --rate 5000
  ctrps produce synthetic --profile avazu --events 1000000 --bootstrap 127.0.0.1:9092

Events are Criteo-like (I1..I13 counts, C1..C26 hex categoricals) with a hidden
logistic model; each carries p_true, its true click probability. The same
--seed gives the same events.

--profile NAME sends a stream shaped like a real CTR log instead (fields,
cardinalities, missing values, click rate and learnability as published for
the dataset; docs/synthetic.md); --seed, --drift, --base-ctr and --fresh
given with it override the profile's own. Profiles:
""" + "\n".join(f"  {p.name:13s} {p.summary}" for p in PROFILES.values())

_FILE = """\
a Criteo TSV, Avazu CSV or JSON-lines file (.gz allowed)

Send the rows of a data file; bad rows are skipped and reported by reason.

examples:
  ctrps produce file --format criteo day_0.gz --bootstrap 127.0.0.1:9092
  ctrps produce file --format avazu train.gz --limit 1000000 --topic avazu
  ctrps produce file --format jsonl events.jsonl

Formats: criteo (TSV: label, I1..I13, C1..C26), avazu (CSV with header; click is
the label, hour YYMMDDHH the time), jsonl (one event object per line). A .gz
suffix is read as gzip. Bad rows are skipped, counted by reason and reported.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--bootstrap",
        metavar="HOST:PORT",
        help="Kafka bootstrap address (default: $CTRPS_KAFKA_BOOTSTRAP)",
    )
    p.add_argument("--topic", default="clicks", help="topic to send to (default clicks)")
    p.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="partitions when the topic is created (default 4); an existing topic keeps its own",
    )
    p.add_argument(
        "--rate",
        type=float,
        help="events per second (default: as fast as possible); synthetic events' time advances at the same "
        "rate (without --rate: 1000 a second, or a --profile's dataset's own rate)",
    )
    p.add_argument("--batch-size", type=int, default=1000, help="events per send (default 1000)")
    p.add_argument("--log-format", choices=("text", "json"), help="log line format (CTRPS_LOG_FORMAT)")
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        help="record-batch codec (default none; CTRPS_COMPRESSION)",
    )
    p.add_argument(
        "--delivery-timeout",
        type=float,
        metavar="S",
        help="seconds a send may wait for the broker's acknowledgement before the "
        "producer gives up with exit code 3 (default 10; CTRPS_DELIVERY_TIMEOUT)",
    )
    add_kafka_security_flags(p)


_STREAM_FLAGS = {
    "seed": "stream and model seed",
    "drift": "rotation of the true weights, radians per hour of event time",
    "base_ctr": "mean click rate",
    "fresh": "probability that a categorical value is a brand-new id, seen once: a long tail",
}
"""`produce synthetic`'s flags for `SyntheticStream` parameters, with their help."""


def add_produce_parser(subparsers: Subcommands) -> None:
    """Add ``produce {synthetic,file}`` to the ``ctrps`` subcommands."""
    produce_p = add_command(subparsers, "produce", _PRODUCE)
    sources = subcommands(produce_p, "source", "SOURCE")

    syn = add_command(sources, "synthetic", _SYNTHETIC)
    syn.add_argument("--events", type=int, default=100_000, help="events to send (default 100000)")
    syn.add_argument(
        "--profile",
        metavar="NAME",
        help=f"a stream shaped like a real CTR log: {', '.join(PROFILES)} (default: the Criteo-like stream "
        "above); its event time advances at the dataset's own rate without --rate",
    )
    # The stream's own parameters: their types and defaults are SyntheticStream's
    # (None when not given, so a profile keeps its own).
    defaults = {f.name: f.default for f in fields(SyntheticStream)}
    for name, text in _STREAM_FLAGS.items():
        default = defaults[name]
        syn.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            help=f"{text} (default {default:g}, or the profile's)",
        )
    _common(syn)

    file_p = add_command(sources, "file", _FILE)
    file_p.add_argument("--format", required=True, choices=FORMATS, help="file format")
    file_p.add_argument("path", metavar="PATH", help="the file (plain or .gz)")
    file_p.add_argument("--limit", type=int, help="read at most this many rows")
    _common(file_p)


class _AckProgress:
    """A progress line at most once per `every_s`: events acknowledged and the recent rate."""

    def __init__(self, every_s: float = 1.0) -> None:
        self.every_s = every_s
        self._last_t = time.monotonic()
        self._last_n = 0
        self.sent = 0
        """Events acknowledged so far."""

    def __call__(self, sent: int) -> None:
        self.sent = sent
        now = time.monotonic()
        if now - self._last_t < self.every_s:
            return
        rate = (sent - self._last_n) / (now - self._last_t)
        self._last_t, self._last_n = now, sent
        log_event(log, "progress", sent=sent, events_per_s=round(rate))


def _fail(msg: str, code: int) -> int:
    """One error line (as the command's top level writes them) and the exit code."""
    logging.getLogger("ctrps produce").error(msg, extra={"fields": {"exit_code": code}})
    return code


def _synthetic_stream(args: argparse.Namespace) -> SyntheticStream:
    """The stream ``produce synthetic`` asked for; `ValueError` if unusable
    (a parameter out of range, an unknown profile).

    Event time advances at the sending rate, so windows close at the pace
    events arrive; without --rate, at 1000 events a second, or a profile's
    dataset's own rate."""
    given = {name: getattr(args, name) for name in _STREAM_FLAGS if getattr(args, name) is not None}
    if args.profile is None:
        return SyntheticStream(**given, events_per_s=args.rate or 1000.0)
    if args.rate:
        given["events_per_s"] = args.rate
    return profile_stream(args.profile, **given)


def _sending_options(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[str, float]:
    """``--compression`` and ``--delivery-timeout``, over ``CTRPS_COMPRESSION``
    and ``CTRPS_DELIVERY_TIMEOUT``, over the defaults; `SettingsError` if unusable."""
    compression = args.compression or env.get("CTRPS_COMPRESSION") or "none"
    if compression not in COMPRESSIONS:
        raise SettingsError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    raw = args.delivery_timeout if args.delivery_timeout is not None else env.get("CTRPS_DELIVERY_TIMEOUT") or 10.0
    try:
        timeout = float(raw)
    except ValueError:
        raise SettingsError(f"CTRPS_DELIVERY_TIMEOUT={raw!r} is not a number") from None
    if not 0 < timeout < float("inf"):
        raise SettingsError("delivery timeout must be a positive number of seconds")
    return compression, timeout


def _source(args: argparse.Namespace) -> tuple[EventSource, dict[str, Any]] | str:
    """The events ``produce`` sends and the fields that name them in its log
    line, or the usage error that prevents it."""
    if args.source == "synthetic":
        if args.events < 0:
            return "--events must be >= 0"
        try:
            stream = _synthetic_stream(args)
        except ValueError as exc:
            return str(exc)
        what: dict[str, Any] = {"source": "synthetic", "events": args.events, "seed": stream.seed}
        if args.profile is not None:
            what["profile"] = args.profile
        return itertools.chain.from_iterable(stream.iter_batches(args.events, 10_000)), what
    path = Path(args.path)
    if not path.is_file():
        return f"no such file: {path}"
    if args.limit is not None and args.limit < 0:
        return "--limit must be >= 0"
    return itertools.islice(iter_file(path, args.format), args.limit), {"source": str(path), "format": args.format}


async def run_produce(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> int:
    """Run ``ctrps produce`` with parsed `args`; returns the exit code.

    Logging is the caller's (`app.cli` configures it). A send the broker
    refuses or never acknowledges raises `consumers.producer.ProduceError`
    (one line and its exit code at the command's top level)."""
    compression, delivery_timeout = _sending_options(args, env)
    kafka = kafka_security_from(args, env)
    bootstrap = args.bootstrap or env.get("CTRPS_KAFKA_BOOTSTRAP")
    if not bootstrap:
        return _fail(
            "no Kafka broker: pass --bootstrap HOST:PORT or set CTRPS_KAFKA_BOOTSTRAP "
            "(for a local one, start `ctrps broker --port 9092` and use 127.0.0.1:9092)",
            2,
        )
    if args.partitions < 1 or args.batch_size < 1 or (args.rate is not None and args.rate <= 0):
        return _fail("--partitions and --batch-size must be >= 1 and --rate > 0", 2)

    source = _source(args)
    if isinstance(source, str):
        return _fail(source, 2)
    events, what = source

    await broker_answers(bootstrap)  # a wrong address: one line at once, not the metadata wait
    try:
        await wait_for_metadata(bootstrap, timeout_s=10.0, security=kafka)
        await create_topics(bootstrap, {args.topic: args.partitions}, security=kafka)
    except BrokerError as exc:
        return _fail(f"cannot reach the broker at {bootstrap}: {exc}", 1)

    log_event(
        log, "producing", bootstrap=bootstrap, topic=args.topic, compression=compression, **kafka.fields(), **what
    )
    progress = _AckProgress()
    sending = asyncio.ensure_future(
        produce(
            bootstrap,
            args.topic,
            events,
            batch_size=args.batch_size,
            rate=args.rate,
            progress=progress,
            compression=compression,
            delivery_timeout_s=delivery_timeout,
            security=kafka,
        )
    )
    stop = asyncio.Event()
    try:
        # SIGTERM/SIGINT end the stream early but cleanly: what was handed to
        # Kafka is flushed (produce's cleanup), and the exit status is 0.
        with stop_on_signals(stop):
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({sending, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            await asyncio.gather(stopping, return_exceptions=True)
            if not sending.done():
                sending.cancel()
                await asyncio.gather(sending, return_exceptions=True)
                log_event(log, "stopped", sent=progress.sent)
                return 0
        report = sending.result()
    except FormatError as exc:  # only an unusable header is raised; rows are skipped
        return _fail(f"{args.path}: {exc}", 2)
    for example in report.skipped_examples:
        log.warning("skipped row", extra={"fields": {"row": example}})
    log_event(log, "done", **report.as_fields())
    if report.sent == 0 and report.skipped_total > 0:
        return _fail("no usable row: every row was skipped (is --format right?)", 1)
    return 0
