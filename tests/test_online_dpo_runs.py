"""online_dpo_async.py end to end, as a user runs it (subprocesses, real engine, tiny task)."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from conftest import ROOT, TINY, read_metrics, run_script, save_random_policy

PYTHON = sys.executable


def assert_lag_invariant(train: list[dict], async_level: int):
    assert [m["step"] for m in train] == list(range(len(train)))
    assert [m["async/lag"] for m in train] == [min(m["step"], async_level) for m in train]
    assert all(m["async/version"] == max(0, m["step"] - async_level) for m in train)


def test_saved_policy_loads_in_transformers_and_vllm(tmp_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    run_script([PYTHON, "online_dpo_async.py", "--output_dir", str(tmp_path), "--total_episodes", "128", "--eval_freq", "0", "--num_eval_prompts", "8"])
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").eval()
    prompt = tokenizer("sort: fox ant cat ->").input_ids
    with torch.no_grad():
        expected = policy.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    llm = LLM(model=str(tmp_path / "policy"), dtype="float32", max_model_len=64, enforce_eager=True)
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert list(out[0].outputs[0].token_ids) == expected.tolist()


def test_gptneox_policy_trains_through_the_engine(tmp_path, tokenizer):
    """Pythia's architecture runs in vLLM through its Transformers backend; the engine's own process
    keeps that backend's patches away from the trainer's GPTNeoX model."""
    policy = save_random_policy(tokenizer, tmp_path / "neox", arch="gptneox")
    run_script([PYTHON, "online_dpo_async.py", "--sft_model_path", str(policy), "--output_dir", str(tmp_path / "run"),
                "--total_episodes", "256", "--local_micro_batch_size", "16", "--eval_freq", "0", "--num_eval_prompts", "16"])
    train, evals = read_metrics(tmp_path / "run")
    assert_lag_invariant(train, async_level=1)
    assert len(train) == 8 and len(evals) == 2
    config = json.loads((tmp_path / "run" / "policy" / "config.json").read_text())
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    assert train[-1]["loss/policy"] == train[-1]["loss/policy"]  # not NaN


def test_ctrl_c_stops_trainer_thread_and_engine(tmp_path):
    proc = subprocess.Popen([PYTHON, "online_dpo_async.py", "--output_dir", str(tmp_path), "--total_episodes", "64000"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("async/lag") >= 3):
        assert proc.poll() is None, proc.stdout.read()[-4000:]
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert children, "the engine should run in child processes"
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output[-4000:]
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left behind: {alive}"
