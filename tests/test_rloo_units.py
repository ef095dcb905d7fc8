"""The pure pieces of rloo_async.py against hand-computed numbers or slow obvious versions."""

import copy
import math

import numpy as np
import pytest
import torch
from conftest import accelerate_launch, run_script, small_config

import rloo_async as rloo

# plain SGD's step in the epoch tests: it moves the sequence ratios of the second epoch to 0.6 .. 2 (some clipped)
LEARNING_RATE = 3e-4


# ------------------------------------------------------------------------------ leave-one-out baseline
def slow_rloo_advantages(rewards: list[list[float]]) -> list[list[float]]:
    """rewards[prompt][sample] minus the mean reward of the prompt's other samples, one at a time."""
    out = []
    for row in rewards:
        out.append([r - sum(o for j, o in enumerate(row) if j != i) / (len(row) - 1) for i, r in enumerate(row)])
    return out


@pytest.mark.parametrize("k", [2, 4])
def test_loo_baseline_vectorised_matches_a_slow_loop(k):
    rewards = torch.randn(5, k, generator=torch.Generator().manual_seed(k))
    got = rloo.rloo_advantages(rewards)
    torch.testing.assert_close(got, torch.tensor(slow_rloo_advantages(rewards.tolist())))
    assert got.sum(1).abs().max() < 1e-6  # a prompt's advantages sum to zero
    if k == 2:  # A(y1) = R(y1) - R(y2): paper appendix B
        assert got[:, 0].tolist() == pytest.approx((rewards[:, 0] - rewards[:, 1]).tolist(), abs=1e-6)


def test_loo_baseline_on_the_blogs_numbers():
    """The RLOO blog's example: 3 prompts x 4 completions, laid out (k, prompts); ours is (prompts, k)."""
    blog = torch.tensor([[1, 2, 3], [2, 3, 4], [5, 6, 7], [8, 9, 10]]).float()
    got = rloo.rloo_advantages(blog.T).T
    assert got[0, 0].item() == pytest.approx(1 - (2 + 5 + 8) / 3)
    assert got[2, 1].item() == pytest.approx(6 - (3 + 2 + 9) / 3)  # the blog's advantages[7]


# ------------------------------------------------------------------------------ sequence reward
def test_sequence_reward_subtracts_the_summed_kl_and_ignores_tokens_after_eos(tokenizer):
    eos = tokenizer.eos_token_id
    # the blog's example (kl = [-1.0, 0.1, -0.3]), then a response cut at its EOS (position 1) and one cut at response_length
    _, mask, _ = rloo.truncate_responses([[4, 5, eos], [4, eos, 6], [4, 5, 6, 7]], 3, eos_token_id=eos, pad_token_id=0)
    assert mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1]]
    logprobs = torch.tensor([[-12.3, -8.3, -2.3], [-1.0, -0.5, -50.0], [-0.2, -0.2, -0.2]])
    ref_logprobs = torch.tensor([[-11.3, -8.4, -2.0], [-1.5, -0.5, 0.0], [-0.1, -0.3, -0.4]])
    scores = torch.tensor([1.0, 2.0, -3.0])
    reward, kl = rloo.sequence_rewards(scores, logprobs, ref_logprobs, mask, kl_coef=0.05)
    assert kl.tolist() == pytest.approx([-1.2, 0.5, 0.2], abs=1e-5)  # the -50 after the EOS counts for nothing
    assert reward.tolist() == pytest.approx([1.0 + 0.05 * 1.2, 2.0 - 0.05 * 0.5, -3.0 - 0.05 * 0.2], abs=1e-6)


# ------------------------------------------------------------------------------ Proximal RLOO loss
def test_proximal_rloo_clips_on_hand_computed_ratios_for_both_signs():
    ratio = torch.tensor([1.5, 0.5, 1.5, 0.5, 1.1, 0.9])
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0, 2.0, -2.0])
    old = torch.tensor([-3.0, -2.0, -5.0, -1.0, -4.0, -2.5])
    logps = (old + ratio.log()).requires_grad_()
    loss, got_ratio, clipped = rloo.proximal_rloo_loss(logps, old, advantages, cliprange=0.2)
    # min(r A, clip(r, 0.8, 1.2) A):
    #   r 1.5 A +1 -> min(1.5, 1.2) = 1.2 (clipped)      r 0.5 A -1 -> min(-0.5, -0.8) = -0.8 (clipped)
    #   r 1.5 A -1 -> min(-1.5, -1.2) = -1.5 (not)       r 0.5 A +1 -> min(0.5, 0.8) = 0.5 (not)
    #   r 1.1 A +2 -> 2.2 (inside the range)             r 0.9 A -2 -> -1.8 (inside the range)
    objectives = [1.2, -0.8, -1.5, 0.5, 2.2, -1.8]
    assert loss.item() == pytest.approx(-sum(objectives) / 6, abs=1e-6)
    assert got_ratio.tolist() == pytest.approx(ratio.tolist(), abs=1e-6)
    assert clipped.tolist() == [True, True, False, False, False, False]
    assert clipped.float().mean().item() == pytest.approx(2 / 6)
    loss.backward()
    # clipped sequences give no gradient; the others d(-r A / n)/d logp = -r A / n
    expected_grad = [0.0, 0.0, 1.5 / 6, -0.5 / 6, -2.2 / 6, 1.8 / 6]
    assert logps.grad.tolist() == pytest.approx(expected_grad, abs=1e-6)


# ------------------------------------------------------------------------------ the group's advantage, PRIME-RL's forms
def test_group_advantages_by_hand_in_every_form():
    """k = 3, two prompts; PRIME-RL's code at 443c657 (src/prime_rl/orchestrator/advantage.py): rloo = (R - mean) k /
    (k - 1), drgrpo = R - mean, drgrpo-negclipped = max(R - mean, 0), opo = R - the mean weighted by the lengths."""
    rewards = torch.tensor([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]])
    lengths = torch.tensor([[2, 4, 2], [1, 1, 4]])
    expected = {
        # 1 - (2 + 6) / 2, 2 - (1 + 6) / 2, 6 - (1 + 2) / 2; 0 - (0 + 3) / 2, twice, 3 - 0
        "leave_one_out": [[-3.0, -1.5, 4.5], [-1.5, -1.5, 3.0]],
        "group_mean": [[-2.0, -1.0, 3.0], [-1.0, -1.0, 2.0]],  # means 3 and 1
        "group_mean_positive": [[0.0, 0.0, 3.0], [0.0, 0.0, 2.0]],
        # (1 x 2 + 2 x 4 + 6 x 2) / 8 = 2.75; (0 + 0 + 3 x 4) / 6 = 2
        "length_weighted_mean": [[-1.75, -0.75, 3.25], [-2.0, -2.0, 1.0]],
    }
    for form, values in expected.items():
        torch.testing.assert_close(rloo.group_advantages(rewards, lengths, form), torch.tensor(values), msg=form)
    # PRIME-RL's rloo and the leave-one-out baseline are the same numbers
    prime_rl_rloo = (rewards - rewards.mean(1, keepdim=True)) * 3 / 2
    torch.testing.assert_close(rloo.group_advantages(rewards, lengths, "leave_one_out"), prime_rl_rloo)


