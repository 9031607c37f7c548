"""The ``ctrps`` console script: `app.cli.main`, or one line naming the
extra to install when the command's Kafka client is missing.

The library (`ps_core`) needs no Kafka; the command does (every role's
settings are shared with the worker's), so ``pip install ctrps`` alone gives
``ctrps: the Kafka client aiokafka is not installed: pip install 'ctrps[kafka]'``
and exit 1 rather than a traceback."""

from __future__ import annotations

import sys

from .failures import EXIT_FAILURE, missing_extra

__all__ = ["main"]


def main() -> int:
    """Run the ``ctrps`` command line (`app.cli.main`)."""
    from .cli import main as cli_main

    try:
        return cli_main()  # its parser imports every role's settings
    except ModuleNotFoundError as exc:
        line = missing_extra(exc)
        if line is None:
            raise
        sys.stderr.write(f"ctrps: {line}\n")
        return EXIT_FAILURE
