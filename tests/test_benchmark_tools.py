"""benchmark/ helpers on hand-made inputs."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmark"))
import inflight  # noqa: E402
import timing  # noqa: E402


def write_run(path, generation, weight_sync, training, step, lag=1, wait=0.0, timeline=False):
    lines = [
        {
            "step": i,
            "episode": i,
            "async/lag": min(i, lag),
            "time/generation": generation,
            "time/weight_sync": weight_sync,
            "time/training": training,
            "time/scoring": 0.1,
            "time/update": training - 0.2,
            "time/wait_for_rollouts": wait,
            "time/step": step,
        }
        for i in range(6)
    ]
    if timeline:  # steps start 1 s apart from step 2 on, so the timed steps (2, 3, 4) take 1 s, not time/step
        for i, m in enumerate(lines):
            m["timeline/step_start"] = 0.5 * i if i < 2 else i - 1.0
    lines.insert(1, {"step": 0, "episode": 0, "eval/win_rate": 0.5})  # evaluation lines are skipped
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_timing_summary_by_hand(tmp_path):
    sync = timing.summarize(write_run(tmp_path / "sync.jsonl", 0.3, 0.1, 0.5, 0.9, lag=0, wait=0.35))
    assert (sync["G"], sync["T"], sync["step"], sync["async_level"], sync["steps"]) == pytest.approx(
        (0.4, 0.5, 0.9, 0, 4)
    )
    assert sync["efficiency"] == pytest.approx(0.5 / 0.9) and sync["push share"] == pytest.approx(0.1 / 0.9)
    assert sync["phases"] == pytest.approx({"time/scoring": 0.1, "time/update": 0.3})
    assert (sync["snapshot and rest"], sync["outside"]) == pytest.approx((0.1, 0.9 - 0.35 - 0.5))
    overlapped = timing.summarize(write_run(tmp_path / "async.jsonl", 0.3, 0.1, 0.5, 0.5))
    assert overlapped["efficiency"] == pytest.approx(1.0)
    timed = timing.summarize(write_run(tmp_path / "timeline.jsonl", 0.3, 0.1, 0.5, 0.5, timeline=True))
    assert (timed["step"], timed["steps"], timed["outside"]) == pytest.approx((1.0, 3, 0.5))
    out = subprocess.run(
        [sys.executable, "benchmark/timing.py", str(tmp_path / "sync.jsonl"), str(tmp_path / "async.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "| ideal speed-up (G + T) / max(G, T) | 1.80x |" in out
        and "| measured speed-up: sync step / async step | 1.80x |" in out
    )
    assert (
        "| pipeline efficiency: max(G, T) / async step | 100.0% |" in out
        and "| weight push share of the async step | 20.0% |" in out
    )
    assert (
        "| **G**: generation + weight push (s) | 0.4000 | 0.4000 |" in out
        and "|   update (s) | 0.3000 | 0.3000 |" in out
    )
    reversed_order = subprocess.run(
        [sys.executable, "benchmark/timing.py", str(tmp_path / "async.jsonl"), str(tmp_path / "sync.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "speed-up" not in reversed_order  # the comparison needs the synchronous run first


def test_model_flop_utilisation_by_hand(tmp_path):
    """--peak_tflops adds, per trainer phase, the FLOPs the script logged over the phase's time and the peak:
    scoring 2e12 FLOPs in 0.1 s at a 100 TFLOP/s peak is 20 %; a phase without logged FLOPs gets no row."""
    path = write_run(tmp_path / "run.jsonl", 0.3, 0.1, 0.5, 0.9)
    lines = [json.loads(line) for line in open(path)]
    for m in lines:
        if "async/lag" in m:
            m["flops/scoring"] = 2e12
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = timing.summarize(path)
    assert summary["flops"] == {"time/scoring": 2e12}
    assert (
        timing.utilisation(summary, "time/scoring", 100.0) == "20.0%"
        and timing.utilisation(summary, "time/update", 100.0) == "-"
    )
    out = subprocess.run(
        [sys.executable, "benchmark/timing.py", "--peak_tflops", "100", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "| model FLOP utilisation: scoring | 20.0% |" in out and "utilisation: update" not in out
    )  # no FLOPs logged for it
    assert "utilisation" not in timing.report([path])  # no peak given: no utilisation rows


# ---------------------------------------------------------------------------------------------
# The memory plan
# ---------------------------------------------------------------------------------------------
def test_memory_plan_by_hand():
    """Random Pythia-1b online DPO, ZeRO-2 over 4 training processes, bf16, micro-batch 8 prompts (16 sequences) of 512
    + 53 tokens, async level 1, 5 GPUs of 79 GiB: every part by hand from Pythia-1b's 1,011,781,632 parameters
    (805,736,448 without the embeddings), its reward model's (the causal LM less its 50304 x 2048 output embedding,
    plus a 2048 x 1 score head), the ZeRO paper's 2 + 2 + 12 bytes, Korthikanti et al.'s 34 s b h."""
    import memory

    P, hidden, layers, vocab = 1_011_781_632, 2048, 16, 50304
    R = P - vocab * hidden + hidden
    command = "accelerate launch --config_file configs/deepspeed_zero2.yaml --num_processes 4 online_dpo_async.py"
    command += " --sft_model_path pythia1b --reward_model_path pythia1b --max_prompt_length 512 --response_length 53"
    command += " --local_micro_batch_size 8 --local_rollout_forward_batch_size 64 --vllm_gpu_memory_utilization 0.7"
    gib = memory.GIB
    result = memory.plan(command.split(), 79 * gib, None)
    rank0, engine = result["gpus"]["training rank 0"], result["gpus"]["engine's GPU"]
    assert result["gpus"]["training ranks 1 ..."] == rank0  # no gold judge
    s, b = 565, 16
    expected = {
        "trained models' weights": 2 * P,
        "trained models' gradients": 2 * P // 4,
        "trained models' optimizer state": 12 * P // 4,
        "reference policy": 2 * P,  # bf16 parameters, as DeepSpeed's bf16 holds the policy's
        "reward model": 2 * R,
        "activations of a micro-batch": layers * 34 * s * b * hidden + 12 * b * 54 * vocab,
        "largest no-grad forward": 34 * s * 64 * hidden + 12 * 64 * 54 * vocab,
        "CUDA context": gib,
    }
    assert rank0 == expected
    assert engine == {
        "engine (vLLM's share)": int(0.7 * 79 * gib),
        # plumbing.weights._BUCKET_BYTES, whatever the async level: the bf16 snapshot (2 x P) is larger, the largest
        # layer (embed_in, 50304 x 2048 x 2 bytes) smaller
        "the weight push's bucket": gib,
        "rank 0's CUDA context (it writes the bucket)": gib,
        "engine's CUDA context": gib,
    }
    # async level 1: 3 snapshots in pinned host memory, each of 2,023,563,264 bytes in a block of 2**31 (torch rounds a
    # pinned block up to a power of two)
    assert result["host"] == {"weight snapshots, pinned (3)": 3 * 2**31}
    text, fits = memory.table(result, 79 * gib)
    assert fits and f"| **total** | **{sum(expected.values()) / gib:.1f}** |" in text
    assert "rank 0's host memory: weight snapshots, pinned (3) 6.0 GiB" in text


def test_under_zero3_everything_but_the_gold_judge_is_sharded():
    import memory

    P = 1_011_781_632
    command = "accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 4 ppo_async.py"
    command += (
        " --sft_model_path pythia1b --reward_model_path pythia1b --gold_judge pythia-6.9b --gradient_checkpointing"
    )
    gpus = memory.plan(command.split(), 79 * memory.GIB, None)["gpus"]
    V = P - 50304 * 2048 + 2048  # the value model starts from the reward model
    assert gpus["training rank 0"]["trained models' weights"] == 2 * (P + V) // 4
    assert gpus["training rank 0"]["reference policy"] == 2 * P // 4
    assert gpus["training rank 0"]["reward model"] == 2 * V // 4
    assert 13.2e9 < gpus["training rank 0"]["gold judge (rank 0 only)"] < 13.4e9  # whole, bf16: 6.65B parameters
    assert "gold judge (rank 0 only)" not in gpus["training ranks 1 ..."]


PYTHIA_410M, HIDDEN, LAYERS, VOCAB = 405_334_016, 1024, 24, 50304
ZERO1 = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 1
num_machines: 1
num_processes: 2
mixed_precision: bf16
"""


