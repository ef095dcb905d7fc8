"""The pure pieces of ppo_async.py against hand-computed numbers or slow obvious versions."""

import copy
import math
from typing import NamedTuple

import numpy as np
import pytest
import torch
from conftest import small_config

import ppo_async as ppo


# plain SGD's step and the value loss's weight in the epoch tests: in the second epoch the per-token ratios reach
# 0.8 .. 1.5 and the values move by more than cliprange_value, both clipped on some tokens and not on others
LEARNING_RATE = 1e-2
VF_COEF = 0.5
CLIPRANGE_VALUE = 0.1


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


# ------------------------------------------------------------------------------ the corrections of --old_logprobs engine
# A batch of three completions of 3, 2 and 4 tokens (garbage after EOS), each token's r = pi_old / mu chosen:
# sequence ratios 3.6, 1.08 and 1.01, geometric means 3.6 ** (1 / 3) = 1.533, 1.08 ** (1 / 2) = 1.039, 1.0025.
CORRECTION_MASK = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
CORRECTION_RATIOS = [[0.4, 1.5, 6.0], [1.2, 0.9], [1.0, 1.0, 1.01, 1.0]]


def correction_batch():
    """pi_old's and mu's per-token logprobs with CORRECTION_RATIOS, garbage (+-50) after each completion's EOS."""
    old = torch.tensor([[-1.0, -2.0, -0.5, 50.0], [-0.3, -1.1, -50.0, 50.0], [-0.2, -0.7, -1.3, -0.9]])
    ratios = torch.ones(3, 4)
    for row, values in enumerate(CORRECTION_RATIOS):
        ratios[row, : len(values)] = torch.tensor(values)
    engine = old - ratios.log() - 30 * (1 - CORRECTION_MASK)
    return old, engine


# correction -> (the weight of each real token, the statistics: mean weight, truncated, masked), by hand with the
# flags' defaults (tis_cap 2, icepop [0.5, 5], sequence_mask [0.5, 2], geo_mask [0.99, 1.01], decoupled_cap 5); a
# sequence correction's statistics are over the 3 sequences, a token correction's over the 9 real tokens
BY_HAND = {
    "tis": ([[0.4, 1.5, 2.0], [1.2, 0.9], [1.0, 1.0, 1.01, 1.0]], (10.01 / 9, 1 / 9, 0)),
    "sequence_tis": ([[2.0] * 3, [1.08] * 2, [1.01] * 4], ((2 + 1.08 + 1.01) / 3, 1 / 3, 0)),
    "sequence_mask": ([[0.0] * 3, [1.08] * 2, [1.01] * 4], ((1.08 + 1.01) / 3, 0, 1 / 3)),
    "icepop": ([[0.0, 1.5, 0.0], [1.2, 0.9], [1.0, 1.0, 1.01, 1.0]], (7.61 / 9, 0, 2 / 9)),
    "geo_mask": ([[0.0] * 3, [0.0] * 2, [1.0] * 4], (1 / 3, 0, 2 / 3)),
    "decoupled": ([[0.4, 1.5, 0.0], [1.2, 0.9], [1.0, 1.0, 1.01, 1.0]], (8.01 / 9, 0, 1 / 9)),
}


@pytest.mark.parametrize("correction", list(BY_HAND))
def test_each_correction_weighs_masks_and_logs_on_hand_computed_numbers(correction):
    """Each correction's weight on every real token of the batch above, 0 after EOS whatever the garbage there: a
    token's own (tis, icepop, decoupled) or its sequence's (sequence_tis, sequence_mask, geo_mask); a masked token or
    sequence weighs 0; the mean weight and the fractions truncated and masked logged as the unit it acts on counts."""
    old, engine = correction_batch()
    args = ppo.Args(old_logprobs="engine", correction=correction)
    weights, stats = ppo.correction_weights(old, engine, CORRECTION_MASK, args)
    rows, (mean, truncated, masked) = BY_HAND[correction]
    expected = torch.zeros(3, 4)
    for row, values in enumerate(rows):
        expected[row, : len(values)] = torch.tensor(values)
    torch.testing.assert_close(weights, expected, atol=1e-6, rtol=1e-5)
    assert stats["correction_weight_mean"].item() == pytest.approx(mean, abs=1e-6)
    assert stats["correction_truncated_frac"].item() == pytest.approx(truncated)
    assert stats["correction_masked_frac"].item() == pytest.approx(masked)


