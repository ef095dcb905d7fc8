"""The pure pieces of online_dpo_async.py against hand-computed numbers or slow obvious versions."""

import copy
import json
import math
import random

import numpy as np
import pytest
import torch
from conftest import TINY, small_config

import online_dpo_async as dpo
import plumbing


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


def test_pairs_put_each_prompts_chosen_at_row_i_and_its_rejected_at_row_b_plus_i():
    """preference_pairs as main calls it, on B = 4 prompts x K = 3 completions (prompt-major, as to_batch repeats
    them) whose every field differs in every row, so a row taken from the wrong place shows in all five."""
    rows = torch.arange(4 * 3)
    column = rows[:, None]
    batch = dpo.Batch(column + 100, column % 2, column + 200, column % 3, rows % 2 == 0)
    scores = torch.tensor([[0.1, 0.9, 0.5], [2.0, 2.0, 2.0], [0.3, -1.0, 0.3], [-0.5, 0.7, 0.7]]).flatten()
    pairs, tied = dpo.preference_pairs(batch, scores, K=3)
    # chosen = first best, rejected = last worst: prompt 0 (rows 0-2): 1 and 0; prompt 1, tied: 3 and 5;
    # prompt 2 (rows 6-8): 6 and 7; prompt 3 (rows 9-11): 10 and 9
    expected = torch.tensor([1, 3, 6, 10, 0, 5, 7, 9])
    for name, got, full in zip(dpo.Batch._fields, pairs, batch):
        assert torch.equal(got, full[expected]), name
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


# ------------------------------------------------------------------------------ the update
def random_pairs(tokenizer, num_pairs: int, args: dpo.Args) -> dpo.Batch:
    """Random prompts and two random completions of each, 1 to 8 words, the odd lengths stopped by EOS, the long
    ones cut at --response_length: row i is pair i's chosen completion, row B + i its rejected one."""
    g = torch.Generator().manual_seed(2)

    def words(n: int) -> list[int]:
        return torch.randint(4, len(tokenizer), (n,), generator=g).tolist()

    prompt_lengths = torch.randint(1, 6, (num_pairs,), generator=g).tolist()
    prompts = [[tokenizer.bos_token_id, *words(n)] for n in prompt_lengths]
    lengths = torch.randint(1, 9, (2 * num_pairs,), generator=g).tolist()
    responses = [words(n) + [tokenizer.eos_token_id] * (n % 2) for n in lengths]
    return dpo.to_batch(prompts * 2, responses, 1, args, tokenizer, torch.device("cpu"))


def slow_sequence_logprob(model, pairs: dpo.Batch, row: int, temperature: float) -> torch.Tensor:
    """Summed logprob of one row's response, its prompt and response unpadded, in one forward pass."""
    query = pairs.query_ids[row][pairs.query_mask[row].bool()]
    response = pairs.response_ids[row][pairs.response_mask[row].bool()]
    logits = model(torch.cat([query, response])[None]).logits[0, len(query) - 1 : -1] / temperature
    return logits.log_softmax(-1).gather(1, response[:, None]).sum()


