"""How every command logs (`LogSettings`): format and levels."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..logs import LEVELS
from .common import FORMATS, log_format
from .declared import SettingsError, load, setting

__all__ = ["LogSettings"]


@dataclass(frozen=True)
class LogSettings:
    """How every command logs; read before the role's own settings, so that
    even a settings error is reported in the chosen format. Its flags are the
    top-level ``--log-level`` and ``--kafka-log-level``, and each command's
    ``--log-format``."""

    log_format: str = log_format()
    level: str = setting(
        "info",
        env="CTRPS_LOG_LEVEL",
        flag="--log-level",
        help="least severe level logged",
        item=str.lower,
        choices=LEVELS,
    )
    kafka_level: str = setting(
        "",
        env="CTRPS_KAFKA_LOG_LEVEL",
        flag="--kafka-log-level",
        help="the Kafka client's level (debug with --log-level debug)",
        item=str.lower,
        choices=LEVELS,
        shown_default="warning",
    )

    def __post_init__(self) -> None:
        if self.log_format not in FORMATS:
            raise SettingsError(f"log format {self.log_format!r} is not text or json")
        for key, value in (("log level", self.level), ("kafka log level", self.kafka_level)):
            if value and value.lower() not in LEVELS:
                raise SettingsError(f"{key} {value!r} is not one of {', '.join(LEVELS)}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> LogSettings:
        """Flags (where the command has them and they were given) over ``CTRPS_*`` over defaults."""
        got = load(cls, args, env)
        return cls(got.log_format, got.level.lower(), got.kafka_level.lower())
