"""Asynchronous PPO (Noukhovitch et al., "Asynchronous RLHF", 2024; details as in "The N Implementation Details of
RLHF with PPO") in one file.

A vLLM engine, driven by a generation thread, samples the next batches from a policy at most `async_level` updates
old while the trainer (accelerate) learns on the current one. The method reads top to bottom: arguments; checks of
the inputs; data; models and rewards; evaluation; the async schedule and the generation thread; the weight push;
PPO's rewards, advantages, losses and update; `main()`, the training loop. The plumbing that is not the method (the engine's processes,
signals, run folder, checkpoints, logging) is in plumbing.py. Flags, metrics and the schedule: README.md and docs/.
"""

import math
import os
import queue
import re
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list
from datasets import load_dataset
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, set_seed

import plumbing
from plumbing import UsageError

if TYPE_CHECKING:  # vLLM is imported where the engine is used: --help and a bad flag need not wait for it (4 s)
    from vllm import LLM

TINY_TASK = Path(__file__).resolve().parent / "benchmark" / "tiny_task"
# The dataset columns each --task reads (docs/tasks.md).
TASK_COLUMNS = {
    "tiny": ["query", "reference_response"],
    "tldr": ["query", "reference_response"],
    "no_robots": ["messages"],
    "gsm8k": ["question", "answer"],
}
# GSM8k's prompt: the format the paper's policy (Rho-1B SFT on GSM8k, after Kazemnejad et al. 2024) was tuned on.
GSM8K_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
# GSM8k's final answer, as OpenAI's grade-school-math checker (the paper's verifier) reads it: the first match.
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


# == Arguments ========================================================================================================
@dataclass
class Args:
    # run
    exp_name: str = "ppo_async"  # name of the experiment: runs are named <exp_name>__<seed>__<unix time>
    seed: int = 1  # seed of the prompt order, the sampling and the initialisation: same seed and flags, same run
    # the run's folder: metrics, TensorBoard logs, checkpoints, final policy (None: runs/<run name>)
    output_dir: str | None = None
    track: bool = False  # also log to Weights & Biases (WANDB_MODE=offline on machines without network)
    wandb_project: str = "async-rlhf"  # Weights & Biases project, with --track
    wandb_entity: str | None = None  # Weights & Biases team or user, with --track (None: wandb's default for you)
    # in minutes: how long a training process waits for the others in a collective before failing (ranks 1..N wait
    # while rank 0 starts the engine, which compiles on a GPU, and generates the first batch)
    collective_timeout_minutes: float = 60.0

    # data and models (local folders or files, or hub ids)
    task: Literal["tiny", "tldr", "no_robots", "gsm8k"] = "tiny"  # prompt format, reward and evaluation (docs/tasks.md)
    # the prompts: a hub dataset id, a local dataset folder, or a .jsonl/.json/.parquet file
    dataset_name: str = str(TINY_TASK / "data")
    dataset_config: str | None = None  # the dataset's config, e.g. `main` for openai/gsm8k (None: its default)
    dataset_train_split: str = "train"  # split whose prompts are trained on
    dataset_eval_split: str = "test"  # split whose prompts (and reference responses) are evaluated on
    num_eval_prompts: int | None = None  # evaluate on the first this many prompts of the eval split (None: all)
    sft_model_path: str = str(TINY_TASK / "sft")  # initial policy, also the frozen reference policy
    # proxy reward model trained on (a one-label sequence classifier); also the value model's start (gsm8k: none, the
    # value model starts from the SFT policy)
    reward_model_path: str = str(TINY_TASK / "reward")
    # evaluation-only judge: `tiny` (the tiny task's exact scorer; no other task) or a reward model (not gsm8k, which
    # its verifier judges)
    gold_judge: str = "tiny"
    trust_remote_code: bool = False  # allow model repositories to run their own code
    max_prompt_length: int = 12  # in tokens: longer prompts are dropped (how many is printed)
    # in tokens: the most a completion generates (one cut there has no EOS: --missing_eos_penalty)
    response_length: int = 12

    # batch sizes (in prompts; each gets one completion)
    # completions sampled over the run, which sets its number of steps: a multiple of the completions per step,
    # local_micro_batch_size x gradient_accumulation_steps x num_mini_batches x processes
    total_episodes: int = 12800
    local_micro_batch_size: int = 32  # prompts per forward/backward pass on one process
    gradient_accumulation_steps: int = 1  # micro-batches accumulated into one optimizer step
    num_mini_batches: int = 1  # N: mini-batches per step's batch, an optimizer step each (paper section 3.2)
    num_ppo_epochs: int = 1  # T: passes over each step's batch (paper section 4.1)
    # sequences per no-grad forward on one process (reward, reference, old logprobs and values)
    local_rollout_forward_batch_size: int = 64

    # optimisation
    learning_rate: float = 1e-4  # AdamW's initial learning rate of the policy and the value model (see --lr_schedule)
    # linear: to 0 over the run's optimizer steps (the paper's TLDR, No Robots); constant: GSM8k's (table 10)
    lr_schedule: Literal["linear", "constant"] = "linear"
    # AdamW as the paper's code builds it (transformers' Trainer, its TrainingArguments defaults): betas (0.9, 0.999)
    adam_epsilon: float = 1e-8  # AdamW's epsilon
    # AdamW's decoupled weight decay (0: none, the paper's); biases and normalisation weights never decay
    weight_decay: float = 0.0
    # the gradients' global norm is clipped to it before each optimizer step (None: no clipping); the paper's runs
    # clipped at 1.0 (DeepSpeed's, as accelerate fills its config)
    max_grad_norm: float | None = 1.0

    # generation and the engine
    # k: step n trains on completions sampled by policy version max(0, n - k), k steps old; 0: on-policy (synchronous)
    async_level: int = 1
    # sampling temperature (gsm8k evaluates greedily); the trainer's logprobs divide the logits by it too
    temperature: float = 0.7
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the engine's weights (auto: --dtype's)
    # GPU of the engine: separate = the one after the N training GPUs (the paper's split), shared = rank 0's,
    # within --vllm_gpu_memory_utilization; auto = separate when N + 1 GPUs are visible (docs/gpus.md)
    vllm_placement: Literal["auto", "separate", "shared"] = "auto"
    # the engine's share of its GPU's memory (None: the largest the run leaves, at most 0.9 of a GPU of its own and
    # 0.3 of a shared one; printed at start)
    vllm_gpu_memory_utilization: float | None = None
    vllm_enforce_eager: bool = False  # run the engine without CUDA graphs (always so on CPUs)

    # trainer numerics and memory
    # policy/value/reference/reward/gold dtype (auto: bfloat16 on GPUs): bf16 autocast over fp32 weights for the
    # policy, the value model and the reference, bf16 weights for the reward and gold models
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~1/3 more compute

    # PPO
    # beta of the per-token reward -beta (log pi_old - log pi_ref), the initial one with --adaptive_kl (0: no KL
    # penalty)
    kl_coef: float = 0.05
    adaptive_kl: bool = False  # adapt kl_coef after each step so the KL tracks kl_target (Ziegler et al. 2019)
    kl_target: float = 6.0  # --adaptive_kl: target of the sequence KL sum_t (log pi_old - log pi_ref)
    kl_horizon: int = 10000  # --adaptive_kl: horizon in episodes of the controller (docs/algorithms.md)
    gamma: float = 1.0  # discount factor of the per-token rewards
    lam: float = 0.95  # lambda of generalised advantage estimation (GAE)
    # whiten the per-token rewards over the batch, mean kept, before GAE (N details, policy #9)
    whiten_rewards: bool = False
    cliprange: float = 0.2  # PPO's epsilon: the per-token probability ratio is clipped to [1 - eps, 1 + eps]
    cliprange_value: float = 0.2  # new values are clipped to old value +- cliprange_value in the value loss
    vf_coef: float = 0.1  # weight of the value loss: loss = pg_loss + vf_coef * vf_loss
    # pi_old of the ratio. trainer: theta_n, the trainer's weights at the top of step n, as the paper's code computes it;
    # at N = T = 1 every ratio is then exactly 1 and nothing corrects for a batch that theta_(n-k) generated. engine:
    # also weight each token by min(pi_old / pi_engine, tis_cap), pi_engine the policy that generated the batch
    old_logprobs: Literal["trainer", "engine"] = "trainer"
    tis_cap: float = 2.0  # --old_logprobs engine: cap of the per-token importance weight exp(trainer_old - engine)
    missing_eos_penalty: float = -3.0  # score of a completion without EOS (not gsm8k: its table 10 has none)

    # evaluation and checkpoints
    eval_freq: int = 25  # evaluate every this many steps, and at step 0 and at the end (0: at step 0 and the end only)
    # checkpoint every this many steps (0: none on a schedule; one is also written on SIGTERM / Ctrl-C)
    save_freq: int = 0
    # the checkpoints kept, the newest; older ones are deleted (never the newest, which --resume reads)
    keep_checkpoints: int = 3
    resume: bool = False  # continue the run in --output_dir from its newest checkpoint (none there: start over)
    num_sample_completions: int = 4  # eval completions printed and logged as a table at each evaluation (0: none)


class Sizes(NamedTuple):
    world_size: int
    local_mini_batch_size: int
    mini_batch_size: int
    local_batch_size: int
    batch_size: int
    episodes_per_step: int
    num_steps: int


# The domain of every numeric flag, checked before any model loads (plumbing.check_domains): flag -> (domain, why).
FLAG_DOMAINS = {
    "seed": (">= 0", "numpy's generators take no negative seed"),
    "collective_timeout_minutes": ("> 0", "a time to wait"),
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
    "temperature": ("> 0", "logprobs divide logits by it"),
    "vllm_gpu_memory_utilization": ("in (0, 1]", "a share of the GPU"),
    "missing_eos_penalty": ("finite", "a score"),
    "eval_freq": (">= 0", "0 evaluates at step 0 and at the end only"),
    "save_freq": (">= 0", "0 writes no periodic checkpoint"),
    "keep_checkpoints": (">= 1", "the latest checkpoint is the one a resume needs"),
    "num_sample_completions": (">= 0", "a count of completions"),
}

