"""How the Kafka clients authenticate and encrypt: one frozen `KafkaSecurity`
handed to every consumer, producer and admin client ctrps builds.

- ``security_protocol``: ``PLAINTEXT`` (the default), ``SSL``,
  ``SASL_PLAINTEXT`` or ``SASL_SSL``, as Kafka names them.
- ``sasl_mechanism``: ``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512``,
  with a username and a password (the password is never in a repr or a log).
- TLS: the CA bundle the brokers' certificates are verified against (the
  system's CAs when none is given), and a client certificate and key for
  brokers that require one. Host names are checked unless turned off.

`KafkaSecurity.client_kwargs` gives the keyword arguments of aiokafka's
``AIOKafkaConsumer``, ``AIOKafkaProducer`` and ``AIOKafkaAdminClient``
(``security_protocol``, ``ssl_context``, ``sasl_mechanism``,
``sasl_plain_username``, ``sasl_plain_password``: the SCRAM mechanisms take
their credentials from the ``sasl_plain_*`` arguments too).

`check_access` makes one connection with these settings and turns a failed
TLS handshake or SASL exchange into one clear `KafkaAccessError`: the Kafka
client itself reports either as "Unable to bootstrap" and retries it forever.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import ssl
from dataclasses import dataclass, field
from typing import Any

from aiokafka.errors import KafkaError

from ps_core.net.tls import TlsFiles, client_context
from ps_core.waits import within

__all__ = [
    "KafkaSecurity",
    "KafkaSecurityError",
    "KafkaAccessError",
    "PROTOCOLS",
    "MECHANISMS",
    "check_access",
]

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
"""Kafka's security protocols."""
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""The SASL mechanisms offered (GSSAPI and OAUTHBEARER need more than a password)."""


class _RedactSasl(logging.Filter):
    """aiokafka logs every request and response at DEBUG, the SASL exchange
    included: a PLAIN login's bytes hold the password. Such a record's
    SASL structure is replaced by its name before any handler sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and any(type(a).__name__.startswith("SaslAuthenticate") for a in args):
            record.args = tuple(
                f"{type(a).__name__}(<redacted>)" if type(a).__name__.startswith("SaslAuthenticate") else a
                for a in args
            )
        return True


_REDACT = _RedactSasl()
# On the logger that writes them (a logger's filters apply to its own records
# only): installed on import, i.e. before any client that could log them exists.
logging.getLogger("aiokafka.conn").addFilter(_REDACT)


class KafkaSecurityError(ValueError):
    """Unusable Kafka security settings: a usage error (exit code 2), one line."""

    exit_code = 2


class KafkaAccessError(Exception):
    """The broker refused these settings: the TLS handshake or the SASL
    authentication failed. An expected failure (exit code 1), one line."""

    exit_code = 1


@dataclass(frozen=True)
class KafkaSecurity:
    """The Kafka clients' security settings (see the module's docstring)."""

    security_protocol: str = "PLAINTEXT"
    """``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``."""
    sasl_mechanism: str = "PLAIN"
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (used by the SASL protocols)."""
    sasl_username: str = ""
    """The SASL username (required by the SASL protocols)."""
    sasl_password: str = field(default="", repr=False)
    """The SASL password (required by the SASL protocols); never shown."""
    ssl_ca: str = ""
    """PEM CA bundle the brokers are verified against; empty: the system's CAs."""
    ssl_cert: str = ""
    """PEM client certificate, for brokers that require one (with `ssl_key`)."""
    ssl_key: str = ""
    """PEM private key of `ssl_cert`."""
    ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host connected to."""

    def __post_init__(self) -> None:
        p = self.security_protocol
        if p not in PROTOCOLS:
            raise KafkaSecurityError(f"Kafka security protocol {p!r} is not one of {', '.join(PROTOCOLS)}")
        if self.sasl_mechanism not in MECHANISMS:
            raise KafkaSecurityError(
                f"Kafka SASL mechanism {self.sasl_mechanism!r} is not one of {', '.join(MECHANISMS)}"
            )
        if self.uses_sasl:
            if not self.sasl_username or not self.sasl_password:
                missing = " and ".join(
                    what
                    for what, given in (
                        ("a username (--kafka-sasl-username or CTRPS_KAFKA_SASL_USERNAME)", self.sasl_username),
                        (
                            "a password (CTRPS_KAFKA_SASL_PASSWORD or CTRPS_KAFKA_SASL_PASSWORD_FILE)",
                            self.sasl_password,
                        ),
                    )
                    if not given
                )
                raise KafkaSecurityError(f"Kafka security protocol {p} needs {missing}")
        elif self.sasl_username or self.sasl_password:
            # Credentials that would silently go unused are a mistake worth a line.
            raise KafkaSecurityError(
                f"a Kafka SASL username or password is set but the security protocol is {p}: "
                "use SASL_PLAINTEXT or SASL_SSL, or unset them"
            )
        files = {"--kafka-ssl-ca": self.ssl_ca, "--kafka-ssl-cert": self.ssl_cert, "--kafka-ssl-key": self.ssl_key}
        if not self.uses_tls:
            given = [flag for flag, path in files.items() if path]
            if given:
                raise KafkaSecurityError(
                    f"{', '.join(given)} set but the Kafka security protocol is {p}: use SSL or SASL_SSL"
                )
            return
        if bool(self.ssl_cert) != bool(self.ssl_key):
            raise KafkaSecurityError("--kafka-ssl-cert and --kafka-ssl-key go together")
        for flag, path in files.items():
            if not path:
                continue
            if not os.path.isfile(path):
                raise KafkaSecurityError(f"{flag} {path!r}: no such file")
            if not os.access(path, os.R_OK):
                raise KafkaSecurityError(f"{flag} {path!r} cannot be read")
        _ = self.ssl_context  # built now: a PEM that does not load is a settings error at start

    @property
    def uses_tls(self) -> bool:
        """Whether the connections are TLS (``SSL``, ``SASL_SSL``)."""
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        """Whether the connections authenticate with SASL."""
        return self.security_protocol.startswith("SASL_")

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext | None:
        """The clients' TLS context (one, shared by every client); None without TLS."""
        if not self.uses_tls:
            return None
        try:
            # The shard clients' context: the same verification, the same floor.
            ctx = client_context(TlsFiles(cert=self.ssl_cert, key=self.ssl_key, ca=self.ssl_ca))
        except (ssl.SSLError, OSError) as exc:
            raise KafkaSecurityError(f"Kafka TLS files do not load: {_reason(exc)}") from None
        # Still verified against the CA; only the name in the certificate is not checked.
        ctx.check_hostname = self.ssl_check_hostname
        return ctx

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's consumer, producer and admin client."""
        kwargs: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.uses_tls:
            kwargs["ssl_context"] = self.ssl_context
        if self.uses_sasl:
            kwargs.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        return kwargs

    def fields(self) -> dict[str, Any]:
        """What a log line may say about these settings (never the password)."""
        out: dict[str, Any] = {"kafka_security": self.security_protocol}
        if self.uses_sasl:
            out.update(kafka_sasl_mechanism=self.sasl_mechanism, kafka_sasl_username=self.sasl_username)
        if self.uses_tls:
            out["kafka_ssl_ca"] = self.ssl_ca or "system"
            if self.ssl_cert:
                out["kafka_ssl_cert"] = self.ssl_cert
        return out


