"""benchmark/tldr.sh, no_robots.sh and gsm8k.sh: their GPU commands (printed with DRY_RUN=1) parse and
carry the paper's settings (tables 4, 7 and 10, checked here by hand: episodes / batch = steps, batch sizes
divide over the GPUs), and every script runs end to end in its tiny-override mode (TINY=1), where each run
it starts must finish with the flags the script meant."""

import dataclasses
import importlib
import json
import math
import os
import shlex
import subprocess
import sys
import time

import pytest
from conftest import ROOT, final_policy_file

MODULES = {"online_dpo_async.py": "online_dpo_async", "rloo_async.py": "rloo_async", "ppo_async.py": "ppo_async"}
REV = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def bash(script: str, *experiments: str, timeout: float = 60, **env) -> subprocess.CompletedProcess:
    """Run `bash benchmark/<script>.sh` with `python` resolving to this interpreter."""
    env = {
        **os.environ,
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
        **env,
    }
    return subprocess.run(
        ["bash", f"benchmark/{script}.sh", *experiments],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@dataclasses.dataclass
class Command:
    launcher: list[str]
    script: str
    flags: list[str]

    @property
    def args(self):
        """The flags as the script reads them (tyro: a later flag overrides an earlier one)."""
        import tyro

        module = importlib.import_module(MODULES[self.script])
        return tyro.cli(module.Args, args=self.flags)

    def value(self, flag: str) -> str:
        return [self.flags[i + 1] for i, word in enumerate(self.flags) if word == flag][-1]

    @property
    def sizes(self):
        module = importlib.import_module(MODULES[self.script])
        world_size = (
            int(self.launcher[self.launcher.index("--num_processes") + 1]) if "--num_processes" in self.launcher else 1
        )
        return module.compute_sizes(self.args, world_size)


def dry_run(script: str, *experiments: str, **env) -> list[Command]:
    proc = bash(script, *experiments, DRY_RUN="1", **env)
    assert proc.returncode == 0, proc.stderr
    commands = []
    for line in proc.stdout.splitlines():
        if line.startswith("#"):
            continue
        words = shlex.split(line)
        at = next(i for i, word in enumerate(words) if word in MODULES)
        commands.append(Command(words[:at], words[at], words[at + 1 :]))
    return commands


def check_names_and_launch(commands: list[Command], bench: str, num_processes: int, zero: int = 2, runs_dir="runs"):
    config = f"configs/deepspeed_zero{zero}.yaml"
    for c in commands:
        assert c.launcher == ["accelerate", "launch", "--config_file", config, "--num_processes", str(num_processes)]
        name = c.value("--exp_name")
        assert name.split("__")[-1].removesuffix("-dirty") == REV  # the run name carries the git revision
        assert c.value("--output_dir") == f"{runs_dir}/{bench}/{name}"
    assert len({c.value("--exp_name") for c in commands}) == len(commands)


@pytest.mark.parametrize("zero", [2, 3])
def test_the_accelerate_configs_are_zero_with_bf16(zero):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / f"deepspeed_zero{zero}.yaml"))
    assert (
        config.distributed_type == "DEEPSPEED"
        and config.deepspeed_config["zero_stage"] == zero
        and config.mixed_precision == "bf16"
    )
    if zero == 3:  # the final policy is gathered to be saved
        assert config.deepspeed_config["zero3_save_16bit_model"]


