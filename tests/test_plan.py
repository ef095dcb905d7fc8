"""benchmark/plan.py (the run plan: the engine's KV cache, its waves, the predicted phases) on hand-computed numbers."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmark"))
import memory  # noqa: E402
import plan  # noqa: E402

GIB = 2**30
H100 = plan.Hardware(
    gpu_bytes=int(79 * GIB),
    bandwidth=3.35e12,
    peak_flops=989e12,
    mfu=0.4,
    engine_reserve=2 * GIB,
    max_num_seqs=1024,
    block_size=16,
)
# The No Robots online DPO command of docs/reproducing.md's memory plans, with no_robots.sh's accumulation and episodes
# (which the memory plan does not need): 2 x 9 prompts x 7 processes = 126 prompts x 2 samples = 252 completions.
NO_ROBOTS = (
    "accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 7 online_dpo_async.py"
    " --sft_model_path models/llama-3.1-8b-sft-no-robots --reward_model_path models/llama-3.1-8b-rm-no-robots"
    " --task no_robots --max_prompt_length 512 --response_length 1024 --local_micro_batch_size 2"
    " --local_rollout_forward_batch_size 8 --gradient_checkpointing --gradient_accumulation_steps 9"
    " --total_episodes 100044"
)
LLAMA_8B = 8_030_261_248  # parameters; 128256 x 4096 = 525,336,576 each in the input and the output embedding


def test_kv_per_token_of_llama_3_8b():
    """32 layers x 8 KV heads x 128 head dim x 2 (K and V) x 2 bytes (bf16) = 131072 bytes, 128 KiB; a sequence of
    512 + 1024 tokens: 1536 x 128 KiB = 192 MiB. Pythia has no GQA: Pythia-1b's 8 heads of 256 over 16 layers also
    make 128 KiB."""
    llama = memory.Model("models/llama-3.1-8b-sft-no-robots")
    assert plan.kv_per_token(llama, 2) == 131072 == 32 * 8 * 128 * 2 * 2
    assert 1536 * plan.kv_per_token(llama, 2) == 192 * 2**20
    assert plan.kv_per_token(memory.Model("pythia1b"), 2) == 16 * 8 * 256 * 2 * 2


def test_no_robots_8b_at_a_share_of_0_3_generates_in_8_waves():
    """vLLM's share int(0.3 x 79 GiB) = 25,447,681,228 bytes, less the bf16 weights (2 x 8,030,261,248 =
    16,060,522,496) and the 2 GiB reserve: 7,239,675,084 bytes of KV cache (6.7 GiB), which holds
    7,239,675,084 // 201,326,592 = 35 sequences of 1536 tokens (192 MiB) of the step's 252: ceil(252 / 35) = 8 waves,
    7 of 35 and one of 7. Generation bounds the step: decoding 8 waves of 1024 tokens takes about 8 x 1024 reads of
    the 15 GiB of weights, 8 x 1024 x 16.06 GB / 3.35 TB/s = 40 s, against 12 s of training."""
    p = plan.make_plan(NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.3"], H100, None)
    assert p.kv_cache == int(0.3 * 79 * GIB) - 2 * LLAMA_8B - 2 * GIB == 7_239_675_084
    assert (p.holds, p.in_flight, p.completions, p.waves) == (35, 35, 252, 8)
    assert p.generation > 4 * p.training and p.fits
    assert plan.advice(p, H100).startswith("generation bounds the step") and "section 4.1" in plan.advice(p, H100)
    out = subprocess.run(
        [sys.executable, "benchmark/plan.py", "--", *NO_ROBOTS.split(), "--vllm_gpu_memory_utilization", "0.3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "| **sequences in flight** | **35 of the step's 252** (at most 1024, vLLM's max_num_seqs) |" in out
    assert "| **waves** | **8** |" in out and "| memory bandwidth | 3.35 TB/s | `--bandwidth` |" in out
    assert "| model FLOP utilisation (training, prefill, decode's FLOPs) | 0.40 | `--mfu` |" in out


def test_no_robots_8b_at_a_share_of_0_8_holds_the_batch_only_with_a_smaller_reserve():
    """int(0.8 x 79 GiB) = 67,860,483,276 bytes less 16,060,522,496 of weights and 2 GiB: 49,652,477,132 bytes hold
    246 sequences of 201,326,592: 6 short of 252, a second wave. A reserve of 0.5 GiB leaves 51,263,089,868 bytes, 254
    sequences: the whole batch in 1 wave. The memory plan fits: 63.2 GiB of share beside the push's bucket (1 GiB)
    and two CUDA contexts, 66.2 GiB of the 75.05 (95 %) it allows; beside a whole bf16 snapshot (15 GiB) it did not."""
    command = NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.8"]
    p = plan.make_plan(command, H100, None)
    assert (p.kv_cache, p.holds, p.in_flight, p.waves, p.fits) == (49_652_477_132, 246, 246, 2, True)
    p = plan.make_plan(command, H100._replace(engine_reserve=GIB // 2), None)
    assert (p.kv_cache, p.holds, p.in_flight, p.waves) == (51_263_089_868, 254, 252, 1)


@pytest.mark.parametrize("async_level", [0, 1, 3])
def test_left_out_the_share_is_what_the_run_would_give_the_engine(async_level):
    """plumbing.placement.engine_share on an empty engine's GPU of 79 GiB: the push's bucket of 1 GiB
    (plumbing.weights._BUCKET_BYTES: the 8B's largest layer, its embedding of 128256 x 4096 x 2 bytes, is 0.98 GiB)
    whatever the async level, the CUDA contexts of rank 0 and the engine and 5 % of the GPU leave (79 GiB - 1 - 2 -
    3.95) / 79 GiB = 0.912, 0.91, of which it takes vLLM's default 0.9 (rank 0's GPU, with 7.2 GiB of models loaded
    and 14.9 GiB of gradients and optimizer state to come, fits): KV for 288 sequences, the step's 252 at once. Beside
    a whole bf16 snapshot (15 GiB) it got 0.73, 217 sequences. The snapshots, async level + 2 of them, are in rank 0's
    pinned host memory, 16 GiB each (torch's pinned blocks are powers of 2)."""
    p = plan.make_plan(NO_ROBOTS.split() + ["--async_level", str(async_level)], H100, None)
    total = 79 * GIB
    assert int(100 * (total - GIB - 2 * GIB - 0.05 * total) / total) / 100 == 0.91
    assert int(100 * (total - 2 * LLAMA_8B - 2 * GIB - 0.05 * total) / total) / 100 == 0.73  # the whole snapshot
    assert p.share == 0.9 and p.share_source.startswith("left out") and p.fits and (p.holds, p.in_flight) == (288, 252)
    assert 2**34 >= 2 * LLAMA_8B
    host = f"{async_level + 2} in rank 0's pinned host memory ({16 * (async_level + 2)}.0 GiB)"
    assert f"async level + 2 = {host}; the engine's GPU holds the push's bucket beside vLLM's share (1.0 GiB)." in (
        plan.report(p, H100)
    )


def test_on_a_shared_gpu_the_share_left_out_leaves_room_for_the_push_s_bucket():
    """Pythia-410m online DPO alone on a 16 GiB GPU (no DeepSpeed, bf16 autocast), the share left out: rank 0's GPU
    holds fp32 policy and reference (4 + 4 bytes a parameter), the bf16 reward model and a CUDA context once the models
    are loaded; the gradients and AdamW state to come (4 + 8 bytes), the push's bucket (the bf16 snapshot, 2 bytes a
    parameter: smaller than 1 GiB), two CUDA contexts and 5 % of the GPU must fit beside the engine:
    int(100 x (free - needed - 0.05 x total) / total) / 100 = 0.2 (0.24 without the bucket)."""
    P = 405_334_016
    R = P - 50304 * 1024 + 1024
    total = 16 * GIB
    free = total - (4 * P + 4 * P + 2 * R + GIB)
    needed = 12 * P + 2 * P + 2 * GIB
    assert int(100 * (free - needed - 0.05 * total) / total) / 100 == 0.2
    assert int(100 * (free - needed + 2 * P - 0.05 * total) / total) / 100 == 0.24  # had the bucket been forgotten
    command = "python online_dpo_async.py --sft_model_path pythia410m --reward_model_path pythia410m"
    command += " --max_prompt_length 512 --response_length 53 --local_micro_batch_size 4"
    p = plan.make_plan(command.split(), H100._replace(gpu_bytes=total), 1)
    assert p.shared and (p.share, p.share_source) == (
        0.2,
        "left out: the largest the run leaves, plumbing.placement.engine_share",
    )
    assert plan.engine_layouts(p, H100) == []
    assert plan.report(p, H100).endswith(
        "The run's 1 GPU(s) leave none to an engine of 1 GPU(s) of its own beside a training process."
    )


def test_no_robots_8b_at_the_scripts_share_holds_the_step_and_generation_still_bounds_it():
    """no_robots.sh's 0.91, the largest the memory plan fits beside the 1 GiB bucket: int(0.91 x 79 GiB) =
    77,191,299,727 bytes less 16,060,522,496 of weights and the 2 GiB reserve leave 58,983,293,583 bytes of KV cache,
    292 sequences of 201,326,592: the step's 252 in one wave. Generation still bounds the step at async level 1: one
    wave of 1024 decoding steps, each reading the 16 GB of weights and the KV, and the prefill, 19.8 s, against 12.2
    s of training."""
    p = plan.make_plan(NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.91", "--async_level", "1"], H100, None)
    assert p.kv_cache == int(0.91 * 79 * GIB) - 2 * LLAMA_8B - 2 * GIB == 58_983_293_583
    assert (p.holds, p.in_flight, p.completions, p.waves, p.fits) == (292, 252, 252, 1, True)
    assert p.generation > p.training and (round(p.generation, 1), round(p.training, 1)) == (19.8, 12.2)


def test_pythia_1b_tldr_step_by_hand():
    """tldr.sh's online DPO at 1b (policy and reward model), K = 2, 4 training processes, micro-batch 8 x 8 accumulated,
    512 + 53 tokens, the engine's share 0.7. Pythia-1b: 1,011,781,632 parameters, 805,736,448 in the body (less the
    input and output embeddings, 50304 x 2048 = 103,022,592 each); its reward model's body 805,738,496 (the score
    head's 2048 in it). FLOP rate: 989e12 x 0.4 = 395.6e12 FLOP/s.

    KV cache: int(0.7 x 79 GiB) = 59,377,922,867 - 2 x 1,011,781,632 (bf16 weights) - 2 GiB = 55,206,875,955 bytes;
    a sequence: 565 tokens in 36 blocks of 16 = 576 x 131072 = 75,497,472 bytes: 731 sequences, more than the step's
    256 x 2 = 512: 1 wave of 512.
    Decode: 53 steps, each reading 2,023,563,264 bytes of weights and 512 x 131072 x (512 + 53 / 2) bytes of KV =
    38,161,686,528 bytes in 11.39 ms at 3.35 TB/s (its FLOPs, 2 x 512 x 908,759,040 = 9.3e11, take 2.35 ms: memory-
    bound): 0.604 s. Prefill: 2 x 512 x (805,736,448 x 512 + 103,022,592) = 4.225e14 FLOPs: 1.068 s. G = 1.672 s.
    Training, per process of 64 prompts (128 sequences of 565 tokens, 54 logit positions), 3 passes: scoring
    2 x 128 x 805,738,496 x 565 = 1.165e14 (0.295 s), reference 2 x 128 x (805,736,448 x 565 + 103,022,592 x 54) =
    1.180e14 (0.298 s), update 3 x that (0.895 s): T = 1.487 s.
    Sync step 3.159 s, async 1.672 s: 1.89x; generation bounds it by 1.12x, too little for a second epoch (0.89 s)."""
    command = (
        "accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes 4 online_dpo_async.py --task tldr"
        " --sft_model_path mnoukhov/pythia1b-sft-tldr --reward_model_path mnoukhov/pythia1b-rm-tldr6.9b"
        " --max_prompt_length 512 --response_length 53 --total_episodes 131072 --local_micro_batch_size 8"
        " --gradient_accumulation_steps 8 --vllm_dtype bfloat16 --vllm_gpu_memory_utilization 0.7 --num_samples 2"
    )
    p = plan.make_plan(command.split(), H100, None)
    P, body, embedding, reward_body, rate = 1_011_781_632, 805_736_448, 50304 * 2048, 805_738_496, 989e12 * 0.4
    assert body == P - 2 * embedding
    assert p.kv_cache == int(0.7 * 79 * GIB) - 2 * P - 2 * GIB == 55_206_875_955
    assert (p.sequence_tokens, p.holds, p.in_flight, p.completions, p.waves) == (576, 731, 512, 512, 1)
    read = 2 * P + 512 * 131072 * (512 + 53 / 2)
    assert p.full_step.read == read == 38_161_686_528
    assert p.decode == pytest.approx(53 * read / 3.35e12) == pytest.approx(0.6038, abs=1e-4)
    assert p.full_step.compute == pytest.approx(2 * 512 * (body + embedding) / rate)
    assert p.prefill == pytest.approx(2 * 512 * (body * 512 + embedding) / rate) == pytest.approx(1.0681, abs=1e-4)
    reference = 2 * 128 * (body * 565 + embedding * 54)  # online_dpo_async.step_flops' phases, on the meta models
    assert p.phase_flops == {"scoring": 2 * 128 * reward_body * 565, "reference": reference, "update": 3 * reference}
    assert p.training == pytest.approx((2 * 128 * reward_body * 565 + 4 * reference) / rate)
    assert (p.generation, p.training) == (pytest.approx(1.672, abs=1e-3), pytest.approx(1.487, abs=1e-3))
    text = plan.report(p, H100)
    assert "| **async speed-up** | **1.89x** | sync / async |" in text
    assert "generation bounds the step: G = 1.1 x T" in text and "T = 2 would already make training bound" in text


def test_training_bound_online_dpo_is_told_how_many_samples_level_the_step():
    """The same run with T = 3 epochs (tldr.sh's figure 7 runs): 3 x 3 training passes of the policy (2.7 s) outweigh
    generation (1.7 s); the advice is section 4.2's K, the largest that keeps generation within training's time."""
    command = (
        "accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes 4 online_dpo_async.py --task tldr"
        " --sft_model_path mnoukhov/pythia1b-sft-tldr --reward_model_path mnoukhov/pythia1b-rm-tldr6.9b"
        " --max_prompt_length 512 --response_length 53 --total_episodes 131072 --local_micro_batch_size 8"
        " --gradient_accumulation_steps 8 --vllm_gpu_memory_utilization 0.7 --num_samples 2 --num_ppo_epochs 3"
    )
    p = plan.make_plan(command.split(), H100, None)
    assert p.training > p.generation
    text = plan.advice(p, H100)
    assert text.startswith("training bounds the step") and "section 4.2" in text
    most = int(text.split("Up to K = ")[1].split(" ")[0])
    at = lambda k: plan.predict(p.run._replace(samples=k), p.sizes, p.share, H100)  # noqa: E731
    assert at(most)["prefill"] + at(most)["decode"] <= sum(at(most)["phases"].values())
    assert at(most + 1)["prefill"] + at(most + 1)["decode"] > sum(at(most + 1)["phases"].values())


@pytest.mark.parametrize("bench", ["tldr", "no_robots", "gsm8k"])
def test_docs_show_every_benchmark_experiments_run_plan(bench):
    """benchmark/plans/runs.md's run plans are the tool's summary of each benchmark script's commands (DRY_RUN=1),
    today, and its assumptions table, as docs/reproducing.md's, is the tool's."""
    commands = subprocess.run(
        ["bash", f"benchmark/{bench}.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True
    ).stdout.splitlines()
    shown = plan.summary(plan.plans(commands, H100, None), H100)
    page = (ROOT / "benchmark" / "plans" / "runs.md").read_text()
    heading = f"`DRY_RUN=1 bash benchmark/{bench}.sh | python benchmark/plan.py`:"
    assert f"{heading}\n\n{shown}\n" in page, f"benchmark/plans/runs.md: the {bench}.sh run plans changed"
    assert f"{plan.assumptions(H100)}\n" in page
    assert f"{plan.assumptions(H100)}\n" in (ROOT / "docs" / "reproducing.md").read_text()


def test_docs_show_what_the_tool_prints_for_their_example():
    """The command docs/reproducing.md's run plans give runs, and they show its report as the tool prints it today."""
    docs = (ROOT / "docs" / "reproducing.md").read_text()
    section = docs[docs.index("### Run plans") :]
    command = next(line for line in section.splitlines() if line.startswith("python benchmark/plan.py -- "))
    p = plan.make_plan(command.removeprefix("python benchmark/plan.py -- ").split(), H100, None)
    assert f"The No Robots command above prints:\n\n{plan.report(p, H100)}\n" in section


def test_a_share_without_room_for_one_sequence_is_refused():
    """0.2 of 79 GiB (15.8 GiB) holds the 8B's 15 GiB of weights and the 2 GiB reserve, but no KV cache."""
    with pytest.raises(SystemExit, match="vLLM would not start"):
        plan.make_plan(NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.2"], H100, None)


# The No Robots online DPO command as 2 engines + 6 training processes on the same 8 GPUs (benchmark/no_robots.sh,
# VLLM_NUM_ENGINES=2): the same 126 prompts a step, 21 per process in 7 micro-batches of 3.
TWO_ENGINES = (
    NO_ROBOTS.replace("--num_processes 7", "--num_processes 6")
    .replace("--local_micro_batch_size 2", "--local_micro_batch_size 3")
    .replace("--gradient_accumulation_steps 9", "--gradient_accumulation_steps 7")
    + " --vllm_gpu_memory_utilization 0.91 --async_level 1"
)
LLAMA_8B_BODY = LLAMA_8B - 2 * 128256 * 4096  # forward_flops: the body, and the output head for each logit
LLAMA_8B_HEAD = 128256 * 4096


def test_no_robots_8b_on_two_engines_by_hand():
    """Each engine generates 63 of the 126 prompts x 2 = 126 completions: its GPU's KV cache (the same 58,983,293,583
    bytes as one engine's at 0.91) holds 292 sequences, so one wave of 126. A decoding step reads the weights and the
    wave's KV, 16,060,522,496 + 126 x 131072 x (512 + 1024 / 2) = 32,971,956,224 bytes, in 9.842 ms at 3.35 TB/s (its
    FLOPs, 2 x 126 x 7,504,924,672, take 4.78 ms): 1024 steps, 10.079 s. Prefill: 2 x 126 x (6,979,588,096 x 512 +
    525,336,576) FLOPs at 395.6 TFLOP/s, 2.277 s. G = 12.355 s against one engine's 19.80. Each of the 6 training
    processes trains 21 prompts where each of 7 trained 18: T = 12.197 x 21 / 18 = 14.230 s, and training bounds the
    step, 14.23 s against 19.80 s, 1.39x."""
    p = plan.make_plan(TWO_ENGINES.split() + ["--vllm_num_engines", "2"], H100, None)
    rate = 989e12 * 0.4
    assert (p.run.engines, p.run.processes, p.gpus, p.fits) == (2, 6, 8, True)
    assert p.kv_cache == 58_983_293_583 and p.kv_token == 131072
    assert (p.holds, p.completions, p.per_engine, p.in_flight, p.waves) == (292, 252, 126, 126, 1)
    read = 2 * LLAMA_8B + 126 * 131072 * (512 + 1024 // 2)
    assert p.full_step.read == read == 32_971_956_224
    assert p.full_step.compute == pytest.approx(2 * 126 * (LLAMA_8B_BODY + LLAMA_8B_HEAD) / rate)
    assert p.decode == pytest.approx(1024 * read / 3.35e12) == pytest.approx(10.0786, abs=1e-4)
    assert p.prefill == pytest.approx(2 * 126 * (LLAMA_8B_BODY * 512 + LLAMA_8B_HEAD) / rate)
    assert p.generation == pytest.approx(12.355, abs=1e-3)
    one = plan.make_plan(
        NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.91", "--async_level", "1"], H100, None
    )
    assert p.phase_flops == {phase: n * 21 // 18 for phase, n in one.phase_flops.items()}
    assert p.training == pytest.approx(one.training * 21 / 18) == pytest.approx(14.230, abs=1e-3)
    assert max(one.generation, one.training) / max(p.generation, p.training) == pytest.approx(1.39, abs=0.005)
    text = plan.report(p, H100)
    assert "2 engine(s) of 1 GPU(s) each, on GPUs of their own, each generating 1/2 of it" in text
    assert "| **sequences in flight** | **126 of an engine's 126, the step's 252 over 2** (at most 1024" in text
    assert "| **G**: generation (each engine) | **12.36** | prefill + decode |" in text
    assert "each engine GPU holds the push's bucket beside vLLM's share (1.0 GiB)." in text


def test_the_plan_finds_the_fewest_engines_at_which_training_bounds_the_step():
    """The paper's 1 + 7 on 8 GPUs: generation bounds the step (19.80 s against 12.20). The search keeps the step's
    batch and moves a GPU at a time from training to a new engine: at 2 engines + 6 training processes it predicts
    what the 2 + 6 command's own plan predicts (its per-process FLOPs, 7 / 6 of 18 prompts' = 21 prompts', exactly),
    training-bound, and stops there."""
    one = plan.make_plan(
        NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.91", "--async_level", "1"], H100, None
    )
    layouts = plan.engine_layouts(one, H100)
    assert [(p.run.engines, p.run.processes) for p in layouts] == [(1, 7), (2, 6)]
    assert layouts[0].generation == one.generation and layouts[0].training == one.training
    two = plan.make_plan(TWO_ENGINES.split() + ["--vllm_num_engines", "2"], H100, None)
    assert (layouts[1].phase_flops, layouts[1].generation, layouts[1].fits) == (two.phase_flops, two.generation, True)
    assert plan.training_bound(layouts) is layouts[1]
    text = plan.report(one, H100)
    assert "| 1 | 7 | 252 / 252 | 1 | 19.80 | 12.20 | 19.80 | generation | fits |" in text
    assert "| 2 | 6 | 126 / 126 | 1 | 12.36 | 14.23 | 14.23 | training | fits |" in text
    assert (
        "The fewest engines at which training bounds the step on these 8 GPUs: **2** (--vllm_num_engines 2 and 6 "
        "training processes), a step of **14.23 s** (this command's: 19.80 s, 1.39x)." in text
    )


def test_more_samples_need_more_engines_and_a_layout_that_does_not_fit_is_not_advised():
    """K = 16 on 4 GPUs, 3 training processes (54 prompts x 16 = 864 completions): 1 engine takes 65.79 s. With 2 or 3
    engines, the 8B's ZeRO-3 shards over 2 processes, or 1, leave rank 0's GPU too little for its gradients and optimizer
    state (plumbing.placement.engine_share): at no layout that fits does training bound the step. The same with the
    engine's share given: 2 engines and 2 training processes would be training-bound (38.78 s against 35.35 s), but the
    memory plan does not fit. K = 8 on 8 GPUs takes 4 engines, the largest of which generates 32 of the 126 prompts."""
    command = [w.replace("7", "3") if w == "7" else w for w in NO_ROBOTS.split()]
    command += ["--num_samples", "16", "--total_episodes", str(54 * 16 * 10)]
    p = plan.make_plan(command, H100, None)
    layouts = plan.engine_layouts(p, H100)
    assert (layouts[0].run.engines, layouts[0].fits) == (1, True) and len(layouts) == 3
    assert all(q.startswith("the run would not start: rank 0's GPU has ") for q in layouts[1:])
    assert "| 2 | 2 | | | | | | | the run would not start: rank 0's GPU has 56.1 GiB free" in plan.report(p, H100)
    assert plan.fewest_engines(p, layouts) == (
        "At no number of engines on these 4 GPUs does training bound the step in a layout that fits; the shortest step "
        "that fits is at 1 engine(s), 65.79 s (this command's: 65.79 s)"
    )
    p = plan.make_plan(command + ["--vllm_gpu_memory_utilization", "0.91"], H100, None)
    layouts = plan.engine_layouts(p, H100)
    assert [(q.run.engines, q.run.processes, q.fits) for q in layouts] == [(1, 3, True), (2, 2, False), (3, 1, False)]
    assert (round(layouts[1].generation, 2), round(layouts[1].training, 2)) == (35.35, 38.78)
    assert plan.training_bound(layouts) is None
    p = plan.make_plan(NO_ROBOTS.split() + ["--num_samples", "8", "--total_episodes", "100800"], H100, None)
    four = plan.training_bound(plan.engine_layouts(p, H100))
    assert (four.run.engines, four.run.processes, four.per_engine) == (4, 4, 32 * 8)  # 126 prompts: 32, 32, 31, 31


def test_an_engine_over_two_gpus_holds_half_the_weights_and_half_the_kv_heads_on_each():
    """--vllm_tensor_parallel_size 2, one engine beside the 6 training processes: each GPU holds 8,030,261,248 bytes of
    weights and 4 of the 8 KV heads, 65536 bytes a token: int(0.91 x 79 GiB) - 8,030,261,248 - 2 GiB = 67,013,554,831
    bytes hold 665 sequences of 1536 tokens, the step's 252 in one wave. A decoding step reads 8,030,261,248 + 252 x
    65536 x 1024 = 24,941,694,976 bytes on each GPU at once, 7.445 ms; the FLOPs are split over both: G = 9.90 s
    (vLLM's all-reduces between the two are not counted)."""
    p = plan.make_plan(TWO_ENGINES.split() + ["--vllm_tensor_parallel_size", "2"], H100, None)
    assert (p.run.engines, p.run.tensor_parallel, p.gpus) == (1, 2, 8)
    assert p.kv_cache == int(0.91 * 79 * GIB) - LLAMA_8B - 2 * GIB == 67_013_554_831 and p.kv_token == 65536
    assert (p.holds, p.in_flight, p.waves) == (665, 252, 1)
    assert p.full_step.read == LLAMA_8B + 252 * 65536 * 1024 == 24_941_694_976
    assert p.decode == pytest.approx(1024 * 24_941_694_976 / 3.35e12)
    assert p.prefill == pytest.approx(2 * 252 * (LLAMA_8B_BODY * 512 + LLAMA_8B_HEAD) / (2 * 989e12 * 0.4))
    assert p.generation == pytest.approx(9.90, abs=5e-3)
    text = plan.report(p, H100)
    assert "| an engine's KV cache, on each of its 2 GPUs | |" in text
    assert "| KV per token | 64.0 KiB: 32 layers x 4 KV heads x 128 head dim x 2 (K and V) x 2 bytes |" in text


def test_kv_heads_split_over_an_engine_s_gpus_or_copied():
    """Llama 3.1 8B's 8 KV heads over 1, 2, 4, 8 GPUs; over 16, each GPU holds a copy of one (vLLM replicates a KV head
    when there are fewer than GPUs). 32 attention heads do not split 3 ways: refused, naming the flag."""
    llama = memory.Model("models/llama-3.1-8b-sft-no-robots")
    assert [plan.kv_per_token(llama, 2, p) for p in (1, 2, 4, 8, 16)] == [32 * k * 128 * 2 * 2 for k in (8, 4, 2, 1, 1)]
    with pytest.raises(SystemExit, match=r"--vllm_tensor_parallel_size 3: vLLM splits the policy's 32 attention heads"):
        plan.make_plan(TWO_ENGINES.split() + ["--vllm_tensor_parallel_size", "3"], H100, None)
    with pytest.raises(SystemExit, match="--vllm_num_engines must be >= 1"):
        plan.make_plan(TWO_ENGINES.split() + ["--vllm_num_engines", "0"], H100, None)


def test_docs_show_the_no_robots_layouts_side_by_side():
    """benchmark/plans/runs.md's No Robots plans at VLLM_NUM_ENGINES=2 are the tool's summary of no_robots.sh's commands."""
    commands = subprocess.run(
        ["bash", "benchmark/no_robots.sh"],
        cwd=ROOT,
        env={**os.environ, "DRY_RUN": "1", "VLLM_NUM_ENGINES": "2"},
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    shown = plan.summary(plan.plans(commands, H100, None), H100)
    heading = "`VLLM_NUM_ENGINES=2 DRY_RUN=1 bash benchmark/no_robots.sh | python benchmark/plan.py`:"
    assert f"{heading}\n\n{shown}\n" in (ROOT / "benchmark" / "plans" / "runs.md").read_text()


def test_a_float32_run_plans_a_float32_engine():
    """--vllm_dtype auto is the trainer's dtype (plumbing.Processes): a --dtype float32 run's engine holds float32
    weights, 4 bytes a parameter, in the memory plan's snapshots (3 at async level 1, each pinned block rounded up to a
    power of two) and in the run plan's engine (its weights beside the KV cache); --vllm_dtype overrides it. Pythia-1b,
    1,011,781,632 parameters, one engine of its own at 0.7 of 79 GiB."""
    import math

    P = 1_011_781_632
    command = (
        "accelerate launch --num_processes 4 online_dpo_async.py --sft_model_path mnoukhov/pythia1b-sft-tldr"
        " --reward_model_path mnoukhov/pythia1b-rm-tldr6.9b --max_prompt_length 512 --response_length 53"
        " --total_episodes 131072 --local_micro_batch_size 8 --vllm_gpu_memory_utilization 0.7"
    )
    for flags, engine_bytes in [
        ("", 2),  # auto on GPUs: bf16
        ("--dtype float32", 4),
        ("--dtype float32 --vllm_dtype bfloat16", 2),
        ("--vllm_dtype float32", 4),
    ]:
        words = f"{command} {flags}".split()
        assert memory.read_command(words).engine_bytes == engine_bytes, flags
        host = memory.plan(words, int(79 * GIB), None)["host"]
        assert host == {"weight snapshots, pinned (3)": 3 * 2 ** math.ceil(math.log2(engine_bytes * P))}, flags
        assert plan.make_plan(words, H100, None).kv_cache == int(0.7 * 79 * GIB) - engine_bytes * P - 2 * GIB, flags


def test_with_lora_the_8b_no_robots_online_dpo_fits_on_one_gpu_and_the_plan_says_what_travels():
    """--lora_rank 8 on every linear layer of Llama 3.1 8B: 32 layers x 8 x (q 4096 + 4096, k and v 4096 + 1024 each,
    o 4096 + 4096, gate and up 4096 + 14336 each, down 14336 + 4096) = 20,971,520 adapter parameters, which alone train
    (AdamW's 12 bytes each under DeepSpeed's bf16, 0.23 GiB); the base model is frozen, whole, in bf16 (15.0 GiB), and
    no reference is loaded. On one H100 beside the engine (its share 0.3, rollout forwards of 4 sequences) rank 0's GPU
    fits where the paper's run takes 8 (ZeRO-3 over 7 training processes and the engine's); the snapshot is the
    adapter, 40 MiB in bf16, and the engine's GPU holds no push bucket. ZeRO-3 with LoRA is refused, as the run
    refuses it."""
    lora = NO_ROBOTS.replace("deepspeed_zero3.yaml --num_processes 7", "deepspeed_zero2.yaml --num_processes 1")
    lora = lora.split() + ["--lora_rank", "8", "--vllm_gpu_memory_utilization", "0.3"]
    lora += ["--local_rollout_forward_batch_size", "4"]
    policy = memory.Model("models/llama-3.1-8b-sft-no-robots")
    adapter = memory.adapter_parameters(policy, 8, "all-linear")
    by_layer = 8 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 2 * (4096 + 14336) + (14336 + 4096))
    assert adapter == 32 * by_layer == 20_971_520
    assert memory.adapter_parameters(policy, 8, "q_proj,v_proj") == 32 * 8 * ((4096 + 4096) + (4096 + 1024))
    result = memory.plan(lora, int(79 * GIB), gpus=1)
    (gpu,) = result["gpus"].values()
    assert "reference policy" not in gpu and memory.BUCKET not in gpu
    assert gpu["frozen base models (LoRA)"] == 2 * LLAMA_8B
    assert gpu["trained models' optimizer state"] == 12 * adapter and gpu["trained models' gradients"] == 2 * adapter
    text, fits = memory.table(result, int(79 * GIB))
    assert fits and "LoRA rank 8 (21.0M adapter parameters)" in text
    assert result["host"] == {
        "weight snapshots, pinned (3)": 3 * 2**26
    }  # 40 MiB in bf16, async level + 2 blocks of 64 MiB
    p = plan.make_plan(lora, H100, 1)
    assert plan.pushed_bytes(p.run) == 2 * adapter and plan.push_bucket(p.run) == 0 and p.fits
    zero3 = NO_ROBOTS.split() + ["--lora_rank", "8"]
    with pytest.raises(SystemExit, match="--lora_rank under ZeRO-3 is refused by the run"):
        memory.plan(zero3, int(79 * GIB), None)


def test_in_flight_updates_cut_decoding_to_the_tokens_the_completions_hold_and_no_further_than_training():
    """No Robots 8B at 0.91 (G 19.8 s: a 4.55 s prefill and one wave of 1024 decoding steps of 14.89 ms, 15.25 s; T
    12.20 s): completions averaging half the response length decode in 7.62 s, G = 12.18 s, under T, so the async step
    is training's, 19.80 / 12.20 = 1.62x, as at f = 0.25: nothing beyond training's time is gained; at f = 0.75 G =
    4.55 + 11.44 = 15.99 s bounds it (1.24x)."""
    p = plan.make_plan(NO_ROBOTS.split() + ["--vllm_gpu_memory_utilization", "0.91", "--async_level", "1"], H100, None)
    assert round(p.prefill, 2) == 4.55 and round(p.full_step.memory * 1e3, 2) == 14.89 and p.waves == 1
    assert round(p.decode, 2) == round(1024 * p.full_step.memory, 2) == 15.25
    generation, step = plan.inflight_step(p, 0.5)
    assert (round(generation, 2), round(step, 2)) == (12.18, 12.20) and step == p.training
    assert round(plan.inflight_step(p, 0.75)[1], 2) == 15.99
    assert plan.inflight_report(p).endswith(
        "f = 0.25: G = 8.37 s, async step 12.20 s (1.62x); f = 0.5: G = 12.18 s, async step 12.20 s (1.62x); "
        "f = 0.75: G = 15.99 s, async step 15.99 s (1.24x)."
    )
