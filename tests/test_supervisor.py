"""The process supervisor of ``ctrps cluster``, with small ``python -c`` children."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from commands import pid_gone
from waiting import until

from app.supervisor import ChildFailed, ChildSpec, LinePrefixer, RestartPolicy, Supervisor

# A child that says "up" once its SIGTERM handler is in place, then waits; on
# SIGTERM it says "term" and exits 0.
PATIENT = textwrap.dedent(
    """
    import signal, sys, time
    def term(*_):
        print("term", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("up", flush=True)
    while True:
        time.sleep(1)  # idle till a signal (pause() could miss one just before it): not a wait-for
    """
)


def py(role: str, code: str, **kw: Any) -> ChildSpec:
    return ChildSpec(role, (sys.executable, "-c", code), **kw)


def lines(out: io.BytesIO) -> list[str]:
    return out.getvalue().decode().splitlines()


def said(out: io.BytesIO, line: str) -> Callable[[], Awaitable[bool]]:
    """A readiness check: `line` is in the prefixed output."""

    async def check() -> bool:
        return line in lines(out)

    return check


# -- LinePrefixer ------------------------------------------------------------------


def test_text_lines_are_prefixed_across_chunk_boundaries() -> None:
    out = io.BytesIO()
    p = LinePrefixer("shard-0", out)
    p.feed(b"first\nsec")
    p.feed(b"ond\r\n\nthi")
    assert lines(out) == ["[shard-0] first", "[shard-0] second", "[shard-0] "]
    p.close()
    assert lines(out)[-1] == "[shard-0] thi"
    p.close()  # nothing buffered: writes nothing
    assert len(lines(out)) == 4


def test_json_lines_get_a_role_key_and_other_lines_are_wrapped() -> None:
    out = io.BytesIO()
    p = LinePrefixer("worker-1", out, "json")
    p.feed(b'{"msg": "window", "auc": 0.8}\nTraceback (most recent call last):\n[1, 2]\n')
    got = [orjson.loads(line) for line in out.getvalue().splitlines()]
    assert got == [
        {"role": "worker-1", "msg": "window", "auc": 0.8},
        {"role": "worker-1", "msg": "output", "line": "Traceback (most recent call last):"},
        {"role": "worker-1", "msg": "output", "line": "[1, 2]"},
    ]


# -- Supervisor ---------------------------------------------------------------------


@pytest.mark.process
async def test_a_child_that_dies_stops_all_and_the_status_is_1() -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0)
    patient = await sup.start(py("patient", PATIENT))
    await sup.wait_ready(patient, said(out, "[patient] up"), timeout_s=20)
    dier = await sup.start(py("dier", "print('bye'); raise SystemExit(3)"))
    stop = asyncio.Event()
    await asyncio.wait_for(sup.wait(stop), 20)  # returns because of the failure
    assert not stop.is_set()
    assert sup.failed is dier and dier.failure == "exited with 3"
    await asyncio.wait_for(sup.stop_all(), 20)
    assert patient.returncode == 0  # stopped by SIGTERM, cleanly
    assert sup.exit_status() == 1
    assert "[dier] bye" in lines(out)
    assert lines(out).count("[patient] term") == 1
    assert pid_gone(patient.pid) and pid_gone(dier.pid)
    await sup.stop_all()  # idempotent


@pytest.mark.process
async def test_stop_order_is_reverse_start_order_one_group_at_a_time() -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0)
    children = []
    for role, group in [("broker", ""), ("shard-0", "shards"), ("shard-1", "shards"), ("worker", "")]:
        child = await sup.start(py(role, PATIENT.replace('"term"', f'"term {role}"'), group=group))
        children.append(child)
    for child in children:
        await sup.wait_ready(child, said(out, f"[{child.role}] up"), timeout_s=20)
    await asyncio.wait_for(sup.stop_all(), 20)
    terms = [line.split()[-1] for line in lines(out) if " term " in line]
    assert terms[0] == "worker" and terms[-1] == "broker"
    assert sorted(terms[1:3]) == ["shard-0", "shard-1"]
    assert sup.exit_status() == 0
    assert all(c.returncode == 0 for c in children)


@pytest.mark.process
async def test_a_child_ignoring_sigterm_is_killed_with_its_process_group() -> None:
    code = textwrap.dedent(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # The helper lives 60 s unless killed with the group (the subject):
        # a bound on a stray, not a wait.
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print("helper", helper.pid, flush=True)
        while True:
            time.sleep(1)  # idle: SIGTERM is ignored, only SIGKILL ends it; not a wait-for
        """
    )
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=0.5)
    stubborn = await sup.start(py("stubborn", code))

    async def helper_started() -> bool:
        return any(line.startswith("[stubborn] helper ") for line in lines(out))

    await sup.wait_ready(stubborn, helper_started, timeout_s=20)
    helper_pid = int(next(x for x in lines(out) if x.startswith("[stubborn] helper ")).split()[-1])
    await asyncio.wait_for(sup.stop_all(), 20)
    assert stubborn.returncode == -9
    assert sup.unclean == [stubborn] and sup.exit_status() == 1
    # Killed with the group; init reaps it.
    await until(lambda: pid_gone(helper_pid), 10, what="the child's helper to end with it")


