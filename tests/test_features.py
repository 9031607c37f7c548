"""Event decoding, validation and feature hashing."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.features import EventError, FeatureHasher, _multipliers, decode_message, flatten_groups, string_hashes
from ps_core.hashing import mix64


def test_decode_object_array_and_json_lines() -> None:
    one = decode_message(b'{"label": 1, "features": {"a": "x"}}')
    many = decode_message(b'[{"label": 1, "features": {}}, {"label": 0, "keys": [1]}]')
    lines = decode_message(b'{"label": 1, "keys": [1]}\n\n{"label": 0, "keys": [2]}\n')
    assert len(one) == 1 and len(many) == 2 and len(lines) == 2
    assert lines[1]["keys"] == [2]


@pytest.mark.parametrize(
    "raw, reason",
    [
        (b"", "empty"),
        (b"   \n", "empty"),
        (None, "empty"),
        (b"[]", "empty"),
        (b"{not json", "invalid_json"),
        (b'{"label": NaN, "keys": [1]}', "invalid_json"),
        (b'{"a": 1}\n{broken', "invalid_json"),
        (b"42", "not_an_object"),
        (b'[{"label": 1}, "x"]', "not_an_object"),
        (b'{"k": "' + b"x" * 2000 + b'"}', "oversized"),
    ],
)
def test_decode_errors_have_reasons(raw: bytes | None, reason: str) -> None:
    with pytest.raises(EventError) as info:
        decode_message(raw, max_bytes=1000)
    assert info.value.reason == reason


def _reference_hash(s: str) -> int:
    """The definition, one string at a time: fmix64(sum_i cp_i * M_i mod 2**64)."""
    m = _multipliers(len(s) + 1).tolist()
    total = sum(ord(c) * m[i] for i, c in enumerate(s)) % 2**64
    return int(mix64(np.array([total], dtype=np.uint64))[0])


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.lists(st.text(max_size=12), max_size=20),  # any code points, NUL included
        # equal lengths (the one-row-per-string path), ASCII or not
        st.integers(0, 9).flatmap(lambda n: st.lists(st.text(min_size=n, max_size=n), min_size=1, max_size=20)),
        st.lists(st.text(alphabet="0123456789abcdef", min_size=8, max_size=8), min_size=1, max_size=20),
    )
)
def test_string_hashes_match_the_definition(strings: list[str]) -> None:
    assert string_hashes(strings).tolist() == [_reference_hash(s) for s in strings]


def test_string_hashes_are_stable_and_independent_of_the_batch() -> None:
    a = string_hashes(["site=a3f09", "x", ""])
    b = string_hashes(["x", "a much longer string that widens the array", "site=a3f09", ""])
    assert a[0] == b[2] and a[1] == b[0] and a[2] == b[3]
    # A pinned value: feature ids must never change between versions or machines.
    assert int(string_hashes(["ctrps"])[0]) == int(string_hashes(np.array(["ctrps"], dtype=object))[0])
    long = "é" * 300 + "z"
    assert string_hashes([long, "x"])[0] == string_hashes([long])[0]
    assert len(set(string_hashes([f"v{i}" for i in range(10000)]).tolist())) == 10000


def test_pinned_feature_ids() -> None:
    """Ids are part of the model's contract (exports, replicas, other
    languages): these literal values must never change."""
    h = FeatureHasher("ctr")
    ids = h.feature_ids(["site", "price"], ["a3f09", None])
    assert [int(x) for x in ids] == [14994452256859813746, 18042555065666325194]
    assert h.bias_key == 3091626315576693014
    assert int(string_hashes(["a3f09"])[0]) == 18105079965947332240
    # The documented formula, computed by hand: fmix64(sum cp_i * M_i).
    mults = mix64(np.arange(1, 65, dtype=np.uint64), 0x2545F4914F6CDD1D) | np.uint64(1)
    acc = sum(ord(c) * int(m) for c, m in zip("a3f09", mults)) % 2**64
    assert int(mix64(np.array([acc], dtype=np.uint64))[0]) == 18105079965947332240


def test_featurize_kinds_of_features() -> None:
    h = FeatureHasher("m")
    batch, errors = h.featurize(
        [
            {"label": 1, "features": {"site": "a", "price": 2.5, "tags": ["p", "q"], "gone": None, "new": True}},
            {"label": 0, "keys": [7, 2**64 - 1], "ts": 100.5, "weight": 2},
        ]
    )
    assert errors == {}
    assert batch.offsets.tolist() == [0, 6, 9]
    k = batch.keys
    assert k[0] == k[6] == h.bias_key
    assert set(k[1:6].tolist()) == set(
        h.feature_ids(["site", "price", "tags", "tags", "new"], ["a", None, "p", "q", "true"]).tolist()
    )
    assert k[7:9].tolist() == [7, 2**64 - 1]
    assert sorted(batch.values[:6].tolist()) == [1, 1, 1, 1, 1, 2.5]
    assert batch.labels.tolist() == [1, 0]
    assert batch.weights.tolist() == [1, 2]
    assert np.isnan(batch.ts[0]) and batch.ts[1] == 100.5
    assert batch.event_of_feature().tolist() == [0] * 6 + [1] * 3


def test_namespaces_separate_models() -> None:
    a, b = FeatureHasher("a"), FeatureHasher("b")
    assert a.feature_ids(["f"], ["v"])[0] != b.feature_ids(["f"], ["v"])[0]
    assert a.bias_key != b.bias_key


@pytest.mark.parametrize(
    "event, reason",
    [
        ({"features": {"a": "x"}}, "missing_label"),
        ({"label": 2, "features": {"a": "x"}}, "bad_label"),
        ({"label": "1", "features": {"a": "x"}}, "bad_label"),
        ({"label": True, "features": {"a": "x"}}, "bad_label"),
        ({"label": 1, "ts": "noon", "features": {"a": "x"}}, "bad_ts"),
        ({"label": 1, "weight": -1, "features": {"a": "x"}}, "bad_weight"),
        ({"label": 1}, "bad_features"),
        ({"label": 1, "features": ["a"]}, "bad_features"),
        ({"label": 1, "features": {"a": {"b": 1}}}, "bad_value"),
        ({"label": 1, "features": {"a": ["x", 3]}}, "bad_value"),
        ({"label": 1, "features": {"a": 1e39}}, "bad_value"),
        ({"label": 1, "keys": [-1]}, "bad_keys"),
        ({"label": 1, "keys": [2**64]}, "bad_keys"),
        ({"label": 1, "keys": ["12"]}, "bad_keys"),
        ({"label": 1, "keys": 12}, "bad_keys"),
        ("an event", "not_an_object"),
    ],
)
def test_bad_events_fail_their_group_only(event: object, reason: str) -> None:
    h = FeatureHasher("m")
    good = {"label": 1, "features": {"a": "x", "n": 1.0}}
    events = [good, event, good, good]
    batch, errors = h.featurize(events, groups=[0, 1, 1, 2])  # type: ignore[list-item]
    assert list(errors) == [1]
    assert errors[1].reason == reason
    assert batch.index.tolist() == [0, 3]  # the whole of group 1 is left out
    assert batch.offsets.tolist() == [0, 3, 6]
    ref, _ = h.featurize([good])
    assert batch.keys[:3].tolist() == ref.keys.tolist()


def test_predict_events_need_no_label() -> None:
    batch, errors = FeatureHasher("m").featurize([{"features": {"a": "x"}}], require_label=False)
    assert errors == {} and np.isnan(batch.labels[0])


def test_select_and_flatten_groups() -> None:
    h = FeatureHasher("m")
    msgs = [orjson.dumps([{"label": 1, "features": {"a": str(i), "b": "y"}} for i in range(3)]), b'{"label": 0, "keys": [5]}']
    events, owner = flatten_groups([decode_message(m) for m in msgs])
    assert owner == [0, 0, 0, 1]
    batch, _ = h.featurize(events, groups=owner)
    sub = batch.select(np.array([1, 3]))
    assert sub.offsets.tolist() == [0, 3, 5]
    assert sub.keys.tolist() == batch.keys[3:6].tolist() + batch.keys[9:11].tolist()
    assert sub.labels.tolist() == [1, 0]


def test_slice_equals_select_of_a_range() -> None:
    h = FeatureHasher("m")
    events = [{"label": i % 2, "ts": float(i), "features": {"a": str(i), "n": float(i)} if i % 3 else {"a": "z"}}
              for i in range(7)]
    batch, _ = h.featurize(events)
    for start, stop in [(0, 7), (2, 5), (6, 7), (3, 3)]:
        a, b = batch.slice(start, stop), batch.select(np.arange(start, stop))
        for name in ("keys", "values", "offsets", "labels", "weights", "ts", "index"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def test_the_field_name_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    import ps_core.features as features

    monkeypatch.setattr(features, "MAX_CACHED_FIELDS", 4)
    h = FeatureHasher("m")
    events = [{"label": 0, "features": {f"f{i}": "x"}} for i in range(10)]
    batch, _ = h.featurize(events)
    assert len(h._fields) == 4
    # Names hashed past the bound get the same ids as cached ones would.
    again, _ = FeatureHasher("m").featurize(events)
    assert batch.keys.tolist() == again.keys.tolist()
