"""`deploy/`: the Dockerfile, docker-compose file and Kubernetes manifests.

No container engine runs here, so the files are checked against the code
they configure: every ctrps command line parses with the real CLI and its
settings build from the environment the file gives it; every ``CTRPS_*``
variable named is one the code reads; shard ids, URLs and ports agree with
each other and with the Services; and the compose file's shard and API
command lines are started as processes on loopback (hostnames and ports
rewritten), where the shards must advertise the RPC port they were given
and the API must become ready over them and predict.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import yaml

from app.cli import build_parser
from app.settings import ApiSettings, ShardSettings, WorkerSettings
from consumers.broker import free_port
from ps_core.client import PSClient
from ps_core.models import make_model

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CTRPS_IMAGE = "ctrps:latest"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return doc


def _k8s() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return docs


def _ctrps_services() -> dict[str, dict[str, Any]]:
    return {name: s for name, s in _compose()["services"].items() if s.get("image") == CTRPS_IMAGE}


def _settings(argv: list[str], env: dict[str, str]) -> Any:
    """The settings a ctrps command line builds from `env` (SettingsError if bad)."""
    args = build_parser().parse_args(argv)
    if args.command == "shard":
        return ShardSettings.from_args(args, env=env)
    if args.command == "worker":
        return WorkerSettings.from_args(args, env=env)
    if args.command == "serve":
        return ApiSettings.from_args(args, env=env)
    return args


def _compose_settings() -> dict[str, Any]:
    return {
        name: _settings(list(s["command"]), {k: str(v) for k, v in s["environment"].items()})
        for name, s in _ctrps_services().items()
    }


def test_compose_command_lines_parse_into_settings() -> None:
    got = _compose_settings()
    assert {"shard-0", "shard-1", "worker", "api", "producer"} <= set(got)
    shards = [s for s in got.values() if isinstance(s, ShardSettings)]
    assert sorted(s.shard_id for s in shards) == list(range(len(shards)))
    for s in shards:
        assert s.num_shards == len(shards) and s.rpc and s.rpc_port == 7200
        assert s.exports_dir == "/exports"
    worker, api = got["worker"], got["api"]
    assert isinstance(worker, WorkerSettings) and isinstance(api, ApiSettings)
    assert worker.bootstrap == "kafka:9092" and worker.use_rpc and api.use_rpc
    # Shard i's URL names the service of shard i on its HTTP port.
    assert worker.shards == api.shards == shards[0].shards
    for i, url in enumerate(worker.shards):
        parts = urlsplit(url)
        assert parts.hostname == f"shard-{i}"
        assert parts.port == next(s.port for s in shards if s.shard_id == i)
    assert got["producer"].source == "synthetic"


def test_compose_workers_get_time_to_finish_their_window() -> None:
    svc = _compose()["services"]["worker"]
    window_s = _compose_settings()["worker"].window_seconds
    grace = svc["stop_grace_period"]
    assert grace.endswith("s") and float(grace[:-1]) >= window_s


def _shard_argv(shell: str, ordinal: int) -> list[str]:
    """The StatefulSet's shell line for pod `ordinal`, as argv after ``ctrps``."""
    line = shell.replace('"${HOSTNAME##*-}"', str(ordinal))
    argv = shlex.split(line)
    assert argv[:2] == ["exec", "ctrps"], line
    return argv[2:]


