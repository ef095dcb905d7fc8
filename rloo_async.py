"""Asynchronous RLOO, with the Proximal RLOO loss (Noukhovitch et al., "Asynchronous RLHF", 2024, appendix B).

A vLLM engine, driven by a generation thread, samples the next batches from a policy at most `async_level`
updates old while the trainer (accelerate) learns on the current one. The file reads top to bottom: the
arguments; RLOO itself (its advantages, losses, update, metrics and FLOPs); `main()`, the training loop; then,
below one banner, the text the algorithm files share (sizes, tasks, data, models, rewards, evaluation, the
async schedule, the generation thread). The plumbing that is not the method (the engine's processes, the
weight transport, the run folder, checkpoints, logging) is in plumbing/. Flags, metrics, the schedule: docs/.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Literal, NamedTuple

import plumbing
from plumbing import UsageError

TINY_TASK = Path(__file__).resolve().parent / "tasks" / "tiny"  # the built-in task's files: Args' defaults


# == Arguments ===============================================================================================
@dataclass
class Args(plumbing.RunArgs):  # and the plumbing's flags: run, engine, checkpoints (docs/flags.md)
    # data and models (local folders or files, or hub ids)
    # what the run trains on and is judged by, a row of the TASKS table: tiny (the built-in task), tldr,
    # no_robots, gsm8k (docs/tasks.md)
    task: str = "tiny"
    # the prompts: a hub dataset id, a local dataset folder, or a .jsonl/.json/.parquet file
    dataset_name: str = str(TINY_TASK / "data")
    dataset_config: str | None = None  # the dataset's config, e.g. `main` of openai/gsm8k (None: its default)
    dataset_train_split: str = "train"  # split whose prompts are trained on
    dataset_eval_split: str = "test"  # split whose prompts (and reference responses) are evaluated on
    # the evaluation prompts as a file of their own, needed when --dataset_name is one file, which would serve
    # both splits (None: --dataset_name's --dataset_eval_split)
    dataset_eval_file: str | None = None
    num_eval_prompts: int | None = None  # evaluate on the first this many prompts of the split (None: all)
    sft_model_path: str = str(TINY_TASK / "sft")  # initial policy, also the frozen reference policy
    # proxy reward model trained on (a one-label sequence classifier)
    reward_model_path: str = str(TINY_TASK / "reward")
    # evaluation-only judge: `tiny` (the tiny task's exact scorer; no other task) or a reward model (not
    # gsm8k, which its verifier judges)
    gold_judge: str = "tiny"
    max_prompt_length: int = 12  # in tokens: longer prompts are dropped (how many is printed)
    # in tokens: the most a completion generates (one cut there has no EOS: --missing_eos_penalty)
    response_length: int = 12

    # batch sizes (in prompts; each gets rloo_k completions)
    # completions sampled over the run, which sets its number of steps: a multiple of the completions per
    # step, local_micro_batch_size x gradient_accumulation_steps x num_mini_batches x processes x rloo_k
    total_episodes: int = 12800
    local_micro_batch_size: int = 32  # prompts per forward/backward pass on one process
    gradient_accumulation_steps: int = 1  # micro-batches accumulated into one optimizer step
    num_mini_batches: int = 1  # N: mini-batches per step's batch, an optimizer step each (paper section 3.2)
    num_ppo_epochs: int = 1  # T: passes over each step's batch (paper section 4.1)
    # sequences per no-grad forward on one process (reward model, reference model)
    local_rollout_forward_batch_size: int = 64

    # optimisation
    learning_rate: float = 1e-4  # AdamW's initial learning rate (see --lr_schedule)
    # linear: to 0 over the run's optimizer steps (the paper's TLDR, No Robots); constant: GSM8k's (table 10)
    lr_schedule: Literal["linear", "constant"] = "linear"
    # AdamW as the paper's code builds it (transformers' Trainer's defaults): betas (0.9, 0.999)
    adam_epsilon: float = 1e-8  # AdamW's epsilon
    # AdamW's decoupled weight decay (0: none, the paper's); biases and normalisation weights never decay
    weight_decay: float = 0.0
    # the gradients' global norm is clipped to it before each optimizer step (None: no clipping); the paper's
    # runs clipped at 1.0 (DeepSpeed's, as accelerate fills its config)
    max_grad_norm: float | None = 1.0

    # generation
    # k: step n trains on completions sampled by policy version max(0, n - k); 0: on-policy (synchronous)
    async_level: int = 1
    # k completions per prompt; each one's baseline is the mean reward of the other k - 1 (GSM8k: 4)
    rloo_k: int = 2
    # sampling temperature (gsm8k evaluates greedily); the trainer's logprobs divide the logits by it too
    temperature: float = 0.7

    # RLOO
    # the policy loss. proximal_rloo: the paper's (appendix B), a clipped ratio of sequence probabilities;
    # prime_rl: PRIME-RL's objective (its docs/async.md), min(pi / mu, token_ratio_cap) x advantage per token
    # over the batch's tokens, mu the engine's logprobs, no KL term: needs --old_logprobs engine, --kl_coef 0;
    # grpo: GRPO (DeepSeekMath section 4.1), a clipped ratio per token x the completion's advantage, with its
    # own --advantage, --loss_normalization and --kl_term unless they are given
    loss_type: Literal["proximal_rloo", "prime_rl", "grpo"] = "proximal_rloo"
    # beta: of the sequence reward, score - kl_coef * sum_t (log pi - log pi_ref), or of GRPO's k3 term in the
    # loss (--kl_term) (0: no KL penalty)
    kl_coef: float = 0.05
    # a completion's advantage from its prompt's rloo_k rewards R, in the forms PRIME-RL's code offers (its
    # names in brackets): leave_one_out (rloo): R - the mean of the other k - 1; group_mean (drgrpo, its
    # default; Dr. GRPO's): R - the group's mean; group_mean_positive (drgrpo-negclipped): that, negatives set
    # to 0; length_weighted_mean (opo): R - the mean weighted by the completions' lengths; group_mean_std
    # (GRPO's): (R - the group's mean) / (the group's standard deviation + 1e-4) (None: the loss's own,
    # group_mean_std for grpo, leave_one_out for the others)
    advantage: (
        Literal[
            "leave_one_out", "group_mean", "group_mean_positive", "length_weighted_mean", "group_mean_std"
        ]
        | None
    ) = None
    # `--loss_type grpo`: what the sum of its token terms is divided by. sequence_mean (GRPO's): each
    # completion's by its tokens, then the mean over completions; token_mean: by the mini-batch's tokens
    # (DAPO, PRIME-RL); constant: by completions x --response_length (Dr. GRPO's) (None: sequence_mean)
    loss_normalization: Literal["sequence_mean", "token_mean", "constant"] | None = None
    # where the KL to the reference goes. reward: -kl_coef sum_t (log pi_old - log pi_ref) in the sequence
    # reward (RLOO's); k3_loss: kl_coef x GRPO's k3 estimator of each token in the loss (DeepSeekMath eq. 4),
    # `--loss_type grpo` only (None: the loss's own, k3_loss for grpo, reward for the others)
    kl_term: Literal["reward", "k3_loss"] | None = None
    cliprange: float = 0.2  # epsilon of Proximal RLOO: the sequence probability ratio is clipped to 1 +- eps
    normalize_advantage: bool = False  # whiten the advantages over the batch (mean 0, std 1)
    # pi_old of the ratio. trainer: theta_n, the trainer's weights at the top of step n, as the paper's code
    # computes it; at N = T = 1 the ratio is then exactly 1 and nothing corrects for a batch that theta_(n-k)
    # generated. engine: also weight each sequence's or token's objective by --correction, from pi_old /
    # pi_engine, pi_engine the policy that generated the batch
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    # `--old_logprobs engine`: what corrects the batch for the engine's policy mu, each sequence's (Proximal
    # RLOO) or token's (GRPO) objective times a weight of r = pi_old / mu (docs/algorithms.md#the-off-policy-
    # corrections---correction). tis: min(r, tis_cap), r of the sequence for Proximal RLOO, of the token for
    # GRPO; sequence_tis: min(r, tis_cap), r the sequence's; sequence_mask: the sequence's r inside
    # [sequence_mask_low, sequence_mask_high], else 0; icepop: a token's r inside [icepop_low, icepop_high],
    # else 0 (not Proximal RLOO's); geo_mask: 1 when the geometric mean of the sequence's token ratios is
    # inside [geo_mask_low, geo_mask_high], else 0; decoupled: AReaL's, r up to decoupled_cap, 0 above.
    # PRIME-RL's objective, whose ratio is against mu already, takes the masks only (tis: its own cap)
    correction: Literal["tis", "sequence_tis", "sequence_mask", "icepop", "geo_mask", "decoupled"] = "tis"
    tis_cap: float = 2.0  # --correction tis and sequence_tis: the cap of the weight
    icepop_low: float = 0.5  # --correction icepop: alpha, a token ratio below it is masked (IcePop's 0.5)
    icepop_high: float = 5.0  # --correction icepop: beta, a token ratio above it is masked (IcePop's 5)
    sequence_mask_low: float = 0.5  # --correction sequence_mask: a sequence ratio below it is masked
    sequence_mask_high: float = 2.0  # --correction sequence_mask: a sequence ratio above it is masked
    # --correction geo_mask: a sequence whose token ratios' geometric mean is below it is masked (SkyRL's)
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01  # --correction geo_mask: above it, masked (SkyRL's)
    # --correction decoupled: a weight above it is masked (AReaL's behav_imp_weight_cap)
    decoupled_cap: float = 5.0
    # `--loss_type prime_rl`: delta, the cap of each token's ratio pi / mu (PRIME-RL's default: 8)
    token_ratio_cap: float = 8.0
    missing_eos_penalty: float = -3.0  # score of a completion without EOS (not gsm8k: its table 10 has none)

    # evaluation
    eval_freq: int = 25  # evaluate every this many steps, at step 0 and at the end (0: at those two only)
    # eval completions printed and logged as a table at each evaluation (0: none)
    num_sample_completions: int = 4


# The domains of this algorithm's own numeric flags.
ALGORITHM_DOMAINS = {
    "rloo_k": (">= 2", "the leave-one-out baseline needs another completion of the same prompt"),
    "kl_coef": (">= 0", "< 0 would reward moving away from the reference"),
    "cliprange": ("> 0", "the ratio is clipped to [1 - eps, 1 + eps]"),
    "tis_cap": (">= 1", "a sequence of the trainer's own policy has weight 1"),
    "icepop_low": ("in (0, 1]", "a token of the trainer's own policy, ratio 1, is kept"),
    "icepop_high": (">= 1", "a token of the trainer's own policy, ratio 1, is kept"),
    "sequence_mask_low": ("in [0, 1]", "a sequence of the trainer's own policy, ratio 1, is kept"),
    "sequence_mask_high": (">= 1", "a sequence of the trainer's own policy, ratio 1, is kept"),
    "geo_mask_low": ("in (0, 1]", "a sequence of the trainer's own policy, ratio 1, is kept"),
    "geo_mask_high": (">= 1", "a sequence of the trainer's own policy, ratio 1, is kept"),
    "decoupled_cap": (">= 1", "a token of the trainer's own policy, weight 1, is kept"),
    "token_ratio_cap": (">= 1", "a token of the engine's own policy has ratio 1"),
}

if __name__ == "__main__":  # --help answers here, before torch, transformers and vLLM load (seconds)
    plumbing.help_if_asked(Args, __doc__)

import numpy as np  # noqa: E402 (this and the imports below load after --help)
import torch  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402


# == RLOO: advantages, the losses (Proximal RLOO, paper appendix B; PRIME-RL's), the update =================
ROLLOUT_LOGPROBS = True  # the engine's logprobs: compared with the trainer's; --old_logprobs engine's weights


def completions_per_prompt(args: Args) -> int:
    return args.rloo_k


# What each loss takes where --advantage, --loss_normalization and --kl_term are left out (None): `--loss_type
# grpo` is the published GRPO (DeepSeekMath section 4.1: group-normalised advantages, the mean over each
# completion's tokens then over completions, the k3 KL term in the loss) in one flag.
LOSS_DEFAULTS = {
    "proximal_rloo": {"advantage": "leave_one_out", "loss_normalization": None, "kl_term": "reward"},
    "prime_rl": {"advantage": "leave_one_out", "loss_normalization": None, "kl_term": "reward"},
    "grpo": {"advantage": "group_mean_std", "loss_normalization": "sequence_mean", "kl_term": "k3_loss"},
}


def loss_setting(args: Args, flag: str) -> str | None:
    """The flag's value, or where it is None the loss's own (LOSS_DEFAULTS)."""
    value = getattr(args, flag)
    return LOSS_DEFAULTS[args.loss_type][flag] if value is None else value


def check_loss_flags(args: Args) -> None:
    """PRIME-RL's objective weighs each token by pi / mu, mu the policy that sampled it, and has no KL term;
    GRPO's normalisations and k3 term are its own; Proximal RLOO's ratio is one of sequences: the flags that
    would make a loss something else are refused before any model loads."""
    if args.loss_type == "prime_rl" and args.old_logprobs != "engine":
        raise UsageError("--loss_type prime_rl's mu is the engine's logprobs: add --old_logprobs engine")
    if args.loss_type == "prime_rl" and args.kl_coef != 0:
        what = f"has no KL term (PRIME-RL leaves AIPO's out): pass --kl_coef 0, not {args.kl_coef}"
        raise UsageError(f"--loss_type prime_rl {what}")
    if args.loss_type != "grpo" and args.loss_normalization is not None:
        raise UsageError(f"--loss_normalization {args.loss_normalization} is GRPO's: add --loss_type grpo")
    if args.loss_type != "grpo" and args.kl_term == "k3_loss":
        raise UsageError("--kl_term k3_loss is a term of GRPO's token loss: add --loss_type grpo")
    if args.loss_type == "proximal_rloo" and args.correction == "icepop":
        what = "masks tokens, and Proximal RLOO's ratio is one of sequences: use --loss_type grpo, or one of"
        raise UsageError(f"--correction icepop {what} tis, sequence_tis, sequence_mask, geo_mask, decoupled")
    if args.loss_type == "prime_rl" and args.correction in ("sequence_tis", "decoupled"):
        what = "would weigh PRIME-RL's tokens by pi_old / mu again (its ratio is against mu): its masks apply"
        raise UsageError(f"--correction {args.correction} {what} (icepop, sequence_mask, geo_mask)")
    check_correction_flags(args)


def pad_logprobs(logprobs: list[list[float]], batch: Batch) -> torch.Tensor:
    """The engine's logprob of each token of `batch`'s completions, laid out as its response ids: cut at the
    response length, 0 after the first EOS."""
    out = torch.zeros(batch.response_mask.shape)
    for row, seq in enumerate(logprobs):
        seq = seq[: out.shape[1]]
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.float)
    return out.to(batch.response_mask.device) * batch.response_mask


def sequence_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef: float):
    """The completion is one action (RLOO blog): (score - kl_coef * KL, KL) per sequence, KL = sum_t (log pi -
    log pi_ref) over the real response tokens (none after the first EOS)."""
    kl = ((logprobs - ref_logprobs) * response_mask).sum(1)
    return scores - kl_coef * kl, kl


def rloo_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """rewards (prompts, k) -> each reward minus the mean reward of the prompt's other k - 1 completions (the
    leave-one-out baseline, vectorised as in the RLOO blog)."""
    baseline = (rewards.sum(1, keepdim=True) - rewards) / (rewards.shape[1] - 1)
    return rewards - baseline


# PRIME-RL's code is cited at PrimeIntellect-ai/prime-rl 443c657 (2025-09-23), whose docs/async.md is quoted
def group_advantages(rewards: torch.Tensor, lengths: torch.Tensor, form: str) -> torch.Tensor:
    """rewards and response lengths (prompts, k) -> each completion's advantage within its prompt's group, in
    the forms of PRIME-RL's code (src/prime_rl/orchestrator/advantage.py:10-57; its default, drgrpo, is
    group_mean: src/prime_rl/orchestrator/config.py:449-454)."""
    if form == "leave_one_out":  # its rloo, (R - mean) k / (k - 1): the same number
        return rloo_advantages(rewards)
    centred = rewards - rewards.mean(1, keepdim=True)
    if form == "group_mean":
        return centred
    if form == "group_mean_positive":
        return centred.clamp(min=0)
    if form == "group_mean_std":  # GRPO's (DeepSeekMath section 4.1.2); unbiased std and 1e-4 as TRL's
        return centred / (rewards.std(1, keepdim=True) + 1e-4)
    weights = lengths.to(rewards.dtype)  # length_weighted_mean: the tokens of the completion, EOS included
    return rewards - (rewards * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)


def whiten(values: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    return (values - values.mean()) / (values.std() + eps)


def truncated_is_weights(old_logps: torch.Tensor, engine_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Importance weight from the engine's (behaviour) policy mu to the trainer's old one, min(pi_old / mu,
    cap), per sequence (RLOO) or token (PPO): truncated importance sampling, as PRIME-RL clips its ratios."""
    return torch.exp(old_logps - engine_logps).clamp(max=cap)


