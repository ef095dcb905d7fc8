"""Mutation check of the method functions of the three algorithm files (docs/tests.md#mutation-check): a curated list
of realistic bugs, each applied in turn to a scratch copy of the repository, and the fast tier's unit tests that can
see it run against it; a mutant is killed when they fail. Prints a table, the survivors and the score.

    python dev/mutation_check.py                       # every mutant, one worker per core
    python dev/mutation_check.py --file rloo_async.py  # the mutants that touch one file
    python dev/mutation_check.py --only D04 P48        # a few, by id
    python dev/mutation_check.py --list                # the mutants, nothing run

A script, not a test module (pytest collects test_*.py only); tests/test_mutation_check.py checks the list itself.
The same machinery checks the plumbing and the run plan's arithmetic: dev/mutation_check_plumbing.py (a Suite).
"""

import argparse
import ast
import functools
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DPO, RLOO, PPO = "online_dpo_async.py", "rloo_async.py", "ppo_async.py"
FILES = (DPO, RLOO, PPO)
SHARED = "shared"  # a function all three files hold, the same text in each (tests/test_shared_code.py)
MODULE = "<module>"  # a mutant of a file's module-level code (a constant): its fragment occurs once in the whole file


class Mutant(NamedTuple):
    id: str
    file: str  # DPO, RLOO, PPO or SHARED; another suite's: the file's path (plumbing/weights.py)
    function: str  # the top-level function or class the fragment lies in, or MODULE
    original: str  # occurs exactly once in the function's source
    replacement: str
    note: str  # the bug it stands for
    equivalent: str = ""  # why it cannot change what the function returns: left out of the score


# The method functions: the algorithms' math and the code that connects it. Every one has a mutant below
# (tests/test_mutation_check.py); main() is left to the whole runs.
METHOD_FUNCTIONS = {
    SHARED: [
        "compute_sizes",
        "lr_factor",
        "make_optimizer",
        "prompt_indices_for_step",
        "left_pad",
        "truncate_responses",
        "Batch",
        "position_ids_from",
        "response_logprobs",
        "get_reward",
        "score_completions",
        "apply_missing_eos_penalty",
        "gsm8k_answer",
        "gsm8k_reward",
        "gsm8k_prompts",
        "chat_prompts",
        "query_prompts",
        "load_prompts",
        "verify_completions",
        "score_batch",
        "tiny_gold_score",
        "win_rates",
        "evaluate",
        "generation_schedule",
        "pending_events",
    ],
    DPO: ["select_chosen_rejected", "preference_pairs", "dpo_loss", "dpo_batch_loss", "dpo_update", "dpo_metrics"],
    RLOO: [
        "pad_logprobs",
        "sequence_rewards",
        "check_loss_flags",
        "rloo_advantages",
        "group_advantages",
        "whiten",
        "truncated_is_weights",
        "check_correction_flags",
        "correction_weights",
        "loss_setting",
        "proximal_rloo_loss",
        "prime_rl_loss",
        "grpo_loss",
        "rloo_targets",
        "rloo_update",
        "rloo_metrics",
    ],
    PPO: [
        "masked_mean",
        "masked_var",
        "masked_whiten",
        "response_values",
        "PolicyAndValue",
        "per_token_rewards",
        "gae_advantages",
        "ppo_policy_loss",
        "ppo_value_loss",
        "explained_variance",
        "adaptive_kl_coef",
        "KLCoefficient",
        "Targets",
        "ppo_targets",
        "old_logprobs_and_values",
        "ppo_update",
        "ppo_metrics",
    ],
}

