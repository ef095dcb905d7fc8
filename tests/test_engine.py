"""The generation side on a real vLLM engine (CPU): weight pushes and failures."""

import os
import re
import time

import psutil
import pytest
import torch
from conftest import PUSHED_FAMILIES, perturbed_policy, save_random_policy

import online_dpo_async as dpo
import plumbing
from plumbing.engine import make_engine
from plumbing.placement import engine_placement
from plumbing.watchdog import kill_process_trees, release_shared_memory, shared_memory_files, started_processes
from plumbing.weights import (
    SnapshotPlace,
    WeightBucket,
    bucket_bytes,
    bucket_chunks,
    _check_loaded,
    engine_probe,
    model_snapshot,
    probe_gap,
    push_weights,
    shared_handle,
    snapshot_bytes,
    snapshot_sizes,
)

PROMPT_LENGTH, BLOCK_SIZE = 45, 32  # prompts span more than one KV-cache block
# the tests on the module's engine run on one xdist worker, which starts the engine once
on_the_module_engine = pytest.mark.xdist_group("module_engine")


@pytest.fixture(scope="module")
def policy_a(tokenizer, tmp_path_factory):
    return save_random_policy(tokenizer, tmp_path_factory.mktemp("policy_a"), seed=0)


@pytest.fixture(scope="module")
def engine(policy_a):
    """The scripts' engine (its own processes, the weight receiver), with prefix caching on small KV blocks."""
    path = policy_a
    placement = engine_placement("auto", [], 1, None)
    llm = make_engine(
        str(path), placement, dtype="float32", max_model_len=128, enforce_eager=True, seed=0, block_size=BLOCK_SIZE
    )
    yield llm
    llm.llm_engine.engine_core.shutdown()


def greedy_with_transformers(model, prompt: list[int], steps: int):
    ids, tokens, logprobs = torch.tensor([prompt]), [], []
    with torch.no_grad():
        for _ in range(steps):
            logp = model(ids).logits[0, -1].log_softmax(-1)
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(logp[token].item())
            ids = torch.cat([ids, torch.tensor([[token]])], 1)
    return tokens, logprobs


def greedy_with_engine(llm, prompts: list[list[int]], steps: int):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=0, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
        for o in outputs
    ]


@on_the_module_engine
def test_engine_after_a_weight_push_matches_the_trainer_on_long_prompts(engine, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
        for _ in range(3)
    ]
    greedy_with_engine(engine, prompts, 8)  # fills the prefix cache with the old weights' KV
    new_policy = AutoModelForCausalLM.from_pretrained(
        save_random_policy(tokenizer, tmp_path / "policy_b", seed=1)
    ).eval()
    weights_dir = tmp_path / "push"
    weights_dir.mkdir()
    place = SnapshotPlace(pinned=False, folder=str(weights_dir))
    push_weights(engine, WeightBucket(None, str(weights_dir)), model_snapshot(new_policy, 1, torch.float32, place))
    for prompt, (tokens, logprobs) in zip(prompts, greedy_with_engine(engine, prompts, 8)):
        expected_tokens, expected_logprobs = greedy_with_transformers(new_policy, prompt, 8)
        assert tokens == expected_tokens
        # float32 on both sides, the same weights: logprobs near -3 agree to a few float32 ulps (measured 2.4e-7)
        assert logprobs == pytest.approx(expected_logprobs, abs=1e-5)

    # Why the cache reset matters: reload the first policy without it and the cached prefix KV of
    # policy b leaks into generations that should be policy a's.
    old_policy = AutoModelForCausalLM.from_pretrained(
        save_random_policy(tokenizer, tmp_path / "policy_a", seed=0)
    ).eval()
    from safetensors.torch import save_file

    save_file(
        {k: v.detach().clone().contiguous() for k, v in old_policy.state_dict().items()},
        str(weights_dir / "model.safetensors"),
    )
    engine.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
    stale = greedy_with_engine(engine, prompts, 8)
    # not numerics (1e-5, above): the leaked keys and values move the logprobs by 0.07 to 0.14 (measured)
    assert any(
        logprobs != pytest.approx(greedy_with_transformers(old_policy, p, 8)[1], abs=1e-2)
        for p, (_, logprobs) in zip(prompts, stale)
    )
    engine.reset_prefix_cache()


