"""Judge-labelled preference pairs for the No Robots reward model (paper section 5, appendix A.2).
Usage: below, `--help` and docs/reproducing.md.

    OPENAI_API_KEY=... python tasks/label_preferences.py --sft_model_path models/llama-3.1-8b-sft-no-robots \\
        --dataset_name HuggingFaceH4/no_robots --split train --output_path data/no_robots_preferences/train.jsonl \\
        --num_samples 3 --temperature 0.7 --top_p 1.0 --max_prompt_length 512 --response_length 1024 \\
        --base_url https://api.openai.com/v1 --model gpt-4o --seed 1

As appendix A.2: for every prompt, sample 3 completions from the SFT model at temperature 0.7 (vLLM,
offline), add the human answer from the dataset as a 4th, and let the LLM judge (GPT-4o in the paper;
the code of tasks/llm_judge.py, same prompt, same seeded A/B order randomisation) compare all
6 = C(4, 2) pairs. The prompt is the SFT model's chat template applied to the messages before the final
assistant turn (as the RLHF scripts' --task no_robots does), the human answer is that turn's content.

Outputs (all written atomically):
- `--output_path` (.jsonl): one row per labelled pair, {"prompt", "chosen", "rejected"} as
  tasks/train_reward.py reads them (prompt: chat-templated text; chosen / rejected: completion
  texts without EOS), plus prompt_id, chosen_source / rejected_source ("sft_0".."sft_2", "human"),
  the judge's verdict, the shown order and the judge's raw answer.
- in --details_dir (by default beside the output's folder, so that the folder stays a dataset of
  preference files): `<name>.samples.jsonl`, the 4 completions of each prompt (written before any
  judging, so that a failed judging run keeps them); `<name>.verdicts.jsonl`, every pair, labelled
  or not; `<name>.summary.json`, the counts below.

Pairs without a label are left out of the preference data, never guessed, and counted in the summary:
- an unparseable verdict (no "[[A]]" / "[[B]]", or both): not asked again (at the judge's default
  temperature 0 a second request gets the same answer), and its raw answer is kept in the verdicts
  file; the summary's `n_unparseable` says how many pairs this lost (--constrained_verdict, on a vLLM
  endpoint, leaves none);
- two identical completion texts (possible for short answers): not sent to the judge, as a pair
  with nothing to choose between teaches a Bradley-Terry reward model nothing (`n_identical`).
"""

import itertools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_judge import JudgeArgs, UsageError, check_judge_args, judge_pairs, make_client, write_atomic  # noqa: E402


@dataclass
class Args(JudgeArgs):
    # data
    dataset_name: str = "HuggingFaceH4/no_robots"
    """hub id, local dataset folder or a single .jsonl / .json / .parquet file with a `messages` column"""
    split: str = "train"
    """dataset split to label (a single file is that split)"""
    num_prompts: int | None = None
    """label only the first this many prompts (None: all)"""
    max_prompt_length: int = 512
    """prompts longer than this many tokens are skipped, as in training (table 7: max prompt token length 512)"""
    output_path: str = "no_robots_preferences/train.jsonl"
    """where the preference pairs go (.jsonl; name it after the split so that its folder loads as a dataset)"""
    details_dir: str | None = None
    """where the samples, verdicts and summary go (None: the output's folder name + "_details", beside it)"""
    # sampling (appendix A.2)
    sft_model_path: str = ""
    """the SFT policy (local folder or hub id) whose chat template writes the prompts and which samples"""
    num_samples: int = 3
    """completions sampled per prompt; with the human answer, C(num_samples + 1, 2) pairs are judged (A.2: 3)"""
    temperature: float = 0.7
    """sampling temperature (A.2: 0.7)"""
    top_p: float = 1.0
    """nucleus sampling threshold (1.0: off)"""
    response_length: int = 1024
    """most tokens per sampled completion (table 7's response length)"""
    seed: int = 1
    """seed of the sampling and of the judge's A/B order"""
    vllm_dtype: str = "auto"
    """dtype of the vLLM engine"""
    vllm_gpu_memory_utilization: float = 0.9
    """fraction of GPU memory vLLM may take"""
    vllm_tensor_parallel_size: int = 1
    """GPUs one vLLM engine spans"""
    vllm_enforce_eager: bool = False
    """skip CUDA graphs / compilation (faster start, slower generation)"""


