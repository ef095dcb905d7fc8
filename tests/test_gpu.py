"""The GPU path on a real GPU: the weight push by CUDA IPC into an engine that shares the trainer's GPU, checked exactly
after each of three pushes for GPTNeoX (Pythia-160m's shape, its engine with CUDA graphs), untied and tied Llama; GPU
memory flat over six pushes; a run stopped by SIGTERM that resumes; ZeRO-2 and ZeRO-3; the engine on a GPU of its own;
each file's default run on one GPU. Skipped where there is no CUDA (CI); run on a GPU machine with
`pytest -q tests/test_gpu.py`, or a part at a time by benchmark/gpu_check.sh (docs/gpus.md). The engine starts as the
scripts start it: the trainer's model is on the GPU first."""

import os
import shutil
import sys
import time

import pytest
import torch
from conftest import perturbed_policy, read_metrics, run_script

from plumbing.engine import make_engine
from plumbing.placement import engine_placement, visible_gpus
from plumbing.weights import SnapshotPlace, WeightBucket, model_snapshot, push_weights

# This process may touch CUDA before an engine starts: the engine is spawned (make_engine), never forked.
pytestmark = pytest.mark.skipif(torch.cuda.device_count() == 0, reason="needs a CUDA GPU")

PROMPT_LENGTH = 45  # prompts longer than one KV-cache block (16 tokens)
# The tests' engines get a KV cache of this size, not the share vLLM measures free on the GPU as it starts: it reads the
# whole GPU's free memory, which a run beside the test (benchmark/gpu_check.sh runs some side by side) changes while it
# measures ("Error in memory profiling" where the neighbour frees memory, a smaller cache where it allocates).
KV_CACHE_BYTES = 2**30


def engine_parameters(llm) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, copied to the CPU (plumbing.receiver.WeightReceiver, in the worker)."""
    from safetensors.torch import load

    return load(llm.collective_rpc("parameter_copies")[0])


def engine_memory(llm) -> int:
    return llm.collective_rpc("cuda_memory_allocated")[0]


def reload_from_file(llm, model, folder) -> None:
    """vLLM's own checkpoint path: the model's safetensors file, reloaded in place."""
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder)
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(folder)})
    llm.reset_prefix_cache()


def engine_sharing_the_trainers_gpu(model, tokenizer, folder, eager: bool = False):
    """`model` on the GPU first, then the engine started from it saved, sharing that GPU, as the scripts start it (but
    for its KV cache: KV_CACHE_BYTES). With CUDA graphs unless `eager`; prints how long the start took, which on a
    machine that never compiled this model is vLLM's first compile and capture."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    trainer = model.cuda()
    placement = engine_placement("shared", visible_gpus(), 1, 0.3)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # as the scripts set it: the push's handle is pickled
    start = time.perf_counter()
    llm = make_engine(
        str(folder),
        placement,
        dtype="bfloat16",
        max_model_len=64,
        seed=0,
        enforce_eager=eager,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    mode = "eager" if eager else "CUDA graphs"
    print(f"engine start ({model.config.model_type}, {mode}): {time.perf_counter() - start:.1f} s")
    return trainer, llm


# GPTNeoX's engine runs with CUDA graphs, which the push must update in place; the Llamas' engines run eager, which
# saves a compile each (benchmark/gpu_check.sh times the first compile on GPTNeoX).
PUSH_CASES = [
    pytest.param("gptneox", False, False, id="gptneox-cuda_graphs"),
    pytest.param("llama", False, True, id="llama-eager"),
    pytest.param("llama", True, True, id="llama_tied-eager"),
]


@pytest.mark.parametrize("arch, tied, eager", PUSH_CASES)
def test_each_ipc_push_loads_exactly_what_a_checkpoint_would(arch, tied, eager, tokenizer, tmp_path):
    """Three pushes of models whose every tensor differs (norms and biases perturbed too). After each, every engine
    parameter is bit for bit what vLLM's loader makes of the same weights from a safetensors file (q/k/v fusion,
    GPTNeoX's q/k/v reordering, the tied head) and differs from the previous version's; the same long prompt gives the
    new model's tokens and its logprobs at temperature 0.7 (the prefix cache was reset); each push passes its probe,
    the engine's logprobs on it within bfloat16's tolerance of the trainer's; GPU memory stays flat in both processes.
    With CUDA graphs, they are captured before the first push."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    models = [perturbed_policy(tokenizer, arch, tied, seed, large=arch == "gptneox") for seed in range(4)]
    trainer, llm = engine_sharing_the_trainers_gpu(models[0], tokenizer, tmp_path / "v0", eager)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
            for _ in range(4)
        ]
        greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
        sampled = SamplingParams(temperature=0.7, max_tokens=8, logprobs=0, ignore_eos=True, seed=0)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.generate(prompts, greedy, use_tqdm=False)  # CUDA graphs captured, the prefix cache full of version 0's KV
        before, memory = engine_parameters(llm), []
        place, bucket = (  # a bucket of the largest layer: each push is several loads by CUDA IPC
            SnapshotPlace(pinned=True, folder=None),
            WeightBucket(torch.device("cuda"), None, least=1),
        )
        for version, model in enumerate(models[1:], start=1):
            trainer.cpu()
            trainer = model.cuda()
            weights = model_snapshot(trainer, version, torch.bfloat16, place, probed=True)  # in bfloat16's tolerance
            push_weights(llm, bucket, weights)
            pushed = engine_parameters(llm)
            outputs = llm.generate(prompts, greedy, use_tqdm=False)
            sampled_outputs = llm.generate(prompts, sampled, use_tqdm=False)
            memory.append((torch.cuda.memory_allocated(), engine_memory(llm)))
            reload_from_file(llm, trainer, tmp_path / f"v{version}")
            from_file = engine_parameters(llm)
            assert pushed.keys() == from_file.keys() == before.keys()
            for name in pushed:
                assert torch.equal(pushed[name], from_file[name]), (version, name)
                assert not torch.equal(pushed[name], before[name]), (version, name, "not pushed")
            before = pushed
            bf16 = trainer.to(torch.bfloat16).eval()
            for prompt, output, sample in zip((p["prompt_token_ids"] for p in prompts), outputs, sampled_outputs):
                with torch.no_grad():
                    logits = bf16(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
                assert output.outputs[0].token_ids[0] == int(
                    logits.argmax()
                )  # later tokens: near-ties of a random model
                tokens = list(sample.outputs[0].token_ids)
                with torch.no_grad():
                    ids = torch.tensor([prompt + tokens], device="cuda")
                    logp = (bf16(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7).log_softmax(-1)
                trainer_logprobs = logp.gather(1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(1).cpu()
                engine_logprobs = torch.tensor([next(iter(lp.values())).logprob for lp in sample.outputs[0].logprobs])
                # Both sides run the same bf16 weights but round at different places. bf16 keeps 8 significant bits,
                # so a logit of magnitude |z| / T carries ~2^-8 |z| / T of rounding per operation, growing with depth.
                # Measured on a CPU for these models (8 tokens sampled at 0.7; two bf16 attention kernels, and bf16
                # against fp32): at most 0.011 per token for the 2-layer Llamas (|z| / T <= 3, 2 x 2^-8 x 3) and 0.0525
                # for the 12-layer GPTNeoX (|z| / T <= 8, 4 x 2^-8 x 8). So the Llamas get 0.025, while the GPTNeoX
                # keeps 0.05, about its numerics. A missing temperature moves these logprobs by tenths.
                atol = 0.05 if arch == "gptneox" else 0.025
                torch.testing.assert_close(engine_logprobs, trainer_logprobs, rtol=0, atol=atol)
            del weights
            torch.cuda.empty_cache()
        print("GPU memory (trainer, engine) after each push:", memory)
        assert memory[-1][0] <= memory[0][0] and memory[-1][1] <= memory[0][1] + 2**20
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("script", ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"])
def test_default_run_learns_on_one_gpu(script, tmp_path):
    run_script([sys.executable, script, "--total_episodes", "3200", "--output_dir", str(tmp_path)], timeout=1200)
    _, evals = read_metrics(tmp_path)
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10, [e["eval/win_rate"] for e in evals]
    assert (tmp_path / "policy" / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------------
# What the later parts of benchmark/gpu_check.sh add: the engine on a GPU of its own, ZeRO-2 and ZeRO-3 under
# accelerate launch with the KL at step 0, snapshots freed over six pushes, and a resume. The runs' engines run eager:
# compile time is not what they check.
def run_watching_gpu_memory(argv: list[str], log, timeout: float) -> list[int]:
    """Run a command to its end (its output in `log`), sampling twice a second how much of each visible GPU is in use
    (the whole GPU, every process: torch.cuda.mem_get_info); returns each GPU's peak over what was in use before the
    command started. Fails with the end of its output if it fails."""
    import subprocess
    import time

    from conftest import ROOT

    def used() -> list[int]:
        return [total - free for free, total in map(torch.cuda.mem_get_info, range(torch.cuda.device_count()))]

    before = used()
    peaks = list(before)
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout
    try:
        while proc.poll() is None:
            assert time.time() < deadline, f"timed out after {timeout} s"
            peaks = [max(peak, now) for peak, now in zip(peaks, used())]
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"{' '.join(argv)} failed ({proc.returncode}):\n{open(log).read()[-8000:]}"
    return [peak - start for peak, start in zip(peaks, before)]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs: one to train on, one for the engine")
def test_the_engine_on_a_gpu_of_its_own_runs_there_and_the_run_learns(tmp_path):
    """--vllm_placement separate, one training process: the trainer on GPU 0, the engine and the weight snapshots on
    GPU 1 (docs/gpus.md). The engine's share of its GPU shows in GPU 1's memory and not in GPU 0's; the run learns as a
    default run does, with the lag invariant and every evaluation where --eval_freq puts it."""
    from conftest import check_run

    run = tmp_path / "run"
    argv = [sys.executable, "online_dpo_async.py", "--vllm_placement", "separate", "--total_episodes", "3200"]
    argv += ["--vllm_enforce_eager"]
    added = run_watching_gpu_memory([*argv, "--output_dir", str(run)], tmp_path / "run.log", timeout=1200)
    totals = [torch.cuda.mem_get_info(gpu)[1] for gpu in range(2)]
    print("GPU memory the run added at its peak (GiB):", [round(bytes_ / 2**30, 2) for bytes_ in added])
    assert added[1] > 0.5 * totals[1] and added[0] < 0.25 * totals[0], (added, totals)
    _, _, evals = check_run(run, "online_dpo_async.py")
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10, [e["eval/win_rate"] for e in evals]


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


@pytest.mark.skipif(not deepspeed_installed(), reason="needs DeepSpeed")
@pytest.mark.parametrize("zero", [2, 3])
def test_zero_runs_under_accelerate_launch_with_the_kl_exactly_0_at_step_0(zero, tmp_path):
    """The shipped configs/deepspeed_zero2.yaml and deepspeed_zero3.yaml under accelerate launch, one training process,
    --dtype bfloat16 (the configs' bf16): the run ends, with the lag invariant, DeepSpeed's own checkpoint and the whole
    final policy. At step 0 the reference is the policy, both on bf16 weights (DeepSpeed's bf16 keeps the policy's in
    bf16, and the frozen models are cast to match), in passes of the same shape (64 pairs: micro-batches of 32 prompts,
    reference passes of 64 sequences): the KL estimate is exactly 0."""
    from conftest import accelerate_launch, check_run, run_script

    launch = accelerate_launch("--config_file", f"configs/deepspeed_zero{zero}.yaml")
    flags = ["--dtype", "bfloat16", "--total_episodes", "640", "--eval_freq", "0", "--num_eval_prompts", "64"]
    flags += ["--local_micro_batch_size", "32", "--local_rollout_forward_batch_size", "64", "--save_freq", "5"]
    flags += ["--vllm_enforce_eager"]
    launch += ["--num_processes", "1", "online_dpo_async.py", *flags, "--output_dir", str(tmp_path)]
    run_script(launch, timeout=1200)
    args, train, _ = check_run(tmp_path, "online_dpo_async.py")
    print(f"ZeRO-{zero}: objective/kl at steps 0-2:", [m["objective/kl"] for m in train[:3]])
    assert args["world_size"] == 1 and args["dtype"] == "bfloat16" and len(train) == 10
    assert (tmp_path / "checkpoints" / "step_000005" / "pytorch_model").is_dir()  # DeepSpeed's own checkpoint
    assert train[0]["objective/kl"] == 0.0


def test_snapshots_freed_over_six_pushes_leave_gpu_memory_as_after_the_second(tokenizer, tmp_path):
    """Six pushes, each of another model (Pythia-160m's shape), into an engine with CUDA graphs, generating after each.
    The snapshots live in pinned host memory as the scripts keep them at --async_level 1 between evaluations: the
    version still owed a batch and the one just published; an older one is freed once the engine has loaded its
    successor. The GPU holds only the push's bucket, allocated at the first push, which the engine opens by CUDA IPC
    at every push; the engine must keep nothing of what it opens: from the second push on, the trainer's and the
    engine's GPU memory stay the same, byte for byte, and the trainer's grew by the bucket alone."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    models = [perturbed_policy(tokenizer, "gptneox", False, seed, large=True) for seed in range(7)]
    trainer, llm = engine_sharing_the_trainers_gpu(models[0], tokenizer, tmp_path / "v0")
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            TokensPrompt(
                prompt_token_ids=[tokenizer.bos_token_id]
                + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
            )
            for _ in range(4)
        ]
        sampled = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True, seed=0)
        llm.generate(prompts, sampled, use_tqdm=False)  # CUDA graphs captured, the prefix cache filled
        alive, memory, before = {}, [], torch.cuda.memory_allocated()
        place, bucket = (
            SnapshotPlace(pinned=True, folder=None),
            WeightBucket(torch.device("cuda"), None),
        )
        for version, model in enumerate(models[1:], start=1):
            trainer.cpu()
            trainer = model.cuda()
            alive[version] = model_snapshot(trainer, version, torch.bfloat16, place)
            assert alive[version].flat.is_pinned() and not alive[version].flat.is_cuda
            push_weights(llm, bucket, alive[version])
            llm.generate(prompts, sampled, use_tqdm=False)
            alive.pop(version - 2, None)  # loaded, and owed nothing any more
            memory.append((torch.cuda.memory_allocated(), engine_memory(llm)))
        print("GPU memory (trainer, engine) after each push:", memory)
        assert sorted(alive) == [5, 6]
        assert memory[1:] == [memory[1]] * 5, memory
        # the bucket, bf16, and its header of 16 bytes (a block of 512)
        assert memory[0][0] - before == pytest.approx(bucket.flat.numel() * 2 + 512, abs=512)
    finally:
        llm.llm_engine.engine_core.shutdown()


def stop_after_steps(argv: list[str], output_dir, steps: int, sig: int, timeout: float = 900) -> tuple[int, str]:
    """Start a run and send `sig` to the trainer once it has logged `steps` training steps; returns its exit code and
    output once it and every process it started are gone. (conftest's start_and_stop also expects the message queues
    of vLLM's multiprocessing executor, which a CPU engine uses and a one-GPU engine does not.)"""
    import subprocess
    import time

    import psutil
    from conftest import ROOT

    log = output_dir.parent / f"{output_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        metrics, deadline = output_dir / "metrics.jsonl", time.time() + timeout
        while not (metrics.exists() and metrics.read_text().count("async/lag") >= steps):
            assert proc.poll() is None, open(log).read()[-4000:]
            assert time.time() < deadline, f"no {steps} steps logged in {timeout} s"
            time.sleep(0.05)
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        proc.send_signal(sig)
        code = proc.wait(timeout=300)
        assert not psutil.wait_procs(family[1:], timeout=30)[1], "processes left behind"
        return code, open(log).read()
    finally:
        if proc.poll() is None:
            proc.kill()


# online DPO (its metrics hold no engine logprobs, whose last bits a new engine may not repeat) at --async_level 2: a
# checkpoint carries the two older policy versions the generator still owes batches from; 64 steps of 8 prompts x 2
RESUMABLE_ON_GPU = ["--total_episodes", "1024", "--local_micro_batch_size", "8", "--eval_freq", "8"]
RESUMABLE_ON_GPU += ["--num_eval_prompts", "32", "--save_freq", "5", "--async_level", "2", "--vllm_enforce_eager"]


def test_a_run_stopped_by_sigterm_resumes_to_the_end_of_the_run_never_stopped(tmp_path):
    """SIGTERM after 12 steps: the trainer finishes its step, writes a checkpoint and exits 143; --resume then ends with
    the metrics.jsonl (wall-clock figures aside) and the final policy of the same run never stopped. Where they differ,
    the message says whether the first difference comes before the checkpoint the run resumed from: the stopped run
    computed those steps itself, so two runs of this GPU differ there whatever the resume does (kernels that are not
    deterministic), or only after it."""
    import signal

    from conftest import check_run, run_script, training_lines_without_timings
    from safetensors.torch import load_file

    reference, stopped = tmp_path / "reference", tmp_path / "stopped"
    argv = [sys.executable, "online_dpo_async.py", *RESUMABLE_ON_GPU]
    run_script([*argv, "--output_dir", str(reference)], timeout=900)
    check_run(reference, "online_dpo_async.py")
    code, output = stop_after_steps([*argv, "--output_dir", str(stopped)], stopped, 12, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, output[-4000:]
    assert not (stopped / "policy").exists(), "the run ended before SIGTERM reached it: stop it earlier"
    checkpoint = sorted(p.name for p in (stopped / "checkpoints").iterdir())[-1]
    print(f"stopped with exit code {code}; resuming from {checkpoint}")
    run_script([*argv, "--output_dir", str(stopped), "--resume"], timeout=900)
    (train, evals), (expected_train, expected_evals) = map(training_lines_without_timings, (stopped, reference))
    differ = [line["step"] for line, expected in zip(train, expected_train) if line != expected]
    resumed_at = int(checkpoint.removeprefix("step_"))
    before = differ and differ[0] < resumed_at
    note = ": two runs on this GPU differ before any resume (its kernels are not deterministic)" if before else ""
    assert not differ, f"steps {differ} differ from the run never stopped; it resumed at step {resumed_at}{note}"
    assert len(train) == len(expected_train) and evals == expected_evals
    check_run(stopped, "online_dpo_async.py")
    final, expected = (load_file(d / "policy" / "model.safetensors") for d in (stopped, reference))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
