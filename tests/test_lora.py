"""LoRA (--lora_rank, plumbing/lora.py and lora_push.py): the reference is the base model with the adapter off, only
the adapter trains, and only the adapter travels to a real engine, which serves it under its policy version, each
push proven; checkpoints of the adapter alone, and runs that resume exactly."""

import json
import math
import os
import shutil

import pytest
import torch
from conftest import TINY

import plumbing
import rloo_async as rloo
from plumbing.engine import make_engine
from plumbing.flags import RunArgs, UsageError
from plumbing.lora import AdapterOff, add_adapter, check_lora_flags, engine_lora_settings
from plumbing.lora_push import _check_adapter_loaded, adapter_config, adapter_fingerprints
from plumbing.placement import engine_placement
from plumbing.weights import SnapshotPlace, Weights, model_snapshot

LORA = RunArgs(lora_rank=8, lora_alpha=16.0)
# the tests on this module's engine run on one xdist worker, which starts it once
on_the_lora_engine = pytest.mark.xdist_group("lora_engine")


def lora_policy(seed: int | None = None, args: RunArgs = LORA):
    """The tiny task's SFT policy with an adapter; `seed`: every A and B drawn at random (as training leaves them),
    B of the scale a trained adapter reaches."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = add_adapter(AutoModelForCausalLM.from_pretrained(TINY / "sft", dtype=torch.float32), args).eval()
    if seed is not None:
        perturb(policy, seed)
    return policy


def perturb(policy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * (0.2 if "lora_A" in name else 0.05))


def test_the_reference_is_the_base_model_and_the_kl_at_step_0_is_exactly_0(tokenizer):
    """With the adapter as PEFT initialises it (B = 0) the policy's logprobs are the base model's, bit for bit, and so
    are the reference's (AdapterOff): the KL at step 0 is exactly 0. Once the adapter moves, the policy moves and the
    reference stays the base model, bit for bit. Only the adapter trains: the optimizer holds its A and B alone, and
    the reference's parameters are the base model's."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY / "sft", dtype=torch.float32).eval()
    policy = lora_policy()
    reference = AdapterOff(policy)
    prompts = [tokenizer(q).input_ids for q in ("sort: fox ant cat ->", "sort: yak bee cow dog ->")]
    ids, mask = rloo.left_pad(prompts, 12, tokenizer.pad_token_id)
    responses = [[5, 6, 7, tokenizer.eos_token_id], [8, 9]]
    batch = rloo.Batch(
        ids, mask, *rloo.truncate_responses(responses, 6, tokenizer.eos_token_id, tokenizer.pad_token_id)
    )
    with torch.no_grad():
        logprobs = {name: rloo.response_logprobs(m, batch, 0.7) for name, m in [("base", base), ("policy", policy)]}
        logprobs["reference"] = rloo.response_logprobs(reference, batch, 0.7)
    assert torch.equal(logprobs["policy"], logprobs["base"]) and torch.equal(logprobs["reference"], logprobs["base"])
    assert (logprobs["policy"] - logprobs["reference"]).sum().item() == 0.0  # the step-0 KL
    perturb(policy, seed=1)
    with torch.no_grad():
        moved, still = rloo.response_logprobs(policy, batch, 0.7), rloo.response_logprobs(reference, batch, 0.7)
    assert (moved - logprobs["base"]).abs().max() > 1e-3 and torch.equal(still, logprobs["base"])
    optimizer = rloo.make_optimizer(policy, rloo.Args())
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    adapter = [p for name, p in policy.named_parameters() if ".lora_" in name]
    assert {id(p) for p in trained} == {id(p) for p in adapter} and len(adapter) == 2 * 7 * 4  # A, B; 7 layers x 4
    assert sum(p.numel() for p in reference.parameters()) == sum(p.numel() for p in base.parameters())


