"""The examples of README.md and of the user guide (docs/guide/, its pages in
mkdocs.yml's order), run: every ```sh and ```python block against a real
pipeline the test starts, so an example that drifts from the code fails.

A block marked ``<!-- illustration: WHY -->`` on the line before its fence
is not run (`test_the_illustrations_are_few_and_say_why` lists them). The
others run in their document's order (README's alone; the guide's pages
one after the other), in a fresh directory, as a user would type them,
with these substitutions only:

- the documents' addresses (``127.0.0.1:9092``, ``:7100``, ``:7101``,
  ``localhost:8080``, ``:8081``, ``:8082``, and those ports after ``--port``)
  become free ports chosen by the test;
- ``.venv/bin/ctrps`` (and ``ctrps``) is ``python -m app.cli`` of this
  checkout (a script of that name in the directory, and on ``PATH``);
- ``...`` ending a ``ctrps worker`` line stands for the pipeline's
  ``--bootstrap`` and ``--shards`` (the guide: "each role ... as above");
- the shard 0 a ``ctrps model`` command finds without ``--shard0`` (the
  shard's default address) is the test's, through ``CTRPS_SHARDS``;
- a cluster's (or demo's) admin token file is the one its ``ready`` line
  names, and ``CTRPS_ADMIN_TOKEN`` its token.

Before ``ctrps model delete NAME`` the workers training NAME are stopped,
as the guide says to.

Roles that serve (``broker``, ``shard``, ``worker``, ``serve``, ``cluster``,
``demo``, or a line ending in ``&``) are started as processes and waited for
(a log line saying so, ``/readyz`` for an API); the next one on the same
port replaces the earlier one (the user's Ctrl-C). Every other line runs to
its end and must exit 0; ``curl`` fails on an HTTP status >= 400. At the end
every role still runs (none died on its own) and stops with exit 0 on
SIGTERM. A block that starts a ``ctrps cluster`` or ``ctrps demo`` is a
pipeline of its own; every other block of a document shares the first one.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest
from commands import PROJECT, clean_env
from jsonlog import read_json_lines
from site_pages import README, guide_pages
from waiting import json_when_ok, until

from consumers.broker import free_port

pytestmark = pytest.mark.slow  # real processes for seconds each: make test-fast leaves them out

FENCE = re.compile(r"^```(\S*)\s*$")
ILLUSTRATION = re.compile(r"^<!--\s*illustration:\s*(.+?)\s*-->\s*$")
RUN = ("sh", "python")
README_PORTS = (9092, 7100, 7101, 8080, 8081, 8082)
# The roles that serve until stopped, and the log line that says each is up.
SERVING = {"broker": "ready", "shard": "listening", "worker": "assigned", "serve": "listening", "cluster": "ready",
           "demo": "ready"}  # fmt: skip
SELF_CONTAINED = ("cluster", "demo")
CTRPS = re.compile(r"^(?:\S+=\S+\s+)*(?:\.venv/bin/)?ctrps\s+(\S+)")
# `curl` as the documents' lines call it, failing on an HTTP error status (22); a
# reader that stops early (`| head -c 600`) is no error of curl's (23).
SHELL_PRELUDE = """set -o pipefail
curl() { command curl -S --fail-with-body "$@"; local rc=$?; [ "$rc" -eq 23 ] && return 0; return "$rc"; }
"""
MAX_ILLUSTRATIONS = 5  # in README and the guide together


def documents() -> dict[str, list[Path]]:
    """Each document whose examples run as one pipeline: its pages, in order."""
    return {"README": [README], "guide": guide_pages()}


@dataclass(frozen=True)
class Block:
    """One fenced block of README.md or a guide page."""

    source: str  # the page, relative to the project
    lang: str
    line: int  # of its opening fence, 1-based
    text: str
    illustration: str | None  # why it is not run; None: it is run

    @property
    def commands(self) -> list[str]:
        """A shell block's commands: lines joined where one ends in ``\\``,
        blank ones left out."""
        out: list[str] = []
        pending = ""
        for raw in self.text.splitlines():
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            line = (pending + raw).strip()
            pending = ""
            if line:
                out.append(line)
        return out

    def starts(self, roles: tuple[str, ...]) -> bool:
        return any((m := CTRPS.match(c)) is not None and m.group(1) in roles for c in self.commands)

    def __str__(self) -> str:
        return f"{self.source}:{self.line} ({self.lang})"


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`."""
    return text_blocks(page.read_text(), str(page.relative_to(PROJECT)))


