"""TLS contexts for the ports ctrps serves and the connections it opens.

One set of files per process: a certificate and key it serves with (and
presents as a client when the far side asks for one), and a CA bundle it
verifies peers against. Servers ask for client certificates only when told
(`server_context(..., require_client_cert=True)`: mutual TLS).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

__all__ = ["TlsFiles", "client_context", "server_context"]


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
