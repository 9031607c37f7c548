"""The ``ctrps`` command line and the shard settings behind it.

Subprocess tests run ``python -m app.cli`` exactly as a user would run
``ctrps``; settings are unit-tested with explicit environment mappings.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from waiting import json_when_ok

from app.cli import build_parser
from app.commands.model import parse_optimizer
from app.config.declared import SettingsError
from app.config.shard import ShardSettings, parse_table_spec
from app.config.worker import WorkerSettings, worker_config
from consumers.broker import free_port
from consumers.worker import WorkerConfig
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.transports import TcpTransport
from ps_core.net.wire import WireFormat
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

PROJECT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without CTRPS_* variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra)
    return env


def ctrps(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT,
        env=dict(env) if env is not None else clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


# -- the command line ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
def test_shard_help_exits_0_and_shows_an_example() -> None:
    out = ctrps("shard", "--help")
    assert out.returncode == 0, out.stderr
    assert "usage: ctrps shard" in out.stdout
    assert "example:" in out.stdout
    assert "ctrps shard --port 7100 --shard-id 0 --num-shards 2" in out.stdout
    for flag in ("--port", "--shard-id", "--num-shards", "--table", "--log-format"):
        assert flag in out.stdout
    assert "CTRPS_TABLES" in out.stdout


def test_the_help_examples_are_valid_settings() -> None:
    """The table spec and the CTRPS_TABLES value shown in --help really parse."""
    args = build_parser().parse_args(
        [
            "shard",
            "--port",
            "7100",
            "--shard-id",
            "0",
            "--num-shards",
            "2",
            "--table",
            "lr,optimizer=ftrl,alpha=0.05,beta=1,l1=1,l2=1",
        ]
    )
    s = ShardSettings.from_args(args, env={})
    assert s.tables == (TableConfig("lr", optimizer={"name": "ftrl"}),)  # the defaults, spelt out
    env = ShardSettings.from_env({"CTRPS_TABLES": "lr,optimizer=ftrl;fm_v,dim=8,optimizer=adagrad"})
    assert [(t.name, t.dim, t.optimizer["name"]) for t in env.tables] == [
        ("lr", 1, "ftrl"),
        ("fm_v", 8, "adagrad"),
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--shard-id", "3", "--num-shards", "2"], "ctrps shard: shard id 3 not in [0, 2)"),
        (["--table", "lr,dim=x"], "ctrps shard: table spec 'lr,dim=x': dim='x' is not a number"),
        (["--table", "lr,optimizer=adam"], "unknown optimizer 'adam'"),
        (["--table", "lr", "--table", "lr,dim=2"], "a table is declared twice"),
    ],
)
@pytest.mark.slow
@pytest.mark.process
def test_bad_settings_exit_2_with_a_clear_message(args: list[str], message: str) -> None:
    out = ctrps("shard", *args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


@pytest.mark.slow
@pytest.mark.process
def test_bad_environment_exits_2_naming_the_variable() -> None:
    out = ctrps("shard", env=clean_env(CTRPS_SHARD_PORT="seventy"))
    assert out.returncode == 2
    assert "CTRPS_SHARD_PORT='seventy' is not an integer" in out.stderr


@pytest.mark.slow
@pytest.mark.process
def test_unknown_flag_is_an_argparse_error() -> None:
    out = ctrps("shard", "--bogus")
    assert out.returncode == 2
    assert "unrecognized arguments: --bogus" in out.stderr


async def wait_healthy(
    proc: asyncio.subprocess.Process, url: str, log: Path, timeout_s: float = 20.0
) -> dict[str, Any]:
    """Poll /healthz until it answers 200, the process dies, or the deadline passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.returncode is not None:
                pytest.fail(f"shard exited with {proc.returncode}: {log.read_text()}")
            body: dict[str, Any] | None = await json_when_ok(session, url + "/healthz")
            if body is not None:
                return body
            if loop.time() > deadline:
                pytest.fail(f"shard not healthy after {timeout_s}s: {log.read_text()}")
            await asyncio.sleep(0.05)  # poll interval


