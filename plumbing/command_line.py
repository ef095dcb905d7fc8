"""1b. The checks of every input file before any model loads: the data (its splits, columns and rows), the
model folders the flags name and their tokenizers."""

import json
import os
from pathlib import Path

from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from plumbing.flags import UsageError


# == The data, the model files and their tokenizers ==========================================================
def _check_local(path: str, flag: str) -> None:
    """A path that cannot be a hub id (org/name) must exist: "/nowhere" or "models/x/y" is a missing folder,
    and saying so beats the hub client's complaint about repository names."""
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        if not os.path.exists(os.path.expanduser(path)):
            raise UsageError(f"{flag} {path}: no such file or folder")


def load_split(
    dataset_name: str,
    dataset_config: str | None,
    split: str,
    columns: dict[str, type],
    task: str,
    evaluation: bool = False,
    eval_file: str | None = None,
    num_prompts: int | None = None,
) -> tuple:
    """The rows of a split of `dataset_name` (--dataset_name, --dataset_config): a hub id, a local dataset
    folder (its README declares its configs, as on the hub) or one file; with `evaluation`, the first
    `num_prompts` (--num_eval_prompts; None: all) of the evaluation split, from `eval_file`
    (--dataset_eval_file) if given. One file would serve every split: evaluation then needs a file of its own.
    Every row read is checked (_check_rows): `columns` maps the names --task `task` reads to str (text) or
    _CHAT. Returns the rows and where they are, as an error names them."""
    name, config, flag = dataset_name, dataset_config, "--dataset_name"
    if evaluation and eval_file is not None:
        name, config, flag = eval_file, None, "--dataset_eval_file"
        if not os.path.isfile(name):
            raise UsageError(f"--dataset_eval_file {name} is not a file: give one file of evaluation prompts")
        if os.path.exists(dataset_name) and os.path.samefile(name, dataset_name):
            raise UsageError(f"--dataset_eval_file {name} is --dataset_name: evaluate on other prompts")
    elif evaluation and os.path.isfile(name):
        raise UsageError(
            f"--dataset_name {name} is one file, which would serve the evaluation split too: the evaluation "
            "would run on the training prompts; give its prompts as another file, --dataset_eval_file"
        )
    dataset = _read_split(name, split, config, flag)
    where = f"{flag} {name}" + ("" if flag == "--dataset_eval_file" else f" split {split}")
    if missing := [column for column in columns if column not in dataset.column_names]:
        has = dataset.column_names
        raise UsageError(f"{where} lacks column(s) {missing} of --task {task}; it has {has}")
    if evaluation and num_prompts is not None:
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    _check_rows(dataset, columns, where)
    return dataset, where


def _read_split(name: str, split: str, config: str | None, flag: str):
    """A split of the dataset `name`, as load_split describes. A file that does not parse is a UsageError
    naming it, and the line of a JSON Lines file (_unparsable_line), not the builder's chained tracebacks."""
    _check_local(name, flag)
    builder = dict(path=name, name=config)
    if os.path.isfile(name):
        builders = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
        if Path(name).suffix not in builders:
            raise UsageError(f"{flag} {name}: a single file must be one of {', '.join(builders)}")
        if config is not None:
            raise UsageError(f"--dataset_config {config}: the single file {flag} {name} has no configs")
        builder = dict(path=builders[Path(name).suffix], data_files={split: name})
    try:
        return load_dataset(**builder, split=split)
    except DatasetGenerationError as exc:  # the builder could not read one of its files
        files = [Path(name)] if os.path.isfile(name) else sorted(Path(name).rglob("*.json*"))
        for file in files:
            if file.suffix in (".json", ".jsonl") and (bad := _unparsable_line(file)):
                raise UsageError(f"{flag} {name}: {file} does not parse at {bad}")
        cause = exc.__cause__ or exc.__context__ or exc
        raise UsageError(f"{flag} {name} split {split} does not parse: {str(cause).strip().splitlines()[0]}")
    except (FileNotFoundError, ValueError) as exc:  # no such dataset / config / split: say which flag
        lines = str(exc).strip().splitlines()
        # a missing config: the second line lists the configs
        detail = " ".join(lines[:2]) if lines[0].startswith("Config name is missing") else lines[0]
        where = f"{flag} {name}" + (f" --dataset_config {config}" if config else "")
        raise UsageError(f"{where} split {split}: {detail}") from exc


def _unparsable_line(path: Path) -> str | None:
    """Where a JSON Lines file stops parsing, "line N (row R): why" (R counts the rows before it); None when
    every line is a JSON value, or the file is one JSON document (it then says its line, without a row)."""
    text, row = path.read_text(errors="replace"), 0
    for number, line in enumerate(text.splitlines(), 1):
        try:
            if line.strip():
                json.loads(line)
                row += 1
        except json.JSONDecodeError as exc:
            first = f"line {number} (row {row}): {exc.msg}"
            break
    else:
        return None
    try:
        json.loads(text)
    except json.JSONDecodeError as whole:
        # a document over several lines fails as JSON Lines at its first line: its own error says where
        return f"line {whole.lineno}: {whole.msg}" if number == 1 and whole.lineno > 1 else first
    return None