# ------------------------------------------------------------------------------ GRPO (DeepSeekMath section 4.1)
def test_grpo_s_group_normalised_advantage_by_hand():
    """(R - the group's mean) / (its unbiased standard deviation + 1e-4): k = 3, R = 1, 2, 6 (mean 3, std sqrt(7));
    k = 2, R = 1, 0 (std 1 / sqrt(2)): +-0.5 / 0.7071; a group of equal rewards: 0, not a division by zero."""
    got = rloo.group_advantages(torch.tensor([[1.0, 2.0, 6.0]]), None, "group_mean_std")
    std = math.sqrt(7)
    assert got.tolist()[0] == pytest.approx([-2 / (std + 1e-4), -1 / (std + 1e-4), 3 / (std + 1e-4)], rel=1e-6)
    got = rloo.group_advantages(torch.tensor([[1.0, 0.0], [2.0, 2.0]]), None, "group_mean_std")
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert got.tolist() == [pytest.approx([half, -half], rel=1e-6), [0.0, 0.0]]


def grpo_case():
    """Two completions of 3 and 1 tokens (garbage after the EOS), advantages +1 and -2, per-token ratios 1.5, 0.9, 1.1
    and 0.5, eps 0.2. -min(r A, clip(r) A) per token: -min(1.5, 1.2) = -1.2 (clipped), -0.9, -1.1; -min(-1.0, -1.6)
    = 1.6 (clipped)."""
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 0, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 40.0], [-0.3, -50.0, 30.0, 8.0]])
    ratios = torch.tensor([[1.5, 0.9, 1.1, 1.0], [0.5, 1.0, 1.0, 1.0]])
    logprobs = (old + ratios.log() + 100 * (1 - mask)).requires_grad_()  # garbage after the EOS here too
    return logprobs, old, torch.tensor([1.0, -2.0]), mask


@pytest.mark.parametrize(
    "normalization, divisor, loss, grads",
    [
        # each completion's mean, then theirs: ((-1.2 - 0.9 - 1.1) / 3 + 1.6) / 2
        ("sequence_mean", None, (-3.2 / 3 + 1.6) / 2, [0.0, -0.9 / 6, -1.1 / 6, 0.0]),
        ("token_mean", 4, (-3.2 + 1.6) / 4, [0.0, -0.9 / 4, -1.1 / 4, 0.0]),  # the 4 tokens
        ("constant", 8, (-3.2 + 1.6) / 8, [0.0, -0.9 / 8, -1.1 / 8, 0.0]),  # Dr. GRPO: 2 completions x 4 tokens
    ],
)
def test_grpo_loss_clips_per_token_and_normalises_by_hand(normalization, divisor, loss, grads):
    """GRPO's clipped token terms under each normalisation: the value, the ratios and the clipped tokens of the real
    tokens, and d loss / d log pi: 0 where clipped, -r A / (the normaliser) elsewhere, 0 after the EOS."""
    logprobs, old, advantages, mask = grpo_case()
    got, ratios, clipped = rloo.grpo_loss(logprobs, old, advantages, mask, 0.2, normalization, divisor)
    assert got.item() == pytest.approx(loss, abs=1e-6)
    assert ratios.tolist() == pytest.approx([1.5, 0.9, 1.1, 0.5], abs=1e-6)
    assert clipped.tolist() == [True, False, False, True]
    got.backward()
    expected = torch.tensor([grads, [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=1e-5)


def test_grpo_loss_adds_the_k3_term_and_weighs_by_the_correction_by_hand():
    """kl_coef x k3 per token, k3 = pi_ref / pi - log(pi_ref / pi) - 1 (DeepSeekMath eq. 4), with log(pi_ref / pi) =
    0.5, -1, 0, 0.2 on the real tokens: 0.1487, 0.3679, 0, 0.0214; its gradient in log pi, kl_coef (1 - pi_ref / pi).
    A correction's weights multiply the policy term only: w = 0 (a masked token), 2, 1 and 0.5."""
    logprobs, old, advantages, mask = grpo_case()
    log_ratio = torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.2, 0.0, 0.0, 0.0]])
    ref = old + log_ratio  # pi_ref / pi_old; and logprobs = old + log r
    weights = torch.tensor([[0.0, 2.0, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    got, _, _ = rloo.grpo_loss(
        logprobs, old, advantages, mask, 0.2, "token_mean", 4, is_weights=weights, ref_logprobs=ref, kl_coef=0.1
    )
    # log(pi_ref / pi) = log(pi_ref / pi_old) - log r
    k = (log_ratio - torch.tensor([[1.5, 0.9, 1.1, 1.0], [0.5, 1.0, 1.0, 1.0]]).log()) * mask
    k3 = (k.exp() - k - 1) * mask
    policy = 0 * -1.2 + 2 * -0.9 + 1 * -1.1 + 0.5 * 1.6
    assert got.item() == pytest.approx((policy + 0.1 * k3.sum().item()) / 4, abs=1e-6)
    got.backward()
    policy_grad = torch.tensor([[0.0, 2 * -0.9, 1 * -1.1, 0.0], [0.0, 0.0, 0.0, 0.0]])  # -w r A where not clipped
    expected = (policy_grad + 0.1 * (1 - k.exp()) * mask) / 4
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=1e-5)


def test_grpo_by_name_is_the_published_grpo_and_each_part_a_flag(tokenizer):
    """--loss_type grpo alone: GRPO's advantages, sequence_mean, the k3 term in the loss (no KL in the reward), the
    per-token old and reference logprobs handed to the loss; each part given by its flag instead: --kl_term reward puts
    -kl_coef sum_t (log pi_old - log pi_ref) back in the reward and hands no reference logprobs; the other losses keep
    their own (leave_one_out, the KL in the reward)."""
    assert [
        rloo.loss_setting(rloo.Args(loss_type="grpo"), f) for f in ("advantage", "loss_normalization", "kl_term")
    ] == ["group_mean_std", "sequence_mean", "k3_loss"]
    assert (
        rloo.loss_setting(rloo.Args(), "advantage") == "leave_one_out"
        and rloo.loss_setting(rloo.Args(), "kl_term") == "reward"
    )
    assert rloo.loss_setting(rloo.Args(loss_type="grpo", advantage="group_mean"), "advantage") == "group_mean"
    eos, width = tokenizer.eos_token_id, 4
    responses = [[5, eos], [5, 5, 5, 5], [5, 5, eos], [eos]]
    _, mask, _ = rloo.truncate_responses(responses, width, eos, tokenizer.pad_token_id)
    old = -torch.rand(4, width, generator=torch.Generator().manual_seed(0)) * mask
    ref = old - 0.25 * mask  # log pi_old - log pi_ref = 0.25 a token: KL 0.5, 1, 0.75, 0.25
    scores = torch.tensor([1.0, 0.0, 3.0, 3.0])
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    targets, stats = rloo.rloo_targets(scores, batch, old, ref, old, rloo.Args(loss_type="grpo", kl_coef=0.4))
    half = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert targets.advantages.tolist() == pytest.approx([half, -half, 0.0, 0.0], rel=1e-6)  # the score alone
    assert targets.old_logprobs is old and targets.ref_logprobs is ref and targets.is_weights is None
    assert stats["kl"].item() == pytest.approx((0.5 + 1 + 0.75 + 0.25) / 4)
    args = rloo.Args(loss_type="grpo", kl_coef=0.4, kl_term="reward")
    targets, _ = rloo.rloo_targets(scores, batch, old, ref, old, args)
    # rewards 0.8, -0.4 and 2.7, 2.9: a pair's centred rewards +-d / 2, its std |d| / sqrt(2)
    first, second = 0.6 / (1.2 / math.sqrt(2) + 1e-4), -0.1 / (0.2 / math.sqrt(2) + 1e-4)
    assert targets.advantages.tolist() == pytest.approx([first, -first, second, -second], rel=1e-5)
    assert targets.ref_logprobs is None and targets.old_logprobs is old
    targets, _ = rloo.rloo_targets(scores, batch, old, ref, old, rloo.Args(kl_coef=0.4))  # Proximal RLOO
    assert targets.advantages.tolist() == pytest.approx([0.8 - -0.4, -0.4 - 0.8, 2.7 - 2.9, 2.9 - 2.7], rel=1e-5)
    assert targets.old_logprobs is None and targets.ref_logprobs is None


def test_the_flags_that_would_make_a_loss_something_else_are_refused():
    check = rloo.check_loss_flags
    with pytest.raises(rloo.UsageError, match="^--loss_normalization token_mean is GRPO's: add --loss_type grpo$"):
        check(rloo.Args(loss_normalization="token_mean"))
    with pytest.raises(
        rloo.UsageError, match="^--kl_term k3_loss is a term of GRPO's token loss: add --loss_type grpo$"
    ):
        check(rloo.Args(kl_term="k3_loss"))
    with pytest.raises(
        rloo.UsageError, match="^--correction icepop masks tokens, and Proximal RLOO's ratio is one of sequences"
    ):
        check(rloo.Args(old_logprobs="engine", correction="icepop"))
    for correction in ("sequence_tis", "decoupled"):
        with pytest.raises(
            rloo.UsageError, match=f"^--correction {correction} would weigh PRIME-RL's tokens by pi_old / mu again"
        ):
            check(rloo.Args(loss_type="prime_rl", old_logprobs="engine", kl_coef=0.0, correction=correction))
    with pytest.raises(
        rloo.UsageError, match="^--correction geo_mask weighs each objective by pi_old / mu, mu the engine's"
    ):
        check(rloo.Args(loss_type="grpo", correction="geo_mask"))
    check(rloo.Args(loss_type="grpo", old_logprobs="engine", correction="icepop", loss_normalization="constant"))
    check(rloo.Args(loss_type="prime_rl", old_logprobs="engine", kl_coef=0.0, correction="geo_mask"))
    check(rloo.Args(old_logprobs="engine", correction="decoupled", kl_term="reward"))


# ------------------------------------------------------------------------------ the corrections, per sequence and as masks
def test_proximal_rloo_takes_each_correction_per_sequence_and_a_dropped_sequence_counts_in_the_mean():
    """Proximal RLOO's ratio is one of sequences: its weights are of the sequence ratios, 3.6, 1.08 and 0.9999 (tokens
    as test_ppo_units' batch), tis its cap 2 of them, decoupled 0 above its cap (1.5 here); with sequence_mask the
    first sequence is dropped (w 0) and still counts in the mean over the 3 (on-policy ratio 1, A = 1, 1, 1: the loss
    -(0 + 1.08 + 0.9999) / 3)."""
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -1.1, 0.0, 0.0], [-0.2, -0.7, -1.3, -0.9]])
    ratios = torch.tensor([[0.4, 1.5, 6.0, 1.0], [1.2, 0.9, 1.0, 1.0], [1.0, 1.0, 1.01, 0.99]])
    engine = (old - ratios.log()) * mask
    expected = {"tis": [2.0, 1.08, 0.9999], "sequence_tis": [2.0, 1.08, 0.9999], "sequence_mask": [0.0, 1.08, 0.9999],
                "geo_mask": [0.0, 0.0, 1.0], "decoupled": [0.0, 1.08, 0.9999]}  # fmt: skip
    for correction, weights in expected.items():
        args = rloo.Args(old_logprobs="engine", correction=correction, decoupled_cap=1.5)
        got, stats = rloo.correction_weights(old, engine, mask, args, per_sequence=True)
        assert got.tolist() == pytest.approx(weights, abs=2e-5), correction
        assert stats["correction_masked_frac"].item() == pytest.approx(weights.count(0.0) / 3), correction
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    args = rloo.Args(rloo_k=3, old_logprobs="engine", correction="sequence_mask")
    targets, stats = rloo.rloo_targets(torch.zeros(3), batch, old, old, engine, args)
    assert targets.is_weights.tolist() == pytest.approx([0.0, 1.08, 0.9999], abs=2e-5)
    assert stats["correction_masked_frac"].item() == pytest.approx(1 / 3)
    logps = old.sum(1).clone().requires_grad_()
    loss, _, _ = rloo.proximal_rloo_loss(logps, old.sum(1), torch.ones(3), 0.2, targets.is_weights)
    assert loss.item() == pytest.approx(-(0 + 1.08 + 0.9999) / 3, abs=2e-5)
    loss.backward()
    assert logps.grad.tolist() == pytest.approx([0.0, -1.08 / 3, -0.9999 / 3], abs=2e-5)


