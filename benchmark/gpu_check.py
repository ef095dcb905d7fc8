"""The GPU check in parts, each of which fits one short loan of a GPU machine: about 9 minutes of commands, two files
back. A part runs its stages (side by side where that is safe, below), each within its time limit, and always
ends the same way, even when a limit, the part's deadline or a signal cuts it: OUT_DIR then holds summary.md (each
stage's result, exit code, seconds and key numbers) and results.tgz (every log, metrics.jsonl, args.json, speed.md,
timeline PNG and evaluation sample; no weights, no models), nothing else. The ledger, benchmark/results/gpu/ledger.md,
says which parts have passed at which code; `--next` names the part the next loan runs. docs/gpus.md.

    bash benchmark/gpu_check.sh --next                                # the part the next loan runs, and its command
    bash benchmark/gpu_check.sh --part 1 OUT_DIR                      # part 1, at most 540 s; OUT_DIR new or empty
    bash benchmark/gpu_check.sh --part 1 --dry_run OUT_DIR            # its stages, limits, estimates and commands
    bash benchmark/gpu_check.sh --record OUT_DIR --device_minutes 14  # its results under benchmark/results/gpu/, a ledger line

Each stage has a limit, in seconds from the start of its step: SIGTERM GRACE seconds before it, SIGKILL at it, to the
stage's whole process group (its engines too). The limits of a part's steps add up to at most --seconds less the
PACK_SECONDS kept for packing, and no stage runs past that deadline. Beside each limit is its estimate, LOW-HIGH
seconds from the start of its step, from the measurements of 2026-11-23 on an H100 (vLLM 0.26.0; an engine start, a
tiny step of 0.15-0.16 s, a Pythia-1b TLDR step of 10.5-12.8 s before the CUDA IPC push, 60 % of it moving weights
through the CPU and files) and the code's own numbers (steps, evaluations, engine starts, and benchmark/plan.py's
1.5-1.9 s for that step). HIGH is the stage's cold estimate (cold_seconds), on the fresh machine every loan starts:
vLLM compiles each model its engines run with CUDA graphs at its first start in the loan and captures the graphs at
every start; no stage's may exceed its limit (tests/test_gpu_check.py). The seconds a stage took are in the ledger:
where they say otherwise, move the stages.

Side by side: vLLM sizes its KV cache from the free memory of the whole GPU, measured while its engine starts, so a
neighbour that frees memory then stops that start ("Error in memory profiling") and one that allocates shrinks its
cache. So a stage runs beside another only where it uses no GPU (building models), or where its engines have a KV
cache of a fixed size (tests/test_gpu.py's) and it starts once the other's engine is up (`after`: that stage has
logged a training step). Speed measurements run alone.

What $PYTHON (default python3) must import for the stages: requirements.txt's stack with vLLM, pytest, DeepSpeed
(part 3) and TRL (the vs_trl parts); the engines sample without FlashInfer where flashinfer is not installed
(plumbing.engine.sampler_settings), so nothing need be exported for it. This file itself needs Python's standard
library only.
"""

import argparse
import hashlib
import importlib.metadata
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import timing  # noqa: E402

