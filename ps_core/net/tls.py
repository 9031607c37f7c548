"""TLS contexts for the ports ctrps serves and the connections it opens.

One set of files per process: a certificate and key it serves with (and
presents as a client when the far side asks for one), and a CA bundle it
verifies peers against. Servers ask for client certificates only when told
(`server_context(..., require_client_cert=True)`: mutual TLS).

A server's refused handshakes (a plaintext client, a client certificate it
does not trust, no certificate under mutual TLS) are counted by reason and
logged without flooding (`HandshakeFailures`, `watch_handshakes`): the
event loop itself drops them silently.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import Any

from .limits import Occurrences

__all__ = ["HandshakeFailures", "TlsFiles", "client_context", "server_context", "watch_handshakes"]

log = logging.getLogger("ctrps.tls")

_MAX_REASONS = 32
"""Distinct reasons counted (they become metric labels); more count as ``other``."""


@dataclass(frozen=True)
class TlsFiles:
    """Paths of a process's TLS files; empty strings for those not given."""

    cert: str = ""
    """PEM certificate (chain) this process serves with, or presents as a client."""
    key: str = ""
    """PEM private key of `cert`."""
    ca: str = ""
    """PEM CA bundle peers are verified against; empty: the system's CAs."""
    require_client_cert: bool = False
    """Servers refuse clients without a certificate signed by `ca` (mutual TLS)."""

    @property
    def serves(self) -> bool:
        """Whether this process serves TLS (it has a certificate and key)."""
        return bool(self.cert and self.key)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context with `files`' certificate; verifies clients against
    `files.ca` when mutual TLS is asked for. Raises OSError/ssl.SSLError for
    unreadable or mismatched files."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert, files.key)
    if files.require_client_cert:
        if not files.ca:
            raise ValueError("mutual TLS needs a CA to verify client certificates against")
        ctx.load_verify_locations(files.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A client context that verifies servers (against `files.ca`, else the
    system's CAs) and presents `files`' certificate when it has one."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=files.ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if files.cert and files.key:
        ctx.load_cert_chain(files.cert, files.key)
    return ctx


class HandshakeFailures:
    """A server's failed TLS handshakes: counted by OpenSSL's reason
    (``http_request``, ``wrong_version_number``,
    ``peer_did_not_return_a_certificate``, ...), one log line per reason
    (the first at once, then at most one a minute with the count)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self._log = logger
        self._lines: dict[str, Occurrences] = {}
        self.counts: dict[str, int] = {}

    def record(self, exc: ssl.SSLError) -> None:
        """Count one failed handshake."""
        reason = str(exc.reason or type(exc).__name__).lower()
        if reason not in self.counts and len(self.counts) >= _MAX_REASONS:
            reason = "other"
        self.counts[reason] = self.counts.get(reason, 0) + 1
        line = self._lines.get(reason)
        if line is None:
            line = self._lines[reason] = Occurrences(self._log, f"tls: refused a handshake ({reason})")
        line.happened()

    def stats(self) -> dict[str, Any]:
        """``{"handshake_failures": {reason: n}}`` for the stats and metrics."""
        return {"handshake_failures": dict(self.counts)}


def watch_handshakes(ctx: ssl.SSLContext, failures: HandshakeFailures) -> ssl.SSLContext:
    """Have `ctx`'s connections report failed handshakes to `failures`; returns `ctx`.

    Both asyncio's and uvloop's TLS create their connections with
    `ssl.SSLContext.wrap_bio`, which builds `ctx.sslobject_class`: a subclass
    that sees the handshake's error before the loop drops it."""

    class _WatchedHandshake(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise  # the handshake goes on
            except ssl.SSLError as exc:
                failures.record(exc)
                raise

    ctx.sslobject_class = _WatchedHandshake
    return ctx