def test_prime_rl_takes_a_correction_s_masks_and_its_normaliser_keeps_the_masked_tokens():
    """PRIME-RL's objective with --correction icepop: its targets carry 1 where a token is kept, 0 where masked (its
    ratio is against mu already: no second weight); the loss of the kept tokens, divided by all 7 real tokens."""
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, 0.0, 0.0, 0.0], [-0.2, -2.5, 0.0, 0.0]])
    ratios = torch.tensor([[1.0, 0.4, 1.0, 7.0], [1.2, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])  # pi_old / mu
    engine = (old - ratios.log()) * mask
    args = rloo.Args(rloo_k=3, loss_type="prime_rl", old_logprobs="engine", kl_coef=0.0, correction="icepop")
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    targets, stats = rloo.rloo_targets(torch.tensor([1.0, 0.0, 2.0]), batch, old, old, engine, args)
    assert targets.is_weights.tolist() == [[1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
    assert stats["correction_masked_frac"].item() == pytest.approx(2 / 7)
    assert stats["correction_weight_mean"].item() == pytest.approx(5 / 7)
    logprobs = engine.clone().requires_grad_()  # pi = mu: every ratio 1, none capped
    advantages = torch.tensor([1.0, -2.0, 0.5])
    loss, _, _ = rloo.prime_rl_loss(logprobs, engine, advantages, mask, 8.0, 7, keep=targets.is_weights)
    assert loss.item() == pytest.approx(-(1 * 2 - 2 * 1 + 0.5 * 2) / 7, abs=1e-6)
    loss.backward()
    expected = -targets.is_weights * advantages[:, None] / 7
    torch.testing.assert_close(logprobs.grad, expected)


# ------------------------------------------------------------------------------ PRIME-RL's objective
def test_prime_rl_loss_and_gradient_by_hand_with_capped_tokens():
    """Three completions of 4, 1 and 2 tokens (their padding holds garbage logprobs, which the mask must drop), delta
    2: min(pi / mu, delta) A summed over the 7 real tokens and divided by 7 (the batch's tokens, not a mean over
    sequences). A capped token (ratio 3, A > 0; ratio 4, A < 0) gives no gradient; another d loss / d log pi_t =
    -r_t A / 7."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]])
    ratios = torch.tensor([[1.5, 0.5, 3.0, 1.0], [0.25, 1.0, 1.0, 1.0], [4.0, 1.2, 1.0, 1.0]])
    mu = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, 50.0, -50.0, 7.0], [-0.2, -2.5, 9.0, -9.0]])
    logprobs = (mu + ratios.log()).requires_grad_()
    advantages = torch.tensor([1.0, -2.0, -1.0])
    loss, got_ratios, capped = rloo.prime_rl_loss(logprobs, mu, advantages, mask, delta=2.0, tokens=7)
    # 1 x (1.5 + 0.5 + 2 + 1) - 2 x 0.25 - 1 x (2 + 1.2) = 1.3
    assert loss.item() == pytest.approx(-1.3 / 7, abs=1e-6)
    assert got_ratios.tolist() == pytest.approx([1.5, 0.5, 3.0, 1.0, 0.25, 4.0, 1.2], abs=1e-5)
    assert capped.tolist() == [False, False, True, False, False, True, False]
    loss.backward()
    expected = [[-1.5, -0.5, 0.0, -1.0], [0.5, 0.0, 0.0, 0.0], [0.0, 1.2, 0.0, 0.0]]
    assert logprobs.grad.tolist() == [pytest.approx([g / 7 for g in row], abs=1e-6) for row in expected]


def test_prime_rl_needs_the_engines_logprobs_and_no_kl_term():
    with pytest.raises(rloo.UsageError, match="^--loss_type prime_rl's mu is the engine's logprobs: add --old_log"):
        rloo.check_loss_flags(rloo.Args(loss_type="prime_rl", kl_coef=0.0))
    with pytest.raises(rloo.UsageError, match=r"no KL term .*: pass --kl_coef 0, not 0.05$"):
        rloo.check_loss_flags(rloo.Args(loss_type="prime_rl", old_logprobs="engine"))
    rloo.check_loss_flags(rloo.Args(loss_type="prime_rl", old_logprobs="engine", kl_coef=0.0))
    rloo.check_loss_flags(rloo.Args(old_logprobs="trainer", kl_coef=0.05))  # Proximal RLOO takes either
    with pytest.raises(rloo.UsageError, match=r"--token_ratio_cap must be >= 1 \(a token of the engine's own policy"):
        rloo.compute_sizes(rloo.Args(token_ratio_cap=0.9), world_size=1)


def test_truncated_importance_weights_cap_only_large_weights():
    old = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    engine = old - torch.tensor([math.log(0.5), math.log(1.5), math.log(3.0), 0.0])
    weights = rloo.truncated_is_weights(old, engine, cap=2.0)
    assert weights.tolist() == pytest.approx([0.5, 1.5, 2.0, 1.0], abs=1e-6)
    # they multiply the clipped objective of each sequence
    advantages = torch.tensor([1.0, -1.0, 2.0, 0.5])
    loss, _, _ = rloo.proximal_rloo_loss(old.clone(), old, advantages, cliprange=0.2, is_weights=weights)
    assert loss.item() == pytest.approx(-(0.5 * 1.0 - 1.5 * 1.0 + 2.0 * 2.0 + 1.0 * 0.5) / 4, abs=1e-6)


def test_advantage_normalisation_whitens_over_the_batch():
    got = rloo.whiten(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    std = math.sqrt(5 / 3)  # unbiased
    assert got.tolist() == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std], abs=1e-6)
    assert rloo.whiten(torch.full((6,), 3.0)).tolist() == [0.0] * 6  # no division by zero


def test_engine_logprobs_are_truncated_and_padded_like_the_responses(tokenizer):
    eos = tokenizer.eos_token_id
    responses = [[5, 6, eos, 7], [5, 6, 7], [5, 6, 7, 8, 9, 10]]
    logprobs = [[-0.1, -0.2, -0.3, -0.4], [-0.5, -0.6, -0.7], [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0]]
    ids, mask, contain_eos = rloo.truncate_responses(responses, 5, eos_token_id=eos, pad_token_id=0)
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=ids, response_mask=mask, contain_eos=contain_eos)
    got = rloo.pad_logprobs(logprobs, batch)  # laid out as the batch's responses, 5 wide
    torch.testing.assert_close(got, torch.tensor([[-0.1, -0.2, -0.3, 0, 0], [-0.5, -0.6, -0.7, 0, 0], [-1.0] * 5]))


# ------------------------------------------------------------------------------ on-policy ratio
def test_first_on_policy_minibatch_ratio_is_exactly_one(tokenizer):
    """async_level 0, --old_logprobs trainer: the old logprobs come from the same model as the first
    mini-batch's forward pass, so every ratio is exactly 1, nothing is clipped, and the gradient is
    REINFORCE's, -mean(A grad log pi(y)) (RLOO blog: REINFORCE is PPO's loss at ratio 1)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(small_config(tokenizer)).train()
    rloo.disable_dropout(model)
    g = torch.Generator().manual_seed(0)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 6, 9)
    ]
    k, eos = 2, tokenizer.eos_token_id
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() + [eos, 7] for n in (1, 4, 2, 6, 3, 9)]
    q_ids, q_mask = rloo.left_pad(prompts, 12, tokenizer.pad_token_id)
    q_ids, q_mask = q_ids.repeat_interleave(k, 0), q_mask.repeat_interleave(k, 0)
    r_ids, r_mask, contain_eos = rloo.truncate_responses(responses, 8, eos, tokenizer.pad_token_id)
    # as the script does: old logprobs in no-grad forward batches, then a shuffled micro-batch of another size
    old_logps = rloo.batch_logprobs(model, rloo.Batch(q_ids, q_mask, r_ids, r_mask, contain_eos), 0.7, 4).sum(1)
    advantages = rloo.rloo_advantages(torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.0]])).flatten()
    idx = torch.tensor([4, 1, 5, 0, 3])
    micro_batch = rloo.Batch(q_ids[idx], q_mask[idx], r_ids[idx], r_mask[idx], contain_eos[idx])
    logps = rloo.response_logprobs(model, micro_batch, 0.7).sum(1)
    loss, ratio, clipped = rloo.proximal_rloo_loss(logps, old_logps[idx], advantages[idx], cliprange=0.2)
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert clipped.float().mean().item() == 0.0
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logps = rloo.response_logprobs(model, micro_batch, 0.7).sum(1)
    (-(advantages[idx] * logps).mean()).backward()
    for got, expected in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, expected)