# ------------------------------------------------------------------------------------- GPU commands
def test_tldr_commands_are_table_4_and_the_figures_sweeps():
    commands = dry_run("tldr")
    check_names_and_launch(commands, "tldr", 4)
    runs = {}
    for c in commands:
        a, s = c.args, c.sizes
        if c.script == "rloo_async.py":
            method, k = {"proximal_rloo": "rloo", "prime_rl": "prime_rl"}[a.loss_type], a.rloo_k
        elif c.script == "ppo_async.py":
            method, k = "ppo", 1
        else:
            method, k = {"sigmoid": "online_dpo", "best_of_k_sft": "best_of_2"}[a.loss_type], a.num_samples
        policy = a.sft_model_path.removeprefix("mnoukhov/pythia").removesuffix("-sft-tldr")
        rm = a.reward_model_path.removeprefix("mnoukhov/pythia").removesuffix("-rm-tldr6.9b")
        assert (
            a.sft_model_path == f"mnoukhov/pythia{policy}-sft-tldr"
            and a.reward_model_path == f"mnoukhov/pythia{rm}-rm-tldr6.9b"
        )
        # table 4
        assert (
            a.task == "tldr"
            and a.dataset_name == "vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144"
        )
        assert a.gold_judge == "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"
        assert (a.max_prompt_length, a.response_length, a.temperature, a.missing_eos_penalty) == (512, 53, 0.7, -1.0)
        assert a.lr_schedule == "linear" and a.vllm_dtype == "bfloat16" and a.save_freq == 0
        # table 4's mini-batch of 512 in the paper's code's units: online DPO and Best-of-2 count prompts (512 pairs
        # a mini-batch, also at K = 4), RLOO completions (256 prompts x 2), PPO 512 prompts x 1; our episodes count
        # completions: 256 steps x 512 x 2 for online DPO and Best-of-2, 256 x 512 for RLOO and PPO
        assert a.total_episodes == (262144 if method in ("online_dpo", "best_of_2") else 131072)
        assert s.world_size == 4 and s.mini_batch_size == (256 if method in ("rloo", "prime_rl") else 512)
        assert (
            s.mini_batch_size % 4 == 0
            and s.local_mini_batch_size == a.local_micro_batch_size * a.gradient_accumulation_steps
        )
        assert s.episodes_per_step == s.mini_batch_size * k * a.num_mini_batches
        assert s.num_steps * s.episodes_per_step == a.total_episodes
        assert s.num_steps * a.num_mini_batches == (
            256 if k <= 2 else 128
        )  # 256 updates; K = 4: half the steps (figure 8)
        assert a.local_micro_batch_size == {"410m": 16, "1b": 8, "2.8b": 4}[policy]
        lr = {"online_dpo": 3e-6, "best_of_2": 1e-6, "rloo": 3e-6, "prime_rl": 3e-6, "ppo": 3e-6}[method]
        assert a.learning_rate == pytest.approx(lr / (2 if k == 4 else 1))
        if method in ("online_dpo", "best_of_2"):
            assert a.beta == 0.1 and a.num_samples in (2, 4)
        elif method == "prime_rl":  # PRIME-RL's objective: mu the engine's, no KL term, its code's delta
            assert (a.old_logprobs, a.kl_coef, a.token_ratio_cap, a.advantage, a.rloo_k) == (
                "engine",
                0.0,
                8.0,
                "leave_one_out",
                2,
            )
            module = importlib.import_module("rloo_async")
            module.check_loss_flags(a)  # the run would not stop at its start
        else:
            assert a.kl_coef == 0.05 and (method == "ppo" or a.rloo_k == 2)
        runs[(method, policy, rm, a.num_mini_batches, a.num_ppo_epochs, k, a.async_level)] = a
    ns, scales = (1, 2, 4, 8, 16, 32, 64), ("410m", "1b", "2.8b")  # figure 5's N; figure 3 (PPO) to 64 too
    for n in ns:  # figures 3-4: every method across N, synchronous, 410m
        for method, k in (("online_dpo", 2), ("best_of_2", 2), ("rloo", 2), ("ppo", 1)):
            assert (method, "410m", "410m", n, 1, k, 0) in runs
        for size in scales:  # figure 5: the policy's and the reward model's scale
            assert ("online_dpo", size, "410m", n, 1, 2, 0) in runs and ("online_dpo", "410m", size, n, 1, 2, 0) in runs
    for size in scales:
        assert {
            (size, async_level)
            for (m, p, r, n, t, k, async_level) in runs
            if (m, p, r, n, t, k) == ("online_dpo", size, size, 1, 1, 2) and async_level <= 1
        } == {(size, 0), (size, 1)}  # figure 1
        assert all(("online_dpo", size, size, 1, t, 2, 1) in runs for t in (1, 2, 3))  # figure 7
        assert ("online_dpo", size, size, 1, 1, 4, 1) in runs  # figure 8
    for async_level in (0, 1, 2, 4, 8):  # staleness, 410m, N = 1
        for method, k in (("online_dpo", 2), ("rloo", 2), ("prime_rl", 2), ("ppo", 1)):
            assert (method, "410m", "410m", 1, 1, k, async_level) in runs
    # 8 runs a sweep point, 14 more for figures 1, 7 and 8, 16 for staleness (4 of its 20 are the others')
    assert len(runs) == len(commands) == 86