def test_the_bounds_flags_move_each_correction_s_edges():
    """The same batch with other bounds: each flag is the one its correction reads, and its edges are inclusive."""
    old, engine = correction_batch()

    def weights(**flags):
        args = ppo.Args(old_logprobs="engine", **flags)
        return ppo.correction_weights(old, engine, CORRECTION_MASK, args)[0][CORRECTION_MASK.bool()]

    # icepop [0.3, 7]: nothing masked, the weights are the ratios themselves; [1, 1]: only the ratios of exactly 1 (a
    # token's log pi_old - log mu of 0) kept, the edges inclusive
    flat = [r for row in CORRECTION_RATIOS for r in row]
    assert weights(correction="icepop", icepop_low=0.3, icepop_high=7.0).tolist() == pytest.approx(flat, rel=1e-5)
    assert weights(correction="icepop", icepop_low=1.0, icepop_high=1.0).tolist() == [0] * 5 + [1, 1, 0, 1]
    assert weights(correction="tis", tis_cap=1.2).tolist() == pytest.approx([min(r, 1.2) for r in flat], rel=1e-5)
    # sequence_mask [0.5, 3.6]: the first sequence (3.6) kept; [1.0, 2]: the last (0.9999) dropped too
    kept = weights(correction="sequence_mask", sequence_mask_high=3.7).tolist()
    assert kept == pytest.approx([3.6] * 3 + [1.08] * 2 + [1.01] * 4, rel=1e-5)
    dropped = weights(correction="sequence_mask", sequence_mask_low=1.05).tolist()
    assert dropped == pytest.approx([0] * 3 + [1.08] * 2 + [0] * 4, rel=1e-5)
    assert weights(correction="geo_mask", geo_mask_high=1.04).tolist() == [0] * 3 + [1] * 6
    assert weights(correction="decoupled", decoupled_cap=1.4).tolist() == pytest.approx(
        [0.4, 0, 0, 1.2, 0.9, 1.0, 1.0, 1.01, 1.0], rel=1e-5
    )


def test_a_masked_token_counts_in_the_normaliser_of_the_token_loss():
    """PPO's loss at the first mini-batch (ratio 1), advantage 1 on every token, icepop: -sum_t w_t / 9 = -7.61 / 9, the two masked
    tokens (w 0) still among the 9 real tokens the mean divides by (IcePop's objective; AReaL's code); their gradient
    is 0 and every other token's -w_t / 9."""
    old, engine = correction_batch()
    old = old * CORRECTION_MASK
    weights, _ = ppo.correction_weights(
        old, engine, CORRECTION_MASK, ppo.Args(old_logprobs="engine", correction="icepop")
    )
    logprobs = old.clone().requires_grad_()
    advantages = torch.ones(3, 4)
    loss, _, _ = ppo.ppo_policy_loss(logprobs, old, advantages, CORRECTION_MASK, cliprange=0.2, is_weights=weights)
    assert loss.item() == pytest.approx(-7.61 / 9, abs=1e-5)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -weights / 9)
    assert logprobs.grad[0, 0].item() == 0.0 and logprobs.grad[0, 2].item() == 0.0


def test_a_correction_needs_the_engine_s_logprobs_and_its_bounds_their_domains():
    ppo.check_correction_flags(ppo.Args())  # tis, the default, with --old_logprobs trainer: nothing to correct
    ppo.check_correction_flags(ppo.Args(old_logprobs="engine", correction="geo_mask"))
    with pytest.raises(
        ppo.UsageError,
        match="^--correction icepop weighs each objective by pi_old / mu, mu the engine's logprobs: add --old_logprobs engine$",
    ):
        ppo.check_correction_flags(ppo.Args(correction="icepop"))
    for flag, value, domain in [
        ("icepop_low", 0.0, r"in \(0, 1\]"),
        ("icepop_high", 0.9, ">= 1"),
        ("sequence_mask_low", 1.5, r"in \[0, 1\]"),
        ("sequence_mask_high", 0.5, ">= 1"),
        ("geo_mask_low", 1.01, r"in \(0, 1\]"),
        ("geo_mask_high", 0.99, ">= 1"),
        ("decoupled_cap", 0.5, ">= 1"),
    ]:
        with pytest.raises(ppo.UsageError, match=f"^--{flag} must be {domain} .*, got {value}$"):
            ppo.compute_sizes(ppo.Args(**{flag: value}), world_size=1)


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


