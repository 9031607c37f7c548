"""``ctrps export --show VERSION``: what one export version holds, read from
its files (no shard needed): its manifest's summary, and per table the
model's largest weights at that version, with the feature names known.

The weights are the model's at the version (its chain, base and deltas,
applied as a serving replica applies them, every file's SHA-256 checked),
not the rows the version's own files happen to hold. Hashed ids cannot be
named back; the bias is, and any feature of the events in ``--names FILE``
(JSON lines, as the workers read them; its first 1,000 lines) is, by
hashing them as training does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ps_core.checkpoint.export_files import latest_chain, load_version, serves_weights
from ps_core.checkpoint.exportstore import StoredModel
from ps_core.errors import ExportNotFoundError
from ps_core.model.featurizer import FeatureHasher
from ps_core.replica import ReplicaTables
from ps_core.store.optim import FTRLMixture

__all__ = ["show_version"]

_NAMES_LINES = 1000


def show_version(
    model_dir: Path | StoredModel, version: int, top: int, names_file: Path | None = None
) -> dict[str, Any]:
    """The summary of `version` in `model_dir` (a local directory, or a
    store's model: an ``s3://`` bucket's) and its `top` weights by
    magnitude per table (a mixture's by its learners' weights);
    `ExportNotFoundError` when there is no such version."""
    chain = latest_chain(model_dir, upto=version, verify=True, serving=True)
    if chain[-1].version != version:
        raise ExportNotFoundError(
            f"no version {version} in {model_dir} (the newest at or below it is {chain[-1].version})"
        )
    serving = all(serves_weights(info.manifest) for info in chain)
    m = chain[-1].manifest
    tables = ReplicaTables(m.serving_precision if serving else "f32")
    for info in chain:
        tables.apply(load_version(info.source, verify=False, serving=serving), serving=serving)
    names = _names(m.model, names_file)
    out_tables: dict[str, Any] = {}
    for name, config in m.tables.items():
        held = tables.tables[name]
        weights = held.weights()
        # A mixture's last K columns are its learners' log-weights (the bias
        # row's, up to 1), no feature's weight: ranked by its learners' only.
        ranked = config.dim // 2 if config.optimizer["name"] == FTRLMixture.name else config.dim
        norm = np.abs(weights[:, :ranked]).max(axis=1) if weights.size else np.zeros(0, np.float32)
        best = np.argsort(-norm, kind="stable")[:top]
        out_tables[name] = {
            "dim": config.dim,
            "optimizer": config.optimizer,
            "features": len(held),
            "rows_in_this_version": sum(f.rows for f in m.files if f.table == name),
            "deleted_in_this_version": sum(f.deleted for f in m.files if f.table == name),
            "top": [
                {
                    "key": int(held.keys[i]),
                    "feature": names.get(int(held.keys[i])),
                    "weights": [round(float(w), 6) for w in weights[i]],
                }
                for i in best
            ],
        }
    return {
        "model": m.model,
        "version": m.version,
        "kind": m.kind,
        "parent": m.parent,
        "chain": [info.version for info in chain],
        "created_at": m.created_at.isoformat(),
        "num_shards": m.num_shards,
        "serving_precision": m.serving_precision,
        "bytes": m.nbytes(),
        "offsets": {t: {str(p): o for p, o in sorted(parts.items())} for t, parts in m.offsets.items()},
        "stream": None if m.stream is None else m.stream.to_dict(),
        "tables": out_tables,
    }


def _names(model: str, names_file: Path | None) -> dict[int, str]:
    """Key → ``name=value`` (or ``name`` for a number) of the bias and of
    every feature of the events in `names_file`, hashed in one call."""
    hasher = FeatureHasher(model)
    out = {hasher.bias_key: "(bias)"}
    if names_file is None:
        return out
    shown: dict[tuple[str, str], tuple[str, Any]] = {}  # each distinct feature once
    for line in names_file.read_bytes().splitlines()[:_NAMES_LINES]:
        event = orjson.loads(line) if line.strip() else None
        features = event.get("features", {}) if isinstance(event, dict) else {}
        for fname, value in features.items() if isinstance(features, dict) else ():
            for v in value if isinstance(value, list) else [value]:
                numeric = isinstance(v, (int, float)) and not isinstance(v, bool)
                shown.setdefault((fname, repr(v)), (fname if numeric else f"{fname}={v}", v))
    # One single-feature event per distinct feature: its keys are the bias and that feature's.
    pairs = list(shown.items())
    events = [{"features": {fname: v}} for (fname, _), (_, v) in pairs]
    batch, _ = hasher.featurize(events, require_label=False)
    event_of = batch.index[np.repeat(np.arange(batch.size), np.diff(batch.offsets))]
    own = batch.keys != np.uint64(hasher.bias_key)
    for key, i in zip(batch.keys[own].tolist(), event_of[own].tolist()):
        out.setdefault(int(key), pairs[i][1][0])
    return out
