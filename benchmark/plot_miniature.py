"""Plots and results table of the miniature reproduction (`benchmark/miniature.py`), from its runs'
metrics.jsonl files, in the style of the paper's figures.

    python benchmark/plot_miniature.py runs/miniature --out runs/miniature/plots

Reads every `<runs_dir>/<run>/` that holds `miniature.json` (written by the driver when a run ended
well) and `metrics.jsonl`, and writes into `--out`:
  - win_rate_vs_kl.png: final win rate vs KL per method across N (figures 3-5), seeds averaged,
    bars spanning the seeds' range;
  - win_rate_vs_time.png: win rate vs training wall time, sync vs async per algorithm file
    (figures 1, 8), with K = 4 on the online DPO panel;
  - learning_curves.png: win rate vs episode of every run group at async level 0 or 1 (figure 3 left);
  - win_rate_vs_async_level.png: the staleness sweep, final win rate and KL proxy against the async
    level k at N = 1 per method, seeds averaged, bars spanning the seeds' range;
  - results.md: per group (method, N, K, async level 0 or 1) the final win rate (mean and range over
    seeds), the KL proxy and the training wall time; then the staleness sweep's table, per method and k;
  - with --copy_runs, runs/<run>/: each run's metrics.jsonl and miniature.json (less its command
    line, which names local paths), the data the table is computed from, so that
    `plot_miniature.py <out>/runs --out <out>` recomputes it.
The KL axis is the reference policy's perplexity on the final evaluation's completions (the
paper's proxy) when the eval lines carry it; otherwise the mean of `objective/kl` over the last
quarter of the training steps, and the axis and table say so.
"""

import argparse
import io
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from plumbing.tidy import write_atomically  # noqa: E402

METHOD_LABELS = {
    "dpo": "online DPO",
    "bo2": "Best-of-2",
    "rloo": "RLOO",
    "prime_rl": "RLOO, PRIME-RL's loss",
    "ppo": "PPO",
    "grpo": "GRPO",
}
PAPER_METHODS = ("dpo", "bo2", "rloo", "ppo")
ASYNC_FILES = {
    "dpo": "online_dpo_async.py",
    "rloo": "rloo_async.py",
    "prime_rl": "rloo_async.py",
    "ppo": "ppo_async.py",
}
DEFAULT_K = {"dpo": 2, "bo2": 2, "rloo": 2, "prime_rl": 2, "ppo": 1, "grpo": 2}
# The corrections sweep's lines (benchmark/miniature.py --study corrections): None, the trainer's pi_old uncorrected
CORRECTION_LABELS = {
    None: "none (trainer's pi_old)",
    "tis": "tis",
    "sequence_tis": "sequence_tis",
    "sequence_mask": "sequence_mask",
    "icepop": "icepop",
    "geo_mask": "geo_mask",
    "decoupled": "decoupled",
}
PERPLEXITY_KEYS = ("eval/ref_perplexity", "eval/ref_ppl")  # the newer name first
KL_FALLBACK_LABEL = "KL proxy: mean objective/kl over the last quarter of training steps (reference perplexity not logged, under one name, by every run)"


def read_run(folder: Path) -> dict:
    """One finished run: the driver's record, its training lines and its evaluations (by step)."""
    meta = json.loads((folder / "miniature.json").read_text())
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = sorted((m for m in lines if "async/lag" in m), key=lambda m: m["step"])
    evals = sorted((m for m in lines if "eval/win_rate" in m), key=lambda m: m["step"])
    if not train or not evals:
        raise SystemExit(f"error: {folder / 'metrics.jsonl'} has no training or no evaluation lines")
    return {"meta": meta, "train": train, "evals": evals}


def finished_folders(runs_dir: Path) -> list[Path]:
    if not runs_dir.is_dir():
        raise SystemExit(f"error: runs_dir {runs_dir} is not a folder")
    folders = [
        f for f in sorted(runs_dir.iterdir()) if (f / "miniature.json").exists() and (f / "metrics.jsonl").exists()
    ]
    if not folders:
        raise SystemExit(f"error: runs_dir {runs_dir} holds no finished run (no <run>/miniature.json)")
    return folders


def read_runs(runs_dir: Path) -> list[dict]:
    return [read_run(f) for f in finished_folders(runs_dir)]


def write_json_atomically(path: Path, data: dict) -> None:
    write_atomically(path, (json.dumps(data, indent=1) + "\n").encode())