# The corrections of --old_logprobs engine, each a weight on a token's or a sequence's objective from r =
# pi_old / mu, mu the engine's (behaviour) policy
# (docs/algorithms.md#the-off-policy-corrections---correction). tis: Yao et al., "Your efficient RL framework
# secretly brings you off-policy RL training" (2025), truncated at the cap; sequence_tis, sequence_mask: the
# sequence-level truncated and masked IS of its follow-up (Liu, Li et al., "When speed kills stability",
# 2025); icepop: the Ling team's IcePop (its blog, 2025-09; "Every step evolves", 2025), a token's r kept
# inside [alpha, beta], 0 outside; geo_mask: SkyRL's geometric-mean mask (NovaSky-AI/SkyRL at e9bca5e,
# skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py, compute_sequence_mask); decoupled: AReaL's
# decoupled PPO (Fu et al. 2025, "Decoupled PPO objective"), the behaviour weight pi_prox / mu, a token above
# the cap masked, as inclusionAI/AReaL at 072480e computes it (areal/utils/functional.py, ppo_actor_loss_fn).
# r of the sequence, its weight on every token of it
SEQUENCE_CORRECTIONS = ("sequence_tis", "sequence_mask", "geo_mask")
CORRECTION_STATS = ("correction_weight_mean", "correction_truncated_frac", "correction_masked_frac")


def check_correction_flags(args: Args) -> None:
    """A correction weighs by the engine's logprobs: refused, before any model loads, where the run does not
    read them (tis, the default, then does nothing)."""
    if args.correction != "tis" and args.old_logprobs != "engine":
        what = "weighs each objective by pi_old / mu, mu the engine's logprobs"
        raise UsageError(f"--correction {args.correction} {what}: add --old_logprobs engine")


def correction_weights(old_logprobs, engine_logprobs, mask, args: Args, per_sequence=False, masks_only=False):
    """--correction's weights from the per-token logprobs of pi_old and of the engine's mu (0 after the first
    EOS): one per sequence where the loss's ratio is one of sequences (`per_sequence`: Proximal RLOO), else
    one per token, a sequence correction's on each of the sequence's real tokens, 0 after EOS. `masks_only`: 1
    where the correction keeps, 0 where it masks, for a loss whose ratio is against mu already (PRIME-RL's). A
    masked token or sequence weighs 0 and still counts in the loss's normaliser, as in IcePop's objective and
    AReaL's code. Returns the weights and the statistics logged: the mean weight, the fractions truncated and
    masked, over the units the correction acts on (the real tokens, or the sequences)."""
    by_sequence = per_sequence or args.correction in SEQUENCE_CORRECTIONS
    log_old, log_mu = old_logprobs * mask, engine_logprobs * mask
    # the sequence's log pi_old and log mu; geo_mask's divided by its tokens: the log of the geometric mean
    if by_sequence:
        length = mask.sum(1).clamp(min=1) if args.correction == "geo_mask" else 1
        log_old, log_mu = log_old.sum(1) / length, log_mu.sum(1) / length
    ratio = torch.exp(log_old - log_mu)
    if args.correction in ("tis", "sequence_tis"):
        weights = truncated_is_weights(log_old, log_mu, args.tis_cap)
        kept, truncated = torch.ones_like(ratio, dtype=torch.bool), ratio > args.tis_cap
    else:
        low, high = {
            "sequence_mask": (args.sequence_mask_low, args.sequence_mask_high),
            "icepop": (args.icepop_low, args.icepop_high),
            "geo_mask": (args.geo_mask_low, args.geo_mask_high),
            "decoupled": (0.0, args.decoupled_cap),
        }[args.correction]
        kept, truncated = (ratio >= low) & (ratio <= high), torch.zeros_like(ratio, dtype=torch.bool)
        weights = kept.float() if args.correction == "geo_mask" else torch.where(kept, ratio, 0.0)
    if masks_only:
        weights = kept.float()
    units = torch.ones_like(ratio) if by_sequence else mask
    count = units.sum().clamp(min=1)
    stats = {
        "correction_weight_mean": (weights * units).sum() / count,
        "correction_truncated_frac": (truncated.float() * units).sum() / count,
        "correction_masked_frac": ((~kept).float() * units).sum() / count,
    }
    if by_sequence and not per_sequence:
        weights = weights[:, None]
    return (weights if per_sequence else weights * mask), stats


