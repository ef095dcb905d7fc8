"""The pure pieces of rloo_async.py against hand-computed numbers or slow obvious versions."""

import math

import pytest
import torch
from conftest import small_config

import rloo_async as rloo


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
    _, mask, _ = rloo.truncate_responses(responses, 5, eos_token_id=eos, pad_token_id=0)
    got = rloo.pad_logprobs(logprobs, 5, mask)
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
    logps = rloo.response_logprobs(model, q_ids[idx], q_mask[idx], r_ids[idx], r_mask[idx], 0.7).sum(1)
    loss, ratio, clipped = rloo.proximal_rloo_loss(logps, old_logps[idx], advantages[idx], cliprange=0.2)
    assert torch.equal(ratio, torch.ones_like(ratio))
    assert clipped.float().mean().item() == 0.0
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logps = rloo.response_logprobs(model, q_ids[idx], q_mask[idx], r_ids[idx], r_mask[idx], 0.7).sum(1)
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
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 1.0)
    g = torch.Generator().manual_seed(1)
    prompts = [
        [tokenizer.bos_token_id] + torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (3, 5, 2, 6)
    ]
    responses = [torch.randint(4, len(tokenizer), (n,), generator=g).tolist() for n in (4, 6, 2, 5, 3, 7, 6, 1)]
    batch = rloo.to_batch(prompts, responses, 2, args, tokenizer, torch.device("cpu"))
    old = rloo.batch_logprobs(model, batch, args.temperature, 8)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.5, 0.0, 1.5, -2.0])
    targets, _ = rloo.rloo_targets(scores, batch, old, old, old, args)
    _, (ratio_max, ratio_min) = rloo.rloo_update(
        model, optimizer, scheduler, accelerator, batch, targets, args, sizes, np.random.default_rng(0), step=0
    )
    if num_mini_batches == 1:
        assert ratio_max == ratio_min == 1.0
    else:
        assert ratio_max > 1 + 1e-4 or ratio_min < 1 - 1e-4, (ratio_max, ratio_min)
