"""The HTTP API (`app.api`), in process (aiohttp test_utils) against real
shards: in this process (`PSClient.local`) and shard servers on 127.0.0.1.

Every response any test here gets is checked against the OpenAPI document the
app serves (`Api.call`), success and error alike.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema_rs
import msgspec
import numpy as np
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from commands import ctrps_process
from documents import json_operations, validate, with_trailing_bytes
from prometheus_client.parser import text_string_to_metric_families
from training import train_step

from app.api import create_app
from app.api.openapi import openapi_document, path_template, response_schema
from app.api.payloads import WeightsRequest
from app.api.state import PREDICTOR
from app.cli import build_parser
from app.config.declared import SettingsError
from app.config.serve import ApiSettings
from app.status import make_status_hook
from consumers.worker import WindowReport, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.checkpoint.coordinator import Coordinator
from ps_core.checkpoint.exporter import Exporter
from ps_core.model.featurizer import FeatureHasher
from ps_core.model.metrics import evaluate
from ps_core.model.models import Model, make_model, sigmoid
from ps_core.net.client import PSClient
from ps_core.net.control_messages import Admit, ExportRequest, LeaseRequest, Release, SnapshotRequest
from ps_core.net.endpoint import RetryPolicy
from ps_core.net.shard_openapi import shard_document
from ps_core.shard import Shard, ShardSpec
from ps_core.store.board import StatusReport, as_worker_status
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

PROJECT = Path(__file__).resolve().parent.parent
MAX_EVENTS = 50
MAX_BODY = 32 * 1024
TOKEN = "s3cret-token"


@dataclass
class Api:
    """The app in process, the shards behind it and a client that trains them."""

    http: TestClient  # type: ignore[type-arg]
    client: PSClient
    control: ControlClient
    model: Model
    shards: list[Shard]
    urls: list[str]
    doc: dict[str, Any] = field(default_factory=dict)
    seen: set[tuple[str, str, int]] = field(default_factory=set)

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One request; the response is checked against the OpenAPI document."""
        payload = orjson.dumps(body) if body is not None else data
        async with self.http.request(method, path, data=payload, headers=headers) as resp:
            raw = await resp.read()
            ctype = resp.content_type
            status = resp.status
        route = path_template(self.doc, path.partition("?")[0])  # /v1/models/ctr/predict: its template
        operation = self.doc["paths"].get(route, {}).get(method.lower())
        if ctype in ("text/plain", "text/html"):
            parsed: Any = raw.decode()
        else:
            assert ctype == "application/json", (status, ctype, raw[:200])
            parsed = orjson.loads(raw)
        if operation is not None:
            schema = response_schema(self.doc, route, method, status, ctype)
        else:  # an unknown route: still the error body
            schema = {"$ref": "#/components/schemas/Error"}
        assert validate(parsed, schema, self.doc) == [], (method, path, status, parsed)
        if status >= 400:
            assert parsed["detail"], parsed
        self.seen.add((method, route, status))
        return status, parsed


MakeApi = Callable[..., Awaitable[Api]]