# ------------------------------------------------------------------------------ sizes
def test_sizes_count_prompts_and_episodes_count_completions():
    args = rloo.Args(
        total_episodes=512, local_micro_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=2, rloo_k=4
    )
    sizes = rloo.compute_sizes(args, world_size=1)
    assert (sizes.local_mini_batch_size, sizes.local_batch_size, sizes.episodes_per_step, sizes.num_steps) == (
        8,
        16,
        64,
        8,
    )
    with pytest.raises(ValueError, match="--rloo_k must be >= 2"):
        rloo.compute_sizes(rloo.Args(rloo_k=1), 1)
    with pytest.raises(ValueError, match="x 4 completions per prompt; change --total_episodes"):
        rloo.compute_sizes(rloo.Args(total_episodes=100, rloo_k=4), 1)


@pytest.mark.parametrize("num_mini_batches", [1, 2])
def test_only_the_later_mini_batches_of_a_step_meet_a_moved_policy(tokenizer, num_mini_batches):
    """rloo_update as the script calls it: with one mini-batch every ratio is exactly 1 (the old logprobs come from the
    same weights); with N = 2 the second mini-batch meets the policy the first optimizer step moved, and the ratio
    extremes it returns (policy/ratio_max, policy/ratio_min) leave 1."""
    import numpy as np
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    # 4 prompts x 2 completions a step either way
    args = rloo.Args(total_episodes=8, local_micro_batch_size=4 // num_mini_batches, num_mini_batches=num_mini_batches)
    args.learning_rate = 1e-2
    sizes = rloo.compute_sizes(args, world_size=1)
    accelerator = Accelerator(cpu=True)
    policy = LlamaForCausalLM(small_config(tokenizer))
    rloo.disable_dropout(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(policy, optimizer)
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 6, 2, 5, 3, 7, 6, 1)]
    batch = rloo.to_batch(prompts, responses, 2, args, tokenizer, torch.device("cpu"))
    old = rloo.batch_logprobs(model, batch, args.temperature, 8)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 0.0, 1.5, -2.0])
    targets, _ = rloo.rloo_targets(scores, batch, old, old, old, args)
    stats, (ratio_max, ratio_min) = rloo.rloo_update(
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


# ------------------------------------------------------------------------------ rloo_targets: everything it returns
def slow_rloo_targets(
    scores, lengths, old, ref, engine, k: int, kl_coef: float, normalize: bool, tis_cap: float, form="leave_one_out"
):
    """rloo_targets one completion at a time: completions i*k .. i*k + k - 1 are prompt i's (rows are prompt-major);
    per-token lists are summed over the first `lengths[i]` tokens only."""
    n = len(scores)
    real = [range(lengths[i]) for i in range(n)]
    kl = [sum(old[i][t] - ref[i][t] for t in real[i]) for i in range(n)]
    rewards = [scores[i] - kl_coef * kl[i] for i in range(n)]
    advantages = []
    for i in range(n):
        group = range(i // k * k, i // k * k + k)
        others = [rewards[j] for j in group if j != i]
        mean = sum(rewards[j] for j in group) / k
        weighted_mean = sum(rewards[j] * lengths[j] for j in group) / sum(lengths[j] for j in group)
        advantages.append(
            {
                "leave_one_out": rewards[i] - sum(others) / len(others),
                "group_mean": rewards[i] - mean,
                "group_mean_positive": max(rewards[i] - mean, 0.0),
                "length_weighted_mean": rewards[i] - weighted_mean,
            }[form]
        )
    if normalize:  # over the whole batch, unbiased standard deviation
        mean = sum(advantages) / n
        std = math.sqrt(sum((a - mean) ** 2 for a in advantages) / (n - 1))
        advantages = [(a - mean) / (std + 1e-8) for a in advantages]
    old_logps = [sum(old[i][t] for t in real[i]) for i in range(n)]
    engine_logps = [sum(engine[i][t] for t in real[i]) for i in range(n)]
    ratios = [math.exp(o - e) for o, e in zip(old_logps, engine_logps)]
    diffs = [engine[i][t] - old[i][t] for i in range(n) for t in real[i]]
    stats = {
        "kl": sum(kl) / n,
        "entropy": -sum(old_logps) / n,
        "engine_abs_diff": sum(abs(d) for d in diffs) / len(diffs),
        "engine_diff": sum(diffs) / len(diffs),
        "correction_weight_mean": sum(min(r, tis_cap) for r in ratios) / n,
        "correction_truncated_frac": sum(r > tis_cap for r in ratios) / n,
        "correction_masked_frac": 0.0,
    }
    return old_logps, advantages, [min(r, tis_cap) for r in ratios], stats


@pytest.mark.parametrize("old_logprobs", ["trainer", "engine"])
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("k", [2, 3])
def test_rloo_targets_match_a_slow_loop_over_every_field(tokenizer, k, normalize, old_logprobs):
    """rloo_targets as the script calls it (per-token logprobs 0 after the first EOS, as batch_logprobs and pad_logprobs
    give them; the reference's after-EOS slots hold garbage, which the sequence reward must ignore), against the slow
    loop above: the old sequence logprobs, the leave-one-out advantages within each prompt's k consecutive completions
    (whitened over the batch with --normalize_advantage), the truncated importance weights of --old_logprobs engine,
    and every statistic logged of them."""
    g = torch.Generator().manual_seed(k)
    n, eos, width = 3 * k, tokenizer.eos_token_id, 6
    cut = [1, 6, 3, 5, 2, 6, 4, 6, 2][:n]  # the EOS's position, or none (6: no EOS within response_length 6)
    responses = [[5] * c + [eos, 7] if c < width else [5] * 8 for c in cut]
    _, mask, _ = rloo.truncate_responses(responses, width, eos, tokenizer.pad_token_id)
    lengths = mask.sum(1).tolist()
    assert lengths == [min(c + 1, width) for c in cut]
    old = -torch.rand(n, width, generator=g) * 3 * mask
    ref = old - torch.randn(n, width, generator=g) * 0.5 + 100 * (1 - mask)
    # the engine's sequence logprobs off the trainer's by -1.5 .. +1.5 nats: some weights are capped at 1.5, some not
    engine = (old + (torch.rand(n, 1, generator=g) * 3 - 1.5) / torch.tensor(lengths)[:, None]) * mask
    scores = torch.randn(n, generator=g) * 2
    args = rloo.Args(rloo_k=k, kl_coef=0.3, normalize_advantage=normalize, old_logprobs=old_logprobs, tis_cap=1.5)
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    targets, stats = rloo.rloo_targets(scores, batch, old, ref, engine, args)
    expected = slow_rloo_targets(
        scores.tolist(), lengths, old.tolist(), ref.tolist(), engine.tolist(), k, 0.3, normalize, 1.5
    )
    old_logps, advantages, weights, expected_stats = expected
    assert targets.old_logps.tolist() == pytest.approx(old_logps, abs=1e-5)
    assert targets.advantages.tolist() == pytest.approx(advantages, abs=1e-5)
    if old_logprobs == "trainer":
        assert targets.is_weights is None and not any(key.startswith("correction_") for key in stats)
        expected_stats = {key: v for key, v in expected_stats.items() if not key.startswith("correction_")}
    else:
        assert 0 < expected_stats["correction_truncated_frac"] < 1  # the data has capped and uncapped weights
        assert targets.is_weights.tolist() == pytest.approx(weights, abs=1e-5)
    assert set(stats) == set(expected_stats)
    for key, value in expected_stats.items():
        assert stats[key].item() == pytest.approx(value, abs=1e-5), key


@pytest.mark.parametrize("form", ["leave_one_out", "group_mean", "group_mean_positive", "length_weighted_mean"])
def test_prime_rl_targets_carry_the_engines_logprobs_and_the_groups_advantages(tokenizer, form):
    """--loss_type prime_rl: the advantages in each of PRIME-RL's forms against the slow loop (k = 3, lengths 2 to 6),
    the engine's per-token logprobs handed to the loss as they came (0 after the first EOS), no per-sequence importance
    weights (PRIME-RL's ratio is per token) and none of their statistics."""
    g = torch.Generator().manual_seed(3)
    k, width, eos = 3, 6, tokenizer.eos_token_id
    cut = [1, 6, 3, 5, 2, 4]
    responses = [[5] * c + [eos, 7] if c < width else [5] * 8 for c in cut]
    _, mask, _ = rloo.truncate_responses(responses, width, eos, tokenizer.pad_token_id)
    lengths = mask.sum(1).tolist()
    old = -torch.rand(6, width, generator=g) * 3 * mask
    engine = (old + torch.randn(6, width, generator=g) * 0.3) * mask
    scores = torch.randn(6, generator=g) * 2
    args = rloo.Args(rloo_k=k, kl_coef=0.0, loss_type="prime_rl", old_logprobs="engine", advantage=form)
    batch = rloo.Batch(query_ids=None, query_mask=None, response_ids=None, response_mask=mask, contain_eos=None)
    targets, stats = rloo.rloo_targets(scores, batch, old, old, engine, args)
    expected = slow_rloo_targets(
        scores.tolist(), lengths, old.tolist(), old.tolist(), engine.tolist(), k, 0.0, False, 2.0, form
    )
    assert targets.advantages.tolist() == pytest.approx(expected[1], abs=1e-5)
    if form == "group_mean_positive":
        assert min(expected[1]) == 0.0 and max(expected[1]) > 0
    assert torch.equal(targets.engine_logprobs, engine) and targets.is_weights is None
    assert not any(key.startswith("correction_") for key in stats)


# ------------------------------------------------------------------------------ rloo_update: epochs and mini-batches
def slow_rloo_update(model, batch, targets, args, sizes, seed: int, lr: float) -> dict:
    """rloo_update by hand, for plain SGD: each epoch a new permutation of the completions from the same numpy stream,
    cut into mini-batches, each the mean of its micro-batches' gradients; the loss written out one completion at a
    time. Returns what every micro-batch saw."""
    n, k, eps = len(targets.old_logps), args.rloo_k, args.cliprange
    mini, micro = sizes.local_mini_batch_size * k, args.local_micro_batch_size * k
    params, rng = list(model.parameters()), np.random.default_rng(seed)
    seen = {"order": [], "loss": [], "approxkl": [], "clipfrac": [], "ratios": [], "clipped": []}
    for _ in range(args.num_ppo_epochs):
        order = rng.permutation(n).tolist()
        seen["order"].append(order)
        for mini_start in range(0, n, mini):
            step = [torch.zeros_like(p) for p in params]
            # PRIME-RL's objective: every token of the mini-batch, whichever micro-batch holds it, counts once; its
            # loss is logged per mini-batch, the sum of its micro-batches' parts
            tokens = sum(int(batch.response_mask[i].sum()) for i in order[mini_start : mini_start + mini])
            mini_batch_loss = 0.0
            for micro_start in range(mini_start, mini_start + mini, micro):
                idx = order[micro_start : micro_start + micro]
                rows = rloo.Batch(
                    batch.query_ids[idx],
                    batch.query_mask[idx],
                    batch.response_ids[idx],
                    batch.response_mask[idx],
                    batch.contain_eos[idx],
                )
                if args.loss_type == "prime_rl":
                    loss = slow_prime_rl_micro_batch(model, rows, idx, targets, args, tokens, seen)
                    for total, grad in zip(step, torch.autograd.grad(loss, params, allow_unused=True)):
                        if grad is not None:
                            total += grad  # each micro-batch's part of the sum over the mini-batch's tokens
                    mini_batch_loss += loss.item()
                    continue
                if args.loss_type == "grpo":
                    loss, share = slow_grpo_micro_batch(model, rows, idx, targets, args, tokens, mini // micro, seen)
                    for total, grad in zip(step, torch.autograd.grad(loss, params, allow_unused=True)):
                        if grad is not None:
                            total += grad * share
                    seen["loss"].append(loss.item())
                    continue
                logps = rloo.response_logprobs(model, rows, args.temperature).sum(1)
                objective, clipped, ratios = 0.0, [], []
                for logp, i in zip(logps, idx):
                    ratio = torch.exp(logp - targets.old_logps[i])
                    advantage = targets.advantages[i]
                    weight = 1.0 if targets.is_weights is None else targets.is_weights[i]
                    plain, clipped_term = ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage
                    objective = objective + weight * min(plain, clipped_term)
                    clipped.append(bool(clipped_term < plain))
                    ratios.append(ratio.item())
                loss = -objective / len(idx)
                grads = torch.autograd.grad(loss, params, allow_unused=True)
                for total, grad in zip(step, grads):
                    if grad is not None:
                        total += grad / (mini // micro)
                seen["loss"].append(loss.item())
                squares = [(logp - targets.old_logps[i]).item() ** 2 for logp, i in zip(logps, idx)]
                seen["approxkl"].append(0.5 * sum(squares) / len(idx))
                seen["clipfrac"].append(sum(clipped) / len(idx))
                seen["ratios"] += ratios
            if args.loss_type == "prime_rl":
                seen["loss"].append(mini_batch_loss)
            with torch.no_grad():  # one SGD step on the mean gradient, clipped to a global norm of --max_grad_norm
                norm = math.sqrt(sum((total**2).sum().item() for total in step))
                scale = 1.0 if args.max_grad_norm is None else min(1.0, args.max_grad_norm / (norm + 1e-6))
                seen["clipped"].append(scale < 1)
                for p, total in zip(params, step):
                    p -= lr * scale * total
    return seen


def slow_prime_rl_micro_batch(model, rows, idx, targets, args, tokens: int, seen: dict):
    """PRIME-RL's objective on a micro-batch, one token at a time: -sum_t min(pi / mu, delta) A / `tokens`, the count
    of the whole mini-batch, a token a correction's mask drops left out of the sum (not of the count). Records what
    the micro-batch saw in `seen`."""
    logprobs = rloo.response_logprobs(model, rows, args.temperature)
    objective, capped, ratios, squares = logprobs.sum() * 0, [], [], []
    for row, i in enumerate(idx):
        for t in range(int(rows.response_mask[row].sum())):
            mu = targets.engine_logprobs[i][t]
            ratio = torch.exp(logprobs[row, t] - mu)
            kept = 1.0 if targets.is_weights is None else targets.is_weights[i][t]
            objective = objective + kept * min(ratio, args.token_ratio_cap) * targets.advantages[i]
            capped.append(ratio.item() > args.token_ratio_cap)
            ratios.append(ratio.item())
            squares.append((logprobs[row, t] - mu).item() ** 2)
    loss = -objective / tokens
    seen["approxkl"].append(0.5 * sum(squares) / len(squares))
    seen["clipfrac"].append(sum(capped) / len(capped))
    seen["ratios"] += ratios
    return loss


def slow_grpo_micro_batch(model, rows, idx, targets, args, tokens: int, micro_batches: int, seen: dict):
    """GRPO's loss on a micro-batch, one token at a time: -w min(r A, clip(r) A) + kl_coef k3 over each completion's
    tokens, r = pi / pi_old. sequence_mean: each completion's mean, then the mean over the micro-batch's completions,
    a 1 / micro_batches share of the mini-batch's gradient; token_mean: the sum over the `tokens` of the whole
    mini-batch (each micro-batch's sum by the tokens over the micro-batches, its share 1 / micro_batches); constant:
    the sum over all micro-batches' completions x response_length. Returns the micro-batch's loss and the share of
    its gradient in the mini-batch's."""
    logprobs = rloo.response_logprobs(model, rows, args.temperature)
    eps, normalization = args.cliprange, rloo.loss_setting(args, "loss_normalization")
    per_sequence, clipped_tokens, squares = [], [], []
    for row, i in enumerate(idx):
        terms = []
        for t in range(int(rows.response_mask[row].sum())):
            ratio = torch.exp(logprobs[row, t] - targets.old_logprobs[i][t])
            advantage = targets.advantages[i]
            weight = 1.0 if targets.is_weights is None else targets.is_weights[i][t]
            plain, clipped = ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage
            term = -weight * torch.min(plain, clipped)
            if targets.ref_logprobs is not None:
                log_ratio = targets.ref_logprobs[i][t] - logprobs[row, t]
                term = term + args.kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
            terms.append(term)
            clipped_tokens.append(bool(clipped < plain))
            squares.append((logprobs[row, t] - targets.old_logprobs[i][t]).item() ** 2)
            seen["ratios"].append(ratio.item())
        per_sequence.append(sum(terms) / len(terms) if normalization == "sequence_mean" else sum(terms))
    seen["approxkl"].append(0.5 * sum(squares) / len(squares))
    seen["clipfrac"].append(sum(clipped_tokens) / len(clipped_tokens))
    if normalization == "sequence_mean":
        return sum(per_sequence) / len(idx), 1 / micro_batches
    if normalization == "token_mean":  # as the update divides it: by the tokens over the micro-batches' share
        return sum(per_sequence) / (tokens / micro_batches), 1 / micro_batches
    return sum(per_sequence) / (len(idx) * args.response_length), 1 / micro_batches


@pytest.mark.parametrize(
    "loss_type, old_logprobs, max_grad_norm, normalization, correction",
    [
        ("proximal_rloo", "trainer", None, None, "tis"),
        ("proximal_rloo", "engine", None, None, "tis"),
        ("proximal_rloo", "trainer", 0.05, None, "tis"),
        ("prime_rl", "engine", None, None, "tis"),
        ("prime_rl", "engine", None, None, "icepop"),  # a correction's token mask on PRIME-RL's objective
        ("grpo", "trainer", None, "sequence_mean", "tis"),
        ("grpo", "engine", None, "token_mean", "icepop"),
        ("grpo", "trainer", None, "constant", "tis"),
    ],
)
def test_two_epochs_of_two_mini_batches_match_plain_sgd_by_hand(
    tokenizer, loss_type, old_logprobs, max_grad_norm, normalization, correction
):
    """rloo_update with --num_ppo_epochs 2 --num_mini_batches 2 and two accumulated micro-batches per mini-batch, on
    plain SGD (at --max_grad_norm 0.05 every update clipped): the parameters it ends with are the slow version's,
    and so are the statistics it returns. The second epoch runs over the same completions again, in a new order, and
    meets ratios far from 1 (some clipped). PRIME-RL's objective: each mini-batch's gradient is the sum over its
    completions' tokens (1 to 7 each) divided by all of them, whichever micro-batch holds a token, with some tokens
    capped (delta 1.05) and others not."""
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    args = rloo.Args(
        total_episodes=8,
        local_micro_batch_size=1,
        gradient_accumulation_steps=2,
        num_mini_batches=2,
        num_ppo_epochs=2,
        loss_type=loss_type,
        old_logprobs=old_logprobs,
        kl_coef=0.0 if loss_type == "prime_rl" else 0.05,
        token_ratio_cap=1.05,
        max_grad_norm=max_grad_norm,
        loss_normalization=normalization,
        cliprange=0.005 if loss_type == "grpo" else 0.2,  # a token moves less than a sequence: clipped and not
        correction=correction,
        icepop_low=0.95,  # the engine's logprobs are 0.1 nats off the trainer's: some tokens masked, others not
        icepop_high=1.05,
    )
    rloo.check_loss_flags(args)
    sizes = rloo.compute_sizes(args, world_size=1)
    assert sizes.local_batch_size == 4  # 4 prompts x 2 completions
    torch.manual_seed(0)
    policy = LlamaForCausalLM(small_config(tokenizer))
    rloo.disable_dropout(policy)
    by_hand = copy.deepcopy(policy)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps)
    model, optimizer = accelerator.prepare(policy, torch.optim.SGD(policy.parameters(), lr=LEARNING_RATE))
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 6, 2, 5, 3, 7, 6, 1)]
    batch = rloo.to_batch(prompts, responses, 2, args, tokenizer, torch.device("cpu"))
    old = rloo.batch_logprobs(model, batch, args.temperature, 8)
    engine = old + torch.randn(old.shape, generator=g) * 0.1 * batch.response_mask
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 0.0, 1.5, -2.0])
    targets, _ = rloo.rloo_targets(scores, batch, old, old, engine, args)
    stats, (ratio_max, ratio_min) = rloo.rloo_update(
        model, optimizer, accelerator, batch, targets, args, sizes, np.random.default_rng(0)
    )
    seen = slow_rloo_update(by_hand, batch, targets, args, sizes, 0, LEARNING_RATE)
    assert seen["clipped"] == [max_grad_norm is not None] * 4  # the gradient's norm: 0.1 .. 1 (measured)
    for (name, got), expected in zip(model.named_parameters(), by_hand.parameters()):
        torch.testing.assert_close(got, expected, msg=name)
    # the two sum their gradients in different orders: float32 rounding, relative 1e-6 in a ratio of 2 after 3 updates
    for key in ("loss", "approxkl", "clipfrac"):
        assert stats[key].item() == pytest.approx(np.mean(seen[key]), rel=1e-5, abs=1e-6), key
    assert stats["ratio_mean"].item() == pytest.approx(np.mean(seen["ratios"]), rel=1e-5)
    assert (ratio_max, ratio_min) == pytest.approx((max(seen["ratios"]), min(seen["ratios"])), rel=1e-5)
    # what makes the test able to fail: the first mini-batch meets the old policy itself, the second epoch reorders the
    # same 8 completions and meets a policy 2 updates away, clipped on some completions and not on others
    first, second = seen["order"]
    assert sorted(first) == sorted(second) == list(range(8)) and first != second
    if correction == "icepop":  # a token mask: some tokens dropped, others not
        real = targets.is_weights[batch.response_mask.bool()]
        assert 0 < (real == 0).sum() < len(real)
    if loss_type == "prime_rl":  # against the engine's logprobs, 0.1 nats off the trainer's: capped and not
        assert 0 < np.mean(seen["clipfrac"][:2]) < 1 and 0 < np.mean(seen["clipfrac"][4:]) < 1
        return
    if loss_type == "grpo":  # per token: the first mini-batch meets ratio 1, the second epoch clips some tokens
        assert set(seen["ratios"][: int(batch.response_mask[first[:4]].sum())]) == {1.0}
        assert 0 < np.mean(seen["clipfrac"][4:]) < 1 and targets.ref_logprobs is not None
        return
    assert seen["ratios"][:4] == [1.0] * 4
    if max_grad_norm is None:  # clipped to 0.05, the updates are too small to move a ratio far
        assert max(abs(r - 1) for r in seen["ratios"][8:]) > 0.3
        assert 0 < np.mean(seen["clipfrac"][4:]) < 1


