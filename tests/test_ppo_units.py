"""The pure pieces of ppo_async.py against hand-computed numbers or slow obvious versions."""

import math

import pytest
import torch
from conftest import small_config

import ppo_async as ppo


def make_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()


# ------------------------------------------------------------------------------ GAE
def slow_gae(rewards: list[list[float]], values: list[list[float]], lengths: list[int], gamma: float, lam: float):
    """One sequence, one token at a time, backwards; the episode ends after the last real token."""
    advantages, returns = [], []
    for r, v, n in zip(rewards, values, lengths):
        adv = [0.0] * len(r)
        last = 0.0
        for t in reversed(range(n)):
            next_value = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * next_value - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advantages.append(adv)
        returns.append([a + v[t] if t < n else 0.0 for t, a in enumerate(adv)])
    return advantages, returns


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_vectorised_matches_a_slow_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    lengths = [6, 3, 1, 6]  # full-length (truncated) responses and ones cut at their EOS
    mask = make_mask(lengths, 6)
    rewards, values = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    # garbage after the EOS must not matter
    advantages, returns = ppo.gae_advantages(rewards, values, mask, gamma, lam)
    expected_adv, expected_ret = slow_gae(rewards.tolist(), values.tolist(), lengths, gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(expected_adv))
    torch.testing.assert_close(returns, torch.tensor(expected_ret))
    assert (advantages[mask == 0] == 0).all() and (returns[mask == 0] == 0).all()


def test_gae_with_lambda_one_and_gamma_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.1, -0.2, 3.0, 9.0]])
    values = torch.tensor([[1.0, 2.0, 0.5, 7.0]])
    mask = make_mask([3], 4)
    advantages, returns = ppo.gae_advantages(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[2.9, 2.8, 3.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[1.9, 0.8, 2.5, 0.0]]))


# ------------------------------------------------------------------------------ whitening
def slow_whiten(values: list[float], shift_mean: bool) -> list[float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) + (0 if shift_mean else mean) for v in values]


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whitening_matches_a_slow_version_and_ignores_padding(shift_mean):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=g) * 3 + 2
    mask = make_mask([5, 2, 4], 5)
    got = ppo.masked_whiten(x, mask, shift_mean=shift_mean)
    real = [x[i, j].item() for i in range(3) for j in range(5) if mask[i, j]]
    expected = iter(slow_whiten(real, shift_mean))
    for i in range(3):
        for j in range(5):
            assert got[i, j].item() == pytest.approx(next(expected) if mask[i, j] else 0.0, abs=1e-5)
    # padding values and extra padded columns change nothing
    x2 = torch.where(mask.bool(), x, torch.full_like(x, 1e3))
    x3 = torch.cat([x2, torch.full((3, 3), -7.0)], 1)
    mask3 = torch.cat([mask, torch.zeros(3, 3)], 1)
    torch.testing.assert_close(ppo.masked_whiten(x2, mask, shift_mean), got)
    torch.testing.assert_close(ppo.masked_whiten(x3, mask3, shift_mean)[:, :5], got)
    if shift_mean:
        assert ppo.masked_mean(got, mask).item() == pytest.approx(0.0, abs=1e-6)
        assert ppo.masked_var(got, mask).item() == pytest.approx(1.0, abs=1e-5)


