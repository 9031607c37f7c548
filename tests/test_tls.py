"""TLS on the shard's HTTP port, its RPC and the API (`ps_core.net.tls`), with a
throwaway CA (`trustme`), on real servers on loopback:

- a client given the CA (``--tls-ca``) verifies the shard and pulls and
  pushes over the RPC and over HTTP; the API answers ``/v1/predict`` over
  https;
- a client without the CA, with another CA, or for a name the certificate
  does not hold fails at once with `TlsVerifyError` naming ``--tls-ca``;
- plaintext to a TLS port gets nothing served;
- with mutual TLS (``--tls-client-auth``) a client without a certificate of
  the CA is refused, one with one is served;
- ``ctrps shard`` and ``ctrps serve`` (their role functions) with TLS and a
  cluster secret: a worker's client trains, shard 0 cuts an export across
  both shards over TLS, the API predicts over https.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import pytest
import trustme
from test_shard_auth import _ctrps, _env, _one_line
from waiting import until

from app.api import ApiServer
from app.config.serve import ApiSettings
from app.config.shard import ShardSettings
from app.roles.serve import run_serve
from app.roles.shard import run_shard
from app.security import SecuritySettings
from consumers.broker import free_port
from ps_core.checkpoint.control import ControlClient
from ps_core.errors import AuthError, ShardUnavailableError, TlsVerifyError
from ps_core.model.models import make_model
from ps_core.net.auth import Scope, TokenVerifier, derive_token, new_secret
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.rpc import RpcConnection, start_rpc_server
from ps_core.net.server import DEFAULT_MAX_BODY, create_shard_app, start_shard_site
from ps_core.net.tls import HandshakeFailures, TlsFiles, client_context, server_context, watch_handshakes
from ps_core.net.transports import TcpTransport
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

LR = TableConfig("ctr_lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})
KEYS = np.array([1, 2, 3, 2**63 + 5], dtype=np.uint64)
GRADS = np.array([-3.0, 2.0, -1.5, 4.0], dtype=np.float32)
PATIENT = RetryPolicy(deadline_s=120.0)
"""A deadline no verification failure may wait out (the calls are bounded by `BOUND_S`)."""
BOUND_S = 30.0
QUICK = RetryPolicy(deadline_s=0.3)
"""For connections that fail the same way every time (they are retried: a
reset is what a restarting shard looks like too)."""


@dataclass(frozen=True)
class Pki:
    """PEM files of a throwaway CA: a server certificate for 127.0.0.1 and
    localhost, a client certificate, and another CA's bundle and client."""

    ca: str
    server: str
    client: str
    other_ca: str
    other_client: str
    wrong_name: str
    """A server certificate of the CA for another host name."""


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    other.cert_pem.write_to_path(d / "other_ca.pem")
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(d / "server.pem")
    ca.issue_cert("worker-1").private_key_and_cert_chain_pem.write_to_path(d / "client.pem")
    other.issue_cert("worker-1").private_key_and_cert_chain_pem.write_to_path(d / "other_client.pem")
    ca.issue_cert("shard.elsewhere.example").private_key_and_cert_chain_pem.write_to_path(d / "wrong_name.pem")
    names = ("ca", "server", "client", "other_ca", "other_client", "wrong_name")
    return Pki(**{name: str(d / f"{name}.pem") for name in names})


def _served(pki: Pki, *, mutual: bool = False, cert: str = "") -> ssl.SSLContext:
    pem = cert or pki.server
    return server_context(TlsFiles(cert=pem, key=pem, ca=pki.ca, require_client_cert=mutual))


def _client(ca: str = "", cert: str = "") -> ssl.SSLContext:
    return client_context(TlsFiles(cert=cert, key=cert, ca=ca))


@dataclass
class TlsShard:
    url: str
    rpc_port: int
    shard: Shard
    tokens: dict[Scope, str]
    handshakes: HandshakeFailures