def slow_dpo_update(model, pairs: dpo.Batch, ref_logps, tied, args: dpo.Args, rng, lr: float) -> dict:
    """dpo_update by hand: T passes over B pairs in the order rng.permutation(B) gives each pass; every mini-batch
    of micro * G pairs one plain SGD step at lr (the step's, the same for all its updates) on the mean over its G
    micro-batches of (the untied pairs' losses summed) / micro, its gradient scaled down to a global norm of
    --max_grad_norm when above it. Pair i: chosen row i, rejected row B + i."""
    B, micro, G = len(tied), args.local_micro_batch_size, args.gradient_accumulation_steps
    clipped = []
    stats = {"loss": [], "logps_chosen": [], "logps_rejected": [], "kl": [], "margin": [], "accuracy": []}
    for epoch in range(args.num_ppo_epochs):
        order = rng.permutation(B).tolist()
        for mini_start in range(0, B, micro * G):
            model.zero_grad()
            for micro_start in range(mini_start, mini_start + micro * G, micro):
                losses, chosen, rejected, kl, margins = [], [], [], [], []
                for i in order[micro_start : micro_start + micro]:
                    c = slow_sequence_logprob(model, pairs, i, args.temperature)
                    r = slow_sequence_logprob(model, pairs, B + i, args.temperature)
                    h = (c - ref_logps[i]) - (r - ref_logps[B + i])
                    if args.loss_type == "sigmoid":
                        loss = torch.log(1 + torch.exp(-args.beta * h))
                    elif args.loss_type == "ipo":
                        loss = (h - 1 / (2 * args.beta)) ** 2
                    else:  # best_of_k_sft: the chosen completion's mean token NLL
                        loss = -c / pairs.response_mask[i].sum()
                    if not tied[i]:
                        losses.append(loss)
                    chosen.append(c.item())
                    rejected.append(r.item())
                    kl.append(((c - ref_logps[i]) + (r - ref_logps[B + i])).item() / 2)
                    margins.append(args.beta * h.item())  # every pair's, tied or not
                loss = sum(losses, torch.zeros(())) / micro
                if losses:
                    (loss / G).backward()
                stats["loss"].append(loss.item())
                stats["logps_chosen"].append(np.mean(chosen))
                stats["logps_rejected"].append(np.mean(rejected))
                stats["margin"].append(np.mean(margins))
                stats["accuracy"].append(np.mean([m > 0 for m in margins]))
                if epoch == 0:
                    stats["kl"].append(np.mean(kl))
            with torch.no_grad():
                norm = math.sqrt(sum((p.grad**2).sum().item() for p in model.parameters()))
                scale = 1.0 if args.max_grad_norm is None else min(1.0, args.max_grad_norm / (norm + 1e-6))
                clipped.append(scale < 1)
                for p in model.parameters():
                    p -= lr * scale * p.grad
    return {k: np.mean(v) for k, v in stats.items()} | {"clipped": np.mean(clipped)}


@pytest.mark.parametrize(
    "loss_type, micro, accumulation, mini_batches, epochs, max_grad_norm",
    [
        ("sigmoid", 2, 1, 1, 1, None),
        ("sigmoid", 2, 2, 1, 1, None),
        ("sigmoid", 2, 1, 2, 1, None),
        ("sigmoid", 2, 1, 1, 2, None),
        ("sigmoid", 2, 2, 2, 2, None),
        ("sigmoid", 1, 3, 1, 1, None),  # micro-batches of one pair: the last of each mini-batch is trained on too
        ("ipo", 2, 1, 1, 1, None),
        ("ipo", 2, 2, 2, 2, None),
        ("best_of_k_sft", 2, 1, 1, 1, None),
        ("best_of_k_sft", 2, 2, 2, 2, None),
        ("sigmoid", 2, 2, 2, 2, 0.02),  # every update's gradient clipped
        ("ipo", 2, 1, 2, 1, 0.5),
    ],
)
def test_dpo_update_is_sgd_on_the_pairs_losses_by_hand(
    tokenizer, loss_type, micro, accumulation, mini_batches, epochs, max_grad_norm
):
    """dpo_update as main calls it (a prepared fp32 model, accelerate's accumulation) against slow_dpo_update: the
    statistics it returns (the margins beta h and the share of them above 0 included) and every parameter's update,
    without and with gradient clipping. Micro-batches of `micro` pairs, every third pair tied, each row's reference
    logprob its own (the policy's own, moved by noise)."""
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    B = micro * accumulation * mini_batches
    args = dpo.Args(
        total_episodes=2 * B,
        local_micro_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_mini_batches=mini_batches,
        num_ppo_epochs=epochs,
        loss_type=loss_type,
        beta=0.5,
        max_prompt_length=6,
        response_length=6,
        max_grad_norm=max_grad_norm,
    )
    sizes = dpo.compute_sizes(args, world_size=1)
    assert sizes.local_batch_size == B
    lr = 0.01 if loss_type == "ipo" else 0.1  # IPO's squared loss has ~10x the gradient: at 0.1 it diverges
    torch.manual_seed(0)
    policy = LlamaForCausalLM(small_config(tokenizer))
    by_hand, before = copy.deepcopy(policy), copy.deepcopy(policy.state_dict())
    pairs = random_pairs(tokenizer, B, args)
    noise = torch.randn(2 * B, generator=torch.Generator().manual_seed(3))
    ref_logps = dpo.batch_logprobs(policy, pairs, args.temperature, 2 * B).sum(1) + noise
    tied = torch.arange(B) % 3 == 1

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    model, optimizer = accelerator.prepare(policy, torch.optim.SGD(policy.parameters(), lr=lr))
    stats = dpo.dpo_update(model, optimizer, accelerator, pairs, ref_logps, tied, args, sizes, np.random.default_rng(5))
    expected = slow_dpo_update(by_hand, pairs, ref_logps, tied, args, np.random.default_rng(5), lr)
    clipped = expected.pop("clipped")  # the share of the updates whose gradient was clipped
    assert clipped == 0 if max_grad_norm is None else clipped > 0
    for key, value in expected.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-5, abs=1e-6), key
    moved = torch.cat([(p.detach() - before[name]).flatten() for name, p in policy.named_parameters()])
    moved_by_hand = torch.cat([(p.detach() - before[name]).flatten() for name, p in by_hand.named_parameters()])
    # an update clipped to norm c moves a weight by lr x c at most
    assert moved_by_hand.abs().max() > (1e-2 if max_grad_norm is None else 0.02 * lr * max_grad_norm)
    torch.testing.assert_close(moved, moved_by_hand, rtol=0, atol=1e-5 * moved_by_hand.abs().max().item())


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
        r_ids, r_mask, eos = dpo.truncate_responses(
            [response], response_length, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        with torch.no_grad():
            got = dpo.response_logprobs(policy, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), temperature=0.7)[0]
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


