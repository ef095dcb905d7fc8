"""Timeline of runs from their metrics.jsonl, drawn like the paper's figures 2, 6 and 12: a
"generation" row (weight push, then the batch, labelled with the policy version that generated it;
evaluations in another colour) and a "training" row (the wait for the batch, then the trainer's
phases, labelled with the step), one bar per step. Several runs are stacked on one time axis.

    python benchmark/plot_timeline.py runs/speed/sync/metrics.jsonl runs/speed/async/metrics.jsonl --out timeline.png
"""

import argparse
from pathlib import Path
from typing import NamedTuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from timing import PHASES, read_lines  # noqa: E402

COLORS = {
    "weight push": "#dd8452",
    "generation": "#4c72b0",
    "evaluation": "#8172b3",
    "wait": "#e5e5e5",
    "scoring": "#55a868",
    "old_logprobs": "#64b5cd",
    "reference": "#ccb974",
    "update": "#c44e52",
    "snapshot": "#da8bc3",
    "snapshot and rest": "#937860",
}
ROWS = {"generation": 1, "training": 0}


class Bar(NamedTuple):
    row: str  # "generation" or "training"
    kind: str  # a key of COLORS, or "step": the outline of a step's whole training time, which carries its label
    start: float  # seconds since the run's generation thread started
    width: float
    label: str = ""


TIMELINE_KEYS = (
    "timeline/step_start",
    "timeline/training_start",
    "timeline/generation_start",
    "timeline/weight_sync_start",
)


def has_timeline(lines: list[dict]) -> bool:
    return any("async/lag" in m for m in lines) and all(
        key in m for m in lines if "async/lag" in m for key in TIMELINE_KEYS
    )


def timeline_bars(lines: list[dict], steps: range) -> list[Bar]:
    """The bars of `steps` (training lines have `async/lag`) and of the evaluations generated meanwhile.
    The trainer's phases are drawn back to back from `timeline/training_start` (small gaps between them
    go into the last segment, "snapshot and rest", which also holds the weight snapshot)."""
    train = {m["step"]: m for m in lines if "async/lag" in m}
    if not any(n in train for n in steps):
        raise SystemExit(
            f"--steps {steps.start}:{steps.stop}: the run has training steps {min(train, default=0)} to {max(train, default=-1)}"
        )
    bars = []
    for n in (n for n in steps if n in train):
        m = train[n]
        if m["time/weight_sync"] > 0:
            bars.append(Bar("generation", "weight push", m["timeline/weight_sync_start"], m["time/weight_sync"]))
        bars.append(
            Bar(
                "generation",
                "generation",
                m["timeline/generation_start"],
                m["time/generation"],
                f"θ{m['async/version']}",
            )
        )
        if m["time/wait_for_rollouts"] > 0:
            bars.append(Bar("training", "wait", m["timeline/step_start"], m["time/wait_for_rollouts"]))
        start = m["timeline/training_start"]
        for key in (k for k in PHASES if k in m):
            bars.append(Bar("training", key[5:], start, m[key]))
            start += m[key]
        if (rest := m["timeline/training_start"] + m["time/training"] - start) > 0:
            bars.append(Bar("training", "snapshot and rest", start, rest))
        bars.append(Bar("training", "step", m["timeline/training_start"], m["time/training"], str(n)))
    lo, hi = min(b.start for b in bars), max(b.start + b.width for b in bars)
    for m in lines:
        if (
            "eval/win_rate" in m
            and m["timeline/eval_generation_start"] < hi
            and m["timeline/eval_generation_start"] + m["time/eval_generation"] > lo
        ):
            bars.append(
                Bar(
                    "generation",
                    "evaluation",
                    m["timeline/eval_generation_start"],
                    m["time/eval_generation"],
                    f"eval θ{m['step']}",
                )
            )
    return bars


def parse_steps(text: str) -> range:
    try:
        first, last = (int(x) for x in text.split(":"))
    except ValueError:
        raise SystemExit(f"--steps must be A:B (steps A to B-1), got {text!r}") from None
    if not 0 <= first < last:
        raise SystemExit(f"--steps must be A:B with 0 <= A < B, got {text!r}")
    return range(first, last)


def plot(paths: list[str], out: str, steps: range = range(12), title: str | None = None) -> None:
    """One panel per run on a shared time axis (seconds since each run's first drawn bar), so the
    faster run visibly ends first."""
    fig, axes = plt.subplots(len(paths), 1, figsize=(14, 1.1 + 1.6 * len(paths)), sharex=True, squeeze=False)
    kinds = set()
    for ax, path in zip(axes[:, 0], paths):
        lines = read_lines(path)
        if not has_timeline(lines):
            raise SystemExit(f"{path}: training lines without the {', '.join(TIMELINE_KEYS)} keys; nothing to draw")
        bars = timeline_bars(lines, steps)
        t0 = min(b.start for b in bars)
        span = max(b.start + b.width for b in bars) - t0
        for b in bars:
            y, x = ROWS[b.row], b.start - t0
            if b.kind == "step":
                ax.barh(y, b.width, left=x, height=0.7, fill=False, edgecolor="black", linewidth=0.6)
            else:
                kinds.add(b.kind)
                ax.barh(
                    y,
                    b.width,
                    left=x,
                    height=0.7,
                    color=COLORS[b.kind],
                    hatch="//" if b.kind == "wait" else None,
                    edgecolor="white" if b.kind != "wait" else "#b0b0b0",
                    linewidth=0.3,
                )
            if b.label and b.width > span / 90:
                ax.text(
                    x + b.width / 2,
                    y,
                    b.label,
                    ha="center",
                    va="center",
                    fontsize=6.5,
                    color="black" if b.kind == "step" else "white",
                )
        lag = max((m["async/lag"] for m in lines if "async/lag" in m), default=0)
        ax.set_title(f"{Path(path).parent.name}: --async_level {lag}", fontsize=9, loc="left")
        ax.set_yticks(list(ROWS.values()), list(ROWS))
        ax.set_ylim(-0.6, 1.6)
    axes[-1, 0].set_xlabel("seconds since the first drawn step")
    handles = [Patch(facecolor=COLORS[k], hatch="//" if k == "wait" else None, label=k) for k in COLORS if k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title or f"timeline, steps {steps.start} to {steps.stop - 1}", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(out, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl of each run, drawn top to bottom")
    parser.add_argument("--out", default="timeline.png", help="PNG to write")
    parser.add_argument("--steps", default="0:12", help="steps A to B-1 (default 0:12, the first 12)")
    parser.add_argument("--title", default=None, help="figure title")
    args = parser.parse_args()
    plot(args.metrics, args.out, parse_steps(args.steps), args.title)
    print(f"wrote {args.out}")
