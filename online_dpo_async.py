"""Asynchronous online DPO (Noukhovitch et al., "Asynchronous RLHF", 2024) in one file.

A vLLM engine, driven by a generation thread, samples the next batches from a policy at most
`async_level` updates old while the trainer (accelerate) learns on the current one.
Usage, flags, metrics and the async schedule: README.md.
"""

import gc
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import psutil
import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, parse_flag_from_env
from datasets import load_dataset
from huggingface_hub import try_to_load_from_cache
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, set_seed
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

TINY_TASK = Path(__file__).resolve().parent / "benchmark" / "tiny_task"
# The dataset columns each --task reads (README "Tasks").
TASK_COLUMNS = {"tiny": ["query", "reference_response"], "tldr": ["query", "reference_response"], "no_robots": ["messages"], "gsm8k": ["question", "answer"]}
# GSM8k's prompt: the format the paper's policy (Rho-1B SFT on GSM8k, after Kazemnejad et al. 2024) was fine-tuned on.
GSM8K_PROMPT = "[MATH_TASK] Problem:\n{question}\n\nSolution:"
# GSM8k's final answer, as OpenAI's grade-school-math checker (the paper's verifier) reads it: the first match counts.
GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


@dataclass
class Args:
    # common
    exp_name: str = "online_dpo_async"
    """name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the prompt order, sampling and initialisation"""
    output_dir: str | None = None
    """where metrics, TensorBoard logs, checkpoints and the final policy go (None: runs/<run name>)"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline on machines without network)"""
    wandb_project: str = "async-rlhf"
    """wandb project"""
    wandb_entity: str | None = None
    """wandb entity (team)"""

    # data and models (local paths or hub ids)
    task: Literal["tiny", "tldr", "no_robots", "gsm8k"] = "tiny"
    """prompt format, reward and evaluation: tiny/tldr read `query` + `reference_response`, no_robots chat `messages`, gsm8k `question` + `answer` (verifier reward)"""
    dataset_name: str = str(TINY_TASK / "data")
    """prompts: a hub dataset id, a local dataset folder, or a .jsonl/.json/.parquet file, with the columns of --task"""
    dataset_config: str | None = None
    """config name of the dataset (`main` for openai/gsm8k); a local folder declares its configs in its README, as a hub repository does"""
    dataset_train_split: str = "train"
    """split whose prompts are trained on"""
    dataset_eval_split: str = "test"
    """split whose prompts (and reference responses) are evaluated on"""
    num_eval_prompts: int | None = None
    """evaluate on the first this many eval prompts (None: all)"""
    sft_model_path: str = str(TINY_TASK / "sft")
    """initial policy; also the frozen reference policy"""
    reward_model_path: str = str(TINY_TASK / "reward")
    """proxy reward model trained on (`AutoModelForSequenceClassification`, one label)"""
    gold_judge: str = "tiny"
    """evaluation-only judge: `tiny` (the tiny task's exact scorer; no gold judge on other tasks) or a reward model path / hub id (not with gsm8k)"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    max_prompt_length: int = 12
    """prompts longer than this many tokens are dropped (the count is printed)"""
    response_length: int = 12
    """maximum number of generated tokens per completion"""

    # batch sizes (in prompts; each prompt gets `num_samples` completions)
    total_episodes: int = 12800
    """prompt-completion pairs to sample over the run (prompts x num_samples); sets the number of steps"""
    local_micro_batch_size: int = 32
    """prompts per forward/backward pass on one process (HF's per_device_train_batch_size)"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step"""
    num_mini_batches: int = 1
    """N: a generated batch holds N mini-batches, trained with N successive optimizer steps (paper section 3.2)"""
    num_ppo_epochs: int = 1
    """T: passes over each generated batch (paper section 4.1)"""
    local_rollout_forward_batch_size: int = 64
    """sequences per no-grad forward (reward model, reference model)"""

    # optimisation
    learning_rate: float = 1e-4
    """initial learning rate (see --lr_schedule)"""
    lr_schedule: Literal["linear", "constant"] = "linear"
    """linear: decayed to 0 over all updates; constant: GSM8k's (the paper's table 10)"""
    adam_epsilon: float = 1e-5
    """AdamW epsilon"""

    # generation / async
    async_level: int = 1
    """k: the batch trained at step n is generated by policy version max(0, n - k); 0 is synchronous on-policy"""
    num_samples: int = 2
    """K completions per prompt; DPO pairs the highest- and lowest-scored one (paper section 4.2)"""
    temperature: float = 0.7
    """sampling temperature of training and evaluation completions (gsm8k evaluates greedily); logits are divided by it for logprobs"""
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the engine's weights (auto: --dtype's); float32 keeps engine and trainer numerics equal"""
    vllm_placement: Literal["auto", "separate", "shared"] = "auto"
    """GPU of the engine: separate = the GPU after the N training GPUs (the paper's split), shared = training
    rank 0's GPU, within --vllm_gpu_memory_utilization; auto = separate when N + 1 GPUs are visible"""
    vllm_gpu_memory_utilization: float | None = None
    """fraction of its GPU's memory the engine may take (None: 0.9 on a GPU of its own, 0.3 on a shared one)"""
    vllm_enforce_eager: bool = False
    """run the engine without CUDA graphs (always so on CPUs)"""

    # trainer numerics and memory
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the policy, reference, reward and gold models (auto: bfloat16 on GPUs, float32 on CPUs). bfloat16:
    fp32 weights with bf16 autocast for the trained and reference models, bf16 weights for the reward and gold models"""
    gradient_checkpointing: bool = False
    """recompute the policy's activations in the backward pass: less memory, about a third more compute"""

    # algorithm
    beta: float = 0.1
    """DPO beta: strength of the implicit KL regularisation"""
    loss_type: Literal["sigmoid", "ipo", "best_of_k_sft"] = "sigmoid"
    """sigmoid: DPO; ipo: IPO; best_of_k_sft: SFT on the best of K samples (paper's Best-of-2 baseline)"""
    missing_eos_penalty: float = -3.0
    """score given to completions that do not end with EOS within response_length (not with gsm8k: table 10 has no penalty)"""

    # evaluation and checkpoints
    eval_freq: int = 25
    """evaluate every this many steps (and at step 0 and at the end)"""
    save_freq: int = 0
    """write a resumable checkpoint every this many steps (0: none; one is also written on SIGTERM / Ctrl-C)"""
    resume: bool = False
    """continue the run in --output_dir from its latest checkpoint (a run that has none starts over)"""
    num_sample_completions: int = 4
    """eval completions printed and logged as a table at each evaluation"""


# ---------------------------------------------------------------------------------------------
# Sizes: every derived batch size in one place.
# ---------------------------------------------------------------------------------------------
class Sizes(NamedTuple):
    world_size: int
    local_mini_batch_size: int
    mini_batch_size: int
    local_batch_size: int
    batch_size: int
    episodes_per_step: int
    num_steps: int
    num_updates: int


class UsageError(ValueError):
    """Bad flags or input files: reported in one line, before any model loads."""


def compute_sizes(args: Args, world_size: int) -> Sizes:
    """Derive and check the batch sizes; errors name the flags to change."""
    if args.async_level < 0:
        raise UsageError(f"--async_level must be >= 0, got {args.async_level}")
    if args.num_samples < 2:
        raise UsageError(f"--num_samples must be >= 2 (DPO needs a best and a worst completion), got {args.num_samples}")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0 (logprobs divide logits by it), got {args.temperature}")
    if not math.isfinite(args.missing_eos_penalty):
        raise UsageError(f"--missing_eos_penalty must be a finite number, got {args.missing_eos_penalty}")
    for flag in ("local_micro_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs", "max_prompt_length", "response_length"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    for flag in ("eval_freq", "save_freq"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    local_mini_batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps
    local_batch_size = local_mini_batch_size * args.num_mini_batches
    batch_size = local_batch_size * world_size
    episodes_per_step = batch_size * args.num_samples
    if args.total_episodes % episodes_per_step != 0 or args.total_episodes < episodes_per_step:
        raise UsageError(
            f"--total_episodes {args.total_episodes} must be a positive multiple of the episodes per step, "
            f"{episodes_per_step} = local_micro_batch_size {args.local_micro_batch_size} x gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} x num_mini_batches {args.num_mini_batches} x processes {world_size} "
            f"x num_samples {args.num_samples}; change --total_episodes or one of those flags"
        )
    num_steps = args.total_episodes // episodes_per_step
    return Sizes(
        world_size=world_size,
        local_mini_batch_size=local_mini_batch_size,
        mini_batch_size=local_mini_batch_size * world_size,
        local_batch_size=local_batch_size,
        batch_size=batch_size,
        episodes_per_step=episodes_per_step,
        num_steps=num_steps,
        num_updates=num_steps * args.num_ppo_epochs * args.num_mini_batches,
    )


def lr_factor(schedule: str, update: int, num_updates: int) -> float:
    """Learning rate of optimizer update `update` (0-indexed) over --learning_rate: linear decay to 0, or constant."""
    return 1.0 if schedule == "constant" else 1.0 - update / num_updates


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def load_split(name: str, split: str, config: str | None = None):
    """A split from a hub id, a local dataset folder or a single local file: the same `datasets` path. `config`
    is the dataset's config name; a local folder declares its configs in its README as a hub repository does
    (one without them has only `default`), and a single file has none."""
    if os.path.isfile(name):
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
        if Path(name).suffix not in builders:
            raise UsageError(f"--dataset_name {name}: a single file must be one of {', '.join(builders)}")
        if config is not None:
            raise UsageError(f"--dataset_config {config}: the single file --dataset_name {name} has no configs")
        return load_dataset(builders[Path(name).suffix], data_files={split: name}, split=split)
    try:
        return load_dataset(name, config, split=split)
    except (FileNotFoundError, ValueError) as exc:  # no such dataset / config / split: say which flag, not a traceback
        lines = str(exc).strip().splitlines()
        detail = " ".join(lines[:2]) if lines[0].startswith("Config name is missing") else lines[0]  # the 2nd line lists the configs
        raise UsageError(f"--dataset_name {name}{f' --dataset_config {config}' if config else ''} split {split}: {detail}") from exc


class Prompts(NamedTuple):
    token_ids: list[list[int]]  # unpadded
    queries: list[str]
    references: list[str]


def task_prompts(dataset, task: str, tokenizer, where: str) -> tuple[list[str], list[str]]:
    """The prompt text the policy sees and the reference answer of every row, in the format of --task (README "Tasks")."""
    if task == "gsm8k":
        answers = list(dataset["answer"])
        if unlabelled := [i for i, answer in enumerate(answers) if gsm8k_answer(answer) is None]:
            raise UsageError(f"{where}: {len(unlabelled)} `answer`(s) without a '#### <number>' final answer (row {unlabelled[0]}): not GSM8k's format")
        return [GSM8K_PROMPT.format(question=question) for question in dataset["question"]], answers
    if task == "no_robots":
        if tokenizer.chat_template is None:
            raise UsageError(f"--task no_robots writes prompts with the policy's chat template, and the tokenizer of --sft_model_path {tokenizer.name_or_path} has none")
        prompts, references = [], []
        for i, messages in enumerate(dataset["messages"]):
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise UsageError(f"{where}: row {i}'s `messages` do not end with an assistant turn after the prompt (the reference answer)")
            # the conversation before the final assistant turn, ending with the header of the assistant's turn
            prompts.append(tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True))
            references.append(messages[-1]["content"])
        return prompts, references
    return list(dataset["query"]), list(dataset["reference_response"])


def load_prompts(name: str, split: str, tokenizer, max_prompt_length: int, limit: int | None = None, task: str = "tiny", config: str | None = None) -> Prompts:
    """The first `limit` prompts of a split in the format of --task; those longer than max_prompt_length tokens are dropped."""
    dataset = load_split(name, split, config)
    missing = [column for column in TASK_COLUMNS[task] if column not in dataset.column_names]
    if missing:
        raise UsageError(f"--dataset_name {name} split {split} lacks column(s) {missing} of --task {task}; it has {dataset.column_names}")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    queries, references = task_prompts(dataset, task, tokenizer, f"--dataset_name {name} split {split}")
    # A chat template writes the BOS token itself (Llama 3.1's does): encoding the text must not add a second one.
    token_ids = tokenizer(queries, add_special_tokens=task != "no_robots").input_ids
    keep = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_length]
    if len(keep) < len(token_ids):
        print(f"{split}: dropped {len(token_ids) - len(keep)} of {len(token_ids)} prompts longer than --max_prompt_length {max_prompt_length}")
    if not keep:
        raise UsageError(f"no {split} prompt fits --max_prompt_length {max_prompt_length}")
    return Prompts(
        token_ids=[token_ids[i] for i in keep],
        queries=[queries[i] for i in keep],
        references=[references[i] for i in keep],
    )


def prompt_indices_for_step(step: int, num_prompts: int, batch_size: int, seed: int) -> np.ndarray:
    """Prompts of a step: each epoch is a fresh seeded permutation, cut into full batches in order,
    so every prompt batch is trained on exactly once per epoch."""
    batches_per_epoch = num_prompts // batch_size
    epoch, i = divmod(step, batches_per_epoch)
    permutation = np.random.default_rng([seed, epoch]).permutation(num_prompts)
    return permutation[i * batch_size : (i + 1) * batch_size]


def left_pad(sequences: list[list[int]], length: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to `length`; the mask comes from the lengths, never from comparing ids with pad
    (Pythia's pad token is its EOS token)."""
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
    positions = torch.arange(row_len, device=bools.device)
    return torch.where(bools, positions, row_len).min(-1).values


def truncate_responses(responses: list[list[int]], response_length: int, eos_token_id: int, pad_token_id: int):
    """Pad completions to `response_length` and cut everything after the first EOS.
    Returns ids, mask (1 up to and including the first EOS) and whether each ended with EOS."""
    ids = torch.full((len(responses), response_length), pad_token_id, dtype=torch.long)
    for row, seq in enumerate(responses):
        seq = seq[:response_length]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    lengths = torch.tensor([min(len(seq), response_length) for seq in responses])
    eos_index = first_true_indices(ids == eos_token_id)
    contain_eos = eos_index < lengths
    lengths = torch.where(contain_eos, eos_index + 1, lengths)
    mask = (torch.arange(response_length)[None, :] < lengths[:, None]).long()
    ids = ids.masked_fill(mask == 0, pad_token_id)
    return ids, mask, contain_eos


# ---------------------------------------------------------------------------------------------
# Models: logprobs, rewards
# ---------------------------------------------------------------------------------------------
def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "attn_dropout", "hidden_dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)


def position_ids_from(mask: torch.Tensor) -> torch.Tensor:
    """Positions count real tokens only, so left padding does not shift them (N details, #2)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def response_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """Per-token logprobs of the responses under `model`, logits divided by the sampling temperature
    (N details, #9); positions after the first EOS are 0."""
    input_ids = torch.cat([query_ids, response_ids], 1)
    mask = torch.cat([query_mask, response_mask], 1)
    # logits of the positions that predict the response only: a 50k vocabulary makes the others the largest tensor
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask), logits_to_keep=response_ids.shape[1] + 1).logits
    logits = logits[:, :-1].float() / temperature
    logprobs = logits.gather(2, response_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return logprobs * response_mask


def forward_flops(model, sequences: int, length: int, logit_positions: int | None = None) -> int:
    """Matmul FLOPs of a forward pass, 2 per parameter and token (Kaplan et al. 2020, attention's quadratic term
    left out): every token through the body, `logit_positions` per sequence through the output head (all when
    None), none through the input embedding, a lookup. A training pass is 3 forwards' worth, 4 when recomputing."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    head_params = 0 if head is None else head.weight.numel()
    tied = head is not None and head.weight is embedding
    body = sum(p.numel() for p in model.parameters()) - embedding.numel() - (0 if tied else head_params)
    return 2 * sequences * (body * length + head_params * (length if logit_positions is None else logit_positions))


def reward_head(model):
    return model.score if hasattr(model, "score") else model.classifier


def get_reward(model, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Reward-model score at the last real token; computed from the backbone so that padding on
    either side (and pad == EOS tokenizers) cannot move the read-out position."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask)).last_hidden_state
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)
    return reward_head(model)(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1).float()


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
        length = max(len(ids) for ids in encoded)
        ids, mask = left_pad(encoded, length, tokenizer.pad_token_id)
        scores.append(get_reward(model, ids.to(device), mask.to(device)))
    return torch.cat(scores)


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab() and a.bos_token_id == b.bos_token_id and a.eos_token_id == b.eos_token_id


@torch.no_grad()
def score_completions(
    reward_model, reward_tokenizer, policy_tokenizer, query_ids, query_mask, response_ids, response_mask, contain_eos, batch_size
) -> torch.Tensor:
    """Reward model on query + response. With another tokenizer, go through text: decode without
    special tokens, re-encode, and end with the reward model's EOS where the policy stopped."""
    if same_tokenizer(reward_tokenizer, policy_tokenizer):
        input_ids = torch.cat([query_ids, response_ids], 1)
        mask = torch.cat([query_mask, response_mask], 1)
        return torch.cat(
            [get_reward(reward_model, input_ids[i : i + batch_size], mask[i : i + batch_size]) for i in range(0, len(input_ids), batch_size)]
        )
    texts = []
    for q, qm, r, rm, eos in zip(query_ids, query_mask, response_ids, response_mask, contain_eos):
        text = policy_tokenizer.decode(torch.cat([q[qm.bool()], r[rm.bool()]]).tolist(), skip_special_tokens=True)
        texts.append(text + (reward_tokenizer.eos_token if eos else ""))
    return score_texts(reward_model, reward_tokenizer, texts, batch_size, query_ids.device)


def apply_missing_eos_penalty(scores: torch.Tensor, contain_eos: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(contain_eos, scores, torch.full_like(scores, penalty))


def gsm8k_answer(text: str) -> str | None:
    """The final answer of a GSM8k solution as OpenAI's grade-school-math checker reads it: the FIRST match of
    `#### (-?[0-9.,]+)` (one space after "####"), commas removed ("#### 1,020 dollars" -> "1020"); None without a
    match. What follows the number (a unit, a made-up next problem with its own "####") is not read; "####18" has no
    answer, and "#### 18." reads "18." (the period is one of the characters the pattern takes)."""
    match = GSM8K_ANSWER.search(text)
    return None if match is None else match.group(1).replace(",", "")


def gsm8k_reward(completion: str, answer: str) -> float:
    """GSM8k's verifier (paper section 5.2, OpenAI's grade-school-math checker): 1.0 when the completion's answer
    (`gsm8k_answer`) is the label's, compared as strings, else 0.0 (no answer: 0.0). Nothing else is normalised:
    "18." is not "18", "3.0" is not "3", and "#### −5" (Unicode minus) or "#### $5" has no answer."""
    predicted = gsm8k_answer(completion)
    return float(predicted is not None and predicted == gsm8k_answer(answer))


def check_scores(scores: torch.Tensor, source: str, step: int) -> None:
    """Stop the run on a NaN or infinite reward, before it is paired or turned into advantages, which would use it
    silently; like the NaN-loss stop, the error names the step, and `source` where the scores came from."""
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        values = ", ".join(str(scores[i].item()) for i in bad[:4])
        raise RuntimeError(f"{source} gave nan/inf scores at step {step} ({len(bad)} of {len(scores)} completions: {values}{', ...' if len(bad) > 4 else ''})")


def verify_completions(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor, answers: list[str]) -> torch.Tensor:
    """GSM8k rewards of a batch: each completion decoded without special tokens (its EOS dropped), checked against its label."""
    texts = [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=True) for r, m in zip(response_ids, response_mask)]
    return torch.tensor([gsm8k_reward(text, answer) for text, answer in zip(texts, answers)], device=response_ids.device)


@torch.no_grad()
def reference_perplexities(model, query_ids, query_mask, response_ids, response_mask) -> torch.Tensor:
    """Perplexity of each completion under `model` (the frozen reference policy, at temperature 1) over its own
    tokens, EOS included and the prompt excluded: exp(-mean_t log pi_ref(y_t | x, y_<t)). The paper's KL proxy
    (section 3.1) is the mean of these over the eval completions, as its evaluation code averages them."""
    logprobs = response_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature=1.0)
    return torch.exp(-logprobs.sum(1) / response_mask.sum(1).clamp(min=1))


# ---------------------------------------------------------------------------------------------
# Online DPO (paper eq. 2)
# ---------------------------------------------------------------------------------------------
def select_chosen_rejected(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (prompts, K) -> chosen = first highest, rejected = last lowest, and `tied` where all K
    scores are equal: such a prompt carries no preference and is left out of the loss."""
    num_samples = scores.shape[1]
    chosen = scores.argmax(1)  # first maximal index
    rejected = num_samples - 1 - scores.flip(1).argmin(1)  # last minimal index
    tied = scores.max(1).values == scores.min(1).values
    return chosen, rejected, tied


def dpo_loss(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float, loss_type: str) -> torch.Tensor:
    """Per-pair loss on summed sequence logprobs: sigmoid = -log sigmoid(beta h), ipo = (h - 1/(2 beta))^2,
    with h = (logp_c - ref_c) - (logp_r - ref_r)."""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown --loss_type {loss_type}")


def dpo_batch_loss(per_pair: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the untied pairs' losses summed, divided by ALL its pairs. Dividing by the untied ones
    only would multiply the step by up to 10x as the policy converges (60-90 % of the tiny task's pairs tie); this
    way every informative pair weighs lr / B whatever the tie fraction, as a prompt whose K samples score the same
    still counts in RLOO's and PPO's means (README, `val/tied_pairs`)."""
    return (per_pair * (~tied).float()).sum() / len(per_pair)


# ---------------------------------------------------------------------------------------------
# Tiny task gold judge (exact; used only for evaluation, like TLDR's 6.9B gold reward model)
# ---------------------------------------------------------------------------------------------
def tiny_gold_score(query: str, response: str) -> float:
    """Gold judge of the tiny task: 1.0 iff `response` is the query's words sorted, then "</s>".

    quality q in [0, 1] = mean of: right word in the right place, F1 of the word multisets,
    fraction of adjacent output words in increasing order. Score 2q - 1 if the response stopped
    with "</s>", else q - 1: a stopped answer that is more than half right beats any that did not stop."""
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


# ---------------------------------------------------------------------------------------------
# Generation thread (Cleanba-style: bounded queues of small version-tagged payloads)
# ---------------------------------------------------------------------------------------------
class Weights(NamedTuple):
    version: int
    flat: torch.Tensor  # every tensor of theta_version, one after the other (see snapshot_weights)
    layout: list[tuple[str, list[int], int]]  # (checkpoint name, shape, offset in `flat`)


class Rollout(NamedTuple):
    step: int
    version: int
    prompt_indices: np.ndarray
    responses: list[list[int]]  # num_samples consecutive completions per prompt
    generation_time: float
    weight_sync_time: float
    wait_time: float  # generator idle, waiting for the weights it needs
    generation_start: float  # time.perf_counter() when each phase began (for the timeline plot)
    weight_sync_start: float


class EvalRollout(NamedTuple):
    version: int
    responses: list[list[int]]
    generation_time: float
    generation_start: float


def generation_schedule(num_steps: int, async_level: int, eval_steps: list[int]) -> list[tuple[str, int, int]]:
    """The generator's work in order: (kind, index, policy version it needs).
    Rollout m is generated by version max(0, m - async_level) (SPEC section 4); an evaluation of
    version v is run right after the last rollout that needs v, so the engine never goes backwards."""
    events = [("rollout", m, max(0, m - async_level)) for m in range(num_steps)]
    events += [("eval", v, v) for v in eval_steps]
    return sorted(events, key=lambda e: (e[2], e[0] == "eval", e[1]))


def published_versions(schedule: list[tuple[str, int, int]]) -> set[int]:
    """Versions the trainer must send to the engine (version 0 is loaded at start)."""
    return {version for _, _, version in schedule if version > 0}


def dead_processes(processes: list[psutil.Process]) -> list[int]:
    dead = []
    for process in processes:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                dead.append(process.pid)
        except psutil.NoSuchProcess:
            dead.append(process.pid)
    return dead


def get_or_raise(q: queue.Queue, stop: threading.Event, error: list, engine_processes=(), interrupt: list | tuple = (), timeout: float = 0.5):
    """Blocking get that wakes up to notice the other side failing or shutting down. The engine's own
    processes are watched too: when one is killed, vLLM's client can wait for its output forever.
    Returns None once `interrupt` is non-empty (a SIGTERM / Ctrl-C, which may have hit the engine too)."""
    while True:
        if interrupt:
            return None
        if error:
            raise RuntimeError("generation thread failed (its traceback is above)") from error[0]
        if stop.is_set():
            raise SystemExit("stopped")
        if dead := dead_processes(engine_processes):
            raise RuntimeError(f"the generation engine's process(es) {dead} died")
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            continue


def kill_process_trees(processes: list[psutil.Process], timeout: float = 5) -> None:
    """SIGKILL these processes and every process they started. Each is stopped first, so that none can
    start another between our listing its children and killing it. Waits (up to `timeout`) for them to
    die without reaping them: vLLM's process manager reaps its own."""
    stopped, todo = {}, list(processes)
    while todo:
        process = todo.pop()
        try:
            if process.pid not in stopped:
                process.suspend()
                stopped[process.pid] = process
                todo.extend(process.children())
        except psutil.Error:
            pass
    for process in stopped.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    deadline = time.time() + timeout
    while len(dead_processes(list(stopped.values()))) < len(stopped) and time.time() < deadline:
        time.sleep(0.02)


def started_processes(before: set[int]) -> list[psutil.Process]:
    """Children of this process not in `before`, but for Python's resource tracker (a child that
    multiprocessing starts here for the engine: it must outlive the engine to clean up after it)."""
    started = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in before and "multiprocessing.resource_tracker" not in " ".join(process.cmdline()):
                started.append(process)
        except psutil.Error:
            pass
    return started


def shared_memory_of(processes: list[psutil.Process]) -> list[str]:
    """The POSIX shared memory segments (Python's psm_*) these processes map: vLLM's message queues."""
    names = set()
    for process in processes:
        try:
            names.update(os.path.basename(m.path) for m in process.memory_maps() if m.path.startswith("/dev/shm/psm_"))
        except psutil.Error:
            pass
    return sorted(names)


def release_shared_memory(names: list[str]) -> None:
    """Unlink the engine's message queues that its processes, killed by their shutdown's timeout, could not:
    vLLM's scheduler process unlinks its queue only after its worker has exited, which takes seconds (a garbage
    collection). Call once those processes are dead. Unlinking here also tells Python's resource tracker, which
    would otherwise unlink them at exit with a "leaked shared_memory objects" warning."""
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue  # its creator unlinked it
        segment.close()
        segment.unlink()


# The watchdog's code (run as `python -c`): it blocks reading the pipe the trainer holds the only write end of.
# When the trainer dies, however it dies (kill -9 included), the pipe closes: it then kills the engine's
# processes, which would otherwise live on, re-parented to init, and removes the weights folder. Lines:
# "process <pid> <create time>" (the time guards against a re-used pid) and "folder <path>".
WATCHDOG = """
import shutil, sys
import psutil
lines = sys.stdin.read().splitlines()
stopped, todo = [], []
for line in lines:
    kind, _, value = line.partition(" ")
    if kind == "process":
        pid, create_time = value.split()
        try:
            process = psutil.Process(int(pid))
            if abs(process.create_time() - float(create_time)) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
                todo.append(process)
        except psutil.Error:
            pass
while todo:
    process = todo.pop()
    try:
        process.suspend()
        stopped.append(process)
        todo.extend(process.children())
    except psutil.Error:
        pass
for process in stopped:
    try:
        process.kill()
    except psutil.Error:
        pass
for line in lines:
    if line.startswith("folder "):
        shutil.rmtree(line[len("folder "):], ignore_errors=True)
"""


def start_watchdog(processes: list[psutil.Process], folder: str) -> subprocess.Popen:
    """A process of its own session (a Ctrl-C to the terminal does not reach it) that cleans up after the
    trainer if it dies without doing so itself; closing its stdin at a normal exit lets it go. Start it after
    the engine: the engine's processes must not hold the pipe's write end (it is not inheritable either)."""
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG], stdin=subprocess.PIPE, start_new_session=True, text=True)
    lines = []
    for process in processes:
        try:
            lines.append(f"process {process.pid} {process.create_time()!r}\n")
        except psutil.Error:
            pass
    watchdog.stdin.write("".join(lines) + f"folder {folder}\n")
    watchdog.stdin.flush()
    return watchdog


def remove_stale_weights_folders(parent: str) -> list[str]:
    """Remove the weights folders (policy-weights-<pid>-*) in `parent` whose trainer is no longer alive:
    what a trainer killed together with its watchdog leaves in RAM. Returns the folders removed."""
    removed = []
    for path in Path(parent).glob("policy-weights-*"):
        match = re.fullmatch(r"policy-weights-(\d+)-\w+", path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def checkpoint_names(model) -> dict[str, str]:
    """In-memory name -> the name `save_pretrained` writes, for each tensor it writes. transformers renames some
    tensors when it saves (GPTNeoX's `lm_head` is `embed_out` in Pythia's checkpoints) and leaves tied copies out;
    the engine loads checkpoint names (vLLM's CUDA GPTNeoX has no `lm_head`)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
    for key in model._keys_to_ignore_on_save or []:
        state.pop(key, None)
    tags = {name: torch.empty(0) for name in state}  # one distinct object per tensor: which one gets which name
    owner = {id(tag): name for name, tag in tags.items()}
    names = {owner.get(id(tag)): saved for saved, tag in revert_weight_conversion(model, dict(tags)).items()}
    if None in names or len(names) != len(tags):
        raise UsageError(f"{type(model).__name__}: transformers converts (not only renames) its weights when saving; the weight push cannot")
    return names


def views(flat: torch.Tensor, layout: list[tuple[str, list[int], int]]) -> list[tuple[str, torch.Tensor]]:
    return [(name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]


def snapshot_weights(state_dict: dict[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype, device) -> tuple[torch.Tensor, list]:
    """theta_v for the engine: a copy in the engine's dtype under the checkpoint's names, in one buffer, taken
    between optimizer steps so the optimizer never writes what the engine reads. On a GPU the buffer stays in GPU
    memory and one CUDA IPC handle shares it with the engine; on a CPU it goes through a file."""
    if missing := [key for key in names if key not in state_dict]:
        raise RuntimeError(f"the weights to push lack {len(missing)} tensor(s) of the policy, e.g. {missing[0]}")
    layout, offset = [], 0
    for key, tensor in state_dict.items():
        if key in names:
            layout.append((names[key], list(tensor.shape), offset))
            offset += tensor.numel()
    flat = torch.empty(offset, dtype=dtype, device=device)
    for (_, view), key in zip(views(flat, layout), [k for k in state_dict if k in names]):
        view.copy_(state_dict[key].detach())
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()  # the engine's process reads it without our stream
    return flat, layout


class WeightReceiver:
    """Added to vLLM's GPU worker (`worker_extension_cls`): loads a snapshot the trainer shares by CUDA IPC,
    with no file and no copy through the CPU, through the model's own loader (which fuses q/k/v and gate/up and
    reorders GPTNeoX's q/k/v as it does for a checkpoint). The copy is in place, so CUDA graphs see it."""

    def load_shared_weights(self, handle: tuple, layout: list, trainer_gpu: int) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handle = list(handle)
        handle[6] = trainer_gpu  # the snapshot's GPU, as this process numbers its GPUs
        flat = rebuild_cuda_tensor(*handle)
        self.reload_weights(weights_iterator=iter(views(flat, layout)))
        torch.cuda.synchronize()  # loaded before the trainer may free the snapshot


def push_weights(llm: LLM, weights: Weights, directory: str, trainer_gpu: int) -> None:
    """Load theta_v into the running engine without restarting it. GPU: a CUDA IPC handle of the snapshot, loaded
    by the engine's worker (WeightReceiver). CPU: safetensors in a RAM-backed folder, reloaded in place (tensors
    cannot travel over the RPC). The prefix cache holds KV computed with the old weights, so reset it."""
    if weights.flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        llm.collective_rpc("load_shared_weights", args=(reduce_tensor(weights.flat)[1], weights.layout, trainer_gpu))
    else:
        save_file({name: view.clone() for name, view in views(weights.flat, weights.layout)}, os.path.join(directory, "model.safetensors"))
        llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    llm.reset_prefix_cache()


def generate(llm: LLM, prompts: list[list[int]], n: int, temperature: float, max_tokens: int, eos_token_id: int, seeds: list[int]):
    """n completions per prompt; each prompt gets its own sampling seed so a batch is reproducible
    whatever else the engine has generated before."""
    params = [
        SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, stop_token_ids=[eos_token_id], seed=seed, detokenize=False)
        for seed in seeds
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(completion.token_ids) for output in outputs for completion in output.outputs]


def generation_thread(
    llm: LLM,
    schedule: list[tuple[str, int, int]],
    train_prompts: list[list[int]],
    eval_prompts: list[list[int]],
    args: Args,
    batch_size: int,
    eos_token_id: int,
    weights_queue: queue.Queue,
    rollout_queue: queue.Queue,
    eval_queue: queue.Queue,
    stop: threading.Event,
    error: list,
    weights_dir: str,
    trainer_gpu: int,
):
    try:
        version = 0
        for kind, index, needed in schedule:
            wait_start = time.perf_counter()
            sync_time, sync_start = 0.0, None
            while version < needed:
                weights = get_or_raise(weights_queue, stop, [])
                push_start = time.perf_counter()
                sync_start = sync_start or push_start
                push_weights(llm, weights, weights_dir, trainer_gpu)
                sync_time += time.perf_counter() - push_start
                version = weights.version
            if version != needed:
                raise RuntimeError(f"{kind} {index} needs policy version {needed} but the engine holds {version}")
            wait_time = time.perf_counter() - wait_start - sync_time
            gen_start = time.perf_counter()
            if kind == "rollout":
                if injected_fault("generation", index):
                    raise RuntimeError(f"injected test fault in generation at rollout {index} (time {time.time():.2f})")
                indices = prompt_indices_for_step(index, len(train_prompts), batch_size, args.seed)
                seeds = [args.seed * 1_000_003 + index * batch_size + i for i in range(len(indices))]
                responses = generate(
                    llm, [train_prompts[i] for i in indices], args.num_samples, args.temperature, args.response_length, eos_token_id, seeds
                )
                rollout = Rollout(index, version, indices, responses, time.perf_counter() - gen_start, sync_time, wait_time, gen_start, sync_start or gen_start)
                rollout_queue.put(rollout)
            else:
                seeds = [args.seed + i for i in range(len(eval_prompts))]
                temperature = 0.0 if args.task == "gsm8k" else args.temperature  # GSM8k's pass@1 is greedy (paper section 5.2)
                responses = generate(llm, eval_prompts, 1, temperature, args.response_length, eos_token_id, seeds)
                eval_queue.put(EvalRollout(version, responses, time.perf_counter() - gen_start, gen_start))
    except SystemExit:
        pass
    except BaseException as exc:
        traceback.print_exc()
        error.append(exc)


@contextmanager
def on_cores(cores: list[int] | None):
    """Run the block on these cores (None: where it runs now). On Linux affinity belongs to a thread and
    is inherited by the threads and processes it starts; the calling thread gets its own back after."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class Placement(NamedTuple):
    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's processes; None: CPU
    shared: bool  # the engine shares training rank 0's GPU
    trainer_gpu: int  # rank 0's GPU, which holds the weight snapshots, as the engine's processes number their GPUs
    memory_utilization: float


def engine_placement(mode: str, visible: list[str], num_training_processes: int, memory_utilization: float | None) -> Placement:
    """Where the engine runs. Training process i uses visible GPU i. With an (N+1)-th visible GPU the engine takes it
    (the paper's split); with fewer, it shares rank 0's GPU within its memory budget. Its processes see rank 0's GPU
    too, second, to open the snapshots that rank 0 shares by CUDA IPC (README "GPUs")."""
    if memory_utilization is not None and not 0 < memory_utilization <= 1:
        raise UsageError(f"--vllm_gpu_memory_utilization must be in (0, 1], got {memory_utilization}")
    if not visible:
        return Placement(None, False, 0, memory_utilization or 0.9)
    separate = len(visible) > num_training_processes if mode == "auto" else mode == "separate"
    if separate and len(visible) <= num_training_processes:
        raise UsageError(
            f"--vllm_placement separate: {num_training_processes} training process(es) and the engine need "
            f"{num_training_processes + 1} GPUs, {len(visible)} are visible; use --vllm_placement shared or fewer processes"
        )
    if separate:
        return Placement(f"{visible[num_training_processes]},{visible[0]}", False, 1, memory_utilization or 0.9)
    return Placement(visible[0], True, 0, memory_utilization or 0.3)


def visible_gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def check_engine_fits(memory_utilization: float, free: int, total: int) -> None:
    """A shared GPU: vLLM takes memory_utilization x the GPU's memory and refuses to start when less is free."""
    if memory_utilization * total > free:
        raise UsageError(
            f"--vllm_gpu_memory_utilization {memory_utilization}: the engine would take {memory_utilization * total / 2**30:.1f} GiB "
            f"of the GPU it shares with training, which has {free / 2**30:.1f} GiB free once the trainer's models are loaded; "
            f"lower it to at most {max(int(100 * free / total) - 5, 0) / 100} (the optimizer state and activations need room too), or use a GPU of its own"
        )


def make_engine(args: Args, placement: Placement, dtype: str) -> LLM:
    """The engine runs in its own process (vLLM's default), so generation does not share the trainer's
    interpreter lock, and architectures vLLM serves through its Transformers backend (GPTNeoX/Pythia on CPUs)
    do not patch the trainer's model classes. The child inherits the environment set here."""
    env = dict(os.environ)
    # torch.distributed variables of an `accelerate launch` would make the engine join our group
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    gpu = {}
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
        # the worker imports WeightReceiver from this file
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent), *filter(None, [env.get("PYTHONPATH")])])
        gpu = dict(worker_extension_cls=f"{Path(__file__).stem}.WeightReceiver")
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default reserves far more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the engine warns on every push that rotary caches are not in the checkpoint
    try:
        return LLM(
            model=args.sft_model_path,
            dtype=dtype,
            seed=args.seed,
            max_model_len=args.max_prompt_length + args.response_length,
            gpu_memory_utilization=placement.memory_utilization,
            enforce_eager=placement.devices is None or args.vllm_enforce_eager,  # CUDA graphs on GPUs
            use_tqdm_on_load=False,
            load_format="safetensors",
            trust_remote_code=args.trust_remote_code,
            **gpu,
        )
    finally:
        os.environ.clear()
        os.environ.update(env)


