"""What a serving replica holds: a model's export versions in read-only tables.

A replica never learns: it loads a version's serving files (written by the
exporter, `ps_core.checkpoint.serving_files`) and applies deltas, whole
versions only. Holds the read-only table (`read_table.ReadTable`: sorted
keys searched vectorised, weights in f32, f16 or int8 block floating point)
and a model's set of them (`tables.ReplicaTables`: a version staged beside the
served tables, then installed in one step). The API's replica, which polls
an export directory and serves it (``ctrps serve --follow``), is
`app.api.follower`.

May import: numpy, the store and the checkpoint package (export files and
their serving form). Nothing in `ps_core` imports it. A new precision or a
new way to apply versions goes here. The names below are imported on first
use (`ps_core.lazy`).
"""

from typing import TYPE_CHECKING

from ..lazy import lazy_exports

if TYPE_CHECKING:
    from .read_table import Prepared, ReadTable, State
    from .tables import ReplicaTables, Staged
else:
    __getattr__, __dir__ = lazy_exports(
        __name__,
        {
            ".read_table": ("Prepared", "ReadTable", "State"),
            ".tables": ("ReplicaTables", "Staged"),
        },
    )

__all__ = ["Prepared", "ReadTable", "ReplicaTables", "Staged", "State"]