def test_no_robots_commands_are_table_7():
    commands = dry_run("no_robots", "online_dpo", "ppo", NO_ROBOTS_SFT="my/sft", NO_ROBOTS_RM="my/rm")
    check_names_and_launch(commands, "no_robots", 7, zero=3)
    assert all(c.args.gradient_checkpointing and c.args.vllm_gpu_memory_utilization == 0.91 for c in commands)
    assert sorted((c.script, c.args.async_level) for c in commands) == [
        ("online_dpo_async.py", 0),
        ("online_dpo_async.py", 1),
        ("ppo_async.py", 0),
        ("ppo_async.py", 1),
    ]
    for c in commands:
        a, s = c.args, c.sizes
        assert (a.task, a.dataset_name, a.sft_model_path, a.reward_model_path) == (
            "no_robots",
            "HuggingFaceH4/no_robots",
            "my/sft",
            "my/rm",
        )
        assert (
            a.learning_rate,
            a.lr_schedule,
            a.temperature,
            a.max_prompt_length,
            a.response_length,
            a.missing_eos_penalty,
        ) == (8e-7, "linear", 0.7, 512, 1024, -10.0)
        # 1 generation + 7 training GPUs (8 H100s); 252 episodes per step, the multiple of 7 x 2 nearest table 7's 256
        assert s.world_size == 7 and s.episodes_per_step == 252 and s.num_steps == 397 and a.total_episodes == 397 * 252
        assert abs(a.total_episodes - 100000) / 100000 < 0.001
        if c.script == "online_dpo_async.py":
            assert a.beta == 0.03 and a.num_samples == 2 and s.batch_size == 126 and a.loss_type == "sigmoid"
        else:
            assert a.kl_coef == 0.01 and s.batch_size == 252  # appendix A.2, "PPO"


def test_no_robots_lora_is_the_paper_s_async_online_dpo_with_an_adapter_on_two_gpus():
    """The lora experiment: table 7's async online DPO (the same step of 126 prompts x 2, 397 steps, beta 0.03), one
    training process under ZeRO-2 beside the engine's GPU, a rank-8 adapter on every linear layer at ten times the
    learning rate; its memory plan fits on those 2 GPUs (the whole policy takes 8)."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import memory

    (lora,) = dry_run("no_robots", "lora")
    (paper,) = [c for c in dry_run("no_robots", "online_dpo") if c.args.async_level == 1]
    assert lora.launcher[-4:] == ["--config_file", "configs/deepspeed_zero2.yaml", "--num_processes", "1"]
    a, s = lora.args, lora.sizes
    assert (a.lora_rank, a.lora_alpha, a.lora_dropout, a.lora_target_modules) == (8, 16.0, 0.0, "all-linear")
    assert a.learning_rate == 10 * paper.args.learning_rate == 8e-6 and (a.beta, a.async_level) == (0.03, 1)
    assert (s.batch_size, s.episodes_per_step, s.num_steps) == (paper.sizes.batch_size, 252, 397) and s.world_size == 1
    assert lora.value("--exp_name").startswith("online_dpo-llama8b-lora8-async1-s1__")
    result = memory.plan(["accelerate", "launch", *lora.launcher[2:], lora.script, *lora.flags], int(79 * 2**30), None)
    assert len(result["gpus"]) == 2 and memory.table(result, int(79 * 2**30))[1]


def without(flags: list[str], names: set[str]) -> list[str]:
    """`flags` less the flags in `names`, each with its value."""
    dropped = {i + j for i, flag in enumerate(flags) if flag in names for j in (0, 1)}
    return [flag for i, flag in enumerate(flags) if i not in dropped]


def test_no_robots_offers_two_engines_beside_six_training_gpus_for_the_same_step():
    """VLLM_NUM_ENGINES=2: the paper's commands on the same 8 GPUs as 2 engines + 6 training processes (the run plan's
    layout for online DPO, docs/reproducing.md): the step's batch the same (online DPO 126 prompts = 6 x 3 x 7, PPO 252
    = 6 x 3 x 14), runs named -e2, every other flag as the paper's layout has it. The default stays the paper's
    (test_no_robots_commands_are_table_7); another count is refused."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import memory
    import tyro

    paper, two = (
        dry_run("no_robots", "online_dpo", "ppo"),
        dry_run("no_robots", "online_dpo", "ppo", VLLM_NUM_ENGINES="2"),
    )
    assert [c.script for c in two] == [c.script for c in paper] and len(two) == 4
    changed = {"--local_micro_batch_size", "--gradient_accumulation_steps", "--exp_name", "--output_dir"}
    for p, t in zip(paper, two):
        assert t.launcher == [*p.launcher[:-1], "6"] and p.launcher[-1] == "7"
        module = importlib.import_module(MODULES[t.script])
        args = tyro.cli(memory.with_engine_layout(module.Args), args=t.flags)
        sizes = module.compute_sizes(args, 6)
        assert (args.vllm_num_engines, args.vllm_tensor_parallel_size, args.local_micro_batch_size) == (2, 1, 3)
        assert (sizes.batch_size, sizes.episodes_per_step, sizes.num_steps) == (p.sizes.batch_size, 252, 397)
        assert t.value("--exp_name") == p.value("--exp_name").replace("-llama8b-", "-llama8b-e2-")
        assert without(t.flags, changed | {"--vllm_num_engines"}) == without(p.flags, changed)
    refused = bash("no_robots", DRY_RUN="1", VLLM_NUM_ENGINES="3")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "no_robots: VLLM_NUM_ENGINES is 1 (the paper's layout) or 2, not '3'"


