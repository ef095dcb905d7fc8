"""Pipeline timing of runs, from their metrics.jsonl: how well generation and training overlap.

    python benchmark/timing.py runs/sync/metrics.jsonl runs/async/metrics.jsonl

Per run (medians over training steps, the first two left out as warm-up): G = engine time per
batch (generation + weight push), T = trainer time per step, the step's wall time, and the pipeline
efficiency max(G, T) / step time (1.0 = the slower side never waits). With two runs, the second's
speed-up over the first.
"""

import json
import statistics
import sys


def summarize(path: str) -> dict:
    steps = [m for m in map(json.loads, open(path)) if "async/lag" in m][2:]
    if not steps:
        raise SystemExit(f"{path}: fewer than three training steps")
    median = lambda key: statistics.median(m[key] for m in steps)  # noqa: E731
    g = statistics.median(m["time/generation"] + m["time/weight_sync"] for m in steps)
    t, step = median("time/training"), median("time/step")
    return {"run": path, "async_level": max(m["async/lag"] for m in steps), "G": g, "T": t, "step": step,
            "efficiency": max(g, t) / step, "push share": median("time/weight_sync") / step}


if __name__ == "__main__":
    rows = [summarize(path) for path in sys.argv[1:]]
    print(f"{'run':<48} {'k':>2} {'G (s)':>7} {'T (s)':>7} {'step (s)':>8} {'efficiency':>10} {'push share':>10}")
    for r in rows:
        print(f"{r['run'][-48:]:<48} {r['async_level']:>2} {r['G']:>7.3f} {r['T']:>7.3f} {r['step']:>8.3f} {r['efficiency']:>10.1%} {r['push share']:>10.1%}")
    if len(rows) == 2:
        print(f"speed-up of the second run: {rows[0]['step'] / rows[1]['step']:.2f}x "
              f"(ideal for perfect overlap: {(rows[0]['G'] + rows[0]['T']) / max(rows[0]['G'], rows[0]['T']):.2f}x)")
