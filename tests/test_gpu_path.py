"""The GPU path's logic, checked on a CPU: engine placement and the GPU memory check, the names and snapshot of the
weight push, response-only logits, gradient checkpointing, FLOP counts. The method's functions are in all three files
(each stands alone), so each of their tests runs against every file; placement and the memory check are
plumbing/engine.py's, the weight push's names, snapshot and bucket plumbing/weights.py's, FLOP counting
plumbing/run_folder.py's. A bf16 run with gradient checkpointing: tests/test_online_dpo_runs.py. What needs a GPU is in
test_gpu.py."""

import importlib
import json
import math
import tempfile

import pytest
import torch
from conftest import ROOT, accelerate_launch, perturbed_policy, run_script, small_config

import plumbing
from plumbing.placement import (
    Placement,
    contiguous_parts,
    engine_line,
    engine_placement,
    engine_placements,
    engine_share,
    engine_shares,
    snapshot_memory,
    trained_memory,
)
from plumbing.weights import (
    _BUCKET_BYTES,
    SnapshotPlace,
    bucket_bytes,
    bucket_chunks,
    checkpoint_names,
    load_unit,
    model_snapshot,
    take_snapshot,
    views,
)

FILES = ["online_dpo_async", "rloo_async", "ppo_async"]
CPU_PLACE = SnapshotPlace(pinned=False, folder=tempfile.gettempdir())  # shared memory files, removed with their buffer


@pytest.fixture(params=FILES)
def algo(request):
    return importlib.import_module(request.param)


# ---------------------------------------------------------------------------------------------
# Engine placement
# ---------------------------------------------------------------------------------------------
def test_placement_on_a_cpu_has_no_gpu():
    assert engine_placement("auto", [], 2, None) == Placement(None, False, 0, 0.9)


def test_placement_one_gpu_is_shared_with_training():
    assert engine_placement("auto", ["0"], 1, None) == Placement("0", True, 0, None)
    assert engine_placement("auto", ["3"], 1, 0.45) == Placement("3", True, 0, 0.45)


def test_placement_n_plus_one_gpus_gives_the_engine_its_own(monkeypatch):
    # training uses visible GPUs 0..N-1; the engine the next one, alone: rank 0 writes the push's bucket there
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert engine_placement("auto", ["0", "1"], 1, None) == Placement("1", False, 1, None)
    assert engine_placement("auto", ["4", "5", "6", "7"], 3, None) == Placement("7", False, 3, None)
    # more GPUs than N + 1: the first spare one
    assert engine_placement("auto", ["0", "1", "2", "3"], 2, None) == Placement("2", False, 2, None)


