"""A wrong address, a wrong shard list or a bad flag is found at start: one
error line, a documented exit code, and soon.

One-shot commands fail within a few seconds when nothing answers at their
address; long-running roles wait their start-up deadline
(``--startup-timeout``), saying what they wait for, then exit 1. Every
command runs as a user runs ``ctrps`` (a child process).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from commands import PROJECT, clean_env
from waiting import until

from consumers.broker import free_port
from ps_core.net.server import ShardSite, create_shard_app, start_shard_site
from ps_core.shard import Shard, ShardSpec

pytestmark = pytest.mark.slow  # real processes for seconds each: make test-fast leaves them out

ONE_SHOT_S = 10.0
"""A one-shot command with a wrong address fails within this (process start included)."""


def run(*args: str, timeout_s: float = 60.0) -> tuple[subprocess.CompletedProcess[str], float]:
    """``ctrps ARGS`` to its end, and its wall time in seconds."""
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    return out, time.monotonic() - started


def only_line(out: subprocess.CompletedProcess[str], code: int) -> dict[str, Any]:
    """The process exited with `code`, its stderr one JSON line at level error: that line."""
    lines = out.stderr.splitlines()
    assert out.returncode == code and len(lines) == 1, (out.returncode, out.stderr)
    line: dict[str, Any] = orjson.loads(lines[0])
    assert line["level"] == "error" and line["exit_code"] == code, line
    return line


def one_error_among(out: subprocess.CompletedProcess[str], code: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The process exited with `code`, no traceback, exactly one error line
    among its JSON lines: that line, and all of them."""
    assert out.returncode == code, out.stderr
    lines = [orjson.loads(x) for x in out.stderr.splitlines()]
    errors = [x for x in lines if x["level"] in ("error", "critical")]
    assert len(errors) == 1 and "exc" not in errors[0], out.stderr
    return errors[0], lines


def nothing_there() -> str:
    return f"127.0.0.1:{free_port()}"


async def shard_site(shard_id: int, num_shards: int, port: int = 0) -> tuple[ShardSite, str]:
    """Shard `shard_id` of `num_shards` served on loopback, and its URL."""
    site = await start_shard_site(create_shard_app(Shard(ShardSpec(shard_id, num_shards))), "127.0.0.1", port)
    return site, f"http://127.0.0.1:{site.port}"


# -- one-shot commands: a wrong address fails within seconds --------------------------


@pytest.mark.parametrize(
    "command",
    [
        ["export"],
        ["export", "--list"],
        ["model", "list"],
        ["model", "create", "ads"],
        ["dlq"],
        ["produce", "synthetic", "--events", "10"],
    ],
)
@pytest.mark.process
def test_a_one_shot_command_at_a_wrong_address_fails_within_seconds(command: list[str]) -> None:
    address = nothing_there()
    kafka = command[0] in ("dlq", "produce")
    flag = ["--bootstrap", address] if kafka else ["--shard0", f"http://{address}"]
    out, took = run(*command, *flag, "--log-format", "json")
    line = only_line(out, 1)
    assert address in line["msg"] and took < ONE_SHOT_S, (took, line)
    assert ("--bootstrap" if kafka else "--shard0") in line["msg"], line


@pytest.mark.process
async def test_a_one_shot_command_at_another_shard_than_shard_0_says_which_it_is() -> None:
    runner, url = await shard_site(1, 2)
    try:
        out, took = await asyncio.to_thread(run, "export", "--list", "--shard0", url, "--log-format", "json")
    finally:
        await runner.cleanup()
    line = only_line(out, 2)
    assert f"{url} is shard 1 of 2, not shard 0" in line["msg"] and took < ONE_SHOT_S, line


# -- long-running roles: a bounded start-up wait, then exit 1 ---------------------------


@pytest.mark.process
def test_a_worker_whose_shard_never_answered_exits_1_after_its_startup_timeout() -> None:
    url = f"http://{nothing_there()}"
    out, took = run(
        "worker", "--bootstrap", nothing_there(), "--shards", url, "--startup-timeout", "3", "--log-format", "json"
    )
    error, lines = one_error_among(out, 1)
    assert f"shard 0 at {url} never answered" in error["msg"] and "--startup-timeout" in error["msg"], error
    waiting = [x for x in lines if x["level"] == "warning" and url in x["msg"]]
    assert waiting and waiting[0]["msg"].startswith(f"waiting for shard 0 at {url} to answer"), lines
    assert took < 12.0, took


@pytest.mark.process
async def test_a_worker_whose_broker_never_answered_exits_1_after_its_startup_timeout() -> None:
    runner, url = await shard_site(0, 1)
    bootstrap = nothing_there()
    try:
        out, took = await asyncio.to_thread(
            run, "worker", "--bootstrap", bootstrap, "--shards", url, "--startup-timeout", "3",
            "--log-format", "json", "--log-level", "error",
        )  # fmt: skip
    finally:
        await runner.cleanup()
    line = only_line(out, 1)
    assert f"the Kafka broker at {bootstrap} never answered" in line["msg"] and took < 12.0, (took, line)


