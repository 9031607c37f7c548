"""The roles a ``ctrps`` command runs until signalled, one module each:
`shard` (a shard server), `worker` (a training worker), `serve` (the HTTP
API over shards, or a serving replica) and `broker` (the embedded broker).

Each takes its settings from `app.config` and may import `ps_core`,
`consumers` and the rest of `app` but the CLI (`app.cli` imports the roles,
not the other way round) and the compositions (`app.demo`, `app.cluster`).
"""