@pytest.fixture(params=["local", "http"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def make_api(transport: str, serve_shards: Any) -> AsyncIterator[MakeApi]:
    """Builds the API over 2 shards holding the model's tables."""
    opened: list[tuple[TestClient, PSClient, ControlClient]] = []  # type: ignore[type-arg]

    async def make(kind: str = "lr", num_shards: int = 2, exports: Path | None = None, **settings: Any) -> Api:
        """With `exports`, shard 0 hosts a coordinator and exporter writing there."""
        model = make_model(kind, "ctr")
        if transport == "http":
            shards, urls = await serve_shards(num_shards, model.tables(), exports)
            client, control = planes(urls, 0.5)
        else:
            shards = [Shard(ShardSpec(i, num_shards), model.tables()) for i in range(num_shards)]
            urls = []
            coordinator = Coordinator() if exports is not None else None
            client, control = PSClient.local(shards), ControlClient.local(shards, coordinator)
            if coordinator is not None and exports is not None:
                control.serve_exports(Exporter(coordinator, control, exports, "ctr"))
        options = {"max_events": MAX_EVENTS, "max_body_bytes": MAX_BODY, **settings}
        app = create_app(ApiSettings(**options), client, model, control=control)
        http = TestClient(TestServer(app))
        await http.start_server()
        opened.append((http, client, control))
        api = Api(http, client, control, model, shards, urls, openapi_document())
        status, doc = await api.call("GET", "/openapi.json")
        assert status == 200
        return Api(http, client, control, model, shards, urls, doc)

    yield make
    for http, client, control in opened:
        await http.close()
        await client.close()
        await control.close()


def planes(urls: list[str], deadline_s: float) -> tuple[PSClient, ControlClient]:
    """The data plane's client and the control plane's over the shards at `urls`."""
    retry = RetryPolicy(deadline_s=deadline_s)
    return PSClient.connect(urls, retry=retry), ControlClient.connect(urls, retry=retry)


def synthetic_events(rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
    """Events with categorical, numeric, multi-hot, boolean and pre-hashed features."""
    out = []
    for _ in range(n):
        site = int(rng.integers(0, 12))
        features: dict[str, Any] = {
            "site": f"s{site}",
            "ad": f"a{int(rng.integers(0, 30))}",
            "price": round(float(rng.uniform(0.5, 3.0)), 3),
            "tags": [f"t{int(t)}" for t in rng.choice(8, size=2, replace=False)],
            "mobile": bool(rng.integers(0, 2)),
            "missing": None,
        }
        out.append(
            {
                "label": int(rng.random() < (0.8 if site < 4 else 0.15)),
                "features": features,
                "keys": [int(rng.integers(1, 2**63))],
            }
        )
    return out


async def train(client: PSClient, model: Model, events: list[dict[str, Any]], rounds: int = 3) -> None:
    """The worker's training step (pull → gradients → push), on `events`."""
    batch, errors = model.hasher().featurize(events)
    assert not errors
    for _ in range(rounds):
        await train_step(client, model, batch)


def by_hand(rows: list[dict[str, Any]], model: Model) -> float:
    """A probability from `/v1/weights` rows: LR's sum of w·x, plus FM's
    pairwise term over the non-bias features. A mixture of K learners (the
    default linear optimizer) has each learner's logit so, its weight the
    k-th of a row (the pairs shared), and mixes their probabilities,
    p = sum_k pi_k sigmoid(z_k), by pi_k ∝ exp(-cap m_k), m the bias row's
    last K columns."""
    w_table, *v_table = model.table_names
    x = np.array([r["value"] for r in rows], dtype=np.float64)
    w = np.array([r["weights"][w_table] for r in rows], dtype=np.float64)
    k = 1 if model.mixture is None else model.mixture.learners
    assert w.shape == (len(rows), 1 if model.mixture is None else 2 * k)
    z = x @ w[:, :k]  # (K,) the learners' logits
    if v_table:
        v = np.array([r["weights"][v_table[0]] for r in rows[1:]], dtype=np.float64) * x[1:, None]
        z += 0.5 * float(((v.sum(axis=0) ** 2) - (v**2).sum(axis=0)).sum())
    p = 1.0 / (1.0 + np.exp(-z))
    if model.mixture is None:
        return float(p[0])
    a = -model.mixture.cap * w[0, k:]  # rows[0] is the event's bias
    pi = np.exp(a - a.max())
    return float(pi @ p / pi.sum())


# -- predictions and weights ---------------------------------------------------------


@pytest.mark.parametrize("kind", ["lr", "fm"])
async def test_predict_equals_a_prediction_by_hand_from_weights(make_api: MakeApi, kind: str) -> None:
    api = await make_api(kind)
    assert api.model.mixture is not None and api.model.mixture.learners == 5  # the default linear optimizer
    rng = np.random.default_rng(11)
    await train(api.client, api.model, synthetic_events(rng, 300))
    probe = synthetic_events(rng, 12) + [{"features": {"site": "never-seen", "price": 1.0}}]
    status, got = await api.call("POST", "/v1/predict", {"events": probe})
    assert status == 200
    assert got["model"] == "ctr" and got["model_version"] == 1
    assert len(got["predictions"]) == len(probe)
    for event, p in zip(probe, got["predictions"]):
        status, w = await api.call(
            "POST",
            "/v1/weights",
            {"features": event["features"], **({"keys": event["keys"]} if "keys" in event else {})},
        )
        assert status == 200 and w["tables"] == list(api.model.table_names)
        assert p == pytest.approx(by_hand(w["weights"], api.model), rel=1e-9, abs=1e-12)
    # The same probabilities as the model computes directly from the shards.
    batch, _ = api.model.hasher().featurize(probe, require_label=False)
    plan = api.model.plan(batch)
    weights = {t: await api.client.pull(t, plan.keys) for t in api.model.table_names}
    np.testing.assert_allclose(got["predictions"], sigmoid(api.model.logits(batch, plan, weights)), rtol=1e-12)
    assert len(set(got["predictions"])) > 3  # trained: not every event at the prior


async def test_weights_name_every_feature_and_flag_absent_ones(make_api: MakeApi) -> None:
    api = await make_api("fm")
    rng = np.random.default_rng(5)
    events = synthetic_events(rng, 50)
    await train(api.client, api.model, events, rounds=3)
    features = dict(events[0]["features"], unseen="zzz")
    status, got = await api.call("POST", "/v1/weights", {"features": features, "keys": [7, 2**64 - 1]})
    assert status == 200
    rows = got["weights"]
    names = [r["feature"] for r in rows]
    tags = features["tags"]
    mobile = "true" if features["mobile"] else "false"
    assert names == [
        "(bias)",
        f"site={features['site']}",
        f"ad={features['ad']}",
        "price",
        f"tags={tags[0]}",
        f"tags={tags[1]}",
        f"mobile={mobile}",
        "unseen=zzz",
        None,
        None,
    ]
    # A number's value is what the model multiplies: its log1p / 16 (the model's numeric).
    assert api.model.numeric == "log1p/16"
    price = features["price"]
    assert [r["value"] for r in rows][:4] == [
        1.0,
        1.0,
        1.0,
        pytest.approx(math.copysign(math.log1p(abs(price)), price) / 16),
    ]
    # The ids are the ones training hashes for the same event.
    batch, _ = FeatureHasher("ctr").featurize([{"features": features, "keys": [7, 2**64 - 1]}], require_label=False)
    assert sorted(r["key"] for r in rows) == sorted(batch.keys.tolist())
    assert [r["present"] for r in rows] == [True] * 7 + [False, False, False]
    # Absent features read their initial values: 0 for the linear part, the
    # key's deterministic init for the embeddings.
    w_cfg, v_cfg = api.model.tables()
    assert w_cfg.dim == 10  # the default mixture: 5 learners' weights, then their 5 log-weights
    for r in rows[7:]:
        assert r["weights"]["ctr_w"] == [0.0] * 10
        expect = SparseTable(v_cfg).initial_weights(np.array([r["key"]], dtype=np.uint64))[0]
        assert r["weights"]["ctr_v"] == pytest.approx(expect.tolist(), abs=0)
    assert any(r["weights"]["ctr_w"][:5] != [0.0] * 5 for r in rows[:7])
    # The learners' log-weights: the bias row's only (their losses, less the smallest).
    assert min(rows[0]["weights"]["ctr_w"][5:]) == 0.0 < max(rows[0]["weights"]["ctr_w"][5:])
    assert all(r["weights"]["ctr_w"][5:] == [0.0] * 5 for r in rows[1:7])
    # Only the bias: an empty features object is a valid event.
    status, only_bias = await api.call("POST", "/v1/weights", {"features": {}})
    assert status == 200 and [r["feature"] for r in only_bias["weights"]] == ["(bias)"]


async def test_one_event_or_thousands_per_request(make_api: MakeApi) -> None:
    api = await make_api(max_events=5000, max_body_bytes=4 * 1024 * 1024)
    rng = np.random.default_rng(2)
    events = synthetic_events(rng, 100)
    await train(api.client, api.model, events)
    many = synthetic_events(rng, 5000)
    status, got = await api.call("POST", "/v1/predict", {"events": many})
    assert status == 200 and len(got["predictions"]) == 5000
    status, one = await api.call("POST", "/v1/predict", {"events": many[4321:4322]})
    assert status == 200 and one["predictions"] == [got["predictions"][4321]]


async def test_concurrent_requests_are_batched_and_a_bad_event_fails_only_its_request(
    make_api: MakeApi,
) -> None:
    api = await make_api()
    rng = np.random.default_rng(9)
    await train(api.client, api.model, synthetic_events(rng, 200))
    requests = [synthetic_events(rng, int(rng.integers(1, 6))) for _ in range(40)]
    bad = {3, 17, 28}
    for i in bad:
        requests[i][-1]["features"]["price"] = {"nested": 1}
    batches: list[tuple[int, int]] = []
    predictor = api.http.app[PREDICTOR]
    predictor._on_batch = lambda r, e: batches.append((r, e))  # observe the batching
    results = await asyncio.gather(*(api.call("POST", "/v1/predict", {"events": r}) for r in requests))
    assert max(r for r, _ in batches) > 1  # some requests were scored together
    for i, (status, body) in enumerate(results):
        if i in bad:
            assert (status, body["error"]) == (422, "bad_value")
            assert body["detail"].startswith(f"event {len(requests[i]) - 1}: price")
            continue
        assert status == 200
        alone_status, alone = await api.call("POST", "/v1/predict", {"events": requests[i]})
        assert alone_status == 200 and alone["predictions"] == body["predictions"]


# -- bad requests -----------------------------------------------------------------------

EV = {"features": {"site": "a"}}

BAD_REQUESTS: list[tuple[str, str, str, bytes | Any, int, str, str]] = [
    # (name, method, path, body (bytes are sent raw), status, error, detail substring)
    ("not-json", "POST", "/v1/predict", b"{events: [", 400, "invalid_json", "not JSON"),
    ("empty-body", "POST", "/v1/predict", b"", 400, "invalid_json", "empty"),
    ("nan-literal", "POST", "/v1/predict", b'{"events": [{"features": {"x": NaN}}]}', 400, "invalid_json", "not JSON"),
    ("array-body", "POST", "/v1/predict", [EV], 400, "bad_request", "Expected `object`"),
    (
        "nested-too-deep",
        "POST",
        "/v1/predict",
        b'{"events": [' + b"[" * 5000 + b"]" * 5000 + b"]}",
        400,
        "invalid_json",
        "nested too deeply",
    ),
    ("no-events-field", "POST", "/v1/predict", {"event": [EV]}, 400, "bad_request", "unknown field `event`"),
    ("missing-events", "POST", "/v1/predict", {}, 400, "bad_request", "required field `events`"),
    ("events-not-list", "POST", "/v1/predict", {"events": EV}, 400, "bad_request", "`$.events`"),
    (
        "model-not-string",
        "POST",
        "/v1/predict",
        {"events": [EV], "model": 3},
        400,
        "bad_request",
        "`$.model`",
    ),
    ("unknown-model", "POST", "/v1/predict", {"events": [EV], "model": "other"}, 404, "unknown_model", "'other'"),
    ("empty-events", "POST", "/v1/predict", {"events": []}, 422, "no_events", "empty"),
    (
        "too-many-events",
        "POST",
        "/v1/predict",
        {"events": [EV] * (MAX_EVENTS + 1)},
        422,
        "too_many_events",
        f"limit is {MAX_EVENTS}",
    ),
    ("event-not-object", "POST", "/v1/predict", {"events": [EV, 5]}, 422, "not_an_object", "event 1:"),
    ("no-features", "POST", "/v1/predict", {"events": [{"id": "x"}]}, 422, "bad_features", "features or keys"),
    ("features-not-object", "POST", "/v1/predict", {"events": [{"features": ["a"]}]}, 422, "bad_features", "object"),
    (
        "nested-value",
        "POST",
        "/v1/predict",
        {"events": [EV, EV, {"features": {"x": {"y": 1}}}]},
        422,
        "bad_value",
        "event 2: x",
    ),
    (
        "float32-overflow",
        "POST",
        "/v1/predict",
        {"events": [{"features": {"x": 1e39}}]},
        422,
        "bad_value",
        "finite float32",
    ),
    ("negative-key", "POST", "/v1/predict", {"events": [{"keys": [-1]}]}, 422, "bad_keys", "[0, 2**64)"),
    (
        "key-over-u64",
        "POST",
        "/v1/predict",
        b'{"events": [{"keys": [18446744073709551616]}]}',
        422,
        "bad_keys",
        "[0, 2**64)",
    ),
    (
        "string-label",
        "POST",
        "/v1/predict",
        {"events": [{"features": {"a": "b"}, "label": "1"}]},
        422,
        "bad_label",
        "0 or 1",
    ),
    (
        "body-too-large",
        "POST",
        "/v1/predict",
        {"events": [{"features": {"x": "y" * MAX_BODY}}]},
        413,
        "too_large",
        f"{MAX_BODY} bytes",
    ),
    (
        "weights-features-list",
        "POST",
        "/v1/weights",
        {"features": ["a"]},
        400,
        "bad_request",
        "`$.features`",
    ),
    ("weights-keys-not-list", "POST", "/v1/weights", {"keys": 5}, 400, "bad_request", "`$.keys`"),
    (
        "weights-unknown-field",
        "POST",
        "/v1/weights",
        {"features": {}, "events": []},
        400,
        "bad_request",
        "unknown field `events`",
    ),
    ("weights-nothing", "POST", "/v1/weights", {}, 422, "bad_features", "features or keys"),
    ("weights-bad-key", "POST", "/v1/weights", {"keys": [1.5]}, 422, "bad_keys", "integers"),
    ("weights-unknown-model", "POST", "/v1/weights", {"keys": [1], "model": "x"}, 404, "unknown_model", "serving: ctr"),
    ("status-not-object", "POST", "/v1/status", [1], 400, "bad_request", "Expected `object`"),
    ("status-no-source", "POST", "/v1/status", {"status": {}}, 400, "bad_request", "required field `source`"),
    (
        "status-bad-field",
        "POST",
        "/v1/status",
        {"source": "w", "status": {"windows": -1}},
        400,
        "bad_request",
        ">= 0 - at `$.status.windows`",
    ),
    (
        "status-extra",
        "POST",
        "/v1/status",
        {"source": "w", "status": {}, "x": 1},
        400,
        "bad_request",
        "unknown field `x`",
    ),
    ("unknown-route", "GET", "/v1/nope", None, 404, "not_found", "no route GET /v1/nope"),
    ("wrong-method", "GET", "/v1/predict", None, 405, "method_not_allowed", "takes POST"),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "error", "detail"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_requests_get_their_status_and_reason(
    make_api: MakeApi, method: str, path: str, body: Any, status: int, error: str, detail: str
) -> None:
    api = await make_api()
    if isinstance(body, bytes):
        got_status, got = await api.call(method, path, data=body)
    else:
        got_status, got = await api.call(method, path, body)
    assert (got_status, got["error"]) == (status, error), got
    assert detail in got["detail"], got
    # Nothing reached the board or the tables.
    assert await api.control.statuses() == []
    assert sum(len(t) for s in api.shards for t in s.tables.values()) == 0


ADMIN = {"Authorization": f"Bearer {TOKEN}"}

# One valid body of each route of the document that takes a JSON body (the
# test checks the list is the document's).
VALID_BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/exports"): {"kind": "base"},
    ("POST", "/v1/models"): {"name": "other", "numeric": "raw/2"},
    ("POST", "/v1/models/{name}/predict"): {"events": [EV]},
    ("POST", "/v1/predict"): {"events": [EV], "model": "ctr"},
    ("POST", "/v1/status"): {"source": "w", "status": {}},
    ("POST", "/v1/weights"): {"features": {"site": "a"}},
}


async def test_a_json_document_and_more_is_invalid_json_on_every_json_route(make_api: MakeApi, tmp_path: Path) -> None:
    """A body that is one JSON document followed by more bytes (a second
    document, NDJSON's next line, a NUL, a word) is 400 invalid_json on every
    route taking JSON, the valid prefix notwithstanding; a blank body too
    (but on POST /v1/exports, where no body is the schedule's export); and
    ``null``, JSON but no object, is 400 bad_request. Nothing was done: then
    each valid body alone is accepted."""
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    assert sorted(VALID_BODIES) == json_operations(api.doc)
    for (method, route), valid in VALID_BODIES.items():
        path = route.replace("{name}", "ctr")
        for body in with_trailing_bytes(orjson.dumps(valid)):
            status, got = await api.call(method, path, data=body, headers=ADMIN)
            assert (status, got["error"]) == (400, "invalid_json"), (route, body, got)
            assert "not JSON" in got["detail"], got
        status, got = await api.call(method, path, data=b"null", headers=ADMIN)
        assert (status, got["error"]) == (400, "bad_request") and "null" in got["detail"], (route, got)
        if route != "/v1/exports":
            for blank in (b"", b" \n"):
                status, got = await api.call(method, path, data=blank, headers=ADMIN)
                assert (status, got["error"]) == (400, "invalid_json"), (route, got)
    assert await api.control.statuses() == []
    assert [m["name"] for m in (await api.call("GET", "/v1/models"))[1]["models"]] == ["ctr"]
    assert (await api.call("GET", "/v1/exports"))[1]["versions"] == []
    for (method, route), valid in VALID_BODIES.items():
        status, got = await api.call(method, route.replace("{name}", "ctr"), valid, headers=ADMIN)
        assert status in (200, 201), (route, got)


async def test_a_model_name_leaves_room_for_its_tables_names(make_api: MakeApi, tmp_path: Path) -> None:
    """A model's tables are ``<name>_w`` and ``<name>_v``, table names of at
    most 64: a model of 62 characters is made, one of 63 refused naming the
    field, as the document says (it said 64: the shards refused the tables, 502)."""
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    status, got = await api.call("POST", "/v1/models", {"name": "n" * 63, "type": "fm"}, headers=ADMIN)
    assert (status, got["error"]) == (400, "bad_request") and "`$.name`" in got["detail"], got
    status, got = await api.call("POST", "/v1/models", {"name": "n" * 62, "type": "fm"}, headers=ADMIN)
    assert status == 201 and sorted(t["name"] for t in got["model"]["tables"]) == ["n" * 62 + "_v", "n" * 62 + "_w"]


async def test_a_coin_model_is_created_with_its_stakes_and_a_bad_one_refused(make_api: MakeApi, tmp_path: Path) -> None:
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    body = {"name": "bets", "type": "fm", "optimizer": {"name": "coin", "wealth": 2}, "embedding_optimizer": "coin"}
    status, got = await api.call("POST", "/v1/models", body, headers=ADMIN)
    assert status == 201, got
    assert {t["name"]: t["optimizer"] for t in got["model"]["tables"]} == {
        "bets_w": {"name": "coin", "wealth": 2.0, "lipschitz": 1.0, "scale": 0.125},
        "bets_v": {"name": "coin", "wealth": 4.0, "lipschitz": 1.0, "scale": 0.125},
    }
    for bad, named in (({"name": "coin", "wealth": -1}, "$.optimizer.wealth"), ({"name": "coin", "lr": 1}, "lr")):
        status, got = await api.call("POST", "/v1/models", {"name": "nope", "optimizer": bad}, headers=ADMIN)
        assert (status, got["error"]) == (400, "bad_request") and named in got["detail"], got
    assert sorted(m["name"] for m in (await api.call("GET", "/v1/models"))[1]["models"]) == ["bets", "ctr"]


async def test_a_mixture_model_is_created_with_its_learners_and_a_bad_one_refused(
    make_api: MakeApi, tmp_path: Path
) -> None:
    """A linear optimizer ``ftrl_mix`` sizes the linear table 2K (K
    learners' weights, then their log-weights); a mixture of learners is
    no embedding optimizer, and learners named wrong are refused naming why."""
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    mix = {"name": "ftrl_mix", "alpha_1": 0.02, "alpha_2": 0.2, "l1_2": 2}
    status, got = await api.call("POST", "/v1/models", {"name": "mix", "type": "fm", "optimizer": mix}, headers=ADMIN)
    assert status == 201, got
    tables = {t["name"]: t for t in got["model"]["tables"]}
    assert tables["mix_w"]["dim"] == 4 and tables["mix_v"]["dim"] == 8
    assert tables["mix_w"]["optimizer"] == {
        "name": "ftrl_mix",
        **{"alpha_1": 0.02, "l1_1": 0.5, "alpha_2": 0.2, "l1_2": 2.0, "beta": 0.1, "l2": 1.0, "cap": 32.0},
    }
    status, got = await api.call("POST", "/v1/models", {"name": "mix3", "optimizer": "ftrl_mix"}, headers=ADMIN)
    assert status == 201 and got["model"]["tables"][0]["dim"] == 10, got  # the 5 default learners
    for bad, named in (
        ({"optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "l1_2": 1}}, "l1_2 without its alpha_i"),
        ({"optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_3": 0.1}}, "without gaps"),
        ({"optimizer": {"name": "ftrl_mix", "lr": 0.1}}, "lr"),
        ({"optimizer": {"name": "ftrl_mix", **{f"alpha_{i}": 0.1 for i in range(1, 8)}}}, "alpha_7"),
        ({"optimizer": {"name": "ftrl_mix", "alpha_1": -1}}, "$.optimizer.alpha_1"),
        # An embedding table of 10 would pass for the mixture of 5: refused all the same.
        ({"type": "fm", "factors": 10, "embedding_optimizer": "ftrl_mix"}, "nope_v: ftrl_mix"),
        ({"type": "fm", "embedding_optimizer": "ftrl_mix"}, "nope_v: ftrl_mix"),
    ):
        status, got = await api.call("POST", "/v1/models", {"name": "nope", **bad}, headers=ADMIN)
        assert (status, got["error"]) == (400, "bad_request") and named in got["detail"], (bad, got)
    assert sorted(m["name"] for m in (await api.call("GET", "/v1/models"))[1]["models"]) == ["ctr", "mix", "mix3"]


NO_BETA = {"name": "ftrl", "beta": 5e-324, "l2": 0}


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"numeric": numeric}, "numeric")
        for numeric in ["raw/0", "log1p/0", "raw/0.0", "log1p/000000.000000", "raw/-1", "log1p/-0.5", "raw/1e9"]
        + ["raw/1234567", "raw/999999999999999999999", "raw/nan", "log1p/NaN", "raw/inf", "raw/-inf", "raw/0x10"]
        + ["raw/", "raw/1/2"]
    ]
    + [({"optimizer": NO_BETA}, "l2"), ({"type": "fm", "embedding_optimizer": NO_BETA}, "l2")],
)
async def test_a_model_the_schema_takes_but_cannot_be_is_a_bad_request(
    make_api: MakeApi, tmp_path: Path, fields: dict[str, Any], named: str
) -> None:
    """``numeric`` divides by D > 0 of at most 6 digits and 6 decimals: a
    zero, negative, huge, NaN-ish or malformed divisor is 400 bad_request
    naming the field, as are optimizer settings the shards refuse together;
    no model is made."""
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    status, got = await api.call("POST", "/v1/models", {"name": "other", **fields}, headers=ADMIN)
    assert (status, got["error"]) == (400, "bad_request"), got
    assert named in got["detail"], got
    assert [m["name"] for m in (await api.call("GET", "/v1/models"))[1]["models"]] == ["ctr"]