# ------------------------------------------------------------------------------ losses
def test_clipped_value_loss_on_hand_computed_numbers():
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0, 5.0]])
    values = torch.tensor([[1.5, 1.5, 0.9, 0.5, 99.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])  # the last position is padding
    loss, clipped = ppo.ppo_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # v 1.5 (clip 1.2) R 2: (0.5^2, 0.8^2) -> 0.64 clipped     v 1.5 (clip 1.2) R 0: (2.25, 1.44) -> 2.25 not clipped
    # v 0.9 (inside) R 0: 0.81, 0.81 -> 0.81 not clipped        v 0.5 (clip 0.8) R 2: (2.25, 1.44) -> 2.25 not clipped
    assert loss.item() == pytest.approx(0.5 * (0.64 + 2.25 + 0.81 + 2.25) / 4, abs=1e-6)
    assert clipped[0, :4].tolist() == [True, False, False, False]
    assert ppo.masked_mean(clipped.float(), mask).item() == pytest.approx(0.25)
    loss.backward()
    # clipped tokens give no gradient; the others 0.5 * 2 (v - R) / 4
    assert values.grad.tolist()[0] == pytest.approx([0.0, 1.5 / 4, 0.9 / 4, -1.5 / 4, 0.0], abs=1e-6)


def test_clipped_policy_surrogate_and_clipfrac_on_hand_computed_ratios_for_both_signs():
    ratio = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1, 0.9, 3.0]])
    advantages = torch.tensor([[1.0, -1.0, -1.0, 1.0, 2.0, -2.0, 5.0]])
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 1, 0]])
    old = torch.tensor([[-3.0, -2.0, -5.0, -1.0, -4.0, -2.5, -1.0]])
    logprobs = (old + ratio.log()).requires_grad_()
    loss, got_ratio, clipped = ppo.ppo_policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    # max(-A r, -A clip(r, 0.8, 1.2)):
    #   r 1.5 A +1 -> max(-1.5, -1.2) = -1.2 (clipped)     r 0.5 A -1 -> max(0.5, 0.8) = 0.8 (clipped)
    #   r 1.5 A -1 -> max(1.5, 1.2) = 1.5 (not)            r 0.5 A +1 -> max(-0.5, -0.8) = -0.5 (not)
    #   r 1.1 A +2 -> -2.2 (inside)                        r 0.9 A -2 -> 1.8 (inside); the last token is padding
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5 - 0.5 - 2.2 + 1.8) / 6, abs=1e-6)
    assert got_ratio[0, :6].tolist() == pytest.approx(ratio[0, :6].tolist(), abs=1e-6)
    assert clipped[0, :6].tolist() == [True, True, False, False, False, False]
    assert ppo.masked_mean(clipped.float(), mask).item() == pytest.approx(2 / 6)
    loss.backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 0.0, 1.5 / 6, -0.5 / 6, -2.2 / 6, 1.8 / 6, 0.0], abs=1e-6)


def test_truncated_importance_weights_are_per_token_and_multiply_the_token_losses():
    old = torch.full((1, 4), -2.0)
    engine = old - torch.tensor([[math.log(0.5), math.log(1.5), math.log(3.0), 0.0]])
    weights = ppo.truncated_is_weights(old, engine, cap=2.0)
    assert weights.tolist()[0] == pytest.approx([0.5, 1.5, 2.0, 1.0], abs=1e-6)
    advantages = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    loss, _, _ = ppo.ppo_policy_loss(old.clone(), old, advantages, torch.ones(1, 4), cliprange=0.2, is_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 - 1.5 * 1.0 + 2.0 * 2.0 + 1.0 * 0.5) / 4, abs=1e-6)


# ------------------------------------------------------------------------------ rewards
def test_per_token_kl_reward_puts_the_score_on_the_eos_or_the_last_token(tokenizer):
    eos = tokenizer.eos_token_id
    # cut at its EOS (position 2), EOS first (position 0), no EOS within response_length 4 (truncated)
    _, mask, contain_eos = ppo.truncate_responses(
        [[4, 5, eos, 6], [eos, 7, 8], [4, 5, 6, 7, 8]], 4, eos_token_id=eos, pad_token_id=0
    )
    assert mask.tolist() == [[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]] and contain_eos.tolist() == [True, True, False]
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -9.0], [-0.3, -5.0, -5.0, -5.0], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = torch.tensor([[-1.5, -1.0, -0.5, 0.0], [-0.1, 0.0, 0.0, 0.0], [-2.0, -1.0, -0.5, -1.0]])
    scores = ppo.apply_missing_eos_penalty(torch.tensor([2.0, 1.0, 4.0]), contain_eos, -3.0)
    rewards, kl = ppo.per_token_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.1)
    expected_kl = [[0.5, -1.0, 0.0, 0.0], [-0.2, 0.0, 0.0, 0.0], [1.0, 0.0, -0.5, 0.0]]
    torch.testing.assert_close(kl, torch.tensor(expected_kl))
    expected = [[-0.05, 0.1, 2.0, 0.0], [0.02 + 1.0, 0.0, 0.0, 0.0], [-0.1, 0.0, 0.05, -3.0]]
    torch.testing.assert_close(rewards, torch.tensor(expected))


