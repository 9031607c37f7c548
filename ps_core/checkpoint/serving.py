"""Serving files: what prediction reads of a version, without optimizer state.

Beside each data file ``shard-<i>.<table>.npz`` a version holds
``serving-<i>.<table>.npz`` with only ``keys``, ``weights`` (n, dim) float32
and ``deleted``: FTRL's ``[z, n]``, AdaGrad's accumulators and the lifecycle
metadata stay with the trainers. A replica (``ctrps serve --follow``) reads
these files only, into tables of weights (`serving_config`): half the bytes
to fetch and hold for an FTRL model, a third for an AdaGrad embedding table.

A version written before serving files existed has none; a replica then
reads its data files as before.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from ..store.lifecycle import Lifecycle
from ..store.table import TableConfig, TableSnapshot
from .manifest import ExportManifest, serving_file_name

__all__ = ["SERVING_ARRAYS", "serving_arrays", "serving_config", "serving_file_name", "serving_snapshot"]

SERVING_ARRAYS = ("keys", "weights", "deleted")
"""Members of a serving file, in file order."""


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


def serving_arrays(snap: TableSnapshot) -> dict[str, npt.NDArray[Any]]:
    """A snapshot's serving file members: keys, the weights its state reads as, deletions."""
    weights = snap.config.row_rule().weights(snap.data, snap.config.dim)
    return {"keys": snap.keys, "weights": np.ascontiguousarray(weights, dtype=np.float32), "deleted": snap.deleted}


def serving_snapshot(manifest: ExportManifest, table: str, arrays: dict[str, npt.NDArray[Any]]) -> TableSnapshot:
    """A serving file's members as the snapshot of a `serving_config` table
    (no counts or times: a replica neither learns nor evicts). `ValueError`
    when they are not a serving file's."""
    keys, weights, deleted = (arrays[name] for name in SERVING_ARRAYS)
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
