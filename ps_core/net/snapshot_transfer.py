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

from ..errors import ExportCorruptError
from ..store.snapshot import TableSnapshot
from ..store.table_config import TableConfig

__all__ = ["snapshots_to_bytes", "snapshots_from_bytes"]


def snapshots_to_bytes(snapshots: Sequence[TableSnapshot]) -> bytes:
    """One shard's snapshots as one uncompressed ``.npz`` body: members
    ``<i>.<array>`` per snapshot and ``meta`` (their labels and configs as
    JSON bytes), so the coordinator can fetch a cut without shared storage."""
    meta = [
        {"table": s.table, "config": s.config.to_dict(), "version": s.version, "kind": s.kind, "parent": s.parent}
        for s in snapshots
    ]
    arrays: dict[str, npt.NDArray[Any]] = {"meta": np.frombuffer(orjson.dumps(meta), dtype=np.uint8)}
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