@pytest.mark.process
async def test_wait_ready_fails_when_the_child_exits_or_the_deadline_passes() -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0)

    async def never() -> bool:
        return False

    early = await sup.start(py("early", "raise SystemExit(0)"))
    with pytest.raises(ChildFailed, match="early: exited with 0 before it was ready"):
        await sup.wait_ready(early, never, timeout_s=20)

    async def refused() -> bool:
        raise ConnectionRefusedError  # not listening yet: not ready, no error

    slow = await sup.start(py("slow", PATIENT))
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ChildFailed, match="slow: not ready within 1s"):
        await sup.wait_ready(slow, refused, timeout_s=1.0)
    assert loop.time() - t0 < 5
    # Up (its SIGTERM handler installed) before it is stopped, however slow to start.
    await until(said(out, "[slow] up"), 20, what="the slow child to start")
    await asyncio.wait_for(sup.stop_all(), 20)
    assert slow.returncode == 0
    assert sup.failed is early  # exiting 0 is a failure for a child that must keep running


@pytest.mark.process
async def test_a_child_that_may_finish_exits_0_without_stopping_the_rest() -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0)
    patient = await sup.start(py("patient", PATIENT))
    # Up first: a SIGTERM before its handler is installed would kill it (-15).
    await sup.wait_ready(patient, said(out, "[patient] up"), timeout_s=20)
    once = await sup.start(py("once", "print('done')", may_finish=True))
    await asyncio.wait_for(once.exited.wait(), 20)
    stop = asyncio.Event()
    waiting = asyncio.create_task(sup.wait(stop))
    assert once.watcher is not None
    await asyncio.wait_for(once.watcher, 20)
    assert not waiting.done() and sup.failed is None
    stop.set()
    await asyncio.wait_for(waiting, 20)
    await asyncio.wait_for(sup.stop_all(), 20)
    assert sup.exit_status() == 0 and patient.returncode == 0 and once.returncode == 0
    assert "[once] done" in lines(out)


@pytest.mark.process
async def test_children_get_the_given_environment() -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0)
    env = {**os.environ, "CTRPS_PROBE": "42"}
    child = await sup.start(py("env", "import os; print(os.environ['CTRPS_PROBE'])", env=env, may_finish=True))
    await asyncio.wait_for(child.exited.wait(), 20)
    await sup.stop_all()
    assert lines(out) == ["[env] 42"]


# -- restarts -----------------------------------------------------------------------

# A child that counts its runs in the file given as argv[1], prints "run N",
# and then does what its run's entry of argv[2] says: "x" exits 3 at once, a
# number sleeps that many seconds and exits 3, "p" behaves like PATIENT.
SCRIPTED = textwrap.dedent(
    """
    import pathlib, signal, sys, time
    counter = pathlib.Path(sys.argv[1])
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    plan = sys.argv[2].split(",")
    step = plan[min(n, len(plan)) - 1]
    def term(*_):
        print("term", n, flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    print("run", n, flush=True)
    if step == "p":
        while True:
            time.sleep(1)  # idle till a signal (pause() could miss one just before it): not a wait-for
    if step != "x":
        time.sleep(float(step))  # the run's length, as planned: the subject, not a wait
    sys.exit(3)
    """
)


def scripted(role: str, counter: Path, plan: str, **kw: Any) -> ChildSpec:
    return ChildSpec(role, (sys.executable, "-c", SCRIPTED, str(counter), plan), restart=True, **kw)