def test_a_version_is_the_adapter_b_scaled_for_the_engine(tmp_path):
    """A LoRA version holds the adapter's A and B alone, under PEFT's file names (no `.default`), B scaled by alpha /
    r = 2, so that its adapter_config says alpha = r (vLLM then scales by exactly 1); its fingerprint is of what is
    sent. adapter_fingerprints adds a fused layer's parts: q, k and v go into one qkv_proj, by hand."""
    policy = lora_policy(seed=2)
    weights = model_snapshot(policy, 3, torch.float32, SnapshotPlace(pinned=False, folder=str(tmp_path)))
    names = [name for name, _, _ in weights.layout]
    assert len(names) == 56 and all(".default." not in name and ".lora_" in name for name in names)
    state = policy.state_dict()
    sent = dict(plumbing.weights.views(weights.flat, weights.layout))
    b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B"
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A"
    assert torch.equal(sent[f"{b}.weight"], state[f"{b}.default.weight"] * 2.0)
    assert torch.equal(sent[f"{a}.weight"], state[f"{a}.default.weight"])
    config = adapter_config(weights)
    assert (config["r"], config["lora_alpha"]) == (8, 8) and "q_proj" in config["target_modules"]
    layer = "model.layers.0.self_attn.qkv_proj"
    parts = [f"base_model.model.model.layers.0.self_attn.{p}_proj.lora_{m}.weight" for p in "qkv" for m in "AB"]
    into = {name: (layer if name in parts else name.rsplit(".lora_", 1)[0]) for name in names}
    summed = adapter_fingerprints(weights, into)[layer]
    for offset, matrix in ((0, "A"), (3, "B")):
        tensors = [sent[name] for name in parts if f".lora_{matrix}." in name]
        assert summed[offset] == pytest.approx(sum(t.double().sum().item() for t in tensors), rel=1e-12)
        assert summed[offset + 1] == pytest.approx(sum((t.double() ** 2).sum().item() for t in tensors), rel=1e-12)
        assert summed[offset + 2] == sum(t.numel() for t in tensors)


def test_a_slot_holding_another_adapter_or_other_sums_is_refused_by_hand():
    """_check_adapter_loaded on what an engine says, by hand: its slot holds the version's adapter with the trainer's
    sums (passes); another adapter in the slot, one sum off by more than float64's rounding, or weights in a layer the
    adapter has none in, each stop the push naming the version."""
    a, b = (
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
    )
    layout = [(a, [2, 3], 0), (b, [3, 2], 6)]
    weights = Weights(5, torch.zeros(12), layout, {a: (1.5, 2.25), b: (-0.5, 4.0)})
    layer = "model.layers.0.mlp.down_proj"
    held = {"slot": 5, "slots": [5], "held": {layer: [1.5, 2.25, -0.5, 4.0]}, "into": {a: layer, b: layer}}
    _check_adapter_loaded(weights, held, None)
    refused = {
        "no LoRA slot holds its adapter": held | {"slot": None, "slots": [4]},
        "1 of 1 adapted layers differ": held | {"held": {layer: [1.5, 2.25, -0.5 + 1e-6, 4.0]}},
        "a layer the adapter has none in, model.layers.1": held
        | {"held": {layer: [1.5, 2.25, -0.5, 4.0], "model.layers.1.mlp.down_proj": [0.1, 0.01, 0.0, 0.0]}},
    }
    for what, engine in refused.items():
        with pytest.raises(RuntimeError, match=rf"policy version 5's adapter after its push: .*{what}"):
            _check_adapter_loaded(weights, engine, None)
    # within float64's rounding of the sums: 1e-10 of sqrt(elements x sum of squares)
    within = held | {"held": {layer: [1.5 + 1e-12, 2.25, -0.5, 4.0]}}
    _check_adapter_loaded(weights, within, None)


