"""Asynchronous online DPO (Noukhovitch et al., "Asynchronous RLHF", 2024) in one file.

A vLLM engine, driven by a generation thread, samples the next batches from a policy at most `async_level`
updates old while the trainer (accelerate) learns on the current one. The file reads top to bottom: the
arguments; online DPO itself (its pairs, loss, update, metrics and FLOPs); `main()`, the training loop; then,
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

    # batch sizes (in prompts; each gets num_samples completions)
    # completions sampled over the run, which sets its number of steps: a multiple of the completions per
    # step, local_micro_batch_size x gradient_accumulation_steps x num_mini_batches x processes x num_samples
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
    num_samples: int = 2  # K completions per prompt; DPO pairs the best and the worst (paper section 4.2)
    # sampling temperature (gsm8k evaluates greedily); the trainer's logprobs divide the logits by it too
    temperature: float = 0.7

    # online DPO
    beta: float = 0.1  # DPO beta: strength of the implicit KL regularisation
    # sigmoid: DPO; ipo: IPO; best_of_k_sft: SFT on the best of K samples (the paper's Best-of-2 baseline)
    loss_type: Literal["sigmoid", "ipo", "best_of_k_sft"] = "sigmoid"
    missing_eos_penalty: float = -3.0  # score of a completion without EOS (not gsm8k: its table 10 has none)

    # evaluation
    eval_freq: int = 25  # evaluate every this many steps, at step 0 and at the end (0: at those two only)
    # eval completions printed and logged as a table at each evaluation (0: none)
    num_sample_completions: int = 4


# The domains of this algorithm's own numeric flags.
ALGORITHM_DOMAINS = {
    "num_samples": (">= 2", "DPO needs a best and a worst completion"),
    "beta": ("> 0", "0 learns nothing, < 0 learns to prefer the rejected completion"),
}


if __name__ == "__main__":  # --help answers here, before torch, transformers and vLLM load (seconds)
    plumbing.help_if_asked(Args, __doc__)

import numpy as np  # noqa: E402 (this and the imports below load after --help)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402


# == Online DPO (paper eq. 2): the pairs, the loss, the update ===============================================
ROLLOUT_LOGPROBS = False  # DPO's loss needs no logprobs of the engine's


def completions_per_prompt(args: Args) -> int:
    return args.num_samples


def select_chosen_rejected(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (prompts, K) -> chosen = first highest, rejected = last lowest, and `tied` where all K scores
    are equal: such a prompt carries no preference (dpo_batch_loss)."""
    chosen = scores.argmax(1)  # first maximal index
    rejected = scores.shape[1] - 1 - scores.flip(1).argmin(1)  # last minimal index
    return chosen, rejected, scores.max(1).values == scores.min(1).values


def preference_pairs(batch: Batch, scores: torch.Tensor, K: int) -> tuple[Batch, torch.Tensor]:
    """B prompts x K completions -> 2B rows, prompt i's chosen at row i, its rejected at B + i; and `tied`."""
    chosen, rejected, tied = select_chosen_rejected(scores.view(-1, K))
    first = torch.arange(len(tied), device=scores.device) * K  # each prompt's first completion
    return batch.rows(torch.cat([first + chosen, first + rejected])), tied


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float, loss_type: str):
    """Per-pair loss on summed sequence logprobs, h = (logp_c - ref_c) - (logp_r - ref_r): sigmoid =
    -log sigmoid(beta h) (DPO; its beta is the strength of the implicit KL term), ipo = (h - 1/(2 beta))^2."""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown --loss_type {loss_type}")


