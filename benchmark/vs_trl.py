"""Side by side with TRL: the same work through TRL 1.16's online DPO and RLOO trainers (synchronous; generating with
vLLM in colocate mode on a GPU, with transformers' `generate` on a CPU) and through online_dpo_async.py and
rloo_async.py at --async_level 0 and 1, on one GPU or on a CPU's cores, over one or more seeds. docs/vs_trl.md.

    pip install -r requirements-trl.txt
    python benchmark/vs_trl.py --model_size pythia-1b --out_dir runs/vs_trl_1b   # TLDR's shapes, random Pythia-1b models
    python benchmark/vs_trl.py --model_size tiny --out_dir runs/vs_trl_tiny      # the tiny task: also the gold win rate
    python benchmark/vs_trl.py --model_size pythia-1b --out_dir runs/x --dry_run # the commands and the differences only

TRL runs through benchmark/trl_driver.py, the only file that imports trl. Our scripts share the GPU with their engine
(`--vllm_placement auto` on one GPU); on a CPU they split their cores as they always do. Every run is pinned to the
same cores (--cores). `<out_dir>/<run>/` holds each run's metrics.jsonl, args.json, run.log and peak_memory.json, and
`vs_trl_run.json` once it finished: a run that has it is reused when the benchmark is started again, one that has not
(stopped, or failed) is started over. Then `vs_trl.md` (the results and the differences), `vs_trl.png` (speed),
`vs_trl_curves.png` (win rate against episodes, the tiny task) and `vs_trl.json`. A run that fails is a row with its
error; the others still run.
"""

import argparse
import fnmatch
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path
from statistics import fmean
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(ROOT))
import speed  # noqa: E402
import timing  # noqa: E402

from plumbing.tidy import stop_process_group, write_atomically  # noqa: E402

SCRIPTS = {"online_dpo": "online_dpo_async.py", "rloo": "rloo_async.py"}
NAMES = {"online_dpo": "online DPO", "rloo": "RLOO"}
GENERATION = {"vllm": "vLLM colocate", "hf": "HF generate"}  # TRL's two ways to generate (trl_driver.py)
PEAK_FILE = "PEAK_MEMORY_FILE"  # environment variable: where a run writes its trainer's peak CUDA memory
DONE = "vs_trl_run.json"  # written into a run's folder when it finished well
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
        eval_freq=25,
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
        eval_freq=0,
    ),
}
SHARED = dict(num_samples=2, adam_epsilon=1e-8, temperature=0.7, vllm_gpu_memory_utilization=0.3)
ALGORITHM = {"online_dpo": dict(beta=0.1), "rloo": dict(kl_coef=0.05, cliprange=0.2)}
OVERRIDES = ("total_episodes", "local_micro_batch_size", "gradient_accumulation_steps", "num_eval_prompts", "eval_freq")
# the steps from each evaluated policy version v on that the timing leaves out, in every run: our runs evaluate in the
# run (the engine generates between two batches, the trainer scores between two steps), which slowed step v + 1 at
# --async_level 0 and step v + 2 at 1 (by about 0.5 s on the tiny task on a CPU); TRL's versions are evaluated after
# training
EVAL_SHADOW = 3
VLLM_REASON = "'s vLLM colocate mode cannot load weights into vLLM's CPU backend"

