"""Expected failures are one log line in the chosen format and an exit code;
bugs keep their traceback, in the chosen format too.

Subprocess tests run ``python -m app.cli`` as a user runs ``ctrps``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from waiting import until

from app.api import ApiServer
from app.cli import build_parser, run_command
from app.config.serve import ApiSettings
from app.failures import ExpectedFailure, expected_failure
from app.logs import KAFKA_LOGGERS, RepeatFilter, configure_logging
from consumers.broker import EmbeddedBroker, free_port
from ps_core.checkpoint.control import ControlClient
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import create_shard_app, start_shard_site
from ps_core.shard import Shard, ShardSpec

PROJECT = Path(__file__).resolve().parent.parent


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra)
    return env


def ctrps(*args: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT, env=clean_env(), capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


def one_error_line(out: subprocess.CompletedProcess[str], fmt: str) -> dict[str, Any] | str:
    """The one line of stderr (no traceback); in JSON, parsed."""
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr, out.stderr
    errors = [x for x in lines if (" error " in x if fmt == "text" else '"level":"error"' in x)]
    assert len(errors) == 1, out.stderr
    if fmt == "json":
        for line in lines:
            orjson.loads(line)  # every line is one JSON object
        parsed: dict[str, Any] = orjson.loads(errors[0])
        return parsed
    return errors[0]


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


# -- settings: exit 2, one line ---------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["worker", "--bootstrap", "127.0.0.1:9092", "--shards", "127.0.0.1:7100"],
         "shard URL '127.0.0.1:7100' is not http://host:port"),
        (["worker", "--bootstrap", "127.0.0.1:9092", "--shards", "http://127.0.0.1:x"],
         "shard URL 'http://127.0.0.1:x' is not http://host:port"),
        (["serve", "--shards", "localhost:7100", "--port", "0"],
         "shard URL 'localhost:7100' is not http://host:port"),
        (["shard", "--num-shards", "2", "--shards", "http://127.0.0.1:1,ftp://h:2", "--no-exports"],
         "shard URL 'ftp://h:2' is not http://host:port"),
        (["shard", "--port", "0", "--model-name", "../x"], "bad model name '../x'"),
        (["serve", "--shards", "http://127.0.0.1:1", "--model-name", "../x"], "bad model name '../x'"),
        (["worker", "--bootstrap", "b:1", "--shards", "http://h:1", "--model-name", "a/b"],
         "bad model name 'a/b'"),
        (["broker", "--topic", "clicks"], "topic 'clicks' is not NAME:PARTITIONS"),
    ],
)  # fmt: skip
@pytest.mark.slow
@pytest.mark.process
def test_bad_settings_are_one_line_and_exit_2(args: list[str], message: str, fmt: str) -> None:
    out = ctrps(*args, "--log-format", fmt)
    assert out.returncode == 2, out.stderr
    line = one_error_line(out, fmt)
    if fmt == "json":
        assert isinstance(line, dict)
        assert message in line["msg"] and line["exit_code"] == 2 and line["logger"] == f"ctrps {args[0]}"
    else:
        assert message in str(line) and f"ctrps {args[0]}: " in str(line)


@pytest.mark.process
def test_a_bad_log_level_is_a_usage_error() -> None:
    out = ctrps("shard", "--log-level", "loud")
    assert out.returncode == 2 and "invalid choice: 'loud'" in out.stderr
    env_out = subprocess.run(
        [sys.executable, "-m", "app.cli", "shard", "--port", "0"], cwd=PROJECT,
        env=clean_env(CTRPS_LOG_LEVEL="loud"), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert env_out.returncode == 2
    assert "log level 'loud' is not one of debug, info, warning, error" in str(one_error_line(env_out, "text"))


# -- ports in use: exit 1, one line -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.parametrize("role", ["shard", "shard-coordinator", "shard-rpc", "serve", "broker"])
@pytest.mark.process
def test_a_port_in_use_is_one_line_and_exit_1(role: str, fmt: str, listening_port: int, tmp_path: Path) -> None:
    port = str(listening_port)
    args = {
        "shard": ["shard", "--port", port, "--no-exports"],
        "shard-coordinator": [
            "shard",
            "--port",
            port,
            "--num-shards",
            "2",
            "--exports-dir",
            str(tmp_path),
            "--shards",
            "http://127.0.0.1:1,http://127.0.0.1:2",
        ],
        "shard-rpc": ["shard", "--port", "0", "--rpc-port", port, "--no-exports"],
        # A replica of an empty directory: no shard to wait for before it listens.
        "serve": ["serve", "--port", port, "--follow", str(tmp_path)],
        "broker": ["broker", "--port", port],
    }[role]
    out = ctrps(*args, "--log-format", fmt)
    assert out.returncode == 1, out.stderr
    line = one_error_line(out, fmt)
    text = line["msg"] if isinstance(line, dict) else line
    assert "cannot listen" in text and port in text and "in use" in text, text
    assert "Unclosed" not in out.stderr


@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="external broker in use")
@pytest.mark.process
@pytest.mark.kafka
async def test_the_broker_takes_a_port_in_time_wait() -> None:
    """A port whose last connection lingers in TIME_WAIT is free for a server
    (SO_REUSEADDR), and so for the broker; a plain bind() would refuse it."""
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: its end of the pair waits in TIME_WAIT
    client.recv(1)
    client.close()
    server.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))  # what the old check did
    async with EmbeddedBroker(port=port) as broker:
        assert broker.bootstrap == f"127.0.0.1:{port}"


# -- the top level: expected failures, bugs, JSON ---------------------------------------


class _Refused(ExpectedFailure):
    exit_code = 4


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def _one_json_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], exc: Exception, code: int
) -> dict[str, Any]:
    """The command `argv` raising `exc` exits with `code`, having written one JSON line: that line."""

    def run(args: argparse.Namespace) -> int:
        raise exc

    assert run_command(_args(*argv), run) == code
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return orjson.loads(lines[0])


def test_an_expected_failure_exits_with_its_code_as_one_json_line(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    refused = _Refused("refusing to resume: offsets ahead of the topic's end")
    line = _one_json_line(capsys, ("worker", "--log-format", "json"), refused, 4)
    assert line["msg"] == "refusing to resume: offsets ahead of the topic's end"
    assert line["level"] == "error" and line["exit_code"] == 4 and "exc" not in line


def test_a_bug_keeps_its_traceback_inside_one_json_object(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    line = _one_json_line(capsys, ("shard", "--log-format", "json"), KeyError("surprise"), 1)
    assert line["level"] == "critical" and "KeyError" in line["msg"]
    assert "Traceback" in line["exc"] and "surprise" in line["exc"]


def test_a_stray_cancellation_is_a_bug_in_the_chosen_format(
    capsys: pytest.CaptureFixture[str], restore_logging: None
) -> None:
    def run(args: argparse.Namespace) -> int:
        raise asyncio.CancelledError()

    assert run_command(_args("worker", "--log-format", "json"), run) == 1
    (line,) = [orjson.loads(x) for x in capsys.readouterr().err.splitlines()]
    assert "CancelledError" in line["msg"] and "Traceback" in line["exc"]


def test_a_bug_in_text_keeps_its_traceback(capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    def run(args: argparse.Namespace) -> int:
        raise ZeroDivisionError("oops")

    assert run_command(_args("shard"), run) == 1
    err = capsys.readouterr().err
    assert "ctrps shard: crashed: ZeroDivisionError: oops" in err and "Traceback" in err


def test_known_foreign_errors_are_expected_failures() -> None:
    import errno

    from aiokafka.errors import KafkaConnectionError

    from consumers.broker import BrokerError
    from ps_core.errors import ShardUnavailableError

    in_use = OSError(
        errno.EADDRINUSE, "error while attempting to bind on address ('127.0.0.1', 7): address already in use"
    )
    assert expected_failure(in_use) == (
        "cannot listen: error while attempting to bind on address ('127.0.0.1', 7): address already in use "
        "(another process listens there: pick another port (0 picks a free one) or stop it)",
        1,
    )
    assert expected_failure(BrokerError("no metadata")) == ("no metadata", 1)
    assert expected_failure(ShardUnavailableError("shard 0 at http://h:1 unreachable")) == (
        "shard 0 at http://h:1 unreachable", 1,
    )  # fmt: skip
    found = expected_failure(KafkaConnectionError("Unable to bootstrap from [('127.0.0.1', 1)]"))
    assert found is not None and found[1] == 1 and "no Kafka broker answered" in found[0]
    group = ExceptionGroup("two", [BrokerError("a"), _Refused("b")])
    assert expected_failure(group) == ("a", 1)
    assert expected_failure(ExceptionGroup("mixed", [BrokerError("a"), KeyError("b")])) is None
    assert expected_failure(OSError(errno.ENOENT, "No such file")) is None  # not one of ours: a bug
    full = OSError(errno.ENOSPC, "No space left on device", "/exports/ctr/.tmp-3/shard-0.lr.npz")
    assert expected_failure(full) == ("No space left on device: /exports/ctr/.tmp-3/shard-0.lr.npz", 1)
    denied = PermissionError(errno.EACCES, "Permission denied", "/exports")
    assert expected_failure(denied) == ("Permission denied: /exports", 1)  # a file, not a listen
    assert expected_failure(RuntimeError("x")) is None


def test_json_lines_take_integer_keys_and_odd_values(capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    """The worker's seek line logs {partition: offset}."""
    configure_logging("json")
    logging.getLogger("ctrps.worker").info(
        "seek", extra={"fields": {"offsets": {0: 17, 3: 4}, "path": Path("/x"), "n": 1}}
    )
    line = orjson.loads(capsys.readouterr().err)
    assert line["offsets"] == {"0": 17, "3": 4} and line["path"] == "/x" and line["n"] == 1