@on_the_module_engine
@pytest.mark.parametrize("async_level", [0, 1, 2, 3])
def test_the_engine_device_holds_one_bucket_at_every_async_level(engine, policy_a, tokenizer, tmp_path, async_level):
    """Three pushes of versions that differ, through the scripts' code: the trainer's publish (PolicySnapshots.take: a
    snapshot in host memory), the generation thread pulling each version its schedule needs and pushing it
    (plumbing.Engine.push), and the snapshots let go once nothing owes them (PolicySnapshots.keep). At every push the
    engine's device holds the push's bucket alone (on a CPU a shared-memory file of the weights folder, as the GPU's is
    CUDA memory), the same one each time, of bucket_bytes: here the largest layer's, less than a snapshot, so each push
    takes several loads; the host holds at most async_level + 2 snapshots, the count the memory plan takes."""
    from transformers import AutoModelForCausalLM

    num_steps = async_level + 4  # versions 1, 2 and 3 are pushed
    # a batch of 2 prompts (of 4) x 2 completions a step, in float32 as the engine
    args = dpo.Args(response_length=2, seed=0, local_micro_batch_size=2, total_episodes=4 * num_steps, dtype="float32")
    policy = AutoModelForCausalLM.from_pretrained(policy_a)
    processes = plumbing.Processes(args, local_micro_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1.0)
    folder = tmp_path
    place, bucket = SnapshotPlace(pinned=False, folder=str(folder)), WeightBucket(None, str(folder), 1)
    snapshots = plumbing.PolicySnapshots(processes, policy, place)  # as the scripts make them
    schedule = dpo.generation_schedule(num_steps, async_level, eval_steps=[])
    to_publish = dpo.published_versions(schedule)
    held = []  # at each push: the engine device's buffers (name, bytes) and the host's snapshots
    link = plumbing.Engine.around([engine], [bucket])
    channel = plumbing.Channel(link)

    def push(weights, keep_cache=False):
        plumbing.Engine.push(link, weights, keep_cache)  # push_weights through the bucket
        files = {f.name: f.stat().st_size for f in folder.iterdir()}
        on_device = [(name, size) for name, size in files.items() if name.startswith(("bucket-", "header-"))]
        held.append((weights.version, sorted(on_device), sum(name.startswith("snapshot-") for name in files)))

    link.push = push
    prompts = [[tokenizer.bos_token_id, 5 + i, 6] for i in range(4)]
    none = dpo.Prompts([], [], [])
    inputs = dpo.Inputs(tokenizer, None, dpo.Prompts(prompts, [""] * 4, [""] * 4), none)
    channel.run_thread(dpo.generation_thread, link, channel, schedule, inputs, args, dpo.compute_sizes(args, 1))
    for step in range(num_steps):
        rollout = channel.get(channel.rollouts)
        assert (rollout.step, rollout.version) == (step, max(0, step - async_level))
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(1e-3)
        if step + 1 in to_publish:  # the test keeps no reference to a snapshot: only the snapshots and the channel
            channel.weights.put(snapshots.take(policy, step + 1))
        snapshots.keep(dpo.published_versions(dpo.pending_events(schedule, step + 1, set())))
    channel.thread.join(timeout=60)
    one = bucket_bytes(snapshot_sizes(snapshots.saved), element_size=4, least=1)
    assert one < snapshot_bytes(snapshots.saved, torch.float32)
    assert [version for version, _, _ in held] == [1, 2, 3]
    # the bucket and its header: the version and the run it holds, two int64
    assert all([size for _, size in on_device] == [one, 16] for _, on_device, _ in held), held
    assert len({name for _, on_device, _ in held for name, _ in on_device}) == 2  # allocated once
    assert all(1 <= host <= async_level + 2 for _, _, host in held), held