# The domains of this algorithm's flags (with FLAG_DOMAINS).
ALGORITHM_DOMAINS = {
    "kl_coef": (">= 0", "< 0 would reward moving away from the reference"),
    "kl_target": ("> 0", "the adaptive controller divides by it"),
    "kl_horizon": (">= 1", "a count of episodes the controller divides by"),
    "gamma": ("in [0, 1]", "a discount"),
    "lam": ("in [0, 1]", "GAE's lambda"),
    "cliprange": ("> 0", "the ratio is clipped to [1 - eps, 1 + eps]"),
    "cliprange_value": ("> 0", "values are clipped to old value +- it"),
    "vf_coef": ("> 0", "0 would never train the value model that GAE reads"),
    "tis_cap": (">= 1", "a token of the trainer's own policy has weight 1"),
}


def completions_per_prompt(args: Args) -> int:
    return 1


def compute_sizes(args: Args, world_size: int) -> Sizes:
    """Check every flag's domain and derive every batch size; errors name the flags to change."""
    plumbing.check_domains(asdict(args), FLAG_DOMAINS | ALGORITHM_DOMAINS)
    samples = completions_per_prompt(args)
    local_mini_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    local_batch_size = local_mini_batch_size * args.num_mini_batches
    episodes_per_step = local_batch_size * world_size * samples
    if args.total_episodes % episodes_per_step != 0 or args.total_episodes < episodes_per_step:
        raise UsageError(
            f"--total_episodes {args.total_episodes} must be a positive multiple of the episodes per step, "
            f"{episodes_per_step} = local_micro_batch_size {args.local_micro_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x num_mini_batches {args.num_mini_batches} x processes {world_size} "
            f"x {samples} completions per prompt; change --total_episodes or one of those flags"
        )
    num_steps = args.total_episodes // episodes_per_step
    mini_batches = (
        local_mini_batch_size,
        local_mini_batch_size * world_size,
        local_batch_size,
        local_batch_size * world_size,
    )
    return Sizes(world_size, *mini_batches, episodes_per_step, num_steps)


def lr_factor(schedule: str, step: int, num_steps: int) -> float:
    """The learning rate of step `step`'s N x T updates (0-indexed) over --learning_rate: linear decay to 0, or
    constant. As the paper's loops, which step their schedule once per batch, at its top (e.g. their
    src/online_dpo_vllm_trainer.py:334-337, num_training_steps = batches at :169): step n trains at
    1 - (n + 1) / num_steps, the last step at 0."""
    return 1.0 if schedule == "constant" else 1.0 - (step + 1) / num_steps