@pytest.mark.slow
@pytest.mark.process
async def test_shard_subprocess_serves_logs_json_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "shard.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "shard",
            "--host", "127.0.0.1", "--port", str(port),
            "--table", "lr,optimizer=ftrl",
            "--log-format", "json", "--stats-interval", "0", "--no-exports",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        health = await wait_healthy(proc, url, log)
        rpc_port = health.pop("rpc_port")
        assert health == {"status": "ok", "shard_id": 0, "num_shards": 1}
        assert isinstance(rpc_port, int) and rpc_port not in (0, port)

        ref = SparseTable(parse_table_spec("lr,optimizer=ftrl"))
        keys = np.array([0, 5, 5, 2**64 - 1, 77], dtype=np.uint64)
        grads = np.array([4.0, -3.0, -2.5, 2.0, 0.5], dtype=np.float32)
        retry = RetryPolicy(deadline_s=5.0)
        async with PSClient.connect([url], retry=retry) as client, ControlClient.connect([url], retry=retry) as control:
            assert await client.push("lr", keys, grads) == 4
            ref.push(keys, grads)
            got = await client.pull("lr", keys)
            np.testing.assert_array_equal(got, ref.pull(keys))
            assert np.count_nonzero(got) >= 3
            stats = (await control.stats())[0]
            assert stats.tables["lr"].features == 4
            # Pulls and pushes went over the advertised RPC port.
            transport = client.transports[0]
            assert isinstance(transport, TcpTransport)
            assert transport.uses_rpc and transport.rpc_port == rpc_port

        loop = asyncio.get_running_loop()
        start = loop.time()
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), timeout=10.0)
        stop_s = loop.time() - start
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert rc == 0, log.read_text()
    assert stop_s < 5.0

    lines = [orjson.loads(line) for line in log.read_text().splitlines() if line.strip()]
    listening = [e for e in lines if e.get("msg") == "listening"]
    assert len(listening) == 1, lines
    event = listening[0]
    assert event["url"] == url and event["shard_id"] == 0 and event["num_shards"] == 1
    assert event["rpc_port"] == rpc_port
    assert event["tables"] == "lr" and event["level"] == "info"
    assert any(e.get("msg") == "stopped" for e in lines)


# -- parse_table_spec ------------------------------------------------------------------


def test_table_spec_name_only_is_a_default_ftrl_table() -> None:
    assert parse_table_spec("lr") == TableConfig("lr", dim=1, optimizer={"name": "ftrl"})


def test_table_spec_with_every_field() -> None:
    cfg = parse_table_spec("fm_v,dim=8,optimizer=adagrad,lr=0.05,init_scale=0.01,seed=7,eps=1e-6")
    assert cfg.name == "fm_v" and cfg.dim == 8
    assert cfg.init_scale == 0.01 and cfg.seed == 7
    assert cfg.optimizer == {"name": "adagrad", "lr": 0.05, "eps": 1e-6, "initial_accumulator": 0.0}


def test_table_spec_declares_a_coin_table() -> None:
    cfg = parse_table_spec("lr,optimizer=coin,wealth=2")
    assert cfg.optimizer == {"name": "coin", "wealth": 2.0, "lipschitz": 1.0, "scale": 0.125}
    assert SparseTable(cfg).width == 5  # [w0, theta, G, L, reward]
    assert parse_optimizer("coin,lipschitz=0.5") == {"name": "coin", "lipschitz": 0.5}
    with pytest.raises(ValueError, match="one of sgd, adagrad, ftrl, coin"):
        parse_optimizer("wealth=2")


def test_table_spec_declares_a_mixture_table() -> None:
    cfg = parse_table_spec("lr,dim=4,optimizer=ftrl_mix,alpha_1=0.1,alpha_2=0.3,l1_2=2,cap=8")
    assert cfg.optimizer == {
        "name": "ftrl_mix",
        **{"alpha_1": 0.1, "l1_1": 0.5, "alpha_2": 0.3, "l1_2": 2.0, "beta": 0.1, "l2": 1.0, "cap": 8.0},
    }
    assert SparseTable(cfg).width == 6  # [z, n, m] per learner
    got = parse_optimizer("ftrl_mix,alpha_1=0.1,l1_1=2,alpha_2=0.4")
    assert got == {"name": "ftrl_mix", "alpha_1": 0.1, "l1_1": 2.0, "alpha_2": 0.4}
    assert make_model("lr", "ctr", optimizer=got).tables()[0].dim == 4  # the model sizes its table: 2K
    with pytest.raises(ValueError, match="one of sgd, adagrad, ftrl, coin, ftrl_mix"):
        parse_optimizer("alpha_1=0.1")


