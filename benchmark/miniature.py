"""The paper's comparisons in miniature, and how much staleness each objective tolerates: every algorithm
file on the tiny task, on a CPU, then the plots and the results tables (`plot_miniature.py`).

    python benchmark/miniature.py --out_dir runs/miniature --dry_run   # the plan and its estimated time
    python benchmark/miniature.py --out_dir runs/miniature             # run it (finished runs are skipped)
    python benchmark/miniature.py --out_dir runs/miniature_smoke --smoke   # every run at a trivial size
    python benchmark/miniature.py --study corrections --out_dir runs/corrections \
        --reuse benchmark/results/miniature/runs                            # the corrections sweep
    python benchmark/miniature.py --study lora --out_dir runs/lora \
        --reuse benchmark/results/miniature/runs                            # LoRA against full fine-tuning

The comparisons (paper sections 3-5):
  - off-policy sweep, figures 3-5: N = 1, 2, 4, 8, 16 mini-batches per generated batch
    (`--num_mini_batches N`, section 3.2) for online DPO, RLOO, PPO and Best-of-2, synchronous
    (`--async_level 0`), so that N alone sets how off-policy the updates are;
  - sync vs async, figure 1: each algorithm file at N = 1 with `--async_level 0` and 1 (the
    sweep's N = 1 run is the synchronous one);
  - K = 2 vs 4, figure 8: asynchronous online DPO with best/worst of 4 samples, the learning rate
    halved and half the steps (the same episodes: an episode is one of K completions);
  - staleness, which the paper does not vary: the async level k = 0, 1, 2, 4, 8 at N = 1 for online
    DPO, RLOO (Proximal RLOO), RLOO with PRIME-RL's objective (`--loss_type prime_rl`) and
    PPO (PRIME-RL's default k is 2, open-instruct's 8); k = 0 and 1 of the first three files are the
    runs above.
The corrections sweep (`--study corrections`, beyond the paper): PPO and GRPO at N = 1 and k = 8, 16, 4, 2, 0 (in
that order: where PPO diverged first), each with the trainer's pi_old and no correction, then with the engine's
logprobs (`--old_logprobs engine`) and each `--correction`; `--reuse` copies the runs it shares with the async level
sweep (same name, same flags) instead of running them again.
The LoRA study (`--study lora`): each file's async N = 1 run in full fine-tuning and with a rank-8 adapter on every
linear layer at ten times the learning rate (`--lora_rank 8`).
Figure 7's T (PPO epochs) sweep is not part of the miniature. Each run has 6144 episodes (the
files' default is 12800) and 2 seeds, evaluated on all 512 eval prompts at step 0 and 3 more times.
Every run lives in `<out_dir>/<name>/` (the script's `--output_dir`; its `args.json` holds the git
revision). When a run ends well the driver writes `<name>/miniature.json` (the run's flags and wall
time); a run that has it is skipped on the next invocation, so an interrupted reproduction continues
where it stopped. A folder without it (a run that was interrupted) is deleted and the run started
over, not resumed: runs take about a minute, and a resumed run's wall time would not be comparable.
"""

import argparse
import fnmatch
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot_miniature  # noqa: E402
from plot_miniature import write_atomically, write_json_atomically  # noqa: E402

