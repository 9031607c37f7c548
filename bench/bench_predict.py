"""Benchmark: ``POST /v1/predict`` of the HTTP API, against a bare aiohttp endpoint.

Six servers run as subprocesses of this script on free 127.0.0.1 ports, each
with uvloop, each stopping itself after ``--lifetime`` seconds or when this
script goes away (and on SIGTERM, which this script sends at the end):

- ``bare``: an aiohttp app whose ``POST /v1/predict`` reads the body and
  answers a constant prediction — the baseline, what HTTP and aiohttp cost;
- ``api-local``: the API (``app.api.run_api``) over one shard in its own
  process (``PSClient.local``), as in ``ctrps demo``;
- ``shard`` + ``api-http``: a shard server (``ctrps shard``'s role) and the
  API over it (``ctrps serve``'s role, ``app.roles.serve.run_serve``);
- ``shard-secure`` + ``api-secure``: the same with TLS on both and
  credentials on the shard (``api-secure`` presents a read token).

The three shards are trained first with the same 20,000 synthetic events
(Criteo-like: 26 categorical fields with Zipf-distributed values, 13 numeric),
with the worker's pull → gradients → push step, so a prediction reads mostly
present features. Requests carry fresh events from the same distribution (a
few thousand pre-built bodies, cycled; re-sending one body would flatter
caches).

Measured, each system the same way in the same run:

1. single-event ``/v1/predict`` at ``--connections`` (32) concurrent
   keep-alive connections for ``--seconds``, from another process: ``wrk``
   when installed (a Lua script cycles the bodies), else an aiohttp load
   generator subprocess; requests/s and p50/p99 latency, and the ratio of
   each API to the bare endpoint (aim: ≥ 0.4);
2. the same for ``api-http`` and ``api-secure`` — the API serving HTTPS
   (a throwaway CA's certificate, made with ``trustme`` for the run) over a
   shard serving TLS and checking credentials (a cluster secret; the API
   presents a read token) — in alternating rounds (7; quick 3): the ratio of
   their median requests/s is security's cost (aim: ≥ 0.8), next to the CPU
   the API and its shard spend per request (``/proc/<pid>/stat``);
3. batch ``/v1/predict`` of 1,000 events, one request at a time on one
   keep-alive connection from this process: p50/p99 latency (aim: p50 ≤ 20 ms).

Run (from the repository root)::

    .venv/bin/python bench/bench_predict.py --quick   # ~25 s
    .venv/bin/python bench/bench_predict.py           # ~1 min

Progress goes to stderr; a summary and, as the last line of stdout, one JSON
object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import uvloop
from aiohttp import web
from common import add_record_option, bench_mode, print_result, progress_log

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from app.api import run_api  # noqa: E402
from app.config.serve import ApiSettings  # noqa: E402
from app.config.shard import ShardSettings  # noqa: E402
from app.roles.serve import run_serve  # noqa: E402
from app.roles.shard import run_shard  # noqa: E402
from app.security import SecuritySettings  # noqa: E402
from app.signals import stop_on_signals  # noqa: E402
from consumers.broker import free_port  # noqa: E402
from ps_core.checkpoint.control import ControlClient  # noqa: E402
from ps_core.model.models import Model, make_model  # noqa: E402
from ps_core.net.auth import Scope, derive_token, new_secret  # noqa: E402
from ps_core.net.client import PSClient  # noqa: E402
from ps_core.net.tls import TlsFiles, client_context  # noqa: E402
from ps_core.shard import Shard  # noqa: E402
from tests.training import train_step  # noqa: E402

MODEL_NAME = "ctr"
TRAIN_EVENTS = 20_000
BATCH_EVENTS = 1_000
AIM_RATIO = 0.4
AIM_BATCH_P50_MS = 20.0
AIM_SECURE_RATIO = 0.8
PAIR_ROUNDS = 7
PAIR_ROUNDS_QUICK = 3
"""The API over HTTPS, with credentials to its TLS shard, against the same in plaintext."""
SYSTEMS = ("bare", "api_local", "api_http", "api_secure")


log = progress_log("bench_predict")
"""One progress line on stderr."""


# -- workload ---------------------------------------------------------------------


def make_events(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    """Criteo-like events: C1..C26 categorical (Zipf over 2,000 values each),
    I1..I13 numeric; a label from a hidden rule so training means something."""
    ranks = np.minimum(rng.zipf(1.3, size=(n, 26)), 2000)
    nums = np.round(rng.exponential(3.0, size=(n, 13)), 2)
    labels = (rng.random(n) < 1 / (1 + np.exp(2.0 - 0.3 * (ranks[:, 0] % 5)))).astype(int)
    out = []
    for i in range(n):  # building the workload, outside any timed region
        features: dict[str, Any] = {f"C{j + 1}": f"v{r}" for j, r in enumerate(ranks[i].tolist())}
        features.update({f"I{j + 1}": x for j, x in enumerate(nums[i].tolist())})
        out.append({"label": int(labels[i]), "features": features})
    return out


async def train(
    client: PSClient, control: ControlClient, model: Model, events: list[dict[str, Any]], step: int = 1024
) -> None:
    """The worker's training step over `events`, `step` events at a time."""
    for t in model.tables():
        await control.declare(t)
    batch, errors = model.hasher().featurize(events)
    assert not errors
    for start in range(0, batch.size, step):
        await train_step(client, model, batch.slice(start, min(start + step, batch.size)))