# Where TRL 1.16 cannot be set as our runs are, read in its source (OnlineDPOConfig / OnlineDPOTrainer, RLOOConfig /
# RLOOTrainer, VLLMGeneration): (methods, setting, ours, TRL, why). What the driver sets equal: docs/vs_trl.md.
DIFFERENCES = [
    (
        "both",
        "engine",
        "vLLM in its own processes, on the trainer's GPU or on a core of its own; weights pushed in place; generation overlaps training at `--async_level 1`",
        "GPU: `vllm_mode=\"colocate\"`, vLLM in the trainer's process (`external_launcher`), weights loaded tensor by tensor; CPU: the policy's own `generate` "
        "(`use_vllm=False`), no weights to load; generation and training take turns",
        "what is compared; on a CPU TRL's colocate mode cannot load weights (vLLM's CPU backend keeps no `weight_loader` on its packed layers)",
    ),
    (
        "both",
        "engine batch limits",
        "vLLM's defaults",
        "vLLM colocate: `max_num_batched_tokens=4096`; `max_num_seqs`: online DPO `per_device_train_batch_size` (half of a micro-batch's sequences at once), "
        "RLOO `per_device_train_batch_size x steps_per_generation`. HF generate: a micro-batch's sequences at once",
        "fixed in TRL's colocate `LLM(...)`, no config field",
    ),
    (
        "both",
        "learning-rate schedule",
        "linear, stepped at the top of each step as the paper's code: step n of N trains at 1 − (n + 1)/N, the last at 0",
        "linear, stepped after each update: step n trains at 1 − n/N, the first at the full rate",
        "TRL's `lr_scheduler_type`; vs_trl.py's `--trl_lr_schedules trl,ours` adds TRL runs on ours",
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
        "in the run, every `--eval_freq` steps (the tiny task's 25), at step 0 and the end",
        "none in the trainer: the driver keeps the policy of those steps and evaluates each after training, as ours "
        "(same prompts, engine sampling with the same per-prompt seeds, judge)",
        "TRL has no tiny-task judge",
    ),
    (
        "both",
        "sampling seeds",
        "one per prompt",
        "vLLM colocate: the engine's (process index) only; HF generate: torch's generator",
        "`seed` is the trainer's; samples differ, not their distribution",
    ),
]


class Setup(NamedTuple):
    """What the machine decides: the GPU or the cores every run gets, how TRL generates, the trainers' dtype."""

    cuda: bool
    cores: list[int]  # every run is pinned to these
    generation: str  # TRL's: vllm | hf
    dtype: str  # bfloat16 | float32
    note: str  # one line on the choices --trl_generation auto and --dtype auto made


class Run(NamedTuple):
    name: str  # config + _s<seed>
    config: str  # the run's setting, seeds aside: trl_online_dpo, ours_rloo_async1, ...
    method: str  # online_dpo | rloo
    side: str  # trl | ours
    async_level: int | None  # None: TRL's synchronous trainer
    seed: int
    generation: str  # what generates: TRL's HF generate or vLLM colocate, our vLLM engine
    argv: list[str]
    env: dict[str, str]
    measures: str


class RunFailed(Exception):
    pass


def as_argv(flags: dict) -> list[str]:
    return [
        word
        for key, value in flags.items()
        for word in ([f"--{key}" if value else f"--no_{key}"] if isinstance(value, bool) else [f"--{key}", str(value)])
    ]


def parse_cores(text: str) -> list[int]:
    """`0,1` or `0-3` or `0-1,4`."""
    cores = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cores |= set(range(int(first), int(last or first) + 1))
    return sorted(cores)


def core_list(cores: list[int]) -> str:
    return (
        f"{cores[0]}-{cores[-1]}"
        if cores == list(range(cores[0], cores[-1] + 1)) and len(cores) > 1
        else ",".join(map(str, cores))
    )


def setup_for(args: argparse.Namespace, cuda: bool, allowed: list[int]) -> Setup:
    """TRL generates with vLLM colocate on a GPU, with HF generate on a CPU, where its colocate mode cannot load
    weights into vLLM's CPU backend (trl_driver.VLLM_ON_CPU); the trainers run bf16 autocast on a GPU, fp32 on a
    CPU (our scripts' --dtype auto). Every run gets the same cores."""
    cores = allowed if args.cores is None else parse_cores(args.cores)
    if not set(cores) <= set(allowed):
        raise SystemExit(f"error: --cores {args.cores}: this process may use cores {core_list(allowed)} only")
    generation = args.trl_generation
    if generation == "auto":
        generation = "vllm" if cuda else "hf"
    elif generation == "vllm" and not cuda:
        raise SystemExit(f"error: --trl_generation vllm needs a GPU: TRL{VLLM_REASON}; use --trl_generation hf")
    dtype = args.dtype if args.dtype != "auto" else "bfloat16" if cuda else "float32"
    device = "a GPU" if cuda else "no GPU"
    note = f"{device}: TRL generates with {GENERATION[generation]}, the trainers run {dtype}"
    if not cuda and args.trl_generation == "auto":
        note += f" (TRL{VLLM_REASON})"
    return Setup(cuda, cores, generation, dtype, note)