def text_blocks(text: str, source: str) -> list[Block]:
    """Every fenced block of `text`, with its illustration marker (the last
    non-blank line before its fence)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = ILLUSTRATION.match(before.strip())
        blocks.append(Block(source, m.group(1), start + 1, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i += 1
    return blocks


def every_block() -> list[Block]:
    return [b for pages in documents().values() for page in pages for b in page_blocks(page)]


def runnable(pages: list[Path]) -> list[Block]:
    return [b for page in pages for b in page_blocks(page) if b.lang in RUN and b.illustration is None]


@dataclass
class Role:
    """A serving process started from a document's line."""

    command: str
    role: str
    proc: subprocess.Popen[bytes]
    log: Path
    port: int | None

    def lines(self) -> list[dict[str, object]]:
        return read_json_lines(self.log)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


@dataclass
class Pipeline:
    """A document's commands run in one directory against the processes they start."""

    home: Path
    ports: dict[int, int]
    env: dict[str, str]
    roles: list[Role] = field(default_factory=list)
    count: int = 0
    token_file: str = "-"  # a cluster's admin token file, once its ready line named it
    timings: list[tuple[float, str]] = field(default_factory=list)  # seconds each command took, shown at the end

    @classmethod
    def make(cls, home: Path, token: str | None) -> Pipeline:
        bindir = home / ".venv" / "bin"
        bindir.mkdir(parents=True)
        script = bindir / "ctrps"
        script.write_text(f'#!/bin/sh\nexec {sys.executable} -m app.cli "$@"\n')
        script.chmod(0o755)
        env = clean_env(
            PYTHONPATH=str(PROJECT),
            PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
            CTRPS_LOG_FORMAT="json",  # the test reads the roles' lines
            TMPDIR=str(home),  # files a role makes for its run (a cluster's admin token) stay here
        )
        if token is not None:
            env["CTRPS_ADMIN_TOKEN"] = token
        return cls(home, {p: free_port() for p in README_PORTS}, env)

    # -- the text of a command ------------------------------------------------
    def substitute(self, text: str) -> str:
        for theirs, ours in self.ports.items():
            text = re.sub(rf"(?<=[:\s]){theirs}(?!\d)", str(ours), text)
        return text.replace("/tmp/ctrps-cluster-*/admin-token", self.token_file)

    def expand(self, command: str) -> str:
        m = CTRPS.match(command)
        if m is not None and m.group(1) == "worker":
            shards = f"http://127.0.0.1:{self.ports[7100]},http://127.0.0.1:{self.ports[7101]}"
            flags = f"--bootstrap 127.0.0.1:{self.ports[9092]} --shards {shards}"
            command = re.sub(r"\s\.\.\.(?=\s|$)", " " + flags, command, count=1)
        return self.substitute(command)

    def env_for(self, command: str) -> dict[str, str]:
        m = CTRPS.match(command)
        env = dict(self.env)
        if m is not None and m.group(1) == "model":
            env["CTRPS_SHARDS"] = f"http://127.0.0.1:{self.ports[7100]}"
        return env

    # -- running it -------------------------------------------------------------
    async def run_block(self, block: Block) -> None:
        if block.lang == "python":
            began = time.monotonic()
            await self.run_python(block)
            self.timings.append((time.monotonic() - began, str(block)))
            return
        for command in block.commands:
            m = CTRPS.match(command)
            role = m.group(1) if m is not None else None
            began = time.monotonic()
            if role in SERVING or re.search(r"&\s*(#.*)?$", command):
                await self.start(block, command, role or "background")
            else:
                deleted = re.search(r"ctrps model delete\s+(\S+)", command)
                if deleted:
                    await self.stop_training(deleted.group(1))
                await self.run_once(block, command)
            self.timings.append((time.monotonic() - began, command[:100]))

    async def run_python(self, block: Block) -> None:
        self.count += 1
        path = self.home / f"block-{block.line}.py"
        path.write_text(self.substitute(block.text))
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, str(path)],
            cwd=self.home,
            env=self.env_for(""),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, f"{block} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"

    async def run_once(self, block: Block, command: str) -> None:
        self.count += 1
        line = self.expand(command)
        self.check_roles()
        out = await asyncio.to_thread(
            subprocess.run,
            ["bash", "-c", SHELL_PRELUDE + line],
            cwd=self.home,
            env=self.env_for(command),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, (
            f"{block}: `{command}` exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        )

    async def start(self, block: Block, command: str, role: str) -> None:
        self.count += 1
        line = re.sub(r"&\s*(#.*)?$", "", self.expand(command)).strip()
        port_flag = re.search(r"--port\s+(\d+)", line)
        port = int(port_flag.group(1)) if port_flag else None
        if port is not None:
            for earlier in [r for r in self.roles if r.port == port]:
                await self.stop(earlier)  # the user's Ctrl-C before starting the next one there
        log = self.home / f"{role}-{len(self.roles)}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                ["bash", "-c", "exec " + line],
                cwd=self.home,
                env=self.env_for(command),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=sink,
            )
        started = Role(command, role, proc, log, port)
        self.roles.append(started)
        await self.ready(block, started)

    async def ready(self, block: Block, role: Role) -> None:
        want = SERVING.get(role.role)

        def seen() -> bool:
            if role.proc.poll() is not None:
                raise AssertionError(f"{block}: `{role.command}` exited {role.proc.returncode}:\n{role.tail()}")
            # A cluster's children's lines carry their role: not its own.
            return want is None or any(x.get("msg") == want and "role" not in x for x in role.lines())

        await until(seen, 120, what=f"{block}: `{role.command}` to log {want!r}", poll_s=0.1)
        if role.role in SELF_CONTAINED:
            [ready] = [x for x in role.lines() if x.get("msg") == "ready" and "role" not in x]
            made = str(ready.get("admin_token_file", "-"))
            if made != "-":  # the run's admin token, for the lines that use it
                self.token_file = made
                self.env["CTRPS_ADMIN_TOKEN"] = Path(made).read_text().strip()
        if role.role in ("serve", "cluster", "demo") and role.port is not None:
            url = f"http://127.0.0.1:{role.port}/readyz"
            async with aiohttp.ClientSession() as session:

                async def answers() -> bool:
                    seen()
                    return await json_when_ok(session, url) is not None

                await until(answers, 120, what=f"{block}: {url} to answer 200", poll_s=0.2)

    async def stop_training(self, model: str) -> None:
        """Stop the workers training `model`, as the guide says before deleting it
        (their windows would fail on its dropped tables)."""
        names = re.compile(rf"--(?:model-name|also-train)[\s=]{re.escape(model)}(?!\S)")
        for role in [r for r in self.roles if r.role == "worker" and names.search(r.command)]:
            await self.stop(role)

    def check_roles(self) -> None:
        """Every role started still runs."""
        for role in self.roles:
            code = role.proc.poll()
            assert code is None, f"`{role.command}` exited {code} on its own:\n{role.tail()}"

    async def stop(self, role: Role) -> None:
        if role.proc.poll() is None:
            role.proc.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(role.proc.wait, 60)
        except subprocess.TimeoutExpired:
            role.proc.kill()
            role.proc.wait(10)
            raise AssertionError(f"`{role.command}` did not stop within 60 s of SIGTERM:\n{role.tail()}") from None
        finally:
            self.roles.remove(role)
        assert code == 0, f"`{role.command}` exited {code}:\n{role.tail()}"

    async def stop_all(self) -> None:
        """Stop every role, the last started first; the first failure is raised
        once all are stopped."""
        self.check_roles()
        failures: list[AssertionError] = []
        for role in reversed(self.roles[:]):
            try:
                await self.stop(role)
            except AssertionError as exc:
                failures.append(exc)
        if failures:
            raise failures[0]

    def kill_all(self) -> None:
        for role in self.roles:
            if role.proc.poll() is None:
                role.proc.kill()
                role.proc.wait(10)


def write_clicks(path: Path, n: int = 3000, seed: int = 0) -> None:
    """A small file of the guide's event format (what "Your own data" reads):
    sites and hours whose clicks follow a hidden logistic model."""
    rng = np.random.default_rng(seed)
    sites = [f"{x:05x}" for x in rng.integers(0, 1 << 20, 40)]
    site_w = rng.normal(0, 1, len(sites))
    hour_w = rng.normal(0, 0.5, 24)
    with path.open("wb") as f:
        for i in range(n):
            s, h = int(rng.integers(len(sites))), int(rng.integers(24))
            p = 1 / (1 + np.exp(-(site_w[s] + hour_w[h] - 2)))
            event = {
                "id": f"e-{i}",
                "ts": 1764681600.0 + i,
                "label": int(rng.random() < p),
                "features": {"site": sites[s], "hour": str(h), "price": round(float(rng.gamma(2, 5)), 2)},
            }
            f.write(orjson.dumps(event) + b"\n")


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    write_clicks(tmp_path / "clicks.jsonl")
    yield tmp_path


async def run_pipeline(home: Path, blocks: list[Block], token: str | None) -> int:
    """Run `blocks` in order in one pipeline; returns how many commands ran."""
    assert shutil.which("curl"), "The documents' examples call curl: install it (.ci/run does)"
    pipeline = Pipeline.make(home, token)
    try:
        for block in blocks:
            await pipeline.run_block(block)
        await pipeline.stop_all()
    finally:
        pipeline.kill_all()
        print("\n".join(f"{s:6.1f} s  {what}" for s, what in pipeline.timings))
    return pipeline.count


def test_the_illustrations_are_few_and_say_why() -> None:
    """The blocks not run, and why (shown with ``-rA`` or on failure)."""
    skipped = [b for b in every_block() if b.lang in RUN and b.illustration is not None]
    listing = "\n".join(f"{b}: {b.illustration}" for b in skipped)
    print(f"Blocks not run:\n{listing}")
    assert len(skipped) <= MAX_ILLUSTRATIONS, listing
    assert all(b.illustration and len(b.illustration) > 10 for b in skipped), listing
    assert len(runnable(documents()["guide"])) >= 8, "the guide's examples are found"
    assert len(runnable([README])) >= 2, "README's tour is run"


def test_every_guide_page_is_in_the_nav() -> None:
    # A page left out of mkdocs.yml's nav would have its examples never run.
    on_disk = set((PROJECT / "docs" / "guide").glob("*.md"))
    assert on_disk == set(guide_pages()) and len(on_disk) >= 10, sorted(on_disk ^ set(guide_pages()))


def test_the_parser_reads_markers_and_continued_lines() -> None:
    text = "x\n<!-- illustration: needs kubectl -->\n```sh\nkubectl apply \\\n   -f deploy/k8s/\n```\n\n```python\nprint(1)\n```\n"
    shown, code = text_blocks(text, "x.md")
    assert shown.illustration == "needs kubectl" and shown.commands == ["kubectl apply     -f deploy/k8s/"]
    assert code.illustration is None and code.lang == "python" and code.line == 8 and str(code) == "x.md:8 (python)"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("document", sorted(documents()))
@pytest.mark.process
async def test_readme_pipeline_examples_run(document: str, home: Path) -> None:
    """Every block of a document but the illustrations and those starting a
    pipeline of their own (cluster, demo), in its order, against one pipeline."""
    blocks = [b for b in runnable(documents()[document]) if not b.starts(SELF_CONTAINED)]
    ran = await run_pipeline(home, blocks, token="readme-admin-token-0123456789")
    assert ran == sum(len(b.commands) if b.lang == "sh" else 1 for b in blocks)


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "block", [b for pages in documents().values() for b in runnable(pages) if b.starts(SELF_CONTAINED)], ids=str
)
@pytest.mark.process
async def test_readme_self_contained_examples_run(block: Block, home: Path) -> None:
    """A block starting ``ctrps cluster`` (or ``demo``), with what it runs against it."""
    ran = await run_pipeline(home, [block], token=None)
    assert ran == len(block.commands)