@pytest.mark.slow
def test_elements_out_of_order_pass_every_sum_and_stop_the_push_at_its_probe(tokenizer, tmp_path, monkeypatch, capsys):
    """What sums cannot see, the probe does (plumbing.weights.engine_probe): a tiny Qwen3-MoE (4 experts, 2 a token)
    pushed through a bucket of one layer, its engine's logprobs on the probe within float32's tolerance of the
    trainer's (its CPU experts packed again after each load: WeightReceiver.repack_experts; without it, 0.055 apart on
    average), then two pushes whose bucket holds every value of the trainer's, some in another order (planted by the
    test-only launcher's fake fill, tests/fault_launcher.py): two rows of a q_proj swapped (vLLM fuses it into
    qkv_proj, which the element check leaves to the sums), and experts 0 and 1 of a layer swapped. Each passes the
    element check and every sum, and stops the push at its probe in one line naming the version."""
    import fault_launcher

    models = [perturbed_policy(tokenizer, "qwen3_moe", False, seed) for seed in range(4)]
    models[0].save_pretrained(tmp_path / "v0")
    tokenizer.save_pretrained(tmp_path / "v0")
    placement = engine_placement("auto", [], 1, None)
    ours = {process.pid for process in psutil.Process().children(recursive=True)}
    llm = make_engine(str(tmp_path / "v0"), placement, dtype="float32", max_model_len=128, enforce_eager=True, seed=0)
    processes = started_processes(ours)
    shared_memory = shared_memory_files(processes)
    try:
        place, bucket = SnapshotPlace(pinned=False, folder=str(tmp_path)), WeightBucket(None, str(tmp_path), least=1)
        weights = model_snapshot(models[1], 1, torch.float32, place, probed=True)
        push_weights(llm, bucket, weights)
        assert len(bucket_chunks(weights.layout, bucket.flat.numel())) > 2
        assert weights.probe.tolerance == 32 * 2.0**-23
        assert probe_gap(weights.probe, engine_probe(llm, weights.probe.token_ids)) < 1e-6  # 1.1e-7 measured
        fill = WeightBucket.fill
        planted = {
            "permuted": "rows 0 and 1 of model.layers.0.self_attn.q_proj.weight swapped",
            "swapped_experts": "experts 0 and 1 of model.layers.0.mlp swapped",
        }
        for version, fault in enumerate(planted, start=2):
            monkeypatch.setattr(WeightBucket, "fill", fault_launcher.faulty_fill(fill, fault, version=version))
            weights = model_snapshot(models[version], version, torch.float32, place, probed=True)
            with pytest.raises(RuntimeError) as stopped:
                push_weights(llm, bucket, weights)
            assert f"injected test fault: {planted[fault]} in version {version}'s bucket" in capsys.readouterr().out
            assert re.fullmatch(
                rf"the engine does not hold policy version {version} after its push: its logprobs on the probe are "
                r"\S+ from the trainer's on average, more than the 3.81e-06 its dtype allows, its sums matching: it "
                "computes with some tensor's elements in another order",
                str(stopped.value),
            ), str(stopped.value)
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=1)
        kill_process_trees(processes)
        release_shared_memory(shared_memory)


@on_the_module_engine
def test_an_engine_holding_other_weights_than_it_was_sent_stops_the_run(engine, tokenizer, tmp_path):
    """After a push the engine says what it holds: each load, the version and run it read in the bucket and how its
    parameters compare with the bucket element for element (plumbing.receiver.WeightReceiver.holds); then the
    fingerprint of every parameter, which plumbing.weights._check_loaded compares with the trainer's. Pushed policy b
    holds b; asked against policy c, which it never loaded (a push that delivered nothing), its parameters differ from
    c's snapshot element for element, and from c's fingerprint, the first the embedding, and the run stops naming
    them; as it does for a version other than the one sent, or a prefix cache not reset."""
    from transformers import AutoModelForCausalLM

    place = SnapshotPlace(pinned=False, folder=str(tmp_path))
    b, c = (
        AutoModelForCausalLM.from_pretrained(save_random_policy(tokenizer, tmp_path / n, seed=s))
        for n, s in (("b", 1), ("c", 2))
    )
    snapshot_b, snapshot_c = model_snapshot(b, 5, torch.float32, place), model_snapshot(c, 6, torch.float32, place)
    push_weights(engine, WeightBucket(None, str(tmp_path)), snapshot_b)  # checks what it holds: b
    held = engine.collective_rpc("holds", args=(shared_handle(snapshot_b.flat), snapshot_b.layout))[0]
    # norms and the embeddings compare on a CPU (its linear layers repack their weights and leave them empty)
    assert held["compared"] >= 5 and held["differ"] == []
    stale = engine.collective_rpc("holds", args=(shared_handle(snapshot_c.flat), snapshot_c.layout))[0]
    # the random policies' norms are all ones: their embeddings and heads tell them apart
    assert stale["compared"] == held["compared"] and stale["differ"] == ["model.embed_tokens.weight", "lm_head.weight"]
    fingerprint = engine.collective_rpc("fingerprint", args=([(n, shape) for n, shape, _ in snapshot_b.layout],))[0]
    loaded = [{"version": 5, "run": 0} | held]
    _check_loaded(snapshot_b, loaded, fingerprint, cache_reset=True)  # what push_weights checked
    # 15 compared: the embedding, the head, the final norm and in each layer o_proj, down_proj, 2 norms, q/k/v against
    # vLLM's qkv_proj, gate/up against gate_up_proj; c differs from b in all but the 5 norms (ones in both)
    with pytest.raises(
        RuntimeError,
        match=r"does not hold policy version 6 after its push: 10 of 15 differ from the trainer's fingerprint, first "
        r"model.embed_tokens.weight: sum",
    ):
        _check_loaded(snapshot_c, [{"version": 6, "run": 0} | held], fingerprint, cache_reset=True)
    with pytest.raises(
        RuntimeError,
        match=rf"does not hold policy version 6 after its push: 2 of {held['compared']} tensors compared with the bucket "
        "differ, e.g. ",
    ):
        _check_loaded(snapshot_c, [{"version": 6, "run": 0} | stale], fingerprint, cache_reset=True)
    with pytest.raises(RuntimeError, match="does not hold policy version 5 after its push: its prefix cache was not"):
        _check_loaded(snapshot_b, loaded, fingerprint, cache_reset=False)
    with pytest.raises(
        RuntimeError, match="does not hold policy version 7 after its push: its load 0 read run 0 of version 5 in the"
    ):
        _check_loaded(snapshot_b._replace(version=7), loaded, fingerprint, cache_reset=True)
    paths = [snapshot_b.flat.shared_path, snapshot_c.flat.shared_path]
    assert all(os.path.exists(path) for path in paths)
    del snapshot_b, snapshot_c
    assert not any(os.path.exists(path) for path in paths)  # a snapshot's shared memory goes with it


