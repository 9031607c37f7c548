"""Benchmark: failure drills on real processes — is every event trained, how
soon does training resume, is any line a traceback?

One embedded broker process (``ctrps broker``) serves every drill. Each drill
has its own topic (4 partitions), exports directory, 2 ``ctrps shard``
processes (shard 0 exports every few seconds) and one ``ctrps worker``
process in a group of its own, run by `app.supervisor.Supervisor` as
``ctrps cluster`` runs them: a child that exits on its own is restarted with
backoff, on the same ports. A producer in this process sends synthetic events
at ``--rate`` and counts those the broker acknowledged (*produced*). Drills:

- ``baseline``: no fault, measured in the same run;
- ``worker_sigkill``: the worker is SIGKILLed (its supervisor restarts it);
- ``shard_sigkill``: the shard holding the bias row (shard 1) is SIGKILLed
  once an export exists; it is restarted alone, restoring from the exports;
- ``shard_outage``: that shard is SIGSTOPped for ``--outage`` seconds (30;
  8 with ``--quick``), then SIGCONTinued;
- ``failed_cut``: that shard is SIGSTOPped during ``ctrps export`` (the cut
  cannot finish), SIGCONTinued, then ``ctrps export`` must succeed;
- ``offsetless_cut``: shards export only when asked; the first export is
  cut before the worker's first commit (no offsets), then the bias shard is
  SIGKILLed: the cluster restores that empty version and the worker must
  train again every event the group had committed;
- ``manifest_edited``: two exports by hand, then one offset of the newest
  manifest is raised by 1000 and both shards are SIGKILLed: the manifest's
  own checksum must refuse it, the older version is restored and the events
  after it trained again;
- ``no_restore``: the bias shard is SIGKILLed before any export (no version
  every shard can load: the worker exits 4), then every shard is restarted
  with ``--no-restore``, the runbook's way out: the worker resumes at the
  group's commits and must say how many committed events the model lacks;
  *trained* plus that count must equal *produced*;
- ``broker_restart`` (last, alone): production stops and every event is
  trained (a memory broker loses what it holds), then the broker is
  SIGKILLed and started again on the same port, its topic recreated, and
  production resumes: every event produced after the restart must be trained.

Per drill: *trained* is the number of event applications the shards hold,
the shows of the bias row (one per event applied), read from a final export
(``POST /v1/exports`` on shard 0, then the files); *replayed* = trained −
produced; *resume_s* the seconds from the end of the fault until every
shard's push counter (``GET /v1/stats``) moved again; *tracebacks* the lines
``Traceback (most recent call last):`` in every child's output; *lost* the
events the worker says the model lacks (``the shards started empty: N
events``; 0 elsewhere), and *replayed* = trained + lost − produced. Aims, printed
with each result: trained = produced at least once, replaying at most one
window (rate × window seconds); resume ≤ session timeout + 5 s (for
``worker_sigkill``, ≤ the broker's floor + 5 s where that is longer: its
partitions cannot move sooner); no traceback; and for ``worker_sigkill``, a
cut waits for the killed worker's lease at most its session timeout + 2 s
(*dead_lease_wait_s*, from shard 0's ``expired_leases`` line). Each phase has a deadline: a drill whose system misbehaves
reports the failure (``error``) instead of hanging.

``--quick`` (under two minutes) runs the drills but the broker's at once, then the
broker drill, with short phases; the full run runs them one after the other
with longer phases and a 30 s outage. Ratios printed: trained/produced per
drill, and each drill's resume time against the baseline's.

Run: ``python bench/bench_drills.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
import numpy as np
import orjson
import uvloop
from aiokafka import AIOKafkaProducer
from common import add_record_option, bench_mode, elapsed_s, print_result, progress_log

from app.cluster import end_broker_processes
from app.logs import configure_logging
from app.supervisor import Child, ChildSpec, RestartPolicy, Supervisor
from consumers.broker import create_topics, free_port, wait_for_metadata
from ps_core.checkpoint.export_files import latest_chain, list_versions
from ps_core.checkpoint.restore import restore_shards
from ps_core.hashing import shard_of
from ps_core.model.featurizer import FeatureHasher
from ps_core.synthetic import SyntheticStream

PARTITIONS = 4
SHARDS = 2
MODEL = "ctr"
HOST = "127.0.0.1"
TRACEBACK = b"Traceback (most recent call last):"
BIAS = np.array([FeatureHasher(MODEL).bias_key], dtype=np.uint64)
BIAS_SHARD = int(shard_of(BIAS, SHARDS)[0])
"""The shard the faults hit: it holds the bias row, so its losses show in the count."""
MANUAL_EXPORTS = ("offsetless_cut", "manifest_edited", "no_restore")
"""Drills whose shards export only when the drill asks (no interval)."""
GAP_LINES = {
    "replayed": re.compile(rb"restore gap replayed: restored version \d+ does not hold (\d+) events"),
    "lost": re.compile(rb"the shards started empty: (\d+) events the group committed are not in the model"),
}
"""The worker's lines for what the group committed past the shards' state."""

DEAD_LEASE = re.compile(rb"export version=\d+ .*?expired_leases=\['[^\]]*\] .*?lease_wait_ms=([\d.]+)")
"""Shard 0's line for a cut that gave up on an expired lease, and how long it waited."""


