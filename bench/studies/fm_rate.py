"""Benchmark: the sweep that chose FM's default embedding learning rate.

On the streams of ``bench_quality.py`` (the synthetic generator with a long
tail, 5% fresh ids and drift; 15k and 45k events with ``--quick``, 200k and
1M without), each learning rate of the embeddings' AdaGrad is run through
the same training code as a worker (`ps_core.model.learner.Learner`:
256-event mini-batches, progressive log loss), beside LR's log loss on the
same events. A rate qualifies when FM's log loss is at most LR's on every
stream at the default numeric feed (`ps_core.model.featurizer.DEFAULT_NUMERIC`,
which the linear part's FTRL defaults were swept with); ``raw`` numerics
are run and reported beside it. The default is the largest rate that
qualifies (the most learning the embeddings can do without costing log loss
anywhere). Ratios are FM's log loss over LR's.

Run: ``python bench/studies/fm_rate.py [--quick]`` (``--quick``: under a minute;
full: about 6 minutes). The last line is JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # bench/: the shared helpers

from common import bench_mode, bench_parser, elapsed_s, print_result, progress_log  # noqa: E402
from learning import add_profiles_flags, logloss, streams  # noqa: E402

from ps_core.model.featurizer import DEFAULT_NUMERIC
from ps_core.model.models import DEFAULT_EMBEDDING_OPTIMIZER

log = progress_log("fm_rate")

RATES = (0.001, 0.002, 0.003, 0.005, 0.01, 0.02, 0.05)
"""The embeddings' AdaGrad learning rates tried."""
NUMERICS = (DEFAULT_NUMERIC, "raw")
"""The numeric feeds run: the default (which qualifies a rate) and ``raw``."""


def parse_args() -> argparse.Namespace:
    p = bench_parser(
        "The sweep behind FM's default embedding learning rate: FM's log loss by rate against LR's.",
        "15k and 45k synthetic events (under a minute)",
        seed=7,
    )
    p.add_argument("--rates", type=float, nargs="+", default=list(RATES), help="learning rates to try")
    add_profiles_flags(p)
    args = p.parse_args()
    # What bench_quality.streams reads beside --quick and --seed: no file of one's own here.
    args.file = None
    return args


def main(args: argparse.Namespace) -> dict[str, Any]:
    data = streams(args)
    rates = tuple(args.rates)
    lr: dict[str, float] = {}
    fm: dict[str, dict[float, float]] = {}
    for stream_name, events in data.items():
        for numeric in NUMERICS:
            case = f"{stream_name}_{numeric}"
            lr[case] = logloss("lr", events, numeric)
            fm[case] = {}
            for rate in rates:
                optimizer = {**DEFAULT_EMBEDDING_OPTIMIZER, "lr": rate}
                fm[case][rate] = logloss("fm", events, numeric, embedding_optimizer=optimizer)
            log(
                f"{case} ({len(events):,} events): LR {lr[case]:.5f}; FM by rate: "
                + ", ".join(f"{r:g} {fm[case][r]:.5f} ({fm[case][r] / lr[case]:.4f}x)" for r in rates)
            )
    at_default = [c for c in lr if c.endswith(f"_{DEFAULT_NUMERIC}")]
    qualifying = [r for r in rates if all(fm[c][r] <= lr[c] for c in at_default)]
    chosen = max(qualifying) if qualifying else None
    log(
        f"rates with FM <= LR on every stream at {DEFAULT_NUMERIC}: {', '.join(f'{r:g}' for r in qualifying) or 'none'}; "
        f"chosen {chosen if chosen is not None else '-'}; the default is {DEFAULT_EMBEDDING_OPTIMIZER['lr']:g}"
    )
    return {
        "mode": bench_mode(args.quick),
        "events": {k: len(v) for k, v in data.items()},
        "lr_logloss": lr,
        "fm_logloss_by_rate": {c: {str(r): v for r, v in by.items()} for c, by in fm.items()},
        "fm_ratio_vs_lr_by_rate": {c: {str(r): v / lr[c] for r, v in by.items()} for c, by in fm.items()},
        "qualifying_rates": list(qualifying),
        "chosen_rate": chosen,
        "default_rate": DEFAULT_EMBEDDING_OPTIMIZER["lr"],
        "elapsed_s": elapsed_s(),
    }


if __name__ == "__main__":
    print_result(main(parse_args()))