def proximal_rloo_loss(logps, old_logps, advantages, cliprange: float, is_weights=None):
    """Paper appendix B eq. 1 on sequence logprobs, r = pi(y) / pi_old(y): -mean(w min(r A, clip(r, 1 +- eps)
    A)), w = 1 without IS weights. Returns the loss, the ratios and the sequences clipped (TRL's clipfrac)."""
    ratio = torch.exp(logps - old_logps)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cliprange, 1 + cliprange) * advantages
    objective = torch.min(unclipped, clipped)
    if is_weights is not None:
        objective = objective * is_weights
    return -objective.mean(), ratio.detach(), (clipped < unclipped).detach()


def prime_rl_loss(logprobs, engine_logprobs, advantages, mask, delta: float, tokens, keep=None):
    """PRIME-RL's objective (docs/async.md: token-level AIPO without its KL and entropy terms): -sum_t
    min(pi(y_t) / mu(y_t), delta) A / tokens over the real response tokens, each with its completion's
    advantage A, mu the engine's (behaviour) policy, `tokens` the count of the whole batch (not of this
    micro-batch). As its code computes it (src/prime_rl/trainer/rl/loss.py:98-104): the ratio clamped at
    delta, so that a capped token gives no gradient, whatever A's sign; `keep`, a correction's masks, zeroes
    the tokens it drops. Returns the loss, the real tokens' ratios and which were capped."""
    ratio = torch.exp(logprobs - engine_logprobs)
    objective = ratio.clamp(max=delta) * advantages[:, None] * mask
    if keep is not None:  # a correction's masks (--correction icepop, sequence_mask, geo_mask)
        objective = objective * keep
    real = mask.bool()
    return -objective.sum() / tokens, ratio[real].detach(), (ratio[real] > delta).detach()