# A conversation: [{"role": ..., "content": ...}, ...], as --task no_robots's `messages`.
_CHAT = list[dict[str, str]]
_CHAT_KEYS = ("role", "content")


def _check_rows(dataset, columns: dict[str, type], where: str) -> None:
    """Each value of `columns` (name -> str or _CHAT) of its type and not empty: a bad row is a UsageError
    naming it and its column. Unchecked, a value that is not text fails in the tokenizer with a traceback
    naming neither, and an empty prompt is trained on or divides an evaluation by zero."""
    for column, kind in columns.items():
        for row, value in enumerate(dataset[column]):
            if problem := _text_problem(value) if kind is str else _chat_problem(value):
                raise UsageError(f"{where}, row {row}, column {column}: {problem}")


def _text_problem(value) -> str | None:
    if value is None:
        return "missing (null)"
    if not isinstance(value, str):
        return f"{shown(value)} is not text"
    return None if value.strip() else f"{value!r} is empty"


def _chat_problem(value) -> str | None:
    if not isinstance(value, list) or not value:
        return f"{shown(value)} is not a list of messages"
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and all(isinstance(message.get(k), str) for k in _CHAT_KEYS)):
            return f"message {i}, {shown(message)}, is not {{'role': text, 'content': text}}"
        if not message["content"].strip():
            return f"message {i}'s content {message['content']!r} is empty"
    return None


def shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _check_model(
    path: str, flag: str, lengths: tuple[int, int], trust_remote_code: bool, reward: bool = False
):
    """The model exists, has safetensors weights (pickled ones are never loaded), prompt + response
    (`lengths`) fit its positions, and a reward model is a sequence classifier (its config says so; a causal
    LM is not)."""
    _check_local(path, flag)
    if os.path.isdir(path) and not list(Path(path).glob("*.safetensors")):
        raise UsageError(f"{flag} {path} has no .safetensors weights (pickled .bin weights are not loaded)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {str(exc).strip().splitlines()[0]}") from exc
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context and sum(lengths) > context:
        raise UsageError(
            f"--max_prompt_length {lengths[0]} + --response_length {lengths[1]} exceed the {context}-token "
            f"context of {flag} {path}"
        )
    if (
        reward
        and config.architectures
        and not any("ForSequenceClassification" in a for a in config.architectures)
    ):
        raise UsageError(_not_a_reward_model(path, flag))


def _not_a_reward_model(path: str, flag: str) -> str:
    return (
        f"{flag} {path} is not a reward model: it has no score head, which loading would initialise at random"
    )


def _load_tokenizer(path: str, flag: str, trust_remote_code: bool):
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {flag} {path} has no EOS token: completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from lengths, not from pad ids
    return tokenizer


def load_tokenizers(
    sft_model_path: str,
    reward_model_path: str | None,
    gold_judge: str | None,
    lengths: tuple[int, int],
    trust_remote_code: bool,
) -> tuple:
    """The policy's tokenizer and the reward model's (None without one), once every model of the run is
    checked (_check_model): the policy `sft_model_path` (--sft_model_path), the reward model
    `reward_model_path` (--reward_model_path; None: the task has none) and the judge `gold_judge`
    (--gold_judge; None: no model), each with room for `lengths`, the prompt's and the response's
    most tokens."""
    _check_model(sft_model_path, "--sft_model_path", lengths, trust_remote_code)
    if reward_model_path is not None:
        _check_model(reward_model_path, "--reward_model_path", lengths, trust_remote_code, reward=True)
    if gold_judge is not None:
        _check_model(gold_judge, "--gold_judge", lengths, trust_remote_code, reward=True)
    tokenizer = _load_tokenizer(sft_model_path, "--sft_model_path", trust_remote_code)
    if reward_model_path is None:
        return tokenizer, None
    return tokenizer, _load_tokenizer(reward_model_path, "--reward_model_path", trust_remote_code)


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers give the same ids to the same text (a reward model may read the policy's)."""
    return (
        a.get_vocab() == b.get_vocab()
        and a.bos_token_id == b.bos_token_id
        and a.eos_token_id == b.eos_token_id
    )


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a text; one that starts with the BOS token (a chat-templated prompt) gets no second."""
    has_bos = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
    return tokenizer(text, add_special_tokens=not has_bos).input_ids


def load_reward_model(path: str, flag: str, **kwargs):
    """A one-label AutoModelForSequenceClassification, refused if its score head was not among the weights."""
    model, info = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, output_loading_info=True, **kwargs
    )
    if any(key == "score.weight" or key.startswith("classifier.") for key in info["missing_keys"]):
        raise UsageError(_not_a_reward_model(path, flag))
    return model