async def _tls_shard(pki: Pki, *, mutual: bool = False, cert: str = "") -> AsyncIterator[TlsShard]:
    secret = new_secret()
    verifier = TokenVerifier(secret)
    shard = Shard(ShardSpec(0, 1), [LR])
    ctx = _served(pki, mutual=mutual, cert=cert)
    handshakes = HandshakeFailures()
    watch_handshakes(ctx, handshakes)
    rpc = await start_rpc_server(shard, "127.0.0.1", 0, max_body=DEFAULT_MAX_BODY, verifier=verifier, ssl=ctx)
    site = await start_shard_site(
        create_shard_app(shard, rpc_port=rpc.port, verifier=verifier), "127.0.0.1", 0, ssl_context=ctx
    )
    try:
        yield TlsShard(
            f"https://127.0.0.1:{site.port}", rpc.port, shard, {s: derive_token(secret, s) for s in Scope}, handshakes
        )
    finally:
        await rpc.close()
        await site.cleanup()


@pytest.fixture
async def tls_shard(pki: Pki) -> AsyncIterator[TlsShard]:
    async for s in _tls_shard(pki):
        yield s


@pytest.fixture
async def mtls_shard(pki: Pki) -> AsyncIterator[TlsShard]:
    async for s in _tls_shard(pki, mutual=True):
        yield s


async def _train_and_read(url: str, token: str, ctx: ssl.SSLContext, *, rpc: bool) -> None:
    async with (
        PSClient.connect([url], token=token, ssl=ctx, rpc=rpc, retry=PATIENT) as client,
        ControlClient.connect([url], token=token, ssl=ctx, retry=PATIENT) as control,
    ):
        assert await asyncio.wait_for(client.push("ctr_lr", KEYS, GRADS), BOUND_S) == KEYS.size
        got = await client.pull("ctr_lr", KEYS)
        assert np.count_nonzero(got) > 0
        assert (await control.stats())[0].tables["ctr_lr"].features == KEYS.size
        transport = client.transports[0]
        assert isinstance(transport, TcpTransport) is rpc
        assert not rpc or transport.uses_rpc  # type: ignore[attr-defined]


@pytest.mark.parametrize("rpc", [True, False], ids=["rpc", "http"])
async def test_a_client_with_the_ca_trains_over_tls(pki: Pki, tls_shard: TlsShard, rpc: bool) -> None:
    await _train_and_read(tls_shard.url, tls_shard.tokens[Scope.TRAIN], _client(pki.ca), rpc=rpc)
    assert len(tls_shard.shard.table("ctr_lr")) == KEYS.size


async def test_the_rpc_over_tls_still_needs_a_token(pki: Pki, tls_shard: TlsShard) -> None:
    with pytest.raises(AuthError):
        await RpcConnection.open("127.0.0.1", tls_shard.rpc_port, ssl=_client(pki.ca))
    conn = await RpcConnection.open(
        "127.0.0.1", tls_shard.rpc_port, token=tls_shard.tokens[Scope.READ], ssl=_client(pki.ca)
    )
    await conn.close()
    assert conn.hello.num_shards == 1


@pytest.mark.parametrize("rpc", [True, False], ids=["rpc", "http"])
async def test_a_client_without_the_ca_fails_at_once_naming_tls_ca(pki: Pki, tls_shard: TlsShard, rpc: bool) -> None:
    token = tls_shard.tokens[Scope.ADMIN]
    for ctx in (None, _client(pki.other_ca)):
        async with (
            PSClient.connect([tls_shard.url], token=token, ssl=ctx, rpc=rpc, retry=PATIENT) as client,
            ControlClient.connect([tls_shard.url], token=token, ssl=ctx, retry=PATIENT) as control,
        ):
            with pytest.raises(TlsVerifyError) as info:
                await asyncio.wait_for(client.pull("ctr_lr", KEYS), BOUND_S)
            assert "did not verify" in info.value.detail and "--tls-ca" in info.value.detail
            assert tls_shard.url in info.value.detail
            with pytest.raises(TlsVerifyError):
                await asyncio.wait_for(control.stats(), BOUND_S)
    # The RPC port alone verifies the same way.
    with pytest.raises(ssl.SSLCertVerificationError):
        await RpcConnection.open("127.0.0.1", tls_shard.rpc_port, token=token, ssl=_client(pki.other_ca))
    assert len(tls_shard.shard.table("ctr_lr")) == 0


