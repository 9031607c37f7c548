"""The shard's HTTP server, driven over real sockets on 127.0.0.1.

Every malformed or unusable request must get its typed JSON error body and
leave the shard exactly as it was: same stats (features, bytes, pushes, pulls,
versions) and same table contents.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp.test_utils import TestServer
from documents import json_operations, with_trailing_bytes
from test_codec import keys_of, patch

from ps_core.hashing import shard_of
from ps_core.net import codec, op_encoders
from ps_core.net.codec import Op
from ps_core.net.server import FRAME_CONTENT_TYPE, create_shard_app
from ps_core.net.shard_openapi import shard_document
from ps_core.net.snapshot_transfer import snapshots_from_bytes
from ps_core.shard import Shard, ShardSpec
from ps_core.store.lifecycle import Lifecycle
from ps_core.store.snapshot import MAX_VERSION
from ps_core.store.table import SparseTable
from ps_core.store.table_config import TableConfig

LR = TableConfig("lr", dim=1, optimizer={"name": "ftrl"})
EMB = TableConfig("emb", dim=4, optimizer={"name": "adagrad", "lr": 0.1}, init_scale=0.05, seed=3)
SEED_KEYS = np.array([0, 1, 2, 3, 2**64 - 1], dtype=np.uint64)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    session: aiohttp.ClientSession, url: str, body: bytes, content_type: str = FRAME_CONTENT_TYPE
) -> tuple[int, str, bytes]:
    async with session.post(url, data=body, headers={"Content-Type": content_type}) as resp:
        return resp.status, resp.content_type, await resp.read()


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url) as resp:
        assert resp.content_type == "application/json"
        return resp.status, orjson.loads(await resp.read())


def error_body(content_type: str, raw: bytes) -> dict[str, str]:
    assert content_type == "application/json", raw[:200]
    body: dict[str, str] = orjson.loads(raw)
    assert set(body) == ({"error", "detail", "epoch"} if body.get("error") == "moved" else {"error", "detail"}), body
    assert isinstance(body["detail"], str) and body["detail"]
    return body


def contents(shard: Shard) -> dict[str, tuple[Any, ...]]:
    """Every table's live keys and raw rows (weights and optimizer state)."""
    out = {}
    for name, t in shard.tables.items():
        n = t.index.num_rows
        out[name] = (
            len(t),
            t.index.row_keys[:n].copy(),
            t.index.row_live[:n].copy(),
            t.data[:n].copy(),
            t.shows[:n].copy(),
            t.clicks[:n].copy(),
        )
    return out


def assert_same_contents(a: dict[str, tuple[Any, ...]], b: dict[str, tuple[Any, ...]]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name][0] == b[name][0], name
        for x, y in zip(a[name][1:], b[name][1:]):
            np.testing.assert_array_equal(x, y)


@pytest.fixture
async def one_shard(serve_shards: Any, http: aiohttp.ClientSession) -> tuple[Shard, str]:
    """One shard (of 1) with tables lr and emb, holding a few updated keys."""
    shards, urls = await serve_shards(1, (LR, EMB))
    url = urls[0]
    for cfg in (LR, EMB):
        grads = np.linspace(-1, 1, SEED_KEYS.size * cfg.dim, dtype=np.float32).reshape(-1, cfg.dim)
        status, _, _ = await post(http, url + "/v1/push", op_encoders.encode_push(cfg.name, SEED_KEYS, grads * 4))
        assert status == 200
    return shards[0], url


# -- frames that must be rejected -------------------------------------------------


def _push(table: str = "lr", grads: Any = None, counts: Any = None, keys: Any = None) -> bytes:
    k = keys_of(1, 2, 99) if keys is None else keys
    g = np.array([[0.5], [-1.0], [2.0]], np.float32) if grads is None else np.asarray(grads, np.float32)
    return op_encoders.encode_push(table, k, g, counts=counts)


def _pull(table: str = "lr") -> bytes:
    return op_encoders.encode_pull(table, keys_of(1, 2, 99))


def _push_pull(
    table: str = "lr", grads: Any = None, counts: Any = None, pull: Any = None, request_id: int = 0
) -> bytes:
    """A push of keys 1, 2, 99 (seeded keys and one new) and a pull of the
    seeded keys and another new one."""
    dim = EMB.dim if table == "emb" else 1
    g = np.full((3, dim), 0.5, np.float32) if grads is None else np.asarray(grads, np.float32)
    pk = keys_of(0, 3, 1234) if pull is None else pull
    return op_encoders.encode_push_pull(table, keys_of(1, 2, 99), g, pk, counts=counts, request_id=request_id)