def test_the_bad_request_table_is_broad() -> None:
    assert len(BAD_REQUESTS) >= 15
    assert {s for *_, s, _, _ in BAD_REQUESTS} >= {400, 404, 405, 413, 422}


# -- model info, status and metrics -------------------------------------------------------


def window_report(window: int, events: int, lag: dict[int, int], dlq: dict[str, int]) -> WindowReport:
    m = evaluate(np.array([0.1, 0.8, 0.3]), np.array([0.0, 1.0, 1.0]))
    return WindowReport(
        window=window,
        partitions=sorted(lag),
        events=events,
        records=events + sum(dlq.values()),
        dlq=sum(dlq.values()),
        metrics=m,
        events_per_s=1000.0,
        lag=sum(lag.values()),
        seconds=0.75,
        lag_by_partition=lag,
        dlq_by_reason=dlq,
    )


async def report_windows(control: ControlClient, worker: str, reports: list[WindowReport]) -> WorkerStats:
    """What a worker's status hook reports after each of `reports`."""
    stats = WorkerStats()
    hook = make_status_hook(control, worker, stats)
    for r in reports:
        stats.windows += 1
        stats.records += r.records
        stats.events_trained += r.events
        stats.dead_letters += r.dlq
        stats.dead_letters_by_reason.update(r.dlq_by_reason)
        await hook(r)
    return stats


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_model_info_and_metrics_report_what_was_trained(make_api: MakeApi) -> None:
    api = await make_api("fm")
    rng = np.random.default_rng(4)
    events = synthetic_events(rng, 120)
    await train(api.client, api.model, events)
    await report_windows(
        api.control,
        "w-a",
        [window_report(1, 100, {0: 5, 1: 2}, {"invalid_json": 2}), window_report(2, 20, {0: 1, 1: 0}, {})],
    )
    await report_windows(api.control, "w-b", [window_report(1, 7, {2: 9}, {"bad_label": 1})])
    features = {t: sum(len(s.tables[t]) for s in api.shards) for t in api.model.table_names}
    assert features["ctr_w"] > 100

    status, info = await api.call("GET", "/v1/model")
    assert status == 200
    assert info["model"] == "ctr" and info["config"]["kind"] == "FactorizationMachine"
    assert info["update_mode"] == "async"
    assert {t: info["tables"][t]["features"] for t in features} == features
    assert info["tables"]["ctr_v"]["dim"] == 8 and info["tables"]["ctr_v"]["optimizer"]["name"] == "adagrad"
    assert info["tables"]["ctr_w"]["optimizer"]["name"] == "ftrl_mix" and info["tables"]["ctr_w"]["declared"]
    assert info["tables"]["ctr_w"]["dim"] == 10  # the default mixture of 5 learners
    # One trainer, pulling before each push: 3 pushes per table and shard, none stale.
    assert info["tables"]["ctr_v"]["mode"] == "async"
    assert info["tables"]["ctr_v"]["staleness"] == {"pushes": 6, "mean": 0.0, "down_weighted": 0, "max_staleness": None}
    assert info["features"] == sum(features.values())
    assert info["bytes"] == sum(t.memory_bytes() for s in api.shards for t in s.tables.values())
    assert (info["events_trained"], info["records_consumed"], info["windows"]) == (127, 130, 3)
    assert info["dead_letters"] == {"total": 3, "by_reason": {"invalid_json": 2, "bad_label": 1}}
    assert info["lag"] == {"total": 10, "by_partition": {"0": 1, "1": 0, "2": 9}}
    assert info["last_window"]["window"] == 1 and info["last_window"]["events"] == 7  # w-b's, the latest
    assert [w["source"] for w in info["workers"]] == ["w-a", "w-b"]
    assert info["model_version"] == 1 and info["last_export_version"] is None
    assert info["shards"] == 2

    for _ in range(3):
        assert (await api.call("POST", "/v1/predict", {"events": events[:4]}))[0] == 200
    status, text = await api.call("GET", "/metrics")
    assert status == 200
    m = samples(text)
    for t, n in features.items():
        assert sum(v for (name, lab), v in m.items() if name == "ctrps_table_features" and ("table", t) in lab) == n
    assert m[("ctrps_shard_up", (("shard", "1"),))] == 1.0
    assert m[("ctrps_events_trained_total", (("model", "ctr"), ("worker", "w-a")))] == 120
    assert m[("ctrps_records_consumed_total", (("model", "ctr"), ("worker", "w-b")))] == 8
    assert m[("ctrps_windows_total", (("model", "ctr"), ("worker", "w-a")))] == 2
    assert m[("ctrps_dead_letters_total", (("model", "ctr"), ("reason", "invalid_json"), ("worker", "w-a")))] == 2
    assert m[("ctrps_consumer_lag_records", (("model", "ctr"), ("partition", "2")))] == 9
    assert m[("ctrps_window_seconds_count", (("model", "ctr"), ("worker", "w-a")))] == 2
    assert m[("ctrps_window_seconds_sum", (("model", "ctr"), ("worker", "w-a")))] == 1.5
    assert m[("ctrps_window_seconds_bucket", (("le", "1.0"), ("model", "ctr"), ("worker", "w-a")))] == 2
    assert m[("ctrps_window_seconds_bucket", (("le", "0.5"), ("model", "ctr"), ("worker", "w-a")))] == 0
    assert m[("ctrps_progressive_auc", (("model", "ctr"), ("worker", "w-b")))] == 1.0
    for shard in ("0", "1"):
        labels = (("shard", shard), ("table", "ctr_w"))
        assert m[("ctrps_table_push_staleness_count", labels)] == 3
        assert m[("ctrps_table_push_staleness_bucket", (("le", "0"), *labels))] == 3
        assert m[("ctrps_table_pushes_down_weighted_total", labels)] == 0
    assert m[("ctrps_predict_seconds_count", (("model", "ctr"),))] == 3
    assert m[("ctrps_predict_events_total", (("model", "ctr"),))] == 12
    assert m[("ctrps_http_requests_total", (("route", "/v1/predict"), ("status", "200")))] == 3
    # Every predict pulled each of the 2 tables from each shard.
    for shard in ("0", "1"):
        assert m[("ctrps_shard_rpc_seconds_count", (("op", "pull"), ("shard", shard)))] == 6
        assert m[("ctrps_shard_rpc_seconds_count", (("op", "stats"), ("shard", shard)))] >= 2