# A table, one mutant to a line or two: left as laid out (the formatter would spread each over eight lines).
# fmt: off
MUTANTS = [
    # -------- shared: applied to the copy in each of the three files
    Mutant("S01", SHARED, "compute_sizes", "local_batch_size = local_mini_batch_size * args.num_mini_batches",
           "local_batch_size = local_mini_batch_size", "--num_mini_batches left out of the batch"),
    Mutant("S02", SHARED, "compute_sizes", "episodes_per_step = local_batch_size * world_size * samples",
           "episodes_per_step = local_batch_size * samples", "the processes left out of the episodes per step"),
    Mutant("S03", SHARED, "compute_sizes", "args.total_episodes < episodes_per_step",
           "args.total_episodes <= episodes_per_step", "< vs <=: a run of exactly one step refused"),
    Mutant("S04", SHARED, "make_optimizer", '"bias" not in name and ', "", "the biases decay"),
    Mutant("S05", SHARED, "compute_sizes", "local_mini_batch_size * world_size,", "local_mini_batch_size,",
           "mini_batch_size without the processes"),
    Mutant("S06", SHARED, "compute_sizes", "num_steps=args.total_episodes // episodes_per_step",
           "num_steps=args.total_episodes // (local_batch_size * world_size)",
           "steps counted in prompts, not completions"),
    Mutant("S07", SHARED, "compute_sizes", "args.total_episodes % episodes_per_step != 0 or ", "",
           "the divisibility check dropped"),
    Mutant("S08", SHARED, "lr_factor", "1.0 - (step + 1) / num_steps", "1.0 - step / num_steps",
           "off by one: the schedule stepped after each step, not before"),
    Mutant("S09", SHARED, "lr_factor", 'schedule == "constant"', 'schedule == "linear"', "the schedules swapped"),
    Mutant("S10", SHARED, "prompt_indices_for_step", "divmod(step, num_prompts // batch_size)",
           "divmod(step, num_prompts)", "an epoch counted in prompts, not batches"),
    Mutant("S11", SHARED, "prompt_indices_for_step", "default_rng([seed, epoch])", "default_rng(seed)",
           "the same prompt order every epoch"),
    Mutant("S12", SHARED, "prompt_indices_for_step", "permutation[i * batch_size : (i + 1) * batch_size]",
           "permutation[i : i + batch_size]", "overlapping batches"),
    Mutant("S13", SHARED, "left_pad", "ids[row, length - len(seq) :] = torch.tensor(seq)",
           "ids[row, : len(seq)] = torch.tensor(seq)", "right-padded ids under a left-padded mask"),
    Mutant("S14", SHARED, "left_pad", "mask[row, length - len(seq) :] = 1", "mask[row, length - len(seq) - 1 :] = 1",
           "off by one: the mask one token too long"),
    Mutant("S15", SHARED, "left_pad", "if seq:", "if True:", "the guard for an empty sequence dropped",
           equivalent="an empty sequence writes an empty tensor into an empty slice: nothing changes"),
    Mutant("S16", SHARED, "truncate_responses", ".min(-1).values", ".max(-1).values", "min vs max: not the first EOS"),
    Mutant("S17", SHARED, "truncate_responses", "torch.arange(length), length)", "torch.arange(length), length - 1)",
           "off by one: a row without EOS reads as EOS at its last index"),
    Mutant("S18", SHARED, "truncate_responses", "contain_eos = eos_index < lengths",
           "contain_eos = eos_index <= lengths", "< vs <=: a full-length completion without EOS counts as stopped"),
    Mutant("S19", SHARED, "truncate_responses", "torch.where(contain_eos, eos_index + 1, lengths)",
           "torch.where(contain_eos, eos_index, lengths)", "the EOS left out of the mask"),
    Mutant("S20", SHARED, "truncate_responses", "torch.arange(length)[None, :] < lengths[:, None]",
           "torch.arange(length)[None, :] <= lengths[:, None]", "< vs <=: the mask one token too long"),
    Mutant("S21", SHARED, "truncate_responses", "return ids.masked_fill(mask == 0, pad_token_id), mask, contain_eos",
           "return ids, mask, contain_eos", "the tokens after EOS kept"),
    Mutant("S22", SHARED, "truncate_responses", "min(len(seq), length)", "len(seq)",
           "lengths not cut at response_length"),
    Mutant("S23", SHARED, "position_ids_from", "(mask.cumsum(1) - 1).clamp(min=0)", "mask.cumsum(1).clamp(min=0)",
           "off by one: positions start at 1"),
    Mutant("S24", SHARED, "position_ids_from", "mask.cumsum(1)", "mask.cumsum(0)", "cumsum over the wrong dim"),
    Mutant("S25", SHARED, "response_logprobs", "logits = logits[:, :-1].float()", "logits = logits[:, 1:].float()",
           "logits shifted the wrong way"),
    Mutant("S26", SHARED, "response_logprobs", "logits[:, :-1].float() / temperature", "logits[:, :-1].float()",
           "the temperature dropped"),
    Mutant("S27", SHARED, "response_logprobs", ".squeeze(-1) - logits.logsumexp(-1)", ".squeeze(-1)",
           "the normaliser dropped: logits, not logprobs"),
    Mutant("S28", SHARED, "response_logprobs", "if not entropy:\n        return logprobs * batch.response_mask",
           "if not entropy:\n        return logprobs", "the tokens after EOS kept"),
    Mutant("S29", SHARED, "Batch", "torch.cat([self.query_mask, self.response_mask], 1)",
           "torch.cat([self.query_mask, torch.ones_like(self.response_mask)], 1)",
           "the padding after EOS read: by the policy (harmless, causal attention) and by the reward model (its score "
           "read at the last padding token)"),
    Mutant("S30", SHARED, "get_reward", "last = mask.shape[1] - 1 - mask.flip(1).argmax(1)", "last = mask.sum(1) - 1",
           "the read-out position assumes right padding"),
    Mutant("S31", SHARED, "get_reward", "hidden.last_hidden_state[rows, last]",
           "hidden.last_hidden_state[:, -1]", "the score read at the last position, padding or not"),
    Mutant("S32", SHARED, "get_reward", "attention_mask=mask, position_ids=position_ids_from(mask))",
           "attention_mask=mask)", "positions shifted by the left padding"),
    Mutant("S33", SHARED, "score_completions", "text + reward_tokenizer.eos_token if stopped else text", "text",
           "through text, the EOS of a completion that stopped is not re-added"),
    Mutant("S34", SHARED, "score_completions", "if stopped else text", "if not stopped else text",
           "the EOS added to the completions that did not stop"),
    Mutant("S35", SHARED, "score_completions", "if plumbing.same_tokenizer(reward_tokenizer, policy_tokenizer):",
           "if True:", "the policy's ids fed to a reward model with another tokenizer"),
    Mutant("S36", SHARED, "apply_missing_eos_penalty",
           "torch.where(contain_eos, scores, torch.full_like(scores, penalty))",
           "torch.where(contain_eos, torch.full_like(scores, penalty), scores)",
           "the penalty given to the completions that stopped"),
    Mutant("S37", SHARED, "apply_missing_eos_penalty", "torch.full_like(scores, penalty)", "scores + penalty",
           "the penalty added to the score, not replacing it"),
    Mutant("S38", SHARED, "gsm8k_answer", 'match.group(1).replace(",", "")', "match.group(1)",
           'commas kept: "1,020" is not "1020"'),
    Mutant("S39", SHARED, "gsm8k_answer", "match.group(1)", "match.group(0)", 'the whole match read, "#### " included'),
    Mutant("S40", SHARED, "gsm8k_reward", "predicted is not None and predicted == gsm8k_answer(answer)",
           "predicted == gsm8k_answer(answer)", "two missing answers count as equal"),
    Mutant("S41", SHARED, "gsm8k_reward", "predicted == gsm8k_answer(answer)", "predicted == answer",
           "the answer compared with the whole label"),
    Mutant("S42", SHARED, "score_batch",
           "return apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty)", "return scores",
           "the missing-EOS penalty dropped"),
    Mutant("S43", SHARED, "score_batch", "rm = models.reward_model, models.reward_tokenizer, models.tokenizer",
           "rm = models.reward_model, models.tokenizer, models.tokenizer",
           "the policy's tokenizer taken for the reward model's"),
    Mutant("S44", SHARED, "score_batch", "scores, batch.contain_eos, args.missing_eos_penalty",
           "scores, ~batch.contain_eos, args.missing_eos_penalty", "the penalty given to the completions that stopped"),
    Mutant("S45", SHARED, "score_batch", "return verify_completions(models.tokenizer, batch, references, verifier)",
           "return apply_missing_eos_penalty(verify_completions(models.tokenizer, batch, references, verifier), "
           "batch.contain_eos, args.missing_eos_penalty)", "GSM8k's rewards penalised without EOS (table 10: none)"),
    Mutant("S46", SHARED, "evaluate", "torch.exp(-logprobs.sum(1) / batch.response_mask.sum(1).clamp(min=1))",
           "torch.exp(-logprobs.mean(1))", "the perplexity averaged over the padded length"),
    Mutant("S47", SHARED, "tiny_gold_score", "query.split()[1:-1]", "query.split()[1:]",
           'the query\'s "->" read as a word'),
    Mutant("S48", SHARED, "tiny_gold_score", 'stopped = len(out) > 0 and out[-1] == "</s>"',
           'stopped = out[-1] == "</s>"', "the guard for an empty completion dropped"),
    Mutant("S49", SHARED, "tiny_gold_score", "sum(a == b for a, b in zip(out, target)) / len(target)",
           "sum(a == b for a, b in zip(out, target)) / max(len(out), 1)",
           "the in-place share over the output, not the target"),
    Mutant("S50", SHARED, "tiny_gold_score", "sum(a < b for a, b in zip(out, out[1:]))",
           "sum(a <= b for a, b in zip(out, out[1:]))", "< vs <=: repeated words count as ordered"),
    Mutant("S51", SHARED, "tiny_gold_score", "2 * q - 1 if stopped else q - 1", "2 * q - 1 if stopped else q",
           "a completion that did not stop not shifted down"),
    Mutant("S52", SHARED, "win_rates", "1.0 if p > r", "1.0 if p >= r", "> vs >=: a tie counts as a win"),
    Mutant("S53", SHARED, "win_rates", "zip(policy_gold, reference_gold)", "zip(reference_gold, policy_gold)",
           "the reference's win rate"),
    Mutant("S54", SHARED, "evaluate", "reference_gold = [task.judge(q, r) for q, r in zip(queries, references)]",
           "reference_gold = [task.judge(q, t) for q, t in zip(queries, texts)]",
           "copy-paste: the references scored on the policy's completions"),
    Mutant("S55", SHARED, "evaluate", "win_rates(policy_gold, reference_gold)",
           "win_rates(reference_gold, policy_gold)", "the reference's win rate logged"),
    Mutant("S56", SHARED, "evaluate", "references = [r + tokenizer.eos_token for r in references]",
           "references = list(references)", "No Robots' human answers judged without EOS"),
    Mutant("S57", SHARED, "evaluate", 'metrics["eval/pass@1"] = correct.mean().item()',
           'metrics["eval/pass@1"] = correct.sum().item()', "pass@1 a count, not a rate"),
    Mutant("S58", SHARED, "evaluate", "texts = tokenizer.batch_decode(ids)",
           "texts = tokenizer.batch_decode(ids, skip_special_tokens=True)",
           "the judge reads the completions without their EOS"),
    Mutant("S59", SHARED, "evaluate",
           "scores = apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty)",
           "scores = scores", "eval/scores without the missing-EOS penalty"),
    Mutant("S60", SHARED, "evaluate", 'metrics["eval/num_eos_tokens"] = batch.contain_eos.float()',
           'metrics["eval/num_eos_tokens"] = (~batch.contain_eos).float()', "the share of completions without EOS"),
    Mutant("S61", SHARED, "evaluate", "batch.response_mask.sum(1).float().mean().item()",
           "batch.response_mask.float().mean().item()", "the length as a share of response_length"),
    Mutant("S62", SHARED, "generation_schedule", '("rollout", m, max(0, m - async_level))',
           '("rollout", m, max(0, m - async_level - 1))', "off by one: one version staler than --async_level"),
    Mutant("S63", SHARED, "generation_schedule", 'e.kind == "eval"', 'e.kind != "eval"',
           "an evaluation before the rollouts of its version"),
    Mutant("S64", SHARED, "generation_schedule", 'key=lambda e: (e.version, e.kind == "eval", e.index)',
           "key=lambda e: (e.index, e.version)", "sorted by index, not by version"),
    Mutant("S65", SHARED, "pending_events", "e.index >= next_step", "e.index > next_step",
           ">= vs >: the next step's rollout not owed"),
    Mutant("S66", SHARED, "pending_events", "e.index not in evals_logged", "e.index in evals_logged",
           "the logged evaluations owed, not the others"),
    # the tasks' table (issue 50): a row's settings and the functions it names
    Mutant("S80", SHARED, "gsm8k_prompts", "GSM8K_PROMPT.format(question=question)", "question",
           "GSM8k's question without the policy's prompt format"),
    Mutant("S81", SHARED, "chat_prompts", "apply_chat_template(messages[:-1]", "apply_chat_template(messages",
           "the reference answer left in the chat prompt"),
    Mutant("S82", SHARED, "query_prompts", 'list(dataset["reference_response"])', 'list(dataset["query"])',
           "the queries taken for the references"),
    Mutant("S83", SHARED, "load_prompts", "add_special_tokens=not task.chat", "add_special_tokens=True",
           "chat prompts encoded with a second BOS"),
    Mutant("S85", SHARED, "verify_completions", "verifier(text, answer)", "verifier(answer, text)",
           "the verifier's arguments swapped: the label checked against the completion",
           equivalent="GSM8k's verifier compares the two final answers as strings, which is symmetric, and every "
           "label has one (gsm8k_prompts refuses the others)"),
    Mutant("S76", SHARED, "Batch", "Batch(*(tensor[index] for tensor in self))",
           "Batch(*(tensor[index] for tensor in self[:4]), self.contain_eos)",
           "a selection of rows that keeps every completion's EOS flag"),
    Mutant("S67", SHARED, "make_optimizer", ' and name.rpartition(".")[0] not in norms', "",
           "the normalisation layers' weights decay"),
    Mutant("S68", SHARED, "make_optimizer", '"weight_decay": args.weight_decay}', '"weight_decay": 0.01}',
           "torch's default decay, not --weight_decay"),
    # -------- online_dpo_async.py
    Mutant("D01", DPO, "select_chosen_rejected", "chosen = scores.argmax(1)", "chosen = scores.argmin(1)",
           "the worst completion chosen"),
    Mutant("D02", DPO, "select_chosen_rejected", "scores.shape[1] - 1 - scores.flip(1).argmin(1)", "scores.argmin(1)",
           "the first lowest rejected: the chosen one when all K tie"),
    Mutant("D03", DPO, "select_chosen_rejected", "scores.max(1).values == scores.min(1).values", "chosen == rejected",
           "no pair ever tied"),
    Mutant("D04", DPO, "preference_pairs", "torch.cat([first + chosen, first + rejected])",
           "torch.cat([first + rejected, first + chosen])", "chosen and rejected swapped"),
    Mutant("D05", DPO, "preference_pairs", "first = torch.arange(len(tied), device=scores.device) * K",
           "first = torch.arange(len(tied), device=scores.device)", "each prompt's first completion at row i, not i K"),
    Mutant("D06", DPO, "preference_pairs", "scores.view(-1, K)", "scores.view(K, -1).T",
           "a prompt's completions read strided, not one after the other"),
    Mutant("D07", DPO, "dpo_loss", "(chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)",
           "(chosen_logps - ref_chosen_logps) + (rejected_logps - ref_rejected_logps)", "flipped sign: h a sum"),
    Mutant("D08", DPO, "dpo_loss", "(chosen_logps - ref_chosen_logps)", "(chosen_logps - ref_rejected_logps)",
           "the rejected completion's reference logprob for the chosen one"),
    Mutant("D09", DPO, "dpo_loss", "return -F.logsigmoid(beta * h)", "return F.logsigmoid(beta * h)",
           "flipped sign: learns to prefer the rejected"),
    Mutant("D10", DPO, "dpo_loss", "F.logsigmoid(beta * h)", "F.logsigmoid(h)", "beta dropped from the sigmoid loss"),
    Mutant("D11", DPO, "dpo_loss", "(h - 1 / (2 * beta)) ** 2", "(h - 1 / 2 * beta) ** 2",
           "precedence: IPO's target beta / 2, not 1 / (2 beta)"),
    Mutant("D12", DPO, "dpo_batch_loss", "(~tied).float()", "tied.float()", "only the tied pairs trained on"),
    Mutant("D13", DPO, "dpo_batch_loss", ".sum() / len(per_pair)", ".sum() / (~tied).sum().clamp(min=1)",
           "divided by the untied pairs (docs/algorithms.md says why not)"),
    Mutant("D14", DPO, "dpo_batch_loss", ".sum() / len(per_pair)", ".mean()", "the mean written out",
           equivalent="the mean is the sum over all pairs divided by their number"),
    Mutant("D15", DPO, "dpo_update", "pairs.rows(torch.cat([idx, idx + B]))", "pairs.rows(torch.cat([idx, idx]))",
           "the chosen completions read twice, the rejected never"),
    Mutant("D16", DPO, "dpo_update", "ref_c, ref_r = ref_logps[idx], ref_logps[idx + B]",
           "ref_c, ref_r = ref_logps[idx + B], ref_logps[idx]",
           "the reference logprobs of chosen and rejected swapped"),
    Mutant("D17", DPO, "dpo_update", "logps_c, logps_r = logps.sum(1).chunk(2)",
           "logps_r, logps_c = logps.sum(1).chunk(2)", "the policy's logprobs of chosen and rejected swapped"),
    Mutant("D18", DPO, "dpo_update", "logps.sum(1).chunk(2)", "logps.mean(1).chunk(2)",
           "the per-token mean, not the sequence logprob"),
    Mutant("D19", DPO, "dpo_update", "per_pair = -logps_c / pairs.response_mask[idx].sum(1).clamp(min=1)",
           "per_pair = -logps_c", "best-of-K SFT not normalised by the length"),
    Mutant("D20", DPO, "dpo_update", "pairs.response_mask[idx].sum(1)", "pairs.response_mask[idx + B].sum(1)",
           "best-of-K SFT normalised by the rejected completion's length"),
    Mutant("D21", DPO, "dpo_update", "loss = dpo_batch_loss(per_pair, tied[idx])", "loss = per_pair.mean()",
           "the tied pairs trained on"),
    Mutant("D22", DPO, "dpo_update", "range(mini_start, mini_start + mini, micro)",
           "range(mini_start, mini_start + mini - 1, micro)",
           "off by one: with micro-batches of one pair the last is skipped"),
    Mutant("D23", DPO, "dpo_update", "optimizer.zero_grad()", "pass", "the gradients carried into the next update"),
    Mutant("D24", DPO, "dpo_update", "if accelerator.sync_gradients and args.max_grad_norm",
           "if args.max_grad_norm", "the gradient clipped every micro-batch, before it is whole"),
    Mutant("D25", DPO, "dpo_update", "for epoch in range(args.num_ppo_epochs):", "for epoch in range(1):",
           "--num_ppo_epochs ignored"),
    Mutant("D26", DPO, "dpo_update", "shuffle.permutation(B)", "np.arange(B)", "the pairs never shuffled"),
    Mutant("D27", DPO, "dpo_update", "margin = args.beta * ((logps_c - ref_c) - (logps_r - ref_r))",
           "margin = args.beta * ((logps_c - ref_c) + (logps_r - ref_r))",
           "flipped sign in the margin (and the accuracy)"),
    Mutant("D28", DPO, "dpo_update", "(logps_r - ref_r)).detach().mean() / 2", "(logps_r - ref_r)).detach().mean()",
           "the KL of a pair, not of a completion"),
    Mutant("D29", DPO, "dpo_update", "if epoch == 0:", "if True:", "KL and entropy of the policy the update moved too"),
    Mutant("D30", DPO, "dpo_metrics", '"episode": (step + 1) * sizes.episodes_per_step',
           '"episode": step * sizes.episodes_per_step', "off by one: the episodes before this step"),
    Mutant("D31", DPO, "dpo_metrics", '"objective/non_score_reward": -beta * reduced["kl"]',
           '"objective/non_score_reward": beta * reduced["kl"]', "flipped sign"),
    Mutant("D32", DPO, "dpo_metrics", 'reduced["scores"] - beta * reduced["kl"]',
           'reduced["scores"] + beta * reduced["kl"]', "flipped sign in the RLHF reward"),
    Mutant("D33", DPO, "dpo_metrics", '"async/lag": step - version', '"async/lag": version - step', "flipped sign"),
    Mutant("D34", DPO, "dpo_metrics", '"logps/chosen": reduced["logps_chosen"]',
           '"logps/chosen": reduced["logps_rejected"]', "chosen and rejected swapped"),
    Mutant("D35", DPO, "dpo_update", "accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)", "pass",
           "--max_grad_norm ignored"),
    # -------- rloo_async.py (truncated_is_weights and pad_logprobs: ppo_async.py's copies too)
    Mutant("R01", RLOO, "pad_logprobs", "return out.to(batch.response_mask.device) * batch.response_mask",
           "return out.to(batch.response_mask.device)", "the engine's logprobs after EOS kept"),
    Mutant("R02", RLOO, "pad_logprobs", "seq = seq[: out.shape[1]]", "seq = seq[: out.shape[1] - 1]",
           "off by one: the last token's logprob dropped"),
    Mutant("R03", RLOO, "sequence_rewards", "scores - kl_coef * kl", "scores + kl_coef * kl",
           "flipped sign: the KL rewarded"),
    Mutant("R04", RLOO, "sequence_rewards", "(logprobs - ref_logprobs)", "(ref_logprobs - logprobs)",
           "flipped sign of the KL"),
    Mutant("R05", RLOO, "sequence_rewards", "* response_mask).sum(1)", "* response_mask).mean(1)",
           "the KL per token, not per sequence"),
    Mutant("R06", RLOO, "rloo_advantages", "/ (rewards.shape[1] - 1)", "/ rewards.shape[1]",
           "off by one: the baseline divided by k, not k - 1"),
    Mutant("R07", RLOO, "rloo_advantages", "rewards.sum(1, keepdim=True)", "rewards.sum(0, keepdim=True)",
           "the baseline summed over prompts: wrong dim"),
    Mutant("R08", RLOO, "rloo_advantages", "return rewards - baseline", "return baseline - rewards", "flipped sign"),
    Mutant("R09", RLOO, "rloo_advantages", "(rewards.sum(1, keepdim=True) - rewards)", "rewards.sum(1, keepdim=True)",
           "the completion's own reward not left out"),
    Mutant("R10", RLOO, "whiten", "values.std() + eps", "values.var() + eps", "divided by the variance"),
    Mutant("R11", RLOO, "whiten", "(values - values.mean())", "values", "not centred"),
    Mutant("R12", RLOO, "truncated_is_weights", ".clamp(max=cap)", ".clamp(min=cap)",
           "min vs max: every weight at least the cap"),
    Mutant("R13", RLOO, "truncated_is_weights", "torch.exp(old_logps - engine_logps)",
           "torch.exp(engine_logps - old_logps)", "the inverse ratio mu / pi_old"),
    Mutant("R14", RLOO, "proximal_rloo_loss", "ratio = torch.exp(logps - old_logps)",
           "ratio = torch.exp(old_logps - logps)", "the inverse ratio"),
    Mutant("R15", RLOO, "proximal_rloo_loss", "ratio.clamp(1 - cliprange, 1 + cliprange)",
           "ratio.clamp(max=1 + cliprange)", "the lower clip dropped"),
    Mutant("R16", RLOO, "proximal_rloo_loss", "torch.min(unclipped, clipped)", "torch.max(unclipped, clipped)",
           "min vs max: the optimistic bound"),
    Mutant("R17", RLOO, "proximal_rloo_loss", "return -objective.mean()", "return objective.mean()",
           "flipped sign: the objective minimised"),
    Mutant("R18", RLOO, "proximal_rloo_loss", "objective = objective * is_weights", "objective = objective",
           "the importance weights ignored"),
    Mutant("R19", RLOO, "proximal_rloo_loss", "(clipped < unclipped)", "(clipped > unclipped)",
           "clipfrac counts the wrong side"),
    Mutant("R20", RLOO, "rloo_targets", "rlhf_reward.view(-1, args.rloo_k)", "rlhf_reward.view(args.rloo_k, -1).T",
           "a prompt's completions read strided, not one after the other"),
    Mutant("R21", RLOO, "rloo_targets", "sequence_rewards(scores, old_logprobs, ref_logprobs",
           "sequence_rewards(scores, engine_logprobs, ref_logprobs", "the KL from the engine's logprobs"),
    Mutant("R22", RLOO, "rloo_targets", "if args.normalize_advantage:", "if not args.normalize_advantage:",
           "--normalize_advantage inverted"),
    Mutant("R23", RLOO, "correction_weights", "truncated_is_weights(log_old, log_mu, args.tis_cap)",
           "truncated_is_weights(log_mu, log_old, args.tis_cap)", "the arguments swapped: the inverse weights"),
    Mutant("R24", RLOO, "rloo_targets", "advantages = whiten(advantages)", "advantages = whiten(rlhf_reward)",
           "the rewards whitened in place of the advantages"),
    Mutant("R25", RLOO, "rloo_targets", '"entropy": -old_logps.mean()', '"entropy": old_logps.mean()',
           "flipped sign of the entropy"),
    Mutant("R26", RLOO, "rloo_targets", 'stats["engine_diff"] = diff.sum() / tokens',
           'stats["engine_diff"] = diff.abs().sum() / tokens', "engine_kl an absolute difference"),
    Mutant("R27", RLOO, "rloo_update", "sizes.local_mini_batch_size * K, args.local_micro_batch_size * K",
           "sizes.local_mini_batch_size, args.local_micro_batch_size * K",
           "the mini-batch counted in prompts, not completions"),
    Mutant("R28", RLOO, "rloo_update", "shuffle.permutation(n)", "np.arange(n)", "the completions never shuffled"),
    Mutant("R29", RLOO, "rloo_update", "targets.advantages[idx]",
           "targets.advantages[micro_start : micro_start + micro_size]",
           "the advantages not shuffled with their completions"),
    Mutant("R30", RLOO, "rloo_update", "weights = None if targets.is_weights is None else targets.is_weights[idx]",
           "weights = None", "the importance weights dropped in the update"),
    Mutant("R31", RLOO, "rloo_update", "for _ in range(args.num_ppo_epochs):", "for _ in range(1):",
           "--num_ppo_epochs ignored"),
    Mutant("R32", RLOO, "rloo_update", "if accelerator.sync_gradients and args.max_grad_norm",
           "if args.max_grad_norm", "the gradient clipped every micro-batch, before it is whole"),
    Mutant("R33", RLOO, "rloo_update", "optimizer.zero_grad()", "pass", "the gradients carried into the next update"),
    Mutant("R34", RLOO, "rloo_update", "logps = logprobs.sum(1)", "logps = logprobs.mean(1)",
           "the per-token mean, not the sequence logprob"),
    Mutant("R35", RLOO, "rloo_update", "0.5 * ((logps.detach() - old_logps) ** 2).mean()",
           "((logps.detach() - old_logps) ** 2).mean()", "approxkl without its 1/2"),
    Mutant("R36", RLOO, "rloo_update", "return stats, (ratio_max, -neg_ratio_min)",
           "return stats, (ratio_max, neg_ratio_min)", "flipped sign of the smallest ratio"),
    Mutant("R37", RLOO, "rloo_metrics", '"objective/non_score_reward": -kl_coef * reduced["kl"]',
           '"objective/non_score_reward": kl_coef * reduced["kl"]', "flipped sign"),
    Mutant("R38", RLOO, "rloo_metrics", '"policy/ratio_min": ratios[1]', '"policy/ratio_min": ratios[0]',
           "wrong index: the largest ratio"),
    Mutant("R39", RLOO, "rloo_update", "accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)", "pass",
           "--max_grad_norm ignored"),
    # PRIME-RL's objective (--loss_type prime_rl) and the group's advantage forms
    Mutant("R40", RLOO, "check_loss_flags", 'args.old_logprobs != "engine"', 'args.old_logprobs == "engine"',
           "the engine's logprobs refused instead of required"),
    Mutant("R41", RLOO, "check_loss_flags", "args.kl_coef != 0", "args.kl_coef < 0", "a KL term let through"),
    Mutant("R42", RLOO, "group_advantages", 'if form == "leave_one_out":', 'if form == "group_mean":',
           "the forms' branches crossed"),
    Mutant("R43", RLOO, "group_advantages", "centred = rewards - rewards.mean(1, keepdim=True)",
           "centred = rewards - rewards.mean()", "the batch's mean, not the group's"),
    Mutant("R44", RLOO, "group_advantages", "centred.clamp(min=0)", "centred.clamp(max=0)",
           "the positive advantages zeroed, not the negative"),
    Mutant("R45", RLOO, "group_advantages", "weights = lengths.to(rewards.dtype)", "weights = torch.ones_like(rewards)",
           "the lengths' weights dropped"),
    Mutant("R46", RLOO, "group_advantages", "/ weights.sum(1, keepdim=True)", "/ weights.sum()",
           "the weighted mean divided by the batch's tokens"),
    Mutant("R47", RLOO, "prime_rl_loss", "ratio = torch.exp(logprobs - engine_logprobs)",
           "ratio = torch.exp(engine_logprobs - logprobs)", "the inverse ratio mu / pi"),
    Mutant("R48", RLOO, "prime_rl_loss", "ratio.clamp(max=delta) * advantages[:, None]",
           "torch.min(ratio * advantages[:, None], delta * advantages[:, None])",
           "the cap taken of r A (PPO's side rule): a negative advantage's large ratio not capped"),
    Mutant("R49", RLOO, "prime_rl_loss", "ratio.clamp(max=delta)", "ratio", "the ratio not capped"),
    Mutant("R50", RLOO, "prime_rl_loss", "* advantages[:, None] * mask", "* advantages[:, None]",
           "the padding after EOS counted"),
    Mutant("R51", RLOO, "prime_rl_loss", "return -objective.sum() / tokens", "return -objective.mean()",
           "the mean over every slot, not the batch's tokens"),
    Mutant("R52", RLOO, "prime_rl_loss", "(ratio[real] > delta)", "(ratio[real] < delta)",
           "clipfrac counts the wrong side"),
    Mutant("R53", RLOO, "rloo_targets",
           'if args.old_logprobs == "engine" and not (args.loss_type == "prime_rl" and args.correction == "tis"):',
           'if args.old_logprobs == "engine":', "tis's weights computed for PRIME-RL's objective, whose cap is its own"),
    Mutant("R54", RLOO, "rloo_targets", 'mu = engine_logprobs if args.loss_type == "prime_rl" else None',
           'mu = old_logprobs if args.loss_type == "prime_rl" else None', "mu from the trainer, not the engine"),
    Mutant("R55", RLOO, "rloo_targets", "mask.sum(1).view(-1, args.rloo_k)", "mask.sum(1).view(args.rloo_k, -1).T",
           "the lengths read strided, not with their completions"),
    Mutant("R56", RLOO, "rloo_update", "share = accelerator.gradient_accumulation_steps * accelerator.num_processes",
           "share = accelerator.gradient_accumulation_steps", "the processes' mean left out of the normalisation"),
    Mutant("R57", RLOO, "rloo_update", 'accelerator.reduce(batch.response_mask.sum(1)[order].view(-1, mini).sum(1), "sum")',
           "batch.response_mask.sum(1)[order].view(-1, mini).sum(1)", "each process's own tokens, not the batch's"),
    Mutant("R58", RLOO, "rloo_update", "batch.response_mask.sum(1)[order]", "batch.response_mask.sum(1)",
           "the mini-batches' tokens counted before the shuffle"),
    Mutant("R59", RLOO, "rloo_update", ".view(-1, mini).sum(1)", ".view(-1, micro).sum(1)",
           "the tokens counted per micro-batch, not per mini-batch"),
    Mutant("R60", RLOO, "rloo_update", "count = tokens[mini_start // mini]", "count = tokens[0]",
           "every mini-batch divided by the first one's tokens"),
    Mutant("R61", RLOO, "rloo_update", "targets.engine_logprobs[idx]",
           "targets.engine_logprobs[micro_start : micro_start + micro]", "mu not shuffled with its completions"),
    Mutant("R62", RLOO, "rloo_update", "0.5 * ((logprobs.detach() - mu) ** 2 * mask).sum() / mask.sum()",
           "0.5 * ((logprobs.detach() - mu) ** 2 * mask).sum() / mask.numel()", "approxkl over the padding too"),
    # the corrections of --old_logprobs engine (correction_weights and check_correction_flags: ppo_async.py's copies
    # too) and GRPO by name (issue 52)
    Mutant("C01", RLOO, "correction_weights", "by_sequence = per_sequence or args.correction in SEQUENCE_CORRECTIONS",
           "by_sequence = per_sequence", "the sequence corrections applied per token"),
    Mutant("C02", RLOO, "correction_weights", "log_old, log_mu = old_logprobs * mask, engine_logprobs * mask",
           "log_old, log_mu = old_logprobs, engine_logprobs", "the garbage after EOS in the ratios"),
    Mutant("C03", RLOO, "correction_weights", 'mask.sum(1).clamp(min=1) if args.correction == "geo_mask" else 1',
           "1", "geo_mask on the product of the ratios, not their geometric mean"),
    Mutant("C04", RLOO, "correction_weights", "ratio = torch.exp(log_old - log_mu)",
           "ratio = torch.exp(log_mu - log_old)", "the inverse ratio mu / pi_old masked"),
    Mutant("C05", RLOO, "correction_weights", "(ratio >= low) & (ratio <= high)", "(ratio > low) & (ratio < high)",
           "the bounds' edges masked"),
    Mutant("C06", RLOO, "correction_weights", 'kept.float() if args.correction == "geo_mask" else ', "",
           "geo_mask weighs by the geometric mean instead of keeping"),
    Mutant("C07", RLOO, "correction_weights", '"decoupled": (0.0, args.decoupled_cap)',
           '"decoupled": (1 / args.decoupled_cap, args.decoupled_cap)', "AReaL's one-sided cap made two-sided"),
    Mutant("C08", RLOO, "correction_weights", '"icepop": (args.icepop_low, args.icepop_high)',
           '"icepop": (args.icepop_low, args.decoupled_cap)', "IcePop's upper bound from another flag"),
    Mutant("C09", RLOO, "correction_weights", "count = units.sum().clamp(min=1)", "count = mask.sum().clamp(min=1)",
           "a sequence correction's fractions over the tokens, not the sequences"),
    Mutant("C10", RLOO, "correction_weights", "weights = kept.float()\n", "pass\n",
           "PRIME-RL's tokens weighed by pi_old / mu a second time"),
    Mutant("C11", RLOO, "correction_weights", "(weights if per_sequence else weights * mask)",
           "(weights if per_sequence else weights)", "a weight after the EOS"),
    Mutant("C12", RLOO, "correction_weights", '"correction_masked_frac": ((~kept).float() * units).sum() / count',
           '"correction_masked_frac": (kept.float() * units).sum() / count', "the fraction kept logged as masked"),
    Mutant("C13", RLOO, "correction_weights", "kept, truncated = torch.ones_like(ratio, dtype=torch.bool), ratio > args.tis_cap",
           "kept, truncated = torch.ones_like(ratio, dtype=torch.bool), ratio < args.tis_cap",
           "the fraction left below the cap logged as truncated"),
    Mutant("C14", RLOO, "check_correction_flags", 'args.old_logprobs != "engine"', 'args.old_logprobs == "engine"',
           "a correction refused where it applies, allowed where it cannot"),
    Mutant("G01", RLOO, "grpo_loss", "ratio = torch.exp((logprobs - old_logprobs) * mask)",
           "ratio = torch.exp(logprobs - old_logprobs)", "the garbage after EOS in the ratio (inf x 0)"),
    Mutant("G02", RLOO, "grpo_loss", "ratio.clamp(1 - cliprange, 1 + cliprange)", "ratio.clamp(max=1 + cliprange)",
           "the lower clip dropped"),
    Mutant("G03", RLOO, "grpo_loss", "per_token = -torch.min(unclipped, clipped)",
           "per_token = -torch.max(unclipped, clipped)", "min vs max: the optimistic bound"),
    Mutant("G04", RLOO, "grpo_loss", "per_token = per_token * is_weights", "per_token = per_token",
           "the correction's weights ignored"),
    Mutant("G05", RLOO, "grpo_loss", "torch.exp(log_ratio) - log_ratio - 1", "torch.exp(log_ratio) + log_ratio - 1",
           "k3 with the wrong sign of its log term"),
    Mutant("G06", RLOO, "grpo_loss", "log_ratio = (ref_logprobs - logprobs) * mask",
           "log_ratio = (logprobs - ref_logprobs) * mask", "k3 of pi / pi_ref: the other direction"),
    Mutant("G07", RLOO, "grpo_loss", "loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()",
           "loss = per_token.sum() / mask.sum()", "sequence_mean computed as a token mean"),
    Mutant("G08", RLOO, "grpo_loss", "per_token = per_token * mask", "per_token = per_token",
           "the padding's terms in the loss"),
    Mutant("G09", RLOO, "grpo_loss", "(clipped < unclipped)[real]", "(clipped > unclipped)[real]",
           "clipfrac counts the wrong side"),
    Mutant("G10", RLOO, "group_advantages", "centred / (rewards.std(1, keepdim=True) + 1e-4)",
           "centred / (rewards.std(1, keepdim=True, correction=0) + 1e-4)", "GRPO's std biased, not TRL's unbiased"),
    Mutant("G11", RLOO, "group_advantages", "centred / (rewards.std(1, keepdim=True) + 1e-4)",
           "rewards / (rewards.std(1, keepdim=True) + 1e-4)", "GRPO's advantage not centred"),
    Mutant("G12", RLOO, "loss_setting", "LOSS_DEFAULTS[args.loss_type][flag] if value is None else value",
           "LOSS_DEFAULTS[args.loss_type][flag]", "the flag given ignored for the loss's own"),
    Mutant("G13", RLOO, "check_loss_flags", 'args.loss_type != "grpo" and args.kl_term == "k3_loss"',
           'args.loss_type == "grpo" and args.kl_term == "k3_loss"', "GRPO's k3 term refused, allowed elsewhere"),
    Mutant("G14", RLOO, "check_loss_flags", 'args.loss_type == "proximal_rloo" and args.correction == "icepop"',
           'args.loss_type == "grpo" and args.correction == "icepop"', "IcePop refused where it applies"),
    Mutant("G15", RLOO, "check_loss_flags", "    check_correction_flags(args)\n", "",
           "a correction allowed without the engine's logprobs"),
    Mutant("G16", RLOO, "check_loss_flags", 'args.correction in ("sequence_tis", "decoupled")',
           'args.correction in ("sequence_tis",)', "PRIME-RL's ratio weighed by AReaL's weight too"),
    Mutant("G17", RLOO, "rloo_targets", 'args.kl_coef if loss_setting(args, "kl_term") == "reward" else 0.0',
           "args.kl_coef", "GRPO's KL in the reward and in the loss"),
    Mutant("G18", RLOO, "rloo_targets", 'per_sequence, masks_only = args.loss_type == "proximal_rloo"',
           'per_sequence, masks_only = args.loss_type == "grpo"', "Proximal RLOO's weights per token, GRPO's per sequence"),
    Mutant("G19", RLOO, "rloo_targets", 'not (args.loss_type == "prime_rl" and args.correction == "tis")',
           'args.loss_type != "prime_rl"', "PRIME-RL's objective without the correction's masks"),
    Mutant("G20", RLOO, "rloo_targets", 'ref_logprobs if loss_setting(args, "kl_term") == "k3_loss" else None',
           "None", "GRPO without its k3 term"),
    Mutant("G21", RLOO, "rloo_targets", 'advantages = group_advantages(*groups, loss_setting(args, "advantage"))',
           'advantages = group_advantages(*groups, args.advantage or "leave_one_out")',
           "--loss_type grpo with the leave-one-out advantage"),
    Mutant("G22", RLOO, "rloo_update", "divisor = len(idx) * args.response_length", "divisor = len(idx)",
           "Dr. GRPO's constant without the response length"),
    Mutant("G23", RLOO, "rloo_update", 'divisor = tokens[mini_start // mini] if normalization == "token_mean"',
           'divisor = tokens[0] if normalization == "token_mean"', "every mini-batch divided by the first one's tokens"),
    Mutant("G24", RLOO, "rloo_update", "ref = None if targets.ref_logprobs is None else targets.ref_logprobs[idx]",
           "ref = None", "the k3 term dropped in the update"),
    Mutant("G25", RLOO, "rloo_update", "is_weights=weights,", "is_weights=None,", "GRPO's correction dropped in the update"),
    Mutant("G26", RLOO, "rloo_update", "logprobs, mu, advantages, mask, delta, count, weights",
           "logprobs, mu, advantages, mask, delta, count", "PRIME-RL's masks dropped in the update"),
    Mutant("G27", RLOO, "rloo_update", "mask, old = batch.response_mask[idx], targets.old_logprobs[idx]",
           "mask, old = batch.response_mask[idx], targets.old_logprobs[micro_start : micro_start + micro]",
           "GRPO's pi_old not shuffled with its completions"),
    Mutant("G28", RLOO, "prime_rl_loss", "objective = objective * keep", "objective = objective",
           "a correction's mask ignored"),
    Mutant("G29", RLOO, "rloo_metrics", "for k in CORRECTION_STATS if k in reduced", "for k in CORRECTION_STATS[:1] if k in reduced",
           "the truncated and masked fractions not logged"),
    # -------- ppo_async.py
    Mutant("P01", PPO, "masked_mean", "mask.sum().clamp(min=1)", "mask.numel()", "the mean over the padding too"),
    Mutant("P02", PPO, "masked_mean", "(values * mask).sum()", "values.sum()", "the mask dropped from the sum"),
    Mutant("P03", PPO, "masked_var", "masked_mean(centered**2, mask) * count / (count - 1).clamp(min=1)",
           "masked_mean(centered**2, mask)", "Bessel's correction dropped"),
    Mutant("P04", PPO, "masked_var", "centered = values - masked_mean(values, mask)",
           "centered = values - values.mean()", "centred on the mean over the padding too"),
    Mutant("P05", PPO, "masked_whiten", "torch.rsqrt(", "torch.sqrt(", "multiplied by the std, not divided"),
    Mutant("P06", PPO, "masked_whiten", "if not shift_mean:", "if shift_mean:", "shift_mean inverted"),
    Mutant("P07", PPO, "masked_whiten", "return whitened * mask", "return whitened", "the padding not zeroed"),
    Mutant("P08", PPO, "PolicyAndValue", "response_logprobs(self.policy, batch, temperature, entropy=True)",
           "response_logprobs(self.policy, batch, 1.0, entropy=True)",
           "the policy's logprobs without the sampling temperature (the ratio stays 1 on-policy)"),
    Mutant("P09", PPO, "PolicyAndValue", "values = response_values(self.value_model, batch)",
           "values = response_values(self.value_model, batch).detach()",
           "the value model never trained"),
    Mutant("P10", SHARED, "response_logprobs",
           "entropies = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)",
           "entropies = -(logits.softmax(-1) * logits).sum(-1)", "the entropy without its normaliser"),
    Mutant("P11", PPO, "response_values", "last_hidden_state[:, batch.query_ids.shape[1] - 1 : -1]",
           "last_hidden_state[:, batch.query_ids.shape[1] :]", "off by one: V read at y_t, not before it"),
    Mutant("P12", PPO, "response_values", ".float() * batch.response_mask", ".float()", "the values after EOS kept"),
    Mutant("P13", PPO, "per_token_rewards", "rewards = -kl_coef * kl", "rewards = kl_coef * kl",
           "flipped sign: the KL rewarded"),
    Mutant("P14", PPO, "per_token_rewards", "lengths - 1] += scores", "-1] += scores",
           "the score on the last column, padding or not"),
    Mutant("P15", PPO, "per_token_rewards", "lengths - 1] += scores", "lengths] += scores",
           "off by one: the score on the token after the last"),
    Mutant("P16", PPO, "per_token_rewards", "if empty := (lengths == 0).nonzero().flatten().tolist():",
           "if False:", "an empty completion's score silently lost"),
    Mutant("P17", PPO, "per_token_rewards", "kl = (logprobs - ref_logprobs) * response_mask",
           "kl = (ref_logprobs - logprobs) * response_mask", "flipped sign of the KL"),
    Mutant("P18", PPO, "gae_advantages", "torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)",
           "torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], 1)", "the previous value, not the next"),
    Mutant("P19", PPO, "gae_advantages", "rewards + gamma * next_values - values", "rewards + next_values - values",
           "gamma dropped from the TD error"),
    Mutant("P20", PPO, "gae_advantages", "(gamma * lam) ** gaps", "gamma ** gaps", "lambda dropped"),
    Mutant("P21", PPO, "gae_advantages", "gaps >= 0", "gaps > 0", ">= vs >: delta_t left out of A_t"),
    Mutant("P22", PPO, "gae_advantages", "deltas @ discounts.T", "deltas @ discounts",
           "the past deltas summed, not later"),
    Mutant("P23", PPO, "gae_advantages", "(advantages + values) * response_mask", "advantages * response_mask",
           "the returns without the values"),
    Mutant("P24", PPO, "ppo_policy_loss", "ratio = torch.exp(logprobs - old_logprobs)",
           "ratio = torch.exp(old_logprobs - logprobs)", "the inverse ratio"),
    Mutant("P25", PPO, "ppo_policy_loss", "pg_losses = -advantages * ratio", "pg_losses = advantages * ratio",
           "flipped sign of the unclipped term"),
    Mutant("P26", PPO, "ppo_policy_loss", "torch.max(pg_losses, pg_losses_clipped)",
           "torch.min(pg_losses, pg_losses_clipped)", "max vs min: the optimistic bound"),
    Mutant("P27", PPO, "ppo_policy_loss", "ratio.clamp(1 - cliprange, 1 + cliprange)", "ratio.clamp(max=1 + cliprange)",
           "the lower clip dropped"),
    Mutant("P28", PPO, "ppo_policy_loss", "per_token = per_token * is_weights", "per_token = per_token",
           "the importance weights ignored"),
    Mutant("P29", PPO, "ppo_policy_loss", "masked_mean(per_token, response_mask)", "per_token.mean()",
           "the padding in the mean"),
    Mutant("P30", PPO, "ppo_policy_loss", "(pg_losses_clipped > pg_losses)", "(pg_losses_clipped >= pg_losses)",
           "> vs >=: every unclipped token counted as clipped"),
    Mutant("P31", PPO, "ppo_value_loss", "old_values - cliprange_value)", "values - cliprange_value)",
           "the lower value clip around V, not V_old"),
    Mutant("P32", PPO, "ppo_value_loss", "0.5 * masked_mean(", "masked_mean(", "the 1/2 dropped"),
    Mutant("P33", PPO, "ppo_value_loss", "torch.max(losses, losses_clipped)", "torch.min(losses, losses_clipped)",
           "max vs min"),
    Mutant("P34", PPO, "ppo_value_loss", "(clipped_values - returns) ** 2", "(clipped_values - old_values) ** 2",
           "the clipped term against V_old, not the returns"),
    Mutant("P35", PPO, "ppo_value_loss", "(losses_clipped > losses)", "(losses_clipped < losses)",
           "vf_clipfrac counts the wrong side"),
    Mutant("P36", PPO, "explained_variance", "masked_var(returns, response_mask).clamp(min=1e-8)",
           "masked_var(values, response_mask).clamp(min=1e-8)", "divided by Var(V), not Var(R)"),
    Mutant("P37", PPO, "adaptive_kl_coef", "np.clip(kl / target - 1, -0.2, 0.2)", "kl / target - 1",
           "the error not clipped to +-20 %"),
    Mutant("P38", PPO, "adaptive_kl_coef", "kl / target - 1", "target / kl - 1", "the error inverted"),
    Mutant("P39", PPO, "adaptive_kl_coef", "proportional_error * n_steps / horizon", "proportional_error / horizon",
           "the step's episodes left out"),
    Mutant("P40", PPO, "adaptive_kl_coef", "-0.2, 0.2", "-0.2, 2.0", "wrong constant: up to +200 % per update"),
    Mutant("P41", PPO, "ppo_targets", "per_token_rewards(scores, old_logprobs, ref_logprobs",
           "per_token_rewards(scores, engine_logprobs, ref_logprobs", "the KL from the engine's logprobs"),
    Mutant("P42", PPO, "ppo_targets", "if args.whiten_rewards:", "if not args.whiten_rewards:",
           "--whiten_rewards inverted"),
    Mutant("P43", PPO, "ppo_targets", "masked_whiten(rewards, mask, shift_mean=False)", "masked_whiten(rewards, mask)",
           "the rewards' mean shifted away"),
    Mutant("P44", PPO, "ppo_targets", "advantages = masked_whiten(advantages, mask)", "advantages = advantages * mask",
           "the advantages not whitened"),
    Mutant("P45", PPO, "ppo_targets", "args.gamma, args.lam", "args.lam, args.gamma", "gamma and lambda swapped"),
    Mutant("P46", PPO, "ppo_targets", 'if args.old_logprobs == "engine":', 'if args.old_logprobs == "trainer":',
           "the correction applied without the engine's logprobs, dropped with them"),
    Mutant("P47", PPO, "old_logprobs_and_values", "[values for _, _, values in outputs]",
           "[logprobs for logprobs, _, _ in outputs]", "copy-paste: the logprobs taken for the values"),
    Mutant("P48", PPO, "ppo_update", "loss = pg_loss + args.vf_coef * vf_loss", "loss = pg_loss + vf_loss",
           "--vf_coef ignored"),
    Mutant("P49", PPO, "ppo_update", "loss = pg_loss + args.vf_coef * vf_loss", "loss = pg_loss",
           "the value model never trained"),
    Mutant("P50", PPO, "ppo_update", "for _ in range(args.num_ppo_epochs):", "for _ in range(1):",
           "--num_ppo_epochs ignored"),
    Mutant("P51", PPO, "ppo_update", "if accelerator.sync_gradients and args.max_grad_norm",
           "if args.max_grad_norm", "the gradient clipped every micro-batch, before it is whole"),
    Mutant("P52", PPO, "ppo_update", "optimizer.zero_grad()", "pass", "the gradients carried into the next update"),
    Mutant("P53", PPO, "ppo_update", "mask, args.cliprange, m.is_weights", "mask, args.cliprange, None",
           "the importance weights dropped in the update"),
    Mutant("P54", PPO, "ppo_update", "m.old_values, m.returns, mask", "m.old_values, m.advantages, mask",
           "the values fitted to the advantages"),
    Mutant("P55", PPO, "ppo_update", "clip = args.cliprange_value", "clip = args.cliprange",
           "the policy's clip range for the value"),
    Mutant("P56", PPO, "ppo_update", '"kl": targets.kl.sum(1).mean()', '"kl": targets.kl.mean()',
           "the KL per token, not per sequence"),
    Mutant("P57", PPO, "ppo_update", 'stats["ratio"].append(ratio[mask.bool()])',
           'stats["ratio"].append(ratio.flatten())', "the padding's ratios (1) in ratio_mean"),
    Mutant("P58", PPO, "ppo_update", "return stats, (ratio_max, -neg_ratio_min)",
           "return stats, (ratio_max, neg_ratio_min)", "flipped sign of the smallest ratio"),
    Mutant("P59", PPO, "ppo_update", "shuffle.permutation(B)", "np.arange(B)", "the batch never shuffled"),
    Mutant("P70", PPO, "KLCoefficient", "        return value\n", "        return self.value\n",
           "the step logged with the next step's coefficient"),
    Mutant("P71", PPO, "Targets", "None if tensor is None else tensor[index]", "tensor",
           "every micro-batch fits the whole batch's targets"),
    Mutant("P60", PPO, "ppo_metrics", '"objective/non_score_reward": -kl_coef * reduced["kl"]',
           '"objective/non_score_reward": kl_coef * reduced["kl"]', "flipped sign"),
    Mutant("P61", PPO, "ppo_metrics", '"loss/value": reduced["vf_loss"]', '"loss/value": reduced["pg_loss"]',
           "the policy's loss logged as the value's"),
    Mutant("P62", PPO, "ppo_update", "accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)", "pass",
           "--max_grad_norm ignored"),
    Mutant("P63", PPO, "ppo_targets", "correction_weights(old_logprobs, engine_logprobs, mask, args)",
           "correction_weights(old_logprobs, engine_logprobs, mask, args, masks_only=True)",
           "the correction's masks only, its weights dropped"),
    Mutant("P64", PPO, "ppo_targets", "correction_weights(old_logprobs, engine_logprobs, mask, args)",
           "correction_weights(engine_logprobs, old_logprobs, mask, args)", "the weights of mu / pi_old"),
    Mutant("P65", PPO, "ppo_metrics", "for k in CORRECTION_STATS if k in reduced",
           "for k in CORRECTION_STATS[:1] if k in reduced", "the truncated and masked fractions not logged"),
]
# fmt: on

