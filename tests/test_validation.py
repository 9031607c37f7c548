"""What a request may carry, and what no request can break.

Each finding is reproduced first as it was reported: a status report whose
partition key is ``"³"`` made ``/v1/model`` and ``/metrics`` answer 500 and
stopped the dashboard's sampler; ``events_trained = 9.2e18`` was stored;
``/v1/snapshots/٣`` fetched cut 3; ``1e9`` and ``0x10`` answered 409; a
compaction with no export answered 502; ``"model": null`` and
``{"events": [{}]}`` disagreed with the document. Real shard servers on
127.0.0.1 and the API in process over them (`PSClient.local` and HTTP).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from documents import validate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from waiting import until

from app.api import create_app
from app.api.history import History
from app.api.openapi import openapi_document, response_schema
from app.api.state import HISTORY
from app.config.serve import ApiSettings
from app.metrics import ApiMetrics, ClusterSnapshot
from app.status import summarize, worker_status
from consumers.worker import WindowReport, WorkerStats
from ps_core.checkpoint.control import ControlClient
from ps_core.errors import InvalidRequestError, StatusError
from ps_core.model.metrics import evaluate
from ps_core.model.models import make_model
from ps_core.net.client import PSClient
from ps_core.net.endpoint import RetryPolicy
from ps_core.parsing import json_int, parse_int
from ps_core.shard import Shard, ShardSpec
from ps_core.store.board import MAX_COUNT, WorkerStatus

TOKEN = "admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def a_status(**changes: Any) -> dict[str, Any]:
    """A worker's status as `app.status.worker_status` builds it, with `changes`."""
    m = evaluate(np.array([0.2, 0.7]), np.array([0.0, 1.0]))
    report = WindowReport(
        window=1,
        partitions=[0, 1],
        events=5,
        records=5,
        dlq=0,
        metrics=m,
        events_per_s=10.0,
        lag=3,
        seconds=0.5,
        lag_by_partition={0: 1, 1: 2},
        dlq_by_reason={},
    )
    stats = WorkerStats(windows=1, records=5, events_trained=5)
    return worker_status(report, stats) | changes


# -- ps_core.parsing ------------------------------------------------------------


@pytest.mark.parametrize("text", ["٣", "³", "1e9", "0x10", "+3", "-3", " 3", "3 ", "3_0", "03", "", "3.0", "１"])
def test_integer_text_is_ascii_digits_only(text: str) -> None:
    with pytest.raises(InvalidRequestError, match="ASCII digits"):
        parse_int(text, "version")


def test_integer_text_in_bounds() -> None:
    assert parse_int("0", "v") == 0 and parse_int("9223372036854775807", "v") == 2**63 - 1
    with pytest.raises(InvalidRequestError, match=r"in \[0, 5\]"):
        parse_int("6", "v", maximum=5)
    with pytest.raises(InvalidRequestError):
        parse_int("9" * 20, "v")


@pytest.mark.parametrize("value", [2.5, 9.2e18, 2.0**53 + 2, True, "3", "1e9", None, [3], 2**63, -1])
def test_json_integers_are_exact_integer_values(value: object) -> None:
    with pytest.raises(InvalidRequestError):
        json_int(value, "version")


def test_a_float_of_an_exact_integer_value_is_that_integer() -> None:
    # JSON Schema's rule (2.0 is the integer 2), which the documents publish.
    assert json_int(3.0, "v") == 3 and type(json_int(1e9, "v")) is int
    assert json_int(2.0**53, "v") == 2**53


# -- the shard: strict integers in paths and bodies ------------------------------


@pytest.fixture
async def shard_http(serve_shards: Any) -> AsyncIterator[tuple[Shard, str, aiohttp.ClientSession]]:
    shards, urls = await serve_shards(1)
    async with aiohttp.ClientSession() as http:
        yield shards[0], urls[0], http


async def _call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else body if isinstance(body, bytes) else orjson.dumps(body)
    async with http.request(method, url, data=data) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if resp.content_type == "application/json" else raw


