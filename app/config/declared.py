"""Settings declared once: each field of a settings dataclass names its
environment variable, its flag and its help beside its type and default, and
the flags, the environment parsing and the precedence (a flag given, else a
variable set and not empty, else the default) are derived from that.

    port: int = setting(7100, env="CTRPS_SHARD_PORT", flag="--port", help="listen port; 0 picks a free one")

`add_flags(parser, ShardSettings)` adds a role's flags; `load(ShardSettings,
args, env)` builds the settings. A field without a declaration (a secret, a
port's limits) is the caller's, passed to `load` by name.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = [
    "Setting",
    "setting",
    "declared",
    "default_text",
    "add_flags",
    "load",
    "given",
    "to_argv",
    "parse_bool",
    "SettingsError",
]


class SettingsError(ValueError):
    """A flag or environment variable has an unusable value: a usage error,
    reported as one line with exit code 2 (see `app.failures`)."""

    exit_code = 2


@dataclass(frozen=True)
class Setting:
    """How one setting is read: its variable, its flag and their help."""

    env: str | None
    """The ``CTRPS_*`` variable (None: no variable)."""
    flag: str | None
    """The flag (None: environment only)."""
    help: str
    """One line for ``--help`` (the default is appended)."""
    off: str | None = None
    """A flag that turns the setting off (``--no-rpc``): the field gets `off_value`."""
    off_value: Any = False
    """What `off` sets."""
    off_help: str | None = None
    """``--help`` of `off` when the setting also has a flag."""
    choices: tuple[str, ...] | None = None
    """The values the flag takes, for ``--help`` and argparse's check."""
    metavar: str | None = None
    """The flag's value in ``--help``."""
    sep: str = ","
    """Between a tuple's items in the variable (and the flag, unless `repeat`)."""
    repeat: bool = False
    """A tuple's flag is given once per item (``--table SPEC --table SPEC``)."""
    item: Callable[[str], Any] | None = None
    """Reads one item of a tuple, or the value of a scalar (default: by the field's type)."""
    exclusive: str | None = None
    """Flags of settings sharing this name are mutually exclusive (and the `off` flag)."""
    shown_default: str | None = None
    """The default as ``--help`` and the docs show it, where ``str(default)`` does not."""
    empty: bool = False
    """An empty variable is a value (``CTRPS_EXPORTS_DIR=`` turns exports off), not unset."""


def setting(
    default: Any,
    *,
    env: str | None,
    flag: str | None,
    help: str,
    **how: Any,
) -> Any:
    """A dataclass field with its `Setting` (keyword arguments as `Setting`'s)."""
    meta = {"setting": Setting(env=env, flag=flag, help=help, **how)}
    if isinstance(default, (list, dict, set)):
        raise TypeError("settings defaults are immutable")
    return dataclasses.field(default=default, metadata=meta)


def declared(cls: type) -> list[tuple[dataclasses.Field[Any], Setting, Any]]:
    """(field, its `Setting`, its type) of every declared field of `cls`, in order."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata["setting"], hints[f.name]) for f in dataclasses.fields(cls) if "setting" in f.metadata]


def parse_bool(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``."""
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


_WORDS = {int: "an integer", float: "a number", bool: "0 or 1"}


def _reader(kind: Any, s: Setting) -> Callable[[str], Any]:
    """Text (a variable's) to the field's value."""
    if typing.get_origin(kind) is tuple:
        one = s.item or str

        def items(raw: str) -> tuple[Any, ...]:
            return tuple(one(part.strip()) for part in raw.split(s.sep) if part.strip())

        return items
    if s.item is not None:
        return s.item
    readers: dict[Any, Callable[[str], Any]] = {bool: parse_bool, int: int, float: float}
    return readers.get(kind, str)


def _dest(s: Setting) -> str:
    assert s.flag is not None
    return s.flag.lstrip("-").replace("-", "_")