def work_for(args: argparse.Namespace) -> dict:
    work = {**WORK["tiny" if args.model_size == "tiny" else "pythia"], **SHARED}
    return {**work, **{key: getattr(args, key) for key in OVERRIDES if getattr(args, key) is not None}}


def models_folder(args: argparse.Namespace) -> Path:
    """Where speed.build_models puts the random models of --model_size (the tiny task's committed ones for tiny)."""
    if args.model_size == "tiny":
        return speed.TINY_TASK
    return Path(args.out_dir).resolve() / "models" / f"{args.model_size}-prompt{work_for(args)['max_prompt_length']}"


def seeds_of(args: argparse.Namespace) -> list[int]:
    return [int(seed) for seed in args.seeds.split(",")]


def make_plan(args: argparse.Namespace, setup: Setup | None = None) -> list[Run]:
    """For each seed and method: TRL's trainer (one run per --trl_lr_schedules), then ours at --async_level 0 and 1,
    the same work, every flag spelled out. `setup`: the machine's (None: this one's, setup_for)."""
    if setup is None:
        import torch

        setup = setup_for(args, torch.cuda.is_available(), sorted(os.sched_getaffinity(0)))
    out, work, models = Path(args.out_dir).resolve(), work_for(args), models_folder(args)
    paths = dict(sft_model_path=models / "sft", reward_model_path=models / "reward", dataset_name=models / "data")
    runs = []
    for seed in seeds_of(args):
        for method, script in SCRIPTS.items():
            for schedule in args.trl_lr_schedules.split(","):
                config = f"trl_{method}" + ("_lr_ours" if schedule == "ours" else "")
                folder = out / f"{config}_s{seed}"
                flags = {"trainer": method, "generation": setup.generation, "lr_schedule": schedule, **paths, **work}
                flags |= {"dtype": setup.dtype, "seed": seed, **ALGORITHM[method], "output_dir": folder}
                on = "our learning-rate schedule" if schedule == "ours" else "its own learning-rate schedule"
                runs.append(
                    Run(
                        folder.name,
                        config,
                        method,
                        "trl",
                        None,
                        seed,
                        f"TRL: {GENERATION[setup.generation]}",
                        [sys.executable, "benchmark/trl_driver.py", *as_argv(flags)],
                        {PEAK_FILE: str(folder / "peak_memory.json")},
                        f"TRL {NAMES[method]}, {GENERATION[setup.generation]}, synchronous, {on}: step time split, "
                        "memory, win rate",
                    )
                )
            samples = "num_samples" if method == "online_dpo" else "rloo_k"
            own = (
                dict(loss_type="sigmoid")
                if method == "online_dpo"
                else dict(normalize_advantage=False, old_logprobs="trainer")
            )
            for k in (0, 1):
                folder = out / f"ours_{method}_async{k}_s{seed}"
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
                    "dtype": setup.dtype,
                    "vllm_dtype": setup.dtype,
                    "seed": seed,
                    "gradient_checkpointing": False,
                    "async_level": k,
                    "vllm_placement": "auto",
                    "num_mini_batches": 1,
                    "num_ppo_epochs": 1,
                    "lr_schedule": "linear",
                    "save_freq": 0,
                    "output_dir": folder,
                }
                where = "engine on the same GPU" if setup.cuda else "engine on a core of its own"
                runs.append(
                    Run(
                        folder.name,
                        f"ours_{method}_async{k}",
                        method,
                        "ours",
                        k,
                        seed,
                        "ours: vLLM engine",
                        [sys.executable, "benchmark/vs_trl.py", "--run_script", script, *as_argv(flags)],
                        {PEAK_FILE: str(folder / "peak_memory.json")},
                        f"{script} --async_level {k}, {where}: step time split, memory, win rate",
                    )
                )
    return runs


def select(plan: list[Run], patterns: str | None) -> list[Run]:
    """The runs --runs names: comma-separated run names (`trl_rloo_s2`), settings (`trl_rloo`: every seed's) or shell
    patterns of either (`trl_*_s2`)."""
    if patterns is None:
        return plan
    named = lambda run, p: fnmatch.fnmatchcase(run.name, p) or fnmatch.fnmatchcase(run.config, p)  # noqa: E731
    unknown = [p for p in patterns.split(",") if not any(named(run, p) for run in plan)]
    if unknown:
        raise SystemExit(
            f"--runs: no run named {', '.join(unknown)}; the runs are {', '.join(run.name for run in plan)}"
        )
    return [run for run in plan if any(named(run, p) for p in patterns.split(","))]


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


