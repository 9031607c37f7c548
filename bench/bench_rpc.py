"""Benchmark: pull + push round trip of 100k keys through the shard RPC.

Two shard servers are started as subprocesses (``python -m app.cli shard``,
one ``lr`` table with FTRL, on free 127.0.0.1 ports) and reached with
``PSClient.connect(urls, rpc=False)`` (every call over HTTP/1.1 keep-alive
through aiohttp at both ends, uvloop: binary frames). Each
round is ``await client.pull("lr", keys)`` then ``await client.push("lr",
keys, grads)`` of a fresh 100k-key batch; pull, push and the whole round trip
are timed with ``time.perf_counter`` and reported as p50/p99 in ms.

Keys are drawn from a pool of random uint64 feature ids (1M by default), which
the tables are warmed with first (every pool key pushed once), with two
distributions, each measured separately:

- ``zipf`` (the headline figures): rank r drawn with probability ∝ 1/r^s
  (s = 1.0 by default), so a batch repeats hot keys as CTR traffic does;
- ``uniform``: every pool key equally likely (few duplicates in a batch).

The baseline, measured in the same run, is the same client API in process:
``PSClient.local([Shard(ShardSpec(i, 2), [cfg]) for i in range(2)])`` (no
encoding, no sockets, shards called one after the other). A third system, on
its own in-process shards, does what the HTTP client does minus HTTP: split by
shard, encode frames, ``handle_frame`` (decode, table work, encode the
reply), decode and reassemble, timing each segment to show where the time
goes. The three run interleaved, round by round (rotating who goes first), so
that drifts in the load of this shared machine hit all alike; each has its own
fresh batches, each batch used once. Batches and gradients of a distribution
are generated before its rounds, outside the timed region.

A second phase measures a training worker's mini-batch on the same two shard
processes: ``--minibatch-keys`` distinct keys (5,000 by default, ~2,500 per
shard, like a 256-event mini-batch), routed once, then either

- ``two_requests``: ``pull(r_i)`` then ``push(r_i, g_i)``, 2 requests per shard;
- ``push_pull``: ``push_pull(r_(i-1), g_(i-1), pull_keys=r_i)``, 1 request per
  shard (mini-batch i-1's push and mini-batch i's pull in one frame);
- ``push_pull_rpc``: the same over the shards' TCP RPC (`ps_core.net.rpc`, the
  default of ``PSClient.connect``) instead of HTTP.

All do one push and one pull of the same sizes per mini-batch. They run in
alternating blocks of rounds, so that each block's CPU can be charged to one
of them: besides wall time per mini-batch (p50/p99), the shard processes' CPU
(utime + stime from ``/proc/<pid>/stat``, summed over both shards) and this
client process's CPU (``time.process_time``) per mini-batch.

A third phase measures what security costs: a second set of shard processes
serves TLS (a throwaway CA's certificate, made with ``trustme`` for the run)
and checks credentials (a cluster secret; the client presents a train token),
and the 100k-key zipf round trip over the TCP RPC is timed on both sets,
interleaved round by round: ``ratio_rpc_tls_auth_vs_plaintext`` (aim <= 1.3).

Run (from the repository root)::

    .venv/bin/python bench/bench_rpc.py --quick   # 50 rounds, < 1 minute
    .venv/bin/python bench/bench_rpc.py           # 200 rounds

Progress goes to stderr, one line per phase; a summary and, as the last line of
stdout, one JSON object with the figures. The shard servers are always stopped
(SIGTERM, then SIGKILL after a timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import numpy as np
import numpy.typing as npt
import uvloop
from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log

from consumers.broker import free_port  # noqa: E402
from ps_core.checkpoint.control import ControlClient  # noqa: E402
from ps_core.hashing import shard_of
from ps_core.net import codec, op_encoders
from ps_core.net.auth import Scope, derive_token, new_secret
from ps_core.net.client import PSClient, Routed
from ps_core.net.frame_handler import handle_frame
from ps_core.net.tls import TlsFiles, client_context
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

U64 = npt.NDArray[np.uint64]
F32 = npt.NDArray[np.float32]

REPO = Path(__file__).resolve().parent.parent
TABLE = "lr"
TABLE_SPEC = "lr,optimizer=ftrl"
TABLE_CONFIG = TableConfig(TABLE, 1, {"name": "ftrl"})
AIM_HTTP_ROUND_TRIP_P50_MS = 10.0
AIM_TLS_AUTH_RATIO = 1.3
"""TLS and credentials on may cost at most this much of the plaintext RPC round trip."""
DISTS = ("zipf", "uniform")


log = progress_log("bench_rpc")
"""One progress line on stderr."""


# -- workload ------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One round's keys and gradients."""

    keys: U64
    grads: F32