def test_a_completion_of_zero_tokens_is_refused_rather_than_losing_its_score(tokenizer):
    """Only an empty completion from the engine gives an all-zero mask row (an EOS sampled first is a one-token
    completion, which keeps its score on that EOS: the test above). Its score would have no token to sit on: GAE
    and the losses see real tokens only, so it would vanish; per_token_rewards refuses it instead."""
    eos = tokenizer.eos_token_id
    ids, mask, contain_eos = ppo.truncate_responses([[eos, 7], [], [4, 5]], 3, eos_token_id=eos, pad_token_id=0)
    assert mask.tolist() == [[1, 0, 0], [0, 0, 0], [1, 1, 0]] and contain_eos.tolist() == [True, False, False]
    scores, zeros = torch.tensor([2.0, 5.0, -1.0]), torch.zeros(3, 3)
    with pytest.raises(
        RuntimeError,
        match=r"^completion\(s\) \[1\] of the batch have zero tokens: there is no token to give the score to",
    ):
        ppo.per_token_rewards(scores, zeros, zeros, mask, kl_coef=0.1)
    # why: a score put on a masked slot is gone after GAE, whatever its value
    rewards = torch.tensor([[0.0, 0.0, 0.0], [5.0, 0.0, 0.0], [0.0, -1.0, 0.0]])
    advantages, returns = ppo.gae_advantages(rewards, zeros, mask, 1.0, 0.95)
    assert advantages[1].tolist() == [0.0, 0.0, 0.0] and returns[1].tolist() == [0.0, 0.0, 0.0]
    # the same batch without the empty completion: every score lands on its last real token
    rewards, _ = ppo.per_token_rewards(scores[[0, 2]], zeros[:2], zeros[:2], mask[[0, 2]], kl_coef=0.1)
    assert rewards.tolist() == [[2.0, 0.0, 0.0], [0.0, -1.0, 0.0]]


# ------------------------------------------------------------------------------ adaptive KL
def test_adaptive_kl_controller_on_hand_computed_numbers():
    # kl 9 over target 6: error 0.5 clipped to 0.2 -> x (1 + 0.2 * 512 / 10000)
    assert ppo.adaptive_kl_coef(0.05, 9.0, 6.0, 512, 10000) == pytest.approx(0.05 * 1.01024)
    # kl 5.4: error -0.1 -> x (1 - 0.1 * 64 / 10000)
    assert ppo.adaptive_kl_coef(0.15, 5.4, 6.0, 64, 10000) == pytest.approx(0.15 * (1 - 0.00064))
    # kl 0: error -1 clipped to -0.2
    assert ppo.adaptive_kl_coef(0.1, 0.0, 6.0, 10000, 10000) == pytest.approx(0.08)
    assert ppo.adaptive_kl_coef(0.1, 6.0, 6.0, 10000, 10000) == pytest.approx(0.1)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert ppo.explained_variance(returns.clone(), returns, mask).item() == pytest.approx(1.0)
    assert ppo.explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0, abs=1e-6)