async def test_model_info_and_metrics_report_the_lifecycle(make_api: MakeApi) -> None:
    api = await make_api()
    lc = Lifecycle(admit="count:2", max_rows=40, low_water=0.5)
    for shard in api.shards:
        linear = api.model.tables()[0]
        assert shard.configure(TableConfig("ctr_w", linear.dim, dict(linear.optimizer), lifecycle=lc))
    events = synthetic_events(np.random.default_rng(5), 200)
    await train(api.client, api.model, events)
    await train(api.client, api.model, events)
    reports = [shard.evict()["ctr_w"] for shard in api.shards]
    tables = [shard.tables["ctr_w"] for shard in api.shards]
    assert all(r.by_rule["max_rows"] > 0 for r in reports)

    status, info = await api.call("GET", "/v1/model")
    assert status == 200
    life = info["tables"]["ctr_w"]["lifecycle"]
    assert life["rules"] == lc.to_dict()
    assert life["evicted"] == {"ttl": 0, "score": 0, "max_rows": sum(r.by_rule["max_rows"] for r in reports)}
    assert life["eviction_passes"] == 2 and life["bytes_freed"] == sum(r.bytes_freed for r in reports)
    assert life["admitted"] == sum(t.admission.admitted for t in tables if t.admission is not None) > 0
    assert life["dropped"] == sum(t.admission.dropped for t in tables if t.admission is not None) > 0
    assert life["last_eviction_ms"] == max(round(r.pause_ms, 3) for r in reports)

    status, text = await api.call("GET", "/metrics")
    m = samples(text)
    for i, (r, t) in enumerate(zip(reports, tables)):
        lab = (("rule", "max_rows"), ("shard", str(i)), ("table", "ctr_w"))
        assert m[("ctrps_table_evicted_rows_total", lab)] == r.by_rule["max_rows"]
        assert m[("ctrps_table_evicted_bytes_total", (("shard", str(i)), ("table", "ctr_w")))] == r.bytes_freed
        assert t.admission is not None
        dropped = (("outcome", "dropped"), ("shard", str(i)), ("table", "ctr_w"))
        assert m[("ctrps_table_admission_total", dropped)] == t.admission.dropped
        assert ("ctrps_table_eviction_pause_ms", (("shard", str(i)), ("table", "ctr_w"))) in m


