"""Security settings shared by every role: the shard plane's credentials and TLS.

Secrets come from the environment or a file, never from a flag (a flag shows
in ``ps``):

- ``CTRPS_CLUSTER_SECRET`` or ``CTRPS_CLUSTER_SECRET_FILE``: the cluster
  secret, held by the shards (they verify every token with it). A client
  role given the secret derives the token of the scope it needs.
- ``CTRPS_SHARD_TOKEN`` or ``CTRPS_SHARD_TOKEN_FILE``: a scoped token
  (`ctrps token --scope ...`), held by the roles that call the shards.

TLS files are paths (``--tls-cert``, ``--tls-key``, ``--tls-ca``,
``--tls-client-auth``, or ``CTRPS_TLS_CERT``/``_KEY``/``_CA``/``_CLIENT_AUTH``).

`ctrps cluster` and `ctrps demo` make an admin token for their API when none
is given (`generated_admin_token`): written to a file only this user reads,
removed when the command ends.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import shutil
import ssl
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ps_core.net.auth import MIN_SECRET_BYTES, Scope, TokenVerifier, derive_token, new_secret
from ps_core.net.tls import TlsFiles, client_context, server_context

from .config.declared import SettingsError

__all__ = ["SecuritySettings", "add_security_flags", "is_loopback", "GeneratedToken", "generated_admin_token"]


def _secret_from(env: Mapping[str, str], key: str) -> str:
    """``KEY`` or the contents of the file named by ``KEY_FILE`` (stripped), else ""."""
    value = env.get(key, "")
    path = env.get(f"{key}_FILE", "")
    if value and path:
        raise SettingsError(f"set {key} or {key}_FILE, not both")
    if path:
        try:
            value = Path(path).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise SettingsError(f"{key}_FILE={path!r} cannot be read: {exc.strerror or exc}") from None
        if not value:
            raise SettingsError(f"{key}_FILE={path!r} is empty")
    return value.strip()


@dataclass(frozen=True)
class GeneratedToken:
    """An admin token made for one run, and the file that holds it."""

    token: str = field(repr=False)
    path: Path
    """Mode 0600, in a directory of mode 0700 made for it."""


@contextlib.contextmanager
def generated_admin_token(command: str) -> Iterator[GeneratedToken]:
    """A new admin token (256 random bits) in ``<tmp>/ctrps-<command>-*/admin-token``,
    readable by this user only; the directory is removed on exit (a token of
    an ended run opens nothing: the next run makes another)."""
    directory = Path(tempfile.mkdtemp(prefix=f"ctrps-{command}-"))  # mode 0700
    try:
        token = new_secret()
        path = directory / "admin-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(token + "\n")
        yield GeneratedToken(token, path)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def add_security_flags(parser: argparse.ArgumentParser, *, serves: bool = True) -> None:
    """The TLS flags (and ``--insecure`` for a role that listens)."""
    group = parser.add_argument_group("security (secrets: CTRPS_CLUSTER_SECRET[_FILE], CTRPS_SHARD_TOKEN[_FILE])")
    group.add_argument("--tls-cert", help="PEM certificate to serve with (and present to servers that ask)")
    group.add_argument("--tls-key", help="PEM private key of --tls-cert")
    group.add_argument("--tls-ca", help="PEM CA bundle that peers' certificates are verified against")
    if serves:
        group.add_argument(
            "--tls-client-auth",
            action="store_true",
            default=None,
            help="require client certificates signed by --tls-ca (mutual TLS)",
        )
        group.add_argument(
            "--insecure",
            action="store_true",
            default=None,
            help="allow listening on a non-loopback address without credentials",
        )


@dataclass(frozen=True)
class SecuritySettings:
    """A role's credentials and TLS files (see the module's docstring)."""

    cluster_secret: str = field(default="", repr=False)
    """The cluster secret (shards; optional for clients, which derive their token)."""
    shard_token: str = field(default="", repr=False)
    """A scoped token to present to the shards."""
    tls: TlsFiles = TlsFiles()
    """TLS files: served with when a cert and key are given; peers verified against the CA."""
    insecure: bool = False
    """Listen on a non-loopback address without credentials (``--insecure``)."""

    def __post_init__(self) -> None:
        if self.cluster_secret and len(self.cluster_secret.encode("utf-8")) < MIN_SECRET_BYTES:
            raise SettingsError(f"the cluster secret must be at least {MIN_SECRET_BYTES} bytes")
        if bool(self.tls.cert) != bool(self.tls.key):
            raise SettingsError("--tls-cert and --tls-key go together")
        if self.tls.require_client_cert and not (self.tls.ca and self.tls.serves):
            raise SettingsError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
        for name in ("cert", "key", "ca"):
            path = getattr(self.tls, name)
            if path and not os.access(path, os.R_OK):
                raise SettingsError(f"--tls-{name} {path!r} cannot be read")

    @classmethod
    def from_args(cls, args: argparse.Namespace | None, env: Mapping[str, str] = os.environ) -> SecuritySettings:
        """Flags (where the parser has them and they were given) over variables."""

        def pick(flag: str, key: str) -> str:
            value = getattr(args, flag, None) if args is not None else None
            return str(value) if value else env.get(key, "")

        def pick_bool(flag: str, key: str) -> bool:
            value = getattr(args, flag, None) if args is not None else None
            if value is not None:
                return bool(value)
            return env.get(key, "").strip().lower() in ("1", "true", "yes", "on")

        return cls(
            cluster_secret=_secret_from(env, "CTRPS_CLUSTER_SECRET"),
            shard_token=_secret_from(env, "CTRPS_SHARD_TOKEN"),
            tls=TlsFiles(
                cert=pick("tls_cert", "CTRPS_TLS_CERT"),
                key=pick("tls_key", "CTRPS_TLS_KEY"),
                ca=pick("tls_ca", "CTRPS_TLS_CA"),
                require_client_cert=pick_bool("tls_client_auth", "CTRPS_TLS_CLIENT_AUTH"),
            ),
            insecure=pick_bool("insecure", "CTRPS_INSECURE"),
        )

    def server_tls(self) -> ssl.SSLContext | None:
        """The context this role serves TLS with (None: no certificate given).
        Files that do not load (a key of another certificate, not PEM) are a
        `SettingsError` naming them, not a traceback."""
        if not self.tls.serves:
            return None
        try:
            return server_context(self.tls)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            files = f"--tls-cert {self.tls.cert!r} with --tls-key {self.tls.key!r}"
            if self.tls.require_client_cert:
                files += f" and --tls-ca {self.tls.ca!r}"
            raise SettingsError(f"{files} cannot be loaded: {exc}") from None

    def client_tls(self) -> ssl.SSLContext | None:
        """The context this role verifies ``https://`` peers with (and presents
        its certificate in): None when it has neither a CA nor a certificate
        (the system's CAs). Files that do not load are a `SettingsError`."""
        if not (self.tls.ca or self.tls.serves):
            return None
        try:
            return client_context(self.tls)
        except (OSError, ValueError) as exc:
            files = f"--tls-ca {self.tls.ca!r}" if self.tls.ca else ""
            if self.tls.serves:
                files += (" or " if files else "") + f"--tls-cert {self.tls.cert!r} with --tls-key {self.tls.key!r}"
            raise SettingsError(f"{files} cannot be loaded: {exc}") from None

    def token_for(self, scope: Scope) -> str:
        """The token this role presents when it needs `scope`: the given
        token, else one derived from the cluster secret, else "" (none)."""
        if self.shard_token:
            return self.shard_token
        if self.cluster_secret:
            return derive_token(self.cluster_secret, scope)
        return ""

    def verifier(self) -> TokenVerifier | None:
        """What a shard checks tokens with; None when it has no secret (open)."""
        return TokenVerifier(self.cluster_secret) if self.cluster_secret else None

    def check_exposed(
        self, role: str, host: str, *, has_credentials: bool, hint: str = "set CTRPS_CLUSTER_SECRET (or _FILE)"
    ) -> None:
        """Refuse (SettingsError, exit 2) to listen on a non-loopback `host`
        without credentials unless ``--insecure`` was given."""
        if has_credentials or self.insecure or is_loopback(host):
            return
        raise SettingsError(f"{role} would listen on {host} with no credentials: {hint}, or pass --insecure")