# -- log levels and the Kafka client ----------------------------------------------------


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, path + (name,))


def test_every_command_has_log_level_flags() -> None:
    leaves = dict(_leaves(build_parser()))
    assert {("shard",), ("worker",), ("serve",), ("broker",), ("demo",), ("cluster",), ("export",),
            ("produce", "synthetic"), ("produce", "file")} <= set(leaves)  # fmt: skip
    for path, parser in leaves.items():
        flags = {s for a in parser._actions for s in a.option_strings}
        assert {"--log-level", "--kafka-log-level", "--log-format"} <= flags, path


def test_kafka_client_loggers_stay_at_warning_unless_asked(restore_logging: None) -> None:
    levels = lambda: [logging.getLogger(n).getEffectiveLevel() for n in (*KAFKA_LOGGERS, "aiokafka.consumer")]  # noqa: E731
    configure_logging("text", logging.INFO)
    assert levels() == [logging.WARNING] * 3
    configure_logging("text", logging.ERROR)
    assert levels() == [logging.ERROR] * 3
    configure_logging("text", logging.DEBUG)
    assert levels() == [logging.DEBUG] * 3
    configure_logging("text", logging.INFO, logging.INFO)
    assert levels() == [logging.INFO] * 3


def test_repeated_kafka_lines_are_collapsed_and_counted() -> None:
    now = [0.0]
    f = RepeatFilter(every_s=5.0, clock=lambda: now[0])

    def record(name: str, msg: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
        r = logging.LogRecord(name, logging.ERROR, __file__, 1, msg, args, None)
        if exc is not None:
            r.exc_info = (type(exc), exc, None)
        return r

    template = "Unable connect to node with id %s: %s"
    first = record("aiokafka", template, 1, "refused", exc=ConnectionRefusedError("refused"))
    assert f.filter(first)
    assert first.exc_info is None and first.fields == {"error": "ConnectionRefusedError: refused"}  # type: ignore[attr-defined]
    passed = 0
    for i in range(399):  # 80 a second for 5 s, arguments varying
        now[0] += 1 / 80
        passed += f.filter(record("aiokafka", template, i % 3, "refused"))
    assert passed == 0
    now[0] += 0.1
    r = record("aiokafka", template, 1, "refused")
    assert f.filter(r)  # the first one after 5 s, which says how many were held back
    assert r.fields == {"suppressed": 399, "suppressed_s": 5.1}  # type: ignore[attr-defined]
    # Another template, another logger, our own loggers: not held back.
    assert f.filter(record("aiokafka", "Unable to update metadata from %s", [0]))
    assert f.filter(record("aiokafka.conn", template, 1, "refused"))
    for _ in range(10):
        assert f.filter(record("ctrps.worker", "window"))
    assert f.filter(record("kafkaesque", template, 1, "x")) and f.filter(record("kafkaesque", template, 1, "x"))


# -- readiness is logged when it changes ------------------------------------------------


async def test_a_failing_readyz_logs_once_per_change(caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    settings = ApiSettings(shards=(url,), port=0, shard_deadline_s=0.2)
    caplog.set_level(logging.INFO, logger="ctrps.api")

    def lines(msg: str) -> int:
        return sum(1 for r in caplog.records if r.name == "ctrps.api" and r.getMessage() == msg)

    retry = RetryPolicy(deadline_s=0.2)
    async with (
        PSClient.connect([url], retry=retry, rpc=False) as client,
        ControlClient.connect([url], retry=retry) as control,
    ):
        async with (
            ApiServer(settings, client, make_model("lr", "ctr"), control=control) as server,
            aiohttp.ClientSession() as http,
        ):
            for _ in range(4):
                async with http.get(server.url + "/readyz") as resp:
                    assert resp.status == 503
            assert lines("not ready") == 1 and lines("request failed") == 0
            one = Shard(ShardSpec(0, 1))
            shard = await start_shard_site(create_shard_app(one), "127.0.0.1", port)
            try:
                for _ in range(3):
                    async with http.get(server.url + "/readyz") as resp:
                        assert resp.status == 200
            finally:
                await shard.cleanup()
            assert lines("ready again") == 1 and lines("not ready") == 1
    not_ready = next(r for r in caplog.records if r.getMessage() == "not ready")
    assert not_ready.levelno == logging.WARNING and url in not_ready.fields["detail"]  # type: ignore[attr-defined]


# -- the producer when the broker dies --------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="kills its own broker")
@pytest.mark.parametrize("how", ["killed", "frozen"])
@pytest.mark.process
@pytest.mark.kafka
async def test_the_producer_gives_up_on_a_dead_broker_with_one_line(how: str, tmp_path: Path) -> None:
    """It counts only acknowledged sends, notices within its delivery timeout,
    says so in one line and exits 3; the Kafka client's flood is collapsed."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    topic = f"dead-{uuid.uuid4().hex[:8]}"
    log = tmp_path / "produce.log"
    broker = EmbeddedBroker()
    await broker.start()
    try:
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "produce", "synthetic", "--events", str(10**9),
                "--rate", "2000", "--topic", topic, "--partitions", "1", "--bootstrap", broker.bootstrap,
                "--log-format", "json", "--delivery-timeout", "3",
                cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip
        try:

            def sending() -> bool:
                assert proc.returncode is None, log.read_text()
                return b'"msg":"progress"' in log.read_bytes()

            await until(sending, 60, what="a progress line", poll_s=0.05)
            mark = len(log.read_bytes().splitlines())
            os.kill(broker.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
            # Bounded generously for a loaded machine; before, it took over a minute.
            assert await asyncio.wait_for(proc.wait(), 45) == 3, log.read_text()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
        after = lines[mark:]
        errors = [x for x in after if x["level"] in ("error", "critical") and x["logger"] == "ctrps produce"]
        assert len(errors) == 1 and errors[0]["exit_code"] == 3, after
        assert "acknowledged no send for 3 s" in errors[0]["msg"]
        assert not [x for x in lines if "exc" in x], "no traceback"
        kafka_lines = [x for x in after if x["logger"].startswith("aiokafka")]
        assert len(kafka_lines) < 40, kafka_lines  # was ~40 a second
        sent = max(x["sent"] for x in lines if x["msg"] == "progress")
        acknowledged = int(errors[0]["msg"].split("gave up with ")[1].split(" ")[0])
        assert acknowledged >= sent
        if how == "frozen":
            # Back from the freeze, the broker holds at least what was counted as acknowledged.
            os.kill(broker.pid, signal.SIGCONT)
            consumer = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap)
            await consumer.start()
            try:
                tp = TopicPartition(topic, 0)
                end = (await consumer.end_offsets([tp]))[tp]
            finally:
                await consumer.stop()
            assert end >= acknowledged > 0
    finally:
        with contextlib.suppress(Exception):  # not running (killed) or already stopped
            os.kill(broker.pid, signal.SIGCONT)
        broker.stop()


@pytest.mark.slow
@pytest.mark.process
async def test_produce_log_level_warning_hides_info_lines(kafka_bootstrap: str) -> None:
    topic = f"lvl-{uuid.uuid4().hex[:8]}"
    quiet = await asyncio.to_thread(
        ctrps, "produce", "synthetic", "--events", "20", "--topic", topic, "--bootstrap", kafka_bootstrap,
        "--log-level", "warning",
    )  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    loud = await asyncio.to_thread(
        ctrps, "produce", "synthetic", "--events", "20", "--topic", topic, "--bootstrap", kafka_bootstrap,
    )  # fmt: skip
    assert loud.returncode == 0 and "done" in loud.stderr and "sent=20 " in loud.stderr


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("CTRPS_KAFKA_BOOTSTRAP")), reason="kills its own broker")
@pytest.mark.process
@pytest.mark.kafka
async def test_a_worker_whose_broker_died_logs_few_kafka_client_lines(tmp_path: Path) -> None:
    """Once the broker is gone the Kafka client repeats a handful of lines
    dozens of times a second; the worker shows each at most every 5 s, with
    the count held back, and no traceback."""
    broker = EmbeddedBroker()
    await broker.start()
    log = tmp_path / "worker.log"
    proc: asyncio.subprocess.Process | None = None
    shard_runner: Any = None
    try:
        await broker.create_topics({"clicks": 2, "clicks.dlq": 1})
        one = Shard(ShardSpec(0, 1))
        port = free_port()
        shard_runner = await start_shard_site(create_shard_app(one), "127.0.0.1", port)
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "app.cli", "worker", "--bootstrap", broker.bootstrap,
                "--shards", f"http://127.0.0.1:{port}", "--window-seconds", "1", "--decode-processes", "0",
                "--log-format", "json",
                cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            )  # fmt: skip

        def lines() -> list[dict[str, Any]]:
            return [orjson.loads(x) for x in log.read_bytes().splitlines()]

        def assigned() -> bool:
            assert proc is not None and proc.returncode is None, log.read_text()
            return any(x["msg"] == "assigned" for x in lines())

        await until(assigned, 60, what="the worker's assignment", poll_s=0.1)
        mark = len(lines())
        os.kill(broker.pid, signal.SIGKILL)
        # A collapsed line comes once a template has repeated for 5 s.
        await until(lambda: any("suppressed" in x for x in lines()[mark:]), 60,
                    what="a line saying how many were held back", poll_s=0.1)  # fmt: skip
        after = lines()[mark:]
        kafka = [x for x in after if x["logger"].startswith("aiokafka")]
        held = sum(x.get("suppressed", 0) for x in kafka)
        assert held > len(kafka), (held, kafka)  # more held back than shown
        assert len(kafka) < 40, kafka
        assert not [x for x in after if "exc" in x], "no traceback"
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        if shard_runner is not None:
            await shard_runner.cleanup()
        broker.stop()


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["text", "json"])
@pytest.mark.process
def test_export_errors_are_one_line_in_the_chosen_format(fmt: str) -> None:
    out = ctrps("export", "--log-format", fmt)
    assert out.returncode == 2
    line = one_error_line(out, fmt)
    if fmt == "json":
        assert isinstance(line, dict) and line["logger"] == "ctrps export" and line["exit_code"] == 2
        assert line["msg"].startswith("no shard 0")
    else:
        assert "ctrps export: no shard 0" in line
    port = free_port()  # nothing listens there: refused at the first look
    out = ctrps("export", "--shard0", f"http://127.0.0.1:{port}", "--log-format", fmt)
    assert out.returncode == 1
    line = one_error_line(out, fmt)
    assert "connection refused" in (line["msg"] if isinstance(line, dict) else line)


@pytest.mark.parametrize("flags", [("--mode", "geo"), ("--max-staleness", "4")])
@pytest.mark.process
async def test_a_worker_in_another_mode_than_its_model_is_refused_in_one_line(
    flags: tuple[str, str], kafka_bootstrap: str
) -> None:
    one = Shard(ShardSpec(0, 1), make_model("lr", "ctr").tables())  # the model, in async
    port = free_port()
    runner = await start_shard_site(create_shard_app(one), "127.0.0.1", port)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "worker", "--bootstrap", kafka_bootstrap,
            "--shards", f"http://127.0.0.1:{port}", "--decode-processes", "0", *flags,
            cwd=PROJECT, env=clean_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await runner.cleanup()
    out = subprocess.CompletedProcess([], proc.returncode, "", err.decode())
    assert out.returncode == 1, out.stderr
    line = one_error_line(out, "text")
    assert "updated in mode async" in str(line) and "same --mode" in str(line), line
    assert one.tables["ctr_w"].config.mode == "async"