class Workload:
    """Draws batches of feature ids from a fixed pool."""

    def __init__(self, rng: np.random.Generator, pool_size: int, zipf_s: float) -> None:
        self.rng = rng
        pool = rng.integers(0, 2**64, size=pool_size, dtype=np.uint64)
        self.pool: U64 = np.unique(pool)  # distinct ids; sorted order is harmless
        self.pool = self.pool[rng.permutation(self.pool.size)]  # rank r -> a random id
        weights = 1.0 / np.arange(1, self.pool.size + 1, dtype=np.float64) ** zipf_s
        cdf = np.cumsum(weights)
        self._cdf = cdf / cdf[-1]

    def batch(self, dist: str, n: int) -> Batch:
        if dist == "zipf":
            ranks = np.searchsorted(self._cdf, self.rng.random(n), side="right")
            ranks = np.minimum(ranks, self.pool.size - 1)
        elif dist == "uniform":
            ranks = self.rng.integers(0, self.pool.size, n)
        else:
            raise ValueError(dist)
        keys = np.ascontiguousarray(self.pool[ranks])
        grads = self.rng.normal(0.0, 0.1, (n, 1)).astype(np.float32)
        return Batch(keys, grads)

    def batches(self, dist: str, n: int, count: int) -> list[Batch]:
        return [self.batch(dist, n) for _ in range(count)]


# -- systems under test --------------------------------------------------------


@dataclass
class RoundResult:
    """Seconds of one round's pull and push, and the distinct keys applied."""

    pull: float
    push: float
    applied: int
    parts: dict[str, float] = field(default_factory=dict)
    """Optional breakdown of the round (seconds per segment)."""


class System(Protocol):
    """One way of doing a pull + push round."""

    name: str

    async def round(self, b: Batch) -> RoundResult: ...


class MiniBatchLoop:
    """A worker's per-mini-batch RPC, as 2 requests per shard or 1 push_pull."""

    def __init__(self, name: str, client: PSClient) -> None:
        self.name = name
        self.client = client
        self._prev: tuple[Routed, F32] | None = None

    async def step(self, keys: U64, grads: F32) -> None:
        r = self.client.route(keys)
        if self.name == "two_requests":
            w = await self.client.pull(TABLE, r)
            applied = await self.client.push(TABLE, r, grads)
        else:
            prev, prev_grads = self._prev or (self.client.route(keys[:0]), grads[:0])
            applied, w = await self.client.push_pull(TABLE, prev, prev_grads, pull_keys=r)
            applied = applied or keys.size  # the first step has nothing to push
            self._prev = (r, grads)
        if w.shape != (keys.size, 1) or applied <= 0:
            raise RuntimeError(f"{self.name}: bad reply: weights {w.shape}, applied {applied}")