# The tiny task's defaults in the algorithm files, spelled out so that no run relies on a default.
TASK = [
    "--task",
    "tiny",
    "--dataset_name",
    "tasks/tiny/data",
    "--dataset_config",
    "None",
    "--dataset_train_split",
    "train",
    "--dataset_eval_split",
    "test",
    "--sft_model_path",
    "tasks/tiny/sft",
    "--reward_model_path",
    "tasks/tiny/reward",
    "--gold_judge",
    "tiny",
    "--max_prompt_length",
    "12",
    "--response_length",
    "12",
    "--temperature",
    "0.7",
    "--vllm_dtype",
    "float32",
    "--gradient_accumulation_steps",
    "1",
    "--num_ppo_epochs",
    "1",
    "--local_rollout_forward_batch_size",
    "64",
    "--lr_schedule",
    "linear",
    "--adam_epsilon",
    "1e-08",
    "--weight_decay",
    "0.0",
    "--max_grad_norm",
    "1.0",
    "--vllm_gpu_memory_utilization",
    "0.9",
    "--save_freq",
    "0",
    "--no_trust_remote_code",
]
# The corrections of --old_logprobs engine (docs/algorithms.md#the-off-policy-corrections---correction) at the files'
# defaults: tis (the default) and the bounds of the others.
CORRECTION_BOUNDS = [
    "--correction",
    "tis",
    "--icepop_low",
    "0.5",
    "--icepop_high",
    "5.0",
    "--sequence_mask_low",
    "0.5",
    "--sequence_mask_high",
    "2.0",
    "--geo_mask_low",
    "0.99",
    "--geo_mask_high",
    "1.01",
    "--decoupled_cap",
    "5.0",
]
# method -> (algorithm file, completions per prompt, the algorithm's flags); kl / beta as in the files' defaults
METHODS = {
    "dpo": ("online_dpo_async.py", 2, ["--loss_type", "sigmoid", "--beta", "0.1", "--missing_eos_penalty", "-3.0"]),
    "bo2": (
        "online_dpo_async.py",
        2,
        ["--loss_type", "best_of_k_sft", "--beta", "0.1", "--missing_eos_penalty", "-3.0"],
    ),
    "rloo": (
        "rloo_async.py",
        2,
        [
            "--kl_coef",
            "0.05",
            "--cliprange",
            "0.2",
            "--no_normalize_advantage",
            "--old_logprobs",
            "trainer",
            "--tis_cap",
            "2.0",
            "--missing_eos_penalty",
            "-3.0",
            "--loss_type",
            "proximal_rloo",
            "--advantage",
            "leave_one_out",
            "--token_ratio_cap",
            "8.0",
            "--kl_term",
            "reward",
            *CORRECTION_BOUNDS,
        ],
    ),
    # PRIME-RL's objective: mu the engine's logprobs, no KL term; delta its code's default
    "prime_rl": (
        "rloo_async.py",
        2,
        [
            "--kl_coef",
            "0.0",
            "--cliprange",
            "0.2",
            "--no_normalize_advantage",
            "--old_logprobs",
            "engine",
            "--tis_cap",
            "2.0",
            "--missing_eos_penalty",
            "-3.0",
            "--loss_type",
            "prime_rl",
            "--advantage",
            "leave_one_out",
            "--token_ratio_cap",
            "8.0",
            "--kl_term",
            "reward",
            *CORRECTION_BOUNDS,
        ],
    ),
    # GRPO as published (DeepSeekMath section 4.1): group-normalised advantages, each completion's token mean then the
    # mean over completions, beta x k3 in the loss; pi_old the trainer's (--old_logprobs engine: the corrections sweep)
    "grpo": (
        "rloo_async.py",
        2,
        [
            "--kl_coef",
            "0.05",
            "--cliprange",
            "0.2",
            "--no_normalize_advantage",
            "--old_logprobs",
            "trainer",
            "--tis_cap",
            "2.0",
            "--missing_eos_penalty",
            "-3.0",
            "--loss_type",
            "grpo",
            "--advantage",
            "group_mean_std",
            "--token_ratio_cap",
            "8.0",
            "--kl_term",
            "k3_loss",
            "--loss_normalization",
            "sequence_mean",
            *CORRECTION_BOUNDS,
        ],
    ),
    "ppo": (
        "ppo_async.py",
        1,
        [
            "--kl_coef",
            "0.05",
            "--no_adaptive_kl",
            "--kl_target",
            "6.0",
            "--kl_horizon",
            "10000",
            "--gamma",
            "1.0",
            "--lam",
            "0.95",
            "--no_whiten_rewards",
            "--cliprange",
            "0.2",
            "--cliprange_value",
            "0.2",
            "--vf_coef",
            "0.1",
            "--old_logprobs",
            "trainer",
            "--tis_cap",
            "2.0",
            "--missing_eos_penalty",
            "-3.0",
            *CORRECTION_BOUNDS,
        ],
    ),
}
NS = (1, 2, 4, 8, 16)  # figure 4's mini-batches per generated batch
N_SWEEP_METHODS = ("dpo", "bo2", "rloo", "ppo")  # the paper's figure 4
ASYNC_LEVELS = (1, 2, 4, 8)  # k > 0 at N = 1; k = 0 is the N sweep's (or PRIME-RL's objective's own) N = 1 run
ASYNC_METHODS = ("dpo", "rloo", "prime_rl", "ppo")  # Best-of-2 shares online DPO's file
SAMPLES_FLAG = {"online_dpo_async.py": "--num_samples", "rloo_async.py": "--rloo_k"}  # PPO: one completion per prompt
# Flags a file gained after the committed runs were recorded, generation by generation (oldest first), each flag
# with the value that runs what those runs ran: a record without the newest generations, where the run gives those
# values, is the same run. RLOO's loss was Proximal RLOO with the leave-one-out advantage before --loss_type
# (--token_ratio_cap is PRIME-RL's alone); then came --kl_term and the corrections of --old_logprobs engine.
CORRECTION_DEFAULTS = dict(zip(CORRECTION_BOUNDS[::2], CORRECTION_BOUNDS[1::2]))
ADDED_FLAGS = {
    "rloo_async.py": [
        {"--loss_type": "proximal_rloo", "--advantage": "leave_one_out", "--token_ratio_cap": "8.0"},
        {"--kl_term": "reward", **CORRECTION_DEFAULTS},
    ],
    "ppo_async.py": [CORRECTION_DEFAULTS],
}
# The tiny task's folder before it moved to tasks/tiny: a run recorded there used the same files.
MOVED_TINY_TASK = "benchmark/tiny_task/"

