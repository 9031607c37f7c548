"""Loading export versions into shards, for joining and cluster restores.

A shard that restores at start in a cluster of several shards starts
*unjoined*: it loads its newest loadable chain eagerly (`newest_loadable`,
`load_shard`), but answers pulls and pushes with `ShardNotJoinedError` (503,
retriable) until the coordinator admits it (`ps_core.checkpoint.membership`).
In a cluster restore the coordinator has every shard load one version
(`restore_version`, each verifying every file of the chain), and takes that
version's offsets (`books_at`).

A cluster of several models (`ps_core.checkpoint.registry`) restores them
together, from a local directory or a bucket alike: a version loads when
every model that existed at it loads it (the default model's exports hold
every version; a model created later than a version has nothing to load at
it), and the coordinator takes each model's
offsets from its own manifest of that version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import (
    ExportCorruptError,
    ExportNotFoundError,
)
from ..net.control_messages import Refused, Restored
from ..shard import Shard, ShardSpec
from ..store.lifecycle import Lifecycle
from ..store.table_config import TableConfig
from .export_files import latest_chain, read_manifest, version_dirs
from .exportstore import StoredModel, VersionSource
from .manifest import parse_version_dir
from .registry import model_dirs
from .restore import RestoreResult, restore_into, restore_shards
from .stream import StreamIdentity

__all__ = [
    "ancestry",
    "bad_version",
    "books_of",
    "refused_answer",
    "chain_of",
    "chains_at",
    "newest_loadable",
    "load_shard",
    "restore_chains",
    "restore_version",
    "refusal_fields",
    "books_at",
    "ModelAt",
    "model_name",
    "model_versions",
]

ModelAt = Path | StoredModel
"""A model's exports: its local directory, or its versions in a bucket."""

log = logging.getLogger("ctrps.join")


def model_name(model_dir: ModelAt) -> str:
    """The model a directory or a stored model holds."""
    return model_dir.model if isinstance(model_dir, StoredModel) else Path(model_dir).name


def model_versions(model_dir: ModelAt) -> Mapping[int, Path | VersionSource]:
    """Version number → where it is (no manifest read): a local directory's
    version directories (`version_dirs`), or a bucket's listed versions."""
    if isinstance(model_dir, StoredModel):
        return model_dir.versions()
    return version_dirs(Path(model_dir))


def chain_of(model_dir: ModelAt, version: int) -> list[Any]:
    """The chain ending exactly at `version`, every file of every shard
    hashed (`ExportCorruptError` naming the first bad file,
    `ExportNotFoundError` when there is no such version)."""
    chain = latest_chain(model_dir, upto=version, verify=True)
    if chain[-1].version != version:
        raise ExportNotFoundError(f"no export version {version} in {model_dir}")
    return chain


def other_models(model_dir: ModelAt) -> dict[str, ModelAt]:
    """The exports of the cluster's other models, beside the default
    model's `model_dir` (those holding a ``model.json``): directories beside
    it, or models beside it in its bucket."""
    if isinstance(model_dir, StoredModel):
        found = model_dirs(model_dir.store, model_dir.model)
    else:
        found = model_dirs(Path(model_dir).parent, Path(model_dir).name)
    return {n: d for n, d in found.items() if n != model_name(model_dir)}


def chains_at(model_dir: ModelAt, version: int) -> dict[str, list[Any]]:
    """Every model's chain ending at `version`: the default model's (in
    `model_dir`) first, then each other model that has a version at or
    below it (a model created later has nothing to load). Raises as
    `chain_of` for the first model that cannot load it."""
    out = {model_name(model_dir): chain_of(model_dir, version)}
    for name, d in other_models(model_dir).items():
        if any(v <= version for v in model_versions(d)):
            out[name] = chain_of(d, version)
    return out


def restore_chains(chains: Mapping[str, Sequence[Any]], num_shards: int, shard_ids: Sequence[int]) -> RestoreResult:
    """Shards `shard_ids` holding every model's chain (`chains_at`); the
    result's offsets and manifest are the first (default) model's."""
    names = list(chains)
    result = restore_shards(chains[names[0]], num_shards, shard_ids=shard_ids)
    for name in names[1:]:
        restore_into(result.shards, chains[name])
    return result


def books_at(chains: Mapping[str, Sequence[Any]]) -> dict[str, tuple[dict[str, dict[int, int]], StreamIdentity | None]]:
    """Each model's offsets and stream at the end of its chain."""
    out = {}
    for name, chain in chains.items():
        m = chain[-1].manifest
        out[name] = ({t: dict(p) for t, p in m.offsets.items()}, m.stream)
    return out


def books_of(model_dir: ModelAt, version: int) -> dict[str, tuple[dict[str, dict[int, int]], StreamIdentity | None]]:
    """Each other model's offsets and stream in its manifest of `version` (no hashing)."""
    out = {}
    for name, d in other_models(model_dir).items():
        path = model_versions(d).get(version)
        if path is None:
            continue
        try:
            m = read_manifest(path)
        except ExportCorruptError:
            continue
        out[name] = ({t: dict(p) for t, p in m.offsets.items()}, m.stream)
    return out