def test_k8s_manifests_configure_a_consistent_cluster() -> None:
    docs = _k8s()
    by_kind: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    env: dict[str, str] = by_kind[("ConfigMap", "ctrps")]["data"]
    shards_set = by_kind[("StatefulSet", "ctrps-shard")]
    replicas = shards_set["spec"]["replicas"]
    container = shards_set["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    shards = [_settings(_shard_argv(container["args"][0], i), env) for i in range(replicas)]
    assert [s.shard_id for s in shards] == list(range(replicas))
    assert all(s.num_shards == replicas and s.rpc for s in shards)

    # Container ports, the headless Service and the shard URLs agree.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": shards[0].port, "rpc": shards[0].rpc_port}
    service = by_kind[("Service", shards_set["spec"]["serviceName"])]
    assert service["spec"]["clusterIP"] == "None"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    assert service["spec"]["selector"] == shards_set["spec"]["template"]["metadata"]["labels"]
    name, svc = shards_set["metadata"]["name"], service["metadata"]["name"]
    assert list(shards[0].shards) == [f"http://{name}-{i}.{svc}:{ports['http']}" for i in range(replicas)]

    for kind, app_name, cls in (("Deployment", "ctrps-worker", WorkerSettings), ("Deployment", "ctrps-api", ApiSettings)):
        pod = by_kind[(kind, app_name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        s = _settings(list(c["args"]), env)
        assert isinstance(s, cls) and s.shards == shards[0].shards
        if isinstance(s, WorkerSettings):
            assert pod["terminationGracePeriodSeconds"] >= s.window_seconds
        else:
            api_service = by_kind[("Service", "ctrps-api")]
            assert api_service["spec"]["ports"][0]["port"] == s.port
            assert api_service["spec"]["selector"] == by_kind[(kind, app_name)]["spec"]["template"]["metadata"]["labels"]


def test_every_ctrps_variable_named_in_deploy_is_read_by_the_code() -> None:
    named = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            named |= set(re.findall(r"\bCTRPS_[A-Z_]+\b", path.read_text()))
    assert named, "deploy names no settings"
    source = "\n".join(p.read_text() for d in ("app", "consumers") for p in (ROOT / d).glob("*.py"))
    unknown = sorted(v for v in named if f'"{v}"' not in source)
    assert not unknown, f"not read by any setting: {unknown}"


def test_dockerfile_copies_the_packages_and_runs_the_cli() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", text, flags=re.M)
    for src in copied:
        assert (ROOT / src).exists(), src
    assert {"ps_core", "consumers", "app", "pyproject.toml"} <= set(copied)
    assert 'ENTRYPOINT ["ctrps"]' in text
    assert 'ctrps = "app.cli:main"' in (ROOT / "pyproject.toml").read_text()
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", text, flags=re.M)[0].split()}
    settings = _compose_settings()
    assert {settings["shard-0"].port, settings["shard-0"].rpc_port, settings["api"].port} <= exposed


def _local(argv: list[str], ports: dict[int, int]) -> list[str]:
    """A compose command line on loopback: its hosts 127.0.0.1, its ports free ones."""
    out = []
    for a in argv:
        a = re.sub(r"http://shard-(\d+):7100", lambda m: f"http://127.0.0.1:{ports[int(m.group(1))]}", a)
        out.append("127.0.0.1" if a == "0.0.0.0" else a)
    return out


async def test_compose_shard_and_api_commands_run_on_loopback(tmp_path: Path) -> None:
    services = _ctrps_services()
    n = 2
    http = {i: free_port() for i in range(n)}
    rpc = {i: free_port() for i in range(n)}
    api_port = free_port()
    env_base = {k: str(v) for k, v in services["api"]["environment"].items()}
    env_base["CTRPS_SHARDS"] = ",".join(f"http://127.0.0.1:{http[i]}" for i in range(n))
    procs: list[asyncio.subprocess.Process] = []
    logs = []

    async def start(argv: list[str], name: str) -> None:
        log = (tmp_path / f"{name}.log").open("wb")
        logs.append(log)
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", *argv, cwd=ROOT,
                env={**_clean_env(), **env_base}, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            )  # fmt: skip
        )

    try:
        for i in range(n):
            argv = _local(list(services[f"shard-{i}"]["command"]), http)
            argv = _replace(argv, {"--port": str(http[i]), "--rpc-port": str(rpc[i]), "--exports-dir": str(tmp_path / "exports")})
            await start(argv, f"shard-{i}")
        await start(_replace(_local(list(services["api"]["command"]), http), {"--port": str(api_port)}), "api")
        async with aiohttp.ClientSession() as session:
            for i in range(n):
                health = await _poll(session, f"http://127.0.0.1:{http[i]}/healthz", procs, tmp_path)
                assert health["shard_id"] == i and health["rpc_port"] == rpc[i]
            ready = await _poll(session, f"http://127.0.0.1:{api_port}/readyz", procs, tmp_path)
            assert ready == {"status": "ready", "shards": n}
            # The tables, as the first worker would declare them, then a prediction.
            async with PSClient.connect([f"http://127.0.0.1:{http[i]}" for i in range(n)]) as client:
                for table in make_model("lr", "ctr").tables():
                    await client.declare(table)
            async with session.post(
                f"http://127.0.0.1:{api_port}/v1/predict", json={"events": [{"features": {"site": "a"}}]}
            ) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert len(body["predictions"]) == 1
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 15.0)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
        for log in logs:
            log.close()


def _replace(argv: list[str], values: dict[str, str]) -> list[str]:
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}


async def _poll(
    session: aiohttp.ClientSession, url: str, procs: list[asyncio.subprocess.Process], logs: Path
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while True:
        dead = [p for p in procs if p.returncode is not None]
        if dead:
            text = "\n".join(f.read_text() for f in logs.glob("*.log"))
            pytest.fail(f"a role exited with {dead[0].returncode}:\n{text}")
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=1.0)) as resp:
                if resp.status == 200:
                    return await resp.json()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if loop.time() > deadline:
            pytest.fail(f"{url} not ready after 30 s")
        await asyncio.sleep(0.1)  # poll interval
