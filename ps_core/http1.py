"""A lean HTTP/1.1 client connection for the shard servers' frame routes.

A training step is one ``POST /v1/push_pull`` per shard of some tens of
kilobytes, and aiohttp's client spends about 120 µs of Python on each, as
much as the shard's table work; at 256-event mini-batches that is a whole
microsecond per trained event of the worker's one core. The frame routes
need little of HTTP: one method, one content type, bodies of known length,
keep-alive. `Http1Connection` speaks exactly that on one persistent
connection, with requests pipelined (RFC 9112 §9.3: the server answers in
order) and replies matched to calls in order, as `ps_core.rpc` does.

It sends ``POST <path> HTTP/1.1`` with ``Host``, ``Content-Type:
application/x-ctrps-frame`` and ``Content-Length``, and reads any HTTP/1.x
reply: bodies delimited by ``Content-Length``, chunked, or (without either)
by the server closing the connection; 1xx interim replies are skipped; a
reply saying ``Connection: close`` ends the connection after it. A stream it
cannot parse, or a connection that closes, fails every call still waiting
with a ConnectionError; the caller (`ps_core.client.HttpTransport`) retries.
"""

from __future__ import annotations

import asyncio

from .pipelined import PipelinedConnection, PipelinedProtocol, Reply
from .server import FRAME_CONTENT_TYPE

__all__ = ["Http1Connection"]

_MAX_HEAD = 64 * 1024
"""A reply head longer than this is not a shard's: the stream is dropped."""


class _Reply:
    """The head of the reply being read."""

    __slots__ = ("status", "length", "chunked", "close")

    def __init__(self, status: int, length: int | None, chunked: bool, close: bool) -> None:
        self.status = status
        self.length = length
        """Body length from Content-Length, None when chunked or read to the close."""
        self.chunked = chunked
        self.close = close
        """Whether the server ends the connection after this reply."""


def _parse_head(head: bytes) -> _Reply | None:
    """The status and framing of a reply head (without its blank line);
    None when it is not HTTP/1.x."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or parts[0] not in (b"HTTP/1.1", b"HTTP/1.0") or not parts[1].isdigit():
        return None
    status = int(parts[1])
    length: int | None = None
    chunked = False
    close = parts[0] == b"HTTP/1.0"
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            return None
        name = name.strip().lower()
        value = value.strip().lower()
        if name == b"content-length":
            if not value.isdigit():
                return None
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.endswith(b"chunked")
        elif name == b"connection":
            tokens = {t.strip() for t in value.split(b",")}
            close = b"close" in tokens or (close and b"keep-alive" not in tokens)
    if chunked:
        length = None  # RFC 9112 §6.3: chunked framing wins over a length
    return _Reply(status, length, chunked, close)


def _chunked_body(buf: bytearray, start: int) -> tuple[bytes, int] | None:
    """A whole chunked body from `buf[start:]` and where it ends, None while
    incomplete; raises ValueError when the chunk framing is broken."""
    parts: list[bytes] = []
    pos = start
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        size_text = bytes(buf[pos:eol]).split(b";", 1)[0].strip()
        size = int(size_text, 16)  # ValueError on junk
        if size < 0:
            raise ValueError("negative chunk size")
        pos = eol + 2
        if size == 0:
            # Trailer fields (none expected) end with a blank line.
            end = buf.find(b"\r\n", pos)
            while end >= 0 and end != pos:
                pos = end + 2
                end = buf.find(b"\r\n", pos)
            if end < 0:
                return None
            return b"".join(parts), end + 2
        if len(buf) < pos + size + 2:
            return None
        parts.append(bytes(buf[pos : pos + size]))
        if buf[pos + size : pos + size + 2] != b"\r\n":
            raise ValueError("chunk not followed by CRLF")
        pos += size + 2


class _ClientProtocol(PipelinedProtocol):
    """Reads HTTP/1.x replies and matches them to the waiting calls, in order."""

    def __init__(self) -> None:
        super().__init__()
        self._reply: _Reply | None = None
        self._body_at = 0

    def connection_lost(self, exc: Exception | None) -> None:
        reply = self._reply
        if reply is not None and reply.length is None and not reply.chunked:
            # A body delimited by the end of the connection is complete now.
            self.deliver(reply.status, bytes(self._buf[self._body_at :]))
        self._reply = None
        super().connection_lost(exc)

    def fail(self, why: str) -> None:
        self._reply = None
        super().fail(why)

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        start = 0
        try:
            while True:
                reply = self._reply
                if reply is None:
                    end = buf.find(b"\r\n\r\n", start)
                    if end < 0:
                        if len(buf) - start > _MAX_HEAD:
                            self.fail(f"reply head over {_MAX_HEAD} bytes")
                            start = 0
                        return
                    reply = _parse_head(bytes(buf[start:end]))
                    if reply is None:
                        self.fail(f"not an HTTP/1.x reply: {bytes(buf[start : min(end, start + 60)])!r}")
                        start = 0
                        return
                    start = end + 4
                    if 100 <= reply.status < 200:
                        continue  # interim reply: the real one follows
                    if not self.waiting:
                        self.fail("a reply nobody asked for")
                        start = 0
                        return
                    self._reply = reply
                    self.closing = self.closing or reply.close
                if reply.length is not None:
                    if len(buf) - start < reply.length:
                        return
                    payload = bytes(memoryview(buf)[start : start + reply.length])
                    start += reply.length
                elif reply.chunked:
                    try:
                        got = _chunked_body(buf, start)
                    except ValueError as exc:
                        self.fail(f"bad chunked body: {exc}")
                        start = 0
                        return
                    if got is None:
                        return
                    payload, start = got
                else:
                    # Read to the close (connection_lost delivers it).
                    self._body_at = start
                    return
                self._reply = None
                self.deliver(reply.status, payload)
                if reply.close and self.transport is not None:
                    self.transport.close()
        finally:
            if start:
                del buf[:start]
                self._body_at = max(self._body_at - start, 0)


class Http1Connection(PipelinedConnection):
    """One keep-alive HTTP/1.1 connection to a server; calls may overlap
    (they are pipelined and answered in order)."""

    def __init__(self, protocol: _ClientProtocol, authority: str) -> None:
        super().__init__(protocol)
        self._headers = (
            f" HTTP/1.1\r\nHost: {authority}\r\nContent-Type: {FRAME_CONTENT_TYPE}\r\nContent-Length: "
        ).encode("ascii")

    @classmethod
    async def open(cls, host: str, port: int) -> Http1Connection:
        """Connect to `host`:`port`; raises OSError when that fails."""
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(_ClientProtocol, host, port)
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return cls(protocol, authority)

    def call(self, path: str, body: bytes) -> asyncio.Future[Reply]:
        """``POST`` `body` to `path`; the future gets (status, reply body) or a ConnectionError."""
        head = b"POST " + path.encode("ascii") + self._headers + str(len(body)).encode("ascii")
        return self._send((head, b"\r\n\r\n", body))
