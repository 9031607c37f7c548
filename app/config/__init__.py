"""Settings: one frozen object per role, from CLI flags over ``CTRPS_*``
environment variables over defaults, handed down explicitly.

Each setting is declared once, as a field with its variable, flag and help
(`app.config.declared.setting`); the flags (`add_flags`), the parsing and the
precedence (`load`) come from the declarations, and so does the flag
reference (``tools/settings_reference.py``); the user guide's flag tables are
checked against them (``tests/test_settings_docs.py``). Nothing below `app`
reads the environment; roles get everything from here.

Modules: `declared` (the machinery), `common` (checks and declarations
several roles share), `limits` (ports' limits), `exports` (the export
settings), and one module per role's settings: `shard`, `worker` (with
`worker_config`, the one way from settings to a `WorkerConfig`), `serve`,
`broker`, `demo`, `cluster`, `log`.

May import `ps_core`, `consumers` (for the configs it builds), `app.config`,
and of `app` only `app.security` and `app.logs`: never a role.
"""