def test_gsm8k_commands_are_table_10():
    commands = dry_run("gsm8k")
    check_names_and_launch(commands, "gsm8k", 3)
    assert sorted((c.script, c.args.async_level) for c in commands) == [
        ("online_dpo_async.py", 0),
        ("online_dpo_async.py", 1),
        ("rloo_async.py", 0),
    ]
    for c in commands:
        a, s = c.args, c.sizes
        assert (a.task, a.dataset_name, a.dataset_config, a.dataset_eval_split) == (
            "gsm8k",
            "openai/gsm8k",
            "main",
            "test",
        )
        assert a.sft_model_path == "realtreetune/rho-1b-sft-GSM8K"
        assert (a.learning_rate, a.temperature, a.max_prompt_length, a.response_length) == (3e-6, 0.7, 512, 512)
        assert a.lr_schedule == "constant"
        # 1 generation + 3 training GPUs: 252 prompts = 6 x 14 accumulated x 3, 4 completions each
        assert (
            s.world_size == 3
            and s.batch_size == 252
            and (a.local_micro_batch_size, a.gradient_accumulation_steps) == (6, 14)
        )
        assert a.total_episodes == 129024 * 4 == 516096 and s.num_steps == 512 == 129024 // 252
        if c.script == "online_dpo_async.py":
            assert (a.num_samples, a.beta, a.loss_type) == (4, 0.05, "sigmoid")
        else:
            assert (a.rloo_k, a.kl_coef) == (4, 0.05)


def test_experiments_are_chosen_by_name_and_bad_sizes_are_refused():
    k4 = dry_run("tldr", "k4")
    assert [(c.args.num_samples, c.args.sft_model_path) for c in k4] == [
        (4, f"mnoukhov/pythia{s}-sft-tldr") for s in ("410m", "1b", "2.8b")
    ]
    assert len(dry_run("tldr", "k4", "epochs")) == 3 + 9
    proc = bash("tldr", "offpolicy", "nonsense", DRY_RUN="1")
    assert (
        proc.returncode == 2
        and "unknown experiment 'nonsense'; tldr has: offpolicy scaling async epochs k4 staleness" in proc.stderr
    )
    proc = bash("tldr", DRY_RUN="1", TRAIN_GPUS="3")  # 256 prompts do not divide over 3 training GPUs
    assert proc.returncode == 2 and "512 does not divide by 3" in proc.stderr and proc.stdout == ""


# ------------------------------------------------------------------------------------- tiny mode, end to end
def finished_run(output_dir) -> tuple[dict, list[dict], list[dict]]:
    args = json.loads((output_dir / "args.json").read_text())
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "async/lag" in m]
    evals = [m for m in lines if any(key.startswith("eval/") for key in m)]
    assert args["num_steps"] == 2 and [m["step"] for m in train] == [0, 1]
    assert [m["async/lag"] for m in train] == [0, min(1, args["async_level"])]
    assert [e["step"] for e in evals] == [0, 2] and train[-1]["episode"] == args["total_episodes"]
    assert all(math.isfinite(v) for m in lines for v in m.values() if isinstance(v, float))
    assert final_policy_file(output_dir).exists()  # the model's, or under LoRA its adapter's
    return args, train, evals