@pytest.mark.parametrize("text", ["%D9%A3", "%C2%B3", "1e9", "0x10", "+3", "03", "3.0", "-1", "99999999999999999999"])
@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_a_snapshot_version_in_the_path_is_ascii_digits(
    shard_http: tuple[Shard, str, aiohttp.ClientSession], method: str, text: str
) -> None:
    shard, url, http = shard_http
    shard.take_snapshot(3, None)
    status, err = await _call(http, method, f"{url}/v1/snapshots/{text}")
    assert (status, err["error"]) == (400, "bad_request"), err
    assert "ASCII digits" in err["detail"] or "in [0," in err["detail"]
    # Cut 3 is still held: neither fetched nor dropped.
    status, _ = await _call(http, "GET", f"{url}/v1/snapshots/3")
    assert status == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/snapshots", {"version": 1.5, "parent": None}),
        ("/v1/snapshots", {"version": 9.2e18, "parent": None}),
        ("/v1/snapshots", {"version": True, "parent": None}),
        ("/v1/snapshots", {"version": "3", "parent": None}),
        ("/v1/snapshots", {"version": 3, "parent": 2.5}),
        ("/v1/snapshots", b'{"version": 18446744073709551616, "parent": null}'),
        ("/v1/snapshots", {"version": 2**63, "parent": None}),
        ("/v1/membership/admit", {"epoch": "e", "version": 1e300}),
        ("/v1/membership/admit", {"epoch": "e", "version": "0x10"}),
        ("/v1/restore", {"version": 0.5}),
        ("/v1/restore", {"version": -1}),
        ("/v1/snapshots", [1]),
        ("/v1/restore", b"{nope"),
    ],
)
async def test_integer_fields_of_shard_bodies_are_json_integers(
    shard_http: tuple[Shard, str, aiohttp.ClientSession], path: str, body: Any
) -> None:
    _, url, http = shard_http
    status, err = await _call(http, "POST", url + path, body)
    # A body that is not JSON is invalid_json, on every route.
    assert (status, err["error"]) == (400, "invalid_json" if body == b"{nope" else "bad_request"), err


async def test_a_whole_float_in_a_shard_body_is_that_integer(
    shard_http: tuple[Shard, str, aiohttp.ClientSession],
) -> None:
    # JSON Schema's integer, which the document publishes (and a fuzzer sends).
    shard, url, http = shard_http
    status, got = await _call(http, "POST", url + "/v1/snapshots", {"version": 3.0, "parent": 2.0})
    assert status == 200 and "rows" in got, got
    status, _ = await _call(http, "GET", f"{url}/v1/snapshots/3")
    assert status == 200
    status, got = await _call(http, "POST", url + "/v1/status", {"source": "w", "status": {"windows": 5.0}})
    assert status == 200, got
    assert shard.statuses()[-1]["status"] == {"windows": 5.0}


@pytest.mark.parametrize("path", ["/v1/snapshots", "/v1/membership/admit", "/v1/status"])
async def test_a_body_nested_past_any_parser_is_refused(
    shard_http: tuple[Shard, str, aiohttp.ClientSession], path: str
) -> None:
    _, url, http = shard_http
    status, err = await _call(http, "POST", url + path, b'{"version": ' + b"[" * 5000 + b"]" * 5000 + b"}")
    assert (status, err["error"]) == (400, "invalid_json"), err


@pytest.mark.parametrize(
    "body",
    [
        {"lease_id": 1.5, "offsets": {}},
        {"lease_id": 1, "offsets": {"t": {"³": 5}}},
        {"lease_id": 1, "offsets": {"t": {"0x10": 5}}},
        {"lease_id": 1, "offsets": {"t": {"0": 1e300}}},
        {"lease_id": 1, "offsets": {"t": {"0": -1}}},
        {"lease_id": 1, "offsets": [], "x": 1},
    ],
)
async def test_lease_release_integers_are_strict(serve_shards: Any, tmp_path: Path, body: Any) -> None:
    _, urls = await serve_shards(1, exports=tmp_path)
    async with aiohttp.ClientSession() as http:
        status, err = await _call(http, "POST", urls[0] + "/v1/leases/release", body)
    assert (status, err["error"]) == (400, "bad_request"), err