def test_the_kl_coefficient_logs_the_step_s_value_and_moves_the_next_one():
    """KLCoefficient.step: the coefficient the step used, returned for its metrics; with --adaptive_kl the next
    step's is the controller's (adaptive_kl_coef), without it the same; a checkpoint keeps the next one."""
    adaptive = ppo.Args(adaptive_kl=True, kl_target=6.0, kl_horizon=10000)
    kl_coef = ppo.KLCoefficient(0.05)
    assert kl_coef.step(9.0, adaptive, 512) == 0.05  # this step's
    assert kl_coef.value == pytest.approx(0.05 * 1.01024)  # the next one's, by hand as above
    assert kl_coef.step(5.4, adaptive, 64) == pytest.approx(0.05 * 1.01024)
    assert kl_coef.state_dict() == {"kl_coef": kl_coef.value}
    fixed = ppo.KLCoefficient(0.05)
    assert fixed.step(9.0, ppo.Args(adaptive_kl=False), 512) == 0.05 and fixed.value == 0.05


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
    r_ids, r_mask, r_eos = ppo.truncate_responses([response], 3, eos, tokenizer.pad_token_id)
    q2, q2_mask = ppo.left_pad([prompt], 9, tokenizer.pad_token_id)
    r2, r2_mask, r2_eos = ppo.truncate_responses([response + [11, 12]], 6, eos, tokenizer.pad_token_id)
    with torch.no_grad():
        values = ppo.response_values(value_model, ppo.Batch(q_ids, q_mask, r_ids, r_mask, r_eos))
        padded = ppo.response_values(value_model, ppo.Batch(q2, q2_mask, r2, r2_mask, r2_eos))
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


def test_policy_and_value_gives_the_policy_s_tempered_logprobs_its_entropies_and_the_values(tokenizer):
    """PolicyAndValue's forward: the policy's per-token logprobs and entropies at the sampling temperature (not
    at 1), from the same pass, and the value model's values, each zero after EOS."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    policy = LlamaForCausalLM(small_config(tokenizer)).eval()
    value_model = LlamaForSequenceClassification(small_config(tokenizer, num_labels=1)).eval()
    model = ppo.PolicyAndValue(policy, value_model)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    q_ids, q_mask = ppo.left_pad([[tokenizer.bos_token_id, 5, 6], [tokenizer.bos_token_id, 7]], 4, pad)
    batch = ppo.Batch(q_ids, q_mask, *ppo.truncate_responses([[8, 9, eos], [10, 11, 12, 13]], 4, eos, pad))
    with torch.no_grad():
        logprobs, entropy, values = model(batch, 0.7)
        expected, expected_entropy = ppo.response_logprobs(policy, batch, 0.7, entropy=True)
        at_one = ppo.response_logprobs(policy, batch, 1.0)
        without_entropy = model(batch, 0.7, entropy=False)  # the old logprobs' pass
    assert torch.equal(logprobs, expected) and torch.equal(entropy, expected_entropy)
    assert torch.equal(without_entropy[0], expected) and without_entropy[1] is None
    assert torch.equal(without_entropy[2], values)
    assert torch.equal(values, ppo.response_values(value_model, batch))
    assert (logprobs - at_one).abs().max() > 0.05  # the temperature matters here
    assert logprobs[0, 3] == 0 and entropy[0, 3] == 0 and values[0, 3] == 0  # after the first row's EOS


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
    r_ids, r_mask, contain_eos = ppo.truncate_responses(responses, 8, eos, tokenizer.pad_token_id)

    def rows(index) -> ppo.Batch:
        return ppo.Batch(q_ids[index], q_mask[index], r_ids[index], r_mask[index], contain_eos[index])

    with torch.no_grad():
        old = [model(rows(slice(i, i + 4)), 0.7) for i in range(0, 6, 4)]
    old_logprobs, old_values = torch.cat([o[0] for o in old]), torch.cat([o[2] for o in old])
    scores = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.0])
    rewards, _ = ppo.per_token_rewards(scores, old_logprobs, old_logprobs - 0.1, r_mask, 0.05)
    advantages, returns = ppo.gae_advantages(rewards, old_values, r_mask, 1.0, 0.95)
    advantages = ppo.masked_whiten(advantages, r_mask)
    idx = torch.tensor([4, 1, 5, 0, 3])
    mask = r_mask[idx]
    logprobs, entropy, values = model(rows(idx), 0.7)
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
    logprobs, _, _ = model(rows(idx), 0.7)
    (-ppo.masked_mean(advantages[idx] * logprobs, mask)).backward()
    for got, expected in zip(grads, (p.grad for p in policy)):
        torch.testing.assert_close(got, expected)


def test_the_saved_policy_has_the_plain_causal_lm_names(tokenizer, tmp_path):
    """plumbing.checkpoints.save_policy with PPO's prefix writes the policy out of PolicyAndValue, under the names from_pretrained expects."""
    from accelerate import Accelerator
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    import plumbing

    policy = LlamaForCausalLM(small_config(tokenizer))
    model = ppo.PolicyAndValue(policy, LlamaForSequenceClassification(small_config(tokenizer, num_labels=1)))
    plumbing.checkpoints.save_policy(
        Accelerator(cpu=True), model, tokenizer, str(tmp_path / "policy"), prefix="policy."
    )
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
        ppo.check_value_model(ppo.Inputs(tokenizer, reward_tokenizer, None, None), args)
    with pytest.raises(ppo.UsageError, match="its tokenizer must be the policy's"):
        ppo.check_value_model(ppo.Inputs(tokenizer, other, None, None), args)


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
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 6, 2, 5)]
    batch = ppo.to_batch(prompts, responses, 1, args, tokenizer, torch.device("cpu"))
    old, values = ppo.old_logprobs_and_values(model, batch, args.temperature, 8)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    targets, _ = ppo.ppo_targets(scores, batch, old, values, old, old, 0.05, args)
    stats, (ratio_max, ratio_min) = ppo.ppo_update(
        model, optimizer, accelerator, batch, targets, args, sizes, np.random.default_rng(0)
    )
    if num_mini_batches == 1:
        assert ratio_max == ratio_min == 1.0
    else:
        # Adam's first step moves every weight by about the learning rate, 1e-2: tenths of a nat per token in this
        # 2-layer model's logprobs, so the ratios leave the clip range [0.8, 1.2] (numerics alone, in float32, stay
        # within 1e-5 of 1). A bound of 1e-4 would pass a step a thousand times too small.
        assert ratio_max > 1.2 or ratio_min < 0.8, (ratio_max, ratio_min)
        assert stats["clipfrac"] > 0


