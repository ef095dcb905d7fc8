"""Asynchronous online DPO (Noukhovitch et al., "Asynchronous RLHF", 2024) in one file.

A vLLM engine, driven by a generation thread, samples the next batches from a policy at most `async_level`
updates old while the trainer (accelerate) learns on the current one. Flags, metrics and the async schedule:
README.md and docs/. Sections: arguments; checks of the inputs; data; models and rewards; evaluation; the async
schedule and the generation thread; the weight push; the engine's placement and processes; logging and
checkpoints; the online DPO loss and update; the training loop (`__main__`).
"""

import gc
import inspect
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
from functools import partial
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
from safetensors.torch import load_file, save_file
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, set_seed
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

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
    # common
    exp_name: str = "online_dpo_async"  # name of this experiment (part of the run name)
    seed: int = 1  # seed of the prompt order, sampling and initialisation
    output_dir: str | None = None  # metrics, TensorBoard logs, checkpoints, final policy (None: runs/<run name>)
    track: bool = False  # log to Weights & Biases (WANDB_MODE=offline on machines without network)
    wandb_project: str = "async-rlhf"  # wandb project
    wandb_entity: str | None = None  # wandb entity (team)

    # data and models (local paths or hub ids)
    task: Literal["tiny", "tldr", "no_robots", "gsm8k"] = "tiny"  # prompt format, reward and evaluation (docs/tasks.md)
    dataset_name: str = str(TINY_TASK / "data")  # a hub dataset id, a local dataset folder or a .jsonl/.json/.parquet
    dataset_config: str | None = None  # config name of the dataset (`main` for openai/gsm8k)
    dataset_train_split: str = "train"  # split whose prompts are trained on
    dataset_eval_split: str = "test"  # split whose prompts (and reference responses) are evaluated on
    num_eval_prompts: int | None = None  # evaluate on the first this many eval prompts (None: all)
    sft_model_path: str = str(TINY_TASK / "sft")  # initial policy; also the frozen reference policy
    reward_model_path: str = str(TINY_TASK / "reward")  # proxy reward model trained on (one-label sequence classifier)
    # evaluation-only judge: `tiny` (the tiny task's exact scorer; none on other tasks) or a reward model (not gsm8k)
    gold_judge: str = "tiny"
    trust_remote_code: bool = False  # allow model repositories to run their own code
    max_prompt_length: int = 12  # prompts longer than this many tokens are dropped (the count is printed)
    response_length: int = 12  # maximum number of generated tokens per completion

    # batch sizes (in prompts; each prompt gets `num_samples` completions)
    total_episodes: int = 12800  # prompt-completion pairs to sample (prompts x num_samples); sets the number of steps
    local_micro_batch_size: int = 32  # prompts per forward/backward pass on one process
    gradient_accumulation_steps: int = 1  # micro-batches accumulated into one optimizer step
    num_mini_batches: int = 1  # N: mini-batches per generated batch, N optimizer steps (paper section 3.2)
    num_ppo_epochs: int = 1  # T: passes over each generated batch (paper section 4.1)
    local_rollout_forward_batch_size: int = 64  # sequences per no-grad forward (reward model, reference model)

    # optimisation
    learning_rate: float = 1e-4  # initial learning rate (see --lr_schedule)
    lr_schedule: Literal["linear", "constant"] = "linear"  # linear: to 0 over all updates; constant: GSM8k's
    adam_epsilon: float = 1e-5  # AdamW epsilon

    # generation / async
    async_level: int = 1  # k: step n trains on a batch from policy version max(0, n - k); 0 is on-policy
    num_samples: int = 2  # K completions per prompt; DPO pairs the best and the worst (paper section 4.2)
    temperature: float = 0.7  # sampling temperature (gsm8k evaluates greedily); logprobs divide logits by it
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # engine's weights (auto: --dtype's)
    # GPU of the engine: separate = the one after the N training GPUs (the paper's split), shared = rank 0's,
    # within --vllm_gpu_memory_utilization; auto = separate when N + 1 GPUs are visible (docs/gpus.md)
    vllm_placement: Literal["auto", "separate", "shared"] = "auto"
    vllm_gpu_memory_utilization: float | None = None  # engine's share of its GPU (None: 0.9 own GPU, 0.3 shared)
    vllm_enforce_eager: bool = False  # run the engine without CUDA graphs (always so on CPUs)

    # trainer numerics and memory
    # policy/reference/reward/gold dtype (auto: bfloat16 on GPUs): bf16 autocast over fp32 weights for the policy
    # and the reference, bf16 weights for the reward and gold models
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    gradient_checkpointing: bool = False  # recompute activations in the backward pass: less memory, ~1/3 more compute

    # algorithm
    beta: float = 0.1  # DPO beta: strength of the implicit KL regularisation
    # sigmoid: DPO; ipo: IPO; best_of_k_sft: SFT on the best of K samples (the paper's Best-of-2 baseline)
    loss_type: Literal["sigmoid", "ipo", "best_of_k_sft"] = "sigmoid"
    missing_eos_penalty: float = -3.0  # score of a completion without EOS (not gsm8k: its table 10 has none)

    # evaluation and checkpoints
    eval_freq: int = 25  # evaluate every this many steps (and at step 0 and at the end)
    save_freq: int = 0  # checkpoint every this many steps (0: none; one is also written on SIGTERM / Ctrl-C)
    resume: bool = False  # continue the run in --output_dir from its latest checkpoint (none: start over)
    num_sample_completions: int = 4  # eval completions printed and logged as a table at each evaluation


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


def check_algorithm_flags(args: Args) -> int:
    """The flags of this algorithm only; returns the completions sampled per prompt."""
    if args.num_samples < 2:
        raise UsageError(
            f"--num_samples must be >= 2 (DPO needs a best and a worst completion), got {args.num_samples}"
        )
    return args.num_samples


def compute_sizes(args: Args, world_size: int) -> Sizes:
    """Check the flags and derive every batch size; errors name the flags to change."""
    if args.async_level < 0:
        raise UsageError(f"--async_level must be >= 0, got {args.async_level}")
    samples = check_algorithm_flags(args)
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be > 0 (logprobs divide logits by it), got {args.temperature}")
    if not math.isfinite(args.missing_eos_penalty):
        raise UsageError(f"--missing_eos_penalty must be a finite number, got {args.missing_eos_penalty}")
    at_least = dict.fromkeys(["local_micro_batch_size", "gradient_accumulation_steps", "num_mini_batches"], 1)
    at_least |= {"num_ppo_epochs": 1, "max_prompt_length": 1, "response_length": 1, "eval_freq": 0, "save_freq": 0}
    for flag, least in at_least.items():
        if getattr(args, flag) < least:
            raise UsageError(f"--{flag} must be >= {least}, got {getattr(args, flag)}")
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
    num_updates = num_steps * args.num_ppo_epochs * args.num_mini_batches
    mini_batches = (
        local_mini_batch_size,
        local_mini_batch_size * world_size,
        local_batch_size,
        local_batch_size * world_size,
    )
    return Sizes(world_size, *mini_batches, episodes_per_step, num_steps, num_updates)