async def test_model_info_before_any_worker(make_api: MakeApi) -> None:
    api = await make_api()
    status, info = await api.call("GET", "/v1/model")
    assert status == 200
    assert info["events_trained"] == 0 and info["workers"] == [] and info["last_window"] is None
    assert info["update_mode"] is None and info["lag"] == {"total": 0, "by_partition": {}}
    assert info["tables"]["ctr_w"]["features"] == 0


async def test_a_model_whose_tables_are_not_on_the_shards_is_unknown(transport: str, serve_shards: Any) -> None:
    model = make_model("lr", "ctr")
    if transport == "http":
        _, urls = await serve_shards(1)  # no tables declared
        client, control = planes(urls, 0.5)
    else:
        client, control = PSClient.local([Shard()]), ControlClient.local([Shard()])
    app = create_app(ApiSettings(), client, model, control=control)
    async with TestClient(TestServer(app)) as http:
        async with http.post("/v1/predict", data=orjson.dumps({"events": [EV]})) as resp:
            body = orjson.loads(await resp.read())
            assert resp.status == 404 and body["error"] == "unknown_model"
            assert "ctr_w" in body["detail"]
        async with http.get("/v1/model") as resp:
            info = orjson.loads(await resp.read())
            assert resp.status == 200 and info["tables"]["ctr_w"]["declared"] is False
    await client.close()
    await control.close()


# -- status board and auth ------------------------------------------------------------


async def test_status_board_round_trip_through_the_api(make_api: MakeApi) -> None:
    api = await make_api()
    status, ack = await api.call("POST", "/v1/status", {"source": "ext-1", "status": {"kind": "worker", "windows": 2}})
    assert status == 200 and ack["source"] == "ext-1" and ack["sources"] == 1
    status, board = await api.call("GET", "/v1/status")
    assert status == 200
    assert [(e["source"], e["status"]) for e in board["statuses"]] == [("ext-1", {"kind": "worker", "windows": 2})]
    assert (await api.control.statuses())[0].status["windows"] == 2


async def test_the_guides_status_report_is_accepted(make_api: MakeApi) -> None:
    """The guide's operator note (`ctrps serve`), sent as written there, is stored and read back."""
    page = (PROJECT / "docs" / "guide" / "serve.md").read_text()
    command = page[page.index("curl -s -XPOST localhost:8080/v1/status") :]
    body = orjson.loads(command[command.index("-d '") + 4 : command.index("'\n")])
    api = await make_api()
    status, ack = await api.call("POST", "/v1/status", body)
    assert status == 200, ack
    _, board = await api.call("GET", "/v1/status")
    assert [(e["source"], e["status"]) for e in board["statuses"]] == [(body["source"], body["status"])]
    # Not a worker: the model's summary still counts no worker.
    _, info = await api.call("GET", "/v1/model")
    assert info["workers"] == []


@pytest.mark.parametrize("note", ["x" * 201, "two\nlines", "bell\x07"])
async def test_status_note_is_bounded_text(make_api: MakeApi, note: str) -> None:
    api = await make_api()
    status, body = await api.call("POST", "/v1/status", {"source": "ops", "status": {"note": note}})
    assert status == 400 and body["error"] == "bad_request" and "$.status.note" in body["detail"], body


@pytest.mark.parametrize(
    ("header", "status"),
    [
        (None, 401),
        ("Bearer wrong", 401),
        (f"Bearer {TOKEN}x", 401),
        (f"Basic {TOKEN}", 401),
        ("Bearer", 401),
        (f"Bearer {TOKEN}", 200),
        (f"bearer {TOKEN}", 200),
    ],
)
async def test_admin_routes_need_the_bearer_token(make_api: MakeApi, header: str | None, status: int) -> None:
    api = await make_api(admin_token=TOKEN)
    headers = {"Authorization": header} if header is not None else None
    report = {"source": "w", "status": {"kind": "worker"}}
    got_status, body = await api.call("POST", "/v1/status", report, headers=headers)
    assert got_status == status, body
    board = await api.control.statuses()
    if status == 401:
        assert body["error"] == "unauthorized" and board == []
    else:
        assert [e.source for e in board] == ["w"]
    # Read-only routes stay open.
    assert (await api.call("GET", "/v1/status"))[0] == 200
    assert (await api.call("POST", "/v1/predict", {"events": [EV]}))[0] == 200


async def test_unauthorized_answers_name_the_scheme(make_api: MakeApi) -> None:
    api = await make_api(admin_token=TOKEN)
    async with api.http.post("/v1/status", data=b"{}") as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")


async def test_without_a_token_admin_routes_are_open(make_api: MakeApi) -> None:
    api = await make_api()
    status, _ = await api.call(
        "POST", "/v1/status", {"source": "w", "status": {}}, headers={"Authorization": "Bearer anything"}
    )
    assert status == 200


# -- health, readiness, shards down -----------------------------------------------------


async def test_health_and_readiness(make_api: MakeApi) -> None:
    api = await make_api()
    assert await api.call("GET", "/healthz") == (200, {"status": "ok"})
    assert await api.call("GET", "/readyz") == (200, {"status": "ready", "shards": 2})


