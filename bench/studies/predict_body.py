"""Benchmark: decoding and validating a ``POST /v1/predict`` body, per candidate.

The API declares each request body once as a model (`app.api.openapi`,
`ps_core.bodies`); this measures what that costs on the hot path against
the hand validation it replaced, for bodies of 1 and of 64 events with 20
features each (14 categorical, 6 numeric: ~340 bytes and ~21 KB):

- ``baseline``: ``orjson.loads`` and the checks the handler made by hand
  (an object of known fields, ``model`` a string, ``events`` a non-empty
  list under the limit);
- ``msgspec``: the API's decoder (`app.api.openapi.predict_decoder`): the
  request's shape in C, the events left as decoded JSON for the hasher;
- ``orjson_msgspec``: ``orjson.loads`` and the same model's check
  (``msgspec.convert``), which the predict route uses: orjson's key cache
  keeps every field name one object across requests, which the hasher's
  layout cache is faster with (see `app.api.routes._predict_body`);
- ``msgspec_typed``: the same with every event decoded into the `Event`
  model (what validating an event's content as a model would cost; the API
  leaves that to the hasher, whose reasons are the training path's);
- ``jsonschema_rs``: ``orjson.loads`` and a JSON Schema validator (Rust)
  over the schema the API's document publishes (`openapi_document`);
- ``pydantic``: ``TypeAdapter.validate_json`` of the same shape (pydantic
  comes with the bench extras, only to be measured; skipped when absent).

For scale, ``featurize``: the baseline and then the hasher's validation and
hashing of the events (`FeatureHasher.featurize`), as a request does.

Run (from the repository root)::

    .venv/bin/python bench/studies/predict_body.py --quick   # ~5 s
    .venv/bin/python bench/studies/predict_body.py           # ~20 s

Progress goes to stderr; a table of microseconds per request and ratios to
the baseline, and, as the last line of stdout, one JSON object.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import jsonschema_rs
import msgspec
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: the shared helpers

from common import bench_mode, print_result  # noqa: E402

from app.api.openapi import Event, PredictRequest, openapi_document, predict_decoder
from ps_core.model.featurizer import FeatureHasher

MAX_EVENTS = 10_000
SIZES = (1, 64)


def body(n: int, seed: int) -> bytes:
    """A predict body of `n` Criteo-like events of 20 features."""
    r = random.Random(seed)
    events = [
        {
            "features": {f"c{j}": f"{r.randrange(1 << 20):05x}" for j in range(14)}
            | {f"n{j}": round(r.lognormvariate(0, 2), 3) for j in range(6)}
        }
        for _ in range(n)
    ]
    return orjson.dumps({"events": events})


def baseline(raw: bytes) -> list[Any]:
    """The hand validation the API's handler made before the models."""
    body = orjson.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    unknown = set(body) - {"events", "model"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError("model")
    events = body["events"]
    if not isinstance(events, list) or not events or len(events) > MAX_EVENTS:
        raise ValueError("events")
    return events


def candidates() -> dict[str, Callable[[bytes], Any]]:
    """Each candidate's decode-and-validate of one body, returning the events."""
    shallow = predict_decoder(MAX_EVENTS)
    typed_type = msgspec.defstruct(
        "PredictRequest",
        [("events", Annotated[list[Event], msgspec.Meta(min_length=1, max_length=MAX_EVENTS)])],
        bases=(PredictRequest,),
    )
    typed = msgspec.json.Decoder(typed_type)
    doc = openapi_document(MAX_EVENTS)
    schema = {"$ref": "#/components/schemas/PredictRequest", "components": doc["components"]}
    validator = jsonschema_rs.Draft202012Validator(schema)

    def by_schema(raw: bytes) -> Any:
        body = orjson.loads(raw)
        validator.validate(body)
        return body["events"]

    out: dict[str, Callable[[bytes], Any]] = {
        "baseline": baseline,
        "msgspec": lambda raw: shallow.decode(raw).events,
        "orjson_msgspec": lambda raw: msgspec.convert(orjson.loads(raw), shallow.type).events,
        "msgspec_typed": lambda raw: typed.decode(raw).events,
        "jsonschema_rs": by_schema,
    }
    try:
        import pydantic
    except ImportError:
        log("pydantic is not installed: skipped")
    else:

        class Request(pydantic.BaseModel, extra="forbid"):
            events: Annotated[list[dict[str, Any]], pydantic.Field(min_length=1, max_length=MAX_EVENTS)]
            model: str | None = None

        request_adapter = pydantic.TypeAdapter(Request)
        out["pydantic"] = lambda raw: request_adapter.validate_json(raw).events
    return out


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def per_call_us(fn: Callable[[bytes], Any], raw: bytes, seconds: float) -> float:
    """Microseconds per call of `fn(raw)`: the best of 5 rounds of ~`seconds` / 5."""
    fn(raw)
    n = 1
    while True:  # calls per round: doubled until they take a tenth of a round
        t = time.perf_counter()
        for _ in range(n):
            fn(raw)
        if time.perf_counter() - t >= seconds / 50:
            break
        n *= 2
    n *= 10
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(raw)
        best = min(best, (time.perf_counter() - t) / n)
    return best * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Decode and validate a /v1/predict body with each candidate, against the hand "
        "validation it replaced. The last stdout line is a JSON object.",
    )
    parser.add_argument("--quick", action="store_true", help="shorter rounds (~5 s in all)")
    parser.add_argument("--seed", type=int, default=12345, help="RNG seed of the events (default 12345)")
    args = parser.parse_args(argv)
    seconds = 0.1 if args.quick else 0.5
    fns = candidates()
    hasher = FeatureHasher("ctr")
    result: dict[str, Any] = {"bench": "models", "mode": bench_mode(args.quick)}
    for n in SIZES:
        raw = body(n, args.seed + n)
        events = baseline(raw)
        for name, fn in fns.items():
            # Every candidate must hand the hasher the same events.
            assert fn(raw) == events or name == "msgspec_typed", name
        figures = {name: per_call_us(fn, raw, seconds) for name, fn in fns.items()}
        figures["featurize"] = per_call_us(
            lambda raw: hasher.featurize(baseline(raw), require_label=False), raw, seconds
        )
        base = figures["baseline"]
        print(f"{n} event(s), {len(raw):,} bytes:")
        for name, us in figures.items():
            ratio = "" if name == "featurize" else f"  {us / base:5.2f}x baseline"
            print(f"  {name:14s} {us:9.2f} us/request{ratio}")
            result[f"{name}_us_per_request_{n}_events"] = round(us, 2)
            if name not in ("baseline", "featurize"):
                result[f"{name}_over_baseline_ratio_{n}_events"] = round(us / base, 3)
        result[f"body_bytes_{n}_events"] = len(raw)
    return print_result(result)


if __name__ == "__main__":
    sys.exit(main())