def test_positions_count_the_real_tokens_from_zero():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    assert dpo.position_ids_from(mask).tolist() == expected


def test_left_padding_does_not_shift_a_learned_position_reward_model(tokenizer):
    """GPT-2 learns an embedding per absolute position: a left-padded sequence gets the score it gets alone only when
    its positions start at 0 at its first real token (with RoPE a uniform shift would not show)."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(4)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = GPT2ForSequenceClassification(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(std=1.0)  # positions that matter
    sequences = [[tokenizer.bos_token_id, 7, 8, 9, 10, 11], [tokenizer.bos_token_id, 12, 13], [14]]
    ids, mask = dpo.left_pad(sequences, 6, tokenizer.pad_token_id)
    with torch.no_grad():
        batched = dpo.get_reward(model, ids, mask)
        alone = [
            dpo.get_reward(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long)).item() for s in sequences
        ]
    assert batched.tolist() == pytest.approx(alone, abs=1e-6)


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
    assert not plumbing.same_tokenizer(other_tokenizer, tokenizer)
    direct = dpo.score_completions(reward_model, tokenizer, tokenizer, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), 8)
    through_text = dpo.score_completions(
        other_model, other_tokenizer, tokenizer, dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), 8
    )
    assert through_text.tolist() == pytest.approx(direct.tolist(), abs=1e-5)
    # score_batch takes the reward model's own tokenizer from Models: the text route, then the missing-EOS penalty
    models = dpo.Models(tokenizer, None, other_model, other_tokenizer, None, None)
    args = dpo.Args(missing_eos_penalty=-2.5, local_rollout_forward_batch_size=8)
    scores = dpo.score_batch(dpo.Batch(q_ids, q_mask, r_ids, r_mask, eos), ["unused"] * 2, models, args)
    assert scores.tolist() == pytest.approx([direct[0].item(), -2.5], abs=1e-5)


@pytest.mark.parametrize("arch", ["llama", "gptneox"])
def test_dropout_is_disabled(tokenizer, arch):
    from transformers import AutoModelForCausalLM

    dropouts = dict(attention_dropout=0.5) if arch == "llama" else dict(attention_dropout=0.5, hidden_dropout=0.5)
    model = AutoModelForCausalLM.from_config(small_config(tokenizer, arch, **dropouts)).train()
    ids = torch.tensor([[tokenizer.bos_token_id, 7, 8, 9, 10]])
    assert not torch.equal(model(ids).logits, model(ids).logits)
    dpo.disable_dropout(model)
    assert torch.equal(model(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------ scores and evaluation
@pytest.fixture(scope="module")
def tiny_models(tokenizer):
    """The tiny task's SFT policy as the reference, its reward model (fp32), no gold model (--gold_judge tiny)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    reference = AutoModelForCausalLM.from_pretrained(TINY / "sft").eval()
    reward_model = AutoModelForSequenceClassification.from_pretrained(TINY / "reward").eval()
    return dpo.Models(tokenizer, reference, reward_model, tokenizer, None, None)