def test_placement_can_be_forced(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert engine_placement("shared", ["0", "1"], 1, None) == Placement("0", True, 0, None)
    assert engine_placement("separate", ["0", "1"], 1, 0.5) == Placement("1", False, 1, 0.5)
    with pytest.raises(
        plumbing.UsageError,
        match=r"--vllm_placement separate: 2 training process\(es\) and the engine need 3 GPUs there, 2 are visible",
    ):
        engine_placement("separate", ["0", "1"], 2, None)


@pytest.mark.parametrize(
    "local, total, gpus, placement",
    [
        ("7", 14, 8, Placement("7", False, 7, None)),  # 2 nodes of 7 training processes: GPU 7 is spare
        ("8", 16, 8, Placement("0", True, 0, None)),  # 2 nodes of 8: none is, the engine shares rank 0's
        ("4", 8, 8, Placement("4", False, 4, None)),  # 2 nodes of 4 on 8-GPU nodes: the first spare one
    ],
)
def test_placement_past_one_node_counts_the_gpus_of_rank_0s_node(monkeypatch, local, total, gpus, placement):
    """Several nodes, simulated as a launcher sets them up (WORLD_SIZE, LOCAL_WORLD_SIZE): the engine runs on rank 0's
    node, so what counts is that node's GPUs against its training processes, not the global process count."""
    monkeypatch.setenv("WORLD_SIZE", str(total))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    assert engine_placement("auto", [str(i) for i in range(gpus)], total, None) == placement
    if placement.shared:
        with pytest.raises(
            plumbing.UsageError,
            match=r"8 training process\(es\) on rank 0's node, of 16 in all, and the engine need 9 GPUs there",
        ):
            engine_placement("separate", [str(i) for i in range(gpus)], total, None)


def test_several_engines_of_several_gpus_each_get_gpus_of_their_own_after_training(monkeypatch):
    """--vllm_num_engines E x --vllm_tensor_parallel_size P, hand-computed: with N + E x P GPUs, engine e gets GPUs
    N + e P .. N + e P + P - 1, its bucket on the first; with fewer, the engines share the first P (rank 0's among
    them); a layout that cannot be is one line naming the flags."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    eight = [str(i) for i in range(8)]
    assert engine_placements("auto", eight, 4, None, engines=2, tensor_parallel=2) == [
        Placement("4,5", False, 4, None),
        Placement("6,7", False, 6, None),
    ]
    assert engine_placements("auto", eight, 6, 0.8, engines=2, tensor_parallel=1) == [
        Placement("6", False, 6, 0.8),
        Placement("7", False, 7, 0.8),
    ]
    assert engine_placements("auto", eight, 1, None, engines=1, tensor_parallel=4) == [
        Placement("1,2,3,4", False, 1, None)
    ]
    # 7 training processes and 2 engines: 9 GPUs needed, 8 visible: both share rank 0's
    assert (
        engine_placements("auto", eight, 7, None, engines=2, tensor_parallel=1) == [Placement("0", True, 0, None)] * 2
    )
    # one GPU, two engines (the GPU check's stage): both on it
    assert (
        engine_placements("auto", ["3"], 1, None, engines=2, tensor_parallel=1) == [Placement("3", True, 0, None)] * 2
    )
    assert (
        engine_placements("shared", eight, 4, None, engines=2, tensor_parallel=2)
        == [Placement("0,1", True, 0, None)] * 2
    )
    # a CPU: every engine on it (the tests' two engines)
    assert engine_placements("auto", [], 1, None, engines=2, tensor_parallel=1) == [Placement(None, False, 0, 0.9)] * 2
    with pytest.raises(
        plumbing.UsageError,
        match=r"^--vllm_placement separate: 7 training process\(es\) and 4 engine GPUs \(--vllm_num_engines 2 x "
        r"--vllm_tensor_parallel_size 2\) need 11 GPUs there, 8 are visible; use --vllm_placement shared or fewer "
        r"engines or training processes$",
    ):
        engine_placements("separate", eight, 7, None, engines=2, tensor_parallel=2)
    with pytest.raises(
        plumbing.UsageError,
        match=r"^--vllm_tensor_parallel_size 2: each engine needs 2 GPUs, 1 are visible on rank 0's node$",
    ):
        engine_placements("auto", ["0"], 1, None, engines=1, tensor_parallel=2)
    with pytest.raises(plumbing.UsageError, match=r"^--vllm_tensor_parallel_size 2: no GPU is visible"):
        engine_placements("auto", [], 1, None, engines=1, tensor_parallel=2)


def test_a_batch_is_cut_into_contiguous_parts_one_per_engine_in_order():
    assert contiguous_parts(10, 2) == [slice(0, 5), slice(5, 10)]
    assert contiguous_parts(10, 3) == [slice(0, 4), slice(4, 7), slice(7, 10)]
    assert contiguous_parts(1, 2) == [slice(0, 1), slice(1, 1)]  # an engine with nothing to do is not called
    for count in range(12):
        for parts in range(1, 5):
            cut = contiguous_parts(count, parts)
            assert [i for part in cut for i in range(count)[part]] == list(range(count))
            assert max(len(range(count)[part]) for part in cut) - min(len(range(count)[part]) for part in cut) <= 1


def test_engines_sharing_rank_0s_gpu_share_one_budget(monkeypatch):
    """Two engines on rank 0's 80 GiB GPU, 40 GiB free, training to add 12 GiB, two buckets of 1 GiB and the CUDA
    contexts 2 GiB, 5 % (4 GiB) kept: (40 - 16 - 4) / 80 = 0.25 for both, 0.12 each; asked 0.1 each, 0.2 together
    fits, asked 0.15 each does not; six engines, with six buckets, would get (40 - 20 - 4) / 80 / 6 = 0.03 each."""
    gib = 2**30
    gpu = (40 * gib, 80 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: gpu)
    to_come = {"gradients": 8 * gib, "optimizer state": 4 * gib}
    shared = [Placement("0", True, 0, None)] * 2
    assert engine_shares(shared, to_come, gib) == ([Placement("0", True, 0, 0.12)] * 2, [80 * gib] * 2)
    asked = [Placement("0", True, 0, 0.1)] * 2
    assert engine_shares(asked, to_come, gib)[0] == asked
    with pytest.raises(
        plumbing.UsageError,
        match=r"^--vllm_num_engines 2 at --vllm_gpu_memory_utilization 0.15 each take 0.3 .*at most 0.25",
    ):
        engine_shares([Placement("0", True, 0, 0.15)] * 2, to_come, gib)
    many = [Placement("0", True, 0, None)] * 6
    with pytest.raises(plumbing.UsageError, match=r"^--vllm_num_engines 6: .* 0.03 of it each, less than 0.05"):
        engine_shares(many, to_come, gib)


def test_the_gpu_memory_check_counts_what_training_allocates_later():
    """Hand-computed, one shared 80 GiB GPU with 40 free once the models are loaded: training will add 8 + 4 GiB, the
    push's bucket 2 GiB (a model with a layer of 2 GiB) and the CUDA contexts 2 GiB (counted twice on a shared GPU, as both processes use
    it): 16 GiB; 5 % of the GPU (4 GiB) is kept. An engine at 0.3 (24 GiB) does not fit (44 > 40); at most
    (40 - 16 - 4) / 80 = 0.25 does."""
    gib = 2**30
    to_come, bucket = {"optimizer state": 8 * gib, "gradients": 4 * gib}, 2 * gib
    shared = Placement("0", True, 0, 0.3)
    gpu = (40 * gib, 80 * gib)
    with pytest.raises(plumbing.UsageError) as raised:
        engine_share(shared, gpu, gpu, to_come, bucket)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(
        "--vllm_gpu_memory_utilization 0.3: the engine would take 24.0 GiB"
    )
    assert "40.0 GiB free" in message and "training will add 16.0 GiB there (optimizer state 8.0 GiB" in message
    assert "the weight push's bucket 2.0 GiB" in message and "lower it to at most 0.25" in message
    assert engine_share(shared._replace(memory_utilization=0.25), gpu, gpu, to_come, bucket) == 0.25
    # left out, the share is the largest that fits, 0.25, within the 0.3 a shared GPU's engine gets at most
    assert engine_share(shared._replace(memory_utilization=None), gpu, gpu, to_come, bucket) == 0.25
    roomy = (60 * gib, 80 * gib)  # (60 - 16 - 4) / 80 = 0.5 would fit: the engine still gets 0.3
    assert engine_share(shared._replace(memory_utilization=None), roomy, roomy, to_come, bucket) == 0.3


def test_with_a_gpu_of_its_own_the_engine_holds_the_push_bucket_beside_its_share():
    """Hand-computed, N + 1 GPUs of 80 GiB: rank 0's must hold training's 12 GiB and 4 GiB kept (16 <= 20 free); the
    engine's holds its share, the push's bucket of 1 GiB (an 8B policy in bf16, whose largest layer is 0.98 GiB) and
    the CUDA contexts of rank 0 and the engine: at most (80 - 1 - 2 - 4) / 80 = 0.9125 fits, 0.91, whatever the
    async level; left out, the engine gets vLLM's 0.9. A whole 16 GiB snapshot there would leave (80 - 16 - 2 - 4) /
    80 = 0.725: 0.72. The snapshots, 3 at async level 1, take 48 GiB of rank 0's pinned host memory (torch rounds each
    block up to a power of two: 15 GiB take 16)."""
    gib = 2**30
    separate = Placement("7", False, 7, 0.9)
    to_come = {"optimizer state": 8 * gib, "gradients": 4 * gib}
    with pytest.raises(plumbing.UsageError, match="lower the model size, .* or shard the models"):
        engine_share(separate, (15 * gib, 80 * gib), (80 * gib, 80 * gib), to_come, 0)
    assert snapshot_memory(16 * gib, async_level=1) == snapshot_memory(15 * gib, 1) == 48 * gib
    assert snapshot_memory(16 * gib, async_level=3) == 80 * gib
    gpus = (20 * gib, 80 * gib), (80 * gib, 80 * gib)
    assert engine_share(separate, *gpus, to_come, gib) == 0.9
    with pytest.raises(plumbing.UsageError) as raised:
        engine_share(separate._replace(memory_utilization=0.95), *gpus, to_come, gib)
    message = str(raised.value)
    assert "the engine's GPU has 80.0 GiB free and the engine would take 76.0 GiB, beside the weight push's" in message
    assert "bucket of 1.0 GiB" in message and "lower it to at most 0.91" in message
    assert engine_share(separate._replace(memory_utilization=0.91), *gpus, to_come, gib) == 0.91
    assert engine_share(separate._replace(memory_utilization=None), *gpus, to_come, gib) == 0.9
    assert engine_share(separate._replace(memory_utilization=None), *gpus, to_come, 16 * gib) == 0.72
    # with a small policy, the engine gets vLLM's default, 0.9, not all the (80 - 2 - 4) / 80 = 0.92 that fit
    assert engine_share(separate._replace(memory_utilization=None), *gpus, to_come, 0) == 0.9


def test_a_2_8b_policy_sharing_one_gpu_gets_the_share_training_leaves():
    """Pythia-2.8B (2.78e9 parameters) on an 80 GiB GPU: fp32 policy and reference and a bf16 reward model leave
    58,099,345,920 bytes (54.1 GiB) free, which holds the engine's 0.3 (24 GiB, what the check looked at before) but
    not beside training's optimizer state and gradients (33.36e9 bytes), the push's bucket (1 GiB: the bf16 snapshot
    is 5.56e9 bytes, its largest layer 0.26e9) and the CUDA contexts (2 GiB): with 5 % kept, (58.10e9 - 36.58e9 -
    4.29e9) / 85.90e9 = 0.2005 fits: 0.2. (Beside a whole bf16 snapshot, 0.14; beside the three snapshots of async
    level 1, 16.7e9 bytes, none fitted.)"""
    gib, params = 2**30, 2.78e9
    trained = trained_memory(int(params), zero_stage=0, processes=1, bf16=True)  # fp32 under autocast
    assert trained == {"weights": 11_120_000_000, "gradients": 11_120_000_000, "optimizer state": 22_240_000_000}
    to_come = {part: trained[part] for part in ("gradients", "optimizer state")}
    free = 80 * gib - int(params * (4 + 4 + 2))
    gpu = (free, 80 * gib)
    with pytest.raises(plumbing.UsageError, match="lower it to at most 0.2, or give the engine a GPU of its own"):
        engine_share(Placement("0", True, 0, 0.3), gpu, gpu, to_come, gib)
    assert engine_share(Placement("0", True, 0, None), gpu, gpu, to_come, gib) == 0.2
    assert engine_share(Placement("0", True, 0, None), gpu, gpu, to_come, int(params) * 2) == 0.14


@pytest.mark.parametrize(
    "params, largest",
    [
        # Pythia-410m (405e6): its bf16 snapshot, 0.81e9 bytes, 0.75 GiB, is the bucket; (80 - 0.75 - 2 - 4) / 80 = 0.9156
        (405_334_016, 0.91),
        # Pythia-1b (1.01e9) and Llama-3.1-8B (8.03e9): a bucket of 1 GiB (larger than their largest layer, smaller
        # than their bf16 snapshot); (80 - 1 - 2 - 4) / 80 = 0.9125
        (1_011_781_632, 0.91),
        (8_030_261_248, 0.91),
    ],
)
def test_the_readme_commands_on_n_plus_1_gpus_get_an_engine_with_the_share_the_run_leaves(params, largest):
    """The README's `accelerate launch ... --num_processes 7 ... --async_level 1` on 8 GPUs of 80 GiB, the flag left
    out: the engine's GPU holds the push's bucket, and the engine gets the rest up to vLLM's 0.9. Rank 0's GPU is
    ZeRO-3's (some GiB free of training's share). Hand-computed shares."""
    gib = 2**30
    separate = Placement("7", False, 7, None)
    to_come = {"gradients": params * 2 // 7, "optimizer state": params * 12 // 7}
    gpus = (60 * gib, 80 * gib), (80 * gib, 80 * gib)
    bucket = min(params * 2, _BUCKET_BYTES)
    assert engine_share(separate, *gpus, to_come, bucket=bucket) == 0.9
    with pytest.raises(plumbing.UsageError, match=f"lower it to at most {largest} "):
        engine_share(separate._replace(memory_utilization=0.95), *gpus, to_come, bucket=bucket)


def test_the_engine_line_says_what_the_engine_got_and_that_its_first_start_compiles():
    """Printed at start: the device, the share and where it came from, the push's bucket and the snapshots in host
    memory; on a GPU with CUDA graphs, that the first start compiles, and the flag that skips it."""
    gib = 2**30
    placement = Placement("7", False, 7, 0.37)
    line = engine_line(placement, 80 * gib, 15 * gib, gib, 48 * gib, flag_given=False, eager=False)
    assert line.startswith("engine: GPU 7 of its own, 0.37 of its 80.00 GiB (the largest share the run leaves")
    assert "bucket of 1.00 GiB (the snapshots of 15.00 GiB: 48.00 GiB at most, in pinned host memory)" in line
    assert "first start compiles the model" in line and "--vllm_enforce_eager" in line
    eager = engine_line(placement, 80 * gib, 15 * gib, gib, 48 * gib, flag_given=True, eager=True)
    assert "(--vllm_gpu_memory_utilization)" in eager and "compiles" not in eager
    cpu = engine_line(Placement(None, False, 0, 0.9), 0, 3 * 2**20, 3 * 2**20, 9 * 2**20, False, True)
    assert cpu == "engine: on the CPU; weight snapshots of 3.00 MiB each"


def test_trained_memory_by_zero_stage_by_hand():
    """700 parameters over 7 processes: DeepSpeed's bf16 keeps 2 + 2 + 12 bytes a parameter, ZeRO-1 shards the 12,
    ZeRO-2 the gradients too, ZeRO-3 the weights too; without DeepSpeed, fp32 weights and gradients, 8 bytes of Adam."""
    assert trained_memory(700, 1, 7, True) == {"weights": 1400, "gradients": 1400, "optimizer state": 1200}
    assert trained_memory(700, 2, 7, True) == {"weights": 1400, "gradients": 200, "optimizer state": 1200}
    assert trained_memory(700, 3, 7, True) == {"weights": 200, "gradients": 200, "optimizer state": 1200}
    assert trained_memory(700, 3, 7, False) == {"weights": 400, "gradients": 400, "optimizer state": 800}
    assert trained_memory(700, 0, 7, True) == {"weights": 2800, "gradients": 2800, "optimizer state": 5600}


# ---------------------------------------------------------------------------------------------
# The weight push: checkpoint names, the snapshot
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gptneox", "qwen3_moe"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("loaded", [False, True])
def test_pushed_names_are_those_save_pretrained_writes(tokenizer, tmp_path, arch, tied, loaded):
    """The engine loads checkpoint names: GPTNeoX's in-memory `lm_head` is `embed_out` on disk, a tied output
    embedding is not written, and a mixture of experts' fused experts (one tensor of every expert's gate and up
    projections, one of their down projections) are one tensor per expert and projection, of the shapes on disk. A
    model built from its config and one loaded from a checkpoint (which carries transformers' load-time renames) must
    both give the saved file's keys and shapes."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(small_config(tokenizer, arch, tie_word_embeddings=tied))
    model.save_pretrained(tmp_path / "saved")
    if loaded:
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
        model.save_pretrained(tmp_path / "resaved")
    with safe_open(str(tmp_path / ("resaved" if loaded else "saved") / "model.safetensors"), "pt") as f:
        saved = {key: f.get_slice(key).get_shape() for key in f.keys()}
    names = checkpoint_names(model)
    assert {name: shape for parts in names.values() for name, shape in parts} == saved
    assert set(names) <= set(model.state_dict())
    if arch == "gptneox" and not tied:
        assert names["lm_head.weight"] == [("embed_out.weight", [len(tokenizer), 64])]
    if arch == "qwen3_moe":  # 4 experts of 32 x 64, gate and up fused: 4 gate and 4 up projections of 32 x 64
        parts = names["model.layers.1.mlp.experts.gate_up_proj"]
        assert [name for name, _ in parts] == [
            f"model.layers.1.mlp.experts.{e}.{projection}.weight"
            for projection in ("gate_proj", "up_proj")
            for e in range(4)
        ]
        assert all(shape == [32, 64] for _, shape in parts)


@pytest.mark.parametrize("arch", ["gptneox", "qwen3_moe"])
def test_snapshot_is_a_copy_in_the_engine_dtype_under_checkpoint_names(tokenizer, arch):
    """A snapshot holds every tensor of the checkpoint, in the engine's dtype (a model's fp32 values rounded to bf16 as
    the engine holds them), under its name on disk (a mixture of experts' split per expert as save_pretrained splits
    them), with the fingerprint of the model's own tensors: the sum and the sum of squares of the values as the dtype
    rounds them, here summed exactly (math.fsum) by hand."""
    from safetensors.torch import load_file

    model = perturbed_policy(tokenizer, arch, tied=False, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        on_disk = load_file(f"{folder}/model.safetensors")
    for dtype in (torch.float32, torch.bfloat16):
        weights = model_snapshot(model, 3, dtype, CPU_PLACE)
        assert weights.version == 3 and weights.flat.dtype == dtype
        assert weights.flat.numel() == sum(p.numel() for p in model.parameters())
        pushed = dict(views(weights.flat, weights.layout))
        assert pushed.keys() == on_disk.keys() == weights.fingerprint.keys()
        for name, tensor in on_disk.items():
            assert torch.equal(pushed[name], tensor.to(dtype)), name
            values = tensor.to(dtype).double().flatten().tolist()
            exact = (math.fsum(values), math.fsum(v * v for v in values))
            assert weights.fingerprint[name] == pytest.approx(exact, rel=1e-13, abs=1e-13), name
    # a copy: the optimizer writing the parameters afterwards does not reach what the engine reads
    head = "embed_out.weight" if arch == "gptneox" else "lm_head.weight"
    before = pushed[head].clone()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # in memory; embed_out.weight in GPTNeoX's checkpoint
    assert torch.equal(pushed[head], before)
    # the layout's offsets tile the buffer without gaps or overlaps, a layer's tensors together
    layout = weights.layout
    ends = [offset + torch.Size(shape).numel() for _, shape, offset in layout]
    assert [offset for _, _, offset in layout] == [0, *ends[:-1]] and ends[-1] == weights.flat.numel()
    units = [load_unit(name) for name, _, _ in layout]
    starts = [unit for i, unit in enumerate(units) if i == 0 or units[i - 1] != unit]
    assert len(starts) == len(set(starts)) == len(set(units))


# ---------------------------------------------------------------------------------------------
# Trainer numerics and memory
# ---------------------------------------------------------------------------------------------
def slow_response_logprobs(model, q_ids, q_mask, r_ids, r_mask, temperature):
    """Logits of every position, then the ones that predict the response: the obvious version."""
    ids, mask = torch.cat([q_ids, r_ids], 1), torch.cat([q_mask, r_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits.float()
    logp = (logits / temperature).log_softmax(-1)
    out = torch.stack(
        [logp[:, q_ids.shape[1] - 1 + t].gather(1, r_ids[:, t : t + 1]).squeeze(1) for t in range(r_ids.shape[1])], 1
    )
    return out * r_mask


@pytest.mark.parametrize("arch", ["llama", "gptneox"])
def test_response_only_logits_give_the_logprobs_of_all_logits(algo, tokenizer, arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config(tokenizer, arch)).eval()
    q_ids, q_mask = algo.left_pad([[1, 5, 6, 7, 8], [1, 9], [1, 4, 4, 4, 4, 4, 4]], 9, tokenizer.pad_token_id)
    r_ids, r_mask, eos = algo.truncate_responses(
        [[5, 6, tokenizer.eos_token_id], [7] * 6, [8, 9]], 6, tokenizer.eos_token_id, tokenizer.pad_token_id
    )
    batch = algo.Batch(q_ids, q_mask, r_ids, r_mask, eos)
    with torch.no_grad():
        fast = algo.response_logprobs(model, batch, 0.7)
        slow = slow_response_logprobs(model, q_ids, q_mask, r_ids, r_mask, 0.7)
    assert fast.shape == slow.shape == (3, 6)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-5)
    with torch.no_grad():  # with the entropy (PPO's): the same logprobs, from the same logits
        with_entropy, _ = algo.response_logprobs(model, batch, 0.7, entropy=True)
    assert torch.equal(with_entropy, fast)


def test_gradient_checkpointing_gives_the_same_gradients(algo, tokenizer):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = small_config(tokenizer, "llama")
    plain, checkpointed = AutoModelForCausalLM.from_config(config), AutoModelForCausalLM.from_config(config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    q_ids, q_mask = algo.left_pad([[1, 5, 6], [1, 9, 9, 9]], 5, tokenizer.pad_token_id)
    r_ids, r_mask, eos = algo.truncate_responses([[5, 6], [7, 7, 7]], 4, tokenizer.eos_token_id, tokenizer.pad_token_id)
    batch = algo.Batch(q_ids, q_mask, r_ids, r_mask, eos)
    grads = []
    for model in (plain, checkpointed):
        model.train()
        algo.response_logprobs(model, batch, 1.0).sum().backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert checkpointed.is_gradient_checkpointing and not plain.is_gradient_checkpointing
    for key in grads[0]:
        torch.testing.assert_close(grads[1][key], grads[0][key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gptneox"])
@pytest.mark.parametrize("tied", [False, True])
def test_forward_flops_by_hand(tokenizer, arch, tied):
    """2 FLOPs per parameter and token: the body's parameters for every token, the output head's for the logit
    positions only, the input embedding (a lookup) for none; a tied head is the embedding, counted as the head."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = small_config(tokenizer, arch, tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_config(config)
    embedding = len(tokenizer) * 64  # vocabulary x hidden
    total = sum(p.numel() for p in model.parameters())
    body = total - embedding - (0 if tied else embedding)
    assert plumbing.forward_flops(model, 3, 20, 5) == 2 * 3 * (body * 20 + embedding * 5)
    assert plumbing.forward_flops(model, 3, 20) == 2 * 3 * (body + embedding) * 20
    scorer = AutoModelForSequenceClassification.from_config(small_config(tokenizer, arch, num_labels=1))
    assert plumbing.forward_flops(scorer, 2, 10) == 2 * 2 * 10 * (
        sum(p.numel() for p in scorer.parameters()) - embedding
    )


def test_a_snapshot_missing_a_tensor_of_the_policy_is_refused(tokenizer):
    """A partial push would leave the engine generating with stale tensors: refuse it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(small_config(tokenizer, "llama"))
    state = model.state_dict()
    names = checkpoint_names(model)
    del state["model.norm.weight"]
    # (name, tensor) pairs, as ZeRO-3 gathers them, that never reach a tensor of the checkpoint
    with pytest.raises(RuntimeError, match="lack 1 tensor.*model.norm.weight"):
        take_snapshot(1, iter(state.items()), names, torch.float32, CPU_PLACE)


ZERO3_PROBE = """import sys, tempfile, torch
sys.path.insert(0, {root!r})
from transformers import AutoModelForCausalLM
from safetensors.torch import save_file
import plumbing
from plumbing.weights import SnapshotPlace, model_snapshot, views
import {module} as algo

processes = plumbing.Processes(plumbing.RunArgs(dtype="float32"), local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
accelerator = processes.accelerator
assert processes.zero_stage == 3
with processes.whole_models():
    whole = AutoModelForCausalLM.from_pretrained({policy!r})
model = AutoModelForCausalLM.from_pretrained({policy!r})  # sharded as it loads
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
policy, (model, optimizer) = model, accelerator.prepare(model, optimizer)
module = accelerator.unwrap_model(model)
place = SnapshotPlace(pinned=False, folder=tempfile.gettempdir())
snapshots = plumbing.PolicySnapshots(processes, policy, place)  # as the script's main() makes them: once prepared
assert all(p.numel() == 0 for p in module.parameters()), "not sharded"
sharded = snapshots.take(model, 1)
plain = model_snapshot(whole, 1, torch.float32, place)
assert sharded.fingerprint == plain.fingerprint, "the fingerprint of the gathered parameters"
save_file(dict(views(sharded.flat, sharded.layout)), {out!r} + "/zero3.safetensors")
save_file(dict(views(plain.flat, plain.layout)), {out!r} + "/plain.safetensors")
"""

# PPO's push under ZeRO-3: the policy and the value model are one prepared module; the push gathers the policy's
# parameters only. deepspeed.zero.GatheredParameters is wrapped to record what each gather asks for (a spy: the
# gathers themselves are DeepSpeed's).
ZERO3_PPO_PROBE = """import json, sys, tempfile, torch, deepspeed
sys.path.insert(0, {root!r})
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification
import plumbing
from plumbing.weights import SnapshotPlace, model_snapshot, views
import ppo_async as algo

gathered, Gather = [], deepspeed.zero.GatheredParameters
def spy(params, *args, **kwargs):
    gathered.extend(id(p) for p in params)
    return Gather(params, *args, **kwargs)
deepspeed.zero.GatheredParameters = spy
processes = plumbing.Processes(plumbing.RunArgs(dtype="float32"), local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
accelerator = processes.accelerator
with processes.whole_models():
    whole = AutoModelForCausalLM.from_pretrained({policy!r})
policy = AutoModelForCausalLM.from_pretrained({policy!r})
value = AutoModelForSequenceClassification.from_pretrained({policy!r}, num_labels=1)
model = algo.PolicyAndValue(policy, value)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model, optimizer = accelerator.prepare(model, optimizer)
module = accelerator.unwrap_model(model)
place = SnapshotPlace(pinned=False, folder=tempfile.gettempdir())
snapshots = plumbing.PolicySnapshots(processes, policy, place, prefix="policy.")  # as ppo_async.py's main(): prepared
gathered.clear()  # loading sharded models gathers too: only the push's gathers count
sharded = snapshots.take(model, 1)
plain = model_snapshot(whole, 1, torch.float32, place)
ids = {{id(p): name for name, p in module.named_parameters()}}
pairs = zip(views(sharded.flat, sharded.layout), views(plain.flat, plain.layout))
print(json.dumps({{"gathered": sorted(ids[i] for i in set(gathered)), "parameters": sorted(ids.values()),
    "equal": all(torch.equal(a, b) for (_, a), (_, b) in pairs) and sharded.fingerprint == plain.fingerprint}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", [("gptneox", False), ("llama", True)])
def test_the_snapshot_pushed_under_zero3_is_the_unsharded_one(tokenizer, tmp_path, arch, tied):
    """Under DeepSpeed ZeRO-3 (one CPU process, fp32) the policy is sharded from the moment it loads; the push
    (plumbing.PolicySnapshots.take) gathers it a layer at a time (plumbing.distributed.gathered_tensors) into the
    snapshot, which equals, name for name and bit for bit, the snapshot of the same weights never sharded."""
    from safetensors.torch import load_file

    policy = tmp_path / "policy"
    perturbed_policy(tokenizer, arch, tied, seed=3).save_pretrained(policy)
    probe = tmp_path / "probe.py"
    probe.write_text(
        ZERO3_PROBE.format(root=str(ROOT), module="online_dpo_async", policy=str(policy), out=str(tmp_path))
    )
    launch = accelerate_launch("--config_file", "configs/deepspeed_zero3.yaml")
    run_script([*launch, "--num_processes", "1", "--mixed_precision", "no", str(probe)], timeout=300)
    sharded, plain = load_file(tmp_path / "zero3.safetensors"), load_file(tmp_path / "plain.safetensors")
    assert sharded.keys() == plain.keys() and len(plain) > 10
    assert all(torch.equal(sharded[name], plain[name]) for name in plain)


@pytest.mark.slow
def test_ppo_s_push_under_zero3_gathers_the_policy_and_never_the_value_model(tokenizer, tmp_path):
    """PPO's policy and value model are one module under ZeRO-3; the push gathers every parameter of the policy (its
    snapshot equals the unsharded one) and none of the value model's: gathering a 7.5B value model at every push
    only to drop it would double the push's traffic."""
    policy = tmp_path / "policy"
    perturbed_policy(tokenizer, "llama", True, seed=3).save_pretrained(policy)
    probe = tmp_path / "probe.py"
    probe.write_text(ZERO3_PPO_PROBE.format(root=str(ROOT), policy=str(policy)))
    launch = accelerate_launch("--config_file", "configs/deepspeed_zero3.yaml")
    stdout = run_script([*launch, "--num_processes", "1", "--mixed_precision", "no", str(probe)], timeout=300).stdout
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["equal"]
    assert report["gathered"] == [name for name in report["parameters"] if name.startswith("policy.")]
    assert any(name.startswith("value_model.") for name in report["parameters"])


def test_the_push_bucket_takes_whole_layers_and_a_tensor_larger_than_its_least():
    """plumbing.weights.bucket_bytes: _BUCKET_BYTES (1 GiB), or the snapshot if smaller, or the largest layer if larger:
    here a single tensor, an embedding of 768 Mi elements, 1.5 GiB in bf16. bucket_chunks cuts the snapshot into runs
    of whole layers (load_unit: q/k/v and gate/up, which vLLM fuses, always in one load) that fill the bucket in
    order, each layout's offsets counted from the bucket's start: the embedding; layers 0 to 2 (3 x 192 Mi) and the
    norm; the head. A layer split in the snapshot, or larger than the bucket, is refused."""
    mi = 2**20
    layers = {
        f"model.layers.{i}.{part}.weight": n for i in range(3) for part, n in [("q_proj", 64 * mi), ("up", 128 * mi)]
    }
    sizes = {"model.embed_tokens.weight": 768 * mi, **layers, "model.norm.weight": 4096, "lm_head.weight": 768 * mi}
    assert bucket_bytes(sizes, element_size=2) == 768 * mi * 2  # 1.5 GiB
    assert bucket_bytes(sizes, element_size=2) > _BUCKET_BYTES
    small = {"model.layers.0.q_proj.weight": mi, "model.norm.weight": 4096}
    assert bucket_bytes(small, element_size=2) == 2 * (mi + 4096)  # the whole snapshot
    assert bucket_bytes(small, element_size=2, least=1) == 2 * mi  # its largest layer
    layout, offset = [], 0
    for name, numel in sizes.items():
        layout.append((name, [numel], offset))
        offset += numel
    chunks = bucket_chunks(layout, capacity=768 * mi)
    assert [(chunk.start, chunk.end) for chunk in chunks] == [
        (0, 768 * mi),
        (768 * mi, 768 * mi + 576 * mi + 4096),
        (768 * mi + 576 * mi + 4096, offset),
    ]
    assert [name for chunk in chunks for name, _, _ in chunk.layout] == list(sizes)
    assert chunks[1].layout[:2] == [
        ("model.layers.0.q_proj.weight", [64 * mi], 0),
        ("model.layers.0.up.weight", [128 * mi], 64 * mi),
    ]
    assert all(chunk.end - chunk.start <= 768 * mi for chunk in chunks)
    with pytest.raises(RuntimeError, match="model.embed_tokens: 805306368 elements, a bucket of 536870912"):
        bucket_chunks(layout, capacity=512 * mi)
    split = [layout[1], layout[3], layout[2]]  # layer 0's up after layer 1's q_proj
    with pytest.raises(RuntimeError, match="the tensors of model.layers.0 are not together"):
        bucket_chunks(split, capacity=768 * mi)


def test_a_layer_of_experts_is_one_load_unit_whatever_its_experts_numbers():
    """A mixture of experts' layer as its checkpoint holds it: each expert's projections carry the expert's number after
    the layer's (model.layers.1.mlp.experts.3.up_proj.weight), and vLLM fuses all of a layer's experts into one
    parameter, processed once every one came in a load. The unit is the layer: the bucket holds the largest layer, more
    than its largest tensor, and a push cuts the snapshot between layers, never between experts: here the embedding (60
    elements); layer 0 and layer 1 (116 each: q 16, 4 experts x 3 projections of 8, a norm of 4); the norm and the
    head (56 + 60 = 116, a run that fills the bucket exactly)."""
    assert load_unit("model.layers.1.mlp.experts.3.up_proj.weight") == "model.layers.1"
    assert load_unit("model.layers.12.block_sparse_moe.experts.7.w2.weight") == "model.layers.12"
    sizes = {"model.embed_tokens.weight": 60}
    for layer in (0, 1):
        sizes[f"model.layers.{layer}.self_attn.q_proj.weight"] = 16
        for expert in range(4):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                sizes[f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"] = 8
        sizes[f"model.layers.{layer}.input_layernorm.weight"] = 4
    sizes |= {"model.norm.weight": 56, "lm_head.weight": 60}
    assert bucket_bytes(sizes, element_size=2, least=1) == 2 * 116
    layout, offset = [], 0
    for name, numel in sizes.items():
        layout.append((name, [numel], offset))
        offset += numel
    chunks = bucket_chunks(layout, capacity=116)
    assert [(chunk.start, chunk.end) for chunk in chunks] == [(0, 60), (60, 176), (176, 292), (292, 408)]
    assert [{load_unit(name) for name, _, _ in chunk.layout} for chunk in chunks] == [
        {"model.embed_tokens"},
        {"model.layers.0"},
        {"model.layers.1"},
        {"model.norm", "lm_head"},
    ]


def test_engines_on_gpus_of_their_own_get_their_share_from_each_gpu_s_free_memory(monkeypatch):
    """engine_shares with two engines on GPUs 6 and 7 of their own beside rank 0's GPU 0 (each GPU's free memory its
    own, as torch.cuda.mem_get_info reads it): the engine on GPU 7, all 80 GiB free, gets vLLM's 0.9; the one on GPU 6,
    50 GiB free (another process holds 30), (50 - 1 - 2 - 4) / 80 = 0.5375: 0.53, by hand; neither gets rank 0's 20
    GiB free. Rank 0's GPU is checked against its own: with 15 GiB free it cannot take training's 12 GiB and the 4
    kept, though the engines' GPUs could."""
    gib = 2**30
    free = {0: 20 * gib, 6: 50 * gib, 7: 80 * gib}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[device], 80 * gib))
    to_come = {"optimizer state": 8 * gib, "gradients": 4 * gib}
    placements = [Placement("6", False, 6, None), Placement("7", False, 7, None)]
    shares, totals = engine_shares(placements, to_come, gib)
    assert [placement.memory_utilization for placement in shares] == [0.53, 0.9] and totals == [80 * gib] * 2
    free[0] = 15 * gib
    with pytest.raises(plumbing.UsageError, match=r"^rank 0's GPU has 15.0 GiB free once the models are loaded"):
        engine_shares(placements, to_come, gib)


def test_the_engine_on_a_gpu_samples_without_flashinfer_where_it_is_not_installed():
    """vLLM's FlashInfer sampler is its default on a GPU, and an engine without the flashinfer package fails as it
    starts: the engine's environment turns it off there, and leaves it to FlashInfer where installed and to the
    user's own setting either way."""
    from plumbing.engine import sampler_settings

    assert sampler_settings({}, flashinfer_installed=False) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert sampler_settings({}, flashinfer_installed=True) == {}
    assert sampler_settings({"VLLM_USE_FLASHINFER_SAMPLER": "1"}, flashinfer_installed=False) == {}
    assert sampler_settings({"VLLM_USE_FLASHINFER_SAMPLER": "0"}, flashinfer_installed=True) == {}
