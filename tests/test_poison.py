"""Poison pills through the real broker and a real ``ctrps worker``: a topic
written by an independent client (confluent-kafka) mixes good events with
messages that cannot be trained (event times and weights beyond what the
shards keep, messages larger than a dead-letter record, and every invalid
kind). The worker trains every good event once and dead-letters every pill
with its reason and source offset, the large ones truncated; it never stops."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
import pytest
from commands import ctrps, ctrps_process
from jsonlog import read_json_lines
from streams import applications, committed, confluent_produce, consume_all, keyed_event, new_topic
from test_cluster import admin_headers, kill_cluster, start_cluster, wait_for_line
from test_cluster import bias_shows as cluster_bias_shows
from waiting import until

from consumers.dlq import MAX_RECORD_BYTES, read_headers
from ps_core.hashing import shard_of

pytestmark = pytest.mark.slow  # real processes for seconds each: make test-fast leaves them out

GOOD = 264  # with the pills, 7 windows of 40 messages: the last one closes too
BIG = 5_000_000
PRICE = b'{"label":0,"features":{"price":2e6}}'
LARGE = {"message.max.bytes": 2 * BIG}  # the producer's own limit, 1 MB by default
PILLS: list[tuple[bytes, str]] = [
    # Accepted before, then refused by the shard: the worker crashed on them.
    (b'{"label":1,"ts":1e300,"features":{"a":"x"}}', "bad_ts"),
    (b'{"label":1,"weight":1e30,"features":{"a":"x"}}', "bad_weight"),
    (PRICE, "bad_value"),  # fed raw beyond MAX_VALUE
    # Larger than a dead-letter record: the dead-letter producer refused them.
    (orjson.dumps({"label": 1, "features": {"a": "x" * BIG}}), "oversized"),
    (orjson.dumps({"label": 1, "features": {f"f{i}": i for i in range(100_000)}}), "oversized"),
    # Dead-lettered already.
    (b'{"label":1,"ts":-5,"features":{"a":"x"}}', "bad_ts"),
    (b"{not json", "invalid_json"),
    (b"", "empty"),
    (b"[1, 2]", "not_an_object"),
    (b'{"features":{"a":"x"}}', "missing_label"),
    (b'{"label":7,"features":{"a":"x"}}', "bad_label"),
    (b'{"label":1}', "bad_features"),
    (b'{"label":1,"features":{"x":{"y":1}}}', "bad_value"),
    (b'{"label":1,"features":{"x":1e39}}', "bad_value"),
    (b'{"label":1,"keys":[-1]}', "bad_keys"),
    (b'{"label":1,"weight":-1,"features":{"a":"x"}}', "bad_weight"),
]


async def _through_ctrps_worker(
    bootstrap: str,
    urls: list[str],
    topic: str,
    group: str,
    n: int,
    *extra: str,
    before: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """A ``ctrps worker`` (windows of 40 messages, model "m" fed raw numbers,
    then `extra` arguments) runs until all `n` messages of `topic` are
    committed, then is stopped: it must not exit before, and must exit 0.
    `before` is awaited once it started."""
    args = ["worker", "--bootstrap", bootstrap, "--shards", ",".join(urls), "--topic", topic]
    args += ["--group", group, "--model-name", "m", "--numeric", "raw", "--window-events", "40"]
    args += ["--window-seconds", "3600", "--decode-processes", "0", "--session-timeout-ms", "6000", *extra]
    async with ctrps_process(*args) as proc:
        if before is not None:
            await before()
        assert proc.stderr is not None
        log = asyncio.create_task(proc.stderr.read())  # drained: a full pipe would stop the worker

        async def done() -> bool:
            if proc.returncode is not None:
                raise AssertionError(f"ctrps worker exited {proc.returncode}: {(await log)[-3000:]!r}")
            return (await committed(bootstrap, group, topic, 1))[0] == n

        try:
            await until(done, 90, what="every message to be committed", poll_s=0.5)
        except AssertionError as exc:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            raise AssertionError(
                f"{exc}; committed {await committed(bootstrap, group, topic, 1)}, worker log: {(await log)[-4000:]!r}"
            ) from None
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=60) == 0, (await log)[-3000:]


def _assert_dead_letters(dead: list[Any], values: list[bytes], pill_at: dict[int, str], topic: str) -> None:
    """`dead` are the dead letters of exactly the pills (offset → reason), from
    `topic`, each the original bytes or, if too large, their start and size."""
    headers = [read_headers(r.headers) for r in dead]
    assert {int(h["ctrps-source-offset"]): h["ctrps-reason"] for h in headers} == pill_at
    assert len(dead) == len(pill_at)
    for r, h in zip(dead, headers):
        original = values[int(h["ctrps-source-offset"])]
        assert h["ctrps-source-topic"] == topic and h["ctrps-source-partition"] == "0"
        if len(original) < MAX_RECORD_BYTES - 2000:
            assert r.value == original and "ctrps-original-bytes" not in h
        else:  # the start, as much as one record holds, and the original size
            assert int(h["ctrps-original-bytes"]) == len(original)
            assert MAX_RECORD_BYTES - 2000 < len(r.value) < MAX_RECORD_BYTES and original.startswith(r.value)


@pytest.mark.parametrize("pill", PILLS[:5], ids=["ts-1e300", "weight-1e30", "value-fed-2e6", "5MB", "100k-features"])
@pytest.mark.process
async def test_one_pill_is_dead_lettered_and_the_rest_trained(
    kafka_bootstrap: str, serve_shards: Any, pill: tuple[bytes, str]
) -> None:
    topic, group = await new_topic(kafka_bootstrap, 1)
    shards, urls = await serve_shards(2)
    values = [keyed_event(i) for i in range(20)] + [pill[0]] + [keyed_event(i) for i in range(20, 39)]
    await asyncio.to_thread(confluent_produce, kafka_bootstrap, topic, values, config=LARGE)
    await _through_ctrps_worker(kafka_bootstrap, urls, topic, group, len(values))
    applied = applications(shards, 0, 39)
    assert (applied == 1).all(), applied
    _assert_dead_letters(await consume_all(kafka_bootstrap, topic + ".dlq", 1), values, {20: pill[1]}, topic)


@pytest.mark.process
async def test_ctrps_worker_trains_around_every_poison_pill(kafka_bootstrap: str, serve_shards: Any) -> None:
    topic, group = await new_topic(kafka_bootstrap, 1)
    shards, urls = await serve_shards(2)
    # Every 15th message is a pill, so each window of 40 holds some of them.
    values: list[bytes] = []
    pill_at: dict[int, str] = {}
    good = iter(range(GOOD))
    pills = iter(PILLS)
    while len(values) < GOOD + len(PILLS):
        pill = next(pills, None) if len(values) % 15 == 7 else None
        if pill is None:
            values.append(keyed_event(next(good)))
        else:
            pill_at[len(values)] = pill[1]
            values.append(pill[0])
    assert len(pill_at) == len(PILLS) and len(values) % 40 == 0
    await asyncio.to_thread(confluent_produce, kafka_bootstrap, topic, values, config=LARGE)
    await _through_ctrps_worker(kafka_bootstrap, urls, topic, group, len(values))
    dead = await consume_all(kafka_bootstrap, topic + ".dlq", len(PILLS))

    applied = applications(shards, 0, GOOD)
    assert (applied == 1).all(), (
        f"missing {np.flatnonzero(applied == 0)[:10]}, twice {np.flatnonzero(applied > 1)[:10]}"
    )
    _assert_dead_letters(dead, values, pill_at, topic)
    headers = [read_headers(r.headers) for r in dead]
    details = {h["ctrps-reason"] + ": " + h["ctrps-detail"] for h in headers}
    assert any("ts must be a number of seconds in [0, 2**32), got 1e+300" in d for d in details), details
    assert any("weight must be a number in [0, 1e+06], got 1e+30" in d for d in details), details
    assert any("price=2000000.0 is fed as 2e+06, beyond +-1e+06" in d for d in details), details

    # `ctrps dlq` shows a truncated dead letter as such.
    out = ctrps("dlq", "--bootstrap", kafka_bootstrap, "--topic", topic + ".dlq", "--reason", "oversized", "--json")
    assert out.returncode == 0, out.stderr
    shown = sorted((orjson.loads(line) for line in out.stdout.splitlines()), key=lambda d: d["source"]["offset"])
    big = [o for o, reason in sorted(pill_at.items()) if reason == "oversized"]
    assert [d["source"]["offset"] for d in shown] == big
    assert [d["truncated_from_bytes"] for d in shown] == [len(values[o]) for o in big]
    text = ctrps("dlq", "--bootstrap", kafka_bootstrap, "--topic", topic + ".dlq", "--reason", "oversized")
    assert text.returncode == 0 and f"[truncated: the original was {len(values[big[0]])} bytes]" in text.stdout


@pytest.mark.process
async def test_an_event_the_model_cannot_train_is_dead_lettered(kafka_bootstrap: str, serve_shards: Any) -> None:
    """Valid, but the model's own weights make its gradient infinite: an FM
    embedding at float32's largest (as a restored model might hold) and a
    weight of 10. The shards would refuse the whole push; the worker leaves
    that event out and dead-letters it, and trains the rest."""
    topic, group = await new_topic(kafka_bootstrap, 1)
    shards, urls = await serve_shards(2)
    key = 7  # a pre-hashed key no other event has
    owner = shards[int(shard_of(np.array([key], dtype=np.uint64), 2)[0])]

    async def huge_embedding() -> None:
        await until(lambda: "m_v" in owner.tables, 30, what="the worker to declare its tables")
        table = owner.tables["m_v"]
        row = np.zeros((1, table.width), dtype=np.float32)
        row[0, : table.dim] = 3e38
        table.load_rows([key], row, [0], [0], [0], [0])

    pill = orjson.dumps({"label": 0, "weight": 10, "keys": [key], "features": {"a": "x"}})
    values = [keyed_event(i) for i in range(20)] + [pill] + [keyed_event(i) for i in range(20, 39)]

    async def produce_then() -> None:
        await huge_embedding()
        await asyncio.to_thread(confluent_produce, kafka_bootstrap, topic, values)

    await _through_ctrps_worker(kafka_bootstrap, urls, topic, group, len(values), "--model", "fm", before=produce_then)
    applied = applications(shards, 0, 39)
    assert (applied == 1).all(), applied
    (dead,) = await consume_all(kafka_bootstrap, topic + ".dlq", 1)
    h = read_headers(dead.headers)
    assert (h["ctrps-reason"], h["ctrps-source-offset"], dead.value) == ("untrainable", "20", pill)
    assert "gradients are not finite" in h["ctrps-detail"], h
    assert np.isfinite(owner.tables["m_v"].pull(np.array([key], dtype=np.uint64))).all()


@pytest.mark.process
async def test_broker_timestamps_the_shards_cannot_keep_are_not_event_times(
    kafka_bootstrap: str, serve_shards: Any
) -> None:
    """Events without ``ts`` take their broker timestamp as their event time,
    unless the shards cannot keep it: here the producer wrote microseconds
    where Kafka means milliseconds (year 55,000). The events are trained at
    the shards' clock; the shards refused the push before."""
    topic, group = await new_topic(kafka_bootstrap, 1)
    shards, urls = await serve_shards(2)
    values = [orjson.dumps({k: v for k, v in orjson.loads(keyed_event(i)).items() if k != "ts"}) for i in range(40)]
    micros = [1_764_681_600_000_000 + i for i in range(40)]
    await asyncio.to_thread(confluent_produce, kafka_bootstrap, topic, values, 1, micros)
    await _through_ctrps_worker(kafka_bootstrap, urls, topic, group, len(values))
    applied = applications(shards, 0, 40)
    assert (applied == 1).all(), applied