def word_ids(tokenizer, text: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(word) for word in text.split()]


def reward_of(reward_model, ids: list[int]) -> float:
    """The reward model's score of one unpadded sequence."""
    with torch.no_grad():
        mask = torch.ones(1, len(ids), dtype=torch.long)
        return dpo.get_reward(reward_model, torch.tensor([ids]), mask).item()


def test_score_batch_gives_the_penalty_without_eos_and_the_reward_models_score_with_it(tokenizer, tiny_models):
    """2 prompts x 2 completions, scored in forward passes of 3: with EOS (one with words after it, which are cut),
    the reward model's score of prompt + completion up to EOS; without (cut at --response_length, or short),
    exactly --missing_eos_penalty."""
    args = dpo.Args(missing_eos_penalty=-2.5, response_length=5, local_rollout_forward_batch_size=3)
    prompts = [tokenizer("sort: fox ant cat ->").input_ids, tokenizer("sort: dog bee ->").input_ids]
    texts = ["ant cat fox </s>", "ant cat fox cat fox yak", "bee dog </s> ant", "bee dog"]
    batch = dpo.to_batch(prompts, [word_ids(tokenizer, t) for t in texts], 2, args, tokenizer, torch.device("cpu"))
    scores = dpo.score_batch(batch, ["unused"] * 4, tiny_models, args)
    rm = tiny_models.reward_model
    cut_at_eos = [(prompts[0], "ant cat fox </s>"), (prompts[1], "bee dog </s>")]
    with_eos = [reward_of(rm, prompt + word_ids(tokenizer, text)) for prompt, text in cut_at_eos]
    assert [scores[0].item(), scores[2].item()] == pytest.approx(with_eos, abs=1e-5)
    assert scores[1].item() == scores[3].item() == -2.5
    assert abs(reward_of(rm, prompts[1] + word_ids(tokenizer, "bee dog")) + 2.5) > 0.1  # the penalty shows


def test_gsm8k_scores_are_the_verifiers_with_no_missing_eos_penalty():
    """Table 10 has no penalty: a right answer cut without EOS scores 1, as one that stopped does."""
    from test_tasks import number_tokenizer  # a word-level tokenizer that can write "#### 40"

    tokenizer = number_tokenizer()
    args = dpo.Args(task="gsm8k", missing_eos_penalty=-2.5, response_length=3)
    texts = ["#### 40 </s>", "so #### 40 so", "#### 12 </s>", "#### 12"]  # the second cut at 3 tokens, no EOS
    responses = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    batch = dpo.to_batch([[tokenizer.bos_token_id]] * 2, responses, 2, args, tokenizer, torch.device("cpu"))
    assert batch.contain_eos.tolist() == [True, False, True, False]
    models = dpo.Models(tokenizer, None, None, None, None, None)
    scores = dpo.score_batch(batch, ["#### 40", "#### 40", "#### 40", "#### 12"], models, args)
    assert scores.tolist() == [1.0, 1.0, 0.0, 1.0]


def test_gsm8k_texts_without_an_answer_do_not_match():
    assert dpo.gsm8k_reward("no answer here", "nor here") == 0.0
    assert dpo.gsm8k_reward("#### 40", "#### 40") == 1.0


def test_gsm8k_evaluation_pass_at_1_is_the_share_of_right_answers():
    """Three GSM8k prompts, two answered right (one cut without EOS: no penalty), one wrong: pass@1 2/3."""
    from test_tasks import number_tokenizer
    from transformers import LlamaForCausalLM

    tokenizer = number_tokenizer()
    torch.manual_seed(0)
    reference = LlamaForCausalLM(small_config(tokenizer)).eval()
    models = dpo.Models(tokenizer, reference, None, None, None, None)
    args = dpo.Args(task="gsm8k", response_length=3, local_rollout_forward_batch_size=2)
    answers = ["so #### 40", "#### 12", "#### 40"]
    evaluation = dpo.Prompts([[tokenizer.bos_token_id]] * 3, ["q1", "q2", "q3"], answers)
    texts = ["#### 40 </s>", "#### 40 </s>", "so #### 40 so"]  # right, wrong, right but cut at 3 tokens
    responses = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    metrics, _, _ = dpo.evaluate(responses, evaluation, models, args, torch.device("cpu"))
    assert metrics["eval/pass@1"] == pytest.approx(2 / 3)
    assert metrics["eval/num_eos_tokens"] == pytest.approx(2 / 3)


