"""Bradley-Terry reward model training on preference pairs, in one file (accelerate).

Makes the reward model the RLHF scripts optimise: the tiny task's (`tiny/build.py` calls
`train` here) and No Robots' (paper appendix A.2, table 6; pairs from tasks/label_preferences.py).
Flags: `--help`.

Data: a hub dataset id, a local dataset folder or a .jsonl/.json/.parquet/.csv file with `prompt`
(text, which is taken as is when it already begins with BOS as chat-templated text does, or a list of
chat messages), `chosen` and `rejected` (texts) columns. Each completion gets
EOS unless it already ends with it: the RLHF scripts score a completion that stopped at its EOS.
The model is `AutoModelForSequenceClassification` with one label, read out at the last real token
of prompt + completion (the read-out of the RLHF scripts' `get_reward`), and the loss is
-log sigmoid(r_chosen - r_rejected). Pair accuracy on --eval_split is printed and saved.

Defaults are the tiny task's RM. Table 6 (No Robots, from the SFT model), on 8 GPUs:

    accelerate launch --num_processes 8 --mixed_precision bf16 tasks/train_reward.py \\
        --model_name_or_path models/llama-3.1-8b-sft-no-robots --dataset_name data/no_robots_preferences \\
        --eval_split test --output_dir models/llama-3.1-8b-rm-no-robots \\
        --max_prompt_length 512 --max_completion_length 512 --trim_padding --gradient_checkpointing \\
        --local_micro_batch_size 4 --gradient_accumulation_steps 8 \\
        --learning_rate 3e-6 --lr_scheduler_type linear --warmup_steps 0 --weight_decay 0.0 \\
        --num_train_epochs 1 --seed 1

(label_preferences.py's prompts are already chat-templated text, so no --apply_chat_template;
effective batch 256 pairs = 4 x 8 accumulation x 8 GPUs; table 6's max sequence length 1,024 =
512 prompt + 512 completion tokens; add a DeepSpeed ZeRO-3 or FSDP accelerate config for the 8B
model's optimizer state.)
"""

import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
import tyro
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_sft import (  # noqa: E402  (the SFT script's data layout, loop and saving: one copy of each)
    Encoded,
    UsageError,
    check_model_path,
    check_output_dir,
    check_prompt,
    check_text,
    encode_completions,
    encode_prompts,
    fitting_prompts,
    load_split,
    load_tokenizer,
    optimize,
    pad_rows,
    position_ids_from,
    require_columns,
    save_model,
    schedule_sizes,
    trim_columns,
)


