"""What the learning benchmarks and studies share: the streams (the
generator's own and every `ps_core.synthetic` profile), progressive
validation of ctrps's `Learner`, and the learners people would pick instead
(Vowpal Wabbit, River) run on the same events in the same order.

Benchmarks import it; it is not a benchmark. VW and River need
``pip install -e '.[quality]'``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from consumers.formats import iter_file
from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.model.learner import Learner
from ps_core.model.metrics import evaluate
from ps_core.synthetic import PROFILES, SyntheticStream, profile_stream

Events = list[dict[str, Any]]


def _tokens(features: dict[str, Any]) -> tuple[list[str], dict[str, float]]:
    """Categorical tokens (``name=value``, lists multi-hot) and numeric features."""
    cats: list[str] = []
    nums: dict[str, float] = {}
    for name, value in features.items():
        if isinstance(value, bool):
            cats.append(f"{name}={value}")
        elif isinstance(value, (int, float)):
            nums[name] = float(value)
        elif isinstance(value, list):
            cats.extend(f"{name}={v}" for v in value)
        else:
            cats.append(f"{name}={value}")
    return cats, nums


def _vw_line(event: dict[str, Any]) -> str:
    cats, nums = _tokens(event["features"])
    clean = [c.replace(" ", "_").replace(":", ";").replace("|", "/") for c in cats]
    label = 1 if event["label"] else -1
    return f"{label} |f " + " ".join(clean + [f"{k}:{v:g}" for k, v in nums.items()])


def _river_x(event: dict[str, Any]) -> dict[str, float]:
    cats, nums = _tokens(event["features"])
    x: dict[str, float] = dict.fromkeys(cats, 1.0)
    x.update(nums)
    return x


def progressive(learner: Learner, events: Events) -> np.ndarray:
    """`learner`'s progressive predictions of `events`, learnt in a worker's
    windows of 20,000 in order; NaN where it refused an event (a count
    beyond what ``--numeric raw`` takes, say)."""
    out = np.full(len(events), np.nan)
    for start in range(0, len(events), 20_000):
        window = events[start : start + 20_000]
        learner.learn(window)
        kept = np.ones(len(window), dtype=bool)
        kept[list(learner.refused)] = False
        out[start : start + len(window)][kept] = learner.predicted
    return out


def run_ctrps(kind: str, events: Events, numeric: str = DEFAULT_NUMERIC, **model_args: Any) -> tuple[np.ndarray, float]:
    learner = Learner(kind, numeric=numeric, **model_args)
    t0 = time.perf_counter()
    predicted = progressive(learner, events)
    return predicted, time.perf_counter() - t0


def run_vw(events: Events) -> tuple[np.ndarray, float]:
    import vowpalwabbit

    lines = [_vw_line(e) for e in events]
    ws = vowpalwabbit.Workspace("--loss_function logistic --link logistic -b 22 --quiet")
    out = np.empty(len(lines))
    t0 = time.perf_counter()
    for i, line in enumerate(lines):  # VW's API takes one example at a time
        ex = ws.parse(line)
        ws.learn(ex)  # predicts, then updates: the prediction is progressive
        out[i] = ex.get_simplelabel_prediction()
        ws.finish_example(ex)
    seconds = time.perf_counter() - t0
    ws.finish()
    return out, seconds


def run_river(kind: str, events: Events) -> tuple[np.ndarray, float]:
    from river import facto, linear_model, optim

    xs = [_river_x(e) for e in events]
    ys = [bool(e["label"]) for e in events]
    model: Any = (
        linear_model.LogisticRegression(optimizer=optim.FTRLProximal())
        if kind == "lr"
        else facto.FMClassifier(n_factors=8, seed=1)
    )
    out = np.empty(len(xs))
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(zip(xs, ys)):  # River learns one event at a time
        out[i] = model.predict_proba_one(x).get(True, 0.5)
        model.learn_one(x, y)
    return out, time.perf_counter() - t0


ONE_FTRL: dict[str, Any] = {"name": "ftrl", "alpha": 0.2, "beta": 0.1, "l1": 0.5, "l2": 1.0}
"""One FTRL learner: the linear default until the mixture of learners took its place."""

LEARNERS: dict[str, Callable[[Events], tuple[np.ndarray, float]]] = {
    "ctrps_lr": lambda ev: run_ctrps("lr", ev),
    "ctrps_fm": lambda ev: run_ctrps("fm", ev),
    "ctrps_lr_raw": lambda ev: run_ctrps("lr", ev, "raw"),
    "ctrps_fm_raw": lambda ev: run_ctrps("fm", ev, "raw"),
    "ctrps_lr_coin": lambda ev: run_ctrps("lr", ev, optimizer={"name": "coin"}),
    "ctrps_lr_ftrl": lambda ev: run_ctrps("lr", ev, optimizer=ONE_FTRL),
    "vw": run_vw,
    "river_lr": lambda ev: run_river("lr", ev),
    "river_fm": lambda ev: run_river("fm", ev),
}


SLOW = ("river_fm",)
"""Learners run only when asked, on each stream's first --slow-limit events."""


