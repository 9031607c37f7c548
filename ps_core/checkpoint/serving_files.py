"""Serving files: what prediction reads of a version, without optimizer state.

Beside each data file ``shard-<i>.<table>.npz`` a version holds
``serving-<i>.<table>.npz`` with only ``keys``, ``weights`` (n, dim) float32
and ``deleted``: FTRL's ``[z, n]``, AdaGrad's accumulators and the lifecycle
metadata stay with the trainers. A replica (``ctrps serve --follow``) reads
these files only, into tables of weights (`serving_config`): half the bytes
to fetch and hold for an FTRL model, a third for an AdaGrad embedding table.

A version written before serving files existed has none; a replica then
reads its data files as before.

Serving files may be written quantized (``ctrps shard --serving-precision``,
recorded as the manifest's ``serving_precision``): ``f16`` stores
``weights`` as float16 (nearest); ``int8`` stores ``codes`` (int8, n × dim)
and ``exps`` (int8, one per 64 rows in file order), a weight being its code
times 2**exp of its block (block floating point; the exponent is the
smallest that fits the block's largest magnitude in 127). The int8 file has
no ``weights`` member, so a reader that predates it refuses the file rather
than read codes as weights. A replica serves a version in its precision.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..net.quantize import F16_MAX
from ..store.block_int8 import block_codes, block_exponents
from ..store.lifecycle import Lifecycle
from ..store.snapshot import TableSnapshot
from ..store.table_config import TableConfig
from .manifest import ExportManifest, serving_file_name

__all__ = [
    "BLOCK_ROWS",
    "INT8_ARRAYS",
    "PRECISIONS",
    "SERVING_ARRAYS",
    "block_int8",
    "serving_weights",
    "serving_arrays",
    "serving_config",
    "serving_file_name",
    "serving_snapshot",
]

PRECISIONS = ("f32", "f16", "int8")
"""What serving files store weights as (and a replica holds them in)."""

SERVING_ARRAYS = ("keys", "weights", "deleted")
"""Members of a float32 or float16 serving file, in file order."""
INT8_ARRAYS = ("keys", "codes", "exps", "deleted")
"""Members of an int8 serving file, in file order."""
BLOCK_ROWS = 64
"""Rows per exponent of an int8 serving file."""


def serving_config(config: TableConfig) -> TableConfig:
    """The table a replica holds for `config`: its weights as the rows of a
    plain SGD table (the first block, read as they are), its initial values
    for absent keys, and of its lifecycle only the lazy embeddings (an
    absent embedding reads as zeros)."""
    lc = config.lifecycle
    lazy = None
    if lc is not None and lc.embed_threshold:
        lazy = Lifecycle(embed_threshold=lc.embed_threshold, embed_from=lc.embed_from)
    return TableConfig(config.name, config.dim, {"name": "sgd"}, config.init_scale, config.seed, lazy)


def serving_arrays(snap: TableSnapshot, precision: str = "f32") -> dict[str, npt.NDArray[Any]]:
    """A snapshot's serving file members: keys, the weights its state reads
    as (in `precision`), deletions."""
    weights = np.ascontiguousarray(snap.config.row_rule().weights(snap.data, snap.config.dim), dtype=np.float32)
    if precision == "f32":
        return {"keys": snap.keys, "weights": weights, "deleted": snap.deleted}
    if precision == "f16":
        clipped = np.clip(weights, -F16_MAX, F16_MAX)
        return {"keys": snap.keys, "weights": clipped.astype(np.float16), "deleted": snap.deleted}
    if precision != "int8":
        raise ValueError(f"serving precision {precision!r}: one of {', '.join(PRECISIONS)}")
    codes, exps = block_int8(weights)
    return {"keys": snap.keys, "codes": codes, "exps": exps, "deleted": snap.deleted}


def block_int8(weights: npt.NDArray[np.float32]) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.int8]]:
    """(codes, exps): `weights` (n, dim) in blocks of `BLOCK_ROWS` rows, each
    with the smallest power-of-two scale that fits its largest magnitude in 127."""
    n, dim = weights.shape
    top = np.maximum.reduceat(np.abs(weights).max(axis=1), np.arange(0, n, BLOCK_ROWS)) if n else np.zeros(0)
    exps = block_exponents(top)
    codes = block_codes(weights, np.repeat(exps, BLOCK_ROWS)[:n])
    return codes, exps.astype(np.int8)


def serving_weights(arrays: dict[str, npt.NDArray[Any]]) -> npt.NDArray[np.float32]:
    """The float32 weights (n, dim) of a serving file's members, whatever its precision."""
    if "codes" in arrays:
        codes, exps = arrays["codes"], arrays["exps"]
        if codes.dtype != np.int8 or exps.dtype != np.int8 or codes.ndim != 2:
            raise ValueError("an int8 serving file's codes and exps are int8 arrays")
        n = codes.shape[0]
        if exps.shape != ((n + BLOCK_ROWS - 1) // BLOCK_ROWS,):
            raise ValueError(f"{exps.shape} exponents for {n} rows")
        per_row = np.repeat(exps.astype(np.int32), BLOCK_ROWS)[:n]
        return np.ldexp(codes.astype(np.float32), per_row[:, None])
    weights = arrays["weights"]
    if weights.dtype not in (np.float32, np.float16):
        raise ValueError(f"serving weights of dtype {weights.dtype}")
    return np.asarray(weights, dtype=np.float32)


def serving_snapshot(manifest: ExportManifest, table: str, arrays: dict[str, npt.NDArray[Any]]) -> TableSnapshot:
    """A serving file's members as the snapshot of a `serving_config` table
    (no counts or times: a replica neither learns nor evicts). `ValueError`
    when they are not a serving file's."""
    keys, deleted = arrays["keys"], arrays["deleted"]
    weights = serving_weights(arrays)
    n = keys.shape[0] if keys.ndim == 1 else -1
    return TableSnapshot(
        table=table,
        config=serving_config(manifest.tables[table]),
        version=manifest.version,
        kind=manifest.kind,
        parent=manifest.parent,
        keys=keys,
        data=weights,
        updated_at=np.full(max(n, 0), manifest.version, dtype=np.uint32),
        last_seen=np.zeros(max(n, 0), dtype=np.uint32),
        shows=np.zeros(max(n, 0), dtype=np.float32),
        clicks=np.zeros(max(n, 0), dtype=np.float32),
        deleted=deleted,
    )
