"""`deploy/`: the Dockerfile, docker-compose file and Kubernetes manifests.

No container engine runs here, so the files are checked against the code
they configure (the Kubernetes objects as ``kubectl kustomize`` renders each
overlay of deploy/k8s/overlays/, every check on each overlay): every ctrps command line parses with the real CLI and its
settings build from the environment the file gives it; every ``CTRPS_*``
variable named is one the code reads; shard ids, URLs and ports agree with
each other and with the Services; and the compose file's shard and API
command lines are started as processes on loopback (hostnames and ports
rewritten), where the shards must advertise the RPC port they were given
and the API must become ready over them and predict.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
import yaml
from jsonlog import read_json_lines
from waiting import json_when_ok

from app.cli import build_parser
from app.config.serve import ApiSettings
from app.config.shard import ShardSettings
from app.config.worker import WorkerSettings
from consumers.broker import free_port
from ps_core.model.models import DEFAULT_LINEAR_OPTIMIZER, make_model
from ps_core.net.auth import Scope, TokenVerifier, bearer, derive_token

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


def _load_make_secrets() -> Any:
    """deploy/make_secrets.py, a script beside the manifests (not a package)."""
    spec = importlib.util.spec_from_file_location("make_secrets", DEPLOY / "make_secrets.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_secrets = _load_make_secrets()
CTRPS_IMAGE = "ctrps:latest"


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    return doc


OVERLAYS = ("one-machine", "production")
KUBECTL = shutil.which("kubectl")
EACH_OVERLAY = pytest.mark.parametrize("overlay", OVERLAYS)


@functools.cache
def _rendered(path: str) -> str:
    """``kubectl kustomize deploy/k8s/<path>``'s output (the test skipped without kubectl)."""
    if KUBECTL is None:
        pytest.skip("kubectl is not installed: the manifests are what `kubectl kustomize` renders")
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "k8s" / path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _k8s(overlay: str, path: str = "overlays/{}") -> list[dict[str, Any]]:
    """The objects of an overlay (or, with `path`, of deploy/k8s/<path>) as rendered."""
    return [d for d in yaml.safe_load_all(_rendered(path.format(overlay))) if d]


# The ConfigMaps the production overlay names and the operator creates
# (its header comment), with values as an operator gives them.
OPERATOR_CONFIGMAPS = {
    "ctrps-kafka": {"CTRPS_KAFKA_BOOTSTRAP": "kafka.kafka:9092"},
    "ctrps-bucket": {"CTRPS_EXPORTS_DIR": "s3://ctrps-exports/prod", "AWS_REGION": "eu-west-1"},
}


def _env(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What `container`'s environment holds: the ConfigMaps of its envFrom,
    rendered (one-machine's Kafka, a component's generated map) or, where
    the overlay renders none, the operator's (`OPERATOR_CONFIGMAPS`; any
    other is an error), then its literal env values. Its CTRPS_*_FILE
    values are left out: `_file_env` holds them to their Secrets."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        if "configMapRef" in ref:
            name = ref["configMapRef"]["name"]
            assert name in maps or name in OPERATOR_CONFIGMAPS, f"ConfigMap {name} is neither rendered nor documented"
            env.update(maps.get(name, OPERATOR_CONFIGMAPS.get(name, {})))
    env.update(
        {e["name"]: e["value"] for e in container.get("env", []) if "value" in e and not e["name"].endswith("_FILE")}
    )
    return env


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


