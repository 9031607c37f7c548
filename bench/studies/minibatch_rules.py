"""Benchmark: how a mini-batch's FTRL update should accumulate ``n`` so that
mini-batches learn as well as per-event updates.

A worker pushes, per key, the sum ``G`` of its events' gradients in a
mini-batch; the shard's FTRL adds ``G²`` to the key's ``n``. Per-event FTRL
adds each event's ``g²`` instead. This measures, on the synthetic stream of
``bench_quality.py`` (long tail, 5% fresh ids, drift), the progressive log
loss of logistic regression with the default FTRL hyperparameters under:

- ``per_event``: mini-batch 1 (the baseline: what per-event FTRL learns);
- ``minibatch_G2``: mini-batches of 256 adding ``G²`` (what ctrps does);
- ``minibatch_sum_g2``: adding ``Σ g²`` (per-event accumulation of squared
  gradients, the usual suggestion);
- ``minibatch_sqrt_c_G2``: adding ``√c · G²`` (``c``: the key's events in the
  mini-batch), between the two;
- ``minibatch_max``: adding ``max(G², √c · Σ g²)``;
- ``minibatch_64`` and ``minibatch_16``: smaller mini-batches adding ``G²``.

And, with mini-batches of 256 adding ``G²``, how numeric features are fed
(the generator's counts are lognormal; the hasher passes them as they are):

- ``numeric_raw``: the count as the value (what ctrps does; = ``minibatch_G2``);
- ``numeric_log1p``: ``log1p(count)``;
- ``numeric_dropped``: numeric features left out (value 0).

The model is plain numpy over dense ids (the ids of `FeatureHasher`, the
update of `ps_core.store.optim.FTRL` in float64), so the rules are compared
alone, without the network. Ratios are each log loss over the per-event one.

Run: ``python bench/studies/minibatch_rules.py [--quick]`` (``--quick``: 60k
events, ~15 s; full: 200k events, ~30 s). The last line is JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: the shared helpers

from common import bench_mode, elapsed_s, print_result, progress_log  # noqa: E402

from ps_core.model.featurizer import FeatureHasher
from ps_core.model.models import DEFAULT_LINEAR_OPTIMIZER
from ps_core.synthetic import SyntheticStream

log = progress_log("minibatch-rules")

F64 = npt.NDArray[np.float64]
# n's increment from (G, Σg², c) per key.
Rule = Callable[[F64, F64, F64], F64]

RULES: dict[str, tuple[int, Rule]] = {
    "per_event": (1, lambda g, s, c: g * g),
    "minibatch_G2": (256, lambda g, s, c: g * g),
    "minibatch_sum_g2": (256, lambda g, s, c: s),
    "minibatch_sqrt_c_G2": (256, lambda g, s, c: np.sqrt(c) * g * g),
    "minibatch_max": (256, lambda g, s, c: np.maximum(g * g, np.sqrt(c) * s)),
    "minibatch_64": (64, lambda g, s, c: g * g),
    "minibatch_16": (16, lambda g, s, c: g * g),
}


def run(ids: npt.NDArray[np.int64], x: F64, offsets: npt.NDArray[np.int64], y: F64, mb: int, rule: Rule) -> float:
    """Progressive log loss of FTRL-LR over the stream in mini-batches of `mb`."""
    o = DEFAULT_LINEAR_OPTIMIZER
    alpha, beta, l1, l2 = o["alpha"], o["beta"], o["l1"], o["l2"]
    k = int(ids.max()) + 1
    z, n = np.zeros(k), np.zeros(k)

    def weights(u: npt.NDArray[np.int64]) -> F64:
        zu = z[u]
        w: F64 = np.where(np.abs(zu) <= l1, 0.0, -(zu - np.sign(zu) * l1) / ((beta + np.sqrt(n[u])) / alpha + l2))
        return w

    loss = 0.0
    for s in range(0, y.size, mb):
        e = min(s + mb, y.size)
        lo, hi = offsets[s], offsets[e]
        occ, xs = ids[lo:hi], x[lo:hi]
        event = np.repeat(np.arange(e - s), np.diff(offsets[s : e + 1]))
        logit = np.bincount(event, weights(occ) * xs, minlength=e - s)
        p = 1 / (1 + np.exp(-np.clip(logit, -35, 35)))
        ys = y[s:e]
        loss -= float((ys * np.log(np.maximum(p, 1e-15)) + (1 - ys) * np.log(np.maximum(1 - p, 1e-15))).sum())
        g = (p - ys)[event] * xs
        u, inv = np.unique(occ, return_inverse=True)
        grad = np.bincount(inv, g, minlength=u.size)
        squares = np.bincount(inv, g * g, minlength=u.size)
        count = np.bincount(inv, minlength=u.size).astype(np.float64)
        add = rule(grad, squares, count)
        w = weights(u)
        sigma = (np.sqrt(n[u] + add) - np.sqrt(n[u])) / alpha
        z[u] += grad - sigma * w
        n[u] += add
    return loss / y.size


def main(args: argparse.Namespace) -> dict[str, object]:
    n = args.events or (60_000 if args.quick else 200_000)
    stream = SyntheticStream(seed=args.seed, fresh=0.05, drift=0.5, events_per_s=1000.0)
    events = [e for b in stream.iter_batches(n, 10_000) for e in b]
    batch, _ = FeatureHasher("ctr").featurize(events)
    _, ids = np.unique(batch.keys, return_inverse=True)
    x = batch.values.astype(np.float64)
    y = batch.labels.astype(np.float64)
    offsets = batch.offsets.astype(np.int64)
    out: dict[str, object] = {"mode": bench_mode(args.quick), "events": int(y.size)}
    losses: dict[str, float] = {}
    for name, (mb, rule) in RULES.items():
        t0 = time.perf_counter()
        losses[name] = run(ids.astype(np.int64), x, offsets, y, mb, rule)
        log(f"{name:22s} mini-batch {mb:4d}: logloss {losses[name]:.5f} ({time.perf_counter() - t0:.1f} s)")
    # The numeric features' ids: a field's id does not depend on its value.
    probe, _ = FeatureHasher("ctr").featurize([{"label": 0, "features": {f"I{i}": 1.0 for i in range(1, 14)}}])
    numeric = np.isin(batch.keys, probe.keys[1:])
    for name, values in (
        ("numeric_log1p", np.where(numeric, np.log1p(np.maximum(x, 0.0)), x)),
        ("numeric_dropped", np.where(numeric, 0.0, x)),
    ):
        losses[name] = run(ids.astype(np.int64), values, offsets, y, 256, RULES["minibatch_G2"][1])
        log(f"{name:22s} mini-batch  256: logloss {losses[name]:.5f}")
    base = losses["per_event"]
    out["numeric_share_of_features"] = float(numeric.mean())
    for name, value in losses.items():
        out[f"{name}_logloss"] = value
        if name.startswith("numeric_"):
            # The same mini-batches, the features fed otherwise: against raw counts.
            raw = losses["minibatch_G2"]
            out[f"ratio_{name}_vs_raw"] = value / raw
            log(f"{name:22s} / numeric_raw = {value / raw:.4f}")
        elif name != "per_event":
            out[f"ratio_{name}_vs_per_event"] = value / base
            log(f"{name:22s} / per_event = {value / base:.4f}")
    out["elapsed_s"] = elapsed_s()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60k events (about 15 s)")
    parser.add_argument("--events", type=int, help="events of the stream (default 200k, --quick 60k)")
    parser.add_argument("--seed", type=int, default=0)
    print_result(main(parser.parse_args()))