def copy_runs(runs_dir: Path, dest: Path) -> None:
    """The data behind the table: each finished run's metrics.jsonl and record into dest/<run>/. The
    record's argv is left out (it holds local paths); its script and flags define the run."""
    for folder in finished_folders(runs_dir):
        meta = json.loads((folder / "miniature.json").read_text())
        meta.pop("argv", None)
        (dest / folder.name).mkdir(parents=True, exist_ok=True)
        write_json_atomically(dest / folder.name / "miniature.json", meta)
        write_atomically(dest / folder.name / "metrics.jsonl", (folder / "metrics.jsonl").read_bytes())


def perplexity_key(runs: list[dict]) -> str | None:
    """The reference-perplexity key every run's final evaluation has (the two names are not the same
    average, so runs that mix them get the fallback); None if there is none."""
    return next((k for k in PERPLEXITY_KEYS if all(k in r["evals"][-1] for r in runs)), None)


def kl_proxy(run: dict, key: str | None) -> float:
    """Reference perplexity at the final evaluation, or mean objective/kl over the last quarter of steps."""
    if key is not None:
        return run["evals"][-1][key]
    last = run["train"][-max(1, len(run["train"]) // 4) :]
    return float(np.mean([m["objective/kl"] for m in last]))


def train_time(run: dict, step: int) -> float:
    """Seconds of training (since the engine was up) when policy version `step` existed: the end of step - 1."""
    if step == 0:
        return 0.0
    line = next(m for m in run["train"] if m["step"] == step - 1)
    return line["timeline/step_start"] + line["time/step"]


def group_key(meta: dict) -> tuple:
    """A run's group, its seeds together: a record made before the corrections sweep has no correction (None), one
    made before the LoRA study no adapter (rank 0)."""
    method, n, k, level = meta["method"], meta["num_mini_batches"], meta["num_samples"], meta["async_level"]
    return method, n, k, level, meta.get("correction"), meta.get("lora_rank", 0)


def mean_over_steps(run: dict, key: str) -> float | None:
    """The mean of a training metric over the run's steps; None where the run does not log it."""
    values = [m[key] for m in run["train"] if key in m]
    return float(np.mean(values)) if values else None


def summarise(runs: list[dict]) -> tuple[list[dict], bool]:
    """Seed-averaged groups, in table order; whether the KL proxy is the reference perplexity."""
    ppl_key = perplexity_key(runs)
    groups = defaultdict(list)
    for run in runs:
        groups[group_key(run["meta"])].append(run)
    order = {m: i for i, m in enumerate(METHOD_LABELS)}
    rows = []
    corrections = {c: i for i, c in enumerate(CORRECTION_LABELS)}
    for key in sorted(
        groups, key=lambda k: (order.get(k[0], len(order)), k[3], k[2], k[1], corrections.get(k[4], 0), k[5])
    ):
        members = sorted(groups[key], key=lambda r: r["meta"]["seed"])
        win = [r["evals"][-1]["eval/win_rate"] for r in members]
        kl = [kl_proxy(r, ppl_key) for r in members]
        wall = [train_time(r, r["train"][-1]["step"] + 1) for r in members]
        # learning curve: evaluation steps every seed has, averaged
        steps = sorted(set.intersection(*({e["step"] for e in r["evals"]} for r in members)))
        curve = {s: [next(e for e in r["evals"] if e["step"] == s) for r in members] for s in steps}
        weighted = [mean_over_steps(r, "policy/correction_truncated_frac") for r in members]
        masked = [mean_over_steps(r, "policy/correction_masked_frac") for r in members]
        rows.append(
            {
                "method": key[0],
                "n": key[1],
                "k": key[2],
                "async_level": key[3],
                "correction": key[4],
                "lora_rank": key[5],
                "truncated": None if None in weighted else float(np.mean(weighted)),
                "masked": None if None in masked else float(np.mean(masked)),
                "seeds": [r["meta"]["seed"] for r in members],
                "win_rate": float(np.mean(win)),
                "win_rate_min": min(win),
                "win_rate_max": max(win),
                "kl": float(np.mean(kl)),
                "kl_min": min(kl),
                "kl_max": max(kl),
                "train_s": float(np.mean(wall)),
                "episodes": [float(np.mean([e["episode"] for e in curve[s]])) for s in steps],
                "curve": [float(np.mean([e["eval/win_rate"] for e in curve[s]])) for s in steps],
                "times": [float(np.mean([train_time(r, s) for r in members])) for s in steps],
            }
        )
    return rows, ppl_key is not None


def label(row: dict) -> str:
    parts = [f"N={row['n']}", "async" if row["async_level"] else "sync"]
    if row["k"] != DEFAULT_K.get(row["method"], row["k"]):
        parts.append(f"K={row['k']}")
    return " ".join(parts)


def paper_rows(rows: list[dict]) -> list[dict]:
    """The paper's comparisons: its methods, synchronous or one step asynchronous, the whole policy trained."""
    return [
        r
        for r in rows
        if r["method"] in PAPER_METHODS and r["async_level"] <= 1 and r["correction"] is None and not r["lora_rank"]
    ]


def lora_rows(rows: list[dict]) -> list[dict]:
    """The LoRA study (benchmark/miniature.py --study lora): at N = 1, async level 1, K default, each method that has
    runs with an adapter, full fine-tuning first."""
    studied = {r["method"] for r in rows if r["lora_rank"]}
    chosen = [
        r
        for r in rows
        if r["method"] in studied and r["n"] == 1 and r["async_level"] == 1 and r["k"] == DEFAULT_K[r["method"]]
    ]
    order = {m: i for i, m in enumerate(METHOD_LABELS)}
    return sorted(chosen, key=lambda r: (order[r["method"]], r["lora_rank"]))


def lora_table(rows: list[dict], use_perplexity: bool) -> str:
    """The LoRA study: per method, the final win rate of full fine-tuning and of LoRA, each with its seeds' range and
    the KL proxy, and LoRA's gain (or cost)."""
    kl = "ref. perplexity" if use_perplexity else "KL proxy"
    chosen = lora_rows(rows)
    ranks = sorted({r["lora_rank"] for r in chosen if r["lora_rank"]})
    head = f"| method | full fine-tuning (range; {kl}) | " + " | ".join(
        f"LoRA r = {rank} (range; {kl}) | LoRA r = {rank} - full" for rank in ranks
    )
    lines = [head + " |", "|---|---|" + "---|---|" * len(ranks)]
    for method in dict.fromkeys(r["method"] for r in chosen):
        by_rank = {r["lora_rank"]: r for r in chosen if r["method"] == method}
        cell = lambda r: f"{r['win_rate']:.3f} ({r['win_rate_min']:.3f}-{r['win_rate_max']:.3f}; {r['kl']:.2f})"  # noqa: E731
        full = by_rank.get(0)
        cells = [cell(full) if full else ""]
        for rank in ranks:
            lora = by_rank.get(rank)
            cells.append(cell(lora) if lora else "")
            cells.append(f"{lora['win_rate'] - full['win_rate']:+.3f}" if lora and full else "")
        lines.append(f"| {METHOD_LABELS[method]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def staleness_rows(rows: list[dict]) -> list[dict]:
    """The async level sweep: every method with runs at N = 1 and K default beyond async level 1, all its k."""
    swept = {r["method"] for r in rows if r["async_level"] > 1 and r["method"] in ASYNC_FILES}
    return [
        r
        for r in rows
        if r["method"] in swept
        and r["n"] == 1
        and r["k"] == DEFAULT_K[r["method"]]
        and r["correction"] is None
        and not r["lora_rank"]
    ]


def correction_rows(rows: list[dict]) -> list[dict]:
    """The corrections sweep: at N = 1, K default, every run of a method that has runs with a correction (those
    without one among them, the trainer's pi_old uncorrected), by method, correction and k."""
    swept = {r["method"] for r in rows if r["correction"] is not None}
    chosen = [r for r in rows if r["method"] in swept and r["n"] == 1 and r["k"] == DEFAULT_K[r["method"]]]
    order, corrections = {m: i for i, m in enumerate(METHOD_LABELS)}, list(CORRECTION_LABELS)
    return sorted(chosen, key=lambda r: (order[r["method"]], corrections.index(r["correction"]), r["async_level"]))


def table(rows: list[dict], use_perplexity: bool) -> str:
    kl_head = "ref. perplexity (final eval)" if use_perplexity else "mean objective/kl, last quarter of steps"
    lines = [
        f"| method | N | K | async level | seeds | final win rate (mean) | range over seeds | {kl_head} | training wall time (s, engine start excluded) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in paper_rows(rows):
        lines.append(
            f"| {METHOD_LABELS.get(r['method'], r['method'])} | {r['n']} | {r['k']} | {r['async_level']} | {len(r['seeds'])} | "
            f"{r['win_rate']:.3f} | {r['win_rate_min']:.3f} - {r['win_rate_max']:.3f} | {r['kl']:.3f} | {r['train_s']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    return text if use_perplexity else text + f"\n{KL_FALLBACK_LABEL}.\n"


def staleness_table(rows: list[dict], use_perplexity: bool) -> str:
    """The async level sweep: per method and k, the final win rate and the KL proxy, each with its seeds' range."""
    kl_head = "ref. perplexity (final eval)" if use_perplexity else "mean objective/kl, last quarter of steps"
    lines = [
        f"| method | async level k | seeds | final win rate (mean) | range over seeds | {kl_head} | range over seeds | training wall time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate(METHOD_LABELS)}
    for r in sorted(staleness_rows(rows), key=lambda r: (order.get(r["method"], len(order)), r["async_level"])):
        lines.append(
            f"| {METHOD_LABELS.get(r['method'], r['method'])} | {r['async_level']} | {len(r['seeds'])} | "
            f"{r['win_rate']:.3f} | {r['win_rate_min']:.3f} - {r['win_rate_max']:.3f} | {r['kl']:.3f} | "
            f"{r['kl_min']:.3f} - {r['kl_max']:.3f} | {r['train_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def staleness_summary(rows: list[dict], use_perplexity: bool) -> str:
    """The async level sweep in a line per method (the README's): the final win rate and, in brackets, the KL proxy at
    each k, seeds averaged."""
    sweep = staleness_rows(rows)
    levels = sorted({r["async_level"] for r in sweep})
    kl = "ref. perplexity" if use_perplexity else "mean objective/kl"
    lines = [
        f"| final win rate ({kl}) | " + " | ".join(f"k = {k}" for k in levels) + " |",
        "|---" * (len(levels) + 1) + "|",
    ]
    for method in (m for m in METHOD_LABELS if any(r["method"] == m for r in sweep)):
        cells = {r["async_level"]: f"{r['win_rate']:.3f} ({r['kl']:.2f})" for r in sweep if r["method"] == method}
        lines.append(f"| {METHOD_LABELS[method]} | " + " | ".join(cells.get(k, "") for k in levels) + " |")
    return "\n".join(lines) + "\n"


def fraction(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def correction_table(rows: list[dict], use_perplexity: bool) -> str:
    """The corrections sweep: per method, correction and k, the final win rate and the KL proxy with their seeds'
    ranges, and the fractions the correction truncated and masked (means over the training steps and seeds)."""
    kl_head = "ref. perplexity (final eval)" if use_perplexity else "mean objective/kl, last quarter of steps"
    lines = [
        f"| method | correction | async level k | seeds | final win rate (mean) | range over seeds | {kl_head} | "
        "range over seeds | truncated (mean over steps) | masked (mean over steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in correction_rows(rows):
        lines.append(
            f"| {METHOD_LABELS[r['method']]} | {CORRECTION_LABELS[r['correction']]} | {r['async_level']} | "
            f"{len(r['seeds'])} | {r['win_rate']:.3f} | {r['win_rate_min']:.3f} - {r['win_rate_max']:.3f} | "
            f"{r['kl']:.3f} | {r['kl_min']:.3f} - {r['kl_max']:.3f} | {fraction(r['truncated'])} | "
            f"{fraction(r['masked'])} |"
        )
    return "\n".join(lines) + "\n"


def correction_summary(rows: list[dict], use_perplexity: bool) -> str:
    """The corrections sweep in a line per method and correction: the final win rate and, in brackets, the KL proxy
    at each k, seeds averaged; a cell no run finished is empty."""
    sweep = correction_rows(rows)
    levels = sorted({r["async_level"] for r in sweep})
    kl = "ref. perplexity" if use_perplexity else "mean objective/kl"
    lines = [
        "| method | correction | " + " | ".join(f"k = {k}" for k in levels) + " |",
        "|---|---" + "|---" * len(levels) + "|",
    ]
    for method in (m for m in METHOD_LABELS if any(r["method"] == m for r in sweep)):
        for correction in (c for c in CORRECTION_LABELS if any(r["correction"] == c for r in sweep)):
            group = [r for r in sweep if (r["method"], r["correction"]) == (method, correction)]
            cells = {r["async_level"]: f"{r['win_rate']:.3f} ({r['kl']:.2f})" for r in group}
            label = f"| {METHOD_LABELS[method]} | {CORRECTION_LABELS[correction]} | "
            lines.append(label + " | ".join(cells.get(k, "") for k in levels) + " |")
    return f"final win rate ({kl}), seeds averaged:\n\n" + "\n".join(lines) + "\n"


def results_text(rows: list[dict], use_perplexity: bool) -> str:
    """results.md: the paper's comparisons if there are their runs, then the staleness sweep's table if there are
    its runs; or else the corrections sweep's alone (whose uncorrected runs are the staleness sweep's, its
    synchronous ones the paper's); or the LoRA study's alone (whose full fine-tuning runs are the paper's)."""
    if lora_rows(rows):
        return "LoRA against full fine-tuning (N = 1, async level 1):\n\n" + lora_table(rows, use_perplexity)
    text = table(rows, use_perplexity) if paper_rows(rows) and not correction_rows(rows) else ""
    if staleness_rows(rows) and not correction_rows(rows):
        text += "\nThe async level sweep (N = 1):\n\n" + staleness_table(rows, use_perplexity)
    elif correction_rows(rows):
        text += "\nThe corrections sweep (N = 1):\n\n" + correction_table(rows, use_perplexity)
    return text.removeprefix("\n")


# ---------------------------------------------------------------------------------------------
def save(fig, path: Path) -> None:
    """Temporary file, then rename: a reader never sees half a PNG."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    write_atomically(path, buffer.getvalue())


def plot_kl(rows: list[dict], use_perplexity: bool, path: Path) -> None:
    """Figures 3-5: one point per N (synchronous, K default), win rate against KL; one panel per method and all together."""
    import matplotlib.pyplot as plt

    sweeps = {
        m: [r for r in rows if r["method"] == m and r["async_level"] == 0 and r["k"] == DEFAULT_K[m]]
        for m in METHOD_LABELS
    }
    sweeps = {m: sorted(s, key=lambda r: r["n"]) for m, s in sweeps.items() if len(s) > 1}
    fig, axes = plt.subplots(
        1, len(sweeps) + 1, figsize=(4 * (len(sweeps) + 1), 3.8), sharey=True, squeeze=False, layout="constrained"
    )
    colors = dict(zip(METHOD_LABELS, plt.cm.tab10.colors))
    for ax, (method, sweep) in zip(axes[0], sweeps.items()):
        for target in (ax, axes[0][-1]):
            x, y = [r["kl"] for r in sweep], [r["win_rate"] for r in sweep]
            xerr = [[r["kl"] - r["kl_min"] for r in sweep], [r["kl_max"] - r["kl"] for r in sweep]]
            yerr = [
                [r["win_rate"] - r["win_rate_min"] for r in sweep],
                [r["win_rate_max"] - r["win_rate"] for r in sweep],
            ]
            target.errorbar(
                x, y, xerr=xerr, yerr=yerr, fmt="-o", color=colors[method], capsize=2, label=METHOD_LABELS[method]
            )
            for r in sweep:
                target.annotate(
                    f"N={r['n']}", (r["kl"], r["win_rate"]), textcoords="offset points", xytext=(4, 3), fontsize=7
                )
        ax.set_title(f"{METHOD_LABELS[method]}: N = {', '.join(str(r['n']) for r in sweep)}")
    axes[0][-1].set_title("all methods")
    axes[0][-1].legend(fontsize=8)
    for ax in axes[0]:
        ax.set_xlabel(
            "reference perplexity (final eval)"
            if use_perplexity
            else "mean objective/kl, last quarter of steps\n(reference perplexity not logged by every run)"
        )
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("final gold win rate")
    fig.suptitle(
        "Off-policy sweep (sync, N mini-batches per generated batch): win rate vs KL, seeds averaged, bars: seed range"
    )
    save(fig, path)
    plt.close(fig)


def plot_time(rows: list[dict], path: Path) -> None:
    """Figures 1 and 8: win rate against training wall time, sync vs async at N = 1, per algorithm file."""
    import matplotlib.pyplot as plt

    panels = {m: [r for r in rows if r["method"] == m and r["n"] == 1 and r["async_level"] <= 1] for m in ASYNC_FILES}
    panels = {m: sorted(p, key=lambda r: (r["async_level"], r["k"])) for m, p in panels.items() if p}
    fig, axes = plt.subplots(
        1,
        max(len(panels), 1),
        figsize=(4.5 * max(len(panels), 1), 3.8),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, (method, group) in zip(axes[0], panels.items()):
        for r in group:
            style = "-" if r["async_level"] == 0 else ("--" if r["k"] == DEFAULT_K[method] else ":")
            ax.plot(r["times"], r["curve"], style, marker="o", label=f"{label(r)} ({r['train_s']:.0f} s)")
        ax.set_title(f"{METHOD_LABELS[method]} ({ASYNC_FILES[method]})")
        ax.set_xlabel("training wall time (s, engine start excluded)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("gold win rate")
    fig.suptitle("Synchronous vs asynchronous (N = 1): win rate vs wall time, seeds averaged")
    save(fig, path)
    plt.close(fig)


def plot_curves(rows: list[dict], path: Path) -> None:
    """Learning curves: win rate against episode for every group of a method."""
    import matplotlib.pyplot as plt

    methods = [m for m in METHOD_LABELS if any(r["method"] == m for r in rows)]
    fig, axes = plt.subplots(
        1,
        max(len(methods), 1),
        figsize=(4 * max(len(methods), 1), 3.8),
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    for ax, method in zip(axes[0], methods):
        group = [r for r in rows if r["method"] == method and r["async_level"] <= 1]
        sync = sorted((r for r in group if r["async_level"] == 0), key=lambda r: r["n"])
        shades = plt.cm.viridis(np.linspace(0, 0.9, max(len(sync), 1)))
        for r, color in zip(sync, shades):
            ax.plot(r["episodes"], r["curve"], "-o", color=color, markersize=3, label=label(r))
        for r in (r for r in group if r["async_level"] > 0):
            ax.plot(
                r["episodes"],
                r["curve"],
                "--" if r["k"] == DEFAULT_K[method] else ":",
                marker="s",
                color="black",
                markersize=3,
                label=label(r),
            )
        ax.set_title(METHOD_LABELS[method])
        ax.set_xlabel("episode")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("gold win rate")
    fig.suptitle("Learning curves, seeds averaged")
    save(fig, path)
    plt.close(fig)


def plot_staleness(rows: list[dict], use_perplexity: bool, path: Path) -> None:
    """The async level sweep against k (evenly spaced), one line per method, seeds averaged, bars spanning the seeds'
    range: the final win rate; the same, close up on the runs that did not fall more than 0.03 below the lowest
    synchronous run (one that diverged leaves the axis); the KL proxy, on a log scale for the same reason."""
    import matplotlib.pyplot as plt

    sweep = staleness_rows(rows)
    levels = sorted({r["async_level"] for r in sweep})
    fig, axes = plt.subplots(1, 3, figsize=(15, 3.8), squeeze=False, layout="constrained")
    colors = dict(zip(METHOD_LABELS, plt.cm.tab10.colors))
    for method in (m for m in METHOD_LABELS if any(r["method"] == m for r in sweep)):
        line = sorted((r for r in sweep if r["method"] == method), key=lambda r: r["async_level"])
        x = [levels.index(r["async_level"]) for r in line]
        for ax, key in zip(axes[0], ("win_rate", "win_rate", "kl")):
            err = [[r[key] - r[f"{key}_min"] for r in line], [r[f"{key}_max"] - r[key] for r in line]]
            y = [r[key] for r in line]
            ax.errorbar(x, y, yerr=err, fmt="-o", color=colors[method], capsize=2, label=METHOD_LABELS[method])
    kl_label = "reference perplexity (final eval)" if use_perplexity else "mean objective/kl, last quarter of steps"
    labels = ("final gold win rate", "final gold win rate, close up", kl_label)
    for ax, label in zip(axes[0], labels):
        ax.set_xticks(range(len(levels)), [str(k) for k in levels])
        ax.set_xlabel("async level k (policy versions a batch is behind)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    synchronous = [r["win_rate_min"] for r in sweep if r["async_level"] == 0] or [r["win_rate_min"] for r in sweep]
    axes[0][1].set_ylim(min(synchronous) - 0.03, max(r["win_rate_max"] for r in sweep) + 0.01)
    axes[0][2].set_yscale("log")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(
        "Staleness (N = 1): final win rate and KL proxy against the async level, seeds averaged, bars: seed range"
    )
    save(fig, path)
    plt.close(fig)


def plot_corrections(rows: list[dict], use_perplexity: bool, path: Path) -> None:
    """The corrections sweep against k (evenly spaced): a column per method, its final win rate above and its KL proxy
    below (a log scale: a run that diverged is far off), one line per correction, seeds averaged, bars spanning the
    seeds' range."""
    import matplotlib.pyplot as plt

    sweep = correction_rows(rows)
    levels = sorted({r["async_level"] for r in sweep})
    methods = [m for m in METHOD_LABELS if any(r["method"] == m for r in sweep)]
    fig, axes = plt.subplots(2, len(methods), figsize=(6 * len(methods), 7), squeeze=False, layout="constrained")
    colors = dict(zip(CORRECTION_LABELS, plt.cm.tab10.colors))
    for column, method in enumerate(methods):
        for correction in CORRECTION_LABELS:
            line = sorted(
                (r for r in sweep if (r["method"], r["correction"]) == (method, correction)),
                key=lambda r: r["async_level"],
            )
            if not line:
                continue
            x = [levels.index(r["async_level"]) for r in line]
            for ax, key in zip(axes[:, column], ("win_rate", "kl")):
                err = [[r[key] - r[f"{key}_min"] for r in line], [r[f"{key}_max"] - r[key] for r in line]]
                style = "--" if correction is None else "-"
                ax.errorbar(
                    [v - 0.3 + 0.1 * list(CORRECTION_LABELS).index(correction) for v in x],
                    [r[key] for r in line],
                    yerr=err,
                    fmt=style + "o",
                    color=colors[correction],
                    capsize=2,
                    markersize=4,
                    label=CORRECTION_LABELS[correction],
                )
        axes[0, column].set_title(METHOD_LABELS[method])
        axes[1, column].set_yscale("log")
    kl_label = "reference perplexity (final eval)" if use_perplexity else "mean objective/kl, last quarter of steps"
    for ax, label in zip(axes.flat, ["final gold win rate"] * len(methods) + [kl_label] * len(methods)):
        ax.set_xticks(range(len(levels)), [str(k) for k in levels])
        ax.set_xlim(-0.5, len(levels) - 0.5)  # each k's slot holds its corrections side by side
        ax.set_xlabel("async level k (policy versions a batch is behind)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower right")  # the runs that learn end high
    fig.suptitle("Corrections against staleness (N = 1): seeds averaged, bars: seed range")
    save(fig, path)
    plt.close(fig)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs_dir", help="the driver's --out_dir: one folder per run")
    parser.add_argument("--out", default=None, help="folder for the PNGs and results.md (default <runs_dir>/plots)")
    parser.add_argument(
        "--copy_runs",
        action="store_true",
        help="also copy each run's metrics.jsonl and miniature.json into <out>/runs/",
    )
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    runs_dir = Path(args.runs_dir)
    out = Path(args.out) if args.out else runs_dir / "plots"
    rows, use_perplexity = summarise(read_runs(runs_dir))
    out.mkdir(parents=True, exist_ok=True)
    pngs = []
    studies = correction_rows(rows) or lora_rows(rows)  # a study's folder shows its own table (and figure) alone
    if paper_rows(rows) and not studies:
        plot_kl(rows, use_perplexity, out / "win_rate_vs_kl.png")
        plot_time(rows, out / "win_rate_vs_time.png")
        plot_curves(rows, out / "learning_curves.png")
        pngs += ["win_rate_vs_kl.png", "win_rate_vs_time.png", "learning_curves.png"]
    if staleness_rows(rows) and not studies:
        plot_staleness(rows, use_perplexity, out / "win_rate_vs_async_level.png")
        pngs.append("win_rate_vs_async_level.png")
    elif correction_rows(rows):
        plot_corrections(rows, use_perplexity, out / "corrections_vs_async_level.png")
        pngs.append("corrections_vs_async_level.png")
    text = results_text(rows, use_perplexity)
    write_atomically(out / "results.md", text.encode())
    if args.copy_runs:
        copy_runs(runs_dir, out / "runs")
    print(text)
    print(f"wrote {', '.join(str(out / n) for n in [*pngs, 'results.md'])}")


if __name__ == "__main__":
    main(sys.argv[1:])
