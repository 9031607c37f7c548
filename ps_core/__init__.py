"""ctrps core, in five packages over six shared modules; no Kafka here.

- `errors`, `hashing`, `parsing`, `bodies`, `rows`, `lazy`: typed errors,
  stable 64-bit ids, strict parsing, request bodies declared once as models
  (validation and the documents' schemas), whole-row gathers and scatters of
  2-d arrays, and the packages' lazy re-exports, imported by every package;
- `store`: the index, optimizers and sparse tables of one shard;
- `shard`: one shard without sockets: its tables, handlers, join state,
  cuts, key sets and status board;
- `model`: events, feature hashing, batches, models and metrics;
- `net`: the codec, a shard's server and frames, the RPC and the clients;
- `checkpoint`: the coordinator, export files, the exporter and restores;
- `synthetic`: synthetic click streams with a known truth and profiles shaped
  like real CTR logs (imports numpy only, nothing of the project; not
  re-exported here).

Each package imports only the shared modules and the packages listed before
it (`tests/test_layers.py` checks this).

The names below are imported on first use (`lazy.lazy_exports`; the errors,
standard library only, at once): ``import ps_core`` loads no numpy, aiohttp
or checkpoint, and ``from ps_core import Learner`` loads what `Learner` needs."""

from typing import TYPE_CHECKING

from .errors import (
    CutInProgressError,
    ExportCorruptError,
    ExportNotFoundError,
    FrameError,
    InvalidValuesError,
    LeaseError,
    MovedError,
    MoveRefusedError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    SlotsUnsettledError,
    SnapshotError,
    TableConfigError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)
from .lazy import lazy_exports

if TYPE_CHECKING:
    from .checkpoint.control import ControlClient
    from .checkpoint.coordinator import Coordinator, Cut, Lease
    from .checkpoint.export_files import latest_chain, list_versions, load_version, write_version
    from .checkpoint.export_report import ExportReport
    from .checkpoint.exporter import Exporter
    from .checkpoint.restore import restore_shards
    from .hashing import mix64, shard_of
    from .model.batch import EventBatch
    from .model.events import decode_message
    from .model.featurizer import FeatureHasher
    from .model.learner import Learner
    from .model.models import FactorizationMachine, LogisticRegression, Model, make_model
    from .net.client import PSClient, PSReader
    from .net.codec import Op
    from .net.endpoint import RetryPolicy
    from .net.frame import Frame
    from .net.server import create_shard_app
    from .net.transports import HttpTransport, LocalTransport, ShardReader, ShardTransport, TcpTransport
    from .shard import Shard, ShardSpec
    from .store.index import KeyIndex
    from .store.optim import FTRL, SGD, AdaGrad, CoinBetting, Optimizer, make_optimizer
    from .store.snapshot import TableSnapshot
    from .store.table import SparseTable
    from .store.table_config import TableConfig
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".checkpoint.control": ("ControlClient",),
            ".checkpoint.coordinator": ("Coordinator", "Cut", "Lease"),
            ".checkpoint.export_files": (
                "latest_chain",
                "list_versions",
                "load_version",
                "write_version",
            ),
            ".checkpoint.export_report": ("ExportReport",),
            ".checkpoint.exporter": ("Exporter",),
            ".checkpoint.restore": ("restore_shards",),
            ".hashing": ("mix64", "shard_of"),
            ".model.batch": ("EventBatch",),
            ".model.events": ("decode_message",),
            ".model.featurizer": ("FeatureHasher",),
            ".model.learner": ("Learner",),
            ".model.models": ("FactorizationMachine", "LogisticRegression", "Model", "make_model"),
            ".net.client": ("PSClient", "PSReader"),
            ".net.codec": ("Op",),
            ".net.frame": ("Frame",),
            ".net.endpoint": ("RetryPolicy",),
            ".net.server": ("create_shard_app",),
            ".shard": ("Shard", "ShardSpec"),
            ".net.transports": ("HttpTransport", "LocalTransport", "ShardReader", "ShardTransport", "TcpTransport"),
            ".store.index": ("KeyIndex",),
            ".store.optim": ("FTRL", "SGD", "AdaGrad", "CoinBetting", "Optimizer", "make_optimizer"),
            ".store.snapshot": ("TableSnapshot",),
            ".store.table": ("SparseTable",),
            ".store.table_config": ("TableConfig",),
        },
    )

__all__ = [
    "AdaGrad",
    "CoinBetting",
    "ControlClient",
    "Coordinator",
    "Cut",
    "CutInProgressError",
    "EventBatch",
    "ExportCorruptError",
    "ExportNotFoundError",
    "ExportReport",
    "Exporter",
    "FTRL",
    "FactorizationMachine",
    "FeatureHasher",
    "Learner",
    "Frame",
    "FrameError",
    "HttpTransport",
    "InvalidValuesError",
    "KeyIndex",
    "Lease",
    "LeaseError",
    "LocalTransport",
    "LogisticRegression",
    "Model",
    "NoCoordinatorError",
    "Op",
    "Optimizer",
    "PSClient",
    "PSReader",
    "PSError",
    "RetryPolicy",
    "SGD",
    "Shard",
    "ShardSpec",
    "ShardReader",
    "ShardTransport",
    "ShardUnavailableError",
    "SnapshotError",
    "SparseTable",
    "TableConfig",
    "TableConfigError",
    "TableConflictError",
    "TableSnapshot",
    "TcpTransport",
    "UnknownTableError",
    "WrongShardError",
    "MovedError",
    "MoveRefusedError",
    "SlotsUnsettledError",
    "create_shard_app",
    "decode_message",
    "latest_chain",
    "list_versions",
    "load_version",
    "make_model",
    "make_optimizer",
    "mix64",
    "restore_shards",
    "shard_of",
    "write_version",
]