def _reason(exc: BaseException) -> str:
    """An SSL or OS error's reason, short (the verify message where there is one)."""
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return f"certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason).replace("_", " ").lower()
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    return str(exc) or type(exc).__name__


def _servers(bootstrap: str) -> list[tuple[str, int]]:
    out = []
    for server in bootstrap.split(","):
        host, sep, port = server.strip().rpartition(":")
        if not sep or not port.isdigit():
            host, port = server.strip(), "9092"
        out.append((host.strip("[]"), int(port)))
    return out


async def check_access(bootstrap: str, security: KafkaSecurity, timeout_s: float = 10.0) -> None:
    """With TLS or SASL: connect once to the first of `bootstrap`'s servers
    that answers and raise `KafkaAccessError` when its TLS handshake or SASL
    authentication fails. A server that does not answer is not an error here
    (the caller waits for it as for any outage). Nothing to do for PLAINTEXT."""
    if security.security_protocol == "PLAINTEXT":
        return
    from aiokafka.conn import create_conn

    for host, port in _servers(bootstrap):
        where = f"{host}:{port}"
        try:
            conn = await within(
                create_conn(host, port, client_id="ctrps-check", request_timeout_ms=int(timeout_s * 1000),
                            **security.client_kwargs()),
                timeout_s,
            )  # fmt: skip
        except ssl.SSLError as exc:
            hint = "is --kafka-ssl-ca the CA that signed the broker's certificate?"
            if isinstance(exc, ssl.SSLCertVerificationError) and "mismatch" in (exc.verify_message or ""):
                hint = "the broker's certificate does not name this host; --kafka-ssl-no-check-hostname skips the check"
            raise KafkaAccessError(
                f"TLS handshake with the Kafka broker at {where} ({security.security_protocol}) failed: "
                f"{_reason(exc)} ({hint})"
            ) from None
        except (TimeoutError, ConnectionRefusedError, OSError):
            continue  # not there (yet): an outage, not a refusal
        except KafkaError as exc:
            name = type(exc).__name__
            if name == "UnsupportedSaslMechanismError":
                raise KafkaAccessError(
                    f"the Kafka broker at {where} does not offer SASL mechanism {security.sasl_mechanism} "
                    "(--kafka-sasl-mechanism)"
                ) from None
            if "Sasl" in name or "Authentication" in name or "Authorization" in name:
                raise KafkaAccessError(
                    f"SASL authentication as {security.sasl_username!r} ({security.sasl_mechanism}) with the "
                    f"Kafka broker at {where} failed: {name}: {exc}"
                ) from None
            if name == "KafkaConnectionError":
                # It listens, yet closed the connection before answering.
                hint = (
                    "does it require a client certificate, --kafka-ssl-cert/--kafka-ssl-key, that it accepts?"
                    if security.uses_tls
                    else "does it expect TLS, --kafka-security-protocol SSL or SASL_SSL?"
                )
                raise KafkaAccessError(f"the Kafka broker at {where} closed the connection ({hint})") from None
            continue
        with contextlib.suppress(Exception):
            conn.close()
        return
