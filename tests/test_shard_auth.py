"""Credentials on the shard plane (`ps_core.net.auth`, `ps_core.net.server`, `ps_core.net.rpc`):
what a stranger on the network could do to an open shard, reproduced against
a shard with a cluster secret, and what each scope may do now.

- no token: no push (over the RPC or HTTP), no table declared, no export, no
  compaction, no snapshot taken or copied: 401, and the model is unchanged;
- a read token pulls but cannot push (403, over HTTP and the RPC, whose
  connection stays open), a train token pushes but cannot cut or export,
  an admin token can;
- every route of the shard app is checked against its scope in
  `ROUTE_SCOPES` (a route added without a scope fails here), HEAD included;
- wrong-secret, malformed and forged tokens are 401; the secret and tokens
  never reach a log line; one line per kind of refusal; counted in the
  shard's stats and the API's ``ctrps_shard_auth_refused_total``;
- clients do not retry a refusal; ``ctrps worker`` and ``ctrps export`` with
  a wrong token exit 2 with one line; ``ctrps shard`` on a non-loopback
  address without a secret refuses to start unless ``--insecure``;
  ``ctrps token`` prints tokens the shard accepts, from a secret file too.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web
from waiting import until

from app.api import ApiServer
from app.config.serve import ApiSettings
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.routes import EXPORTER, checkpointed_shard_app
from ps_core.errors import AuthError, ForbiddenError
from ps_core.model.models import make_model
from ps_core.net import codec, op_encoders
from ps_core.net.auth import Refusals, Scope, TokenVerifier, bearer, derive_token, new_secret
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.rpc import RpcConnection, RpcServer, start_rpc_server
from ps_core.net.server import DEFAULT_MAX_BODY, ROUTE_SCOPES, ShardSite, start_shard_site
from ps_core.net.shard_bodies import AuthStats
from ps_core.net.transports import TcpTransport
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

PROJECT = Path(__file__).resolve().parent.parent
LR = TableConfig("ctr_lr", dim=1, optimizer={"name": "ftrl", "alpha": 0.1, "l1": 0.5})
KEYS = np.array([1, 2, 3, 2**63 + 5], dtype=np.uint64)
GRADS = np.array([-3.0, 2.0, -1.5, 4.0], dtype=np.float32)
# A retry deadline no refusal may wait out: a refused call that were retried
# would hold the test far past its own bound (`asyncio.wait_for` below).
PATIENT = RetryPolicy(deadline_s=120.0)
BOUND_S = 30.0


@dataclass
class Secured:
    """One shard (shard 0 of 1, hosting the coordinator and an exporter) with a cluster secret."""

    shard: Shard
    url: str
    rpc_port: int
    secret: str
    app: web.Application
    refusals: Refusals
    tokens: dict[Scope, str] = field(default_factory=dict)

    def client(self, scope: Scope | None, *, rpc: bool = True) -> PSClient:
        return PSClient.connect([self.url], token=self.tokens[scope] if scope else "", rpc=rpc, retry=PATIENT)

    def control(self, scope: Scope | None) -> ControlClient:
        return ControlClient.connect([self.url], token=self.tokens[scope] if scope else "", retry=PATIENT)


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    secret = new_secret()
    verifier = TokenVerifier(secret)
    refusals = Refusals(logging.getLogger("ctrps.shard.auth"))
    shard = Shard(ShardSpec(0, 1), [LR])
    rpc: RpcServer = await start_rpc_server(
        shard, "127.0.0.1", 0, max_body=DEFAULT_MAX_BODY, verifier=verifier, refusals=refusals
    )
    coordinator = Coordinator()
    local = ControlClient.local([shard], coordinator)
    exporter = Exporter(coordinator, local, tmp_path / "exports", "ctr")
    app = checkpointed_shard_app(
        shard, rpc_port=rpc.port, verifier=verifier, refusals=refusals, coordinator=coordinator, exporter=exporter
    )
    site: ShardSite = await start_shard_site(app, "127.0.0.1", 0)
    try:
        yield Secured(
            shard,
            f"http://127.0.0.1:{site.port}",
            rpc.port,
            secret,
            app,
            refusals,
            {scope: derive_token(secret, scope) for scope in Scope},
        )
    finally:
        await rpc.close()
        await site.cleanup()
        await local.close()


async def _http(
    method: str,
    url: str,
    token: str | None = None,
    body: bytes | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[int, object]:
    """One request; the status and the JSON body (or the raw bytes)."""
    sent = dict(headers or {})
    if token is not None:
        sent.update(bearer(token))
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, data=body, headers=sent) as resp:
            raw = await resp.read()
            try:
                return resp.status, orjson.loads(raw)
            except orjson.JSONDecodeError:
                return resp.status, raw


def _refused(s: Secured) -> int:
    return sum(s.refusals.counts.values())


# -- finding 1: the open shard plane, with a secret ------------------------------------


async def test_no_token_cannot_push_declare_export_compact_or_copy_snapshots(secured: Secured) -> None:
    s = secured
    s.shard.table("ctr_lr").push(KEYS, GRADS)
    before = s.shard.table("ctr_lr").pull(KEYS).copy()
    for rpc in (True, False):
        async with s.client(None, rpc=rpc) as stranger:
            for _ in range(3):
                with pytest.raises(AuthError) as info:
                    await asyncio.wait_for(stranger.push("ctr_lr", KEYS, -100 * GRADS), BOUND_S)
                assert not isinstance(info.value, ForbiddenError)
            with pytest.raises(AuthError):
                async with s.control(None) as c:
                    await c.declare(TableConfig("rogue", dim=1, optimizer={"name": "sgd"}))
            with pytest.raises(AuthError):
                await stranger.pull("ctr_lr", KEYS)
    np.testing.assert_array_equal(s.shard.table("ctr_lr").pull(KEYS), before)
    assert "rogue" not in s.shard.tables

    s.shard.take_snapshot(1, None)  # a cut under way: a stranger must neither copy nor drop it
    for method, path, body in [
        ("POST", "/v1/exports", b"{}"),
        ("POST", "/v1/exports/compact", b"{}"),
        ("POST", "/v1/snapshots", b'{"version": 2, "parent": null}'),
        ("GET", "/v1/snapshots/1", None),
        ("DELETE", "/v1/snapshots/1", None),
        ("POST", "/v1/tables", orjson.dumps({"name": "rogue", "dim": 1})),
        ("POST", "/v1/push", op_encoders.encode_push("ctr_lr", KEYS, GRADS, request_id=7)),
    ]:
        status, got = await _http(method, s.url + path, body=body)
        assert status == 401, (method, path, got)
        assert isinstance(got, dict) and got["error"] == "unauthorized"
    assert not (s.app[EXPORTER].model_dir / "1").exists()
    # The cut is still there for the exporter (a copy taken once, by an admin).
    status, got = await _http("GET", s.url + "/v1/snapshots/1", s.tokens[Scope.ADMIN])
    assert status == 200 and isinstance(got, bytes) and len(got) > 0
    assert "rogue" not in s.shard.tables


async def test_read_token_pulls_but_cannot_push_over_rpc_or_http(secured: Secured) -> None:
    s = secured
    s.shard.table("ctr_lr").push(KEYS, GRADS)
    want = s.shard.table("ctr_lr").pull(KEYS).copy()
    for rpc in (True, False):
        async with s.client(Scope.READ, rpc=rpc) as reader:
            np.testing.assert_array_equal(await reader.pull("ctr_lr", KEYS), want)
            transport = reader.transports[0]
            assert isinstance(transport, TcpTransport) is rpc
            assert not rpc or transport.uses_rpc  # type: ignore[attr-defined]
            conn = transport._conn  # type: ignore[attr-defined]
            with pytest.raises(ForbiddenError) as info:
                await asyncio.wait_for(reader.push("ctr_lr", KEYS, GRADS), BOUND_S)
            assert "train" in info.value.detail and "read" in info.value.detail
            with pytest.raises(ForbiddenError):
                await reader.push_pull("ctr_lr", KEYS, GRADS, pull_keys=KEYS)
            with pytest.raises(ForbiddenError):
                async with s.control(Scope.READ) as c:
                    await c.declare(TableConfig("rogue", dim=1, optimizer={"name": "sgd"}))
            # The refused frames left the connection open: the next pull uses it.
            np.testing.assert_array_equal(await reader.pull("ctr_lr", KEYS), want)
            if rpc:
                assert conn is not None and transport._conn is conn and conn.is_open  # type: ignore[attr-defined]
    np.testing.assert_array_equal(s.shard.table("ctr_lr").pull(KEYS), want)


async def test_rpc_hello_without_a_token_is_refused_and_a_read_token_cannot_push(secured: Secured) -> None:
    s = secured
    for token in ("", "read.AAAA", derive_token(new_secret(), Scope.ADMIN)):
        with pytest.raises(AuthError) as info:
            await RpcConnection.open("127.0.0.1", s.rpc_port, token=token)
        assert info.value.status == 401 and not isinstance(info.value, ForbiddenError)
    conn = await RpcConnection.open("127.0.0.1", s.rpc_port, token=s.tokens[Scope.READ])
    try:
        status, payload = await conn.call("/v1/push", op_encoders.encode_push("ctr_lr", KEYS, GRADS, request_id=1))
        assert status == 403 and orjson.loads(payload)["error"] == "forbidden"
        status, payload = await conn.call(
            "/v1/push_pull", op_encoders.encode_push_pull("ctr_lr", KEYS, GRADS, KEYS, request_id=2)
        )
        assert status == 403
        # Kept open: a pull on the same connection is answered.
        status, payload = await conn.call("/v1/pull", op_encoders.encode_pull("ctr_lr", KEYS))
        assert status == 200 and codec.decode(payload, codec.Op.WEIGHTS).values is not None
        assert conn.is_open
    finally:
        await conn.close()
    assert len(s.shard.table("ctr_lr")) == 0
    assert s.refusals.counts == {"missing": 1, "wrong": 2, "scope": 2}


async def test_train_token_pushes_but_cannot_snapshot_or_export_and_admin_can(secured: Secured) -> None:
    s = secured
    async with s.client(Scope.TRAIN) as trainer, s.control(Scope.TRAIN) as training:
        assert await training.declare(TableConfig("ctr_extra", dim=1, optimizer={"name": "sgd"}))
        assert await trainer.push("ctr_lr", KEYS, GRADS) == KEYS.size
        grant = await training.acquire_lease("w1", wait_s=1.0)
        assert await training.release_lease(grant.lease_id, {"clicks": {0: 5}})
        assert (await training.coordinator_offsets()) == {"clicks": {0: 5}}
        for refused in (
            training.take_snapshots(1, None),
            training.fetch_snapshots(1),
            training.export_now(),
            training.compact_exports(),
        ):
            with pytest.raises(ForbiddenError) as info:
                await asyncio.wait_for(refused, BOUND_S)
            assert "admin" in info.value.detail
    async with s.client(Scope.ADMIN) as admin, s.control(Scope.ADMIN) as admin_control:
        assert (await admin_control.take_snapshots(1, None)) == [{"ctr_lr": KEYS.size, "ctr_extra": 0}]
        fetched = await admin_control.fetch_snapshots(1)
        assert {snap.table for snap in fetched[0]} == {"ctr_lr", "ctr_extra"}
        report = await admin_control.export_now("base")
        assert report.version == 1 and report.kind == "base"
        assert (await admin_control.exports()).versions
        assert await admin.push("ctr_lr", KEYS, GRADS) == KEYS.size  # admin includes train


def _concrete(path: str) -> str:
    return (
        path.replace("{version}", "1")
        .replace("{epoch}", "1")
        .replace("{name}", "m_w" if path.startswith("/v1/tables") else "ctr")
    )


@pytest.mark.parametrize(("method", "path"), sorted(ROUTE_SCOPES), ids=lambda v: str(v))
async def test_every_route_needs_its_scope(secured: Secured, method: str, path: str) -> None:
    needs = ROUTE_SCOPES[(method, path)]
    url = secured.url + _concrete(path)
    body = b"{}" if method in ("POST", "DELETE") else None
    status, got = await _http(method, url, body=body)
    if needs is None:
        assert path in ("/healthz", "/openapi.json") and status == 200, got
        return
    assert status == 401 and isinstance(got, dict) and got["error"] == "unauthorized", got
    for scope in Scope:
        status, got = await _http(method, url, secured.tokens[scope], body=body)
        if scope < needs:
            assert status == 403, (scope, got)
            assert isinstance(got, dict) and got["error"] == "forbidden"
            assert needs.label in got["detail"]
        else:
            # Past the check: the route's own answer (a bad body is 4xx, never a refusal).
            assert status not in (401, 403), (scope, status, got)
            assert status < 500, (scope, status, got)
    # HEAD of a GET route needs the GET's scope (aiohttp runs the GET's handler).
    if method == "GET" and needs > Scope.READ:
        status, _ = await _http("HEAD", url, secured.tokens[Scope.READ])
        assert status in (403, 405)


def test_every_route_the_shard_app_registers_has_a_scope(secured: Secured) -> None:
    registered = {
        ("GET" if r.method == "HEAD" else r.method, r.resource.canonical)
        for r in secured.app.router.routes()
        if r.resource is not None
    }
    assert registered - set(ROUTE_SCOPES) == set(), "routes without a scope in ROUTE_SCOPES"
    assert set(ROUTE_SCOPES) - registered == set(), "ROUTE_SCOPES names routes the app does not serve"
    # Open: the probes' route, and the document (routes public in the source, no state).
    assert {key for key, scope in ROUTE_SCOPES.items() if scope is None} == {
        ("GET", "/healthz"),
        ("GET", "/openapi.json"),
    }


async def test_head_cannot_hand_over_a_snapshot(secured: Secured) -> None:
    """A HEAD runs the GET's handler: with a read token (the default scope of
    a route not in the map) it handed the cut over and dropped it unseen."""
    s = secured
    s.shard.table("ctr_lr").push(KEYS, GRADS)
    s.shard.take_snapshot(1, None)
    for token in (s.tokens[Scope.READ], s.tokens[Scope.ADMIN]):
        status, _ = await _http("HEAD", s.url + "/v1/snapshots/1", token)
        assert status in (403, 405)
    assert [snap.table for snap in s.shard.pop_snapshot(1)] == ["ctr_lr"]
    status, got = await _http("HEAD", s.url + "/healthz")
    assert status == 200


async def test_unknown_routes_and_methods_need_a_valid_token(secured: Secured) -> None:
    for method, path in [("GET", "/nope"), ("PUT", "/v1/tables"), ("GET", "/v1/snapshots")]:
        status, _ = await _http(method, secured.url + path)
        assert status == 401
        status, _ = await _http(method, secured.url + path, secured.tokens[Scope.READ])
        assert status in (404, 405)


async def test_a_strangers_body_is_not_read(secured: Secured) -> None:
    """The credentials are checked before the body is read: a stranger
    announcing 500 MB and sending none is answered 401 at once (were the body
    read first, the answer would be the body deadline's 408)."""
    port = int(secured.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/push HTTP/1.1\r\nHost: shard\r\nContent-Type: application/x-ctrps-frame\r\n"
            b"Content-Length: 500000000\r\n\r\n" + b"\0" * 1024
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), BOUND_S)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 401 "), head
    assert secured.refusals.counts["missing"] == 1


