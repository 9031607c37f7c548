"""decode_records: the fast paths against the record-at-a-time reference."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.decode import Decoded, Rejected, decode_records
from ps_core.model.events import EventError, decode_message
from ps_core.model.featurizer import FeatureHasher

# Every test here takes seconds (processes, a broker, fuzzing): `make test-fast` skips them.
pytestmark = pytest.mark.slow

# -- the fast paths against the record-at-a-time reference ----------------------


def _reference_decode_message(value: bytes | None, max_bytes: int) -> list[dict[str, Any]]:
    """The message format by its definition, without decode_message's
    shortcuts: blank is empty (whatever its size), then larger than the limit
    is oversized; a JSON array is its events, another document one event; a
    message that does not parse as one document, or is JSON null, is JSON
    lines if it has several lines."""
    text = value or b""
    if not text or text.isspace():
        raise EventError("empty", "the message has no content")
    if len(text) > max_bytes:
        raise EventError("oversized", f"{len(text)} bytes > limit {max_bytes}")
    error: orjson.JSONDecodeError | None = None
    try:
        docs = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        docs, error = None, exc
    if docs is None:
        if error is not None and text.strip().count(b"\n") == 0:
            raise EventError("invalid_json", str(error))
        docs = []
        for line in filter(bytes.strip, text.split(b"\n")):
            try:
                docs.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise EventError("invalid_json", f"JSON lines: {exc}") from None
    elif type(docs) is not list:
        docs = [docs]
    if docs == []:
        raise EventError("empty", "an empty array holds no events")
    not_objects = [i for i, doc in enumerate(docs) if type(doc) is not dict]
    if not_objects:
        i = not_objects[0]
        raise EventError("not_an_object", f"event {i} is {type(docs[i]).__name__}, not an object")
    return docs


def _reference_decode_records(values: list[bytes | None], namespace: str, max_bytes: int) -> Decoded:
    """decode_records without its fast paths: one record at a time."""
    decoded: list[tuple[int, list[dict[str, Any]]]] = []
    rejected: list[Rejected] = []
    for i, value in enumerate(values):
        try:
            decoded.append((i, _reference_decode_message(value, max_bytes)))
        except EventError as exc:
            rejected.append(Rejected(i, exc.reason, exc.detail))
    events = [ev for _, evs in decoded for ev in evs]
    record_of = [i for i, evs in decoded for _ in evs]
    batch, errors = FeatureHasher(namespace).featurize(events, groups=record_of)
    rejected.extend(Rejected(g, e.reason, e.detail) for g, e in errors.items())
    rejected.sort(key=lambda r: r.index)
    return Decoded(batch, record_of, rejected)


_EVENT = st.fixed_dictionaries(
    {
        "label": st.sampled_from([0, 1, 1, 1, 2]),
        "features": st.dictionaries(st.sampled_from("abc"), st.text("xyz", max_size=3) | st.floats(0, 9), max_size=3),
    },
    optional={"ts": st.floats(0, 1e9), "keys": st.lists(st.integers(0, 9), max_size=2)},
)
_RECORD = st.one_of(
    _EVENT.map(orjson.dumps),
    _EVENT.map(orjson.dumps),
    _EVENT.map(lambda e: b" \n" + orjson.dumps(e) + b"\n"),
    st.lists(_EVENT, max_size=3).map(orjson.dumps),  # arrays, the empty one too
    st.lists(_EVENT, min_size=1, max_size=3).map(lambda evs: b"\n".join(map(orjson.dumps, evs)) + b"\n"),
    st.sampled_from(
        [
            None,
            b"",
            b"  \n",
            b"{broken",
            b"null",
            b"42",
            b'"x"',
            b'[{"label": 1, "keys": [1]}, 3]',
            b'{"label": 1, "keys": [1]}\n{broken',
            b"\xff\xfe",
            b"[]",
            b" " * 300,
            b'{"pad": "' + b"x" * 300 + b'"}',
            b"[\n]",
            b"null\nnull",
            b'{"label": 1, "keys": [1]}\n\n',
        ]
    ),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_RECORD, max_size=20))
def test_decode_records_matches_the_reference(values: list[bytes | None]) -> None:
    got = decode_records(values, "m", 200)
    want = _reference_decode_records(values, "m", 200)
    for field in ("keys", "values", "offsets", "labels", "weights", "ts", "index"):
        np.testing.assert_array_equal(getattr(got.batch, field), getattr(want.batch, field), err_msg=field)
    assert got.record_of == want.record_of
    assert got.rejected == want.rejected


@pytest.mark.parametrize(
    "raw", [b"", b"   \n", None, b"[]", b"{not json", b'{"a": 1}\n{broken', b"42", b" " * 2000, b"x" * 2000, b"null"]
)
def test_decode_message_gives_the_reference_reason(raw: bytes | None) -> None:
    with pytest.raises(EventError) as want:
        _reference_decode_message(raw, 1000)
    with pytest.raises(EventError) as got:
        decode_message(raw, 1000)
    assert (got.value.reason, got.value.detail) == (want.value.reason, want.value.detail)


def test_decode_records_pauses_the_collector_only_while_decoding() -> None:
    assert gc.isenabled()
    decode_records([b'{"label": 1, "keys": [1]}'], "m", 1 << 20)
    assert gc.isenabled()