# The fast tier's tests that can see a file's method functions: its own unit tests first (they kill most mutants,
# and -x stops at the first failure), then the tests every file's copy of the shared code runs.
UNIT_TESTS = {DPO: "tests/test_online_dpo_units.py", RLOO: "tests/test_rloo_units.py", PPO: "tests/test_ppo_units.py"}
SHARED_TESTS = ("tests/test_tasks.py", "tests/test_tiny_task.py", "tests/test_gpu_path.py", "tests/test_bad_input.py")
# The other test modules that import an algorithm file, and why they are not run (tests/test_mutation_check.py
# keeps this list and the one above complete).
LEFT_OUT = {
    "tests/test_shared_code.py": "the drift test fails on any change to one copy of shared code (here a shared mutant "
    "reaches every copy); ruff",
    "tests/test_docs.py": "the README's and the docs' commands, whole runs; the docs checks",
    "tests/test_engine.py": "starts a vLLM engine, tens of seconds a test: the weight push and the generation thread",
    "tests/test_online_dpo_runs.py": "whole runs, each starting an engine",
    "tests/test_machines.py": "whole runs, each starting an engine",
    "tests/test_rloo_runs.py": "whole runs, each starting an engine",
    "tests/test_ppo_runs.py": "whole runs, each starting an engine",
    "tests/test_faults_and_resume.py": "whole runs: faults, signals, resume",
    "tests/test_inflight.py": "in-flight updates: whole runs, each starting an engine, and a command line's refusal",
    "tests/test_run_folder.py": "the run folder (plumbing's): checkpoints, its lock and space, a full disk",
    "tests/test_gpu.py": "needs a GPU",
    "tests/test_benchmark_scripts.py": "the benchmark scripts' commands",
    "tests/test_benchmark_tools.py": "the benchmark tools",
    "tests/test_gpu_check.py": "benchmark/gpu_check.sh",
    "tests/test_miniature.py": "the miniature runs' driver and table",
    "tests/test_plan.py": "benchmark/plan.py's run plans",
    "tests/test_vs_trl.py": "the comparison with TRL's driver",
    "tests/test_plumbing.py": "the plumbing's promises, which reads only the files' Args (mutation_check_plumbing.py)",
    "tests/test_lora.py": "LoRA's adapter, reference and push (plumbing's: mutation_check_plumbing.py); an engine",
}
# Of those, the tests that start a script in a subprocess (seconds each): they check the command line, not the method.
SUBPROCESS_TESTS = (
    "tests/test_bad_input.py::test_the_command_line_prints_one_line_and_writes_nothing",
    "tests/test_bad_input.py::test_an_sft_policy_as_reward_model_or_gold_judge_is_refused_in_one_line",
    "tests/test_bad_input.py::test_bad_data_and_settings_get_one_line_from_the_shell_and_nothing_written",
    "tests/test_tasks.py::test_a_gold_reward_model_for_gsm8k_is_refused_in_one_line_before_any_model_loads",
)


