"""The pure pieces of online_dpo_async.py against hand-computed numbers or slow obvious versions."""

import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import TINY, small_config

import online_dpo_async as dpo


# ------------------------------------------------------------------------------ loss and pairs
def test_dpo_sigmoid_and_ipo_losses_match_hand_computed_numbers():
    chosen, rejected = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    ref_chosen, ref_rejected = torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -2.0])
    # h = (logp_c - ref_c) - (logp_r - ref_r) = [1.0, -2.0]
    sigmoid = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="sigmoid")
    assert sigmoid.tolist() == pytest.approx([math.log(1 + math.exp(-0.1)), math.log(1 + math.exp(0.2))], abs=1e-6)
    ipo = dpo.dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.1, loss_type="ipo")
    assert ipo.tolist() == pytest.approx([(1.0 - 5.0) ** 2, (-2.0 - 5.0) ** 2])


def test_best_and_worst_of_four_with_ties_are_deterministic():
    scores = torch.tensor([[1.0, 3.0, 3.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, -1.0, -1.0], [4.0, 1.0, 2.0, 3.0]])
    chosen, rejected, tied = dpo.select_chosen_rejected(scores)
    assert chosen.tolist() == [1, 0, 1, 0]  # first of the best
    assert rejected.tolist() == [3, 3, 3, 1]  # last of the worst: never the chosen one when K >= 2
    assert tied.tolist() == [False, True, False, False]


def test_tied_pairs_add_nothing_to_the_loss_but_count_in_its_denominator():
    """Kept on purpose (docs/algorithms.md, "Tied pairs and the DPO denominator"): sum over the untied pairs / all pairs of the micro-batch, so
    the gradient is the untied-only mean's times untied / all."""
    logps_c = torch.tensor([-1.0, -3.0, -2.0, -0.5, -4.0], requires_grad=True)
    logps_r = torch.tensor([-2.0, -1.0, -2.0, -1.5, -1.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-1.5, -2.0, -2.0, -1.0, -3.0]), torch.tensor([-1.5, -2.0, -2.0, -1.0, -2.0])
    tied = torch.tensor([False, False, True, True, False])
    loss = dpo.dpo_batch_loss(dpo.dpo_loss(logps_c, logps_r, ref_c, ref_r, beta=0.1, loss_type="sigmoid"), tied)
    # by hand: h = [1, -2, 0, 1.5, -2] (the tied pairs' h are ignored); -log sigmoid(0.1 h) = log(1 + exp(-0.1 h))
    untied_h = [1.0, -2.0, -2.0]
    assert loss.item() == pytest.approx(sum(math.log(1 + math.exp(-0.1 * h)) for h in untied_h) / 5, abs=1e-6)
    loss.backward()
    grad_c, grad_r = logps_c.grad.clone(), logps_r.grad.clone()
    # the untied pairs alone, averaged over themselves
    untied = ~tied
    c, r = logps_c.detach()[untied].requires_grad_(), logps_r.detach()[untied].requires_grad_()
    dpo.dpo_loss(c, r, ref_c[untied], ref_r[untied], beta=0.1, loss_type="sigmoid").mean().backward()
    torch.testing.assert_close(grad_c[untied], c.grad * 3 / 5)
    torch.testing.assert_close(grad_r[untied], r.grad * 3 / 5)
    assert grad_c[tied].tolist() == [0.0, 0.0] and grad_r[tied].tolist() == [0.0, 0.0]
    # the by-hand gradient of one untied pair: d/dlogp_c log(1 + exp(-0.1 h)) / 5 = -0.1 sigmoid(-0.1 h) / 5
    assert grad_c[0].item() == pytest.approx(-0.1 / (1 + math.exp(0.1)) / 5, abs=1e-7)
    # every pair tied: loss 0 (no pair is informative), not 0 / 0
    assert dpo.dpo_batch_loss(torch.tensor([0.7, 0.2]), torch.tensor([True, True])).item() == 0.0


def test_win_rate_counts_ties_as_one_half():
    assert dpo.win_rates([0.9, 0.5, 0.1], [0.5, 0.5, 0.5]) == [1.0, 0.5, 0.0]