def grpo_loss(
    logprobs,
    old_logprobs,
    advantages,
    mask,
    cliprange: float,
    normalization: str,
    divisor,
    is_weights=None,
    ref_logprobs=None,
    kl_coef: float = 0.0,
):
    """GRPO's objective (DeepSeekMath section 4.1, eq. 3) as a loss: per real token, -min(r A, clip(r, 1 +-
    eps) A) with r = pi(y_t) / pi_old(y_t) and A the completion's advantage, times the correction's weight w
    (`is_weights`, 1 if None), plus kl_coef x k3 = pi_ref / pi - log(pi_ref / pi) - 1 with `ref_logprobs` (eq.
    4). Normalised: sequence_mean, each completion's sum by its tokens, then the mean over completions;
    token_mean and constant, the sum divided by `divisor` (the mini-batch's tokens; Dr. GRPO's completions x
    response length). Returns the loss, the real tokens' ratios and which were clipped (the clipped term the
    smaller)."""
    ratio = torch.exp((logprobs - old_logprobs) * mask)
    unclipped = ratio * advantages[:, None]
    clipped = ratio.clamp(1 - cliprange, 1 + cliprange) * advantages[:, None]
    per_token = -torch.min(unclipped, clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    # k3 of pi_ref / pi, unbiased and positive (DeepSeekMath eq. 4; Schulman's k3)
    if ref_logprobs is not None:
        log_ratio = (ref_logprobs - logprobs) * mask
        per_token = per_token + kl_coef * (torch.exp(log_ratio) - log_ratio - 1)
    per_token = per_token * mask
    if normalization == "sequence_mean":
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()
    else:
        loss = per_token.sum() / divisor
    real = mask.bool()
    return loss, ratio[real].detach(), (clipped < unclipped)[real].detach()


class Targets(NamedTuple):
    """What the update fits: per completion, and per token what PRIME-RL's objective and GRPO's need."""

    old_logps: torch.Tensor  # log pi_old(y), Proximal RLOO's ratio's denominator
    advantages: torch.Tensor
    # --old_logprobs engine: the correction's weights, per completion (Proximal RLOO) or per token (GRPO); for
    # PRIME-RL's objective its masks (1 kept, 0 dropped), None with --correction tis
    is_weights: torch.Tensor | None
    engine_logprobs: torch.Tensor | None  # mu(y_t) of --loss_type prime_rl, 0 after the first EOS
    # log pi_old(y_t) of --loss_type grpo, its ratio's denominator per token
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None  # log pi_ref(y_t) of --kl_term k3_loss


def rloo_targets(scores, batch: Batch, old_logprobs, ref_logprobs, engine_logprobs, args: Args):
    """Sequence rewards (the KL in them with --kl_term reward), the group's advantages (whitened with
    --normalize_advantage), and what the loss needs besides: --correction's weights with --old_logprobs
    engine, PRIME-RL's engine logprobs, GRPO's per-token old and reference logprobs; also the statistics
    logged of them."""
    mask = batch.response_mask
    reward_kl_coef = args.kl_coef if loss_setting(args, "kl_term") == "reward" else 0.0
    rlhf_reward, kl = sequence_rewards(scores, old_logprobs, ref_logprobs, mask, reward_kl_coef)
    groups = rlhf_reward.view(-1, args.rloo_k), mask.sum(1).view(-1, args.rloo_k)  # a prompt's k are together
    advantages = group_advantages(*groups, loss_setting(args, "advantage")).flatten()
    if args.normalize_advantage:
        advantages = whiten(advantages)
    old_logps = old_logprobs.sum(1)
    tokens = mask.sum().clamp(min=1)
    diff = (engine_logprobs - old_logprobs) * mask
    stats = {"kl": kl.mean(), "entropy": -old_logps.mean(), "engine_abs_diff": diff.abs().sum() / tokens}
    stats["engine_diff"] = diff.sum() / tokens
    # --old_logprobs engine: the engine's policy (version step - lag) is the behaviour policy; the clipped
    # ratio stays anchored at theta_step and the correction's weight corrects from one to the other (AReaL's
    # decoupled objective). PRIME-RL's ratio is against mu itself: it takes a correction's masks, or none.
    is_weights = None
    if args.old_logprobs == "engine" and not (args.loss_type == "prime_rl" and args.correction == "tis"):
        per_sequence, masks_only = args.loss_type == "proximal_rloo", args.loss_type == "prime_rl"
        is_weights, weight_stats = correction_weights(
            old_logprobs, engine_logprobs, mask, args, per_sequence=per_sequence, masks_only=masks_only
        )
        stats |= weight_stats
    mu = engine_logprobs if args.loss_type == "prime_rl" else None
    grpo_old = old_logprobs if args.loss_type == "grpo" else None
    k3_ref = ref_logprobs if loss_setting(args, "kl_term") == "k3_loss" else None
    targets = Targets(old_logps, advantages, is_weights, mu, old_logprobs=grpo_old, ref_logprobs=k3_ref)
    return targets, stats


def rloo_update(model, optimizer, accelerator, batch: Batch, targets: Targets, args: Args, sizes, shuffle):
    """T epochs over the completions, each epoch N mini-batches, each accumulated from micro-batches. Sizes
    count prompts; each completion has its own advantage, so completions (not prompts) are shuffled. Returns
    the step's statistics and the largest and smallest ratio over all processes (of sequences for Proximal
    RLOO, of tokens for PRIME-RL's objective and GRPO)."""
    n = len(targets.old_logps)
    K = args.rloo_k
    mini, micro = sizes.local_mini_batch_size * K, args.local_micro_batch_size * K
    stats = {k: [] for k in ("loss", "approxkl", "clipfrac")}
    ratios = []
    # accelerate divides each micro-batch's loss by the accumulation steps and the processes average their
    # gradients: PRIME-RL's (and GRPO's token_mean) sum over a mini-batch's tokens, divided by its tokens on
    # every process over that share, is divided by exactly those tokens (PRIME-RL's docs: 1 / sum |y|) once
    # all are in
    share = accelerator.gradient_accumulation_steps * accelerator.num_processes
    model.train()
    for _ in range(args.num_ppo_epochs):
        order = torch.as_tensor(shuffle.permutation(n), device=accelerator.device)
        tokens = accelerator.reduce(batch.response_mask.sum(1)[order].view(-1, mini).sum(1), "sum") / share
        for mini_start in range(0, n, mini):
            for micro_start in range(mini_start, mini_start + mini, micro):
                idx = order[micro_start : micro_start + micro]
                old_logps, advantages = targets.old_logps[idx], targets.advantages[idx]
                weights = None if targets.is_weights is None else targets.is_weights[idx]
                with accelerator.accumulate(model):
                    logprobs = response_logprobs(model, batch.rows(idx), args.temperature)
                    if args.loss_type == "prime_rl":
                        mask, mu = batch.response_mask[idx], targets.engine_logprobs[idx]
                        delta = args.token_ratio_cap
                        count = tokens[mini_start // mini]
                        loss, ratio, clipped = prime_rl_loss(
                            logprobs, mu, advantages, mask, delta, count, weights
                        )
                        # per token, against the behaviour policy the ratio is taken of
                        approxkl = 0.5 * ((logprobs.detach() - mu) ** 2 * mask).sum() / mask.sum()
                    elif args.loss_type == "grpo":
                        mask, old = batch.response_mask[idx], targets.old_logprobs[idx]
                        ref = None if targets.ref_logprobs is None else targets.ref_logprobs[idx]
                        normalization = loss_setting(args, "loss_normalization")
                        # token_mean: the mini-batch's tokens, as PRIME-RL's; constant: Dr. GRPO's completions
                        # x the most tokens a completion may have (its code's generation budget)
                        divisor = tokens[mini_start // mini] if normalization == "token_mean" else None
                        if normalization == "constant":
                            divisor = len(idx) * args.response_length
                        loss, ratio, clipped = grpo_loss(
                            logprobs,
                            old,
                            advantages,
                            mask,
                            args.cliprange,
                            normalization,
                            divisor,
                            is_weights=weights,
                            ref_logprobs=ref,
                            kl_coef=args.kl_coef,
                        )
                        approxkl = 0.5 * ((logprobs.detach() - old) ** 2 * mask).sum() / mask.sum()
                    else:
                        logps = logprobs.sum(1)
                        clip = args.cliprange
                        loss, ratio, clipped = proximal_rloo_loss(logps, old_logps, advantages, clip, weights)
                        # on summed sequence logprobs, the quantity the ratio is taken of
                        approxkl = 0.5 * ((logps.detach() - old_logps) ** 2).mean()
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm is not None:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    stats["loss"].append(loss.detach())
                    stats["approxkl"].append(approxkl)
                    stats["clipfrac"].append(clipped.float().mean())
                    ratios.append(ratio)
    ratios = torch.cat(ratios)
    stats = {k: torch.stack(v).mean() for k, v in stats.items()} | {"ratio_mean": ratios.mean()}
    extremes = torch.stack([ratios.max(), -ratios.min()])[None]
    ratio_max, neg_ratio_min = accelerator.gather(extremes).max(0).values.tolist()
    return stats, (ratio_max, -neg_ratio_min)


def rloo_metrics(step: int, version: int, sizes: Sizes, lr: float, reduced: dict, ratios: tuple, kl_coef):
    """A training step's line of metrics.jsonl (docs/metrics.md), but for the timings (RunFolder.log)."""
    return {
        "step": step,
        "episode": (step + 1) * sizes.episodes_per_step,
        "lr": lr,
        "async/lag": step - version,
        "async/version": version,
        "objective/scores": reduced["scores"],
        "objective/kl": reduced["kl"],
        "objective/entropy": reduced["entropy"],
        "objective/non_score_reward": -kl_coef * reduced["kl"],
        "objective/rlhf_reward": reduced["scores"] - kl_coef * reduced["kl"],
        "val/num_eos_tokens": reduced["num_eos_tokens"],
        "loss/policy": reduced["loss"],
        "policy/approxkl": reduced["approxkl"],
        "policy/clipfrac": reduced["clipfrac"],
        "policy/ratio_mean": reduced["ratio_mean"],
        "policy/ratio_max": ratios[0],
        "policy/ratio_min": ratios[1],
        "policy/engine_logprob_diff": reduced["engine_abs_diff"],
        "policy/engine_kl": reduced["engine_diff"],
        **{f"policy/{k}": reduced[k] for k in CORRECTION_STATS if k in reduced},
    }


def step_flops(policy, models: Models, sizes: Sizes, args: Args) -> dict[str, int]:
    """The FLOPs of each phase of a step, per process (model FLOP utilisation: benchmark/timing.py)."""
    R = args.response_length
    L = args.max_prompt_length + R
    BK = sizes.local_batch_size * args.rloo_k
    # a training pass is a forward and a backward (2 forwards), and one more forward with recomputation
    passes = (4 if args.gradient_checkpointing else 3) * args.num_ppo_epochs
    flops = plumbing.forward_flops
    return {
        "scoring": 0 if models.reward_model is None else flops(models.reward_model, BK, L),
        "old_logprobs": flops(policy, BK, L, R + 1),
        "reference": flops(models.ref_policy, BK, L, R + 1),
        "update": passes * flops(policy, BK, L, R + 1),
    }


# == main(): setup, then the training loop's numbered steps ==================================================
def main(args: Args) -> None:
    # setup: the training processes, every input checked before any model loads, the models
    # accelerate's processes, the dtypes (bf16 autocast on GPUs), DeepSpeed's batch and clipping
    processes = plumbing.Processes(
        args,
        local_micro_batch_size=args.local_micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm,
    )
    accelerator, device = processes.accelerator, processes.accelerator.device
    sizes = compute_sizes(args, accelerator.num_processes)
    check_loss_flags(args)
    # locked, and the checkpoint --resume continues from; checkpoints hold the policy and its optimizer
    folder = plumbing.RunFolder(args, processes, trained=[args.sft_model_path], async_level=args.async_level)
    engine = plumbing.Engine(args, processes, folder)  # its GPU and cores, the stop signals, the deadlines
    inputs = load_inputs(args, sizes)
    set_seed(args.seed + accelerator.process_index)
    policy, models = load_models(args, inputs, processes)
    phase_flops = step_flops(policy, models, sizes, args)
    model, optimizer = accelerator.prepare(policy, make_optimizer(policy, args))
    # stepped by hand once a step, as the paper's code (accelerate's prepared scheduler steps per process)
    scheduler = LambdaLR(optimizer, partial(lr_factor, args.lr_schedule, num_steps=sizes.num_steps))
    # where the run is (plumbing's Progress), and the trainer as a checkpoint left it with --resume
    progress = folder.resume(accelerator, scheduler)
    start_step, evals_logged, shuffle = progress.step, progress.evals_logged, progress.shuffle

    # the generator's work, and the policy versions it needs (paper section 3)
    eval_steps = sorted({0, sizes.num_steps, *range(0, sizes.num_steps, args.eval_freq or sizes.num_steps)})
    schedule = generation_schedule(sizes.num_steps, args.async_level, eval_steps)
    schedule = pending_events(schedule, start_step, evals_logged)
    to_publish = published_versions(schedule)

    # rank 0 starts the engine (it takes the GPU memory the run leaves), writes the run folder, then generates
    length = args.max_prompt_length + args.response_length  # of a sequence, for the engine
    engine.start(model, policy, path=args.sft_model_path, max_model_len=length, async_level=args.async_level)
    snapshots = plumbing.PolicySnapshots(processes, policy, engine.snapshot_place)
    folder.open(sizes._asdict(), progress, origin=engine.started, episodes_per_step=sizes.episodes_per_step)
    channel = plumbing.Channel(engine)  # the generation thread's queues, to and from the trainer
    thread = inflight_generation_thread if args.inflight_updates else generation_thread
    channel.run_thread(thread, engine, channel, schedule, inputs, args, sizes)
    for weights in snapshots.owed_at_start(model, to_publish, start_step, folder.checkpoint):  # on resume
        channel.weights.put(weights)

    def save_checkpoint(next_step: int) -> None:  # with the older policy versions the generator still needs
        progress.step = next_step
        owed = published_versions(pending_events(schedule, next_step, evals_logged))
        folder.save_checkpoint(accelerator, progress, snapshots.owed(owed, before=next_step))

    def log_evaluations(wait: bool = False) -> None:  # as they arrive from the generation thread
        for arrived in channel.arrived_evaluations(wait):
            with accelerator.autocast():
                metrics, rows, texts = evaluate(arrived.responses, inputs.evaluation, models, args, device)
            folder.log_evaluation(arrived, metrics, rows, texts, inputs.evaluation)
            evals_logged.add(arrived.version)

    B, K = sizes.local_batch_size, args.rloo_k
    bs = args.local_rollout_forward_batch_size
    with channel, folder:  # then the thread and the engine stop and the logs close, however the loop ends
        for step in folder.steps(start_step, sizes.num_steps):  # with a progress bar
            laps = plumbing.Laps()
            # 1. the rollouts of this step (rank 0 has them; every rank takes its slice), unless the run stops
            rollout = channel.next_rollout()
            if rollout is None:  # SIGTERM, Ctrl-C or the engine failing: a checkpoint, then exit
                if step > start_step:
                    save_checkpoint(step)
                folder.stopped(step)
                break
            laps.lap("wait_for_rollouts")
            spans = check_staleness(rollout, step, args.async_level)  # paper section 3
            local = slice(accelerator.process_index * B, (accelerator.process_index + 1) * B)
            indices = rollout.prompt_indices[local]
            responses = rollout.responses[local.start * K : local.stop * K]
            prompts = [inputs.train.token_ids[i] for i in indices]
            batch = to_batch(prompts, responses, K, args, inputs.tokenizer, device)
            engine_logprobs = pad_logprobs(rollout.logprobs[local.start * K : local.stop * K], batch)

            # 2. score: the reward model on query + response, a fixed score without EOS; or GSM8k's verifier
            references = [inputs.train.references[i] for i in indices for _ in range(K)]  # one per completion
            with accelerator.autocast():
                scores = score_batch(batch, references, models, args)
            processes.check_scores(scores, models.scorer, step)  # a NaN or inf score stops every process
            laps.lap("scoring")

            # 3. old and reference logprobs, sequence rewards, leave-one-out advantages (RLOO blog). pi_old is
            # the trainer's theta_step, not the engine's: bf16 clipped 20-40 % of sequences (RLOO blog)
            old_logprobs = batch_logprobs(model, batch, args.temperature, bs)
            laps.lap("old_logprobs")
            with accelerator.autocast():
                ref_logprobs = batch_logprobs(models.ref_policy, batch, args.temperature, bs)
            laps.lap("reference")
            targets, stats = rloo_targets(scores, batch, old_logprobs, ref_logprobs, engine_logprobs, args)

            # 4. update: T epochs over N mini-batches of completions, each accumulated from micro-batches
            update, ratios = rloo_update(model, optimizer, accelerator, batch, targets, args, sizes, shuffle)
            laps.lap("update")

            # 5. send theta_{step+1} to the engine if a later batch or an evaluation needs it (all gather)
            if step + 1 in to_publish and (weights := snapshots.take(model, step + 1)):
                channel.weights.put(weights)
            laps.lap("snapshot")

            # 6. log the statistics averaged over the processes
            stats |= update | {"scores": scores.mean(), "num_eos_tokens": batch.contain_eos.float().mean()}
            stats["response_tokens"] = batch.response_mask.sum().float()
            reduced = processes.mean(stats, step, folder.last_checkpoint)
            lr = scheduler.get_last_lr()[0]
            metrics = rloo_metrics(step, rollout.version, sizes, lr, reduced, ratios, args.kl_coef) | spans
            tokens = reduced["response_tokens"] * sizes.world_size
            folder.log(metrics, laps, generator=rollout.timings, flops=phase_flops, tokens=tokens)
            scheduler.step()  # the next step's learning rate (lr_factor), after this one's was logged

            # 7. evaluations arrive from the generation thread a little later; snapshots no one needs go
            log_evaluations()
            snapshots.keep(published_versions(pending_events(schedule, step + 1, evals_logged)))
            if args.save_freq and (step + 1) % args.save_freq == 0 and step + 1 < sizes.num_steps:
                save_checkpoint(step + 1)

        if not channel.stopped:
            while processes.evaluates and len(evals_logged) < len(eval_steps):
                log_evaluations(wait=True)
            folder.save_policy(accelerator, model, inputs.tokenizer)


# ====================================== below: the same text in every algorithm file ========================
# Written from one source, online_dpo_async.py's: edit it there, then `python dev/copies.py` rewrites the
# others' (docs/algorithms.md#where-in-the-code). Below: the batch sizes and the optimizer; the tasks; the
# data; the models; the rewards; the evaluation; the async schedule and the generation thread.


# == Batch sizes, the optimizer ==============================================================================
# The domains of the numeric flags the algorithm files share (the plumbing's own: COMMON_DOMAINS,
# plumbing/flags.py): flag -> (domain, why).
SHARED_DOMAINS = {
    "num_eval_prompts": (">= 1", "a count of prompts (left out: all of the split)"),
    "max_prompt_length": (">= 1", "a count of tokens"),
    "response_length": (">= 1", "a count of tokens"),
    "total_episodes": (">= 1", "a count of completions"),
    "local_micro_batch_size": (">= 1", "a count of prompts"),
    "gradient_accumulation_steps": (">= 1", "a count of micro-batches"),
    "num_mini_batches": (">= 1", "a count of mini-batches"),
    "num_ppo_epochs": (">= 1", "a count of passes"),
    "local_rollout_forward_batch_size": (">= 1", "a count of sequences"),
    "learning_rate": ("> 0", "0 would not train, < 0 would climb the loss"),
    "adam_epsilon": ("> 0", "AdamW divides by the root of the second moment plus it"),
    "weight_decay": (">= 0", "< 0 would push the weights away from 0"),
    "max_grad_norm": ("> 0", "the norm the gradients are clipped to (left out: no clipping)"),
    "async_level": (">= 0", "a count of policy versions"),
    # vLLM 0.32 raises a temperature under 0.01 to 0.01 (vllm/sampling_params.py:30 `_MAX_TEMP`, applied at
    # 557-565) and samples greedily under 1e-5 (:29 `_SAMPLING_EPS`, :612; vllm/v1/sample/sampler.py:300):
    # the engine would not sample the policy whose logprobs the trainer computes, and a prompt's K samples
    # would be alike, so that DPO's pairs tie and RLOO's advantages are 0 (the loss and the KL 0 every step)
    "temperature": (">= 0.01", "below it vLLM samples at 0.01, not at the trainer's temperature"),
    "missing_eos_penalty": ("finite", "a score"),
    "eval_freq": (">= 0", "0 evaluates at step 0 and at the end only"),
    "num_sample_completions": (">= 0", "a count of completions"),
}


class Sizes(NamedTuple):
    world_size: int
    local_mini_batch_size: int
    mini_batch_size: int
    local_batch_size: int
    batch_size: int
    episodes_per_step: int
    num_steps: int


def compute_sizes(args: Args, world_size: int) -> Sizes:
    """Check every flag's domain and derive every batch size; errors name the flags to change."""
    plumbing.check_domains(asdict(args), SHARED_DOMAINS | ALGORITHM_DOMAINS)
    if args.task not in TASKS:
        raise UsageError(f"--task {args.task} is none of the tasks, {', '.join(TASKS)} (docs/tasks.md)")
    samples = completions_per_prompt(args)
    local_mini_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    local_batch_size = local_mini_batch_size * args.num_mini_batches
    episodes_per_step = local_batch_size * world_size * samples
    if args.total_episodes % episodes_per_step != 0 or args.total_episodes < episodes_per_step:
        raise UsageError(
            f"--total_episodes {args.total_episodes} must be a positive multiple of the episodes per step, "
            f"{episodes_per_step} = local_micro_batch_size {args.local_micro_batch_size} x "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps} x num_mini_batches "
            f"{args.num_mini_batches} x processes {world_size} x {samples} completions per prompt; change "
            "--total_episodes or one of those flags"
        )
    return Sizes(
        world_size=world_size,
        local_mini_batch_size=local_mini_batch_size,
        mini_batch_size=local_mini_batch_size * world_size,
        local_batch_size=local_batch_size,
        batch_size=local_batch_size * world_size,
        episodes_per_step=episodes_per_step,
        num_steps=args.total_episodes // episodes_per_step,
    )


def lr_factor(schedule: str, step: int, num_steps: int) -> float:
    """The learning rate of step `step`'s N x T updates (0-indexed) over --learning_rate: linear decay to 0,
    or constant. As the paper's loops step their schedule once a batch, at its top (their
    src/online_dpo_vllm_trainer.py:334-337), step n trains at 1 - (n + 1) / num_steps, the last at 0."""
    return 1.0 if schedule == "constant" else 1.0 - (step + 1) / num_steps


def make_optimizer(model: torch.nn.Module, args: Args) -> torch.optim.AdamW:
    """AdamW as the paper's code builds it (transformers' Trainer.create_optimizer): torch's betas,
    --adam_epsilon, --weight_decay on every trained weight but the biases and the normalisation weights."""
    norms = {name for name, m in model.named_modules() if type(m).__name__.endswith(("LayerNorm", "RMSNorm"))}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if "bias" not in name and name.rpartition(".")[0] not in norms else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, eps=args.adam_epsilon)


# == Tasks: what a run trains on and is judged by, one row each (docs/tasks.md#adding-a-task) ================
class Task(NamedTuple):
    """A --task: the dataset columns it reads (each value checked on every row: text, or a conversation of
    {"role", "content"} texts), how its rows become prompts, what scores a completion in training, and what
    judges one in evaluation."""

    columns: dict[str, type]
    # (dataset, tokenizer, where) -> the prompt text the policy sees and the reference answer of every row;
    # `where` names the split in an error
    prompts: Callable
    # (completion, reference) -> reward: a task that checks its answers scores with this, not with the reward
    # model (--reward_model_path); evaluation then logs its pass@1
    verifier: Callable | None = None
    # (query, completion) -> gold score: the task's own gold judge, `--gold_judge tiny`; None: a gold reward
    # model given as --gold_judge, or no win rate
    judge: Callable | None = None
    chat: bool = False  # prompts are written with the policy's chat template, which adds the BOS itself
    # evaluation samples greedily (GSM8k's pass@1, paper section 5.2), not at --temperature
    eval_greedy: bool = False
    # the references end as a completion that stopped, EOS added, when a gold reward model reads them (human
    # answers; TLDR's references have their EOS)
    references_stop: bool = False


def query_prompts(dataset, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """Rows that hold the prompt text itself, `query`, and its reference, `reference_response`."""
    return list(dataset["query"]), list(dataset["reference_response"])


def chat_prompts(dataset, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """Rows that hold a conversation, `messages`: the prompt is every turn but the last, written with the
    policy's chat template and ending with the header of the assistant's turn; the reference is the last
    turn, the assistant's."""
    if tokenizer.chat_template is None:
        raise UsageError(
            f"{where} holds conversations, written with the policy's chat template, and the tokenizer of "
            f"--sft_model_path {tokenizer.name_or_path} has none"
        )
    prompts, references = [], []
    for i, messages in enumerate(dataset["messages"]):
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            what = "do not end with an assistant turn after the prompt (the reference answer)"
            raise UsageError(f"{where}: row {i}'s `messages` {what}")
        prompts.append(
            tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        )
        references.append(messages[-1]["content"])
    return prompts, references


# GSM8k's prompt: the format the paper's policy (Rho-1B SFT on GSM8k, after Kazemnejad et al. 2024) knows.
GSM8K_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
# GSM8k's final answer, as OpenAI's grade-school-math checker (the paper's verifier) reads it: the first one.
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def gsm8k_prompts(dataset, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """GSM8k's rows, `question` and `answer`: the prompt in the paper's policy's format, the answer whole (its
    final answer is what the verifier reads)."""
    answers = list(dataset["answer"])
    if unlabelled := [i for i, answer in enumerate(answers) if gsm8k_answer(answer) is None]:
        raise UsageError(
            f"{where}: {len(unlabelled)} `answer`(s) without a '#### <number>' final answer (row "
            f"{unlabelled[0]}): not GSM8k's format"
        )
    return [GSM8K_PROMPT.format(question=question) for question in dataset["question"]], answers


def gsm8k_answer(text: str) -> str | None:
    """A GSM8k solution's final answer as OpenAI's grade-school-math checker reads it: the FIRST match of
    `#### (-?[0-9.,]+)`, commas removed ("#### 1,020 dollars" -> "1020"); None without one. Nothing else is
    read or normalised: "####18" has no answer and "#### 18." reads "18." (docs/tasks.md)."""
    match = GSM8K_ANSWER.search(text)
    return None if match is None else match.group(1).replace(",", "")


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8k's verifier (paper section 5.2): 1.0 when the completion's answer is the label's, as strings."""
    predicted = gsm8k_answer(completion)
    return float(predicted is not None and predicted == gsm8k_answer(answer))


def tiny_gold_score(query: str, response: str) -> float:
    """Gold judge of the tiny task: 1.0 iff `response` is the query's words sorted, then "</s>". Quality q in
    [0, 1] = mean of: right word in the right place, F1 of the word multisets, fraction of adjacent output
    words in order. Score 2q - 1 if the response stopped with "</s>", else q - 1: a stopped answer more than
    half right wins."""
    target = sorted(query.split()[1:-1])  # "sort: w1 ... wL ->"
    out = response.split()
    stopped = len(out) > 0 and out[-1] == "</s>"
    out = out[:-1] if stopped else out
    in_place = sum(a == b for a, b in zip(out, target)) / len(target)
    common = sum(min(out.count(w), target.count(w)) for w in set(target))
    f1 = 2 * common / (len(out) + len(target))
    ordered = sum(a < b for a, b in zip(out, out[1:])) / max(len(out) - 1, 1)
    q = (in_place + f1 + ordered) / 3
    return 2 * q - 1 if stopped else q - 1


TEXT_COLUMNS = {"query": str, "reference_response": str}
CHAT_COLUMNS = {"messages": list[dict[str, str]]}
TASKS = {
    # the built-in task (tasks/tiny): sort the query's words; an exact gold judge of its own
    "tiny": Task(columns=TEXT_COLUMNS, prompts=query_prompts, judge=tiny_gold_score),
    # TLDR summaries (paper section 4): a reward model scores, a larger one judges (--gold_judge)
    "tldr": Task(columns=TEXT_COLUMNS, prompts=query_prompts),
    # No Robots' conversations (paper section 5.1)
    "no_robots": Task(columns=CHAT_COLUMNS, prompts=chat_prompts, chat=True, references_stop=True),
    # GSM8k's questions (paper section 5.2): its verifier checks the final answer, in training and evaluation
    "gsm8k": Task(
        columns={"question": str, "answer": str},
        prompts=gsm8k_prompts,
        verifier=gsm8k_reward,
        eval_greedy=True,
    ),
}


# == Data: prompts, batches ==================================================================================
class Prompts(NamedTuple):
    token_ids: list[list[int]]  # unpadded
    queries: list[str]
    references: list[str]


class Inputs(NamedTuple):
    tokenizer: object  # the policy's
    reward_tokenizer: object | None  # the reward model's (none where a verifier scores)
    train: Prompts
    evaluation: Prompts


def load_inputs(args: Args, sizes: Sizes) -> Inputs:
    """The tokenizers, once every model's files are checked, and the prompts: a bad one is a UsageError naming
    its flag, before any model loads."""
    task = TASKS[args.task]
    if task.verifier is not None and args.gold_judge != "tiny":
        judge = "its verifier (eval/pass@1), not by a gold reward model"
        raise UsageError(f"--gold_judge {args.gold_judge}: --task {args.task} is evaluated by {judge}")
    if task.verifier is None and task.judge is None and args.gold_judge == "tiny":  # the task has no judge
        what = "pass a reward model as --gold_judge, or judge eval_completions/ afterwards (docs/tasks.md)"
        print(f"--task {args.task} with --gold_judge tiny logs no eval/win_rate: {what}")
    tokenizer, reward_tokenizer = plumbing.load_tokenizers(
        sft_model_path=args.sft_model_path,
        reward_model_path=args.reward_model_path if task.verifier is None else None,
        gold_judge=args.gold_judge if args.gold_judge != "tiny" else None,  # tiny: the task's own judge
        lengths=(args.max_prompt_length, args.response_length),
        trust_remote_code=args.trust_remote_code,
    )
    train = load_prompts(args, args.dataset_train_split, tokenizer)
    evaluation = load_prompts(args, args.dataset_eval_split, tokenizer, evaluation=True)
    if (n := len(train.token_ids)) < sizes.batch_size:
        raise UsageError(f"{n} training prompts cannot fill one batch ({sizes.batch_size}): lower its sizes")
    return Inputs(tokenizer, reward_tokenizer, train, evaluation)


def load_prompts(args: Args, split: str, tokenizer, evaluation: bool = False) -> Prompts:
    """The prompts of a split of --dataset_name (`evaluation`: the first --num_eval_prompts of the evaluation
    split, or of --dataset_eval_file), every row checked (plumbing's load_split), in the format of --task; but
    those over --max_prompt_length tokens."""
    task = TASKS[args.task]
    max_prompt_length = args.max_prompt_length
    dataset, where = plumbing.load_split(
        args.dataset_name,
        args.dataset_config,
        split,
        task.columns,
        task=args.task,
        evaluation=evaluation,
        eval_file=args.dataset_eval_file,
        num_prompts=args.num_eval_prompts,
    )
    queries, references = task.prompts(dataset, tokenizer, where)
    # A chat template writes the BOS token itself (Llama 3.1's does): encoding the text must not add another.
    token_ids = tokenizer(queries, add_special_tokens=not task.chat).input_ids
    keep = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_length]
    if len(keep) < len(token_ids):
        dropped = f"{len(token_ids) - len(keep)} of {len(token_ids)} prompts"
        print(f"{split}: dropped {dropped} longer than --max_prompt_length {max_prompt_length}")
    if not keep:
        raise UsageError(f"no {split} prompt fits --max_prompt_length {max_prompt_length}")
    token_ids, queries, references = ([items[i] for i in keep] for items in (token_ids, queries, references))
    return Prompts(token_ids, queries, references)


def prompt_indices_for_step(step: int, num_prompts: int, batch_size: int, seed: int) -> np.ndarray:
    """Each epoch is a fresh seeded permutation cut into full batches: each trained on once an epoch."""
    epoch, i = divmod(step, num_prompts // batch_size)
    permutation = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    return permutation[i * batch_size : (i + 1) * batch_size]


def left_pad(sequences: list[list[int]], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to `length`; the mask comes from the lengths, never from pad ids (Pythia's pad is its EOS)."""
    ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if seq:
            ids[row, length - len(seq) :] = torch.tensor(seq)
            mask[row, length - len(seq) :] = 1
    return ids, mask


def truncate_responses(responses: list[list[int]], length: int, eos_token_id: int, pad_token_id: int):
    """Pad completions to `length` and cut everything after the first EOS. Returns ids, mask (1 up to and
    including the first EOS) and whether each ended with EOS."""
    ids = torch.full((len(responses), length), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(responses):
        seq = seq[:length]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    lengths = torch.tensor([min(len(seq), length) for seq in responses])
    eos_index = torch.where(ids == eos_token_id, torch.arange(length), length).min(-1).values  # or `length`
    contain_eos = eos_index < lengths
    lengths = torch.where(contain_eos, eos_index + 1, lengths)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad_token_id), mask, contain_eos


class Batch(NamedTuple):
    """A row per completion: its prompt, left-padded, and itself, right-padded and cut after its first EOS."""

    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor  # 1 up to and including the first EOS
    contain_eos: torch.Tensor

    def rows(self, index) -> "Batch":
        return Batch(*(tensor[index] for tensor in self))

    def sequences(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Query + response: the ids and the attention mask a model reads."""
        ids = torch.cat([self.query_ids, self.response_ids], 1)
        return ids, torch.cat([self.query_mask, self.response_mask], 1)


def to_batch(prompts: list[list[int]], responses, repeat: int, args: Args, tokenizer, device):
    """Prompts (each repeated for its `repeat` consecutive completions) and completions as a Batch."""
    query_ids, query_mask = left_pad(prompts, args.max_prompt_length, tokenizer.pad_token_id)
    query_ids = query_ids.repeat_interleave(repeat, 0)
    query_mask = query_mask.repeat_interleave(repeat, 0)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    response_ids, response_mask, contain_eos = truncate_responses(responses, args.response_length, eos, pad)
    return Batch(*(t.to(device) for t in (query_ids, query_mask, response_ids, response_mask, contain_eos)))


# == Models: logprobs, rewards ===============================================================================
class Models(NamedTuple):
    """The frozen models and the tokenizers (no reward model where a verifier scores; only rank 0 holds a gold
    judge)."""

    tokenizer: object
    ref_policy: torch.nn.Module
    reward_model: torch.nn.Module | None
    reward_tokenizer: object | None
    gold_model: torch.nn.Module | None
    gold_tokenizer: object | None
    scorer: str = "the reward model"  # what scores the rollouts, as an error names it


def load_models(args: Args, inputs: Inputs, processes: plumbing.Processes) -> tuple[torch.nn.Module, Models]:
    """The policy and the frozen models (safetensors only), dropout off. The policy and the reference keep
    fp32 weights (the optimizer's, the policy's numbers at step 0) under autocast; the reward and gold models
    hold --dtype weights. Under ZeRO-3 every model is sharded but the gold judge, which only rank 0 holds.
    With LoRA (--lora_rank) only the policy's adapter trains, and the reference is the policy with it off:
    the same weights, no copy of its own (docs/algorithms.md#lora---lora_rank)."""
    remote = args.trust_remote_code
    safe = dict(use_safetensors=True)
    load = partial(AutoModelForCausalLM.from_pretrained, args.sft_model_path, dtype=torch.float32, **safe)
    policy = load(trust_remote_code=remote)
    ref_policy = None if args.lora_rank else load(trust_remote_code=remote)
    scoring = dict(dtype=processes.dtype, trust_remote_code=remote, **safe)
    reward_model = gold_model = gold_tokenizer = None
    scorer = f"--task {args.task}'s verifier"  # what scores the rollouts, as an error names it
    if TASKS[args.task].verifier is None:
        scorer = f"reward model --reward_model_path {args.reward_model_path}"
        reward_model = plumbing.load_reward_model(args.reward_model_path, "--reward_model_path", **scoring)
    if args.gold_judge != "tiny" and processes.is_main:
        with processes.whole_models():  # only rank 0 runs it: never sharded
            gold_model = plumbing.load_reward_model(args.gold_judge, "--gold_judge", **scoring)
        gold_model = gold_model.to(processes.accelerator.device).eval().requires_grad_(False)
        gold_tokenizer = AutoTokenizer.from_pretrained(args.gold_judge, trust_remote_code=remote)
    for model in (policy, ref_policy, reward_model, gold_model):
        if model is not None:
            disable_dropout(model)
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora_rank:
        policy = plumbing.add_adapter(policy, args)
        ref_policy = plumbing.AdapterOff(policy)
    else:
        ref_policy = processes.prepare_frozen(ref_policy)  # sharded for inference under ZeRO-3
    reward_model = None if reward_model is None else processes.prepare_frozen(reward_model)
    tokenizer, reward_tokenizer = inputs.tokenizer, inputs.reward_tokenizer
    return policy, Models(
        tokenizer, ref_policy, reward_model, reward_tokenizer, gold_model, gold_tokenizer, scorer
    )


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "attn_dropout", "hidden_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def position_ids_from(mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so left padding does not shift them (N details, general #3)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def response_logprobs(model, batch: Batch, temperature: float, entropy: bool = False):
    """Per-token logprobs of the responses, logits divided by the sampling temperature (N details, policy #1);
    0 after EOS; with `entropy`, also the entropy of pi(. | query, y_<t) (a diagnostic: no gradient). Only the
    logits that predict the response: over a 50k vocabulary the others would be the largest tensor."""
    ids, mask = batch.sequences()
    positions = position_ids_from(mask)
    keep = batch.response_ids.shape[1] + 1  # the logits of the last prompt token and the response's
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
    logits = logits[:, :-1].float() / temperature
    logprobs = logits.gather(2, batch.response_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    if not entropy:
        return logprobs * batch.response_mask
    with torch.no_grad():
        entropies = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
    return logprobs * batch.response_mask, entropies * batch.response_mask


@torch.no_grad()
def batch_logprobs(model, batch: Batch, temperature: float, batch_size: int) -> torch.Tensor:
    """Per-token logprobs of a batch's responses, in no-grad forward passes of `batch_size` sequences."""
    parts = [batch.rows(slice(i, i + batch_size)) for i in range(0, len(batch.query_ids), batch_size)]
    return torch.cat([response_logprobs(model, part, temperature) for part in parts])


def get_reward(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score at the last real token, from the backbone: padding on either side (and pad == EOS)
    cannot move the read-out position."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask))
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    head = model.score if hasattr(model, "score") else model.classifier
    rows = torch.arange(len(input_ids), device=input_ids.device)
    return head(hidden.last_hidden_state[rows, last]).squeeze(-1).float()


# == Rewards: the reward model, the missing-EOS penalty, a verifier ==========================================
@torch.no_grad()
def score_texts(model, tokenizer, texts: list[str], batch_size: int, device) -> torch.Tensor:
    """Score whole texts with a reward model that has a tokenizer of its own."""
    scores = []
    for start in range(0, len(texts), batch_size):
        encoded = [plumbing.encode_text(tokenizer, text) for text in texts[start : start + batch_size]]
        ids, mask = left_pad(encoded, max(len(ids) for ids in encoded), tokenizer.pad_token_id)
        scores.append(get_reward(model, ids.to(device), mask.to(device)))
    return torch.cat(scores)


@torch.no_grad()
def score_completions(reward_model, reward_tokenizer, policy_tokenizer, batch: Batch, bs: int):
    """Reward model on query + response. With another tokenizer, go through text: decode without special
    tokens, re-encode, and end with the reward model's EOS where the policy stopped."""
    ids, mask = batch.sequences()
    if plumbing.same_tokenizer(reward_tokenizer, policy_tokenizer):
        parts = range(0, len(ids), bs)
        return torch.cat([get_reward(reward_model, ids[i : i + bs], mask[i : i + bs]) for i in parts])
    real = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
    texts = policy_tokenizer.batch_decode(real, skip_special_tokens=True)
    stops = batch.contain_eos
    texts = [text + reward_tokenizer.eos_token if stopped else text for text, stopped in zip(texts, stops)]
    return score_texts(reward_model, reward_tokenizer, texts, bs, ids.device)


def apply_missing_eos_penalty(scores: torch.Tensor, contain_eos: torch.Tensor, penalty: float):
    """A completion that did not end with EOS within response_length gets a fixed score (tables 4, 7)."""
    return torch.where(contain_eos, scores, torch.full_like(scores, penalty))


def verify_completions(tokenizer, batch: Batch, answers: list[str], verifier: Callable) -> torch.Tensor:
    """A verifier's rewards of a batch (a Task's): each completion decoded without special tokens, checked
    against its reference answer."""
    ids = [r[m.bool()].tolist() for r, m in zip(batch.response_ids, batch.response_mask)]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    rewards = [verifier(text, answer) for text, answer in zip(texts, answers)]
    return torch.tensor(rewards, device=batch.response_ids.device)


def score_batch(batch: Batch, references: list[str], models: Models, args: Args) -> torch.Tensor:
    """Rewards of a batch: the task's verifier (no missing-EOS penalty: GSM8k's table 10 has none), or the
    reward model on query + response with the missing-EOS penalty."""
    if (verifier := TASKS[args.task].verifier) is not None:
        return verify_completions(models.tokenizer, batch, references, verifier)
    rm = models.reward_model, models.reward_tokenizer, models.tokenizer
    scores = score_completions(*rm, batch, args.local_rollout_forward_batch_size)
    return apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty)


# == Evaluation: the gold judge's win rate, the KL proxy =====================================================
def win_rates(policy_gold: list[float], reference_gold: list[float]) -> list[float]:
    """1 when the policy's completion beats the reference under the gold judge, 1/2 on a tie."""
    return [1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy_gold, reference_gold)]


@torch.no_grad()
def evaluate(responses: list[list[int]], evaluation: Prompts, models: Models, args: Args, device):
    """One evaluation (docs/metrics.md): the reference policy's perplexity on the completions, EOS included
    (the paper's KL proxy, section 3.1), their EOS rate and length; a verifier's pass@1, or the proxy RM's
    score and, with a gold judge, the win rate against the references. Returns the metrics, samples,
    completions."""
    task = TASKS[args.task]
    tokenizer = models.tokenizer
    bs = args.local_rollout_forward_batch_size
    queries, references = evaluation.queries, evaluation.references
    batch = to_batch(evaluation.token_ids, responses, 1, args, tokenizer, device)
    ids = [r[m.bool()].tolist() for r, m in zip(batch.response_ids, batch.response_mask)]
    texts = tokenizer.batch_decode(ids)  # with the EOS, as the judge reads it
    parts = [batch.rows(slice(i, i + bs)) for i in range(0, len(ids), bs)]
    metrics, extras = {}, {}
    if (task.judge is not None and args.gold_judge == "tiny") or models.gold_model is not None:
        if models.gold_model is None:
            policy_gold = [task.judge(q, t) for q, t in zip(queries, texts)]
            reference_gold = [task.judge(q, r) for q, r in zip(queries, references)]
        else:
            if task.references_stop:
                references = [r + tokenizer.eos_token for r in references]
            judge = models.gold_model, models.gold_tokenizer
            gold = partial(score_texts, *judge, batch_size=bs, device=device)
            policy_gold = gold([q + t for q, t in zip(queries, texts)]).tolist()
            reference_gold = gold([q + r for q, r in zip(queries, references)]).tolist()
        metrics["eval/gold_score"] = float(np.mean(policy_gold))
        metrics["eval/win_rate"] = float(np.mean(win_rates(policy_gold, reference_gold)))
        extras = {"gold": [round(g, 3) for g in policy_gold]}
        extras["reference_gold"] = [round(g, 3) for g in reference_gold]
    if task.verifier is not None:
        correct = verify_completions(tokenizer, batch, evaluation.references, task.verifier)
        metrics["eval/pass@1"] = correct.mean().item()
        extras = {"correct": correct.tolist()}
    logprobs = torch.cat([response_logprobs(models.ref_policy, part, temperature=1.0) for part in parts])
    perplexities = torch.exp(-logprobs.sum(1) / batch.response_mask.sum(1).clamp(min=1))
    metrics["eval/ref_perplexity"] = perplexities.mean().item()
    if models.reward_model is not None:
        reward_model = models.reward_model, models.reward_tokenizer, tokenizer
        scores = torch.cat([score_completions(*reward_model, part, bs) for part in parts])
        scores = apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty)
        metrics["eval/scores"] = scores.mean().item()
    metrics["eval/num_eos_tokens"] = batch.contain_eos.float().mean().item()
    metrics["eval/response_length"] = batch.response_mask.sum(1).float().mean().item()
    shown = enumerate(zip(queries[: args.num_sample_completions], texts, evaluation.references))
    rows = [
        dict(query=q, response=t, reference=r) | {k: v[i] for k, v in extras.items()}
        for i, (q, t, r) in shown
    ]
    return metrics, rows, tokenizer.batch_decode(ids, skip_special_tokens=True)


# == The async schedule: which policy version generates which batch (paper section 3) =======================
class Event(NamedTuple):
    kind: str  # "rollout" (the batch a step trains on) or "eval"
    index: int  # the step of a rollout, the policy version of an evaluation
    version: int  # the policy version the engine needs for it


class Rollout(NamedTuple):
    step: int
    version: int
    prompt_indices: np.ndarray
    responses: list[list[int]]  # the completions of each prompt, one after the other
    logprobs: list[list[float]] | None  # the engine's logprob of each response token (after temperature)
    # generation, weight_sync and generator_wait (idle, waiting for the weights it needs) -> (start, seconds)
    timings: dict[str, tuple[float | None, float]]
    # --inflight_updates: the policy version that sampled each token of each response (None: all `version`'s)
    token_versions: list[list[int]] | None = None


class EvalRollout(NamedTuple):
    version: int
    responses: list[list[int]]
    generation_time: float
    generation_start: float


def generation_schedule(num_steps: int, async_level: int, eval_steps: list[int]) -> list[Event]:
    """The generator's work in order. Rollout m is generated by version max(0, m - async_level); an evaluation
    of version v runs right after the last rollout that needs v, so the engine never goes back a version."""
    events = [Event("rollout", m, max(0, m - async_level)) for m in range(num_steps)]
    events += [Event("eval", v, v) for v in eval_steps]
    return sorted(events, key=lambda e: (e.version, e.kind == "eval", e.index))


def check_staleness(rollout: Rollout, step: int, async_level: int) -> dict[str, float]:
    """The staleness contract (paper section 3), checked at every step: step n trains on rollout n, which
    policy version max(0, n - k) started; with --inflight_updates every token of it was sampled by a version
    from there to n (later versions reach the engine between two segments), and the versions the batch spans
    are logged. Broken, the run stops."""
    oldest = max(0, step - async_level)
    if rollout.step != step or rollout.version != oldest:
        got = f"rollout {rollout.step} from policy version {rollout.version}"
        raise RuntimeError(f"async invariant broken: step {step} got {got}")
    if rollout.token_versions is None:
        return {}
    versions = [v for response in rollout.token_versions for v in response]
    if versions and not oldest <= min(versions) <= max(versions) <= step:
        spans = f"tokens of versions {min(versions)} to {max(versions)}"
        raise RuntimeError(f"async invariant broken: step {step} got {spans}, not {oldest} to {step}")
    return {
        "async/token_version_min": min(versions, default=oldest),
        "async/token_version_max": max(versions, default=oldest),
        "async/token_version_mean": float(np.mean(versions)) if versions else float(oldest),
    }


def published_versions(schedule: list[Event]) -> set[int]:
    """Versions the trainer must send to the engine (version 0 is loaded at start)."""
    return {event.version for event in schedule if event.version > 0}


def pending_events(schedule: list[Event], next_step: int, evals_logged: set[int]) -> list[Event]:
    """The generator's work still owed to a trainer about to run `next_step`: later rollouts and the
    evaluations not yet logged. The policy versions they need are the snapshots to keep, and a checkpoint's to
    carry."""
    return [
        e for e in schedule if (e.index >= next_step if e.kind == "rollout" else e.index not in evals_logged)
    ]


# == The generation thread: it drives the engine, one batch ahead of the trainer =============================
def generate(
    engine,
    call,
    prompts,
    n: int,
    temperature: float,
    max_tokens: int,
    eos: int,
    seeds,
    logprobs=False,
    salt=None,
):
    """n completions per prompt (and the engine's logprob of each token), the prompts cut among the engines
    (plumbing's Engine.generate), under the deadline of `call` (what it is, and its step or version); each
    prompt has its own sampling seed, so a batch is reproducible whatever the engine generated before and
    whichever engine generates it. `salt`: the prompts' prefix-cache salt (no KV cached under another salt is
    read for them)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = dict(temperature=temperature, max_tokens=max_tokens, stop_token_ids=[eos], detokenize=False)
    params = [SamplingParams(n=n, **sampling, seed=seed, logprobs=0 if logprobs else None) for seed in seeds]
    salted = {} if salt is None else {"cache_salt": salt}
    outputs = engine.generate([TokensPrompt(prompt_token_ids=p, **salted) for p in prompts], params, call)
    completions = [completion for output in outputs for completion in output.outputs]
    responses = [list(c.token_ids) for c in completions]
    if not logprobs:
        return responses, None
    return responses, [[at[t].logprob for t, at in zip(c.token_ids, c.logprobs)] for c in completions]


def load_version(engine, channel, version: int, event: Event, keep_cache: bool = False) -> tuple[int, dict]:
    """Loads each policy version up to the one `event` needs, as soon as the trainer publishes it, into
    every engine (keep_cache: their prefix cache stays, --inflight_kv keep); returns the version the engines
    hold, and the time spent waiting (generator_wait) and pushing (weight_sync: start and seconds)."""
    wait_start, sync_time, sync_start = time.perf_counter(), 0.0, None
    while version < event.version:
        weights = channel.get(channel.weights)
        push_start = time.perf_counter()
        sync_start = sync_start or push_start
        engine.push(weights, keep_cache)  # into every running engine, in place (plumbing/weights.py)
        sync_time += time.perf_counter() - push_start
        version = engine.version  # each engine proved it holds it (check_loaded)
    if version != event.version:
        raise RuntimeError(f"{event.kind} {event.index} needs version {event.version}, has {version}")
    now = time.perf_counter()
    return version, {
        "generator_wait": (None, now - wait_start - sync_time),
        "weight_sync": (sync_start or now, sync_time),
    }


def run_evaluation(engine, channel, version: int, inputs: Inputs, args: Args, salt=None) -> None:
    """The evaluation of policy version `version`, the engine's: one completion of each evaluation prompt
    (greedy where the task says so), sent to the trainer."""
    gen_start, prompts = time.perf_counter(), inputs.evaluation.token_ids
    seeds = [args.seed + i for i in range(len(prompts))]
    temperature = 0.0 if TASKS[args.task].eval_greedy else args.temperature
    sampling = (temperature, args.response_length, inputs.tokenizer.eos_token_id, seeds)
    responses, _ = generate(engine, ("evaluation", version), prompts, 1, *sampling, salt=salt)
    channel.evals.put(EvalRollout(version, responses, time.perf_counter() - gen_start, gen_start))


def rollout_prompts(step: int, inputs: Inputs, args: Args, sizes: Sizes) -> tuple[np.ndarray, list[int]]:
    """Rollout `step`'s prompts (their indices in the training split) and each one's sampling seed."""
    indices = prompt_indices_for_step(step, len(inputs.train.token_ids), sizes.batch_size, args.seed)
    return indices, [args.seed * 1_000_003 + step * sizes.batch_size + i for i in range(len(indices))]


def generation_thread(engine, channel, schedule: list[Event], inputs: Inputs, args: Args, sizes):
    """Works through the schedule: loads each policy version it needs as soon as the trainer publishes it,
    then generates rollout m (the completions of each prompt of step m's batch) or evaluates version v.
    Cleanba's protocol: it and the trainer exchange version-tagged messages through plumbing's Channel,
    policy versions one way (channel.weights), Rollout and EvalRollout the other (channel.rollouts,
    channel.evals). Rank 0 runs it (Channel.run_thread: an exception here stops the trainer); the trainer
    stops the run if a call to the engine (a push, a generation) passes its deadline."""
    version, eos, train = 0, inputs.tokenizer.eos_token_id, inputs.train.token_ids
    for event in schedule:
        version, timings = load_version(engine, channel, version, event)
        if event.kind == "eval":
            run_evaluation(engine, channel, version, inputs, args)
            continue
        gen_start = time.perf_counter()
        indices, seeds = rollout_prompts(event.index, inputs, args, sizes)
        prompts, n = [train[i] for i in indices], completions_per_prompt(args)
        sampling = (args.temperature, args.response_length, eos, seeds, ROLLOUT_LOGPROBS)
        responses, logprobs = generate(engine, ("rollout", event.index), prompts, n, *sampling)
        timings |= {"generation": (gen_start, time.perf_counter() - gen_start)}
        channel.rollouts.put(Rollout(event.index, version, indices, responses, logprobs, timings))


# == In-flight weight updates (--inflight_updates): new policy versions between two segments of tokens =======
class InFlight(NamedTuple):
    """A rollout the engine is decoding, not yet delivered to the trainer."""

    step: int
    version: int  # the policy version the engine held when it joined: max(0, step - k)
    prompt_indices: np.ndarray
    sequences: list  # plumbing's Sequence, a completion each, those of each prompt one after the other
    timings: dict[str, tuple[float | None, float]]  # as Rollout's; generation from its start


def may_start(event: Event, in_flight: list[InFlight], decoding: int, args: Args, sizes: Sizes) -> bool:
    """Whether the generator takes up `event`, the schedule's next, beside the rollouts `in_flight` (with
    `decoding` sequences not yet done). Its version, if new, may be waited for only once every rollout
    before it was delivered: the trainer publishes version v after training on rollout v - 1. A rollout
    joins when fewer than a batch's sequences are decoding: the engine decodes the next batch beside the
    longest completions of the last. One at a checkpoint step (every --save_freq) starts alone, on an empty
    prefix cache, as it does after --resume from that checkpoint: the resumed run decodes what the
    uninterrupted one did."""
    if any(flight.step < event.version for flight in in_flight):
        return False
    if event.kind == "eval":
        return True
    if args.save_freq and event.index % args.save_freq == 0:
        return not in_flight
    return decoding < sizes.batch_size * completions_per_prompt(args)


def inflight_generation_thread(engine, channel, schedule: list[Event], inputs: Inputs, args: Args, sizes):
    """generation_thread's work with --inflight_updates (docs/algorithms.md#in-flight-weight-updates): the
    rollouts in flight decode --inflight_segment_tokens tokens at a time (plumbing's decode_segment), each
    completion a sequence of its own, and between two segments the schedule's next events start (may_start):
    an evaluation, or a rollout, which first loads its version max(0, m - k), the sequences in flight keeping
    their KV (--inflight_kv keep) or not. Every token records the version that sampled it and the engine's
    logprob of it; a rollout is delivered, in order, once all its sequences are done. Where each version
    begins in each sequence depends on the run alone, never on the clock."""
    version, eos, train = 0, inputs.tokenizer.eos_token_id, inputs.train.token_ids
    K, keep = completions_per_prompt(args), args.inflight_kv == "keep"
    events, in_flight = list(schedule), []
    while events or in_flight:
        decoding = sum(not sequence.done for flight in in_flight for sequence in flight.sequences)
        while events and may_start(events[0], in_flight, decoding, args, sizes):
            event = events.pop(0)
            version, timings = load_version(engine, channel, version, event, keep_cache=keep)
            if event.kind == "eval":  # salted by its version: it reads no KV another version computed
                run_evaluation(engine, channel, version, inputs, args, salt=f"e{version}")
                continue
            if not in_flight:  # it starts on an empty cache, as after --resume
                engine.reset_prefix_cache()
            indices, seeds = rollout_prompts(event.index, inputs, args, sizes)
            salt, length = f"r{event.index}", args.response_length  # its sequences read only its own KV
            sequences = [
                plumbing.Sequence(train[i], seed * K + j, length, salt)
                for i, seed in zip(indices, seeds)
                for j in range(K)
            ]
            timings |= {"generation": (time.perf_counter(), 0.0)}
            in_flight.append(InFlight(event.index, version, indices, sequences, timings))
            decoding += len(sequences)
        if not in_flight:  # the schedule ended with evaluations
            continue
        sequences = [sequence for flight in in_flight for sequence in flight.sequences]
        call = ("segment", in_flight[0].step)
        plumbing.decode_segment(
            engine, sequences, args.inflight_segment_tokens, version, args.temperature, eos, call
        )
        while in_flight and all(sequence.done for sequence in in_flight[0].sequences):
            flight = in_flight.pop(0)
            gen_start = flight.timings["generation"][0]
            timings = flight.timings | {"generation": (gen_start, time.perf_counter() - gen_start)}
            responses, versions = [s.tokens for s in flight.sequences], [s.versions for s in flight.sequences]
            logprobs = [s.logprobs for s in flight.sequences] if ROLLOUT_LOGPROBS else None
            sampled = (responses, logprobs, timings, versions)
            channel.rollouts.put(Rollout(flight.step, flight.version, flight.prompt_indices, *sampled))


if __name__ == "__main__":
    plumbing.run(main, Args, __doc__)
