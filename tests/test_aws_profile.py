"""Exports on a bucket take an AWS profile's keys and region from the shared
files (``~/.aws/credentials``, ``~/.aws/config``), as AWS's own tools do,
when the environment holds none (`ps_core.checkpoint.exportstore.aws_profile`);
and a store made that way reads and writes the real S3-protocol server."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
from s3_server import S3Endpoint

from ps_core.checkpoint.exportstore import ExportStoreError, S3ExportStore
from ps_core.checkpoint.exportstore.aws_profile import profile_settings


def _files(tmp_path: Path, credentials: str = "", config: str = "") -> dict[str, str]:
    """An environment whose shared files are these (and nothing of the machine's)."""
    (tmp_path / "credentials").write_text(credentials)
    (tmp_path / "config").write_text(config)
    return {
        "HOME": str(tmp_path / "home"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
    }


def test_the_default_profile_gives_its_keys_token_and_region(tmp_path: Path) -> None:
    env = _files(
        tmp_path,
        "[default]\naws_access_key_id = AKIDFILE\naws_secret_access_key = SECRETFILE\naws_session_token = TOKENFILE\n",
        "[default]\nregion = eu-west-3\n",
    )
    assert profile_settings(env) == {
        "access_key_id": "AKIDFILE",
        "secret_access_key": "SECRETFILE",
        "session_token": "TOKENFILE",
        "region": "eu-west-3",
    }


def test_a_named_profile_is_read_from_the_config_files_profile_section(tmp_path: Path) -> None:
    env = _files(
        tmp_path,
        "[default]\naws_access_key_id = A\naws_secret_access_key = B\n",
        "[profile ml]\naws_access_key_id = AKIDML\naws_secret_access_key = SECRETML\nregion = ap-south-1\n",
    )
    env["AWS_PROFILE"] = "ml"
    assert profile_settings(env) == {"access_key_id": "AKIDML", "secret_access_key": "SECRETML", "region": "ap-south-1"}


def test_the_environment_wins_over_the_files(tmp_path: Path) -> None:
    env = _files(tmp_path, "[default]\naws_access_key_id = A\naws_secret_access_key = B\n", "[default]\nregion = x-1\n")
    env["AWS_ACCESS_KEY_ID"] = "FROMENV"
    assert profile_settings(env) == {"region": "x-1"}  # obstore reads the environment's keys itself
    env["AWS_REGION"] = "us-west-2"
    assert profile_settings(env) == {}


def test_no_files_and_no_profile_named_is_nothing(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "absent")}
    assert profile_settings(env) == {}  # then web identity, container or instance credentials


def test_a_named_profile_the_files_lack_is_an_error_naming_them(tmp_path: Path) -> None:
    env = _files(tmp_path, "[default]\naws_access_key_id = A\naws_secret_access_key = B\n")
    env["AWS_PROFILE"] = "prod"
    with pytest.raises(ExportStoreError, match="AWS profile 'prod' is in neither") as err:
        profile_settings(env)
    assert str(tmp_path / "credentials") in str(err.value) and str(tmp_path / "config") in str(err.value)
    (tmp_path / "config").write_text("[profile prod]\nregion = eu-north-1\n")
    with pytest.raises(ExportStoreError, match="has no aws_access_key_id and aws_secret_access_key"):
        profile_settings(env)


def test_an_unreadable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    env = _files(tmp_path, "aws_access_key_id = outside any section\n")
    with pytest.raises(ExportStoreError, match="cannot read AWS file .*credentials"):
        profile_settings(env)


@pytest.mark.slow
def test_a_store_with_keys_only_in_the_credentials_file_reads_and_writes_the_bucket(
    s3_endpoint: S3Endpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = _files(
        tmp_path,
        f"[ml]\naws_access_key_id = {s3_endpoint.key_id}\naws_secret_access_key = {s3_endpoint.secret}\n",
        "[profile ml]\nregion = us-east-1\n",
    )
    for name, value in {**env, "AWS_PROFILE": "ml", "AWS_ENDPOINT_URL": s3_endpoint.url}.items():
        monkeypatch.setenv(name, value)
    store = S3ExportStore(s3_endpoint.bucket, f"run-{secrets.token_hex(4)}")
    assert store.client.config.get("access_key_id") == s3_endpoint.key_id  # the file's, not the environment's
    assert store.write_object("probe", b"from a profile", replace=False)
    assert store.read_object("probe") == b"from a profile"