def test_table_spec_tolerates_spaces_and_empty_parts() -> None:
    assert parse_table_spec(" lr , dim=2 ,, optimizer=sgd ,") == TableConfig("lr", dim=2, optimizer={"name": "sgd"})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "must start with the table name"),
        ("dim=2,lr", "must start with the table name"),
        ("lr,dim", "'dim' is not key=value"),
        ("lr,dim=two", "dim='two' is not a number"),
        ("lr,dim=1.5", "dim='1.5' is not a number"),
        ("lr,seed=x", "seed='x' is not a number"),
        ("lr,init_scale=big", "init_scale='big' is not a number"),
        ("lr,alpha=fast", "alpha='fast' is not a number"),
        ("lr,dim=0", "dim must be an integer in [1, 4096]"),
        ("lr,init_scale=-1", "init_scale must be in [0, 1000]"),
        ("lr,optimizer=adam", "unknown optimizer 'adam'"),
        ("lr,optimizer=sgd,momentum=0.9", "bad sgd hyperparameters"),
        ("lr,optimizer=ftrl,alpha=0", "ftrl needs alpha >= 1e-12"),
        ("lr,optimizer=coin,wealth=-1", "coin needs wealth, lipschitz, scale >= 1e-12"),
        ("lr,optimizer=coin,alpha=0.1", "bad coin hyperparameters"),
        ("lr,optimizer=ftrl_mix", "a mixture of 5 learners has 10 weights a row, not 1"),
        ("lr,dim=4,optimizer=ftrl_mix,alpha_1=0.1,alpha_2=0.2,alpha_3=0.3", "a mixture of 3 learners has 6"),
        ("lr,dim=10,optimizer=ftrl_mix,l1_2=1", "ftrl_mix: l1_2 without its alpha_i"),
        ("lr,dim=4,optimizer=ftrl_mix,alpha_1=0.1,alpha_3=1", "numbered 1..K without gaps, got alpha_[1, 3]"),
        ("lr,dim=2,optimizer=ftrl_mix,alpha_1=0.1,lr=1", "ftrl_mix has no hyperparameter lr"),
        ("lr,dim=14,optimizer=ftrl_mix," + ",".join(f"alpha_{i}=1" for i in range(1, 8)), "no hyperparameter alpha_7"),
        ("bad name", "bad table name"),
    ],
)
def test_bad_table_spec_raises_settings_error(spec: str, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_table_spec(spec)
    assert message in str(info.value)
    assert repr(spec) in str(info.value)


@pytest.mark.parametrize(
    "spec", ["lr,optimizer=ftrl,alpha=nan", "lr,optimizer=sgd,lr=nan", "lr,optimizer=adagrad,lr=inf"]
)
def test_non_finite_hyperparameters_are_rejected(spec: str) -> None:
    with pytest.raises(SettingsError):
        parse_table_spec(spec)


# -- ShardSettings -----------------------------------------------------------------------


def shard_args(*flags: str) -> Any:
    return build_parser().parse_args(["shard", *flags])


FULL_ENV = {
    "CTRPS_SHARD_HOST": "0.0.0.0",
    "CTRPS_SHARD_PORT": "7200",
    "CTRPS_SHARD_ID": "1",
    "CTRPS_NUM_SHARDS": "4",
    "CTRPS_TABLES": "lr;emb,dim=4,optimizer=adagrad",
    "CTRPS_MAX_BODY_MB": "64",
    "CTRPS_STATS_INTERVAL": "2.5",
    "CTRPS_LOG_FORMAT": "json",
    "CTRPS_RPC_PORT": "7201",
}


def test_from_env_without_variables_is_the_defaults() -> None:
    s = ShardSettings.from_env({})
    assert s == ShardSettings()
    assert (s.host, s.port, s.shard_id, s.num_shards) == ("127.0.0.1", 7100, 0, 1)
    assert (s.tables, s.max_body_mb, s.stats_interval_s, s.log_format) == ((), 512, 60.0, "text")


def test_from_env_overrides_every_default() -> None:
    s = ShardSettings.from_env(FULL_ENV)
    assert s == ShardSettings(
        host="0.0.0.0",
        port=7200,
        shard_id=1,
        num_shards=4,
        tables=(TableConfig("lr"), TableConfig("emb", dim=4, optimizer={"name": "adagrad"})),
        max_body_mb=64,
        stats_interval_s=2.5,
        log_format="json",
        rpc_port=7201,
    )


def test_empty_numeric_variables_mean_the_default() -> None:
    env = {"CTRPS_SHARD_PORT": "", "CTRPS_NUM_SHARDS": "", "CTRPS_STATS_INTERVAL": "", "CTRPS_TABLES": ""}
    assert ShardSettings.from_env(env) == ShardSettings()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CTRPS_SHARD_PORT": "http"}, "CTRPS_SHARD_PORT='http' is not an integer"),
        ({"CTRPS_SHARD_PORT": "-1"}, "port -1 out of range"),
        ({"CTRPS_SHARD_ID": "1.0"}, "CTRPS_SHARD_ID='1.0' is not an integer"),
        ({"CTRPS_SHARD_ID": "2", "CTRPS_NUM_SHARDS": "2"}, "shard id 2 not in [0, 2)"),
        ({"CTRPS_NUM_SHARDS": "0"}, "shard id 0 not in [0, 0)"),
        ({"CTRPS_MAX_BODY_MB": "0"}, "max body must be at least 1 MiB"),
        ({"CTRPS_STATS_INTERVAL": "often"}, "CTRPS_STATS_INTERVAL='often' is not a number"),
        ({"CTRPS_LOG_FORMAT": "xml"}, "log format is text or json"),
        ({"CTRPS_RPC_PORT": "70000"}, "rpc port 70000 out of range"),
        ({"CTRPS_RPC": "maybe"}, "CTRPS_RPC='maybe'"),
        ({"CTRPS_TABLES": "lr;lr,dim=2"}, "a table is declared twice"),
        ({"CTRPS_TABLES": "lr,dim=zero"}, "dim='zero' is not a number"),
    ],
)
def test_from_env_bad_values_raise_settings_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        ShardSettings.from_env(env)
    assert message in str(info.value)


