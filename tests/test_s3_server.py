"""The S3 server fixture (`s3_endpoint`: moto's server in a subprocess) through
the client library exports to object storage use (obstore, the ``s3`` extra):
an object written is read back whole, a create-only PUT of an existing key
is refused (what keeps a manifest written last from being overwritten), and
the credentials come from the AWS environment variables the fixture yields."""

from __future__ import annotations

import os

import pytest
from s3_server import S3Endpoint

obstore = pytest.importorskip("obstore", reason="obstore is not installed (the s3 extra)")
from obstore.exceptions import AlreadyExistsError, PreconditionError  # noqa: E402
from obstore.store import S3Store  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.process]


def store_from_env(endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch) -> S3Store:
    """A store given only the bucket and endpoint: the keys come from the environment."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in endpoint.env.items():
        monkeypatch.setenv(name, value)
    return S3Store(endpoint.bucket, endpoint=endpoint.url, client_options={"allow_http": True})


async def test_an_object_round_trips_and_a_create_only_put_is_refused(
    s3_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = store_from_env(s3_endpoint, monkeypatch)
    data = os.urandom(12 << 20)  # past obstore's 5 MB chunk: a multipart upload
    await obstore.put_async(store, "m/0000000001/shard-0.npz", data)
    got = await obstore.get_async(store, "m/0000000001/shard-0.npz")
    assert bytes(await got.bytes_async()) == data

    await obstore.put_async(store, "m/0000000001/manifest.json", b"{}", mode="create")
    with pytest.raises((AlreadyExistsError, PreconditionError)):
        await obstore.put_async(store, "m/0000000001/manifest.json", b'{"other": 1}', mode="create")
    got = await obstore.get_async(store, "m/0000000001/manifest.json")
    assert bytes(await got.bytes_async()) == b"{}"