def proc_cpu_s(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of processes `pids` (all their threads), or
    None where /proc is not available."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                # Fields after the parenthesised command name; utime, stime are 14, 15.
                stat = f.read().rsplit(")", 1)[1].split()
            total += (int(stat[11]) + int(stat[12])) / tick
    except (OSError, ValueError, IndexError):
        return None
    return total


@dataclass
class LoopTimings:
    """Seconds per mini-batch, and CPU seconds over all the loop's blocks."""

    wall: list[float] = field(default_factory=list)
    shard_cpu_s: float | None = 0.0
    client_cpu_s: float = 0.0


async def measure_minibatches(
    loops: Sequence[MiniBatchLoop],
    batches: Sequence[Sequence[Batch]],
    pids: Sequence[int],
    block: int,
    warmup_blocks: int = 1,
) -> list[LoopTimings]:
    """Alternate blocks of `block` mini-batches between the loops (rotating
    who goes first); the shards' and this process's CPU over a block is
    charged to that block's loop. The first `warmup_blocks` per loop are not kept."""
    out = [LoopTimings() for _ in loops]
    nblocks = min(len(b) for b in batches) // block
    for bi in range(nblocks):
        for j in ((bi + o) % len(loops) for o in range(len(loops))):
            cpu0, proc0 = proc_cpu_s(pids), time.process_time()
            walls = []
            for b in batches[j][bi * block : (bi + 1) * block]:
                t = time.perf_counter()
                await loops[j].step(b.keys, b.grads)
                walls.append(time.perf_counter() - t)
            cpu1, proc1 = proc_cpu_s(pids), time.process_time()
            if bi < warmup_blocks:
                continue
            o = out[j]
            o.wall += walls
            o.client_cpu_s += proc1 - proc0
            if cpu0 is None or cpu1 is None or o.shard_cpu_s is None:
                o.shard_cpu_s = None
            else:
                o.shard_cpu_s += cpu1 - cpu0
    return out


class ClientSystem:
    """`PSClient` over HTTP or in process."""

    def __init__(self, name: str, client: PSClient) -> None:
        self.name = name
        self.client = client

    async def round(self, b: Batch) -> RoundResult:
        t0 = time.perf_counter()
        w = await self.client.pull(TABLE, b.keys)
        t1 = time.perf_counter()
        applied = await self.client.push(TABLE, b.keys, b.grads)
        t2 = time.perf_counter()
        if w.shape != (b.keys.size, 1) or applied <= 0:
            raise RuntimeError(f"{self.name}: bad reply: weights {w.shape}, applied {applied}")
        return RoundResult(t1 - t0, t2 - t1, applied)


class FramePathSystem:
    """What an HTTP round costs without HTTP, split into segments.

    Mirrors `PSClient` over the binary frames, in process: split the batch by
    shard, encode each shard's frame, `handle_frame` (decode, table work,
    encode the reply), decode the replies and reassemble; shards one after the
    other (over HTTP they work in parallel).
    """

    name = "frames"

    def __init__(self, shards: Sequence[Shard]) -> None:
        self.shards = list(shards)
        self._rid = 0

    def _split(self, keys: U64) -> tuple[npt.NDArray[np.intp], list[slice]]:
        n = len(self.shards)
        sid = shard_of(keys, n)
        order = np.argsort(sid, kind="stable")
        bounds = np.concatenate(([0], np.cumsum(np.bincount(sid, minlength=n))))
        return order, [slice(int(bounds[j]), int(bounds[j + 1])) for j in range(n)]

    async def round(self, b: Batch) -> RoundResult:
        seg = dict.fromkeys(("split", "encode", "shard_pull", "shard_push", "decode"), 0.0)
        clock = time.perf_counter

        def lap(name: str, since: float) -> float:
            now = clock()
            seg[name] += now - since
            return now

        t_pull = t = clock()
        order, parts = self._split(b.keys)
        sk = b.keys[order]
        t = lap("split", t)
        replies: list[F32] = []
        for j, p in enumerate(parts):
            req = op_encoders.encode_pull(TABLE, sk[p])
            t = lap("encode", t)
            rep = handle_frame(self.shards[j], req, codec.Op.PULL)
            t = lap("shard_pull", t)
            vals = codec.decode(rep, codec.Op.WEIGHTS).values
            assert vals is not None
            replies.append(vals)
            t = lap("decode", t)
        got = np.concatenate(replies)
        w = np.empty_like(got)
        w[order] = got
        t = lap("decode", t)
        t_push = t
        self._rid += 1
        order, parts = self._split(b.keys)
        sk, sg = b.keys[order], b.grads[order]
        t = lap("split", t)
        applied = 0
        for j, p in enumerate(parts):
            req = op_encoders.encode_push(TABLE, sk[p], sg[p], request_id=self._rid)
            t = lap("encode", t)
            rep = handle_frame(self.shards[j], req, codec.Op.PUSH)
            t = lap("shard_push", t)
            applied += codec.decode(rep, codec.Op.ACK).count
            t = lap("decode", t)
        if w.shape != (b.keys.size, 1) or applied <= 0:
            raise RuntimeError(f"frames: bad reply: weights {w.shape}, applied {applied}")
        return RoundResult(t_push - t_pull, t - t_push, applied, seg)


# -- timing --------------------------------------------------------------------


@dataclass
class Timings:
    """Per-round seconds of pull, push and the whole round trip."""

    pull: list[float] = field(default_factory=list)
    push: list[float] = field(default_factory=list)
    round_trip: list[float] = field(default_factory=list)
    distinct_keys: list[int] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)

    def add(self, r: RoundResult) -> None:
        self.pull.append(r.pull)
        self.push.append(r.push)
        self.round_trip.append(r.pull + r.push)
        self.distinct_keys.append(r.applied)
        for k, v in r.parts.items():
            self.parts.setdefault(k, []).append(v)


def pct_ms(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) * 1e3


