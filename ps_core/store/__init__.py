"""The store: sparse tables of one shard and their optimizers.

Holds the vectorised key index (`KeyIndex`), the optimizers (`SGD`,
`AdaGrad`, `FTRL`, `CoinBetting`), a table's declaration (`table_config`)
and the table itself (`table.SparseTable`), which composes one module per
concept: its storage (`storage`: index and rows, grown in place by
`growth`), the per-row metadata view (`row_meta`), a push's checks and
admission (`push`; what a pull found, for its push: `pull_cache`), eviction
passes (`eviction`), export cuts (`snapshot`: `TableSnapshot`, `Cuts`); a
table's feature lifecycle (`lifecycle`: admission and eviction rules);
int8 block floating point, the one rule of a replica's int8 table and an
int8 serving file (`block_int8`); and the status board's bounded report
model (`board.check_report`). A replica's read-only tables are
`ps_core.replica`.

May import: numpy, msgspec, and `ps_core.errors`, `ps_core.hashing`, `ps_core.parsing`,
`ps_core.bodies`, `ps_core.rows`, `ps_core.lazy`. Nothing of the network,
the model side or checkpoints. Within it, a table's parts never import
`table` (the layer test's rules). A new optimizer, per-row metadata or a
table's admission and eviction go here. The names below are imported on
first use (`ps_core.lazy`).
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .index import KeyIndex
    from .optim import FTRL, SGD, AdaGrad, CoinBetting, Optimizer, make_optimizer
    from .snapshot import TableSnapshot
    from .table import SparseTable
    from .table_config import TableConfig
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".index": ("KeyIndex",),
            ".optim": ("FTRL", "SGD", "AdaGrad", "CoinBetting", "Optimizer", "make_optimizer"),
            ".snapshot": ("TableSnapshot",),
            ".table": ("SparseTable",),
            ".table_config": ("TableConfig",),
        },
    )

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
