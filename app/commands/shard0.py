"""What the commands that ask shard 0's coordinator share (``ctrps export``,
``ctrps model``): finding shard 0, one call through a `ControlClient`, its
answer as JSON on stdout and its error as one log line with an exit status."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import orjson

from ps_core.checkpoint.control import ControlClient
from ps_core.errors import PSError
from ps_core.net.auth import Scope
from ps_core.net.endpoint import RetryPolicy

from ..security import SecuritySettings
from ..startup import shard0_answers

__all__ = ["call_shard0", "print_json"]


def print_json(out: Any) -> None:
    """`out` as indented JSON on stdout, one trailing newline."""
    # A control call's reply is a model (`msgspec.Struct`): printed as its JSON form.
    sys.stdout.write(orjson.dumps(msgspec.to_builtins(out), option=orjson.OPT_INDENT_2).decode() + "\n")


async def call_shard0(
    args: argparse.Namespace,
    log: logging.Logger,
    scope: Scope,
    call: Callable[[ControlClient], Awaitable[Any]],
) -> int:
    """Run `call` against shard 0 (``--shard0``, else the first URL of
    ``CTRPS_SHARDS``) with a token of `scope`, and print its answer; returns
    the exit status (2: no shard 0). Shard 0 must answer its first look
    within a few seconds (`app.startup.shard0_answers`: else one line, exit
    1); the call then waits up to ``--timeout`` seconds."""
    url = args.shard0 or next((u for u in os.environ.get("CTRPS_SHARDS", "").split(",") if u.strip()), "")
    if not url:
        log.error("no shard 0: pass --shard0 URL or set CTRPS_SHARDS", extra={"fields": {"exit_code": 2}})
        return 2
    security = SecuritySettings.from_args(args)
    # An address that does not answer now is a wrong one: a few seconds, not --timeout.
    await shard0_answers(url.strip(), ssl=security.client_tls())
    # Only shard 0 is asked, so the client holds only its transport.
    async with ControlClient.connect(
        [url.strip()],
        retry=RetryPolicy(deadline_s=args.timeout),
        token=security.token_for(scope),
        ssl=security.client_tls(),
    ) as client:
        try:
            out = await call(client)
        except PSError as exc:
            # A refused token or an unverified certificate is a settings error (2).
            code = getattr(type(exc), "exit_code", 1)
            log.error(exc.detail, extra={"fields": {"error": exc.code, "exit_code": code}})
            return int(code)
    print_json(out)
    return 0