# ------------------------------------------------------------------------------ ppo_targets: everything it returns
def slow_correction_weights(old, engine, lengths, args) -> list[list[float]]:
    """--correction's weight of each token, one completion at a time from its real tokens' ratios pi_old / mu: a
    token's own (tis, icepop, decoupled) or its sequence's, of the product or the geometric mean; 0 after EOS."""
    out = []
    for i, length in enumerate(lengths):
        ratios = [math.exp(old[i][t] - engine[i][t]) for t in range(length)]
        sequence, geometric = math.prod(ratios), math.prod(ratios) ** (1 / length)
        weights = {
            "tis": [min(r, args.tis_cap) for r in ratios],
            "sequence_tis": [min(sequence, args.tis_cap)] * length,
            "sequence_mask": [sequence if args.sequence_mask_low <= sequence <= args.sequence_mask_high else 0.0]
            * length,
            "icepop": [r if args.icepop_low <= r <= args.icepop_high else 0.0 for r in ratios],
            "geo_mask": [1.0 if args.geo_mask_low <= geometric <= args.geo_mask_high else 0.0] * length,
            "decoupled": [r if r <= args.decoupled_cap else 0.0 for r in ratios],
        }[args.correction]
        out.append(weights + [0.0] * (len(old[i]) - length))
    return out


def slow_ppo_targets(scores, lengths, old, values, ref, engine, kl_coef, whiten_rewards, gamma, lam, args):
    """ppo_targets one token at a time, on per-token lists whose slots after `lengths[i]` are ignored: the KL penalty on
    every real token and the score on the last one, the rewards whitened (mean kept) over the batch's real tokens,
    GAE (slow_gae), returns before the advantages are whitened over the real tokens, the truncated importance weights.
    Padding slots are 0 in every output."""
    n, width = len(scores), len(old[0])
    real = [[t < lengths[i] for t in range(width)] for i in range(n)]
    kl = [[old[i][t] - ref[i][t] if real[i][t] else 0.0 for t in range(width)] for i in range(n)]
    rewards = [[-kl_coef * kl[i][t] for t in range(width)] for i in range(n)]
    for i in range(n):
        rewards[i][lengths[i] - 1] += scores[i]

    def whiten_real(rows, shift_mean):
        whitened = iter(slow_whiten([rows[i][t] for i in range(n) for t in range(width) if real[i][t]], shift_mean))
        return [[next(whitened) if real[i][t] else 0.0 for t in range(width)] for i in range(n)]

    if whiten_rewards:
        rewards = whiten_real(rewards, shift_mean=False)
    advantages, returns = slow_gae(rewards, values, lengths, gamma, lam)
    return kl, whiten_real(advantages, shift_mean=True), returns, slow_correction_weights(old, engine, lengths, args)