def error_line(log: Path) -> str:
    """The line of a run's log that says why it failed: the last that names an exception or starts `error:`."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        head = line.split(":")[0]
        if line.startswith("error:") or (" " not in head and head.endswith(("Error", "Exception", "Interrupt"))):
            return line
    return lines[-1] if lines else "no output"


def execute(run: Run, folder: Path, cores: list[int], timeout: float, interval: float = 0.5) -> float | None:
    """Run one command on `cores`, in a process group of its own, its output in <folder>/run.log. Returns the GPU
    memory it took at its peak over what was in use before it started (trainer, engine and CUDA contexts;
    nvidia-smi every `interval` s), in GiB; None without a GPU. Raises RunFailed with the log's error line when it
    fails or runs past `timeout` seconds; its processes are stopped then."""
    folder.mkdir(parents=True, exist_ok=True)
    before = peak = gpu_memory_used()
    deadline = time.monotonic() + timeout
    with open(folder / "run.log", "w") as log:
        proc = subprocess.Popen(
            run.argv,
            cwd=ROOT,
            env={**os.environ, **run.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        )
        try:
            while proc.poll() is None:
                time.sleep(interval)
                if time.monotonic() > deadline:
                    raise RunFailed(f"still running after {timeout:.0f} s (--run_timeout_minutes); stopped")
                if before is not None and (used := gpu_memory_used()) is not None:
                    peak = max(peak, used)
        except BaseException:  # the deadline, or Ctrl-C, which reaches no process of another session
            stop_process_group(proc)
            raise
    if proc.returncode:
        with suppress(ProcessLookupError, PermissionError):  # what it started and left behind
            os.killpg(proc.pid, signal.SIGKILL)
        raise RunFailed(f"exit {proc.returncode}: {error_line(folder / 'run.log')}")
    return None if before is None else (peak - before) / 1024


def collect(run: Run, folder: Path, gpu_peak_gib: float | None) -> dict:
    metrics = str(folder / "metrics.jsonl")
    peak_file = folder / "peak_memory.json"
    peak = json.loads(peak_file.read_text())["max_memory_allocated"] if peak_file.exists() else None
    run_args = json.loads((folder / "args.json").read_text())
    lines = timing.read_lines(metrics)
    return result(
        run,
        timing.summarize(metrics, leave_out=shadowed_steps(lines)),
        run_args["episodes_per_step"],
        evaluations(lines),
        peak,
        gpu_peak_gib,
        run_args.get("torch_threads"),
    )


def run_or_reuse(run: Run, setup: Setup, timeout: float) -> dict:
    """A finished run (its DONE file) is read again; an unfinished or failed one is started over in an empty folder
    (timings of a run resumed half-way would not be comparable). A failure is the run's row, with its error."""
    folder = Path(run.argv[run.argv.index("--output_dir") + 1])
    done = folder / DONE
    if done.exists():
        record = json.loads(done.read_text())
        if (record["argv"], record["cores"]) != (run.argv[1:], setup.cores):
            raise SystemExit(f"error: {folder} holds a run of another command or cores: pick another --out_dir")
        print(f"[{run.name}] finished before: reused", flush=True)
        return collect(run, folder, record["gpu_peak_gib"])
    if folder.exists():
        print(f"[{run.name}] unfinished: started over", flush=True)
        shutil.rmtree(folder)
    start = time.perf_counter()
    try:
        gpu_peak = execute(run, folder, setup.cores, timeout)
        collected = collect(run, folder, gpu_peak)
    except (RunFailed, SystemExit, OSError, KeyError, ValueError) as error:
        print(f"[{run.name}] failed: {error}; see {folder / 'run.log'}", flush=True)
        return failed(run, str(error))
    seconds = time.perf_counter() - start
    record = {"argv": run.argv[1:], "cores": setup.cores, "gpu_peak_gib": gpu_peak, "wall_s": seconds}
    write_atomically(done, json.dumps(record, indent=1) + "\n")
    print(f"[{run.name}] done in {seconds:.0f} s", flush=True)
    return collected