@on_the_module_engine
@pytest.mark.parametrize("fault", ["wrong_copy", "stale_run"])
def test_a_wrong_copy_or_a_stale_run_in_the_bucket_stops_the_push_naming_the_version(
    engine, tokenizer, tmp_path, monkeypatch, fault
):
    """Faults in the copy from the host snapshot into the bucket, injected from outside by the test-only launcher's
    fake fill (tests/fault_launcher.py): a wrong value planted in the bucket after the copy, which the bucket and the
    engine then agree on, and a run never copied, the bucket holding the run before it. Through a bucket of one layer
    (each push 4 loads), version 1 is pushed and proven; version 2 stops the push, naming the version and the tensor the
    value was planted in (the trainer's fingerprint of its own weights differs from the engine's), or the run the load
    read (the bucket's header: run 0, not 1)."""
    from transformers import AutoModelForCausalLM

    import fault_launcher

    place, bucket = SnapshotPlace(pinned=False, folder=str(tmp_path)), WeightBucket(None, str(tmp_path), least=1)
    policies = [
        AutoModelForCausalLM.from_pretrained(save_random_policy(tokenizer, tmp_path / f"{v}", seed=v)) for v in (1, 2)
    ]
    push_weights(engine, bucket, model_snapshot(policies[0], 1, torch.float32, place))
    weights = model_snapshot(policies[1], 2, torch.float32, place)
    assert len(bucket_chunks(weights.layout, bucket.flat.numel())) == 4
    monkeypatch.setattr(WeightBucket, "fill", fault_launcher.faulty_fill(WeightBucket.fill, fault, version=2))
    planted = [name for name, _, _ in bucket_chunks(weights.layout, bucket.flat.numel())[0].layout][-1]
    expected = {
        "wrong_copy": rf"1 of 15 differ from the trainer's fingerprint, first {planted}: sum",
        "stale_run": "its load 1 read run 0 of version 2 in the bucket",
    }
    with pytest.raises(RuntimeError, match=f"does not hold policy version 2 after its push: {expected[fault]}"):
        push_weights(engine, bucket, weights)


@on_the_module_engine
def test_generated_completions_stop_at_eos_and_are_reproducible(engine, tokenizer):
    prompts = [[tokenizer.bos_token_id, 7, 8, 9]] * 2
    engines, call = plumbing.Engine.around([engine], [None]), ("rollout", 0)
    first, logprobs = dpo.generate(
        engines, call, prompts, n=3, temperature=1.0, max_tokens=10, eos=tokenizer.eos_token_id, seeds=[11, 12]
    )
    again, again_logprobs = dpo.generate(engines, call, prompts, 3, 1.0, 10, tokenizer.eos_token_id, [11, 12], True)
    assert logprobs is None and [len(lp) for lp in again_logprobs] == [len(c) for c in again]
    assert len(first) == 6 and first == again
    assert len({tuple(c) for c in first[:3]}) > 1  # the n samples of one prompt differ
    assert first[:3] != first[3:]  # so do prompts with different seeds
    for completion in first:
        assert tokenizer.eos_token_id not in completion[:-1] and len(completion) <= 10


