"""Checkpoints and coordination: consistent cuts, export files, restores.

Holds the coordinator (leases around windows, cuts, committed offsets) and its
routes, the stream identity of offsets, manifests, export files (write, list,
verify, load), their restore into shards (`restore`), compaction and
retention (`retention`) and their serving files (`serving_files`: the
weights a replica reads, `ps_core.replica`), the exporter that cuts across shards and its report
(`export_report`), the loading of export versions into shards (`joining`)
and the coordinator's admission of them at one version (`membership`), the
control plane's client (`control.ControlClient`: tables, stats, the status
board, snapshots, membership, leases, offsets and exports, over the calls of
`ps_core.net.control_calls`) and the checkpoint routes of a shard app
(`routes`).

May import: everything else in `ps_core` (the store, the model side and the
network) but the replica, which reads what it writes. Nothing imports it
from below. A new export kind, retention rule or
coordination step goes here. The names below are imported on first use
(`ps_core.lazy`).
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .control import ControlClient, HttpControl, LocalControl, ShardControl
    from .coordinator import Coordinator
    from .export_report import ExportReport
    from .exporter import Exporter
    from .routes import checkpointed_shard_app
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".control": ("ControlClient", "HttpControl", "LocalControl", "ShardControl"),
            ".coordinator": ("Coordinator",),
            ".export_report": ("ExportReport",),
            ".exporter": ("Exporter",),
            ".routes": ("checkpointed_shard_app",),
        },
    )

__all__ = [
    "ControlClient",
    "Coordinator",
    "ExportReport",
    "Exporter",
    "HttpControl",
    "LocalControl",
    "ShardControl",
    "checkpointed_shard_app",
]