SECONDS = 540  # what a short loan leaves a part after the machine's start, the staging and the hand-back
PACK_SECONDS = 30  # kept at the end for summary.md and results.tgz
GRACE = 10  # SIGTERM this long before a stage's limit (a run finishes its step and writes a checkpoint), SIGKILL at it
SIGNAL_GRACE = 5  # when the part itself gets a signal: whoever sent it may not wait long for the summary
MIN_STAGE = 20  # a stage that would get less (or less than half its limit) is not started
AFTER_WAIT = 90  # the longest a stage waits for the one it starts after to log a training step
WEIGHTS_BYTES = 64 * 2**20  # a stage's files over this are weights: deleted once the stage ends, never packed
LEDGER = ROOT / "benchmark" / "results" / "gpu" / "ledger.md"
PACKED_SUFFIXES = {".log", ".jsonl", ".json", ".md", ".png", ".txt", ".csv"}
UNPACKED_FOLDERS = {"models", "checkpoints", "policy", "tensorboard", "wandb", "__pycache__"}  # weights, duplicates
PACKED_FILE_BYTES = 4 * 2**20  # a longer text file keeps its head and tail (results.tgz stays under 16 MiB)
RECORDED_FILE_BYTES = 2**19  # the same when recorded: every tracked MiB travels to the GPU machine with each call
FAKE_PARTS = "GPU_CHECK_FAKE_PARTS"  # tests only: a JSON file of fake parts in place of PARTS
# dense bf16 FLOP/s and memory bandwidth (NVIDIA's datasheets, SXM): speed.py's MFU and plan.py's roofline
DEVICES = {"H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12)}


# ---------------------------------------------------------------------------------------------------------------------
# Parts: stages, their limits and estimates
# ---------------------------------------------------------------------------------------------------------------------
class Later(NamedTuple):
    """A command made as its stage starts, from what earlier stages wrote."""

    description: str  # what --dry_run prints
    make: Callable[[], list[str]]  # raises StageNotStarted where what it reads is not there


class StageNotStarted(Exception):
    pass


class Stage(NamedTuple):
    name: str  # its log: <name>.log; its output folder, if any: <name>/
    limit: int  # seconds from the start of its step
    estimate: str  # seconds expected, and from what
    argv: list[str] | Later
    kind: str  # which key numbers: KEY_NUMBERS
    after: str | None = None  # start once this stage of the same step has logged a training step (its engine is up)
    env: dict[str, str] = {}
    models: bool = False  # its <name>/models is the part's models/, built once (speed.py --models_only)
    skips: bool = False  # pytest: a skipped test still passes (a condition the machine does not meet)


class Part(NamedTuple):
    title: str
    steps: Callable[["Context"], list[list[Stage]]]  # each step's stages run side by side
    depends: tuple[str, ...]  # the files its results depend on: a path, "folder/*.suffix" or "folder/"


class Context(NamedTuple):
    python: str
    work: Path  # where the stages write

    def out(self, *names: str) -> str:
        return str(self.work.joinpath(*names))


TEST_GPU = "tests/test_gpu.py"
PUSH = f"{TEST_GPU}::test_each_ipc_push_loads_exactly_what_a_checkpoint_would"
SNAPSHOTS = f"{TEST_GPU}::test_snapshots_freed_over_six_pushes_leave_gpu_memory_as_after_the_second"
RESUME = f"{TEST_GPU}::test_a_run_stopped_by_sigterm_resumes_to_the_end_of_the_run_never_stopped"
ZERO = f"{TEST_GPU}::test_zero_runs_under_accelerate_launch_with_the_kl_exactly_0_at_step_0"
SEPARATE = f"{TEST_GPU}::test_the_engine_on_a_gpu_of_its_own_runs_there_and_the_run_learns"
# the TLDR step of 2026-11-23: 64 prompts x 2 samples (PPO: 128 x 1) of 512 + 53 tokens, 8 steps, bf16
PYTHIA_BATCH = ["--total_episodes", "1024", "--local_micro_batch_size", "16"]
# vs_trl at Pythia-1b: 5 steps a run (the timing leaves out two warm-up steps and the last), which three runs with
# two first compiles fit in one loan (vs_trl_part's estimate)
VS_TRL_EPISODES = 640
TWO = ["--vllm_num_engines", "2"]  # two engines sharing the GPU, as a one-GPU machine runs them
# A Pythia-1b TLDR step with the CUDA IPC push: at most 8.0 s, 2026-11-23's 12.8 s (sync) less its push through files
# (2.5 s) and its snapshot through the CPU (2.6 s), which the push through GPU memory replaced (0.1-0.15 s measured that
# day, ../shared/gpu/README.md); at least plan.py's 1.5-1.9 s. PPO's steps, with a value model, at most 9 s.
SPEED_ESTIMATE = (
    "80-235 s: random Pythia-1b, engines eager; each run (sync, then async) starts and loads three 1B models (10-20 "
    "s), starts its engine (15-25 s), evaluates 64 prompts at step 0 and at the end (2-5 s) and runs 8 steps of "
    "1.5-8.0 s (plan.py's prediction to 2026-11-23's step less the push the CUDA IPC push replaced); speed.py's tables "
    "and timeline 2-5 s"
)
PLAN_ESTIMATE = "5-15 s: plan.py loads no model; importing torch and transformers is most of it"
MODELS_ESTIMATE = "20-50 s: two random Pythia-1b models (1.0 B parameters each, fp32, 8 GB) built and saved; no GPU"
# Pythia-1b's speed runs with eager engines: on a fresh machine its first engine start compiles Pythia-1b and
# captures CUDA graphs (50-90 s, then 20-35 s a start), which two runs of 8 steps at these shapes cannot fit beside in
# one loan, and generation is 0.3 s of a 12.8 s step (2026-11-23): CUDA graphs would move the step by a few percent.
# The first compile is timed by part 1's push stage (GPTNeoX with CUDA graphs); the ledger says so.
SPEED_EAGER = ["--vllm_enforce_eager"]


def probe(c: Context) -> list[Stage]:
    """What every part starts with: the GPUs and the installed packages' versions."""
    gpus = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"]
    return [
        Stage("gpus", 10, "1-2 s: nvidia-smi", gpus, "gpus"),
        Stage(
            "packages",
            10,
            "1-3 s: the installed distributions",
            [c.python, "benchmark/gpu_check.py", "--versions"],
            "packages",
        ),
    ]


def pytest(c: Context, *tests: str) -> list[str]:
    # -s: the output is in the log as it comes, so a stage cut at its limit keeps what its tests printed
    return [c.python, "-m", "pytest", "-v", "-s", "--durations", "0", "-p", "no:cacheprovider", *tests]


def default_run(c: Context, name: str, script: str) -> list[str]:
    """The README's first command, the tiny task, with its engine eager: compile time is not what it measures."""
    return [c.python, script, "--vllm_enforce_eager", "--output_dir", c.out(name)]


def models(c: Context, beside_a_compile: bool = False) -> Stage:
    """The random Pythia-1b models of the part's speed or vs_trl stage, built on the CPU while the GPU does other work
    (on 4 threads where a compile, which a stage times, needs the other cores)."""
    argv = [c.python, "benchmark/speed.py", "--model_size", "pythia-1b", "--out_dir", c.out(), "--models_only"]
    env = {"OMP_NUM_THREADS": "4"} if beside_a_compile else {}
    return Stage("models", 60, MODELS_ESTIMATE, argv, "models", env=env)


def speed(c: Context, name: str, script: str, *flags: str) -> list[str]:
    """benchmark/speed.py, sync then async, at TLDR's shapes on random Pythia-1b models, its engine with CUDA graphs."""
    launch = f"{c.python} -m accelerate.commands.launch --config_file configs/multi_gpu.yaml --num_processes 1"
    return [
        c.python,
        "benchmark/speed.py",
        "--script",
        script,
        "--out_dir",
        c.out(name),
        "--model_size",
        "pythia-1b",
        "--launch",
        launch,
        "--peak_tflops",
        "989",  # an H100's and an H200's dense bf16 (SXM)
        "--",
        *PYTHIA_BATCH,
        *SPEED_EAGER,
        *flags,
    ]


def plan(c: Context, speed_stage: str) -> Later:
    """benchmark/plan.py's prediction for the command speed.py ran asynchronously (its log's `[async]` line), for this
    machine's GPUs (the gpus stage's log)."""

    def argv() -> list[str]:
        log = c.work / f"{speed_stage}.log"
        lines = log.read_text().splitlines() if log.exists() else []
        command = next((line.removeprefix("[async] ") for line in lines if line.startswith("[async] ")), None)
        if command is None:
            raise StageNotStarted(f"{speed_stage}.log has no [async] command: its async run did not start")
        gpus = read_gpus(c.work / "gpus.log")
        _, bandwidth = DEVICES.get(device_name(gpus), DEVICES["H100"])
        gib = min(gpu["mib"] for gpu in gpus) / 1024 if gpus else 79.0
        hardware = ["--gpus", str(max(len(gpus), 1)), "--gpu_gib", f"{gib:.1f}", "--bandwidth", f"{bandwidth:g}"]
        return [c.python, "benchmark/plan.py", *hardware, "--", *shlex.split(command)]

    description = (
        f"{c.python} benchmark/plan.py --gpus <the GPUs> --gpu_gib <their memory> --bandwidth <theirs> -- "
        f"<{speed_stage}'s async command, from {speed_stage}.log>"
    )
    return Later(description, argv)


def vs_trl(c: Context, name: str, size: str, episodes: int, runs: list[str] | None) -> list[str]:
    argv = [c.python, "benchmark/vs_trl.py", "--model_size", size, "--out_dir", c.out(name)]
    return argv + ["--total_episodes", str(episodes)] + (["--runs", ",".join(runs)] if runs else [])


def part_1(c: Context) -> list[list[Stage]]:
    push = (
        "125-220 s: started 25-40 s into the step; pytest 10 s; GPTNeoX of Pythia-160m's shape: 4 models built 10 s, "
        "an engine with vLLM's first compile and CUDA graph capture 40-90 s, 3 pushes each probed and checked against a "
        "reload from a file 15-30 s; tiny Llama, eager: an engine 15-25 s, 3 pushes 5-10 s"
    )
    return [
        probe(c),
        [
            Stage(
                "default_dpo",
                150,
                "50-100 s: imports 10 s, an eager engine 15-25 s, 200 steps of 0.10-0.16 s (0.157 s on 2026-11-23), "
                "9 evaluations of 512 prompts",
                default_run(c, "default_dpo", "online_dpo_async.py"),
                "run",
            ),
            Stage(
                "push",
                220,
                push,
                pytest(c, f"{PUSH}[gptneox-cuda_graphs]", f"{PUSH}[llama-eager]"),
                "pytest",
                after="default_dpo",
            ),
            models(c, beside_a_compile=True),
        ],
        [
            Stage(
                "speed_dpo",
                250,
                SPEED_ESTIMATE,
                speed(
                    c, "speed_dpo", "online_dpo_async.py", "--gradient_accumulation_steps", "4", "--num_samples", "2"
                ),
                "speed",
                models=True,
            )
        ],
        [Stage("plan_dpo", 30, PLAN_ESTIMATE, plan(c, "speed_dpo"), "plan")],
    ]


def part_2(c: Context) -> list[list[Stage]]:
    resume = (
        "130-180 s: pytest 10 s; three runs (the reference, the one stopped at step 12, its resume) of 64 steps of 8 "
        "prompts x 2, each imports 10 s, an eager engine 15-25 s, steps of 0.1 s, 8 evaluations, a checkpoint every 5 "
        "steps"
    )
    return [
        probe(c),
        [
            Stage(
                "default_rloo",
                130,
                "50-100 s: as default_dpo (0.166 s a step on 2026-11-23)",
                default_run(c, "default_rloo", "rloo_async.py"),
                "run",
            ),
            Stage(
                "push_tied",
                130,
                "60-95 s: started 25-40 s in; pytest 10 s, tiny tied Llamas, an eager engine 15-25 s, 3 pushes 5-10 s",
                pytest(c, f"{PUSH}[llama_tied-eager]"),
                "pytest",
                after="default_rloo",
            ),
        ],
        [
            Stage(
                "default_ppo",
                170,
                "55-110 s: as default_dpo, with a value model (0.148 s a step on 2026-11-23)",
                default_run(c, "default_ppo", "ppo_async.py"),
                "run",
            ),
            Stage(
                "snapshots",
                170,
                "100-170 s: started 25-40 s in; pytest 10 s, 7 models of Pythia-160m's shape 15-20 s, an engine that "
                "compiles 40-90 s, 6 pushes 10 s",
                pytest(c, SNAPSHOTS),
                "pytest",
                after="default_ppo",
            ),
        ],
        [Stage("resume", 200, resume, pytest(c, RESUME), "pytest")],
    ]


def part_3(c: Context) -> list[list[Stage]]:
    zero = (
        "140-220 s: pytest 10 s; ZeRO-2 then ZeRO-3, each: accelerate launch and DeepSpeed's start 15-25 s (its first "
        "use may build an op: up to a minute), an eager engine 15-25 s, 10 steps of 64 prompts x 2, a checkpoint, the "
        "final policy gathered"
    )
    return [
        probe(c),
        [Stage("zero", 230, zero, pytest(c, f"{ZERO}[2]", f"{ZERO}[3]"), "pytest"), models(c)],
        [
            Stage(
                "speed_rloo",
                240,
                SPEED_ESTIMATE,
                speed(c, "speed_rloo", "rloo_async.py", "--gradient_accumulation_steps", "4", "--rloo_k", "2"),
                "speed",
                models=True,
            )
        ],
        [Stage("plan_rloo", 30, PLAN_ESTIMATE, plan(c, "speed_rloo"), "plan")],
    ]


def part_4(c: Context) -> list[list[Stage]]:
    """Two engines sharing the one GPU (--vllm_num_engines 2) beside the plan, which uses no GPU: the functional
    check of several engines (docs/gpus.md#several-engines---vllm_num_engines)."""
    two = (
        "60-115 s: as default_dpo (0.166 s a step on 2026-11-23), with two eager engines started one after the other "
        "(15-25 s each), each generating half of every batch"
    )
    return [
        [*probe(c), models(c)],
        [
            Stage(
                "speed_ppo",
                300,
                "85-260 s: as speed_dpo, a fourth model loaded (a value model, which PPO also trains) and steps of at "
                f"most 9 s; speed_dpo's: {SPEED_ESTIMATE}",
                speed(c, "speed_ppo", "ppo_async.py", "--gradient_accumulation_steps", "8"),
                "speed",
                models=True,
            )
        ],
        [
            Stage("plan_ppo", 30, PLAN_ESTIMATE, plan(c, "speed_ppo"), "plan"),
            Stage("two_engines", 120, two, [*default_run(c, "two_engines", "online_dpo_async.py"), *TWO], "run"),
        ],
    ]


def vs_trl_part(name: str, size: str, method: str) -> Callable[[Context], list[list[Stage]]]:
    runs = [f"trl_{method}", f"ours_{method}_async0", f"ours_{method}_async1"]
    estimate = (
        "180-440 s: TRL's trainer, then ours at async levels 0 and 1, 5 steps each at TLDR's shapes, with CUDA graphs "
        "as TRL's engine: TRL's run starts and loads its models (10-20 s), compiles Pythia-1b for its engine (50-90 s), "
        "runs 5 steps of 2-13 s and its evaluations (2-5 s); ours at async level 0 compiles again (its engine's "
        "settings are not TRL's: 50-90 s) and runs 5 steps of 1.5-8.0 s (SPEED_ESTIMATE's), async level 1 with the "
        "compile cached (20-35 s); vs_trl.py's tables and plots 2-5 s"
    )

    def steps(c: Context) -> list[list[Stage]]:
        stage = Stage(name, 450, estimate, vs_trl(c, name, size, VS_TRL_EPISODES, runs), "vs_trl", models=True)
        return [[*probe(c), models(c)], [stage]]

    return steps


def part_7(c: Context) -> list[list[Stage]]:
    estimate = (
        "250-450 s: the tiny task, 3200 episodes (50 steps) a run: TRL's online DPO and RLOO trainers and ours at "
        "async levels 0 and 1, each run starting its engine (20-40 s) and evaluating the gold win rate"
    )
    return [probe(c), [Stage("vs_trl_tiny", 500, estimate, vs_trl(c, "vs_trl_tiny", "tiny", 3200, None), "vs_trl")]]


def part_8(c: Context) -> list[list[Stage]]:
    estimate = (
        "80-150 s: on two GPUs, pytest 10 s and online DPO's run of 3200 episodes with its engine, eager, on GPU 1; "
        "where one GPU is visible, 10 s (the test skips)"
    )
    return [probe(c), [Stage("separate", 200, estimate, pytest(c, SEPARATE), "pytest", skips=True)]]


# what each part's results depend on (Part.depends), with the algorithm files it runs
COMMON = ("plumbing/*.py", "tasks/tiny/", "configs/multi_gpu.yaml")
TESTS = ("tests/test_gpu.py", "tests/conftest.py")
SPEED = (
    "benchmark/speed.py",
    "benchmark/timing.py",
    "benchmark/plot_timeline.py",
    "benchmark/plan.py",
    "benchmark/memory.py",
)
ZERO_CONFIGS = ("configs/deepspeed_zero2.yaml", "configs/deepspeed_zero3.yaml")
VS_TRL = ("benchmark/vs_trl.py", "benchmark/trl_driver.py", "benchmark/speed.py", "benchmark/timing.py")
PARTS = {
    1: Part(
        "the push on a GPU (GPTNeoX with CUDA graphs, Llama), the default online DPO run, online DPO's Pythia-1b speed",
        part_1,
        COMMON + TESTS + SPEED + ("online_dpo_async.py",),
    ),
    2: Part(
        "RLOO's and PPO's default runs, the tied Llama push, snapshots freed over six pushes, SIGTERM and --resume",
        part_2,
        COMMON + TESTS + ("online_dpo_async.py", "rloo_async.py", "ppo_async.py"),
    ),
    3: Part(
        "ZeRO-2 and ZeRO-3 on one GPU, RLOO's Pythia-1b speed against the run plan's prediction",
        part_3,
        COMMON + TESTS + SPEED + ZERO_CONFIGS + ("online_dpo_async.py", "rloo_async.py"),
    ),
    4: Part(
        "PPO's Pythia-1b speed against the run plan's prediction; two engines sharing one GPU",
        part_4,
        COMMON + TESTS + SPEED + ("online_dpo_async.py", "ppo_async.py"),
    ),
    5: Part(
        "TRL's online DPO against ours at async levels 0 and 1, Pythia-1b at TLDR's shapes",
        vs_trl_part("vs_trl_dpo", "pythia-1b", "online_dpo"),
        COMMON + VS_TRL + ("online_dpo_async.py",),
    ),
    6: Part(
        "TRL's RLOO against ours at async levels 0 and 1, Pythia-1b at TLDR's shapes",
        vs_trl_part("vs_trl_rloo", "pythia-1b", "rloo"),
        COMMON + VS_TRL + ("rloo_async.py",),
    ),
    7: Part(
        "TRL against ours on the tiny task: online DPO and RLOO, with the gold win rate",
        part_7,
        COMMON + VS_TRL + ("online_dpo_async.py", "rloo_async.py"),
    ),
    8: Part(
        "the engine on a GPU of its own, one training process on another (needs two GPUs)",
        part_8,
        COMMON + TESTS + ("online_dpo_async.py",),
    ),
}


# ---------------------------------------------------------------------------------------------------------------------
# Fake parts, for tests only: tiny stages from a JSON file (FAKE_PARTS), to stop, cut and pack without a GPU
# ---------------------------------------------------------------------------------------------------------------------
class Settings(NamedTuple):
    parts: dict[int, Part]
    pack_seconds: int
    min_stage: int


def fake_parts(path: str) -> Settings:
    """{"pack_seconds": N, "min_stage": N, "parts": {"1": {"title": ..., "depends": [...], "steps": [[{stage}, ...],
    ...]}}}; a stage: name, limit, argv ("{out}" is the work folder), and optionally after and kind ("none")."""
    spec = json.loads(Path(path).read_text())

    def steps_of(steps: list) -> Callable[[Context], list[list[Stage]]]:
        def steps_for(c: Context) -> list[list[Stage]]:
            return [
                [
                    Stage(
                        s["name"],
                        s["limit"],
                        "fake",
                        [word.replace("{out}", c.out()) for word in s["argv"]],
                        s.get("kind", "none"),
                        after=s.get("after"),
                    )
                    for s in step
                ]
                for step in steps
            ]

        return steps_for

    parts = {
        int(n): Part(p["title"], steps_of(p["steps"]), tuple(p.get("depends", ()))) for n, p in spec["parts"].items()
    }
    return Settings(parts, spec.get("pack_seconds", PACK_SECONDS), spec.get("min_stage", MIN_STAGE))


def settings() -> Settings:
    if os.environ.get(FAKE_PARTS):
        return fake_parts(os.environ[FAKE_PARTS])
    return Settings(PARTS, PACK_SECONDS, MIN_STAGE)


# ---------------------------------------------------------------------------------------------------------------------
# The plan of a part, as --dry_run prints it; its code hash
# ---------------------------------------------------------------------------------------------------------------------
def step_limit(step: list[Stage]) -> int:
    return max(stage.limit for stage in step)


def cold_seconds(stage: Stage) -> int:
    """The stage's cold estimate: the high end of its estimate's range (LOW-HIGH s), seconds from the start of its step
    on a fresh machine, where vLLM compiles each model at its first start with CUDA graphs in the loan."""
    return int(re.match(r"(\d+)-(\d+) s: ", stage.estimate)[2])


def command_text(stage: Stage) -> str:
    return stage.argv.description if isinstance(stage.argv, Later) else shlex.join(stage.argv)


def plan_text(number: int, part: Part, c: Context, seconds: int, pack_seconds: int, estimates: bool = True) -> str:
    steps = part.steps(c)
    total = sum(step_limit(step) for step in steps)
    lines = [
        f"# part {number}: {part.title}",
        f"# at most {seconds} s, {pack_seconds} of them kept for packing; the steps' limits add up to {total} s",
    ]
    for i, step in enumerate(steps, start=1):
        after = [f"{s.name} starts once {s.after} has logged a training step" for s in step if s.after]
        side = "; side by side" if len(step) > 1 else ""
        lines.append(f"## step {i}: at most {step_limit(step)} s{side}" + "".join(f"; {a}" for a in after))
        for stage in step:
            estimate = f", cold estimate {cold_seconds(stage)} s (estimate {stage.estimate})" if estimates else ""
            env = "".join(f"{key}={value} " for key, value in stage.env.items())
            lines += [f"# {stage.name}: at most {stage.limit} s{estimate}", env + command_text(stage)]
    return "\n".join(lines)


def blob_id(data: bytes) -> str:
    """The id git gives a file's content, so that the same hash is computed from a working tree or from a commit."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def matches(path: str, pattern: str) -> bool:
    """A pattern of Part.depends: a file's path, "folder/*.suffix" (the folder's own files) or "folder/" (all below)."""
    if pattern.endswith("/"):
        return path.startswith(pattern)
    folder, _, name = pattern.rpartition("/")
    if name.startswith("*"):
        return path.rpartition("/")[0] == folder and path.endswith(name[1:])
    return path == pattern


def tree_files(root: Path, patterns: tuple[str, ...]) -> dict[str, str]:
    """The files of a working tree that the patterns name, and their blob ids."""
    found = {}
    for pattern in patterns:
        folder = root / pattern.rpartition("/")[0]
        if pattern.endswith("/"):
            candidates = folder.rglob("*")
        elif "*" in pattern:
            candidates = folder.iterdir() if folder.is_dir() else []
        else:
            candidates = [root / pattern]
        for path in candidates:
            relative = path.relative_to(root).as_posix()
            if path.is_file() and "__pycache__" not in relative and matches(relative, pattern):
                found[relative] = blob_id(path.read_bytes())
    return found


def commit_files(root: Path, commit: str, patterns: tuple[str, ...]) -> dict[str, str]:
    """The same at a commit: its files that the patterns name, and their blob ids."""
    listing = git(root, "ls-tree", "-r", "--full-tree", commit)
    found = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        if any(matches(path, pattern) for pattern in patterns):
            found[path] = meta.split()[2]
    return found


def code_hash(number: int, part: Part, files: dict[str, str]) -> str:
    """The part's plan (its stages, limits and commands, not the estimates) and its files: --next compares it with the
    ledger's. Any change to what the part runs or to the code it runs makes a passed part due again."""
    c = Context("python3", Path("OUT_DIR"))
    digest = hashlib.sha256(plan_text(number, part, c, SECONDS, PACK_SECONDS, estimates=False).encode())
    for path, blob in sorted(files.items()):
        digest.update(f"{path} {blob}\n".encode())
    return digest.hexdigest()[:12]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def head_commit(root: Path) -> str | None:
    try:
        return git(root, "rev-parse", "--short=8", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # no git here (a GPU machine gets the working tree only)


# ---------------------------------------------------------------------------------------------------------------------
# Running a part
# ---------------------------------------------------------------------------------------------------------------------
class Result(NamedTuple):
    name: str
    result: str  # passed, failed, cut, stopped, not started
    code: int | None
    seconds: float
    limit: int
    numbers: str


@dataclass
class Running:
    stage: Stage
    proc: subprocess.Popen
    log: io.TextIOWrapper
    started: float
    term_at: float  # SIGTERM then
    kill_at: float  # SIGKILL then
    cut_by: str  # what kill_at is: "its limit" or "the part's deadline"
    stopped_by: str | None = None  # why it got SIGTERM: cut_by, or the part's signal


class Runner:
    """Runs a part's steps in WORK, each stage in a process group of its own, every wait bounded by the deadline."""

    def __init__(self, c: Context, deadline: float, min_stage: int):
        self.c, self.deadline, self.min_stage = c, deadline, min_stage
        self.results: list[Result] = []
        self.running: list[Running] = []
        self.signal: str | None = None  # the signal that stopped the part
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum, frame) -> None:
        self.signal = signal.Signals(signum).name

    def run(self, steps: list[list[Stage]]) -> None:
        for step in steps:
            if self.signal:
                self.results += [self.not_started(stage, f"the part got {self.signal}") for stage in step]
            else:
                self.run_step(step)

    def not_started(self, stage: Stage, why: str) -> Result:
        return Result(stage.name, "not started", None, 0, stage.limit, why)

    def run_step(self, step: list[Stage]) -> None:
        start, pending = time.monotonic(), list(step)
        while pending or self.running:
            for stage in list(pending):
                if self.signal:
                    pending.remove(stage)
                    self.results.append(self.not_started(stage, f"the part got {self.signal}"))
                elif self.may_start(stage, start):
                    pending.remove(stage)
                    self.start(stage, start)
            now = time.monotonic()
            for run in list(self.running):
                if run.proc.poll() is not None:
                    self.running.remove(run)
                    self.finish(run)
                elif now >= run.kill_at:
                    stop_group(run.proc, signal.SIGKILL)
                elif run.stopped_by is None and (self.signal or now >= run.term_at):
                    run.stopped_by = f"the part's {self.signal}" if self.signal else run.cut_by
                    run.kill_at = min(run.kill_at, now + SIGNAL_GRACE) if self.signal else run.kill_at
                    stop_group(run.proc, signal.SIGTERM)
            time.sleep(0.1)

    def may_start(self, stage: Stage, step_start: float) -> bool:
        """Now, unless it starts after another stage that runs and has not logged a training step yet."""
        if not stage.after or time.monotonic() > step_start + AFTER_WAIT:
            return True
        if not any(run.stage.name == stage.after for run in self.running):
            return True  # it ended, or never started
        metrics = (self.c.work / stage.after).rglob("metrics.jsonl")
        return any('"async/lag"' in path.read_text() for path in metrics)

    def start(self, stage: Stage, step_start: float) -> None:
        now = time.monotonic()
        kill_at, cut_by = step_start + stage.limit, "its limit"
        if self.deadline < kill_at:
            kill_at, cut_by = self.deadline, "the part's deadline"
        if kill_at - now < min(self.min_stage, stage.limit / 2):
            self.results.append(self.not_started(stage, f"{max(kill_at - now, 0):.0f} s left before {cut_by}"))
            return
        try:
            argv = stage.argv.make() if isinstance(stage.argv, Later) else stage.argv
        except StageNotStarted as error:
            self.results.append(self.not_started(stage, str(error)))
            return
        if stage.models:
            (self.c.work / "models").mkdir(exist_ok=True)
            (self.c.work / stage.name).mkdir(exist_ok=True)
            (self.c.work / stage.name / "models").symlink_to("../models")
        log = open(self.c.work / f"{stage.name}.log", "w")
        log.write(f"$ {shlex.join(argv)}\n")
        log.flush()
        print(f"== {stage.name}: at most {kill_at - now:.0f} s; log {stage.name}.log", flush=True)
        try:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **stage.env},
                start_new_session=True,  # its own process group: its engines get the signals too
            )
        except OSError as error:
            log.write(f"cannot start: {error}\n")
            log.close()
            self.results.append(Result(stage.name, "failed", 127, 0, stage.limit, f"cannot start: {error}"))
            return
        grace = min(GRACE, (kill_at - now) / 4)
        self.running.append(Running(stage, proc, log, now, kill_at - grace, kill_at, cut_by))

    def finish(self, run: Running) -> None:
        """The stage's process has ended: what is left of its group is ended too (an engine must free its GPU memory
        before the next stage starts one); its weights are deleted; its key numbers read."""
        code, seconds = run.proc.returncode, time.monotonic() - run.started
        end_group(run.proc.pid, max(min(10, self.deadline - time.monotonic()), 1))
        run.log.close()
        if run.stage.kind != "models":  # the models stage's folder is the part's models
            delete_weights(self.c.work / run.stage.name, self.c.work / "deleted_weights.txt")
        try:
            numbers, problem = KEY_NUMBERS[run.stage.kind](self.c.work, run.stage)
        except (Exception, SystemExit) as error:  # the part ends with its summary, whatever a stage wrote
            numbers, problem = "", f"its key numbers could not be read: {type(error).__name__}: {error}"
        if run.stopped_by and code != 0:
            result = "stopped" if run.stopped_by.startswith("the part's SIG") else "cut"
            numbers = "; ".join(filter(None, [f"{result} by {run.stopped_by} after {seconds:.0f} s", numbers]))
        elif code != 0:
            result = "failed"
        elif problem:
            result, numbers = "failed", "; ".join(filter(None, [problem, numbers]))
        else:
            result = "passed"
        print(f"   {run.stage.name}: {result} (exit code {code}) after {seconds:.0f} s: {numbers}", flush=True)
        self.results.append(Result(run.stage.name, result, code, seconds, run.stage.limit, numbers))

    def kill_all(self) -> None:
        """What still runs when the part ends by an error of its own."""
        for run in self.running:
            stop_group(run.proc, signal.SIGKILL)


