"""Export cuts in transit from a shard to the coordinator: one shard's
snapshots as one ``.npz`` body (`snapshots_to_bytes`) and back
(`snapshots_from_bytes`), so a cut is fetched without shared storage
(``GET /v1/snapshots/{version}``).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ..errors import ExportCorruptError, InvalidRequestError
from ..slots import SlotMap
from ..store.snapshot import TableSnapshot
from ..store.table_config import TableConfig

__all__ = ["snapshots_to_bytes", "snapshots_from_bytes", "slot_rows_to_bytes", "slot_rows_from_bytes"]


def snapshots_to_bytes(snapshots: Sequence[TableSnapshot], **extra: bytes) -> bytes:
    """One shard's snapshots as one uncompressed ``.npz`` body: members
    ``<i>.<array>`` per snapshot and ``meta`` (their labels and configs as
    JSON bytes), so the coordinator can fetch a cut without shared storage;
    `extra` members as given (a reader of snapshots passes over them)."""
    meta = [
        {"table": s.table, "config": s.config.to_dict(), "version": s.version, "kind": s.kind, "parent": s.parent}
        for s in snapshots
    ]
    arrays: dict[str, npt.NDArray[Any]] = {"meta": np.frombuffer(orjson.dumps(meta), dtype=np.uint8)}
    arrays.update({name: np.frombuffer(raw, dtype=np.uint8) for name, raw in extra.items()})
    for i, snap in enumerate(snapshots):
        for name, a in snap.arrays().items():
            arrays[f"{i}.{name}"] = a
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def snapshots_from_bytes(raw: bytes) -> list[TableSnapshot]:
    """Inverse of `snapshots_to_bytes`; `ExportCorruptError` on anything else."""
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            meta = orjson.loads(npz["meta"].tobytes())
            return [
                TableSnapshot(
                    table=m["table"],
                    config=TableConfig.from_dict(m["config"]),
                    version=int(m["version"]),
                    kind=m["kind"],
                    parent=m["parent"],
                    **{name: npz[f"{i}.{name}"] for name in TableSnapshot.ARRAYS},
                )
                for i, m in enumerate(meta)
            ]
    except (ValueError, KeyError, OSError, EOFError, TypeError, zipfile.BadZipFile, orjson.JSONDecodeError) as exc:
        raise ExportCorruptError(f"snapshot body unreadable: {type(exc).__name__}: {exc}") from None


def slot_rows_to_bytes(snapshots: Sequence[TableSnapshot], slot_map: SlotMap) -> bytes:
    """A slot move's rows (`ps_core.shard.slot_moves`) and the map they move
    at, as one body (`snapshots_to_bytes` with member ``slot_map``)."""
    return snapshots_to_bytes(snapshots, slot_map=orjson.dumps(slot_map.to_dict()))


def slot_rows_from_bytes(raw: bytes) -> tuple[list[TableSnapshot], SlotMap]:
    """Inverse of `slot_rows_to_bytes`; `InvalidRequestError` on anything else."""
    try:
        snaps = snapshots_from_bytes(raw)
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            return snaps, SlotMap.from_dict(orjson.loads(npz["slot_map"].tobytes()))
    except (ExportCorruptError, ValueError, KeyError, orjson.JSONDecodeError) as exc:
        raise InvalidRequestError(f"slot rows unreadable: {getattr(exc, 'detail', None) or exc}") from None
