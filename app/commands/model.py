"""``ctrps model``: create, list, show and delete the cluster's models through shard 0.

A model is created once with its type, optimizer and update mode; its
declaration lives with shard 0's coordinator and in ``<exports>/<name>/model.json``
(`ps_core.checkpoint.registry`). Workers started with ``--model-name NAME``
train it with that declaration. Shard 0 is ``--shard0``, else the first URL
of ``CTRPS_SHARDS``, else where ``ctrps shard`` listens by default. Output
is JSON on stdout; an error is one log line on stderr with exit status 1
(nothing answering at the address: within a few seconds; 2: another shard at
its address, a refused token, or a bad flag).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from typing import Any

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.manifest import check_model_name
from ps_core.checkpoint.registry import ModelSpec
from ps_core.errors import PSError
from ps_core.model.featurizer import DEFAULT_NUMERIC, numeric_spec
from ps_core.model.models import DEFAULT_EMBEDDING_OPTIMIZER, DEFAULT_LINEAR_OPTIMIZER, make_model
from ps_core.net.auth import Scope
from ps_core.net.control_messages import ModelDeclaration
from ps_core.store.optim import OPTIMIZERS
from ps_core.store.table_config import MODES

from ..config.shard import ShardSettings
from ..security import add_security_flags
from .parsers import Subcommands, add_command
from .shard0 import call_shard0

__all__ = ["add_model_parser", "run_model", "parse_optimizer", "DEFAULT_SHARD0"]

log = logging.getLogger("ctrps model")

_SHARD = {f.name: f.default for f in dataclasses.fields(ShardSettings)}
DEFAULT_SHARD0 = f"http://{_SHARD['host']}:{_SHARD['port']}"
"""Where ``ctrps shard`` listens without flags: shard 0 of the README's pipeline."""

_MODEL = """\
create, list, show or delete the models of a cluster

Each model has its own tables, offsets and exports directory; workers name
the one they train with --model-name, and the API serves every model.

example:
  ctrps model create ads --type lr --optimizer ftrl,alpha=0.1,l1=1 --shard0 http://127.0.0.1:7100
  ctrps model create feed --type fm --factors 8 --mode geo --numeric log1p/16
  ctrps model create bets --type lr --optimizer coin,wealth=1
  ctrps model list
  ctrps model show ads
  ctrps model delete ads     # drops its tables on every shard; its exports stay on disk

--shard0 falls back to the first URL of CTRPS_SHARDS, else to
http://127.0.0.1:7100 (where `ctrps shard` listens by default). When
shard 0 holds a cluster secret, creating needs a train token (workers
create their model the same way) and deleting an admin one:
CTRPS_SHARD_TOKEN from `ctrps token --scope admin`, or the secret itself.
"""