def load_conversations(name: str, split: str, limit: int | None):
    """No Robots rows from a hub id, a local dataset folder or a single local file."""
    from datasets import load_dataset

    if os.path.isfile(name):
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
        if Path(name).suffix not in builders:
            raise UsageError(f"--dataset_name {name}: a single file must be one of {', '.join(builders)}")
        dataset = load_dataset(builders[Path(name).suffix], data_files={split: name}, split=split)
    else:
        try:
            dataset = load_dataset(name, split=split)
        except (FileNotFoundError, ValueError, ConnectionError) as exc:
            raise UsageError(f"--dataset_name {name} --split {split}: {str(exc).strip().splitlines()[0]}") from None
    if "messages" not in dataset.column_names:
        raise UsageError(f"--dataset_name {name}: no `messages` column (it has {dataset.column_names})")
    if limit is not None:
        dataset = dataset.select(range(min(limit, len(dataset))))
    return dataset


def prompts_and_references(dataset, tokenizer, max_prompt_length: int, where: str) -> list[dict]:
    """Per row: the chat-templated prompt (conversation before the final assistant turn, ending with the
    header of the assistant's turn), its token ids, and the human answer (final assistant turn)."""
    items, too_long = [], 0
    ids = dataset["prompt_id"] if "prompt_id" in dataset.column_names else [str(i) for i in range(len(dataset))]
    for i, messages in enumerate(dataset["messages"]):
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise UsageError(
                f"{where}: row {i}'s `messages` do not end with an assistant turn after the prompt (the human answer)"
            )
        prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
        # the chat template writes the BOS token itself (Llama 3.1's does): encoding must not add another
        token_ids = tokenizer(prompt, add_special_tokens=False).input_ids
        if len(token_ids) > max_prompt_length:
            too_long += 1
            continue
        items.append(
            {"prompt_id": ids[i], "prompt": prompt, "token_ids": token_ids, "reference": messages[-1]["content"]}
        )
    if too_long:
        print(f"skipped {too_long} of {len(dataset)} prompts longer than --max_prompt_length {max_prompt_length}")
    if not items:
        raise UsageError(f"{where}: no prompt fits --max_prompt_length {max_prompt_length}")
    return items


def load_sft_tokenizer(path: str, length: int):
    """The SFT model's tokenizer, checked before any weights load: it has a chat template, and prompt +
    response (`length` tokens) fit the model's positions."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--sft_model_path {path}: {str(exc).strip().splitlines()[0]}") from None
    if tokenizer.chat_template is None:
        raise UsageError(f"--sft_model_path {path}: its tokenizer has no chat template to write the prompts with")
    context = getattr(config, "max_position_embeddings", None)
    if context and length > context:
        raise UsageError(
            f"--max_prompt_length + --response_length = {length} exceed the {context}-token context of --sft_model_path {path}"
        )
    return tokenizer


def all_pairs(num_answers: int) -> list[tuple[int, int]]:
    """The C(n, 2) unordered pairs of n answers (A.2: 4 answers, 6 pairs)."""
    return list(itertools.combinations(range(num_answers), 2))


def preference_rows(samples: list[dict], verdicts: list[dict]) -> list[dict]:
    """Labelled pairs as chosen / rejected rows: `preferred` "left" means the pair's first answer won."""
    rows = []
    for v in verdicts:
        if v["preferred"] is None:
            continue
        sample = samples[v["prompt_index"]]
        winner, loser = (v["left"], v["right"]) if v["preferred"] == "left" else (v["right"], v["left"])
        rows.append(
            {
                "prompt": sample["prompt"],
                "chosen": sample["completions"][winner],
                "rejected": sample["completions"][loser],
                "prompt_id": sample["prompt_id"],
                "chosen_source": winner,
                "rejected_source": loser,
                "judge_verdict": v["verdict"],
                "swapped": v["swapped"],
                "judge_response": v["judge_response"],
            }
        )
    return rows


def default_details_dir(output_path: Path) -> Path:
    """Next to the output folder, not in it: `datasets` sorts every file of a folder whose name starts
    with a split name into that split, so the folder must hold the preference files only."""
    folder = output_path.resolve().parent
    return folder.with_name(folder.name + "_details")


