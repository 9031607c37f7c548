"""Every shard at one export version, or no training: joining and cluster restores.

A shard that restores at start in a cluster of several shards starts
*unjoined*: it loads its newest loadable chain eagerly, but answers pulls and
pushes with `ShardNotJoinedError` (503, retriable) until the coordinator
admits it. `Membership`, run beside the coordinator (shard 0), asks every
shard for its state (`Shard.membership`: boot id, joined under which epoch,
the version its state was restored or cut at, and whether anything was
pushed since) and decides:

- every shard a member of this coordinator's epoch: nothing to do;
- every shard at one version, nothing trained since, and that version on
  disk (or 0, nothing restored): admit them all at it (a full cluster start);
- otherwise (a shard restarted alone while the others trained on, shards that
  loaded different versions, shard 0 restarted alone): a *cluster restore*.
  With leases refused and none active, every shard loads the newest version
  that every shard can load (`restore_version`, each verifying every file of
  the chain), older ones tried together when one is refused; the coordinator
  takes that version's offsets under a new epoch, so workers rewind and the
  windows since it are trained again, once, on every shard alike.

No version every shard can load: leases stay refused (`NoCommonVersionError`)
with one line saying what to do.

A cluster of several models (`ps_core.checkpoint.registry`) restores them
together: a version loads when every model that existed at it loads it (the
default model's directory holds every version; a model created later than a
version has nothing to load at it), and the coordinator takes each model's
offsets from its own manifest of that version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    ClusterNotReadyError,
    ExportCorruptError,
    ExportNotFoundError,
    NoCommonVersionError,
    PSError,
    ShardUnavailableError,
)
from ..shard import Shard, ShardSpec
from ..store.lifecycle import Lifecycle
from ..store.table_config import TableConfig
from .coordinator import Coordinator
from .export_files import latest_chain, read_manifest, version_dirs
from .manifest import parse_version_dir
from .registry import model_dirs
from .restore import RestoreResult, restore_into, restore_shards
from .stream import StreamIdentity

if TYPE_CHECKING:  # the control client imports this module (in-process restores)
    from .control import ControlClient

__all__ = [
    "Membership",
    "chain_of",
    "chains_at",
    "newest_loadable",
    "load_shard",
    "restore_chains",
    "restore_version",
    "refusal_fields",
    "books_at",
]

log = logging.getLogger("ctrps.join")


def chain_of(model_dir: Path, version: int) -> list[Any]:
    """The chain ending exactly at `version`, every file of every shard
    hashed (`ExportCorruptError` naming the first bad file,
    `ExportNotFoundError` when there is no such version)."""
    chain = latest_chain(model_dir, upto=version, verify=True)
    if chain[-1].version != version:
        raise ExportNotFoundError(f"no export version {version} in {model_dir}")
    return chain


def other_models(model_dir: Path) -> dict[str, Path]:
    """The directories of the cluster's other models, beside the default
    model's `model_dir` (those holding a ``model.json``)."""
    model_dir = Path(model_dir)
    return {n: d for n, d in model_dirs(model_dir.parent, model_dir.name).items() if n != model_dir.name}


def chains_at(model_dir: Path, version: int) -> dict[str, list[Any]]:
    """Every model's chain ending at `version`: the default model's (in
    `model_dir`) first, then each other model that has a version at or
    below it (a model created later has nothing to load). Raises as
    `chain_of` for the first model that cannot load it."""
    out = {Path(model_dir).name: chain_of(model_dir, version)}
    for name, d in other_models(model_dir).items():
        if any(v <= version for v in version_dirs(d)):
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


def _books_of(model_dir: Path, version: int) -> dict[str, tuple[dict[str, dict[int, int]], StreamIdentity | None]]:
    """Each other model's offsets and stream in its manifest of `version` (no hashing)."""
    out = {}
    for name, d in other_models(model_dir).items():
        path = version_dirs(d).get(version)
        if path is None:
            continue
        try:
            m = read_manifest(path)
        except ExportCorruptError:
            continue
        out[name] = ({t: dict(p) for t, p in m.offsets.items()}, m.stream)
    return out


def _bad_version(exc: ExportCorruptError) -> int | None:
    """The version whose directory holds the file a refusal names."""
    for part in reversed(Path(exc.file).parts):
        v = parse_version_dir(part)
        if v is not None:
            return v
    return None


def _ancestry(dirs: dict[int, Path], version: int) -> set[int] | None:
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