@pytest.mark.slow
async def test_a_shard_down_is_503_naming_it(serve_shards: Any) -> None:
    model = make_model("lr", "ctr")
    shards, urls = await serve_shards(2, model.tables())
    client, control = planes(urls, 0.3)
    api_app = create_app(ApiSettings(max_events=MAX_EVENTS), client, model, control=control)
    async with TestClient(TestServer(api_app)) as http:
        api = Api(http, client, control, model, shards, urls, openapi_document(MAX_EVENTS))
        events = synthetic_events(np.random.default_rng(1), 20)  # features on both shards
        assert (await api.call("POST", "/v1/predict", {"events": events}))[0] == 200
        await serve_shards.runners[1].cleanup()
        for method, path, body in [
            ("POST", "/v1/predict", {"events": events}),
            ("POST", "/v1/weights", {"features": events[0]["features"]}),
            ("GET", "/v1/model", None),
            ("GET", "/readyz", None),
        ]:
            status, err = await api.call(method, path, body)
            assert (status, err["error"]) == (503, "shard_unavailable"), (path, err)
            assert "shard 1" in err["detail"] and urls[1] in err["detail"], err
            assert "shard 0" not in err["detail"]
        assert await api.call("GET", "/healthz") == (200, {"status": "ok"})
        # The board is on shard 0, which still answers.
        assert (await api.call("GET", "/v1/status"))[0] == 200
        status, text = await api.call("GET", "/metrics")
        assert status == 200
        m = samples(text)
        assert m[("ctrps_shard_up", (("shard", "1"),))] == 0.0
        assert m[("ctrps_shard_up", (("shard", "0"),))] == 1.0
        assert (
            m[("ctrps_shard_rpc_errors_total", (("error", "shard_unavailable"), ("op", "pull"), ("shard", "1")))] >= 2
        )
        assert m[("ctrps_http_requests_total", (("route", "/v1/predict"), ("status", "503")))] == 1
    await client.close()
    await control.close()


async def test_a_shard_that_refuses_is_502() -> None:
    """A client that disagrees with the shards on their number sends keys to
    the wrong shard; the shard's refusal (moved) is the server's fault, not the caller's."""
    model = make_model("lr", "ctr")
    shard = Shard(ShardSpec(0, 2), model.tables())  # shard 0 of 2, reached as if alone
    client, control = PSClient.local([shard]), ControlClient.local([shard])
    async with TestClient(TestServer(create_app(ApiSettings(), client, model, control=control))) as http:
        api = Api(http, client, control, model, [shard], [], openapi_document())
        status, err = await api.call("POST", "/v1/predict", {"events": synthetic_events(np.random.default_rng(0), 10)})
        assert (status, err["error"]) == (502, "shard_error") and "moved" in err["detail"]


# -- the OpenAPI document -------------------------------------------------------------


@pytest.mark.slow
async def test_every_route_is_documented_and_every_documented_response_happens(
    make_api: MakeApi, tmp_path: Path
) -> None:
    api = await make_api(admin_token=TOKEN, exports=tmp_path)
    routes = {
        (r.method, r.resource.canonical)
        for r in api.http.app.router.routes()
        if r.resource is not None and r.method not in ("HEAD", "*")
    }
    documented = {(m.upper(), p) for p, ops in api.doc["paths"].items() for m in ops}
    assert routes == documented
    events = synthetic_events(np.random.default_rng(3), 5)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    calls: list[tuple[str, str, Any, dict[str, str] | None]] = [
        ("POST", "/v1/predict", {"events": events}, None),
        ("POST", "/v1/predict", {"x": 1}, None),
        ("POST", "/v1/predict", {"events": events, "model": "m"}, None),
        ("POST", "/v1/predict", {"events": [{"f": 1}] * 2000}, None),
        ("POST", "/v1/predict", {"events": [{"f": 1}] * 5000}, None),
        ("POST", "/v1/predict", {"events": []}, None),
        ("GET", "/v1/models", None, None),
        ("POST", "/v1/models/ctr/predict", {"events": events}, None),
        ("POST", "/v1/models/ctr/predict", {"x": 1}, None),
        ("POST", "/v1/models/m/predict", {"events": events}, None),
        ("POST", "/v1/models/ctr/predict", {"events": [{"f": 1}] * 2000}, None),
        ("POST", "/v1/models/ctr/predict", {"events": [{"f": 1}] * 5000}, None),
        ("POST", "/v1/weights", {"features": events[0]["features"]}, None),
        ("POST", "/v1/weights", {"features": 1}, None),
        ("POST", "/v1/weights", {"keys": [1], "model": "m"}, None),
        ("POST", "/v1/weights", {"features": {"x": "y" * MAX_BODY}}, None),
        ("POST", "/v1/weights", {"keys": [-1]}, None),
        ("GET", "/v1/model", None, None),
        ("GET", "/v1/status", None, None),
        ("POST", "/v1/status", {"source": "w", "status": {}}, auth),
        ("POST", "/v1/status", {"source": 1, "status": {}}, auth),
        ("POST", "/v1/status", {"source": "w", "status": {}}, None),
        ("POST", "/v1/status", {"source": "w", "status": {"x": "y" * MAX_BODY}}, auth),
        ("GET", "/healthz", None, None),
        ("GET", "/readyz", None, None),
        ("GET", "/metrics", None, None),
        ("GET", "/openapi.json", None, None),
        ("GET", "/", None, None),
        ("GET", "/v1/history", None, None),
        ("GET", "/v1/history?since=soon", None, None),
        ("POST", "/v1/exports", {}, auth),
        ("POST", "/v1/exports", {"kind": "base"}, auth),
        ("POST", "/v1/exports", {"kind": "sideways"}, auth),
        ("POST", "/v1/exports", {}, None),
        ("POST", "/v1/exports", {"kind": "y" * MAX_BODY}, auth),
        ("GET", "/v1/exports", None, None),
        ("POST", "/v1/exports/compact", None, auth),
        ("POST", "/v1/exports/compact", None, None),
        ("POST", "/v1/models", {"name": "two"}, auth),
        ("POST", "/v1/models", {"name": "two"}, auth),
        ("POST", "/v1/models", {"name": "two", "type": "fm"}, auth),
        ("POST", "/v1/models", {"name": "two", "type": "svm"}, auth),
        ("POST", "/v1/models", {"name": "two"}, None),
        ("POST", "/v1/models", {"name": "y" * MAX_BODY}, auth),
        ("GET", "/v1/model?model=two", None, None),
        ("GET", "/v1/model?model=nope", None, None),
        ("GET", "/v1/exports?model=nope", None, None),
        ("DELETE", "/v1/models/two", None, None),
        ("DELETE", "/v1/models/two", None, auth),
        ("DELETE", "/v1/models/two", None, auth),
        ("DELETE", "/v1/models/ctr", None, auth),
    ]
    for method, path, body, headers in calls:
        await api.call(method, path, body, headers=headers)
    # Without an exporter on shard 0, the exports routes are 404.
    bare = await make_api(admin_token=TOKEN)
    for method, path, body in (
        ("GET", "/v1/exports", None),
        ("POST", "/v1/exports", {}),
        ("POST", "/v1/exports/compact", None),
        ("POST", "/v1/models", {"name": "two"}),
        ("DELETE", "/v1/models/two", None),
    ):
        status, got = await bare.call(method, path, body, headers=auth)
        assert (status, got["error"]) == (404, "no_coordinator"), got
    api.seen |= bare.seen
    # 502 and 503 need a broken cluster: shards that answer 500 to everything,
    # then none at all.
    broken = web.Application()

    async def fail(request: web.Request) -> web.Response:
        return web.json_response({"error": "boom", "detail": "broken on purpose"}, status=500)

    broken.router.add_route("*", "/{tail:.*}", fail)
    async with TestServer(broken) as bad_server:
        url = str(bad_server.make_url(""))
        await _call_every_route(api, [url], auth)
    await _call_every_route(api, [url], auth)  # now closed: 503
    expected = {
        (m.upper(), p, int(s))
        for p, ops in api.doc["paths"].items()
        for m, op in ops.items()
        for s in op["responses"]
        if s != "default"
    }
    assert expected - api.seen == set()


async def _call_every_route(api: Api, urls: list[str], auth: dict[str, str]) -> None:
    """Every shard-reading route, through an app over the shards at `urls`;
    responses checked against the document and recorded in ``api.seen``."""
    client, control = planes(urls, 0.2)
    app = create_app(ApiSettings(max_events=MAX_EVENTS, max_body_bytes=MAX_BODY), client, api.model, control=control)
    async with TestClient(TestServer(app)) as http:
        other = Api(http, client, control, api.model, [], urls, api.doc, api.seen)
        for method, path, body, headers in [
            ("POST", "/v1/predict", {"events": [EV]}, None),
            ("POST", "/v1/models/ctr/predict", {"events": [EV]}, None),
            ("POST", "/v1/weights", {"keys": [1]}, None),
            ("GET", "/v1/model", None, None),
            ("GET", "/v1/status", None, None),
            ("POST", "/v1/status", {"source": "w", "status": {}}, auth),
            ("GET", "/v1/exports", None, None),
            ("POST", "/v1/exports", {}, auth),
            ("POST", "/v1/exports/compact", None, auth),
            ("POST", "/v1/models", {"name": "two"}, auth),
            ("DELETE", "/v1/models/two", None, auth),
            ("GET", "/v1/models", None, None),
            ("GET", "/readyz", None, None),
            ("GET", "/metrics", None, None),
        ]:
            status, _ = await other.call(method, path, body, headers=headers)
            assert status in (200, 502, 503), (path, status)
    await client.close()
    await control.close()