@pytest.mark.parametrize(
    "whiten_rewards, gamma, lam, old_logprobs, correction",
    [
        (False, 1.0, 0.95, "trainer", "tis"),
        (True, 0.9, 0.8, "engine", "tis"),
        (False, 0.99, 0.5, "engine", "tis"),
        (True, 1.0, 1.0, "trainer", "tis"),
        (False, 1.0, 0.95, "engine", "sequence_tis"),
        (False, 1.0, 0.95, "engine", "sequence_mask"),
        (False, 1.0, 0.95, "engine", "icepop"),
        (False, 1.0, 0.95, "engine", "geo_mask"),
        (False, 1.0, 0.95, "engine", "decoupled"),
    ],
)
def test_ppo_targets_match_a_slow_loop_over_every_field(
    tokenizer, whiten_rewards, gamma, lam, old_logprobs, correction
):
    """ppo_targets against the slow loop above, on completions cut at their EOS (one at the first token) or at
    response_length, with garbage after the EOS in every per-token input: the per-token KL; through GAE with gamma and
    lambda, the rewards (score on the last real token, --whiten_rewards); the returns (advantages + old values, before
    whitening); the whitened advantages; the importance weights; the old logprobs, old values and engine logprobs pass
    through unchanged."""
    g = torch.Generator().manual_seed(2)
    eos, width = tokenizer.eos_token_id, 6
    cut = [2, 6, 0, 4, 6]  # the EOS's position, or none within response_length 6
    responses = [[5] * c + [eos, 7] if c < width else [5] * 8 for c in cut]
    _, mask, _ = ppo.truncate_responses(responses, width, eos, tokenizer.pad_token_id)
    lengths = mask.sum(1).tolist()
    assert lengths == [3, 6, 1, 5, 6]
    garbage = 50 * (1 - mask)
    old = -torch.rand(5, width, generator=g) * 3 + garbage
    ref = old - torch.randn(5, width, generator=g) * 0.5 - garbage
    values = torch.randn(5, width, generator=g) + garbage
    engine = old + torch.randn(5, width, generator=g) * 0.5 - 2 * garbage  # weights 0.3 .. 3: some capped at 1.5
    scores = torch.randn(5, generator=g) * 2
    # bounds that the data's ratios (0.3 .. 3 a token) fall on both sides of
    bounds = dict(
        tis_cap=1.5, icepop_low=0.6, icepop_high=2.0, sequence_mask_high=1.5, geo_mask_low=0.8, decoupled_cap=1.5
    )
    args = ppo.Args(
        whiten_rewards=whiten_rewards, gamma=gamma, lam=lam, old_logprobs=old_logprobs, correction=correction, **bounds
    )
    batch = ppo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    targets, stats = ppo.ppo_targets(scores, batch, old, values, ref, engine, 0.3, args)
    kl, advantages, returns, weights = slow_ppo_targets(
        scores.tolist(),
        lengths,
        old.tolist(),
        values.tolist(),
        ref.tolist(),
        engine.tolist(),
        0.3,
        whiten_rewards,
        gamma,
        lam,
        args,
    )
    torch.testing.assert_close(targets.kl, torch.tensor(kl))
    torch.testing.assert_close(targets.advantages, torch.tensor(advantages))
    torch.testing.assert_close(targets.returns, torch.tensor(returns))
    assert targets.old_logprobs is old and targets.old_values is values and targets.engine_logprobs is engine
    if old_logprobs == "trainer":
        assert targets.is_weights is None and stats == {}
    else:
        torch.testing.assert_close(targets.is_weights, torch.tensor(weights))
        real = [w for row, n in zip(weights, lengths) for w in row[:n]]
        # what makes the test able to fail: some weights capped or masked, others not
        if correction in ("tis", "sequence_tis"):
            assert 0 < real.count(1.5) < len(real)
        else:
            assert 0 < real.count(0.0) < len(real)
    if correction == "tis" and old_logprobs == "engine":  # the statistics logged, over the real tokens
        assert stats["correction_weight_mean"].item() == pytest.approx(np.mean(real), rel=1e-6)
        assert stats["correction_truncated_frac"].item() == pytest.approx(real.count(1.5) / len(real))
        assert stats["correction_masked_frac"].item() == 0.0


# ------------------------------------------------------------------------------ ppo_update: loss, epochs, mini-batches
class UpdateCall(NamedTuple):
    """ppo_update's arguments but the numpy generator, and an untouched copy of the model."""

    model: ppo.PolicyAndValue
    by_hand: ppo.PolicyAndValue
    optimizer: object
    accelerator: object
    batch: ppo.Batch
    targets: ppo.Targets
    sizes: ppo.Sizes


def ppo_step_setup(tokenizer, args, seed: int = 0) -> UpdateCall:
    """What ppo_update is called with: a PolicyAndValue of two tiny random models (and an untouched copy of it, for the
    slow version), plain SGD prepared by accelerate with the linear decay, a batch of 4 prompts, one completion each
    (two cut at their EOS, one at the first token), and its targets from ppo_targets."""
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(seed)
    model = ppo.PolicyAndValue(
        LlamaForCausalLM(small_config(tokenizer)), LlamaForSequenceClassification(small_config(tokenizer, num_labels=1))
    )
    ppo.disable_dropout(model)
    by_hand = copy.deepcopy(model)
    sizes = ppo.compute_sizes(args, world_size=1)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=args.learning_rate))
    g, eos = torch.Generator().manual_seed(1), tokenizer.eos_token_id
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 14, 0, 9)]
    responses = [r + [eos, 9] for r in responses[:3]] + responses[3:]
    batch = ppo.to_batch(prompts, responses, 1, args, tokenizer, torch.device("cpu"))
    assert batch.response_mask.sum(1).tolist() == [5, 12, 1, 9]
    old, values = ppo.old_logprobs_and_values(model, batch, args.temperature, 8)
    ref = old - torch.randn(old.shape, generator=g) * 0.2 * batch.response_mask
    engine = old + torch.randn(old.shape, generator=g) * 0.5 * batch.response_mask
    targets, _ = ppo.ppo_targets(torch.tensor([1.0, -1.0, 0.5, 2.0]), batch, old, values, ref, engine, 0.05, args)
    return UpdateCall(model, by_hand, optimizer, accelerator, batch, targets, sizes)