TINY_RUNS = {  # what each script's tiny mode runs: (script, distinguishing flags)
    "tldr": [
        (
            "online_dpo_async.py",
            dict(loss_type="sigmoid", num_mini_batches=2, num_samples=2, async_level=0, learning_rate=3e-6),
        ),
        (
            "online_dpo_async.py",
            dict(loss_type="best_of_k_sft", num_mini_batches=2, num_samples=2, async_level=0, learning_rate=1e-6),
        ),
        ("rloo_async.py", dict(num_mini_batches=2, rloo_k=2, async_level=0)),
        ("ppo_async.py", dict(num_mini_batches=2, async_level=0)),
        (
            "online_dpo_async.py",
            dict(num_mini_batches=1, num_ppo_epochs=2, num_samples=2, async_level=1, learning_rate=3e-6),
        ),
        (
            "online_dpo_async.py",
            dict(num_mini_batches=1, num_ppo_epochs=1, num_samples=4, async_level=1, learning_rate=1.5e-6),
        ),
    ],
    "no_robots": [
        ("online_dpo_async.py", dict(task="no_robots", beta=0.03, async_level=1, learning_rate=8e-7)),
        ("online_dpo_async.py", dict(task="no_robots", beta=0.03, async_level=1, learning_rate=8e-6, lora_rank=8)),
        ("ppo_async.py", dict(task="no_robots", kl_coef=0.01, async_level=1, learning_rate=8e-7)),
    ],
    "gsm8k": [
        (
            "online_dpo_async.py",
            dict(task="gsm8k", dataset_config="main", num_samples=4, beta=0.05, async_level=1, lr_schedule="constant"),
        ),
        (
            "rloo_async.py",
            dict(task="gsm8k", dataset_config="main", rloo_k=4, kl_coef=0.05, async_level=0, lr_schedule="constant"),
        ),
    ],
}


@pytest.mark.slow
@pytest.mark.benchmark
@pytest.mark.parametrize("bench", ["tldr", "no_robots", "gsm8k"])
def test_tiny_mode_runs_every_command_to_the_end(bench, tmp_path):
    """TINY=1: the GPU commands with the tiny task's models or the task's fixture swapped in (flags appended:
    a later flag overrides an earlier one), 2 steps each, with plain python on the CPU."""
    tiny = dry_run(bench, TINY="1", RUNS_DIR=str(tmp_path))
    real = {c.value("--exp_name"): c for c in dry_run(bench)}
    for c in tiny:  # the same command, then the swaps
        gpu = real[c.value("--exp_name")]
        assert c.launcher == ["python"] and c.script == gpu.script
        assert c.flags[: len(gpu.flags) - 4] == gpu.flags[:-4]  # all but --exp_name and --output_dir
    start = time.perf_counter()
    # 5-7 runs of 1.5-2 minutes each on 2 free cores, up to three times that beside the other xdist worker's runs;
    # every run has its own deadlines (the engine's calls), so a hung run stops well within this
    proc = bash(bench, timeout=1800, TINY="1", RUNS_DIR=str(tmp_path))
    print(f"TINY=1 bash benchmark/{bench}.sh: {len(tiny)} runs in {time.perf_counter() - start:.0f} s")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    started = sorted(p.name for p in (tmp_path / bench).iterdir() if p.is_dir() and p.name != "tiny_sft_chat")
    assert started == sorted(c.value("--exp_name") for c in tiny)
    assert len(tiny) == len(TINY_RUNS[bench])
    for c, (script, expected) in zip(tiny, TINY_RUNS[bench]):
        args, train, evals = finished_run(tmp_path / bench / c.value("--exp_name"))
        meant = dataclasses.asdict(c.args)  # what the script meant: every flag, as tyro reads the command line
        assert {key: args[key] for key in meant} == meant
        assert args["git_revision"].startswith(
            c.value("--exp_name").split("__")[-1].removesuffix("-dirty")
        )  # the name's revision
        assert c.script == script and {key: args[key] for key in expected} == pytest.approx(expected), c.value(
            "--exp_name"
        )
    if bench == "tldr":  # the K = 4 run: half the learning rate of the K = 2 runs
        lrs = {
            (a.num_samples, a.loss_type): a.learning_rate
            for a in (c.args for c in tiny if c.script == "online_dpo_async.py")
        }
        assert lrs[(4, "sigmoid")] == lrs[(2, "sigmoid")] / 2
    if bench == "no_robots":  # prompts written with the chat template the tiny mode gave the tiny policy
        rows = [
            json.loads(line)
            for line in (tmp_path / bench / tiny[0].value("--exp_name") / "eval_completions" / "step_000000.jsonl")
            .read_text()
            .splitlines()
        ]
        assert rows and all(
            row["prompt"].startswith("<s><|user|>\n") or row["prompt"].startswith("<s><|system|>\n") for row in rows
        )