# -- the shard's status board ------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"lag_by_partition": {"³": 1}}, "`key` in `$.status.lag_by_partition`"),
        ({"lag_by_partition": {"03": 1}}, "`key` in `$.status.lag_by_partition`"),
        ({"events_trained": 9.2e18}, "Expected `int`, got `float` - at `$.status.events_trained`"),
        ({"events_trained": 9_200_000_000_000_000_000}, "<= 9007199254740991 - at `$.status.events_trained`"),
        ({"events_trained": MAX_COUNT + 1}, f"<= {MAX_COUNT} - at `$.status.events_trained`"),
        ({"windows": -1}, ">= 0 - at `$.status.windows`"),
        ({"windows": True}, "Expected `int`, got `bool` - at `$.status.windows`"),
        ({"kind": "coordinator"}, "Invalid enum value 'coordinator' - at `$.status.kind`"),
        ({"nested": {"a": 1}}, "unknown field `nested` - at `$.status`"),
        ({"dead_letters_by_reason": {"bad\nlabel": 1}}, "`key` in `$.status.dead_letters_by_reason`"),
        ({"dead_letters_by_reason": {f"r{i}": 1 for i in range(65)}}, "<= 64 - at `$.status.dead_letters_by_reason`"),
        ({"lag_by_partition": {str(i): 1 for i in range(4097)}}, "<= 4096 - at `$.status.lag_by_partition`"),
        ({"reported_at": 1e300}, "<= 10000000000.0 - at `$.status.reported_at`"),
        ({"window_seconds": {"bounds": [1.0], "counts": [1, 0]}}, "field `sum` - at `$.status.window_seconds`"),
    ],
)
async def test_the_board_accepts_only_its_schema(
    shard_http: tuple[Shard, str, aiohttp.ClientSession], changes: dict[str, Any], problem: str
) -> None:
    shard, url, http = shard_http
    shard.report_status("keep", a_status(), now=1.0)
    before = shard.statuses()
    status, err = await _call(http, "POST", url + "/v1/status", {"source": "w", "status": a_status(**changes)})
    assert (status, err["error"]) == (400, "bad_status"), err
    assert problem in err["detail"], err
    assert shard.statuses() == before


@pytest.mark.parametrize("source", ["", " w", "w\n", "é", "x" * 201, 7, None])
def test_a_source_is_short_printable_ascii(source: object) -> None:
    shard = Shard()
    with pytest.raises(StatusError, match="source"):
        shard.report_status(source, a_status())
    assert shard.statuses() == []


def test_what_workers_report_is_what_the_board_accepts() -> None:
    shard = Shard()
    status = a_status(
        started_at=12.5, window_seconds={"bounds": [0.1, 1.0], "counts": [0, 1, 0], "sum": 0.5, "count": 1}
    )
    doc = openapi_document()
    assert validate(status, {"$ref": "#/components/schemas/WorkerStatus"}, doc) == []
    assert msgspec.convert(status, WorkerStatus) is not None
    shard.report_status("host-1-abc", status)
    assert shard.statuses()[0]["status"] == status


# -- nothing stored or sampled breaks a reader -----------------------------------------

# Any JSON at all, as a board (the shard refuses it; a reader still must not break).
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20,
)
_statuses = st.dictionaries(
    st.sampled_from(
        [
            "kind",
            "events_trained",
            "lag_by_partition",
            "dead_letters_by_reason",
            "last_window",
            "window_seconds",
            "stale_offsets",
            "update_mode",
            "windows",
            "records_consumed",
        ]
    ),
    _json_values,
).map(lambda s: s | {"kind": "worker"} if s.get("kind") is None else s)
_boards = st.lists(
    st.fixed_dictionaries({"source": st.text(max_size=5), "received_at": st.floats(0, 2e9), "status": _statuses})
    | _json_values,
    max_size=4,
)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(board=_boards)
def test_summaries_and_metrics_never_fail_on_any_board(board: list[Any]) -> None:
    summary = summarize(board)
    assert summary.lag >= 0 and summary.events_trained >= 0
    exposition = ApiMetrics().render(ClusterSnapshot(stats=[None], board=summary, model="ctr")).decode()
    assert list(text_string_to_metric_families(exposition))


@pytest.fixture(params=["local", "http"])
async def api(request: pytest.FixtureRequest, serve_shards: Any) -> AsyncIterator[tuple[TestClient, Shard]]:  # type: ignore[type-arg]
    model = make_model("lr", "ctr")
    if request.param == "http":
        shards, urls = await serve_shards(1, model.tables())
        client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=0.5))
        control = ControlClient.connect(urls, retry=RetryPolicy(deadline_s=0.5))
    else:
        shards = [Shard(ShardSpec(0, 1), model.tables())]
        client, control = PSClient.local(shards), ControlClient.local(shards)
    app = create_app(ApiSettings(admin_token=TOKEN, history_interval_s=3600.0), client, model, control=control)
    async with TestClient(TestServer(app)) as http:
        yield http, shards[0]
    await client.close()
    await control.close()


