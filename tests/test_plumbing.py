"""The plumbing's promises against hand-computed numbers, none starting an engine or a run (docs/tests.md): the proof of
a push (the fingerprints and plumbing.weights._check_loaded), snapshots in the engine's dtype, the statistics two
processes reduce, a non-finite loss, checkpoints written whole or not at all, the flags a resumed run may change, and a
step's timings. The push on a real engine: tests/test_engine.py."""

import json
import math
import multiprocessing
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_port, perturbed_policy

import online_dpo_async as dpo
import plumbing
import plumbing.checkpoints as checkpoints
import plumbing.receiver as receiver
import plumbing.run_folder as run_folder
import plumbing.weights as weights_module
import ppo_async as ppo
import rloo_async as rloo
from plumbing.weights import (
    _FINGERPRINT_RTOL,
    SnapshotPlace,
    Weights,
    _check_loaded,
    combined_fingerprints,
    fingerprint,
    snapshot_sizes,
    _unmatched_fingerprints,
    views,
)

# Private plumbing names (leading underscore) on purpose: this file tests the plumbing's parts one by one, by hand.


# ---------------------------------------------------------------------------------------------
# The proof of a push
# ---------------------------------------------------------------------------------------------
def exact_fingerprint(tensor: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """The sum and the sum of squares of the values as `dtype` rounds them, summed exactly (math.fsum)."""
    values = tensor.to(dtype).double().flatten().tolist()
    return math.fsum(values), math.fsum(v * v for v in values)


def test_a_fingerprint_is_the_sum_and_the_sum_of_squares_of_the_values_the_engine_s_dtype_holds(monkeypatch):
    """float32 values rounded to bfloat16 as the engine holds them, summed in float64: the exact sums to float64's
    rounding; the same in chunks (7 elements at a time here, 2**24 in a run), for a matrix and for its transpose."""
    torch.manual_seed(0)
    matrix = torch.randn(37, 29) * 3
    for dtype in (torch.float32, torch.bfloat16):
        expected = exact_fingerprint(matrix, dtype)
        assert fingerprint(matrix, dtype).tolist() == pytest.approx(expected, rel=1e-14)
        assert fingerprint(matrix.t(), dtype).tolist() == pytest.approx(expected, rel=1e-14)
    assert exact_fingerprint(matrix, torch.bfloat16) != pytest.approx(
        exact_fingerprint(matrix, torch.float32), rel=1e-6
    )
    monkeypatch.setattr(weights_module, "FINGERPRINT_CHUNK", 7)  # 1073 elements: 153 chunks and 2 left
    assert fingerprint(matrix, torch.bfloat16).tolist() == pytest.approx(
        exact_fingerprint(matrix, torch.bfloat16), 1e-14
    )


class RepackedLinear:
    """A stand-in for a linear layer whose weight vLLM's CPU backend repacked for its matmul library, leaving the
    parameter empty: its kernel alone, x W^T. A real one needs vLLM's process group (tests/test_engine.py reads them
    back in the engine's worker)."""

    def __init__(self, weight: torch.Tensor):
        self.input_size, self.weight, self.packed = weight.shape[1], torch.empty(0), weight.clone()

    def cpu_linear(self, x, weight, bias):
        assert weight.numel() == 0 and bias is None
        return x @ self.packed.T


def test_a_repacked_weight_is_read_back_whole_through_its_kernel_a_block_at_a_time(monkeypatch):
    """repacked_fingerprint multiplies the identity's rows by the layer's kernel: W's columns, exactly; in blocks of
    FINGERPRINT_CHUNK // inputs rows (5 of the 48 here: 9 blocks and 3 rows), as a layer of 14336 inputs is read (an
    8B's down projection: blocks of 1170) where the tests' layers are read in one."""
    torch.manual_seed(0)
    weight = torch.randn(40, 48)
    monkeypatch.setattr(weights_module, "FINGERPRINT_CHUNK", 48 * 5)
    monkeypatch.setattr(receiver, "FINGERPRINT_CHUNK", 48 * 5)
    for dtype in (torch.float32, torch.bfloat16):
        layer = RepackedLinear(weight.to(dtype))
        read = receiver._repacked_fingerprint(layer, dtype).tolist()
        assert read == pytest.approx(exact_fingerprint(weight, dtype), rel=1e-14)


def sent(*tensors: tuple[str, list[int], tuple[float, float]], version: int = 7) -> Weights:
    """A snapshot's layout and the trainer's fingerprint, by hand (the values are not needed: flat is empty)."""
    layout, offset = [], 0
    for name, shape, _ in tensors:
        layout.append((name, shape, offset))
        offset += math.prod(shape)
    return Weights(version, torch.empty(0), layout, {name: sums for name, _, sums in tensors})


# A layer of a mixture of experts as a checkpoint holds it, with the trainer's sums: q/k/v, which vLLM fuses into
# qkv_proj, and two experts' gate/up/down projections, which it fuses into w13_weight (gates and ups) and w2_weight.
SENT = sent(
    ("model.embed_tokens.weight", [8, 4], (1.0, 9.0)),
    ("model.layers.0.self_attn.q_proj.weight", [4, 4], (0.5, 4.0)),
    ("model.layers.0.self_attn.k_proj.weight", [2, 4], (0.25, 1.0)),
    ("model.layers.0.self_attn.v_proj.weight", [2, 4], (-0.75, 2.0)),
    ("model.layers.0.self_attn.o_proj.weight", [4, 4], (5.0, 5.0)),
    ("model.layers.0.mlp.experts.0.gate_proj.weight", [2, 4], (1.0, 1.0)),
    ("model.layers.0.mlp.experts.0.up_proj.weight", [2, 4], (2.0, 2.0)),
    ("model.layers.0.mlp.experts.0.down_proj.weight", [4, 2], (3.0, 3.0)),
    ("model.layers.0.mlp.experts.1.gate_proj.weight", [2, 4], (-1.0, 1.5)),
    ("model.layers.0.mlp.experts.1.up_proj.weight", [2, 4], (0.0, 2.5)),
    ("model.layers.0.mlp.experts.1.down_proj.weight", [4, 2], (1.0, 3.5)),
    ("model.layers.0.input_layernorm.weight", [4], (4.0, 4.0)),
    ("lm_head.weight", [8, 4], (-2.0, 7.0)),
)
# What the engine holds, by vLLM's names: the fused parameters' sums are their parts'
HELD = {
    "model.embed_tokens.weight": [1.0, 9.0],
    "model.layers.0.self_attn.qkv_proj.weight": [0.0, 7.0],
    "model.layers.0.self_attn.o_proj.weight": [5.0, 5.0],
    "model.layers.0.mlp.experts.routed_experts.w13_weight": [2.0, 7.0],
    "model.layers.0.mlp.experts.routed_experts.w2_weight": [4.0, 6.5],
    "model.layers.0.input_layernorm.weight": [4.0, 4.0],
    "lm_head.weight": [-2.0, 7.0],
}
QKV = {f"model.layers.0.self_attn.{p}_proj.weight": "model.layers.0.self_attn.qkv_proj.weight" for p in "qkv"}


@pytest.mark.parametrize("renamed", [{}, QKV], ids=["by prefix", "renamed by vLLM's mapper"])
def test_fused_parameters_are_compared_with_the_sum_of_their_parts(renamed):
    """Each tensor sent against the engine's parameter of its name; q/k/v against vLLM's qkv_proj, found by the
    mapper's name or by the longest prefix that holds a parameter no sent tensor names; the experts' projections
    against w13_weight and w2_weight together. 6 compared: the embedding, q/k/v, o_proj, the experts, the norm, the
    head."""
    assert _unmatched_fingerprints(SENT, HELD, renamed) == (6, [])
    # an expert's down projection, one of the norm's elements and the head's sign wrong: named in the snapshot's order
    wrong = HELD | {
        "model.layers.0.mlp.experts.routed_experts.w2_weight": [4.5, 6.5],
        "model.layers.0.input_layernorm.weight": [4.0, 4.5],
        "lm_head.weight": [2.0, 7.0],
    }
    compared, unmatched = _unmatched_fingerprints(SENT, wrong, renamed)
    assert compared == 6 and len(unmatched) == 3
    assert unmatched[0] == (
        "model.layers.0.mlp.experts.0.gate_proj.weight (and 5 more): sum 6.5, sum of squares 13.5 in the engine's "
        "model.layers.0.mlp.experts.routed_experts.w13_weight, model.layers.0.mlp.experts.routed_experts.w2_weight, "
        "6 and 13.5 in the trainer's"
    )
    assert unmatched[1].startswith("model.layers.0.input_layernorm.weight: sum 4, sum of squares 4.5 in the engine's")
    assert unmatched[2].startswith("lm_head.weight: sum 2, sum of squares 7 in the engine's lm_head.weight, -2 and 7")
    # q/k/v sent, the engine's qkv_proj left zeros (a load that never reached it)
    zeros = HELD | {"model.layers.0.self_attn.qkv_proj.weight": [0.0, 0.0]}
    assert _unmatched_fingerprints(SENT, zeros, renamed)[1] == [
        "model.layers.0.self_attn.q_proj.weight (and 2 more): sum 0, sum of squares 0 in the engine's "
        "model.layers.0.self_attn.qkv_proj.weight, 0 and 7 in the trainer's"
    ]


def test_the_fingerprints_agree_within_float64_s_rounding_of_their_sums_and_no_further():
    """A tensor of n elements with sum of squares Q: its sums may differ by _FINGERPRINT_RTOL of its scale, sqrt(n Q),
    and its sums of squares by _FINGERPRINT_RTOL of Q (float64's rounding of sums of the same values, added in another
    order); twice that is a different tensor."""
    n, q = 64 * 1024, 2.0**20  # scale sqrt(2**16 * 2**20) = 2**18
    weights = sent(("w", [64, 1024], (3.0, q)))
    for factor, matched in [(0.5, True), (2.0, False)]:
        off_sum = {"w": [3.0 + factor * _FINGERPRINT_RTOL * 2.0**18, q]}
        off_squares = {"w": [3.0, q + factor * _FINGERPRINT_RTOL * q]}
        assert (_unmatched_fingerprints(weights, off_sum, {})[1] == []) is matched
        assert (_unmatched_fingerprints(weights, off_squares, {})[1] == []) is matched
    assert math.sqrt(n * q) == 2.0**18


def load(version: int, run: int, compared: int = 3, differ: tuple = ()) -> dict:
    """What the engine's worker says after a load (WeightReceiver.load_shared_weights), by hand."""
    return {"version": version, "run": run, "compared": compared, "differ": list(differ)}


def test_check_loaded_stops_the_run_naming_the_version_and_what_differs():
    """plumbing.weights._check_loaded on what the engine said, by hand: the version and run each load read in the
    bucket, its parameters against the bucket and against the trainer's fingerprint, and the prefix cache's reset."""
    fingerprints = {"held": HELD, "renamed": {}}
    ok = [load(7, 0), load(7, 1)]
    _check_loaded(SENT, ok, fingerprints, cache_reset=True)
    _check_loaded(SENT, ok, fingerprints, cache_reset=None)  # an engine that does not say: not a failure
    failures = [
        ([load(7, 0), load(7, 0)], fingerprints, True, "its load 1 read run 0 of version 7 in the bucket"),
        ([load(6, 0), load(6, 1)], fingerprints, True, "its load 0 read run 0 of version 6 in the bucket"),
        ([load(7, 1), load(7, 0)], fingerprints, True, "its load 0 read run 1 of version 7 in the bucket"),
        (
            [load(7, 0), load(7, 1, 4, ["lm_head.weight"])],
            fingerprints,
            True,
            "1 of 7 tensors compared with the bucket differ, e.g. ['lm_head.weight']",
        ),
        (
            ok,
            {"held": HELD | {"lm_head.weight": [-2.0, 7.5]}, "renamed": {}},
            True,
            "1 of 6 differ from the trainer's fingerprint, first lm_head.weight: sum -2, sum of squares 7.5",
        ),
        (ok, {"held": {}, "renamed": {}}, True, "none of its parameters could be compared with the trainer's"),
        (ok, fingerprints, False, "its prefix cache was not reset"),
    ]
    for loads, held, cache_reset, what in failures:
        with pytest.raises(RuntimeError) as raised:
            _check_loaded(SENT, loads, held, cache_reset)
        assert str(raised.value).startswith(f"the engine does not hold policy version 7 after its push: {what}"), what


def test_the_probe_s_tolerance_is_32_epsilons_of_the_coarser_of_the_engine_s_dtype_and_the_trainer_s_precision():
    """plumbing.weights.probe_tolerance by hand: float32 everywhere on a CPU, 32 x 2^-23; an engine in bfloat16, 32 x
    2^-7 whatever the trainer; a float32 trainer on a GPU computes in TF32 (10 bits), 32 x 2^-10; a trainer under
    DeepSpeed's bfloat16 holds bfloat16 parameters."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert weights_module.probe_tolerance(f32, f32, on_gpu=False) == 32 * 2.0**-23
    assert weights_module.probe_tolerance(bf16, f32, on_gpu=False) == 32 * 2.0**-7
    assert weights_module.probe_tolerance(bf16, f32, on_gpu=True) == 32 * 2.0**-7
    assert weights_module.probe_tolerance(f32, f32, on_gpu=True) == 32 * 2.0**-10
    assert weights_module.probe_tolerance(f32, bf16, on_gpu=True) == 32 * 2.0**-7


def test_the_trainer_s_probe_is_each_token_s_logprob_given_those_before_it(tokenizer):
    """plumbing.weights.trainer_probe against a slow loop, one prefix at a time: the logprob of each token of the
    probe after the first, given those before it, at temperature 1; the probe's sequences (probe_token_ids) are the
    same at every call, 4 of 32 tokens of the vocabulary, or as many as the model has positions."""
    from conftest import small_config

    policy = perturbed_policy(tokenizer, "llama", tied=False, seed=0)
    probe = weights_module.probe_token_ids(policy.config)
    assert probe == weights_module.probe_token_ids(small_config(tokenizer))
    assert [len(ids) for ids in probe] == [32] * 4 and all(0 <= t < len(tokenizer) for ids in probe for t in ids)
    short = small_config(tokenizer, max_position_embeddings=3)
    assert [len(ids) for ids in weights_module.probe_token_ids(short)] == [3] * 4
    taken = weights_module.trainer_probe(policy, probe, torch.device("cpu"), tolerance=0.5)
    assert taken.token_ids == probe and taken.tolerance == 0.5
    with torch.no_grad():
        for ids, logprobs in zip(probe, taken.logprobs):
            slow = [
                policy(torch.tensor([ids[:t]])).logits[0, -1].log_softmax(-1)[ids[t]].item() for t in range(1, len(ids))
            ]
            assert logprobs == pytest.approx(slow, abs=1e-5)


def test_a_push_whose_probe_the_engine_computes_otherwise_stops_the_run():
    """plumbing.weights._check_loaded with a probe, by hand: the engine's logprobs within the tolerance of the
    trainer's on average pass (one token far off among many does too: the mean), beyond it the run stops in one line
    naming the version, the mean difference and the tolerance, once every other check has passed; differences either
    way do not cancel; an engine holding shorter sequences is compared on the tokens it has."""
    trainer = [[-1.0, -2.0, -3.0, -4.0], [-0.5, -1.5, -2.5, -3.5]]
    weights = SENT._replace(probe=weights_module.Probe([[0] * 5] * 2, trainer, tolerance=0.01))
    ok, fingerprints = [load(7, 0), load(7, 1)], {"held": HELD, "renamed": {}}
    near = [[value + 0.009 for value in row] for row in trainer]
    _check_loaded(weights, ok, fingerprints, cache_reset=True, probed=near)
    one_off = [[trainer[0][0] + 0.07, *trainer[0][1:]], trainer[1]]  # 0.07 / 8 = 0.00875
    _check_loaded(weights, ok, fingerprints, cache_reset=True, probed=one_off)
    _check_loaded(weights, ok, fingerprints, cache_reset=True, probed=[row[:2] for row in near])  # a shorter engine
    with pytest.raises(RuntimeError, match="its logprobs on the probe are 0.125 from"):  # its tokens' compared
        _check_loaded(
            weights, ok, fingerprints, cache_reset=True, probed=[[v + 0.125 for v in row[:2]] for row in trainer]
        )
    either_side = [[value + 0.2 * (-1) ** i for i, value in enumerate(row)] for row in trainer]  # they do not cancel
    with pytest.raises(RuntimeError, match="its logprobs on the probe are 0.2 from the trainer's on average"):
        _check_loaded(weights, ok, fingerprints, cache_reset=True, probed=either_side)
    far = [[value + 0.25 * (i % 2) for i, value in enumerate(row)] for row in trainer]  # 0.125 on average
    with pytest.raises(RuntimeError) as raised:
        _check_loaded(weights, ok, fingerprints, cache_reset=True, probed=far)
    assert str(raised.value) == (
        "the engine does not hold policy version 7 after its push: its logprobs on the probe are 0.125 from the "
        "trainer's on average, more than the 0.01 its dtype allows, its sums matching: it computes with some tensor's "
        "elements in another order"
    )
    with pytest.raises(RuntimeError, match="its prefix cache was not reset"):  # the checks before it come first
        _check_loaded(weights, ok, fingerprints, cache_reset=False, probed=far)


def test_snapshots_are_taken_in_the_engine_s_dtype_from_the_trainer_s_weights(tokenizer, tmp_path):
    """A float32 trainer whose engine runs bfloat16 (--vllm_dtype): PolicySnapshots.take copies the policy's
    parameters rounded to bfloat16, under their checkpoint names, with the fingerprint of the parameters (by hand);
    a checkpoint carries the versions still owed (owed), which a resumed run loads back the same (load); keep lets the
    others go."""
    from safetensors.torch import save_file

    # --dtype and --vllm_dtype auto: float32 on CPUs
    on_cpu = plumbing.Processes(
        plumbing.RunArgs(), local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0
    )
    assert (on_cpu.dtype, on_cpu.engine_dtype) == (torch.float32, torch.float32)
    processes = plumbing.Processes(
        plumbing.RunArgs(dtype="float32", vllm_dtype="bfloat16"),
        local_micro_batch_size=1,
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
    )
    assert (processes.dtype, processes.engine_dtype) == (torch.float32, torch.bfloat16)
    policy = perturbed_policy(tokenizer, "llama", tied=False, seed=0)
    snapshots = plumbing.PolicySnapshots(processes, policy, SnapshotPlace(pinned=False, folder=str(tmp_path)))
    taken = snapshots.take(policy, 1)
    state = policy.state_dict()
    assert taken.flat.dtype == torch.bfloat16 and taken.version == 1
    assert snapshot_sizes(snapshots.saved) == {name: state[name].numel() for name in state}
    for name, tensor in views(taken.flat, taken.layout):
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name
        assert taken.fingerprint[name] == pytest.approx(exact_fingerprint(state[name], torch.bfloat16), rel=1e-13)
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)  # the next update
    snapshots.take(policy, 2)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for version, tensors in snapshots.owed({1, 2}, before=2).items():  # theta_2 is the policy's weights
        save_file({name: t.clone() for name, t in tensors}, str(checkpoint / f"version_{version:06d}.safetensors"))
    assert sorted(p.name for p in checkpoint.iterdir()) == ["version_000001.safetensors"]
    snapshots.keep({2})
    assert sorted(snapshots.held) == [2]
    loaded = snapshots.load(str(checkpoint), 1)
    pairs, expected = dict(views(loaded.flat, loaded.layout)), dict(views(taken.flat, taken.layout))
    assert pairs.keys() == expected.keys() and all(torch.equal(pairs[name], expected[name]) for name in pairs)
    assert loaded.fingerprint.keys() == taken.fingerprint.keys()
    for name, sums in taken.fingerprint.items():
        assert loaded.fingerprint[name] == pytest.approx(sums, rel=1e-13), name
    assert sorted(snapshots.held) == [1, 2]


def test_the_fingerprint_is_of_the_trainer_s_weights_not_of_their_copy(tokenizer, tmp_path, monkeypatch):
    """A copy into the snapshot gone wrong (snapshot_weights made to plant a wrong value, a fault injected from
    outside): the fingerprint still says what the trainer's weights are, not what the snapshot holds, so an engine
    loading that snapshot would not match it."""
    copy = weights_module._snapshot_weights

    def wrong_copy(pairs, shapes, dtype, place):
        flat, layout = copy(pairs, shapes, dtype, place)
        flat[0] += 1.0  # injected test fault: the first element of the first tensor
        return flat, layout

    monkeypatch.setattr(weights_module, "_snapshot_weights", wrong_copy)
    model = perturbed_policy(tokenizer, "llama", tied=False, seed=0)
    weights = weights_module.model_snapshot(model, 1, torch.float32, SnapshotPlace(pinned=False, folder=str(tmp_path)))
    name, copied = views(weights.flat, weights.layout)[0]
    trainer = exact_fingerprint(model.state_dict()[name], torch.float32)
    assert weights.fingerprint[name] == pytest.approx(trainer, rel=1e-13)
    assert exact_fingerprint(copied, torch.float32) != pytest.approx(trainer, rel=1e-6)


# ---------------------------------------------------------------------------------------------
# What the processes compute together
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_loss_stops_the_run_before_a_checkpoint_has_it(loss):
    processes = plumbing.Processes(
        plumbing.RunArgs(dtype="float32"), local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0
    )
    stats = {"loss": torch.tensor(0.25), "kl": torch.tensor(2.0)}
    assert processes.mean(stats, 3, None) == {"loss": 0.25, "kl": 2.0}  # one process: its own numbers
    with pytest.raises(RuntimeError) as raised:
        processes.mean(stats | {"loss": torch.tensor(loss)}, 3, "runs/x/checkpoints/step_000002")
    assert str(raised.value) == (
        f"loss is {loss} at step 3: stopping before it reaches a checkpoint; the last good one is "
        "runs/x/checkpoints/step_000002 (--resume)"
    )


def reduce_on_two_processes(rank: int, port: int, out: str) -> None:
    """One of two training processes (gloo, as `accelerate launch --num_processes 2` on a CPU sets them up), each the
    one of its machine (LOCAL_WORLD_SIZE 1: `--num_machines 2`): its step's statistics averaged over both
    (Processes.mean), the scores of both checked (check_scores), rank 0's value broadcast; the engine's GPU by
    --vllm_placement separate where rank 0's machine has 2 GPUs, then 1, and rank 1's 1 (a stand-in for the GPUs, none
    here: visible_gpus, and the processes taken for a GPU's); what it got, as JSON in `out`."""
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.update(MASTER_PORT=str(port), ACCELERATE_USE_CPU="true")
    args = dpo.Args(dtype="float32", local_micro_batch_size=1, collective_timeout_minutes=2, vllm_placement="separate")
    processes = plumbing.Processes(args, local_micro_batch_size=1, gradient_accumulation_steps=1, max_grad_norm=1.0)
    stats = {"loss": torch.tensor(1.0 + 2 * rank), "kl": torch.tensor(10.0 * rank), "tied": torch.tensor(0.25)}
    result = {"mean": processes.mean(stats, 0, None), "broadcast": processes.broadcast(f"from rank {rank}")}
    scores = torch.tensor([0.5, 1.0]) if rank == 0 else torch.tensor([float("-inf"), 2.0])
    try:
        processes.check_scores(scores, "the reward model", 4)
    except RuntimeError as error:
        result["scores"] = str(error)
    # a push's snapshot (PolicySnapshots.take) and its probe's trainer side: without ZeRO-3 rank 0's forward pass
    # alone (the calls counted by a spy around the real trainer_probe)
    from transformers import AutoModelForCausalLM

    probes, trainer_probe = [], weights_module.trainer_probe
    weights_module.trainer_probe = lambda *args, **kwargs: probes.append(rank) or trainer_probe(*args, **kwargs)
    policy = AutoModelForCausalLM.from_pretrained(ROOT / "tasks" / "tiny" / "sft")
    place = SnapshotPlace(pinned=False, folder=str(Path(out).parent)) if rank == 0 else None
    taken = plumbing.PolicySnapshots(processes, policy, place).take(policy, 1)
    result["probes"] = [len(probes), None if taken is None else len(taken.probe.logprobs)]
    weights_module.trainer_probe = trainer_probe
    processes.on_gpu = True
    for rank_0s in (["0", "1"], ["0"]):
        gpus = rank_0s if rank == 0 else ["0"]
        plumbing.placement.visible_gpus = lambda: gpus
        try:
            result.setdefault("placements", []).append(
                [list(p) for p in plumbing.Engine(args, processes, None).placements]
            )
        except plumbing.UsageError as refused:
            result["placements"].append(str(refused))
    Path(out).write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def test_two_processes_reduce_their_statistics_to_the_hand_computed_means(tmp_path):
    """Two CPU processes in one process group (gloo), as two machines: each step's statistics are their mean over the
    processes (loss 1 and 3: 2; KL 0 and 10: 5), rank 0's broadcast reaches both, and a -inf score on rank 1 stops
    both. The engine runs on rank 0's machine, whose GPUs decide its placement for every process: its second GPU there,
    though rank 1's machine has none to spare; with one GPU there, every process stops on the refusal, in one line.
    A push's snapshot runs its probe's forward pass on rank 0 alone (without ZeRO-3 the others' would be wasted)."""
    context = multiprocessing.get_context("spawn")
    port = free_port()
    ranks = [
        context.Process(target=reduce_on_two_processes, args=(r, port, str(tmp_path / f"{r}.json"))) for r in (0, 1)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=180)
    assert [process.exitcode for process in ranks] == [0, 0]
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    for result in results:
        assert result["mean"] == {"loss": 2.0, "kl": 5.0, "tied": 0.25}
        assert result["broadcast"] == "from rank 0"
        assert result["scores"] == "the reward model gave nan/inf scores at step 4 (1 of 4 completions: -inf)"
        assert result["placements"] == [
            [["1", False, 1, None]],
            "--vllm_placement separate: 1 training process(es) on rank 0's node, of 2 in all, and the engine need 2 "
            "GPUs there, 1 are visible; use --vllm_placement shared or one training process fewer on that node",
        ]
    assert [result["probes"] for result in results] == [[1, 4], [0, None]]


# ---------------------------------------------------------------------------------------------
# The run folder: checkpoints, resuming, timings
# ---------------------------------------------------------------------------------------------
def test_checkpoints_are_written_whole_or_not_at_all_and_the_oldest_deleted(tmp_path, monkeypatch):
    """plumbing.checkpoints.save_checkpoint with a real Accelerator: the trainer's state, the versions owed and the
    format, in step_NNNNNN, all but the `keep` newest deleted; a machine that goes down before the rename (a failing
    os.replace, injected) leaves no step_NNNNNN of it, so --resume reads the newest whole one. args.json likewise."""
    from accelerate import Accelerator
    from safetensors.torch import load_file

    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(torch.nn.Linear(2, 2), torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    progress = checkpoints.Progress(seed=1)
    owed = {1: [("w", torch.ones(2))]}
    for step in (2, 4, 6):
        progress.step = step
        path = checkpoints.save_checkpoint(accelerator, str(tmp_path), progress, owed, keep=2, trained_only={})
        assert path == str(tmp_path / "checkpoints" / f"step_{step:06d}")
    assert [p.name for p in checkpoints.checkpoints_in(str(tmp_path))] == ["step_000004", "step_000006"]
    newest = tmp_path / "checkpoints" / "step_000006"
    assert json.loads((newest / "format.json").read_text()) == {"format": checkpoints._CHECKPOINT_FORMAT}
    assert torch.equal(load_file(newest / "version_000001.safetensors")["w"], torch.ones(2))
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))

    def machine_down(source, destination):
        raise OSError(f"injected test fault: the machine went down before {destination} was renamed")

    monkeypatch.setattr(checkpoints.os, "replace", machine_down)
    progress.step = 8
    with pytest.raises(OSError, match="injected test fault"):
        checkpoints.save_checkpoint(accelerator, str(tmp_path), progress, owed, keep=2, trained_only={})
    assert not (tmp_path / "checkpoints" / "step_000008").exists()
    (tmp_path / "args.json").write_text(json.dumps({"world_size": 1}))  # the run's, which a resume checks
    assert checkpoints.checkpoint_to_resume(str(tmp_path), {}, True, 1) == str(newest)
    args_json = tmp_path / "args.json"
    args_json.write_text("the run's flags")
    with pytest.raises(OSError, match="injected test fault"):
        plumbing.tidy.write_atomically(str(args_json), "another run's flags")
    assert args_json.read_text() == "the run's flags"


# Flags a resumed run may change, and why: they change nothing the run computes. Any other flag, changed, would train
# another run than the one its checkpoint continues (the schedule, the batches, the method's numbers).
RESUMABLE = {
    "resume": "says to resume",
    "output_dir": "the folder resumed, given again",
    "track": "where the metrics are also sent",
    "wandb_project": "where the metrics are also sent",
    "wandb_entity": "where the metrics are also sent",
    "save_freq": "when checkpoints are written, not what they hold",
    "keep_checkpoints": "how many old checkpoints stay on disk",
    "num_sample_completions": "how many completions are printed",
    "collective_timeout_minutes": "how long a process waits for the others",
    "engine_timeout_minutes": "how long the trainer waits for the engine (where the files have the flag)",
    "vllm_num_engines": "how many engines generate: a prompt's completions have its seed, whichever engine makes them",
    "vllm_tensor_parallel_size": "how many GPUs an engine spans",
}


def other_value(value):
    """A value of the same kind that differs."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "-other"
    return 1  # None


@pytest.mark.parametrize("module", [dpo, rloo, ppo], ids=["online_dpo", "rloo", "ppo"])
def test_a_resumed_run_may_change_only_the_flags_that_change_nothing_it_computes(module, tmp_path):
    """Every flag of each file, changed on --resume: refused in one line naming it, with the value it had and the one
    given (--async_level 1 -> 3 would move every later batch to another policy version), unless it is one of
    RESUMABLE; and a run resumed on another number of training processes."""
    flags = asdict(module.Args())
    (tmp_path / "args.json").write_text(json.dumps(flags | {"world_size": 1}))
    refused = []
    for name, value in flags.items():
        changed = flags | {name: other_value(value)}
        try:
            checkpoints.checkpoint_to_resume(str(tmp_path), changed, True, 1)
        except plumbing.UsageError as error:
            assert f"--{name} {value!r} -> {other_value(value)!r}" in str(error), str(error)
            refused.append(name)
    assert set(flags) - set(refused) == set(RESUMABLE) & set(flags)
    assert {"async_level", "total_episodes", "eval_freq", "num_mini_batches", "seed"} <= set(refused)
    with pytest.raises(plumbing.UsageError, match=r"training processes 1 -> 2 differ"):
        checkpoints.checkpoint_to_resume(str(tmp_path), flags, True, 2)


def test_a_resumed_run_s_metrics_keep_the_steps_before_its_checkpoint_and_the_evaluations_it_logged(tmp_path):
    """metrics.jsonl of a run stopped after logging steps 0 to 4 and the evaluations of versions 0, 2 and 4, resumed from
    its checkpoint of step 3 whose Progress had logged the evaluations of 0 and 2: steps 0 to 2 and those two are kept
    (steps 3 and 4 and the evaluation of 4 are logged again by the resumed run)."""
    lines = [{"step": step, "async/lag": 1} for step in range(5)]
    lines += [{"step": version, "eval/win_rate": 0.5} for version in (0, 2, 4)]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_folder._keep_metrics_before(str(metrics), start_step=3, evals_logged={0, 2})
    kept = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert kept == lines[:3] + lines[5:7]


def test_a_step_s_timings_by_hand(monkeypatch):
    """A fake clock: the step starts at 100 s, waits 2 s for its rollouts, scores for 0.5 s and updates for 1 s, and
    is logged at 104 s. Training is the 1.5 s after the wait (the speed-up and efficiency figures read it); the step is
    4 s; the timeline counts from the origin, 90 s; the throughput divides by the whole step."""
    clock = iter([100.0, 102.0, 102.5, 103.5, 104.0])
    monkeypatch.setattr(run_folder.time, "perf_counter", lambda: next(clock))
    laps = plumbing.Laps()
    for phase in ("wait_for_rollouts", "scoring", "update"):
        laps.lap(phase)
    generator = {"generation": (95.0, 3.0), "generator_wait": (None, 0.25)}
    metrics = plumbing.timings.pipeline_metrics(laps, generator, 90.0, {"update": 7e9}, episodes=32, tokens=400.0)
    assert metrics == {
        "time/generation": 3.0,
        "time/generator_wait": 0.25,
        "time/wait_for_rollouts": 2.0,
        "time/scoring": 0.5,
        "time/update": 1.0,
        "time/training": 1.5,
        "time/step": 4.0,
        "flops/update": 7e9,
        "timeline/step_start": 10.0,
        "timeline/training_start": 12.0,
        "timeline/generation_start": 5.0,
        "throughput/episodes_per_second": 8.0,
        "throughput/tokens_per_second": 100.0,
    }


def test_an_engine_over_several_gpus_is_fingerprinted_from_all_its_workers():
    """vLLM's tensor parallelism, hand-computed: a replicated parameter (a norm) is held alike by both workers and counts
    once; a sharded one (a projection's rows) is the sum of its two parts; one worker's fingerprint is itself. Then
    _check_loaded passes the combined fingerprint against the trainer's."""
    norm, rows = torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    worker = lambda shard: {  # noqa: E731
        "held": {
            "norm.weight": fingerprint(norm, torch.float32).tolist(),
            "proj.weight": fingerprint(shard, torch.float32).tolist(),
        },
        "renamed": {},
    }
    combined = combined_fingerprints([worker(rows[:1]), worker(rows[1:])])
    assert combined == {"held": {"norm.weight": [3.0, 5.0], "proj.weight": [10.0, 30.0]}, "renamed": {}}
    assert combined_fingerprints([worker(rows)]) == worker(rows)
    layout = [("norm.weight", [2], 0), ("proj.weight", [2, 2], 2)]
    weights = Weights(
        1, torch.cat([norm, rows.flatten()]), layout, {"norm.weight": (3.0, 5.0), "proj.weight": (10.0, 30.0)}
    )
    loads = [{"version": 1, "run": 0, "compared": 1, "differ": []}]
    _check_loaded(weights, loads, combined, cache_reset=True)
    with pytest.raises(RuntimeError, match="1 of 2 differ from the trainer's fingerprint, first proj.weight"):
        _check_loaded(weights, loads, combined_fingerprints([worker(rows[:1]), worker(rows[:1])]), cache_reset=True)


def test_a_deepspeed_build_lock_no_process_holds_is_removed_and_a_held_one_kept(tmp_path, monkeypatch):
    """plumbing.distributed.release_stale_build_locks: torch waits forever on a JIT build's lock file, which its
    holder keeps open; one that no process has open (its holder killed) is removed, one a live process holds
    open is kept, and so are the locks of other extensions. A process killed during DeepSpeed's CPU op check
    left such a lock, and every later DeepSpeed start on that machine waited on it forever."""
    import subprocess
    import sys

    from plumbing.distributed import release_stale_build_locks

    stale, held, other = (
        tmp_path / "py311_cpu" / name / "lock" for name in ("deepspeed_shm_comm", "deepspeed_x", "mine")
    )
    for lock in (stale, held, other):
        lock.parent.mkdir(parents=True)
        lock.touch()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os, time; os.open({str(held)!r}, os.O_RDONLY); print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "1\n"  # the lock is open in the holder
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
        assert release_stale_build_locks() == [str(stale)]
        assert not stale.exists() and held.exists() and other.exists()
        assert release_stale_build_locks(str(tmp_path / "empty")) == []
    finally:
        holder.kill()
        holder.wait()
    assert release_stale_build_locks() == [str(held)]  # its holder gone, it is stale too


def test_a_command_past_its_timeout_is_stopped_with_what_it_started_in_sessions_of_their_own():
    """tests/conftest.py's run_script on a command that starts a process in a session of its own (as torch's
    launcher starts each rank) holding its output, then runs past its timeout: it fails in seconds with the
    timeout named and that process killed, rather than wait forever for the output the process held open."""
    import sys
    import time

    import psutil
    from conftest import run_script

    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
        "print(child.pid, flush=True); time.sleep(300)"
    )
    start = time.monotonic()
    with pytest.raises(AssertionError, match="ran past 3 s") as failed:
        run_script([sys.executable, "-c", code], timeout=3)
    assert time.monotonic() - start < 30
    child = int(str(failed.value).split("ran past 3 s:\n")[1].split()[0])
    deadline = time.monotonic() + 10  # killed, then reaped by init
    while psutil.pid_exists(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(child)


def test_each_segment_of_a_sequence_draws_its_own_numbers():
    """In-flight decoding's requests (plumbing/inflight.py): a segment's seed is its sequence's advanced by the tokens
    decoded before it (vLLM seeds each request afresh), and stays within the seeds a request takes."""
    from plumbing.inflight import segment_seed

    assert [segment_seed(7, decoded) for decoded in (0, 5, 10)] == [7_000_021, 7_000_026, 7_000_031]
    assert 0 <= segment_seed(2**62, 0) < 2**63