def make_optimizer(model: torch.nn.Module, args: Args) -> torch.optim.AdamW:
    """AdamW as the paper's code builds it (transformers' Trainer.create_optimizer): torch's betas, --adam_epsilon,
    --weight_decay on every trained weight but the biases and the normalisation layers' weights."""
    norms = {name for name, module in model.named_modules() if type(module).__name__.endswith(("LayerNorm", "RMSNorm"))}
    decays = {True: [], False: []}
    for name, p in model.named_parameters():
        if p.requires_grad:
            decays["bias" not in name and name.rpartition(".")[0] not in norms].append(p)
    groups = [{"params": decays[True], "weight_decay": args.weight_decay}, {"params": decays[False], "weight_decay": 0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, eps=args.adam_epsilon)


# == Checks of every flag and input, before any model loads ===========================================================
class Inputs(NamedTuple):
    sizes: Sizes
    checkpoint: str | None  # to resume from
    placement: plumbing.Placement  # the engine's GPU
    tokenizer: object
    reward_tokenizer: object | None
    train: "Prompts"
    evaluation: "Prompts"


def check_inputs(args: Args, accelerator: Accelerator, output_dir: str, on_gpu: bool) -> Inputs:
    """Every check of the flags and input files, and the engine's GPU placement, before any model loads: a bad one is
    a UsageError naming the flag. Exits (0) on --resume of a finished run."""
    sizes = compute_sizes(args, accelerator.num_processes)
    if args.resume and args.output_dir is None:
        raise UsageError("--resume needs --output_dir, the folder of the run to continue")
    checkpoint = plumbing.checkpoint_to_resume(output_dir, asdict(args), args.resume, sizes.world_size)
    gpus = plumbing.visible_gpus() if on_gpu else []
    memory = args.vllm_gpu_memory_utilization
    placement = plumbing.engine_placement(args.vllm_placement, gpus, accelerator.num_processes, memory)
    if args.task == "gsm8k" and args.gold_judge != "tiny":
        raise UsageError(
            f"--gold_judge {args.gold_judge}: --task gsm8k is evaluated by its verifier (eval/pass@1), not by a gold reward model"
        )
    lengths, remote = (args.max_prompt_length, args.response_length), args.trust_remote_code
    plumbing.check_model(args.sft_model_path, "--sft_model_path", lengths, remote)
    if args.task != "gsm8k":  # GSM8k's verifier needs no reward model
        plumbing.check_model(args.reward_model_path, "--reward_model_path", lengths, remote, reward=True)
    if args.gold_judge != "tiny":
        plumbing.check_model(args.gold_judge, "--gold_judge", lengths, remote, reward=True)
    tokenizer = plumbing.load_tokenizer(args.sft_model_path, "--sft_model_path", remote)
    reward_tokenizer = None
    if args.task != "gsm8k":
        reward_tokenizer = plumbing.load_tokenizer(args.reward_model_path, "--reward_model_path", remote)
    task = dict(task=args.task, config=args.dataset_config)
    train = load_prompts(args.dataset_name, args.dataset_train_split, tokenizer, args.max_prompt_length, **task)
    evaluation = load_prompts(
        args.dataset_name, args.dataset_eval_split, tokenizer, args.max_prompt_length, args.num_eval_prompts, **task
    )
    if len(train.token_ids) < sizes.batch_size:
        raise UsageError(
            f"{len(train.token_ids)} training prompts cannot fill one batch of {sizes.batch_size} prompts; lower the batch sizes"
        )
    return Inputs(sizes, checkpoint, placement, tokenizer, reward_tokenizer, train, evaluation)


# == Data: prompts, batches ===========================================================================================
def load_split(name: str, split: str, config: str | None = None):
    """A split from a hub id, a local dataset folder (its README declares its configs, as on the hub) or one file."""
    plumbing.check_local(name, "--dataset_name")
    if os.path.isfile(name):
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
        if Path(name).suffix not in builders:
            raise UsageError(f"--dataset_name {name}: a single file must be one of {', '.join(builders)}")
        if config is not None:
            raise UsageError(f"--dataset_config {config}: the single file --dataset_name {name} has no configs")
        return load_dataset(builders[Path(name).suffix], data_files={split: name}, split=split)
    try:
        return load_dataset(name, config, split=split)
    except (FileNotFoundError, ValueError) as exc:  # no such dataset / config / split: say which flag
        lines = str(exc).strip().splitlines()
        detail = " ".join(lines[:2]) if lines[0].startswith("Config name is missing") else lines[0]  # 2nd: the configs
        raise UsageError(
            f"--dataset_name {name}{f' --dataset_config {config}' if config else ''} split {split}: {detail}"
        ) from exc


class Prompts(NamedTuple):
    token_ids: list[list[int]]  # unpadded
    queries: list[str]
    references: list[str]


def task_prompts(dataset, task: str, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """The prompt text the policy sees and the reference answer of every row, in the format of --task."""
    if task == "gsm8k":
        answers = list(dataset["answer"])
        if unlabelled := [i for i, answer in enumerate(answers) if gsm8k_answer(answer) is None]:
            raise UsageError(
                f"{where}: {len(unlabelled)} `answer`(s) without a '#### <number>' final answer (row {unlabelled[0]}): not GSM8k's format"
            )
        return [GSM8K_PROMPT.format(question=question) for question in dataset["question"]], answers
    if task == "no_robots":
        if tokenizer.chat_template is None:
            raise UsageError(
                f"--task no_robots writes prompts with the policy's chat template, and the tokenizer of --sft_model_path {tokenizer.name_or_path} has none"
            )
        prompts, references = [], []
        for i, messages in enumerate(dataset["messages"]):
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise UsageError(
                    f"{where}: row {i}'s `messages` do not end with an assistant turn after the prompt (the reference answer)"
                )
            # the conversation before the final assistant turn, ending with the header of the assistant's turn
            prompts.append(tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
            references.append(messages[-1]["content"])
        return prompts, references
    return list(dataset["query"]), list(dataset["reference_response"])


def load_prompts(name, split, tokenizer, max_prompt_length: int, limit=None, task="tiny", config=None) -> Prompts:
    """The first `limit` prompts of a split in the format of --task; those over max_prompt_length tokens are dropped."""
    dataset = load_split(name, split, config)
    if missing := [column for column in TASK_COLUMNS[task] if column not in dataset.column_names]:
        raise UsageError(
            f"--dataset_name {name} split {split} lacks column(s) {missing} of --task {task}; it has {dataset.column_names}"
        )
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    queries, references = task_prompts(dataset, task, tokenizer, f"--dataset_name {name} split {split}")
    # A chat template writes the BOS token itself (Llama 3.1's does): encoding the text must not add a second one.
    token_ids = tokenizer(queries, add_special_tokens=task != "no_robots").input_ids
    keep = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_length]
    if len(keep) < len(token_ids):
        print(
            f"{split}: dropped {len(token_ids) - len(keep)} of {len(token_ids)} prompts longer than --max_prompt_length {max_prompt_length}"
        )
    if not keep:
        raise UsageError(f"no {split} prompt fits --max_prompt_length {max_prompt_length}")
    return Prompts(*([items[i] for i in keep] for items in (token_ids, queries, references)))


def prompt_indices_for_step(step: int, num_prompts: int, batch_size: int, seed: int) -> np.ndarray:
    """Each epoch is a fresh seeded permutation cut into full batches: every batch is trained on once per epoch."""
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


def first_true_indices(bools: torch.Tensor) -> torch.Tensor:
    """Index of the first True in each row; the row length where there is none."""
    row_len = bools.size(-1)
    return torch.where(bools, torch.arange(row_len, device=bools.device), row_len).min(-1).values


def truncate_responses(responses: list[list[int]], response_length: int, eos_token_id: int, pad_token_id: int):
    """Pad completions to `response_length` and cut everything after the first EOS. Returns ids, mask (1 up to and
    including the first EOS) and whether each ended with EOS."""
    ids = torch.full((len(responses), response_length), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(responses):
        seq = seq[:response_length]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    lengths = torch.tensor([min(len(seq), response_length) for seq in responses])
    eos_index = first_true_indices(ids == eos_token_id)
    contain_eos = eos_index < lengths
    lengths = torch.where(contain_eos, eos_index + 1, lengths)
    mask = (torch.arange(response_length)[None, :] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad_token_id), mask, contain_eos


class Batch(NamedTuple):
    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    contain_eos: torch.Tensor


def to_batch(prompts: list[list[int]], responses: list[list[int]], repeat: int, args: Args, tokenizer, device) -> Batch:
    """Prompts (each repeated for its `repeat` consecutive completions) and completions as padded tensors."""
    query_ids, query_mask = left_pad(prompts, args.max_prompt_length, tokenizer.pad_token_id)
    response = truncate_responses(responses, args.response_length, tokenizer.eos_token_id, tokenizer.pad_token_id)
    query = (t.repeat_interleave(repeat, 0) for t in (query_ids, query_mask))
    return Batch(*(t.to(device) for t in (*query, *response)))


# == Models: logprobs, rewards, FLOPs =================================================================================
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


def response_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """Per-token logprobs of the responses, logits divided by the sampling temperature (N details, policy #1); 0
    after EOS."""
    input_ids, mask = torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1)
    # only the logits that predict the response: over a 50k vocabulary the others would be the largest tensor
    keep = response_ids.shape[1] + 1
    logits = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask), logits_to_keep=keep
    ).logits
    logits = logits[:, :-1].float() / temperature
    logprobs = logits.gather(2, response_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return logprobs * response_mask


@torch.no_grad()
def batch_logprobs(model, batch: Batch, temperature: float, batch_size: int) -> torch.Tensor:
    """Per-token logprobs of a batch's responses, in no-grad forward passes of `batch_size` sequences."""
    parts = [[t[i : i + batch_size] for t in batch[:4]] for i in range(0, len(batch.query_ids), batch_size)]
    return torch.cat([response_logprobs(model, *part, temperature) for part in parts])


def get_reward(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score at the last real token, from the backbone: padding on either side (and pad == EOS) cannot
    move the read-out position."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask)).last_hidden_state
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    head = model.score if hasattr(model, "score") else model.classifier
    return head(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1).float()


class Models(NamedTuple):
    """The frozen models and the tokenizers (GSM8k has no reward model; only rank 0 holds a gold judge)."""

    tokenizer: object
    ref_policy: torch.nn.Module
    reward_model: torch.nn.Module | None
    reward_tokenizer: object | None
    gold_model: torch.nn.Module | None
    gold_tokenizer: object | None


# == Rewards: the reward model, the missing-EOS penalty, GSM8k's verifier =============================================
def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a text; one that starts with the BOS token (a chat-templated prompt) does not get a second one."""
    has_bos = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
    return tokenizer(text, add_special_tokens=not has_bos).input_ids


@torch.no_grad()
def score_texts(model, tokenizer, texts: list[str], batch_size: int, device) -> torch.Tensor:
    """Score full texts with a reward model's own tokenizer (used when it differs from the policy's)."""
    scores = []
    for start in range(0, len(texts), batch_size):
        encoded = [encode_text(tokenizer, text) for text in texts[start : start + batch_size]]
        ids, mask = left_pad(encoded, max(len(ids) for ids in encoded), tokenizer.pad_token_id)
        scores.append(get_reward(model, ids.to(device), mask.to(device)))
    return torch.cat(scores)


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.bos_token_id == b.bos_token_id and a.eos_token_id == b.eos_token_id


@torch.no_grad()
def score_completions(reward_model, reward_tokenizer, policy_tokenizer, batch: Batch, bs: int) -> torch.Tensor:
    """Reward model on query + response. With another tokenizer, go through text: decode without special tokens,
    re-encode, and end with the reward model's EOS where the policy stopped."""
    if same_tokenizer(reward_tokenizer, policy_tokenizer):
        ids, mask = torch.cat(batch[0::2][:2], 1), torch.cat(batch[1::2][:2], 1)  # query + response ids, masks
        return torch.cat([get_reward(reward_model, ids[i : i + bs], mask[i : i + bs]) for i in range(0, len(ids), bs)])
    texts = []
    for q, qm, r, rm, eos in zip(*batch):
        text = policy_tokenizer.decode(torch.cat([q[qm.bool()], r[rm.bool()]]).tolist(), skip_special_tokens=True)
        texts.append(text + (reward_tokenizer.eos_token if eos else ""))
    return score_texts(reward_model, reward_tokenizer, texts, bs, batch.query_ids.device)


def apply_missing_eos_penalty(scores: torch.Tensor, contain_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    """A completion that did not end with EOS within response_length gets a fixed score (the paper's tables 4, 7)."""
    return torch.where(contain_eos, scores, torch.full_like(scores, penalty))


def gsm8k_answer(text: str) -> str | None:
    """A GSM8k solution's final answer as OpenAI's grade-school-math checker reads it: the FIRST match of
    `#### (-?[0-9.,]+)`, commas removed ("#### 1,020 dollars" -> "1020"); None without one. Nothing else is read
    or normalised: "####18" has no answer and "#### 18." reads "18." (docs/tasks.md)."""
    match = GSM8K_ANSWER.search(text)
    return None if match is None else match.group(1).replace(",", "")


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8k's verifier (paper section 5.2): 1.0 when the completion's answer is the label's, as strings, else 0.0."""
    predicted = gsm8k_answer(completion)
    return float(predicted is not None and predicted == gsm8k_answer(answer))


def verify_completions(
    tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor, answers: list[str]
) -> torch.Tensor:
    """GSM8k rewards of a batch: each completion decoded without special tokens, checked against its label."""
    texts = [
        tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(response_ids, response_mask)
    ]
    return torch.tensor(
        [gsm8k_reward(text, answer) for text, answer in zip(texts, answers)], device=response_ids.device
    )


def score_batch(batch: Batch, references: list[str], models: Models, args: Args) -> torch.Tensor:
    """Rewards of a batch: GSM8k's verifier (no missing-EOS penalty: table 10 has none), or the reward model on
    query + response with the missing-EOS penalty."""
    if args.task == "gsm8k":
        return verify_completions(models.tokenizer, batch.response_ids, batch.response_mask, references)
    rm = models.reward_model, models.reward_tokenizer, models.tokenizer
    scores = score_completions(*rm, batch, args.local_rollout_forward_batch_size)
    return apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty)


def check_scores(scores: torch.Tensor, source: str, step: int) -> None:
    """Stop on a NaN or infinite reward before it is paired or turned into advantages, naming the step and source."""
    if bad := (~torch.isfinite(scores)).nonzero().flatten().tolist():
        values = ", ".join(str(scores[i].item()) for i in bad[:4]) + (", ..." if len(bad) > 4 else "")
        raise RuntimeError(
            f"{source} gave nan/inf scores at step {step} ({len(bad)} of {len(scores)} completions: {values})"
        )


# == Evaluation: the gold judge's win rate, the KL proxy ==============================================================
@torch.no_grad()
def reference_perplexities(model, query_ids, query_mask, response_ids, response_mask) -> torch.Tensor:
    """Perplexity of each completion under the reference policy (temperature 1) over its tokens, EOS included: the
    paper's KL proxy (section 3.1) is their mean over the eval completions."""
    logprobs = response_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature=1.0)
    return torch.exp(-logprobs.sum(1) / response_mask.sum(1).clamp(min=1))


def tiny_gold_score(query: str, response: str) -> float:
    """Gold judge of the tiny task: 1.0 iff `response` is the query's words sorted, then "</s>". Quality q in [0, 1]
    = mean of: right word in the right place, F1 of the word multisets, fraction of adjacent output words in order.
    Score 2q - 1 if the response stopped with "</s>", else q - 1: a stopped answer more than half right wins."""
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


def win_rates(policy_gold: list[float], reference_gold: list[float]) -> list[float]:
    """1 when the policy's completion beats the reference under the gold judge, 1/2 on a tie."""
    return [1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy_gold, reference_gold)]