def measure(name: str, events: Events) -> dict[str, float]:
    """A learner's progressive metrics on `events` (over those it learnt:
    ``refused`` counts the others) and its events/s."""
    labels = np.array([float(e["label"]) for e in events])
    p, seconds = LEARNERS[name](events)
    learnt = ~np.isnan(p)
    m = evaluate(np.clip(p[learnt], 1e-7, 1 - 1e-7), labels[learnt])
    return {
        "logloss": m.logloss,
        "auc": m.auc,
        "copc": m.copc,
        "events_per_s": len(events) / seconds,
        "refused": int(len(events) - learnt.sum()),
    }


MIN_CLICKS = 100
"""A profile's stream is at least long enough for this many clicks on
average: 15k events of a 0.08% click rate hold 12 clicks, and measure little
but the bias."""


def stream_size(profile: str, size: int) -> int:
    """`size`, or more events where `profile`'s click rate needs them for `MIN_CLICKS`."""
    base_ctr = PROFILES[profile].base_ctr if profile in PROFILES else 0.1
    return max(size, math.ceil(MIN_CLICKS / base_ctr))


def profile_events(profile: str, seed: int, n: int) -> Events:
    """`n` events of a `ps_core.synthetic` profile, or of ``quality``: the
    generator's own stream with a long tail (5% fresh ids) and drift, as
    this benchmark has always run it."""
    if profile == "quality":
        stream = SyntheticStream(seed=seed, fresh=0.05, drift=0.5, events_per_s=1000.0)
    else:
        stream = profile_stream(profile, seed=seed)
    return [e for batch in stream.iter_batches(n, 10_000) for e in batch]


def add_profiles_flags(p: argparse.ArgumentParser) -> None:
    """``--profiles`` and ``--profiles-only``, which `streams` reads."""
    p.add_argument(
        "--profiles",
        nargs="*",
        default=list(PROFILES),
        choices=list(PROFILES),
        help="the synthetic profiles to run (docs/synthetic.md; default all of them)",
    )
    p.add_argument("--profiles-only", action="store_true", help="only the --profiles streams")


def streams(args: argparse.Namespace) -> dict[str, Events]:
    small, large = (15_000, 45_000) if args.quick else (200_000, 1_000_000)
    out: dict[str, Events] = {}
    if not args.profiles_only:
        out["synthetic_small"] = profile_events("quality", args.seed, small)
        out["synthetic_large"] = profile_events("quality", args.seed, large)
        # The same, its counts acting linearly: numeric handling not chosen for one generator's truth.
        linear = SyntheticStream(seed=args.seed, fresh=0.05, drift=0.5, events_per_s=1000.0, numeric_truth="linear")
        out["synthetic_linear_counts"] = [e for batch in linear.iter_batches(small, 10_000) for e in batch]
    # The profiles shaped like real logs, at the small size.
    for profile in args.profiles:
        out[f"profile_{profile}"] = profile_events(profile, args.seed, stream_size(profile, small))
    if args.file is not None:
        rows = [e for e in iter_file(args.file, args.format) if isinstance(e, dict) and "label" in e]
        out[f"file_{Path(args.file).name}"] = rows[: args.file_limit] if args.file_limit else rows
    return out


def logloss(kind: str, events: Events, numeric: str, **model_args: Any) -> float:
    """Progressive log loss of a `kind` model learning `events` in windows of
    20,000 (over the events it learnt)."""
    predicted = progressive(Learner(kind, numeric=numeric, **model_args), events)
    labels = np.array([float(e["label"]) for e in events])
    learnt = ~np.isnan(predicted)
    return evaluate(np.clip(predicted[learnt], 1e-7, 1 - 1e-7), labels[learnt]).logloss
