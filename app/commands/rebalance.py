"""``ctrps rebalance``: show the slot map, move slots to a shard, or drain a
shard, through shard 0 while the cluster trains and serves.

Shard 0's coordinator runs the move (``POST /v1/slots/move``,
`ps_core.checkpoint.moves`) under its exporter's lock, so it needs exports
(``ctrps shard --exports-dir``). The answer (the map after the move and its
steps, or with ``--show`` the map's shards and slots) is printed as JSON on
stdout; an error is one log line on stderr with exit status 1, or 2 as for
``ctrps export`` (no shard 0, a refused token).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

import numpy as np

from ps_core.checkpoint.control import ControlClient
from ps_core.net.auth import Scope
from ps_core.net.control_messages import MoveRequest

from ..config.declared import SettingsError
from ..security import add_security_flags
from .parsers import Subcommands, add_command
from .shard0 import call_shard0

__all__ = ["add_rebalance_parser", "run_rebalance", "parse_slots"]

log = logging.getLogger("ctrps rebalance")

_REBALANCE = """\
move slots between the running shards, or show the slot map

Keys live in slots (4,096 in a cluster of 1, 2, 4 or 8 shards), slots on
shards. Shard 0's coordinator moves slots while workers train and the API
serves: each step copies up to 256 slots' rows from their shard to another,
whose keys are refused for those milliseconds and sent again by their
clients. Needs shard 0 with exports (its lock keeps cuts and moves apart).

example:
  ctrps rebalance --shard0 http://127.0.0.1:7100 --show                 # slots per shard, the epoch
  ctrps rebalance --shard0 http://127.0.0.1:7100 --move 0-511 --to 1    # these slots to shard 1
  ctrps rebalance --shard0 http://127.0.0.1:7100 --drain 2              # every slot of shard 2 to the others

--shard0 falls back to the first URL of CTRPS_SHARDS. Moves need an admin
token when the cluster has a secret (CTRPS_SHARD_TOKEN, `ctrps token --scope
admin`); --show a read token.
"""


def add_rebalance_parser(sub: Subcommands) -> None:
    """The ``rebalance`` subcommand."""
    p = add_command(sub, "rebalance", _REBALANCE)
    p.add_argument("--shard0", help="URL of shard 0 (default: first of CTRPS_SHARDS)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--show", action="store_true", help="print the slot map: its epoch and each shard's slots")
    what.add_argument("--move", metavar="SLOTS", help="slots to move: numbers and ranges, e.g. 0-511,1000")
    what.add_argument("--drain", type=int, metavar="SHARD", help="move every slot of SHARD to the other shards")
    p.add_argument("--to", type=int, metavar="SHARD", help="with --move: the shard to move them to")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the move may take once shard 0 answered (default 600; nothing answering: exit 1 within 5 s)",
    )
    add_security_flags(p, serves=False)


def parse_slots(text: str) -> list[int]:
    """``0-511,1000`` → the slots it names; `SettingsError` (exit 2) otherwise."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise SettingsError(f"--move {text!r}: slots are numbers and ranges like 0-511,1000") from None
        if lo < 0 or hi < lo:
            raise SettingsError(f"--move {text!r}: {part!r} is not a slot or a rising range")
        out.extend(range(lo, hi + 1))
    return out


async def run_rebalance(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    if args.move is not None and args.to is None:
        raise SettingsError("--move needs --to SHARD: the shard to move the slots to")
    if args.move is None and args.to is not None:
        raise SettingsError("--to goes with --move")
    request = None
    if args.move is not None:
        request = MoveRequest(slots=parse_slots(args.move), to=args.to)
    elif args.drain is not None:
        request = MoveRequest(drain=args.drain)

    async def call(client: ControlClient) -> Any:
        if request is not None:
            return await client.move_slots(request)
        slot_map = await client.slot_map()
        load = slot_map.load()
        return {
            "epoch": slot_map.epoch,
            "slots": slot_map.slots,
            "even": slot_map.is_even,
            "shards": [{"shard": i, "slots": int(n)} for i, n in enumerate(np.asarray(load))],
        }

    return await call_shard0(args, log, Scope.READ if request is None else Scope.ADMIN, call)
