"""Every shard at one export version, or no training: the coordinator's
view of the shards' membership.

`Membership`, run beside the coordinator (shard 0), asks every shard for its
state (`Shard.membership`: boot id, joined under which epoch, the version its
state was restored or cut at, and whether anything was pushed since) and
decides:

- every shard a member of this coordinator's epoch: nothing to do;
- every shard at one version, nothing trained since, and that version on
  disk (or 0, nothing restored): admit them all at it (a full cluster start);
- otherwise (a shard restarted alone while the others trained on, shards that
  loaded different versions, shard 0 restarted alone): a *cluster restore*.
  With leases refused and none active, every shard loads the newest version
  that every shard can load (`ps_core.checkpoint.joining.restore_version`,
  each verifying every file of the chain), older ones tried together when one
  is refused; the coordinator takes that version's offsets under a new epoch,
  so workers rewind and the windows since it are trained again, once, on
  every shard alike.

No version every shard can load: leases stay refused (`NoCommonVersionError`)
with one line saying what to do.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ClusterNotReadyError, ExportCorruptError, NoCommonVersionError, PSError, ShardUnavailableError
from ..net.control_messages import MembershipBody, Refused, Restored
from ..waits import within
from .control import ControlClient, HttpControl, LocalControl, ShardControl
from .coordinator import Coordinator
from .export_files import read_manifest
from .exportstore import StoredModel, VersionSource
from .joining import ModelAt, ancestry, bad_version, books_of, model_versions, refused_answer, restore_version

__all__ = ["Membership", "agreed_version", "restore_on"]

log = logging.getLogger("ctrps.join")


async def _already(version: int) -> Restored:
    return Restored(version, chain="", kept=True)


async def restore_on(shard: ShardControl, version: int) -> Restored:
    """`shard` loads export `version`: in this process, by `restore_version`;
    a shard server, asked over its control routes."""
    if isinstance(shard, LocalControl):
        return await restore_version(shard.shard, version)
    if isinstance(shard, HttpControl):
        return await shard.restore_version(version)
    raise TypeError(f"cannot restore a {type(shard).__name__}: neither in this process nor a shard server")


def _why(
    reports: Sequence[MembershipBody],
    dirs: Mapping[int, Path | VersionSource],
    member: Callable[[MembershipBody], bool],
) -> str:
    """Why the shards cannot simply be admitted, for the log line."""
    held = ",".join(f"{r.shard_id}:{r.version}{'' if r.clean else '+trained'}" for r in reports)
    versions = {r.version for r in reports}
    joining = ",".join(str(r.shard_id) for r in reports if not member(r))
    if len(versions) > 1:
        return f"the shards hold different versions (shard:version {held}; joining: {joining})"
    v = versions.pop()
    if not all(r.clean for r in reports):
        return f"shard(s) {joining} joined at version {v} while others trained past it (shard:version {held})"
    if v == 0:
        return "no shard loaded a version at start although versions are on disk"
    return f"the shards hold version {v}, which is not on disk"


def agreed_version(reports: Sequence[MembershipBody], dirs: Mapping[int, Path | VersionSource]) -> int | None:
    """The version every shard may be admitted at as it is: all hold the
    same one, trained nothing since, and it is on disk (or 0, when nothing
    was to be loaded); None when the shards must restore together."""
    versions = {r.version for r in reports}
    if len(versions) != 1 or not all(r.clean for r in reports):
        return None
    agreed = versions.pop()
    # Holding nothing agrees only when nothing was to be loaded: shards
    # started with --no-restore, or an empty directory.
    nothing_ok = not dirs or not any(r.restores for r in reports)
    return agreed if agreed in dirs or (agreed == 0 and nothing_ok) else None


@dataclass
class _Refusals:
    """What a cluster restore met, newest version first."""

    lines: list[str] = field(default_factory=list)
    """``"<version> by shard(s) <ids>: <file or detail>"`` per version refused."""
    bad: set[int] = field(default_factory=set)
    """Versions holding a refused file: those built on them are not tried."""

    def note(self, v: int, answers: Sequence[Restored]) -> int:
        """Record the shards' refusals of `v` (logged); how many refused."""
        refusals = [(i, _refused(v, a)) for i, a in enumerate(answers) if a.version != v]
        if not refusals:
            return 0
        first = refusals[0][1]
        by = ",".join(str(i) for i, _ in refusals)
        self.lines.append(f"{v} by shard(s) {by}: {first.file or first.detail}")
        # One line per version refused (each shard logs its own refusal too).
        log.warning(
            "version refused",
            extra={
                "fields": {
                    "version": v,
                    "shards": by,
                    "file": first.file,
                    "expected": first.expected,
                    "actual": first.actual,
                    "by": "cluster restore",
                }
            },
        )
        for _, r in refusals:
            bv = bad_version(ExportCorruptError("", file=r.file))
            self.bad.add(bv if bv is not None else v)
        return len(refusals)