@pytest.mark.kafka
@pytest.mark.process
async def test_ctrps_cluster_trains_around_every_poison_pill(tmp_path: Path) -> None:
    """The poison topic into a whole ``ctrps cluster`` (one worker, so no
    rebalance replays a window): the worker is never restarted, every good
    event is trained once (the bias row's shows in a cut), and every pill is
    a dead letter with its reason and source."""
    err_log = tmp_path / "cluster.log"
    proc = await start_cluster(
        tmp_path, "--shards", "2", "--workers", "1", "--no-produce", "--window-seconds", "1", "--export-interval", "0"
    )
    good = 400
    values = [keyed_event(i) for i in range(good)]
    for j, (value, _) in enumerate(PILLS):  # one in 23 messages, over the 4 partitions
        values.insert(11 + j * 23, value)
    # The cluster's model feeds numbers as log1p/16: a price of 2e6 is fed as
    # 0.91, so that message is valid there, and trained.
    reasons = {v: r for v, r in PILLS if v != PRICE}
    pill_at = {(i % 4, i // 4): reasons[v] for i, v in enumerate(values) if v in reasons}
    assert len(pill_at) == len(PILLS) - 1
    try:
        ready = await wait_for_line(proc, err_log, {"logger": "ctrps.cluster", "msg": "ready"}, 90)
        api, bootstrap = ready["api"], ready["bootstrap"]
        await asyncio.to_thread(confluent_produce, bootstrap, "clicks", values, 4, None, LARGE)
        async with aiohttp.ClientSession() as session:

            async def all_trained() -> bool:
                assert proc.returncode is None, f"the cluster stopped: {err_log.read_text()[-3000:]}"
                if sum((await committed(bootstrap, "ctrps", "clicks", 4)).values()) < len(values):
                    return False
                async with session.post(
                    api + "/v1/exports", json={}, headers=admin_headers(ready)
                ) as resp:  # every committed window
                    assert resp.status == 201, await resp.text()
                return True

            await until(all_trained, 120, what="every message committed", poll_s=1.0)
        trained = cluster_bias_shows(Path(ready["exports"]) / "ctr", 2)
        dead = await consume_all(bootstrap, "clicks.dlq", len(pill_at))
        proc.send_signal(signal.SIGINT)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        await kill_cluster(proc, tmp_path)
    assert rc == 0, err_log.read_text()[-3000:]
    assert trained == good + 1  # the price
    lines = read_json_lines(err_log)
    assert not [x for x in lines if x.get("msg") == "restarting a child"], err_log.read_text()[-3000:]
    headers = [read_headers(r.headers) for r in dead]
    got = {(int(h["ctrps-source-partition"]), int(h["ctrps-source-offset"])): h["ctrps-reason"] for h in headers}
    assert len(dead) == len(pill_at) and got == pill_at
    assert sum("ctrps-original-bytes" in h for h in headers) == 2