@pytest.mark.process
async def test_serve_with_a_shard_that_never_answered_exits_1_after_its_startup_timeout() -> None:
    url = f"http://{nothing_there()}"
    out, took = await asyncio.to_thread(
        run, "serve", "--shards", url, "--port", "0", "--startup-timeout", "2", "--log-format", "json",
        "--log-level", "error",
    )  # fmt: skip
    line = only_line(out, 1)
    assert f"shard 0 at {url} never answered" in line["msg"] and took < 12.0, (took, line)


@pytest.mark.process
def test_serve_following_a_directory_that_never_appeared_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    out, took = run(
        "serve", "--follow", str(missing), "--port", "0", "--startup-timeout", "2", "--log-format", "json",
        "--log-level", "error",
    )  # fmt: skip
    line = only_line(out, 1)
    assert f"the directory {missing} does not exist" in line["msg"] and took < 12.0, (took, line)


# -- the shard list: every URL in its place --------------------------------------------


@pytest.mark.parametrize("role", ["serve", "worker"])
@pytest.mark.process
async def test_a_shard_list_out_of_order_or_short_is_refused_at_start_naming_each_shard(role: str) -> None:
    (first, a), (second, b) = [await shard_site(i, 2) for i in range(2)]
    flags = ["--port", "0"] if role == "serve" else ["--bootstrap", nothing_there()]
    try:
        swapped, took = await asyncio.to_thread(
            run, role, "--shards", f"{b},{a}", *flags, "--log-format", "json", "--log-level", "error"
        )
        short, _ = await asyncio.to_thread(
            run, role, "--shards", a, *flags, "--log-format", "json", "--log-level", "error"
        )
    finally:
        await first.cleanup()
        await second.cleanup()
    line = only_line(swapped, 2)
    assert f"{b} is shard 1 of 2, {a} is shard 0 of 2" in line["msg"] and took < ONE_SHOT_S, (took, line)
    assert "shard 0 first" in line["msg"]
    assert f"{a} is shard 0 of 2" in only_line(short, 2)["msg"]


@pytest.mark.process
async def test_readyz_is_503_naming_the_places_once_shards_come_back_in_another_order(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    runners = [(await shard_site(i, 2, p))[0] for i, p in enumerate(ports)]
    api_port = free_port()
    err = tmp_path / "serve.log"
    with err.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "serve", "--shards", ",".join(f"http://127.0.0.1:{p}" for p in ports),
            "--port", str(api_port), "--log-format", "json",
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:

            async def readyz() -> tuple[int, dict[str, Any]]:
                async with http.get(f"http://127.0.0.1:{api_port}/readyz") as resp:
                    return resp.status, await resp.json()

            async def ready() -> bool:
                assert proc.returncode is None, err.read_text()
                try:
                    return (await readyz())[0] == 200
                except aiohttp.ClientConnectionError:
                    return False

            await until(ready, 60, what="the API ready", poll_s=0.1)
            # Both shards restart, each on the other's port: shard 1 where shard 0 was.
            for r in runners:
                await r.cleanup()
            runners = [(await shard_site(1 - i, 2, p))[0] for i, p in enumerate(ports)]
            status, body = await readyz()
    finally:
        for r in runners:
            await r.cleanup()
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
    assert status == 503 and body["error"] == "wrong_shard_order", body
    assert "place 0 is shard 1 of 2, place 1 is shard 0 of 2" in body["detail"], body


# -- bad input at start: one line ----------------------------------------------------


@pytest.mark.process
def test_a_broker_port_out_of_range_is_one_line_and_exit_2() -> None:
    out, _ = run("broker", "--port", "99999", "--log-format", "json")
    assert "port 99999 out of range" in only_line(out, 2)["msg"]


@pytest.mark.process
def test_a_shard_whose_exports_directory_cannot_be_written_exits_1_at_start() -> None:
    out, took = run("shard", "--port", "0", "--exports-dir", "/proc/nope", "--log-format", "json")
    line = only_line(out, 1)
    assert "exports directory /proc/nope cannot be written" in line["msg"] and took < ONE_SHOT_S, (took, line)


@pytest.mark.process
def test_dlq_with_an_unknown_reason_lists_the_reasons() -> None:
    out, _ = run("dlq", "--bootstrap", nothing_there(), "--reason", "nosuchreason", "--log-format", "json")
    line = only_line(out, 2)
    assert "'nosuchreason'" in line["msg"] and "invalid_json" in line["msg"] and "missing_label" in line["msg"]