def stop_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def end_group(pgid: int, wait: float = 10) -> None:
    """Wait a little for the rest of a process group to exit, then kill it."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def delete_weights(folder: Path, listing: Path) -> None:
    """A stage's files over WEIGHTS_BYTES (final policies, checkpoints), not the shared models (links not followed)."""
    if not folder.is_dir() or folder.is_symlink():
        return
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if not Path(dirpath, d).is_symlink()]
        for name in filenames:
            path = Path(dirpath, name)
            if not path.is_symlink() and path.stat().st_size > WEIGHTS_BYTES:
                with open(listing, "a") as out:
                    out.write(f"{path.relative_to(folder.parent)} {path.stat().st_size}\n")
                path.unlink()


# ---------------------------------------------------------------------------------------------------------------------
# Key numbers: (what the summary shows, why the stage fails though it exited with 0, or None)
# ---------------------------------------------------------------------------------------------------------------------
def read_gpus(log: Path) -> list[dict]:
    gpus = []
    for line in log.read_text().splitlines() if log.exists() else []:
        fields = [field.strip() for field in line.split(",")]
        if len(fields) == 4 and fields[0].isdigit() and fields[2].endswith(" MiB"):
            gpus.append({"name": fields[1], "mib": int(fields[2].split()[0]), "driver": fields[3]})
    return gpus