@torch.no_grad()
def evaluate(
    responses: list[list[int]], evaluation: Prompts, models: Models, args: Args, device
) -> tuple[dict, list[dict], list[str]]:
    """One evaluation (docs/metrics.md): the reference policy's perplexity on the completions (the KL proxy), their
    EOS rate and length; GSM8k's pass@1, or the proxy RM's score and, with a gold judge, the win rate against the
    references. Returns the metrics, the sample table's rows and the completions' text."""
    tokenizer, bs = models.tokenizer, args.local_rollout_forward_batch_size
    batch = to_batch(evaluation.token_ids, responses, 1, args, tokenizer, device)
    q_ids, q_mask, r_ids, r_mask, contain_eos = batch
    # with the EOS, as the judge reads it
    texts = [tokenizer.decode(r[m.bool()].tolist()) for r, m in zip(r_ids, r_mask)]
    parts = [slice(i, i + bs) for i in range(0, len(q_ids), bs)]
    metrics, extras, queries, references = {}, {}, evaluation.queries, evaluation.references
    if (args.task == "tiny" and args.gold_judge == "tiny") or models.gold_model is not None:
        if models.gold_model is None:
            policy_gold = [tiny_gold_score(q, t) for q, t in zip(queries, texts)]
            reference_gold = [tiny_gold_score(q, r) for q, r in zip(queries, references)]
        else:
            if args.task == "no_robots":  # a human answer ends as a completion that stopped (TLDR's carry their EOS)
                references = [r + tokenizer.eos_token for r in references]
            gold = models.gold_model, models.gold_tokenizer
            policy_gold = score_texts(*gold, [q + t for q, t in zip(queries, texts)], bs, device).tolist()
            reference_gold = score_texts(*gold, [q + r for q, r in zip(queries, references)], bs, device).tolist()
        metrics["eval/gold_score"] = float(np.mean(policy_gold))
        metrics["eval/win_rate"] = float(np.mean(win_rates(policy_gold, reference_gold)))
        extras = {"gold": [round(g, 3) for g in policy_gold], "reference_gold": [round(g, 3) for g in reference_gold]}
    if args.task == "gsm8k":
        correct = verify_completions(tokenizer, r_ids, r_mask, evaluation.references)
        metrics["eval/pass@1"] = correct.mean().item()
        extras = {"correct": correct.tolist()}
    perplexities = [reference_perplexities(models.ref_policy, q_ids[p], q_mask[p], r_ids[p], r_mask[p]) for p in parts]
    metrics["eval/ref_perplexity"] = torch.cat(perplexities).mean().item()
    if models.reward_model is not None:
        rm = models.reward_model, models.reward_tokenizer, tokenizer
        scores = torch.cat([score_completions(*rm, Batch(*(t[p] for t in batch)), bs) for p in parts])
        metrics["eval/scores"] = apply_missing_eos_penalty(scores, contain_eos, args.missing_eos_penalty).mean().item()
    metrics["eval/num_eos_tokens"] = contain_eos.float().mean().item()
    metrics["eval/response_length"] = r_mask.sum(1).float().mean().item()
    rows = [
        {"query": q, "response": t, "reference": r, **{k: v[i] for k, v in extras.items()}}
        for i, (q, t, r) in enumerate(zip(queries[: args.num_sample_completions], texts, evaluation.references))
    ]
    completions = [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(r_ids, r_mask)]
    return metrics, rows, completions


# == The async schedule: which policy version generates which batch (paper section 3) ================================
class Weights(NamedTuple):
    version: int
    flat: torch.Tensor  # every tensor of theta_version, one after the other (see snapshot_weights)
    layout: list[tuple[str, list[int], int]]  # (checkpoint name, shape, offset in `flat`)


class Rollout(NamedTuple):
    step: int
    version: int
    prompt_indices: np.ndarray
    responses: list[list[int]]  # the completions of each prompt, one after the other
    logprobs: list[list[float]] | None  # the engine's logprob of each response token (after temperature), if asked
    # generation, weight_sync and generator_wait (idle, waiting for the weights it needs) -> (start, seconds)
    timings: dict[str, tuple[float | None, float]]


class EvalRollout(NamedTuple):
    version: int
    responses: list[list[int]]
    generation_time: float
    generation_start: float


def generation_schedule(num_steps: int, async_level: int, eval_steps: list[int]) -> list[tuple[str, int, int]]:
    """The generator's work in order: (kind, index, policy version it needs). Rollout m is generated by version
    max(0, m - async_level); an evaluation of version v runs right after the last rollout that needs v, so the
    engine never goes back to an older version."""
    events = [("rollout", m, max(0, m - async_level)) for m in range(num_steps)]
    events += [("eval", v, v) for v in eval_steps]
    return sorted(events, key=lambda e: (e[2], e[0] == "eval", e[1]))


def published_versions(schedule: list[tuple[str, int, int]]) -> set[int]:
    """Versions the trainer must send to the engine (version 0 is loaded at start)."""
    return {version for _, _, version in schedule if version > 0}


def pending_events(
    schedule: list[tuple[str, int, int]], next_step: int, evals_logged: set[int]
) -> list[tuple[str, int, int]]:
    """The generator's work still owed to a trainer about to run `next_step`: later rollouts and the evaluations not
    yet logged. The policy versions they need are what a checkpoint must keep."""
    return [e for e in schedule if (e[1] >= next_step if e[0] == "rollout" else e[1] not in evals_logged)]


# == The generation thread: it drives the engine, one batch ahead of the trainer =====================================
class Channels(NamedTuple):
    weights: queue.Queue  # Weights, trainer -> generator (unbounded: the schedule bounds what is in flight)
    rollouts: queue.Queue  # Rollout, generator -> trainer
    evals: queue.Queue  # EvalRollout, generator -> trainer
    stop: threading.Event
    error: list  # the generation thread's exception


def get_or_raise(q: queue.Queue, channels: Channels, engine_processes=(), interrupt=(), timeout: float = 0.5):
    """Blocking get that wakes up to notice the other side failing or shutting down, and the engine's processes dying
    (vLLM's client can then wait forever). Returns None once `interrupt` is non-empty (a SIGTERM / Ctrl-C)."""
    while not interrupt:
        if channels.error:
            error = channels.error[0]
            raise RuntimeError(f"the generation thread failed: {type(error).__name__}: {error}") from error
        if channels.stop.is_set():
            raise SystemExit("stopped")
        if dead := plumbing.dead_processes(engine_processes):
            why = "a crash prints its traceback above; none: killed from outside, e.g. by the out-of-memory killer"
            raise RuntimeError(f"the generation engine's process(es) {dead} died ({why})")
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            continue
    return None