BAD_REQUESTS: list[tuple[str, str, Callable[[], bytes], int, str, str]] = [
    # (id, path, body, status, error code, detail pattern)
    (
        "push-wrong-version",
        "/v1/push",
        lambda: patch(_push(), 4, "B", 7),
        400,
        "bad_frame",
        r"unsupported frame format version 7",
    ),
    (
        "pull-wrong-version",
        "/v1/pull",
        lambda: patch(_pull(), 4, "B", 3),
        400,
        "bad_frame",
        r"unsupported frame format version 3",
    ),
    (
        "push-truncated",
        "/v1/push",
        lambda: _push()[:-3],
        400,
        "bad_frame",
        r"frame is \d+ bytes but its header \(n=3, dim=1\) implies",
    ),
    (
        "pull-truncated",
        "/v1/pull",
        lambda: _pull()[:-8],
        400,
        "bad_frame",
        r"frame is \d+ bytes but its header \(n=3, dim=0\) implies",
    ),
    ("push-short-header", "/v1/push", lambda: _push()[:20], 400, "bad_frame", r"shorter than the 48-byte header"),
    ("pull-empty-body", "/v1/pull", lambda: b"", 400, "bad_frame", r"frame of 0 bytes is shorter"),
    (
        "push-json-body",
        "/v1/push",
        lambda: orjson.dumps({"keys": [1, 2, 3], "grads": [1, 2, 3]}),
        400,
        "bad_frame",
        r"(bad magic|shorter than)",
    ),
    (
        "push-count-mismatch",
        "/v1/push",
        lambda: patch(_push(), 8, "I", 2),
        400,
        "bad_frame",
        r"header \(n=2, dim=1\) implies",
    ),
    (
        "pull-count-mismatch",
        "/v1/pull",
        lambda: patch(_pull(), 8, "I", 5),
        400,
        "bad_frame",
        r"header \(n=5, dim=0\) implies",
    ),
    (
        "push-unknown-table",
        "/v1/push",
        lambda: _push("nope"),
        404,
        "unknown_table",
        r"no table 'nope' on shard 0; declared: \['emb', 'lr'\]",
    ),
    ("pull-unknown-table", "/v1/pull", lambda: _pull("nope"), 404, "unknown_table", r"no table 'nope'"),
    ("push-nan", "/v1/push", lambda: _push(grads=[[1.0], [np.nan], [1.0]]), 400, "invalid_values", r"NaN or inf"),
    ("push-inf", "/v1/push", lambda: _push(grads=[[np.inf], [1.0], [1.0]]), 400, "invalid_values", r"NaN or inf"),
    (
        "push-minus-inf-dim4",
        "/v1/push",
        lambda: _push("emb", grads=np.where(np.eye(3, 4) > 0, -np.inf, 0.1)),
        400,
        "invalid_values",
        r"NaN or inf",
    ),
    (
        "push-dim-mismatch",
        "/v1/push",
        lambda: _push("lr", grads=np.ones((3, 4))),
        400,
        "invalid_values",
        r"table lr has dim 1, the push carries dim 4",
    ),
    (
        "push-dim-mismatch-emb",
        "/v1/push",
        lambda: _push("emb", grads=np.ones((3, 1))),
        400,
        "invalid_values",
        r"table emb has dim 4, the push carries dim 1",
    ),
    (
        "push-negative-counts",
        "/v1/push",
        lambda: _push(counts=np.array([[1, 0], [-1, 0], [2, 1]], np.float32)),
        400,
        "invalid_values",
        r"counts must be \(n, 2\), finite, whole and >= 0",
    ),
    (
        "push-nan-counts",
        "/v1/push",
        lambda: _push(counts=np.array([[1, 0], [1, np.nan], [2, 1]], np.float32)),
        400,
        "invalid_values",
        r"counts must be",
    ),
    ("pull-frame-to-push", "/v1/push", _pull, 400, "bad_frame", r"expected op 2, got 1"),
    ("push-frame-to-pull", "/v1/pull", _push, 400, "bad_frame", r"expected op 1, got 2"),
    (
        "weights-frame-to-pull",
        "/v1/pull",
        lambda: op_encoders.encode_weights("lr", np.zeros((3, 1), np.float32), 1),
        400,
        "bad_frame",
        r"expected op 1, got 3",
    ),
    ("unknown-flags", "/v1/push", lambda: patch(_push(), 6, "H", 2), 400, "bad_frame", r"unknown flags 0x2"),
    # push_pull: whichever section is bad, the push must not be applied either.
    (
        "pp-wrong-version",
        "/v1/push_pull",
        lambda: patch(_push_pull(), 4, "B", 3),
        400,
        "bad_frame",
        r"unsupported frame format version 3",
    ),
    (
        "pp-truncated-pull-keys",
        "/v1/push_pull",
        lambda: _push_pull()[:-8],
        400,
        "bad_frame",
        r"header \(n=3, dim=1, m=3\) implies",
    ),
    (
        "pp-pull-count-mismatch",
        "/v1/push_pull",
        lambda: patch(_push_pull(), 44, "I", 4),
        400,
        "bad_frame",
        r"header \(n=3, dim=1, m=4\) implies",
    ),
    (
        "pp-push-count-mismatch",
        "/v1/push_pull",
        lambda: patch(_push_pull(), 8, "I", 2),
        400,
        "bad_frame",
        r"header \(n=2, dim=1, m=3\) implies",
    ),
    (
        "pp-presence-flag",
        "/v1/push_pull",
        lambda: patch(_push_pull(), 6, "H", 2),
        400,
        "bad_frame",
        r"only pulls carry presence",
    ),
    ("pp-unknown-table", "/v1/push_pull", lambda: _push_pull("nope"), 404, "unknown_table", r"no table 'nope'"),
    (
        "pp-nan",
        "/v1/push_pull",
        lambda: _push_pull(grads=[[1.0], [np.nan], [1.0]]),
        400,
        "invalid_values",
        r"NaN or inf",
    ),
    (
        "pp-dim-mismatch",
        "/v1/push_pull",
        lambda: _push_pull("emb", grads=np.ones((3, 1))),
        400,
        "invalid_values",
        r"table emb has dim 4, the push carries dim 1",
    ),
    (
        "pp-negative-counts",
        "/v1/push_pull",
        lambda: _push_pull(counts=np.array([[1, 0], [-1, 0], [2, 1]], np.float32)),
        400,
        "invalid_values",
        r"counts must be",
    ),
    ("push-frame-to-push-pull", "/v1/push_pull", _push, 400, "bad_frame", r"expected op 5, got 2"),
    ("pull-frame-to-push-pull", "/v1/push_pull", _pull, 400, "bad_frame", r"expected op 5, got 1"),
    ("push-pull-frame-to-push", "/v1/push", _push_pull, 400, "bad_frame", r"expected op 2, got 5"),
    ("push-pull-frame-to-pull", "/v1/pull", _push_pull, 400, "bad_frame", r"expected op 1, got 5"),
    (
        "reply-frame-to-push-pull",
        "/v1/push_pull",
        lambda: op_encoders.encode_push_pull_reply("lr", 3, np.zeros((3, 1), np.float32), 1),
        400,
        "bad_frame",
        r"expected op 5, got 6",
    ),
    # changes: a geo table's question; this shard's table is async.
    ("pull-frame-to-changes", "/v1/changes", _pull, 400, "bad_frame", r"expected op 7, got 1"),
    (
        "changes-frame-to-pull",
        "/v1/pull",
        lambda: op_encoders.encode_changes("lr", 0, 0, keys_of(5)),
        400,
        "bad_frame",
        r"expected op 1, got 7",
    ),
    (
        "changes-of-an-async-table",
        "/v1/changes",
        lambda: op_encoders.encode_changes("lr", 0, 0, keys_of(5)),
        409,
        "mode_conflict",
        r"only a geo table keeps a change log",
    ),
    (
        "changes-unknown-table",
        "/v1/changes",
        lambda: op_encoders.encode_changes("nope", 0, 0, keys_of(5)),
        404,
        "unknown_table",
        r"no table 'nope'",
    ),
    (
        "changes-reply-to-changes",
        "/v1/changes",
        lambda: op_encoders.encode_changes_reply("lr", keys_of(1, 2), 1, 1, complete=True),
        400,
        "bad_frame",
        r"expected op 7, got 8",
    ),
]


