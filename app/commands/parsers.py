"""The ``ctrps`` subcommands' parsers, each from one text that reads like its
manual page: the line shown in the parent's list, a description, then the
examples and notes ``--help`` ends with.

A command's text is written in that order, paragraphs apart::

    serve one shard of the sparse tables over HTTP

    Serve one shard of the sparse tables (binary pull/push RPC, stats, health).

    example:
      ctrps shard --port 7100
"""

from __future__ import annotations

import argparse
from typing import TypeAlias

__all__ = ["Subcommands", "subcommands", "add_command"]

Subcommands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
"""What `subcommands` returns: where `add_command` adds a command."""


def subcommands(parser: argparse.ArgumentParser, dest: str, metavar: str) -> Subcommands:
    """`parser`'s required subcommands, the chosen one's name stored in `dest`."""
    sub = parser.add_subparsers(dest=dest, metavar=metavar)
    sub.required = True
    return sub


def add_command(sub: Subcommands, name: str, text: str) -> argparse.ArgumentParser:
    """The parser of the command `name`, from `text` (see the module's
    docstring): its first line is the help, its second paragraph the
    description and the rest the epilog, each printed as written."""
    summary, description, epilog = text.split("\n\n", 2)
    if "\n" in summary:
        raise ValueError(f"{name}: the first paragraph of a command's text is one line")
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser
