"""online_dpo_async.py end to end, as a user runs it (subprocesses, real engine, tiny task)."""

import json
import re
import shutil
import subprocess
import sys
import time

import psutil
import pytest
from transformers import AutoModelForCausalLM
from conftest import (
    ROOT,
    TINY,
    accelerate_launch,
    read_metrics,
    run_script,
    save_random_policy,
    training_lines_without_timings,
)

PYTHON = sys.executable


def assert_lag_invariant(train: list[dict], async_level: int):
    assert [m["step"] for m in train] == list(range(len(train)))
    assert [m["async/lag"] for m in train] == [min(m["step"], async_level) for m in train]
    assert all(m["async/version"] == max(0, m["step"] - async_level) for m in train)


@pytest.mark.slow
def test_bf16_run_with_gradient_checkpointing_saves_a_policy_that_loads_in_transformers_and_vllm(tmp_path, tokenizer):
    """--dtype bfloat16, a GPU's default, on a CPU: autocast for the policy and the reference, a bf16 reward model, the
    snapshot pushed in the engine's float32, and gradient checkpointing. It trains, and at step 0 (the reference is
    the policy, both under the same autocast) the KL estimate is exactly 0. A reward model as gold judge (TLDR's path:
    the tiny proxy RM stands in for TLDR's 6.9B gold RM). The saved policy (fp32 weights) generates in vLLM what it
    generates in transformers."""
    import math

    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    flags = ["--total_episodes", "128", "--local_micro_batch_size", "8", "--eval_freq", "0", "--num_eval_prompts", "8"]
    flags += ["--dtype", "bfloat16", "--vllm_dtype", "float32", "--gradient_checkpointing"]
    run_script(
        [PYTHON, "online_dpo_async.py", *flags, "--gold_judge", str(TINY / "reward"), "--output_dir", str(tmp_path)]
    )
    train, evals = read_metrics(tmp_path)
    assert [m["step"] for m in train] == list(range(8))  # 128 episodes of 8 prompts x 2 samples
    assert train[0]["objective/kl"] == 0.0 and all(math.isfinite(m["loss/policy"]) for m in train)
    assert len(evals) == 2 and all(0 <= e["eval/win_rate"] <= 1 for e in evals)
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    assert policy.dtype == torch.float32
    prompt = tokenizer("sort: fox ant cat ->").input_ids
    with torch.no_grad():
        expected = policy.generate(
            torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :]
    llm = LLM(model=str(tmp_path / "policy"), dtype="float32", max_model_len=64, enforce_eager=True)
    try:
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt)],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(out[0].outputs[0].token_ids) == expected.tolist()