def generate(
    llm: "LLM",
    prompts,
    n: int,
    temperature: float,
    max_tokens: int,
    eos_token_id: int,
    seeds: list[int],
    logprobs=False,
):
    """n completions per prompt (and the engine's logprob of each token); each prompt has its own sampling seed, so a
    batch is reproducible whatever the engine generated before."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = dict(
        n=n, temperature=temperature, max_tokens=max_tokens, stop_token_ids=[eos_token_id], detokenize=False
    )
    params = [SamplingParams(**sampling, seed=seed, logprobs=0 if logprobs else None) for seed in seeds]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    completions = [completion for output in outputs for completion in output.outputs]
    responses = [list(c.token_ids) for c in completions]
    return responses, [
        [at[t].logprob for t, at in zip(c.token_ids, c.logprobs)] for c in completions
    ] if logprobs else None


def generation_thread(
    llm: "LLM", schedule, train_prompts, eval_prompts, args: Args, n, batch_size, eos_token_id, channels, push
):
    """Works through the schedule: loads each policy version it needs as soon as the trainer publishes it (`push`:
    push_weights with its folder and GPU), then generates rollout m (n completions per prompt) or evaluates v."""
    try:
        version = 0
        for kind, index, needed in schedule:
            wait_start, sync_time, sync_start = time.perf_counter(), 0.0, None
            while version < needed:
                weights = get_or_raise(channels.weights, channels)
                push_start = time.perf_counter()
                sync_start = sync_start or push_start
                push(weights)
                sync_time += time.perf_counter() - push_start
                version = weights.version
            if version != needed:
                raise RuntimeError(f"{kind} {index} needs policy version {needed} but the engine holds {version}")
            wait_time = time.perf_counter() - wait_start - sync_time
            gen_start = time.perf_counter()
            if kind == "rollout":
                if plumbing.injected_fault("generation", index):
                    raise RuntimeError(f"injected test fault in generation at rollout {index} (time {time.time():.2f})")
                indices = prompt_indices_for_step(index, len(train_prompts), batch_size, args.seed)
                seeds = [args.seed * 1_000_003 + index * batch_size + i for i in range(len(indices))]
                prompts = [train_prompts[i] for i in indices]
                out = generate(
                    llm, prompts, n, args.temperature, args.response_length, eos_token_id, seeds, ROLLOUT_LOGPROBS
                )
                timings = dict(
                    generation=(gen_start, time.perf_counter() - gen_start), generator_wait=(None, wait_time)
                )
                timings["weight_sync"] = (sync_start or gen_start, sync_time)
                channels.rollouts.put(Rollout(index, version, indices, *out, timings))
            else:
                seeds = [args.seed + i for i in range(len(eval_prompts))]
                # GSM8k's pass@1 is greedy (section 5.2)
                temperature = 0.0 if args.task == "gsm8k" else args.temperature
                responses, _ = generate(llm, eval_prompts, 1, temperature, args.response_length, eos_token_id, seeds)
                channels.evals.put(EvalRollout(version, responses, time.perf_counter() - gen_start, gen_start))
    except SystemExit:
        pass
    except BaseException as exc:
        traceback.print_exc()
        channels.error.append(exc)


# == The weight push: theta_v from the trainer into the running engine ===============================================
def checkpoint_names(model) -> dict[str, str]:
    """In-memory name -> the name `save_pretrained` writes, for each tensor it writes: transformers renames some when
    saving (GPTNeoX's `lm_head` is `embed_out` in Pythia's checkpoints) and leaves tied copies out, and the engine
    loads checkpoint names (vLLM's CUDA GPTNeoX has no `lm_head`)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # tied weights found on a copy of the model on the meta device: transformers tells them by their storage, which
    # ZeRO-3 empties (every shard would look tied to every other)
    with torch.device("meta"):
        shadow = type(model)(model.config)
    state = remove_tied_weights_from_state_dict(shadow.state_dict(), shadow)
    for key in model._keys_to_ignore_on_save or []:
        state.pop(key, None)
    tags = {name: torch.empty(0) for name in state}  # one distinct object per tensor: which one gets which name
    owner = {id(tag): name for name, tag in tags.items()}
    names = {owner.get(id(tag)): saved for saved, tag in revert_weight_conversion(model, dict(tags)).items()}
    if None in names or len(names) != len(tags):
        raise UsageError(
            f"{type(model).__name__}: transformers converts (not only renames) its weights when saving; the weight push cannot"
        )
    return names


def views(flat: torch.Tensor, layout: list[tuple[str, list[int], int]]) -> list[tuple[str, torch.Tensor]]:
    return [(name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]


def snapshot_weights(
    tensors, names: dict[str, str], dtype: torch.dtype, place: plumbing.SnapshotPlace, shapes=None
) -> tuple[torch.Tensor, list]:
    """theta_v for the engine: a copy in the engine's dtype under the checkpoint's names, in one buffer, taken between
    optimizer steps so the optimizer never writes what the engine reads. `tensors`: a state dict, or (name, tensor)
    pairs with their whole `shapes` (under ZeRO-3 they come a layer at a time: plumbing.gathered_tensors). The buffer
    is in host memory (`place`), pinned on a GPU: the engine's device holds only the one version it loads."""
    if isinstance(tensors, dict):
        tensors, shapes = tensors.items(), {name: tensor.shape for name, tensor in tensors.items()}
    keys = [key for key in shapes if key in names]
    offsets = np.cumsum([0] + [math.prod(shapes[key]) for key in keys]).tolist()
    layout = [(names[key], list(shapes[key]), offset) for key, offset in zip(keys, offsets)]
    flat = place.buffer(offsets[-1], dtype)
    unfilled = {key: view for (_, view), key in zip(views(flat, layout), keys)}
    for key, tensor in tensors:
        if key in unfilled:
            unfilled.pop(key).copy_(tensor.detach())
    if missing := [key for key in names if key not in shapes] + list(unfilled):
        raise RuntimeError(f"the weights to push lack {len(missing)} tensor(s) of the policy, e.g. {missing[0]}")
    return flat, layout


def push_weights(llm: "LLM", bucket: plumbing.WeightBucket, weights: Weights) -> None:
    """Load theta_v into the running engine, in place, a bucket at a time: each run of whole layers of the host
    snapshot is copied into the push's bucket on the engine's device, which its worker opens (by CUDA IPC on a GPU,
    shared memory on a CPU), loads as a checkpoint's and checks against what it holds (plumbing.WeightReceiver) before
    the next run overwrites it; the prefix cache holds KV of the old weights: reset it. An engine left with other
    weights stops the run."""
    loaded = [
        llm.collective_rpc("load_shared_weights", args=(weights.version, filled.handle, filled.layout))[0]
        for filled in bucket.fill(weights.flat, weights.layout)
    ]
    plumbing.check_loaded(weights.version, loaded, llm.reset_prefix_cache())


def publish(
    version: int, accelerator: Accelerator, model, names: dict, dtype, place, snapshots: dict, channels: Channels
) -> None:
    """Snapshot theta_version (between optimizer steps) and hand it to the generation thread; rank 0 keeps it for
    checkpoints until no pending batch or evaluation needs it. The snapshot is copied from the parameters where they
    are, GPU memory on GPUs (`accelerator.get_state_dict` would copy each to the CPU under DeepSpeed), under ZeRO-3
    gathered a layer at a time, with every process taking part."""
    module = accelerator.unwrap_model(model)
    tensors = plumbing.gathered_tensors(accelerator, module, names)
    if not accelerator.is_main_process:
        for _ in tensors:  # the gathers of ZeRO-3 are collective
            pass
        return
    shapes = plumbing.full_shapes(module)
    snapshots[version] = Weights(version, *snapshot_weights(tensors, names, dtype, place, shapes))
    channels.weights.put(snapshots[version])


# == PPO: per-token rewards with the KL penalty, GAE, the clipped losses, the update ==================================
ROLLOUT_LOGPROBS = True  # the engine's logprobs: --old_logprobs engine's importance weights, policy/engine_* metrics


def check_value_model(inputs: Inputs, args: Args) -> None:
    """The value model starts from the reward model and reads the policy's tokens: their tokenizers must agree."""
    if inputs.reward_tokenizer is not None and not same_tokenizer(inputs.reward_tokenizer, inputs.tokenizer):
        raise UsageError(
            f"the value model starts from --reward_model_path {args.reward_model_path} and reads the policy's tokens: "
            "its tokenizer must be the policy's"
        )


def load_value_model(args: Args) -> torch.nn.Module:
    """The value model: its own copy of the reward model, trained with the policy (as the paper's code, ppov2.py; the
    N details blog starts its value head at 0), in fp32 as the policy, dropout off. GSM8k has no reward model: it
    starts from the SFT policy with a new value head."""
    start = args.sft_model_path if args.task == "gsm8k" else args.reward_model_path
    kwargs = dict(trust_remote_code=args.trust_remote_code, use_safetensors=True)
    value_model = AutoModelForSequenceClassification.from_pretrained(start, num_labels=1, dtype=torch.float32, **kwargs)
    disable_dropout(value_model)
    return value_model


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Unbiased variance over the real tokens only (torch.var's Bessel correction, as TRL's masked_var, which the
    paper's PPO whitens with; the N details blog's `whiten` is the biased one)."""
    centered = values - masked_mean(values, mask)
    count = mask.sum()
    return masked_mean(centered**2, mask) * count / (count - 1).clamp(min=1)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """N details, policy #9, over the real tokens only (padding stays 0); shift_mean=False keeps the mean (rewards)."""
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def pad_logprobs(logprobs: list[list[float]], response_length: int, response_mask: torch.Tensor) -> torch.Tensor:
    """The engine's per-token logprobs laid out like `truncate_responses`' ids (cut at response_length, 0 after EOS),
    on the mask's device."""
    out = torch.zeros(len(logprobs), response_length)
    for row, seq in enumerate(logprobs):
        seq = seq[:response_length]
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.float)
    return out.to(response_mask.device) * response_mask


def response_logprobs_and_entropy(model, query_ids, query_mask, response_ids, response_mask, temperature: float):
    """`response_logprobs` and, from the same logits, the entropy of pi(. | query, y_<t) (a diagnostic: no gradient)."""
    input_ids, mask = torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1)
    positions, keep = position_ids_from(mask), response_ids.shape[1] + 1  # keep: the logits that predict the response
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, logits_to_keep=keep).logits
    logits = logits[:, :-1].float() / temperature
    logprobs = logits.gather(2, response_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    with torch.no_grad():
        entropy = logits.logsumexp(-1) - (logits.softmax(-1) * logits).sum(-1)
    return logprobs * response_mask, entropy * response_mask


def response_values(value_model, query_ids, query_mask, response_ids, response_mask) -> torch.Tensor:
    """V(s_t), s_t = query + y_<t: the value head on the hidden state of the token before each response token y_t
    (as TRL's PPO; `get_reward` per token); 0 after the first EOS."""
    input_ids, mask = torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1)
    backbone = getattr(value_model, value_model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask)).last_hidden_state
    head = value_model.score if hasattr(value_model, "score") else value_model.classifier
    return head(hidden[:, query_ids.shape[1] - 1 : -1]).squeeze(-1).float() * response_mask


class PolicyAndValue(torch.nn.Module):
    """Policy and value model in one module: one prepared model and one optimizer train both (TRL's
    PolicyAndValueWrapper). A forward returns per-token logprobs, entropies and values."""

    def __init__(self, policy, value_model):
        super().__init__()
        self.policy, self.value_model = policy, value_model

    def forward(self, query_ids, query_mask, response_ids, response_mask, temperature: float):
        batch = (query_ids, query_mask, response_ids, response_mask)
        logprobs, entropy = response_logprobs_and_entropy(self.policy, *batch, temperature)
        return logprobs, entropy, response_values(self.value_model, *batch)


def per_token_rewards(scores, logprobs, ref_logprobs, response_mask, kl_coef: float):
    """N details, policy #8: -kl_coef (log pi_old - log pi_ref) on every response token, plus the score on the last
    real one;
    0 after it. Returns (rewards, kl) per token. A completion of zero tokens has no token for its score: refused."""
    lengths = response_mask.sum(1)
    if (lengths == 0).any():
        empty = (lengths == 0).nonzero().flatten().tolist()
        raise RuntimeError(
            f"completion(s) {empty} of the batch have zero tokens: there is no token to give the score to "
            "(the engine returned an empty completion)"
        )
    kl = (logprobs - ref_logprobs) * response_mask
    rewards = -kl_coef * kl
    rewards[torch.arange(len(rewards), device=rewards.device), lengths - 1] += scores
    return rewards, kl