def lr_factor(schedule: str, update: int, num_updates: int) -> float:
    """Learning rate of optimizer update `update` (0-indexed) over --learning_rate: linear decay to 0, or constant."""
    return 1.0 if schedule == "constant" else 1.0 - update / num_updates


# == Checks of every flag and input, before any model loads ===========================================================
def load_tokenizer(path: str, flag: str, trust_remote_code: bool):
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {flag} {path} has no EOS token: completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from lengths, not from pad ids
    return tokenizer


def not_a_reward_model(path: str, flag: str) -> str:
    return f"{flag} {path} is not a reward model: it has no score head, which loading would initialise at random"


def check_model(path: str, flag: str, args: Args, reward: bool = False) -> None:
    """The model exists, has safetensors weights (pickled ones are never loaded), prompt + response fit its
    positions, and a reward model is a sequence classifier (its config says so; a causal LM is not)."""
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
    if reward and config.architectures and not any("ForSequenceClassification" in a for a in config.architectures):
        raise UsageError(not_a_reward_model(path, flag))


def load_reward_model(path: str, flag: str, **kwargs):
    """A one-label AutoModelForSequenceClassification, refused if its score head was not among the weights."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, output_loading_info=True, **kwargs
    )
    if any(key == "score.weight" or key.startswith("classifier.") for key in info["missing_keys"]):
        raise UsageError(not_a_reward_model(path, flag))
    return model


def name_run(args: Args) -> str:
    """<exp_name>__<seed>__<unix time>, as rank 0 sees it: another rank's clock may be in the next second."""
    return broadcast_object_list([f"{args.exp_name}__{args.seed}__{int(time.time())}"])[0]


def holds_a_run(output_dir: str) -> bool:
    """Whether a run logged or saved anything there (one stopped while starting left only args.json)."""
    metrics, checkpoints = Path(output_dir, "metrics.jsonl"), Path(output_dir, "checkpoints")
    logged = metrics.exists() and metrics.stat().st_size > 0
    return logged or any(checkpoints.glob("step_*")) or Path(output_dir, "policy").exists()


# Flags that may change when a run is resumed; any other must be what the run started with.
RESUMABLE_CHANGES = {"resume", "output_dir", "track", "wandb_project", "wandb_entity", "save_freq"} | {
    "num_sample_completions"
}


def checkpoint_to_resume(output_dir: str, args: Args, world_size: int) -> str | None:
    """The checkpoint a run continues from (None: it starts at step 0); two runs never share a folder."""
    if not args.resume:
        if holds_a_run(output_dir):
            raise UsageError(
                f"--output_dir {output_dir} holds another run: pass --resume to continue it, or choose another --output_dir"
            )
        return None
    if os.path.exists(run_file := os.path.join(output_dir, "args.json")):
        previous = json.loads(Path(run_file).read_text())
        changed = [
            f"--{k} {previous.get(k)!r} -> {v!r}"
            for k, v in asdict(args).items()
            if k not in RESUMABLE_CHANGES and previous.get(k) != v
        ]
        if previous.get("world_size") != world_size:
            changed.append(f"training processes {previous.get('world_size')} -> {world_size}")
        if changed:
            raise UsageError(
                f"--resume: {', '.join(changed)} differ from the run in --output_dir {output_dir}; resume it with its own flags"
            )
    checkpoints = sorted(
        p for p in Path(output_dir, "checkpoints").glob("step_*") if re.fullmatch(r"step_\d{6}", p.name)
    )
    if checkpoints and not (checkpoints[-1] / "custom_checkpoint_1.pkl").exists():  # no accelerate state: not ours
        raise UsageError(
            f"--resume: {checkpoints[-1]} is not a checkpoint of this version (accelerate's save_state): resume it with the version that wrote it"
        )
    return str(checkpoints[-1]) if checkpoints else None


class Inputs(NamedTuple):
    sizes: "Sizes"
    checkpoint: str | None
    placement: "Placement"
    tokenizer: object
    reward_tokenizer: object | None
    train: "Prompts"
    evaluation: "Prompts"