# ---------------------------------------------------------------------------------------------
# Logging and saving
# ---------------------------------------------------------------------------------------------
class MetricsLogger:
    """metrics.jsonl (one JSON object per line, each with step and episode), TensorBoard, wandb."""

    def __init__(self, output_dir: str, run_name: str, args: Args):
        from tensorboardX import SummaryWriter

        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(project=args.wandb_project, entity=args.wandb_entity, name=run_name, config=asdict(args), dir=output_dir)

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for key, value in metrics.items():
            if key not in ("step", "episode"):
                self.writer.add_scalar(key, value, metrics["episode"])
        if self.wandb:
            self.wandb.log(metrics)

    def log_samples(self, step: int, episode: int, rows: list[dict]) -> None:
        text = "\n\n".join(" | ".join(f"**{k}**: {v}" for k, v in row.items()) for row in rows)
        self.writer.add_text("samples", text, episode)
        if self.wandb:
            import wandb

            self.wandb.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows]), "step": step, "episode": episode})

    def close(self) -> None:
        self.file.close()
        self.writer.close()
        if self.wandb:
            self.wandb.finish()


def save_policy(accelerator: Accelerator, model, tokenizer, path: str) -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: no half-written model."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        tmp = f"{path}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


def git_revision() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, stderr=subprocess.DEVNULL, text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# ---------------------------------------------------------------------------------------------
# Checks of the inputs, checkpoints and resuming
# ---------------------------------------------------------------------------------------------
def name_run(args: Args) -> str:
    """<exp_name>__<seed>__<unix time>, as rank 0 sees it (the default --output_dir is runs/<run name>):
    another rank's clock may already be in the next second."""
    return broadcast_object_list([f"{args.exp_name}__{args.seed}__{int(time.time())}"])[0]