def test_evaluate_by_hand(tokenizer, tiny_models):
    """evaluate on four hand-made completions against the tiny task's references, with tiny_gold_score worked out
    by hand (target = the query's words sorted; q = (in_place + f1 + ordered) / 3; 2q - 1 stopped, q - 1 not):
    1. policy "ant cat fox </s>" 1 beats reference "ant fox cat </s>": in_place 1/3, f1 1, ordered 1/2,
       q 11/18, 2/9
    2. policy "bee dog </s>" (the "ant" after EOS is cut) 1 beats reference "bee dog", q 1 unstopped: 0
    3. policy "elk yak emu </s>" (elk in place) ties reference "emu elk yak </s>" (yak in place): both 2/9
    4. policy "cow" x 8, cut at 6 tokens: in_place 1/2, f1 2 * 1 / (6 + 2) = 1/4, ordered 0/5, q 1/4, -3/4,
       loses to reference "ape cow </s>": 1."""
    args = dpo.Args(missing_eos_penalty=-2.5, response_length=6, local_rollout_forward_batch_size=3)
    queries = ["sort: fox ant cat ->", "sort: dog bee ->", "sort: yak elk emu ->", "sort: cow ape ->"]
    references = ["ant fox cat </s>", "bee dog", "emu elk yak </s>", "ape cow </s>"]
    policy = ["ant cat fox </s>", "bee dog </s> ant", "elk yak emu </s>", " ".join(["cow"] * 8)]
    evaluation = dpo.Prompts([tokenizer(q).input_ids for q in queries], queries, references)
    responses = [word_ids(tokenizer, t) for t in policy]
    metrics, _, completions = dpo.evaluate(responses, evaluation, tiny_models, args, torch.device("cpu"))

    assert completions == ["ant cat fox", "bee dog", "elk yak emu", " ".join(["cow"] * 6)]
    assert metrics["eval/win_rate"] == pytest.approx((1 + 1 + 0.5 + 0) / 4, abs=1e-12)  # swapped: 3/8
    assert metrics["eval/gold_score"] == pytest.approx((1 + 1 + 2 / 9 - 3 / 4) / 4, abs=1e-12)
    assert metrics["eval/num_eos_tokens"] == 3 / 4
    assert metrics["eval/response_length"] == (4 + 3 + 4 + 6) / 4  # tokens up to and including EOS
    # the completions as the models read them: up to and including EOS, or cut at --response_length
    kept = [word_ids(tokenizer, t) for t in ("ant cat fox </s>", "bee dog </s>", "elk yak emu </s>", "cow " * 6)]
    sequences = list(zip(evaluation.token_ids, kept))
    perplexities = [math.exp(-np.mean(slow_logprobs(tiny_models.ref_policy, q, r, 1.0))) for q, r in sequences]
    assert metrics["eval/ref_perplexity"] == pytest.approx(np.mean(perplexities), rel=1e-5)
    scores = [reward_of(tiny_models.reward_model, q + r) for q, r in sequences[:3]] + [-2.5]  # the 4th: no EOS
    assert metrics["eval/scores"] == pytest.approx(np.mean(scores), abs=1e-5)


def test_no_robots_references_are_judged_as_completions_that_stopped(tokenizer, tiny_models):
    """With a gold model on No Robots, a human answer gets the EOS a policy's completion that stopped carries: the
    gold score of each reference is the gold model's on query + reference + EOS (the tiny reward model as gold)."""
    args = dpo.Args(task="no_robots", response_length=6, local_rollout_forward_batch_size=3)
    models = tiny_models._replace(gold_model=tiny_models.reward_model, gold_tokenizer=tokenizer)
    queries = ["sort: fox ant cat ->", "sort: dog bee ->"]
    references = ["ant cat fox", "dog bee"]
    evaluation = dpo.Prompts([tokenizer(q).input_ids for q in queries], queries, references)
    responses = [word_ids(tokenizer, t) for t in ("ant cat fox </s>", "bee")]
    _, rows, _ = dpo.evaluate(responses, evaluation, models, args, torch.device("cpu"))
    gold = [tiny_models.reward_model, tokenizer]
    with_eos = dpo.score_texts(*gold, [q + r + "</s>" for q, r in zip(queries, references)], 3, "cpu").tolist()
    without = dpo.score_texts(*gold, [q + r for q, r in zip(queries, references)], 3, "cpu").tolist()
    assert [row["reference_gold"] for row in rows] == [round(g, 3) for g in with_eos]
    assert all(abs(a - b) > 0.01 for a, b in zip(with_eos, without))  # the EOS shows


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
    assert (sizes.episodes_per_step, sizes.num_steps) == (64, 2)
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


