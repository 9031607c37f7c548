"""Credentials of the shard plane: one cluster secret, scoped tokens derived from it.

The shards hold the cluster secret; every other process holds only the token
of the scope it needs, derived from the secret with HMAC-SHA256, so a token
given to a serving replica cannot train, and none of them can be turned back
into the secret. Scopes are ordered, each including the ones below it:

- ``read``: pulls, table listing, stats, the status board and the exports'
  listing (the API's predictions, replicas' sources);
- ``train``: pushes, leases and the coordinator's offsets, declaring the
  model's tables and reporting to the status board (the workers);
- ``admin``: snapshots, exports, compaction, membership and restores (the
  exporter, ``ctrps export``, the API's admin routes, shard 0).

A token is ``<scope>.<mac>`` (the mac in unpadded base64url), sent as
``Authorization: Bearer <token>`` over HTTP and in the RPC's hello. Tokens
are compared in constant time (`hmac.compare_digest`); no token or secret is
ever logged or put in an error.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac
import logging
import secrets
import time
from typing import Any

__all__ = [
    "MIN_SECRET_BYTES",
    "Refusals",
    "Scope",
    "TokenVerifier",
    "bearer",
    "check",
    "derive_token",
    "new_secret",
    "token_from_header",
]

MIN_SECRET_BYTES = 16
"""The shortest cluster secret accepted: 128 bits."""

_CONTEXT = b"ctrps shard token v1:"


class Scope(enum.IntEnum):
    """What a token may do; a higher scope includes every lower one."""

    READ = 1
    TRAIN = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, text: str) -> Scope:
        """``read``, ``train`` or ``admin``; ValueError otherwise."""
        try:
            return cls[text.strip().upper()]
        except KeyError:
            raise ValueError(f"scope {text!r} is not read, train or admin") from None


def new_secret() -> str:
    """A fresh cluster secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _check_secret(secret: str) -> bytes:
    raw = secret.encode("utf-8")
    if len(raw) < MIN_SECRET_BYTES:
        raise ValueError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
    return raw


def derive_token(secret: str, scope: Scope) -> str:
    """The token of `scope` under the cluster `secret`."""
    mac = hmac.new(_check_secret(secret), _CONTEXT + scope.label.encode("ascii"), hashlib.sha256).digest()
    return f"{scope.label}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode('ascii')}"


class TokenVerifier:
    """Checks presented tokens against a cluster secret (held by the shards)."""

    def __init__(self, secret: str) -> None:
        self._expected = {scope: derive_token(secret, scope).encode("ascii") for scope in Scope}

    def scope_of(self, token: str | bytes | None) -> Scope | None:
        """The scope `token` grants, or None for a missing or wrong token.

        Every scope's token is compared, in constant time, whatever matches,
        so the time taken says nothing about how much of a token was right."""
        if not token:
            return None
        presented = token.encode("utf-8", "replace") if isinstance(token, str) else bytes(token)
        granted: Scope | None = None
        for scope, expected in self._expected.items():
            if hmac.compare_digest(presented, expected):
                granted = scope
        return granted

    def token(self, scope: Scope) -> str:
        """This secret's token of `scope` (for a shard that calls other shards)."""
        return self._expected[scope].decode("ascii")


def bearer(token: str) -> dict[str, str]:
    """The header that presents `token` (none for an empty token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def token_from_header(value: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not value:
        return None
    kind, _, token = value.partition(" ")
    if kind.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Refusals:
    """Counts a server's refused credentials and logs them without flooding.

    Per reason, the first refusal is logged at once; after it, at most one
    line per `every_s`, saying how many of that reason were refused since its
    last line (so a misconfigured worker's ``wrong`` token does not hide a
    stranger's ``missing`` one). Reasons: ``missing`` (no token), ``wrong``
    (a token no scope has), ``scope`` (a valid token of too low a scope). No
    token is ever part of a line."""

    def __init__(self, log: logging.Logger, *, every_s: float = 10.0) -> None:
        self._log = log
        self._every_s = every_s
        self.counts: dict[str, int] = {"missing": 0, "wrong": 0, "scope": 0}
        self._last_line: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def refuse(self, reason: str, *, plane: str, peer: str, what: str, needs: Scope) -> None:
        """Count one refusal (of `what`, from `peer`) and log it if it is time."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        self._unlogged[reason] = unlogged = self._unlogged.get(reason, 0) + 1
        now = time.monotonic()
        if now - self._last_line.get(reason, -float("inf")) < self._every_s:
            return
        self._last_line[reason] = now
        self._unlogged[reason] = 0
        self._log.warning(
            "credentials refused",
            extra={
                "fields": {
                    "plane": plane,
                    "reason": reason,
                    "peer": peer,
                    "request": what,
                    "needs": needs.label,
                    "refused": unlogged,
                    "refused_total": self.counts[reason],
                }
            },
        )

    def stats(self) -> dict[str, Any]:
        """``{"refused": {reason: n}}`` for the shard's stats (and metrics)."""
        return {"refused": dict(self.counts)}


def check(verifier: TokenVerifier | None, token: str | bytes | None, needs: Scope) -> tuple[str, Scope | None]:
    """Whether `token` may do what needs `needs`: ("", scope) when it may
    (scope None on an open server), else (reason, scope granted)."""
    if verifier is None:
        return "", None
    if not token:
        return "missing", None
    granted = verifier.scope_of(token)
    if granted is None:
        return "wrong", None
    if granted < needs:
        return "scope", granted
    return "", granted
