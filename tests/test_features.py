"""Event decoding, validation and feature hashing."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_core.hashing import mix64
from ps_core.model import layouts
from ps_core.model.batch import EventBatch
from ps_core.model.events import MAX_FLOAT32, MAX_VALUE, EventError, check_each, decode_message
from ps_core.model.featurizer import DEFAULT_NUMERIC, FeatureHasher
from ps_core.model.string_hashing import GRID_WIDTH, string_hashes


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
    """The definition, one string at a time: fmix64(sum_i cp_i * M_i mod 2**64)
    with ``M_i = fmix64((i + 1) ^ 0x2545F4914F6CDD1D) | 1``."""
    m = (mix64(np.arange(1, len(s) + 1, dtype=np.uint64), 0x2545F4914F6CDD1D) | np.uint64(1)).tolist()
    total = sum(ord(c) * m[i] for i, c in enumerate(s)) % 2**64
    return int(mix64(np.array([total], dtype=np.uint64))[0])


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.lists(st.text(max_size=12), max_size=20),  # any code points, NUL included
        # equal lengths (the one-row-per-string path), ASCII or not
        st.integers(0, 9).flatmap(lambda n: st.lists(st.text(min_size=n, max_size=n), min_size=1, max_size=20)),
        st.lists(st.text(alphabet="0123456789abcdef", min_size=8, max_size=8), min_size=1, max_size=20),
        # around the longest string hashed as a padded matrix: both paths, one list
        st.lists(st.text(min_size=GRID_WIDTH - 2, max_size=GRID_WIDTH + 2) | st.text(max_size=4), min_size=1),
    )
)
@pytest.mark.slow
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
    # A number is fed as sign(x) log1p(|x|) / 16, the default.
    assert DEFAULT_NUMERIC == "log1p/16"
    assert sorted(batch.values[:6].tolist()) == [pytest.approx(math.log1p(2.5) / 16), 1, 1, 1, 1, 1]
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
    batch, errors = h.featurize(events, groups=[0, 1, 1, 2])  # type: ignore[arg-type]
    assert list(errors) == [1]
    assert errors[1].reason == reason
    assert batch.index.tolist() == [0, 3]  # the whole of group 1 is left out
    assert batch.offsets.tolist() == [0, 3, 6]
    ref, _ = h.featurize([good])
    assert batch.keys[:3].tolist() == ref.keys.tolist()


def test_predict_events_need_no_label() -> None:
    batch, errors = FeatureHasher("m").featurize([{"features": {"a": "x"}}], require_label=False)
    assert errors == {} and np.isnan(batch.labels[0])


def test_select_of_grouped_events() -> None:
    h = FeatureHasher("m")
    msgs = [
        orjson.dumps([{"label": 1, "features": {"a": str(i), "b": "y"}} for i in range(3)]),
        b'{"label": 0, "keys": [5]}',
    ]
    events = [e for m in msgs for e in decode_message(m)]
    owner = [0, 0, 0, 1]
    batch, _ = h.featurize(events, groups=owner)
    sub = batch.select(np.array([1, 3]))
    assert sub.offsets.tolist() == [0, 3, 5]
    assert sub.keys.tolist() == batch.keys[3:6].tolist() + batch.keys[9:11].tolist()
    assert sub.labels.tolist() == [1, 0]


def test_slice_equals_select_of_a_range() -> None:
    h = FeatureHasher("m")
    events = [
        {"label": i % 2, "ts": float(i), "features": {"a": str(i), "n": float(i)} if i % 3 else {"a": "z"}}
        for i in range(7)
    ]
    batch, _ = h.featurize(events)
    for start, stop in [(0, 7), (2, 5), (6, 7), (3, 3)]:
        a, b = batch.slice(start, stop), batch.select(np.arange(start, stop))
        for name in ("keys", "values", "offsets", "labels", "weights", "ts", "index"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def test_the_field_name_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "MAX_CACHED_FIELDS", 4)
    h = FeatureHasher("m")
    events = [{"label": 0, "features": {f"f{i}": "x"}} for i in range(10)]
    batch, _ = h.featurize(events)
    assert len(h._fields) == 4
    # Names hashed past the bound get the same ids as cached ones would.
    again, _ = FeatureHasher("m").featurize(events)
    assert batch.keys.tolist() == again.keys.tolist()


# -- the reference: featurize one event and one value at a time ---------------
# The ids by their definition (`FeatureHasher`'s docstring), one value at a
# time in a plain loop, with no shared code but the per-event checks
# (`check_each`): the property tests below then check the column-wise checks
# against those, and every vectorised hashing step against the definition.

_C_CAT, _C_NUM, _C_BIAS = 0x9E3779B97F4A7C15, 0xD6E8FEB86659FD93, 0xA0761D6478BD642F


def _fmix(x: int) -> int:
    return int(mix64(np.array([x], dtype=np.uint64))[0])


class _Reference:
    def __init__(self, namespace: str, *, max_features: int = 4096, numeric: str = DEFAULT_NUMERIC) -> None:
        self.ns = _reference_hash(namespace)
        self.max_features = max_features
        base, _, divisor = numeric.partition("/")
        self.log1p = base == "log1p"
        self.divisor = float(divisor) if divisor else 1.0
        self.bias_key = _fmix(self.ns ^ _C_BIAS)
        self.field_hashes: dict[str, int] = {}

    def field(self, name: str) -> int:
        if name not in self.field_hashes:
            self.field_hashes[name] = _fmix(_reference_hash(name) ^ self.ns)
        return self.field_hashes[name]

    def categorical(self, name: str, value: str) -> int:
        return _fmix(self.field(name) ^ (_reference_hash(value) * _C_CAT % 2**64))

    def featurize(
        self,
        events: Sequence[dict[str, Any]],
        *,
        require_label: bool = True,
        groups: Sequence[int] | None = None,
    ) -> tuple[EventBatch, dict[int, EventError]]:
        n = len(events)
        grp = list(range(n)) if groups is None else list(groups)
        labels, weights, ts, to_hash, prehashed, errors = check_each(events, require_label, self.max_features, grp)
        keys_of = dict(prehashed)
        # Hashing finds bad numbers first, then bad values of other types,
        # then bad keys, each in event order; a group keeps its first error.
        bad_numbers: list[tuple[int, str, str]] = []
        bad_values: list[tuple[int, str, str]] = []
        bad_keys: list[tuple[int, str, str]] = []
        features: list[tuple[list[int], list[float]]] = []
        for i in range(n):
            ids, vals, extras = [self.bias_key], [1.0], []
            for name, v in (to_hash[i] or {}).items():
                if v is None:
                    continue  # a missing feature
                if type(v) is str:
                    ids.append(self.categorical(name, v))
                    vals.append(1.0)
                elif type(v) in (int, float):
                    x = float(v)
                    ids.append(_fmix(self.field(name) ^ _C_NUM))
                    # A log1p model's value (the default), then divided; a bad
                    # number stays as it is (its event fails).
                    if not math.isfinite(x):
                        fed = x
                    elif self.log1p:
                        fed = math.copysign(math.log1p(abs(x)), x) if x != 0 else 0.0  # sign(0) is 0: never -0.0
                        fed /= self.divisor
                    else:
                        fed = x / self.divisor
                    if not (math.isfinite(x) and abs(x) <= MAX_FLOAT32):
                        bad_numbers.append((i, "bad_value", f"{name}={v!r} is not a finite float32"))
                    elif abs(fed) > MAX_VALUE:
                        why = f"fed as {fed:.6g}, beyond +-{MAX_VALUE:.6g}"
                        bad_numbers.append((i, "bad_value", f"{name}={v!r} is {why}"))
                    vals.append(fed)
                elif type(v) is bool:
                    extras.append(self.categorical(name, "true" if v else "false"))
                elif type(v) is list and all(isinstance(s, str) for s in v):
                    extras.extend(self.categorical(name, s) for s in v)
                else:
                    why = f"{name} has a {type(v).__name__} value; expected string, number or list of strings"
                    bad_values.append((i, "bad_value", why))
            if i in keys_of:
                klist = [int(k) if type(k) is float and k.is_integer() and abs(k) <= 2**53 else k for k in keys_of[i]]
                if all(type(k) is int and 0 <= k < 2**64 for k in klist):
                    extras.extend(klist)
                else:
                    bad_keys.append((i, "bad_keys", "keys must be integers in [0, 2**64)"))
            features.append((ids + extras, vals + [1.0] * len(extras)))
        for i, reason, detail in bad_numbers + bad_values + bad_keys:
            errors.setdefault(grp[i], EventError(reason, f"event {i}: {detail}"))
        # Every event of a failed group goes, whatever failed in it.
        good = [i for i in range(n) if grp[i] not in errors]
        offsets = [0]
        for i in good:
            offsets.append(offsets[-1] + len(features[i][0]))
        batch = EventBatch(
            keys=np.array([k for i in good for k in features[i][0]], dtype=np.uint64),
            values=np.array([v for i in good for v in features[i][1]], dtype=np.float32),
            offsets=np.array(offsets, dtype=np.int64),
            labels=labels[good],
            weights=weights[good],
            ts=ts[good],
            index=np.array(good, dtype=np.int64),
        )
        return batch, errors


# -- fast paths against the reference ------------------------------------------


class _Str(str):
    """A str subclass (like numpy.str_): not a categorical value."""


_NAMES = ["a", "b", "site", "price", "é", "n0", "n1", "tags", "x" * 30]
_VALUE = st.one_of(
    st.text(alphabet="0123456789abcdef", min_size=8, max_size=8),  # the usual ids
    st.text(max_size=6),  # any code points, NUL and empty included
    st.floats(allow_nan=False, width=32) | st.floats(),  # NaN, inf, beyond float32 too
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
    st.lists(st.text(max_size=3), max_size=3),
    st.lists(st.one_of(st.text(max_size=2), st.integers(0, 3)), min_size=1, max_size=2),
    st.builds(_Str, st.text(max_size=3)),
    st.just({"nested": 1}),
)


@st.composite
def _features(draw: st.DrawFn) -> Any:
    names = draw(st.lists(st.sampled_from(_NAMES), unique=True, max_size=6))
    if draw(st.integers(0, 9)) == 0:  # a layout of the usual types
        return {k: draw(_VALUE) for k in names}
    usual = draw(st.sampled_from([st.text("0123456789abcdef", min_size=8, max_size=8), st.floats(0, 100)]))
    feats = {k: draw(usual) for k in names}
    if draw(st.integers(0, 3)) == 0 and names:  # an odd value in an otherwise usual layout
        feats[draw(st.sampled_from(names))] = draw(_VALUE)
    return feats


_NUMBERISH = st.one_of(
    st.floats(0, 1e9),
    st.integers(0, 10**6),
    st.floats(),
    st.integers(-5, 2**1100),
    st.booleans(),
    st.just("1"),
    st.none(),
)


@st.composite
def _event(draw: st.DrawFn) -> Any:
    kind = draw(st.integers(0, 39))
    if kind == 0:
        return draw(st.sampled_from(["an event", 3, None, ["x"]]))
    ev: dict[str, Any] = {}
    fields: list[tuple[str, st.SearchStrategy[Any]]] = [
        (
            "label",
            st.one_of(
                st.sampled_from([0, 1, 0.0, 1.0, -0.0]), st.sampled_from([None, True, 2, "1", 0.5, float("nan")])
            ),
        ),
        ("ts", _NUMBERISH),
        ("weight", _NUMBERISH),
        ("features", st.one_of(_features(), st.sampled_from([None, ["a"], "x"]))),
        (
            "keys",
            st.one_of(
                st.lists(st.integers(0, 2**64 - 1), max_size=3),
                st.lists(st.one_of(st.integers(-1, 2**64), st.booleans(), st.just("12")), max_size=2),
                st.sampled_from([None, 12, (1, 2)]),
            ),
        ),
    ]
    mostly_valid = kind > 8
    for name, strat in fields:
        if mostly_valid and name in ("ts", "weight", "keys") and draw(st.integers(0, 3)) > 0:
            continue  # usually absent
        if mostly_valid and name == "label":
            ev[name] = draw(st.sampled_from([0, 1]))
        elif mostly_valid and name == "features":
            if draw(st.integers(0, 4)):  # else absent: keys-only, or neither
                ev[name] = draw(_features())
        elif mostly_valid and name == "ts":
            ev[name] = draw(st.floats(0, 2e9))
        elif draw(st.booleans()):
            ev[name] = draw(strat)
    if kind == 1:  # dicts as Python callers may give them: subclasses
        return OrderedDict(ev)
    if kind == 2 and isinstance(ev.get("features"), dict):
        ev["features"] = OrderedDict(ev["features"])
    return ev


def _outcome(h: Any, events: list[Any], require_label: bool, groups: list[int] | None, **options: Any) -> Any:
    """A comparable picture of a featurize call: the batch and errors, or the exception."""
    try:
        batch, errors = h.featurize(events, require_label=require_label, groups=groups, **options)
    except Exception as exc:  # the fast paths must raise exactly where the reference raises
        return ("raised", type(exc))
    arrays = {
        name: getattr(batch, name).tobytes() + str(getattr(batch, name).dtype).encode()
        for name in ("keys", "values", "offsets", "labels", "weights", "ts", "index")
    }
    return arrays, [(g, e.reason, e.detail) for g, e in errors.items()]


_SHARED = FeatureHasher("m")  # keeps its caches from one example to the next
_SHARED_REF = _Reference("m")


def _check_against_reference(events: list[Any], require_label: bool, grouped: list[bool] | None) -> None:
    groups = None
    if grouped is not None:  # consecutive events share a message where grouped[i]
        groups, g = [], 0
        for i, same in enumerate(grouped[: len(events)] + [False] * max(0, len(events) - len(grouped))):
            g += 0 if same and i else 1
            groups.append(g)
    ref = _outcome(_SHARED_REF, events, require_label, groups)
    assert _outcome(_SHARED, events, require_label, groups) == ref
    assert _outcome(FeatureHasher("m"), events, require_label, groups) == ref
    few = _outcome(_Reference("m", max_features=4), events, require_label, groups)
    assert _outcome(FeatureHasher("m", max_features=4), events, require_label, groups) == few


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(st.lists(_event(), max_size=12), st.booleans(), st.none() | st.lists(st.booleans(), max_size=12))
def test_featurize_matches_the_reference(events: list[Any], require_label: bool, grouped: list[bool] | None) -> None:
    _check_against_reference(events, require_label, grouped)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(_features(), min_size=1, max_size=40), st.integers(0, 4), st.integers(0, 20))
def test_featurize_past_the_layout_bound_matches_the_reference(
    feats: list[Any], max_layouts: int, max_fields: int
) -> None:
    events = [{"label": i % 2, "features": f} for i, f in enumerate(feats)]
    saved = layouts.MAX_CACHED_SCHEMAS, layouts.MAX_CACHED_SCHEMA_FIELDS
    layouts.MAX_CACHED_SCHEMAS, layouts.MAX_CACHED_SCHEMA_FIELDS = max_layouts, max_fields
    try:
        h = FeatureHasher("m")
        ref = _outcome(_Reference("m"), events, True, None)
        for _ in range(2):  # the second call meets a full cache
            assert _outcome(h, events, True, None) == ref
        assert h._layouts.count <= max_layouts and h._layouts.used <= max_fields
        assert len(h._layouts.ids) == h._layouts.count
    finally:
        layouts.MAX_CACHED_SCHEMAS, layouts.MAX_CACHED_SCHEMA_FIELDS = saved


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(_event(), max_size=12), st.booleans())
def test_featurize_of_json_types_matches_the_reference(events: list[Any], require_label: bool) -> None:
    """With ``json_types`` (the worker's decoding), events as orjson makes
    them hash exactly as the reference hashes them."""
    try:
        parsed = orjson.loads(orjson.dumps(events))  # exact JSON types, as a worker sees them
    except orjson.JSONEncodeError:  # integers past 64 bits: not JSON orjson makes
        return
    ref = _outcome(_SHARED_REF, parsed, require_label, None)
    assert _outcome(_SHARED, parsed, require_label, None, json_types=True) == ref
    assert _outcome(FeatureHasher("m"), parsed, require_label, None, json_types=True) == ref


def test_json_types_still_catch_a_non_string_where_a_layout_had_one() -> None:
    h, ref = FeatureHasher("m"), _Reference("m")
    events = orjson.loads(
        b'[{"label": 1, "features": {"a": "x", "n": 2.0}}, {"label": 0, "features": {"a": 3, "n": "y"}},'
        b' {"label": 0, "features": {"a": null, "n": 2}}, {"label": 1, "features": {"a": ["p"], "n": true}},'
        b' {"label": 0, "features": {"a": {"b": 1}, "n": 1.0}}]'
    )
    for _ in range(2):  # the layout of event 0 is cached after the first call
        assert _outcome(h, events, True, None, json_types=True) == _outcome(ref, events, True, None)
    batch, errors = h.featurize(events, json_types=True)
    assert batch.size == 4 and list(errors) == [4]


def test_a_cached_layout_with_other_types_still_hashes_each_value_by_its_type() -> None:
    h, ref = FeatureHasher("m"), _Reference("m")
    first = {"label": 1, "features": {"a": "x", "n": 2.0}}
    events: list[Any] = [
        first,
        {"label": 0, "features": {"a": 3, "n": "y"}},  # the same names, the types swapped
        {"label": 0, "features": {"a": None, "n": 2}},
        {"label": 1, "features": {"a": _Str("x"), "n": 1.0}},  # not a categorical value
        {"label": 1, "features": {"a": ["p", "q"], "n": True}},
        {"label": 0, "features": {"a": "x", "n": 1e39}},
    ]
    for _ in range(2):
        assert _outcome(h, events, True, None) == _outcome(ref, events, True, None)
    _, errors = h.featurize(events)
    # Numbers are checked before the rare types, so event 5's error comes first.
    assert [(g, e.reason) for g, e in errors.items()] == [(5, "bad_value"), (3, "bad_value")]
    # Error messages name the field of the failing value.
    assert "event 3: a has a _Str value" in str(errors[3]) and "n=1e+39" in str(errors[5])


def test_a_bad_event_mid_chunk_fails_only_its_group() -> None:
    h, ref = FeatureHasher("m"), _Reference("m")
    good = [{"label": i % 2, "ts": float(i), "features": {"a": f"{i:08x}", "n": float(i)}} for i in range(600)]
    for bad in ({"label": 1, "weight": -1, "features": {"a": "x"}}, {"label": 1, "keys": ["1"]}, "x"):
        events: list[Any] = good[:300] + [bad] + good[300:]
        groups = [i // 3 for i in range(len(events))]
        out = _outcome(h, events, True, groups)
        assert out == _outcome(ref, events, True, groups)
        batch, errors = h.featurize(events, groups=groups)
        assert list(errors) == [100] and batch.size == len(events) - 3


def test_the_layout_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layouts, "MAX_CACHED_SCHEMAS", 3)
    h = FeatureHasher("m")
    events = [{"label": 0, "features": {f"f{i}": "x", "g": 1.0}} for i in range(10)]
    batch, _ = h.featurize(events)
    assert len(h._layouts.ids) == 3
    again, _ = h.featurize(events[::-1])  # past the bound: the same ids
    assert again.keys.tolist() == FeatureHasher("m").featurize(events[::-1])[0].keys.tolist()
    assert batch.keys.tolist() == FeatureHasher("m").featurize(events)[0].keys.tolist()


def test_layouts_with_long_names_are_not_cached_and_block_no_others() -> None:
    h = FeatureHasher("m")
    long = {"label": 1, "features": {"n" * 100: "x"}}
    short = {"label": 0, "features": {"a": "y", "b": 1.0}}
    for _ in range(2):
        batch, errors = h.featurize([long, short])
        assert errors == {}
        assert list(h._layouts.ids) == [("a", "b")]
        assert batch.keys.tolist() == _Reference("m").featurize([long, short])[0].keys.tolist()


@pytest.mark.parametrize(
    "events",
    [
        [{"label": 1, "keys": [1]}, {"label": 1}],
        [{"label": 1, "features": {}}, {"label": 1, "features": None, "keys": None}],
        [{"label": 1, "keys": [1]}, {"label": 0, "features": {"a": "x"}, "keys": [2**64 - 1, 0]}],
    ],
)
def test_features_and_keys_columns_match_the_reference(events: list[Any]) -> None:
    assert _outcome(FeatureHasher("m"), events, True, None) == _outcome(_Reference("m"), events, True, None)
