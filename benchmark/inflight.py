"""In-flight weight updates against whole-batch generation, side by side: the tiny task's long-tailed variant.

    python benchmark/inflight.py --out_dir runs/inflight                  # 2 rounds of both, online DPO
    python benchmark/inflight.py --out_dir runs/inflight --rounds 1 -- --total_episodes 1280

The variant: the tiny task with completions of up to 48 tokens (--response_length 48) instead of 12. Most
completions stop at EOS after about 7 tokens; the few that miss it (3 % of them here) run to 48, so whole-batch
generation waits for a handful of sequences seven times longer than the rest. Each round runs the same flags
twice, in turn: without in-flight updates, and with them (--inflight_updates --inflight_segment_tokens 8), so
that the machine's noise falls on both alike. Flags after `--` go to both runs. Prints one table of medians over
the timed steps (the first three, which compile, left out) and writes it to <out_dir>/inflight.md:
- step: seconds a training step takes, the trainer's waits included;
- generation: seconds from a rollout's start to its delivery (with in-flight updates rollouts overlap, so these
  add up to more than the engine's time);
- waiting: seconds the trainer waits for its rollout;
- tokens/s: response tokens trained on per second of training steps.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LONG_TAILED = ["--response_length", "48", "--eval_freq", "0", "--num_eval_prompts", "64", "--total_episodes", "3200"]
MODES = {"whole batch": [], "in-flight": ["--inflight_updates", "--inflight_segment_tokens", "8"]}
SKIPPED_STEPS = 3  # the first steps compile the engine's and the trainer's kernels
FIGURES = {
    "step": "time/step",
    "generation": "time/generation",
    "waiting": "time/wait_for_rollouts",
    "tokens/s": "throughput/tokens_per_second",
}


def medians(metrics: Path) -> dict[str, float]:
    """The medians of FIGURES over a run's timed steps (its metrics.jsonl)."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [line for line in lines if "time/step" in line][SKIPPED_STEPS:]
    return {name: statistics.median(line[key] for line in steps) for name, key in FIGURES.items()}


def run(script: str, flags: list[str], out: Path) -> dict[str, float]:
    """One run, its output in `out` (and out.log); its medians."""
    argv = [sys.executable, script, *LONG_TAILED, *flags, "--output_dir", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)
    return medians(out / "metrics.jsonl")


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """Markdown: a row a mode, each figure the median of its rounds' medians; the last row the ratio."""
    medians = {mode: {f: statistics.median(r[f] for r in rounds) for f in FIGURES} for mode, rounds in results.items()}
    rows = ["| mode | " + " | ".join(FIGURES) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    rows += [f"| {mode} | " + " | ".join(f"{m[f]:.3f}" for f in FIGURES) + " |" for mode, m in medians.items()]
    whole, inflight = medians["whole batch"], medians["in-flight"]
    ratios = [f"{inflight[f] / whole[f]:.2f}x" if whole[f] > 0.01 else "-" for f in FIGURES]  # no ratio to ~0
    rows.append("| in-flight / whole batch | " + " | ".join(ratios) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out_dir", type=Path, required=True)
    parser.add_argument("--script", default="online_dpo_async.py")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("flags", nargs="*", help="after --: flags for both runs")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for mode, flags in MODES.items():
            out = args.out_dir / f"{mode.replace(' ', '_')}_{i}"
            results[mode].append(run(args.script, [*flags, *args.flags], out))
            print(f"round {i} {mode}: " + ", ".join(f"{f} {v:.3f}" for f, v in results[mode][-1].items()))
    text = table(results)
    print(text)
    tmp = args.out_dir / "inflight.md.tmp"
    tmp.write_text(text + "\n")
    tmp.rename(args.out_dir / "inflight.md")


if __name__ == "__main__":
    main()