def bodies(rng: np.random.Generator, count: int, events_per_body: int) -> list[bytes]:
    """Predict request bodies of fresh events (labels dropped)."""
    out = []
    for _ in range(count):
        evs = make_events(rng, events_per_body)
        for e in evs:
            del e["label"]
        out.append(orjson.dumps({"events": evs}))
    return out


# -- servers (this script, run as a subprocess) -------------------------------------


async def _watch(stop: asyncio.Event, lifetime_s: float) -> None:
    """Stop after `lifetime_s`, or as soon as the parent process is gone."""
    parent = os.getppid()
    deadline = time.monotonic() + lifetime_s
    while not stop.is_set() and time.monotonic() < deadline and os.getppid() == parent:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    stop.set()


async def _bare(port: int, stop: asyncio.Event) -> None:
    answer = orjson.dumps({"predictions": [0.5], "model": MODEL_NAME, "model_version": 1})

    async def predict(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=answer, content_type="application/json")

    async def healthz(request: web.Request) -> web.Response:
        return web.Response(body=b'{"status": "ok"}', content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/predict", predict)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def tls_files(tls_dir: Path, *, ca_only: bool = False) -> TlsFiles:
    """The run's TLS files in `tls_dir` (made by `make_tls`)."""
    if ca_only:
        return TlsFiles(ca=str(tls_dir / "ca.pem"))
    return TlsFiles(cert=str(tls_dir / "cert.pem"), key=str(tls_dir / "key.pem"), ca=str(tls_dir / "ca.pem"))


def make_tls(tls_dir: Path) -> None:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (trustme, a dev dependency)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(tls_dir / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(tls_dir / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tls_dir / "key.pem"))


async def serve(kind: str, port: int, shard_url: str, lifetime_s: float, tls_dir: Path | None = None) -> None:
    """Run one server until SIGTERM, its lifetime, or the parent's exit (the
    secure ones with the TLS files in `tls_dir` and ``CTRPS_CLUSTER_SECRET``)."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(stop, lifetime_s))
    model = make_model("lr", MODEL_NAME)
    with stop_on_signals(stop):
        if kind == "bare":
            await _bare(port, stop)
        elif kind == "shard":
            await run_shard(ShardSettings(port=port, stats_interval_s=0, tables=model.tables()), stop)
        elif kind == "api-http":
            await run_serve(ApiSettings(shards=(shard_url,), port=port), stop)
        elif kind == "shard-secure":
            assert tls_dir is not None
            security = SecuritySettings(cluster_secret=os.environ["CTRPS_CLUSTER_SECRET"], tls=tls_files(tls_dir))
            await run_shard(
                ShardSettings(port=port, stats_interval_s=0, tables=model.tables()), stop, security=security
            )
        elif kind == "api-secure":
            # As `ctrps serve` is deployed: HTTPS, a read token, the shard verified against the CA.
            assert tls_dir is not None
            token = derive_token(os.environ["CTRPS_CLUSTER_SECRET"], Scope.READ)
            security = SecuritySettings(shard_token=token, tls=tls_files(tls_dir))
            await run_serve(ApiSettings(shards=(shard_url,), port=port), stop, security=security)
        elif kind == "api-local":
            shard = Shard(tables=model.tables())
            client, control = PSClient.local([shard]), ControlClient.local([shard])
            await train(client, control, model, make_events(np.random.default_rng(1), TRAIN_EVENTS))
            await run_api(ApiSettings(port=port), client, model, stop, control=control)
        else:
            raise ValueError(kind)
    await watcher


# -- load generation ------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """One load run's result."""

    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


_WRK_SCRIPT = """
local bodies = {}
for line in io.lines(os.getenv("BENCH_BODIES")) do bodies[#bodies + 1] = line end
local i = 0
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  i = i % #bodies + 1
  return wrk.format(nil, "/v1/predict", nil, bodies[i])
end
"""


def _wrk_ms(text: str) -> float:
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text).groups()  # type: ignore[union-attr]
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def run_wrk(url: str, bodies_path: Path, connections: int, seconds: float) -> Load:
    script = bodies_path.with_suffix(".lua")
    script.write_text(_WRK_SCRIPT)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url],
        env={**os.environ, "BENCH_BODIES": str(bodies_path)},
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _wrk_ms(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _wrk_ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    errors = (int(non2xx.group(1)) if non2xx else 0) + (sum(map(int, sock.groups())) if sock else 0)
    return Load(rps, p50, p99, errors)


async def _python_load(url: str, bodies_path: Path, connections: int, seconds: float) -> dict[str, Any]:
    payloads = bodies_path.read_bytes().splitlines()
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    connector = _connector(url, connections)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as http:

        async def one(offset: int) -> None:
            nonlocal errors
            i = offset
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                async with http.post(url + "/v1/predict", data=payloads[i % len(payloads)], headers=headers) as r:
                    await r.read()
                    errors += r.status != 200
                latencies.append(time.perf_counter() - t0)
                i += connections

        t0 = time.perf_counter()
        await asyncio.gather(*(one(c) for c in range(connections)))
        elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1e3
    return {
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)),
        "p99_ms": float(np.percentile(lat, 99)),
        "errors": errors,
    }