async def measure_interleaved(
    systems: Sequence[System], batches: Sequence[Sequence[Batch]], warmup: int
) -> list[Timings]:
    """Round i runs batch i of every system, rotating who goes first, so that
    drifts in the load of this shared machine hit all alike. Each system has
    its own batches, each used once; the first `warmup` rounds are not kept."""
    out = [Timings() for _ in systems]
    rounds = min(len(b) for b in batches)
    n = len(systems)
    for i in range(rounds):
        for j in ((i + o) % n for o in range(n)):
            r = await systems[j].round(batches[j][i])
            if i >= warmup:
                out[j].add(r)
    return out


async def warm_pool(client: PSClient, pool: U64, chunk: int) -> None:
    """Push every pool key once so the tables hold the whole pool."""
    rng = np.random.default_rng(7)
    for i in range(0, pool.size, chunk):
        keys = pool[i : i + chunk]
        await client.push(TABLE, keys, rng.normal(0.0, 0.1, (keys.size, 1)).astype(np.float32))


def summarize(prefix: str, t: Timings) -> dict[str, float]:
    return {
        f"{prefix}round_trip_p50_ms": pct_ms(t.round_trip, 50),
        f"{prefix}round_trip_p99_ms": pct_ms(t.round_trip, 99),
        f"{prefix}pull_p50_ms": pct_ms(t.pull, 50),
        f"{prefix}pull_p99_ms": pct_ms(t.pull, 99),
        f"{prefix}push_p50_ms": pct_ms(t.push, 50),
        f"{prefix}push_p99_ms": pct_ms(t.push, 99),
    }


def describe(label: str, t: Timings) -> str:
    return (
        f"{label}: round trip p50 {pct_ms(t.round_trip, 50):6.2f} ms p99 "
        f"{pct_ms(t.round_trip, 99):6.2f} | pull p50 {pct_ms(t.pull, 50):6.2f} "
        f"| push p50 {pct_ms(t.push, 50):6.2f} | {len(t.round_trip)} rounds, "
        f"~{int(np.median(t.distinct_keys)):,} distinct keys/batch"
    )


# -- shard servers ---------------------------------------------------------------


@dataclass
class ShardProc:
    shard_id: int
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path


def start_shards(
    num_shards: int,
    log_dir: Path,
    *,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    scheme: str = "http",
    name: str = "shard",
) -> list[ShardProc]:
    """Start the shard servers (`extra` flags, `env` added to the environment);
    the caller must `stop_shards` them (also on error)."""
    out: list[ShardProc] = []
    ctrps = Path(sys.executable).with_name("ctrps")
    for i in range(num_shards):
        port = free_port()
        args = [
            "shard",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--shard-id",
            str(i),
            "--num-shards",
            str(num_shards),
            "--table",
            TABLE_SPEC,
            "--stats-interval",
            "0",
            "--no-exports",
            *extra,
        ]
        cmd = [str(ctrps), *args] if ctrps.exists() else [sys.executable, "-m", "app.cli", *args]
        log_path = log_dir / f"{name}{i}.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        out.append(ShardProc(i, f"{scheme}://127.0.0.1:{port}", proc, log_path))
    return out


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