@on_the_module_engine
def test_engine_logprobs_are_the_trainers_after_temperature(engine, policy_a, tokenizer, tmp_path):
    """The engine returns processed logprobs (after temperature): for the same float32 weights they match the
    trainer's temperature-scaled logprobs of the same tokens (RLOO's and PPO's importance weights rely on it); raw
    logprobs (temperature 1) would not."""
    import rloo_async as rloo
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(policy_a).eval()
    place = SnapshotPlace(pinned=False, folder=str(tmp_path))
    push_weights(engine, WeightBucket(None, str(tmp_path)), model_snapshot(policy, 0, torch.float32, place))
    prompts = [
        tokenizer(q).input_ids for q in ("sort: fox ant cat ->", "sort: yak bee cow dog elk emu ->", "sort: ape asp ->")
    ]
    eos, temperature, length = tokenizer.eos_token_id, 0.7, 12
    engines, call = plumbing.Engine.around([engine], [None]), ("rollout", 0)
    responses, logprobs = rloo.generate(engines, call, prompts, 4, temperature, length, eos, [0, 1, 2], logprobs=True)
    q_ids, q_mask = rloo.left_pad(prompts, 12, tokenizer.pad_token_id)
    q_ids, q_mask = q_ids.repeat_interleave(4, 0), q_mask.repeat_interleave(4, 0)
    batch = rloo.Batch(q_ids, q_mask, *rloo.truncate_responses(responses, length, eos, tokenizer.pad_token_id))
    pushed = rloo.pad_logprobs(logprobs, batch)
    with torch.no_grad():
        trainer = rloo.response_logprobs(policy, batch, temperature)
        raw = rloo.response_logprobs(policy, batch, 1.0)
    assert [len(lp) for lp in logprobs] == [len(r) for r in responses]
    diff = (pushed - trainer).abs().max().item()
    print(f"max |engine - trainer| per token: {diff:.2e}")
    # float32 on both sides: a few ulps of logprobs near -4 (measured 4.8e-7); a missing temperature moves them by
    # tenths (measured 0.18)
    assert diff < 1e-5
    assert (pushed - raw).abs().max().item() > 0.1


@pytest.mark.slow  # it starts a second engine
@on_the_module_engine
def test_two_engines_are_each_proven_at_every_push_and_generate_what_one_does(engine, policy_a, tokenizer, tmp_path):
    """--vllm_num_engines 2 on the CPU, through plumbing.Engine as the scripts drive it: a push goes to both engines,
    each through its own bucket, and each proves it (_check_loaded), so both hold the version; a batch is cut into two
    contiguous parts (7 prompts: 4 and 3), generated by both at once and put back in prompt order, and gives the
    completions one engine gives, each prompt with its own seed (docs/gpus.md#several-engines---vllm_num_engines).
    Engines that hold different versions stop the batch."""
    import rloo_async as rloo
    from transformers import AutoModelForCausalLM

    placement = engine_placement("auto", [], 1, None)
    second = make_engine(
        str(policy_a), placement, dtype="float32", max_model_len=128, enforce_eager=True, seed=0, block_size=BLOCK_SIZE
    )
    try:
        place = SnapshotPlace(pinned=False, folder=str(tmp_path))
        one = plumbing.Engine.around([engine], [WeightBucket(None, str(tmp_path), least=1)])
        two = plumbing.Engine.around([engine, second], [WeightBucket(None, str(tmp_path), least=1) for _ in range(2)])
        policy = AutoModelForCausalLM.from_pretrained(save_random_policy(tokenizer, tmp_path / "b", seed=1))
        weights = model_snapshot(policy, 1, torch.float32, place)
        two.push(weights)
        held = [engine_parameters(llm) for llm in (engine, second)]
        assert two.version == 1 and held[0].keys() == held[1].keys()
        assert all(torch.equal(tensor, held[1][name]) for name, tensor in held[0].items())
        buckets = [name for name in os.listdir(tmp_path) if name.startswith("bucket-")]
        assert len(buckets) == 2 and two.buckets[0].flat.shared_path != two.buckets[1].flat.shared_path
        queries = [f"sort: {' '.join(['fox', 'ant', 'cat', 'yak', 'bee', 'cow', 'dog'][: 2 + i])} ->" for i in range(7)]
        prompts = [tokenizer(q).input_ids for q in queries]
        eos, seeds = tokenizer.eos_token_id, [100 + i for i in range(7)]
        alone = rloo.generate(one, ("rollout", 0), prompts, 3, 0.7, 12, eos, seeds, logprobs=True)
        both = rloo.generate(two, ("rollout", 0), prompts, 3, 0.7, 12, eos, seeds, logprobs=True)
        assert both[0] == alone[0]  # the same completions, in prompt order
        diff = max(abs(a - b) for la, lb in zip(alone[1], both[1]) for a, b in zip(la, lb))
        print(f"two engines against one: max |logprob difference| {diff:.2e}")
        assert diff == 0.0  # the same logprobs, bit for bit: a batch of 4 or 3 prompts rounds as one of 7 here
        greedy = ("evaluation", 1), prompts, 1, 0.0, 12, eos, seeds
        evaluation = [rloo.generate(e, *greedy)[0] for e in (one, two)]
        assert evaluation[0] == evaluation[1]
        two.versions = [1, 2]
        with pytest.raises(RuntimeError, match=r"the engines hold different policy versions: \[1, 2\]"):
            two.version
        first = AutoModelForCausalLM.from_pretrained(policy_a)  # the module's engine as it started
        push_weights(engine, one.buckets[0], model_snapshot(first, 0, torch.float32, place))
    finally:
        second.llm_engine.engine_core.shutdown()