async def test_a_certificate_for_another_name_does_not_verify(pki: Pki) -> None:
    async for s in _tls_shard(pki, cert=pki.wrong_name):
        async with PSClient.connect([s.url], token=s.tokens[Scope.READ], ssl=_client(pki.ca), retry=PATIENT) as c:
            with pytest.raises(TlsVerifyError) as info:
                await asyncio.wait_for(c.pull("ctr_lr", KEYS), BOUND_S)
        assert "127.0.0.1" in info.value.detail


async def test_plaintext_to_a_tls_port_is_not_served(pki: Pki, tls_shard: TlsShard) -> None:
    plain = tls_shard.url.replace("https://", "http://")
    for rpc in (True, False):
        async with PSClient.connect([plain], token=tls_shard.tokens[Scope.ADMIN], rpc=rpc, retry=QUICK) as client:
            with pytest.raises(ShardUnavailableError):
                await client.pull("ctr_lr", KEYS)
    with pytest.raises((ConnectionError, OSError)):
        await RpcConnection.open("127.0.0.1", tls_shard.rpc_port, token=tls_shard.tokens[Scope.ADMIN])
    # Raw bytes get no HTTP answer either (and the port still serves TLS after them).
    reader, writer = await asyncio.open_connection("127.0.0.1", int(tls_shard.url.rsplit(":", 1)[1]))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), BOUND_S)
    writer.close()
    assert b"HTTP/1.1 200" not in got and b"shard_id" not in got
    await _train_and_read(tls_shard.url, tls_shard.tokens[Scope.TRAIN], _client(pki.ca), rpc=True)


async def test_mutual_tls_refuses_a_client_without_a_certificate_of_the_ca(
    pki: Pki, mtls_shard: TlsShard, caplog: pytest.LogCaptureFixture
) -> None:
    s = mtls_shard
    token = s.tokens[Scope.TRAIN]
    for ctx in (_client(pki.ca), _client(pki.ca, pki.other_client)):
        for rpc in (True, False):
            async with PSClient.connect([s.url], token=token, ssl=ctx, rpc=rpc, retry=QUICK) as client:
                with pytest.raises(ShardUnavailableError):
                    await client.push("ctr_lr", KEYS, GRADS)
        with pytest.raises((ConnectionError, OSError)):
            conn = await RpcConnection.open("127.0.0.1", s.rpc_port, token=token, ssl=ctx)
            await conn.call("/v1/pull", b"")  # TLS 1.3: the refusal may come after the handshake
    assert len(s.shard.table("ctr_lr")) == 0
    # The client sees a disconnect; the shard says why, by reason, in its counters and one line each.
    assert set(s.handshakes.counts) <= {"peer_did_not_return_a_certificate", "certificate_verify_failed"}
    assert s.handshakes.counts.get("peer_did_not_return_a_certificate", 0) > 0
    assert s.handshakes.counts.get("certificate_verify_failed", 0) > 0
    lines = [r.getMessage() for r in caplog.records if r.name == "ctrps.tls"]
    assert sorted(m.split(" total=")[0] for m in lines) == [
        "tls: refused a handshake (certificate_verify_failed)",
        "tls: refused a handshake (peer_did_not_return_a_certificate)",
    ]
    for rpc in (True, False):
        await _train_and_read(s.url, token, _client(pki.ca, pki.client), rpc=rpc)