# ------------------------------------------------------------------------------ PRIME-RL's 1 / (the batch's tokens)
def long_and_short_completions(tokenizer, gradient_accumulation_steps: int):
    """A policy and a batch of 2 prompts x 2 completions: prompt 0's long (7 and 5 tokens), prompt 1's short (1 and
    2), with the targets of PRIME-RL's objective: the engine's logprobs 0.2 nats off the policy's, and one token's
    ratio 2, capped at delta 1.5."""
    from transformers import LlamaForCausalLM

    args = rloo.Args(
        total_episodes=4,
        local_micro_batch_size=1,
        gradient_accumulation_steps=gradient_accumulation_steps,
        loss_type="prime_rl",
        old_logprobs="engine",
        kl_coef=0.0,
        token_ratio_cap=1.5,
        max_grad_norm=None,
    )
    torch.manual_seed(0)
    policy = LlamaForCausalLM(small_config(tokenizer))
    rloo.disable_dropout(policy)
    g = torch.Generator().manual_seed(7)
    prompts = [[tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 3)]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (7, 5, 1, 2)]
    batch = rloo.to_batch(prompts, responses, 2, args, tokenizer, torch.device("cpu"))
    assert batch.response_mask.sum(1).tolist() == [7, 5, 1, 2]
    old = rloo.batch_logprobs(policy, batch, args.temperature, 4)
    engine = (old + torch.randn(old.shape, generator=g) * 0.2) * batch.response_mask
    engine[0, 3] = old[0, 3] - math.log(2.0)
    scores = torch.tensor([1.0, -0.5, 2.0, 0.0])
    targets, _ = rloo.rloo_targets(scores, batch, old, old, engine, args)
    return args, policy, batch, targets