def test_an_engine_over_two_gpus_is_proven_from_both_workers_slots_together():
    """Under vLLM's tensor parallelism each worker's slot holds a part of a sharded matrix (a column-parallel layer's
    B, a row-parallel layer's A) and the whole of a replicated one: combined_slots counts a matrix both hold alike
    once, and adds the parts of one they hold differently, by hand; a worker whose slot holds another adapter makes
    the engine's slot none."""
    from plumbing.lora_push import combined_slots

    layer = "model.layers.0.self_attn.qkv_proj"
    one = {"slot": 3, "slots": [3], "held": {layer: [1.5, 2.25, 0.5, 1.0]}, "into": {}}
    two = {"slot": 3, "slots": [3], "held": {layer: [1.5, 2.25, -0.25, 3.0]}, "into": {}}
    combined = combined_slots([one, two])
    assert combined["held"][layer] == [1.5, 2.25, 0.25, 4.0] and combined["slot"] == 3
    assert combined_slots([one, two | {"slot": 2}])["slot"] is None
    assert combined_slots([one]) is one


def test_lora_flags_are_refused_in_one_line_where_they_cannot_work():
    """LoRA's other flags without --lora_rank, a rank vLLM does not serve, ZeRO-3: each a UsageError naming what to
    change; target modules the model has none of: PEFT's reason, with the flag."""
    with pytest.raises(
        UsageError, match=r"--lora_alpha, --lora_save_merged set LoRA's adapter, which only --lora_rank"
    ):
        check_lora_flags(RunArgs(lora_alpha=32.0, lora_save_merged=True), zero_stage=0)
    with pytest.raises(UsageError, match="vLLM serves adapters of rank 512 at most"):
        check_lora_flags(RunArgs(lora_rank=1024), zero_stage=2)
    with pytest.raises(UsageError, match="--lora_rank under DeepSpeed ZeRO-3: .* use ZeRO-2"):
        check_lora_flags(LORA, zero_stage=3)
    check_lora_flags(LORA, zero_stage=2)
    with pytest.raises(
        UsageError,
        match="--lora_target_modules q_proj,wq: LlamaForCausalLM has no linear layer named wq .its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj",
    ):
        lora_policy(args=RunArgs(lora_rank=8, lora_target_modules="q_proj,wq"))
    assert engine_lora_settings(8)["max_lora_rank"] == 8 and engine_lora_settings(9)["max_lora_rank"] == 16


def test_a_checkpoint_holds_the_weights_that_train_and_a_resume_reads_exactly_those_back(tmp_path):
    """hold_trained_weights_only, with a real Accelerator: save_state writes the adapter alone (the 56 tensors that
    train, none of the base model's), and in PEFT's format too (policy_adapter/: PEFT loads it into the same logits,
    bit for bit), and load_state reads them back into a fresh policy, bit for bit; a checkpoint
    short of one of them, or holding a weight that does not train, stops the resume in one line naming it."""
    from accelerate import Accelerator
    from safetensors.torch import load_file, save_file

    from plumbing.checkpoints import hold_trained_weights_only, load_trained_weights

    accelerator = Accelerator(cpu=True)
    policy = accelerator.prepare(lora_policy(seed=7))
    hold_trained_weights_only(accelerator)
    accelerator.save_state(str(tmp_path / "checkpoint"))
    held = load_file(tmp_path / "checkpoint" / "model.safetensors")
    trained = {name: p for name, p in policy.named_parameters() if p.requires_grad}
    assert held.keys() == trained.keys() and len(held) == 56
    # the adapter again in PEFT's own format, which PEFT loads onto the base model as the policy it was
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY / "sft", dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, tmp_path / "checkpoint" / "policy_adapter").eval()
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, policy(input_ids=ids).logits)
    fresh = Accelerator(cpu=True)
    other = fresh.prepare(lora_policy(seed=8))
    hold_trained_weights_only(fresh)
    fresh.load_state(str(tmp_path / "checkpoint"))
    assert all(torch.equal(p, trained[name]) for name, p in other.named_parameters() if p.requires_grad)
    short = dict(held)
    short.pop(next(iter(short)))
    with pytest.raises(
        UsageError, match=r"does not hold this run's trained weights \(56 tensors\): it lacks base_model"
    ):
        load_trained_weights(short, other, "step_000004/model.safetensors")
    frozen = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    extra = held | {frozen: torch.zeros(1)}
    with pytest.raises(UsageError, match=f"it holds {frozen}, which does not train"):
        load_trained_weights(extra, other, "step_000004/model.safetensors")
    save_file(short, tmp_path / "checkpoint" / "model.safetensors")
    with pytest.raises(UsageError, match="checkpoint/model.safetensors does not hold this run's trained weights"):
        fresh.load_state(str(tmp_path / "checkpoint"))