def _forged_tokens(secret: str) -> dict[str, str]:
    read = derive_token(secret, Scope.READ)
    mac = read.split(".", 1)[1]
    other = derive_token(new_secret(), Scope.ADMIN)
    flipped = mac[:-1] + ("A" if mac[-1] != "A" else "B")
    return {
        "another secret's admin token": other,
        "admin label on the read mac": f"admin.{mac}",
        "train label on the read mac": f"train.{mac}",
        "last character changed": f"read.{flipped}",
        "mac only": mac,
        "label only": "admin.",
        "padded mac": f"read.{mac}=",
        "mac of the secret itself": "admin." + base64.urlsafe_b64encode(secret.encode()).decode().rstrip("="),
        "the secret": secret,
        "not ascii": "admin.\u00e9\u00e9",
        "very long": "admin." + "A" * 5000,
    }


async def test_wrong_malformed_and_forged_tokens_are_401(secured: Secured) -> None:
    s = secured
    for what, token in _forged_tokens(s.secret).items():
        status, got = await _http("GET", s.url + "/v1/tables", token)
        assert status == 401, what
        assert isinstance(got, dict) and got["error"] == "unauthorized"
        if len(token.encode()) <= 1024:
            with pytest.raises(AuthError) as info:
                await RpcConnection.open("127.0.0.1", s.rpc_port, token=token)
            assert info.value.status == 401, what
    for header in (
        "Basic " + s.tokens[Scope.ADMIN],
        "Bearer",
        "Bearer  ",
        s.tokens[Scope.ADMIN],
        "Token " + s.tokens[Scope.ADMIN],
    ):
        status, got = await _http("GET", s.url + "/v1/tables", headers={"Authorization": header})
        assert status == 401, header
    status, _ = await _http("GET", s.url + "/v1/tables", headers={"Authorization": "bearer " + s.tokens[Scope.READ]})
    assert status == 200
    assert s.refusals.counts["scope"] == 0 and s.refusals.counts["wrong"] > 10


