"""Write docs/reference/settings.md, the flag and environment reference, from
the settings declarations (`app.config.declared.setting` fields of the settings
classes in `app/config/`): each command's flags, variables, defaults and
help as ``ctrps COMMAND --help`` shows them, and every variable with the
commands that read it.

    python tools/settings_reference.py          # write the page
    python tools/settings_reference.py --check  # exit 1 when the page is stale

`make docs` runs it before building the site; tests/test_settings_docs.py
checks that the page in the tree is what it writes.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the project's own `app`
    sys.path.insert(0, str(ROOT))

from app.config.broker import BrokerSettings  # noqa: E402
from app.config.cluster import ClusterSettings  # noqa: E402
from app.config.declared import declared, default_text  # noqa: E402
from app.config.demo import DemoSettings  # noqa: E402
from app.config.log import LogSettings  # noqa: E402
from app.config.serve import ApiSettings  # noqa: E402
from app.config.shard import ShardSettings  # noqa: E402
from app.config.worker import WorkerSettings  # noqa: E402

PAGE = ROOT / "docs" / "reference" / "settings.md"
# Each command whose flags are declared settings, in the order the guide
# presents them, with the guide page that explains it.
COMMANDS: dict[str, tuple[type, str]] = {
    "shard": (ShardSettings, "../guide/shard.md"),
    "worker": (WorkerSettings, "../guide/worker.md"),
    "serve": (ApiSettings, "../guide/serve.md"),
    "demo": (DemoSettings, "../guide/demo-cluster.md#ctrps-demo"),
    "cluster": (ClusterSettings, "../guide/demo-cluster.md#ctrps-cluster"),
    "broker": (BrokerSettings, "../guide/tools.md#ctrps-broker"),
}
HEADER = "| flag | environment | default | meaning |\n|---|---|---|---|\n"


def _text(raw: str) -> str:
    """Help text as Markdown shows it literally (no HTML, emphasis or cell breaks)."""
    return re.sub(r"([\\`*_\[\]|])", r"\\\1", html.escape(raw, quote=False))


def _rows(cls: type, skip: frozenset[str] = frozenset()) -> str:
    out = []
    groups: dict[str, list[str]] = {}
    for _, s, _ in declared(cls):
        if s.exclusive:
            groups.setdefault(s.exclusive, []).extend(x for x in (s.flag, s.off) if x)
    for f, s, _ in declared(cls):
        if f.name in skip:
            continue
        flags = [f"`{s.flag}{' ' + s.metavar if s.metavar else ''}`" if s.flag else "", f"`{s.off}`" if s.off else ""]
        flag_cell = " / ".join(x for x in flags if x) or "(environment only)"
        env_cell = f"`{s.env}`" if s.env else ""
        if isinstance(f.default, bool):
            default_cell = "on" if f.default else "off"
        else:
            shown = default_text(f, s)
            default_cell = f"`{shown}`" if shown else "none"
        meaning = [_text(s.help)]
        if s.choices:
            meaning.append("one of " + ", ".join(f"`{c}`" for c in s.choices))
        if s.flag and s.off:
            meaning.append(f"`{s.off}`: {_text(s.off_help or s.help)}")
        if s.exclusive and len(groups[s.exclusive]) > len([x for x in (s.flag, s.off) if x]):
            others = [x for x in groups[s.exclusive] if x not in (s.flag, s.off)]
            meaning.append("not with " + " or ".join(f"`{x}`" for x in others))
        out.append(f"| {flag_cell} | {env_cell} | {default_cell} | {'; '.join(meaning)} |\n")
    return "".join(out)


def _variables() -> str:
    """Every variable, with the commands that read it."""
    readers: dict[str, list[str]] = {}
    every = [("every command", LogSettings)] + [(f"`ctrps {c}`", cls) for c, (cls, _) in COMMANDS.items()]
    for name, cls in every:
        for _, s, _ in declared(cls):
            if s.env and name not in readers.setdefault(s.env, []):
                readers[s.env].append(name)
    lines = [f"| `{env}` | {', '.join(names)} |\n" for env, names in sorted(readers.items())]
    return "| variable | read by |\n|---|---|\n" + "".join(lines)


def render() -> str:
    """The page, as the declarations say it."""
    log_fields = frozenset(f.name for f, _, _ in declared(LogSettings))
    parts = [
        "# Flags and environment variables\n\n",
        "<!-- Written by tools/settings_reference.py from app/config: do not edit; `make docs` writes it. -->\n\n",
        "Every flag and `CTRPS_*` variable declared in the settings (`app/config/`),\n",
        "as `ctrps COMMAND --help` shows them. A flag given wins over its variable set\n",
        "and not empty, which wins over the default. The Kafka and shard-plane\n",
        "security flags are described in [Security](../guide/security.md); the flags of\n",
        "`ctrps produce`, `export`, `model`, `dlq` and `token` in their guide pages\n",
        "([produce](../guide/produce.md), [export, dlq, broker](../guide/tools.md),\n",
        "[model](../guide/models.md)).\n\n",
        "## Every command\n\n",
        HEADER,
        _rows(LogSettings),
    ]
    for command, (cls, guide) in COMMANDS.items():
        parts += [f"\n## `ctrps {command}`\n\n", f"Explained in [the guide]({guide}).\n\n", HEADER]
        parts.append(_rows(cls, skip=log_fields - {"log_format"}))
    parts += ["\n## Every variable\n\n", _variables()]
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs from the declarations")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run `make docs` (or python tools/settings_reference.py)")
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