async def _api_call(http: TestClient, method: str, path: str, body: Any = None) -> tuple[int, Any]:  # type: ignore[type-arg]
    doc = openapi_document()
    async with http.request(method, path, data=None if body is None else orjson.dumps(body), headers=AUTH) as resp:
        raw, status, ctype = await resp.read(), resp.status, resp.content_type
    parsed = raw.decode() if ctype == "text/plain" else orjson.loads(raw)
    assert validate(parsed, response_schema(doc, path.partition("?")[0], method, status, ctype), doc) == [], parsed
    return status, parsed


async def test_a_partition_key_of_a_superscript_digit_breaks_nothing(api: tuple[TestClient, Shard]) -> None:  # type: ignore[type-arg]
    http, _ = api
    assert (await _api_call(http, "POST", "/v1/status", {"source": "w1", "status": a_status()}))[0] == 200
    status, err = await _api_call(
        http, "POST", "/v1/status", {"source": "w2", "status": a_status(lag_by_partition={"³": 1})}
    )
    assert (status, err["error"]) == (400, "bad_request"), err
    status, err = await _api_call(
        http, "POST", "/v1/status", {"source": "w2", "status": a_status(events_trained=9.2e18)}
    )
    assert status == 400, err
    status, info = await _api_call(http, "GET", "/v1/model")
    assert status == 200 and info["lag"]["by_partition"] == {"0": 1, "1": 2}
    assert [w["source"] for w in info["workers"]] == ["w1"]
    status, text = await _api_call(http, "GET", "/metrics")
    assert status == 200 and 'ctrps_consumer_lag_records{model="ctr",partition="1"} 2.0' in text
    history: History = http.app[HISTORY]
    assert await history.sample() is not None and history.error is None


def _break_statuses(monkeypatch: pytest.MonkeyPatch, history: History, exc: Exception) -> list[Exception]:
    """From now on `history`'s view fails with `exc` (a bug, not an outage:
    an exception no sample expects); the list returned grows by one a call."""
    raised: list[Exception] = []

    async def broken() -> list[dict[str, Any]]:
        raised.append(exc)
        raise exc

    monkeypatch.setattr(history.view, "statuses", broken)
    return raised


async def test_the_sampler_survives_any_exception_and_shows_it(
    api: tuple[TestClient, Shard],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,  # type: ignore[type-arg]
) -> None:
    http, _ = api
    history: History = http.app[HISTORY]
    await history.sample()
    kept = len(history.points())
    calls = _break_statuses(monkeypatch, history, KeyError("received_at"))
    caplog.set_level(logging.WARNING, "ctrps.history")
    for _ in range(3):
        assert await history.sample() is None
    assert len(calls) == 3
    assert history.error is not None and "KeyError" in history.error and "received_at" in history.error
    lines = [r for r in caplog.records if r.name == "ctrps.history"]
    assert len(lines) == 1 and lines[0].exc_info is None, lines
    status, got = await _api_call(http, "GET", "/v1/history")
    assert status == 200 and got["error"] == history.error and len(got["points"]) == kept
    monkeypatch.undo()
    assert await history.sample() is not None and history.error is None


async def test_the_sampling_task_keeps_running_through_errors(
    api: tuple[TestClient, Shard],
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
) -> None:
    http, _ = api
    history = History(http.app[HISTORY].view, make_model("lr", "ctr"), interval_s=0.01, max_points=10)
    failures = _break_statuses(monkeypatch, history, ZeroDivisionError("a bug"))
    async with history:
        await until(lambda: len(failures) >= 3, 10.0, what="three failed samples")
        assert history.running and "ZeroDivisionError" in (history.error or "")
        assert history.points() == []


# -- finding 7: the document and the handlers agree --------------------------------------


async def test_compaction_with_no_export_is_404(serve_shards: Any, tmp_path: Path) -> None:
    model = make_model("lr", "ctr")
    _, urls = await serve_shards(1, model.tables(), tmp_path)
    client = PSClient.connect(urls, retry=RetryPolicy(deadline_s=0.5))
    control = ControlClient.connect(urls, retry=RetryPolicy(deadline_s=0.5))
    app = create_app(ApiSettings(admin_token=TOKEN), client, model, control=control)
    async with TestClient(TestServer(app)) as http:
        status, err = await _api_call(http, "POST", "/v1/exports/compact")
        assert (status, err["error"]) == (404, "export_not_found"), err
    await client.close()
    await control.close()
    async with aiohttp.ClientSession() as raw:
        status, err = await _call(raw, "POST", urls[0] + "/v1/exports/compact")
        assert (status, err["error"]) == (404, "export_not_found"), err


