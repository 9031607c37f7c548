"""Moving slots between running shards: the coordinator's side of a live
move (`move_slots`); the shards' side is `ps_core.shard.slot_moves`.

A move of slots from shard A to shard B, at the map's next epoch:

1. A hands them off: in one step it copies and removes their rows and takes
   the new map (it refuses their keys from then on);
2. shard 0, whose map clients read after a refusal, takes the new map (if
   it is neither A nor B);
3. B takes the rows over, flagged changed, and the new map;
4. every other shard takes the new map; A drops its copies.

Pushes of the moving slots between steps 1 and 3 are refused and sent again
by their clients once the maps agree (`ps_core.net.client`): nothing
acknowledged is lost, nothing applied twice. If B does not take the rows,
A takes them back at the epoch after, and the move is `MoveFailedError`.
Moves run under the exporter's lock, so a cut never sees a slot in flight.
Slots move in batches of `BATCH` per step, so each step's pause of those
slots stays short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import numpy as np

from ..errors import MoveRefusedError, PSError
from ..net.client import fan_out
from ..net.control_messages import MoveRequest, MoveStepBody, SlotMapBody, SlotsMoved
from ..slots import SlotMap
from ..store.snapshot import TableSnapshot
from .control import ControlClient

__all__ = ["BATCH", "MoveFailedError", "MoveStep", "move_slots", "plan_drain", "run_move"]

log = logging.getLogger("ctrps.moves")

BATCH = 256
"""Slots one step moves: 1/16 of a shard's slots of a 2-shard cluster."""


class MoveFailedError(PSError, code="move_failed", status=502, retriable=True):
    """The destination did not take the slots; the source took them back."""


@dataclass(frozen=True)
class MoveStep:
    """One step of a move: `slots` from `source` to `to` at map `epoch`."""

    epoch: int
    source: int
    to: int
    slots: int
    rows: int
    paused_ms: float
    """From the hand-off to the take-over: how long the slots' keys were refused."""


async def move_slots(
    client: ControlClient, slots: Sequence[int], to: int, *, lock: asyncio.Lock | None = None, batch: int = BATCH
) -> list[MoveStep]:
    """Move `slots` to shard `to` from whichever shards own them (those it
    owns already stay), `batch` at a time, under `lock` (the exporter's).
    `MoveRefusedError` for a slot or shard that does not exist."""
    async with lock if lock is not None else contextlib.nullcontext():
        current = await client.slot_map()
        if not 0 <= to < current.num_shards:
            raise MoveRefusedError(f"no shard {to}: the cluster has {current.num_shards}")
        chosen = np.unique(np.asarray(slots, dtype=np.int64))
        if chosen.size and (chosen.min() < 0 or chosen.max() >= current.slots):
            raise MoveRefusedError(f"slots are in [0, {current.slots})")
        owners = np.array(current.owners)
        steps: list[MoveStep] = []
        for source in sorted(set(owners[chosen].tolist()) - {to}):
            its = chosen[owners[chosen] == source]
            for start in range(0, its.size, batch):
                step, current = await _step(client, current, source, to, its[start : start + batch].tolist())
                steps.append(step)
        return steps


async def _step(
    client: ControlClient, current: SlotMap, source: int, to: int, slots: list[int]
) -> tuple[MoveStep, SlotMap]:
    new = current.moved(dict.fromkeys(slots, to))
    shards = client.shards
    t0 = time.perf_counter()  # the source refuses the slots' keys from its hand-off on
    copies = await shards[source].hand_off(slots, new)
    if 0 not in (source, to):
        await shards[0].adopt_slot_map(new)
    try:
        rows = await shards[to].take_over(copies, new)
    except PSError as exc:
        if not await _took_over(client, to, new):
            await _give_back(client, copies, new, source, to, slots, exc)
        # The destination holds the slots at the new map: only its answer was lost.
        rows = sum(c.rows for c in copies)
        log.warning(
            "slot move: the destination took the slots, its answer was lost",
            extra={"fields": {"source": source, "to": to, "slots": len(slots), "epoch": new.epoch, "error": str(exc)}},
        )
    paused_ms = (time.perf_counter() - t0) * 1e3
    others = [s.adopt_slot_map(new) for i, s in enumerate(shards) if i not in (source, to, 0)]
    if others:
        await fan_out(others)
    try:
        await shards[source].release_slots(new.epoch)
    except PSError as exc:
        # The move is done: the destination holds the slots. A source that no
        # longer answers keeps its copies until it restarts (and loses them).
        log.warning(
            "slot move: the source did not drop its copies",
            extra={"fields": {"source": source, "epoch": new.epoch, "error": str(exc)}},
        )
    step = MoveStep(new.epoch, source, to, len(slots), rows, paused_ms)
    log.info(
        "slots moved",
        extra={
            "fields": {
                "epoch": step.epoch,
                "source": source,
                "to": to,
                "slots": step.slots,
                "rows": rows,
                "paused_ms": round(paused_ms, 2),
            }
        },
    )
    return step, new