def check_inputs(args: Args, accelerator: Accelerator, output_dir: str, on_gpu: bool) -> Inputs:
    """Every check of the flags and input files, and the engine's GPU placement, before any model loads: a bad
    one is a UsageError naming the flag. Exits (0) on --resume of a finished run."""
    sizes = compute_sizes(args, accelerator.num_processes)
    deepspeed = accelerator.state.deepspeed_plugin
    if deepspeed is not None and deepspeed.zero_stage == 3:
        raise UsageError("ZeRO-3 is not supported yet (the reference and reward models are not sharded): use ZeRO-2")
    if args.resume and args.output_dir is None:
        raise UsageError("--resume needs --output_dir, the folder of the run to continue")
    checkpoint = checkpoint_to_resume(output_dir, args, sizes.world_size)
    if args.resume and os.path.isdir(os.path.join(output_dir, "policy")):  # the final policy is saved at the very end
        if accelerator.is_main_process:
            print(
                f"--resume: the run in {output_dir} is finished (its final policy is {os.path.join(output_dir, 'policy')}): nothing to do"
            )
        raise SystemExit(0)
    gpus = visible_gpus() if on_gpu else []
    placement = engine_placement(args.vllm_placement, gpus, accelerator.num_processes, args.vllm_gpu_memory_utilization)
    if args.task == "gsm8k" and args.gold_judge != "tiny":
        raise UsageError(
            f"--gold_judge {args.gold_judge}: --task gsm8k is evaluated by its verifier (eval/pass@1), not by a gold reward model"
        )
    check_model(args.sft_model_path, "--sft_model_path", args)
    if args.task != "gsm8k":  # GSM8k's verifier needs no reward model
        check_model(args.reward_model_path, "--reward_model_path", args, reward=True)
    if args.gold_judge != "tiny":
        check_model(args.gold_judge, "--gold_judge", args, reward=True)
    tokenizer = load_tokenizer(args.sft_model_path, "--sft_model_path", args.trust_remote_code)
    reward_tokenizer = None
    if args.task != "gsm8k":
        reward_tokenizer = load_tokenizer(args.reward_model_path, "--reward_model_path", args.trust_remote_code)
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
    """Positions count real tokens only, so left padding does not shift them (N details, #2)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def response_logprobs(model, query_ids, query_mask, response_ids, response_mask, temperature: float) -> torch.Tensor:
    """Per-token logprobs of the responses, logits divided by the sampling temperature (N details, #9); 0 after EOS."""
    input_ids, mask = torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1)
    # only the logits that predict the response: over a 50k vocabulary the others would be the largest tensor
    keep = response_ids.shape[1] + 1
    logits = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from(mask), logits_to_keep=keep
    ).logits
    logits = logits[:, :-1].float() / temperature
    logprobs = logits.gather(2, response_ids.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    return logprobs * response_mask


def forward_flops(model, sequences: int, length: int, logit_positions: int | None = None) -> int:
    """Matmul FLOPs of a forward pass, 2 per parameter and token (Kaplan et al. 2020, no attention term): every token
    through the body, `logit_positions` per sequence (None: all) through the output head, none through the input
    embedding (a lookup). A training pass is 3 forwards' worth, 4 when recomputing activations."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_params = 0 if head is None else head.weight.numel()
    tied = head is not None and head.weight is embedding
    body = sum(p.numel() for p in model.parameters()) - embedding.numel() - (0 if tied else head_params)
    return 2 * sequences * (body * length + head_params * (length if logit_positions is None else logit_positions))


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
def score_completions(
    reward_model,
    reward_tokenizer,
    policy_tokenizer,
    query_ids,
    query_mask,
    response_ids,
    response_mask,
    contain_eos,
    bs,
):
    """Reward model on query + response. With another tokenizer, go through text: decode without special tokens,
    re-encode, and end with the reward model's EOS where the policy stopped."""
    if same_tokenizer(reward_tokenizer, policy_tokenizer):
        ids, mask = torch.cat([query_ids, response_ids], 1), torch.cat([query_mask, response_mask], 1)
        return torch.cat([get_reward(reward_model, ids[i : i + bs], mask[i : i + bs]) for i in range(0, len(ids), bs)])
    texts = []
    for q, qm, r, rm, eos in zip(query_ids, query_mask, response_ids, response_mask, contain_eos):
        text = policy_tokenizer.decode(torch.cat([q[qm.bool()], r[rm.bool()]]).tolist(), skip_special_tokens=True)
        texts.append(text + (reward_tokenizer.eos_token if eos else ""))
    return score_texts(reward_model, reward_tokenizer, texts, bs, query_ids.device)


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
    scores = score_completions(*rm, *batch, args.local_rollout_forward_batch_size)
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
    q_ids, q_mask, r_ids, r_mask, contain_eos = to_batch(evaluation.token_ids, responses, 1, args, tokenizer, device)
    texts = [
        tokenizer.decode(r[m.bool()].tolist()) for r, m in zip(r_ids, r_mask)
    ]  # with the EOS, as the judge reads it
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
        scores = torch.cat(
            [score_completions(*rm, q_ids[p], q_mask[p], r_ids[p], r_mask[p], contain_eos[p], bs) for p in parts]
        )
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
            raise RuntimeError("generation thread failed (its traceback is above)") from channels.error[0]
        if channels.stop.is_set():
            raise SystemExit("stopped")
        if dead := dead_processes(engine_processes):
            raise RuntimeError(f"the generation engine's process(es) {dead} died")
        try:
            return q.get(timeout=timeout)
        except queue.Empty:
            continue
    return None


def generate(
    llm: LLM, prompts, n: int, temperature: float, max_tokens: int, eos_token_id: int, seeds: list[int], logprobs=False
):
    """n completions per prompt (and the engine's logprob of each token); each prompt has its own sampling seed, so a
    batch is reproducible whatever the engine generated before."""
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
    llm: LLM, schedule, train_prompts, eval_prompts, args: Args, n, batch_size, eos_token_id, channels, push
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
                if injected_fault("generation", index):
                    raise RuntimeError(f"injected test fault in generation at rollout {index} (time {time.time():.2f})")
                indices = prompt_indices_for_step(index, len(train_prompts), batch_size, args.seed)
                seeds = [args.seed * 1_000_003 + index * batch_size + i for i in range(len(indices))]
                prompts = [train_prompts[i] for i in indices]
                out = generate(
                    llm, prompts, n, args.temperature, args.response_length, eos_token_id, seeds, ROLLOUT_LOGPROBS
                )
                timing = (time.perf_counter() - gen_start, sync_time, wait_time, gen_start, sync_start or gen_start)
                channels.rollouts.put(Rollout(index, version, indices, *out, *timing))
            else:
                seeds = [args.seed + i for i in range(len(eval_prompts))]
                temperature = (
                    0.0 if args.task == "gsm8k" else args.temperature
                )  # GSM8k's pass@1 is greedy (section 5.2)
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

    state = remove_tied_weights_from_state_dict(model.state_dict(), model)
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
    state_dict: dict[str, torch.Tensor], names: dict[str, str], dtype: torch.dtype, device
) -> tuple[torch.Tensor, list]:
    """theta_v for the engine: a copy in the engine's dtype under the checkpoint's names, in one buffer, taken between
    optimizer steps so the optimizer never writes what the engine reads. On a GPU the buffer stays in GPU memory and
    one CUDA IPC handle shares it with the engine; on a CPU it goes through a file."""
    if missing := [key for key in names if key not in state_dict]:
        raise RuntimeError(f"the weights to push lack {len(missing)} tensor(s) of the policy, e.g. {missing[0]}")
    keys = [key for key in state_dict if key in names]
    offsets = np.cumsum([0] + [state_dict[key].numel() for key in keys]).tolist()
    layout = [(names[key], list(state_dict[key].shape), offset) for key, offset in zip(keys, offsets)]
    flat = torch.empty(offsets[-1], dtype=dtype, device=device)
    for (_, view), key in zip(views(flat, layout), keys):
        view.copy_(state_dict[key].detach())
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()  # the engine's process reads it without our stream
    return flat, layout


class WeightReceiver:
    """Added to vLLM's GPU worker (`worker_extension_cls`): loads a snapshot shared by CUDA IPC, with no file and no
    copy through the CPU, through the model's own loader (which fuses q/k/v and gate/up and reorders GPTNeoX's q/k/v
    as for a checkpoint). The copy is in place, so CUDA graphs see it."""

    def load_shared_weights(self, handle: tuple, layout: list, trainer_gpu: int) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        handle = list(handle)
        handle[6] = trainer_gpu  # the snapshot's GPU, as this process numbers its GPUs
        self.reload_weights(weights_iterator=iter(views(rebuild_cuda_tensor(*handle), layout)))
        torch.cuda.synchronize()  # loaded before the trainer may free the snapshot


