"""Schemathesis against a shard's documented routes: the document it serves
at ``GET /openapi.json`` (`ps_core.net.shard_openapi`), on shard 0 of a real
shard port on 127.0.0.1 under its limits, with a cluster secret, a
coordinator and an exporter (the routes ``ctrps shard`` serves on shard 0).

Every request carries an admin token, so each route is reached; each
response must not be a 5xx and must be what the document says, invalid
requests refused, valid ones accepted. The binary frame routes are not in
the document (their bodies are codec frames, tested in test_codec). Then the
credentials: without a token only ``/healthz`` and ``/openapi.json`` answer,
and a read token is refused the admin routes, each as documented.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
import schemathesis
from fuzzing import fuzz
from threaded import serve_in_thread

from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.checkpoint.routes import checkpointed_shard_app
from ps_core.net.auth import Scope, TokenVerifier, bearer, derive_token, new_secret
from ps_core.net.server import ROUTE_SCOPES, start_shard_site
from ps_core.net.shard_openapi import shard_document
from ps_core.shard import Shard, ShardSpec
from ps_core.store.table_config import TableConfig

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

SECRET = new_secret()
ADMIN = bearer(derive_token(SECRET, Scope.ADMIN))
READ = bearer(derive_token(SECRET, Scope.READ))
TABLE = TableConfig("emb", dim=2, optimizer={"name": "adagrad"})


@pytest.fixture(scope="module")
def shard_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exports = tmp_path_factory.mktemp("exports")

    async def start() -> tuple[str, Callable[[], Awaitable[None]]]:
        shard = Shard(ShardSpec(0, 1), (TABLE,))
        coordinator = Coordinator()
        # Fuzzed workers join and never arrive: a step waits for them 0.2 s at most.
        coordinator.sync_max_deadline_s = 0.2
        client = ControlClient.local([shard], coordinator)
        exporter = Exporter(coordinator, client, Path(exports), "ctr")
        app = checkpointed_shard_app(shard, verifier=TokenVerifier(SECRET), coordinator=coordinator, exporter=exporter)
        site = await start_shard_site(app, "127.0.0.1", 0)

        async def stop() -> None:
            await site.cleanup()
            await client.close()

        return f"http://127.0.0.1:{site.port}", stop

    with serve_in_thread(start) as url:
        yield url


@pytest.fixture(scope="module")
def shard_schema(shard_url: str) -> Any:
    """The document shard 0 serves (no token needed), loaded by schemathesis."""
    return schemathesis.openapi.from_url(shard_url + "/openapi.json")


# Shard 0 with a coordinator serves every documented operation.
OPERATIONS = sorted((m.upper(), p) for p, ops in shard_document()["paths"].items() for m in ops if m != "parameters")


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_the_shard_answers_as_documented(shard_schema: Any, shard_url: str, method: str, path: str) -> None:
    fuzz(shard_schema[path][method], shard_url, ADMIN)


def test_the_document_names_every_json_route_served() -> None:
    # The binary routes are left out: frames, and a slot hand-off's .npz archive.
    binary = ("/v1/pull", "/v1/push", "/v1/push_pull", "/v1/changes", "/v1/slots/take_over")
    served = {k for k in ROUTE_SCOPES if k[1] not in binary}
    assert served == set(OPERATIONS)


async def test_without_a_token_only_the_open_routes_answer(shard_url: str) -> None:
    doc = shard_document()
    async with aiohttp.ClientSession() as http:
        for method, path in OPERATIONS:
            url = shard_url + path.replace("{version}", "1").replace("{epoch}", "1").replace("{name}", "emb")
            async with http.request(method, url) as resp:
                body = await resp.json()
                status = resp.status
            open_ = ROUTE_SCOPES[(method, path)] is None
            assert (status == 200) if open_ else (status, body["error"]) == (401, "unauthorized"), (path, body)
            assert str(status) in doc["paths"][path][method.lower()]["responses"]
            if ROUTE_SCOPES[(method, path)] in (Scope.TRAIN, Scope.ADMIN):
                async with http.request(method, url, headers=READ, json={}) as resp:
                    assert resp.status == 403 and (await resp.json())["error"] == "forbidden"


def test_the_document_is_open_and_is_the_one_built(shard_url: str) -> None:
    got = requests.get(shard_url + "/openapi.json", timeout=10)
    assert got.status_code == 200 and got.json() == shard_document()