def slow_ppo_update(model, batch, targets, args, sizes, seed: int, lr: float) -> dict:
    """ppo_update by hand, for plain SGD: each epoch a new permutation of the completions from the same numpy stream,
    cut into mini-batches, each the mean of its micro-batches' gradients; each micro-batch's loss written out one
    real token at a time, pg_loss + vf_coef * vf_loss. Returns what every micro-batch saw."""
    eps, c = args.cliprange, args.cliprange_value
    batch_size, mini, micro = sizes.local_batch_size, sizes.local_mini_batch_size, args.local_micro_batch_size
    params, rng = list(model.parameters()), np.random.default_rng(seed)
    keys = "order loss pg_loss vf_loss approxkl clipfrac vf_clipfrac value_error policy_entropy ratios clipped"
    seen = {key: [] for key in keys.split()}
    for _ in range(args.num_ppo_epochs):
        order = rng.permutation(batch_size).tolist()
        seen["order"].append(order)
        for mini_start in range(0, batch_size, mini):
            step = [torch.zeros_like(p) for p in params]
            for micro_start in range(mini_start, mini_start + mini, micro):
                idx = order[micro_start : micro_start + micro]
                rows = ppo.Batch(
                    batch.query_ids[idx],
                    batch.query_mask[idx],
                    batch.response_ids[idx],
                    batch.response_mask[idx],
                    batch.contain_eos[idx],
                )
                logprobs, entropy, values = model(rows, args.temperature)
                tokens = {key: [] for key in ("pg", "vf", "approxkl", "clipped", "vf_clipped", "error", "entropy")}
                for row, i in enumerate(idx):
                    for t in range(int(batch.response_mask[i].sum())):
                        ratio = torch.exp(logprobs[row, t] - targets.old_logprobs[i, t])
                        advantage = targets.advantages[i, t]
                        weight = 1.0 if targets.is_weights is None else targets.is_weights[i, t]
                        plain, clipped = -advantage * ratio, -advantage * ratio.clamp(1 - eps, 1 + eps)
                        tokens["pg"].append(weight * torch.max(plain, clipped))
                        tokens["clipped"].append(float(clipped > plain))
                        value, old_value, ret = values[row, t], targets.old_values[i, t], targets.returns[i, t]
                        plain, clipped = (value - ret) ** 2, (value.clamp(old_value - c, old_value + c) - ret) ** 2
                        tokens["vf"].append(torch.max(plain, clipped))
                        tokens["vf_clipped"].append(float(clipped > plain))
                        tokens["approxkl"].append(0.5 * (logprobs[row, t] - targets.old_logprobs[i, t]).item() ** 2)
                        tokens["error"].append(plain.item())
                        tokens["entropy"].append(entropy[row, t].item())
                        seen["ratios"].append(ratio.item())
                count = len(tokens["pg"])
                pg_loss, vf_loss = sum(tokens["pg"]) / count, 0.5 * sum(tokens["vf"]) / count
                loss = pg_loss + args.vf_coef * vf_loss
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for total, grad in zip(step, grads):
                    if grad is not None:
                        total += grad / (mini // micro)
                for key, value in (("loss", loss), ("pg_loss", pg_loss), ("vf_loss", vf_loss)):
                    seen[key].append(value.item())
                for key, token_key in (
                    ("approxkl", "approxkl"),
                    ("clipfrac", "clipped"),
                    ("vf_clipfrac", "vf_clipped"),
                    ("value_error", "error"),
                    ("policy_entropy", "entropy"),
                ):
                    seen[key].append(sum(tokens[token_key]) / count)
            with torch.no_grad():  # one SGD step on the mean gradient, clipped to a global norm of --max_grad_norm
                norm = math.sqrt(sum((total**2).sum().item() for total in step))
                scale = 1.0 if args.max_grad_norm is None else min(1.0, args.max_grad_norm / (norm + 1e-6))
                seen["clipped"].append(scale < 1)
                for p, total in zip(params, step):
                    p -= lr * scale * total
    return seen


@pytest.mark.parametrize(
    "old_logprobs, max_grad_norm, correction",
    [("trainer", None, "tis"), ("engine", None, "tis"), ("trainer", 0.05, "tis"), ("engine", None, "icepop")],
)
def test_two_epochs_of_two_mini_batches_match_plain_sgd_by_hand(tokenizer, old_logprobs, max_grad_norm, correction):
    """ppo_update with --num_ppo_epochs 2 --num_mini_batches 2 and two accumulated micro-batches per mini-batch, on
    plain SGD (at --max_grad_norm 0.05 every update clipped): the parameters of the policy and of the value
    model it ends with are the slow version's, and so is every statistic it returns. The second epoch runs over the
    same completions again, in a new order, and meets ratios far from 1 and moved values (some clipped)."""
    args = ppo.Args(
        total_episodes=4,
        local_micro_batch_size=1,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        old_logprobs=old_logprobs,
        correction=correction,
        icepop_low=0.6,  # the data's token ratios, 0.5 .. 2.5, fall on both sides of both bounds
        icepop_high=2.0,
        max_grad_norm=max_grad_norm,
        learning_rate=LEARNING_RATE,
        vf_coef=VF_COEF,
        cliprange=0.2,
        cliprange_value=CLIPRANGE_VALUE,  # not the policy's: each loss clips with its own
    )
    call = ppo_step_setup(tokenizer, args)
    batch, targets, sizes = call.batch, call.targets, call.sizes
    assert sizes.local_batch_size == 4
    stats, (ratio_max, ratio_min) = ppo.ppo_update(
        call.model,
        call.optimizer,
        call.accelerator,
        batch,
        targets,
        args,
        sizes,
        np.random.default_rng(0),
    )
    seen = slow_ppo_update(call.by_hand, batch, targets, args, sizes, 0, LEARNING_RATE)
    assert seen["clipped"] == [max_grad_norm is not None] * 4  # the gradient's norm: 0.1 .. 1 (measured)
    for (name, got), expected in zip(call.model.named_parameters(), call.by_hand.parameters()):
        torch.testing.assert_close(got, expected, msg=name)
    # the two sum their gradients in different orders: float32 rounding, relative 1e-6 after 3 updates
    for key in ("loss", "pg_loss", "vf_loss", "approxkl", "clipfrac", "vf_clipfrac", "value_error", "policy_entropy"):
        assert stats[key].item() == pytest.approx(np.mean(seen[key]), rel=1e-5, abs=1e-6), key
    assert stats["ratio_mean"].item() == pytest.approx(np.mean(seen["ratios"]), rel=1e-5)
    assert (ratio_max, ratio_min) == pytest.approx((max(seen["ratios"]), min(seen["ratios"])), rel=1e-5)
    # the rollouts' statistics, from the targets one real token at a time
    lengths = batch.response_mask.sum(1).tolist()
    real = [(i, t) for i in range(4) for t in range(lengths[i])]
    old, engine = targets.old_logprobs, targets.engine_logprobs
    assert stats["kl"].item() == pytest.approx(sum(targets.kl[i, t].item() for i, t in real) / 4, abs=1e-6)
    assert stats["entropy"].item() == pytest.approx(-sum(old[i, t].item() for i, t in real) / 4, rel=1e-6)
    diffs = [(engine[i, t] - old[i, t]).item() for i, t in real]
    assert stats["engine_abs_diff"].item() == pytest.approx(np.mean(np.abs(diffs)), rel=1e-6)
    assert stats["engine_diff"].item() == pytest.approx(np.mean(diffs), abs=1e-6)
    returns = [targets.returns[i, t].item() for i, t in real]
    errors = [targets.returns[i, t].item() - targets.old_values[i, t].item() for i, t in real]
    explained = 1 - np.var(errors, ddof=1) / np.var(returns, ddof=1)
    assert stats["explained_variance"].item() == pytest.approx(explained, abs=1e-5)
    assert not any(key.startswith("correction_") for key in stats)  # ppo_targets returns the correction's
    if correction == "icepop":  # some tokens masked (weight 0), whose gradient the slow version leaves out too
        assert 0 < (targets.is_weights[batch.response_mask.bool()] == 0).sum() < batch.response_mask.sum()
    # what makes the test able to fail: the first mini-batch meets the old policy and values themselves, the second
    # epoch reorders the same 4 completions and meets a policy and values 2 updates away, some tokens clipped
    first, second = seen["order"]
    assert sorted(first) == sorted(second) == [0, 1, 2, 3] and first != second
    first_mini_batch = lengths[first[0]] + lengths[first[1]]
    assert seen["ratios"][:first_mini_batch] == [1.0] * first_mini_batch
    if max_grad_norm is None:  # clipped to 0.05, the updates are too small to move a ratio far
        assert max(abs(r - 1) for r in seen["ratios"][sum(lengths) :]) > 0.3
        assert 0 < np.mean(seen["clipfrac"][4:]) < 1 and 0 < np.mean(seen["vf_clipfrac"][4:]) < 1


def test_vf_coef_scales_the_value_model_s_gradient_and_nothing_else(tokenizer):
    """One update of plain SGD at learning rate 1, so each parameter moves by minus its gradient: the value model's
    move is exactly -vf_coef x the gradient of the value loss (at ratio 1 the values are the old ones, nothing clipped:
    0.5 masked_mean((V - R)^2)), four times as large with vf_coef 0.4 as with 0.1, and the policy's move, minus the
    gradient of the policy loss, is the same for both."""
    moves = {}
    for vf_coef in (0.1, 0.4):
        args = ppo.Args(
            total_episodes=4, local_micro_batch_size=4, vf_coef=vf_coef, learning_rate=1.0, max_grad_norm=None
        )
        call = ppo_step_setup(tokenizer, args)
        batch, targets, by_hand = call.batch, call.targets, call.by_hand
        ppo.ppo_update(
            call.model,
            call.optimizer,
            call.accelerator,
            batch,
            targets,
            args,
            call.sizes,
            np.random.default_rng(0),
        )
        moves[vf_coef] = {name: p - q for (name, p), q in zip(call.model.named_parameters(), by_hand.parameters())}
    # the update's only forward: all 4 completions
    logprobs, _, values = by_hand(batch, args.temperature)
    mask = batch.response_mask
    pg_loss = -ppo.masked_mean(targets.advantages * torch.exp(logprobs - targets.old_logprobs), mask)
    vf_loss = 0.5 * ppo.masked_mean((values - targets.returns) ** 2, mask)
    names = [name for name, _ in by_hand.named_parameters()]
    pg_grads = dict(zip(names, torch.autograd.grad(pg_loss, list(by_hand.parameters()), allow_unused=True)))
    vf_grads = dict(zip(names, torch.autograd.grad(vf_loss, list(by_hand.parameters()), allow_unused=True)))
    # a move is the difference of two float32 numbers near 1 at most (the norms' weights): 6e-8 each, 3e-7 for 4 x one
    value_names = [name for name in names if name.startswith("value_model.")]
    assert "value_model.score.weight" in value_names and len(value_names) < len(names)
    for name in names:
        if name in value_names:
            assert pg_grads[name] is None
            torch.testing.assert_close(moves[0.1][name], -0.1 * vf_grads[name], rtol=1e-4, atol=3e-7, msg=name)
            torch.testing.assert_close(moves[0.4][name], 4 * moves[0.1][name], rtol=1e-4, atol=3e-7, msg=name)
        else:
            assert vf_grads[name] is None
            torch.testing.assert_close(moves[0.1][name], -pg_grads[name], rtol=1e-4, atol=3e-7, msg=name)
            assert torch.equal(moves[0.4][name], moves[0.1][name]), name
    assert moves[0.1]["value_model.score.weight"].abs().max() > 1e-3  # the value head does move


def test_ppo_metrics_by_hand():
    sizes = ppo.compute_sizes(ppo.Args(total_episodes=64, local_micro_batch_size=4), world_size=1)
    assert sizes.episodes_per_step == 4  # 4 prompts, one completion each
    reduced = dict(
        scores=0.5, kl=2.0, entropy=3.0, num_eos_tokens=0.75, pg_loss=0.6, vf_loss=0.9, approxkl=0.01, clipfrac=0.125,
        policy_entropy=2.5, ratio_mean=1.02, vf_clipfrac=0.375, value_error=0.4, explained_variance=0.3,
        engine_abs_diff=0.03, engine_diff=-0.02, correction_weight_mean=0.9, correction_truncated_frac=0.0,
        correction_masked_frac=0.05,
    )  # fmt: skip
    metrics = ppo.ppo_metrics(5, 3, sizes, 0.01, reduced, ratios=(1.4, 0.7), kl_coef=0.1)
    assert metrics == {
        "step": 5,
        "episode": 6 * 4,
        "lr": 0.01,
        "async/lag": 2,
        "async/version": 3,
        "objective/scores": 0.5,
        "objective/kl": 2.0,
        "objective/entropy": 3.0,
        "objective/non_score_reward": pytest.approx(-0.2),
        "objective/rlhf_reward": pytest.approx(0.3),
        "objective/kl_coef": 0.1,
        "val/num_eos_tokens": 0.75,
        "loss/policy": 0.6,
        "loss/value": 0.9,
        "policy/approxkl": 0.01,
        "policy/clipfrac": 0.125,
        "policy/entropy": 2.5,
        "policy/ratio_mean": 1.02,
        "policy/ratio_max": 1.4,
        "policy/ratio_min": 0.7,
        "val/clipfrac": 0.375,
        "val/value_error": 0.4,
        "val/explained_variance": 0.3,
        "policy/engine_logprob_diff": 0.03,
        "policy/engine_kl": -0.02,
        "policy/correction_weight_mean": 0.9,
        "policy/correction_truncated_frac": 0.0,
        "policy/correction_masked_frac": 0.05,
    }