def test_from_args_without_flags_follows_env() -> None:
    assert ShardSettings.from_args(shard_args(), env=FULL_ENV) == ShardSettings.from_env(FULL_ENV)
    assert ShardSettings.from_args(shard_args(), env={}) == ShardSettings()


def test_flags_override_env() -> None:
    args = shard_args(
        "--host", "127.0.0.2", "--port", "0", "--shard-id", "3", "--num-shards", "5",
        "--table", "only,dim=2", "--max-body-mb", "8", "--stats-interval", "0",
        "--log-format", "text", "--rpc-port", "0",
    )  # fmt: skip
    s = ShardSettings.from_args(args, env=FULL_ENV)
    assert s == ShardSettings(
        host="127.0.0.2",
        port=0,
        shard_id=3,
        num_shards=5,
        tables=(TableConfig("only", dim=2),),
        max_body_mb=8,
        stats_interval_s=0.0,
        log_format="text",
        rpc_port=0,
    )
    assert ShardSettings.from_args(shard_args("--no-rpc"), env=FULL_ENV).rpc is False
    assert ShardSettings.from_env({"CTRPS_RPC": "0"}).rpc is False


def test_some_flags_combine_with_the_rest_of_env() -> None:
    s = ShardSettings.from_args(shard_args("--shard-id", "3"), env=FULL_ENV)
    assert s.shard_id == 3 and s.num_shards == 4 and s.port == 7200
    assert [t.name for t in s.tables] == ["lr", "emb"]


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (["--shard-id", "3", "--num-shards", "2"], {}, "shard id 3 not in [0, 2)"),
        (["--shard-id", "3"], {"CTRPS_NUM_SHARDS": "2"}, "shard id 3 not in [0, 2)"),
        (["--table", "lr,optimizer=adam"], {}, "unknown optimizer"),
        (["--log-format", "json"], {"CTRPS_SHARD_PORT": "x"}, "CTRPS_SHARD_PORT='x'"),
    ],
)
def test_from_args_bad_values_raise_settings_error(flags: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        ShardSettings.from_args(shard_args(*flags), env=env)
    assert message in str(info.value)


def test_empty_host_and_log_format_variables_mean_the_default() -> None:
    s = ShardSettings.from_env({"CTRPS_SHARD_HOST": "", "CTRPS_LOG_FORMAT": ""})
    assert s.host == "127.0.0.1" and s.log_format == "text"


@pytest.mark.slow
@pytest.mark.process
async def test_shard_on_port_0_logs_the_port_it_got(tmp_path: Path) -> None:
    log = tmp_path / "shard.log"
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "shard", "--port", "0",
            "--shard-id", "1", "--num-shards", "2", "--log-format", "json", "--no-exports",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0
        url = ""
        while not url:
            for line in log.read_text().splitlines():
                event = orjson.loads(line)
                if event.get("msg") == "listening":
                    url, rpc_port = event["url"], event["rpc_port"]
            if not url:
                assert proc.returncode is None, log.read_text()
                assert loop.time() < deadline, f"no listening line: {log.read_text()}"
                await asyncio.sleep(0.05)  # poll interval
        assert not url.endswith(":0")
        health = await wait_healthy(proc, url, log)
        assert health == {"status": "ok", "shard_id": 1, "num_shards": 2, "rpc_port": rpc_port}
        assert isinstance(rpc_port, int) and rpc_port > 0
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=10.0) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_worker_wire_flags_and_variables_make_its_wire_format() -> None:
    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:7100"]
    default = WorkerSettings.from_args(build_parser().parse_args(base), env={})
    assert default.wire() == WireFormat(key_sets=True, compact_counts=True)  # the lossless two, format 2
    args = build_parser().parse_args([*base, "--wire-push", "int8", "--no-key-sets", "--wire-rounding", "feedback"])
    s = WorkerSettings.from_args(args, env={"CTRPS_WIRE_PULL": "f16", "CTRPS_COMPACT_COUNTS": "0"})
    assert s.wire() == WireFormat(push="int8", pull="f16", key_sets=False, compact_counts=False, rounding="feedback")
    with pytest.raises(SystemExit):  # argparse: not a choice
        build_parser().parse_args([*base, "--wire-pull", "int8"])
    with pytest.raises(SettingsError, match="wire format: push values 'f8': one of f32, f16, int8"):
        WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_WIRE_PUSH": "f8"})