def push_weights(llm: LLM, weights: Weights, directory: str, trainer_gpu: int) -> None:
    """Load theta_v into the running engine. GPU: a CUDA IPC handle of the snapshot (WeightReceiver). CPU: safetensors
    in a RAM-backed folder, reloaded in place. The prefix cache holds KV of the old weights: reset it."""
    if weights.flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        llm.collective_rpc("load_shared_weights", args=(reduce_tensor(weights.flat)[1], weights.layout, trainer_gpu))
    else:
        save_file(
            {name: view.clone() for name, view in views(weights.flat, weights.layout)},
            os.path.join(directory, "model.safetensors"),
        )
        llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    llm.reset_prefix_cache()


def publish(
    version: int, accelerator: Accelerator, model, names: dict, dtype, device, snapshots: dict, channels: Channels
) -> None:
    """Snapshot theta_version (between optimizer steps) and hand it to the generation thread; rank 0 keeps it for
    checkpoints until no pending batch or evaluation needs it."""
    state_dict = accelerator.get_state_dict(model, unwrap=True)
    if accelerator.is_main_process:
        snapshots[version] = Weights(version, *snapshot_weights(state_dict, names, dtype, device))
        channels.weights.put(snapshots[version])


# == The engine: its GPU, its processes, signals ======================================================================
class Placement(NamedTuple):
    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's processes; None: CPU
    shared: bool  # the engine shares training rank 0's GPU
    trainer_gpu: int  # rank 0's GPU, which holds the weight snapshots, as the engine's processes number their GPUs
    memory_utilization: float


def visible_gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def engine_placement(
    mode: str, visible: list[str], num_training_processes: int, memory_utilization: float | None
) -> Placement:
    """Training process i uses visible GPU i. With an (N+1)-th visible GPU the engine takes it (the paper's split);
    with fewer, it shares rank 0's within its memory budget. Its processes also see rank 0's GPU, second, to open the
    snapshots rank 0 shares by CUDA IPC (docs/gpus.md)."""
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


def check_engine_fits(memory_utilization: float, free: int, total: int) -> None:
    """A shared GPU: vLLM takes memory_utilization x the GPU's memory and refuses to start when less is free."""
    if memory_utilization * total > free:
        raise UsageError(
            f"--vllm_gpu_memory_utilization {memory_utilization}: the engine would take {memory_utilization * total / 2**30:.1f} GiB "
            f"of the GPU it shares with training, which has {free / 2**30:.1f} GiB free once the trainer's models are loaded; "
            f"lower it to at most {max(int(100 * free / total) - 5, 0) / 100} (the optimizer state and activations need room too), or use a GPU of its own"
        )


@contextmanager
def on_cores(cores: list[int] | None):
    """Run the block on these cores (None: where it runs now). On Linux affinity belongs to a thread and is inherited
    by the threads and processes it starts; the calling thread gets its own back after."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def make_engine(args: Args, placement: Placement, dtype: str) -> LLM:
    """The engine runs in its own processes (vLLM's default): generation does not share the trainer's interpreter
    lock, and models vLLM serves through its Transformers backend (GPTNeoX on CPUs) do not patch the trainer's
    classes. The children inherit the environment set here."""
    env = dict(os.environ)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(
            key, None
        )  # an `accelerate launch`'s torch.distributed variables: the engine would join our group
    gpu = {}
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
        here = str(Path(__file__).resolve().parent)  # the worker imports WeightReceiver from this file
        os.environ["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
        gpu = dict(worker_extension_cls=f"{Path(__file__).stem}.WeightReceiver")
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default reserves far more
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # it warns at every push that rotary caches are not pushed
    try:
        return LLM(
            model=args.sft_model_path,
            dtype=dtype,
            seed=args.seed,
            max_model_len=args.max_prompt_length + args.response_length,
            gpu_memory_utilization=placement.memory_utilization,
            enforce_eager=placement.devices is None or args.vllm_enforce_eager,  # CUDA graphs on GPUs
            use_tqdm_on_load=False,
            logprobs_mode="processed_logprobs",  # logprobs after temperature, like the trainer's
            load_format="safetensors",
            trust_remote_code=args.trust_remote_code,
            **gpu,
        )
    finally:
        os.environ.clear()
        os.environ.update(env)


def dead_processes(processes: list[psutil.Process]) -> list[int]:
    dead = []
    for process in processes:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                dead.append(process.pid)
        except psutil.NoSuchProcess:
            dead.append(process.pid)
    return dead


def kill_process_trees(processes: list[psutil.Process], timeout: float = 5) -> None:
    """SIGKILL these processes and all they started, each stopped first so none can start another between our listing
    its children and killing it. Waits (up to `timeout`) for them to die without reaping them (vLLM reaps its own)."""
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
    """Children of this process not in `before`, but for Python's resource tracker (multiprocessing starts it here for
    the engine: it must outlive the engine to clean up after it)."""
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
    """Unlink the message queues of the engine's processes, dead now: killed by their shutdown's timeout, they could not
    (vLLM's scheduler unlinks its queue only after its worker exits, seconds later). This also tells Python's resource
    tracker, which would otherwise unlink them at exit with a "leaked shared_memory objects" warning."""
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue  # its creator unlinked it
        segment.close()
        segment.unlink()


# The watchdog (`python -c`, with dead_processes and kill_process_trees): it blocks reading a pipe whose only write end
# the trainer holds. When the trainer dies, however it dies (kill -9 included), the pipe closes: it then kills the
# engine's processes, which would live on re-parented to init, and removes the weights folder. Its input: lines
# "<pid> <create time>" (the time guards against a re-used pid), then the folder.
WATCHDOG = """
lines, processes = sys.stdin.read().splitlines(), []
for pid, create_time in (line.split() for line in lines[:-1]):
    try:
        if abs((process := psutil.Process(int(pid))).create_time() - float(create_time)) < 0.01:
            processes.append(process)
    except psutil.Error:
        pass
kill_process_trees(processes)
shutil.rmtree(lines[-1], ignore_errors=True)
"""


def start_watchdog(processes: list[psutil.Process], folder: str) -> subprocess.Popen:
    """A process of its own session (a Ctrl-C to the terminal does not reach it) that cleans up after a trainer that
    died without doing so; closing its stdin lets it go. Started after the engine, whose processes must not hold the
    pipe's write end."""
    functions = [inspect.getsource(function) for function in (dead_processes, kill_process_trees)]
    code = "\n".join(["import shutil, sys, time", "import psutil", *functions, WATCHDOG])
    watchdog = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, start_new_session=True, text=True)
    lines = []
    for process in processes:
        try:
            lines.append(f"{process.pid} {process.create_time()!r}\n")
        except psutil.Error:
            pass
    watchdog.stdin.write("".join(lines) + f"{folder}\n")
    watchdog.stdin.flush()
    return watchdog


