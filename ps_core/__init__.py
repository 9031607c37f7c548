"""ctrps core: sparse tables, optimizers, the shard RPC and its client. No Kafka here."""

from .client import HttpTransport, LocalTransport, PSClient, RetryPolicy, ShardTransport
from .codec import Frame, Op
from .errors import (
    FrameError,
    InvalidValuesError,
    PSError,
    ShardUnavailableError,
    TableConfigError,
    TableConflictError,
    UnknownTableError,
    WrongShardError,
)
from .hashing import mix64, shard_of
from .index import KeyIndex
from .optim import FTRL, SGD, AdaGrad, Optimizer, make_optimizer
from .server import create_shard_app
from .shard import Shard, ShardSpec
from .table import SparseTable, TableConfig

__all__ = [
    "AdaGrad",
    "FTRL",
    "Frame",
    "FrameError",
    "HttpTransport",
    "InvalidValuesError",
    "KeyIndex",
    "LocalTransport",
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
    "SparseTable",
    "TableConfig",
    "TableConfigError",
    "TableConflictError",
    "UnknownTableError",
    "WrongShardError",
    "create_shard_app",
    "make_optimizer",
    "mix64",
    "shard_of",
]