def gae_advantages(rewards, values, response_mask, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE, vectorised: delta_t = r_t + gamma V_{t+1} - V_t, A_t = sum_{l >= t} (gamma lam)^(l - t) delta_l, V = 0 after
    the last real token. Returns advantages and returns = advantages + values (before any whitening)."""
    rewards, values = rewards * response_mask, values * response_mask
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    deltas = (rewards + gamma * next_values - values) * response_mask
    t = torch.arange(rewards.shape[1], device=rewards.device)
    gaps = t[None, :] - t[:, None]  # [t, l] = l - t
    zero = torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    discounts = torch.where(gaps >= 0, (gamma * lam) ** gaps.clamp(min=0).to(rewards.dtype), zero)
    advantages = deltas @ discounts.T
    return advantages * response_mask, (advantages + values) * response_mask


def truncated_is_weights(old_logps: torch.Tensor, engine_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Importance weight from the engine's (behaviour) policy mu to the trainer's old one, min(pi_old / mu, cap), per
    sequence (RLOO) or per token (PPO): truncated importance sampling, as PRIME-RL clips its token ratios."""
    return torch.exp(old_logps - engine_logps).clamp(max=cap)


def ppo_policy_loss(logprobs, old_logprobs, advantages, response_mask, cliprange: float, is_weights=None):
    """Clipped surrogate (PPO, Schulman et al. 2017): masked_mean(w max(-A r, -A clip(r, 1 - eps, 1 + eps))),
    r = pi / pi_old, w the importance weights (1 if None). Returns the loss, the ratios and the clipped tokens (TRL's
    clipfrac)."""
    ratio = torch.exp(logprobs - old_logprobs)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * ratio.clamp(1 - cliprange, 1 + cliprange)
    per_token = torch.max(pg_losses, pg_losses_clipped)
    if is_weights is not None:
        per_token = per_token * is_weights
    return masked_mean(per_token, response_mask), ratio.detach(), (pg_losses_clipped > pg_losses).detach()


def ppo_value_loss(values, old_values, returns, response_mask, cliprange_value: float):
    """Clipped value loss (N details, policy #10): 0.5 masked_mean(max((V - R)^2, (clip(V, V_old +- c) - R)^2)).
    Returns the loss and the tokens whose clipped term was the larger (val/clipfrac)."""
    clipped_values = torch.max(torch.min(values, old_values + cliprange_value), old_values - cliprange_value)
    losses, losses_clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * masked_mean(torch.max(losses, losses_clipped), response_mask), (losses_clipped > losses).detach()


def explained_variance(values, returns, response_mask) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over real tokens: 1 is a perfect value model, 0 predicts only the mean."""
    return 1 - masked_var(returns - values, response_mask) / masked_var(returns, response_mask).clamp(min=1e-8)


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, n_steps: int, horizon: int) -> float:
    """Ziegler et al. (2019)'s proportional controller (N details, policy #11): kl_coef grows when the KL is above its
    target and shrinks below it, by at most 20 % x n_steps / horizon per update."""
    proportional_error = float(np.clip(kl / target - 1, -0.2, 0.2))
    return kl_coef * (1 + proportional_error * n_steps / horizon)


class KLCoefficient:
    """The KL coefficient of the current step (it moves with --adaptive_kl); saved with the checkpoints."""

    def __init__(self, value: float):
        self.value = value

    def state_dict(self) -> dict:
        return {"kl_coef": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["kl_coef"]


class Targets(NamedTuple):
    """What a step's update trains towards, computed once before it (N details, policy #8 and #9)."""

    old_logprobs: torch.Tensor  # theta_step's, recomputed by the trainer: the ratio's old policy
    old_values: torch.Tensor
    advantages: torch.Tensor  # GAE, whitened
    returns: torch.Tensor  # advantages + old values, before whitening
    kl: torch.Tensor  # per token: log pi_old - log pi_ref
    engine_logprobs: torch.Tensor  # the behaviour policy's (version step - lag), from the engine
    is_weights: torch.Tensor | None  # --old_logprobs engine: the truncated importance weights


@torch.no_grad()
def old_logprobs_and_values(model, batch: Batch, temperature: float, batch_size: int):
    """theta_step's per-token logprobs and values of a batch (PolicyAndValue), in no-grad passes of `batch_size`."""
    parts = [[t[i : i + batch_size] for t in batch[:4]] for i in range(0, len(batch.query_ids), batch_size)]
    old = [model(*part, temperature) for part in parts]
    return torch.cat([o[0] for o in old]), torch.cat([o[2] for o in old])


def ppo_targets(scores, batch: Batch, old_logprobs, old_values, ref_logprobs, engine_logprobs, kl_coef, args: Args):
    """Per-token rewards, GAE advantages (whitened) and returns, and --old_logprobs engine's truncated importance
    weights (N details, policy #8 and #9)."""
    mask = batch.response_mask
    rewards, kl = per_token_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef)
    if args.whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False)
    advantages, returns = gae_advantages(rewards, old_values, mask, args.gamma, args.lam)
    advantages = masked_whiten(advantages, mask)
    # --old_logprobs engine: the engine's policy (version step - lag) is the behaviour policy; the clipped ratio stays
    # anchored at theta_step and a truncated importance weight corrects from one to the other.
    is_weights = None
    if args.old_logprobs == "engine":
        is_weights = truncated_is_weights(old_logprobs, engine_logprobs, args.tis_cap) * mask
    return Targets(old_logprobs, old_values, advantages, returns, kl, engine_logprobs, is_weights)


def ppo_update(
    model, optimizer, accelerator, batch: Batch, t: Targets, args: Args, sizes: Sizes, shuffle_rng, step: int
) -> tuple[dict, tuple[float, float]]:
    """T epochs over N shuffled mini-batches, each accumulated from micro-batches (N details, policy #7); the
    policy and the value model take the same optimizer steps. Returns the step's statistics and the largest and smallest
    ratio over all processes."""
    B, micro = sizes.local_batch_size, args.local_micro_batch_size
    keys = "loss pg_loss vf_loss approxkl clipfrac vf_clipfrac value_error policy_entropy ratio"
    stats = {k: [] for k in keys.split()}
    model.train()
    for _ in range(args.num_ppo_epochs):
        order = torch.as_tensor(shuffle_rng.permutation(B), device=accelerator.device)
        for mini_start in range(0, B, sizes.local_mini_batch_size):
            for micro_start in range(mini_start, mini_start + sizes.local_mini_batch_size, micro):
                idx = order[micro_start : micro_start + micro]
                mask, m = batch.response_mask[idx], Targets(*(x if x is None else x[idx] for x in t))
                with accelerator.accumulate(model):
                    logprobs, entropy, values = model(*(x[idx] for x in batch[:4]), args.temperature)
                    pg_loss, ratio, clipped = ppo_policy_loss(
                        logprobs, m.old_logprobs, m.advantages, mask, args.cliprange, m.is_weights
                    )
                    vf_loss, vf_clipped = ppo_value_loss(values, m.old_values, m.returns, mask, args.cliprange_value)
                    loss = pg_loss + args.vf_coef * vf_loss
                    if plumbing.injected_fault("nan_loss", step):
                        loss = loss * float("nan")
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and args.max_grad_norm is not None:
                        accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                with torch.no_grad():
                    stats["loss"].append(loss.detach())
                    stats["pg_loss"].append(pg_loss.detach())
                    stats["vf_loss"].append(vf_loss.detach())
                    stats["approxkl"].append(0.5 * masked_mean((logprobs.detach() - m.old_logprobs) ** 2, mask))
                    stats["clipfrac"].append(masked_mean(clipped.float(), mask))
                    stats["vf_clipfrac"].append(masked_mean(vf_clipped.float(), mask))
                    stats["value_error"].append(masked_mean((values.detach() - m.returns) ** 2, mask))
                    stats["policy_entropy"].append(masked_mean(entropy, mask))
                    stats["ratio"].append(ratio[mask.bool()])
    ratios = torch.cat(stats.pop("ratio"))
    stats = {k: torch.stack(v).mean() for k, v in stats.items()} | {"ratio_mean": ratios.mean()}
    # the rollouts' own statistics (docs/metrics.md)
    mask, old, engine = batch.response_mask, t.old_logprobs, t.engine_logprobs
    stats |= {"kl": t.kl.sum(1).mean(), "entropy": -old.sum(1).mean()}
    stats["explained_variance"] = explained_variance(t.old_values, t.returns, mask)
    stats["engine_abs_diff"] = masked_mean((engine - old).abs(), mask)
    stats["engine_diff"] = masked_mean(engine - old, mask)
    if t.is_weights is not None:
        stats["tis_weight_mean"] = masked_mean(t.is_weights, mask)
        stats["tis_capped_frac"] = masked_mean(((old - engine).exp() > args.tis_cap).float(), mask)
    extremes = torch.stack([ratios.max(), -ratios.min()])[None]
    ratio_max, neg_ratio_min = accelerator.gather(extremes).max(0).values.tolist()
    return stats, (ratio_max, -neg_ratio_min)


def ppo_metrics(step: int, version: int, sizes: Sizes, lr: float, reduced: dict, ratios: tuple, kl_coef: float):
    """A training step's line of metrics.jsonl (docs/metrics.md), but for the timings (plumbing.pipeline_metrics)."""
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
        "objective/kl_coef": kl_coef,
        "val/num_eos_tokens": reduced["num_eos_tokens"],
        "loss/policy": reduced["pg_loss"],
        "loss/value": reduced["vf_loss"],
        "policy/approxkl": reduced["approxkl"],
        "policy/clipfrac": reduced["clipfrac"],
        "policy/entropy": reduced["policy_entropy"],
        "policy/ratio_mean": reduced["ratio_mean"],
        "policy/ratio_max": ratios[0],
        "policy/ratio_min": ratios[1],
        "val/clipfrac": reduced["vf_clipfrac"],
        "val/value_error": reduced["value_error"],
        "val/explained_variance": reduced["explained_variance"],
        "policy/engine_logprob_diff": reduced["engine_abs_diff"],
        "policy/engine_kl": reduced["engine_diff"],
        **{f"policy/{k}": reduced[k] for k in ("tis_weight_mean", "tis_capped_frac") if k in reduced},
    }