def _off_dest(s: Setting) -> str:
    assert s.off is not None
    return s.off.lstrip("-").replace("-", "_")


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add the flags of `cls`'s declared settings (but those named in `skip`)."""
    groups: dict[str, Any] = {}
    for f, s, kind in declared(cls):
        if f.name in skip or (s.flag is None and s.off is None):
            continue
        target: Any = parser
        if s.exclusive is not None:
            target = groups.get(s.exclusive) or groups.setdefault(s.exclusive, parser.add_mutually_exclusive_group())
        shown = default_text(f, s)
        if s.flag is not None:
            is_tuple = typing.get_origin(kind) is tuple
            notes = "; ".join(n for n in (f"default {shown}" if shown else "", s.env or "") if n)
            kwargs: dict[str, Any] = {"dest": _dest(s), "help": f"{s.help} ({notes})" if notes else s.help}
            if s.repeat:
                kwargs["action"] = "append"
            elif not is_tuple and s.item is not None:
                kwargs["type"] = s.item  # as the variable is read (an octal mode is an int)
            elif not is_tuple and kind in (int, float):
                kwargs["type"] = kind
            if s.choices:
                kwargs["choices"] = s.choices
            if s.metavar:
                kwargs["metavar"] = s.metavar
            target.add_argument(s.flag, **kwargs)
        if s.off is not None:
            target.add_argument(s.off, action="store_true", dest=_off_dest(s), help=_off_help(s))


def _off_help(s: Setting) -> str:
    if s.flag and s.off_help:
        return s.off_help
    return f"{s.help} ({s.env}=0)" if s.env and not s.flag else s.help


def default_text(f: dataclasses.Field[Any], s: Setting) -> str:
    """The default as ``--help`` and the settings reference show it ("" for
    none, an empty tuple or a switch)."""
    return s.shown_default if s.shown_default is not None else _shown(f.default)


def _shown(default: Any) -> str:
    if isinstance(default, bool) or default in ("", ()):
        return ""
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


T = TypeVar("T")


def load(cls: type[T], args: argparse.Namespace | None, env: Mapping[str, str], **given: Any) -> T:
    """`cls` from its flags in `args` (where given) over its variables in
    `env` (where set and not empty) over its defaults; `given` fills the
    fields without a declaration, and overrides any. A variable that does
    not read is `SettingsError` naming it."""
    values: dict[str, Any] = {}
    for f, s, kind in declared(cls):
        if f.name in given:
            continue
        if args is not None and s.off is not None and getattr(args, _off_dest(s), False):
            values[f.name] = s.off_value
            continue
        flagged = getattr(args, _dest(s), None) if args is not None and s.flag is not None else None
        if flagged is not None:
            values[f.name] = _from_flag(flagged, kind, s, f.name)
            continue
        raw = env.get(s.env) if s.env else None
        if raw == "" and s.empty:
            values[f.name] = ""
            continue
        if raw:
            try:
                values[f.name] = _reader(kind, s)(raw)
            except SettingsError:
                raise
            except ValueError:
                word = _WORDS.get(kind, "valid")
                raise SettingsError(f"{s.env}={raw!r} is not {word}") from None
    return cls(**values, **given)


def given(cls: type, args: argparse.Namespace | None, env: Mapping[str, str]) -> frozenset[str]:
    """The names of `cls`'s declared settings that a flag in `args` or a
    variable set (not empty) in `env` gives: the rest are their defaults."""
    out: set[str] = set()
    for f, s, _ in declared(cls):
        flagged = args is not None and (
            (s.flag is not None and getattr(args, _dest(s), None) is not None)
            or (s.off is not None and bool(getattr(args, _off_dest(s), False)))
        )
        if flagged or (s.env is not None and env.get(s.env)):
            out.add(f.name)
    return frozenset(out)


def to_argv(settings: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """The flags giving `settings`' values of the fields `names`, default or
    not (a flag given is a value given: see `given`), such that `load` reads
    those values back: ``str(value)``, a tuple's items joined by its
    separator (its flag repeated if `repeat`). Only fields with a `flag`."""
    by_name = {f.name: (s, kind) for f, s, kind in declared(type(settings))}
    argv: list[str] = []
    for name in names:
        s, kind = by_name[name]
        if s.flag is None:
            raise ValueError(f"{name} has no flag to give it")
        value = getattr(settings, name)
        if typing.get_origin(kind) is not tuple:
            argv += [s.flag, str(value)]
        elif s.repeat:
            argv += [part for v in value for part in (s.flag, str(v))]
        else:
            argv += [s.flag, s.sep.join(str(v) for v in value)]
    return tuple(argv)


def _from_flag(value: Any, kind: Any, s: Setting, name: str) -> Any:
    """A flag's value as the field's: argparse typed scalars already; a tuple's
    items are split (or were repeated) and read."""
    if typing.get_origin(kind) is not tuple:
        return value
    one = s.item or str
    parts = value if s.repeat else str(value).split(s.sep)
    return tuple(one(p.strip()) for p in parts if p.strip())
