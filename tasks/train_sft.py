"""Supervised fine-tuning of a causal LM on prompt/completion pairs, in one file (accelerate).

Makes the SFT policy the RLHF scripts start from: the tiny task's (`tiny/build.py` calls
`train` here) and No Robots' (paper appendix A.2, table 5). Flags: `--help`. The loss is the mean
negative log-likelihood of the completion tokens only; prompt tokens and padding are masked.

Data: a hub dataset id, a local dataset folder or a .jsonl/.json/.parquet/.csv file, with either
  - `prompt` (text, or a list of chat messages) and `completion` (text) columns, or
  - a `messages` column of chat turns (HuggingFaceH4/no_robots): the final turn, which must be the
    assistant's, is the completion; the turns before it, rendered with the chat template and the
    assistant prefix, are the prompt.
EOS is appended to every completion that does not already end with it, so the policy learns to stop.

Defaults are the tiny task's SFT. Table 5 (No Robots, from Meta-Llama-3.1-8B), on 8 GPUs:

    accelerate launch --num_processes 8 --mixed_precision bf16 tasks/train_sft.py \\
        --model_name_or_path meta-llama/Llama-3.1-8B --dataset_name HuggingFaceH4/no_robots \\
        --chat_template tulu --output_dir models/llama-3.1-8b-sft-no-robots \\
        --max_prompt_length 1024 --max_completion_length 3072 --trim_padding --gradient_checkpointing \\
        --local_micro_batch_size 2 --gradient_accumulation_steps 8 \\
        --learning_rate 5e-6 --lr_scheduler_type linear --warmup_ratio 0.03 --weight_decay 0.0 \\
        --num_train_epochs 2 --total_steps None --batch_sampling epochs --seed 1

(effective batch 128 = 2 x 8 accumulation x 8 GPUs; table 5's max sequence length 4,096 =
1,024 prompt + 3,072 completion tokens; an 8B model with AdamW needs its optimizer state sharded:
add a DeepSpeed ZeRO-3 or FSDP accelerate config.)
"""

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator

# A plain role-tag template for base models that ship without one: `--chat_template tulu`.
# Assistant turns end with EOS, which is where a completion stops.
TULU_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass
class Args:
    # data and model
    model_name_or_path: str
    """initial model: a local folder or hub id (the tiny task's builder passes a fresh random model instead)"""
    dataset_name: str
    """a hub dataset id, a local dataset folder or a .jsonl/.json/.parquet/.csv file (columns: see the file's docstring)"""
    output_dir: str
    """the trained model folder (safetensors + tokenizer); written atomically, replacing an earlier model there"""
    dataset_train_split: str = "train"
    """split trained on"""
    chat_template: str | None = None
    """Jinja chat template for chat data, stored with the model: `tulu`, a file, or the template text (None: the tokenizer's own)"""
    apply_chat_template: bool = False
    """render text prompts as one user turn with the chat template (chat data and message-list prompts always are)"""
    max_prompt_length: int = 12
    """prompts longer than this many tokens are dropped (the count is printed)"""
    max_completion_length: int = 12
    """completions (EOS included) are cut to this many tokens; a cut completion has lost its EOS"""
    append_eos: bool = True
    """end every completion with EOS unless it already does"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the weights load in (mixed precision itself comes from the accelerate config)"""

    # batch sizes (effective batch = local_micro_batch_size x gradient_accumulation_steps x processes)
    local_micro_batch_size: int = 128
    """rows per forward/backward pass on one process"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step"""
    trim_padding: bool = False
    """drop the columns that are padding in every row of a micro-batch (much faster on ragged real data; the
    tiny task keeps its fixed layout so that its build is reproducible byte for byte)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (long sequences on big models)"""

    # optimisation
    learning_rate: float = 2e-3
    """peak learning rate (AdamW)"""
    lr_scheduler_type: Literal["cosine", "linear", "constant"] = "cosine"
    """decay to 0 over the run (cosine, linear) or none, multiplied by the linear warmup"""
    warmup_steps: int = 50
    """steps of linear warmup"""
    warmup_ratio: float = 0.0
    """when > 0: warmup over this fraction of the steps instead of --warmup_steps"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    max_grad_norm: float = 1.0
    """gradients are clipped to this global norm"""
    batch_sampling: Literal["uniform", "epochs"] = "uniform"
    """uniform: every batch drawn uniformly with replacement; epochs: a fresh shuffle per epoch, each row once"""
    num_train_epochs: int = 1
    """passes over the data, used when --total_steps is None"""
    total_steps: int | None = 1200
    """optimizer steps (None: num_train_epochs x rows // batch size)"""
    seed: int = 1
    """seed of the batch order and initialisation"""
    log_every: int = 200
    """print the loss every this many steps (and at the last)"""


class UsageError(ValueError):
    """Bad flags or input files: reported in one line, before any model loads."""


class Encoded(NamedTuple):
    """Rows in the RLHF scripts' layout: prompt left-padded to max_prompt_length, then the completion
    right-padded to max_completion_length. Masks come from lengths, never from comparing ids with pad
    (Llama-3.1 has no pad token; the EOS stands in for it)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor  # 1 on completion tokens: the only ones the SFT loss sees


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def load_split(name: str, split: str, flag: str = "--dataset_name"):
    """A split from a hub id or a local dataset folder; a single local file is one split of its own."""
    from datasets import load_dataset

    if os.path.isfile(name):
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
        if Path(name).suffix not in builders:
            raise UsageError(f"{flag} {name}: a single file must be one of {', '.join(builders)}")
        if os.path.getsize(name) == 0:
            raise UsageError(f"{flag} {name} has no rows")
        try:
            dataset = load_dataset(builders[Path(name).suffix], data_files=name, split="train")
        except Exception as exc:  # a malformed file: name it in one line, not in a traceback
            raise UsageError(
                f"{flag} {name} cannot be read: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            ) from exc
    else:
        try:
            dataset = load_dataset(name, split=split)
        except (FileNotFoundError, ValueError) as exc:
            raise UsageError(f"{flag} {name} split {split}: {str(exc).strip().splitlines()[0]}") from exc
    if len(dataset) == 0:
        raise UsageError(f"{flag} {name} split {split} has no rows")
    return dataset


def require_columns(dataset, columns: set[str], where: str) -> None:
    missing = columns - set(dataset.column_names)
    if missing:
        raise UsageError(f"{where} lacks column(s) {sorted(missing)}; it has {dataset.column_names}")


def check_text(values: list, column: str, where: str) -> None:
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise UsageError(f"{where} row {i}: `{column}` must be a string, got {type(value).__name__}")


def check_prompt(value, i: int, where: str) -> None:
    """A prompt is text or a non-empty list of {"role", "content"} chat messages."""
    if isinstance(value, str):
        return
    if not (
        isinstance(value, list)
        and value
        and all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value)
    ):
        raise UsageError(f"{where} row {i}: `prompt` must be a string or a list of {{role, content}} messages")


def load_sft_rows(name: str, split: str) -> tuple[list, list[str]]:
    """(prompts, completions) from prompt/completion columns or from No Robots' `messages` column."""
    dataset = load_split(name, split)
    where = f"--dataset_name {name} split {split}"
    if "messages" in dataset.column_names:
        prompts, completions = [], []
        for i, messages in enumerate(dataset["messages"]):
            check_prompt(messages, i, where)
            if len(messages) < 2 or messages[-1]["role"] != "assistant":
                raise UsageError(
                    f"{where} row {i}: `messages` must end with an assistant turn after at least one other turn"
                )
            prompts.append(messages[:-1])
            completions.append(messages[-1]["content"])
        return prompts, completions
    require_columns(dataset, {"prompt", "completion"}, where + " (or give a `messages` column)")
    prompts, completions = list(dataset["prompt"]), list(dataset["completion"])
    for i, prompt in enumerate(prompts):
        check_prompt(prompt, i, where)
    check_text(completions, "completion", where)
    return prompts, completions


def resolve_chat_template(value: str) -> str:
    """--chat_template: `tulu`, a template file, or the template text itself."""
    if value == "tulu":
        return TULU_CHAT_TEMPLATE
    return Path(value).read_text() if os.path.isfile(value) else value


def load_tokenizer(path: str, args):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model_name_or_path {path}: {str(exc).strip().splitlines()[0]}") from exc
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of --model_name_or_path {path} has no EOS token: completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from lengths, not from pad ids
    if args.chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(args.chat_template)
    return tokenizer


def encode_prompts(tokenizer, prompts: list, apply_chat_template: bool = False) -> list[list[int]]:
    """Text prompts get the tokenizer's own special tokens (BOS for Llama) unless their text already
    begins with BOS, as chat-templated text does (tasks/label_preferences.py writes such prompts);
    chat prompts are rendered with the chat template and the assistant prefix, whose text holds them."""
    if all(isinstance(p, str) for p in prompts) and not apply_chat_template:
        bos = tokenizer.bos_token
        templated = [bool(bos) and p.startswith(bos) for p in prompts]
        plain = iter(
            tokenizer([p for p, t in zip(prompts, templated) if not t]).input_ids if not all(templated) else []
        )
        as_is = iter(
            tokenizer([p for p, t in zip(prompts, templated) if t], add_special_tokens=False).input_ids
            if any(templated)
            else []
        )
        return [next(as_is) if t else next(plain) for t in templated]
    if tokenizer.chat_template is None:
        raise UsageError("chat prompts need a chat template: the tokenizer has none, pass --chat_template (e.g. tulu)")
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}] if isinstance(p, str) else p, add_generation_prompt=True, tokenize=False
        )
        for p in prompts
    ]
    return tokenizer(texts, add_special_tokens=False).input_ids