def prime_rl_step_by_hand(policy, batch, targets, args, lr: float) -> list[torch.Tensor]:
    """The parameters after one SGD step on PRIME-RL's J (its docs/async.md): the sum over every real token of the batch of min(pi /
    mu, delta) A, divided by their number, one token at a time."""
    model = copy.deepcopy(policy)
    logprobs = rloo.response_logprobs(model, batch, args.temperature)
    objective, tokens = 0.0, 0
    for i, length in enumerate(batch.response_mask.sum(1).tolist()):
        for t in range(length):
            ratio = torch.exp(logprobs[i, t] - targets.engine_logprobs[i, t])
            objective = objective + min(ratio, args.token_ratio_cap) * targets.advantages[i]
            tokens += 1
    grads = torch.autograd.grad(-objective / tokens, list(model.parameters()))
    return [(p - lr * grad).detach() for p, grad in zip(model.parameters(), grads)]


def test_prime_rl_divides_by_the_batchs_tokens_across_micro_batches_and_processes(tokenizer, tmp_path):
    """PRIME-RL's J (its docs/async.md): the sum over all 15 tokens of the long and the short completions, divided by 15, whoever holds a
    token. One process, two micro-batches accumulated into one optimizer step (plain SGD, lr 1), the short completions
    (3 tokens) and the long ones (12): dividing each by its own would weigh the short ones' tokens four times as much
    as the long ones'. Then two training processes
    (gloo), one prompt each, rank 0 the long completions (12 tokens), rank 1 the short ones (3): PRIME-RL's code
    divides by each process's own tokens (src/prime_rl/trainer/rl/train.py:255-259 at 443c657), which would weigh
    rank 1's tokens four times as much as rank 0's. Both updates are the hand computation's."""
    import dataclasses

    from accelerate import Accelerator

    args, policy, batch, targets = long_and_short_completions(tokenizer, gradient_accumulation_steps=2)
    expected = prime_rl_step_by_hand(policy, batch, targets, args, lr=1.0)
    before = [p.detach().clone() for p in policy.parameters()]
    policy.save_pretrained(tmp_path / "policy")  # for the two processes
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(policy, torch.optim.SGD(policy.parameters(), lr=1.0))
    sizes = rloo.compute_sizes(args, world_size=1)
    stats, _ = rloo.rloo_update(model, optimizer, accelerator, batch, targets, args, sizes, np.random.default_rng(2))
    lengths = batch.response_mask.sum(1)[np.random.default_rng(2).permutation(4)]
    assert (lengths[:2].sum(), lengths[2:].sum()) == (3, 12)  # the two micro-batches: the short ones, the long ones
    assert 0 < stats["clipfrac"] < 1  # the capped token
    for got, old, new in zip(model.parameters(), before, expected):
        torch.testing.assert_close(got.detach() - old, new - old, rtol=1e-4, atol=1e-7)

    two = dataclasses.replace(args, gradient_accumulation_steps=1)
    inputs = dict(policy=str(tmp_path / "policy"), args=dataclasses.asdict(two), learning_rate=1.0)
    torch.save(inputs | dict(batch=batch._asdict(), targets=targets._asdict()), tmp_path / "inputs.pt")
    launch = accelerate_launch("--config_file", "configs/cpu_2proc.yaml", "tests/two_process_update.py")
    run_script([*launch, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")], env={"ACCELERATE_USE_CPU": "1"})
    got = torch.load(tmp_path / "out.pt")
    for (name, _), old, new in zip(policy.named_parameters(), before, expected):
        torch.testing.assert_close(got[name] - old, new - old, rtol=1e-4, atol=1e-7, msg=name)


def test_rloo_metrics_by_hand():
    sizes = rloo.compute_sizes(rloo.Args(total_episodes=64, local_micro_batch_size=4), world_size=1)
    assert sizes.episodes_per_step == 8  # 4 prompts x 2 completions
    reduced = dict(
        scores=0.5, kl=2.0, entropy=3.0, num_eos_tokens=0.75, loss=0.6, approxkl=0.01, clipfrac=0.125,
        ratio_mean=1.02, engine_abs_diff=0.03, engine_diff=-0.02, correction_weight_mean=0.98,
        correction_masked_frac=0.25,
    )  # fmt: skip
    metrics = rloo.rloo_metrics(5, 3, sizes, 0.01, reduced, ratios=(1.4, 0.7), kl_coef=0.1)
    assert metrics == {
        "step": 5,
        "episode": 6 * 8,
        "lr": 0.01,
        "async/lag": 2,
        "async/version": 3,
        "objective/scores": 0.5,
        "objective/kl": 2.0,
        "objective/entropy": 3.0,
        "objective/non_score_reward": pytest.approx(-0.2),
        "objective/rlhf_reward": pytest.approx(0.3),
        "val/num_eos_tokens": 0.75,
        "loss/policy": 0.6,
        "policy/approxkl": 0.01,
        "policy/clipfrac": 0.125,
        "policy/ratio_mean": 1.02,
        "policy/ratio_max": 1.4,
        "policy/ratio_min": 0.7,
        "policy/engine_logprob_diff": 0.03,
        "policy/engine_kl": -0.02,
        "policy/correction_weight_mean": 0.98,
        "policy/correction_masked_frac": 0.25,
    }