# ------------------------------------------------------------------------------ responses
def test_truncation_after_first_eos_and_masks():
    ids, mask, eos = dpo.truncate_responses(
        [[5, 6, 2, 7, 8], [5, 6, 7], [2], [5, 6, 7, 8, 9, 10]], 5, eos_token_id=2, pad_token_id=0
    )
    assert ids.tolist() == [[5, 6, 2, 0, 0], [5, 6, 7, 0, 0], [2, 0, 0, 0, 0], [5, 6, 7, 8, 9]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert eos.tolist() == [True, False, True, False]


def test_truncation_when_pad_token_is_eos_token():
    ids, mask, eos = dpo.truncate_responses([[5, 2, 9], [5, 6, 7]], 4, eos_token_id=2, pad_token_id=2)
    assert ids.tolist() == [[5, 2, 2, 2], [5, 6, 7, 2]]
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert eos.tolist() == [True, False]


def test_missing_eos_penalty_replaces_the_score():
    scores = dpo.apply_missing_eos_penalty(torch.tensor([0.5, 0.7, -0.2]), torch.tensor([True, False, True]), -3.0)
    assert scores.tolist() == pytest.approx([0.5, -3.0, -0.2])


def test_left_pad_masks_come_from_lengths():
    ids, mask = dpo.left_pad([[7, 8], [9]], 4, pad_token_id=9)  # pad id equal to a real token
    assert ids.tolist() == [[9, 9, 7, 8], [9, 9, 9, 9]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]


# ------------------------------------------------------------------------------ logprobs and rewards
@pytest.fixture(scope="module")
def policy(tokenizer):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(small_config(tokenizer)).eval()


def slow_logprobs(model, query: list[int], response: list[int], temperature: float) -> list[float]:
    """One unpadded sequence, token by token."""
    with torch.no_grad():
        logits = model(torch.tensor([query + response])).logits[0]
    out = []
    for t, token in enumerate(response):
        out.append(torch.log_softmax(logits[len(query) - 1 + t] / temperature, -1)[token].item())
    return out


def test_logprobs_divide_by_temperature_and_ignore_padding(policy, tokenizer):
    query, response = [tokenizer.bos_token_id, 7, 8, 9], [10, 11, tokenizer.eos_token_id]
    expected = slow_logprobs(policy, query, response, temperature=0.7)
    assert expected != pytest.approx(slow_logprobs(policy, query, response, temperature=1.0), abs=1e-3)
    for prompt_length, response_length in [(4, 3), (9, 6), (16, 12)]:
        q_ids, q_mask = dpo.left_pad([query], prompt_length, tokenizer.pad_token_id)
        r_ids, r_mask, _ = dpo.truncate_responses(
            [response], response_length, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        with torch.no_grad():
            got = dpo.response_logprobs(policy, q_ids, q_mask, r_ids, r_mask, temperature=0.7)[0]
        assert got[:3].tolist() == pytest.approx(expected, abs=1e-5)
        assert got[3:].abs().sum() == 0


@pytest.fixture(scope="module")
def reward_model(tokenizer):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(1)
    return LlamaForSequenceClassification(small_config(tokenizer, num_labels=1)).eval()


def test_reward_is_read_at_the_last_real_token_whatever_the_padding(reward_model, tokenizer):
    query, response = [tokenizer.bos_token_id, 7, 8, 9], [10, 11, tokenizer.eos_token_id]
    with torch.no_grad():
        hidden = reward_model.model(torch.tensor([query + response])).last_hidden_state
        expected = reward_model.score(hidden[0, -1]).item()
    for prompt_length, response_length in [(4, 3), (10, 8)]:
        q_ids, q_mask = dpo.left_pad([query], prompt_length, tokenizer.pad_token_id)
        r_ids, r_mask, eos = dpo.truncate_responses(
            [response], response_length, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        got = dpo.score_completions(reward_model, tokenizer, tokenizer, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), 4)
        assert got.item() == pytest.approx(expected, abs=1e-5)


def permuted_tokenizer(tokenizer, tmp_path, seed=0):
    """The same tokenizer with every id moved: a reward model with another tokenizer."""
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    new_ids = list(range(len(vocab)))
    random.Random(seed).shuffle(new_ids)
    mapping = {old: new_ids[old] for old in vocab.values()}
    spec["model"]["vocab"] = {tok: mapping[i] for tok, i in vocab.items()}
    for added in spec["added_tokens"]:
        added["id"] = mapping[added["id"]]
    for special in (spec.get("post_processor") or {}).get("special_tokens", {}).values():
        special["ids"] = [mapping[i] for i in special["ids"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    other = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
    )
    return other, mapping


def test_reward_model_with_another_tokenizer_goes_through_text(reward_model, tokenizer, tmp_path):
    other_tokenizer, mapping = permuted_tokenizer(tokenizer, tmp_path)
    other_model = type(reward_model)(reward_model.config).eval()
    other_model.load_state_dict(reward_model.state_dict())
    with torch.no_grad():
        old_rows = torch.tensor(sorted(mapping))
        other_model.model.embed_tokens.weight[torch.tensor([mapping[i] for i in sorted(mapping)])] = (
            reward_model.model.embed_tokens.weight[old_rows]
        )
    words = [t for t in tokenizer.get_vocab() if t.isalpha()][:6]
    queries = [
        tokenizer(f"sort: {words[0]} {words[1]} ->").input_ids,
        tokenizer(f"sort: {words[2]} {words[3]} {words[4]} ->").input_ids,
    ]
    body = [tokenizer.convert_tokens_to_ids(w) for w in words]
    responses = [[body[1], body[0], tokenizer.eos_token_id], [body[2], body[3]]]  # the second has no EOS
    q_ids, q_mask = dpo.left_pad(queries, 12, tokenizer.pad_token_id)
    r_ids, r_mask, eos = dpo.truncate_responses(responses, 5, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert not dpo.same_tokenizer(other_tokenizer, tokenizer)
    direct = dpo.score_completions(reward_model, tokenizer, tokenizer, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), 8)
    through_text = dpo.score_completions(
        other_model, other_tokenizer, tokenizer, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), 8
    )
    assert through_text.tolist() == pytest.approx(direct.tolist(), abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gptneox"])
def test_dropout_is_disabled(tokenizer, arch):
    from transformers import AutoModelForCausalLM

    dropouts = dict(attention_dropout=0.5) if arch == "llama" else dict(attention_dropout=0.5, hidden_dropout=0.5)
    model = AutoModelForCausalLM.from_config(small_config(tokenizer, arch, **dropouts)).train()
    ids = torch.tensor([[tokenizer.bos_token_id, 7, 8, 9, 10]])
    assert not torch.equal(model(ids).logits, model(ids).logits)
    dpo.disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------ sizes, data order, schedule
def test_derived_sizes_and_indivisible_errors():
    args = dpo.Args(
        total_episodes=128,
        local_micro_batch_size=4,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_samples=2,
        num_ppo_epochs=3,
    )
    sizes = dpo.compute_sizes(args, world_size=2)
    assert (sizes.local_mini_batch_size, sizes.mini_batch_size, sizes.local_batch_size, sizes.batch_size) == (
        8,
        16,
        16,
        32,
    )
    assert (sizes.episodes_per_step, sizes.num_steps, sizes.num_updates) == (64, 2, 12)
    with pytest.raises(ValueError, match="--total_episodes 100 .* 64"):
        dpo.compute_sizes(
            dpo.Args(total_episodes=100, local_micro_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2), 2
        )
    with pytest.raises(ValueError, match="--async_level"):
        dpo.compute_sizes(dpo.Args(async_level=-1), 1)
    with pytest.raises(ValueError, match="--num_samples"):
        dpo.compute_sizes(dpo.Args(num_samples=1), 1)


def test_each_prompt_batch_is_seen_once_per_epoch_in_a_seeded_order():
    steps = [dpo.prompt_indices_for_step(s, num_prompts=10, batch_size=3, seed=5) for s in range(6)]
    first_epoch, second_epoch = np.concatenate(steps[:3]), np.concatenate(steps[3:])
    assert len(set(first_epoch)) == 9 and len(set(second_epoch)) == 9  # one leftover prompt per epoch
    assert not np.array_equal(first_epoch, second_epoch)
    assert np.array_equal(steps[4], dpo.prompt_indices_for_step(4, 10, 3, seed=5))


@pytest.mark.parametrize("async_level", [0, 1, 3])
def test_generation_schedule_obeys_the_staleness_contract(async_level):
    num_steps, eval_steps = 10, [0, 4, 8, 10]
    schedule = dpo.generation_schedule(num_steps, async_level, eval_steps)
    rollouts = [(index, version) for kind, index, version in schedule if kind == "rollout"]
    assert rollouts == [(m, max(0, m - async_level)) for m in range(num_steps)]
    assert [index for kind, index, _ in schedule if kind == "eval"] == eval_steps
    assert [v for _, _, v in schedule] == sorted(v for _, _, v in schedule)  # the engine never goes back
    # No deadlock: theta_v exists once the trainer has trained step v - 1, i.e. after rollout v - 1.
    position = {(kind, index): i for i, (kind, index, _) in enumerate(schedule)}
    for i, (kind, index, version) in enumerate(schedule):
        if version > 0:
            assert position[("rollout", version - 1)] < i
    assert dpo.published_versions(schedule) == {max(0, m - async_level) for m in range(num_steps)} - {0} | {4, 8, 10}


# ------------------------------------------------------------------------------ the tiny task's gold judge
def test_gold_judge_is_the_builders_and_scores_by_hand():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build", TINY / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    rng = random.Random(0)
    words = build.WORDS
    for _ in range(300):
        query = build.make_query(rng.sample(words, rng.randint(3, 6)))
        response = " ".join(rng.choice(words) for _ in range(rng.randint(0, 8))) + rng.choice(["", " </s>"])
        assert dpo.tiny_gold_score(query, response) == build.tiny_gold_score(query, response)
    query = build.make_query(["fox", "ant", "cat"])
    assert dpo.tiny_gold_score(query, "ant cat fox </s>") == 1.0
    assert dpo.tiny_gold_score(query, "ant cat fox") == 0.0  # right words, never stopped


# ------------------------------------------------------------------------------ data loading
def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_prompts_load_from_a_folder_a_file_or_parquet_and_long_ones_are_dropped(tokenizer, tmp_path, capsys):
    import datasets

    rows = [
        {"query": "sort: fox ant ->", "reference_response": "ant fox </s>"},
        {"query": "sort: " + " ".join(["fox"] * 30) + " ->", "reference_response": "fox </s>"},
        {"query": "sort: cat ->", "reference_response": "cat </s>"},
    ]
    (tmp_path / "folder").mkdir()
    write_rows(tmp_path / "folder" / "train.jsonl", rows)
    write_rows(tmp_path / "single.jsonl", rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    for name in (tmp_path / "folder", tmp_path / "single.jsonl", tmp_path / "rows.parquet"):
        prompts = dpo.load_prompts(str(name), "train", tokenizer, max_prompt_length=12)
        assert prompts.queries == [rows[0]["query"], rows[2]["query"]]
        assert prompts.references == [rows[0]["reference_response"], rows[2]["reference_response"]]
        assert prompts.token_ids[0] == tokenizer(rows[0]["query"]).input_ids
        assert "dropped 1 of 3 prompts longer than --max_prompt_length 12" in capsys.readouterr().out


def test_a_dataset_without_the_needed_columns_is_a_clear_error(tokenizer, tmp_path):
    write_rows(tmp_path / "bad.jsonl", [{"prompt": "sort: fox ant ->"}])
    with pytest.raises(
        ValueError, match=r"--dataset_name .*bad.jsonl .* lacks column\(s\) \['query', 'reference_response'\]"
    ):
        dpo.load_prompts(str(tmp_path / "bad.jsonl"), "train", tokenizer, max_prompt_length=12)