def remove_stale_weights_folders(parent: str) -> list[str]:
    """Remove the weights folders (policy-weights-<pid>-*) of trainers no longer alive: what a trainer killed together
    with its watchdog leaves in RAM. Returns the folders removed."""
    removed = []
    for path in Path(parent).glob("policy-weights-*"):
        match = re.fullmatch(r"policy-weights-(\d+)-\w+", path.name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


class StopSignals:
    """SIGTERM (pre-emption) or Ctrl-C. Once the engine runs: finish the step, write a checkpoint, exit; a second
    signal exits at once. While starting: kill the processes started so far and exit at once, as vLLM cannot be left
    to stop: its start-up handshake swallows KeyboardInterrupt, and its wait for the engine's ready message does not
    notice the engine dying (as a Ctrl-C to the process group makes it), so it waits out a 10-minute timeout."""

    def __init__(self):
        self.received, self.starting, self.weights_dir = [], True, None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.starting:
            os.write(2, f"\n{name} while starting: stopping the engine and exiting\n".encode())
            kill_process_trees(started_processes(set()))
            if self.weights_dir is not None:
                shutil.rmtree(self.weights_dir, ignore_errors=True)
            gc.freeze()  # see the end of the file
            raise SystemExit(128 + signum)
        os.write(2, f"\n{name}: writing a checkpoint at the end of this step, then exiting\n".encode())
        self.received.append(signum)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


class Engine(NamedTuple):
    llm: LLM
    thread: threading.Thread
    processes: list[psutil.Process]
    segments: list[str]  # their shared memory
    weights_dir: str
    watchdog: subprocess.Popen
    started: float  # time.perf_counter() as the generation thread started: the timeline's origin


def start_engine(
    args: Args, inputs: Inputs, n: int, dtype: torch.dtype, schedule, channels: Channels, signals: StopSignals, cores
) -> Engine:
    """Rank 0's engine and the generation thread that drives it, started on `cores` (None: anywhere), with a watchdog
    that ends its processes if the trainer dies."""
    with on_cores(cores):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        if inputs.placement.devices is not None:
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = (
                "1"  # the push's CUDA IPC handle is pickled, between our processes
            )
        llm = make_engine(args, inputs.placement, str(dtype).removeprefix("torch."))
        processes = started_processes(before)
        ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_stale_weights_folders(ram)
        weights_dir = signals.weights_dir = tempfile.mkdtemp(prefix=f"policy-weights-{os.getpid()}-", dir=ram)
        push = partial(push_weights, llm, directory=weights_dir, trainer_gpu=inputs.placement.trainer_gpu)
        eos, prompts = inputs.tokenizer.eos_token_id, (inputs.train.token_ids, inputs.evaluation.token_ids)
        work = (llm, schedule, *prompts, args, n, inputs.sizes.batch_size, eos, channels, push)
        thread = threading.Thread(target=generation_thread, args=work, daemon=True)
        watchdog = start_watchdog(processes, weights_dir)
        engine = Engine(llm, thread, processes, shared_memory_of(processes), weights_dir, watchdog, time.perf_counter())
        thread.start()
    return engine


def stop_engine(engine: Engine | None, channels: Channels) -> None:
    """Stop the generation thread and the engine; the engine holds nothing to save, so nothing waits on its exit."""
    channels.stop.set()
    if engine is None:
        return
    engine.thread.join(timeout=1)  # it finishes the batch it is generating, or the engine's shutdown ends it
    engine.llm.llm_engine.engine_core.shutdown(timeout=1)
    engine.thread.join(timeout=5)  # a daemon: a thread stuck on a dead engine does not keep the process alive
    # The engine's worker outlives its scheduler process, killed after 1 s, by seconds (a garbage collection), and
    # their message queues stay in shared memory: end both.
    kill_process_trees(engine.processes)
    release_shared_memory(engine.segments)
    shutil.rmtree(engine.weights_dir, ignore_errors=True)
    engine.watchdog.stdin.close()  # nothing is left for it to clean up: it exits
    try:
        engine.watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


# == Logging and checkpoints ==========================================================================================
class MetricsLogger:
    """metrics.jsonl (one JSON object per line, each with step and episode), TensorBoard, wandb."""

    def __init__(self, output_dir: str, run_name: str, args: Args):
        from tensorboardX import SummaryWriter

        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.wandb = None
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project, entity=args.wandb_entity, name=run_name, config=asdict(args), dir=output_dir
            )

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

            table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self.wandb.log({"samples": table, "step": step, "episode": episode})

    def close(self) -> None:
        self.file.close()
        self.writer.close()
        if self.wandb:
            self.wandb.finish()


def git_revision() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, stderr=subprocess.DEVNULL, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_atomically(path: str, text: str) -> None:
    """Temporary file, then rename: a reader (or a crash) never sees half a file."""
    Path(f"{path}.tmp").write_text(text)
    os.replace(f"{path}.tmp", path)


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


def log_evaluation(
    rollout: EvalRollout, evaluation: Prompts, models, args, accelerator, logger, output_dir, episode, origin
):
    """Evaluate the completions of policy version `rollout.version` and log it: metrics, a sample table (also printed)
    and the completions, to eval_completions/step_NNNNNN.jsonl for judges that run after training
    (benchmark/llm_judge.py; a resumed run replaces a step's file). `origin`: the timeline's."""
    with accelerator.autocast():
        metrics, rows, completions = evaluate(rollout.responses, evaluation, models, args, accelerator.device)
    metrics |= {
        "time/eval_generation": rollout.generation_time,
        "timeline/eval_generation_start": rollout.generation_start - origin,
    }
    write_eval_completions(output_dir, rollout.version, episode, evaluation.queries, completions, evaluation.references)
    logger.log_samples(rollout.version, episode, rows)
    for row in rows:
        query = row["query"] if len(row["query"]) <= 80 else "..." + row["query"][-77:]  # what the completion follows
        details = ", ".join(f"{k} {v!r}" for k, v in row.items() if k not in ("query", "response"))
        print(f"  [step {rollout.version}] {query!r} -> {row['response']!r} ({details})")
    logger.log({"step": rollout.version, "episode": episode, **metrics})
    print(
        f"eval step {rollout.version}: "
        + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/"))
    )


def write_eval_completions(
    output_dir: str, step: int, episode: int, prompts: list[str], completions: list[str], references: list[str]
) -> str:
    folder = os.path.join(output_dir, "eval_completions")
    os.makedirs(folder, exist_ok=True)
    rows = [
        dict(step=step, episode=episode, prompt=p, completion=c, reference=r)
        for p, c, r in zip(prompts, completions, references)
    ]
    write_atomically(
        path := os.path.join(folder, f"step_{step:06d}.jsonl"), "".join(json.dumps(row) + "\n" for row in rows)
    )
    return path