async def test_refusals_are_one_line_per_kind_counted_and_never_show_a_token(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    s = secured
    caplog.set_level(logging.WARNING, logger="ctrps.shard.auth")
    caplog.set_level(logging.WARNING, logger="ctrps.rpc")
    wrong = derive_token(new_secret(), Scope.ADMIN)
    for _ in range(5):
        await _http("GET", s.url + "/v1/stats")  # missing
        await _http("GET", s.url + "/v1/stats", wrong)  # wrong
        await _http("POST", s.url + "/v1/snapshots", s.tokens[Scope.TRAIN], b"{}")  # scope
        with pytest.raises(AuthError):
            await RpcConnection.open("127.0.0.1", s.rpc_port, token=wrong)
    assert s.refusals.counts == {"missing": 5, "wrong": 10, "scope": 5}

    lines = [r for r in caplog.records if r.getMessage() == "credentials refused"]
    assert sorted(r.fields["reason"] for r in lines) == ["missing", "scope", "wrong"]  # type: ignore[attr-defined]
    scope_line = next(r for r in lines if r.fields["reason"] == "scope")  # type: ignore[attr-defined]
    assert scope_line.fields["needs"] == "admin" and scope_line.fields["request"] == "POST /v1/snapshots"  # type: ignore[attr-defined]
    secrets_ = [s.secret, wrong, *s.tokens.values(), *(t.split(".", 1)[1] for t in s.tokens.values())]
    for record in caplog.records:
        text = f"{record.getMessage()} {record.__dict__!r}"
        for secret in secrets_:
            assert secret not in text, record

    # Counted in the shard's stats, for a read token.
    async with s.control(Scope.READ) as reader:
        stats = (await reader.stats())[0]
    assert stats.auth == AuthStats({"missing": 5, "wrong": 10, "scope": 5})

    # And on the API's metrics, which reads the shards' stats.
    client = PSClient.connect([s.url], token=s.tokens[Scope.READ])
    control = s.control(Scope.READ)
    api = ApiServer(ApiSettings(port=0), client, make_model("lr"), control=control)
    await api.start()
    try:
        status, text = await _http("GET", api.url + "/metrics")
    finally:
        await api.stop()
        await client.close()
        await control.close()
    assert status == 200 and isinstance(text, bytes)
    got = {}
    for m in re.finditer(r"^ctrps_shard_auth_refused_total\{([^}]*)\} (\S+)$", text.decode(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        got[labels["shard"], labels["reason"]] = float(m.group(2))
    assert got == {("0", "missing"): 5.0, ("0", "wrong"): 10.0, ("0", "scope"): 5.0}, got
    assert s.secret.encode() not in text


def test_refusals_collapse_into_one_line_per_kind_and_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Within `every_s` a kind's refusals are counted, not logged; the next
    line of that kind says how many it stands for."""
    import ps_core.net.auth as auth

    now = [1000.0]
    monkeypatch.setattr(auth.time, "monotonic", lambda: now[0])  # a sync test: no loop reads the clock
    caplog.set_level(logging.WARNING, logger="test.refusals")
    refusals = Refusals(logging.getLogger("test.refusals"), every_s=10.0)

    def refuse(reason: str, n: int) -> None:
        for _ in range(n):
            refusals.refuse(reason, plane="http", peer="10.0.0.9:5000", what="GET /v1/stats", needs=Scope.READ)

    refuse("missing", 7)
    refuse("wrong", 3)
    now[0] += 9.9
    refuse("missing", 2)
    assert [(r.fields["reason"], r.fields["refused"]) for r in caplog.records] == [  # type: ignore[attr-defined]
        ("missing", 1),
        ("wrong", 1),
    ]
    now[0] += 0.2
    refuse("missing", 1)
    lines = [(r.fields["reason"], r.fields["refused"], r.fields["refused_total"]) for r in caplog.records]  # type: ignore[attr-defined]
    assert lines[-1] == ("missing", 9, 10)  # the 8 unlogged since the first line, and this one
    assert refusals.stats() == {"refused": {"missing": 10, "wrong": 3, "scope": 0}}


# -- clients do not retry a refusal ----------------------------------------------------


@pytest.mark.parametrize("rpc", [True, False], ids=["rpc", "http"])
async def test_refusals_are_not_retried(secured: Secured, rpc: bool) -> None:
    """One attempt per call: the shard counts one refusal, and the call
    raises long before its retry deadline (120 s) could pass."""
    s = secured
    data: list[tuple[Scope | None, Callable[[PSClient], Awaitable[Any]], type[Exception]]] = [
        (None, lambda c: c.push("ctr_lr", KEYS, GRADS), AuthError),
        (None, lambda c: c.pull("ctr_lr", KEYS), AuthError),
        (Scope.READ, lambda c: c.push("ctr_lr", KEYS, GRADS), ForbiddenError),
    ]
    control: list[tuple[Scope | None, Callable[[ControlClient], Awaitable[Any]], type[Exception]]] = [
        (None, lambda c: c.declare(LR), AuthError),
        (Scope.TRAIN, lambda c: c.export_now(), ForbiddenError),
        (Scope.TRAIN, lambda c: c.take_snapshots(3, None), ForbiddenError),
    ]
    for scope, call, error in data:
        async with s.client(scope, rpc=rpc) as client:
            before = _refused(s)
            with pytest.raises(error):
                await asyncio.wait_for(call(client), BOUND_S)
            assert _refused(s) == before + 1, (scope, error)
    for scope, ask, error in control:
        async with s.control(scope) as ctl:
            before = _refused(s)
            with pytest.raises(error):
                await asyncio.wait_for(ask(ctl), BOUND_S)
            assert _refused(s) == before + 1, (scope, error)


async def test_an_api_with_a_refused_shard_token_answers_502_not_401(secured: Secured) -> None:
    """The API's shard token is the server's configuration, not the caller's
    credentials: a shard refusing it is a 502 naming the refusal."""
    s = secured
    model = make_model("lr")
    s.shard.declare(model.tables()[0])
    body = orjson.dumps({"events": [{"features": {"site": "a3f09"}}]})
    for token, code in ((derive_token(new_secret(), Scope.READ), "unauthorized"), ("", "unauthorized")):
        client = PSClient.connect([s.url], token=token, retry=PATIENT)
        control = ControlClient.connect([s.url], token=token, retry=PATIENT)
        api = ApiServer(ApiSettings(port=0), client, model, control=control)
        await api.start()
        try:
            status, got = await asyncio.wait_for(_http("POST", api.url + "/v1/predict", body=body), BOUND_S)
        finally:
            await api.stop()
            await client.close()
            await control.close()
        assert status == 502, got
        assert isinstance(got, dict) and got["error"] == "shard_error" and code in got["detail"]
        assert not token or token not in got["detail"]
    client = PSClient.connect([s.url], token=s.tokens[Scope.READ])
    control = s.control(Scope.READ)
    api = ApiServer(ApiSettings(port=0), client, model, control=control)
    await api.start()
    try:
        status, got = await _http("POST", api.url + "/v1/predict", body=body)
    finally:
        await api.stop()
        await client.close()
        await control.close()
    assert status == 200, got


# -- the command line ------------------------------------------------------------------


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    env.update(extra)
    return env


async def _ctrps(*args: str, env: Mapping[str, str], timeout_s: float = 60.0) -> tuple[int, str, str]:
    """Run ``ctrps ARGS`` without blocking the loop (the shard under test
    answers it from this process); exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *args, cwd=PROJECT, env=dict(env),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def _one_line(err: str) -> str:
    """The one error line of a command's stderr (text format); no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if re.match(r"^\S+ (error|critical) ", line)]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.slow
@pytest.mark.process
async def test_worker_and_export_with_a_wrong_token_exit_2_with_one_line(
    secured: Secured, tmp_path: Path, kafka_bootstrap: str
) -> None:
    s = secured
    wrong = derive_token(new_secret(), Scope.TRAIN)
    token_file = tmp_path / "token"
    token_file.write_text(wrong + "\n")

    async def worker(env: dict[str, str]) -> tuple[int, str, str]:
        """`ctrps worker` of the secured shard (its broker answers: the token is what is wrong)."""
        return await _ctrps(
            "worker", "--shards", s.url, "--bootstrap", kafka_bootstrap, "--decode-processes", "0", env=env
        )

    code, _, err = await worker(_env(CTRPS_SHARD_TOKEN_FILE=str(token_file)))
    line = _one_line(err)
    assert code == 2, err
    assert "not valid for this cluster" in line and wrong not in err
    # A read token: a worker needs train (it declares its tables first).
    code, _, err = await worker(_env(CTRPS_SHARD_TOKEN=s.tokens[Scope.READ]))
    assert code == 2 and "scope train" in _one_line(err), err

    for args in (["--list"], [], ["--compact"]):
        code, out, err = await _ctrps("export", "--shard0", s.url, *args, env=_env(CTRPS_SHARD_TOKEN=wrong))
        assert code == 2 and out == "", err
        assert "not valid for this cluster" in _one_line(err) and wrong not in err
    code, out, err = await _ctrps("export", "--shard0", s.url, env=_env(CTRPS_SHARD_TOKEN=s.tokens[Scope.TRAIN]))
    assert code == 2 and "scope admin" in _one_line(err), err
    # The secret itself: ``ctrps export`` derives the admin token from it.
    code, out, err = await _ctrps(
        "export", "--shard0", s.url, "--kind", "base", env=_env(CTRPS_CLUSTER_SECRET=s.secret)
    )
    assert code == 0, err
    assert orjson.loads(out)["version"] == 1


@pytest.mark.slow
@pytest.mark.process
async def test_shard_on_a_public_address_needs_a_secret_or_insecure(tmp_path: Path) -> None:
    code, _, err = await _ctrps("shard", "--host", "0.0.0.0", "--port", "0", "--no-exports", env=_env())
    line = _one_line(err)
    assert code == 2
    assert "0.0.0.0" in line and "CTRPS_CLUSTER_SECRET" in line and "--insecure" in line
    code, _, err = await _ctrps(
        "shard", "--host", "0.0.0.0", "--port", "0", "--no-exports", env=_env(CTRPS_INSECURE="0")
    )
    assert code == 2, err
    short = tmp_path / "short"
    short.write_text("too short\n")
    code, _, err = await _ctrps(
        "shard", "--host", "0.0.0.0", "--port", "0", "--no-exports", env=_env(CTRPS_CLUSTER_SECRET_FILE=str(short))
    )
    assert code == 2 and "16 bytes" in _one_line(err), err
    assert "too short" not in err


async def _start_shard(*args: str, env: Mapping[str, str], log: Path) -> tuple[asyncio.subprocess.Process, str]:
    """A ``ctrps shard`` child on a free port; it and its URL once it is listening."""
    with log.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "app.cli", "shard", "--port", "0", "--no-exports",
            "--log-format", "json", "--stats-interval", "0", *args,
            cwd=PROJECT, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
        )  # fmt: skip
    found: list[str] = []

    def listening() -> bool:
        if proc.returncode is not None:
            raise AssertionError(f"the shard exited {proc.returncode}: {log.read_text()}")
        for line in log.read_text().splitlines():
            event = orjson.loads(line)
            if event.get("msg") == "listening":
                found.append(event["url"])
        return bool(found)

    try:
        await until(listening, 30.0, what="the shard's listening line")
    except BaseException:
        await _stop(proc)
        raise
    return proc, found[0]


async def _stop(proc: asyncio.subprocess.Process) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 15.0)
        except TimeoutError:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode


@pytest.mark.slow
@pytest.mark.process
async def test_ctrps_token_from_a_secret_file_is_accepted_by_a_public_shard(tmp_path: Path) -> None:
    secret = new_secret()
    secret_file = tmp_path / "cluster-secret"
    secret_file.write_text(secret + "\n")
    env = _env(CTRPS_CLUSTER_SECRET_FILE=str(secret_file))
    tokens = {}
    for scope in ("read", "train", "admin"):
        code, out, err = await _ctrps("token", "--scope", scope, env=env)
        assert code == 0 and err == "", err
        tokens[scope] = out.strip()
        assert out.count("\n") == 1 and tokens[scope].startswith(f"{scope}.") and secret not in out
    assert tokens["train"] == derive_token(secret, Scope.TRAIN)
    code, _, err = await _ctrps("token", "--scope", "train", env=_env())
    assert code == 2 and "CTRPS_CLUSTER_SECRET" in _one_line(err)

    log = tmp_path / "shard.log"
    proc, url = await _start_shard("--host", "0.0.0.0", "--table", "lr,optimizer=ftrl", env=env, log=log)
    try:
        port = url.rsplit(":", 1)[1]
        local = f"http://127.0.0.1:{port}"
        async with PSClient.connect([local], token=tokens["train"], retry=RetryPolicy(deadline_s=10)) as trainer:
            assert await trainer.push("lr", KEYS, GRADS) == KEYS.size
            assert np.count_nonzero(await trainer.pull("lr", KEYS)) > 0
            transport = trainer.transports[0]
            assert isinstance(transport, TcpTransport) and transport.uses_rpc
        async with PSClient.connect([local], token=tokens["read"], retry=RetryPolicy(deadline_s=10)) as reader:
            with pytest.raises(ForbiddenError):
                await reader.push("lr", KEYS, GRADS)
        async with PSClient.connect([local], retry=RetryPolicy(deadline_s=10)) as stranger:
            with pytest.raises(AuthError):
                await stranger.pull("lr", KEYS)
    finally:
        rc = await _stop(proc)
    assert rc == 0, log.read_text()
    text = log.read_text()
    assert secret not in text and all(t.split(".", 1)[1] not in text for t in tokens.values())
    events = [orjson.loads(line) for line in text.splitlines()]
    assert any(e.get("msg") == "listening" and e.get("auth") == "on" for e in events)
    refused = [e for e in events if e.get("msg") == "credentials refused"]
    assert sorted(e["reason"] for e in refused) == ["missing", "scope"], refused


@pytest.mark.process
async def test_shard_on_a_public_address_starts_with_insecure(tmp_path: Path) -> None:
    log = tmp_path / "shard.log"
    proc, url = await _start_shard("--host", "0.0.0.0", "--insecure", env=_env(), log=log)
    try:
        port = url.rsplit(":", 1)[1]
        status, got = await _http("GET", f"http://127.0.0.1:{port}/v1/tables")
        assert status == 200 and got == {}  # open, as asked
    finally:
        rc = await _stop(proc)
    assert rc == 0, log.read_text()
    assert any(orjson.loads(line).get("auth") == "off" for line in log.read_text().splitlines())