def load_tokenizer(path: str, flag: str, trust_remote_code: bool):
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {flag} {path} has no EOS token: completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from lengths, not from pad ids
    return tokenizer


def check_model(path: str, flag: str, args: Args) -> None:
    """Before any weights load: the model exists, has safetensors weights (pickled ones are never loaded),
    and prompt + response fit its positions."""
    if os.path.isdir(path) and not list(Path(path).glob("*.safetensors")):
        raise UsageError(f"{flag} {path} has no .safetensors weights (pickled .bin weights are not loaded)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {str(exc).strip().splitlines()[0]}") from exc
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context and args.max_prompt_length + args.response_length > context:
        raise UsageError(
            f"--max_prompt_length {args.max_prompt_length} + --response_length {args.response_length} exceed the "
            f"{context}-token context of {flag} {path}"
        )


def is_score_head(name: str) -> bool:
    """A weight of the head `reward_head` reads: `score` (Llama, GPT-NeoX, ...) or `classifier` (BERT-like models)."""
    return name == "score.weight" or name.startswith("classifier.")


def stored_weight_names(path: str, cache_dir: str | None = None) -> set[str] | None:
    """Names of the tensors a checkpoint stores, read from its safetensors index or headers (no weights load): a
    local folder, or a hub id whose weights are in the local cache; None when that cannot be told before loading."""
    if os.path.isdir(path):
        index = Path(path, "model.safetensors.index.json")
        index, files = (str(index) if index.exists() else None), [str(f) for f in Path(path).glob("*.safetensors")]
    else:
        try:
            index, single = (try_to_load_from_cache(path, name, cache_dir=cache_dir) for name in ("model.safetensors.index.json", "model.safetensors"))
        except ValueError:  # neither a folder nor a hub id
            return None
        index, files = (index if isinstance(index, str) else None), ([single] if isinstance(single, str) else [])
    if index is not None:
        return set(json.loads(Path(index).read_text())["weight_map"])
    if not files:
        return None
    names = set()
    for file in files:
        with safe_open(file, "pt") as weights:
            names.update(weights.keys())
    return names


