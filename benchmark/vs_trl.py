"""Side by side with TRL: the same work through TRL 1.16's online DPO and RLOO trainers (vLLM colocate, synchronous)
and through online_dpo_async.py and rloo_async.py at --async_level 0 and 1, on one GPU. docs/vs_trl.md.

    pip install -r requirements-trl.txt
    python benchmark/vs_trl.py --model_size pythia-1b --out_dir runs/vs_trl_1b   # TLDR's shapes, random Pythia-1b models
    python benchmark/vs_trl.py --model_size tiny --out_dir runs/vs_trl_tiny      # the tiny task: also the gold win rate
    python benchmark/vs_trl.py --model_size pythia-1b --out_dir runs/x --dry_run # the commands and the differences only

TRL runs through benchmark/trl_driver.py, the only file that imports trl. Our scripts share the GPU with their engine
(`--vllm_placement auto` on one GPU). `<out_dir>/<run>/` holds each run's metrics.jsonl, args.json, run.log and
peak_memory.json; then `vs_trl.md` (the results and the differences), `vs_trl.png` and `vs_trl.json`.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402
import timing  # noqa: E402

SCRIPTS = {"online_dpo": "online_dpo_async.py", "rloo": "rloo_async.py"}
NAMES = {"online_dpo": "online DPO", "rloo": "RLOO"}
PEAK_FILE = "PEAK_MEMORY_FILE"  # environment variable: where a run writes its trainer's peak CUDA memory
GIB = 2**30
# The work, every flag that defines it. Pythia sizes: TLDR's lengths, batch, learning rate and EOS penalty
# (benchmark/tldr.sh), as `speed.py --model_size pythia-1b` times them; the tiny task: the scripts' defaults.
WORK = {
    "tiny": dict(
        total_episodes=12800,
        local_micro_batch_size=32,
        gradient_accumulation_steps=1,
        learning_rate=1e-4,
        max_prompt_length=12,
        response_length=12,
        missing_eos_penalty=-3.0,
        local_rollout_forward_batch_size=64,
        num_eval_prompts=512,
    ),
    "pythia": dict(
        total_episodes=3840,
        local_micro_batch_size=16,
        gradient_accumulation_steps=4,
        learning_rate=3e-6,
        max_prompt_length=speed.TLDR_LENGTHS[0],
        response_length=speed.TLDR_LENGTHS[1],
        missing_eos_penalty=-1.0,
        local_rollout_forward_batch_size=32,
        num_eval_prompts=64,
    ),
}
SHARED = dict(
    num_samples=2, adam_epsilon=1e-8, temperature=0.7, dtype="bfloat16", seed=1, vllm_gpu_memory_utilization=0.3
)
ALGORITHM = {"online_dpo": dict(beta=0.1), "rloo": dict(kl_coef=0.05, cliprange=0.2)}
OVERRIDES = ("total_episodes", "local_micro_batch_size", "gradient_accumulation_steps")

# Where TRL 1.16 cannot be set as our runs are, read in its source (OnlineDPOConfig / OnlineDPOTrainer, RLOOConfig /
# RLOOTrainer, VLLMGeneration): (methods, setting, ours, TRL, why). What the driver sets equal: docs/vs_trl.md.
DIFFERENCES = [
    (
        "both",
        "engine",
        "its own process on the trainer's GPU; weights pushed by CUDA IPC; generation overlaps training at `--async_level 1`",
        '`vllm_mode="colocate"`: vLLM in the trainer\'s process (`external_launcher`), weights loaded tensor by tensor; generation and training take turns',
        "what is compared",
    ),
    (
        "both",
        "engine batch limits",
        "vLLM's defaults",
        "`max_num_batched_tokens=4096`; `max_num_seqs`: online DPO `per_device_train_batch_size` (half of a micro-batch's sequences at once), "
        "RLOO `per_device_train_batch_size x steps_per_generation`",
        "fixed in TRL's colocate `LLM(...)`, no config field",
    ),
    (
        "online_dpo",
        "generation batch",
        "the step's prompts at once, 2 samples each",
        "each micro-batch's prompts, 2 samples each, `gradient_accumulation_steps` times per step",
        "TRL generates in `training_step`",
    ),
    (
        "rloo",
        "generation batch",
        "the step's prompts, `n = k` samples each",
        "each prompt repeated `num_generations` times, `n = 1`",
        "TRL's `RepeatSampler`",
    ),
    (
        "both",
        "positions of left-padded prompts",
        "counted from the attention mask",
        "no `position_ids`: padding counts (`_forward`, `_get_per_token_logps_and_entropies`)",
        "no config field; only the tiny task's prompts differ in length (Pythia shapes: all 512 tokens)",
    ),
    (
        "online_dpo",
        "logprob temperature",
        "logits / `--temperature`",
        "raw logits (`_forward`'s `log_softmax`)",
        "no config field: `temperature` only samples",
    ),
    (
        "online_dpo",
        "tied pairs",
        "left out of the loss, divided by all pairs",
        "first completion chosen (`first_half >= second_half`), in `losses.mean()`",
        "no config field",
    ),
    (
        "online_dpo",
        "gradient accumulation",
        "each micro-batch's loss / `gradient_accumulation_steps`",
        "not divided: the gradient is `gradient_accumulation_steps` x ours (AdamW ignores the scale but for eps)",
        "TRL's `training_step` backpropagates each micro-batch's mean",
    ),
    (
        "online_dpo",
        "logits computed",
        "at the response positions",
        "at every position, prompt included (`_forward`)",
        "implementation: memory and time only",
    ),
    (
        "both",
        "evaluation",
        "in the run, at step 0 and the end (outside the timed steps)",
        "none in the trainer: the driver evaluates the final policy after training (same prompts, seeds, judge)",
        "TRL has no tiny-task judge",
    ),
    (
        "both",
        "sampling seeds",
        "one per prompt",
        "the engine's (process index) only",
        "`seed` is the trainer's; samples differ, not their distribution",
    ),
]


class Run(NamedTuple):
    name: str
    method: str  # online_dpo | rloo
    side: str  # trl | ours
    async_level: int | None  # None: TRL's synchronous trainer
    argv: list[str]
    env: dict[str, str]
    measures: str


def as_argv(flags: dict) -> list[str]:
    return [
        word
        for key, value in flags.items()
        for word in ([f"--{key}" if value else f"--no_{key}"] if isinstance(value, bool) else [f"--{key}", str(value)])
    ]


def work_for(args: argparse.Namespace) -> dict:
    work = {**WORK["tiny" if args.model_size == "tiny" else "pythia"], **SHARED}
    return {**work, **{key: getattr(args, key) for key in OVERRIDES if getattr(args, key) is not None}}


def models_folder(args: argparse.Namespace) -> Path:
    """Where speed.build_models puts the random models of --model_size (the tiny task's committed ones for tiny)."""
    if args.model_size == "tiny":
        return speed.TINY_TASK
    return Path(args.out_dir).resolve() / "models" / f"{args.model_size}-prompt{work_for(args)['max_prompt_length']}"


def make_plan(args: argparse.Namespace) -> list[Run]:
    """TRL's trainer, then ours at --async_level 0 and 1, for each method: the same work, every flag spelled out."""
    out, work, models = Path(args.out_dir).resolve(), work_for(args), models_folder(args)
    paths = dict(sft_model_path=models / "sft", reward_model_path=models / "reward", dataset_name=models / "data")
    runs = []
    for method, script in SCRIPTS.items():
        folder = out / f"trl_{method}"
        flags = {"trainer": method, **paths, **work, **ALGORITHM[method], "output_dir": folder}
        runs.append(
            Run(
                f"trl_{method}",
                method,
                "trl",
                None,
                [sys.executable, "benchmark/trl_driver.py", *as_argv(flags)],
                {PEAK_FILE: str(folder / "peak_memory.json")},
                f"TRL {NAMES[method]}, vLLM colocate, synchronous: step time split, memory, final win rate",
            )
        )
        samples = "num_samples" if method == "online_dpo" else "rloo_k"
        own = (
            dict(loss_type="sigmoid")
            if method == "online_dpo"
            else dict(normalize_advantage=False, old_logprobs="trainer")
        )
        for k in (0, 1):
            folder = out / f"ours_{method}_async{k}"
            flags = {
                "task": "tiny",
                "gold_judge": "tiny",
                **paths,
                "dataset_config": None,
                "dataset_train_split": "train",
                "dataset_eval_split": "test",
                **{key: value for key, value in work.items() if key != "num_samples"},
                samples: work["num_samples"],
                **ALGORITHM[method],
                **own,
                "vllm_dtype": work["dtype"],
                "gradient_checkpointing": False,
                "async_level": k,
                "vllm_placement": "auto",
                "num_mini_batches": 1,
                "num_ppo_epochs": 1,
                "lr_schedule": "linear",
                "eval_freq": 0,
                "save_freq": 0,
                "output_dir": folder,
            }
            runs.append(
                Run(
                    f"ours_{method}_async{k}",
                    method,
                    "ours",
                    k,
                    [sys.executable, "benchmark/vs_trl.py", "--run_script", script, *as_argv(flags)],
                    {PEAK_FILE: str(folder / "peak_memory.json")},
                    f"{script} --async_level {k}, engine on the same GPU: step time split, memory, final win rate",
                )
            )
    return runs


def differences_table(methods=tuple(SCRIPTS)) -> str:
    lines = ["| method | setting | ours | TRL 1.16 | why |", "|---|---|---|---|---|"]
    return "\n".join(
        lines
        + [
            f"| {'both' if m == 'both' else NAMES[m]} | {setting} | {ours} | {trl} | {why} |"
            for m, setting, ours, trl, why in DIFFERENCES
            if m == "both" or m in methods
        ]
    )


# ---------------------------------------------------------------------------------------------
# Executor
# ---------------------------------------------------------------------------------------------
def run_script(script: str, flags: list[str]) -> None:
    """Run an algorithm file as `python SCRIPT FLAGS` does, in this process, and write the trainer's peak CUDA memory
    (the engine has processes of its own) to $PEAK_MEMORY_FILE at exit."""
    import atexit
    import runpy

    import torch

    if PEAK_FILE in os.environ:
        peak = lambda: torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None  # noqa: E731
        atexit.register(lambda: Path(os.environ[PEAK_FILE]).write_text(json.dumps({"max_memory_allocated": peak()})))
    sys.argv = [script, *flags]
    sys.path.insert(0, str(ROOT))
    runpy.run_path(str(ROOT / script), run_name="__main__")


def gpu_memory_used() -> float | None:
    """MiB in use on the first visible GPU (nvidia-smi), None without one."""
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    try:
        proc = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return float(proc.stdout.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def execute(run: Run, folder: Path, interval: float = 0.5) -> float | None:
    """Run one command, its output in <folder>/run.log. Returns the GPU memory it took at its peak over what was in use
    before it started (trainer, engine and CUDA contexts; nvidia-smi every `interval` s), in GiB; None without a GPU."""
    folder.mkdir(parents=True, exist_ok=True)
    before = peak = gpu_memory_used()
    with open(folder / "run.log", "w") as log:
        proc = subprocess.Popen(run.argv, cwd=ROOT, env={**os.environ, **run.env}, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(interval)
            if before is not None and (used := gpu_memory_used()) is not None:
                peak = max(peak, used)
    if proc.returncode:
        raise SystemExit(f"[{run.name}] exited with {proc.returncode}; see {folder / 'run.log'}")
    return None if before is None else (peak - before) / 1024


def collect(run: Run, folder: Path, gpu_peak_gib: float | None) -> dict:
    metrics = str(folder / "metrics.jsonl")
    peak_file = folder / "peak_memory.json"
    peak = json.loads(peak_file.read_text())["max_memory_allocated"] if peak_file.exists() else None
    episodes_per_step = json.loads((folder / "args.json").read_text())["episodes_per_step"]
    return result(
        run,
        timing.summarize(metrics),
        episodes_per_step,
        final_win_rate(timing.read_lines(metrics)),
        peak,
        gpu_peak_gib,
    )


# ---------------------------------------------------------------------------------------------
# Results: pure functions of the runs' summaries
# ---------------------------------------------------------------------------------------------
def final_win_rate(lines: list[dict]) -> float | None:
    evals = [m for m in lines if "eval/win_rate" in m]
    return max(evals, key=lambda m: m["step"])["eval/win_rate"] if evals else None


def result(run: Run, summary: dict, episodes_per_step: int, win_rate, trainer_peak_bytes, gpu_peak_gib) -> dict:
    """One run's numbers from timing.summarize (means over the steps after warm-up): G = generation + weight sync,
    T = the trainer's own work (scoring included), the trainer's wait for its rollouts, the step's wall time."""
    return {
        "name": run.name,
        "method": run.method,
        "side": run.side,
        "async_level": run.async_level,
        "steps_timed": summary["steps"],
        "episodes_per_step": episodes_per_step,
        "step_s": summary["step"],
        "episodes_per_s": episodes_per_step / summary["step"],
        "generation_s": summary["generation"],
        "weight_sync_s": summary["push"],
        "trainer_s": summary["T"],
        "scoring_s": summary["phases"].get("time/scoring"),
        "wait_s": summary["wait"],
        "win_rate": win_rate,
        "gpu_peak_gib": gpu_peak_gib,
        "trainer_peak_gib": None if trainer_peak_bytes is None else trainer_peak_bytes / GIB,
    }


def speedups(results: list[dict]) -> dict[str, float | None]:
    """Each run's episodes per second over those of TRL's trainer for the same method."""
    trl = {r["method"]: r["episodes_per_s"] for r in results if r["side"] == "trl"}
    return {r["name"]: r["episodes_per_s"] / trl[r["method"]] if r["method"] in trl else None for r in results}


def label(r: dict) -> str:
    return f"TRL {NAMES[r['method']]}" if r["side"] == "trl" else f"ours {NAMES[r['method']]}, async {r['async_level']}"


def results_table(results: list[dict], win_rate: bool) -> str:
    cell = lambda value, spec: "-" if value is None else format(value, spec)  # noqa: E731
    ratios = speedups(results)
    columns = [
        ("episodes/s", "episodes_per_s", ".1f"),
        ("step (s)", "step_s", ".3f"),
        ("generation (s)", "generation_s", ".3f"),
        ("weight sync (s)", "weight_sync_s", ".3f"),
        ("trainer (s)", "trainer_s", ".3f"),
        ("of which scoring (s)", "scoring_s", ".3f"),
        ("trainer waits (s)", "wait_s", ".3f"),
        ("trainer peak (GiB)", "trainer_peak_gib", ".1f"),
        ("GPU peak (GiB)", "gpu_peak_gib", ".1f"),
    ]
    columns += [("final win rate", "win_rate", ".3f")] if win_rate else []
    lines = ["| run | x TRL | " + " | ".join(name for name, _, _ in columns) + " |", "|---" * (len(columns) + 2) + "|"]
    lines += [
        f"| {label(r)} | {cell(ratios[r['name']], '.2f')} | "
        + " | ".join(cell(r[key], spec) for _, key, spec in columns)
        + " |"
        for r in results
    ]
    return "\n".join(lines)


def plot(results: list[dict], path: str, title: str) -> list[tuple[str, float, str]]:
    """Bar chart of episodes per second, each bar labelled with its ratio to TRL's; returns (label, height, annotation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = speedups(results)
    bars = [
        (label(r), r["episodes_per_s"], "" if ratios[r["name"]] is None else f"{ratios[r['name']]:.2f}x")
        for r in results
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = ax.bar(
        range(len(bars)),
        [h for _, h, _ in bars],
        color=["tab:gray" if r["side"] == "trl" else "tab:blue" for r in results],
    )
    ax.bar_label(drawn, labels=[a for _, _, a in bars], fontsize=8)
    ax.set_xticks(range(len(bars)), [name for name, _, _ in bars], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("episodes per second after warm-up")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return bars


# ---------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", required=True, help="where the runs, vs_trl.md, vs_trl.png and vs_trl.json go")
    parser.add_argument(
        "--model_size",
        default="pythia-1b",
        choices=("tiny", *speed.PYTHIA),
        help="tiny: the committed tiny task (also the gold win rate); else random models of that Pythia size at TLDR's lengths",
    )
    parser.add_argument(
        "--runs", default=None, help="comma-separated run names to run (default: all; --dry_run lists them)"
    )
    parser.add_argument(
        "--dry_run", action="store_true", help="print the plan's commands and the differences table; run nothing"
    )
    for key in OVERRIDES:
        parser.add_argument(
            f"--{key}", type=int, default=None, help=f"override the work's {key} (every run gets the same)"
        )
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    if argv[:1] == ["--run_script"]:  # one of our runs, started by the executor
        return run_script(argv[1], argv[2:])
    args = parse(argv)
    plan = make_plan(args)
    if args.runs is not None:
        unknown = set(args.runs.split(",")) - {run.name for run in plan}
        if unknown:
            raise SystemExit(
                f"--runs: no run named {', '.join(sorted(unknown))}; the runs are {', '.join(run.name for run in plan)}"
            )
        plan = [run for run in plan if run.name in args.runs.split(",")]
    for run in plan:
        print(f"[{run.name}] {run.measures}\n  {shlex.join([f'{k}={v}' for k, v in run.env.items()] + run.argv)}")
    differences = differences_table()
    print(f"\nSettings that differ from TRL's:\n{differences}")
    if args.dry_run:
        return
    out = Path(args.out_dir).resolve()
    if args.model_size != "tiny":
        print(f"building random {args.model_size} models ...", flush=True)
        speed.build_models(args.model_size, work_for(args)["max_prompt_length"], out / "models")
    results = []
    for run in plan:
        folder = Path(run.argv[run.argv.index("--output_dir") + 1])
        if (folder / "metrics.jsonl").exists():
            raise SystemExit(f"{folder} already holds a run: pick another --out_dir")
        start = time.perf_counter()
        gpu_peak = execute(run, folder)
        print(f"[{run.name}] done in {time.perf_counter() - start:.0f} s", flush=True)
        results.append(collect(run, folder, gpu_peak))
    title = f"{args.model_size}: TRL 1.16 (vLLM colocate) and ours on one GPU, the same work"
    table = results_table(results, win_rate=args.model_size == "tiny")
    (out / "vs_trl.md").write_text(f"{title}\n\n{table}\n\nSettings that differ from TRL's:\n\n{differences}\n")
    (out / "vs_trl.json").write_text(json.dumps({"work": work_for(args), "results": results}, indent=2))
    plot(results, str(out / "vs_trl.png"), title)
    print(f"\n{table}\n\nwrote {out / 'vs_trl.md'}, {out / 'vs_trl.png'}, {out / 'vs_trl.json'}")


if __name__ == "__main__":
    main(sys.argv[1:])
