"""Benchmark: failure drills across hosts on one machine — each role in a
network namespace of its own with its own address (`hosts.Hosts`: veth pairs
to one bridge), faults made in the network: a link cut, a partition, a
bandwidth limit. Needs root (``ip netns``); without it the run says why.

The drills are bench_drills' (its `Drill`, `Config`, `Result`, producer,
counts and aims), with every role placed in a host and bound to the host's
address: one ``ctrps broker`` (advertising its host's address) serves every
drill; each drill has 2 ``ctrps shard`` hosts (shard 0 exports every few
seconds to a directory on the shared filesystem) and a ``ctrps worker`` host.
The producer (this process, in the root namespace, which holds the bridge's
gateway address) sends synthetic events at ``--rate``; *produced* counts those
the broker acknowledged. Drills:

- ``baseline``: no fault;
- ``shard_partition``: the bias shard's host is cut off (its link down) for
  ``--outage`` seconds (30; 8 with ``--quick``), then put back;
- ``worker_limited``: the worker's link is limited to ``--mbit`` (32) Mbit/s
  both ways (tbf) for ``--outage`` seconds; the worker's bytes over that
  phase are reported as Mbit/s;
- ``api_partition``: an API (``ctrps serve`` over the drill's shards) and a
  serving replica (``ctrps serve --follow`` of the exports) in hosts of their
  own; a predict loop posts one event to each every 0.1 s; the API is
  partitioned from both shards (blackhole routes: the API, the replica and
  the bench still reach each other) for ``--outage`` seconds;
- ``broker_partition`` (last, alone: it stops every drill's stream): the
  broker's host is cut off for ``--outage`` seconds.

Per drill: produced, trained (the bias row's shows in a final export),
replayed (trained − produced), resume_s (from the link's return until every
shard's pushes move), tracebacks in every child's output, and for the API
drill the predict errors of the API (while cut off, and outside that) and of
the replica. Aims, printed met/not met: trained = produced at least once,
replaying at most one window; resume ≤ session timeout + 5 s; no traceback;
predict errors from the API only while its shards were cut off (the cut plus
the resume aim), none from the replica.

``--quick`` (under two minutes) runs the drills but the broker's at once,
then the broker's, with short phases; the full run runs them one after the
other with longer phases and 30 s faults.

Run (as root): ``python bench/bench_hosts.py [--quick] [--drill NAME]``; the
last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import uvloop
from bench_drills import (
    BIAS_SHARD,
    MODEL,
    SHARDS,
    TRACEBACK,
    Broker,
    Config,
    Drill,
    Result,
    config_of,
    ctrps,
    figures,
    run_drill,
)
from common import add_record_option, bench_mode, elapsed_s, print_result, progress_log
from hosts import Hosts, available

from app.logs import configure_logging
from app.supervisor import Child, ChildSpec
from ps_core.synthetic import SyntheticStream

DRILLS = ("baseline", "shard_partition", "worker_limited", "api_partition", "broker_partition")
CODE = {"baseline": "base", "shard_partition": "shard", "worker_limited": "limit", "api_partition": "api",
        "broker_partition": "brk"}  # fmt: skip
"""Each drill's prefix of its host names."""
BROKER_PORT, SHARD_PORT, RPC_PORT, API_PORT = 9092, 7100, 7200, 8080
"""Each host is a network namespace of its own: fixed ports never collide."""
PREDICT_EVERY_S = 0.1
PREDICT_TIMEOUT_S = 5.0
"""Longer than the API's shard deadline (2 s): a failed predict is the API's own answer."""

log = progress_log("bench_hosts")
"""One progress line on stderr."""


def host_names(drills: list[str]) -> list[str]:
    """Every host the drills need: the broker's, and per drill its shards,
    worker, and for ``api_partition`` its API and replica."""
    names = ["broker"]
    for d in drills:
        names += [f"{CODE[d]}-shard-{i}" for i in range(SHARDS)] + [f"{CODE[d]}-worker"]
        if d == "api_partition":
            names += [f"{CODE[d]}-api", f"{CODE[d]}-replica"]
    return names