def not_a_reward_model(path: str, flag: str) -> str:
    return f"{flag} {path} is not a reward model: its weights have no score head (score.weight or classifier.*), which loading would initialise at random"


def check_reward_model(path: str, flag: str, cache_dir: str | None = None) -> None:
    """Before any weights load: a reward model's score head is among its stored weights. From a causal LM (an SFT
    policy, say) AutoModelForSequenceClassification initialises the head at random, and a run would train against
    noise. A hub id not in the local cache cannot be told here: `load_reward_model` checks it as it loads."""
    names = stored_weight_names(path, cache_dir)
    if names is not None and not any(map(is_score_head, names)):
        raise UsageError(not_a_reward_model(path, flag))


def load_reward_model(path: str, flag: str, **kwargs):
    """AutoModelForSequenceClassification with one label, refused if its score head was not in the checkpoint."""
    model, info = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, output_loading_info=True, **kwargs)
    if any(map(is_score_head, info["missing_keys"])):
        raise UsageError(not_a_reward_model(path, flag))
    return model


def holds_a_run(output_dir: str) -> bool:
    """Whether a run has logged or saved anything in the folder: one stopped while starting (args.json and
    an empty metrics.jsonl) has not, and a plain re-run may use the folder."""
    metrics = Path(output_dir, "metrics.jsonl")
    return (metrics.exists() and metrics.stat().st_size > 0) or any(Path(output_dir, "checkpoints").glob("step_*")) or Path(output_dir, "policy").exists()