def test_generation_schedule_and_what_is_owed_by_hand():
    """--num_steps 4 --async_level 1, evaluations of versions 0, 2, 4: rollout m by version max(0, m - 1); an
    evaluation of v after every rollout of v and before any of a later version."""
    schedule = dpo.generation_schedule(4, 1, [0, 2, 4])
    assert schedule == [
        ("rollout", 0, 0),
        ("rollout", 1, 0),
        ("eval", 0, 0),
        ("rollout", 2, 1),
        ("rollout", 3, 2),
        ("eval", 2, 2),
        ("eval", 4, 4),
    ]
    # a trainer about to run step 2, evaluation 0 logged: rollouts 2 and 3, evaluations 2 and 4
    assert dpo.pending_events(schedule, 2, {0}) == [
        ("rollout", 2, 1),
        ("rollout", 3, 2),
        ("eval", 2, 2),
        ("eval", 4, 4),
    ]
    assert dpo.pending_events(schedule, 3, {0, 2}) == [("rollout", 3, 2), ("eval", 4, 4)]
    assert dpo.pending_events(schedule, 0, set()) == schedule
    assert dpo.pending_events(schedule, 4, {0, 2, 4}) == []


def test_dpo_metrics_by_hand():
    sizes = dpo.compute_sizes(dpo.Args(total_episodes=64, local_micro_batch_size=4), world_size=1)
    assert sizes.episodes_per_step == 8
    reduced = dict(
        scores=0.5, kl=2.0, entropy=3.0, num_eos_tokens=0.75, tied=0.25, loss=0.6,
        logps_chosen=-4.0, logps_rejected=-7.0, accuracy=0.625, margin=1.5,
    )  # fmt: skip
    metrics = dpo.dpo_metrics(step=5, version=3, sizes=sizes, lr=0.01, reduced=reduced, beta=0.1)
    assert metrics == {
        "step": 5,
        "episode": 6 * 8,  # the pairs trained on up to and including this step
        "lr": 0.01,
        "async/lag": 2,
        "async/version": 3,
        "objective/scores": 0.5,
        "objective/kl": 2.0,
        "objective/entropy": 3.0,
        "objective/non_score_reward": pytest.approx(-0.2),
        "objective/rlhf_reward": pytest.approx(0.3),
        "val/num_eos_tokens": 0.75,
        "val/tied_pairs": 0.25,
        "loss/policy": 0.6,
        "logps/chosen": -4.0,
        "logps/rejected": -7.0,
        "rewards/accuracies": 0.625,
        "rewards/margins": 1.5,
    }


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
        prompts = dpo.load_prompts(dpo.Args(dataset_name=str(name), max_prompt_length=12), "train", tokenizer)
        assert prompts.queries == [rows[0]["query"], rows[2]["query"]]
        assert prompts.references == [rows[0]["reference_response"], rows[2]["reference_response"]]
        assert prompts.token_ids[0] == tokenizer(rows[0]["query"]).input_ids
        assert "dropped 1 of 3 prompts longer than --max_prompt_length 12" in capsys.readouterr().out


def test_a_dataset_without_the_needed_columns_is_a_clear_error(tokenizer, tmp_path):
    write_rows(tmp_path / "bad.jsonl", [{"prompt": "sort: fox ant ->"}])
    with pytest.raises(
        ValueError, match=r"--dataset_name .*bad.jsonl .* lacks column\(s\) \['query', 'reference_response'\]"
    ):
        dpo.load_prompts(dpo.Args(dataset_name=str(tmp_path / "bad.jsonl"), max_prompt_length=12), "train", tokenizer)