# ------------------------------------------------------------------------------ models
def test_values_are_read_before_each_response_token_and_padding_does_not_change_them(tokenizer):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    value_model = LlamaForSequenceClassification(small_config(tokenizer, num_labels=1)).eval()
    eos = tokenizer.eos_token_id
    prompt, response = [tokenizer.bos_token_id, 5, 6, 7], [8, 9, eos]
    q_ids, q_mask = ppo.left_pad([prompt], 4, tokenizer.pad_token_id)
    r_ids, r_mask, _ = ppo.truncate_responses([response], 3, eos, tokenizer.pad_token_id)
    q2, q2_mask = ppo.left_pad([prompt], 9, tokenizer.pad_token_id)
    r2, r2_mask, _ = ppo.truncate_responses([response + [11, 12]], 6, eos, tokenizer.pad_token_id)
    with torch.no_grad():
        values = ppo.response_values(value_model, q_ids, q_mask, r_ids, r_mask)
        padded = ppo.response_values(value_model, q2, q2_mask, r2, r2_mask)
        # V(s_t) is the reward-model reading of query + y_<t
        expected = [
            ppo.get_reward(
                value_model, torch.tensor([prompt + response[:t]]), torch.ones(1, 4 + t, dtype=torch.long)
            ).item()
            for t in range(3)
        ]
    assert values[0].tolist() == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(padded[:, :3], values, atol=1e-5, rtol=0)
    assert padded[0, 3:].tolist() == [0.0, 0.0, 0.0]


def test_first_on_policy_minibatch_ratio_is_exactly_one(tokenizer):
    """async_level 0, --old_logprobs trainer: old logprobs and values come from the same model as the first
    mini-batch's forward pass, so every per-token ratio is exactly 1, nothing is clipped (policy or value),
    and the policy gradient is -masked_mean(A grad log pi)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    model = ppo.PolicyAndValue(
        LlamaForCausalLM(small_config(tokenizer)), LlamaForSequenceClassification(small_config(tokenizer, num_labels=1))
    ).train()
    ppo.disable_dropout(model)
    g = torch.Generator().manual_seed(0)
    eos = tokenizer.eos_token_id
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist()
        for n in (3, 6, 9, 2, 5, 7)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() + [eos, 7] for n in (1, 4, 2, 6, 3, 9)]
    q_ids, q_mask = ppo.left_pad(prompts, 12, tokenizer.pad_token_id)
    r_ids, r_mask, _ = ppo.truncate_responses(responses, 8, eos, tokenizer.pad_token_id)
    with torch.no_grad():
        old = [
            model(q_ids[i : i + 4], q_mask[i : i + 4], r_ids[i : i + 4], r_mask[i : i + 4], 0.7) for i in range(0, 6, 4)
        ]
    old_logprobs, old_values = torch.cat([o[0] for o in old]), torch.cat([o[2] for o in old])
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.0])
    rewards, _ = ppo.per_token_rewards(scores, old_logprobs, old_logprobs - 0.1, r_mask, 0.05)
    advantages, returns = ppo.gae_advantages(rewards, old_values, r_mask, 1.0, 0.95)
    advantages = ppo.masked_whiten(advantages, r_mask)
    idx = torch.tensor([4, 1, 5, 0, 3])
    mask = r_mask[idx]
    logprobs, entropy, values = model(q_ids[idx], q_mask[idx], r_ids[idx], mask, 0.7)
    pg_loss, ratio, clipped = ppo.ppo_policy_loss(logprobs, old_logprobs[idx], advantages[idx], mask, cliprange=0.2)
    _, vf_clipped = ppo.ppo_value_loss(values, old_values[idx], returns[idx], mask, 0.2)
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert clipped.float().sum().item() == 0.0 and vf_clipped.float().sum().item() == 0.0
    assert torch.equal(values.detach(), old_values[idx])
    assert (entropy[mask.bool()] > 0).all() and (entropy[~mask.bool()] == 0).all()
    pg_loss.backward()
    policy = list(model.policy.parameters())
    grads = [p.grad.clone() for p in policy]
    model.zero_grad()
    logprobs, _, _ = model(q_ids[idx], q_mask[idx], r_ids[idx], mask, 0.7)
    (-ppo.masked_mean(advantages[idx] * logprobs, mask)).backward()
    for got, expected in zip(grads, (p.grad for p in policy)):
        torch.testing.assert_close(got, expected)


def test_the_saved_policy_has_the_plain_causal_lm_names(tokenizer, tmp_path):
    """save_policy with PPO's prefix writes the policy out of PolicyAndValue, under the names from_pretrained expects."""
    from accelerate import Accelerator
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    import plumbing

    policy = LlamaForCausalLM(small_config(tokenizer))
    model = ppo.PolicyAndValue(policy, LlamaForSequenceClassification(small_config(tokenizer, num_labels=1)))
    plumbing.save_policy(Accelerator(cpu=True), model, tokenizer, str(tmp_path / "policy"), prefix="policy.")
    saved = load_file(tmp_path / "policy" / "model.safetensors")
    expected = {
        k: v for k, v in policy.state_dict().items() if k != "lm_head.weight" or not policy.config.tie_word_embeddings
    }
    assert set(saved) == set(expected)
    assert all(torch.equal(saved[k], v) for k, v in expected.items())
    assert LlamaForCausalLM.from_pretrained(tmp_path / "policy").config.architectures == ["LlamaForCausalLM"]