# Estimated seconds per run on 2 quiet CPU cores. Measured on real runs of each file (tiny task,
# --total_episodes 4096, sync, N = 1 and 16, 5 evaluations of 512 prompts) while other work shared
# the machine; each wall time was divided by L / 2 (L: the load average at the run's end, i.e. L
# runnable threads sharing 2 cores). Training time per episode is A + B / N: B is what each generated
# batch costs (generation, hand-offs), paid 1/N as often with N mini-batches per batch (K = 4 makes a
# step's batch twice as large, like N = 2). START_S: process, models and engine start; EVAL_S: one
# evaluation. The measured and scaled numbers (run: wall s at load L -> scaled; training part):
#   online DPO N=1 91 s at 3.2 -> 58 s (31 s);  N=16 64 s at 2.7 -> 48 s (15 s);  async N=1 -> 40 s
#   RLOO       N=1 221 s at 7.5 -> 59 s (31 s); N=16 174 s at 8 -> 44 s (18 s)
#   PPO        N=1 241 s at 6.7 -> 72 s (44 s); N=16 178 s at 8.4 -> 42 s (24 s)
# They are rough (the load moved during runs) and err long: at the plan's 6144 episodes the N = 1 sync
# runs took 43 s (online DPO) and 63 s (PPO) of CPU time, engine included, against estimates of 74 and
# 93 s. The printed total also says what 1.5x that would be, for a machine shared with other work.
START_S = 22.0
EVAL_S = 1.2
TRAIN_A_S = {"online_dpo_async.py": 0.0035, "rloo_async.py": 0.0036, "ppo_async.py": 0.0057}
TRAIN_B_S = {"online_dpo_async.py": 0.0042, "rloo_async.py": 0.0042, "ppo_async.py": 0.0050}


@dataclass
class Run:
    name: str
    method: str
    script: str
    seed: int
    num_mini_batches: int
    num_samples: int
    async_level: int
    learning_rate: float
    total_episodes: int
    num_steps: int
    eval_freq: int
    flags: list[str]
    # the correction sweep's: --old_logprobs engine with this --correction; None: --old_logprobs trainer, no correction
    correction: str | None = None
    lora_rank: int = 0  # the LoRA study's: an adapter of this rank trains (LORA); 0: the whole policy

    def argv(self, out_dir: Path) -> list[str]:
        return [sys.executable, self.script, *self.flags, "--output_dir", str(out_dir / self.name)]