# == main(): setup, then the training loop's numbered steps ===========================================================
def load_models(args: Args, inputs: Inputs, dtype: torch.dtype, accelerator: Accelerator):
    """The policy and the frozen models (safetensors only), dropout off. The policy and the reference keep fp32 weights
    (the optimizer's, and the policy's numbers at step 0) and run under autocast; the reward and gold models, which
    only score, hold --dtype weights. Under ZeRO-3 every model but the gold judge, which only rank 0 holds, is sharded
    across the processes. Returns the policy and the Models."""
    kwargs = dict(trust_remote_code=args.trust_remote_code, use_safetensors=True)
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, **kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, **kwargs)
    reward_model = gold_model = gold_tokenizer = None
    if args.task != "gsm8k":
        reward_model = plumbing.load_reward_model(args.reward_model_path, "--reward_model_path", dtype=dtype, **kwargs)
    if args.gold_judge != "tiny" and accelerator.is_main_process:
        with plumbing.whole_models(accelerator):  # only rank 0 runs it: never sharded
            gold_model = plumbing.load_reward_model(args.gold_judge, "--gold_judge", dtype=dtype, **kwargs)
        gold_model = gold_model.to(accelerator.device).eval().requires_grad_(False)
        gold_tokenizer = AutoTokenizer.from_pretrained(args.gold_judge, trust_remote_code=args.trust_remote_code)
    for model in (policy, ref_policy, reward_model, gold_model):
        if model is not None:
            disable_dropout(model)
    ref_policy = plumbing.prepare_frozen(ref_policy, accelerator)  # sharded for inference under ZeRO-3
    if reward_model is not None:
        reward_model = plumbing.prepare_frozen(reward_model, accelerator)
    models = Models(inputs.tokenizer, ref_policy, reward_model, inputs.reward_tokenizer, gold_model, gold_tokenizer)
    return policy, models


def start_generation(args: Args, inputs: Inputs, n: int, dtype, schedule, channels: Channels, signals, cores, memory):
    """Rank 0's engine (in processes of its own: plumbing.py) and the generation thread that drives it, on `cores`.
    On GPUs the engine must leave room for what training allocates later (`memory`: what training adds on rank 0's GPU,
    and the weight push's bucket on the engine's GPU: plumbing.EngineRoom)."""
    placement, host, total = inputs.placement, plumbing.snapshot_memory(memory.snapshot, args.async_level), 0
    if placement.devices is not None:
        with plumbing.usage_errors():
            gpus = torch.cuda.mem_get_info(0), torch.cuda.mem_get_info(placement.engine_gpu)  # rank 0's, the engine's
            placement = placement._replace(
                memory_utilization=plumbing.engine_share(placement, *gpus, memory.to_come, bucket=memory.bucket)
            )
        total = gpus[1][1]
    given = args.vllm_gpu_memory_utilization is not None
    print(plumbing.engine_line(placement, total, memory.snapshot, memory.bucket, host, given, args.vllm_enforce_eager))
    llm = dict(seed=args.seed, dtype=str(dtype).removeprefix("torch."), trust_remote_code=args.trust_remote_code)
    llm["max_model_len"] = args.max_prompt_length + args.response_length
    llm["enforce_eager"] = placement.devices is None or args.vllm_enforce_eager  # CUDA graphs on GPUs
    engine = plumbing.start_engine(args.sft_model_path, placement, signals, cores, **llm)
    push = partial(push_weights, engine.llm, engine.bucket)
    prompts, eos = (inputs.train.token_ids, inputs.evaluation.token_ids), inputs.tokenizer.eos_token_id
    work = (engine.llm, schedule, *prompts, args, n, inputs.sizes.batch_size, eos, channels, push)
    thread = threading.Thread(target=generation_thread, args=work, daemon=True)
    with plumbing.on_cores(cores):  # the generation thread takes turns with the engine's processes
        thread.start()
    return engine, thread


def publish_owed(versions: set[int], start_step: int, checkpoint: str | None, push_to: tuple) -> None:
    """A resumed run re-sends the versions the generator still needs: older ones from the checkpoint, then theta_start
    (push_to: publish's arguments after the version)."""
    accelerator, dtype, place, snapshots, channels = push_to[0], *push_to[3:]
    for version in sorted(v for v in versions if v <= start_step):
        if version == start_step:
            publish(version, *push_to)
        elif accelerator.is_main_process:
            tensors = plumbing.load_owed_version(checkpoint, version)
            snapshots[version] = Weights(version, *snapshot_weights(tensors, {k: k for k in tensors}, dtype, place))
            channels.weights.put(snapshots[version])


def next_rollout(channels: Channels, engine, signals, accelerator: Accelerator) -> tuple[Rollout | None, int]:
    """The step's rollout, which rank 0 takes from the generation thread, or the number of the stop signal that came
    first (0: none): every rank gets both."""
    rollout = stop = None
    if accelerator.is_main_process:
        rollout = get_or_raise(channels.rollouts, channels, engine.processes, interrupt=signals.received)
        stop = signals.received[0] if rollout is None else 0
    rollout, stop = broadcast_object_list([rollout, stop])
    return rollout, stop


def score_step(batch: Batch, references: list[str], models: Models, args: Args, accelerator, step: int):
    """score_batch, stopped on a NaN or infinite score: every process sees every score, so all of them stop."""
    with accelerator.autocast():
        scores = score_batch(batch, references, models, args)
    if plumbing.injected_fault("scoring", step):
        raise RuntimeError(f"injected test fault in reward scoring at step {step} (time {time.time():.2f})")
    if plumbing.injected_fault("nan_score", step):
        scores[0] = float("nan")
    source = f"reward model --reward_model_path {args.reward_model_path}"
    check_scores(accelerator.gather(scores), "GSM8k's verifier" if args.task == "gsm8k" else source, step)
    return scores


def arrived_evaluations(channels: Channels, accelerator: Accelerator, engine=None) -> list[EvalRollout]:
    """The evaluations the generation thread has finished (given the engine: at least one, waited for), which rank 0
    evaluates; under ZeRO-3 every process does (they are handed to all), as all take part in the sharded frozen
    models' forward passes."""
    evaluations = []
    if accelerator.is_main_process:
        if engine is not None:
            evaluations.append(get_or_raise(channels.evals, channels, engine.processes))
        while not channels.evals.empty():
            evaluations.append(channels.evals.get())
    return broadcast_object_list([evaluations])[0] if plumbing.zero_stage(accelerator) == 3 else evaluations


def log_evaluation(rollout: EvalRollout, evaluation: Prompts, models: Models, args: Args, accelerator, logger, run):
    """Evaluate the completions of policy version `rollout.version` (arrived_evaluations says where) and log them:
    metrics, a sample table, the completions (plumbing.py). `run`: the episodes per step, the evaluations logged so
    far, the timeline's origin."""
    episodes_per_step, evals_logged, origin = run
    with accelerator.autocast():
        metrics, rows, completions = evaluate(rollout.responses, evaluation, models, args, accelerator.device)
    metrics["time/eval_generation"] = rollout.generation_time
    metrics["timeline/eval_generation_start"] = rollout.generation_start - origin
    texts = (evaluation.queries, completions, evaluation.references)
    if logger is not None:
        logger.log_evaluation(rollout.version, rollout.version * episodes_per_step, metrics, rows, texts)
    evals_logged.add(rollout.version)


def write_checkpoint(accelerator, output_dir: str, keep: int, progress, snapshots: dict, schedule, step: int) -> str:
    """A checkpoint for a trainer about to run `step`, with the older policy versions the generator still needs."""
    progress.step, owed = step, owed_snapshots(snapshots, schedule, step, progress.evals_logged)
    owed = {v: views(w.flat, w.layout) for v, w in owed.items() if v < step}  # theta_step is the policy's weights
    return plumbing.save_checkpoint(accelerator, output_dir, progress, owed, keep)


def owed_snapshots(snapshots: dict[int, Weights], schedule, next_step: int, evals_logged: set[int]) -> dict:
    """The snapshots of the policy versions the generator still needs for a trainer about to run `next_step`."""
    needed = published_versions(pending_events(schedule, next_step, evals_logged))
    return {version: weights for version, weights in snapshots.items() if version in needed}