@pytest.fixture(scope="module")
def lora_engine():
    """The scripts' engine over the tiny SFT policy, serving LoRA adapters of rank 8 (engine_lora_settings)."""
    placement = engine_placement("auto", [], 1, None)
    settings = engine_lora_settings(8)
    llm = make_engine(
        str(TINY / "sft"), placement, dtype="float32", max_model_len=64, enforce_eager=True, seed=0, **settings
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def sampled_and_logprobs(engine, tokenizer, policy, seeds):
    """Completions the engine samples at temperature 0.7 with the logprob of each token, and the trainer's logprobs
    of the same tokens (`policy`; None: none)."""
    prompts = [tokenizer(q).input_ids for q in ("sort: fox ant cat ->", "sort: yak bee cow dog elk ->", "sort: ape ->")]
    eos = tokenizer.eos_token_id
    responses, logprobs = rloo.generate(engine, ("rollout", 0), prompts, 4, 0.7, 12, eos, seeds, logprobs=True)
    ids, mask = rloo.left_pad(prompts, 12, tokenizer.pad_token_id)
    ids, mask = ids.repeat_interleave(4, 0), mask.repeat_interleave(4, 0)
    batch = rloo.Batch(ids, mask, *rloo.truncate_responses(responses, 12, eos, tokenizer.pad_token_id))
    with torch.no_grad():
        trainer = rloo.response_logprobs(policy, batch, 0.7)
    return rloo.pad_logprobs(logprobs, batch), trainer, responses


@on_the_lora_engine
def test_only_the_adapter_travels_and_the_engine_samples_the_trainers_policy_at_each_version(
    lora_engine, tokenizer, tmp_path
):
    """Three versions pushed through plumbing.Engine as the generation thread pushes them: each is a PEFT adapter
    folder the engine serves under the version's id, proven (the slot's fingerprint and the probe); the engine then
    samples the trainer's policy: its logprobs of its own completions are the trainer's to 1e-5 (float32), while the
    base model's are off by more than 0.01. The previous version's adapter is dropped, and its folder gone."""
    engine = plumbing.Engine.around([lora_engine], [None], weights_dir=str(tmp_path))
    place = SnapshotPlace(pinned=False, folder=str(tmp_path))
    policy = lora_policy()
    for version in (1, 2, 3):
        perturb(policy, seed=10 + version)
        weights = model_snapshot(policy, version, torch.float32, place, probed=True)
        engine.push(weights)
        assert engine.version == version and engine.adapter.lora_int_id == version
        assert set(lora_engine.llm_engine.list_loras()) == {version}
        folders = sorted(name for name in os.listdir(tmp_path) if name.startswith("adapter-"))
        assert folders == [f"adapter-{version:06d}"]
        held = json.loads((tmp_path / folders[0] / "adapter_config.json").read_text())
        assert held["r"] == held["lora_alpha"] == 8
        engine_logprobs, trainer, _ = sampled_and_logprobs(engine, tokenizer, policy, [version, 7, 8])
        with policy.disable_adapter():
            _, base, _ = sampled_and_logprobs(engine, tokenizer, policy, [version, 7, 8])
        gap, off = (engine_logprobs - trainer).abs().max().item(), (engine_logprobs - base).abs().max().item()
        print(f"version {version}: max |engine - trainer| {gap:.2e}, |engine - base model| {off:.2f}")
        assert gap < 1e-5 and off > 0.01
    size = sum(math.prod(shape) for _, shape, _ in weights.layout) * 4
    print(
        f"a push: {size / 2**20:.2f} MiB of adapter; the whole policy {sum(p.numel() for p in policy.parameters()) * 4 / 2**20:.2f} MiB"
    )


@on_the_lora_engine
def test_a_stale_or_foreign_adapter_stops_the_push_naming_the_version(lora_engine, tokenizer, tmp_path, monkeypatch):
    """A fault planted where the adapter is written (plumbing.engine's write_adapter, the one place it is): the folder
    of version 5 holds version 4's tensors (a stale adapter), or those of another run's adapter of the same shapes:
    the engine serves them, and the push stops, naming version 5 and the layers whose sums differ."""
    engine = plumbing.Engine.around([lora_engine], [None], weights_dir=str(tmp_path))
    place = SnapshotPlace(pinned=False, folder=str(tmp_path))
    policy = lora_policy(seed=4)
    engine.push(model_snapshot(policy, 4, torch.float32, place, probed=True))
    stale = model_snapshot(policy, 4, torch.float32, place)
    foreign = model_snapshot(lora_policy(seed=99), 5, torch.float32, place)
    perturb(policy, seed=5)
    fresh = model_snapshot(policy, 5, torch.float32, place, probed=True)
    write = plumbing.engine.write_adapter
    for planted in (stale, foreign):
        monkeypatch.setattr(
            plumbing.engine, "write_adapter", lambda folder, _, p=planted: write(folder, p._replace(version=5))
        )
        with pytest.raises(
            RuntimeError, match=r"policy version 5's adapter after its push: \d+ of 16 adapted layers differ"
        ):
            engine.push(fresh)
        lora_engine.llm_engine.remove_lora(5)
    monkeypatch.setattr(plumbing.engine, "write_adapter", write)
    engine.push(fresh)
    assert engine.version == 5


@pytest.mark.slow
@on_the_lora_engine
def test_an_adapter_saved_in_peft_s_format_is_served_by_the_engine_as_peft_computes_it(
    lora_engine, tokenizer, tmp_path
):
    """A run's final policy/ is PEFT's save_pretrained of the adapter (its own alpha 16, B unscaled): vLLM serves that
    folder as an adapter too, and samples what PEFT's model computes, to 1e-5 (float32)."""
    from vllm.lora.request import LoRARequest

    policy = lora_policy(seed=21)
    policy.save_pretrained(tmp_path / "policy")
    engine = plumbing.Engine.around([lora_engine], [None], weights_dir=str(tmp_path))
    engine.adapter = LoRARequest(lora_name="final", lora_int_id=1000, lora_path=str(tmp_path / "policy"))
    try:
        engine_logprobs, trainer, _ = sampled_and_logprobs(engine, tokenizer, policy, [1, 2, 3])
    finally:
        lora_engine.llm_engine.remove_lora(1000)
    gap = (engine_logprobs - trainer).abs().max().item()
    print(f"PEFT's folder served by the engine: max |engine - PEFT| {gap:.2e}")
    assert gap < 1e-5


# A LoRA run of the tests' size, checkpointed every 4 steps: 32 steps of 8 prompts (x 2 samples for online DPO)
LORA_RUN = ["--total_episodes", "256", "--local_micro_batch_size", "8", "--eval_freq", "8", "--num_eval_prompts", "32"]
LORA_RUN += ["--lora_rank", "8", "--learning_rate", "1e-3", "--save_freq", "4", "--lora_save_merged"]


@pytest.mark.slow
@pytest.mark.xdist_group("resume_online_dpo_lora")
def test_a_lora_run_killed_by_sigkill_resumes_exactly_from_checkpoints_of_the_adapter_alone(tmp_path):
    """kill -9 after 10 steps, then --resume: the same metrics and final adapter, bit for bit, as the run that was not
    stopped. Its checkpoints hold the adapter alone (the 56 tensors that train, 10.5 % of the tiny policy's
    parameters; the optimizer, their state); the final policy/ is the adapter in PEFT's format, which PEFT loads onto the base model, and
    policy_merged/ (--lora_save_merged) the same policy merged into the base model's weights (logits to 1e-5)."""
    import signal

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import assert_resumed_run_matches

    run, reference, _, stopped, _ = assert_resumed_run_matches(
        "online_dpo_async.py", LORA_RUN, tmp_path, stop_after=10, sig=signal.SIGKILL
    )
    assert stopped == ["step_000004", "step_000008"]
    checkpoint = sorted((run / "checkpoints").iterdir())[-1]  # the resumed run's newest
    held = load_file(checkpoint / "model.safetensors")
    assert len(held) == 56 and all(".lora_A.default." in name or ".lora_B.default." in name for name in held)
    adapter = {name: p.numel() for name, p in lora_policy().named_parameters() if ".lora_" in name}
    whole = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(TINY / "sft").parameters())
    assert {name: t.numel() for name, t in held.items()} == adapter
    print(f"a checkpoint's weights: {sum(adapter.values())} of the policy's {whole} parameters")
    optimizer = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert len(optimizer["state"]) == 56
    base = AutoModelForCausalLM.from_pretrained(TINY / "sft", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, reference / "policy").eval()
    merged = AutoModelForCausalLM.from_pretrained(reference / "policy_merged", dtype=torch.float32).eval()
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    untrained = AutoModelForCausalLM.from_pretrained(TINY / "sft", dtype=torch.float32).eval()
    with torch.no_grad():
        logits = {"adapted": adapted(input_ids=ids).logits, "merged": merged(input_ids=ids).logits}
        gap = (logits["adapted"] - logits["merged"]).abs().max().item()
        moved = (logits["merged"] - untrained(input_ids=ids).logits).abs().max().item()
    print(f"PEFT's adapted policy against the merged one: max |logit difference| {gap:.2e}; from the SFT {moved:.2f}")
    assert gap < 1e-5 and moved > 1e-3
    config = json.loads((reference / "policy" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (8, 16.0, "LORA")


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, processes",
    [("configs/cpu_2proc.yaml", 2), ("configs/deepspeed_zero2.yaml", 1)],
    ids=["two_processes", "zero2"],
)
def test_lora_trains_and_resumes_exactly_over_two_processes_and_under_zero2(config, processes, tmp_path):
    """LoRA over two CPU training processes (gloo) and under DeepSpeed ZeRO-2 (bf16, which DeepSpeed writes its own
    checkpoints for, here of the weights that train alone): the run copied as if stopped during step 5 resumes from
    its step-4 checkpoint and ends with the same metrics and final adapter, bit for bit."""
    from safetensors.torch import load_file

    from conftest import accelerate_launch, run_script, training_lines_without_timings

    launch = accelerate_launch("--config_file", config, "--num_processes", str(processes))
    launch += ["online_dpo_async.py", "--total_episodes", "128", "--local_micro_batch_size", "4", "--eval_freq", "4"]
    launch += ["--num_eval_prompts", "16", "--save_freq", "2", "--keep_checkpoints", "8"]
    launch += ["--lora_rank", "8", "--learning_rate", "1e-3"]
    if processes == 1:
        launch += ["--dtype", "bfloat16", "--gradient_accumulation_steps", "2"]
    env = {"ACCELERATE_USE_CPU": "1"} if processes > 1 else {}
    run_script(launch + ["--output_dir", str(tmp_path / "run")], env=env)
    if processes == 1:  # DeepSpeed's own checkpoint: its model file holds the adapter alone
        model_file = next((tmp_path / "run" / "checkpoints" / "step_000004" / "pytorch_model").glob("*model_states.pt"))
        saved = torch.load(model_file, weights_only=False)["module"]
        assert len(saved) == 56 and all(".lora_" in name for name in saved)
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", resumed)
    shutil.rmtree(resumed / "policy")
    for later in [p for p in (resumed / "checkpoints").iterdir() if p.name > "step_000004"]:
        shutil.rmtree(later)
    lines = (resumed / "metrics.jsonl").read_text().splitlines()
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if json.loads(line)["step"] < 5))
    said = run_script(launch + ["--output_dir", str(resumed), "--resume"], env=env).stdout
    assert f"resuming from {resumed / 'checkpoints' / 'step_000004'} (step 4)" in said
    assert training_lines_without_timings(resumed) == training_lines_without_timings(tmp_path / "run")
    final, expected = (load_file(d / "policy" / "adapter_model.safetensors") for d in (resumed, tmp_path / "run"))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)