def encode_completions(tokenizer, completions: list[str], append_eos: bool) -> list[list[int]]:
    out = tokenizer(completions, add_special_tokens=False).input_ids if completions else []
    if append_eos:
        out = [ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id] for ids in out]
    return out


def pad_rows(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    max_prompt_length: int,
    max_completion_length: int,
    pad_token_id: int,
) -> Encoded:
    """The layout of `Encoded`; prompts must fit, completions are cut to max_completion_length."""
    n, width = len(prompt_ids), max_prompt_length + max_completion_length
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    completion_mask = torch.zeros((n, width), dtype=torch.long)
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completion_ids)):
        assert len(prompt) <= max_prompt_length, "drop the prompts that do not fit first"
        completion = completion[:max_completion_length]
        start, end = max_prompt_length - len(prompt), max_prompt_length + len(completion)
        input_ids[row, start:end] = torch.tensor(prompt + completion, dtype=torch.long)
        attention_mask[row, start:end] = 1
        completion_mask[row, max_prompt_length:end] = 1
    return Encoded(input_ids, attention_mask, completion_mask)


def fitting_prompts(prompt_ids: list[list[int]], max_prompt_length: int, what: str) -> list[int]:
    """Indices of the prompts within max_prompt_length; the dropped ones are counted."""
    keep = [i for i, ids in enumerate(prompt_ids) if len(ids) <= max_prompt_length]
    if len(keep) < len(prompt_ids):
        print(
            f"{what}: dropped {len(prompt_ids) - len(keep)} of {len(prompt_ids)} rows whose prompt is longer than --max_prompt_length {max_prompt_length}"
        )
    if not keep:
        raise UsageError(f"{what}: no prompt fits --max_prompt_length {max_prompt_length}")
    return keep


def encode_sft(tokenizer, prompts: list, completions: list[str], args) -> Encoded:
    prompt_ids = encode_prompts(tokenizer, prompts, args.apply_chat_template)
    completion_ids = encode_completions(tokenizer, completions, args.append_eos)
    keep = fitting_prompts(prompt_ids, args.max_prompt_length, "SFT data")
    cut = sum(len(completion_ids[i]) > args.max_completion_length for i in keep)
    if cut:
        print(f"SFT data: {cut} of {len(keep)} completions cut to --max_completion_length {args.max_completion_length}")
    prompt_ids, completion_ids = [prompt_ids[i] for i in keep], [completion_ids[i] for i in keep]
    return pad_rows(
        prompt_ids, completion_ids, args.max_prompt_length, args.max_completion_length, tokenizer.pad_token_id
    )


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def position_ids_from(mask: torch.Tensor) -> torch.Tensor:
    """Real tokens count from 0 whatever the left padding (pads get arbitrary positions, they are masked)."""
    return mask.cumsum(1) - mask