def dpo_batch_loss(per_pair: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the untied pairs' losses summed, divided by ALL its pairs. Dividing by the untied
    ones only would multiply the step by up to 10x as the policy converges (60-90 % of the tiny task's pairs
    tie); so an informative pair weighs lr / B whatever the tie fraction, as a tied prompt counts in RLOO's
    and PPO's means."""
    return (per_pair * (~tied).float()).sum() / len(per_pair)


def dpo_update(model, optimizer, accelerator, pairs: Batch, ref_logps, tied, args: Args, sizes, shuffle):
    """T epochs over the B pairs (rows i and B + i: chosen and rejected), each epoch N mini-batches, each
    accumulated from micro-batches. Returns the step's statistics."""
    B, micro, mini = sizes.local_batch_size, args.local_micro_batch_size, sizes.local_mini_batch_size
    stats = {k: [] for k in ("loss", "logps_chosen", "logps_rejected", "kl", "entropy", "accuracy", "margin")}
    model.train()
    for epoch in range(args.num_ppo_epochs):
        order = torch.as_tensor(shuffle.permutation(B), device=accelerator.device)
        for mini_start in range(0, B, mini):
            for micro_start in range(mini_start, mini_start + mini, micro):
                idx = order[micro_start : micro_start + micro]
                with accelerator.accumulate(model):
                    logps = response_logprobs(model, pairs.rows(torch.cat([idx, idx + B])), args.temperature)
                    logps_c, logps_r = logps.sum(1).chunk(2)
                    ref_c, ref_r = ref_logps[idx], ref_logps[idx + B]
                    if args.loss_type == "best_of_k_sft":
                        per_pair = -logps_c / pairs.response_mask[idx].sum(1).clamp(min=1)
                    else:
                        per_pair = dpo_loss(logps_c, logps_r, ref_c, ref_r, args.beta, args.loss_type)
                    loss = dpo_batch_loss(per_pair, tied[idx])
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm is not None:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    margin = args.beta * ((logps_c - ref_c) - (logps_r - ref_r))
                    stats["loss"].append(loss.detach())
                    stats["logps_chosen"].append(logps_c.detach().mean())
                    stats["logps_rejected"].append(logps_r.detach().mean())
                    if epoch == 0:  # the policy as it meets this data for the first time
                        stats["kl"].append(((logps_c - ref_c) + (logps_r - ref_r)).detach().mean() / 2)
                        stats["entropy"].append(-(logps_c + logps_r).detach().mean() / 2)
                    stats["accuracy"].append((margin > 0).float().mean())
                    stats["margin"].append(margin.mean())
    return {k: torch.stack(v).mean() for k, v in stats.items()}


def dpo_metrics(step: int, version: int, sizes: Sizes, lr: float, reduced: dict, beta: float) -> dict:
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
        "objective/non_score_reward": -beta * reduced["kl"],
        "objective/rlhf_reward": reduced["scores"] - beta * reduced["kl"],
        "val/num_eos_tokens": reduced["num_eos_tokens"],
        "val/tied_pairs": reduced["tied"],
        "loss/policy": reduced["loss"],
        "logps/chosen": reduced["logps_chosen"],
        "logps/rejected": reduced["logps_rejected"],
        "rewards/accuracies": reduced["accuracy"],
        "rewards/margins": reduced["margin"],
    }


def step_flops(policy, models: Models, sizes: Sizes, args: Args) -> dict[str, int]:
    """The FLOPs of each phase of a step, per process (model FLOP utilisation: benchmark/timing.py)."""
    R = args.response_length
    L = args.max_prompt_length + R
    B = sizes.local_batch_size
    # a training pass is a forward and a backward (2 forwards), and one more forward with recomputation
    passes = (4 if args.gradient_checkpointing else 3) * args.num_ppo_epochs
    flops = plumbing.forward_flops
    return {
        "scoring": 0 if models.reward_model is None else flops(models.reward_model, B * args.num_samples, L),
        "reference": flops(models.ref_policy, 2 * B, L, R + 1),  # the pairs' chosen and rejected
        "update": passes * flops(policy, 2 * B, L, R + 1),
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

    B, K = sizes.local_batch_size, args.num_samples
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

            # 2. score: the reward model on query + response, a fixed score without EOS; or GSM8k's verifier
            references = [inputs.train.references[i] for i in indices for _ in range(K)]  # one per completion
            with accelerator.autocast():
                scores = score_batch(batch, references, models, args)
            processes.check_scores(scores, models.scorer, step)  # a NaN or inf score stops every process
            laps.lap("scoring")

            # 3. pairs: best and worst of K (paper section 4.2), and their reference logprobs
            pairs, tied = preference_pairs(batch, scores, K)
            with accelerator.autocast():
                ref_logps = batch_logprobs(models.ref_policy, pairs, args.temperature, bs).sum(1)
            laps.lap("reference")

            # 4. update: T epochs over N mini-batches, each accumulated from micro-batches
            stats = dpo_update(model, optimizer, accelerator, pairs, ref_logps, tied, args, sizes, shuffle)
            laps.lap("update")

            # 5. send theta_{step+1} to the engine if a later batch or an evaluation needs it (all gather)
            if step + 1 in to_publish and (weights := snapshots.take(model, step + 1)):
                channel.weights.put(weights)
            laps.lap("snapshot")

            # 6. log the statistics averaged over the processes
            stats |= {"scores": scores.mean(), "num_eos_tokens": batch.contain_eos.float().mean()}
            stats |= {"tied": tied.float().mean(), "response_tokens": batch.response_mask.sum().float()}
            reduced = processes.mean(stats, step, folder.last_checkpoint)
            lr = scheduler.get_last_lr()[0]
            metrics = dpo_metrics(step, rollout.version, sizes, lr, reduced, args.beta) | spans
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