def device_name(gpus: list[dict]) -> str:
    """H100 or H200 (what the ledger says), else nvidia-smi's name, or "no GPU seen"."""
    names = {gpu["name"] for gpu in gpus}
    for short in DEVICES:
        if names and all(short in name for name in names):
            return short
    return ", ".join(sorted(names)) or "no GPU seen"


def gpus_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    gpus = read_gpus(work / f"{stage.name}.log")
    text = "; ".join(f"{g['name']}, {g['mib']} MiB, driver {g['driver']}" for g in gpus)
    return text or "no GPU listed", None if gpus else "nvidia-smi listed no GPU"


def packages_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    found = dict(line.split("==", 1) for line in (work / f"{stage.name}.log").read_text().splitlines() if "==" in line)
    found = {name.lower(): version for name, version in found.items()}
    names = ("torch", "vllm", "transformers", "accelerate", "deepspeed", "trl", "pytest")
    return "; ".join(f"{name} {found.get(name, 'not installed')}" for name in names), None


def vllm_starts(text: str) -> list[str]:
    """vLLM's own lines on its engine's start (logged at VLLM_LOGGING_LEVEL=INFO): seconds, compile included."""
    starts = []
    for took, compiled in re.findall(
        r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s(?: \(compilation: ([0-9.]+) s)?", text
    ):
        starts.append(f"{float(took):.1f} s" + (f" (compilation {float(compiled):.1f} s)" if compiled else ""))
    captures = re.findall(r"Graph capturing finished in ([0-9.]+) secs", text)
    return starts + [f"CUDA graphs captured in {seconds} s" for seconds in captures]


def pytest_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    text = (work / f"{stage.name}.log").read_text()
    totals = re.findall(r"^=+ (.*\b(?:passed|failed|skipped|errors?|deselected)\b.*) in [0-9.]+s", text, re.M)
    printed = re.findall(r"^((?:engine start|ZeRO-\d|GPU memory|stopped with exit code)\b.*)$", text, re.M)
    numbers = "; ".join([totals[-1] if totals else "no pytest summary", *printed])
    if starts := vllm_starts(text):
        numbers += "; vLLM's engine starts: " + ", ".join(starts)
    skipped = totals and re.search(r"\bskipped\b", totals[-1])
    return numbers, "a test skipped: a condition the part needs is missing" if skipped and not stage.skips else None


def run_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    """A default run: the win rate at its first and last evaluation, which must rise by 0.10 (tests/test_gpu.py's
    default-run test asks the same), its steps and their mean time from step 2 on."""
    lines = timing.read_lines(str(work / stage.name / "metrics.jsonl"))
    evals = sorted((m for m in lines if "eval/win_rate" in m), key=lambda m: m["step"])
    train = [m for m in lines if "async/lag" in m]
    times = [m["time/step"] for m in train if m["step"] >= 2 and "time/step" in m]
    text = f"{len(train)} steps" + (f", {sum(times) / len(times):.3f} s each from step 2 on" if times else "")
    if not evals:
        return f"no evaluation logged; {text}", "no evaluation logged"
    first, last = evals[0], evals[-1]
    rise = last["eval/win_rate"] - first["eval/win_rate"]
    text = (
        f"win rate {first['eval/win_rate']:.3f} at step {first['step']}, {last['eval/win_rate']:.3f} at step "
        f"{last['step']} ({rise:+.3f}); {text}"
    )
    return text, None if rise >= 0.10 else f"the win rate rose {rise:+.3f}, not the +0.10 a default run must"


def speed_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    folder, parts = work / stage.name, []
    runs = {}
    for name in ("sync", "async"):
        try:
            runs[name] = timing.summarize(str(folder / name / "metrics.jsonl"))
        except SystemExit as error:  # too few steps, or none: a run cut short
            parts.append(f"{name}: {error}")
    if "sync" in runs and "async" in runs:
        figures = timing.compare(runs["sync"], runs["async"])
        parts.append(
            f"step {runs['sync']['step']:.3f} s sync, {runs['async']['step']:.3f} s async "
            f"({figures['measured speed-up']:.2f}x); max(G, T) / async step {figures['pipeline efficiency']:.1%}; "
            f"weight push {figures['push share']:.1%} of the async step"
        )
    elif runs:
        name, run = next(iter(runs.items()))
        parts.append(f"{name} only: step {run['step']:.3f} s")
    if "async" in runs:
        peak = DEVICES["H100"][0] / 1e12
        mfu = [f"{key[5:]} {timing.utilisation(runs['async'], key, peak)}" for key in runs["async"]["phases"]]
        parts.append("MFU (async, of 989 TFLOP/s): " + ", ".join(mfu))
    log = folder / "sync" / "run.log"
    if log.exists() and (starts := vllm_starts(log.read_text())):
        parts.append("the sync run's engine start (eager): " + ", ".join(starts))
    if (folder / "timeline.png").exists():
        parts.append(f"{stage.name}/timeline.png")
    return "; ".join(parts), None


def plan_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    """plan.py's predicted step (its summary table's last row) against the one speed.py measured."""
    rows = [line for line in (work / f"{stage.name}.log").read_text().splitlines() if line.startswith("| `")]
    if not rows:
        return "no plan printed", "plan.py printed no plan"
    cells = [cell.strip() for cell in rows[-1].strip("|").split("|")]
    g, t, sync, async_ = (float(cell) for cell in cells[3:7])
    text = f"predicted: G {g:.2f} s, T {t:.2f} s, step {sync:.2f} s sync, {async_:.2f} s async ({cells[8]}-bound)"
    speed_stage = "speed_" + stage.name.removeprefix("plan_")
    try:
        measured = {
            name: timing.summarize(str(work / speed_stage / name / "metrics.jsonl")) for name in ("sync", "async")
        }
    except SystemExit:
        return f"{text}; nothing measured to compare", None
    m_sync, m_async = measured["sync"], measured["async"]
    return (
        f"{text}; measured ({speed_stage}): G {m_sync['G']:.2f} s, T {m_sync['T']:.2f} s, step {m_sync['step']:.2f} s "
        f"sync, {m_async['step']:.2f} s async; the prediction's error on the async step "
        f"{(async_ - m_async['step']) / m_async['step']:+.0%}, on the sync step {(sync - m_sync['step']) / m_sync['step']:+.0%}"
    ), None


def vs_trl_numbers(work: Path, stage: Stage) -> tuple[str, str | None]:
    path = work / stage.name / "vs_trl.json"
    if not path.exists():
        return "no vs_trl.json", "vs_trl.py wrote no results"
    results = json.loads(path.read_text())["results"]
    finished = [r for r in results if r.get("episodes_per_s") is not None]
    trl = {}  # method -> TRL's episodes per second, the mean over its seeds
    for method in {r["method"] for r in finished if r["side"] == "trl"}:
        speeds = [r["episodes_per_s"] for r in finished if r["side"] == "trl" and r["method"] == method]
        trl[method] = sum(speeds) / len(speeds)
    parts = []
    for r in results:
        if r.get("episodes_per_s") is None:
            parts.append(f"{r['name']} failed: {r.get('error') or 'no timing'}")
            continue
        ratio = (
            f" ({r['episodes_per_s'] / trl[r['method']]:.2f}x TRL's)"
            if r["side"] == "ours" and r["method"] in trl
            else ""
        )
        peak = f", GPU peak {r['gpu_peak_gib']:.1f} GiB" if r.get("gpu_peak_gib") is not None else ""
        parts.append(f"{r['name']} {r['episodes_per_s']:.1f} episodes/s{ratio}{peak}")
    failed = [r["name"] for r in results if r.get("episodes_per_s") is None]
    problem = f"run(s) {', '.join(failed)} failed" if failed else None
    return "; ".join(parts + [f"{stage.name}/vs_trl.md"]), problem


KEY_NUMBERS = {
    "gpus": gpus_numbers,
    "packages": packages_numbers,
    "pytest": pytest_numbers,
    "run": run_numbers,
    "speed": speed_numbers,
    "plan": plan_numbers,
    "vs_trl": vs_trl_numbers,
    "models": lambda work, stage: ("", None),
    "none": lambda work, stage: ("", None),
}


# ---------------------------------------------------------------------------------------------------------------------
# The summary and the packing
# ---------------------------------------------------------------------------------------------------------------------
def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def summary_text(info: dict, results: list[Result], packing: str) -> str:
    lines = [
        f"# GPU check, part {info['part']}: {info['title']}",
        "",
        "| | |",
        "|---|---|",
        f"| date | {info['date']} |",
        f"| part | {info['part']} |",
        f"| code | {info['code']} (the hash of the part's stages and files: `bash benchmark/gpu_check.sh --next` reads it) |",
        f"| commit | {info['commit'] or 'unknown (no git here)'} |",
        f"| device | {info['device']}: {info['gpus'] or 'no GPU listed'} |",
        f"| seconds | {info['seconds']:.0f} of {info['limit']}, {info['pack_seconds']} kept for packing |",
        f"| result | {info['result']} |",
        "",
        "| stage | result | exit code | seconds | limit | key numbers |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        code = "-" if r.code is None else str(r.code)
        lines.append(
            f"| {r.name} | {r.result} | {code} | {r.seconds:.0f} | {r.limit} | {r.numbers.replace('|', '/')} |"
        )
    # what --record reads, in a comment that no "--" may end early (JSON has "--" only inside strings: escaped there)
    record = json.dumps({**info, "stages": [r._asdict() for r in results]}).replace("--", "-\\u002d")
    recording = "To add it to the ledger: `bash benchmark/gpu_check.sh --record OUT_DIR --device_minutes M`."
    lines += ["", packing, "", recording, "", f"<!-- gpu_check {record} -->", ""]
    return "\n".join(lines)


def packed_bytes(path: Path, limit: int) -> bytes:
    """A file's bytes; a text file over `limit` keeps its head and tail."""
    data = path.read_bytes()
    if len(data) <= limit or path.suffix == ".png":
        return data
    keep = limit // 2 - 100
    return data[:keep] + f"\n[... {len(data) - 2 * keep} bytes left out ...]\n".encode() + data[-keep:]


def pack(work: Path, archive: Path) -> str:
    """Every log, metrics.jsonl, args.json, table, PNG and evaluation sample under WORK into one .tgz; never a model
    folder, a checkpoint or a final policy. Returns the line summary.md says about it."""
    packed, left_out = [], []
    for dirpath, dirnames, filenames in os.walk(work):
        dirnames[:] = sorted(d for d in dirnames if d not in UNPACKED_FOLDERS and not Path(dirpath, d).is_symlink())
        for name in sorted(filenames):
            path = Path(dirpath, name)
            if path.is_symlink():
                continue
            if path.suffix in PACKED_SUFFIXES and not (
                path.suffix == ".png" and path.stat().st_size > PACKED_FILE_BYTES
            ):
                packed.append(path)
            else:
                left_out.append(path)
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in packed:
            data = packed_bytes(path, PACKED_FILE_BYTES)
            member = tarfile.TarInfo(path.relative_to(work).as_posix())
            member.size, member.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(member, io.BytesIO(data))
    os.replace(tmp, archive)
    size = archive.stat().st_size / 2**20
    line = f"results.tgz: {len(packed)} files, {size:.1f} MiB ({', '.join(sorted(UNPACKED_FOLDERS))} folders left out)"
    if left_out:
        line += f"; left out: {len(left_out)} other files ({', '.join(sorted({p.suffix or p.name for p in left_out}))})"
    deleted = work / "deleted_weights.txt"
    if deleted.exists():
        count = len(deleted.read_text().splitlines())
        line += f"; {count} weights files over {WEIGHTS_BYTES // 2**20} MiB deleted as their stages ended (deleted_weights.txt)"
    return line


def run_part(number: int, part: Part, out: Path, seconds: int, setup: Settings, python: str) -> int:
    started, start, pack_seconds = datetime.now(timezone.utc), time.monotonic(), setup.pack_seconds
    work = Path(tempfile.mkdtemp(prefix=f"gpu_check-part{number}-"))
    c = Context(python, work)
    runner = Runner(c, start + seconds - pack_seconds, setup.min_stage)
    print(f"# part {number}: {part.title}\n# at most {seconds} s; the stages write in {work}", flush=True)
    code = code_hash(number, part, tree_files(ROOT, part.depends))
    steps = part.steps(c)
    try:
        runner.run(steps)
    finally:
        runner.kill_all()
        shutil.rmtree(work / "models", ignore_errors=True)
        order = [stage.name for step in steps for stage in step]
        runner.results.sort(key=lambda r: order.index(r.name))  # as the part lists them, not as they ended
        failed = [r.name for r in runner.results if r.result != "passed"]
        if runner.signal:
            result = f"stopped by {runner.signal}"
        else:
            result = "passed" if not failed else f"failed: {', '.join(failed)}"
        gpus = read_gpus(work / "gpus.log")
        info = dict(
            part=number,
            title=part.title,
            date=started.strftime("%Y-%m-%d %H:%M UTC"),
            code=code,
            commit=head_commit(ROOT),
            device=device_name(gpus),
            gpus="; ".join(f"{g['name']}, {g['mib']} MiB" for g in gpus),
            seconds=time.monotonic() - start,
            limit=seconds,
            pack_seconds=pack_seconds,
            result=result,
        )
        # summary.md first, then results.tgz, then summary.md again with the packing's line: a kill between the two
        # still leaves a summary
        write_atomically(out / "summary.md", summary_text(info, runner.results, "results.tgz: being packed").encode())
        packing = pack(work, out / "results.tgz")
        info["seconds"] = time.monotonic() - start
        text = summary_text(info, runner.results, packing)
        write_atomically(out / "summary.md", text.encode())
        shutil.rmtree(work, ignore_errors=True)
        print(f"\n{text}", flush=True)
    if runner.signal:
        return 128 + signal.Signals[runner.signal].value
    return 0 if result == "passed" else 1


# ---------------------------------------------------------------------------------------------------------------------
# The ledger: --next and --record
# ---------------------------------------------------------------------------------------------------------------------
LEDGER_COLUMNS = [
    "date",
    "part",
    "commit",
    "code",
    "device",
    "result",
    "exit codes",
    "key numbers",
    "minutes",
    "results",
]


def ledger_rows(ledger: Path) -> list[dict]:
    """The ledger's table rows (its lines that start with "| " after the header row), as dicts of LEDGER_COLUMNS."""
    rows, in_table = [], False
    for line in ledger.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if cells == LEDGER_COLUMNS:
            in_table = True
        elif in_table and line.startswith("| ") and not set(line) <= {"|", "-", " "}:
            if len(cells) != len(LEDGER_COLUMNS):
                raise SystemExit(f"error: {ledger}: a row of {len(cells)} cells, not {len(LEDGER_COLUMNS)}: {line}")
            rows.append(dict(zip(LEDGER_COLUMNS, cells)))
    return rows


def next_part(parts: dict[int, Part], ledger: Path, root: Path) -> tuple[int | None, str]:
    """The first part with no passing ledger row at its code hash now, and why."""
    rows = ledger_rows(ledger)
    for number, part in parts.items():
        code = code_hash(number, part, tree_files(root, part.depends))
        passes = [row for row in rows if row["part"] == str(number) and row["result"] == "passed"]
        if any(row["code"] == code for row in passes):
            continue
        if passes:
            last = passes[-1]
            why = f"it passed at commit {last['commit']} (code {last['code']}), and its code has changed since ({code})"
        elif any(row["part"] == str(number) for row in rows):
            why = f"it has not passed at its code ({code}) yet"
        else:
            why = f"it has not run on a GPU yet (its code: {code})"
        return number, why
    return None, "every part has passed at its code"


def recorded_members(archive: Path) -> list[tarfile.TarInfo]:
    """What --record keeps of results.tgz: every file but the evaluation samples between a run's first and last
    evaluation (the tracked files travel to the GPU machine with every call: each MiB costs loan time)."""
    with tarfile.open(archive) as tar:
        files = [member for member in tar.getmembers() if member.isfile()]
    samples = {}
    for member in files:
        folder, _, name = member.name.rpartition("/")
        if folder.endswith("eval_completions") and name.startswith("step_"):
            samples.setdefault(folder, []).append(name)
    kept = {f"{folder}/{name}" for folder, names in samples.items() for name in (min(names), max(names))}
    return [m for m in files if m.name in kept or not m.name.rpartition("/")[0].endswith("eval_completions")]


def recorded_bytes(data: bytes, suffix: str) -> bytes:
    if len(data) <= RECORDED_FILE_BYTES or suffix == ".png":
        return data
    keep = RECORDED_FILE_BYTES // 2
    return data[:keep] + b"\n[... left out here: the whole file is in results.tgz ...]\n" + data[-keep:]


def record(out: Path, minutes: float, ledger: Path, parts: dict[int, Part]) -> None:
    """Unpack a part's results next to the ledger and add its row; the part's files at HEAD must be the code it ran."""
    summary = (out / "summary.md").read_text()
    found = re.search(r"<!-- gpu_check (.*) -->", summary)
    if not found:
        raise SystemExit(f"error: {out / 'summary.md'} is not a summary of benchmark/gpu_check.sh")
    info = json.loads(found.group(1))
    number, commit = info["part"], head_commit(ROOT)
    if commit is None:
        raise SystemExit("error: --record needs git: the ledger names the commit whose code ran")
    at_head = code_hash(number, parts[number], commit_files(ROOT, "HEAD", parts[number].depends))
    if at_head != info["code"]:
        raise SystemExit(
            f"error: {out}: part {number} ran code {info['code']}, but its files at HEAD ({commit}) hash to "
            f"{at_head}: commit the code it ran (or check out the commit it ran at), then record"
        )
    folder = ledger.parent / f"part{number}-{info['date'][:10]}-{commit}"
    if folder.exists():
        raise SystemExit(f"error: {folder} exists: this part's results at this commit and date are recorded")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "summary.md").write_text(summary)
    archive = out / "results.tgz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            for member in recorded_members(archive):
                target = tmp / member.name
                if not target.resolve().is_relative_to(tmp.resolve()):
                    raise SystemExit(f"error: {archive}: {member.name} would land outside {folder}")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(recorded_bytes(tar.extractfile(member).read(), target.suffix))
    os.replace(tmp, folder)
    stages = info["stages"]
    codes = ", ".join(f"{s['name']} {'-' if s['code'] is None else s['code']}" for s in stages)
    shown = [s for s in stages if s["numbers"] and s["name"] not in ("gpus", "packages")]
    numbers = "; ".join(f"{s['name']}: {s['numbers']}" for s in shown)
    result = "passed" if info["result"] == "passed" else "failed"
    link = f"[{folder.name}]({folder.name}/summary.md)"
    cells = [info["date"][:10], str(number), commit, info["code"], info["device"], result, codes, numbers]
    cells += [f"{minutes:g}", link]
    row = "| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |\n"
    text = ledger.read_text()
    write_atomically(ledger, (text if text.endswith("\n") else text + "\n").encode() + row.encode())
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20
    print(f"recorded part {number} ({result}) in {ledger} and {folder} ({size:.2f} MiB to commit)")


# ---------------------------------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bash benchmark/gpu_check.sh", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--part", type=int, help="run this part (OUT_DIR: new or empty)")
    mode.add_argument(
        "--next", action="store_true", help="name the first part not yet passed at its code, and its command"
    )
    mode.add_argument("--record", action="store_true", help="unpack OUT_DIR's results next to the ledger, add its row")
    mode.add_argument("--versions", action="store_true", help="print the installed distributions as NAME==VERSION")
    parser.add_argument("out_dir", nargs="?", help="where summary.md and results.tgz go (--part), or are (--record)")
    parser.add_argument("--seconds", type=int, default=SECONDS, help=f"the part's deadline (default {SECONDS})")
    parser.add_argument(
        "--dry_run", action="store_true", help="print what it would do; run and write nothing (also DRY_RUN=1)"
    )
    parser.add_argument("--device_minutes", type=float, help="--record: the device minutes the loan used, all told")
    parser.add_argument("--ledger", default=str(LEDGER), help="the ledger (default benchmark/results/gpu/ledger.md)")
    args = parser.parse_args(argv)
    args.dry_run = args.dry_run or os.environ.get("DRY_RUN") == "1"
    if (args.part is not None or args.record) and not args.out_dir:
        parser.error("OUT_DIR is needed with --part and --record")
    if args.record and args.device_minutes is None and not args.dry_run:
        parser.error(
            "--record needs --device_minutes: the device minutes the loan used (its start, the staging, the part, the hand-back)"
        )
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    setup = settings()
    parts, pack_seconds = setup.parts, setup.pack_seconds
    ledger = Path(args.ledger)
    if args.versions:  # the packages stage: pip's freeze format, without pip (a GPU machine may not have it)
        found = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions() if d.metadata["Name"]}
        print("\n".join(f"{name}=={version}" for name, version in sorted(found.items(), key=lambda i: i[0].lower())))
        return 0
    if args.next:
        number, why = next_part(parts, ledger, ROOT)
        if number is None:
            print(f"nothing to run: {why} ({ledger})")
        else:
            print(f"part {number}: {parts[number].title}\n  {why} ({ledger})")
            print(f"  bash benchmark/gpu_check.sh --part {number} OUT_DIR")
        return 0
    if args.record:
        out = Path(args.out_dir)
        if args.dry_run:
            print(f"would unpack {out / 'results.tgz'} next to {ledger} and add a row for {out / 'summary.md'}")
            return 0
        record(out, args.device_minutes, ledger, parts)
        return 0
    if args.part not in parts:
        raise SystemExit(f"error: --part {args.part}: the parts are {', '.join(map(str, parts))}")
    part, out = parts[args.part], Path(args.out_dir).resolve()
    python = os.environ.get("PYTHON", "python3")
    if args.seconds < pack_seconds + setup.min_stage:
        least = pack_seconds + setup.min_stage
        raise SystemExit(f"error: --seconds {args.seconds}: at least {least} ({pack_seconds} of them for packing)")
    if args.dry_run:
        work = Path(tempfile.gettempdir(), f"gpu_check-part{args.part}-XXXXXXXX")  # made as the part starts
        print(plan_text(args.part, part, Context(python, work), args.seconds, pack_seconds))
        print(f"# the stages write in a new temporary folder ({work}); OUT_DIR gets summary.md and results.tgz")
        return 0
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"error: OUT_DIR {out} is not empty: pick a new one")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # vLLM's lines on its starts: compile and capture times
    os.environ["PYTHONUNBUFFERED"] = "1"
    return run_part(args.part, part, out, args.seconds, setup, python)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
