"""The pure pieces of rloo_async.py against hand-computed numbers or slow obvious versions."""

import copy
import math
import sys

import numpy as np
import pytest
import torch
from conftest import run_script, small_config

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
    of the whole mini-batch. Records what the micro-batch saw in `seen`."""
    logprobs = rloo.response_logprobs(model, rows, args.temperature)
    objective, capped, ratios, squares = logprobs.sum() * 0, [], [], []
    for row, i in enumerate(idx):
        for t in range(int(rows.response_mask[row].sum())):
            mu = targets.engine_logprobs[i][t]
            ratio = torch.exp(logprobs[row, t] - mu)
            objective = objective + min(ratio, args.token_ratio_cap) * targets.advantages[i]
            capped.append(ratio.item() > args.token_ratio_cap)
            ratios.append(ratio.item())
            squares.append((logprobs[row, t] - mu).item() ** 2)
    loss = -objective / tokens
    seen["approxkl"].append(0.5 * sum(squares) / len(squares))
    seen["clipfrac"].append(sum(capped) / len(capped))
    seen["ratios"] += ratios
    return loss


@pytest.mark.parametrize(
    "loss_type, old_logprobs, max_grad_norm",
    [
        ("proximal_rloo", "trainer", None),
        ("proximal_rloo", "engine", None),
        ("proximal_rloo", "trainer", 0.05),
        ("prime_rl", "engine", None),
    ],
)
def test_two_epochs_of_two_mini_batches_match_plain_sgd_by_hand(tokenizer, loss_type, old_logprobs, max_grad_norm):
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
    if loss_type == "prime_rl":  # against the engine's logprobs, 0.1 nats off the trainer's: capped and not
        assert 0 < np.mean(seen["clipfrac"][:2]) < 1 and 0 < np.mean(seen["clipfrac"][4:]) < 1
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
    import socket

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
    with socket.socket() as free:  # a port of our own: another run of the suite may hold accelerate's default
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/cpu_2proc.yaml"]
    launch += ["--main_process_port", str(port), "tests/two_process_update.py"]
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
    }