def trim_columns(*tensors: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Drop the leading and trailing columns that are padding in every row."""
    real = attention_mask.any(0).nonzero()
    first, last = real.min().item(), real.max().item()
    return tuple(t[:, first : last + 1] for t in tensors)


def sft_loss(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> torch.Tensor:
    """Mean NLL of the completion tokens: token t is predicted from the logits at t - 1, and only
    targets under completion_mask count (prompt tokens and padding are masked)."""
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
    ).logits.float()
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(), reduction="none")
    target_mask = completion_mask[:, 1:].flatten()
    return (nll * target_mask).sum() / target_mask.sum().clamp(min=1)


def lr_at(step: int, total: int, lr: float, warmup: int, schedule: str) -> float:
    """Linear warmup over `warmup` steps times the decay (cosine or linear to 0, or none)."""
    ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    if schedule == "cosine":
        return lr * ramp * 0.5 * (1 + math.cos(math.pi * step / total))
    if schedule == "linear":
        return lr * ramp * (1 - step / total)
    return lr * ramp


def batch_indices(num_rows: int, batch_size: int, num_steps: int, sampling: str, seed: int):
    """Row indices of each step's (global) batch. `epochs`: a seeded shuffle per epoch cut into full
    batches (the remainder is skipped); `uniform`: drawn with replacement."""
    g = torch.Generator().manual_seed(seed)
    per_epoch = num_rows // batch_size
    for step in range(num_steps):
        if sampling == "uniform":
            yield torch.randint(num_rows, (batch_size,), generator=g)
        else:
            if step % per_epoch == 0:
                perm = torch.randperm(num_rows, generator=g)
            yield perm[(step % per_epoch) * batch_size :][:batch_size]


def schedule_sizes(num_rows: int, args, world_size: int) -> tuple[int, int, int]:
    """(batch_size, num_steps, warmup_steps), checked; errors name the flags to change."""
    for flag in (
        "local_micro_batch_size",
        "gradient_accumulation_steps",
        "num_train_epochs",
        "max_prompt_length",
        "max_completion_length",
        "log_every",
    ):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.total_steps is not None and args.total_steps < 1:
        raise UsageError(f"--total_steps must be >= 1 or None, got {args.total_steps}")
    if args.learning_rate <= 0 or args.warmup_steps < 0 or not 0 <= args.warmup_ratio < 1 or args.max_grad_norm <= 0:
        raise UsageError(
            "--learning_rate and --max_grad_norm must be > 0, --warmup_steps >= 0, 0 <= --warmup_ratio < 1"
        )
    batch_size = args.local_micro_batch_size * args.gradient_accumulation_steps * world_size
    if num_rows < batch_size:
        raise UsageError(
            f"{num_rows} rows cannot fill one batch of {batch_size} = local_micro_batch_size {args.local_micro_batch_size} x "
            f"gradient_accumulation_steps {args.gradient_accumulation_steps} x processes {world_size}; lower those flags"
        )
    num_steps = args.total_steps or args.num_train_epochs * (num_rows // batch_size)
    warmup = round(args.warmup_ratio * num_steps) if args.warmup_ratio > 0 else args.warmup_steps
    return batch_size, num_steps, warmup


def optimize(model, loss_fn, num_rows: int, sampling: str, args, accelerator: Accelerator, name: str):
    """The loop both training scripts share: each step's batch of row indices gives one optimizer step
    over gradient_accumulation_steps micro-batches per process. `loss_fn(model, rows)` returns the loss
    of those rows and extra metrics to print. Returns the prepared model and the loss of every step."""
    assert accelerator.gradient_accumulation_steps == args.gradient_accumulation_steps, (
        "build the Accelerator with the same accumulation"
    )
    batch_size, num_steps, warmup = schedule_sizes(num_rows, args, accelerator.num_processes)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    model, optimizer = accelerator.prepare(model, optimizer)
    local, micro = args.local_micro_batch_size * args.gradient_accumulation_steps, args.local_micro_batch_size
    losses = []
    model.train()
    for step, indices in enumerate(batch_indices(num_rows, batch_size, num_steps, sampling, args.seed)):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, num_steps, args.learning_rate, warmup, args.lr_scheduler_type)
        mine = indices[accelerator.process_index * local :][:local]
        step_loss = 0.0
        for i in range(args.gradient_accumulation_steps):
            with accelerator.accumulate(
                model
            ):  # steps the optimizer (and syncs gradients) on the last micro-batch only
                loss, metrics = loss_fn(model, mine[i * micro :][:micro])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad()
            step_loss += loss.item() / args.gradient_accumulation_steps
        step_loss = accelerator.reduce(
            torch.tensor(step_loss, dtype=torch.float64, device=accelerator.device), "mean"
        ).item()  # over processes
        losses.append(step_loss)
        if accelerator.is_main_process and (step % args.log_every == 0 or step == num_steps - 1):
            extra = "".join(f"  {k} {v:.3f}" for k, v in metrics.items())
            print(f"  {name} step {step:5d}  loss {step_loss:.4f}{extra}", flush=True)
    model.eval()
    return model, losses


def train(model, data: Encoded, args: Args, accelerator: Accelerator):
    """SFT of `model` on `data`; returns the prepared model (`accelerator.unwrap_model` gives the
    trained model itself) and the per-step losses."""

    def loss_fn(model, rows):
        ids, mask, completion = data.input_ids[rows], data.attention_mask[rows], data.completion_mask[rows]
        if args.trim_padding:
            ids, mask, completion = trim_columns(ids, mask, completion, attention_mask=mask)
        device = accelerator.device
        return sft_loss(model, ids.to(device), mask.to(device), completion.to(device)), {}

    return optimize(model, loss_fn, len(data.input_ids), args.batch_sampling, args, accelerator, "sft")


# ---------------------------------------------------------------------------------------------
# Checks and saving
# ---------------------------------------------------------------------------------------------
def check_output_dir(path: str) -> None:
    """The output folder is replaced when training ends: refuse one that holds something other than a model."""
    if os.path.exists(path) and not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))):
        raise UsageError(f"--output_dir {path} exists and is not a model folder: it would be replaced; choose another")


def check_model_path(path: str, args) -> None:
    """Before any weights load: the model exists and has safetensors weights (pickled ones are never loaded)."""
    from transformers import AutoConfig

    if os.path.isdir(path) and not list(Path(path).glob("*.safetensors")):
        raise UsageError(
            f"--model_name_or_path {path} has no .safetensors weights (pickled .bin weights are not loaded)"
        )
    try:
        AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--model_name_or_path {path}: {str(exc).strip().splitlines()[0]}") from exc


def save_model(
    accelerator: Accelerator, prepared, tokenizer, path: str, json_files: dict | None = None, submodule: str = ""
) -> None:
    """save_pretrained (safetensors) and `json_files` ({name: object}) into a temporary folder, then
    rename: never a half-written model. `prepared` is the model as accelerate returned it (ZeRO-3 shards
    it: every process must call this); `submodule` names the model inside it (train_reward.py wraps its)."""
    state_dict = accelerator.get_state_dict(prepared)
    model = accelerator.unwrap_model(prepared)
    if submodule:
        model = getattr(model, submodule)
        state_dict = {k.removeprefix(submodule + "."): v for k, v in state_dict.items()}
    if accelerator.is_main_process:
        tmp = f"{path}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for name, content in (json_files or {}).items():
            Path(tmp, name).write_text(json.dumps(content, indent=2) + "\n")
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    start = time.time()
    try:  # every check of the flags and input files, before the model loads
        check_output_dir(args.output_dir)
        prompts, completions = load_sft_rows(args.dataset_name, args.dataset_train_split)
        check_model_path(args.model_name_or_path, args)
        tokenizer = load_tokenizer(args.model_name_or_path, args)
        data = encode_sft(tokenizer, prompts, completions, args)
        batch_size, num_steps, warmup = schedule_sizes(len(data.input_ids), args, accelerator.num_processes)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    accelerator.print(f"{len(data.input_ids)} rows, batch {batch_size}, {num_steps} steps ({warmup} warmup)")
    from transformers import AutoModelForCausalLM, set_seed

    set_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(
        args.model_name_or_path, dtype=getattr(torch, args.dtype), trust_remote_code=args.trust_remote_code
    )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model, losses = train(model, data, args, accelerator)
    save_model(accelerator, model, tokenizer, args.output_dir, {"training_args.json": asdict(args)})
    if accelerator.is_main_process:
        print(f"saved {args.output_dir} after {time.time() - start:.0f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    accelerator.end_training()  # leaves the process group: gloo's threads would abort the interpreter's exit