@pytest.mark.slow
def test_ppo_s_value_model_gets_an_adapter_of_its_own_and_a_sigterm_resumes_exactly(tmp_path):
    """PPO with --lora_value_model: the policy and the value model each with an adapter, the value head trained whole
    (PEFT's SEQ_CLS); a checkpoint holds exactly the weights that train, and a run stopped by SIGTERM after 6 steps
    resumes to the same metrics and final adapter as the run that was not stopped."""
    import signal

    from safetensors.torch import load_file

    from conftest import assert_resumed_run_matches

    flags = [*LORA_RUN[:-1], "--lora_value_model", "--total_episodes", "128"]  # no merged policy; 16 steps
    run, reference, _, stopped, _ = assert_resumed_run_matches(
        "ppo_async.py", flags, tmp_path, stop_after=6, sig=signal.SIGTERM
    )
    held = load_file(sorted((reference / "checkpoints").iterdir())[-1] / "model.safetensors")
    policy = {name for name in held if name.startswith("policy.")}
    value = {name for name in held if name.startswith("value_model.")}
    assert len(policy) == 56 and all(".lora_" in name for name in policy)
    assert {name for name in value if ".lora_" not in name} == {"value_model.score.modules_to_save.default.weight"}
    reward_layers = json.loads((TINY / "reward" / "config.json").read_text())["num_hidden_layers"]
    assert len(value) == 2 * 7 * reward_layers + 1 and policy | value == held.keys()


