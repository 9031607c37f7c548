"""The model a version's manifest describes (`model_from_manifest`): what a
replica serves and what `ps_core.Learner.load` learns on with."""

from __future__ import annotations

from ..errors import TableConfigError
from ..model.featurizer import numeric_feed
from ..model.models import FactorizationMachine, LogisticRegression, Model
from .manifest import ExportManifest

__all__ = ["model_from_manifest"]

_KINDS = {"lr": "lr", "LogisticRegression": "lr", "fm": "fm", "FactorizationMachine": "fm"}


def model_from_manifest(manifest: ExportManifest) -> Model:
    """The model whose tables a version holds.

    Its name is ``model_config["name"]`` (what the exporter writes) when a
    table ``<name>_w`` exists, else the model directory's name, else the
    prefix of the one ``*_w`` table. The kind follows from the tables, as the
    models name them: ``<name>_w`` alone is logistic regression,
    ``<name>_w`` and ``<name>_v`` a factorization machine (k is the
    ``_v`` table's dim); the tables' optimizers and initial values are
    taken as declared. A kind named in ``model_config`` (``"model"``:
    ``lr``/``fm``, or ``"kind"`` as `Model.config` writes it) must agree.
    `ValueError` when the tables are not a model's.
    """
    tables, config = manifest.tables, manifest.model_config
    hinted = config.get("name")
    prefixes = [t[: -len("_w")] for t in tables if t.endswith("_w")]
    candidates = [hinted, manifest.model] + (prefixes if len(prefixes) == 1 else [])
    name = next((c for c in candidates if isinstance(c, str) and f"{c}_w" in tables), None)
    if name is None:
        raise ValueError(
            f"version {manifest.version}: no model in tables {sorted(tables)} "
            f"(expected <name>_w, and <name>_v for a factorization machine)"
        )
    w, v = tables[f"{name}_w"], tables.get(f"{name}_v")
    model: Model
    # How the trainer fed numeric features (a version from before the choice: raw).
    numeric = str(config.get("numeric") or "raw")
    try:
        numeric_feed(numeric)
    except ValueError as exc:
        raise ValueError(f"version {manifest.version}: model_config: {exc}") from None
    try:
        if v is None:
            model = LogisticRegression(
                name, optimizer=w.optimizer, mode=w.mode, max_staleness=w.max_staleness, numeric=numeric
            )
        else:
            model = FactorizationMachine(
                name,
                k=v.dim,
                optimizer=w.optimizer,
                embedding_optimizer=v.optimizer,
                init_scale=v.init_scale,
                seed=v.seed,
                mode=w.mode,
                max_staleness=w.max_staleness,
                numeric=numeric,
            )
    except TableConfigError as exc:  # tables no model is built of (an FM's embeddings of ftrl_mix)
        raise ValueError(f"version {manifest.version}: {exc.detail}") from None
    hint = config.get("model", config.get("kind"))
    kind = "lr" if v is None else "fm"
    if hint is not None and _KINDS.get(str(hint)) != kind:
        raise ValueError(f"version {manifest.version}: model_config names {hint!r}, its tables are {kind}")
    # The models build their own declarations: they must be the stored ones
    # (a `_w` table of another dim is not a model's linear part).
    mismatch = [t.name for t in model.tables() if not tables[t.name].accepts(t)]
    if mismatch:
        raise ValueError(f"version {manifest.version}: tables {mismatch} are not those of a {kind} model")
    return model
