"""``ctrps export``: cut a version now, or list the versions, through shard 0.

Shard 0 hosts the coordinator and its exporter (``ctrps shard --shards ...``),
so this command needs only its URL. It prints the export's report (or the
list) as JSON on stdout; an error is one log line on stderr (in the chosen
``--log-format``) with exit status 1 (nothing answering at the address: within
a few seconds), or 2 without a shard 0, when the address is another shard, or
when shard 0 refuses the token or its certificate does not verify.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

import orjson

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.exportstore import ExportStoreError, model_at
from ps_core.errors import PSError
from ps_core.net.auth import Scope

from ..security import add_security_flags
from .export_show import show_version
from .parsers import Subcommands, add_command
from .shard0 import call_shard0, print_json

__all__ = ["add_export_parser", "run_export"]

log = logging.getLogger("ctrps export")

_EXPORT = """\
cut and write a model version now, or list the versions

Ask shard 0's coordinator to cut and write an export version now, or list them.

example:
  ctrps export --shard0 http://127.0.0.1:7100             # cut now (base or delta by schedule)
  ctrps export --shard0 http://127.0.0.1:7100 --kind base
  ctrps export --shard0 http://127.0.0.1:7100 --list      # the versions on disk
  ctrps export --shard0 http://127.0.0.1:7100 --list --model ads   # another model's
  ctrps export --shard0 http://127.0.0.1:7100 --compact   # fold the newest chain into a base
  ctrps export --show 12 --dir exports/ctr --top 5        # what version 12 holds, from its files
  ctrps export --show 12 --dir s3://bucket/exports/ctr    # the same from a bucket (AWS_* credentials)

--shard0 falls back to the first URL of CTRPS_SHARDS. The API offers the same
as POST/GET /v1/exports (POST needs the admin token when one is set).
Shard 0 with a cluster secret needs an admin token: CTRPS_SHARD_TOKEN (from
`ctrps token --scope admin`) or the secret itself; --tls-ca verifies https://.
"""


def add_export_parser(sub: Subcommands) -> None:
    """The ``export`` subcommand."""
    p = add_command(sub, "export", _EXPORT)
    p.add_argument("--shard0", help="URL of shard 0 (default: first of CTRPS_SHARDS)")
    p.add_argument("--kind", choices=("base", "delta"), help="force a base or a delta")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--list", action="store_true", help="list the versions instead of cutting one")
    what.add_argument("--compact", action="store_true", help="fold the newest chain into a base, then prune")
    what.add_argument(
        "--show",
        type=int,
        metavar="VERSION",
        help="print what VERSION holds, read from its files (no shard needed): its summary and the "
        "model's largest weights at it",
    )
    p.add_argument(
        "--dir",
        help="with --show: the model's exports directory or s3://bucket/prefix/<model> (default: "
        "<CTRPS_EXPORTS_DIR or exports>/<CTRPS_MODEL_NAME or ctr>)",
    )
    p.add_argument("--top", type=int, default=10, help="with --show: weights per table (default 10)")
    p.add_argument(
        "--names",
        type=Path,
        metavar="FILE",
        help="with --show: JSON-lines events whose features name the keys shown (its first 1,000 lines)",
    )
    p.add_argument(
        "--model",
        help="with --list or --compact: the model (default: shard 0's default model); a cut writes every model",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds a call may take once shard 0 answered (default 120; "
        "nothing answering at --shard0: exit 1 within 5 s)",
    )
    add_security_flags(p, serves=False)


async def run_export(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    if args.show is not None:
        return _show(args)

    async def cut_or_list(client: ControlClient) -> Any:
        if args.list:
            return await client.exports(args.model)
        if args.compact:
            return await client.compact_exports(args.model)
        return await client.export_now(args.kind)

    return await call_shard0(args, log, Scope.ADMIN, cut_or_list)


def _show(args: argparse.Namespace) -> int:
    """``--show VERSION``: the version's summary as JSON on stdout."""
    exports = (os.environ.get("CTRPS_EXPORTS_DIR") or "exports").rstrip("/")
    where = args.dir or f"{exports}/{os.environ.get('CTRPS_MODEL_NAME') or 'ctr'}"
    if args.top < 1:
        log.error("--top must be >= 1", extra={"fields": {"exit_code": 2}})
        return 2
    try:
        model = model_at(where)
    except (ValueError, ExportStoreError) as exc:  # no local path nor s3://bucket/prefix/<model>, or no obstore
        log.error(str(exc), extra={"fields": {"exit_code": 2}})
        return 2
    try:
        out = show_version(model, args.show, args.top, args.names)
    except PSError as exc:
        log.error(exc.detail, extra={"fields": {"error": exc.code, "exit_code": 1}})
        return 1
    except ExportStoreError as exc:  # the bucket did not answer, or refused
        log.error(str(exc), extra={"fields": {"exit_code": 1}})
        return 1
    except (OSError, orjson.JSONDecodeError) as exc:  # the --names file
        log.error(f"--names {args.names}: {exc}", extra={"fields": {"exit_code": 2}})
        return 2
    print_json(out)
    return 0
