"""ctrps core: sparse tables, optimizers, the shard RPC and its client, features
and models, the coordinator and exports. No Kafka here."""

from .client import HttpTransport, LocalTransport, PSClient, RetryPolicy, ShardTransport
from .codec import Frame, Op
from .coordinator import Coordinator, Cut, Lease
from .errors import (
    CutInProgressError,
    ExportCorruptError,
    ExportNotFoundError,
    FrameError,
    InvalidValuesError,
    LeaseError,
    NoCoordinatorError,
    PSError,
    ShardUnavailableError,
    SnapshotError,
    TableConfigError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)
from .export import latest_chain, list_versions, load_version, restore_shards, write_version
from .exporter import Exporter, ExportReport
from .features import EventBatch, FeatureHasher, decode_message
from .hashing import mix64, shard_of
from .index import KeyIndex
from .models import FactorizationMachine, LogisticRegression, Model, make_model
from .optim import FTRL, SGD, AdaGrad, Optimizer, make_optimizer
from .server import create_shard_app
from .shard import Shard, ShardSpec
from .table import SparseTable, TableConfig, TableSnapshot

__all__ = [
    "AdaGrad",
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
    "PSError",
    "RetryPolicy",
    "SGD",
    "Shard",
    "ShardSpec",
    "ShardTransport",
    "ShardUnavailableError",
    "SnapshotError",
    "SparseTable",
    "TableConfig",
    "TableConfigError",
    "TableConflictError",
    "TableSnapshot",
    "UnknownTableError",
    "WrongShardError",
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