def newest_loadable(model_dir: Path) -> tuple[dict[str, list[Any]] | None, list[ExportCorruptError]]:
    """Every model's chain (`chains_at`) at the newest version whose every
    file checks in every model, and the refusals met on the way (newest
    first); a version built on a refused one is not hashed again."""
    dirs = version_dirs(Path(model_dir))
    refusals: list[ExportCorruptError] = []
    bad: set[int] = set()
    for v in sorted(dirs, reverse=True):
        ancestry = _ancestry(dirs, v)
        if ancestry is not None and ancestry & bad:
            continue
        try:
            return chains_at(model_dir, v), refusals
        except ExportCorruptError as exc:
            refusals.append(exc)
            if Path(exc.file).is_relative_to(model_dir):
                bad.add(_bad_version(exc) or v)
        except ExportNotFoundError:
            continue  # another model lacks the version (its write failed): an older one
    return None, refusals


def refusal_fields(exc: ExportCorruptError) -> dict[str, str]:
    """What a ``version refused`` line and a refusal answer carry."""
    return {"file": exc.file, "expected": exc.expected, "actual": exc.actual, "detail": exc.detail}


def load_shard(
    spec: ShardSpec,
    model_dir: Path,
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
    return shard, ",".join(str(v.version) for v in chains[Path(model_dir).name])


async def restore_version(shard: Shard, version: int) -> dict[str, Any]:
    """Have `shard` load export `version` from its `restore_dir` (the
    coordinator's request, ``POST /v1/restore``). It leaves the cluster
    first and stays unjoined until admitted. Answers ``{"version": v,
    "chain": "..."}``, or ``{"version": null, "refused": {file, expected,
    actual, detail}}`` when a file of the chain does not check."""
    if shard.restore_dir is None:
        raise ExportNotFoundError(f"shard {shard.spec.shard_id} has no exports directory to restore from")
    shard.leave("the coordinator is restoring every shard to one export version")
    try:
        fresh, chain = await asyncio.to_thread(
            load_shard, shard.spec, shard.restore_dir, version, shard.configured_tables, shard.default_lifecycle
        )
    except ExportCorruptError as exc:
        log.warning(
            "version refused",
            extra={"fields": {"version": version, "shard_id": shard.spec.shard_id, **refusal_fields(exc)}},
        )
        return {"version": None, "refused": refusal_fields(exc)}
    except ExportNotFoundError as exc:
        return {
            "version": None,
            "refused": {"file": "", "expected": f"version {version}", "actual": "missing", "detail": exc.detail},
        }
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
    return {"version": version, "chain": chain, "rows": rows}


async def _already(version: int) -> dict[str, Any]:
    return {"version": version, "chain": "", "kept": True}


def _why(reports: list[dict[str, Any]], dirs: dict[int, Path], member: Any) -> str:
    """Why the shards cannot simply be admitted, for the log line."""
    held = ",".join(f"{r['shard_id']}:{r['version']}{'' if r['clean'] else '+trained'}" for r in reports)
    versions = {int(r["version"]) for r in reports}
    joining = ",".join(str(r["shard_id"]) for r in reports if not member(r))
    if len(versions) > 1:
        return f"the shards hold different versions (shard:version {held}; joining: {joining})"
    v = versions.pop()
    if not all(r["clean"] for r in reports):
        return f"shard(s) {joining} joined at version {v} while others trained past it (shard:version {held})"
    if v == 0:
        return "no shard loaded a version at start although versions are on disk"
    return f"the shards hold version {v}, which is not on disk"


class Membership:
    """The coordinator's view of the shards: admits them at one version, or
    makes them all load one together. Runs in the coordinator's process."""

    def __init__(
        self,
        coordinator: Coordinator,
        client: ControlClient,
        model_dir: Path | str,
        *,
        interval_s: float = 1.0,
        wait_log_s: float = 5.0,
        urls: Sequence[str] = (),
        restore_client: ControlClient | None = None,
        files_lock: asyncio.Lock | None = None,
    ) -> None:
        """`client` reaches every shard (shard 0 in process) for the quick
        calls; `restore_client` (default `client`) for loads, which may take
        minutes; `urls` name the shards in log lines; `files_lock` is held
        while deciding (the exporter's: a compaction swapping a version
        while shards read it would read as damaged)."""
        self._files_lock = files_lock or asyncio.Lock()
        self.coordinator = coordinator
        self.client = client
        self.restore_client = restore_client or client
        self.model_dir = Path(model_dir)
        self.interval_s = interval_s
        self.wait_log_s = wait_log_s
        self.urls = list(urls)
        self.cluster_restores = 0
        """Cluster restores done."""
        self.versions_refused = 0
        """Refusals of a version by a shard during cluster restores."""
        self.last_reports: list[dict[str, Any] | None] = []
        self._refused_key: object = None
        self._last_wait_log = float("-inf")
        coordinator.refuse(ClusterNotReadyError("the shards have not joined yet"))

    def stats(self) -> dict[str, Any]:
        """``cluster`` section of shard 0's stats (for metrics)."""
        refusal = self.coordinator.refusal
        return {
            "ready": self.coordinator.ready,
            "version": self.coordinator.version,
            "epoch": self.coordinator.epoch,
            "cluster_restores": self.cluster_restores,
            "versions_refused": self.versions_refused,
            "refusal": None if refusal is None else refusal.detail,
            "joined": [
                None if r is None else bool(r["joined"] and r["epoch"] == self.coordinator.epoch)
                for r in self.last_reports
            ],
        }

    async def run(self, stop: asyncio.Event) -> None:
        """`check` every `interval_s` until `stop`; a round that fails is
        logged and tried again (leases stay as they were)."""
        while not stop.is_set():
            try:
                await self.check()
            except PSError as exc:
                log.warning("membership check failed", extra={"fields": {"error": f"{exc.code}: {exc.detail}"}})
            except Exception:  # a bug: logged with its traceback; leases stay as they were
                log.exception("membership check failed")
            try:
                await asyncio.wait_for(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def _reports(self) -> list[dict[str, Any] | None]:
        got = await asyncio.gather(*(t.membership() for t in self.client.shards), return_exceptions=True)
        out: list[dict[str, Any] | None] = []
        for r in got:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r if isinstance(r, dict) else None)
        self.last_reports = out
        return out

    def _member(self, r: dict[str, Any] | None) -> bool:
        return r is not None and bool(r["joined"]) and r["epoch"] == self.coordinator.epoch

    def _url(self, i: int) -> str:
        return self.urls[i] if i < len(self.urls) else f"shard {i}"

    async def check(self) -> None:
        """One look at every shard; admit or restore when one is not a member."""
        reports = await self._reports()
        if all(self._member(r) for r in reports):
            if isinstance(self.coordinator.refusal, ClusterNotReadyError):
                self.coordinator.refuse(None)
            return
        down = [i for i, r in enumerate(reports) if r is None]
        if down:
            if self.coordinator.ready and all(self._member(r) for r in reports if r is not None):
                return  # a shard is down: its clients see it; back, it comes unjoined
            if not isinstance(self.coordinator.refusal, NoCommonVersionError):
                self.coordinator.refuse(
                    ClusterNotReadyError(
                        f"waiting for shard(s) {','.join(map(str, down))} to answer before training resumes"
                    )
                )
            now = time.monotonic()
            if now - self._last_wait_log >= self.wait_log_s:
                self._last_wait_log = now
                log.warning(
                    "waiting for shards to join",
                    extra={
                        "fields": {
                            "unreachable": ",".join(f"{i} ({self._url(i)})" for i in down),
                            "hint": "start them (ctrps shard --shard-id N ...); leases are refused until every shard joins",
                        }
                    },
                )
            return
        key = (tuple((r or {}).get("boot_id") for r in reports), self._dir_key())
        if isinstance(self.coordinator.refusal, NoCommonVersionError) and key == self._refused_key:
            return  # nothing changed since the refusal: do not hash everything again
        joining = [i for i, r in enumerate(reports) if not self._member(r)]
        self.coordinator.refuse(
            ClusterNotReadyError(
                f"shard(s) {','.join(map(str, joining))} joining: the cluster is settling on one export version"
            )
        )
        async with self._files_lock, self.coordinator.paused():
            reports = await self._reports()
            if any(r is None for r in reports):
                return  # next round
            await self._decide([r for r in reports if r is not None], key)

    def _dir_key(self) -> tuple[tuple[int, float], ...]:
        """The versions and their files' latest change: a refusal is tried
        again once a damaged file is replaced or a version moved aside."""
        out = []
        for v, path in sorted(version_dirs(self.model_dir).items()):
            try:
                out.append((v, max([path.stat().st_mtime] + [e.stat().st_mtime for e in path.iterdir()])))
            except OSError:
                continue
        return tuple(out)

    async def _admit(self, version: int) -> bool:
        epoch = self.coordinator.epoch
        got = await asyncio.gather(*(t.admit(epoch, version) for t in self.client.shards), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(got) if isinstance(r, BaseException)]
        for i, exc in failed:
            if not isinstance(exc, Exception):
                raise exc
            log.warning("admission failed", extra={"fields": {"shard_id": i, "version": version, "error": str(exc)}})
        return not failed

    async def _decide(self, reports: list[dict[str, Any]], key: object) -> None:
        coord = self.coordinator
        versions = [int(r["version"]) for r in reports]
        dirs = version_dirs(self.model_dir)
        agreed = versions[0]
        # Holding nothing agrees only when nothing was to be loaded: shards
        # started with --no-restore, or an empty directory.
        nothing_ok = not dirs or not any(r.get("restores") for r in reports)
        if (
            len(set(versions)) == 1
            and all(r["clean"] for r in reports)
            and (agreed in dirs or (agreed == 0 and nothing_ok))
        ):
            if agreed != coord.version:
                manifest = read_manifest(dirs[agreed]) if agreed else None
                coord.reset(
                    agreed,
                    manifest.offsets if manifest else {},
                    manifest.stream if manifest else None,
                    books=_books_of(self.model_dir, agreed) if agreed else None,
                )
            if await self._admit(agreed):
                coord.refuse(None)
                log.info(
                    "cluster joined",
                    extra={"fields": {"version": agreed, "shards": len(reports), "epoch": coord.epoch}},
                )
            return
        why = _why(reports, dirs, self._member)
        bad: set[int] = set()
        refused: list[str] = []
        chosen: int | None = None
        chains = ""
        for v in sorted(dirs, reverse=True):
            ancestry = _ancestry(dirs, v)
            if ancestry is None or ancestry & bad:
                continue
            # A shard that holds exactly `v` already (it loaded it at start,
            # every file checked, and trained nothing since) needs no reload.
            got = await asyncio.gather(
                *(
                    _already(v) if int(r["version"]) == v and r["clean"] else t.restore_version(v)
                    for t, r in zip(self.restore_client.shards, reports)
                ),
                return_exceptions=True,
            )
            for j, r in enumerate(got):
                if isinstance(r, BaseException) and not isinstance(r, Exception):
                    raise r
                if isinstance(r, PSError) and not isinstance(r, ShardUnavailableError):
                    # An answer, not an outage (e.g. a shard without an
                    # exports directory): that shard cannot load `v`.
                    got[j] = {
                        "version": None,
                        "refused": {"file": "", "expected": f"version {v}", "actual": r.code, "detail": r.detail},
                    }
            unreachable = [i for i, r in enumerate(got) if isinstance(r, Exception)]
            if unreachable:
                log.warning(
                    "cluster restore interrupted",
                    extra={
                        "fields": {
                            "version": v,
                            "unreachable": ",".join(map(str, unreachable)),
                            "error": str(got[unreachable[0]]),
                        }
                    },
                )
                return  # the shards stay unjoined; the next round starts over
            answers = [r for r in got if isinstance(r, dict)]
            refusals = [(i, a["refused"]) for i, a in enumerate(answers) if a.get("version") != v]
            if not refusals:
                chosen = v
                chains = next((str(a["chain"]) for a in answers if a.get("chain")), str(v))
                break
            self.versions_refused += len(refusals)
            first = refusals[0][1]
            by = ",".join(str(i) for i, _ in refusals)
            refused.append(f"{v} by shard(s) {by}: {first.get('file') or first.get('detail')}")
            # One line per version refused (each shard logs its own refusal too).
            log.warning(
                "version refused",
                extra={
                    "fields": {
                        "version": v,
                        "shards": by,
                        "file": first.get("file", ""),
                        "expected": first.get("expected", ""),
                        "actual": first.get("actual", ""),
                        "by": "cluster restore",
                    }
                },
            )
            for _, r in refusals:
                bv = _bad_version(ExportCorruptError("", file=str(r.get("file", ""))))
                bad.add(bv if bv is not None else v)
        if chosen is None:
            self._refused_key = key
            err = NoCommonVersionError(
                f"no export version in {self.model_dir} loads on every shard ({why}; refused: "
                f"{'; '.join(refused) or 'no version on disk'}): move the damaged version directories aside "
                "and the shards retry, or restart every shard with --no-restore to start from empty tables"
            )
            coord.refuse(err)
            log.error("no common version: leases refused", extra={"fields": {"detail": err.detail}})
            return
        manifest = read_manifest(dirs[chosen])
        coord.reset(chosen, manifest.offsets, manifest.stream, books=_books_of(self.model_dir, chosen))
        self.cluster_restores += 1
        if await self._admit(chosen):
            coord.refuse(None)
        log.warning(
            "cluster restore",
            extra={
                "fields": {
                    "version": chosen,
                    "chain": chains,
                    "why": why,
                    "refused": "; ".join(refused) or "-",
                    "epoch": coord.epoch,
                }
            },
        )