def make_run(
    method: str,
    n: int,
    async_level: int,
    seed: int,
    episodes: int,
    learning_rate: float,
    micro_batch: int,
    num_evals: int,
    eval_prompts: int,
    num_samples: int | None = None,
    correction: str | None = None,
    lora_rank: int = 0,
) -> Run:
    """One run with every defining flag spelled out. Batch sizes count prompts: a step generates
    micro_batch x N prompts x K completions and trains N mini-batches of micro_batch prompts, so at equal
    episodes every N makes the same number of optimizer updates (and the same linear lr decay). A `correction`
    reads the engine's logprobs (--old_logprobs engine) and corrects with it (--correction); a `lora_rank` trains an
    adapter of that rank alone (LORA's settings spelled out)."""
    script, default_samples, algorithm = METHODS[method]
    k = num_samples or default_samples
    mode = "sync" if async_level == 0 else "async" if async_level == 1 else f"async{async_level}"
    name = f"{method}_n{n}_{mode}" + (f"_k{k}" if k != default_samples else "")
    name += (f"_{correction}" if correction else "") + (f"_lora{lora_rank}" if lora_rank else "") + f"_s{seed}"
    if correction:
        algorithm = list(algorithm)
        algorithm[algorithm.index("--old_logprobs") + 1] = "engine"
        algorithm[algorithm.index("--correction") + 1] = correction
    per_step = micro_batch * n * k
    if episodes % per_step:
        raise SystemExit(
            f"error: --episodes {episodes} is not a multiple of {per_step}, the episodes per step of run {name}"
        )
    num_steps = episodes // per_step
    if num_steps % num_evals:
        raise SystemExit(
            f"error: --num_evals {num_evals} does not divide the {num_steps} steps of run {name}; change --num_evals or --episodes"
        )
    flags = [
        *TASK,
        *algorithm,
        "--exp_name",
        name,
        "--seed",
        str(seed),
        "--total_episodes",
        str(episodes),
        "--local_micro_batch_size",
        str(micro_batch),
        "--num_mini_batches",
        str(n),
        "--learning_rate",
        repr(learning_rate),
        "--async_level",
        str(async_level),
        "--eval_freq",
        str(num_steps // num_evals),
        "--num_eval_prompts",
        str(eval_prompts),
    ]
    if script in SAMPLES_FLAG:
        flags += [SAMPLES_FLAG[script], str(k)]
    if lora_rank:
        flags += ["--lora_rank", str(lora_rank), *LORA]
    return Run(
        name,
        method,
        script,
        seed,
        n,
        k,
        async_level,
        learning_rate,
        episodes,
        num_steps,
        num_steps // num_evals,
        flags,
        correction,
        lora_rank,
    )


def make_plan(
    seeds: list[int], episodes: int, learning_rate: float, micro_batch: int, num_evals: int, eval_prompts: int
) -> list[Run]:
    """Seed by seed (an interrupted reproduction has whole seeds): per method the N sweep (sync; PRIME-RL's
    objective N = 1 only), the async N = 1 runs at k = 1, 2, 4, 8, and for online DPO the K = 4 run of figure 8.
    GRPO runs in the corrections sweep only (make_correction_plan)."""
    per_step = math.lcm(*(micro_batch * n * k for _, k, _ in METHODS.values() for n in NS), micro_batch * 4)
    if episodes % per_step:
        raise SystemExit(
            f"error: --episodes {episodes} must be a multiple of {per_step}, so that every run has whole steps"
        )
    common = dict(episodes=episodes, micro_batch=micro_batch, num_evals=num_evals, eval_prompts=eval_prompts)
    plan = []
    for seed in seeds:
        for method in (method for method in METHODS if method in N_SWEEP_METHODS + ASYNC_METHODS):
            ns = NS if method in N_SWEEP_METHODS else (1,)
            plan += [make_run(method, n, 0, seed, learning_rate=learning_rate, **common) for n in ns]
            if method in ASYNC_METHODS:
                plan += [make_run(method, 1, k, seed, learning_rate=learning_rate, **common) for k in ASYNC_LEVELS]
        # figure 8: K = 4, lr / 2, half the steps (same episodes, twice the completions per prompt), async
        plan.append(make_run("dpo", 1, 1, seed, learning_rate=learning_rate / 2, num_samples=4, **common))
    return plan


# The corrections sweep (docs/reproducing.md#the-corrections-sweep): which correction keeps which objective learning as
# staleness grows. PPO (whose k = 8 diverged in the async level sweep) and GRPO, each with the trainer's pi_old and no
# correction (None), then with the engine's logprobs and each correction; the most informative levels first (where
# PPO diverged), so that a sweep stopped early has them.
CORRECTION_METHODS = ("ppo", "grpo")
CORRECTIONS = (None, "tis", "sequence_tis", "sequence_mask", "icepop", "geo_mask", "decoupled")
CORRECTION_LEVELS = (8, 16, 4, 2, 0)


def make_correction_plan(
    seeds: list[int], episodes: int, learning_rate: float, micro_batch: int, num_evals: int, eval_prompts: int
) -> list[Run]:
    """The corrections sweep at N = 1, in the order it runs: level by level (CORRECTION_LEVELS), each level seed by
    seed, each seed PPO's runs then GRPO's, each without a correction and with each. A run without a correction is the
    async level sweep's where it has one (PPO's at k = 0, 2, 4, 8: the same name and flags)."""
    common = dict(episodes=episodes, micro_batch=micro_batch, num_evals=num_evals, eval_prompts=eval_prompts)
    return [
        make_run(method, 1, k, seed, learning_rate=learning_rate, correction=correction, **common)
        for k in CORRECTION_LEVELS
        for seed in seeds
        for method in CORRECTION_METHODS
        for correction in CORRECTIONS
    ]


# The LoRA study (docs/reproducing.md#lora-against-full-fine-tuning): each file's async N = 1 run, the whole policy
# trained at the sweep's learning rate beside a rank-8 adapter on every linear layer at ten times it (the usual
# starting point: docs/algorithms.md#lora---lora_rank), PEFT's defaults but alpha 16 and no dropout.
LORA_METHODS = ("dpo", "rloo", "ppo")
LORA_RANK = 8
LORA = ["--lora_alpha", "16.0", "--lora_dropout", "0.0", "--lora_target_modules", "all-linear", "--no_lora_save_merged"]


def make_lora_plan(
    seeds: list[int], episodes: int, learning_rate: float, micro_batch: int, num_evals: int, eval_prompts: int
) -> list[Run]:
    """Seed by seed, each method's async N = 1 run in full fine-tuning (the async level sweep's: --reuse copies it),
    then with LoRA at ten times the learning rate."""
    common = dict(episodes=episodes, micro_batch=micro_batch, num_evals=num_evals, eval_prompts=eval_prompts)
    return [
        make_run(method, 1, 1, seed, learning_rate=lr, lora_rank=rank, **common)
        for seed in seeds
        for method in LORA_METHODS
        for lr, rank in ((learning_rate, 0), (10 * learning_rate, LORA_RANK))
    ]


def estimate_s(run: Run, num_evals: int) -> float:
    """Wall time of a run on 2 quiet cores, from the constants above (async runs as if sync: no overlap counted)."""
    batches = run.num_mini_batches * run.num_samples / METHODS[run.method][1]
    train_s = run.total_episodes * (TRAIN_A_S[run.script] + TRAIN_B_S[run.script] / batches)
    return START_S + train_s + (num_evals + 1) * EVAL_S


# ---------------------------------------------------------------------------------------------
def same_flags(recorded: list[str], run: Run) -> bool:
    """The recorded run's flags are the run's, or the run's less its file's newest ADDED_FLAGS generations, where the
    run gives each of their flags the value that runs what the older record ran; a path under MOVED_TINY_TASK reads as
    the same path under tasks/tiny/."""
    recorded = [
        flag.replace(MOVED_TINY_TASK, "tasks/tiny/", 1) if flag.startswith(MOVED_TINY_TASK) else flag
        for flag in recorded
    ]
    older = list(run.flags)
    for generation in reversed(ADDED_FLAGS.get(run.script, [])):
        if recorded == older:
            return True
        for flag, value in generation.items():
            at = older.index(flag)
            if older[at + 1] != value:
                return False  # the run sets a value its file's older versions could not
            del older[at : at + 2]
    return recorded == older


def is_finished(run: Run, out_dir: Path) -> bool:
    """A run with the driver's marker is done; one made with other flags is an error, not a skip."""
    marker = out_dir / run.name / "miniature.json"
    if not marker.exists():
        return False
    recorded = json.loads(marker.read_text())
    if not same_flags(recorded["flags"], run):
        raise SystemExit(
            f"error: --out_dir {out_dir} holds run {run.name} made with other flags (see {marker}); choose another --out_dir"
        )
    return True


def reuse(run: Run, reuse_dir: Path, out_dir: Path) -> bool:
    """A run finished in `reuse_dir` with the run's flags (same_flags) is copied into out_dir (its record and metrics,
    what the tables read) and not run again; one finished there with other flags is left alone."""
    marker = reuse_dir / run.name / "miniature.json"
    if not marker.exists() or not same_flags(json.loads(marker.read_text())["flags"], run):
        return False
    folder = out_dir / run.name
    if folder.exists():
        shutil.rmtree(folder)  # an unfinished run of the same name
    folder.mkdir(parents=True)
    write_atomically(folder / "metrics.jsonl", (reuse_dir / run.name / "metrics.jsonl").read_bytes())
    write_atomically(folder / "miniature.json", marker.read_bytes())
    return True


def execute(run: Run, out_dir: Path, env: dict) -> float:
    """Run the algorithm file from the repository root (an unfinished folder is started over); returns its wall time."""
    folder = out_dir / run.name
    if folder.exists():
        print(f"[{run.name}] starting over an unfinished run", flush=True)
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    argv = run.argv(out_dir)
    print(f"[{run.name}] {shlex.join(argv)}", flush=True)
    start = time.perf_counter()
    with open(folder / "run.log", "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:  # the run got the same Ctrl-C: let it shut its engine down before we exit
            proc.wait()
            raise
    wall_s = time.perf_counter() - start
    if code:
        raise RuntimeError(f"[{run.name}] {run.script} exited with {code}; see {folder / 'run.log'}")
    revision = json.loads((folder / "args.json").read_text())["git_revision"]
    write_json_atomically(
        folder / "miniature.json", {**asdict(run), "argv": argv, "wall_s": wall_s, "git_revision": revision}
    )
    return wall_s


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out_dir", default="runs/miniature", help="one folder per run goes here, and the plots under <out_dir>/plots"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds of every run (default 1 2)")
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="episodes (prompt-completion pairs) of every run (default 6144; the files' own default is 12800)",
    )
    parser.add_argument(
        "--learning_rate", type=float, default=1e-4, help="initial learning rate (the K = 4 run gets half)"
    )
    parser.add_argument(
        "--num_evals", type=int, default=None, help="evaluations per run after step 0, evenly spaced (default 3)"
    )
    parser.add_argument(
        "--study",
        choices=("paper", "corrections", "lora"),
        default="paper",
        help="paper: the paper's comparisons and the async level sweep; corrections: the corrections sweep, PPO and "
        "GRPO at k = 8, 16, 4, 2, 0 without and with each --correction (docs/reproducing.md#the-corrections-sweep); "
        "lora: each file's async N = 1 run in full fine-tuning and with a rank-8 LoRA adapter at 10x the learning rate",
    )
    parser.add_argument(
        "--reuse",
        default=None,
        help="a folder of finished runs (e.g. benchmark/results/miniature/runs): a planned run finished there with the "
        "same flags is copied into --out_dir instead of run again",
    )
    parser.add_argument(
        "--only",
        default=None,
        help="run only the runs whose name matches one of these comma-separated patterns, e.g. 'dpo_*_s1,ppo_n1_*'",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="every run at a trivial size (1 prompt per mini-batch, 32 episodes, 16 eval prompts): checks the plumbing, not the results",
    )
    parser.add_argument(
        "--dry_run", action="store_true", help="print the plan, every run's command and the estimated time, run nothing"
    )
    args = parser.parse_args(argv)
    # the reproduction's sizes; the smoke test's trivial ones (N = 16 is then one step of 16 prompts)
    size = (
        dict(seeds=[1], episodes=32, micro_batch=1, num_evals=1, eval_prompts=16)
        if args.smoke
        else dict(seeds=[1, 2], episodes=6144, micro_batch=32, num_evals=3, eval_prompts=512)
    )
    args.seeds = args.seeds or size["seeds"]
    args.episodes = args.episodes or size["episodes"]
    args.num_evals = args.num_evals or size["num_evals"]
    args.micro_batch, args.eval_prompts = size["micro_batch"], size["eval_prompts"]
    for flag in ("episodes", "num_evals"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    out_dir = Path(args.out_dir).resolve()
    planner = {"paper": make_plan, "corrections": make_correction_plan, "lora": make_lora_plan}[args.study]
    plan = planner(args.seeds, args.episodes, args.learning_rate, args.micro_batch, args.num_evals, args.eval_prompts)
    if args.only:
        patterns = args.only.split(",")
        plan = [run for run in plan if any(fnmatch.fnmatch(run.name, p) for p in patterns)]
        if not plan:
            raise SystemExit(f"error: --only {args.only} matches no run")
    if args.reuse:
        reused = [run.name for run in plan if not is_finished(run, out_dir) and reuse(run, Path(args.reuse), out_dir)]
        print(f"reused {len(reused)} finished run(s) of {args.reuse}: {', '.join(reused) or 'none'}")
    done = [run for run in plan if is_finished(run, out_dir)]
    todo = [run for run in plan if run not in done]
    print(
        f"{'run':<34} {'file':<20} {'N':>3} {'K':>2} {'async':>5} {'lr':>8} {'episodes':>8} {'steps':>5} {'est. s':>7}"
    )
    for run in plan:
        state = "done" if run in done else f"{estimate_s(run, args.num_evals):7.0f}"
        print(
            f"{run.name:<34} {run.script:<20} {run.num_mini_batches:>3} {run.num_samples:>2} {run.async_level:>5} "
            f"{run.learning_rate:>8.2g} {run.total_episodes:>8} {run.num_steps:>5} {state:>7}"
        )
    total = sum(estimate_s(run, args.num_evals) for run in todo)
    print(
        f"{len(plan)} runs, {len(done)} done; estimated time of the {len(todo)} left: {total / 60:.0f} min on 2 quiet CPU cores "
        f"(up to {1.5 * total / 60:.0f} min if other work shares them)"
    )
    if args.dry_run:
        for run in todo:
            print(shlex.join(run.argv(out_dir)))
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM reserves far more by default
    failed, start = [], time.perf_counter()
    for i, run in enumerate(todo):
        try:
            wall_s = execute(run, out_dir, env)
            print(
                f"[{run.name}] done in {wall_s:.0f} s (estimated {estimate_s(run, args.num_evals):.0f} s); "
                f"{i + 1}/{len(todo)} after {(time.perf_counter() - start) / 60:.1f} min",
                flush=True,
            )
        except RuntimeError as exc:  # go on with the others: one failure should not cost the whole reproduction
            print(exc, flush=True)
            failed.append(run.name)
        except KeyboardInterrupt:
            print(
                f"interrupted during {run.name}: run the same command again to continue (finished runs are skipped, this one starts over)"
            )
            return 130
    try:
        plot_miniature.main([str(out_dir), "--out", str(out_dir / "plots")])
    except SystemExit as exc:  # e.g. no run finished: the failures below say why
        print(exc)
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