def trainer_logprobs(model, prompt: list[int], tokens: list[int], temperature: float, past=None) -> list[float]:
    """The trainer's logprob (after temperature) of each of `tokens` after `prompt`; with `past` (the keys and values
    of the first tokens of prompt + tokens, another model's), only the rest is computed by `model`."""
    ids = torch.tensor([prompt + tokens])
    start = 0 if past is None else past.get_seq_length()
    with torch.no_grad():
        logits = model(ids[:, start:], past_key_values=past).logits[0]
    logprobs = (logits / temperature).log_softmax(-1)
    # the logit at position i (of the computed part) predicts token start + i + 1
    return [logprobs[len(prompt) + i - 1 - start, token].item() for i, token in enumerate(tokens)]


@on_the_module_engine
@pytest.mark.parametrize("kv", ["recompute", "keep"])
def test_a_push_between_two_segments_changes_the_logprobs_after_it_and_not_before(
    engine, policy_a, tokenizer, tmp_path, kv
):
    """In-flight decoding (plumbing/inflight.py): 5 tokens of each of 3 sampled sequences under policy a (version 0),
    then a push of policy b (version 1), then the rest (one sampled EOS before the push). Every token records the version that sampled it, exactly, and
    the engine's logprob of it is the trainer's under that version: under "recompute" the first 5 are a's and the
    others b's, each given its whole prefix (to 1e-5, float32 on both sides); under "keep" the tokens after the push
    are b's given the keys and values a computed for the prefix's whole KV-cache blocks (the cache keeps whole blocks:
    the first 32 of the 50 tokens), which a differs from b's own by far more than numerics."""
    from transformers import AutoModelForCausalLM

    from plumbing.inflight import Sequence, decode_segment

    g = torch.Generator().manual_seed(0)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
        for _ in range(3)
    ]
    models = {
        0: AutoModelForCausalLM.from_pretrained(policy_a).eval(),
        1: AutoModelForCausalLM.from_pretrained(save_random_policy(tokenizer, tmp_path / "policy_b", seed=1)).eval(),
    }
    place = SnapshotPlace(pinned=False, folder=str(tmp_path))
    bucket = WeightBucket(None, str(tmp_path))
    push_weights(engine, bucket, model_snapshot(models[0], 0, torch.float32, place))
    engines, eos, temperature = plumbing.Engine.around([engine], [None]), tokenizer.eos_token_id, 0.7
    sequences = [Sequence(p, seed=i, max_tokens=12, salt=f"{kv}-rollout-0") for i, p in enumerate(prompts)]
    decode_segment(engines, sequences, 5, 0, temperature, eos, ("rollout", 0))
    before = [list(s.tokens) for s in sequences]
    weights = model_snapshot(models[1], 1, torch.float32, place)
    push_weights(engine, bucket, weights, reset_prefix_cache=kv == "recompute")
    while not all(s.done for s in sequences):
        decode_segment(engines, sequences, 5, 1, temperature, eos, ("rollout", 0))
    gaps = {"before": [], "after": [], "after, a's prefix": []}
    for sequence, first in zip(sequences, before):
        assert sequence.tokens[: len(first)] == first and (len(first) == 5 or first[-1] == eos)
        assert sequence.versions == [0] * len(first) + [1] * (len(sequence.tokens) - len(first))
        assert len(sequence.logprobs) == len(sequence.tokens)
        under_a = trainer_logprobs(models[0], sequence.prompt, sequence.tokens, temperature)
        under_b = trainer_logprobs(models[1], sequence.prompt, sequence.tokens, temperature)
        with torch.no_grad():  # a's keys and values of the first KV-cache block, the rest b's
            past = models[0](torch.tensor([(sequence.prompt + sequence.tokens)[:BLOCK_SIZE]])).past_key_values
        kept = trainer_logprobs(models[1], sequence.prompt, sequence.tokens, temperature, past=past)
        expected = under_b if kv == "recompute" else kept
        gaps["before"] += [abs(e - t) for e, t in zip(sequence.logprobs[:5], under_a[:5])]
        gaps["after"] += [abs(e - t) for e, t in zip(sequence.logprobs[5:], expected[5:])]
        gaps["after, a's prefix"] += [abs(e - t) for e, t in zip(sequence.logprobs[5:], under_a[5:])]
        if kv == "keep":  # what keeping the KV changes: b's logprobs given a's KV of the first block
            assert sequence.done and (len(first) < 5 or max(abs(k - b) for k, b in zip(kept[5:], under_b[5:])) > 1e-2)
    print(kv, {name: f"{max(gap):.2e}" for name, gap in gaps.items()}, [len(s.tokens) for s in sequences])
    assert sum(len(s.tokens) > 5 for s in sequences) >= 2  # sequences that went on after the push
    assert max(gaps["before"]) < 1e-5 and max(gaps["after"]) < 1e-5
    assert min(gaps["after, a's prefix"]) > 1e-3  # after the push, not policy a's
    engine.reset_prefix_cache()


