"""The model side, shared by training and serving.

Holds events (decoding and validation), feature hashing (`featurizer`, with
its string hashes in `string_hashing` and its caches in `layouts`), the CSR batch of
hashed events (`EventBatch`), the models (`LogisticRegression`,
`FactorizationMachine`: tables, logits and gradients for a batch), the
online metrics (log loss, AUC, COPC) and `Learner` (a model trained in this
process, without Kafka or shards, for trying things out).

May import: numpy, orjson, `ps_core.errors`, `ps_core.hashing`,
`ps_core.parsing` and `ps_core.store` (a model declares its tables). Nothing of
the network or checkpoints, but for `Learner.save` / `Learner.load`, which
import `ps_core.checkpoint` when called (the export format's one writer and
reader). A new model, feature kind or metric goes here.
The names below are imported on first use (`ps_core.lazy`): a decoding
process loads events, hashing and batches, not the models or `Learner`.
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .batch import EventBatch
    from .events import decode_message
    from .featurizer import FeatureHasher
    from .learner import Learner
    from .metrics import Metrics, evaluate
    from .models import FactorizationMachine, LogisticRegression, Model, make_model
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".batch": ("EventBatch",),
            ".events": ("decode_message",),
            ".featurizer": ("FeatureHasher",),
            ".learner": ("Learner",),
            ".metrics": ("Metrics", "evaluate"),
            ".models": ("FactorizationMachine", "LogisticRegression", "Model", "make_model"),
        },
    )

__all__ = [
    "EventBatch",
    "FactorizationMachine",
    "FeatureHasher",
    "Learner",
    "LogisticRegression",
    "Metrics",
    "Model",
    "decode_message",
    "evaluate",
    "make_model",
]