@pytest.mark.parametrize("path", ["/v1/weights", "/v1/predict"])
async def test_model_null_is_the_served_model_as_documented(api: tuple[TestClient, Shard], path: str) -> None:  # type: ignore[type-arg]
    http, _ = api
    body: dict[str, Any] = (
        {"keys": [1], "model": None} if path == "/v1/weights" else {"events": [{"keys": [1]}], "model": None}
    )
    doc = openapi_document()
    request_schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert validate(body, request_schema, doc) == []
    status, _ = await _api_call(http, "POST", path, body)
    assert status == 200


async def _predict_one(http: TestClient, event: dict[str, Any]) -> tuple[list[Any], int, Any]:  # type: ignore[type-arg]
    """What the document's request schema finds wrong with a predict request
    of one event, and the handler's status and answer to it."""
    doc = openapi_document()
    request_schema = doc["paths"]["/v1/predict"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema_errors = validate({"events": [event]}, request_schema, doc)
    status, answer = await _api_call(http, "POST", "/v1/predict", {"events": [event]})
    return schema_errors, status, answer


@pytest.mark.parametrize(
    "event", [{}, {"features": None}, {"keys": None}, {"features": None, "keys": None}, {"id": "x"}]
)
async def test_an_event_without_features_or_keys_is_refused_by_schema_and_handler(
    api: tuple[TestClient, Shard],
    event: dict[str, Any],  # type: ignore[type-arg]
) -> None:
    schema_errors, status, err = await _predict_one(api[0], event)
    assert schema_errors != []
    assert status in (400, 422) and err["error"] in ("bad_request", "bad_features"), err


@pytest.mark.parametrize("event", [{"features": {"a": "b"}}, {"keys": [1]}, {"features": {}, "keys": None}])
async def test_an_event_with_features_or_keys_is_valid_by_both(
    api: tuple[TestClient, Shard],
    event: dict[str, Any],  # type: ignore[type-arg]
) -> None:
    schema_errors, status, _ = await _predict_one(api[0], event)
    assert schema_errors == []
    assert status == 200


async def test_a_whole_float_key_is_that_key_and_a_weight_must_fit_a_float32(api: tuple[TestClient, Shard]) -> None:  # type: ignore[type-arg]
    # What the fuzzer found: 3.0 is the integer 3 by the document's schema, and
    # a weight of 1e300 became an infinite float32 (a warning, then a 500).
    http, _ = api
    status, as_int = await _api_call(http, "POST", "/v1/predict", {"events": [{"keys": [3, 2**60]}]})
    assert status == 200
    status, as_float = await _api_call(http, "POST", "/v1/predict", {"events": [{"keys": [3.0, 2**60]}]})
    assert status == 200 and as_float["predictions"] == as_int["predictions"]
    status, got = await _api_call(http, "POST", "/v1/weights", {"keys": [3.0]})
    assert status == 200 and got["weights"][1]["key"] == 3
    status, err = await _api_call(http, "POST", "/v1/predict", {"events": [{"keys": [1], "weight": 1e300}]})
    assert status == 422 and err["error"] == "bad_weight", err
    status, err = await _api_call(http, "POST", "/v1/predict", {"events": [{"features": {"x": 1e300}}]})
    assert status == 422 and err["error"] == "bad_value", err


@pytest.mark.parametrize("since", ["١٢", " 1", "1_0", "inf", "nan", "0x10", "1e400", "--1", ""])
async def test_history_since_is_a_number_in_ascii(api: tuple[TestClient, Shard], since: str) -> None:  # type: ignore[type-arg]
    http, _ = api
    status, err = await _api_call(http, "GET", f"/v1/history?since={since}")
    assert (status, err["error"]) == (400, "bad_request") and "since" in err["detail"], err


@pytest.mark.parametrize("since", ["0", "-1.5", "1e9", "1796400000.25"])
async def test_history_since_takes_json_numbers(api: tuple[TestClient, Shard], since: str) -> None:  # type: ignore[type-arg]
    http, _ = api
    assert (await _api_call(http, "GET", f"/v1/history?since={since}"))[0] == 200