@on_the_module_engine
def test_a_failure_in_the_generation_thread_surfaces_in_the_trainer(engine, tokenizer, tmp_path):
    """Fault injected with a real engine error: a prompt token id outside the vocabulary."""
    args = dpo.Args(num_samples=2, response_length=4, local_micro_batch_size=2, total_episodes=8)  # 2 steps of 2 x 2
    bad_prompts = dpo.Prompts([[tokenizer.bos_token_id, 10_000]] * 4, [""] * 4, [""] * 4)
    inputs = dpo.Inputs(tokenizer, None, bad_prompts, dpo.Prompts([], [], []))
    link = plumbing.Engine.around([engine], [WeightBucket(None, str(tmp_path))])
    channel = plumbing.Channel(link)
    schedule, sizes = dpo.generation_schedule(2, 1, []), dpo.compute_sizes(args, 1)
    start = time.perf_counter()
    channel.run_thread(dpo.generation_thread, link, channel, schedule, inputs, args, sizes)
    with pytest.raises(RuntimeError, match="generation thread failed") as raised:
        channel.get(channel.rollouts)
    assert time.perf_counter() - start < 10
    assert raised.value.__cause__ is channel.thread_error
    channel.thread.join(timeout=5)
    assert not channel.thread.is_alive()


def engine_parameters(llm) -> dict[str, torch.Tensor]:
    """Every parameter of the engine's model, copied to the CPU (plumbing.receiver.WeightReceiver, in the worker)."""
    from safetensors.torch import load

    return load(llm.collective_rpc("parameter_copies")[0])


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", PUSHED_FAMILIES)
def test_each_push_loads_exactly_what_a_checkpoint_would(arch, tied, tokenizer, tmp_path):
    """The scripts' engine (plumbing.engine.make_engine) takes three pushes (push_weights, as the scripts push) of
    models whose every tensor differs, norms and biases included, for each family researchers train now: GPTNeoX, Llama
    (untied and tied), Qwen2, Qwen3 (tied), Mistral, Gemma 2, OLMo 2, Phi-3, GPT-2, and a mixture of experts, Qwen3-MoE
    (transformers fuses its experts in memory; the push sends them as on disk, one tensor per expert and projection).
    After each, the engine says it holds the pushed version (plumbing.weights._check_loaded: its parameters match the
    trainer's fingerprint), through one bucket that holds the whole snapshot (version 1) and through one that holds its
    largest layer (2 and 3: a push of several loads, a layer at a time, each layer larger than the bucket's least, a
    layer whose tensors carry an expert's number too), every engine parameter is bit for bit what vLLM's loader makes
    of the same model saved by save_pretrained, and differs from the previous version's; long prompts (the prefix cache
    was reset) give the new model's greedy tokens and logprobs (vLLM's own after loading the saved model, bit for bit;
    and transformers', the mixture of experts' too: its CPU experts packed again after each load, which vLLM's reload
    skips, WeightReceiver.repack_experts; without it, logprobs 0.05 apart). vLLM's CPU linear layers repack their
    weights and leave the parameter empty: those are compared by their fingerprints, read back through their kernels,
    and through the logprobs, which every weight moves. tests/test_gpu.py does the same by CUDA IPC on a GPU for GPTNeoX and Llama,
    every parameter compared."""
    models = [perturbed_policy(tokenizer, arch, tied, seed) for seed in range(4)]
    models[0].save_pretrained(tmp_path / "v0")
    tokenizer.save_pretrained(tmp_path / "v0")
    placement = engine_placement("auto", [], 1, None)
    ours = {process.pid for process in psutil.Process().children(recursive=True)}
    llm = make_engine(
        str(tmp_path / "v0"), placement, dtype="float32", max_model_len=128, enforce_eager=True, seed=0, block_size=32
    )
    processes = started_processes(ours)
    shared_memory = shared_memory_files(processes)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = [
            [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (PROMPT_LENGTH,), generator=g).tolist()
            for _ in range(3)
        ]
        greedy_with_engine(llm, prompts, 4)  # the prefix cache holds version 0's KV
        before = engine_parameters(llm)
        place = SnapshotPlace(pinned=False, folder=str(tmp_path))
        whole, small = WeightBucket(None, str(tmp_path)), WeightBucket(None, str(tmp_path), least=1)
        for version, model in enumerate(models[1:], start=1):  # each push probed, as the scripts' are
            weights = model_snapshot(model, version, torch.float32, place, probed=True)
            bucket = whole if version == 1 else small
            push_weights(llm, bucket, weights)
            loads = len(bucket_chunks(weights.layout, bucket.flat.numel()))
            assert loads == 1 if version == 1 else loads > 3, loads
            # what the engine says it holds, which push_weights has checked already (_check_loaded)
            held = llm.collective_rpc("holds", args=(shared_handle(weights.flat), weights.layout))[0]
            assert held["compared"] > 0 and held["differ"] == [], held
            pushed, generated = engine_parameters(llm), greedy_with_engine(llm, prompts, 4)
            sent = [(name, shape) for name, shape, _ in weights.layout]
            pushed_fingerprint = llm.collective_rpc("fingerprint", args=(sent,))[0]
            model.save_pretrained(tmp_path / f"v{version}")
            llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp_path / f"v{version}")})
            # vLLM's reload from a file skips the CPU experts' packing as the push's does: redone alike (the logprobs
            # against transformers' below prove it right)
            llm.collective_rpc("repack_experts", args=([name for name, _ in sent],))
            llm.reset_prefix_cache()
            saved = engine_parameters(llm)
            # the repacked weights too: the same values, summed in the same order
            assert llm.collective_rpc("fingerprint", args=(sent,))[0] == pushed_fingerprint
            assert greedy_with_engine(llm, prompts, 4) == generated  # the same tokens and logprobs, bit for bit
            assert pushed.keys() == saved.keys() == before.keys()
            compared = [name for name in pushed if pushed[name].numel() > 0]
            assert len(compared) >= len(pushed) // 2, compared  # norms, biases, embeddings, the head
            for name in compared:
                assert torch.equal(pushed[name], saved[name]), (version, name)
                assert not torch.equal(pushed[name], before[name]), (version, name, "not pushed")
            before = pushed
            for prompt, (tokens, logprobs) in zip(prompts, generated):
                expected_tokens, expected_logprobs = greedy_with_transformers(model, prompt, 4)
                assert tokens == expected_tokens, version
                assert logprobs == pytest.approx(expected_logprobs, abs=1e-5), version  # float32: 2.2e-6 at most
    finally:
        # stopped as the scripts stop it (plumbing.Engine.stop): its worker's own exit takes seconds, ten engines here
        llm.llm_engine.engine_core.shutdown(timeout=1)
        kill_process_trees(processes)
        release_shared_memory(shared_memory)
