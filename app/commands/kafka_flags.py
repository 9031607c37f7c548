"""The Kafka security flags of every command that talks to Kafka, and the
`consumers.kafka_security.KafkaSecurity` they build.

Each flag falls back to a variable: ``--kafka-security-protocol``
(``CTRPS_KAFKA_SECURITY_PROTOCOL``), ``--kafka-sasl-mechanism``
(``CTRPS_KAFKA_SASL_MECHANISM``), ``--kafka-sasl-username``
(``CTRPS_KAFKA_SASL_USERNAME``), ``--kafka-ssl-ca`` / ``--kafka-ssl-cert`` /
``--kafka-ssl-key`` (``CTRPS_KAFKA_SSL_CA`` / ``_CERT`` / ``_KEY``) and
``--kafka-ssl-no-check-hostname`` (``CTRPS_KAFKA_SSL_CHECK_HOSTNAME=0``).
The password has no flag (a flag shows in ``ps``): ``CTRPS_KAFKA_SASL_PASSWORD``
or the file named by ``CTRPS_KAFKA_SASL_PASSWORD_FILE``.

A composition (``ctrps cluster``) hands its settings to the children that
talk to Kafka (workers, the producer) as flags, and the password in their
environment only; the other children get no password at all.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from consumers.kafka_security import MECHANISMS, PROTOCOLS, KafkaSecurity, KafkaSecurityError

from ..config.declared import SettingsError
from ..security import _secret_from

__all__ = [
    "add_kafka_security_flags",
    "kafka_security_from",
    "kafka_child_argv",
    "kafka_child_env",
    "PASSWORD_VARS",
]

PASSWORD_VARS = ("CTRPS_KAFKA_SASL_PASSWORD", "CTRPS_KAFKA_SASL_PASSWORD_FILE")
"""Where the SASL password comes from (never a flag)."""

_FLAGS = (
    # (attribute, flag, variable, help)
    ("kafka_security_protocol", "--kafka-security-protocol", "CTRPS_KAFKA_SECURITY_PROTOCOL",
     f"{' | '.join(PROTOCOLS)} (default PLAINTEXT)"),
    ("kafka_sasl_mechanism", "--kafka-sasl-mechanism", "CTRPS_KAFKA_SASL_MECHANISM",
     f"{' | '.join(MECHANISMS)} (default PLAIN)"),
    ("kafka_sasl_username", "--kafka-sasl-username", "CTRPS_KAFKA_SASL_USERNAME", "SASL username"),
    ("kafka_ssl_ca", "--kafka-ssl-ca", "CTRPS_KAFKA_SSL_CA",
     "PEM CA bundle the brokers are verified against (default: the system's CAs)"),
    ("kafka_ssl_cert", "--kafka-ssl-cert", "CTRPS_KAFKA_SSL_CERT",
     "PEM client certificate, for brokers that require one"),
    ("kafka_ssl_key", "--kafka-ssl-key", "CTRPS_KAFKA_SSL_KEY", "PEM private key of --kafka-ssl-cert"),
)  # fmt: skip


def add_kafka_security_flags(parser: argparse.ArgumentParser) -> None:
    """The Kafka security flags, in a group of their own."""
    group = parser.add_argument_group("Kafka security (SASL password: CTRPS_KAFKA_SASL_PASSWORD[_FILE])")
    for _, flag, key, help_ in _FLAGS:
        metavar = "PEM" if "-ssl-" in flag else flag.rsplit("-", 1)[1].upper()
        group.add_argument(flag, metavar=metavar, help=f"{help_}; {key}")
    group.add_argument(
        "--kafka-ssl-no-check-hostname", action="store_true", default=None,
        help="verify the brokers' certificates against the CA but not the host name in them; "
        "CTRPS_KAFKA_SSL_CHECK_HOSTNAME=0",
    )  # fmt: skip


def kafka_security_from(args: argparse.Namespace | None, env: Mapping[str, str] = os.environ) -> KafkaSecurity:
    """Flags (where the parser has them and they were given) over ``CTRPS_KAFKA_*``
    over defaults; `SettingsError` (exit 2, one line) when unusable."""

    def pick(attr: str, key: str) -> str:
        value = getattr(args, attr, None) if args is not None else None
        return str(value) if value else env.get(key, "").strip()

    given = {attr: pick(attr, key) for attr, _, key, _ in _FLAGS}
    no_check = getattr(args, "kafka_ssl_no_check_hostname", None) if args is not None else None
    check_hostname = True
    if no_check:
        check_hostname = False
    elif raw := env.get("CTRPS_KAFKA_SSL_CHECK_HOSTNAME", "").strip().lower():
        if raw not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            raise SettingsError(f"CTRPS_KAFKA_SSL_CHECK_HOSTNAME={raw!r} is not 0 or 1")
        check_hostname = raw in ("1", "true", "yes", "on")
    try:
        return KafkaSecurity(
            security_protocol=(given["kafka_security_protocol"] or "PLAINTEXT").upper(),
            sasl_mechanism=(given["kafka_sasl_mechanism"] or "PLAIN").upper(),
            sasl_username=given["kafka_sasl_username"],
            sasl_password=_secret_from(env, "CTRPS_KAFKA_SASL_PASSWORD"),
            ssl_ca=given["kafka_ssl_ca"],
            ssl_cert=given["kafka_ssl_cert"],
            ssl_key=given["kafka_ssl_key"],
            ssl_check_hostname=check_hostname,
        )
    except KafkaSecurityError as exc:
        raise SettingsError(str(exc)) from None


def kafka_child_argv(security: KafkaSecurity) -> list[str]:
    """The flags that give a child command `security` (all but the password)."""
    if security.security_protocol == "PLAINTEXT":
        return []
    argv = ["--kafka-security-protocol", security.security_protocol]
    if security.uses_sasl:
        argv += ["--kafka-sasl-mechanism", security.sasl_mechanism, "--kafka-sasl-username", security.sasl_username]
    if security.uses_tls:
        for flag, path in (
            ("--kafka-ssl-ca", security.ssl_ca),
            ("--kafka-ssl-cert", security.ssl_cert),
            ("--kafka-ssl-key", security.ssl_key),
        ):
            if path:
                argv += [flag, os.path.abspath(path)]
        if not security.ssl_check_hostname:
            argv.append("--kafka-ssl-no-check-hostname")
    return argv


def kafka_child_env(
    security: KafkaSecurity, *, talks_to_kafka: bool, env: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """A child's environment: `env` without the SASL password, and, for a child
    that talks to Kafka, the password (read here, once) in ``CTRPS_KAFKA_SASL_PASSWORD``."""
    out = {k: v for k, v in env.items() if k not in PASSWORD_VARS}
    if talks_to_kafka and security.sasl_password:
        out["CTRPS_KAFKA_SASL_PASSWORD"] = security.sasl_password
    return out