def test_worker_mini_batch_ramp_flag_and_variable_reach_its_config() -> None:
    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:7100"]
    assert worker_config(WorkerSettings.from_args(build_parser().parse_args(base), env={})).mini_batch_ramp == 64
    flag = WorkerSettings.from_args(build_parser().parse_args([*base, "--mini-batch-ramp", "0"]), env={})
    assert worker_config(flag).mini_batch_ramp == 0
    env = WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_MINI_BATCH_RAMP": "16"})
    assert worker_config(env).mini_batch_ramp == 16
    with pytest.raises(SettingsError, match="mini-batch ramp must be >= 0"):
        WorkerSettings.from_args(build_parser().parse_args([*base, "--mini-batch-ramp", "-1"]), env={})
    with pytest.raises(ValueError, match="mini_batch_ramp must be >= 0"):
        WorkerConfig("k:9092", mini_batch_ramp=-1)


def test_worker_in_flight_flag_and_variable_reach_its_config() -> None:
    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:7100"]
    assert worker_config(WorkerSettings.from_args(build_parser().parse_args(base), env={})).in_flight == 1
    flag = WorkerSettings.from_args(build_parser().parse_args([*base, "--in-flight", "8"]), env={})
    assert worker_config(flag).in_flight == 8
    env = WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_IN_FLIGHT": "4"})
    assert worker_config(env).in_flight == 4
    for bad in ("0", "1025"):
        with pytest.raises(SettingsError, match=f"in-flight must be in \\[1, 1024\\], not {bad}"):
            WorkerSettings.from_args(build_parser().parse_args([*base, "--in-flight", bad]), env={})
    with pytest.raises(ValueError, match="in_flight must be >= 1"):
        WorkerConfig("k:9092", in_flight=0)


def test_shard_serving_precision_flag() -> None:
    assert ShardSettings.from_args(shard_args("--serving-precision", "int8"), env={}).serving_precision == "int8"
    assert ShardSettings.from_args(shard_args(), env={"CTRPS_SERVING_PRECISION": "f16"}).serving_precision == "f16"
    with pytest.raises(SettingsError, match="serving precision 'f8' is not one of f32, f16, int8"):
        ShardSettings.from_args(shard_args(), env={"CTRPS_SERVING_PRECISION": "f8"})


@pytest.mark.slow
@pytest.mark.process
def test_ctrps_alone_prints_its_help_and_version_prints_the_version() -> None:
    out = ctrps()
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("usage: ctrps") and "shard" in out.stdout and "example:" in out.stdout
    version = ctrps("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"ctrps {importlib.metadata.version('ctrps')}"


def test_numeric_feeds_read_from_flags_and_variables_or_fail_in_one_line() -> None:
    base = ["worker", "--bootstrap", "k:9092", "--shards", "http://127.0.0.1:7100"]
    assert WorkerSettings.from_args(build_parser().parse_args(base), env={}).numeric == "log1p/16"
    flag = WorkerSettings.from_args(build_parser().parse_args([*base, "--numeric", "raw/2.5"]), env={})
    assert flag.numeric == "raw/2.5"
    assert WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_NUMERIC": "log1p"}).numeric == "log1p"
    with pytest.raises(SettingsError, match="CTRPS_NUMERIC='log1p/0' is not valid"):
        WorkerSettings.from_args(build_parser().parse_args(base), env={"CTRPS_NUMERIC": "log1p/0"})
    for argv in ([*base, "--numeric", "sqrt"], ["model", "create", "m", "--numeric", "log1p/-1"]):
        with pytest.raises(SystemExit):  # argparse's usage error
            build_parser().parse_args(argv)
    assert build_parser().parse_args(["model", "create", "m", "--numeric", "log1p/16"]).numeric == "log1p/16"