@pytest.mark.parametrize("placement", ["shared GPU", "DDP", "ZeRO-1", "ZeRO-3"])
def test_the_memory_plan_of_every_placement_by_hand(placement, tmp_path):
    """Random Pythia-410m online DPO (bf16 on GPUs), micro-batch 4 prompts (8 sequences) of 512 + 53 tokens, no-grad
    forwards of 16, async level 1, GPUs of 79 GiB, every part by hand from its 405,334,016 parameters (R for its reward
    model: less the 50304 x 1024 output embedding, plus a 1024 x 1 head): one process sharing its GPU with the engine
    (0.3 of it), no DeepSpeed; and the engine on a GPU of its own (0.9) beside 2 training processes, without DeepSpeed
    (fp32 weights and gradients under autocast, 8 bytes of AdamW state, a fp32 reference), under ZeRO-1 (bf16 weights,
    gradients and reference, 12 bytes of state over the 2) and ZeRO-3 (all of it over the 2). The push's bucket is the
    bf16 snapshot, 2 P bytes (smaller than 1 GiB); the host holds 3 snapshots, each in a pinned block of 1 GiB."""
    import memory

    P, gib = PYTHIA_410M, memory.GIB
    R = P - VOCAB * HIDDEN + HIDDEN
    (tmp_path / "zero1.yaml").write_text(ZERO1)
    launch = {
        "shared GPU": "python",
        "DDP": "accelerate launch --config_file configs/multi_gpu.yaml --num_processes 2",
        "ZeRO-1": f"accelerate launch --config_file {tmp_path / 'zero1.yaml'} --num_processes 2",
        "ZeRO-3": "accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 2",
    }[placement]
    command = f"{launch} online_dpo_async.py --sft_model_path pythia410m --reward_model_path pythia410m"
    command += " --max_prompt_length 512 --response_length 53 --local_micro_batch_size 4"
    command += " --local_rollout_forward_batch_size 16"
    result = memory.plan(command.split(), 79 * gib, 1 if placement == "shared GPU" else None)
    weights, gradients, state, reference, reward = {
        "shared GPU": (4 * P, 4 * P, 8 * P, 4 * P, 2 * R),
        "DDP": (4 * P, 4 * P, 8 * P, 4 * P, 2 * R),
        "ZeRO-1": (2 * P, 2 * P, 12 * P // 2, 2 * P, 2 * R),
        "ZeRO-3": (2 * P // 2, 2 * P // 2, 12 * P // 2, 2 * P // 2, 2 * R // 2),
    }[placement]
    s = 565
    rank = {
        "trained models' weights": weights,
        "trained models' gradients": gradients,
        "trained models' optimizer state": state,
        "reference policy": reference,
        "reward model": reward,
        "activations of a micro-batch": LAYERS * 34 * s * 8 * HIDDEN + 12 * 8 * 54 * VOCAB,
        "largest no-grad forward": 34 * s * 16 * HIDDEN + 12 * 16 * 54 * VOCAB,
        "CUDA context": gib,
    }
    if placement == "shared GPU":
        shared = rank | {"engine (vLLM's share)": int(0.3 * 79 * gib), "the weight push's bucket": 2 * P}
        assert result["gpus"] == {"training rank 0, shared with the engine": shared | {"engine's CUDA context": gib}}
        assert result["summary"].startswith("online_dpo_async.py: 0.41B policy, 1 training process(es), no ZeRO,")
    else:
        engine = {"engine (vLLM's share)": int(0.9 * 79 * gib), "the weight push's bucket": 2 * P}
        engine |= {"rank 0's CUDA context (it writes the bucket)": gib, "engine's CUDA context": gib}
        expected = {"training rank 0": rank, "engine's GPU": engine, "training ranks 1 ...": rank}
        assert result["gpus"] == expected
        stage = {"DDP": ", no ZeRO,", "ZeRO-1": ", ZeRO-1,", "ZeRO-3": ", ZeRO-3,"}[placement]
        assert (
            f"2 training process(es){stage} micro-batch 4 x 565 tokens, async level 1, 3 GPUs of 79 GiB"
            in (result["summary"])
        )
    assert result["host"] == {"weight snapshots, pinned (3)": 3 * gib}
    text, fits = memory.table(result, 79 * gib)
    totals = [sum(gpu.values()) for gpu in result["gpus"].values()]
    assert fits == all(total <= 0.95 * 79 * gib for total in totals) and fits
    assert "| **total** | " + " | ".join(f"**{t / gib:.1f}**" for t in totals) + " |" in text


@pytest.mark.parametrize("bench", ["tldr", "no_robots", "gsm8k"])
def test_every_benchmark_experiment_fits_and_docs_show_its_plan(bench):
    """Each command the benchmark script prints (DRY_RUN=1) fits its GPUs by the plan, and benchmark/plans/memory.md
    shows the plans as the tool prints them today."""
    import memory

    commands = subprocess.run(
        ["bash", f"benchmark/{bench}.sh"], cwd=ROOT, env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True
    ).stdout.splitlines()
    results = memory.plans(commands, int(79 * memory.GIB), None)
    assert results and all(fits for _, _, fits in results), [names for names, _, fits in results if not fits]
    shown = "\n".join(f"{', '.join(f'`{name}`' for name in names)}:\n\n{text}\n" for names, text, _ in results)
    page = (ROOT / "benchmark" / "plans" / "memory.md").read_text()
    assert f"## {bench}.sh\n\n{shown.strip()}\n" in page, f"benchmark/plans/memory.md: the {bench}.sh plans changed"


@pytest.mark.parametrize("tool, page", [("memory.py", "memory.md"), ("plan.py", "runs.md")])
def test_the_planners_write_the_committed_plan_pages(tool, page, tmp_path):
    """`--scripts_page` writes the page of every benchmark script's plans that the repository holds, byte for byte
    (a changed script, model or formula without the page rewritten fails here), and leaves no temporary file."""
    written = tmp_path / "plans" / page
    proc = subprocess.run(
        [sys.executable, f"benchmark/{tool}", "--scripts_page", str(written)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert written.read_text() == (ROOT / "benchmark" / "plans" / page).read_text(), (
        f"run: python benchmark/{tool} --scripts_page benchmark/plans/{page}"
    )
    assert [p.name for p in written.parent.iterdir()] == [page]


def test_the_memory_plan_of_engines_of_their_own_by_hand():
    """Pythia-410m online DPO as in the placements above (no DeepSpeed), 2 training processes, and 2 engines of 2 GPUs
    each (--vllm_num_engines 2 --vllm_tensor_parallel_size 2): 6 GPUs by default, the 4 engine GPUs alike, each with
    vLLM's share of it (0.9 left out), the push's bucket (the bf16 snapshot, 2 P bytes) and the CUDA contexts of rank 0
    and the engine. On 5 GPUs the engines would not have GPUs of their own: refused, naming the flags; so are 0 engines."""
    import memory

    P, gib = PYTHIA_410M, memory.GIB
    command = "accelerate launch --config_file configs/multi_gpu.yaml --num_processes 2 online_dpo_async.py"
    command += " --sft_model_path pythia410m --reward_model_path pythia410m --max_prompt_length 512"
    command += " --response_length 53 --local_micro_batch_size 4 --local_rollout_forward_batch_size 16"
    command += " --vllm_num_engines 2 --vllm_tensor_parallel_size 2"
    result = memory.plan(command.split(), 79 * gib, None)
    assert list(result["gpus"]) == ["training rank 0", "each engine GPU (2 x 2)", "training ranks 1 ..."]
    assert result["gpus"]["each engine GPU (2 x 2)"] == {
        "engine (vLLM's share)": int(0.9 * 79 * gib),
        "the weight push's bucket": 2 * P,
        "rank 0's CUDA context (it writes the bucket)": gib,
        "engine's CUDA context": gib,
    }
    assert "2 training process(es), no ZeRO, 2 engine(s) of 2 GPU(s), micro-batch 4 x 565 tokens" in result["summary"]
    assert result["summary"].endswith("6 GPUs of 79 GiB")
    with pytest.raises(SystemExit, match=r"--vllm_num_engines 2 x --vllm_tensor_parallel_size 2 engine GPUs beside 2 "):
        memory.plan(command.split(), 79 * gib, 5)
    with pytest.raises(SystemExit, match="--vllm_num_engines must be >= 1"):
        memory.plan(command.replace("--vllm_num_engines 2", "--vllm_num_engines 0").split(), 79 * gib, None)


def test_the_help_benchmark_times_every_algorithm_file():
    """benchmark/help_time.py's command as docs/flags.md shows it, with one run: a row per algorithm file, min <=
    median <= max seconds (no time is asserted: a benchmark measures, a test does not)."""
    from dev.copies import ALGORITHM_FILES

    proc = subprocess.run(
        [sys.executable, "benchmark/help_time.py", "--runs", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split(" | ") for line in proc.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ALGORITHM_FILES
    for _, seconds in rows:
        low, median, high = (float(x) for x in seconds.split(" / "))
        assert 0 < low <= median <= high


def test_the_in_flight_benchmark_s_medians_and_table_by_hand(tmp_path):
    """benchmark/inflight.py: a run's medians leave out its first three steps and its evaluation lines; the table
    holds the median of the rounds' medians and the ratio of the modes, none where whole-batch's figure is ~0."""
    steps = [(9.0, 9.0, 9.0, 1.0)] * 3 + [(1.0, 0.5, 0.0, 100.0), (2.0, 0.7, 0.0, 300.0), (4.0, 0.9, 0.0, 200.0)]
    keys = ("time/step", "time/generation", "time/wait_for_rollouts", "throughput/tokens_per_second")
    lines = [json.dumps(dict(zip(keys, figures))) for figures in steps] + [json.dumps({"eval/win_rate": 0.5})]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    whole = inflight.medians(tmp_path / "metrics.jsonl")
    assert whole == {"step": 2.0, "generation": 0.7, "waiting": 0.0, "tokens/s": 200.0}
    other = {"step": 3.0, "generation": 1.4, "waiting": 0.5, "tokens/s": 100.0}
    text = inflight.table({"whole batch": [whole], "in-flight": [other, {**other, "step": 5.0}]})
    assert text.splitlines()[2:] == [
        "| whole batch | 2.000 | 0.700 | 0.000 | 200.000 |",
        "| in-flight | 4.000 | 1.400 | 0.500 | 100.000 |",
        "| in-flight / whole batch | 2.00x | 2.00x | - | 0.50x |",
    ]