class HostDrill(Drill):
    """bench_drills' `Drill` with each role in its host, on the host's address."""

    def __init__(self, name: str, cfg: Config, broker: Broker, hosts: Hosts, mbit: float) -> None:
        self.hosts, self.mbit = hosts, mbit
        super().__init__(name, cfg, broker)
        self.predicts: dict[str, list[tuple[float, bool]]] = {"api": [], "replica": []}
        """Each predict's time (monotonic) and success, by target."""
        self.predict_errors: dict[str, dict[str, int]] = {"api": {}, "replica": {}}
        """Failed predicts by target and kind (``http 503``, ``TimeoutError``, ...)."""
        self.predict_task: asyncio.Task[None] | None = None
        self.cut_from_to: tuple[float, float] | None = None

    def host(self, role: str) -> str:
        return f"{CODE[self.name]}-{role}"

    def addresses(self) -> tuple[list[str], list[int]]:
        addrs = [self.hosts.address[self.host(f"shard-{i}")] for i in range(SHARDS)]
        return [f"http://{a}:{SHARD_PORT}" for a in addrs], [RPC_PORT] * SHARDS

    def role_argv(self, role: str, argv: tuple[str, ...]) -> tuple[str, ...]:
        return self.hosts.cmd(self.host(role), argv)

    def url(self, role: str) -> str:
        return f"http://{self.hosts.address[self.host(role)]}:{API_PORT}"

    async def start(self) -> None:
        await super().start()
        if self.name != "api_partition":
            return
        serving: list[Child] = []
        for role, extra in (
            ("api", ("--shards", ",".join(self.urls))),
            ("replica", ("--follow", str(self.exports / MODEL), "--startup-timeout", str(self.cfg.phase_timeout_s))),
        ):
            addr = self.hosts.address[self.host(role)]
            argv = self.role_argv(role, ctrps("serve", "--host", addr, "--port", str(API_PORT), "--insecure",
                                              "--model-name", MODEL, *extra))  # fmt: skip
            serving.append(await self.sup.start(ChildSpec(role, argv, restart=True)))
        await asyncio.gather(
            *(
                self.sup.wait_ready(ch, partial(self._ready, self.url(r)), self.cfg.phase_timeout_s)
                for ch, r in zip(serving, ("api", "replica"))
            )
        )
        self.predict_task = asyncio.create_task(self._predict_loop(), name="predict")

    async def _ready(self, url: str) -> bool:
        assert self.session is not None
        async with self.session.get(url + "/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200

    async def _predict_loop(self) -> None:
        """One event to the API and to the replica every `PREDICT_EVERY_S`
        (or once the last answer came); each answer's time and success."""
        assert self.session is not None
        session = self.session
        event = next(SyntheticStream(seed=7, start_ts=time.time(), events_per_s=1).iter_batches(1, 1))[0]
        event.pop("label", None)
        body = orjson.dumps({"events": [event]})

        async def loop(role: str) -> None:
            while True:
                t = time.monotonic()
                try:
                    async with session.post(
                        self.url(role) + "/v1/predict",
                        data=body,
                        headers={"Content-Type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=PREDICT_TIMEOUT_S),
                    ) as r:
                        got = await r.read()
                        ok = r.status == 200 and len(orjson.loads(got)["predictions"]) == 1
                        why = "" if ok else f"http {r.status}"
                except Exception as exc:
                    ok, why = False, type(exc).__name__
                self.predicts[role].append((t, ok))
                if why:
                    self.predict_errors[role][why] = self.predict_errors[role].get(why, 0) + 1
                await asyncio.sleep(max(0.0, t + PREDICT_EVERY_S - time.monotonic()))  # pacing

        # One loop each: the API's answers, slow while it is cut off, never hold up the replica's.
        await asyncio.gather(loop("api"), loop("replica"))

    async def stop(self) -> None:
        if self.predict_task is not None:
            self.predict_task.cancel()
            await asyncio.gather(self.predict_task, return_exceptions=True)
        await super().stop()

    def finish(self, t0: float) -> Result:
        r = super().finish(t0)
        if self.name != "api_partition":
            return r
        api, replica = self.predicts["api"], self.predicts["replica"]
        n = r.notes
        n["predicts_api"], n["predicts_replica"] = len(api), len(replica)
        n["predict_errors_replica"] = sum(not ok for _, ok in replica)
        n["predict_error_kinds"] = self.predict_errors
        if self.cut_from_to is not None:
            # An answer asked for before the cut may fail at its start; the API's
            # own shards may take the resume aim to answer again after it.
            lo, hi = self.cut_from_to[0] - PREDICT_TIMEOUT_S, self.cut_from_to[1] + self.cfg.resume_aim_s
            n["predict_errors_api_cut"] = sum(not ok for t, ok in api if lo <= t <= hi)
            n["predict_errors_api_outside"] = sum(not ok for t, ok in api if not lo <= t <= hi)
            back = [t for t, ok in api if ok and t >= self.cut_from_to[1]]
            n["api_resume_s"] = round(back[0] - self.cut_from_to[1], 2) if back else None
        r.aims["predict_errors_only_while_cut"] = n.get("predict_errors_api_outside", 1) == 0
        r.aims["replica_no_predict_errors"] = n["predict_errors_replica"] == 0 and len(replica) > 0
        return r


# -- the faults ---------------------------------------------------------------------
# Each returns the monotonic time the fault ended (the link back).


async def fault_none(d: HostDrill) -> float:
    return time.monotonic()


async def fault_shard_partition(d: HostDrill) -> float:
    host = d.host(f"shard-{BIAS_SHARD}")
    d.hosts.cut(host)
    try:
        await asyncio.sleep(d.cfg.outage_s)  # the partition itself
    finally:
        d.hosts.restore(host)
    d.result.notes["outage_s"] = d.cfg.outage_s
    return time.monotonic()


async def fault_worker_limited(d: HostDrill) -> float:
    host = d.host("worker")
    before, pushes = d.hosts.link_bytes(host), await d.pushes()
    d.hosts.limit(host, d.mbit)
    t0 = time.monotonic()
    try:
        await asyncio.sleep(d.cfg.outage_s)  # the limited phase
    finally:
        after, seconds = d.hosts.link_bytes(host), time.monotonic() - t0
        d.hosts.unlimit(host)
    moved = await d.pushes()
    d.result.notes.update(
        limit_mbit=d.mbit,
        limited_s=round(seconds, 1),
        worker_in_mbit_per_s=round((after[0] - before[0]) * 8 / seconds / 1e6, 2),
        worker_out_mbit_per_s=round((after[1] - before[1]) * 8 / seconds / 1e6, 2),
        pushes_while_limited=[m - p for m, p in zip(moved, pushes)],
    )
    return time.monotonic()


async def fault_api_partition(d: HostDrill) -> float:
    api = d.host("api")
    t0 = time.monotonic()
    shards = [d.host(f"shard-{i}") for i in range(SHARDS)]
    for s in shards:
        d.hosts.partition(api, s)
    try:
        await asyncio.sleep(d.cfg.outage_s)  # the partition itself
    finally:
        for s in shards:
            d.hosts.heal(api, s)
    t_end = time.monotonic()
    d.cut_from_to = (t0, t_end)
    d.result.notes["outage_s"] = d.cfg.outage_s
    return t_end


async def fault_broker_partition(d: HostDrill) -> float:
    d.hosts.cut("broker")
    try:
        await asyncio.sleep(d.cfg.outage_s)  # the partition itself
    finally:
        d.hosts.restore("broker")
    d.result.notes["outage_s"] = d.cfg.outage_s
    return time.monotonic()


FAULTS: dict[str, Callable[[HostDrill], Awaitable[float]]] = {
    "baseline": fault_none,
    "shard_partition": fault_shard_partition,
    "worker_limited": fault_worker_limited,
    "api_partition": fault_api_partition,
    "broker_partition": fault_broker_partition,
}


def config(args: argparse.Namespace, workdir: Path) -> Config:
    return config_of(args, workdir, drill_timeout_s=60.0 if args.quick else 300.0, decode_processes=1)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    """Run the drills of `args` (all by default); the JSON line's figures."""
    names: list[str] = args.drill or list(DRILLS)
    why = available()
    if why:
        log(f"skipped: {why}")
        return {"mode": bench_mode(args.quick), "skipped": why}
    workdir = Path(tempfile.mkdtemp(prefix="bench-hosts-"))
    cfg = config(args, workdir)
    parallel = args.quick if args.parallel is None else args.parallel
    results: dict[str, Result] = {}
    with Hosts(host_names(names)) as hosts:
        log(
            f"drills {','.join(names)} in {workdir}; hosts on {hosts.subnet} (bridge {hosts.bridge}); "
            f"rate {cfg.rate:g}/s, session timeout {cfg.session_timeout_ms} ms, outage {cfg.outage_s:g} s"
        )
        broker_out = (workdir / "broker.log").open("wb")
        broker = Broker(broker_out, hosts.address["broker"], BROKER_PORT, partial(hosts.cmd, "broker"))

        def make(name: str) -> Drill:
            return HostDrill(name, cfg, broker, hosts, args.mbit)

        def run(name: str) -> Awaitable[Result]:
            return run_drill(name, cfg, broker, make, FAULTS)

        try:
            await broker.start(60.0)
            first = [n for n in names if n != "broker_partition"]
            if parallel:
                for r in await asyncio.gather(*(run(n) for n in first)):
                    results[r.name] = r
            else:
                for n in first:
                    results[n] = await run(n)
            if "broker_partition" in names:
                results["broker_partition"] = await run("broker_partition")
        finally:
            await broker.sup.stop_all()
            broker_out.close()
        address = dict(hosts.address)
    if "broker_partition" in results:
        r = results["broker_partition"]
        r.tracebacks += (workdir / "broker.log").read_bytes().count(TRACEBACK)
        r.aims["no_tracebacks"] = r.tracebacks == 0

    base = results.get("baseline")
    out: dict[str, Any] = {
        "mode": bench_mode(args.quick),
        "parallel": bool(parallel),
        "rate_events_per_s": cfg.rate,
        "window_s": cfg.window_s,
        "shards": SHARDS,
        "session_timeout_ms": cfg.session_timeout_ms,
        "outage_s": cfg.outage_s,
        "limit_mbit": args.mbit,
        "aim_resume_s": cfg.resume_aim_s,
        "aim_replay_max": cfg.replay_bound,
        "hosts": len(address),
        "broker_address": address["broker"],
        "workdir": str(workdir),
    }
    passed = 0
    for name, r in results.items():
        out[name] = figures(r, base)
        passed += out[name]["passed"]
        log(f"{name}: " + ", ".join(f"{k} {'met' if v else 'NOT met'}" for k, v in r.aims.items()))
    out["drills_passed"] = passed
    out["drills"] = len(results)
    out["elapsed_s"] = round(elapsed_s(), 1)
    log(f"{passed}/{len(results)} drills met every aim")
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short phases, drills at once (under two minutes)")
    p.add_argument("--drill", action="append", choices=list(DRILLS), help="run only this drill; repeatable")
    p.add_argument("--rate", type=float, help="events/s per drill (default 2000, --quick 500)")
    p.add_argument("--outage", type=float, help="seconds of each fault (default 30, --quick 8)")
    p.add_argument("--mbit", type=float, default=32.0, help="the worker's limited link, Mbit/s (default 32)")
    p.add_argument("--session-timeout-ms", type=int, help="the workers' (default 10000, --quick 6000)")
    par = p.add_mutually_exclusive_group()
    par.add_argument("--parallel", action="store_true", default=None, help="run the drills at once")
    par.add_argument("--sequential", dest="parallel", action="store_false", help="one drill after the other")
    add_record_option(p)
    return p


if __name__ == "__main__":
    configure_logging("text", logging.WARNING)  # restarts and kills, not every start
    ARGS = parser().parse_args()

    async def as_script() -> dict[str, Any]:
        # SIGTERM ends the run as Ctrl-C does: every child stopped, every namespace removed.
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await main(ARGS)

    try:
        figures_ = uvloop.run(as_script())
    except (asyncio.CancelledError, KeyboardInterrupt):  # SIGTERM, Ctrl-C: children and hosts are gone
        log("interrupted: every child stopped, every host removed")
        sys.exit(130)
    print_result(figures_, ARGS)