async def wait_ready(shards: Sequence[ShardProc], timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
    """Poll GET /healthz of every shard until it answers, or raise at the deadline."""
    deadline = time.monotonic() + timeout_s
    connector = aiohttp.TCPConnector(ssl=ssl_context) if ssl_context is not None else None
    async with aiohttp.ClientSession(connector=connector) as session:
        for s in shards:
            while True:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"shard {s.shard_id} exited with {s.proc.returncode}:\n{tail(s.log_path)}")
                try:
                    async with session.get(s.url + "/healthz", timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                        if resp.status == 200:
                            body = await resp.json()
                            if body.get("shard_id") != s.shard_id:
                                raise RuntimeError(f"{s.url} is not shard {s.shard_id}: {body}")
                            break
                except (TimeoutError, aiohttp.ClientError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"shard {s.shard_id} at {s.url} not ready after {timeout_s:.0f}s:\n{tail(s.log_path)}"
                    )
                await asyncio.sleep(0.05)


def stop_shards(shards: Sequence[ShardProc], timeout_s: float = 10.0) -> list[int | None]:
    """SIGTERM each shard, wait, SIGKILL the ones still alive; returns exit codes."""
    for s in shards:
        if s.proc.poll() is None:
            s.proc.terminate()
    codes: list[int | None] = []
    for s in shards:
        try:
            codes.append(s.proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            log(f"shard {s.shard_id} ignored SIGTERM for {timeout_s:.0f}s; killing it")
            s.proc.kill()
            try:
                codes.append(s.proc.wait(timeout=timeout_s))
            except subprocess.TimeoutExpired:
                codes.append(None)
    return codes


# -- main ------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    rounds: int
    warmup: int
    keys_per_request: int
    pool_size: int
    zipf_s: float
    num_shards: int
    seed: int
    ready_timeout_s: float
    quick: bool
    minibatch_keys: int = 5_000
    minibatch_rounds: int = 1_000
    minibatch_block: int = 25


async def run_minibatches(
    cfg: Config, work: Workload, client: PSClient, rpc_client: PSClient, pids: Sequence[int]
) -> dict[str, Any]:
    """The mini-batch phase: 2 requests per shard vs 1 push_pull per shard
    over HTTP, and 1 push_pull per shard over the shards' TCP RPC."""
    rounds = cfg.minibatch_rounds + cfg.minibatch_block  # + one warm-up block each
    loops = [
        MiniBatchLoop("two_requests", client),
        MiniBatchLoop("push_pull", client),
        MiniBatchLoop("push_pull_rpc", rpc_client),
    ]
    t = time.perf_counter()
    batches = []
    for _ in loops:
        bs = []
        for _ in range(rounds):
            # Distinct keys (a worker pulls a mini-batch's distinct keys), fresh each round.
            idx = np.unique(work.rng.integers(0, work.pool.size, cfg.minibatch_keys))
            keys = np.ascontiguousarray(work.pool[idx])
            bs.append(Batch(keys, work.rng.normal(0.0, 0.1, (keys.size, 1)).astype(np.float32)))
        batches.append(bs)
    per_shard = np.bincount(shard_of(batches[0][0].keys, cfg.num_shards), minlength=cfg.num_shards)
    log(
        f"mini-batches: {len(loops)} x {rounds} of ~{batches[0][0].keys.size:,} distinct keys "
        f"({per_shard.tolist()} per shard) generated in {time.perf_counter() - t:.1f}s (untimed)"
    )
    got = await measure_minibatches(loops, batches, pids, cfg.minibatch_block)
    out: dict[str, Any] = {
        "minibatch_distinct_keys": int(np.median([b.keys.size for b in batches[0]])),
        "minibatch_rounds": len(got[0].wall),
    }
    for loop, g in zip(loops, got):
        n = len(g.wall)
        pre = f"minibatch_{loop.name}_"
        out[pre + "p50_ms"] = pct_ms(g.wall, 50)
        out[pre + "p99_ms"] = pct_ms(g.wall, 99)
        out[pre + "mean_ms"] = float(np.mean(g.wall)) * 1e3
        out[pre + "shard_cpu_us"] = None if g.shard_cpu_s is None else g.shard_cpu_s / n * 1e6
        out[pre + "client_cpu_us"] = g.client_cpu_s / n * 1e6
        log(
            f"mini-batch {loop.name:12}: p50 {out[pre + 'p50_ms']:.2f} ms, p99 "
            f"{out[pre + 'p99_ms']:.2f} ms; per mini-batch CPU: shards "
            f"{out[pre + 'shard_cpu_us'] or float('nan'):.0f} us, client "
            f"{out[pre + 'client_cpu_us']:.0f} us ({n} mini-batches)"
        )
    a, b = "minibatch_push_pull_", "minibatch_two_requests_"
    out["minibatch_ratio_push_pull_vs_two_requests_p50"] = out[a + "p50_ms"] / out[b + "p50_ms"]
    if out[a + "shard_cpu_us"] is not None and out[b + "shard_cpu_us"]:
        out["minibatch_ratio_push_pull_vs_two_requests_shard_cpu"] = out[a + "shard_cpu_us"] / out[b + "shard_cpu_us"]
    out["minibatch_ratio_push_pull_vs_two_requests_client_cpu"] = out[a + "client_cpu_us"] / out[b + "client_cpu_us"]
    r = "minibatch_push_pull_rpc_"
    out["minibatch_ratio_rpc_vs_http_p50"] = out[r + "p50_ms"] / out[a + "p50_ms"]
    if out[r + "shard_cpu_us"] is not None and out[a + "shard_cpu_us"]:
        out["minibatch_ratio_rpc_vs_http_shard_cpu"] = out[r + "shard_cpu_us"] / out[a + "shard_cpu_us"]
    out["minibatch_ratio_rpc_vs_http_client_cpu"] = out[r + "client_cpu_us"] / out[a + "client_cpu_us"]
    return out


async def run_secure(cfg: Config, work: Workload, plain: PSClient, tmp: Path) -> dict[str, Any]:
    """The 100k-key round trip over the TCP RPC, plaintext (`plain`, on the
    first shard processes) against TLS with credentials on (a second set of
    shard processes with a throwaway CA's certificate and a cluster secret,
    reached with a train token), interleaved round by round."""
    import trustme  # a dev dependency: the TLS files are made for this run only

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca_path, cert_path, key_path = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    cert.private_key_pem.write_to_path(str(key_path))
    secret = new_secret()
    tls = client_context(TlsFiles(ca=str(ca_path)))
    procs: list[ShardProc] = []
    try:
        procs = start_shards(
            cfg.num_shards,
            tmp,
            extra=["--tls-cert", str(cert_path), "--tls-key", str(key_path)],
            env={"CTRPS_CLUSTER_SECRET": secret},
            scheme="https",
            name="secure",
        )
        await wait_ready(procs, cfg.ready_timeout_s, tls)
        log(f"{cfg.num_shards} shard servers with TLS and credentials ready at " + ", ".join(p.url for p in procs))
        token = derive_token(secret, Scope.TRAIN)
        async with PSClient.connect([p.url for p in procs], token=token, ssl=tls) as sc:
            t = time.perf_counter()
            await warm_pool(sc, work.pool, cfg.keys_per_request)
            log(f"secure warm-up: pushed the {work.pool.size:,}-id pool in {time.perf_counter() - t:.2f}s")
            systems: list[System] = [ClientSystem("rpc", plain), ClientSystem("rpc_tls_auth", sc)]
            per_system = cfg.warmup + cfg.rounds
            batches = [work.batches(DISTS[0], cfg.keys_per_request, per_system) for _ in systems]
            plain_t, secure_t = await measure_interleaved(systems, batches, cfg.warmup)
    finally:
        codes = stop_shards(procs)
        if procs:
            log(f"secure shard servers stopped, exit codes {codes}")
    log(describe(f"RPC plaintext  {DISTS[0]}", plain_t))
    log(describe(f"RPC TLS+token  {DISTS[0]}", secure_t))
    out: dict[str, Any] = {}
    out.update(summarize("rpc_", plain_t))
    out.update(summarize("rpc_tls_auth_", secure_t))
    out["ratio_rpc_tls_auth_vs_plaintext"] = out["rpc_tls_auth_round_trip_p50_ms"] / out["rpc_round_trip_p50_ms"]
    out["aim_rpc_tls_auth_ratio_met"] = out["ratio_rpc_tls_auth_vs_plaintext"] <= AIM_TLS_AUTH_RATIO
    out["secure_shard_exit_codes"] = codes
    return out


async def run(cfg: Config) -> dict[str, Any]:
    rng = np.random.default_rng(cfg.seed)
    work = Workload(rng, cfg.pool_size, cfg.zipf_s)
    per_system = cfg.warmup + cfg.rounds
    chunk = cfg.keys_per_request
    names = ("http", "local", "frames")
    results: dict[str, dict[str, Timings]] = {d: {} for d in DISTS}
    spec = [ShardSpec(i, cfg.num_shards) for i in range(cfg.num_shards)]
    local_shards = [Shard(s, [TABLE_CONFIG]) for s in spec]
    frame_shards = [Shard(s, [TABLE_CONFIG]) for s in spec]
    exit_codes: list[int | None] = []
    mb: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_rpc_") as tmp:
        procs: list[ShardProc] = []
        try:
            procs = start_shards(cfg.num_shards, Path(tmp))
            t = time.perf_counter()
            await wait_ready(procs, cfg.ready_timeout_s)
            log(
                f"{cfg.num_shards} shard servers ready in {time.perf_counter() - t:.2f}s at "
                + ", ".join(p.url for p in procs)
            )
            # "HTTP" is every call over HTTP; the shard servers' TCP RPC (the
            # default of PSClient.connect) is measured in the mini-batch phase.
            async with (
                PSClient.connect([p.url for p in procs], rpc=False) as hc,
                PSClient.connect([p.url for p in procs]) as rc,
                PSClient.local(local_shards) as lc,
                PSClient.local(frame_shards) as fc,
                ControlClient.connect([p.url for p in procs]) as control,
            ):
                warm: list[float] = []
                for c in (hc, lc, fc):
                    t = time.perf_counter()
                    await warm_pool(c, work.pool, chunk)
                    warm.append(time.perf_counter() - t)
                feats = [s.tables[TABLE].features for s in await control.stats()]
                log(
                    f"warm-up: pushed the {work.pool.size:,}-id pool to each system "
                    f"(HTTP {warm[0]:.2f}s, in process {warm[1]:.2f}s); HTTP features per "
                    f"shard {feats}"
                )
                systems: list[System] = [
                    ClientSystem("http", hc),
                    ClientSystem("local", lc),
                    FramePathSystem(frame_shards),
                ]
                for d in DISTS:
                    t = time.perf_counter()
                    batches = [work.batches(d, chunk, per_system) for _ in systems]
                    log(
                        f"{d}: generated {len(systems)} x {per_system} fresh batches of "
                        f"{chunk:,} keys in {time.perf_counter() - t:.1f}s (untimed)"
                    )
                    timings = await measure_interleaved(systems, batches, cfg.warmup)
                    del batches
                    results[d] = dict(zip(names, timings))
                    log(describe(f"HTTP   {d:7}", results[d]["http"]))
                    log(describe(f"local  {d:7}", results[d]["local"]))
                    fr = results[d]["frames"]
                    log(
                        describe(f"frames {d:7}", fr)
                        + " | segment p50 ms: "
                        + ", ".join(f"{k} {pct_ms(v, 50):.2f}" for k, v in fr.parts.items())
                    )
                mb = await run_minibatches(cfg, work, hc, rc, [p.proc.pid for p in procs])
                mb.update(await run_secure(cfg, work, rc, Path(tmp)))
        finally:
            exit_codes = stop_shards(procs)
            if procs:
                log(f"shard servers stopped, exit codes {exit_codes}")

    head = DISTS[0]
    out: dict[str, Any] = {
        "mode": bench_mode(cfg.quick),
        "keys_per_request": cfg.keys_per_request,
        "num_shards": cfg.num_shards,
        "pool_keys": int(work.pool.size),
        "key_distribution": f"zipf_s{cfg.zipf_s:g}",
        "rounds": cfg.rounds,
    }
    for d in DISTS:
        pre = "" if d == head else f"{d}_"
        r = results[d]
        http_p50 = pct_ms(r["http"].round_trip, 50)
        out[f"{pre}distinct_keys_per_request_p50"] = int(np.median(r["http"].distinct_keys))
        out.update(summarize(f"{pre}http_", r["http"]))
        out.update(summarize(f"{pre}local_", r["local"]))
        out[f"{pre}ratio_http_vs_local"] = http_p50 / pct_ms(r["local"].round_trip, 50)
        out[f"{pre}frames_round_trip_p50_ms"] = pct_ms(r["frames"].round_trip, 50)
        for k, v in r["frames"].parts.items():
            out[f"{pre}frames_{k}_p50_ms"] = pct_ms(v, 50)
        out[f"{pre}http_keys_per_s"] = cfg.keys_per_request / (http_p50 / 1e3)
    out.update(mb)
    out["aim_http_round_trip_p50_met"] = out["http_round_trip_p50_ms"] <= AIM_HTTP_ROUND_TRIP_P50_MS
    out["shard_exit_codes"] = exit_codes
    out["elapsed_s"] = elapsed_s()
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line: what is measured, and the workload's sizes."""
    parser = bench_parser(
        "Benchmark the pull + push round trip of 100k keys over HTTP to 2 shard "
        "server subprocesses, against the same client in process.",
        "50 rounds (< 1 minute)",
        seed=2024,
        record=True,
    )
    parser.add_argument("--rounds", type=int, help="timed rounds per distribution (200; quick 50)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    parser.add_argument(
        "--keys",
        dest="keys_per_request",
        metavar="KEYS",
        type=int,
        default=100_000,
        help="keys per request (default 100000)",
    )
    parser.add_argument(
        "--pool",
        dest="pool_size",
        metavar="POOL",
        type=int,
        default=1_000_000,
        help="feature ids in the pool (default 1000000)",
    )
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of the zipf workload (default 1.0)")
    parser.add_argument(
        "--shards", dest="num_shards", metavar="SHARDS", type=int, default=2, help="shard servers (default 2)"
    )
    parser.add_argument(
        "--minibatch-keys",
        type=int,
        default=5_000,
        help="keys drawn per mini-batch in the push_pull phase (default 5000; ~2,500 distinct per shard)",
    )
    parser.add_argument(
        "--minibatch-rounds",
        type=int,
        help="timed mini-batches per variant in the push_pull phase (1000; quick 300)",
    )
    parser.add_argument(
        "--ready-timeout",
        dest="ready_timeout_s",
        metavar="READY_TIMEOUT",
        type=float,
        default=60.0,
        help="seconds to wait for the shards (60)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 50 if args.quick else 200
    if args.minibatch_rounds is None:
        args.minibatch_rounds = 300 if args.quick else 1000
    if args.rounds < 1 or args.warmup < 0 or args.keys_per_request < 1 or args.pool_size < 1 or args.num_shards < 1:
        parser.error("rounds, keys, pool and shards must be >= 1, warmup >= 0")
    if args.zipf_s <= 0:
        parser.error("--zipf-s must be > 0")
    if args.minibatch_rounds < 25 or args.minibatch_keys < 1:
        parser.error("--minibatch-rounds must be >= 25 (one block), --minibatch-keys >= 1")
    # Each flag's destination is its field of Config.
    cfg = Config(**{f.name: getattr(args, f.name) for f in fields(Config) if hasattr(args, f.name)})
    log(
        f"mode {bench_mode(cfg.quick)}: {cfg.rounds} rounds (+{cfg.warmup} warm-up) "
        f"per distribution, {cfg.keys_per_request:,} keys/request, {cfg.num_shards} shards, "
        f"pool {cfg.pool_size:,}; {os.cpu_count()} CPUs, uvloop"
    )
    result: dict[str, Any] = uvloop.run(run(cfg))

    print(
        f"bench_rpc ({result['mode']}, {cfg.keys_per_request:,} keys per pull+push, "
        f"{cfg.num_shards} shards, {cfg.rounds} rounds)"
    )
    for label, pre in (("zipf", ""), ("uniform", "uniform_")):
        print(
            f"  {label:7}  HTTP round trip p50 {result[pre + 'http_round_trip_p50_ms']:6.2f} ms "
            f"(p99 {result[pre + 'http_round_trip_p99_ms']:6.2f}; pull "
            f"{result[pre + 'http_pull_p50_ms']:.2f}, push {result[pre + 'http_push_p50_ms']:.2f})"
            f"  in-process {result[pre + 'local_round_trip_p50_ms']:6.2f} ms"
            f"  ratio {result[pre + 'ratio_http_vs_local']:.2f}x"
        )
    print(
        f"  where the time goes (zipf, in process, p50 ms per round): client split by shard "
        f"{result['frames_split_p50_ms']:.2f} (pull and push each split), encode "
        f"{result['frames_encode_p50_ms']:.2f}, shards' handle_frame pull "
        f"{result['frames_shard_pull_p50_ms']:.2f} + push {result['frames_shard_push_p50_ms']:.2f} "
        f"(summed over shards), decode {result['frames_decode_p50_ms']:.2f}"
    )
    print(
        f"  mini-batch of ~{result['minibatch_distinct_keys']:,} distinct keys, pull + push: "
        f"2 requests per shard p50 {result['minibatch_two_requests_p50_ms']:.2f} ms, 1 push_pull "
        f"per shard p50 {result['minibatch_push_pull_p50_ms']:.2f} ms "
        f"({result['minibatch_ratio_push_pull_vs_two_requests_p50']:.2f}x); CPU per mini-batch: "
        f"shards {result['minibatch_two_requests_shard_cpu_us'] or float('nan'):.0f} -> "
        f"{result['minibatch_push_pull_shard_cpu_us'] or float('nan'):.0f} us, client "
        f"{result['minibatch_two_requests_client_cpu_us']:.0f} -> "
        f"{result['minibatch_push_pull_client_cpu_us']:.0f} us"
    )
    print(
        f"  the same push_pull over the shards' TCP RPC: p50 {result['minibatch_push_pull_rpc_p50_ms']:.2f} ms "
        f"({result['minibatch_ratio_rpc_vs_http_p50']:.2f}x HTTP); CPU per mini-batch: shards "
        f"{result['minibatch_push_pull_rpc_shard_cpu_us'] or float('nan'):.0f} us, client "
        f"{result['minibatch_push_pull_rpc_client_cpu_us']:.0f} us"
    )
    print(
        f"  100k-key round trip over the RPC: plaintext p50 {result['rpc_round_trip_p50_ms']:.2f} ms, "
        f"TLS + credentials p50 {result['rpc_tls_auth_round_trip_p50_ms']:.2f} ms "
        f"({result['ratio_rpc_tls_auth_vs_plaintext']:.2f}x; aim <= {AIM_TLS_AUTH_RATIO}x: "
        f"{'met' if result['aim_rpc_tls_auth_ratio_met'] else 'NOT met'})"
    )
    print(
        f"  aim: HTTP round trip p50 <= {AIM_HTTP_ROUND_TRIP_P50_MS:.0f} ms: "
        f"{'met' if result['aim_http_round_trip_p50_met'] else 'NOT met'}"
    )
    return print_result(result, args)


if __name__ == "__main__":
    sys.exit(main())
