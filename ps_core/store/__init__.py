"""The store: sparse tables of one shard and their optimizers.

Holds the vectorised key index (`KeyIndex`), the optimizers (`SGD`,
`AdaGrad`, `FTRL`, `CoinBetting`), a table's declaration (`table_config`)
and the table itself (`table.SparseTable`), which composes one module per
concept: its storage (`storage`: index and rows, grown in place by
`growth`), the per-row metadata view (`row_meta`), a push's checks and
admission (`push`; what a pull found, for its push: `pull_cache`), eviction
passes (`eviction`), export cuts (`snapshot`: `TableSnapshot`, `Cuts`); a
table's feature lifecycle (`lifecycle`: admission and eviction rules); a
replica's read-only table (`read_table`) and the status board's bounded
report model (`board.check_report`).

May import: numpy, msgspec, and `ps_core.errors`, `ps_core.hashing`, `ps_core.parsing`,
`ps_core.models`, `ps_core.rows`. Nothing of the network, the model side or
checkpoints. Within it, a table's parts never import `table` (the layer
test's rules). A new optimizer, per-row metadata or a table's admission and
eviction go here.
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