def restart_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [
        dict(getattr(r, "fields", {}))
        for r in caplog.records
        if r.name == "ctrps.supervisor" and r.getMessage() == "restarting a child"
    ]


def test_restart_delays_double_up_to_the_cap() -> None:
    p = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [p.delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert p.delay(10**6) == 30


@pytest.mark.process
async def test_a_failing_child_is_restarted_with_backoff_until_it_keeps_failing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.BytesIO()
    policy = RestartPolicy(backoff_s=0.1, max_backoff_s=0.3, max_restarts=3, window_s=600)
    sup = Supervisor(out=out, grace_s=5.0, restart=policy)
    caplog.set_level(logging.INFO, logger="ctrps.supervisor")
    child = await sup.start(scripted("flaky", tmp_path / "runs", "x"))
    stop = asyncio.Event()
    await asyncio.wait_for(sup.wait(stop), 60)  # returns because it keeps failing
    assert sup.failed is child
    assert child.failure == "exited with 3; restarted 3 times within 600s"
    got = restart_lines(caplog)
    assert [(x["attempt"], x["delay_s"], x["restarts"]) for x in got] == [(1, 0.1, 1), (2, 0.2, 2), (3, 0.3, 3)]
    assert all(x["reason"] == "exited with 3" and x["returncode"] == 3 for x in got)
    gave_up = [r for r in caplog.records if r.getMessage() == "child keeps failing: stopping"]
    assert len(gave_up) == 1 and gave_up[0].levelno == logging.ERROR
    await asyncio.wait_for(sup.stop_all(), 20)
    assert sup.exit_status() == 1 and child.restarts == 3 and sup.restarts == 3
    assert [x for x in lines(out) if x.startswith("[flaky] run")] == [f"[flaky] run {n}" for n in (1, 2, 3, 4)]
    assert (tmp_path / "runs").read_text() == "4"


@pytest.mark.process
async def test_a_sigkilled_child_comes_back_with_the_same_arguments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0, restart=RestartPolicy(backoff_s=0.1))
    caplog.set_level(logging.INFO, logger="ctrps.supervisor")
    child = await sup.start(scripted("steady", tmp_path / "runs", "p"))
    await sup.wait_ready(child, said(out, "[steady] run 1"), timeout_s=20)
    first = child.pid
    os.kill(first, signal.SIGKILL)
    await until(said(out, "[steady] run 2"), 30, what="the restarted child")
    assert child.pid != first and pid_gone(first) and child.restarts == 1
    [line] = restart_lines(caplog)
    assert (line["reason"], line["returncode"], line["attempt"]) == ("killed by SIGKILL", -9, 1)
    assert sup.failed is None
    await asyncio.wait_for(sup.stop_all(), 20)
    assert child.returncode == 0 and sup.exit_status() == 0
    assert "[steady] term 2" in lines(out)