def plan_drain(slot_map: SlotMap, shard: int) -> dict[int, list[int]]:
    """Every slot of `shard`, each to the shard holding the fewest slots at
    that point (ties: the lowest number): the slots' new owners, by owner."""
    if not 0 <= shard < slot_map.num_shards:
        raise MoveRefusedError(f"no shard {shard}: the cluster has {slot_map.num_shards}")
    if slot_map.num_shards == 1:
        raise MoveRefusedError("the cluster's only shard cannot be drained")
    load = slot_map.load()
    load[shard] = np.iinfo(np.int64).max
    out: dict[int, list[int]] = {}
    for slot in slot_map.slots_of(shard).tolist():
        to = int(np.argmin(load))
        load[to] += 1
        out.setdefault(to, []).append(slot)
    return out


async def run_move(client: ControlClient, request: MoveRequest, lock: asyncio.Lock | None = None) -> SlotsMoved:
    """A move as ``POST /v1/slots/move`` asks it (`MoveRequest`): its slots to
    one shard, or a shard drained; the map after it and its steps."""
    steps: list[MoveStep] = []
    if request.to is not None and request.drain is None:
        steps = await move_slots(client, request.slots, request.to, lock=lock)
    elif request.drain is not None and request.to is None and not request.slots:
        async with lock if lock is not None else contextlib.nullcontext():
            plan = plan_drain(await client.slot_map(), request.drain)
            for to, slots in sorted(plan.items()):
                steps += await move_slots(client, slots, to)
    else:
        raise MoveRefusedError("a move names slots and a shard to move them to, or a shard to drain")
    final = await client.slot_map()
    return SlotsMoved(
        msgspec.convert(final.to_dict(), SlotMapBody),
        [MoveStepBody(s.epoch, s.source, s.to, s.slots, s.rows, round(s.paused_ms, 3)) for s in steps],
    )


async def _took_over(client: ControlClient, to: int, new: SlotMap) -> bool:
    """Whether shard `to` holds the map `new` (or a later one): it applied a
    take-over whose answer was lost. False when it does not answer."""
    try:
        got = await client.shards[to].slot_map()
    except PSError:
        return False
    return got.epoch >= new.epoch


async def _give_back(
    client: ControlClient,
    copies: Sequence[TableSnapshot],
    new: SlotMap,
    source: int,
    to: int,
    slots: list[int],
    exc: PSError,
) -> NoReturn:
    """The destination did not take `slots`: the source takes them back at
    the epoch after `new` and drops its copies, the others take that map
    where they answer (one that does not keeps the older map, whose owners
    are the same); `MoveFailedError`."""
    shards = client.shards
    back = new.moved(dict.fromkeys(slots, source))
    await shards[source].take_over(copies, back)
    await shards[source].release_slots(new.epoch)
    for i, s in enumerate(shards):
        if i != source:
            with contextlib.suppress(PSError):
                await s.adopt_slot_map(back)
    log.warning(
        "slot move failed: the source took its slots back",
        extra={"fields": {"source": source, "to": to, "slots": len(slots), "epoch": back.epoch, "error": str(exc)}},
    )
    raise MoveFailedError(f"shard {to} did not take {len(slots)} slots of shard {source}: {exc}") from exc