@functools.cache
def _secret_files() -> dict[str, Path]:
    """One set of credentials as make_secrets.py writes them, for the files the services name."""
    directory = Path(tempfile.mkdtemp(prefix="ctrps-deploy-test-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    files: dict[str, Path] = make_secrets.make(directory / "secrets")
    return files


def _with_secret_files(env: dict[str, Any]) -> dict[str, str]:
    """A compose service's environment, its /run/secrets/<name> paths the files of `_secret_files`."""
    by_name = {name: Path(s["file"]).name for name, s in _compose()["secrets"].items()}
    out = {k: str(v) for k, v in env.items()}
    for key, value in out.items():
        if value.startswith("/run/secrets/"):
            out[key] = str(_secret_files()[by_name[value.removeprefix("/run/secrets/")]])
    return out


def _compose_settings() -> dict[str, Any]:
    return {
        name: _settings(list(s["command"]), _with_secret_files(s["environment"]))
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


def _expanded(args: list[str], env: dict[str, str]) -> list[str]:
    """A container's args as the kubelet runs them: each ``$(NAME)`` of its
    environment replaced by the value (``$$`` is a literal ``$``). A
    reference left unexpanded (the kubelet would pass it as it is) fails."""

    def one(arg: str) -> str:
        out = re.sub(
            r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg
        )
        assert "$(" not in out, f"{arg}: not in the container's environment"
        return out

    return [one(a) for a in args]


def _argv(docs: list[dict[str, Any]], role: str, c: dict[str, Any]) -> list[str]:
    """A role's ctrps command line after ``ctrps`` (the shard pod 0's)."""
    return _shard_argv(c["args"][0], 0) if role == "shard" else _expanded(list(c["args"]), _env(docs, c))


@EACH_OVERLAY
def test_k8s_manifests_configure_a_consistent_cluster(overlay: str) -> None:
    docs = _k8s(overlay)
    by_kind: dict[tuple[str, str], dict[str, Any]] = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    shards_set = by_kind[("StatefulSet", "ctrps-shard")]
    replicas = shards_set["spec"]["replicas"]
    container = shards_set["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["/bin/sh", "-c"]
    shards = [_settings(_shard_argv(container["args"][0], i), _env(docs, container)) for i in range(replicas)]
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

    for kind, app_name, cls in (
        ("Deployment", "ctrps-worker", WorkerSettings),
        ("Deployment", "ctrps-api", ApiSettings),
    ):
        pod = by_kind[(kind, app_name)]["spec"]["template"]["spec"]
        c = pod["containers"][0]
        s = _settings(list(c["args"]), _env(docs, c))
        assert isinstance(s, cls) and s.shards == shards[0].shards
        if isinstance(s, WorkerSettings):
            assert pod["terminationGracePeriodSeconds"] >= s.window_seconds
        else:
            api_service = by_kind[("Service", "ctrps-api")]
            assert api_service["spec"]["ports"][0]["port"] == s.port
            assert (
                api_service["spec"]["selector"] == by_kind[(kind, app_name)]["spec"]["template"]["metadata"]["labels"]
            )

    # Serving replicas (production: its exports are in a bucket) follow
    # every model at the location the shards export to, the one the workers
    # train the default; they name no shard.
    replica = by_kind.get(("Deployment", "ctrps-replica"))
    assert (replica is not None) == (overlay == "production")
    if replica is not None:
        [rc] = replica["spec"]["template"]["spec"]["containers"]
        s = _settings(_argv(docs, "replica", rc), _env(docs, rc))
        [wc] = by_kind[("Deployment", "ctrps-worker")]["spec"]["template"]["spec"]["containers"]
        worker = _settings(list(wc["args"]), _env(docs, wc))
        assert isinstance(s, ApiSettings) and s.follows_store() and not s.shards and s.follow_all
        assert s.follow == shards[0].exports_dir == OPERATOR_CONFIGMAPS["ctrps-bucket"]["CTRPS_EXPORTS_DIR"]
        assert s.model_name == worker.model_name
        service = by_kind[("Service", "ctrps-replica")]
        assert service["spec"]["selector"] == replica["spec"]["template"]["metadata"]["labels"]
        assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(s.port, "http")]
        assert {p["name"]: p["containerPort"] for p in rc["ports"]} == {"http": s.port}


def test_every_ctrps_variable_named_in_deploy_is_read_by_the_code() -> None:
    named = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            named |= set(re.findall(r"\bCTRPS_[A-Z_]+\b", path.read_text()))
    assert named, "deploy names no settings"
    source = "\n".join(p.read_text() for d in ("app", "consumers") for p in (ROOT / d).rglob("*.py"))
    # A secret's X_FILE is read wherever X is read from the environment or a file.
    read_from_file = set(re.findall(r'_secret_from\(env, "(CTRPS_[A-Z_]+)"\)', source))
    unknown = sorted(v for v in named if f'"{v}"' not in source and v.removesuffix("_FILE") not in read_from_file)
    assert not unknown, f"not read by any setting: {unknown}"


def test_dockerfile_copies_the_packages_and_runs_the_cli() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", text, flags=re.M)
    for src in copied:
        assert (ROOT / src).exists(), src
    assert {"ps_core", "consumers", "app", "pyproject.toml"} <= set(copied)
    assert 'ENTRYPOINT ["ctrps"]' in text
    assert 'ctrps = "app.entry:main"' in (ROOT / "pyproject.toml").read_text()
    exposed = {int(p) for p in re.findall(r"^EXPOSE (.+)$", text, flags=re.M)[0].split()}
    settings = _compose_settings()
    assert {settings["shard-0"].port, settings["shard-0"].rpc_port, settings["api"].port} <= exposed


def test_the_image_production_runs_holds_the_s3_client() -> None:
    """The production overlay runs the image as built by default (no
    ``images`` override), and its shards and replicas read ``s3://``: the
    Dockerfile's default extras include ``s3`` (obstore)."""
    production = yaml.safe_load((DEPLOY / "k8s" / "overlays" / "production" / "kustomization.yaml").read_text())
    assert "images" not in production
    assert {c["image"] for pod in _pods("production").values() for c in pod["containers"]} == {CTRPS_IMAGE}
    assert any(_env(_k8s("production"), c).get("CTRPS_EXPORTS_DIR", "").startswith("s3://")
               for pod in _pods("production").values() for c in pod["containers"])  # fmt: skip
    [extras] = re.findall(r"^ARG EXTRAS=(\S+)$", (DEPLOY / "Dockerfile").read_text(), flags=re.M)
    assert "s3" in extras.split(","), extras
    assert re.search(r"^s3 = \[.*obstore", (ROOT / "pyproject.toml").read_text(), flags=re.M)


def _local(argv: list[str], ports: dict[int, int]) -> list[str]:
    """A compose command line on loopback: its hosts 127.0.0.1, its ports free ones."""
    out = []
    for a in argv:
        a = re.sub(r"http://shard-(\d+):7100", lambda m: f"http://127.0.0.1:{ports[int(m.group(1))]}", a)
        out.append("127.0.0.1" if a == "0.0.0.0" else a)
    return out


@pytest.mark.slow
@pytest.mark.process
async def test_compose_shard_and_api_commands_run_on_loopback(tmp_path: Path) -> None:
    services = _ctrps_services()
    n = 2
    # Every port the children can take themselves is port 0, read from their
    # listening lines: a port picked here and bound later by a child may be
    # taken meanwhile (another test's shard 0 answered as shard 1). Only
    # shard 0's must be known before it starts (it is in its own
    # CTRPS_SHARDS): a race for it is seen and retried below.
    http: dict[int, int] = {}
    rpc: dict[int, int] = {}
    # The credentials as an operator makes them, each service given its
    # compose secrets at the files its CTRPS_*_FILE names.
    secret_files = make_secrets.make(tmp_path / "secrets")
    compose_secrets = {name: Path(s["file"]).name for name, s in _compose()["secrets"].items()}
    procs: list[asyncio.subprocess.Process] = []
    logs = []

    def service_env(service: str, shards: str | None) -> dict[str, str]:
        env = {k: str(v) for k, v in services[service]["environment"].items()}
        for key, value in env.items():
            if value.startswith("/run/secrets/"):
                name = value.removeprefix("/run/secrets/")
                assert name in services[service]["secrets"], (service, name)
                env[key] = str(secret_files[compose_secrets[name]])
        # Only shard 0 (the coordinator's) and the API reach the other shards.
        env.pop("CTRPS_SHARDS", None)
        return {**env, **({"CTRPS_SHARDS": shards} if shards is not None else {})}

    async def start(argv: list[str], name: str, service: str, shards: str | None) -> dict[str, Any] | None:
        """Start a role; its listening line, or None when it exited first."""
        path = tmp_path / f"{name}.log"
        log = path.open("wb")
        logs.append(log)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            *argv,
            cwd=ROOT,
            env={**_clean_env(), **service_env(service, shards)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )  # fmt: skip
        procs.append(proc)
        deadline = asyncio.get_running_loop().time() + 30.0
        while True:
            for event in read_json_lines(path):
                if event.get("msg") == "listening":
                    return event
            if proc.returncode is not None:
                return None
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"{name}: no listening line after 30 s: {path.read_text()[-2000:]}")
            await asyncio.sleep(0.05)  # poll interval

    def port_of(event: dict[str, Any]) -> int:
        port = urlsplit(str(event["url"])).port
        assert port, event
        return port

    try:
        for i in range(n - 1, -1, -1):  # shard 0 last: it names every other shard
            argv = _replace(
                _local(list(services[f"shard-{i}"]["command"]), http),
                {"--port": "0", "--rpc-port": "0", "--exports-dir": str(tmp_path / "exports")},
            )
            for attempt in range(3):
                if i == 0:
                    http[0] = free_port()
                    argv = _replace(argv, {"--port": str(http[0])})
                shards = ",".join(f"http://127.0.0.1:{http[j]}" for j in range(n)) if i == 0 else None
                event = await start(argv, f"shard-{i}-{attempt}", f"shard-{i}", shards)
                if event is not None:
                    break
                said = (tmp_path / f"shard-{i}-{attempt}.log").read_text()
                # Another process took the port picked for shard 0 before it bound it.
                assert i == 0 and "in use" in said, said[-2000:]
                procs.pop()
            else:
                pytest.fail(f"shard-{i}: its port was taken three times")
            http[i], rpc[i] = port_of(event), event["rpc_port"]
        shards = ",".join(f"http://127.0.0.1:{http[i]}" for i in range(n))
        api = await start(
            _replace(_local(list(services["api"]["command"]), http), {"--port": "0"}), "api", "api", shards
        )
        assert api is not None, (tmp_path / "api.log").read_text()[-2000:]
        api_port = port_of(api)
        async with aiohttp.ClientSession() as session:
            for i in range(n):
                health = await _poll(session, f"http://127.0.0.1:{http[i]}/healthz", procs, tmp_path)
                assert health["shard_id"] == i and health["rpc_port"] == rpc[i]
            ready = await _poll(session, f"http://127.0.0.1:{api_port}/readyz", procs, tmp_path)
            assert ready == {"status": "ready", "shards": n}
            # The tables, as the first worker would declare them (with the
            # workers' token), then a prediction through the API's own token.
            worker_token = secret_files["worker-token"].read_text().strip()
            admin_shard_token = secret_files["api-shard-token"].read_text().strip()
            for i in range(n):
                # Shard 0 admits every shard (itself too) once it starts.
                await _poll(
                    session, f"http://127.0.0.1:{http[i]}/v1/membership", procs, tmp_path,
                    headers=bearer(admin_shard_token), until=lambda m: bool(m["joined"]),
                )  # fmt: skip
            for i in range(n):
                for table in make_model("lr", "ctr").tables():
                    async with session.post(
                        f"http://127.0.0.1:{http[i]}/v1/tables", data=orjson.dumps(table.to_dict()),
                        headers={"Content-Type": "application/json", **bearer(worker_token)},
                    ) as resp:  # fmt: skip
                        assert resp.status in (200, 201), await resp.text()
            async with session.post(
                f"http://127.0.0.1:{api_port}/v1/predict", json={"events": [{"features": {"site": "a"}}]}
            ) as resp:
                assert resp.status == 200, await resp.text()
                body = await resp.json()
            assert len(body["predictions"]) == 1
            # The API on 0.0.0.0 in compose started because it has its admin token (from its file).
            admin = secret_files["admin-token"].read_text().strip()
            async with session.post(f"http://127.0.0.1:{api_port}/v1/status", json={}) as resp:
                assert resp.status == 401, await resp.text()
            async with session.post(f"http://127.0.0.1:{api_port}/v1/status", json={}, headers=bearer(admin)) as resp:
                assert resp.status != 401, await resp.text()
    finally:
        for p in procs:
            if p.returncode is None:
                p.terminate()
        for p in procs:
            try:
                await asyncio.wait_for(p.wait(), 15.0)
            except TimeoutError:
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

    return {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}


async def _poll(
    session: aiohttp.ClientSession,
    url: str,
    procs: list[asyncio.subprocess.Process],
    logs: Path,
    headers: dict[str, str] | None = None,
    until: Callable[[Any], bool] = lambda body: True,
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while True:
        dead = [p for p in procs if p.returncode is not None]
        if dead:
            text = "\n".join(f.read_text() for f in logs.glob("*.log"))
            pytest.fail(f"a role exited with {dead[0].returncode}:\n{text}")
        body = await json_when_ok(session, url, headers)
        if body is not None and until(body):
            return body
        if loop.time() > deadline:
            pytest.fail(f"{url} not ready after 30 s")
        await asyncio.sleep(0.1)  # poll interval


# -- secrets and the network policy ---------------------------------------------------------

COMPONENT = "app.kubernetes.io/component"


WORKLOADS = ("Deployment", "StatefulSet", "Job")


def _pods(overlay: str) -> dict[str, dict[str, Any]]:
    """Each workload's pod spec, by its component label (shard, worker, api,
    topics; broker in one-machine)."""
    return {
        d["spec"]["template"]["metadata"]["labels"][COMPONENT]: d["spec"]["template"]["spec"]
        for d in _k8s(overlay)
        if d["kind"] in WORKLOADS
    }


def _secrets_of(pod: dict[str, Any]) -> dict[str, set[str]]:
    """Secret name -> the keys of it a pod can read (every key: ``*``)."""
    got: dict[str, set[str]] = {}

    def add(name: str, items: list[dict[str, str]] | None) -> None:
        got.setdefault(name, set()).update({i["key"] for i in items} if items else {"*"})

    for volume in pod.get("volumes", []):
        if "secret" in volume:
            add(volume["secret"]["secretName"], volume["secret"].get("items"))
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                add(source["secret"]["name"], source["secret"].get("items"))
    for c in pod["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                add(ref["name"], [{"key": ref["key"]}])
        for e in c.get("envFrom", []):
            if "secretRef" in e:
                add(e["secretRef"]["name"], None)
    return got


def _file_env(pod: dict[str, Any]) -> dict[str, str]:
    """The container's CTRPS_*_FILE variables mapped to the Secret key behind each file."""
    [c] = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    files: dict[str, tuple[str, str]] = {}
    for volume in pod.get("volumes", []):
        sources = (
            [{"secret": {"name": volume["secret"]["secretName"], **volume["secret"]}}] if "secret" in volume else []
        )
        sources += volume.get("projected", {}).get("sources", [])
        for source in sources:
            for item in source.get("secret", {}).get("items", []):
                files[f"{mounts[volume['name']]}/{item['path']}"] = (source["secret"]["name"], item["key"])
    return {e["name"]: "/".join(files[e["value"]]) for e in c.get("env", []) if e["name"].endswith("_FILE")}


@EACH_OVERLAY
def test_k8s_each_secret_goes_only_to_the_roles_that_use_it(overlay: str) -> None:
    pods = _pods(overlay)
    # The embedded broker runs in one-machine only, the serving replicas in production only.
    assert set(pods) == {"shard", "worker", "api", "topics"} | ({"broker"} if overlay == "one-machine" else {"replica"})
    replicas = {"replica"} if overlay == "production" else set()
    # The credentials, as files named by CTRPS_*_FILE (never values in the environment).
    assert _file_env(pods["shard"]) == {"CTRPS_CLUSTER_SECRET_FILE": "ctrps-cluster-secret/secret"}
    assert _file_env(pods["worker"]) == {"CTRPS_SHARD_TOKEN_FILE": "ctrps-worker-token/token"}
    assert _file_env(pods["api"]) == {
        "CTRPS_SHARD_TOKEN_FILE": "ctrps-api-shard-token/token",
        "CTRPS_ADMIN_TOKEN_FILE": "ctrps-admin-token/token",
    }
    # A replica calls no shard: its admin token only (on 0.0.0.0 it needs one).
    for role in replicas:
        assert _file_env(pods[role]) == {"CTRPS_ADMIN_TOKEN_FILE": "ctrps-replica-admin-token/token"}
    readable = {role: _secrets_of(pod) for role, pod in pods.items()}
    holders = {
        name: {role for role, got in readable.items() if name in got} for got in readable.values() for name in got
    }
    assert holders == {
        "ctrps-cluster-secret": {"shard"},
        "ctrps-worker-token": {"worker"},
        "ctrps-api-shard-token": {"api"},
        "ctrps-admin-token": {"api"},
        **({"ctrps-replica-admin-token": replicas} if replicas else {}),
        "ctrps-tls": {"shard", "worker", "api"} | replicas,
        "ctrps-kafka": {"worker", "topics"},
        # The bucket's credentials (production: its exports are in a bucket,
        # which the shards write and the replicas read).
        **({"ctrps-s3": {"shard", "replica"}} if overlay == "production" else {}),
    }
    for role in {"shard"} | replicas if overlay == "production" else ():
        # Key by key as the AWS variables of the same names, each optional
        # (a web identity instead): never the whole Secret.
        [container] = pods[role]["containers"]
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        }
        assert refs == {k: {"name": "ctrps-s3", "key": k, "optional": True} for k in BUCKET_CREDENTIALS}, role
        assert readable[role]["ctrps-s3"] == set(BUCKET_CREDENTIALS), role
    # TLS: the servers get the certificate, key and CA; the workers only the CA.
    assert readable["shard"]["ctrps-tls"] == readable["api"]["ctrps-tls"] == {"*"}
    for role in replicas:
        assert readable[role]["ctrps-tls"] == {"*"}
    assert readable["worker"]["ctrps-tls"] == {"ca.crt"}
    # The secret names and keys are those make_secrets.py tells kubectl to create.
    created = {name: key for name, (key, _) in make_secrets.KUBERNETES.items()}
    for got in readable.values():
        for name, keys in got.items():
            if name not in ("ctrps-tls", "ctrps-kafka", "ctrps-s3"):
                assert keys == {created[name]}, (name, keys)
    # Files readable by the image's user only through its group; no API token to the pods.
    for role, pod in pods.items():
        assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 10001, role
        assert pod["automountServiceAccountToken"] is False, role
    # Whatever the ConfigMaps give every pod holds no credential.
    for config in (d["data"] for d in _k8s(overlay) if d["kind"] == "ConfigMap"):
        assert not [k for k in config if re.search(r"SECRET|TOKEN|KEY", k)]


@EACH_OVERLAY
def test_k8s_roles_on_0_0_0_0_start_with_their_credentials_and_without_insecure(overlay: str, tmp_path: Path) -> None:
    """The API binds 0.0.0.0 and accepts that only with an admin token; nothing passes --insecure."""
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert "--insecure" not in path.read_text() and "CTRPS_INSECURE" not in path.read_text(), path
    files = make_secrets.make(tmp_path / "s")
    file_of = {f"{name}/{key}": file for name, (key, file) in make_secrets.KUBERNETES.items()}
    pods = _pods(overlay)
    # The API, and in production the serving replicas (`ctrps serve` both).
    assert {"api", "replica"} & set(pods) == {"api"} | ({"replica"} if overlay == "production" else set())
    for role in {"api", "replica"} & set(pods):
        pod = pods[role]
        [c] = pod["containers"]
        env = _env(_k8s(overlay), c)
        for key, secret_key in _file_env(pod).items():
            env[key] = str(files[file_of[secret_key]])
        argv = _argv(_k8s(overlay), role, c)
        settings = _settings(argv, env)
        assert settings.host == "0.0.0.0" and not settings.insecure, role
        settings.check_exposed()  # the admin token from its file: it starts
        with pytest.raises(Exception, match="no credentials"):
            _settings(argv, {k: v for k, v in env.items() if k != "CTRPS_ADMIN_TOKEN_FILE"}).check_exposed()


@EACH_OVERLAY
def test_the_network_policy_lets_only_workers_the_api_and_shards_reach_the_shards(overlay: str) -> None:
    docs = _k8s(overlay)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    shard_labels = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    # A default deny for every ctrps pod: no rule, ingress only.
    deny = policies["ctrps-default-deny"]
    assert deny["podSelector"] == {"matchLabels": {"app.kubernetes.io/name": "ctrps"}}
    assert deny["policyTypes"] == ["Ingress"] and "ingress" not in deny
    selecting_shards = {
        name: p for name, p in policies.items() if p["podSelector"]["matchLabels"].items() <= shard_labels.items()
    }
    assert set(selecting_shards) == {"ctrps-default-deny", "ctrps-shard", "ctrps-metrics"}
    # Prometheus's namespace reaches the metrics ports only: the shards' HTTP port, not their RPC.
    [scrape] = policies["ctrps-metrics"]["ingress"]
    assert scrape["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    assert {p["port"] for p in scrape["ports"]} == {
        int(a["prometheus.io/port"]) for a in _scrape_annotations(overlay).values()
    } - {
        8080  # the API's port is open to everyone already
    }
    [rule] = policies["ctrps-shard"]["ingress"]
    allowed = {peer["podSelector"]["matchLabels"][COMPONENT] for peer in rule["from"]}
    assert allowed == {"worker", "api", "shard"}
    assert all(set(peer) == {"podSelector"} for peer in rule["from"])  # no namespace or IP block widens it
    pods = _pods(overlay)
    assert {pods[r]["containers"][0]["name"] for r in allowed} == {"worker", "api", "shard"}
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "ctrps-shard")
    assert {(p["protocol"], p["port"]) for p in rule["ports"]} == {
        ("TCP", p["targetPort"]) for p in service["spec"]["ports"]
    }
    # The API's port is open to everyone, and so is a serving replica's
    # (production): a prediction endpoint as the API; its policy selects it alone.
    [api_rule] = policies["ctrps-api"]["ingress"]
    assert "from" not in api_rule and api_rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    replica = next((d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "ctrps-replica"), None)
    assert (replica is not None) == (overlay == "production")
    if replica is not None:
        labels = replica["spec"]["template"]["metadata"]["labels"]
        selecting = {n for n, p in policies.items() if p["podSelector"]["matchLabels"].items() <= labels.items()}
        assert selecting == {"ctrps-default-deny", "ctrps-replica", "ctrps-metrics"}
        [replica_rule] = policies["ctrps-replica"]["ingress"]
        [rc] = replica["spec"]["template"]["spec"]["containers"]
        port = _settings(_argv(docs, "replica", rc), _env(docs, rc)).port
        assert "from" not in replica_rule and replica_rule["ports"] == [{"protocol": "TCP", "port": port}]
    # Every pod is under the default deny.
    for d in docs:
        if d["kind"] in WORKLOADS:
            assert d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "ctrps"


def test_compose_gives_each_service_only_its_own_secrets() -> None:
    doc = _compose()
    files = {name: s["file"] for name, s in doc["secrets"].items()}
    # Every file but the serving replicas' token: compose runs no replica.
    assert sorted(Path(f).name for f in files.values()) == sorted(set(make_secrets.FILES) - {"replica-admin-token"})
    assert all(f.startswith("./secrets/") for f in files.values())
    got = {name: (set(s.get("secrets", [])), {k: v for k, v in s["environment"].items() if k.endswith("_FILE")})
           for name, s in _ctrps_services().items()}  # fmt: skip
    assert got == {
        "shard-0": ({"cluster_secret"}, {"CTRPS_CLUSTER_SECRET_FILE": "/run/secrets/cluster_secret"}),
        "shard-1": ({"cluster_secret"}, {"CTRPS_CLUSTER_SECRET_FILE": "/run/secrets/cluster_secret"}),
        "worker": ({"worker_token"}, {"CTRPS_SHARD_TOKEN_FILE": "/run/secrets/worker_token"}),
        "api": ({"api_shard_token", "admin_token"}, {"CTRPS_SHARD_TOKEN_FILE": "/run/secrets/api_shard_token",
                                                   "CTRPS_ADMIN_TOKEN_FILE": "/run/secrets/admin_token"}),
        "producer": (set(), {}),
        "topics": (set(), {}),
    }  # fmt: skip
    assert "secrets/" in (ROOT / ".gitignore").read_text()


@EACH_OVERLAY
def test_no_deploy_file_holds_a_literal_credential(overlay: str) -> None:
    for path in DEPLOY.rglob("*"):
        if not path.is_file():
            continue
        text = path.read_text()
        # A token looks like <scope>.<43 base64url characters>; a secret is long base64url.
        assert not re.search(r"\b(read|train|admin)\.[A-Za-z0-9_-]{43}\b", text), path
        for run in re.findall(r"[A-Za-z0-9_-]{24,}", text):
            mixed = re.search(r"[a-z]", run) and re.search(r"[A-Z]", run) and re.search(r"[0-9]", run)
            assert not mixed, (path, run)
    for d in _k8s(overlay):
        assert d["kind"] != "Secret", "Secrets are created by the operator, not shipped"
        for pod in [d["spec"]["template"]["spec"]] if d["kind"] in WORKLOADS else []:
            for c in pod["containers"]:
                for e in c.get("env", []):
                    assert "valueFrom" in e or e["name"].endswith("_FILE"), e
    for s in _ctrps_services().values():
        for key in s["environment"]:
            assert not re.search(r"SECRET|TOKEN", key) or key.endswith("_FILE"), key


@pytest.mark.slow
@pytest.mark.process
def test_make_secrets_writes_private_files_of_derived_tokens(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(DEPLOY / "make_secrets.py"), str(tmp_path / "s"), "ml"],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    d = tmp_path / "s"
    values = {name: (d / name).read_text().strip() for name in make_secrets.FILES}
    assert sorted(p.name for p in d.iterdir()) == sorted(make_secrets.FILES)
    assert (d.stat().st_mode & 0o777) == 0o700
    assert all(((d / n).stat().st_mode & 0o777) == 0o600 for n in make_secrets.FILES)
    secret = values["cluster-secret"]
    verifier = TokenVerifier(secret)
    assert values["worker-token"] == derive_token(secret, Scope.TRAIN)
    assert verifier.scope_of(values["api-shard-token"]) is Scope.ADMIN
    for admin in ("admin-token", "replica-admin-token"):  # for people, unrelated to the secret
        assert verifier.scope_of(values[admin]) is None and len(values[admin]) >= 32
    assert values["admin-token"] != values["replica-admin-token"]
    for value in values.values():
        assert value not in out.stdout  # it prints where, never what
    for name, (key, file) in make_secrets.KUBERNETES.items():
        assert f"kubectl create secret generic {name} --namespace ml --from-file={key}={d / file}" in out.stdout
    # A second run never overwrites: exit 1, the files unchanged.
    again = subprocess.run(
        [sys.executable, str(DEPLOY / "make_secrets.py"), str(d)],
        cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert again.returncode == 1 and "exists" in again.stderr
    assert {n: (d / n).read_text().strip() for n in make_secrets.FILES} == values


def _scrape_annotations(overlay: str) -> dict[str, dict[str, str]]:
    """Each workload's pod annotations, by its component label (the ones
    that have any: the broker serves its /metrics on loopback only)."""
    return {
        d["spec"]["template"]["metadata"]["labels"][COMPONENT]: d["spec"]["template"]["metadata"]["annotations"]
        for d in _k8s(overlay)
        if d["kind"] in ("Deployment", "StatefulSet") and "annotations" in d["spec"]["template"]["metadata"]
    }


@EACH_OVERLAY
def test_every_role_is_scraped_on_the_port_that_serves_its_metrics(overlay: str) -> None:
    """Each pod template's Prometheus annotations name the port its role
    serves ``/metrics`` on (the worker's --metrics-port, on every interface),
    a container port; deploy/monitoring/prometheus.yml scrapes the compose
    services on theirs."""
    pods = _pods(overlay)
    for role, wanted in _scrape_annotations(overlay).items():
        container = pods[role]["containers"][0]
        s = _settings(_argv(_k8s(overlay), role, container), _env(_k8s(overlay), container))
        port = s.metrics_port if isinstance(s, WorkerSettings) else s.port
        if isinstance(s, WorkerSettings):
            assert s.metrics_host == "0.0.0.0"
        assert wanted == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }
        assert port in {p["containerPort"] for p in container["ports"]}, role
    assert set(_scrape_annotations(overlay)) == {"shard", "worker", "api"} | (
        {"replica"} if overlay == "production" else set()
    )

    scrape = yaml.safe_load((DEPLOY / "monitoring" / "prometheus.yml").read_text())["scrape_configs"]
    jobs = {j["job_name"]: j for j in scrape}
    settings = _compose_settings()
    shards = [f"{name}:{s.port}" for name, s in settings.items() if isinstance(s, ShardSettings)]
    assert jobs["ctrps-shard"]["static_configs"] == [{"targets": shards}]
    assert jobs["ctrps-api"]["static_configs"] == [{"targets": [f"api:{settings['api'].port}"]}]
    worker = settings["worker"]
    assert (worker.metrics_host, jobs["ctrps-worker"]["dns_sd_configs"]) == (
        "0.0.0.0",
        [{"names": ["worker"], "type": "A", "port": worker.metrics_port}],
    )


# -- what an operator expects of the overlays ----------------------------------------------

RESULTS = ROOT / "bench" / "results"
# The restore rate docs/measurements.md quotes ("Exports and restores": 10M
# rows, 2 shards → 3, checked): the slower of the measured figures.
RESTORE_ROWS_PER_S = 2.4e6
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "m": 1e-3, "": 1}


def _quantity(text: str | int) -> float:
    """A Kubernetes quantity (``512Mi``, ``4Gi``, ``500m``, ``2``) as a number."""
    number, unit = re.fullmatch(r"([0-9.]+)([KMG]i|m)?", str(text)).groups()  # type: ignore[union-attr]
    return float(number) * _UNITS[unit or ""]


def _result(bench: str) -> dict[str, Any]:
    result: dict[str, Any] = orjson.loads((RESULTS / f"{bench}.quick.json").read_bytes())["result"]
    return result


def _measured(bench: str, key: str) -> float:
    return float(_result(bench)[key])


def _workloads(overlay: str) -> dict[str, dict[str, Any]]:
    return {d["spec"]["template"]["metadata"]["labels"][COMPONENT]: d for d in _k8s(overlay) if d["kind"] in WORKLOADS}


def _validator() -> str:
    """The ``kubernetes-validate`` script of this environment (a dev dependency)."""
    found = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)) or shutil.which(
        "kubernetes-validate"
    )
    assert found, "kubernetes-validate is not installed: pip install -e '.[dev]'"
    return found