# The LoRA command of each file: the docs' (the README's and docs/flags.md's CPU examples, which the docs' test of
# those examples leaves to this one: test_docs.RUN_BY_THE_LORA_TESTS), and RLOO's alike.
LORA_COMMANDS = {
    "online_dpo_async.py": [".venv/bin/python", "online_dpo_async.py", "--lora_rank", "8", "--learning_rate", "1e-3"],
    "rloo_async.py": [".venv/bin/python", "rloo_async.py", "--lora_rank", "8", "--learning_rate", "1e-3"],
    "ppo_async.py": [
        ".venv/bin/python",
        "ppo_async.py",
        "--lora_rank",
        "8",
        "--lora_value_model",
        "--learning_rate",
        "1e-3",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("script", LORA_COMMANDS)
def test_each_file_learns_with_lora(script, tmp_path):
    """Each file's LoRA command (LORA_COMMANDS: PPO's gives its value model an adapter too) at 4,096 episodes, on
    every core as a user runs it: a finished run, nothing on stderr but the progress bar, and the tiny task's win rate
    rises by 0.10 or more and the gold score with it, as full fine-tuning's does (the default-length runs:
    docs/algorithms.md#lora---lora_rank; the miniature's LoRA runs gain 0.16 to 0.19 by 4,096 episodes)."""
    import sys

    from conftest import check_run, read_metrics, run_script, stderr_noise

    argv = [sys.executable, *LORA_COMMANDS[script][1:], "--total_episodes", "4096", "--output_dir", str(tmp_path)]
    stderr = run_script(argv, timeout=900, all_cores=True).stderr
    assert stderr_noise(stderr) == []
    check_run(tmp_path, script)
    _, evals = read_metrics(tmp_path)
    print(script, "win rate", [round(e["eval/win_rate"], 3) for e in evals])
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert evals[-1]["eval/gold_score"] > evals[0]["eval/gold_score"]