async def _plaintext_request(url: str) -> None:
    """One plaintext HTTP request to a TLS port, read to its close: no answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    got = await asyncio.wait_for(reader.read(), BOUND_S)
    writer.close()
    assert b"HTTP/1.1 200" not in got


async def test_the_api_serves_https(pki: Pki) -> None:
    model = make_model("lr")
    shards = [Shard(ShardSpec(0, 1), model.tables())]
    client, control = PSClient.local(shards), ControlClient.local(shards)
    api = ApiServer(ApiSettings(port=0), client, model, control=control, ssl_context=_served(pki))
    await api.start()
    try:
        assert api.url.startswith("https://")
        body = orjson.dumps({"events": [{"features": {"site": "a3f09", "hour": "13"}}]})
        async with aiohttp.ClientSession() as session:
            async with session.post(api.url + "/v1/predict", data=body, ssl=_client(pki.ca)) as resp:
                assert resp.status == 200
                got = orjson.loads(await resp.read())
            assert len(got["predictions"]) == 1
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.post(api.url + "/v1/predict", data=body, ssl=_client(pki.other_ca))
            with pytest.raises(aiohttp.ClientError):
                await session.get(api.url.replace("https://", "http://") + "/healthz")
            # Refused plaintext requests are counted by reason (aiohttp's request
            # may have been retried; the raw one is exactly one) and shown in the metrics.
            await until(lambda: "http_request" in api.handshakes.counts, BOUND_S, what="the refusal counted")
            before = api.handshakes.counts["http_request"]
            await _plaintext_request(api.url)
            await until(
                lambda: api.handshakes.counts["http_request"] == before + 1, BOUND_S, what="one more refusal counted"
            )
            async with session.get(api.url + "/metrics", ssl=_client(pki.ca)) as resp:
                text = (await resp.read()).decode()
            assert (
                f'ctrps_tls_handshake_failures_total{{reason="http_request",role="api",shard=""}} {before + 1}.0'
                in text
            )
            assert 'ctrps_port_open_connections{port="http",role="api",shard=""}' in text
            assert 'ctrps_port_refused_total{port="http",reason="head_timeout",role="api",shard=""} 0.0' in text
    finally:
        await api.stop()
        await client.close()


@pytest.mark.process
async def test_shard_and_serve_roles_with_tls_and_a_secret(
    pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Two ``ctrps shard`` and a ``ctrps serve`` (their role functions) with
    a cluster secret and TLS; a client holding only a train token, as
    ``ctrps worker`` builds it, trains; shard 0 cuts across both shards over
    TLS with its admin token; the API, holding a read token, predicts."""
    caplog.set_level(logging.INFO)
    secret = new_secret()
    tls = TlsFiles(cert=pki.server, key=pki.server, ca=pki.ca)
    shard_security = SecuritySettings(cluster_secret=secret, tls=tls)
    ports = [free_port(), free_port()]
    urls = tuple(f"https://127.0.0.1:{p}" for p in ports)
    stop = asyncio.Event()
    shards = [
        asyncio.create_task(run_shard(ShardSettings(
            port=ports[i], shard_id=i, num_shards=2, shards=urls, stats_interval_s=0,
            exports_dir=str(tmp_path / "exports") if i == 0 else "", export_interval_s=0,
        ), stop, security=shard_security), name=f"shard-{i}")
        for i in range(2)
    ]  # fmt: skip
    api_port = free_port()
    api_security = SecuritySettings(shard_token=derive_token(secret, Scope.READ), tls=tls)
    serve = asyncio.create_task(
        run_serve(ApiSettings(shards=urls, port=api_port, shard_deadline_s=5.0), stop, security=api_security),
        name="serve",
    )
    ctx = _client(pki.ca)
    worker_security = SecuritySettings(shard_token=derive_token(secret, Scope.TRAIN), tls=TlsFiles(ca=pki.ca))
    admin_security = SecuritySettings(cluster_secret=secret, tls=TlsFiles(ca=pki.ca))
    try:
        async with ControlClient.connect(
            urls, token=admin_security.token_for(Scope.ADMIN), ssl=ctx, retry=RetryPolicy(deadline_s=20)
        ) as admin:

            async def joined() -> bool:
                for task in (*shards, serve):
                    if task.done():
                        task.result()
                        raise AssertionError(f"{task.get_name()} stopped")
                try:
                    return (await admin.shards[0].membership()).joined
                except ShardUnavailableError:
                    return False

            await until(joined, 30.0, what="shard 0 joined")
            model = make_model("lr")
            worker_tls = client_context(worker_security.tls)
            token = worker_security.token_for(Scope.TRAIN)
            async with (
                PSClient.connect(urls, token=token, ssl=worker_tls, retry=RetryPolicy(deadline_s=20)) as worker,
                ControlClient.connect(urls, token=token, ssl=worker_tls, retry=RetryPolicy(deadline_s=20)) as training,
            ):
                for table in model.tables():
                    await training.declare(table)
                name, dim = model.tables()[0].name, model.tables()[0].dim
                keys = np.arange(1, 400, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
                assert await worker.push(name, keys, np.full((keys.size, dim), -2.0, dtype=np.float32)) > 0
                assert all(isinstance(t, TcpTransport) and t.uses_rpc for t in worker.transports)
                with pytest.raises(AuthError):
                    await training.export_now("base")
            report = await admin.export_now("base")
            assert report.version == 1
            # Shard 0 took shard 1's rows over TLS, with its admin token.
            assert report.rows == keys.size, report
            rows = [(await t.stats()).tables[name].features for t in admin.shards]
            assert all(n > 0 for n in rows) and sum(rows) == keys.size

        # ``ctrps export`` verifies shard 0 with --tls-ca; without it, one line and exit 2.
        env = _env(CTRPS_SHARD_TOKEN=derive_token(secret, Scope.ADMIN))
        code, out, err = await _ctrps("export", "--shard0", urls[0], "--list", "--tls-ca", pki.ca, env=env)
        assert code == 0, err
        assert [v["version"] for v in orjson.loads(out)["versions"]] == [1]
        code, out, err = await _ctrps("export", "--shard0", urls[0], "--list", env=env)
        assert code == 2 and out == ""
        assert "--tls-ca" in _one_line(err) and "did not verify" in err

        api_url = f"https://127.0.0.1:{api_port}"
        body = orjson.dumps({"events": [{"features": {"site": "a3f09"}}]})
        async with aiohttp.ClientSession() as session:

            async def predicts() -> bool:
                if serve.done():
                    serve.result()
                try:
                    async with session.post(api_url + "/v1/predict", data=body, ssl=ctx) as resp:
                        return resp.status == 200
                except aiohttp.ClientConnectionError:
                    return False

            await until(predicts, 30.0, what="the API over https")
            # Plaintext to shard 1's TLS port: refused, counted there, relayed by the API.
            await _plaintext_request(urls[1])
            async with session.get(api_url + "/metrics", ssl=ctx) as resp:
                text = (await resp.read()).decode()
            assert 'ctrps_shard_up{shard="1"} 1.0' in text
            assert 'ctrps_tls_handshake_failures_total{reason="http_request",role="shard",shard="1"} 1.0' in text
            assert 'ctrps_port_open_connections{port="rpc",role="shard",shard="0"}' in text
            assert 'ctrps_port_refused_total{port="rpc",reason="overloaded",role="shard",shard="1"} 0.0' in text
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*shards, serve, return_exceptions=True), 30.0)
    for task in (*shards, serve):
        task.result()
    listening = [r for r in caplog.records if r.getMessage() == "listening" and r.name == "ctrps.shard"]
    assert len(listening) == 2
    assert all(r.fields["tls"] == "on" and r.fields["auth"] == "on" for r in listening)  # type: ignore[attr-defined]
    assert all(r.fields["url"].startswith("https://") for r in listening)  # type: ignore[attr-defined]
    text_logged = "\n".join(f"{r.getMessage()} {r.__dict__!r}" for r in caplog.records)
    assert secret not in text_logged
    refused = [r for r in caplog.records if r.name == "ctrps.tls"]
    assert [r.getMessage() for r in refused] == ["tls: refused a handshake (http_request) total=1"]


@pytest.mark.slow
@pytest.mark.process
async def test_tls_files_that_do_not_load_are_one_line_and_exit_2(pki: Pki, tmp_path: Path) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    env = _env(CTRPS_CLUSTER_SECRET=new_secret())
    for args in (
        ["shard", "--port", "0", "--no-exports", "--tls-cert", pki.server, "--tls-key", pki.other_client],
        ["serve", "--port", "0", "--shards", "https://127.0.0.1:1", "--tls-cert", str(junk), "--tls-key", str(junk)],
        ["export", "--shard0", "https://127.0.0.1:1", "--tls-ca", str(junk)],
        ["worker", "--shards", "https://127.0.0.1:1", "--bootstrap", "127.0.0.1:1", "--tls-ca", str(junk)],
    ):
        code, _, err = await _ctrps(*args, env=env)
        line = _one_line(err)
        assert code == 2, err
        assert "cannot be loaded" in line and ("--tls-key" in line or "--tls-ca" in line), line