# ---------------------------------------------------------------------------------------------
# Results: pure functions of the runs' metrics
# ---------------------------------------------------------------------------------------------
def evaluations(lines: list[dict]) -> list[tuple[int, int, float]]:
    """(step, episode, win rate) of each evaluation, in order of step."""
    evals = sorted((m["step"], m["episode"], m["eval/win_rate"]) for m in lines if "eval/win_rate" in m)
    return [tuple(e) for e in evals]


def shadowed_steps(lines: list[dict]) -> frozenset[int]:
    """The steps the timing leaves out (EVAL_SHADOW): from each evaluated policy version on."""
    evaluated = {m["step"] for m in lines if any(key.startswith("eval/") for key in m)}
    return frozenset(s for v in evaluated for s in range(v, v + EVAL_SHADOW))


def result(run: Run, summary: dict, episodes_per_step: int, evals, trainer_peak_bytes, gpu_peak_gib, threads) -> dict:
    """One run's numbers from timing.summarize (means over the timed steps): G = generation + weight sync, T = the
    trainer's own work (scoring included), the trainer's wait for its rollouts, the step's wall time; its evaluations."""
    return {
        **identity(run),
        "error": None,
        "steps_timed": summary["steps"],
        "episodes_per_step": episodes_per_step,
        "step_s": summary["step"],
        "episodes_per_s": episodes_per_step / summary["step"],
        "median_step_s": summary["step_median"],
        "episodes_per_s_median": episodes_per_step / summary["step_median"],
        "generation_s": summary["generation"],
        "weight_sync_s": summary["push"],
        "trainer_s": summary["T"],
        "scoring_s": summary["phases"].get("time/scoring"),
        "wait_s": summary["wait"],
        "win_rate": evals[-1][2] if evals else None,
        "evals": evals,
        "torch_threads": threads,
        "gpu_peak_gib": gpu_peak_gib,
        "trainer_peak_gib": None if trainer_peak_bytes is None else trainer_peak_bytes / GIB,
    }


NUMBERS = (
    "steps_timed",
    "episodes_per_step",
    "step_s",
    "episodes_per_s",
    "median_step_s",
    "episodes_per_s_median",
    "generation_s",
    "weight_sync_s",
    "trainer_s",
    "scoring_s",
    "wait_s",
    "win_rate",
    "torch_threads",
    "gpu_peak_gib",
    "trainer_peak_gib",
)


def identity(run: Run) -> dict:
    keys = ("name", "config", "method", "side", "async_level", "seed", "generation")
    return {key: getattr(run, key) for key in keys}


def failed(run: Run, error: str) -> dict:
    return {**identity(run), "error": error, **dict.fromkeys(NUMBERS), "evals": []}


def configs(results: list[dict]) -> list[dict]:
    """Each setting over its seeds, in the plan's order: the means of the runs that finished, the final win rate's
    range, how many finished of how many."""
    out = []
    for config in dict.fromkeys(r["config"] for r in results):
        runs = [r for r in results if r["config"] == config]
        done = [r for r in runs if r["error"] is None]
        mean = lambda key: fmean(r[key] for r in done) if done and done[0][key] is not None else None  # noqa: E731
        wins = [r["win_rate"] for r in done if r["win_rate"] is not None]
        out.append(
            {
                **{key: runs[0][key] for key in ("config", "method", "side", "async_level", "generation")},
                "seeds": [r["seed"] for r in done],
                "runs": len(runs),
                **{key: mean(key) for key in NUMBERS if key not in ("win_rate", "torch_threads", "steps_timed")},
                "win_rate": fmean(wins) if wins else None,
                "win_rate_range": (min(wins), max(wins)) if wins else None,
                "curve": mean_curve(done),
            }
        )
    return out


def mean_curve(runs: list[dict]) -> list[tuple[int, float, float, float]]:
    """(episode, mean, min, max) of the win rate over the runs at each evaluation all of them made."""
    by_episode = {}
    for r in runs:
        for _, episode, win in r["evals"]:
            by_episode.setdefault(episode, []).append(win)
    return [(e, fmean(w), min(w), max(w)) for e, w in sorted(by_episode.items()) if len(w) == len(runs)]