def run_python_load(url: str, bodies_path: Path, connections: int, seconds: float) -> Load:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--loadgen-child",
            url,
            "--bodies",
            str(bodies_path),
            "--connections",
            str(connections),
            "--seconds",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 60,
        check=True,
    ).stdout
    return Load(**json.loads(out.strip().splitlines()[-1]))


def _connector(url: str, limit: int) -> aiohttp.TCPConnector:
    ca = os.environ.get("BENCH_CA", "")
    tls = client_context(TlsFiles(ca=ca)) if url.startswith("https://") else None
    return aiohttp.TCPConnector(limit=limit, ssl=tls if tls is not None else True)


async def batch_latencies(url: str, payloads: Sequence[bytes], warmup: int, expect: int) -> tuple[float, float, int]:
    """p50/p99 ms of one request at a time on one keep-alive connection;
    an answer without `expect` predictions is an error."""
    times: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=_connector(url, 1)) as http:
        for i, body in enumerate(payloads):
            t0 = time.perf_counter()
            async with http.post(url + "/v1/predict", data=body, headers={"Content-Type": "application/json"}) as r:
                got = await r.read()
                if r.status != 200 or len(orjson.loads(got)["predictions"]) != expect:
                    errors += 1
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
    return float(np.percentile(times, 50)), float(np.percentile(times, 99)), errors