def _refused(v: int, answer: Restored) -> Refused:
    """Why a shard did not load `v`, as its answer says."""
    if isinstance(answer.refused, Refused):
        return answer.refused
    return Refused("", f"version {v}", f"version {answer.version}", "the shard answered another version")


class Membership:
    """The coordinator's view of the shards: admits them at one version, or
    makes them all load one together. Runs in the coordinator's process."""

    def __init__(
        self,
        coordinator: Coordinator,
        client: ControlClient,
        model_dir: ModelAt | str,
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
        self.model_dir: ModelAt = model_dir if isinstance(model_dir, StoredModel) else Path(model_dir)
        self.interval_s = interval_s
        self.wait_log_s = wait_log_s
        self.urls = list(urls)
        self.cluster_restores = 0
        """Cluster restores done."""
        self.versions_refused = 0
        """Refusals of a version by a shard during cluster restores."""
        self.last_reports: list[MembershipBody | None] = []
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
            "joined": [None if r is None else self._member(r) for r in self.last_reports],
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
                await within(stop.wait(), self.interval_s)
            except TimeoutError:
                pass

    async def _reports(self) -> list[MembershipBody | None]:
        got = await asyncio.gather(*(t.membership() for t in self.client.shards), return_exceptions=True)
        out: list[MembershipBody | None] = []
        for r in got:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r
            out.append(r if isinstance(r, MembershipBody) else None)
        self.last_reports = out
        return out

    def _member(self, r: MembershipBody | None) -> bool:
        return r is not None and r.joined and r.epoch == self.coordinator.epoch

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
            self._wait_for(down, reports)
            return
        key = (tuple(r.boot_id if r is not None else None for r in reports), self._dir_key())
        if isinstance(self.coordinator.refusal, NoCommonVersionError) and key == self._refused_key:
            return  # nothing changed since the refusal: do not hash everything again
        joining = [i for i, r in enumerate(reports) if not self._member(r)]
        self.coordinator.refuse(
            ClusterNotReadyError(
                f"shard(s) {','.join(map(str, joining))} joining: the cluster is settling on one export version"
            )
        )
        async with self._files_lock, self.coordinator.paused():
            again = await self._reports()
            answered = [r for r in again if r is not None]
            if len(answered) == len(again):  # else: the next round
                await self._decide(answered, key)

    def _wait_for(self, down: list[int], reports: Sequence[MembershipBody | None]) -> None:
        """Shards `down` did not answer: leases wait for them (logged every `wait_log_s`)."""
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

    def _dir_key(self) -> tuple[tuple[int, float], ...]:
        """The versions and their files' latest change: a refusal is tried
        again once a damaged file is replaced or a version moved aside."""
        out = []
        for v, path in sorted(model_versions(self.model_dir).items()):
            if not isinstance(path, Path):
                out.append((v, 0.0))  # a bucket's version is never rewritten in place
                continue
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

    async def _decide(self, reports: list[MembershipBody], key: object) -> None:
        """Admit the shards at the version they agree on, or restore them all
        to the newest version every one can load."""
        dirs = model_versions(self.model_dir)
        agreed = agreed_version(reports, dirs)
        if agreed is not None:
            await self._admit_agreed(agreed, dirs, len(reports))
        else:
            await self._restore_cluster(reports, dirs, key)

    async def _admit_agreed(self, agreed: int, dirs: Mapping[int, Path | VersionSource], shards: int) -> None:
        coord = self.coordinator
        if agreed != coord.version:
            manifest = read_manifest(dirs[agreed]) if agreed else None
            coord.reset(
                agreed,
                manifest.offsets if manifest else {},
                manifest.stream if manifest else None,
                books=books_of(self.model_dir, agreed) if agreed else None,
            )
        if await self._admit(agreed):
            coord.refuse(None)
            log.info("cluster joined", extra={"fields": {"version": agreed, "shards": shards, "epoch": coord.epoch}})

    async def _restore_cluster(
        self, reports: list[MembershipBody], dirs: Mapping[int, Path | VersionSource], key: object
    ) -> None:
        """Every shard loads the newest version all of them can load, older
        ones tried together when one is refused; none: leases refused."""
        why = _why(reports, dirs, self._member)
        refusals = _Refusals()
        for v in sorted(dirs, reverse=True):
            built_on = ancestry(dirs, v)
            if built_on is None or built_on & refusals.bad:
                continue
            answers = await self._load_everywhere(v, reports)
            if answers is None:
                return  # the shards stay unjoined; the next round starts over
            refused = refusals.note(v, answers)
            self.versions_refused += refused
            if not refused:
                chain = next((a.chain for a in answers if isinstance(a.chain, str) and a.chain), str(v))
                await self._adopt(v, dirs, chain, why, refusals.lines)
                return
        self._refuse_all(key, why, refusals.lines)

    async def _load_everywhere(self, v: int, reports: Sequence[MembershipBody]) -> list[Restored] | None:
        """Every shard's answer to loading `v`; None when one could not be
        reached (logged). A shard that holds exactly `v` already (it loaded
        it at start, every file checked, and trained nothing since) needs no reload."""
        got = await asyncio.gather(
            *(
                _already(v) if r.version == v and r.clean else restore_on(t, v)
                for t, r in zip(self.restore_client.shards, reports)
            ),
            return_exceptions=True,
        )
        answers: list[Restored] = []
        unreachable: list[tuple[int, BaseException]] = []
        for i, r in enumerate(got):
            if isinstance(r, Restored):
                answers.append(r)
            elif not isinstance(r, Exception):
                raise r
            elif isinstance(r, PSError) and not isinstance(r, ShardUnavailableError):
                # An answer, not an outage (e.g. a shard without an
                # exports directory): that shard cannot load `v`.
                answers.append(refused_answer(v, r.code, r.detail))
            else:
                unreachable.append((i, r))
        if not unreachable:
            return answers
        log.warning(
            "cluster restore interrupted",
            extra={
                "fields": {
                    "version": v,
                    "unreachable": ",".join(str(i) for i, _ in unreachable),
                    "error": str(unreachable[0][1]),
                }
            },
        )
        return None

    def _refuse_all(self, key: object, why: str, refused: Sequence[str]) -> None:
        """No version loads on every shard: leases stay refused until one does."""
        self._refused_key = key
        err = NoCommonVersionError(
            f"no export version in {self.model_dir} loads on every shard ({why}; refused: "
            f"{'; '.join(refused) or 'no version on disk'}): move the damaged version directories aside "
            "and the shards retry, or restart every shard with --no-restore to start from empty tables"
        )
        self.coordinator.refuse(err)
        log.error("no common version: leases refused", extra={"fields": {"detail": err.detail}})

    async def _adopt(
        self, chosen: int, dirs: Mapping[int, Path | VersionSource], chain: str, why: str, refused: Sequence[str]
    ) -> None:
        """Every shard holds `chosen`: the coordinator takes its offsets under a new epoch and admits them."""
        coord = self.coordinator
        manifest = read_manifest(dirs[chosen])
        coord.reset(chosen, manifest.offsets, manifest.stream, books=books_of(self.model_dir, chosen))
        self.cluster_restores += 1
        if await self._admit(chosen):
            coord.refuse(None)
        log.warning(
            "cluster restore",
            extra={
                "fields": {
                    "version": chosen,
                    "chain": chain,
                    "why": why,
                    "refused": "; ".join(refused) or "-",
                    "epoch": coord.epoch,
                }
            },
        )