if __name__ == "__main__":
    args = tyro.cli(Args, use_underscores=True)
    output_path = Path(args.output_path)
    try:  # every check of flags and inputs, before any model loads or request goes out
        check_judge_args(args)
        if output_path.suffix != ".jsonl":
            raise UsageError(f"--output_path {args.output_path} must end in .jsonl")
        if args.num_samples < 1 or args.response_length < 1 or args.max_prompt_length < 1:
            raise UsageError("--num_samples, --response_length and --max_prompt_length must be >= 1")
        if args.temperature <= 0:
            raise UsageError(f"--temperature must be > 0 (sampled completions), got {args.temperature}")
        if not args.sft_model_path:
            raise UsageError("--sft_model_path is required: the SFT policy that writes the prompts and samples")
        tokenizer = load_sft_tokenizer(args.sft_model_path, args.max_prompt_length + args.response_length)
        dataset = load_conversations(args.dataset_name, args.split, args.num_prompts)
        items = prompts_and_references(
            dataset, tokenizer, args.max_prompt_length, f"--dataset_name {args.dataset_name}"
        )
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    details_dir = Path(args.details_dir) if args.details_dir else default_details_dir(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    details_dir.mkdir(parents=True, exist_ok=True)

    # 1. sample num_samples completions per prompt from the SFT model (A.2: 3 at temperature 0.7)
    from vllm import LLM, SamplingParams

    start = time.time()
    llm = LLM(
        model=args.sft_model_path,
        dtype=args.vllm_dtype,
        seed=args.seed,
        max_model_len=args.max_prompt_length + args.response_length,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        tensor_parallel_size=args.vllm_tensor_parallel_size,
        enforce_eager=args.vllm_enforce_eager,
    )
    params = SamplingParams(
        n=args.num_samples, temperature=args.temperature, top_p=args.top_p, max_tokens=args.response_length
    )
    outputs = llm.generate([{"prompt_token_ids": item["token_ids"]} for item in items], params)
    names = [f"sft_{k}" for k in range(args.num_samples)] + ["human"]
    samples = []
    for i, (item, output) in enumerate(zip(items, outputs)):
        texts = [o.text for o in output.outputs] + [item["reference"]]
        reasons = [o.finish_reason for o in output.outputs] + [None]
        samples.append(
            {
                "prompt_index": i,
                "prompt_id": item["prompt_id"],
                "prompt": item["prompt"],
                "completions": dict(zip(names, texts)),
                "finish_reasons": dict(zip(names, reasons)),
            }
        )
    write_atomic(details_dir / f"{output_path.stem}.samples.jsonl", "".join(json.dumps(s) + "\n" for s in samples))
    sampling_seconds = time.time() - start
    del llm

    # 2. judge every pair of different answers, in a seeded random A/B order (llm_judge.py)
    start = time.time()
    pairs = []
    for sample in samples:
        for a, b in all_pairs(len(names)):
            texts = sample["completions"]
            pairs.append(
                {
                    "prompt_index": sample["prompt_index"],
                    "prompt_id": sample["prompt_id"],
                    "left": names[a],
                    "right": names[b],
                    "identical": texts[names[a]] == texts[names[b]],
                }
            )
    to_judge = [p for p in pairs if not p["identical"]]
    requests = [
        (
            samples[p["prompt_index"]]["prompt"],
            samples[p["prompt_index"]]["completions"][p["left"]],
            samples[p["prompt_index"]]["completions"][p["right"]],
        )
        for p in to_judge
    ]
    try:
        results = judge_pairs(make_client(args), args, requests, args.seed)
    except RuntimeError as exc:
        raise SystemExit(f"error: judging failed: {exc} (the samples are saved in {details_dir})")
    for pair, result in zip(to_judge, results):
        pair.update(result)
    for pair in pairs:
        if pair["identical"]:
            pair.update(swapped=None, verdict=None, preferred=None, judge_response=None, finish_reason=None, attempts=0)

    # 3. chosen / rejected rows and the counts
    rows = preference_rows(samples, pairs)
    judged = to_judge
    labelled = [p for p in judged if p["verdict"] is not None]
    human_pairs = [p for p in labelled if "human" in (p["left"], p["right"])]
    summary = {
        "dataset_name": args.dataset_name,
        "split": args.split,
        "sft_model_path": args.sft_model_path,
        "judge_model": args.model,
        "seed": args.seed,
        "n_prompts": len(samples),
        "n_pairs": len(pairs),
        "n_identical": len(pairs) - len(judged),
        "n_judged": len(judged),
        "n_unparseable": sum(p["verdict"] is None for p in judged),
        "n_written": len(rows),
        "unparseable_rate": sum(p["verdict"] is None for p in judged) / len(judged) if judged else None,
        # how often the human answer beat an SFT sample, and how often the judge picked the answer shown first
        "human_win_rate": sum(p[p["preferred"]] == "human" for p in human_pairs) / len(human_pairs)
        if human_pairs
        else None,
        "verdict_a_rate": sum(p["verdict"] == "A" for p in labelled) / len(labelled) if labelled else None,
        "sampling_seconds": round(sampling_seconds, 2),
        "judging_seconds": round(time.time() - start, 2),
    }
    write_atomic(details_dir / f"{output_path.stem}.verdicts.jsonl", "".join(json.dumps(p) + "\n" for p in pairs))
    write_atomic(output_path, "".join(json.dumps(r) + "\n" for r in rows))
    write_atomic(details_dir / f"{output_path.stem}.summary.json", json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
