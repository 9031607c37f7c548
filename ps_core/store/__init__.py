"""The store: sparse tables of one shard and their optimizers.

Holds the vectorised key index (`KeyIndex`), the optimizers (`SGD`,
`AdaGrad`, `FTRL`, `CoinBetting`), tables (`TableConfig`, `SparseTable`, `TableSnapshot`;
what a pull found, for its push: `pull_cache.PullCache`; arrays grown in
place: `growth`), a table's feature lifecycle (`lifecycle`: admission and
eviction rules) and the status board's bounded report model
(`board.check_report`).

May import: numpy, msgspec, and `ps_core.errors`, `ps_core.hashing`, `ps_core.parsing`,
`ps_core.models`. Nothing of the network, the model side or checkpoints.
A new optimizer, per-row metadata or a table's admission and eviction go here.
"""

from .index import KeyIndex
from .optim import FTRL, SGD, AdaGrad, CoinBetting, Optimizer, make_optimizer
from .snapshot import TableSnapshot
from .table import SparseTable
from .table_config import TableConfig

__all__ = [
    "FTRL",
    "SGD",
    "AdaGrad",
    "CoinBetting",
    "KeyIndex",
    "Optimizer",
    "SparseTable",
    "TableConfig",
    "TableSnapshot",
    "make_optimizer",
]
