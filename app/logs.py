"""Logging: one line per event worth logging, as text or as JSON objects.

Structured fields go in ``extra={"fields": {...}}``; the JSON format emits them
as top-level keys, the text format as ``key=value`` after the message.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import orjson

__all__ = ["configure_logging", "log_event"]


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
        return orjson.dumps(out, option=orjson.OPT_SERIALIZE_NUMPY).decode()


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = getattr(record, "fields", {})
        tail = "".join(f" {k}={v}" for k, v in fields.items())
        line = f"{ts} {record.levelname.lower():5} {record.name}: {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    """Send logs to stderr, one line each, as ``text`` or ``json``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # aiohttp's access log is one line per request: far too much for RPC.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def log_event(logger: logging.Logger, msg: str, **fields: Any) -> None:
    """Log one event with structured fields at INFO."""
    logger.info(msg, extra={"fields": fields})