def bad_version(exc: ExportCorruptError) -> int | None:
    """The version whose directory holds the file a refusal names."""
    for part in reversed(Path(exc.file).parts):
        v = parse_version_dir(part)
        if v is not None:
            return v
    return None


def ancestry(dirs: Mapping[int, Path | VersionSource], version: int) -> set[int] | None:
    """The versions of `version`'s chain from their manifests (no hashing);
    None when a manifest is missing or unreadable."""
    out: set[int] = set()
    v: int | None = version
    while v is not None:
        if v in out or v not in dirs:
            return None
        out.add(v)
        try:
            v = read_manifest(dirs[v]).parent
        except ExportCorruptError:
            return None
    return out


def newest_loadable(model_dir: ModelAt) -> tuple[dict[str, list[Any]] | None, list[ExportCorruptError]]:
    """Every model's chain (`chains_at`) at the newest version whose every
    file checks in every model (of a local directory or a bucket), and the
    refusals met on the way (newest first); a version built on a refused
    one is not hashed again."""
    dirs = model_versions(model_dir)
    refusals: list[ExportCorruptError] = []
    bad: set[int] = set()
    for v in sorted(dirs, reverse=True):
        built_on = ancestry(dirs, v)
        if built_on is not None and built_on & bad:
            continue
        try:
            return chains_at(model_dir, v), refusals
        except ExportCorruptError as exc:
            refusals.append(exc)
            if _within(exc.file, model_dir):
                bad.add(bad_version(exc) or v)
        except ExportNotFoundError:
            continue  # another model lacks the version (its write failed): an older one
    return None, refusals


def _within(file: str, model_dir: ModelAt) -> bool:
    """Whether a refused file is one of `model_dir`'s (not another model's)."""
    if isinstance(model_dir, StoredModel):
        return file.startswith(f"{model_dir}/")
    return Path(file).is_relative_to(model_dir)


def refusal_fields(exc: ExportCorruptError) -> dict[str, str]:
    """What a ``version refused`` line and a refusal answer carry."""
    return {"file": exc.file, "expected": exc.expected, "actual": exc.actual, "detail": exc.detail}


def load_shard(
    spec: ShardSpec,
    model_dir: ModelAt,
    version: int,
    tables: Sequence[TableConfig],
    lifecycle: Lifecycle | None = None,
) -> tuple[Shard, str]:
    """A fresh shard `spec` holding export `version` (empty for 0) and the
    tables configured, with `lifecycle` for tables declared without one; and
    the chain loaded, as ``"1,2,3"``. Synchronous (hashes and parses files):
    run it in a thread."""
    if version == 0:
        return Shard(spec, tables, lifecycle=lifecycle), "-"
    chains = chains_at(model_dir, version)
    shard = restore_chains(chains, spec.num_shards, [spec.shard_id]).shards[0]
    shard.reconfigure(tables, lifecycle)
    return shard, ",".join(str(v.version) for v in chains[model_name(model_dir)])


async def restore_version(shard: Shard, version: int) -> Restored:
    """Have `shard` load export `version` from its `restore_dir` (the
    coordinator's request, ``POST /v1/restore``). It leaves the cluster
    first and stays unjoined until admitted. Answers the version and the
    chain loaded, or no version and the refusal (file, expected, actual,
    detail) when a file of the chain does not check."""
    at = shard.restore_dir
    if not isinstance(at, (Path, StoredModel)):
        raise ExportNotFoundError(f"shard {shard.spec.shard_id} has no exports directory to restore from")
    shard.leave("the coordinator is restoring every shard to one export version")
    try:
        fresh, chain = await asyncio.to_thread(
            load_shard, shard.spec, at, version, shard.configured_tables, shard.default_lifecycle
        )
    except ExportCorruptError as exc:
        log.warning(
            "version refused",
            extra={"fields": {"version": version, "shard_id": shard.spec.shard_id, **refusal_fields(exc)}},
        )
        return Restored(None, refused=Refused(**refusal_fields(exc)))
    except ExportNotFoundError as exc:
        return refused_answer(version, "missing", exc.detail)
    shard.replace_state(fresh, version)
    rows = sum(len(t) for t in shard.tables.values())
    log.info(
        "restore",
        extra={
            "fields": {
                "version": version,
                "chain": chain,
                "rows": rows,
                "shard_id": shard.spec.shard_id,
                "by": "coordinator",
            }
        },
    )
    return Restored(version, chain=chain, rows=rows)


def refused_answer(version: int, actual: str, detail: str) -> Restored:
    """A shard's answer that it cannot load `version`, for a cause other than a file's check
    (`actual`: what was found instead)."""
    return Restored(None, refused=Refused("", f"version {version}", actual, detail))
