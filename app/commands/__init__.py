"""The ``ctrps`` commands that are not long-running roles, and what every
command's parser shares.

`parsers` (a command's parser from one text: `add_command`, `subcommands`),
`kafka_flags` (Kafka TLS and SASL flags, and how a composition hands them to
its children), `shard0` (a call to shard 0's API for the commands below), and
one module per command: `produce` (``ctrps produce synthetic|file``),
`export` with `export_show` (``ctrps export``), `model` (``ctrps model``),
`dlq` (``ctrps dlq``). `app.cli` adds their parsers and runs them.

May import `ps_core`, `consumers`, `app.commands`, `app.config` and of the
rest of `app` only `app.security`, `app.logs`, `app.signals` and
`app.startup`: never the CLI, a role or a composition.
"""
