"""Logging: one line per event worth logging, as text or as JSON objects.

Structured fields go in ``extra={"fields": {...}}``; the JSON format emits them
as top-level keys, the text format as ``key=value`` after the message. A
traceback (a bug's) is part of its record: in JSON one object whose ``exc``
field holds the traceback's text.

The Kafka client's loggers (``aiokafka``, ``kafka``) are held at WARNING
unless asked otherwise, and their repeated lines are collapsed by
`RepeatFilter`: while a broker is down a consumer logs the same few lines
dozens of times a second.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

__all__ = [
    "configure_logging",
    "log_event",
    "parse_level",
    "LEVELS",
    "KAFKA_LOGGERS",
    "RepeatFilter",
]

LEVELS = ("debug", "info", "warning", "error")
"""The names ``--log-level`` and ``--kafka-log-level`` accept."""

KAFKA_LOGGERS = ("aiokafka", "kafka")
"""The Kafka client's logger names (and their children)."""

_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def parse_level(name: str) -> int:
    """``debug``/``info``/``warning``/``error`` (any case) → a `logging` level."""
    if name.strip().lower() not in LEVELS:
        raise ValueError(f"log level {name!r} is not one of {', '.join(LEVELS)}")
    return int(getattr(logging, name.strip().upper()))


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        # Integer keys (a `{partition: offset}` field) need OPT_NON_STR_KEYS;
        # anything orjson cannot encode is written as its str().
        return orjson.dumps(out, default=str, option=_JSON_OPTIONS).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", {})
        tail = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower():5} {record.name}: {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _is_kafka(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in KAFKA_LOGGERS)


class RepeatFilter(logging.Filter):
    """Collapses repeated Kafka-client lines: one line per logger, level and
    message template every `every_s` seconds; the next one let through says
    how many were held back (fields ``suppressed`` and ``suppressed_s``).

    Also drops the traceback of a Kafka-client record (keeping the exception's
    one-line text in the field ``error``) unless `tracebacks`: the client logs
    connection failures, expected while a broker is away, with theirs.
    Records of other loggers pass untouched."""

    _MAX_KEYS = 1024  # templates are few; a bound keeps a pathological logger from growing it

    def __init__(
        self, every_s: float = 5.0, *, tracebacks: bool = False, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.every_s = every_s
        self.tracebacks = tracebacks
        self._clock = clock
        self._seen: dict[tuple[str, int, str], list[float]] = {}
        """key → [time the last line was let through, lines held back since]."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _is_kafka(record.name):
            return True
        key = (record.name, record.levelno, str(record.msg))
        now = self._clock()
        entry = self._seen.get(key)
        if entry is not None and now - entry[0] < self.every_s:
            entry[1] += 1
            return False
        if entry is None and len(self._seen) >= self._MAX_KEYS:
            self._seen.clear()
        fields: dict[str, Any] = dict(getattr(record, "fields", {}))
        if entry is not None and entry[1]:
            fields["suppressed"] = int(entry[1])
            fields["suppressed_s"] = round(now - entry[0], 1)
        self._seen[key] = [now, 0]
        if record.exc_info and not self.tracebacks:
            exc = record.exc_info[1]
            if exc is not None:
                fields["error"] = f"{type(exc).__name__}: {exc}"
            record.exc_info = None
            record.exc_text = None
        if fields:
            record.fields = fields
        return True


def configure_logging(fmt: str = "text", level: int = logging.INFO, kafka_level: int | None = None) -> None:
    """Send logs to stderr, one line each, as ``text`` or ``json``, at `level`.

    The Kafka client logs at `kafka_level`; by default at WARNING, or DEBUG
    when `level` is DEBUG. Above DEBUG its repeated lines are collapsed and
    its tracebacks dropped (`RepeatFilter`); at DEBUG it logs everything."""
    if kafka_level is None:
        kafka_level = logging.DEBUG if level <= logging.DEBUG else max(level, logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    if kafka_level > logging.DEBUG:
        handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for name in KAFKA_LOGGERS:
        logging.getLogger(name).setLevel(kafka_level)
    # aiohttp's access log is one line per request: far too much for RPC.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def log_event(logger: logging.Logger, msg: str, **fields: Any) -> None:
    """Log one event with structured fields at INFO."""
    logger.info(msg, extra={"fields": fields})