def parse_optimizer(spec: str) -> dict[str, Any]:
    """``NAME[,HYPER=V...]``, e.g. ``ftrl,alpha=0.1,l1=1`` → ``{"name": "ftrl", "alpha": 0.1, "l1": 1.0}``;
    `ValueError` naming what is wrong."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise ValueError(f"optimizer {spec!r} must start with its name (one of {', '.join(OPTIMIZERS)})")
    out: dict[str, Any] = {"name": parts[0]}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"optimizer {spec!r}: {part!r} is not key=value")
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"optimizer {spec!r}: {key}={value!r} is not a number") from None
    return out


def add_model_parser(sub: Subcommands) -> None:
    """The ``model`` subcommand."""
    p = add_command(sub, "model", _MODEL)
    p.add_argument("action", choices=("create", "list", "show", "delete"), help="what to do")
    p.add_argument("name", nargs="?", help="the model (create, show, delete)")
    p.add_argument(
        "--shard0", help=f"URL of shard 0 (default: first of CTRPS_SHARDS, else {DEFAULT_SHARD0}, a shard's default)"
    )
    p.add_argument("--type", choices=("lr", "fm"), default="lr", help="create: lr or fm (default lr)")
    p.add_argument(
        "--optimizer",
        help=f"create: the linear weights' optimizer, NAME[,HYPER=V...], NAME one of {', '.join(OPTIMIZERS)} "
        "(e.g. coin,wealth=2: parameter-free, no learning rate) "
        f"(default {DEFAULT_LINEAR_OPTIMIZER['name']} with "
        f"{', '.join(f'{k}={v}' for k, v in DEFAULT_LINEAR_OPTIMIZER.items() if k != 'name')})",
    )
    p.add_argument(
        "--embedding-optimizer",
        help="create, fm: the embeddings' optimizer "
        f"(default {DEFAULT_EMBEDDING_OPTIMIZER['name']},"
        f"{','.join(f'{k}={v}' for k, v in DEFAULT_EMBEDDING_OPTIMIZER.items() if k != 'name')})",
    )
    p.add_argument("--factors", type=int, default=8, help="create, fm: embedding width k (default 8)")
    p.add_argument("--mode", choices=MODES, default="async", help="create: update mode (default async)")
    p.add_argument(
        "--numeric",
        type=numeric_spec,
        metavar="raw|log1p[/D]",
        default=DEFAULT_NUMERIC,
        help="create: numeric feature values fed as sent (raw) or as sign(x) log1p(|x|) (log1p), /D divided by "
        f"D; default {DEFAULT_NUMERIC}",
    )
    p.add_argument("--max-staleness", type=int, help="create, async: down-weight gradients staler than N pushes")
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds a call may take once shard 0 answered (default 30; "
        "nothing answering at --shard0: exit 1 within 5 s)",
    )
    add_security_flags(p, serves=False)


def _spec(args: argparse.Namespace) -> ModelSpec:
    """The declaration `create` sends (`ValueError` for a bad flag)."""
    check_model_name(args.name)
    kwargs: dict[str, Any] = {"mode": args.mode, "max_staleness": args.max_staleness, "numeric": args.numeric}
    if args.optimizer:
        kwargs["optimizer"] = parse_optimizer(args.optimizer)
    if args.type == "fm":
        if args.factors < 1:
            raise ValueError("--factors must be >= 1")
        kwargs["k"] = args.factors
        if args.embedding_optimizer:
            kwargs["embedding_optimizer"] = parse_optimizer(args.embedding_optimizer)
    elif args.embedding_optimizer:
        raise ValueError("--embedding-optimizer is for --type fm")
    if args.max_staleness is not None and args.mode != "async":
        raise ValueError("--max-staleness is for --mode async")
    return ModelSpec.of(make_model(args.type, args.name, **kwargs), created_at=0.0)


async def run_model(args: argparse.Namespace) -> int:
    """Run the command; returns the exit status."""
    if args.action != "list" and not args.name:
        log.error(f"ctrps model {args.action} needs a model name", extra={"fields": {"exit_code": 2}})
        return 2
    body: ModelDeclaration | None = None
    if args.action == "create":
        try:
            body = _spec(args).declaration()
        except (ValueError, PSError) as exc:
            log.error(getattr(exc, "detail", None) or str(exc), extra={"fields": {"exit_code": 2}})
            return 2

    async def act(client: ControlClient) -> Any:
        if args.action == "list":
            return await client.models()
        if args.action == "show":
            return await client.model_info(args.name)
        if args.action == "delete":
            return await client.delete_model(args.name)
        assert body is not None
        return await client.create_model(body)

    if not args.shard0 and not os.environ.get("CTRPS_SHARDS", "").strip(","):
        # As `ctrps shard` listens without flags: the pipeline's shard 0.
        args.shard0 = DEFAULT_SHARD0
    scope = {"create": Scope.TRAIN, "delete": Scope.ADMIN}.get(args.action, Scope.READ)
    return await call_shard0(args, log, scope, act)