# ---------------------------------------------------------------------------------------------------------------------
# Applying a mutant
# ---------------------------------------------------------------------------------------------------------------------
@functools.cache
def function_spans(source: str) -> dict[str, tuple[int, int]]:
    """Character offsets of each top-level function's or class's source, its first line to its last."""
    starts = [0, *(i + 1 for i, char in enumerate(source) if char == "\n")]  # ast's lines end at "\n" only here
    nodes = [node for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    return {node.name: (starts[node.lineno - 1], starts[node.end_lineno]) for node in nodes}


def function_source(source: str, name: str) -> str | None:
    span = function_spans(source).get(name)
    return None if span is None else source[span[0] : span[1]]


def mutate(source: str, mutant: Mutant) -> str:
    """The source with the mutant's fragment replaced in its function; ValueError unless it occurs there once."""
    spans = function_spans(source) | {MODULE: (0, len(source))}
    if mutant.function not in spans:
        raise ValueError(f"{mutant.id}: no function {mutant.function}")
    start, end = spans[mutant.function]
    count = source[start:end].count(mutant.original)
    if count != 1:
        raise ValueError(f"{mutant.id}: {mutant.original!r} occurs {count} times in {mutant.function}, not once")
    return source[:start] + source[start:end].replace(mutant.original, mutant.replacement) + source[end:]


def touched_files(mutant: Mutant, sources: dict[str, str]) -> list[str]:
    """The files a mutant is applied to: its own and every other algorithm file holding the same text of the function
    (shared code is kept identical by tests/test_shared_code.py, so a real change would reach each copy); a file of
    another suite: its own."""
    if mutant.file not in (*FILES, SHARED):
        return [mutant.file]
    own = DPO if mutant.file == SHARED else mutant.file
    text = {name: function_source(sources[name], mutant.function) for name in FILES}
    files = [name for name in FILES if name == own or text[name] == text[own]]
    if mutant.file == SHARED and len(files) != len(FILES):
        raise ValueError(f"{mutant.id}: {mutant.function} is not the same text in the three files")
    return files


def mutated_sources(mutant: Mutant, sources: dict[str, str]) -> dict[str, str]:
    return {name: mutate(sources[name], mutant) for name in touched_files(mutant, sources)}


def tests_for(files: list[str]) -> list[str]:
    return [UNIT_TESTS[name] for name in FILES if name in files] + list(SHARED_TESTS)


class Suite(NamedTuple):
    """What a mutation check mutates and runs: the `files` its `mutants` change, the `tests` the first run (without a
    mutant) runs and records, the ones it leaves out (`deselected`: they start a script in a subprocess), and, for
    functions that run in another process (the engine's worker), where the recording of calls cannot see them, the
    tests that call them there (`unrecorded`: (file, function) -> tests)."""

    files: tuple[str, ...]
    mutants: list[Mutant]
    tests: list[str]
    deselected: tuple[str, ...]
    unrecorded: dict[tuple[str, str], list[str]]


METHOD = Suite(FILES, MUTANTS, tests_for(list(FILES)), SUBPROCESS_TESTS, {})


# ---------------------------------------------------------------------------------------------------------------------
# Workers: one process per core, each with its own copy of the repository, importing torch and transformers once
# ---------------------------------------------------------------------------------------------------------------------
def copy_repository(source: Path, destination: Path) -> None:
    def ignore(folder: str, names: list[str]) -> set[str]:
        left_out = {".venv", ".vllm_gpu", ".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
        return {n for n in names if n in left_out or (Path(folder) == source and n == "runs")}

    shutil.copytree(source, destination, ignore=ignore, symlinks=True)


class TestReport:
    """A pytest plugin: the tests (or collections) that failed and, when `record` is on, which method functions each
    test calls, in its body, its setup or the setup of any fixture it uses (a module's fixture is set up once)."""

    def __init__(self, root: str, record: bool, files: tuple[str, ...]):
        self.failed: list[str] = []
        self.record, self.paths = record, {os.path.join(root, name): name for name in files}
        self.calls: dict[str, set[tuple[str, str]]] = {}  # test id -> (file, function)
        self.fixture_calls: dict[int, set[tuple[str, str]]] = {}
        self.collection: set[tuple[str, str]] = set()  # called while collecting: before any test
        self.current = self.collection

    def profile(self, frame, event, arg):
        if event == "call" and (name := self.paths.get(frame.f_code.co_filename)):
            self.current.add((name, frame.f_code.co_qualname.split(".")[0]))  # a method: its class's name
        return self.profile

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid)

    def pytest_collectreport(self, report):
        if report.failed:
            self.failed.append(report.nodeid or "collection")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        outer, self.current = self.current, self.fixture_calls.setdefault(id(fixturedef), set())
        yield
        self.current = outer

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = self.calls.setdefault(item.nodeid, set())
        yield
        for definitions in item._fixtureinfo.name2fixturedefs.values():
            for definition in definitions:
                self.current |= self.fixture_calls.get(id(definition), set())
        self.current = self.collection

    def run(self, args: list[str]) -> int:
        if self.record:
            sys.setprofile(self.profile)
            threading.setprofile(self.profile)
        try:
            code = int(pytest.main(args, plugins=[self]))
        finally:
            recorded = sys.getprofile() == self.profile
            sys.setprofile(None)
            threading.setprofile(None)
        if self.record and not recorded:  # a test replaced the hook: the calls after it are missing
            self.failed.append("the recording of calls (sys.setprofile), switched off by a test")
            return -1
        return code


def worker(connection, root: str, threads: int, files: tuple[str, ...], deselected: tuple[str, ...]) -> None:
    """Runs pytest in this process for each job it receives, (sources, tests, record), on `root` with those sources
    written and its modules imported afresh, less the `deselected` tests; the calls recorded are those into `files`.
    Answers (exit code, failed test ids, seconds, calls per test if recorded)."""
    os.chdir(root)
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [root, os.path.join(root, "tests")] + [p for p in sys.path if p not in ("", here)]
    sys.dont_write_bytecode = True  # a mutated file must never be read back from a stale .pyc
    log = os.open(os.path.join(root, "pytest.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    import torch
    import transformers  # noqa: F401  (imported once here, not once per mutant)

    torch.set_num_threads(threads)
    originals = {name: Path(root, name).read_text() for name in files}
    while (job := connection.recv()) is not None:
        sources, tests, record = job
        for name, text in sources.items():
            Path(root, name).write_text(text)
        for name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(root + os.sep):
                del sys.modules[name]
        report, start = TestReport(root, record, files), time.perf_counter()
        args = ["-q", "-x", "-m", "not slow", "-p", "no:cacheprovider", "--no-header"]
        args += [arg for test in deselected for arg in ("--deselect", test)]
        code = report.run(args + tests)
        for name in sources:
            Path(root, name).write_text(originals[name])
        calls = {"": report.collection, **report.calls} if record else None
        connection.send((code, report.failed, time.perf_counter() - start, calls))


class Worker:
    """A worker process, started again after a timeout and every RECYCLE jobs (memory)."""

    RECYCLE = 40

    def __init__(self, root: Path, threads: int, suite: Suite):
        self.root, self.threads, self.process, self.jobs = root, threads, None, 0
        self.files, self.deselected = suite.files, suite.deselected

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        arguments = (child, str(self.root), self.threads, self.files, self.deselected)
        # not a daemon: its tests start processes of their own (an engine, a process group), which a daemon cannot
        self.process = context.Process(target=worker, args=arguments)
        self.process.start()
        self.jobs = 0

    def stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.connection.send(None)
            self.process.join(timeout=30)
            if self.process.is_alive():
                self.kill()
        self.process = None

    def kill(self) -> None:
        """The worker and every process its tests started (an engine left running by a test cut short)."""
        import psutil

        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.process.kill()
        self.process.join()
        for child in children:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def run(self, sources: dict[str, str], tests: list[str], timeout: float, record: bool = False):
        """(pytest's exit code, failed tests, seconds, calls per test if `record`); exit code None after `timeout`
        seconds or when the worker died (it is started again)."""
        if self.process is None or self.jobs >= self.RECYCLE:
            self.stop()
            self.start()
        self.jobs += 1
        start = time.perf_counter()
        self.connection.send((sources, tests, record))
        if self.connection.poll(timeout):
            try:
                return self.connection.recv()
            except EOFError:  # a mutant that crashed the interpreter
                self.kill()
                self.process = None
                return None, ["the worker died"], time.perf_counter() - start, None
        self.kill()
        self.process = None
        return None, [], time.perf_counter() - start, None


class Result(NamedTuple):
    mutant: Mutant
    files: list[str]
    status: str  # killed, survived, timeout (counts as killed) or error
    seconds: float
    tests: int  # how many tests call the mutated function, and so ran
    killed_by: str  # the first test that failed
    log: str = ""  # for an error: the end of the worker's pytest output


# ---------------------------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------------------------
def selected(args, suite: Suite) -> list[Mutant]:
    mutants = suite.mutants
    if args.only:
        unknown = set(args.only) - {m.id for m in suite.mutants}
        if unknown:
            sys.exit(f"unknown mutant id(s): {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m.id in args.only]
    if args.file == SHARED:
        mutants = [m for m in mutants if m.file == SHARED]
    elif args.file:
        sources = {name: (ROOT / name).read_text() for name in suite.files}
        mutants = [m for m in mutants if args.file in touched_files(m, sources)]
    return mutants


def calling_tests(calls: dict[str, set[tuple[str, str]]], files: list[str], function: str) -> list[str]:
    """The tests that call `function` in one of `files` (all of them if it is called while collecting); the run's
    order is kept, so a file's own unit tests come first."""
    hit = {(name, function) for name in files}
    if hit & calls[""]:
        return [test for test in calls if test]
    return [test for test, called in calls.items() if test and hit & called]


def short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def print_row(result: Result) -> None:
    names = [Path(f).name.removesuffix("_async.py").removesuffix(".py") for f in result.files]
    where = SHARED if result.mutant.file == SHARED else ", ".join(names)
    status = result.status + (" (equivalent)" if result.mutant.equivalent else "")
    killed_by = result.killed_by.split("::")[-1] if result.killed_by else ""
    line = f"{result.mutant.id:4} {where:10} {result.mutant.function:30} {status:22} {result.tests:5} "
    print(line + f"{result.seconds:6.1f}s  {short(killed_by, 60)}", flush=True)


def main(argv: list[str] | None = None, suite: Suite = METHOD, doc: str = __doc__) -> int:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    files = [*suite.files, SHARED] if suite is METHOD else list(suite.files)
    parser.add_argument("--file", choices=files, help="only the mutants applied to this file (or shared)")
    parser.add_argument("--only", nargs="+", metavar="ID", help="only these mutants (ids as in --list)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes (default: cores)")
    parser.add_argument(
        "--min_score", type=float, default=90.0, help="exit 1 below this share of non-equivalent mutants killed (%%)"
    )
    parser.add_argument("--list", action="store_true", help="print the mutants and run nothing")
    args = parser.parse_args(argv)
    mutants = selected(args, suite)
    if args.list:
        for m in mutants:
            flag = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.id:4} {m.file:19} {m.function:30} {m.original!r} -> {m.replacement!r}  ({m.note}){flag}")
        return 0

    started = time.perf_counter()
    scratch = Path(tempfile.mkdtemp(prefix="mutation-check-"))
    workers: list[Worker] = []
    results: list[Result] = []
    try:
        copies = [scratch / f"copy{i}" for i in range(max(1, min(args.workers, len(mutants))))]
        copy_repository(ROOT, copies[0])  # every worker copies the same snapshot
        for copy in copies[1:]:
            shutil.copytree(copies[0], copy, symlinks=True)
        sources = {name: (copies[0] / name).read_text() for name in suite.files}
        jobs = [(m, mutated_sources(m, sources)) for m in mutants]  # any fragment that no longer matches: fail now
        threads = max(1, len(os.sched_getaffinity(0)) // len(copies))
        workers = [Worker(copy, threads, suite) for copy in copies]
        for w in workers:
            w.start()

        # the baseline: every test passes without a mutant, and which method functions each one calls
        baseline_tests = suite.tests
        code, failed, baseline, calls = workers[0].run({}, baseline_tests, timeout=3600, record=True)
        if code != 0:
            output = (workers[0].root / "pytest.log").read_text()[-3000:]
            print(
                f"the tests fail without any mutant (exit code {code}): {', '.join(failed)}; pytest's output:\n{output}"
            )
            return 2
        timeout = 3 * baseline + 60
        print(f"baseline: {len(calls) - 1} tests pass in {baseline:.0f} s ({' '.join(baseline_tests)}),")
        print("and which of the mutated files' functions each one calls is recorded")
        print(f"each mutant runs the tests that call its function, for at most {timeout:.0f} s\n")
        print(f"{'id':4} {'file':10} {'function':30} {'result':22} {'tests':>5} {'time':>7}  killed by")

        todo: queue.Queue = queue.Queue()
        for job in jobs:
            todo.put(job)
        lock = threading.Lock()

        def drain(w: Worker) -> None:
            while True:
                try:
                    mutant, mutated = todo.get_nowait()
                except queue.Empty:
                    return
                files = list(mutated)
                tests = calling_tests(calls, files, mutant.function)
                unrecorded = suite.unrecorded.get((mutant.file, mutant.function), [])
                tests += [test for test in unrecorded if test not in tests]
                if not tests:
                    code, failed, seconds = 0, [], 0.0
                else:
                    code, failed, seconds, _ = w.run(mutated, tests, timeout)
                if code is None:
                    status = "timeout" if not failed else "error"
                elif code == 0:
                    status = "survived"
                elif failed:
                    status = "killed"
                else:
                    status = "error"
                log = (w.root / "pytest.log").read_text()[-3000:] if status == "error" else ""
                result = Result(mutant, files, status, seconds, len(tests), failed[0] if failed else "", log)
                with lock:
                    results.append(result)
                    print_row(result)

        drainers = [threading.Thread(target=drain, args=(w,)) for w in workers]
        for t in drainers:
            t.start()
        for t in drainers:
            t.join()
    finally:
        for w in workers:
            w.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    order = {m.id: i for i, m in enumerate(suite.mutants)}
    results.sort(key=lambda r: order[r.mutant.id])
    scored = [r for r in results if not r.mutant.equivalent]
    killed = [r for r in scored if r.status in ("killed", "timeout")]
    survivors = [r for r in scored if r.status == "survived"]
    errors = [r for r in results if r.status == "error"]
    wrong_equivalents = [r for r in results if r.mutant.equivalent and r.status != "survived"]
    if survivors:
        print("\nsurvivors (tests: how many call the function):")
        for r in survivors:
            change = f"{short(r.mutant.original, 70)!r} -> {short(r.mutant.replacement, 70)!r}"
            print(f"  {r.mutant.id} {r.mutant.function} ({r.tests} tests): {change}  ({r.mutant.note})")
    for r in wrong_equivalents:
        print(f"\n{r.mutant.id} is marked equivalent but was {r.status}: its reason is wrong ({r.mutant.equivalent})")
    for r in errors:
        print(
            f"\n{r.mutant.id}: the check itself failed ({r.killed_by or 'no test failed'}); pytest's output:\n{r.log}"
        )
    share = 100.0 * len(killed) / len(scored) if scored else 100.0
    elapsed = time.perf_counter() - started
    equivalent = len(results) - len(scored)
    print(f"\nkilled {len(killed)} of {len(scored)} non-equivalent ({share:.1f} %), {equivalent} equivalent")
    print(f"{len(results)} mutants in {elapsed / 60:.1f} min on {len(workers)} worker(s)")
    if errors or wrong_equivalents:
        return 2
    return 0 if share >= args.min_score else 1


if __name__ == "__main__":
    sys.exit(main())
