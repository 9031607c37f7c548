"""README's flag tables say what the settings declare: every declared flag
of a command is in its table, with its variable and default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from app.config.broker import BrokerSettings
from app.config.cluster import ClusterSettings
from app.config.declared import Setting, declared
from app.config.demo import DemoSettings
from app.config.log import LogSettings
from app.config.serve import ApiSettings
from app.config.shard import ShardSettings
from app.config.worker import WorkerSettings

README = Path(__file__).resolve().parents[1] / "README.md"
COMMANDS = {
    "shard": ShardSettings,
    "worker": WorkerSettings,
    "serve": ApiSettings,
    "demo": DemoSettings,
    "cluster": ClusterSettings,
    "broker": BrokerSettings,
}


def _tables() -> dict[str, list[list[str]]]:
    """The rows of each command's flag table, cells stripped."""
    tables: dict[str, list[list[str]]] = {}
    command = None
    for line in README.read_text().splitlines():
        heading = re.match(r"^### `ctrps (\w+)`", line)
        if heading:
            command = heading.group(1)
        elif line.startswith("#"):
            command = None
        elif command and line.startswith("| `--"):
            tables.setdefault(command, []).append([c.strip() for c in line.strip().strip("|").split("|")])
    return tables


def _flags(cell: str) -> list[str]:
    return re.findall(r"`(--[a-z0-9-]+)", cell)


def _shown(s: Setting, default: object) -> str:
    if s.shown_default is not None:
        return s.shown_default
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return "" if default in ("", ()) else str(default)


def _by_flag(cls: type) -> dict[str, tuple[Setting, object]]:
    out = {}
    for f, s, _ in declared(cls):
        for flag in (s.flag, s.off):
            if flag:
                out[flag] = (s, f.default)
    return out


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_commands_table_matches_its_declarations(command: str) -> None:
    rows = _tables()[command]
    declared_flags = {**_by_flag(LogSettings), **_by_flag(COMMANDS[command])}
    seen = set()
    checked = 0
    for flag_cell, env_cell, default_cell, *_ in rows:
        for flag in _flags(flag_cell):
            seen.add(flag)
        first = _flags(flag_cell)[0]
        if first not in declared_flags:
            continue  # security and Kafka flags: their own sections
        s, default = declared_flags[first]
        envs = re.findall(r"`(CTRPS_[A-Z0-9_]+)`", env_cell)
        assert envs and envs[0] == s.env, (command, first, env_cell, s.env)
        if first == s.off and not s.flag:
            continue  # a switch's default is said in words (on, restore, use it)
        want = _shown(s, default)
        quoted = re.match(r"^`([^`]*)`", default_cell)
        got = quoted.group(1) if quoted else default_cell.replace("`", "")
        assert got == want or (got == "none" and want == ""), (command, first, default_cell, want)
        checked += 1
    missing = {f for f in _by_flag(COMMANDS[command]) if f not in seen}
    assert not missing, f"README's table of ctrps {command} lacks {sorted(missing)}"
    assert checked >= 5


def test_the_check_reads_the_tables() -> None:
    # A parser that found no rows would pass every command.
    tables = _tables()
    assert set(COMMANDS) <= set(tables) and len(tables["shard"]) >= 15
