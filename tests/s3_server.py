"""A real S3-protocol server for tests and studies: moto's server in a
subprocess on a free loopback port, with a bucket (`moto_server`; the session
fixture `s3_endpoint` in conftest.py is one). moto comes with the dev extras."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from consumers.broker import free_port

__all__ = ["BUCKET", "S3Endpoint", "moto_installed", "moto_server"]

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
REGION = "us-east-1"
BUCKET = "ctrps-test"
"""The bucket `moto_server` makes."""


@dataclass(frozen=True)
class S3Endpoint:
    """Where the server listens, its bucket, and the credentials it takes (moto
    takes any) as the usual AWS environment variables."""

    url: str
    bucket: str
    env: dict[str, str]

    @property
    def key_id(self) -> str:
        return self.env["AWS_ACCESS_KEY_ID"]

    @property
    def secret(self) -> str:
        return self.env["AWS_SECRET_ACCESS_KEY"]


def moto_installed() -> bool:
    """Whether moto's server can be started here."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@contextmanager
def moto_server(
    timeout_s: float = START_TIMEOUT_S, server_env: Mapping[str, str] | None = None
) -> Iterator[S3Endpoint]:
    """moto's S3 server (``python -m moto.server``) on a free 127.0.0.1 port,
    ready with an empty bucket `BUCKET` when this yields; terminated (killed after `STOP_TIMEOUT_S`) after.
    A subprocess, not moto's threaded server: it does not share the GIL with
    the client it serves, and a stop cannot hang in a thread. `RuntimeError`
    with the server's last output if it is not answering within `timeout_s`.
    `server_env` adds to the server's environment (moto's settings, e.g.
    ``INITIAL_NO_AUTH_ACTION_COUNT`` to check credentials)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}
    with tempfile.TemporaryDirectory(prefix="moto-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, **(server_env or {})},
            )
        try:
            _wait_ready(url, proc, timeout_s, log_path)
            # moto checks no signature: a plain PUT makes the bucket, with no client library
            urllib.request.urlopen(urllib.request.Request(f"{url}/{BUCKET}", method="PUT"), timeout=10).close()
            yield S3Endpoint(url, BUCKET, env)
        finally:
            proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log_path: Path) -> None:
    """Poll moto's own API until it answers, the process dies or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/moto-api/", timeout=1.0):
                return
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-2000:]
            state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not ready in {timeout_s:.0f}s"
            raise RuntimeError(f"moto server at {url} {state}: {tail}")
        time.sleep(0.05)  # polling a starting server, bounded by the deadline
