"""Pipeline timing of runs from their metrics.jsonl: where a step's time goes, and how well
generation and training overlap.

    python benchmark/timing.py runs/speed/sync/metrics.jsonl runs/speed/async/metrics.jsonl

Means over training steps, the first two left out as warm-up (engine and allocator warm-up, the
step-0 evaluation). A step's wall time is the time from its start to the next step's start
(`timeline/step_start`), so logging between steps is counted; the last step, which has no next
start, is then left out too (files without timeline keys use `time/step`). One column per run; with
two runs, synchronous then asynchronous, also the speed-up figures. With `--peak_tflops` (the GPU's dense
bf16 peak, e.g. 989 for an H100 SXM), also the trainer's model FLOP utilisation per phase: the FLOPs a
script logs per process and step (`flops/*`: 2 per parameter and token in a forward, 3x for training)
over the phase's time and that peak.

    python benchmark/timing.py --peak_tflops 989 runs/speed/sync/metrics.jsonl runs/speed/async/metrics.jsonl
"""

import json
import sys
from statistics import fmean as mean
from statistics import median

WARMUP = 2
# the trainer's phases, in the scripts' order
PHASES = ("time/scoring", "time/old_logprobs", "time/reference", "time/update", "time/snapshot")


def read_lines(path: str) -> list[dict]:
    try:
        return [json.loads(line) for line in open(path) if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: cannot read metrics ({exc})")


def summarize(path: str, leave_out: frozenset[int] = frozenset()) -> dict:
    """Means per step of: G = engine time per batch (generation + weight push), T = trainer time
    (`time/training`), its phases, the trainer's wait for rollouts, the rest of the step
    (logging between steps) and the step's wall time; efficiency = max(G, T) / step. `leave_out`: steps
    (their `step`) not counted either."""
    train = [m for m in read_lines(path) if "async/lag" in m]
    timeline = all("timeline/step_start" in m for m in train)
    counted = range(WARMUP, len(train) - 1 if timeline else len(train))
    counted = [i for i in counted if train[i]["step"] not in leave_out]
    steps = [train[i] for i in counted]
    if not steps:
        raise SystemExit(f"{path}: {len(train)} training steps; timing needs at least {WARMUP + 1 + timeline}")
    if timeline:
        starts = [m["timeline/step_start"] for m in train]
        step_times = [starts[i + 1] - starts[i] for i in counted]
    else:
        step_times = [m["time/step"] for m in steps]
    phases = {key: mean(m[key] for m in steps) for key in PHASES if key in steps[0]}
    flops = {key: mean(m["flops/" + key[5:]] for m in steps) for key in phases if "flops/" + key[5:] in steps[0]}
    r = {
        "run": path,
        "async_level": max(m["async/lag"] for m in train),
        "steps": len(steps),
        "generation": mean(m["time/generation"] for m in steps),
        "push": mean(m["time/weight_sync"] for m in steps),
        "T": mean(m["time/training"] for m in steps),
        "phases": phases,
        "flops": flops,
        "wait": mean(m["time/wait_for_rollouts"] for m in steps),
        "step": mean(step_times),
        "step_median": median(step_times),
    }
    r["G"] = r["generation"] + r["push"]
    r["snapshot and rest"] = r["T"] - sum(phases.values())
    r["outside"] = r["step"] - r["wait"] - r["T"]
    r["efficiency"] = max(r["G"], r["T"]) / r["step"]
    r["push share"] = r["push"] / r["step"]
    return r


def compare(sync: dict, async_: dict) -> dict:
    """Speed-up figures. G and T come from the synchronous run: there the engine and the trainer take
    turns, so each is timed while the other is idle; overlapped, they contend and grow."""
    g, t = sync["G"], sync["T"]
    return {
        "ideal speed-up": (g + t) / max(g, t),
        "measured speed-up": sync["step"] / async_["step"],
        "pipeline efficiency": max(g, t) / async_["step"],
        "push share": async_["push share"],
    }


def utilisation(r: dict, key: str, peak_tflops: float) -> str:
    """Model FLOP utilisation of a phase: the FLOPs it does per step over its time and the GPU's peak."""
    return f"{r['flops'][key] / r['phases'][key] / (peak_tflops * 1e12):.1%}" if key in r["flops"] else "-"


def report(paths: list[str], peak_tflops: float | None = None) -> str:
    """A Markdown table, one column per run; the comparison below it when given (sync, async)."""
    runs = [summarize(path) for path in paths]
    phase_keys = [key for key in PHASES if any(key in r["phases"] for r in runs)]
    mfu_keys = [key for key in phase_keys if peak_tflops and any(key in r["flops"] for r in runs)]
    rows = [
        ("steps timed", lambda r: f"{r['steps']}"),
        ("**G**: generation + weight push (s)", lambda r: f"{r['G']:.4f}"),
        ("  generation (s)", lambda r: f"{r['generation']:.4f}"),
        ("  weight push (s)", lambda r: f"{r['push']:.4f}"),
        ("**T**: trainer, `time/training` (s)", lambda r: f"{r['T']:.4f}"),
        *[
            (f"  {key[5:]} (s)", lambda r, key=key: f"{r['phases'][key]:.4f}" if key in r["phases"] else "-")
            for key in phase_keys
        ],
        ("  weight snapshot and rest (s)", lambda r: f"{r['snapshot and rest']:.4f}"),
        ("trainer waits for rollouts (s)", lambda r: f"{r['wait']:.4f}"),
        ("rest of the step: logging (s)", lambda r: f"{r['outside']:.4f}"),
        ("**step**: wall time per step (s)", lambda r: f"{r['step']:.4f}"),
        ("max(G, T) / step", lambda r: f"{r['efficiency']:.1%}"),
        *[
            (f"model FLOP utilisation: {key[5:]}", lambda r, key=key: utilisation(r, key, peak_tflops))
            for key in mfu_keys
        ],
    ]
    lines = [
        "| | " + " | ".join(f"`--async_level {r['async_level']}`" for r in runs) + " |",
        "|---" * (len(runs) + 1) + "|",
    ]
    lines += [f"| {name} | " + " | ".join(cell(r) for r in runs) + " |" for name, cell in rows]
    if len(runs) == 2 and runs[0]["async_level"] == 0 < runs[1]["async_level"]:
        c, (g, t) = compare(*runs), (runs[0]["G"], runs[0]["T"])
        lines += [
            "",
            f"G = {g:.4f} s, T = {t:.4f} s, measured in the synchronous run, where the two sides take turns (each timed while the other is idle);",
            f"in the asynchronous run they overlap and contend (G {runs[1]['G']:.4f} s, T {runs[1]['T']:.4f} s there).",
            "",
            "| figure | value |",
            "|---|---|",
            f"| ideal speed-up (G + T) / max(G, T) | {c['ideal speed-up']:.2f}x |",
            f"| measured speed-up: sync step / async step | {c['measured speed-up']:.2f}x |",
            f"| pipeline efficiency: max(G, T) / async step | {c['pipeline efficiency']:.1%} |",
            f"| weight push share of the async step | {c['push share']:.1%} |",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    argv, peak = sys.argv[1:], None
    if argv[:1] == ["--peak_tflops"] and len(argv) > 1:
        peak, argv = float(argv[1]), argv[2:]
    if not argv:
        raise SystemExit(
            "usage: python benchmark/timing.py [--peak_tflops TFLOPS] METRICS.jsonl [METRICS.jsonl ...] (sync first, then async)"
        )
    print(report(argv, peak))