def save_policy(accelerator: Accelerator, model, tokenizer, path: str) -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: no half-written model."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        shutil.rmtree(tmp := f"{path}.tmp", ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


class Progress:
    """Where the run is: the next step and the evaluations logged. Saved by accelerate with the trainer's state."""

    def __init__(self):
        self.step, self.evals_logged = 0, set()

    def state_dict(self) -> dict:
        return {"step": self.step, "evals_logged": sorted(self.evals_logged)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evals_logged = state["step"], set(state["evals_logged"])


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, progress: Progress, owed: dict[int, Weights], shuffle_rng
) -> str:
    """Everything a resumed run needs to go on exactly: accelerate's `save_state` (policy weights as safetensors, the
    optimizer, and the registered scheduler and Progress, RNG states), this process's shuffle generator, and the older
    policy versions the generator still owes batches or evaluations (so no engine state is needed). Written to a
    temporary folder, then renamed."""
    path = os.path.join(output_dir, "checkpoints", f"step_{progress.step:06d}")
    if accelerator.is_main_process:
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(f"{path}.tmp")
    Path(f"{path}.tmp", f"shuffle_rng_{accelerator.process_index}.json").write_text(
        json.dumps(shuffle_rng.bit_generator.state)
    )
    if accelerator.is_main_process:  # theta_step itself is the policy's weights
        for version, weights in [(v, w) for v, w in owed.items() if v < progress.step]:
            tensors = {name: view.cpu().clone() for name, view in views(weights.flat, weights.layout)}
            save_file(tensors, os.path.join(f"{path}.tmp", f"version_{version:06d}.safetensors"))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(f"{path}.tmp", path)
    accelerator.wait_for_everyone()
    return path


def owed_snapshots(
    snapshots: dict[int, Weights], schedule, next_step: int, evals_logged: set[int]
) -> dict[int, Weights]:
    """The snapshots of the policy versions the generator still needs for a trainer about to run `next_step`."""
    needed = published_versions(pending_events(schedule, next_step, evals_logged))
    return {version: weights for version, weights in snapshots.items() if version in needed}


def injected_fault(where: str, step: int) -> bool:
    """Fault injection, used only by the tests: ASYNC_RLHF_TEST_FAULT=<where>:<step>."""
    return os.environ.get("ASYNC_RLHF_TEST_FAULT") == f"{where}:{step}"


# == Online DPO (paper eq. 2): the pairs, the loss, the update ========================================================
ROLLOUT_LOGPROBS = False  # DPO's loss needs no logprobs of the engine's


