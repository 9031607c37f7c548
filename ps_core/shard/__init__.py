"""One shard of the parameter server, without sockets: `Shard` and its parts.

Holds `Shard` (`shard`), which composes one module per concept: where it
sits (`spec.ShardSpec`), its tables and their declarations
(`tables.ShardTables`), its admission to the cluster
(`join_state.JoinState`), the data handlers for pulls, pushes, change feeds
and sync steps (`handlers.DataHandlers`, `handlers.Push`), the export cuts it
takes part in (`cuts.HeldCuts`), the key sets its pulls keep for the pushes that
name them (`key_sets.KeySets`) and the status board (`status_board.StatusBoard`).

May import: numpy, orjson, `ps_core.errors`, `ps_core.hashing`,
`ps_core.parsing`, `ps_core.bodies`, `ps_core.rows`, `ps_core.lazy` and
`ps_core.store`. Nothing of the network (which serves a shard: frames are
decoded in `ps_core.net.frame_handler`), the model side or checkpoints. The
names below are imported on first use (`ps_core.lazy`).
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .handlers import Push
    from .shard import Shard
    from .spec import ShardSpec
else:
    __getattr__, __dir__ = lazy_exports(
        __name__, {".handlers": ("Push",), ".shard": ("Shard",), ".spec": ("ShardSpec",)}
    )

__all__ = ["Push", "Shard", "ShardSpec"]