@dataclass
class Args:
    # data and model
    model_name_or_path: str
    """initial model, usually the SFT policy (local folder or hub id); the one-label score head starts random"""
    dataset_name: str
    """preference pairs: a hub dataset id, a local dataset folder or a .jsonl/.json/.parquet/.csv file"""
    output_dir: str
    """the trained reward model folder (safetensors + tokenizer + eval_results.json); written atomically"""
    dataset_train_split: str = "train"
    """split trained on"""
    eval_split: str | None = "test"
    """pairs whose accuracy is reported: a split of --dataset_name, or a separate data file (None: none)"""
    chat_template: str | None = None
    """Jinja chat template, stored with the model: `tulu`, a file, or the template text (None: the tokenizer's own)"""
    apply_chat_template: bool = False
    """render text prompts as one user turn with the chat template, as the RLHF scripts do for chat tasks
    (message-list prompts always are)"""
    max_prompt_length: int = 12
    """pairs whose prompt is longer than this many tokens are dropped (the count is printed)"""
    max_completion_length: int = 12
    """completions (EOS included) are cut to this many tokens"""
    append_eos: bool = True
    """end every completion with EOS unless it already does"""
    trust_remote_code: bool = False
    """allow model repositories to run their own code"""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype the weights load in (mixed precision itself comes from the accelerate config)"""

    # batch sizes, in pairs (effective batch = local_micro_batch_size x gradient_accumulation_steps x processes)
    local_micro_batch_size: int = 64
    """pairs per forward/backward pass on one process (chosen and rejected go through together)"""
    gradient_accumulation_steps: int = 1
    """micro-batches accumulated into one optimizer step"""
    local_eval_batch_size: int = 64
    """pairs per no-grad forward when measuring pair accuracy"""
    trim_padding: bool = False
    """drop the columns that are padding in every row of a micro-batch (much faster on ragged real data)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass (long sequences on big models)"""

    # optimisation
    learning_rate: float = 1e-3
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
    num_train_epochs: int = 6
    """passes over the pairs (a fresh shuffle each; the last incomplete batch of an epoch is skipped)"""
    total_steps: int | None = None
    """optimizer steps (None: num_train_epochs x pairs // batch size)"""
    seed: int = 4
    """seed of the pair order and of the score head's initialisation"""
    log_every: int = 200
    """print the loss and batch accuracy every this many steps (and at the last)"""


class Pairs(NamedTuple):
    """Both sides of each pair in train_sft's layout (same prompt, left-padded; completion right-padded)."""

    chosen: Encoded
    rejected: Encoded


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------
def load_preference_rows(name: str, split: str, flag: str = "--dataset_name") -> tuple[list, list[str], list[str]]:
    dataset = load_split(name, split, flag)
    where = f"{flag} {name}" + ("" if os.path.isfile(name) else f" split {split}")
    require_columns(dataset, {"prompt", "chosen", "rejected"}, where)
    prompts, chosen, rejected = list(dataset["prompt"]), list(dataset["chosen"]), list(dataset["rejected"])
    for i, prompt in enumerate(prompts):
        check_prompt(prompt, i, where)
    check_text(chosen, "chosen", where)
    check_text(rejected, "rejected", where)
    return prompts, chosen, rejected


def load_eval_rows(args) -> tuple[list, list[str], list[str]] | None:
    """--eval_split: a data file of its own, or a split of --dataset_name (which a single file lacks)."""
    if args.eval_split is None:
        return None
    if os.path.isfile(args.eval_split):
        return load_preference_rows(args.eval_split, "train", "--eval_split")
    if os.path.isfile(args.dataset_name):
        raise UsageError(
            f"--dataset_name {args.dataset_name} is a single file, so it has no split {args.eval_split!r}: "
            "pass --eval_split a file of its own, or None"
        )
    return load_preference_rows(args.dataset_name, args.eval_split)


def encode_pairs(
    tokenizer, prompts: list, chosen: list[str], rejected: list[str], args, what: str = "preference data"
) -> Pairs:
    prompt_ids = encode_prompts(tokenizer, prompts, args.apply_chat_template)
    keep = fitting_prompts(prompt_ids, args.max_prompt_length, what)
    prompt_ids = [prompt_ids[i] for i in keep]
    sides, cut = [], 0
    for texts in (chosen, rejected):
        completion_ids = encode_completions(tokenizer, [texts[i] for i in keep], args.append_eos)
        cut += sum(len(ids) > args.max_completion_length for ids in completion_ids)
        sides.append(
            pad_rows(
                prompt_ids, completion_ids, args.max_prompt_length, args.max_completion_length, tokenizer.pad_token_id
            )
        )
    if cut:
        print(
            f"{what}: {cut} of {2 * len(keep)} completions cut to --max_completion_length {args.max_completion_length}"
        )
    return Pairs(*sides)


# ---------------------------------------------------------------------------------------------
# Reward and loss
# ---------------------------------------------------------------------------------------------
def get_reward(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score = the head applied to the backbone's hidden state at the last real (non-pad) token;
    computed from the backbone so that padding on either side, and pad == EOS tokenizers, cannot
    move the read-out."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids_from(attention_mask)
    ).last_hidden_state
    last = (attention_mask * torch.arange(attention_mask.shape[1], device=attention_mask.device)).argmax(1)
    return model.score(hidden[torch.arange(len(last), device=hidden.device), last]).squeeze(-1).float()


class LastTokenReward(torch.nn.Module):
    """`get_reward` as a module's forward, so that training calls it through accelerate's wrapper
    (DDP / DeepSpeed synchronise gradients only for calls that go through it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return get_reward(self.model, input_ids, attention_mask)


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """-log P(chosen > rejected) under Bradley-Terry, P = sigmoid(r_chosen - r_rejected)."""
    return -F.logsigmoid(r_chosen - r_rejected).mean()


def pair_batch(pairs: Pairs, rows, trim: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen rows, then rejected rows: both sides in one forward pass."""
    ids = torch.cat([pairs.chosen.input_ids[rows], pairs.rejected.input_ids[rows]])
    mask = torch.cat([pairs.chosen.attention_mask[rows], pairs.rejected.attention_mask[rows]])
    if trim:
        ids, mask = trim_columns(ids, mask, attention_mask=mask)
    return ids.to(device), mask.to(device)


@torch.no_grad()
def pair_rewards(
    reward_fn, pairs: Pairs, batch_size: int, trim: bool = False, device="cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(r_chosen, r_rejected) of every pair; `reward_fn(input_ids, attention_mask)` scores rows."""
    chosen, rejected = [], []
    for start in range(0, len(pairs.chosen.input_ids), batch_size):
        rows = torch.arange(start, min(start + batch_size, len(pairs.chosen.input_ids)))
        r_chosen, r_rejected = reward_fn(*pair_batch(pairs, rows, trim, device)).chunk(2)
        chosen.append(r_chosen.cpu())
        rejected.append(r_rejected.cpu())
    return torch.cat(chosen), torch.cat(rejected)


def pair_accuracy(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> float:
    """Fraction of pairs scored chosen > rejected (a tie counts as wrong)."""
    return (r_chosen > r_rejected).float().mean().item() if len(r_chosen) else float("nan")


def train(model, data: Pairs, args: Args, accelerator: Accelerator):
    """Bradley-Terry training of the one-label `model`; returns the prepared `LastTokenReward` around
    it (`accelerator.unwrap_model(...).model` is the trained model) and the per-step losses."""

    def loss_fn(reward_model, rows):
        r_chosen, r_rejected = reward_model(*pair_batch(data, rows, args.trim_padding, accelerator.device)).chunk(2)
        return bradley_terry_loss(r_chosen, r_rejected), {"acc": pair_accuracy(r_chosen, r_rejected)}

    return optimize(LastTokenReward(model), loss_fn, len(data.chosen.input_ids), "epochs", args, accelerator, "rm")


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    start = time.time()
    try:  # every check of the flags and input files, before the model loads
        check_output_dir(args.output_dir)
        rows = load_preference_rows(args.dataset_name, args.dataset_train_split)
        eval_rows = load_eval_rows(args)
        if args.local_eval_batch_size < 1:
            raise UsageError(f"--local_eval_batch_size must be >= 1, got {args.local_eval_batch_size}")
        check_model_path(args.model_name_or_path, args)
        tokenizer = load_tokenizer(args.model_name_or_path, args)
        data = encode_pairs(tokenizer, *rows, args)
        eval_data = encode_pairs(tokenizer, *eval_rows, args, "eval data") if eval_rows else None
        batch_size, num_steps, warmup = schedule_sizes(len(data.chosen.input_ids), args, accelerator.num_processes)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    accelerator.print(f"{len(data.chosen.input_ids)} pairs, batch {batch_size}, {num_steps} steps ({warmup} warmup)")
    from transformers import AutoModelForSequenceClassification, set_seed

    set_seed(args.seed)
    model = AutoModelForSequenceClassification.from_pretrained(
        args.model_name_or_path,
        num_labels=1,
        dtype=getattr(torch, args.dtype),
        trust_remote_code=args.trust_remote_code,
    )
    model.config.pad_token_id = tokenizer.pad_token_id  # HF's own batched forward needs it; our read-out does not
    if not hasattr(model, "score"):
        raise SystemExit(
            f"error: --model_name_or_path {args.model_name_or_path}: {type(model).__name__} has no `score` head"
        )
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    reward_model, losses = train(model, data, args, accelerator)
    results = {
        "train_loss_first": losses[0],
        "train_loss_last": losses[-1],
        "num_train_pairs": len(data.chosen.input_ids),
    }
    if eval_data is not None:  # every process scores all pairs (ZeRO-3 needs them all in every forward)
        scores = pair_rewards(
            reward_model, eval_data, args.local_eval_batch_size, args.trim_padding, accelerator.device
        )
        results |= {"eval_pair_accuracy": pair_accuracy(*scores), "num_eval_pairs": len(scores[0])}
        if accelerator.is_main_process:
            print(f"eval pair accuracy {results['eval_pair_accuracy']:.4f} on {results['num_eval_pairs']} pairs")
    json_files = {"training_args.json": asdict(args), "eval_results.json": results}
    save_model(accelerator, reward_model, tokenizer, args.output_dir, json_files, submodule="model")
    if accelerator.is_main_process:
        print(f"saved {args.output_dir} after {time.time() - start:.0f} s")
    accelerator.end_training()  # leaves the process group: gloo's threads would abort the interpreter's exit