@EACH_OVERLAY
def test_each_overlay_renders_objects_kubernetes_accepts(overlay: str, tmp_path: Path) -> None:
    """Every object against the Kubernetes schemas, unknown fields refused."""
    rendered = tmp_path / f"{overlay}.yaml"
    rendered.write_text(_rendered(f"overlays/{overlay}"))
    out = subprocess.run(
        [_validator(), "--strict", "--quiet", str(rendered)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    kinds = {d["kind"] for d in _k8s(overlay)}
    assert {"StatefulSet", "Deployment", "Job", "PodDisruptionBudget"} <= kinds
    assert {"PersistentVolumeClaim" if overlay == "one-machine" else "ServiceAccount"} <= kinds


@EACH_OVERLAY
def test_every_role_has_probes_on_a_route_it_serves_and_every_container_its_resources(overlay: str) -> None:
    for role, workload in _workloads(overlay).items():
        [c] = workload["spec"]["template"]["spec"]["containers"]
        # Requests and limits of CPU and memory, the limit at least the request.
        for what in ("cpu", "memory"):
            request, limit = c["resources"]["requests"][what], c["resources"]["limits"][what]
            assert _quantity(request) <= _quantity(limit), (role, what)
        if workload["kind"] == "Job":
            continue  # runs to its end: nothing to probe
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}
        assert {"readinessProbe", "livenessProbe"} <= set(probes), role
        if role == "broker":
            args = build_parser().parse_args(c["args"])
            assert all(p["tcpSocket"]["port"] == "kafka" for p in probes.values())
            assert ports["kafka"] == args.port
            continue
        s = _settings(_argv(_k8s(overlay), role, c), _env(_k8s(overlay), c))
        # The routes each role serves: a shard /healthz, the API /healthz and
        # /readyz on its port, a worker nothing but /metrics on its metrics port.
        served: set[tuple[str, int]]
        if isinstance(s, WorkerSettings):
            served = {("/metrics", s.metrics_port)}
        elif isinstance(s, ApiSettings):
            served = {("/healthz", s.port), ("/readyz", s.port)}
        else:
            served = {("/healthz", s.port)}
        for kind, probe in probes.items():
            assert (probe["httpGet"]["path"], ports[probe["httpGet"]["port"]]) in served, (role, kind)
        if role == "worker":
            assert s.metrics_host == "0.0.0.0"  # the kubelet reaches it
        if role == "replica":
            # It listens before it loads: ready once it serves a version.
            assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
            assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"


@EACH_OVERLAY
def test_shards_are_sized_for_their_row_cap_from_the_measured_figures(overlay: str) -> None:
    """Memory: the row cap at the default linear table's peak bytes a row
    (bench_index: a new model's table, a mixture of FTRL learners), plus a
    process of the library (bench_lifecycle: peak RSS less its table),
    under the request; while restoring, the loaded arrays (that table's raw
    bytes a row, bench_export) too, under the limit. The startup probe
    waits at least three times the restore at the slower of the measured
    rates (docs/measurements.md's, and bench_export's of the default table)."""
    docs = _k8s(overlay)
    shards = next(d for d in docs if d["kind"] == "StatefulSet")
    [c] = shards["spec"]["template"]["spec"]["containers"]
    shard = _settings(_shard_argv(c["args"][0], 0), _env(docs, c))
    max_rows = shard.max_rows
    assert max_rows > 0, "the shards' memory is sized from a row cap"
    # The model the overlay's workers create holds the default linear table
    # alone: the figures are that table's.
    [wc] = _pods(overlay)["worker"]["containers"]
    worker = _settings(list(wc["args"]), _env(docs, wc))
    model = make_model(worker.model, worker.model_name)
    measured = (_result("bench_index")["default_table_optimizer"], _result("bench_index")["default_table_dim"])
    assert measured[0] == DEFAULT_LINEAR_OPTIMIZER["name"] == _result("bench_export")["default_lr_optimizer"]
    assert [(t.optimizer["name"], t.dim) for t in model.tables()] == [measured]
    per_row = _measured("bench_index", "default_table_peak_traced_bytes_per_feature")
    process = _measured("bench_lifecycle", "none_peak_rss_mb") * 2**20 - _measured(
        "bench_lifecycle", "none_table_bytes"
    )
    steady = max_rows * per_row + process
    restoring = steady + max_rows * _measured("bench_export", "default_lr_raw_bytes_per_row")
    assert steady <= _quantity(c["resources"]["requests"]["memory"]) < 2 * steady
    assert restoring <= _quantity(c["resources"]["limits"]["memory"])
    startup = c["startupProbe"]
    waits_s = startup["failureThreshold"] * startup["periodSeconds"]
    rate = min(RESTORE_ROWS_PER_S, _measured("bench_export", "default_lr_restore_rows_per_s"))
    assert waits_s >= 3 * max_rows / rate, (overlay, waits_s)
    assert startup["httpGet"]["path"] == "/healthz"


def test_replicas_are_sized_for_the_whole_model_from_the_measured_figures() -> None:
    """A serving replica holds the whole model: every shard's row cap
    (CTRPS_MAX_ROWS × the shards) at the bytes a row a replica following the
    default LR model holds (bench_follow: RSS over the process's base, the
    most of any version) plus that base, under the request (by less than
    twice); at its peak (a new base loaded beside the served one) under the
    limit. It listens before it loads: the rollout waits for it to be ready
    at least three times the load at the measured rate."""
    docs = _k8s("production")
    workloads = _workloads("production")
    [c] = workloads["shard"]["spec"]["template"]["spec"]["containers"]
    shard = _settings(_shard_argv(c["args"][0], 0), _env(docs, c))
    rows = shard.max_rows * shard.num_shards
    assert shard.max_rows > 0 and shard.num_shards == workloads["shard"]["spec"]["replicas"]
    # The figures are those of the model the workers create: the default
    # linear table alone, as the replica measured follows it.
    [wc] = _pods("production")["worker"]["containers"]
    worker = _settings(list(wc["args"]), _env(docs, wc))
    model = make_model(worker.model, worker.model_name)
    assert [t.optimizer["name"] for t in model.tables()] == [_result("bench_follow")["memory_optimizer"]]
    assert _result("bench_follow")["memory_optimizer"] == DEFAULT_LINEAR_OPTIMIZER["name"]
    replica = workloads["replica"]
    [rc] = replica["spec"]["template"]["spec"]["containers"]
    process = _measured("bench_follow", "replica_process_base_mb") * 2**20
    steady = rows * _measured("bench_follow", "replica_bytes_per_row") + process
    peak = rows * _measured("bench_follow", "replica_peak_bytes_per_row") + process
    assert steady <= _quantity(rc["resources"]["requests"]["memory"]) < 2 * steady
    assert peak <= _quantity(rc["resources"]["limits"]["memory"])
    load_s = rows / _measured("bench_follow", "replica_base_load_rows_per_s")
    assert replica["spec"]["progressDeadlineSeconds"] >= 3 * load_s
    # A rollout starts a new replica, and stops an old one once it is ready.
    assert replica["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@EACH_OVERLAY
def test_disruption_budgets_and_shard_anti_affinity(overlay: str) -> None:
    docs = _k8s(overlay)
    budgets = [d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"]
    workloads = _workloads(overlay)

    def budgets_of(role: str) -> list[dict[str, Any]]:
        labels = workloads[role]["spec"]["template"]["metadata"]["labels"]
        return [b for b in budgets if b["selector"]["matchLabels"].items() <= labels.items()]

    [shard_budget] = budgets_of("shard")
    assert shard_budget["maxUnavailable"] == 1 and "minAvailable" not in shard_budget
    # An API with one replica and minAvailable 1 would block every drain.
    api_budgets = budgets_of("api")
    if workloads["api"]["spec"]["replicas"] > 1:
        assert [b.get("minAvailable") for b in api_budgets] == [1]
    else:
        assert not api_budgets
    # The same rule for the serving replicas (production).
    assert ("replica" in workloads) == (overlay == "production")
    if "replica" in workloads:
        replica_budgets = budgets_of("replica")
        if workloads["replica"]["spec"]["replicas"] > 1:
            assert [b.get("minAvailable") for b in replica_budgets] == [1]
        else:
            assert not replica_budgets
    shard_pod = workloads["shard"]["spec"]["template"]
    anti = shard_pod["spec"]["affinity"]["podAntiAffinity"]
    if overlay == "production":
        [term] = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        assert "preferredDuringSchedulingIgnoredDuringExecution" not in anti
    else:
        [preferred] = anti["preferredDuringSchedulingIgnoredDuringExecution"]
        term = preferred["podAffinityTerm"]
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= shard_pod["metadata"]["labels"].items()


def _topics(argv: list[str]) -> dict[str, int]:
    """The NAME:PARTITIONS a ``ctrps topics create`` or ``ctrps broker`` line asks for."""
    from app.commands.topics import parse_topics

    args = build_parser().parse_args(argv)
    assert args.command in ("topics", "broker"), argv
    return parse_topics(args.topic)


@EACH_OVERLAY
def test_the_topics_job_creates_what_the_workers_read_with_a_partition_each(overlay: str) -> None:
    docs = _k8s(overlay)
    workloads = _workloads(overlay)
    worker = workloads["worker"]
    [wc] = worker["spec"]["template"]["spec"]["containers"]
    s = _settings(list(wc["args"]), _env(docs, wc))
    assert isinstance(s, WorkerSettings)
    job = workloads["topics"]["spec"]["template"]["spec"]
    [jc] = job["containers"]
    topics = _topics(list(jc["args"]))
    assert set(topics) == {s.topic, s.dlq}
    assert topics[s.topic] >= worker["spec"]["replicas"], "a worker without a partition idles"
    # The Job reaches the Kafka the workers read, with the same settings.
    assert jc["envFrom"] == wc["envFrom"]
    if overlay == "one-machine":  # the broker creates the same topics as it starts
        [bc] = workloads["broker"]["spec"]["template"]["spec"]["containers"]
        assert _topics(list(bc["args"])) == topics
        args = build_parser().parse_args(bc["args"])
        bootstrap = _env(docs, wc)["CTRPS_KAFKA_BOOTSTRAP"]
        assert bootstrap == f"{args.advertised_host}:{args.port}"
        service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == args.advertised_host)
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    # The compose file's topics service asks the same of its workers.
    compose = _compose()["services"]
    compose_topics = _topics(list(compose["topics"]["command"]))
    assert set(compose_topics) == {s.topic, s.dlq}
    assert compose_topics[s.topic] >= compose["worker"]["deploy"]["replicas"]


def test_production_takes_kafka_from_the_operators_configmap() -> None:
    """No broker address in the base or the production overlay: the workers
    and the Job read it from ConfigMap ctrps-kafka, which the operator
    creates (not optional: without it the pods do not start)."""
    for path in (DEPLOY / "k8s" / "base").rglob("*.yaml"):
        assert not re.search(r"^\s*CTRPS_KAFKA_BOOTSTRAP\s*:", path.read_text(), flags=re.M), path
    docs = _k8s("production")
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ctrps-kafka")]
    assert "CTRPS_KAFKA_BOOTSTRAP" not in _rendered("overlays/production")
    for role in ("worker", "topics"):
        [c] = _pods("production")[role]["containers"]
        assert {"configMapRef": {"name": "ctrps-kafka"}} in c["envFrom"], role


BUCKET_CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def _shard_exports(docs: list[dict[str, Any]]) -> str:
    """Where the rendered shards write and restore their exports (pod 0's settings)."""
    [c] = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"]
    exports: str = _settings(_shard_argv(c["args"][0], 0), _env(docs, c)).exports_dir
    return exports


def test_the_base_names_no_exports_location() -> None:
    """Neither a volume nor a location in the base: a component gives both."""
    base = _k8s("", path="base")
    assert not [d for d in base if d["kind"] in ("PersistentVolumeClaim", "ServiceAccount")]
    pod = next(d for d in base if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    assert "exports" not in {v["name"] for v in pod["volumes"]}
    [c] = pod["containers"]
    assert "--exports-dir" not in _shard_argv(c["args"][0], 0)
    assert all("CTRPS_EXPORTS_DIR" not in d.get("data", {}) for d in base if d["kind"] == "ConfigMap")
    assert "serviceAccountName" not in pod


def test_one_machine_exports_to_its_claim() -> None:
    """The exports-volume component: the shards' CTRPS_EXPORTS_DIR is where
    its ReadWriteMany claim is mounted, in the shards only."""
    docs = _k8s("one-machine")
    shards = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    [c] = shards["containers"]
    claim = {v["name"]: v for v in shards["volumes"]}["exports"]["persistentVolumeClaim"]["claimName"]
    [pvc] = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts["exports"] == _shard_exports(docs) == "/exports"
    for role, pod in _pods("one-machine").items():
        assert ("exports" in {v["name"] for v in pod.get("volumes", [])}) == (role == "shard"), role
        [rc] = pod["containers"]
        assert ("CTRPS_EXPORTS_DIR" in _env(docs, rc)) == (role == "shard"), role


def test_production_exports_to_the_operators_bucket_without_a_shared_volume() -> None:
    """The exports-bucket component: no claim and no ReadWriteMany anywhere;
    the shards' exports location is the s3:// URL of the operator's
    ConfigMap ctrps-bucket (not rendered: nothing here names a bucket), with
    its region, given to the shards only; egress to the bucket is open."""
    docs = _k8s("production")
    rendered = _rendered("overlays/production")
    assert not [d for d in docs if d["kind"] in ("PersistentVolumeClaim", "PersistentVolume")]
    assert "ReadWriteMany" not in rendered and "persistentVolumeClaim" not in rendered
    assert not [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("ctrps-bucket")]
    assert "s3://" not in rendered
    exports = _shard_exports(docs)
    assert exports.startswith("s3://") and exports == OPERATOR_CONFIGMAPS["ctrps-bucket"]["CTRPS_EXPORTS_DIR"]
    # Required, as Kafka's: a shard without it would export to its container's disk.
    [shard] = _pods("production")["shard"]["containers"]
    assert {"configMapRef": {"name": "ctrps-bucket"}} in shard["envFrom"]
    # The serving replicas read the same bucket (and require it too).
    [replica] = _pods("production")["replica"]["containers"]
    assert {"configMapRef": {"name": "ctrps-bucket"}} in replica["envFrom"]
    readers = {"shard", "replica"}
    for role, pod in _pods("production").items():
        [c] = pod["containers"]
        assert ("exports" in {v["name"] for v in pod.get("volumes", [])}) is False, role
        env = _env(docs, c)
        assert ("CTRPS_EXPORTS_DIR" in env and "AWS_REGION" in env) == (role in readers), role
    # Workload identity: the shards and the replicas each run as their own
    # ServiceAccount (the one a role is given to: the replicas' may only
    # read), which mounts no API token; no other pod names one.
    accounts = {d["metadata"]["labels"][COMPONENT]: d for d in docs if d["kind"] == "ServiceAccount"}
    assert set(accounts) == readers
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())
    for role, pod in _pods("production").items():
        expected = accounts[role]["metadata"]["name"] if role in readers else None
        assert pod.get("serviceAccountName") == expected, role
    assert len({a["metadata"]["name"] for a in accounts.values()}) == len(accounts)
    # No policy restricts egress: the shards reach the bucket's endpoint.
    assert all("Egress" not in d["spec"]["policyTypes"] for d in docs if d["kind"] == "NetworkPolicy")