@pytest.mark.slow
@pytest.mark.process
async def test_a_healthy_run_resets_the_backoff(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Runs 1 and 2 fail at once (attempts 1, 2), run 3 lasts longer than
    # healthy_s: its restart is attempt 1 again, with the first delay.
    out = io.BytesIO()
    policy = RestartPolicy(backoff_s=0.1, max_backoff_s=10.0, healthy_s=3.0, max_restarts=10)
    sup = Supervisor(out=out, grace_s=5.0, restart=policy)
    caplog.set_level(logging.INFO, logger="ctrps.supervisor")
    child = await sup.start(scripted("resets", tmp_path / "runs", "x,x,4,x,p"))
    await until(said(out, "[resets] run 5"), 60, what="the fifth run")
    got = [(x["attempt"], x["delay_s"]) for x in restart_lines(caplog)]
    assert got == [(1, 0.1), (2, 0.2), (1, 0.1), (2, 0.2)]
    await asyncio.wait_for(sup.stop_all(), 20)
    assert sup.exit_status() == 0 and child.restarts == 4


@pytest.mark.process
async def test_stopping_during_the_backoff_starts_nothing_and_does_not_wait(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0, restart=RestartPolicy(backoff_s=3600.0, max_backoff_s=3600.0))
    caplog.set_level(logging.INFO, logger="ctrps.supervisor")
    patient = await sup.start(py("patient", PATIENT))
    await sup.wait_ready(patient, said(out, "[patient] up"), timeout_s=20)
    child = await sup.start(scripted("down", tmp_path / "runs", "x"))
    await until(lambda: bool(restart_lines(caplog)), 30, what="the restart's backoff")
    # The backoff is an hour: stop_all returning at all shows it did not wait for it.
    await asyncio.wait_for(sup.stop_all(), 20)
    assert child.stopped_while_down and child.returncode == 3
    assert (tmp_path / "runs").read_text() == "1"  # never started again
    assert sup.failed is None and sup.exit_status() == 0 and patient.returncode == 0
    assert child.watcher is not None and child.watcher.done()
    stopped = [dict(getattr(r, "fields", {})) for r in caplog.records if r.getMessage() == "stopped"]
    assert {"role": "down", "pid": child.pid, "returncode": 3, "restarts": 1, "waiting_to_restart": True} in stopped


@pytest.mark.process
async def test_a_restart_asks_for_its_arguments(tmp_path: Path) -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0, restart=RestartPolicy(backoff_s=0.1))
    runs = tmp_path / "runs"
    spec = ChildSpec(
        "again", (sys.executable, "-c", SCRIPTED, str(runs), "x"), restart=True,
        restart_argv=lambda: (sys.executable, "-c", SCRIPTED, str(runs), "x,p"),
    )  # fmt: skip
    child = await sup.start(spec)
    await until(said(out, "[again] run 2"), 30, what="the restart")
    await asyncio.wait_for(sup.stop_all(), 20)
    assert child.returncode == 0 and "[again] term 2" in lines(out) and sup.exit_status() == 0


@pytest.mark.process
async def test_a_child_without_restart_still_fails_at_once(tmp_path: Path) -> None:
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=5.0, restart=RestartPolicy(backoff_s=0.1))
    spec = ChildSpec("once", (sys.executable, "-c", SCRIPTED, str(tmp_path / "runs"), "x"))
    child = await sup.start(spec)
    await asyncio.wait_for(sup.wait(asyncio.Event()), 30)
    await sup.stop_all()
    assert sup.failed is child and child.failure == "exited with 3" and child.restarts == 0


@pytest.mark.process
async def test_a_child_exiting_while_everything_stops_is_not_restarted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # "late" (started last, stopped first) answers SIGTERM by creating a
    # file and waiting until "early" has exited: early exits 3 on seeing the
    # file, while stop_all is still stopping late.
    flag = tmp_path / "flag"
    early_code = textwrap.dedent(
        f"""
        import os, sys, time
        print("up", flush=True)
        while not os.path.exists({str(flag)!r}):
            time.sleep(0.02)  # poll interval for the flag; the test's timeout bounds it
        sys.exit(3)
        """
    )
    late_code = textwrap.dedent(
        f"""
        import os, pathlib, signal, sys, time
        def term(*_):
            pathlib.Path({str(flag)!r}).touch()
            pid = int(sys.argv[1])
            while True:
                try:
                    state = pathlib.Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()[0]
                except FileNotFoundError:
                    break
                if state == "Z":
                    break
                time.sleep(0.02)  # poll interval for early's exit; the test's timeout bounds it
            sys.exit(0)
        signal.signal(signal.SIGTERM, term)
        print("up", flush=True)
        while True:
            time.sleep(1)  # idle till SIGTERM: not a wait-for
        """
    )
    out = io.BytesIO()
    sup = Supervisor(out=out, grace_s=20.0, restart=RestartPolicy(backoff_s=0.1))
    caplog.set_level(logging.INFO, logger="ctrps.supervisor")
    early = await sup.start(ChildSpec("early", (sys.executable, "-c", early_code), restart=True))
    await sup.wait_ready(early, said(out, "[early] up"), timeout_s=20)
    late = await sup.start(ChildSpec("late", (sys.executable, "-c", late_code, str(early.pid)), restart=True))
    await sup.wait_ready(late, said(out, "[late] up"), timeout_s=20)
    await asyncio.wait_for(sup.stop_all(), 30)
    assert late.returncode == 0 and early.returncode == 3
    assert early.restarts == 0 and not restart_lines(caplog)
    assert sup.failed is early and early.failure == "exited with 3" and sup.exit_status() == 1