def main(args: Args) -> None:
    # the process group and device first: the Accelerator needs the dtype, which depends on the device
    on_gpu = plumbing.process_state(args.collective_timeout_minutes).device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" or (args.dtype == "auto" and on_gpu) else torch.float32
    engine_dtype = {"auto": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.vllm_dtype]
    # bf16: autocast in the forward passes of the policy (accelerate's mixed precision) and of every frozen model
    precision = "bf16" if dtype == torch.bfloat16 else "no"
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=precision)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on tensor cores
    run_name = plumbing.name_run(args.exp_name, args.seed)
    output_dir = args.output_dir or os.path.join("runs", run_name)
    with plumbing.usage_errors():
        inputs = check_inputs(args, accelerator, output_dir, on_gpu)
        check_value_model(inputs, args)
    sizes, tokenizer, train, device = inputs.sizes, inputs.tokenizer, inputs.train, accelerator.device
    signals = plumbing.StopSignals()  # before any model loads: see StopSignals
    if (deepspeed := accelerator.state.deepspeed_plugin) is not None:  # DeepSpeed wants these in its own config
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
        deepspeed.deepspeed_config["gradient_clipping"] = args.max_grad_norm or 0.0  # DeepSpeed clips (0: it does not)
    engine_cores = plumbing.split_cores(device, accelerator.num_processes)
    # The generation thread needs the interpreter lock at every decoding step; training hands it over every switch
    # interval (5 ms by default) while it runs Python. 0.5 ms: pipeline efficiency 92.5% -> 96.1% (docs/speed.md).
    sys.setswitchinterval(0.0005)
    set_seed(args.seed + accelerator.process_index)

    # models, and the FLOPs of each phase per process and step (model FLOP utilisation: benchmark/timing.py)
    with plumbing.usage_errors():  # the score-head check of a hub id whose config did not say
        policy, models = load_models(args, inputs, dtype, accelerator)
    value_model = load_value_model(args)
    # before accelerate wraps the policy; under PolicyAndValue's names, which the pushed state dict has
    engine_names = {f"policy.{name}": saved for name, saved in checkpoint_names(policy).items()}
    if args.gradient_checkpointing:
        for m in (policy, value_model):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    L, R = args.max_prompt_length + args.response_length, args.response_length  # padded widths the passes process
    B, K, bs = sizes.local_batch_size, 1, args.local_rollout_forward_batch_size
    passes, flops = (4 if args.gradient_checkpointing else 3) * args.num_ppo_epochs, plumbing.forward_flops
    trained = flops(policy, B, L, R + 1) + flops(value_model, B, L)
    phase_flops = {
        "scoring": 0 if models.reward_model is None else flops(models.reward_model, B, L),
        "old_logprobs": trained,
        "reference": flops(models.ref_policy, B, L, R + 1),
        "update": passes * trained,
    }
    policy_and_value = PolicyAndValue(policy, value_model)  # one prepared model and one optimizer train both
    optimizer = make_optimizer(policy_and_value, args)
    model, optimizer = accelerator.prepare(policy_and_value, optimizer)
    # Stepped by hand once a step (accelerate's prepared scheduler would step per process).
    lr = partial(lr_factor, args.lr_schedule, num_steps=sizes.num_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr)
    progress = plumbing.Progress(args.seed)  # the next step, the evaluations logged, the shuffle generator
    kl_coef = KLCoefficient(args.kl_coef)  # PPO's own state, saved and restored with the trainer's
    accelerator.register_for_checkpointing(scheduler, progress, kl_coef)
    if inputs.checkpoint:  # the trainer exactly as it was when the checkpoint was written
        accelerator.load_state(inputs.checkpoint)
        print(f"resuming from {inputs.checkpoint} (step {progress.step})")
    elif args.resume:
        print(f"--resume: no checkpoint in {output_dir} yet, starting at step 0")
    start_step, evals_logged = progress.step, progress.evals_logged
    eval_steps = sorted({0, sizes.num_steps, *range(0, sizes.num_steps, args.eval_freq or sizes.num_steps)})
    schedule = generation_schedule(sizes.num_steps, args.async_level, eval_steps)
    schedule = pending_events(schedule, start_step, evals_logged)
    to_publish = published_versions(schedule)

    # what training allocates later, which the engine must leave room for on a GPU
    trained = sum(plumbing.numel(p) for p in model.parameters())
    trained = plumbing.trained_memory(
        trained, plumbing.zero_stage(accelerator), accelerator.num_processes, precision == "bf16"
    )
    to_come = {part: trained[part] for part in ("gradients", "optimizer state")}  # the weights are loaded
    snapshot = plumbing.snapshot_sizes(accelerator.unwrap_model(model), engine_names)
    memory = plumbing.EngineRoom(
        to_come=to_come,
        snapshot=sum(snapshot.values()) * engine_dtype.itemsize,
        bucket=plumbing.bucket_bytes(snapshot, engine_dtype.itemsize),
    )

    # rank 0 owns the engine and generates for every rank; the run folder is written once the engine is up, so a
    # start-up stopped by a signal or a failure leaves none
    channels = Channels(queue.Queue(), queue.Queue(), queue.Queue(), threading.Event(), [])
    engine = logger = thread = None
    if accelerator.is_main_process:
        work = (args, inputs, K, engine_dtype, schedule, channels, signals, engine_cores, memory)
        engine, thread = start_generation(*work)
        plumbing.open_run_folder(output_dir, asdict(args) | sizes._asdict(), start_step, evals_logged)
        tracking = (args.track, args.wandb_project, args.wandb_entity)
        logger = plumbing.MetricsLogger(output_dir, run_name, asdict(args), *tracking)
    signals.starting = False
    # Policy versions the generator may still need (in host memory): a checkpoint hands them on.
    snapshots, place = {}, plumbing.SnapshotPlace(pinned=on_gpu, folder=engine.weights_dir if engine else None)
    push_to = (accelerator, model, engine_names, engine_dtype, place, snapshots, channels)
    publish_owed(to_publish, start_step, inputs.checkpoint, push_to)

    run = (sizes.episodes_per_step, evals_logged, engine.started if engine else 0.0)
    log_eval = partial(log_evaluation, evaluation=inputs.evaluation, models=models, args=args, accelerator=accelerator)
    log_eval = partial(log_eval, logger=logger, run=run)
    checkpoint = partial(
        write_checkpoint, accelerator, output_dir, args.keep_checkpoints, progress, snapshots, schedule
    )
    last_checkpoint, exit_code, main_process = inputs.checkpoint, 0, accelerator.is_main_process
    try:
        steps = range(start_step, sizes.num_steps)
        bar = tqdm(steps, initial=start_step, total=sizes.num_steps, disable=not main_process, desc="steps")
        for step in bar:
            laps = plumbing.Laps()
            # 1. the rollouts of this step (rank 0 has them; every rank takes its slice), unless a signal came
            rollout, stop = next_rollout(channels, engine, signals, accelerator)
            if stop:
                last_checkpoint = checkpoint(step) if step > start_step else last_checkpoint
                resume = f"; resume from {last_checkpoint} with --resume" if last_checkpoint else ""
                print(f"stopped before step {step}{resume}")
                exit_code = 128 + stop
                break
            laps.lap("wait_for_rollouts")
            if rollout.step != step or step - rollout.version != min(step, args.async_level):  # paper section 3
                raise RuntimeError(
                    f"async invariant broken: step {step} got rollout {rollout.step} from policy version {rollout.version}"
                )
            local = slice(accelerator.process_index * B, (accelerator.process_index + 1) * B)
            indices, responses = rollout.prompt_indices[local], rollout.responses[local.start * K : local.stop * K]
            batch = to_batch([train.token_ids[i] for i in indices], responses, K, args, tokenizer, device)
            engine_logprobs = pad_logprobs(rollout.logprobs[local.start * K : local.stop * K], R, batch.response_mask)

            # 2. score: the reward model on query + response with a fixed score without EOS, or GSM8k's verifier
            references = [train.references[i] for i in indices for _ in range(K)]  # one per completion
            scores = score_step(batch, references, models, args, accelerator, step)
            laps.lap("scoring")

            # 3. old logprobs and values, reference logprobs, per-token rewards, GAE advantages (N details, policy #8,
            # #9). The ratio's old policy is theta_step recomputed by the trainer, not the engine's logprobs: their
            # numerics differ (bf16 clipped 20-40 % of sequences: RLOO blog), and so the first mini-batch's ratio is
            # exactly 1.
            old_logprobs, old_values = old_logprobs_and_values(model, batch, args.temperature, bs)
            laps.lap("old_logprobs")
            with accelerator.autocast():
                ref_logprobs = batch_logprobs(models.ref_policy, batch, args.temperature, bs)
            laps.lap("reference")
            targets = (old_logprobs, old_values, ref_logprobs, engine_logprobs, kl_coef.value)
            targets = ppo_targets(scores, batch, *targets, args)

            # 4. update: T epochs over N shuffled mini-batches, each accumulated from micro-batches
            stats, ratios = ppo_update(
                model, optimizer, accelerator, batch, targets, args, sizes, progress.shuffle, step
            )
            laps.lap("update")

            # 5. send theta_{step+1} to the engine if a later batch or an evaluation needs it
            if step + 1 in to_publish:
                publish(step + 1, *push_to)
            laps.lap("snapshot")

            # 6. log the statistics averaged over the processes
            stats |= {"scores": scores.mean(), "num_eos_tokens": batch.contain_eos.float().mean()}
            stats["response_tokens"] = batch.response_mask.sum().float()
            reduced = plumbing.reduce_statistics(stats, accelerator, step, last_checkpoint)
            step_kl_coef, n = kl_coef.value, sizes.episodes_per_step
            if args.adaptive_kl:  # every rank sees the same reduced KL: the coefficient stays equal across ranks
                kl_coef.value = adaptive_kl_coef(step_kl_coef, reduced["kl"], args.kl_target, n, args.kl_horizon)
            if main_process:
                lr = scheduler.get_last_lr()[0]
                metrics = ppo_metrics(step, rollout.version, sizes, lr, reduced, ratios, step_kl_coef)
                tokens = reduced["response_tokens"] * sizes.world_size
                work = (phase_flops, sizes.episodes_per_step, tokens)
                logger.log(metrics | plumbing.pipeline_metrics(laps, rollout.timings, engine.started, *work))
                bar.set_postfix(lag=step - rollout.version, score=f"{reduced['scores']:.3f}", kl=f"{reduced['kl']:.2f}")
            scheduler.step()  # the next step's learning rate (lr_factor), after this one's was logged
            # 7. evaluations arrive from the generation thread a little later; score them as they come
            for eval_rollout in arrived_evaluations(channels, accelerator):
                log_eval(eval_rollout)
            if main_process:
                for version in snapshots.keys() - owed_snapshots(snapshots, schedule, step + 1, evals_logged).keys():
                    del snapshots[version]
            if args.save_freq and (step + 1) % args.save_freq == 0 and step + 1 < sizes.num_steps:
                last_checkpoint = checkpoint(step + 1)

        if not exit_code:
            evaluator = main_process or plumbing.zero_stage(accelerator) == 3
            while evaluator and len(evals_logged) < len(eval_steps):
                for eval_rollout in arrived_evaluations(channels, accelerator, engine):
                    log_eval(eval_rollout)
            # the policy alone, under the plain causal-LM names
            plumbing.save_policy(accelerator, model, tokenizer, os.path.join(output_dir, "policy"), prefix="policy.")
    except KeyboardInterrupt:
        print("interrupted: stopping the generation thread and the engine")
        exit_code = 130
    finally:
        plumbing.stop_engine(engine, thread, channels.stop)
        if logger is not None:
            logger.close()
        plumbing.exit_quickly()
    if exit_code:
        raise SystemExit(exit_code)


if __name__ == "__main__":
    plumbing.run(main, plumbing.parse_args(Args, __doc__))