# -- orchestration --------------------------------------------------------------------


def proc_cpu_s(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of processes `pids`, or None without /proc."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # utime, stime are fields 14, 15
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


@dataclass
class Server:
    kind: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path


def start(kind: str, log_dir: Path, lifetime_s: float, shard_url: str = "", secret: str = "") -> Server:
    """One server subprocess; a ``*-secure`` one serves TLS with the files in
    `log_dir` and holds `secret` (the shard) or a token derived from it (the API)."""
    port = free_port()
    log_path = log_dir / f"{kind}.log"
    secure = kind.endswith("-secure")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--serve",
                kind,
                "--port",
                str(port),
                "--shard-url",
                shard_url,
                "--lifetime",
                str(lifetime_s),
                *(["--tls-dir", str(log_dir)] if secure else []),
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={**os.environ, **({"CTRPS_CLUSTER_SECRET": secret} if secure else {})},
        )
    return Server(kind, f"{'https' if secure else 'http'}://127.0.0.1:{port}", proc, log_path)


async def wait_ready(servers: Sequence[Server], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(connector=_connector("https://", 8)) as http:
        for s in servers:
            while True:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"{s.kind} exited {s.proc.returncode}:\n{s.log_path.read_text()[-2000:]}")
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(s.url + "/healthz") as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{s.kind} not ready in {timeout_s}s")
                await asyncio.sleep(0.1)