def speedups(rows: list[dict], key: str = "episodes_per_s") -> dict[str, float | None]:
    """Each setting's episodes per second (`key`) over those of TRL's trainer (on its own schedule), same method."""
    trl = {r["method"]: r[key] for r in rows if r["config"] == f"trl_{r['method']}"}
    return {r["config"]: r[key] / trl[r["method"]] if trl.get(r["method"]) and r[key] else None for r in rows}


def label(r: dict) -> str:
    if r["side"] == "trl":
        return f"TRL {NAMES[r['method']]}" + (", our lr schedule" if r["config"].endswith("_lr_ours") else "")
    return f"ours {NAMES[r['method']]}, async {r['async_level']}"


def cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def summary_table(rows: list[dict], win_rate: bool) -> str:
    """One row per setting: means over its seeds that finished; columns with no number in any row are left out."""
    ratios, at_median = speedups(rows), speedups(rows, "episodes_per_s_median")
    columns = [
        ("episodes/s", "episodes_per_s", ".1f"),
        ("step (s)", "step_s", ".3f"),
        ("median step (s)", "median_step_s", ".3f"),
        ("generation (s)", "generation_s", ".3f"),
        ("weight sync (s)", "weight_sync_s", ".3f"),
        ("trainer (s)", "trainer_s", ".3f"),
        ("of which scoring (s)", "scoring_s", ".3f"),
        ("trainer waits (s)", "wait_s", ".3f"),
        ("trainer peak (GiB)", "trainer_peak_gib", ".1f"),
        ("GPU peak (GiB)", "gpu_peak_gib", ".1f"),
    ]
    columns = [c for c in columns if any(r[c[1]] is not None for r in rows)]
    names = ["run", "generation", "seeds", "x TRL", "x TRL, median steps", *(name for name, _, _ in columns)]
    names += ["final win rate", "range"] if win_rate else []
    lines = ["| " + " | ".join(names) + " |", "|---" * len(names) + "|"]
    for r in rows:
        cells = [label(r), r["generation"], f"{len(r['seeds'])} of {r['runs']}", cell(ratios[r["config"]], ".2f")]
        cells.append(cell(at_median[r["config"]], ".2f"))
        cells += [cell(r[key], spec) for _, key, spec in columns]
        if win_rate:
            low_high = r["win_rate_range"]
            cells += [cell(r["win_rate"], ".3f"), "-" if low_high is None else f"{low_high[0]:.3f}-{low_high[1]:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def curve_table(rows: list[dict]) -> str:
    """The win rate at each evaluation, the mean over seeds, one row per setting."""
    episodes = sorted({e for r in rows for e, *_ in r["curve"]})
    lines = ["| run | " + " | ".join(f"{e}" for e in episodes) + " |", "|---" * (len(episodes) + 1) + "|"]
    for r in rows:
        at = {e: mean for e, mean, _, _ in r["curve"]}
        lines.append(f"| {label(r)} | " + " | ".join(cell(at.get(e), ".3f") for e in episodes) + " |")
    return "\n".join(lines)


def runs_table(results: list[dict], win_rate: bool) -> str:
    """Every run: its speed, its final win rate, or its error."""
    names = ["run", "seed", "episodes/s"] + (["final win rate"] if win_rate else []) + ["error"]
    lines = ["| " + " | ".join(names) + " |", "|---" * len(names) + "|"]
    for r in results:
        error = "-" if r["error"] is None else r["error"].replace("|", "\\|")[:200]
        cells = [label(r), str(r["seed"]), cell(r["episodes_per_s"], ".1f")]
        cells += [cell(r["win_rate"], ".3f")] if win_rate else []
        lines.append("| " + " | ".join(cells + [error]) + " |")
    return "\n".join(lines)


def title(data: dict) -> str:
    setup, place = (
        data["setup"],
        "one GPU" if data["setup"]["cuda"] else f"CPU cores {core_list(data['setup']['cores'])}",
    )
    return f"{data['model_size']}: TRL 1.16 ({GENERATION[setup['generation']]}) and ours, the same work, on {place}"


def count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def cores_line(data: dict) -> str:
    """What each run got of the machine, TRL's threads as its runs recorded them."""
    cores = data["setup"]["cores"]
    threads = sorted({r["torch_threads"] for r in data["results"] if r["side"] == "trl" and r["torch_threads"]})
    trl = (
        count(threads[0], "torch thread")
        if len(threads) == 1
        else f"{'/'.join(map(str, threads)) or '?'} torch threads"
    )
    line = f"Every run was pinned to the same {count(len(cores), 'core')}, {core_list(cores)}: TRL's trainer with {trl} on them"
    if data["setup"]["cuda"]:
        return line + "; ours as their scripts run on a GPU, the engine sharing the trainer's GPU."
    if len(cores) == 1:
        return line + "; ours with the engine and the trainer sharing it."
    return (
        line + f", generation and training taking turns; ours split them as the scripts do: the engine on core "
        f"{cores[0]}, the trainer on core{'s' * (len(cores) > 2)} {core_list(cores[1:])} "
        f"({count(len(cores) - 1, 'torch thread')})."
    )


def timing_line(data: dict) -> str:
    return (
        "Speed: each run's steps after two warm-up steps and before the last, leaving out the "
        f"{EVAL_SHADOW} steps from each evaluation on (ours evaluate in the run, TRL's versions after training); the "
        "mean step time and, less sensitive to other work on the machine, the median; then the means over the seeds."
    )


def report(data: dict) -> str:
    """vs_trl.md: the title, what each run got, the tables; a pure function of vs_trl.json's data."""
    win_rate = data["model_size"] == "tiny"
    rows = data["configs"]
    parts = [
        f"{title(data)}\n",
        f"{data['setup']['note']}. {cores_line(data)} {timing_line(data)}\n",
        summary_table(rows, win_rate),
    ]
    if win_rate:
        parts += ["\nWin rate at each evaluation (episodes), the mean over seeds:\n", curve_table(rows)]
    parts += ["\nEvery run:\n", runs_table(data["results"], win_rate)]
    parts += ["\nSettings that differ from TRL's:\n", differences_table()]
    return "\n".join(parts) + "\n"


COLOURS = {"trl": "tab:gray", 0: "tab:blue", 1: "tab:orange"}


def colour(r: dict) -> str:
    if r["config"].endswith("_lr_ours"):
        return "tab:green"
    return COLOURS["trl"] if r["side"] == "trl" else COLOURS[r["async_level"]]


def plot(rows: list[dict], path: str, title_: str) -> list[tuple[str, float, str]]:
    """Bar chart of episodes per second, each bar labelled with its ratio to TRL's; returns (label, height, annotation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = speedups(rows)
    shown = [r for r in rows if r["episodes_per_s"] is not None]
    bars = [
        (label(r), r["episodes_per_s"], "" if ratios[r["config"]] is None else f"{ratios[r['config']]:.2f}x")
        for r in shown
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = ax.bar(range(len(bars)), [h for _, h, _ in bars], color=[colour(r) for r in shown])
    ax.bar_label(drawn, labels=[a for _, _, a in bars], fontsize=8)
    ax.set_xticks(range(len(bars)), [name for name, _, _ in bars], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("episodes per second (timed steps)")
    ax.set_title(title_, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return bars


def plot_curves(rows: list[dict], path: str, title_: str) -> dict[str, list]:
    """Win rate against episodes, a panel per method: each setting's mean over seeds, its seeds' range as a band.
    Returns each drawn line's points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in SCRIPTS if any(r["method"] == m and r["curve"] for r in rows)]
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.4), sharey=True, squeeze=False)
    drawn = {}
    for ax, method in zip(axes[0], methods):
        for r in (r for r in rows if r["method"] == method and r["curve"]):
            episodes, mean, low, high = zip(*r["curve"])
            seeds = len(r["seeds"])
            ax.plot(episodes, mean, color=colour(r), label=f"{label(r)} ({seeds} seed{'s' * (seeds > 1)})", lw=1.5)
            ax.fill_between(episodes, low, high, color=colour(r), alpha=0.2, lw=0)
            drawn[label(r)] = list(zip(episodes, mean))
        ax.set_title(NAMES[method], fontsize=9)
        ax.set_xlabel("episodes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("gold win rate vs references")
    fig.suptitle(title_, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return drawn


# ---------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", required=True, help="where the runs, vs_trl.md, the PNGs and vs_trl.json go")
    parser.add_argument(
        "--model_size",
        default="pythia-1b",
        choices=("tiny", *speed.PYTHIA),
        help="tiny: the committed tiny task (also the gold win rate); else random models of that Pythia size at TLDR's lengths",
    )
    parser.add_argument("--seeds", default="1", help="comma-separated seeds: every run once per seed (default: 1)")
    parser.add_argument(
        "--trl_generation",
        default="auto",
        choices=("auto", "vllm", "hf"),
        help="how TRL generates: vllm (its colocate mode, a GPU), hf (transformers' generate); auto: vllm on a GPU, hf on a CPU",
    )
    parser.add_argument(
        "--trl_lr_schedules",
        default="trl",
        choices=("trl", "ours", "trl,ours"),
        help="TRL's runs on its own learning-rate schedule (trl), on ours, one step ahead (ours), or both",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float32"),
        help="the trainers' and engines' dtype (auto: bfloat16 on a GPU, float32 on a CPU, as our scripts' --dtype)",
    )
    parser.add_argument(
        "--cores",
        default=None,
        help="the CPU cores every run is pinned to, e.g. 0-1 (default: all this process may use)",
    )
    parser.add_argument(
        "--run_timeout_minutes", type=float, default=180.0, help="a run still going after this long is stopped, failed"
    )
    parser.add_argument(
        "--runs",
        default=None,
        help="comma-separated run names or patterns (trl_*_s2) to run (default: all; --dry_run lists them); "
        "the tables cover these",
    )
    parser.add_argument(
        "--dry_run", action="store_true", help="print the plan's commands and the differences table; run nothing"
    )
    for key in OVERRIDES:
        parser.add_argument(
            f"--{key}", type=int, default=None, help=f"override the work's {key} (every run gets the same)"
        )
    args = parser.parse_args(argv)
    try:
        seeds_of(args)
        if args.cores is not None:
            parse_cores(args.cores)
    except ValueError:
        parser.error(f"--seeds {args.seeds} / --cores {args.cores}: comma-separated integers (cores: also 0-3)")
    return args


def main(argv: list[str]) -> None:
    if argv[:1] == ["--run_script"]:  # one of our runs, started by the executor
        return run_script(argv[1], argv[2:])
    args = parse(argv)
    import torch

    setup = setup_for(args, torch.cuda.is_available(), sorted(os.sched_getaffinity(0)))
    plan = select(make_plan(args, setup), args.runs)
    print(setup.note)
    for run in plan:
        command = shlex.join([f"{k}={v}" for k, v in run.env.items()] + run.argv)
        print(f"[{run.name}] {run.measures}\n  on cores {core_list(setup.cores)}: {command}")
    differences = differences_table()
    print(f"\nSettings that differ from TRL's:\n{differences}")
    if args.dry_run:
        return
    out = Path(args.out_dir).resolve()
    if args.model_size != "tiny":
        print(f"building random {args.model_size} models ...", flush=True)
        speed.build_models(args.model_size, work_for(args)["max_prompt_length"], out / "models")
    results = [run_or_reuse(run, setup, args.run_timeout_minutes * 60) for run in plan]
    data = {
        "model_size": args.model_size,
        "work": work_for(args),
        "setup": setup._asdict(),
        "results": results,
        "configs": configs(results),
    }
    write_atomically(out / "vs_trl.json", json.dumps(data, indent=1) + "\n")
    write_atomically(out / "vs_trl.md", report(data))
    plot(data["configs"], str(out / "vs_trl.png"), title(data))
    written = [out / "vs_trl.md", out / "vs_trl.png", out / "vs_trl.json"]
    if any(r["curve"] for r in data["configs"]) and args.model_size == "tiny":
        plot_curves(data["configs"], str(out / "vs_trl_curves.png"), title(data))
        written.append(out / "vs_trl_curves.png")
    print(f"\n{summary_table(data['configs'], args.model_size == 'tiny')}\n\nwrote {', '.join(map(str, written))}")
    if any(r["error"] for r in results):
        raise SystemExit(f"{sum(r['error'] is not None for r in results)} run(s) failed: see {out / 'vs_trl.md'}")


if __name__ == "__main__":
    main(sys.argv[1:])
