"""Schemathesis against the API's own ``/openapi.json``: requests generated
from the document (valid ones and ones it says are invalid) to a real API
on 127.0.0.1, over real shards in its process with a coordinator and an
exporter, so every route has something behind it.

Each response must not be a 5xx and must be what the document says
(status, content type, body schema); a request the document calls invalid
must be refused and a valid one accepted. After every stored status report
``/v1/model`` and ``/metrics`` must still answer 200: no report breaks a
reader. A bounded number of examples per operation keeps the file short.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import schemathesis
from fuzzing import fuzz
from threaded import serve_in_thread

from app.api import ApiServer
from app.api.openapi import openapi_document
from app.config.serve import ApiSettings
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.shard import Shard, ShardSpec

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

TOKEN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EVENTS = 100


@pytest.fixture(scope="module")
def api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    exports = tmp_path_factory.mktemp("exports")

    async def start() -> tuple[str, Callable[[], Awaitable[None]]]:
        model = make_model("lr", "ctr")
        shards = [Shard(ShardSpec(i, 2), model.tables()) for i in range(2)]
        coordinator = Coordinator()
        client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
        control.serve_exports(Exporter(coordinator, control, Path(exports), "ctr"))
        settings_ = ApiSettings(port=0, admin_token=TOKEN, max_events=MAX_EVENTS, history_interval_s=0.05)
        server = ApiServer(settings_, client, model, control=control)
        url = await server.start()

        async def stop() -> None:
            await server.stop()
            await client.close()

        return url, stop

    with serve_in_thread(start) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(api_url: str) -> Any:
    """The document the app serves, loaded by schemathesis."""
    return schemathesis.openapi.from_url(api_url + "/openapi.json")


# The operations, from the document the app builds; the test checks it is
# the one served. (Schemathesis's lazy pytest loader does not run on this
# pytest, so each operation is a parameter and hypothesis runs inside.)
OPERATIONS = sorted((m.upper(), p) for p, ops in openapi_document(MAX_EVENTS)["paths"].items() for m in ops)


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_the_api_answers_as_documented(api_schema: Any, api_url: str, method: str, path: str) -> None:
    fuzz(api_schema[path][method], api_url, AUTH, after=_readers_still_answer)


def _readers_still_answer(case: Any, response: requests.Response, session: requests.Session, url: str) -> None:
    if (case.method, case.path) == ("POST", "/v1/status") and response.status_code == 200:
        for path in ("/v1/model", "/metrics", "/v1/history"):
            got = session.get(url + path, timeout=10)
            assert got.status_code == 200, (path, got.status_code, got.text[:300])


def test_the_document_served_is_the_one_fuzzed(api_url: str) -> None:
    served = requests.get(api_url + "/openapi.json", timeout=10).json()
    assert sorted((m.upper(), p) for p, ops in served["paths"].items() for m in ops) == OPERATIONS
