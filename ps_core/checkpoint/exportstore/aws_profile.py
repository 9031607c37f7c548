"""An AWS profile's keys and region from the shared files, as AWS's own tools read them.

obstore reads the AWS environment variables, web identity (IRSA), container
and instance credentials, but not ``~/.aws/credentials`` or
``~/.aws/config``. A user who has run ``aws configure`` expects those to
work, so `profile_settings` reads them: the profile ``AWS_PROFILE`` names
(else ``default``) from ``AWS_SHARED_CREDENTIALS_FILE`` (default
``~/.aws/credentials``), then from ``AWS_CONFIG_FILE`` (default
``~/.aws/config``, where the section is ``[profile NAME]``, or
``[default]``).

The order: keys in the environment win over the files, and the files over
obstore's other sources. A region comes from ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, else the profile's. A profile named in
``AWS_PROFILE`` that neither file holds is an error, never a silent fall
back to other credentials.
"""

from __future__ import annotations

import configparser
from collections.abc import Mapping
from pathlib import Path

from .base import ExportStoreError

__all__ = ["profile_settings"]

_KEYS = {"aws_access_key_id": "access_key_id", "aws_secret_access_key": "secret_access_key"}
_TOKEN = ("aws_session_token", "session_token")


def _read(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(path.read_text())
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError, configparser.Error) as exc:
        raise ExportStoreError(f"cannot read AWS file {path}: {type(exc).__name__}: {exc}") from None
    return parser


def _file(env: Mapping[str, str], variable: str, default: str) -> Path:
    given = env.get(variable)
    if given:
        return Path(given).expanduser()
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".aws" / default


def profile_settings(env: Mapping[str, str]) -> dict[str, str]:
    """obstore `S3Store` settings from the AWS shared files for `env`'s
    profile: ``access_key_id``, ``secret_access_key``, ``session_token``
    unless the environment holds keys, and ``region`` unless it names one.
    Empty when the files hold nothing for the default profile."""
    named = env.get("AWS_PROFILE") or env.get("AWS_DEFAULT_PROFILE")
    profile = named or "default"
    credentials_path = _file(env, "AWS_SHARED_CREDENTIALS_FILE", "credentials")
    config_path = _file(env, "AWS_CONFIG_FILE", "config")
    credentials, config = _read(credentials_path), _read(config_path)
    config_section = "default" if profile == "default" else f"profile {profile}"
    sections = [
        dict(parser[name])
        for parser, name in ((credentials, profile), (config, config_section))
        if parser.has_section(name)
    ]
    if named and not sections:
        raise ExportStoreError(f"AWS profile {profile!r} is in neither {credentials_path} nor {config_path}")
    out: dict[str, str] = {}
    if not env.get("AWS_ACCESS_KEY_ID"):
        for section in sections:  # the credentials file first
            if all(section.get(k) for k in _KEYS):
                out = {ours: section[theirs] for theirs, ours in _KEYS.items()}
                if section.get(_TOKEN[0]):
                    out[_TOKEN[1]] = section[_TOKEN[0]]
                break
        else:
            if named:
                raise ExportStoreError(
                    f"AWS profile {profile!r} has no aws_access_key_id and aws_secret_access_key "
                    f"in {credentials_path} or {config_path}"
                )
    if not (env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION")):
        region = next((s["region"] for s in sections if s.get("region")), None)
        if region:
            out["region"] = region
    return out
