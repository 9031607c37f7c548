"""Checkpoints and coordination: consistent cuts, export files, restores.

Holds the coordinator (leases around windows, cuts, committed offsets) and its
routes, the stream identity of offsets, manifests, export files (write, list,
verify, load, restore, compact, prune), the exporter that cuts across shards,
and the joining of restored shards (`joining`).

May import: everything else in `ps_core` (the store, the model side and the
network). Nothing imports it from below. A new export kind, retention rule or
coordination step goes here.
"""