@pytest.mark.parametrize(
    ("path", "make_body", "status", "code", "detail"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
async def test_bad_request_gets_json_error_and_changes_nothing(
    one_shard: tuple[Shard, str],
    http: aiohttp.ClientSession,
    path: str,
    make_body: Callable[[], bytes],
    status: int,
    code: str,
    detail: str,
) -> None:
    shard, url = one_shard
    _, stats_before = await get_json(http, url + "/v1/stats")
    before = contents(shard)

    got_status, ctype, raw = await post(http, url + path, make_body())

    assert got_status == status, raw
    body = error_body(ctype, raw)
    assert body["error"] == code
    assert re.search(detail, body["detail"]), body["detail"]
    _, stats_after = await get_json(http, url + "/v1/stats")
    assert stats_after == stats_before
    assert_same_contents(contents(shard), before)


async def test_keys_of_the_other_shard_are_rejected(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(2, (LR,))
    keys = np.arange(64, dtype=np.uint64)
    owner = shard_of(keys, 2)
    mine, theirs = keys[owner == 0][:3], keys[owner == 1][:2]
    mixed = np.concatenate([mine, theirs])
    _, stats_before = await get_json(http, urls[0] + "/v1/stats")

    status, ctype, raw = await post(
        http, urls[0] + "/v1/push", op_encoders.encode_push("lr", mixed, np.ones(5, np.float32))
    )
    assert status == 421  # Misdirected Request: the keys' slots are another shard's
    body = error_body(ctype, raw)
    assert (body["error"], body["epoch"]) == ("moved", 1)
    assert "2 of 5 keys belong to other shards, not shard 0 of 2 at slot map epoch 1" in body["detail"]
    assert f"first: {int(theirs[0])}" in body["detail"]

    status, ctype, raw = await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("lr", mixed))
    assert status == 421 and error_body(ctype, raw)["error"] == "moved"

    _, stats_after = await get_json(http, urls[0] + "/v1/stats")
    assert stats_after == stats_before
    assert len(shards[0].tables["lr"]) == 0

    # The owned keys alone are fine.
    status, _, _ = await post(http, urls[0] + "/v1/push", op_encoders.encode_push("lr", mine, np.ones(3, np.float32)))
    assert status == 200 and len(shards[0].tables["lr"]) == 3


async def test_rejected_push_does_not_consume_its_request_id(
    one_shard: tuple[Shard, str], http: aiohttp.ClientSession
) -> None:
    shard, url = one_shard
    keys = keys_of(500, 501)
    bad = op_encoders.encode_push("lr", keys, np.array([np.nan, 1.0], np.float32), request_id=1234)
    good = op_encoders.encode_push("lr", keys, np.array([3.0, 1.0], np.float32), request_id=1234)
    assert (await post(http, url + "/v1/push", bad))[0] == 400
    status, _, raw = await post(http, url + "/v1/push", good)
    assert status == 200
    assert codec.decode(raw, Op.ACK).count == 2
    assert shard.duplicate_pushes == 0
    assert len(shard.tables["lr"]) == SEED_KEYS.size + 2


async def test_push_pull_with_a_bad_section_on_a_2_shard_server_changes_nothing(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    """Either section holding another shard's key is refused whole: the push
    part is not applied even when it alone is fine (and vice versa)."""
    shards, urls = await serve_shards(2, (LR,))
    keys = np.arange(64, dtype=np.uint64)
    owner = shard_of(keys, 2)
    mine, theirs = keys[owner == 0][:4], keys[owner == 1][:2]
    seed = op_encoders.encode_push("lr", mine, np.ones(4, np.float32), request_id=1)
    assert (await post(http, urls[0] + "/v1/push", seed))[0] == 200
    _, stats_before = await get_json(http, urls[0] + "/v1/stats")
    before = contents(shards[0])
    grads = np.full(4, -2.0, np.float32)
    for body in (
        op_encoders.encode_push_pull("lr", mine, grads, np.concatenate([mine[:1], theirs]), request_id=2),
        op_encoders.encode_push_pull("lr", np.concatenate([mine, theirs]), np.ones(6, np.float32), mine, request_id=3),
    ):
        status, ctype, raw = await post(http, urls[0] + "/v1/push_pull", body)
        assert status == 421, raw
        assert error_body(ctype, raw)["error"] == "moved"
        _, stats_after = await get_json(http, urls[0] + "/v1/stats")
        assert stats_after == stats_before
        assert_same_contents(contents(shards[0]), before)
    # The rejected request id 2 was not consumed: the good request is applied.
    status, _, raw = await post(
        http, urls[0] + "/v1/push_pull", op_encoders.encode_push_pull("lr", mine, grads, mine, request_id=2)
    )
    assert status == 200 and codec.decode(raw, Op.PUSH_PULL_REPLY).applied == 4
    assert shards[0].duplicate_pushes == 0 and shards[0].tables["lr"].pushes == 2


# -- pull and push that work -----------------------------------------------------


async def test_push_then_pull_over_http_matches_a_reference_table(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    _, urls = await serve_shards(1, (EMB,))
    ref = SparseTable(EMB)
    keys = keys_of(2**64 - 1, 0, 7, 7, 42)
    grads = (np.arange(20).reshape(5, 4) / 10 - 1).astype(np.float32)
    counts = np.array([[1, 0], [1, 1], [2, 0], [1, 0], [3, 2]], np.float32)

    status, ctype, raw = await post(
        http, urls[0] + "/v1/push", op_encoders.encode_push("emb", keys, grads, counts=counts)
    )
    assert status == 200 and ctype == FRAME_CONTENT_TYPE
    ack = codec.decode(raw, Op.ACK)
    assert ack.count == 4 == ref.push(keys, grads, counts=counts)
    assert ack.table == "emb" and ack.version == 1

    query = keys_of(42, 7, 0, 2**64 - 1, 123456)
    status, ctype, raw = await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("emb", query))
    assert status == 200 and ctype == FRAME_CONTENT_TYPE
    reply = codec.decode(raw, Op.WEIGHTS)
    assert reply.dim == 4 and reply.count == 5
    np.testing.assert_array_equal(reply.values, ref.pull(query))


async def test_push_pull_equals_push_then_pull(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    """Worker-style steps (push mini-batch i, pull mini-batch i+1): one
    push_pull request per step leaves a shard and answers exactly as a push
    request then a pull request do on another shard server fed the same."""
    (combined,), (url_c,) = await serve_shards(1, (EMB,))
    (sequential,), (url_s,) = await serve_shards(1, (EMB,))
    ref = SparseTable(EMB)
    rng = np.random.default_rng(11)
    pool = np.concatenate([keys_of(0, 2**64 - 1), rng.integers(1, 2**64 - 1, 60, dtype=np.uint64)])
    prev = keys_of()
    for step in range(12):
        nxt = rng.choice(pool, int(rng.integers(1, pool.size)), replace=False)
        nxt = np.concatenate([nxt, nxt[:2]])  # a pull may repeat keys
        grads = rng.standard_normal((prev.size, 4)).astype(np.float32)
        counts = rng.integers(0, 3, (prev.size, 2)).astype(np.float32)
        t = 1.7e9 + step
        status, ctype, raw = await post(
            http,
            url_c + "/v1/push_pull",
            op_encoders.encode_push_pull("emb", prev, grads, nxt, counts=counts, event_time=t, request_id=100 + step),
        )
        assert status == 200 and ctype == FRAME_CONTENT_TYPE
        reply = codec.decode(raw, Op.PUSH_PULL_REPLY)
        if prev.size:
            status, _, ack = await post(
                http,
                url_s + "/v1/push",
                op_encoders.encode_push("emb", prev, grads, counts=counts, event_time=t, request_id=100 + step),
            )
            assert status == 200
            assert reply.applied == codec.decode(ack, Op.ACK).count == prev.size
            assert ref.push(prev, grads, counts=counts, event_time=t) == prev.size
        else:
            assert reply.applied == 0
        status, _, raw = await post(http, url_s + "/v1/pull", op_encoders.encode_pull("emb", nxt))
        weights = codec.decode(raw, Op.WEIGHTS)
        assert (reply.count, reply.dim, reply.version) == (nxt.size, 4, weights.version)
        np.testing.assert_array_equal(reply.values, weights.values)
        np.testing.assert_array_equal(reply.values, ref.pull(nxt))
        prev = np.unique(nxt)
    assert_same_contents(contents(combined), contents(sequential))
    tc, ts = combined.tables["emb"], sequential.tables["emb"]
    assert (tc.pushes, tc.pulls) == (ts.pushes, ts.pulls) == (11, 12)
    n = tc.index.num_rows
    np.testing.assert_array_equal(tc.last_seen[:n], ts.last_seen[:n])
    np.testing.assert_array_equal(tc.changed(), ts.changed())


async def test_retried_push_pull_is_applied_once_and_still_answers(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    shards, urls = await serve_shards(1, (LR,))
    push_keys, pull_keys = keys_of(10, 11, 10), keys_of(11, 12, 10)
    grads = np.array([2.0, -3.0, 1.5], np.float32)
    frame = op_encoders.encode_push_pull("lr", push_keys, grads, pull_keys, request_id=2**63 + 5)
    ref = SparseTable(LR)
    ref.push(push_keys, grads)
    once = ref.pull(pull_keys)

    replies = []
    for _ in range(2):
        status, _, raw = await post(http, urls[0] + "/v1/push_pull", frame)
        assert status == 200
        replies.append(codec.decode(raw, Op.PUSH_PULL_REPLY))
    assert [r.applied for r in replies] == [2, 2]
    for r in replies:
        np.testing.assert_array_equal(r.values, once)  # the retry's pull is answered too
    assert shards[0].duplicate_pushes == 1
    _, stats = await get_json(http, urls[0] + "/v1/stats")
    assert stats["duplicate_pushes"] == 1 and stats["tables"]["lr"]["pushes"] == 1

    # A plain push with the same id is a duplicate as well (one id space).
    status, _, raw = await post(
        http, urls[0] + "/v1/push", op_encoders.encode_push("lr", push_keys, grads, request_id=2**63 + 5)
    )
    assert status == 200 and shards[0].duplicate_pushes == 2
    # Control: a new id is applied.
    again = op_encoders.encode_push_pull("lr", push_keys, grads, pull_keys, request_id=2**63 + 6)
    status, _, raw = await post(http, urls[0] + "/v1/push_pull", again)
    ref.push(push_keys, grads)
    np.testing.assert_array_equal(codec.decode(raw, Op.PUSH_PULL_REPLY).values, ref.pull(pull_keys))
    assert shards[0].tables["lr"].pushes == 2


async def test_push_pull_with_an_empty_part(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1, (EMB,))
    ref = SparseTable(EMB)
    t = shards[0].tables["emb"]
    keys = keys_of(5, 6, 7)
    grads = np.ones((3, 4), np.float32)
    # Push only: applied, and the empty pull answers (0, dim) without counting.
    status, _, raw = await post(
        http,
        urls[0] + "/v1/push_pull",
        op_encoders.encode_push_pull("emb", keys, grads, keys_of(), request_id=1),
    )
    ref.push(keys, grads)
    reply = codec.decode(raw, Op.PUSH_PULL_REPLY)
    assert status == 200 and reply.applied == 3
    assert reply.values is not None and reply.values.shape == (0, 4)
    assert (t.pushes, t.pulls) == (1, 0)
    # Pull only (an empty push of dim 0): nothing applied, no id remembered.
    status, _, raw = await post(
        http,
        urls[0] + "/v1/push_pull",
        op_encoders.encode_push_pull("emb", keys_of(), np.zeros(0, np.float32), keys[::-1], request_id=2),
    )
    reply = codec.decode(raw, Op.PUSH_PULL_REPLY)
    assert status == 200 and reply.applied == 0
    np.testing.assert_array_equal(reply.values, ref.pull(keys[::-1]))
    assert (t.pushes, t.pulls, shards[0].duplicate_pushes) == (1, 1, 0)
    # Both empty: the table's dim, and an unknown table is still an error.
    status, _, raw = await post(
        http,
        urls[0] + "/v1/push_pull",
        op_encoders.encode_push_pull("emb", keys_of(), np.zeros((0, 4), np.float32), keys_of()),
    )
    assert status == 200
    v = codec.decode(raw, Op.PUSH_PULL_REPLY).values
    assert v is not None and v.shape == (0, 4)
    status, _, _ = await post(
        http,
        urls[0] + "/v1/push_pull",
        op_encoders.encode_push_pull("nope", keys_of(), np.zeros((0, 4), np.float32), keys_of()),
    )
    assert status == 404


async def test_empty_pull_answers_with_the_table_dim(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    _, urls = await serve_shards(1, (EMB,))
    status, _, raw = await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("emb", keys_of()))
    assert status == 200
    reply = codec.decode(raw, Op.WEIGHTS)
    assert reply.values is not None and reply.values.shape == (0, 4)


async def test_same_push_request_id_is_applied_once(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1, (LR,))
    keys = keys_of(10, 11, 10)
    grads = np.array([2.0, -3.0, 1.5], np.float32)
    frame = op_encoders.encode_push("lr", keys, grads, request_id=2**63 + 5)
    ref_once = SparseTable(LR)
    ref_once.push(keys, grads)

    acks = []
    for _ in range(2):
        status, _, raw = await post(http, urls[0] + "/v1/push", frame)
        assert status == 200
        acks.append(codec.decode(raw, Op.ACK).count)
    assert acks == [2, 2]
    assert shards[0].duplicate_pushes == 1
    _, stats = await get_json(http, urls[0] + "/v1/stats")
    assert stats["duplicate_pushes"] == 1 and stats["tables"]["lr"]["pushes"] == 1

    status, _, raw = await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("lr", keys[:2]))
    np.testing.assert_array_equal(codec.decode(raw).values, ref_once.pull(keys[:2]))

    # Control: a new request id is applied again.
    again = op_encoders.encode_push("lr", keys, grads, request_id=2**63 + 6)
    assert (await post(http, urls[0] + "/v1/push", again))[0] == 200
    ref_once.push(keys, grads)
    status, _, raw = await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("lr", keys[:2]))
    np.testing.assert_array_equal(codec.decode(raw).values, ref_once.pull(keys[:2]))
    assert shards[0].duplicate_pushes == 1


async def test_pushes_without_request_id_are_never_deduplicated(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1, (LR,))
    frame = op_encoders.encode_push("lr", keys_of(1), np.array([1.0], np.float32))
    for _ in range(3):
        assert (await post(http, urls[0] + "/v1/push", frame))[0] == 200
    assert shards[0].tables["lr"].pushes == 3 and shards[0].duplicate_pushes == 0


# -- table declarations --------------------------------------------------------------


async def declare(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    raw_body = body if isinstance(body, bytes) else orjson.dumps(body)
    status, ctype, raw = await post(http, url + "/v1/tables", raw_body, "application/json")
    assert ctype == "application/json", raw
    return status, orjson.loads(raw)


async def test_declare_creates_then_is_idempotent(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1)
    url = urls[0]
    spec = {"name": "fm", "dim": 8, "optimizer": "adagrad", "init_scale": 0.01, "seed": 4}

    status, body = await declare(http, url, spec)
    assert status == 201 and body["created"] is True
    assert body["table"] == TableConfig("fm", 8, {"name": "adagrad"}, 0.01, 4).to_dict()
    assert shards[0].tables["fm"].dim == 8

    status, body = await declare(http, url, spec)
    assert status == 200 and body["created"] is False

    # The same table spelt with every default written out is the same table.
    explicit = dict(spec, optimizer={"name": "adagrad", "lr": 0.05, "eps": 1e-8})
    status, body = await declare(http, url, explicit)
    assert status == 200 and body["created"] is False

    status, tables = await get_json(http, url + "/v1/tables")
    assert status == 200 and list(tables) == ["fm"]
    assert tables["fm"]["dim"] == 8 and tables["fm"]["optimizer"]["name"] == "adagrad"


async def test_a_coin_table_is_declared_with_its_stake_and_learns(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    shards, urls = await serve_shards(1)
    status, body = await declare(http, urls[0], {"name": "c", "dim": 2, "optimizer": {"name": "coin", "wealth": 2}})
    assert status == 201, body
    assert body["table"]["optimizer"] == {"name": "coin", "wealth": 2.0, "lipschitz": 1.0, "scale": 0.125}
    table = shards[0].tables["c"]
    assert table.width == 2 * 5  # [w0, theta, G, L, reward] per coordinate
    # The same table by name alone is another stake: a conflict, not a silent change.
    status, body = await declare(http, urls[0], {"name": "c", "dim": 2, "optimizer": "coin"})
    assert status == 409 and body["error"] == "table_conflict"
    keys = np.array([3, 4], dtype=np.uint64)
    table.push(keys, np.array([[1.0, -2.0], [0.0, 0.5]], dtype=np.float32))
    # One step with a fresh row's L = 1 and G = 0, wealth 2, the default
    # scale 1/8: w = 2 * theta / (L' (L' + G')) / 8.
    np.testing.assert_allclose(
        table.pull(keys), [[2 * -1 / (1 * 2) / 8, 2 * 2 / (2 * 4) / 8], [0.0, 2 * -0.5 / (1 * 1.5) / 8]], rtol=1e-6
    )


async def test_a_mixture_table_is_declared_with_its_learners_and_learns(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    shards, urls = await serve_shards(1)
    mix = {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.5, "l1_2": 0}
    status, body = await declare(http, urls[0], {"name": "mx", "dim": 4, "optimizer": mix})
    assert status == 201, body
    assert body["table"]["optimizer"] == {
        "name": "ftrl_mix",
        **{"alpha_1": 0.1, "l1_1": 0.5, "alpha_2": 0.5, "l1_2": 0.0, "beta": 0.1, "l2": 1.0, "cap": 32.0},
    }
    table = shards[0].tables["mx"]
    assert table.width == 2 * 3  # [z, n, m] per learner
    # The default learners are another mixture (of 5: dim 10): a conflict.
    status, body = await declare(http, urls[0], {"name": "mx", "dim": 10, "optimizer": "ftrl_mix"})
    assert status == 409 and body["error"] == "table_conflict"
    keys = np.array([3, 4], dtype=np.uint64)
    table.push(keys, np.array([[1.0, -2.0, 0.3, 0.1], [0.0, 0.5, 2.5, 0.0]], dtype=np.float32))
    # One FTRL step from 0 per learner, z = g and n = g^2, beta 0.1, l2 1:
    # w = -sign(z) max(|z| - l1, 0) / ((beta + |g|) / alpha + l2); the
    # log-weights add theirs, less their smallest, at most 1.
    np.testing.assert_allclose(
        table.pull(keys),
        [[-0.5 / (1.1 / 0.1 + 1), 2 / (2.1 / 0.5 + 1), 0.2, 0.0], [0.0, -0.5 / (0.6 / 0.5 + 1), 1.0, 0.0]],
        rtol=1e-6,
        atol=1e-7,
    )


async def test_a_declaration_carries_its_lifecycle(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1)
    url = urls[0]
    rules = {"admit": "count:3", "ttl_s": 604800, "max_rows": 1000}
    status, body = await declare(http, url, {"name": "lr", "lifecycle": rules})
    assert status == 201
    assert body["table"]["lifecycle"] == Lifecycle(admit="count:3", ttl_s=604800.0, max_rows=1000).to_dict()
    assert shards[0].tables["lr"].admission is not None
    # A worker's declaration (no lifecycle) is the same table; other rules conflict.
    assert (await declare(http, url, {"name": "lr"}))[0] == 200
    status, body = await declare(http, url, {"name": "lr", "lifecycle": {"admit": "count:2"}})
    assert status == 409 and body["error"] == "table_conflict"
    for bad, why in (
        ({"admit": "count:0"}, "N must be an integer"),
        ({"admit": "sometimes"}, "admit"),
        ({"low_water": 1.5}, "low_water"),
        ({"ttl": 5}, "ttl"),
    ):
        status, body = await declare(http, url, {"name": "t2", "lifecycle": bad})
        assert status == 400 and why in body["detail"], body
    _, stats = await get_json(http, url + "/v1/stats")
    life = stats["tables"]["lr"]["lifecycle"]
    assert life["lifecycle"]["admit"] == "count:3" and life["admission"] == {
        "admitted": 0,
        "dropped": 0,
        "sketch_bytes": 4 << 20,
        "sketch_agings": 0,
    }


async def test_declare_with_a_different_config_conflicts(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1, (LR,))
    for other in (
        {"name": "lr", "dim": 2},
        {"name": "lr", "optimizer": "sgd"},
        {"name": "lr", "optimizer": {"name": "ftrl", "alpha": 0.1}},
        {"name": "lr", "init_scale": 0.5},
        {"name": "lr", "seed": 1},
    ):
        status, body = await declare(http, urls[0], other)
        assert status == 409, other
        assert body["error"] == "table_conflict"
        assert "table lr exists with" in body["detail"]
    assert shards[0].tables["lr"].config == LR


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"name": "t", "optimizer": "adam"}, r"Invalid enum value 'adam' - at `\$.optimizer`"),
        ({"name": "t", "optimizer": {"alpha": 1}}, r"missing required field `name` - at `\$.optimizer`"),
        ({"name": "t", "dim": 0}, r"Expected `int` >= 1 - at `\$.dim`"),
        ({"name": "t", "dim": 5000}, r"Expected `int` <= 4096 - at `\$.dim`"),
        ({"name": "t", "dim": 2.5}, r"Expected `int`, got `float` - at `\$.dim`"),
        ({"name": "t", "dim": True}, r"Expected `int`, got `bool` - at `\$.dim`"),
        ({"name": "t", "seed": -1}, r"Expected `int` >= 0 - at `\$.seed`"),
        ({"name": "t", "seed": "1"}, r"Expected `int`, got `str` - at `\$.seed`"),
        ({"name": "t", "init_scale": -0.1}, r"Expected `float` >= 0.0 - at `\$.init_scale`"),
        ({"name": "t", "init_scale": 1e300}, r"Expected `float` <= 1000.0 - at `\$.init_scale`"),
        ({"name": "t", "init_scale": "big"}, r"Expected `float`, got `str` - at `\$.init_scale`"),
        (
            {"name": "t", "optimizer": {"name": "ftrl", "alpha": -1}},
            r"Expected `float` >= 1e-12 - at `\$.optimizer.alpha`",
        ),
        (
            {"name": "t", "optimizer": {"name": "ftrl", "l1": 1e300}},
            r"Expected `float` <= 1000000.0 - at `\$.optimizer.l1`",
        ),
        ({"name": "t", "optimizer": {"name": "ftrl", "beta": 5e-324, "l2": 0}}, r"ftrl needs beta or l2"),
        (
            {"name": "t", "optimizer": {"name": "sgd", "lr": "0.1"}},
            r"Expected `float`, got `str` - at `\$.optimizer.lr`",
        ),
        ({"name": "t", "optimizer": {"name": "sgd", "momentum": 0.9}}, r"unknown field `momentum` - at `\$.optimizer`"),
        (
            {"name": "t", "optimizer": {"name": "coin", "wealth": -1}},
            r"Expected `float` >= 1e-12 - at `\$.optimizer.wealth`",
        ),
        ({"name": "t", "optimizer": {"name": "coin", "lr": 0.1}}, r"unknown field `lr` - at `\$.optimizer`"),
        ({"name": "t", "optimizer": "ftrl_mix"}, r"table t: a mixture of 5 learners has 10 weights a row, not 1"),
        (
            {"name": "t", "dim": 6, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 0.2}},
            r"a mixture of 2 learners has 4 weights a row, not 6",
        ),
        ({"name": "t", "dim": 10, "optimizer": {"name": "ftrl_mix", "l1_2": 1}}, r"ftrl_mix: l1_2 without its alpha_i"),
        (
            {"name": "t", "dim": 4, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_2": 1, "l1_3": 1}},
            r"ftrl_mix: l1_3 without its alpha_i",
        ),
        (
            {"name": "t", "dim": 4, "optimizer": {"name": "ftrl_mix", "alpha_1": 0.1, "alpha_3": 0.2}},
            r"numbered 1\.\.K without gaps, got alpha_\[1, 3\]",
        ),
        (
            {"name": "t", "dim": 6, "optimizer": {"name": "ftrl_mix", "lr": 0.1}},
            r"unknown field `lr` - at `\$.optimizer`",
        ),
        (
            {"name": "t", "dim": 14, "optimizer": {"name": "ftrl_mix", **{f"alpha_{i}": 0.1 for i in range(1, 8)}}},
            r"unknown field `alpha_7` - at `\$.optimizer`",
        ),
        (
            {"name": "t", "dim": 6, "optimizer": {"name": "ftrl_mix", "alpha_2": 0}},
            r"Expected `float` >= 1e-12 - at `\$.optimizer.alpha_2`",
        ),
        ({"name": "t", "dim": 6, "optimizer": {"name": "ftrl_mix", "cap": 0}}, r"at `\$.optimizer.cap`"),
        ({"name": "t", "optimizer": 3}, r"Expected `str \| object`, got `int` - at `\$.optimizer`"),
        ({"name": "t", "shards": 2}, r"unknown field `shards`"),
        ({"dim": 2}, r"missing required field `name`"),
        ({"name": "no spaces"}, r"Expected `str` matching regex .* - at `\$.name`"),
        ({"name": "x" * 65}, r"Expected `str` matching regex .* - at `\$.name`"),
        ([{"name": "t"}], r"Expected `object`, got `array`"),
        (b"{not json", r"body is not JSON"),
        (b"", r"body is not JSON"),
    ],
)
async def test_invalid_declaration_is_rejected(
    serve_shards: Any, http: aiohttp.ClientSession, body: Any, detail: str
) -> None:
    shards, urls = await serve_shards(1, (LR,))
    status, reply = await declare(http, urls[0], body)
    assert status == 400, reply
    # A body that is not JSON is invalid_json, on every route.
    assert reply["error"] == ("invalid_json" if isinstance(body, bytes) else "bad_table_config")
    assert re.search(detail, reply["detail"]), reply["detail"]
    assert list(shards[0].tables) == ["lr"]


# One valid body of each route of the shard's document that takes a JSON body
# (the test checks the list is the document's).
VALID_BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/v1/exports"): {"kind": "base"},
    ("POST", "/v1/leases"): {"worker": "w", "wait_s": 0},
    ("POST", "/v1/leases/release"): {"lease_id": 1},
    ("POST", "/v1/leases/renew"): {"lease_id": 1},
    ("POST", "/v1/membership/admit"): {"epoch": "e", "version": 0},
    ("POST", "/v1/models"): {"name": "other", "numeric": "raw/2"},
    ("POST", "/v1/restore"): {"version": 0},
    ("POST", "/v1/snapshots"): {"version": 1, "parent": None},
    ("POST", "/v1/status"): {"source": "w", "status": {}},
    ("POST", "/v1/sync/apply"): {"step": 0},
    ("POST", "/v1/sync/arrive"): {"worker": "w", "deadline_s": 0},
    ("POST", "/v1/sync/join"): {"worker": "w"},
    ("POST", "/v1/sync/leave"): {"worker": "w"},
    ("POST", "/v1/tables"): {"name": "t", "dim": 1},
    # A slot map the shard holds already: taken or refused as not newer, nothing moved.
    ("PUT", "/v1/slots"): {"epoch": 1, "num_shards": 1, "slots": 4096, "even": True},
    ("POST", "/v1/slots/move"): {"slots": [], "to": 0},
    ("POST", "/v1/slots/hand_off"): {
        "slots": [0],
        "slot_map": {"epoch": 1, "num_shards": 1, "slots": 4096, "even": True},
    },
}


async def test_a_json_document_and_more_is_invalid_json_on_every_json_route(
    serve_shards: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """On shard 0 with a coordinator and an exporter, a body that is one JSON
    document followed by more bytes is 400 invalid_json on every route
    taking JSON, a blank body too (but on POST /v1/exports, where no body is
    the schedule's export), and ``null`` is the route's 400 naming the type.
    Nothing was done: then each valid body alone is not refused."""
    shards, urls = await serve_shards(1, (LR,), tmp_path)
    assert sorted(VALID_BODIES) == json_operations(shard_document())

    # The last export's age moves with the clock: the rest of the stats must not move.
    def still(stats: dict[str, Any]) -> dict[str, Any]:
        return stats | {"exports": {k: v for k, v in stats["exports"].items() if k != "age_s"}}

    stats, membership = still(shards[0].stats()), shards[0].membership()

    async def call(method: str, route: str, body: bytes) -> tuple[int, dict[str, str]]:
        headers = {"Content-Type": "application/json"}
        async with http.request(method, urls[0] + route, data=body, headers=headers) as resp:
            status, ctype, raw = resp.status, resp.content_type, await resp.read()
        return status, error_body(ctype, raw) if status >= 400 else orjson.loads(raw)

    for (method, route), valid in VALID_BODIES.items():
        for body in with_trailing_bytes(orjson.dumps(valid)):
            status, got = await call(method, route, body)
            assert (status, got["error"]) == (400, "invalid_json"), (route, body, got)
            assert "not JSON" in got["detail"], got
        status, got = await call(method, route, b"null")
        assert status == 400 and got["error"] != "invalid_json" and "null" in got["detail"], (route, got)
        if route != "/v1/exports":
            for blank in (b"", b" \n"):
                status, got = await call(method, route, blank)
                assert (status, got["error"]) == (400, "invalid_json"), (route, got)
    assert still(shards[0].stats()) == stats and list(shards[0].tables) == ["lr"]
    assert shards[0].statuses() == [] and shards[0].membership() == membership
    for (method, route), valid in VALID_BODIES.items():
        status, got = await call(method, route, orjson.dumps(valid))
        assert status < 400 or got["error"] not in ("invalid_json", "bad_request"), (route, got)


async def test_a_cut_at_the_last_version_leaves_the_shard_able_to_cut_again(
    serve_shards: Any, http: aiohttp.ClientSession
) -> None:
    """A cut may take any version up to MAX_VERSION (the document's bound).
    After one there, the tables' open version is past it, and the next cut
    (a stray request's, a new coordinator's) was a 500: the table marked its
    open version exported before the shard marked the cut's."""
    shards, urls = await serve_shards(1, (LR,))
    for version in (MAX_VERSION, MAX_VERSION, 5):
        body = orjson.dumps({"version": version, "parent": None})
        status, ctype, raw = await post(http, urls[0] + "/v1/snapshots", body, "application/json")
        assert (status, ctype) == (200, "application/json"), raw[:300]
        assert shards[0].tables["lr"].last_snapshot == version
    async with http.get(urls[0] + "/v1/snapshots/5") as resp:
        assert resp.status == 200
        assert [s.version for s in snapshots_from_bytes(await resp.read())] == [5]


async def test_declaration_with_a_null_name_is_rejected(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    shards, urls = await serve_shards(1)
    status, reply = await declare(http, urls[0], {"name": None, "dim": 2})
    assert status == 400 and reply["error"] == "bad_table_config"
    assert shards[0].tables == {}


# -- stats, health, limits ---------------------------------------------------------------


async def test_stats_report_features_bytes_and_calls(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    _, urls = await serve_shards(1, (LR, EMB))
    _, empty = await get_json(http, urls[0] + "/v1/stats")
    assert empty["shard_id"] == 0 and empty["num_shards"] == 1
    assert empty["duplicate_pushes"] == 0
    assert empty["tables"]["lr"]["features"] == 0 and empty["tables"]["lr"]["pushes"] == 0
    assert empty["tables"]["lr"]["config"] == LR.to_dict()

    keys = np.arange(5000, dtype=np.uint64)
    for batch in np.array_split(keys, 2):
        frame = op_encoders.encode_push("lr", batch, np.ones(batch.size, np.float32))
        assert (await post(http, urls[0] + "/v1/push", frame))[0] == 200
    assert (await post(http, urls[0] + "/v1/pull", op_encoders.encode_pull("emb", keys[:3])))[0] == 200

    status, stats = await get_json(http, urls[0] + "/v1/stats")
    assert status == 200
    lr, emb = stats["tables"]["lr"], stats["tables"]["emb"]
    assert (lr["features"], lr["pushes"], lr["pulls"]) == (5000, 2, 0)
    assert (emb["features"], emb["pushes"], emb["pulls"]) == (0, 0, 1)
    # 5000 rows of 2 float32 slots plus metadata and index: well above 40 kB.
    assert lr["bytes"] > 5000 * 8 > 0
    assert lr["bytes"] > empty["tables"]["lr"]["bytes"]


async def test_healthz(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    _, urls = await serve_shards(2)
    for i, url in enumerate(urls):
        status, body = await get_json(http, url + "/healthz")
        assert status == 200
        assert body == {"status": "ok", "shard_id": i, "num_shards": 2, "rpc_port": None}


async def test_wrong_method_and_unknown_route_get_json_errors(serve_shards: Any, http: aiohttp.ClientSession) -> None:
    _, urls = await serve_shards(1)
    async with http.get(urls[0] + "/v1/push") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"  # RFC 9110: a 405 names the methods the route takes
        error = error_body(resp.content_type, await resp.read())
        assert error == {"error": "method_not_allowed", "detail": "/v1/push takes POST, not GET"}
    async with http.delete(urls[0] + "/healthz") as resp:
        assert (resp.status, resp.headers["Allow"]) == (405, "GET, HEAD")
    async with http.get(urls[0] + "/v2/nothing") as resp:
        assert resp.status == 404
        assert error_body(resp.content_type, await resp.read())["error"] == "not_found"


@pytest.fixture
async def small_body_server() -> AsyncIterator[tuple[Shard, str]]:
    shard = Shard(ShardSpec(0, 1), (LR,))
    server = TestServer(create_shard_app(shard, max_body=1024), host="127.0.0.1")
    await server.start_server()
    try:
        yield shard, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.parametrize("path", ["/v1/push", "/v1/pull", "/v1/push_pull", "/v1/tables"])
async def test_body_over_the_limit_is_413_json(
    small_body_server: tuple[Shard, str], http: aiohttp.ClientSession, path: str
) -> None:
    shard, url = small_body_server
    keys = np.arange(200, dtype=np.uint64)  # 1600 bytes of keys alone
    big = {
        "/v1/push": op_encoders.encode_push("lr", keys, np.ones(200, np.float32)),
        "/v1/pull": op_encoders.encode_pull("lr", keys),
        "/v1/push_pull": op_encoders.encode_push_pull("lr", keys[:10], np.ones(10, np.float32), keys),
        "/v1/tables": orjson.dumps({"name": "t", "optimizer": {"name": "sgd"}, "x": "y" * 2000}),
    }[path]
    assert len(big) > 1024
    status, ctype, raw = await post(http, url + path, big)
    assert status == 413
    body = error_body(ctype, raw)
    assert body["error"] == "too_large"
    assert "1024" in body["detail"]
    assert len(shard.tables["lr"]) == 0 and shard.tables["lr"].pushes == 0
    assert list(shard.tables) == ["lr"]

    # A small request on the same server still works.
    small = op_encoders.encode_push("lr", keys[:10], np.ones(10, np.float32))
    assert len(small) <= 1024
    status, _, raw = await post(http, url + "/v1/push", small)
    assert status == 200 and codec.decode(raw, Op.ACK).count == 10