_SHARD_DOC = shard_document()
_API_DOC = openapi_document()


@pytest.mark.parametrize(
    ("doc", "model", "body"),
    [
        (_SHARD_DOC, SnapshotRequest, {"version": 3, "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": 3, "parent": 2}),
        (_SHARD_DOC, SnapshotRequest, {"version": 3}),
        (_SHARD_DOC, SnapshotRequest, {"version": -1, "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": 2**32, "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": 1.5, "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": True, "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": "3", "parent": None}),
        (_SHARD_DOC, SnapshotRequest, {"version": 3, "parent": None, "x": 1}),
        (_SHARD_DOC, Admit, {"epoch": "e", "version": 1}),
        (_SHARD_DOC, Admit, {"epoch": "e" * 201, "version": 1}),
        (_SHARD_DOC, LeaseRequest, {"worker": "w"}),
        (_SHARD_DOC, LeaseRequest, {"worker": "", "wait_s": 1}),
        (_SHARD_DOC, LeaseRequest, {"worker": "w", "wait_s": 301}),
        (_SHARD_DOC, Release, {"lease_id": 1, "offsets": {"t": {"0": 5}}}),
        (_SHARD_DOC, Release, {"lease_id": 1, "offsets": {"t": {"3\n": 5}}}),
        (_SHARD_DOC, Release, {"lease_id": 1, "offsets": {"t": {"03": 5}}}),
        (_SHARD_DOC, Release, {"lease_id": 1, "offsets": {"": {"0": 5}}}),
        (_SHARD_DOC, Release, {"lease_id": 1, "stream": {"cluster_id": "c", "group": "g"}}),
        (_SHARD_DOC, Release, {"lease_id": 1, "stream": {"cluster_id": "", "group": "g"}}),
        (_SHARD_DOC, ExportRequest, {}),
        (_SHARD_DOC, ExportRequest, {"kind": "full"}),
        (_API_DOC, StatusReport, {"source": "w", "status": {"lag_by_partition": {"3": 1}}}),
        (_API_DOC, StatusReport, {"source": "w", "status": {"lag_by_partition": {"³": 1}}}),
        (_API_DOC, StatusReport, {"source": "w\n", "status": {}}),
        (_API_DOC, StatusReport, {"source": "w", "status": {"events_trained": 2**53}}),
        (_API_DOC, StatusReport, {"source": "w", "status": {"windows": 1, "x": 1}}),
        (_API_DOC, StatusReport, {"source": "w", "status": {"kind": "worker", "update_mode": "a b"}}),
        (_API_DOC, WeightsRequest, {"features": {"a": "b"}, "model": None}),
        (_API_DOC, WeightsRequest, {"features": ["a"]}),
        (_API_DOC, WeightsRequest, {"keys": 5}),
        (_API_DOC, WeightsRequest, {"keys": [1], "events": []}),
    ],
)
def test_a_model_and_the_schema_its_document_publishes_agree(
    doc: dict[str, Any], model: type[msgspec.Struct], body: Any
) -> None:
    # Integers written as floats (3.0) aside: JSON Schema calls them
    # integers, the models refuse them (an exact integer is written as one).
    by_document = validate(body, {"$ref": f"#/components/schemas/{model.__name__}"}, doc) == []
    try:
        msgspec.convert(body, model)
        by_model = True
    except msgspec.ValidationError:
        by_model = False
    # The hasher, not the model, refuses an event's content: the schema says more.
    if model is WeightsRequest and by_model:
        return
    assert by_document == by_model, (body, validate(body, {"$ref": f"#/components/schemas/{model.__name__}"}, doc))


@pytest.mark.parametrize("doc", [_API_DOC, openapi_document(replica=True), _SHARD_DOC], ids=["api", "replica", "shard"])
def test_the_documents_are_valid_json_schema_with_anchored_patterns(doc: dict[str, Any]) -> None:
    # Every schema compiles, and every pattern reads the same in Python and
    # in JSON Schema: anchored, ending in $ (the models write \\Z for it).
    patterns: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for name, schema in doc["components"]["schemas"].items():
        assert jsonschema_rs.meta.is_valid({**schema, "components": doc["components"]}), name
    walk(doc)
    assert patterns and all(p.startswith("^") and p.endswith("$") and "\\Z" not in p for p in patterns), patterns


# -- ctrps serve ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.process
async def test_ctrps_serve_answers_and_stops_on_sigterm(serve_shards: Any) -> None:
    model = make_model("lr", "ctr")
    _, urls = await serve_shards(2, model.tables())
    async with ctrps_process(
        "serve", "--shards", ",".join(urls), "--port", "0", "--log-format", "json", "--max-events", "7"
    ) as proc:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), timeout=30)
        started = orjson.loads(line)
        assert started["msg"] == "listening" and started["shards"] == 2 and started["max_events"] == 7
        url = started["url"]
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/readyz") as resp:
                assert resp.status == 200
            async with http.post(url + "/v1/predict", data=orjson.dumps({"events": [EV] * 2})) as resp:
                assert resp.status == 200
                assert orjson.loads(await resp.read())["predictions"] == [0.5, 0.5]
            async with http.post(url + "/v1/predict", data=orjson.dumps({"events": [EV] * 8})) as resp:
                assert resp.status == 422
        proc.send_signal(signal.SIGTERM)
        rest = await asyncio.wait_for(proc.stderr.read(), timeout=30)
        assert await asyncio.wait_for(proc.wait(), timeout=30) == 0
        assert any(orjson.loads(ln)["msg"] == "stopped" for ln in rest.splitlines() if ln.strip())