# Flags that may change when a run is resumed; any other must be what the run started with.
RESUMABLE_CHANGES = {"resume", "output_dir", "track", "wandb_project", "wandb_entity", "save_freq", "num_sample_completions"}


def checkpoint_to_resume(output_dir: str, args: Args, world_size: int) -> str | None:
    """The checkpoint a run continues from (None: it starts at step 0); two runs never share a folder."""
    run_file = os.path.join(output_dir, "args.json")
    if not args.resume:
        if holds_a_run(output_dir):
            raise UsageError(f"--output_dir {output_dir} holds another run: pass --resume to continue it, or choose another --output_dir")
        return None
    if os.path.exists(run_file):
        previous = json.loads(Path(run_file).read_text())
        changed = [f"--{k} {previous.get(k)!r} -> {v!r}" for k, v in asdict(args).items() if k not in RESUMABLE_CHANGES and previous.get(k) != v]
        if previous.get("world_size") != world_size:
            changed.append(f"training processes {previous.get('world_size')} -> {world_size}")
        if changed:
            raise UsageError(f"--resume: {', '.join(changed)} differ from the run in --output_dir {output_dir}; resume it with its own flags")
    checkpoints = sorted(p for p in Path(output_dir, "checkpoints").glob("step_*") if re.fullmatch(r"step_\d{6}", p.name))
    if checkpoints and "optimizer" not in json.loads((checkpoints[-1] / "trainer_state.json").read_text()):
        raise UsageError(f"--resume: {checkpoints[-1]} was written under DeepSpeed, whose optimizer state it lacks; it cannot be resumed")
    return str(checkpoints[-1]) if checkpoints else None


def pending_events(schedule: list[tuple[str, int, int]], next_step: int, evals_logged: set[int]) -> list[tuple[str, int, int]]:
    """The generator's work still owed to a trainer about to run `next_step`: later rollouts and the
    evaluations not yet logged. The policy versions they need are what a checkpoint must keep."""
    return [e for e in schedule if (e[1] >= next_step if e[0] == "rollout" else e[1] not in evals_logged)]


