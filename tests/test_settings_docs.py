"""The flag tables say what the settings declare: the user guide's table of
each command has every declared flag, with its variable and default, and the
generated reference (docs/reference/settings.md) is what
tools/settings_reference.py writes from the declarations now."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType

import pytest
from commands import PROJECT
from site_pages import guide_pages

from app.config.broker import BrokerSettings
from app.config.cluster import ClusterSettings
from app.config.declared import Setting, declared
from app.config.demo import DemoSettings
from app.config.log import LogSettings
from app.config.serve import ApiSettings
from app.config.shard import ShardSettings
from app.config.worker import WorkerSettings

COMMANDS = {
    "shard": ShardSettings,
    "worker": WorkerSettings,
    "serve": ApiSettings,
    "demo": DemoSettings,
    "cluster": ClusterSettings,
    "broker": BrokerSettings,
}


def _tables() -> dict[str, list[list[str]]]:
    """The rows of each command's flag table in the guide, cells stripped."""
    tables: dict[str, list[list[str]]] = {}
    for page in guide_pages():
        command = None
        for line in page.read_text().splitlines():
            heading = re.match(r"^#+ `ctrps (\w+)`", line)
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
    assert not missing, f"the guide's table of ctrps {command} lacks {sorted(missing)}"
    assert checked >= 5


def test_the_check_reads_the_tables() -> None:
    # A parser that found no rows would pass every command.
    tables = _tables()
    assert set(COMMANDS) <= set(tables) and len(tables["shard"]) >= 15


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("settings_reference", PROJECT / "tools" / "settings_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_reference_page_is_what_the_declarations_write() -> None:
    reference = _reference()
    page = PROJECT / "docs" / "reference" / "settings.md"
    assert page.read_text() == reference.render(), "docs/reference/settings.md is stale: run `make docs`"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_the_reference_names_every_declared_flag_and_variable(command: str) -> None:
    # The page compared above could leave a declaration out: each is in its command's section.
    reference = _reference()
    assert reference.COMMANDS[command][0] is COMMANDS[command]
    text = reference.render()
    section = text.split(f"\n## `ctrps {command}`\n", 1)[1].split("\n## ", 1)[0]
    for _, s, _ in declared(COMMANDS[command]):
        for name in (s.flag, s.off, s.env):
            if name:
                assert f"`{name}" in section, (command, name)


def test_the_check_flag_says_whether_the_page_is_current(capsys: pytest.CaptureFixture[str]) -> None:
    reference = _reference()
    assert reference.main(["--check"]) == 0
    reference.PAGE = PROJECT / "docs" / "reference" / "missing.md"  # a page never written: stale
    assert reference.main(["--check"]) == 1
    assert "is stale: run `make docs`" in capsys.readouterr().out