def ctrps(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CTRPS_")}
    return subprocess.run(
        [sys.executable, "-m", "app.cli", *args],
        cwd=PROJECT,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.mark.slow
@pytest.mark.process
def test_serve_help_shows_an_example_and_every_flag() -> None:
    out = ctrps("serve", "--help")
    assert out.returncode == 0, out.stderr
    assert "example:" in out.stdout and "ctrps serve --shards http://127.0.0.1:7100" in out.stdout
    for flag in ("--shards", "--port", "--host", "--model", "--model-name", "--max-events", "--max-body-bytes"):
        assert flag in out.stdout
    assert "CTRPS_ADMIN_TOKEN" in out.stdout


@pytest.mark.slow
@pytest.mark.process
def test_serve_without_shards_is_a_usage_error() -> None:
    out = ctrps("serve")
    assert out.returncode == 2 and "no shards" in out.stderr
    out = ctrps("serve", "--shards", "http://x", env={"CTRPS_MAX_EVENTS": "many"})
    assert out.returncode == 2 and "CTRPS_MAX_EVENTS" in out.stderr


def test_api_settings_flags_over_environment_over_defaults() -> None:
    parse = build_parser().parse_args
    env = {
        "CTRPS_SHARDS": "http://a:1,http://b:2",
        "CTRPS_API_PORT": "9000",
        "CTRPS_MODEL": "fm",
        "CTRPS_MAX_EVENTS": "20",
        "CTRPS_ADMIN_TOKEN": "tok",
        "CTRPS_SHARD_DEADLINE": "0.5",
    }
    s = ApiSettings.from_args(parse(["serve", "--port", "9100", "--model-name", "m"]), env=env)
    assert s.shards == ("http://a:1", "http://b:2") and s.port == 9100 and s.model == "fm"
    assert (s.model_name, s.max_events, s.admin_token, s.shard_deadline_s) == ("m", 20, "tok", 0.5)
    assert "tok" not in repr(s)
    d = ApiSettings.from_args(parse(["serve", "--shards", "http://c:3"]), env={})
    assert d == ApiSettings(shards=("http://c:3",))
    assert (d.host, d.port, d.model, d.max_events, d.max_body_bytes) == ("127.0.0.1", 8080, "lr", 10_000, 16 << 20)
    for bad in ({"port": 70000}, {"model": "gbdt"}, {"max_events": 0}, {"shard_deadline_s": 0.0}):
        with pytest.raises(SettingsError):
            ApiSettings(**bad)


async def test_exports_through_the_api(make_api: MakeApi, tmp_path: Path) -> None:
    api = await make_api(exports=tmp_path)
    status, model = await api.call("GET", "/v1/model")
    assert status == 200 and model["last_export_version"] is None
    status, first = await api.call("POST", "/v1/exports", {})
    assert status == 201 and (first["version"], first["kind"], first["parent"]) == (1, "base", None)
    status, second = await api.call("POST", "/v1/exports", {"kind": "delta"})
    assert status == 201 and (second["version"], second["kind"], second["parent"]) == (2, "delta", 1)
    status, listed = await api.call("GET", "/v1/exports")
    assert status == 200 and [v["version"] for v in listed["versions"]] == [1, 2]
    assert listed["model"] == "ctr" and listed["last"]["version"] == 2
    assert (tmp_path / "ctr" / "0000000002" / "manifest.json").is_file()
    status, model = await api.call("GET", "/v1/model")
    assert model["last_export_version"] == 2
    # Compaction folds base 1 and delta 2 into a base 2.
    status, folded = await api.call("POST", "/v1/exports/compact")
    assert status == 200 and (folded["version"], folded["kind"], folded["compacted_from"]) == (2, "base", [1, 2])
    status, listed = await api.call("GET", "/v1/exports")
    assert [(v["version"], v["kind"]) for v in listed["versions"]] == [(1, "base"), (2, "base")]


async def test_a_stats_call_cancelled_before_it_starts_leaves_no_coroutine_behind() -> None:
    # A shutdown can cancel a scrape whose per-shard calls were scheduled but
    # never ran: no call coroutine may be left unawaited (a warning, at
    # collection time, that pytest turns into a failure).
    import gc

    from app.api.views import ControlView
    from app.metrics import ApiMetrics

    shards = [Shard(ShardSpec(i, 2)) for i in range(2)]
    view = ControlView(ControlClient.local(shards), ApiMetrics())
    task = asyncio.ensure_future(view.stats_each())
    await asyncio.sleep(0)  # one loop turn, no time: gather has scheduled the per-shard tasks; none has run
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gc.collect()


async def test_model_info_and_metrics_count_only_the_apis_own_models_workers(make_api: MakeApi) -> None:
    """Workers of another model report to the same board: the API of model
    "ctr" counts its own (and those naming no model, from before workers
    named theirs), never the others'."""
    api = await make_api()
    for source, model, events in (("w-ctr", "ctr", 100), ("w-mine", "mine", 7000), ("w-old", None, 5)):
        status: dict[str, Any] = {"kind": "worker", "events_trained": events, "windows": 1}
        if model is not None:
            status["model"] = model
        await api.control.report_status(source, as_worker_status(status))
    status_code, info = await api.call("GET", "/v1/model")
    assert status_code == 200
    assert info["events_trained"] == 105 and info["windows"] == 2
    assert sorted(w["source"] for w in info["workers"]) == ["w-ctr", "w-old"]
    _, text = await api.call("GET", "/metrics")
    m = samples(text)
    # Metrics carry every model's workers, each labelled with its model.
    assert m[("ctrps_events_trained_total", (("model", "ctr"), ("worker", "w-ctr")))] == 100
    assert m[("ctrps_events_trained_total", (("model", "ctr"), ("worker", "w-old")))] == 5
    assert m[("ctrps_events_trained_total", (("model", "mine"), ("worker", "w-mine")))] == 7000


async def test_models_are_listed_and_each_has_its_predict_route(make_api: MakeApi) -> None:
    api = await make_api("fm")
    status, listed = await api.call("GET", "/v1/models")
    assert status == 200
    assert listed == {
        "default": "ctr",
        "models": [
            {
                "name": "ctr",
                "type": "fm",
                "tables": ["ctr_w", "ctr_v"],
                "update_mode": "async",
                "predict": "/v1/models/ctr/predict",
                "default": True,
            }
        ],
    }
    events = synthetic_events(np.random.default_rng(5), 4)
    for e in events:
        e.pop("label", None)
    status, by_route = await api.call("POST", "/v1/models/ctr/predict", {"events": events})
    assert status == 200
    status, plain = await api.call("POST", "/v1/predict", {"events": events, "model": "ctr"})
    assert status == 200 and by_route == plain
    status, err = await api.call("POST", "/v1/models/other/predict", {"events": events})
    assert (status, err["error"]) == (404, "unknown_model") and "'other'" in err["detail"]
    status, err = await api.call("POST", "/v1/models/ctr/predict", {"events": events, "model": "other"})
    assert (status, err["error"]) == (404, "unknown_model")


async def test_the_api_serves_every_model_of_its_cluster(make_api: MakeApi, tmp_path: Path) -> None:
    """A model created on the cluster (admin route) is listed, predicts from
    its own tables, has its own /v1/model, exports and metrics; deleted, it
    is 404 again (after the API's one-second look-up pause)."""
    api = await make_api("lr", exports=tmp_path, admin_token="s3cret")
    admin = {"Authorization": "Bearer s3cret"}
    body = {"name": "ads", "type": "fm", "factors": 4, "optimizer": {"name": "adagrad", "lr": 0.1}}
    status, err = await api.call("POST", "/v1/models", body)
    assert (status, err["error"]) == (401, "unauthorized")
    status, made = await api.call("POST", "/v1/models", body, headers=admin)
    assert status == 201 and made["created"] and made["model"]["type"] == "fm"
    status, again = await api.call("POST", "/v1/models", body, headers=admin)
    assert status == 200 and not again["created"]
    status, err = await api.call("POST", "/v1/models", {**body, "type": "lr"}, headers=admin)
    assert (status, err["error"]) == (409, "model_conflict")
    status, listed = await api.call("GET", "/v1/models")
    assert [(m["name"], m["type"], m["default"]) for m in listed["models"]] == [
        ("ctr", "lr", True),
        ("ads", "fm", False),
    ]

    # Train the two models apart: each predicts from its own tables.
    events = synthetic_events(np.random.default_rng(7), 64)
    await train(api.client, make_model("fm", "ads", k=4, optimizer={"name": "adagrad", "lr": 0.1}), events, rounds=3)
    plain = [{k: v for k, v in e.items() if k != "label"} for e in events[:4]]
    status, ctr = await api.call("POST", "/v1/predict", {"events": plain})
    status2, ads = await api.call("POST", "/v1/models/ads/predict", {"events": plain})
    status3, ads_body = await api.call("POST", "/v1/predict", {"events": plain, "model": "ads"})
    assert (status, status2, status3) == (200, 200, 200)
    assert (ctr["model"], ads["model"]) == ("ctr", "ads") and ads == ads_body
    assert ctr["predictions"] == [0.5] * 4 and ads["predictions"] != ctr["predictions"]
    status, info = await api.call("GET", "/v1/model?model=ads")
    assert status == 200 and info["model"] == "ads" and info["tables"]["ads_v"]["features"] > 0
    status, err = await api.call("GET", "/v1/model?model=nope")
    assert (status, err["error"]) == (404, "unknown_model")
    status, err = await api.call("GET", "/v1/model?mdoel=ads")
    assert (status, err["error"]) == (400, "bad_request")
    status, cut = await api.call("POST", "/v1/exports", {}, headers=admin)
    assert status == 201 and sorted(cut["models"]) == ["ads", "ctr"]
    status, listed = await api.call("GET", "/v1/exports?model=ads")
    assert status == 200 and listed["model"] == "ads" and [v["version"] for v in listed["versions"]] == [1]
    _, text = await api.call("GET", "/metrics")
    m = samples(text)
    assert m[("ctrps_predict_events_total", (("model", "ads"),))] == 8
    assert m[("ctrps_predict_events_total", (("model", "ctr"),))] == 4

    status, gone = await api.call("DELETE", "/v1/models/ads", headers=admin)
    assert status == 200 and sorted(gone["tables_dropped"]) == ["ads_v", "ads_w"]
    status, err = await api.call("DELETE", "/v1/models/ctr", headers=admin)
    assert (status, err["error"]) == (409, "model_conflict")
    status, err = await api.call("POST", "/v1/models/ads/predict", {"events": plain})
    assert (status, err["error"]) == (404, "unknown_model")  # its tables are gone from the shards