def optimizer_state_to_tensors(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state_dict as safetensors tensors named "<param index>.<name>", plus a JSON part."""
    tensors, other = {}, {}
    for index, values in state["state"].items():
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                other[f"{index}.{name}"] = value
    return tensors, {"param_groups": state["param_groups"], "other": other}


def optimizer_state_from_tensors(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for key, value in [*tensors.items(), *meta["other"].items()]:
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def keep_metrics_until(path: str, step: int, evals_logged: set[int]) -> None:
    """On resume, drop what the interrupted run logged after its checkpoint: those steps are trained again."""
    if not os.path.exists(path):
        return
    kept = []
    for line in Path(path).read_text().splitlines():
        metrics = json.loads(line)
        is_eval = any(key.startswith("eval/") for key in metrics)
        if (metrics["step"] in evals_logged) if is_eval else (metrics["step"] < step):
            kept.append(line + "\n")
    write_atomically(path, "".join(kept))


def write_atomically(path: str, text: str) -> None:
    """Temporary file, then rename: a reader (or a crash) never sees half a file."""
    Path(f"{path}.tmp").write_text(text)
    os.replace(f"{path}.tmp", path)


def write_eval_completions(output_dir: str, step: int, episode: int, prompts: list[str], completions: list[str], references: list[str]) -> str:
    """<output_dir>/eval_completions/step_NNNNNN.jsonl, one row per eval prompt, for judges that run after
    training (benchmark/llm_judge.py for No Robots). One file per evaluation: a resumed run that evaluates a
    step again replaces that step's file."""
    folder = os.path.join(output_dir, "eval_completions")
    os.makedirs(folder, exist_ok=True)
    rows = [{"step": step, "episode": episode, "prompt": p, "completion": c, "reference": r} for p, c, r in zip(prompts, completions, references)]
    path = os.path.join(folder, f"step_{step:06d}.jsonl")
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def injected_fault(where: str, step: int) -> bool:
    """Fault injection, used only by the tests: ASYNC_RLHF_TEST_FAULT=<where>:<step>."""
    return os.environ.get("ASYNC_RLHF_TEST_FAULT") == f"{where}:{step}"


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    # the process group and device, before the Accelerator that needs the dtype (as that Accelerator would make them)
    on_gpu = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")).device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" or (args.dtype == "auto" and on_gpu) else torch.float32
    engine_dtype = {"auto": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.vllm_dtype]
    # bf16: autocast in the forward passes of the policy (accelerate's mixed precision) and of every frozen model
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision="bf16" if dtype == torch.bfloat16 else "no")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on tensor cores (GPUs only)
    run_name = name_run(args)
    output_dir = args.output_dir or os.path.join("runs", run_name)
    deepspeed = accelerator.state.deepspeed_plugin
    try:  # every check of the flags and input files, before any model loads
        sizes = compute_sizes(args, accelerator.num_processes)
        if deepspeed is not None and deepspeed.zero_stage == 3:
            raise UsageError("ZeRO-3 is not supported yet (the reference and reward models are not sharded): use ZeRO-2")
        if deepspeed is not None and args.resume:
            raise UsageError("--resume does not support DeepSpeed yet (its optimizer state is sharded): resume without DeepSpeed")
        if args.resume and args.output_dir is None:
            raise UsageError("--resume needs --output_dir, the folder of the run to continue")
        checkpoint = checkpoint_to_resume(output_dir, args, sizes.world_size)
        if args.resume and os.path.isdir(os.path.join(output_dir, "policy")):  # the final policy is saved at the very end
            if accelerator.is_main_process:
                print(f"--resume: the run in {output_dir} is finished (its final policy is {os.path.join(output_dir, 'policy')}): nothing to do")
            raise SystemExit(0)
        placement = engine_placement(args.vllm_placement, visible_gpus() if on_gpu else [], accelerator.num_processes, args.vllm_gpu_memory_utilization)
        if args.task == "gsm8k" and args.gold_judge != "tiny":
            raise UsageError(f"--gold_judge {args.gold_judge}: --task gsm8k is evaluated by its verifier (eval/pass@1), not by a gold reward model")
        check_model(args.sft_model_path, "--sft_model_path", args)
        if args.task != "gsm8k":  # GSM8k's verifier needs no reward model
            check_model(args.reward_model_path, "--reward_model_path", args)
            check_reward_model(args.reward_model_path, "--reward_model_path")
        if args.gold_judge != "tiny":
            check_reward_model(args.gold_judge, "--gold_judge")
        tokenizer = load_tokenizer(args.sft_model_path, "--sft_model_path", args.trust_remote_code)
        reward_tokenizer = None if args.task == "gsm8k" else load_tokenizer(args.reward_model_path, "--reward_model_path", args.trust_remote_code)
        task_flags = dict(task=args.task, config=args.dataset_config)
        train = load_prompts(args.dataset_name, args.dataset_train_split, tokenizer, args.max_prompt_length, **task_flags)
        evaluation = load_prompts(args.dataset_name, args.dataset_eval_split, tokenizer, args.max_prompt_length, args.num_eval_prompts, **task_flags)
        if len(train.token_ids) < sizes.batch_size:
            raise UsageError(f"{len(train.token_ids)} training prompts cannot fill one batch of {sizes.batch_size} prompts; lower the batch sizes")
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    # SIGTERM (pre-emption) or Ctrl-C. Once the engine runs: finish the step, write a checkpoint, exit; a second
    # signal exits at once. Until then, exit at once. vLLM cannot be left to stop its engine's start-up: its
    # handshake swallows KeyboardInterrupt, and its wait for the engine's ready message does not notice the
    # engine dying (which a Ctrl-C to the process group does), so it waits out its 10-minute timeout. Hence
    # the handler kills the processes started so far itself.
    stop_signal, starting, weights_dir = [], True, None

    def request_stop(signum, frame):
        if starting:
            os.write(2, f"\n{signal.Signals(signum).name} while starting: stopping the engine and exiting\n".encode())
            kill_process_trees(started_processes(set()))
            if weights_dir is not None:
                shutil.rmtree(weights_dir, ignore_errors=True)
            gc.freeze()  # see the end of the file
            raise SystemExit(128 + signum)
        os.write(2, f"\n{signal.Signals(signum).name}: writing a checkpoint at the end of this step, then exiting\n".encode())
        stop_signal.append(signum)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, request_stop)

    if deepspeed is not None:  # DeepSpeed wants these in its own config
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    device = accelerator.device
    cores, engine_cores = sorted(os.sched_getaffinity(0)), None
    if device.type == "cpu" and len(cores) > accelerator.num_processes:
        # Split the cores as the paper splits GPUs, so that neither side slows the other down: the first
        # core is the engine's (its worker, its scheduler process and our generation thread, which take
        # turns), the others train. Threads started later inherit the training cores.
        engine_cores = cores[:1]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[0]))
        os.sched_setaffinity(0, cores[1:])
        torch.set_num_threads(len(cores) - 1)
    # The generation thread drives the engine from this process and needs the interpreter lock at every
    # decoding step; training hands it over only every switch interval (5 ms by default) while it runs
    # Python code. 0.5 ms: pipeline efficiency 92.5% -> 96.1% (medians of 13 and 6 benchmark pairs, README).
    sys.setswitchinterval(0.0005)
    set_seed(args.seed + accelerator.process_index)

    # resuming: the checkpoint's step, the evaluations already logged, and the generator's work still owed
    state = json.loads(Path(checkpoint, "trainer_state.json").read_text()) if checkpoint else {"step": 0, "evals_logged": []}
    start_step, evals_logged = state["step"], set(state["evals_logged"])
    if checkpoint:
        print(f"resuming from {checkpoint} (step {start_step})")
    elif args.resume:
        print(f"--resume: no checkpoint in {output_dir} yet, starting at step 0")
    eval_steps = sorted({0, sizes.num_steps, *range(0, sizes.num_steps, args.eval_freq or sizes.num_steps)})
    schedule = pending_events(generation_schedule(sizes.num_steps, args.async_level, eval_steps), start_step, evals_logged)
    to_publish = published_versions(schedule)

    # models (safetensors only: no pickled weights are ever loaded). The policy and the reference keep fp32 weights
    # (the optimizer's, and the same numbers as the policy's at step 0) and run under autocast; the reward and gold
    # models, which only score, hold --dtype weights.
    model_kwargs = dict(trust_remote_code=args.trust_remote_code, use_safetensors=True)
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(checkpoint, "policy") if checkpoint else args.sft_model_path, dtype=torch.float32, **model_kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, **model_kwargs)
    gold_model = gold_tokenizer = None
    try:  # the score-head check of a hub id that was not in the local cache before it loaded
        reward_model = None if args.task == "gsm8k" else load_reward_model(args.reward_model_path, "--reward_model_path", dtype=dtype, **model_kwargs)
        if args.gold_judge != "tiny" and accelerator.is_main_process:
            gold_model = load_reward_model(args.gold_judge, "--gold_judge", dtype=dtype, **model_kwargs).to(device).eval()
            gold_tokenizer = AutoTokenizer.from_pretrained(args.gold_judge, trust_remote_code=args.trust_remote_code)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    engine_names = checkpoint_names(policy)  # computed before accelerate wraps the policy
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    L, R = args.max_prompt_length + args.response_length, args.response_length  # padded widths the passes process
    B, K = sizes.local_batch_size, args.num_samples
    phase_flops = {  # per process and step, for the model FLOP utilisation of each phase (benchmark/timing.py)
        "scoring": 0 if reward_model is None else forward_flops(reward_model, B * K, L),
        "reference": forward_flops(ref_policy, 2 * B, L, R + 1),
        "update": (4 if args.gradient_checkpointing else 3) * args.num_ppo_epochs * forward_flops(policy, 2 * B, L, R + 1),
    }
    frozen = [m for m in (ref_policy, reward_model) if m is not None]  # GSM8k has no reward model
    for m in (policy, *frozen):
        disable_dropout(m)
    for m in frozen:
        m.to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=args.adam_epsilon)
    model, optimizer = accelerator.prepare(policy, optimizer)
    # Stepped by hand once per optimizer update (accelerate's prepared scheduler would step per process).
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: lr_factor(args.lr_schedule, update, sizes.num_updates))
    shuffle_rng = np.random.default_rng([args.seed, accelerator.process_index])
    if checkpoint:  # the trainer exactly as it was when the checkpoint was written
        optimizer.load_state_dict(optimizer_state_from_tensors(load_file(os.path.join(checkpoint, "optimizer.safetensors")), state["optimizer"]))
        scheduler.load_state_dict(state["scheduler"])
        rng = json.loads(Path(checkpoint, f"rng_{accelerator.process_index}.json").read_text())
        shuffle_rng.bit_generator.state = rng["shuffle_rng"]
        torch.set_rng_state(torch.tensor(rng["torch_rng"], dtype=torch.uint8))

    # generation thread: rank 0 owns the engine and generates for every rank
    weights_queue, rollout_queue, eval_queue = queue.Queue(), queue.Queue(), queue.Queue()
    stop, error = threading.Event(), []
    llm = thread = watchdog = logger = run_start = None
    engine_processes, engine_segments = [], []
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        if args.resume:
            keep_metrics_until(os.path.join(output_dir, "metrics.jsonl"), start_step, evals_logged)
        run_args = {**asdict(args), **sizes._asdict(), "output_dir": output_dir, "git_revision": git_revision()}
        write_atomically(os.path.join(output_dir, "args.json"), json.dumps(run_args, indent=2))
        logger = MetricsLogger(output_dir, run_name, args)
        with on_cores(engine_cores):  # the engine's processes and the generation thread start there
            children_before = {p.pid for p in psutil.Process().children(recursive=True)}
            if placement.shared:
                try:
                    check_engine_fits(placement.memory_utilization, *torch.cuda.mem_get_info(device))
                except UsageError as exc:
                    raise SystemExit(f"error: {exc}")
            if placement.devices is not None:
                os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the push's CUDA IPC handle is pickled, between our own processes
            llm = make_engine(args, placement, str(engine_dtype).removeprefix("torch."))
            engine_processes = started_processes(children_before)
            engine_segments = shared_memory_of(engine_processes)
            ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            remove_stale_weights_folders(ram)
            weights_dir = tempfile.mkdtemp(prefix=f"policy-weights-{os.getpid()}-", dir=ram)  # the pid: see remove_stale_weights_folders
            watchdog = start_watchdog(engine_processes, weights_dir)
            thread = threading.Thread(
                target=generation_thread,
                args=(llm, schedule, train.token_ids, evaluation.token_ids, args, sizes.batch_size, tokenizer.eos_token_id,
                      weights_queue, rollout_queue, eval_queue, stop, error, weights_dir, placement.trainer_gpu),
                daemon=True,
            )
            run_start = time.perf_counter()
            thread.start()
    starting = False

    def to_batch(prompt_token_ids: list[list[int]], responses: list[list[int]], repeat: int):
        query_ids, query_mask = left_pad(prompt_token_ids, args.max_prompt_length, tokenizer.pad_token_id)
        response_ids, response_mask, contain_eos = truncate_responses(responses, args.response_length, tokenizer.eos_token_id, tokenizer.pad_token_id)
        return (
            query_ids.repeat_interleave(repeat, 0).to(device),
            query_mask.repeat_interleave(repeat, 0).to(device),
            response_ids.to(device),
            response_mask.to(device),
            contain_eos.to(device),
        )

    def decode_responses(response_ids, response_mask, skip_special_tokens: bool = False) -> list[str]:
        return [tokenizer.decode(r[m.bool()].tolist(), skip_special_tokens=skip_special_tokens) for r, m in zip(response_ids, response_mask)]

    def score(q_ids, q_mask, r_ids, r_mask, contain_eos, references: list[str]) -> torch.Tensor:
        """Rewards of a batch. GSM8k: its verifier, with no missing-EOS penalty (the paper's table 10 has none, unlike
        tables 4 and 7). Otherwise: the reward model on query + response, and a fixed score for a completion without EOS."""
        if args.task == "gsm8k":
            return verify_completions(tokenizer, r_ids, r_mask, references)
        with accelerator.autocast():
            scores = score_completions(reward_model, reward_tokenizer, tokenizer, q_ids, q_mask, r_ids, r_mask, contain_eos, args.local_rollout_forward_batch_size)
        return apply_missing_eos_penalty(scores, contain_eos, args.missing_eos_penalty)

    score_source = "GSM8k's verifier" if args.task == "gsm8k" else f"reward model --reward_model_path {args.reward_model_path}"

    @torch.no_grad()
    def evaluate(rollout: EvalRollout) -> dict:
        """One evaluation (README "Tasks"): the reference policy's perplexity on the completions (the paper's KL proxy),
        their EOS rate and length; GSM8k's pass@1, or the proxy RM's score and, with a gold judge, the win rate against
        the references. The completions also go to eval_completions/ for judges that run after training."""
        q_ids, q_mask, r_ids, r_mask, contain_eos = to_batch(evaluation.token_ids, rollout.responses, 1)
        texts = decode_responses(r_ids, r_mask)  # with the EOS, as the gold judge reads a completion that stopped
        bs = args.local_rollout_forward_batch_size
        parts = [slice(i, i + bs) for i in range(0, len(q_ids), bs)]
        metrics, extras = {}, {}  # extras: columns of the sample table
        if (args.task == "tiny" and args.gold_judge == "tiny") or gold_model is not None:
            references = evaluation.references
            if gold_model is None:
                policy_gold = [tiny_gold_score(q, t) for q, t in zip(evaluation.queries, texts)]
                reference_gold = [tiny_gold_score(q, r) for q, r in zip(evaluation.queries, references)]
            else:
                if args.task == "no_robots":  # a human answer ends as a completion that stopped does (TLDR's references carry their EOS)
                    references = [r + tokenizer.eos_token for r in references]
                policy_gold = score_texts(gold_model, gold_tokenizer, [q + t for q, t in zip(evaluation.queries, texts)], bs, device).tolist()
                reference_gold = score_texts(gold_model, gold_tokenizer, [q + r for q, r in zip(evaluation.queries, references)], bs, device).tolist()
            metrics["eval/gold_score"] = float(np.mean(policy_gold))
            metrics["eval/win_rate"] = float(np.mean(win_rates(policy_gold, reference_gold)))
            extras = {"gold": [round(g, 3) for g in policy_gold], "reference_gold": [round(g, 3) for g in reference_gold]}
        if args.task == "gsm8k":
            correct = verify_completions(tokenizer, r_ids, r_mask, evaluation.references)
            metrics["eval/pass@1"] = correct.mean().item()
            extras = {"correct": correct.tolist()}
        perplexities = torch.cat([reference_perplexities(ref_policy, q_ids[p], q_mask[p], r_ids[p], r_mask[p]) for p in parts])
        metrics["eval/ref_perplexity"] = perplexities.mean().item()
        if reward_model is not None:
            rm_scores = [score_completions(reward_model, reward_tokenizer, tokenizer, q_ids[p], q_mask[p], r_ids[p], r_mask[p], contain_eos[p], bs) for p in parts]
            metrics["eval/scores"] = apply_missing_eos_penalty(torch.cat(rm_scores), contain_eos, args.missing_eos_penalty).mean().item()
        metrics["eval/num_eos_tokens"] = contain_eos.float().mean().item()
        metrics["eval/response_length"] = r_mask.sum(1).float().mean().item()
        metrics["time/eval_generation"] = rollout.generation_time
        metrics["timeline/eval_generation_start"] = rollout.generation_start - run_start
        episode = rollout.version * sizes.episodes_per_step
        completions = decode_responses(r_ids, r_mask, skip_special_tokens=True)
        write_eval_completions(output_dir, rollout.version, episode, evaluation.queries, completions, evaluation.references)
        rows = [
            {"query": q, "response": t, "reference": r, **{k: v[i] for k, v in extras.items()}}
            for i, (q, t, r) in enumerate(zip(evaluation.queries[: args.num_sample_completions], texts, evaluation.references))
        ]
        logger.log_samples(rollout.version, episode, rows)
        for row in rows:
            query = row["query"] if len(row["query"]) <= 80 else "..." + row["query"][-77:]  # the end of a long prompt: what the completion follows
            details = ", ".join(f"{k} {v!r}" for k, v in row.items() if k not in ("query", "response"))
            print(f"  [step {rollout.version}] {query!r} -> {row['response']!r} ({details})")
        return metrics

    def log_eval(rollout: EvalRollout) -> None:
        with accelerator.autocast():
            metrics = {"step": rollout.version, "episode": rollout.version * sizes.episodes_per_step, **evaluate(rollout)}
        logger.log(metrics)
        evals_logged.add(rollout.version)
        print(f"eval step {rollout.version}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/")))

    # Policy versions the generator may still need, as snapshot_weights takes them (on rank 0's GPU on GPUs): a
    # checkpoint hands them on. One is freed once no pending batch or evaluation needs it, after the engine loaded it.
    snapshots = {}
    snapshot_device = device if placement.devices is not None else torch.device("cpu")

    def publish(version: int) -> None:
        """Snapshot theta_version for the engine, here, between optimizer steps (snapshot_weights)."""
        state_dict = accelerator.get_state_dict(model, unwrap=True)
        if accelerator.is_main_process:
            snapshots[version] = Weights(version, *snapshot_weights(state_dict, engine_names, engine_dtype, snapshot_device))
            weights_queue.put(snapshots[version])

    def save_checkpoint(step: int) -> str:
        """Everything a resumed run needs to go on exactly: policy, optimizer, scheduler and RNG states, the
        evaluations logged, and the older policy versions the generator still owes batches or evaluations
        from (so no engine state is needed). Written to a temporary folder, then renamed."""
        path = os.path.join(output_dir, "checkpoints", f"step_{step:06d}")
        tmp = f"{path}.tmp"
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        accelerator.wait_for_everyone()
        save_policy(accelerator, model, tokenizer, os.path.join(tmp, "policy"))
        rng = {"shuffle_rng": shuffle_rng.bit_generator.state, "torch_rng": torch.get_rng_state().tolist()}
        Path(tmp, f"rng_{accelerator.process_index}.json").write_text(json.dumps(rng))
        if accelerator.is_main_process:
            for version in sorted(v for v in published_versions(pending_events(schedule, step, evals_logged)) if v < step):
                tensors = {name: view.cpu().clone() for name, view in views(snapshots[version].flat, snapshots[version].layout)}
                save_file(tensors, os.path.join(tmp, f"version_{version:06d}.safetensors"))
            state = {"step": step, "evals_logged": sorted(evals_logged), "scheduler": scheduler.state_dict()}
            if deepspeed is None:  # DeepSpeed shards its optimizer state: such a checkpoint is not resumable
                tensors, state["optimizer"] = optimizer_state_to_tensors(optimizer.state_dict())
                save_file(tensors, os.path.join(tmp, "optimizer.safetensors"))
            Path(tmp, "trainer_state.json").write_text(json.dumps(state))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        accelerator.wait_for_everyone()
        return path

    # A resumed run re-sends the versions the generator still needs: older ones from the checkpoint, then theta_start.
    for version in sorted(v for v in to_publish if v <= start_step):
        if version == start_step:
            publish(version)
        elif accelerator.is_main_process:
            tensors = load_file(os.path.join(checkpoint, f"version_{version:06d}.safetensors"))
            snapshots[version] = Weights(version, *snapshot_weights(tensors, {k: k for k in tensors}, engine_dtype, snapshot_device))
            weights_queue.put(snapshots[version])

    last_checkpoint = checkpoint
    exit_code = 0
    try:
        progress = tqdm(range(start_step, sizes.num_steps), initial=start_step, total=sizes.num_steps, disable=not accelerator.is_main_process, desc="steps")
        for step in progress:
            step_start = time.perf_counter()
            # 1. get the rollouts of this step (rank 0 has them; every rank takes its slice), or a stop signal
            rollout = None
            if accelerator.is_main_process:
                rollout = get_or_raise(rollout_queue, stop, error, engine_processes, interrupt=stop_signal)
                rollout = stop_signal[0] if rollout is None else rollout
            rollout = broadcast_object_list([rollout])[0]
            if isinstance(rollout, int):
                if step > start_step:
                    last_checkpoint = save_checkpoint(step)
                print(f"stopped before step {step}; resume from {last_checkpoint} with --resume" if last_checkpoint else f"stopped before step {step}")
                exit_code = 128 + rollout
                break
            wait_for_rollouts = time.perf_counter() - step_start
            lag = step - rollout.version
            if rollout.step != step or lag != min(step, args.async_level):
                raise RuntimeError(f"async invariant broken: step {step} got rollout {rollout.step} from policy version {rollout.version}")
            train_start = time.perf_counter()
            rank = accelerator.process_index
            local = slice(rank * sizes.local_batch_size, (rank + 1) * sizes.local_batch_size)
            local_indices = rollout.prompt_indices[local]
            local_responses = rollout.responses[local.start * args.num_samples : local.stop * args.num_samples]
            q_ids, q_mask, r_ids, r_mask, contain_eos = to_batch([train.token_ids[i] for i in local_indices], local_responses, args.num_samples)

            # 2. score: the reward model on query + response with a fixed score without EOS, or GSM8k's verifier
            references = [train.references[i] for i in local_indices for _ in range(args.num_samples)]  # one per completion
            scores = score(q_ids, q_mask, r_ids, r_mask, contain_eos, references)
            if injected_fault("scoring", step):
                raise RuntimeError(f"injected test fault in reward scoring at step {step} (time {time.time():.2f})")
            if injected_fault("nan_score", step):
                scores[0] = float("nan")
            check_scores(accelerator.gather(scores), score_source, step)  # every process sees every score, so all stop together
            score_time = time.perf_counter() - train_start

            # 3. pairs: best and worst of K (paper section 4.2), and their reference logprobs
            K, B = args.num_samples, sizes.local_batch_size
            chosen, rejected, tied = select_chosen_rejected(scores.view(B, K))
            pair_rows = torch.cat([torch.arange(B, device=device) * K + chosen, torch.arange(B, device=device) * K + rejected])
            pq_ids, pq_mask, pr_ids, pr_mask = q_ids[pair_rows], q_mask[pair_rows], r_ids[pair_rows], r_mask[pair_rows]
            ref_start = time.perf_counter()
            with torch.no_grad(), accelerator.autocast():
                bs = args.local_rollout_forward_batch_size
                ref_logps = torch.cat(
                    [response_logprobs(ref_policy, pq_ids[i : i + bs], pq_mask[i : i + bs], pr_ids[i : i + bs], pr_mask[i : i + bs], args.temperature).sum(1) for i in range(0, 2 * B, bs)]
                )
            ref_time = time.perf_counter() - ref_start

            # 4. update: T epochs over N mini-batches, each accumulated from micro-batches
            update_start = time.perf_counter()
            stats = {k: [] for k in ("loss", "logps_chosen", "logps_rejected", "kl", "entropy", "accuracy", "margin")}
            model.train()
            for epoch in range(args.num_ppo_epochs):
                order = torch.as_tensor(shuffle_rng.permutation(B), device=device)
                for mini_start in range(0, B, sizes.local_mini_batch_size):
                    for micro_start in range(mini_start, mini_start + sizes.local_mini_batch_size, args.local_micro_batch_size):
                        idx = order[micro_start : micro_start + args.local_micro_batch_size]
                        rows = torch.cat([idx, idx + B])
                        with accelerator.accumulate(model):
                            logps = response_logprobs(model, pq_ids[rows], pq_mask[rows], pr_ids[rows], pr_mask[rows], args.temperature).sum(1)
                            logps_c, logps_r = logps.chunk(2)
                            ref_c, ref_r = ref_logps[idx], ref_logps[idx + B]
                            if args.loss_type == "best_of_k_sft":
                                per_pair = -logps_c / pr_mask[idx].sum(1).clamp(min=1)
                            else:
                                per_pair = dpo_loss(logps_c, logps_r, ref_c, ref_r, args.beta, args.loss_type)
                            loss = dpo_batch_loss(per_pair, tied[idx])
                            if injected_fault("nan_loss", step):
                                loss = loss * float("nan")
                            accelerator.backward(loss)
                            optimizer.step()
                            optimizer.zero_grad()
                        if accelerator.sync_gradients:
                            scheduler.step()
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
            update_time = time.perf_counter() - update_start

            # 5. send theta_{step+1} to the engine if a later batch or an evaluation needs it
            if step + 1 in to_publish:
                publish(step + 1)
            training_time = time.perf_counter() - train_start

            # 6. log
            local_stats = {k: torch.stack(v).mean() for k, v in stats.items()}
            local_stats["scores"] = scores.mean()
            local_stats["num_eos_tokens"] = contain_eos.float().mean()
            local_stats["tied"] = tied.float().mean()
            local_stats["response_tokens"] = r_mask.sum().float()
            keys = list(local_stats)
            reduced = dict(zip(keys, accelerator.reduce(torch.stack([local_stats[k] for k in keys]), "mean").tolist()))
            if not math.isfinite(reduced["loss"]):
                raise RuntimeError(
                    f"loss is {reduced['loss']} at step {step}: stopping before it reaches a checkpoint"
                    + (f"; the last good one is {last_checkpoint} (--resume)" if last_checkpoint else "")
                )
            if accelerator.is_main_process:
                step_time = time.perf_counter() - step_start
                metrics = {
                    "step": step,
                    "episode": (step + 1) * sizes.episodes_per_step,
                    "lr": scheduler.get_last_lr()[0],
                    "objective/scores": reduced["scores"],
                    "objective/kl": reduced["kl"],
                    "objective/entropy": reduced["entropy"],
                    "objective/non_score_reward": -args.beta * reduced["kl"],
                    "objective/rlhf_reward": reduced["scores"] - args.beta * reduced["kl"],
                    "val/num_eos_tokens": reduced["num_eos_tokens"],
                    "val/tied_pairs": reduced["tied"],
                    "loss/policy": reduced["loss"],
                    "logps/chosen": reduced["logps_chosen"],
                    "logps/rejected": reduced["logps_rejected"],
                    "rewards/accuracies": reduced["accuracy"],
                    "rewards/margins": reduced["margin"],
                    "async/lag": lag,
                    "async/version": rollout.version,
                    "time/generation": rollout.generation_time,
                    "time/weight_sync": rollout.weight_sync_time,
                    "time/generator_wait": rollout.wait_time,
                    "time/wait_for_rollouts": wait_for_rollouts,
                    "time/scoring": score_time,
                    "time/reference": ref_time,
                    "time/update": update_time,
                    "flops/scoring": phase_flops["scoring"],
                    "flops/reference": phase_flops["reference"],
                    "flops/update": phase_flops["update"],
                    "time/training": training_time,
                    "time/step": step_time,
                    "timeline/step_start": step_start - run_start,  # seconds since the engine was up
                    "timeline/training_start": train_start - run_start,
                    "timeline/generation_start": rollout.generation_start - run_start,
                    "timeline/weight_sync_start": rollout.weight_sync_start - run_start,
                    "throughput/episodes_per_second": sizes.episodes_per_step / step_time,
                    "throughput/tokens_per_second": reduced["response_tokens"] * sizes.world_size / step_time,
                }
                logger.log(metrics)
                progress.set_postfix(lag=lag, score=f"{reduced['scores']:.3f}", kl=f"{reduced['kl']:.2f}")
                # 7. evaluations arrive from the generation thread a little later; score them as they come
                while True:
                    try:
                        log_eval(eval_queue.get_nowait())
                    except queue.Empty:
                        break
                owed = published_versions(pending_events(schedule, step + 1, evals_logged))
                for version in [v for v in snapshots if v not in owed]:
                    del snapshots[version]
            if args.save_freq and (step + 1) % args.save_freq == 0 and step + 1 < sizes.num_steps:
                last_checkpoint = save_checkpoint(step + 1)

        if not exit_code:
            if accelerator.is_main_process:
                while len(evals_logged) < len(eval_steps):
                    log_eval(get_or_raise(eval_queue, stop, error, engine_processes))
            save_policy(accelerator, model, tokenizer, os.path.join(output_dir, "policy"))
    except KeyboardInterrupt:
        print("interrupted: stopping the generation thread and the engine")
        exit_code = 130
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=1)  # it finishes the batch it is generating, or the engine's shutdown ends it
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=1)  # the engine holds nothing to save: don't wait on its exit
        if thread is not None:
            thread.join(timeout=5)  # a daemon: a thread stuck on a dead engine does not keep the process alive
        # The engine's worker outlives its scheduler process, killed after 1 s, by seconds (a garbage collection),
        # and their message queues stay in shared memory: end both.
        kill_process_trees(engine_processes)
        release_shared_memory(engine_segments)
        if weights_dir is not None:
            shutil.rmtree(weights_dir, ignore_errors=True)
        if watchdog is not None:
            watchdog.stdin.close()  # nothing is left for it to clean up: it exits
            try:
                watchdog.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if logger is not None:
            logger.close()
        gc.freeze()  # the interpreter's exit would garbage-collect the whole heap (seconds on a CPU); the OS frees it
    if exit_code:
        raise SystemExit(exit_code)