log = progress_log("bench_drills")
"""One progress line on stderr."""


def ctrps(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", "app.cli", *args)


@dataclass(frozen=True)
class Config:
    quick: bool
    rate: float
    window_s: float
    session_timeout_ms: int
    outage_s: float
    pre_s: float
    post_s: float
    export_interval_s: float
    phase_timeout_s: float
    drill_timeout_s: float
    decode_processes: int
    workdir: Path
    kafka_floor_s: float | None = None
    """The broker's floor for the worker drill, measured in the run (`kafka_rejoin_s`)."""

    @property
    def resume_aim_s(self) -> float:
        return self.session_timeout_ms / 1000 + 5.0

    def resume_aim_of(self, drill: str) -> float:
        """Session timeout + 5 s; for worker_sigkill, the broker's floor + 5 s
        where that is longer (its partitions cannot move sooner)."""
        if drill == "worker_sigkill" and self.kafka_floor_s is not None:
            return max(self.resume_aim_s, self.kafka_floor_s + 5.0)
        return self.resume_aim_s

    @property
    def dead_lease_aim_s(self) -> float:
        """How long a cut may wait for a SIGKILLed worker's lease: its session timeout + 2 s."""
        return self.session_timeout_ms / 1000 + 2.0

    @property
    def replay_bound(self) -> int:
        return int(self.rate * self.window_s)


def bias_shows(model_dir: Path) -> int:
    """Events applied, as of the newest export: the shows of the bias row."""
    restored = restore_shards(latest_chain(model_dir), SHARDS)
    table = restored.shards[BIAS_SHARD].tables[f"{MODEL}_w"]
    row = int(table.index.lookup(BIAS)[0])
    return int(table.shows[row]) if row >= 0 else 0


async def until(cond: Any, timeout_s: float, what: str, poll_s: float = 0.2) -> None:
    """Await `cond()` true, or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not await cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not within {timeout_s:.0f}s")
        await asyncio.sleep(poll_s)  # poll interval


def said_lost(out: bytes) -> int:
    """The events the worker's lines say the model lacks (``the shards started empty``)."""
    return sum(int(m) for m in GAP_LINES["lost"].findall(out))


class Broker:
    """The ``ctrps broker`` process every drill uses; killed and started again by one."""

    def __init__(
        self, out: BinaryIO, host: str = HOST, port: int = 0, wrap: Callable[[tuple[str, ...]], tuple[str, ...]] = tuple
    ) -> None:
        """On `host` (its advertised address too) and `port` (0: a free one);
        `wrap` makes the command that runs an argv there (bench_hosts: in a namespace)."""
        self.port = port or free_port(host)
        self.bootstrap = f"{host}:{self.port}"
        self.argv = wrap(ctrps("broker", "--host", host, "--port", str(self.port)))
        self.sup = Supervisor(out=out, grace_s=10.0)
        self.child: Child | None = None

    async def start(self, timeout_s: float) -> int:
        """Start it on its port, retrying while it exits at once (a refused
        port); returns the attempts it took."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            attempt += 1
            self.child = await self.sup.start(ChildSpec("broker", self.argv))
            try:
                await self.sup.wait_ready(
                    self.child, lambda: self._answers(), max(1.0, min(20.0, deadline - time.monotonic()))
                )
                return attempt
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the broker did not start again within {timeout_s:.0f}s: {exc}") from exc
                await self.sup._stop(self.child)
                await asyncio.sleep(1.0)  # before the next attempt on the same port

    async def _answers(self) -> bool:
        await wait_for_metadata(self.bootstrap, timeout_s=2.0)
        return True

    async def kill(self) -> None:
        """SIGKILL the role and its binary (which runs in a session of its own)."""
        assert self.child is not None
        os.killpg(self.child.pid, signal.SIGKILL)
        await self.child.exited.wait()
        await end_broker_processes(self.port)


@dataclass
class Result:
    name: str
    produced: int = 0
    trained: int | None = None
    replayed: int | None = None
    lost: int = 0
    """Events the worker said the model lacks (``the shards started empty``)."""
    resume_s: float | None = None
    tracebacks: int = 0
    restarts: int = 0
    send_failures: int = 0
    error: str = ""
    seconds: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)
    aims: dict[str, bool] = field(default_factory=dict)


class Drill:
    """One drill's processes, producer and measurements."""

    def __init__(self, name: str, cfg: Config, broker: Broker) -> None:
        self.name, self.cfg, self.broker = name, cfg, broker
        self.dir = cfg.workdir / name
        self.dir.mkdir(parents=True)
        self.log_path = self.dir / "children.log"
        self.out = self.log_path.open("wb")
        self.sup = Supervisor(
            out=self.out, grace_s=5.0 if cfg.quick else 10.0,
            restart=RestartPolicy(backoff_s=0.5, max_backoff_s=4.0, healthy_s=30.0, max_restarts=20, window_s=600.0),
        )  # fmt: skip
        self.topic = f"drill-{name}-{uuid.uuid4().hex[:6]}"
        self.exports = self.dir / "exports"
        self.urls, self.rpc_ports = self.addresses()
        self.shards: list[Child] = []
        self.worker: Child | None = None
        self.result = Result(name)
        self.producing = asyncio.Event()
        self.producer_task: asyncio.Task[None] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.no_restore = False
        """Set by a drill: shards restarted from then on start with ``--no-restore``."""

    # -- processes ------------------------------------------------------------------

    def addresses(self) -> tuple[list[str], list[int]]:
        """The shards' URLs and RPC ports: free ports on loopback."""
        ports: list[int] = []
        while len(ports) < 2 * SHARDS:
            p = free_port(HOST)
            if p not in ports:
                ports.append(p)
        return [f"http://{HOST}:{p}" for p in ports[:SHARDS]], ports[SHARDS:]

    def role_argv(self, role: str, argv: tuple[str, ...]) -> tuple[str, ...]:
        """The command running `role` (``shard-<i>``, ``worker``): `argv` itself here."""
        return argv

    async def start(self) -> None:
        c = self.cfg
        await create_topics(self.broker.bootstrap, {self.topic: PARTITIONS, self.topic + ".dlq": 1})
        self.session = aiohttp.ClientSession()
        interval = 0.0 if self.name in MANUAL_EXPORTS else c.export_interval_s
        for i, url in enumerate(self.urls):
            extra = ["--shards", ",".join(self.urls), "--export-interval", str(interval)] if i == 0 else []
            host, port = url.split("//", 1)[1].rsplit(":", 1)
            argv = self.role_argv(f"shard-{i}", ctrps(
                "shard", "--host", host, "--port", port, "--rpc-port", str(self.rpc_ports[i]),
                "--shard-id", str(i), "--num-shards", str(SHARDS), "--stats-interval", "0",
                "--exports-dir", str(self.exports), "--model-name", MODEL, *extra,
                *(() if host == HOST else ("--insecure",))))  # fmt: skip
            again = partial(self._restart_argv, argv)
            spec = ChildSpec(f"shard-{i}", argv, group="shards", restart=True, restart_argv=again)
            self.shards.append(await self.sup.start(spec))
        await asyncio.gather(
            *(
                self.sup.wait_ready(ch, partial(self._healthy, u), c.phase_timeout_s)
                for ch, u in zip(self.shards, self.urls)
            )
        )
        if self.name == "offsetless_cut":
            # Before the worker exists: the cut holds no offsets.
            rc, why = await self.export()
            if rc != 0:
                raise RuntimeError(f"the export before the worker failed ({rc}): {why}")
        self.worker = await self.sup.start(
            ChildSpec(
                "worker",
                self.role_argv("worker", ctrps("worker", "--bootstrap", self.broker.bootstrap, "--shards", ",".join(self.urls),
                      "--topic", self.topic, "--group", f"g-{self.topic}", "--model-name", MODEL,
                      "--window-seconds", str(c.window_s), "--session-timeout-ms", str(c.session_timeout_ms),
                      "--decode-processes", str(c.decode_processes))),
                restart=True,
            )
        )  # fmt: skip
        self.producing.set()
        self.producer_task = asyncio.create_task(self._produce(), name=f"produce-{self.name}")

    def _restart_argv(self, argv: tuple[str, ...]) -> tuple[str, ...]:
        return argv + (("--no-restore",) if self.no_restore else ())

    async def stop(self) -> None:
        self.producing.clear()
        if self.producer_task is not None:
            self.producer_task.cancel()
            await asyncio.gather(self.producer_task, return_exceptions=True)
        await asyncio.wait_for(self.sup.stop_all(), 60)
        if self.session is not None:
            await self.session.close()
        self.out.close()
        self.result.restarts = self.sup.restarts

    async def _healthy(self, url: str) -> bool:
        assert self.session is not None
        async with self.session.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200

    # -- the producer -----------------------------------------------------------------

    async def _produce(self) -> None:
        """Send `rate` events/s in tenths of a second; count the acknowledged.
        A failed batch (broker gone) is not counted; the producer is made anew."""
        c = self.cfg
        per_tick = max(1, int(c.rate / 10))
        stream = SyntheticStream(seed=sum(self.name.encode()), start_ts=time.time(), events_per_s=c.rate)
        batches = stream.iter_batches(10**12, per_tick)
        sent = 0
        while self.producing.is_set():
            producer = AIOKafkaProducer(bootstrap_servers=self.broker.bootstrap, linger_ms=5, request_timeout_ms=5000)
            try:
                await asyncio.wait_for(producer.start(), 10)
                while self.producing.is_set():
                    t0 = time.monotonic()
                    now_ms = int(time.time() * 1000)
                    futs = [
                        await producer.send(self.topic, orjson.dumps(e), partition=(sent + i) % PARTITIONS, timestamp_ms=now_ms)
                        for i, e in enumerate(next(batches))
                    ]  # fmt: skip
                    sent += len(futs)
                    got = await asyncio.wait_for(asyncio.gather(*futs, return_exceptions=True), 15)
                    ok = sum(not isinstance(g, BaseException) for g in got)
                    self.result.produced += ok
                    if ok < len(got):
                        self.result.send_failures += len(got) - ok
                        raise ConnectionError("sends failed")
                    await asyncio.sleep(max(0.0, t0 + 0.1 - time.monotonic()))  # pacing
            except asyncio.CancelledError:
                raise
            except Exception:
                await asyncio.sleep(0.5)  # the broker is away: try a new producer soon
            finally:
                try:
                    await asyncio.wait_for(producer.stop(), 10)
                except Exception:
                    pass

    # -- measurements -----------------------------------------------------------------

    async def pushes(self) -> list[int]:
        """Each shard's push count of the model's table (-1: no answer)."""
        session = self.session
        assert session is not None

        async def one(url: str) -> int:
            try:
                async with session.get(url + "/v1/stats", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    body = await r.json()
                return int(body["tables"].get(f"{MODEL}_w", {}).get("pushes", 0))
            except Exception:
                return -1

        return list(await asyncio.gather(*(one(u) for u in self.urls)))

    async def wait_training(self) -> None:
        async def trains() -> bool:
            return all(p > 0 for p in await self.pushes())

        await until(trains, self.cfg.phase_timeout_s, "training on every shard")

    async def wait_resumed(self, t_end: float) -> float | None:
        """Seconds from `t_end` (monotonic) until every shard's pushes moved."""
        base = await self.pushes()
        deadline = t_end + self.cfg.phase_timeout_s
        while time.monotonic() < deadline:
            now = await self.pushes()
            if all(n > 0 and n != b for n, b in zip(now, base)):
                return time.monotonic() - t_end
            await asyncio.sleep(0.2)  # poll interval
        return None

    async def export(self) -> tuple[int, str]:
        """``ctrps export`` against shard 0: exit status ("timeout" as -1) and its stderr's end."""
        proc = await asyncio.create_subprocess_exec(
            *ctrps("export", "--shard0", self.urls[0], "--timeout", str(self.cfg.phase_timeout_s)),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        try:
            _, err = await asyncio.wait_for(proc.communicate(), self.cfg.phase_timeout_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return -1, "timed out"
        self.out.write(b"".join(b"[export] " + line + b"\n" for line in err.splitlines()))
        return proc.returncode or 0, err.decode(errors="replace").strip()[-300:]

    async def trained(self) -> int | None:
        """Cut now and read the bias shows from the files; None when the cut fails."""
        assert self.session is not None
        try:
            async with self.session.post(
                self.urls[0] + "/v1/exports", json={}, timeout=aiohttp.ClientTimeout(total=30)
            ) as r:
                if r.status != 201:
                    self.result.notes["last_export_error"] = (await r.text())[:300]
                    return None
            return await asyncio.to_thread(bias_shows, self.exports / MODEL)
        except Exception as exc:
            self.result.notes["last_export_error"] = repr(exc)[:300]
            return None

    async def drain(self) -> None:
        """Stop producing; count trained until it reaches produced, stops moving, or the deadline."""
        self.producing.clear()
        if self.producer_task is not None:
            await asyncio.wait_for(self.producer_task, 30)
        produced = self.result.produced
        deadline = time.monotonic() + self.cfg.phase_timeout_s
        last, unchanged = None, 0
        while time.monotonic() < deadline:
            n = await self.trained()
            if n is not None:
                self.result.trained = n
                # Events the worker said the model lacks are never trained.
                if n + said_lost(self.log_path.read_bytes()) >= produced:
                    break
            unchanged = unchanged + 1 if n == last else 0
            if unchanged >= 3:  # three cuts 2 s apart saw nothing more
                break
            last = n
            await asyncio.sleep(2.0)  # poll interval

    def finish(self, t0: float) -> Result:
        r, c = self.result, self.cfg
        r.seconds = time.monotonic() - t0
        out = self.log_path.read_bytes()
        r.tracebacks = out.count(TRACEBACK)
        for action, line in GAP_LINES.items():
            counts = [int(m) for m in line.findall(out)]
            if counts:
                r.notes[f"gap_{action}_lines"] = counts
        r.lost = said_lost(out)
        if r.trained is not None:
            r.replayed = r.trained + r.lost - r.produced
        if self.name == "worker_sigkill":
            # The killed worker's lease (if it held one) holds a cut until it expires.
            waits = [float(m) / 1000 for m in DEAD_LEASE.findall(out)]
            r.notes["dead_lease_wait_s"] = round(max(waits), 1) if waits else 0.0
        r.aims = {
            "trained_eq_produced": r.replayed is not None and 0 <= r.replayed <= c.replay_bound,
            "resume": r.resume_s is not None and r.resume_s <= c.resume_aim_of(self.name),
            "no_tracebacks": r.tracebacks == 0,
            "no_error": not r.error,
            **(
                {"dead_lease_wait": r.notes["dead_lease_wait_s"] <= c.dead_lease_aim_s}
                if self.name == "worker_sigkill"
                else {}
            ),
        }
        return r


# -- the drills' faults ---------------------------------------------------------------
# Each returns the monotonic time the fault ended (training may resume from then).


async def fault_none(d: Drill) -> float:
    return time.monotonic()


async def fault_worker_sigkill(d: Drill) -> float:
    assert d.worker is not None
    d.result.notes["killed_pid"] = d.worker.pid
    os.kill(d.worker.pid, signal.SIGKILL)
    return time.monotonic()


async def fault_shard_sigkill(d: Drill) -> float:
    async def exported() -> bool:
        model_dir = d.exports / MODEL
        return model_dir.is_dir() and any(v.manifest.offsets for v in list_versions(model_dir))

    await until(exported, d.cfg.phase_timeout_s, "an export with offsets")
    # Its supervisor starts it again on the same ports; it restores the newest export.
    return await _kill_and_wait(d, [BIAS_SHARD])


async def _healthy_new(d: Drill, i: int, old_pid: int) -> bool:
    shard = d.shards[i]
    if shard.pid == old_pid or shard.exited.is_set():
        return False
    try:
        return await d._healthy(d.urls[i])
    except Exception:
        return False


async def fault_shard_outage(d: Drill) -> float:
    shard = d.shards[BIAS_SHARD]
    os.kill(shard.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(d.cfg.outage_s)  # the outage itself
    finally:
        os.kill(shard.pid, signal.SIGCONT)
    d.result.notes["outage_s"] = d.cfg.outage_s
    d.result.notes["worker_restarts_during_outage"] = d.worker.restarts if d.worker else 0
    return time.monotonic()


async def fault_failed_cut(d: Drill) -> float:
    shard = d.shards[BIAS_SHARD]
    os.kill(shard.pid, signal.SIGSTOP)
    try:
        # The cut cannot finish while the shard does not answer; the export
        # call is bounded by the phase timeout.
        d.result.notes["cut_during_outage_rc"], d.result.notes["cut_during_outage"] = await asyncio.wait_for(
            d.export(), d.cfg.phase_timeout_s + 10
        )
    finally:
        os.kill(shard.pid, signal.SIGCONT)
    t_end = time.monotonic()
    rc, why = await d.export()
    d.result.notes["export_after_rc"], d.result.notes["export_after"] = rc, why
    if rc != 0:
        d.result.error = f"the export after the failed cut failed ({rc}): {why}"
    return t_end


async def fault_broker_restart(d: Drill) -> float:
    # A memory broker loses what it holds, acknowledged or not: the producer
    # stops and the worker trains everything first, so the drill asks what the
    # issue of a restart is (is every event produced after it trained, and
    # nothing trained before it lost?), not what memory storage means.
    await d.drain()
    if d.result.trained is None or d.result.trained < d.result.produced:
        d.result.error = f"not drained before the kill: trained {d.result.trained} of {d.result.produced}"
    d.result.notes["trained_before_kill"] = d.result.trained
    await d.broker.kill()
    t_down = time.monotonic()
    attempts = await d.broker.start(d.cfg.phase_timeout_s)
    await create_topics(d.broker.bootstrap, {d.topic: PARTITIONS, d.topic + ".dlq": 1})
    d.result.notes["broker_start_attempts"] = attempts
    d.result.notes["broker_down_s"] = round(time.monotonic() - t_down, 2)
    d.producing.set()
    d.producer_task = asyncio.create_task(d._produce(), name=f"produce-{d.name}")
    return time.monotonic()


async def fault_offsetless_cut(d: Drill) -> float:
    # The only export (taken before the worker started) holds no offsets.
    return await _kill_and_wait(d, [BIAS_SHARD])


async def _kill_and_wait(d: Drill, which: list[int], sig: int = signal.SIGKILL) -> float:
    """Signal shards `which`; wait until their supervisor has them healthy again."""
    pids = {i: d.shards[i].pid for i in which}
    for pid in pids.values():
        os.kill(pid, sig)
    for i, pid in pids.items():
        await until(lambda i=i, pid=pid: _healthy_new(d, i, pid), d.cfg.phase_timeout_s, f"shard-{i} back", poll_s=0.1)
    return time.monotonic()


async def fault_manifest_edited(d: Drill) -> float:
    for _ in range(2):
        rc, why = await d.export()
        if rc != 0:
            raise RuntimeError(f"an export failed ({rc}): {why}")
        await asyncio.sleep(d.cfg.pre_s)  # training past the export
    newest = max(list_versions(d.exports / MODEL), key=lambda v: v.version)
    path = d.exports / MODEL / f"{newest.version:010d}" / "manifest.json"
    raw = json.loads(path.read_text())
    offsets = raw["offsets"][d.topic]
    part = max(offsets, key=lambda p: offsets[p])
    offsets[part] += 1000  # one digit of one offset
    path.write_text(json.dumps(raw, indent=2) + "\n")
    d.result.notes["edited"] = f"version {newest.version} partition {part}: {offsets[part] - 1000} -> {offsets[part]}"
    end = await _kill_and_wait(d, list(range(SHARDS)))
    d.result.notes["manifest_refused"] = d.log_path.read_bytes().count(b"manifest.json: sha256")
    if not d.result.notes["manifest_refused"]:
        d.result.error = "the edited manifest was not refused"
    return end


async def fault_no_restore(d: Drill) -> float:
    await _kill_and_wait(d, [BIAS_SHARD])

    async def refused() -> bool:
        return b"no common version: leases refused" in d.log_path.read_bytes()

    await until(refused, d.cfg.phase_timeout_s, "no common version")
    # The runbook: restart every shard with --no-restore.
    d.no_restore = True
    return await _kill_and_wait(d, list(range(SHARDS)), signal.SIGTERM)


DRILLS = {
    "baseline": fault_none,
    "worker_sigkill": fault_worker_sigkill,
    "shard_sigkill": fault_shard_sigkill,
    "shard_outage": fault_shard_outage,
    "failed_cut": fault_failed_cut,
    "offsetless_cut": fault_offsetless_cut,
    "manifest_edited": fault_manifest_edited,
    "no_restore": fault_no_restore,
    "broker_restart": fault_broker_restart,
}


_MEMBER = """
import asyncio, sys, time
from aiokafka import AIOKafkaConsumer
async def main(boot, topic, session_ms):
    c = AIOKafkaConsumer(topic, bootstrap_servers=boot, group_id="g-" + topic, enable_auto_commit=False,
                         session_timeout_ms=session_ms, heartbeat_interval_ms=max(100, session_ms // 5))
    await c.start()
    while not c.assignment():
        await c.getmany(timeout_ms=100)
    print("assigned", flush=True)
    await asyncio.sleep(600)
asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def kafka_rejoin_s(bootstrap: str, session_timeout_ms: int, timeout_s: float) -> float | None:
    """The broker's own floor for the worker_sigkill drill: seconds from
    SIGKILLing a bare aiokafka consumer (the only member of its group) until a
    new one started at once holds the partitions again. None past `timeout_s`."""
    topic = f"rejoin-{uuid.uuid4().hex[:6]}"
    await create_topics(bootstrap, {topic: PARTITIONS})

    async def member() -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-c", _MEMBER, bootstrap, topic, str(session_timeout_ms),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip

    procs: list[asyncio.subprocess.Process] = []
    try:
        first = await member()
        procs.append(first)
        assert first.stdout is not None
        await asyncio.wait_for(first.stdout.readline(), timeout_s)
        first.kill()
        await first.wait()
        t_kill = time.monotonic()
        second = await member()
        procs.append(second)
        assert second.stdout is not None
        await asyncio.wait_for(second.stdout.readline(), timeout_s)
        return time.monotonic() - t_kill
    except TimeoutError:
        return None
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                await p.wait()


async def run_drill(
    name: str,
    cfg: Config,
    broker: Broker,
    make: Callable[[str], Drill] | None = None,
    faults: Mapping[str, Callable[[Any], Awaitable[float]]] = DRILLS,
) -> Result:
    """Run drill `name` (its fault from `faults`) on a `Drill` (`make(name)` if given)."""
    d = make(name) if make else Drill(name, cfg, broker)
    t0 = time.monotonic()
    try:

        async def body() -> None:
            await d.start()
            await d.wait_training()
            await asyncio.sleep(cfg.pre_s)  # steady training before the fault
            t_end = await faults[name](d)
            at_fault_end = d.result.produced
            d.result.resume_s = await d.wait_resumed(t_end)
            if d.result.resume_s is None:
                d.result.error = d.result.error or f"training did not resume within {cfg.phase_timeout_s:.0f}s"
            await asyncio.sleep(cfg.post_s)  # training after the fault
            d.result.notes["produced_after_fault"] = d.result.produced - at_fault_end
            if d.result.produced == at_fault_end:
                d.result.error = d.result.error or "nothing was produced after the fault"
            await d.drain()

        await asyncio.wait_for(body(), cfg.drill_timeout_s)
    except Exception as exc:  # a phase's deadline, the drill's, a process that never started
        d.result.error = d.result.error or f"{type(exc).__name__}: {exc}"
    finally:
        try:
            await d.stop()
        except Exception as exc:
            d.result.error = d.result.error or f"stop: {exc!r}"
    r = d.finish(t0)
    ratio = f"{r.trained / r.produced:.3f}" if r.trained is not None and r.produced else "-"
    log(
        f"{name}: produced {r.produced}, trained {r.trained}, lost (said) {r.lost}, replayed {r.replayed} "
        f"(aim 0..{cfg.replay_bound}), trained/produced {ratio}; resume "
        f"{'-' if r.resume_s is None else f'{r.resume_s:.1f}'} s (aim <= {cfg.resume_aim_of(name):.0f}); "
        f"tracebacks {r.tracebacks} (aim 0); restarts {r.restarts}; "
        + ("PASS" if all(r.aims.values()) else "FAIL " + ",".join(k for k, v in r.aims.items() if not v))
        + (f"; error: {r.error}" if r.error else "")
    )
    return r


def figures(r: Result, base: Result | None) -> dict[str, Any]:
    """A drill's figures in the JSON line: counts, ratios to `base` (the baseline), aims, notes."""
    return {
        "produced": r.produced, "trained": r.trained, "lost": r.lost, "replayed": r.replayed,
        "ratio_trained_vs_produced": (r.trained / r.produced) if r.trained is not None and r.produced else None,
        "resume_s": r.resume_s,
        "ratio_resume_vs_baseline": (r.resume_s / base.resume_s)
        if base and base.resume_s and r.resume_s is not None else None,
        "tracebacks": r.tracebacks, "restarts": r.restarts, "send_failures": r.send_failures,
        "seconds": round(r.seconds, 1), "aims": r.aims, "passed": all(r.aims.values()), "error": r.error, **r.notes,
    }  # fmt: skip


def config_of(args: argparse.Namespace, workdir: Path, *, drill_timeout_s: float, decode_processes: int) -> Config:
    """The drills' settings from the flags both drill benches take (``--quick``,
    ``--rate``, ``--session-timeout-ms``, ``--outage``)."""
    quick = args.quick
    return Config(
        quick=quick,
        rate=args.rate or (500.0 if quick else 2000.0),
        window_s=1.0,
        session_timeout_ms=args.session_timeout_ms or (6000 if quick else 10_000),
        outage_s=args.outage if args.outage is not None else (8.0 if quick else 30.0),
        pre_s=2.0 if quick else 10.0,
        post_s=2.0 if quick else 10.0,
        export_interval_s=2.0 if quick else 5.0,
        phase_timeout_s=20.0 if quick else 60.0,
        drill_timeout_s=drill_timeout_s,
        decode_processes=decode_processes,
        workdir=workdir,
    )


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quick = args.quick
    workdir = Path(tempfile.mkdtemp(prefix="bench-drills-"))
    cfg = config_of(args, workdir, drill_timeout_s=55.0 if quick else 300.0, decode_processes=args.decode_processes)
    names = args.drill or list(DRILLS)
    log(
        f"drills {','.join(names)} in {workdir}; rate {cfg.rate:g}/s, window {cfg.window_s:g} s, "
        f"session timeout {cfg.session_timeout_ms} ms, outage {cfg.outage_s:g} s; faults hit shard-{BIAS_SHARD}"
    )
    broker_out = (workdir / "broker.log").open("wb")
    broker = Broker(broker_out)
    floor: float | None = None
    results: dict[str, Result] = {}
    try:
        await broker.start(60.0)
        floor = await kafka_rejoin_s(broker.bootstrap, cfg.session_timeout_ms, cfg.phase_timeout_s + 30)
        cfg = replace(cfg, kafka_floor_s=floor)
        log(
            f"the broker's floor: a bare consumer SIGKILLed and started again holds its partitions after "
            f"{'-' if floor is None else f'{floor:.1f}'} s (session timeout {cfg.session_timeout_ms} ms)"
        )
        parallel = quick if args.parallel is None else args.parallel
        # The broker drill disturbs every drill on the broker: it runs last, alone.
        first = [n for n in names if n != "broker_restart"]
        if parallel:
            for r in await asyncio.gather(*(run_drill(n, cfg, broker) for n in first)):
                results[r.name] = r
        else:
            for n in first:
                results[n] = await run_drill(n, cfg, broker)
        if "broker_restart" in names:
            results["broker_restart"] = await run_drill("broker_restart", cfg, broker)
    finally:
        await broker.sup.stop_all()
        await end_broker_processes(broker.port)  # a killed role's binary, if any
        broker_out.close()
    broker_tracebacks = (workdir / "broker.log").read_bytes().count(TRACEBACK)
    if "broker_restart" in results:
        results["broker_restart"].tracebacks += broker_tracebacks
        results["broker_restart"].aims["no_tracebacks"] = results["broker_restart"].tracebacks == 0

    base = results.get("baseline")
    out: dict[str, Any] = {
        "mode": bench_mode(quick),
        "parallel": bool(quick if args.parallel is None else args.parallel),
        "rate_events_per_s": cfg.rate,
        "window_s": cfg.window_s,
        "partitions": PARTITIONS,
        "shards": SHARDS,
        "session_timeout_ms": cfg.session_timeout_ms,
        "outage_s": cfg.outage_s,
        "aim_resume_s": cfg.resume_aim_s,
        "aim_resume_worker_sigkill_s": cfg.resume_aim_of("worker_sigkill"),
        "aim_dead_lease_wait_s": cfg.dead_lease_aim_s,
        "aim_replay_max": cfg.replay_bound,
        "kafka_rejoin_floor_s": floor,
        "workdir": str(workdir),
    }
    passed = 0
    for name, r in results.items():
        out[name] = figures(r, base)
        if name == "worker_sigkill" and floor and r.resume_s is not None:
            out[name]["ratio_resume_vs_kafka_floor"] = r.resume_s / floor
        passed += out[name]["passed"]
    out["drills_passed"] = passed
    out["drills"] = len(results)
    out["elapsed_s"] = round(elapsed_s(), 1)
    log(f"{passed}/{len(results)} drills met every aim")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases, drills at once (under two minutes)")
    parser.add_argument("--drill", action="append", choices=list(DRILLS), help="run only this drill; repeatable")
    parser.add_argument("--rate", type=float, help="events/s per drill (default 2000, --quick 500)")
    parser.add_argument("--outage", type=float, help="seconds of the shard outage (default 30, --quick 8)")
    parser.add_argument("--session-timeout-ms", type=int, help="the workers' (default 10000, --quick 6000)")
    parser.add_argument("--decode-processes", type=int, default=1, help="each worker's decode processes")
    par = parser.add_mutually_exclusive_group()
    par.add_argument("--parallel", action="store_true", default=None, help="run the drills at once")
    par.add_argument("--sequential", dest="parallel", action="store_false", help="one drill after the other")
    configure_logging("text", logging.WARNING)  # restarts and kills, not every start
    add_record_option(parser)
    ARGS = parser.parse_args()
    print_result(uvloop.run(main(ARGS)), ARGS)