def stop(servers: Sequence[Server]) -> None:
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)
    for s in servers:
        try:
            s.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log(f"{s.kind} ignored SIGTERM; killing it")
            s.proc.kill()
            s.proc.wait()


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.seconds or (4.0 if args.quick else 15.0)
    batch_requests = 30 if args.quick else 100
    rounds = PAIR_ROUNDS_QUICK if args.quick else PAIR_ROUNDS
    loadgen = args.loadgen
    if loadgen == "auto":
        loadgen = "wrk" if shutil.which("wrk") else "python"
    log(f"load generator: {loadgen}, {args.connections} connections, {seconds:.0f}s per run")
    rng = np.random.default_rng(7)
    single = bodies(rng, 2000 if args.quick else 5000, 1)
    batch = bodies(rng, batch_requests + 3, BATCH_EVENTS)
    with tempfile.TemporaryDirectory(prefix="bench_predict.") as tmp:
        tmpdir = Path(tmp)
        bodies_path = tmpdir / "single.jsonl"
        bodies_path.write_bytes(b"\n".join(single) + b"\n")
        lifetime = 10 * seconds + 600
        make_tls(tmpdir)
        os.environ["BENCH_CA"] = str(tmpdir / "ca.pem")  # the load generators verify the API's certificate
        secret = new_secret()
        shard = start("shard", tmpdir, lifetime)
        secure_shard = start("shard-secure", tmpdir, lifetime, secret=secret)
        servers = [shard, secure_shard]
        try:
            servers += [
                start("bare", tmpdir, lifetime),
                start("api-local", tmpdir, lifetime),
                start("api-http", tmpdir, lifetime, shard.url),
                start("api-secure", tmpdir, lifetime, secure_shard.url, secret=secret),
            ]
            await wait_ready(servers, 60)
            model = make_model("lr", MODEL_NAME)
            async with PSClient.connect([shard.url]) as client, ControlClient.connect([shard.url]) as control:
                await train(client, control, model, make_events(np.random.default_rng(1), TRAIN_EVENTS))
            tls = client_context(tls_files(tmpdir, ca_only=True))
            token = derive_token(secret, Scope.TRAIN)
            async with (
                PSClient.connect([secure_shard.url], token=token, ssl=tls) as client,
                ControlClient.connect([secure_shard.url], token=token, ssl=tls) as control,
            ):
                await train(client, control, model, make_events(np.random.default_rng(1), TRAIN_EVENTS))
            log(f"shards (plaintext, and TLS with credentials) trained with the same {TRAIN_EVENTS} events")
            urls = {
                "bare": servers[2].url,
                "api_local": servers[3].url,
                "api_http": servers[4].url,
                "api_secure": servers[5].url,
            }
            run = run_wrk if loadgen == "wrk" else run_python_load
            loads: dict[str, Load] = {}
            for name in SYSTEMS:
                run(urls[name], bodies_path, args.connections, 1.0)  # warm-up
                loads[name] = run(urls[name], bodies_path, args.connections, seconds)
                r = loads[name]
                log(
                    f"{name:9} single-event: {r.requests_per_s:8.0f} req/s  p50 {r.p50_ms:6.2f} ms  "
                    f"p99 {r.p99_ms:6.2f} ms  errors {r.errors}"
                )
            # Security's cost, plaintext and secure alternating, so that drifts
            # of this shared machine's load hit both alike: medians of 3 rounds.
            # Besides requests/s, the CPU the API and its shard spend per request
            # (steadier than throughput on a shared machine).
            pair: dict[str, list[float]] = {"api_http": [], "api_secure": []}
            pair_cpu: dict[str, list[float]] = {"api_http": [], "api_secure": []}
            pids = {
                "api_http": (servers[4].proc.pid, shard.proc.pid),
                "api_secure": (servers[5].proc.pid, secure_shard.proc.pid),
            }
            for i in range(rounds):
                for name in ("api_http", "api_secure") if i % 2 == 0 else ("api_secure", "api_http"):
                    cpu0 = proc_cpu_s(pids[name])
                    load = run(urls[name], bodies_path, args.connections, seconds / 2)
                    cpu1 = proc_cpu_s(pids[name])
                    pair[name].append(load.requests_per_s)
                    if cpu0 is not None and cpu1 is not None and load.requests_per_s > 0:
                        pair_cpu[name].append((cpu1 - cpu0) / (load.requests_per_s * seconds / 2) * 1e6)
            log(
                "alternating rounds, req/s: "
                + "; ".join(f"{k} " + ", ".join(f"{v:.0f}" for v in vs) for k, vs in pair.items())
            )
            log(
                "alternating rounds, API + shard CPU us per request: "
                + "; ".join(f"{k} " + ", ".join(f"{v:.0f}" for v in vs) for k, vs in pair_cpu.items())
            )
            batches = {}
            for name in SYSTEMS:
                # The bare endpoint answers one constant prediction.
                expect = 1 if name == "bare" else BATCH_EVENTS
                batches[name] = await batch_latencies(urls[name], batch, warmup=3, expect=expect)
                p50, p99, errs = batches[name]
                log(f"{name:9} {BATCH_EVENTS}-event batch: p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  errors {errs}")
        finally:
            stop(servers)
    out: dict[str, Any] = {
        "bench": "predict",
        "mode": bench_mode(args.quick),
        "loadgen": loadgen,
        "connections": args.connections,
        "run_s": seconds,
    }
    for name in SYSTEMS:
        r = loads[name]
        out[f"{name}_requests_per_s"] = round(r.requests_per_s, 1)
        out[f"{name}_p50_ms"] = round(r.p50_ms, 3)
        out[f"{name}_p99_ms"] = round(r.p99_ms, 3)
    for name in ("api_local", "api_http", "api_secure"):
        out[f"{name}_over_bare_ratio"] = round(loads[name].requests_per_s / loads["bare"].requests_per_s, 3)
    for name, vs in pair.items():
        out[f"alternating_{name}_requests_per_s"] = round(float(np.median(vs)), 1)
    out["ratio_secure_vs_plaintext"] = round(
        out["alternating_api_secure_requests_per_s"] / out["alternating_api_http_requests_per_s"], 3
    )
    if all(pair_cpu.values()):
        for name, vs in pair_cpu.items():
            out[f"alternating_{name}_server_cpu_us_per_request"] = round(float(np.median(vs)), 1)
        out["cpu_ratio_secure_vs_plaintext"] = round(
            out["alternating_api_secure_server_cpu_us_per_request"]
            / out["alternating_api_http_server_cpu_us_per_request"],
            3,
        )
    out["alternating_rounds"] = rounds
    out["batch_ratio_secure_vs_plaintext_p50"] = round(batches["api_secure"][0] / batches["api_http"][0], 3)
    out["aim_secure_ratio"] = AIM_SECURE_RATIO
    for name in SYSTEMS:
        out[f"batch_{name}_p50_ms"] = round(batches[name][0], 3)
        out[f"batch_{name}_p99_ms"] = round(batches[name][1], 3)
    out["batch_events"] = BATCH_EVENTS
    out["errors"] = sum(r.errors for r in loads.values()) + sum(b[2] for b in batches.values())
    out["aim_ratio"] = AIM_RATIO
    out["aim_batch_p50_ms"] = AIM_BATCH_P50_MS
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short runs (under a minute)")
    p.add_argument("--loadgen", choices=("auto", "wrk", "python"), default="auto")
    p.add_argument("--connections", type=int, default=32)
    p.add_argument("--seconds", type=float, default=0.0, help="seconds per load run (default 4 quick, 15 full)")
    # Internal: this script as a server or a load generator subprocess.
    p.add_argument(
        "--serve",
        choices=("bare", "shard", "api-local", "api-http", "shard-secure", "api-secure"),
        help=argparse.SUPPRESS,
    )
    p.add_argument("--tls-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--shard-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--lifetime", type=float, default=600.0, help=argparse.SUPPRESS)
    p.add_argument("--loadgen-child", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--bodies", type=Path, help=argparse.SUPPRESS)
    add_record_option(p)
    args = p.parse_args(argv)
    if args.serve:
        uvloop.run(serve(args.serve, args.port, args.shard_url, args.lifetime, args.tls_dir))
        return 0
    if args.loadgen_child:
        return print_result(uvloop.run(_python_load(args.loadgen_child, args.bodies, args.connections, args.seconds)))
    out = uvloop.run(bench(args))
    print()
    print(f"single-event predict at {out['connections']} connections ({out['loadgen']}):")
    for name in SYSTEMS:
        print(
            f"  {name:9} {out[f'{name}_requests_per_s']:9.0f} req/s  p50 {out[f'{name}_p50_ms']:.2f} ms  "
            f"p99 {out[f'{name}_p99_ms']:.2f} ms"
        )
    for name in ("api_local", "api_http", "api_secure"):
        print(f"  {name} / bare: {out[f'{name}_over_bare_ratio']:.2f} (aim >= {AIM_RATIO})")
    if "cpu_ratio_secure_vs_plaintext" in out:
        print(
            f"  API + shard CPU per request: api_http {out['alternating_api_http_server_cpu_us_per_request']:.0f} us, "
            f"api_secure {out['alternating_api_secure_server_cpu_us_per_request']:.0f} us "
            f"({out['cpu_ratio_secure_vs_plaintext']:.2f}x)"
        )
    print(
        f"  api_secure (HTTPS, TLS and a token to its shard) / api_http, medians of {out['alternating_rounds']} "
        f"alternating rounds: {out['ratio_secure_vs_plaintext']:.2f} "
        f"(aim >= {AIM_SECURE_RATIO}); {BATCH_EVENTS}-event p50 ratio {out['batch_ratio_secure_vs_plaintext_p50']:.2f}"
    )
    print(f"{BATCH_EVENTS}-event predict, one at a time:")
    for name in SYSTEMS:
        print(
            f"  {name:9} p50 {out[f'batch_{name}_p50_ms']:.2f} ms  p99 {out[f'batch_{name}_p99_ms']:.2f} ms"
            + (f" (aim p50 <= {AIM_BATCH_P50_MS:.0f} ms)" if name != "bare" else "")
        )
    print_result(out, args)
    return 0 if out["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