def test_the_value_model_needs_the_policy_s_tokenizer(tokenizer):
    """The value model starts from the reward model and reads the policy's token ids: another tokenizer is refused."""
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tokenizer.name_or_path, padding_side="left")
    other.add_tokens(["<another>"])
    args, same = ppo.Args(), AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    for reward_tokenizer in (same, None):  # None: gsm8k, no reward model
        ppo.check_value_model(ppo.Inputs(None, None, None, tokenizer, reward_tokenizer, None, None), args)
    with pytest.raises(ppo.UsageError, match="its tokenizer must be the policy's"):
        ppo.check_value_model(ppo.Inputs(None, None, None, tokenizer, other, None, None), args)


# ------------------------------------------------------------------------------ sizes
def test_sizes_count_prompts_one_completion_each():
    args = ppo.Args(total_episodes=512, local_micro_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2)
    sizes = ppo.compute_sizes(args, world_size=1)
    assert (sizes.local_mini_batch_size, sizes.local_batch_size, sizes.episodes_per_step, sizes.num_steps) == (
        8,
        16,
        16,
        32,
    )
    with pytest.raises(ValueError, match="change --total_episodes"):
        ppo.compute_sizes(ppo.Args(total_episodes=100), 1)
    with pytest.raises(ValueError, match="--cliprange_value"):
        ppo.compute_sizes(ppo.Args(cliprange_value=0.0), 1)


@pytest.mark.parametrize("num_mini_batches", [1, 2])
def test_only_the_later_mini_batches_of_a_step_meet_a_moved_policy(tokenizer, num_mini_batches):
    """ppo_update as the script calls it: with one mini-batch every per-token ratio is exactly 1; with N = 2 the second
    mini-batch meets the policy the first optimizer step moved, and the ratio extremes it returns leave 1."""
    import numpy as np
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    args = ppo.Args(total_episodes=4, local_micro_batch_size=4 // num_mini_batches, num_mini_batches=num_mini_batches)
    args.learning_rate = 1e-2
    sizes = ppo.compute_sizes(args, world_size=1)
    accelerator = Accelerator(cpu=True)
    model = ppo.PolicyAndValue(
        LlamaForCausalLM(small_config(tokenizer)), LlamaForSequenceClassification(small_config(tokenizer, num_labels=1))
    )
    ppo.disable_dropout(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 6, 2, 5)]
    batch = ppo.to_batch(prompts, responses, 1, args, tokenizer, torch.device("cpu"))
    old, values = ppo.old_logprobs_and_values(model, batch, args.temperature, 8)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    targets = ppo.ppo_targets(scores, batch, old, values, old, old, 0.05, args)
    _, (ratio_max, ratio_min) = ppo.ppo_update(
        model, optimizer, scheduler, accelerator, batch, targets, args, sizes, np.random.default_rng(0), step=0
    )
    if num_mini_batches == 1:
        assert ratio_max == ratio_min == 1.0
    else:
        assert ratio_max > 1 + 1e-4 or ratio_min < 1 - 1e-4, (ratio_max, ratio_min)
