"""Benchmark: one worker training several models on one decode
(``--also-train``) against one worker per model.

A topic on the embedded broker (or ``CTRPS_KAFKA_BOOTSTRAP``) is pre-loaded
with synthetic Criteo-like events (13 numeric, 26 categorical fields). With
in-process shards (the network is not what differs), in one run:

(a) one worker trains one model (``ctr``, LR with FTRL): the baseline, and
    the cost of a second model trained by a second worker (its own group,
    its own decode), since it does the same work again;
(b) one worker trains ``ctr`` and, with ``--also-train``, ``ads`` and
    ``feed`` (3 models): each record parsed and validated once, hashed into
    each model's namespace, each model trained on the window in turn.

Reported: events/s of each run (records of the topic per second, from the
first assignment to the last commit), and model-events/s (events × models
per second). The ratio ``ratio_models_per_s_vs_separate`` compares (b)'s
model-events/s with 3 workers run one after the other (3 × (a)'s time for
the same records): above 1, the shared decode saves work. ``--quick`` runs
100k events once; the full run 300k events, 3 rounds, medians.

Run: ``python bench/bench_many_models.py [--quick]``; the last line is JSON.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import uvloop
from common import add_record_option, bench_mode, elapsed_s, print_result, progress_log
from running import local_clients, preload, worker_rate

from consumers.broker import EmbeddedBroker, create_topics

log = progress_log("many-models")

PARTITIONS = 4
MODELS = ("ctr", "ads", "feed")


async def main(args: argparse.Namespace) -> dict[str, object]:
    n = 100_000 if args.quick else 300_000
    window = 20_000
    rounds = 1 if args.quick else 3
    external = os.environ.get("CTRPS_KAFKA_BOOTSTRAP")
    broker = None if external else EmbeddedBroker()
    if broker is not None:
        await broker.start()
    bootstrap = external or (broker.bootstrap if broker else "")
    try:
        topic = f"bench-many-{os.getpid()}"
        await create_topics(bootstrap, {topic: PARTITIONS, topic + ".dlq": 1})
        log(f"preloading {n} events into {PARTITIONS} partitions")
        await preload(bootstrap, topic, n, args.seed)
        one: list[float] = []
        many: list[float] = []
        for rnd in range(rounds):
            tag = f"round {rnd + 1}/{rounds}: " if rounds > 1 else ""
            for label, also, out in (("(a) one model", (), one), (f"(b) {len(MODELS)} models", MODELS[1:], many)):
                log(f"{tag}{label}")
                rate, worker, _ = await worker_rate(
                    bootstrap, topic, n, *local_clients(), window, decode_processes=1, also=also
                )
                trained = [worker.stats.events_trained, *(a.stats.events_trained for a in worker.also)]
                assert all(t == n for t in trained), trained
                out.append(rate)
                log(f"{label}: {rate:,.0f} events/s, {rate * (1 + len(also)):,.0f} model-events/s")
        a, b = float(np.median(one)), float(np.median(many))
        k = len(MODELS)
        # k separate workers over the same records, one after the other (k ×
        # (a)'s time): k × n model-events in k × n / a seconds, a model-events/s.
        log(
            f"one worker, {k} models: {b:,.0f} events/s = {b * k:,.0f} model-events/s; "
            f"{k} workers one after the other: {a / k:,.0f} events/s = {a:,.0f} model-events/s; "
            f"ratio {b * k / a:.2f}"
        )
        return {
            "mode": bench_mode(args.quick),
            "events": n,
            "models": k,
            "rounds": rounds,
            "one_model_events_per_s": a,
            "many_models_events_per_s": b,
            "many_models_model_events_per_s": b * k,
            "separate_workers_model_events_per_s": a,
            "ratio_models_per_s_vs_separate": b * k / a,
            "ratio_events_per_s_vs_one_model": b / a,
            "rounds_one_model_events_per_s": one,
            "rounds_many_models_events_per_s": many,
            "elapsed_s": elapsed_s(),
        }
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100k events, one round (under a minute)")
    parser.add_argument("--seed", type=int, default=0)
    add_record_option(parser)
    ARGS = parser.parse_args()
    print_result(uvloop.run(main(ARGS)), ARGS)