def select_chosen_rejected(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores (prompts, K) -> chosen = first highest, rejected = last lowest, and `tied` where all K scores are equal:
    such a prompt carries no preference (dpo_batch_loss)."""
    chosen = scores.argmax(1)  # first maximal index
    rejected = scores.shape[1] - 1 - scores.flip(1).argmin(1)  # last minimal index
    return chosen, rejected, scores.max(1).values == scores.min(1).values


def dpo_loss(
    chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta: float, loss_type: str
) -> torch.Tensor:
    """Per-pair loss on summed sequence logprobs, h = (logp_c - ref_c) - (logp_r - ref_r): sigmoid = -log sigmoid(beta h)
    (DPO; its beta is the strength of the implicit KL term), ipo = (h - 1/(2 beta))^2."""
    h = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * h)
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown --loss_type {loss_type}")


def dpo_batch_loss(per_pair: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss: the untied pairs' losses summed, divided by ALL its pairs. Dividing by the untied ones only
    would multiply the step by up to 10x as the policy converges (60-90 % of the tiny task's pairs tie); this way an
    informative pair weighs lr / B whatever the tie fraction, as a tied prompt counts in RLOO's and PPO's means."""
    return (per_pair * (~tied).float()).sum() / len(per_pair)


def dpo_update(
    model, optimizer, scheduler, accelerator, pairs: Batch, ref_logps, tied, args, sizes, shuffle_rng, step
) -> dict:
    """T epochs over the B pairs (rows i and B + i: chosen and rejected), each epoch N mini-batches, each accumulated
    from micro-batches. Returns the step's statistics."""
    B, micro = sizes.local_batch_size, args.local_micro_batch_size
    stats = {k: [] for k in ("loss", "logps_chosen", "logps_rejected", "kl", "entropy", "accuracy", "margin")}
    model.train()
    for epoch in range(args.num_ppo_epochs):
        order = torch.as_tensor(shuffle_rng.permutation(B), device=accelerator.device)
        for mini_start in range(0, B, sizes.local_mini_batch_size):
            for micro_start in range(mini_start, mini_start + sizes.local_mini_batch_size, micro):
                idx = order[micro_start : micro_start + micro]
                rows = torch.cat([idx, idx + B])
                with accelerator.accumulate(model):
                    logps = response_logprobs(model, *(t[rows] for t in pairs[:4]), args.temperature).sum(1)
                    logps_c, logps_r = logps.chunk(2)
                    ref_c, ref_r = ref_logps[idx], ref_logps[idx + B]
                    if args.loss_type == "best_of_k_sft":
                        per_pair = -logps_c / pairs.response_mask[idx].sum(1).clamp(min=1)
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
    return {k: torch.stack(v).mean() for k, v in stats.items()}


# == The training loop ================================================================================================
if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    # the process group and device, before the Accelerator that needs the dtype (as that Accelerator would make them)
    on_gpu = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU")).device.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bfloat16" or (args.dtype == "auto" and on_gpu) else torch.float32
    engine_dtype = {"auto": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.vllm_dtype]
    # bf16: autocast in the forward passes of the policy (accelerate's mixed precision) and of every frozen model
    precision = "bf16" if dtype == torch.bfloat16 else "no"
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=precision)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # fp32 matmuls on tensor cores
    run_name = name_run(args)
    output_dir = args.output_dir or os.path.join("runs", run_name)
    try:
        inputs = check_inputs(args, accelerator, output_dir, on_gpu)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    sizes, tokenizer, train, evaluation = inputs.sizes, inputs.tokenizer, inputs.train, inputs.evaluation
    device = accelerator.device
    signals = StopSignals()  # before any model loads: see StopSignals
    if (deepspeed := accelerator.state.deepspeed_plugin) is not None:  # DeepSpeed wants these in its own config
        deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = args.local_micro_batch_size
        deepspeed.deepspeed_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    cores, engine_cores = sorted(os.sched_getaffinity(0)), None
    if device.type == "cpu" and len(cores) > accelerator.num_processes:
        # Split the cores as the paper splits GPUs: the first is the engine's (its worker, its scheduler and our
        # generation thread, which take turns), the others train. Threads started later inherit the training cores.
        engine_cores = cores[:1]
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[0]))
        os.sched_setaffinity(0, cores[1:])
        torch.set_num_threads(len(cores) - 1)
    # The generation thread needs the interpreter lock at every decoding step; training hands it over every switch
    # interval (5 ms by default) while it runs Python. 0.5 ms: pipeline efficiency 92.5% -> 96.1% (docs/speed.md).
    sys.setswitchinterval(0.0005)
    set_seed(args.seed + accelerator.process_index)

    # models (safetensors only). The policy and the reference keep fp32 weights (the optimizer's, and the policy's
    # numbers at step 0) and run under autocast; the reward and gold models, which only score, hold --dtype weights.
    model_kwargs = dict(trust_remote_code=args.trust_remote_code, use_safetensors=True)
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, **model_kwargs)
    ref_policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, **model_kwargs)
    gold_model = gold_tokenizer = reward_model = None
    try:  # the score-head check of a hub id whose config did not say
        if args.task != "gsm8k":
            reward_model = load_reward_model(args.reward_model_path, "--reward_model_path", dtype=dtype, **model_kwargs)
        if args.gold_judge != "tiny" and accelerator.is_main_process:
            gold_model = (
                load_reward_model(args.gold_judge, "--gold_judge", dtype=dtype, **model_kwargs).to(device).eval()
            )
            gold_tokenizer = AutoTokenizer.from_pretrained(args.gold_judge, trust_remote_code=args.trust_remote_code)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    models = Models(tokenizer, ref_policy, reward_model, inputs.reward_tokenizer, gold_model, gold_tokenizer)
    engine_names = checkpoint_names(policy)  # before accelerate wraps the policy
    if args.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    L, R = args.max_prompt_length + args.response_length, args.response_length  # padded widths the passes process
    B, K = sizes.local_batch_size, args.num_samples
    phase_flops = {  # per process and step, for the model FLOP utilisation of each phase (benchmark/timing.py)
        "scoring": 0 if reward_model is None else forward_flops(reward_model, B * K, L),
        "reference": forward_flops(ref_policy, 2 * B, L, R + 1),
        "update": (4 if args.gradient_checkpointing else 3)
        * args.num_ppo_epochs
        * forward_flops(policy, 2 * B, L, R + 1),
    }
    frozen = [m for m in (ref_policy, reward_model) if m is not None]
    for m in (policy, *frozen):
        disable_dropout(m)
    for m in frozen:
        m.to(device).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=args.adam_epsilon)
    model, optimizer = accelerator.prepare(policy, optimizer)
    # Stepped by hand once per optimizer update (accelerate's prepared scheduler would step per process).
    schedule_factor = partial(lr_factor, args.lr_schedule, num_updates=sizes.num_updates)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule_factor)
    shuffle_rng, progress = np.random.default_rng([args.seed, accelerator.process_index]), Progress()
    accelerator.register_for_checkpointing(scheduler, progress)
    if inputs.checkpoint:  # the trainer exactly as it was when the checkpoint was written
        accelerator.load_state(inputs.checkpoint)
        rng_file = Path(inputs.checkpoint, f"shuffle_rng_{accelerator.process_index}.json")
        shuffle_rng.bit_generator.state = json.loads(rng_file.read_text())
        print(f"resuming from {inputs.checkpoint} (step {progress.step})")
    elif args.resume:
        print(f"--resume: no checkpoint in {output_dir} yet, starting at step 0")
    start_step, evals_logged = progress.step, progress.evals_logged
    eval_steps = sorted({0, sizes.num_steps, *range(0, sizes.num_steps, args.eval_freq or sizes.num_steps)})
    schedule = pending_events(
        generation_schedule(sizes.num_steps, args.async_level, eval_steps), start_step, evals_logged
    )
    to_publish = published_versions(schedule)

    # rank 0 owns the engine and generates for every rank
    channels = Channels(queue.Queue(), queue.Queue(), queue.Queue(), threading.Event(), [])
    engine = logger = None
    if accelerator.is_main_process:
        os.makedirs(output_dir, exist_ok=True)
        if args.resume:
            keep_metrics_until(os.path.join(output_dir, "metrics.jsonl"), start_step, evals_logged)
        run_args = {**asdict(args), **sizes._asdict(), "output_dir": output_dir, "git_revision": git_revision()}
        write_atomically(os.path.join(output_dir, "args.json"), json.dumps(run_args, indent=2))
        logger = MetricsLogger(output_dir, run_name, args)
        if inputs.placement.shared:
            try:
                check_engine_fits(inputs.placement.memory_utilization, *torch.cuda.mem_get_info(device))
            except UsageError as exc:
                raise SystemExit(f"error: {exc}")
        engine = start_engine(args, inputs, K, engine_dtype, schedule, channels, signals, engine_cores)
    signals.starting = False
    engine_processes = engine.processes if engine else []
    score_source = (
        "GSM8k's verifier" if args.task == "gsm8k" else f"reward model --reward_model_path {args.reward_model_path}"
    )

    # Policy versions the generator may still need (on rank 0's GPU on GPUs): a checkpoint hands them on.
    snapshots, snapshot_device = {}, device if inputs.placement.devices is not None else torch.device("cpu")
    push_to = (accelerator, model, engine_names, engine_dtype, snapshot_device, snapshots, channels)
    # A resumed run re-sends the versions the generator still needs: older ones from the checkpoint, then theta_start.
    for version in sorted(v for v in to_publish if v <= start_step):
        if version == start_step:
            publish(version, *push_to)
        elif accelerator.is_main_process:
            tensors = load_file(os.path.join(inputs.checkpoint, f"version_{version:06d}.safetensors"))
            snapshots[version] = Weights(
                version, *snapshot_weights(tensors, {k: k for k in tensors}, engine_dtype, snapshot_device)
            )
            channels.weights.put(snapshots[version])

    eval_log = (evaluation, models, args, accelerator, logger, output_dir)
    last_checkpoint, exit_code = inputs.checkpoint, 0
    try:
        steps = range(start_step, sizes.num_steps)
        progress_bar = tqdm(
            steps, initial=start_step, total=sizes.num_steps, disable=not accelerator.is_main_process, desc="steps"
        )
        for step in progress_bar:
            step_start = time.perf_counter()
            # 1. get the rollouts of this step (rank 0 has them; every rank takes its slice), or a stop signal
            rollout = None
            if accelerator.is_main_process:
                rollout = get_or_raise(channels.rollouts, channels, engine_processes, interrupt=signals.received)
                rollout = signals.received[0] if rollout is None else rollout
            rollout = broadcast_object_list([rollout])[0]
            if isinstance(rollout, int):
                if step > start_step:
                    progress.step, owed = step, owed_snapshots(snapshots, schedule, step, evals_logged)
                    last_checkpoint = save_checkpoint(accelerator, output_dir, progress, owed, shuffle_rng)
                print(
                    f"stopped before step {step}"
                    + (f"; resume from {last_checkpoint} with --resume" if last_checkpoint else "")
                )
                exit_code = 128 + rollout
                break
            wait_for_rollouts = time.perf_counter() - step_start
            lag = step - rollout.version
            if rollout.step != step or lag != min(step, args.async_level):  # the async contract (paper section 3)
                raise RuntimeError(
                    f"async invariant broken: step {step} got rollout {rollout.step} from policy version {rollout.version}"
                )
            train_start = time.perf_counter()
            local = slice(accelerator.process_index * B, (accelerator.process_index + 1) * B)
            local_indices = rollout.prompt_indices[local]
            responses = rollout.responses[local.start * K : local.stop * K]
            batch = to_batch([train.token_ids[i] for i in local_indices], responses, K, args, tokenizer, device)

            # 2. score: the reward model on query + response with a fixed score without EOS, or GSM8k's verifier
            references = [train.references[i] for i in local_indices for _ in range(K)]  # one per completion
            with accelerator.autocast():
                scores = score_batch(batch, references, models, args)
            if injected_fault("scoring", step):
                raise RuntimeError(f"injected test fault in reward scoring at step {step} (time {time.time():.2f})")
            if injected_fault("nan_score", step):
                scores[0] = float("nan")
            check_scores(accelerator.gather(scores), score_source, step)  # every process sees every score: all stop
            score_time = time.perf_counter() - train_start

            # 3. pairs: best and worst of K (paper section 4.2), and their reference logprobs
            chosen, rejected, tied = select_chosen_rejected(scores.view(B, K))
            pair_rows = torch.cat(
                [torch.arange(B, device=device) * K + chosen, torch.arange(B, device=device) * K + rejected]
            )
            pairs = Batch(*(t[pair_rows] for t in batch))
            ref_start, bs = time.perf_counter(), args.local_rollout_forward_batch_size
            with torch.no_grad(), accelerator.autocast():
                parts = [[t[i : i + bs] for t in pairs[:4]] for i in range(0, 2 * B, bs)]
                ref_logps = torch.cat([response_logprobs(ref_policy, *part, args.temperature).sum(1) for part in parts])
            ref_time = time.perf_counter() - ref_start

            # 4. update: T epochs over N mini-batches, each accumulated from micro-batches
            update_start = time.perf_counter()
            stats = dpo_update(
                model, optimizer, scheduler, accelerator, pairs, ref_logps, tied, args, sizes, shuffle_rng, step
            )
            update_time = time.perf_counter() - update_start

            # 5. send theta_{step+1} to the engine if a later batch or an evaluation needs it
            if step + 1 in to_publish:
                publish(step + 1, *push_to)
            training_time = time.perf_counter() - train_start

            # 6. log
            stats |= {
                "scores": scores.mean(),
                "num_eos_tokens": batch.contain_eos.float().mean(),
                "tied": tied.float().mean(),
            }
            stats["response_tokens"] = batch.response_mask.sum().float()
            reduced = dict(zip(stats, accelerator.reduce(torch.stack(list(stats.values())), "mean").tolist()))
            if not math.isfinite(reduced["loss"]):
                last = f"; the last good one is {last_checkpoint} (--resume)" if last_checkpoint else ""
                raise RuntimeError(
                    f"loss is {reduced['loss']} at step {step}: stopping before it reaches a checkpoint{last}"
                )
            if accelerator.is_main_process:
                step_time = time.perf_counter() - step_start
                times = dict(generation=rollout.generation_time, weight_sync=rollout.weight_sync_time)
                times |= dict(generator_wait=rollout.wait_time, wait_for_rollouts=wait_for_rollouts, scoring=score_time)
                times |= dict(reference=ref_time, update=update_time)
                starts = {
                    "step_start": step_start,
                    "training_start": train_start,
                    "generation_start": rollout.generation_start,
                }
                starts["weight_sync_start"] = rollout.weight_sync_start
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
                    **{f"time/{k}": v for k, v in times.items()},
                    **{f"flops/{k}": v for k, v in phase_flops.items()},
                    "time/training": training_time,
                    "time/step": step_time,
                    **{
                        f"timeline/{k}": v - engine.started for k, v in starts.items()
                    },  # seconds since the engine was up
                    "throughput/episodes_per_second": sizes.episodes_per_step / step_time,
                    "throughput/tokens_per_second": reduced["response_tokens"] * sizes.world_size / step_time,
                }
                logger.log(metrics)
                progress_bar.set_postfix(lag=lag, score=f"{reduced['scores']:.3f}", kl=f"{reduced['kl']:.2f}")
                # 7. evaluations arrive from the generation thread a little later; score them as they come
                while not channels.evals.empty():
                    eval_rollout = channels.evals.get()
                    log_evaluation(
                        eval_rollout, *eval_log, eval_rollout.version * sizes.episodes_per_step, engine.started
                    )
                    evals_logged.add(eval_rollout.version)
                for version in snapshots.keys() - owed_snapshots(snapshots, schedule, step + 1, evals_logged).keys():
                    del snapshots[version]
            if args.save_freq and (step + 1) % args.save_freq == 0 and step + 1 < sizes.num_steps:
                progress.step, owed = step + 1, owed_snapshots(snapshots, schedule, step + 1, evals_logged)
                last_checkpoint = save_checkpoint(accelerator, output_dir, progress, owed, shuffle_rng)

        if not exit_code:
            if accelerator.is_main_process:
                while len(evals_logged) < len(eval_steps):
                    eval_rollout = get_or_raise(channels.evals, channels, engine_processes)
                    log_evaluation(
                        eval_rollout, *eval_log, eval_rollout.version * sizes.episodes_per_step, engine.started
                    )
                    evals_logged.add(eval_rollout.version)
            save_policy(accelerator, model, tokenizer, os.path.join(output_dir, "policy"))
    except KeyboardInterrupt:
        print("interrupted: stopping the generation thread and the engine")
        exit_code = 130
    finally:
        stop_engine(engine, channels)
        if logger is not None:
            logger.close()
        gc.freeze()  # the interpreter's exit would garbage-collect the whole heap (seconds on a CPU); the OS frees it
    if exit_code:
        raise SystemExit(exit_code)
