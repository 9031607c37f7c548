"""Who gets which credential: `ctrps cluster`'s children, and the API's
refusal to listen beyond loopback with its admin routes open.

The cluster's real children are checked in tests/test_cluster.py (their
/proc/<pid>/environ while it trains); here the function that builds each
child's environment, the given-secret path, and the API's start-up check
(`ctrps serve`, `ctrps demo`, `ApiServer`), none of which listens.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.api import ApiServer
from app.child_credentials import CREDENTIAL_VARIABLES, ChildCredentials
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.demo import DemoSettings
from app.config.serve import ApiSettings
from app.demo import api_settings_of
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.auth import MIN_SECRET_BYTES, Scope, TokenVerifier, derive_token
from ps_core.net.client import PSClient
from ps_core.shard import Shard

PROJECT = Path(__file__).resolve().parent.parent
SECRET = "s" * 43
ADMIN = "admin-token-for-people"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


# -- ctrps cluster: each child's environment -------------------------------------------


def test_each_child_gets_only_the_credentials_its_role_uses() -> None:
    creds = ChildCredentials(secret=SECRET, admin_token=ADMIN, generated=False)
    # Every credential this process holds is a decoy a child must not inherit.
    base = {name: f"inherited-{name}" for name in CREDENTIAL_VARIABLES}
    base |= {"PATH": "/bin", "CTRPS_LOG_LEVEL": "debug"}
    verifier = TokenVerifier(SECRET)
    envs = {kind: creds.env_for(kind, base) for kind in ("broker", "shard", "api", "worker", "producer")}
    for kind, env in envs.items():
        assert env["PATH"] == "/bin" and env["CTRPS_LOG_LEVEL"] == "debug", kind
        assert not any(v.startswith("inherited-") for v in env.values()), kind
    added = {kind: {k: v for k, v in env.items() if k in CREDENTIAL_VARIABLES} for kind, env in envs.items()}
    assert added["shard"] == {"CTRPS_CLUSTER_SECRET": SECRET}
    assert added["worker"] == {"CTRPS_SHARD_TOKEN": derive_token(SECRET, Scope.TRAIN)}
    assert verifier.scope_of(added["worker"]["CTRPS_SHARD_TOKEN"]) is Scope.TRAIN
    assert added["api"] == {"CTRPS_SHARD_TOKEN": derive_token(SECRET, Scope.ADMIN), "CTRPS_ADMIN_TOKEN": ADMIN}
    assert added["broker"] == added["producer"] == {}
    # Without an admin token of its own the API gets none (on loopback its admin routes are open).
    assert "CTRPS_ADMIN_TOKEN" not in ChildCredentials(secret=SECRET).env_for("api", base)
    with pytest.raises(ValueError, match="no child of kind 'exporter'"):
        creds.env_for("exporter", base)


def test_the_cluster_secret_is_made_per_run_unless_given(tmp_path: Path) -> None:
    made = [ChildCredentials.from_env({}) for _ in range(2)]
    assert all(c.generated and len(c.secret) >= MIN_SECRET_BYTES for c in made)
    assert made[0].secret != made[1].secret
    assert made[0].admin_token == ""
    assert SECRET not in repr(ChildCredentials(secret=SECRET, admin_token=ADMIN))
    given = ChildCredentials.from_env({"CTRPS_CLUSTER_SECRET": SECRET, "CTRPS_ADMIN_TOKEN": ADMIN})
    assert (given.secret, given.admin_token, given.generated) == (SECRET, ADMIN, False)
    (tmp_path / "secret").write_text(SECRET + "\n")
    (tmp_path / "admin").write_text(ADMIN + "\n")
    from_files = ChildCredentials.from_env(
        {"CTRPS_CLUSTER_SECRET_FILE": str(tmp_path / "secret"), "CTRPS_ADMIN_TOKEN_FILE": str(tmp_path / "admin")}
    )
    assert (from_files.secret, from_files.admin_token, from_files.generated) == (SECRET, ADMIN, False)
    with pytest.raises(SettingsError, match="at least 16 bytes"):
        ChildCredentials.from_env({"CTRPS_CLUSTER_SECRET": "short"})
    with pytest.raises(SettingsError, match="CTRPS_CLUSTER_SECRET_FILE=.* cannot be read"):
        ChildCredentials.from_env({"CTRPS_CLUSTER_SECRET_FILE": str(tmp_path / "missing")})


@pytest.mark.process
@pytest.mark.kafka
def test_a_cluster_with_a_short_secret_exits_2_in_one_line_before_starting_anything() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "cluster", "--port", "0", "--no-exports"],
        cwd=PROJECT, env=clean_env(CTRPS_CLUSTER_SECRET="short"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    [line] = out.stderr.strip().splitlines()  # one line, nothing started
    assert " error ctrps cluster: the cluster secret must be at least 16 bytes error=SettingsError" in line


# -- the API: no open admin routes beyond loopback -----------------------------------------


def serve_settings(*flags: str, env: dict[str, str] | None = None) -> ApiSettings:
    args = build_parser().parse_args(["serve", "--shards", "http://127.0.0.1:1", *flags])
    return ApiSettings.from_args(args, env=env or {})


def test_the_api_refuses_a_non_loopback_host_without_an_admin_token(tmp_path: Path) -> None:
    exposed = serve_settings("--host", "0.0.0.0")
    with pytest.raises(
        SettingsError,
        match=r"^the API would listen on 0\.0\.0\.0 with no credentials: set CTRPS_ADMIN_TOKEN \(or _FILE\), or pass --insecure$",
    ):
        exposed.check_exposed()
    serve_settings("--host", "127.0.0.1").check_exposed()  # loopback: open admin routes are the user's own
    serve_settings("--host", "::1").check_exposed()
    serve_settings("--host", "0.0.0.0", env={"CTRPS_ADMIN_TOKEN": ADMIN}).check_exposed()
    (tmp_path / "admin").write_text(ADMIN)
    from_file = serve_settings("--host", "10.1.2.3", env={"CTRPS_ADMIN_TOKEN_FILE": str(tmp_path / "admin")})
    assert from_file.admin_token == ADMIN
    from_file.check_exposed()
    insecure = serve_settings("--host", "0.0.0.0", env={"CTRPS_INSECURE": "1"})
    assert insecure.insecure and not insecure.admin_token
    insecure.check_exposed()
    assert not serve_settings(env={"CTRPS_INSECURE": "0"}).insecure


async def test_api_server_start_refuses_before_it_binds() -> None:
    async with PSClient.local([Shard()]) as client:
        server = ApiServer(
            ApiSettings(host="0.0.0.0", port=0), client, make_model("lr"), control=ControlClient.local([Shard()])
        )
        with pytest.raises(SettingsError, match="would listen on 0.0.0.0 with no credentials"):
            await server.start()
        assert server.url == "" and server._runner is None  # nothing was set up, nothing listens
        await server.stop()


@pytest.mark.parametrize("command", ["serve", "demo"])
@pytest.mark.process
def test_an_exposed_api_without_a_token_exits_2_in_one_line(command: str) -> None:
    flags = ["--shards", "http://127.0.0.1:1"] if command == "serve" else ["--no-exports"]
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", command, "--host", "0.0.0.0", "--port", "0", *flags],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stdout == ""
    [line] = out.stderr.strip().splitlines()  # one line, no traceback
    assert (
        f" error ctrps {command}: the API would listen on 0.0.0.0 with no credentials: "
        "set CTRPS_ADMIN_TOKEN (or _FILE), or pass --insecure error=SettingsError exit_code=2"
    ) in line


def test_the_demo_takes_its_admin_token_and_insecure_from_flags_and_environment(tmp_path: Path) -> None:
    def demo(*flags: str, env: dict[str, str] | None = None) -> ApiSettings:
        args = build_parser().parse_args(["demo", *flags])
        return api_settings_of(DemoSettings.from_args(args, env=env or {}))

    with pytest.raises(SettingsError, match="would listen on 0.0.0.0"):
        demo("--host", "0.0.0.0").check_exposed()
    accepted = demo("--host", "0.0.0.0", "--insecure")
    assert accepted.insecure and not accepted.admin_token
    accepted.check_exposed()
    demo("--host", "0.0.0.0", env={"CTRPS_INSECURE": "yes"}).check_exposed()
    token = demo("--host", "0.0.0.0", env={"CTRPS_ADMIN_TOKEN": ADMIN})
    assert token.admin_token == ADMIN and not token.insecure
    token.check_exposed()
    assert ADMIN not in repr(DemoSettings.from_args(build_parser().parse_args(["demo"]), {"CTRPS_ADMIN_TOKEN": ADMIN}))
    assert demo().admin_token == "" and demo().host == "127.0.0.1"