@pytest.mark.slow
def test_gptneox_policy_trains_through_the_engine(tmp_path, tokenizer):
    """Pythia's architecture runs in vLLM through its Transformers backend; the engine's own process
    keeps that backend's patches away from the trainer's GPTNeoX model."""
    policy = save_random_policy(tokenizer, tmp_path / "neox", arch="gptneox")
    run_script(
        [
            PYTHON,
            "online_dpo_async.py",
            "--sft_model_path",
            str(policy),
            "--output_dir",
            str(tmp_path / "run"),
            "--total_episodes",
            "256",
            "--local_micro_batch_size",
            "16",
            "--eval_freq",
            "0",
            "--num_eval_prompts",
            "16",
            "--track",
        ],
        env={"WANDB_MODE": "offline"},
    )
    train, evals = read_metrics(tmp_path / "run")
    assert_lag_invariant(train, async_level=1)
    assert len(train) == 8 and len(evals) == 2
    config = json.loads((tmp_path / "run" / "policy" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    assert train[-1]["loss/policy"] == train[-1]["loss/policy"]  # not NaN
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*")), "--track should write an offline wandb run"


@pytest.fixture
def long_run(tmp_path):
    """A long default run, handed over once it has trained three steps, with its child processes;
    killed at teardown whatever the test did."""
    proc = subprocess.Popen(
        [PYTHON, "online_dpo_async.py", "--output_dir", str(tmp_path), "--total_episodes", "64000"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    children = []
    try:
        metrics = tmp_path / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("async/lag") >= 3):
            assert proc.poll() is None, proc.stdout.read()[-4000:]
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        yield proc, children
    finally:
        for process in [proc, *children]:
            try:
                process.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass


@pytest.mark.slow
def test_the_engine_dying_surfaces_in_the_trainer(long_run):
    """Fault: the engine process is killed mid-run. vLLM's client may wait for it forever, so the trainer
    watches the engine's processes itself."""
    proc, children = long_run
    engines = [c for c in children if "EngineCore" in " ".join([c.name()] + c.cmdline())]
    assert engines, [c.cmdline() for c in children]
    killed_at = time.time()
    for engine in engines:
        engine.kill()
    output, _ = proc.communicate(timeout=120)
    print(f"trainer exited {time.time() - killed_at:.1f} s after the engine died")
    assert proc.returncode not in (0, None), output[-4000:]
    # the trainer sees the process it killed die, whether it noticed first (it watches the processes) or the
    # generation thread did (vLLM's EngineDeadError), and stops with the checkpoint of the step it stopped before
    last = output.strip().splitlines()[-1]
    died = re.match(r"error: the engine died: its process (.+?) ended \(.*\); resume from ", last)
    assert died, output[-4000:]
    assert any(f"VLLM::EngineCore (pid {engine.pid})" in died[1] for engine in engines), last
    assert re.search(r"checkpoints/step_\d{6} with --resume$", last), last
    assert not psutil.wait_procs(children, timeout=10)[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, processes, flags",
    [
        ("configs/deepspeed_zero2.yaml", 1, ["--gradient_accumulation_steps", "2"]),
        ("configs/deepspeed_zero3.yaml", 2, ["--gradient_checkpointing", "--collective_timeout_minutes", "45"]),
    ],
)
def test_deepspeed_trains_pushes_and_resumes_exactly(config, processes, flags, tmp_path):
    """The shipped ZeRO-2 and ZeRO-3 configs on CPUs (DeepSpeed's CPU accelerator, gloo; bf16), ZeRO-3 over two
    training processes (plumbing.distributed._process_state counts them: accelerate alone takes each for the only one on a CPU).
    Under ZeRO-3 every model but the gold judge is sharded, both processes evaluate, the push gathers a layer at a
    time on both, and each process's shuffle generator goes into the checkpoint. The checkpoints are accelerate's
    save_state, written by DeepSpeed, with a manifest of their files in DeepSpeed's subfolder too: the run resumed
    from step 4, past a damaged step-6 checkpoint, ends as the run that was not stopped. In bf16, where
    accelerate's autocast does nothing under DeepSpeed, the reference gives the policy's logprobs at step 0 (KL
    exactly 0); the weight snapshot is sized from the whole shapes (ZeRO-3's state dict holds empty tensors): the tiny
    policy's 662,144 parameters in bf16 are 1,324,288 bytes, 1.26 MiB; the collective timeout is the flag's."""
    launch = accelerate_launch("--config_file", config, "--num_processes", str(processes))
    launch += ["online_dpo_async.py", "--total_episodes", "256", "--local_micro_batch_size", "8", *flags]
    launch += ["--eval_freq", "4", "--num_eval_prompts", "16", "--save_freq", "2", "--dtype", "bfloat16"]
    stdout = run_script(launch + ["--output_dir", str(tmp_path / "run")]).stdout
    assert "engine: on the CPU; weight snapshots of 1.26 MiB each" in stdout.splitlines()
    if processes > 1:
        assert "2 training processes; a collective waits 0:45:00 for them at most" in stdout.splitlines()
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint
    assert not list((tmp_path / "run" / "checkpoints").glob("*.tmp"))
    train, evals = read_metrics(tmp_path / "run")
    assert_lag_invariant(train, async_level=1)
    assert len(train) == 8 and len(evals) == 3
    assert json.loads((tmp_path / "run" / "args.json").read_text())["world_size"] == processes
    assert all(m["loss/policy"] == m["loss/policy"] for m in train)
    assert train[0]["objective/kl"] == 0.0 and train[1]["objective/kl"] != 0.0
    # the same run as if stopped during step 7, its step-6 checkpoint damaged since: no final policy, nothing logged
    # after step 6, the last line cut off; the resume (rank 0 checks, every process follows) continues from step 4
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "policy")
    shard = next((resumed / "checkpoints" / "step_000006" / "pytorch_model").iterdir())  # DeepSpeed's subfolder
    shard.unlink()
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    kept = "".join(line + "\n" for line in lines if json.loads(line)["step"] < 7)
    (resumed / "metrics.jsonl").write_text(kept + lines[-1][:40])
    said = run_script(launch + ["--output_dir", str(resumed), "--resume"]).stdout.splitlines()
    assert (
        f"--resume: {resumed / 'checkpoints' / 'step_000006'} is damaged (pytorch_model/{shard.name} is missing; "
        f"delete it): continuing from the newest intact one, {resumed / 'checkpoints' / 'step_000004'}" in said
    )
    assert "--resume: the last line of metrics.jsonl was cut off (40 characters): dropped" in said
    assert training_lines_without_timings(resumed) == training_lines_without_timings(tmp_path / "run")
    AutoModelForCausalLM.from_pretrained(tmp_path / "resumed" / "policy")  # the whole policy, gathered to be saved
