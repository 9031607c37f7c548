"""The control plane's calls declared once (`ps_core.net.control_calls`):
the client encodes its requests with the models the routes decode, decodes
each reply into its model (a reply that is not one is `ControlReplyError`
naming the route; a field a newer shard adds is dropped), and leaves out the
optional fields it does not set, so a shard of an older version reads the
request as before. And the coordinator's decision over typed membership
reports (`ps_core.checkpoint.membership.agreed_version`).

A real shard app with a coordinator on a loopback port; a middleware stands
for a shard of another version where the test needs one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web

from consumers.broker import free_port
from ps_core.checkpoint.control import HttpControl, ResumePoint
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.membership import agreed_version
from ps_core.checkpoint.routes import checkpointed_shard_app
from ps_core.checkpoint.stream import StreamIdentity
from ps_core.net.control_calls import CONTROL_CALLS, ControlReplyError
from ps_core.net.control_messages import MembershipBody
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.server import ROUTE_SCOPES
from ps_core.net.shard_bodies import Stats, TableStats
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Rewrite = dict[str, Callable[[dict[str, object]], dict[str, object]]]


class Served:
    """Shard 0 with a coordinator, the bodies it was sent by path, and
    replies rewritten by path (`rewrite`) as another version's would be."""

    def __init__(self) -> None:
        self.sent: dict[str, list[dict[str, object]]] = {}
        self.rewrite: Rewrite = {}
        self.control: HttpControl


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    out = Served()

    @web.middleware
    async def other_version(request: web.Request, handler: Handler) -> web.StreamResponse:
        raw = await request.read()
        out.sent.setdefault(request.path, []).append(orjson.loads(raw) if raw else {})
        resp = await handler(request)
        change = out.rewrite.get(request.path)
        if change is None or not isinstance(resp, web.Response) or resp.body is None:
            return resp
        return web.json_response(change(orjson.loads(resp.body)), status=resp.status)  # type: ignore[arg-type]

    app = checkpointed_shard_app(Shard(ShardSpec(0, 1)), coordinator=Coordinator())
    app.middlewares.append(other_version)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    async with aiohttp.ClientSession() as session:
        out.control = HttpControl(0, f"http://127.0.0.1:{port}", session, RetryPolicy(deadline_s=5.0))
        yield out
    await runner.cleanup()


async def test_membership_is_decoded_into_its_model_and_a_newer_shards_field_is_dropped(served: Served) -> None:
    served.rewrite["/v1/membership"] = lambda body: {**body, "zone": "eu-1"}
    got = await served.control.membership()
    assert isinstance(got, MembershipBody)
    assert (got.shard_id, got.num_shards, got.version, got.clean) == (0, 1, 0, True)


async def test_a_newer_shards_fields_are_dropped_at_any_depth_and_the_stats_decoded(served: Served) -> None:
    await served.control.declare(TableConfig("w", 1))

    def newer(body: dict[str, object]) -> dict[str, object]:
        tables = body["tables"]
        assert isinstance(tables, dict)
        heated = {
            name: {**t, "heat": 0.5, "lifecycle": {**t["lifecycle"], "paused": True}} for name, t in tables.items()
        }
        return {**body, "zone": "eu-1", "tables": heated}

    served.rewrite["/v1/stats"] = newer
    got = await served.control.stats()
    assert isinstance(got, Stats) and isinstance(got.tables["w"], TableStats)
    assert (got.shard_id, got.num_shards, got.tables["w"].features, got.tables["w"].config.dim) == (0, 1, 0, 1)


async def test_a_reply_that_is_not_the_calls_model_is_refused_naming_the_route(served: Served) -> None:
    lease = await served.control.acquire_lease("w1", wait_s=1.0)
    served.rewrite["/v1/leases/renew"] = lambda body: {"renewed": "yes"}
    with pytest.raises(ControlReplyError, match="/v1/leases/renew") as caught:
        await served.control.renew_lease(lease.lease_id)
    assert "renewed" in caught.value.detail


async def test_optional_request_fields_are_left_out_when_not_set(served: Served) -> None:
    lease = await served.control.acquire_lease("w1", wait_s=1.0)
    await served.control.sync_join("w1")
    await served.control.sync_apply(0)
    assert await served.control.release_lease(lease.lease_id, {})
    # As the bodies were before models: no null for what the caller left unset.
    assert served.sent["/v1/leases"] == [{"worker": "w1", "wait_s": 1.0}]
    assert served.sent["/v1/sync/join"] == [{"worker": "w1"}]
    assert served.sent["/v1/sync/apply"] == [{"step": 0}]
    assert served.sent["/v1/leases/release"] == [{"lease_id": lease.lease_id}]


async def test_an_older_coordinators_offsets_without_restored_read_as_not_known(served: Served) -> None:
    served.rewrite["/v1/offsets"] = lambda body: {k: v for k, v in body.items() if k != "restored"}
    point = await served.control.coordinator_resume()
    assert point.restored is None and point.offsets == {}


async def test_the_coordinators_offsets_are_decoded_into_their_model_the_wire_as_before(served: Served) -> None:
    lease = await served.control.acquire_lease("w1", wait_s=1.0)
    stream = StreamIdentity("k1", "g", ("clicks",))
    assert await served.control.release_lease(lease.lease_id, {"clicks": {0: 5}}, stream=stream)
    seen: list[dict[str, object]] = []
    served.rewrite["/v1/offsets"] = lambda body: seen.append(body) or body
    point = await served.control.coordinator_resume()
    assert point == ResumePoint({"clicks": {0: 5}}, stream, 0)
    stream_json = {"cluster_id": "k1", "group": "g", "topics": ["clicks"]}
    assert seen == [{"offsets": {"clicks": {"0": 5}}, "stream": stream_json, "restored": 0}]
    served.rewrite["/v1/offsets"] = lambda body: {**body, "stream": {**stream_json, "cluster_id": ""}}
    with pytest.raises(ControlReplyError, match="/v1/offsets") as caught:
        await served.control.coordinator_resume()
    assert "cluster_id" in caught.value.detail


def test_every_control_call_is_declared_once_with_its_scope() -> None:
    keys = [call.key for call in CONTROL_CALLS]
    assert len(keys) == len(set(keys))
    for call in CONTROL_CALLS:
        assert ROUTE_SCOPES[call.key] == call.scope, call.name


def _report(shard_id: int, version: int, *, clean: bool = True, restores: bool = True) -> MembershipBody:
    return MembershipBody(shard_id, 2, f"boot{shard_id}", False, "", version, clean, restores)


def test_the_shards_are_admitted_as_they_are_only_at_one_clean_version_on_disk(tmp_path: Path) -> None:
    dirs = {1: tmp_path / "v1", 2: tmp_path / "v2"}
    assert agreed_version([_report(0, 2), _report(1, 2)], dirs) == 2
    assert agreed_version([_report(0, 2), _report(1, 1)], dirs) is None  # different versions
    assert agreed_version([_report(0, 2), _report(1, 2, clean=False)], dirs) is None  # one trained past it
    assert agreed_version([_report(0, 3), _report(1, 3)], dirs) is None  # not on disk
    # Nothing loaded agrees only when nothing was to be loaded.
    assert agreed_version([_report(0, 0), _report(1, 0)], dirs) is None
    assert agreed_version([_report(0, 0, restores=False), _report(1, 0, restores=False)], dirs) == 0
    assert agreed_version([_report(0, 0), _report(1, 0)], {}) == 0
