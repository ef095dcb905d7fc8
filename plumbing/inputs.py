"""1b. The checks of every input file before any model loads: the data (its splits, columns and rows), the
model folders the flags name and their tokenizers."""

import json
import os
from pathlib import Path

from datasets import load_dataset, load_dataset_builder
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


def _not_reachable(flag: str, name: str, what: str) -> str:
    """The line for a hub id that is neither local nor in the local cache, while the hub cannot be reached."""
    import huggingface_hub

    hub = "is offline (HF_HUB_OFFLINE=1)" if huggingface_hub.constants.HF_HUB_OFFLINE else "cannot be reached"
    return (
        f"{flag} {name} is not a local {what} and not in the local cache, and the hub {hub}: download it "
        f"once where the hub is reachable, or give a local {what}"
    )


def json_kind(value) -> str:
    """The JSON name of a parsed value's type, as an error says what it found."""
    kinds = {dict: "object", list: "array", str: "string", bool: "true/false", type(None): "null"}
    return kinds.get(type(value), "number")


def json_error(error: ValueError) -> str:
    """Where a JSON text stops parsing ("line N: why"), or why its bytes are not text."""
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}: {error.msg}"
    return str(error)


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
    dataset, files = _read_split(name, split, config, flag)
    where = f"{flag} {name}" + ("" if flag == "--dataset_eval_file" else f" split {split}")
    if missing := [column for column in columns if column not in dataset.column_names]:
        has = dataset.column_names
        raise UsageError(f"{where} lacks column(s) {missing} of --task {task}; it has {has}")
    rows = len(dataset)
    if evaluation and num_prompts is not None:
        dataset = dataset.select(range(min(num_prompts, len(dataset))))
    _check_rows(dataset, columns, where)
    if os.environ.get("RANK", "0") == "0":  # once for the run, by rank 0
        print(_prompts_line(split, name, files, rows, len(dataset)))
    return dataset, where


# A single data file's builder in `datasets`, by its suffix
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


def _read_split(name: str, split: str, config: str | None, flag: str) -> tuple:
    """A split of the dataset `name`, as load_split describes, and its local files (_split_files). Each is
    checked first (_data_file_problem: empty, not UTF-8, a Parquet file cut short); a file that does not
    parse, or holds a JSON value that is not a row, is a UsageError naming it and its line (the row for JSON
    Lines: _json_file_problem), not the builder's chained tracebacks; so is a hub id not there offline."""
    _check_local(name, flag)
    builder = dict(path=name, name=config)
    if os.path.isfile(name):
        if Path(name).suffix not in _BUILDERS:
            raise UsageError(f"{flag} {name}: a single file must be one of {', '.join(_BUILDERS)}")
        if config is not None:
            raise UsageError(f"--dataset_config {config}: the single file {flag} {name} has no configs")
        builder = dict(path=_BUILDERS[Path(name).suffix], data_files={split: name})
    files = _split_files(builder, split)
    for file in files:
        if problem := _data_file_problem(file):
            raise UsageError(f"{flag} {name}: {file} {problem}")
    try:
        return load_dataset(**builder, split=split), files
    except DatasetGenerationError as exc:  # the builder could not read one of its files
        for file in files or ([Path(name)] if os.path.isfile(name) else sorted(Path(name).rglob("*.json*"))):
            if file.suffix in (".json", ".jsonl") and (bad := _json_file_problem(file)):
                raise UsageError(f"{flag} {name}: {file} does not parse at {bad}")
        cause = exc.__cause__ or exc.__context__ or exc
        raise UsageError(f"{flag} {name} split {split} does not parse: {str(cause).strip().splitlines()[0]}")
    except ConnectionError as exc:  # a hub id, not in the local cache
        raise UsageError(_not_reachable(flag, name, "file or folder")) from exc
    except (FileNotFoundError, ValueError) as exc:  # no such dataset / config / split: say which flag
        lines = str(exc).strip().splitlines()
        # a missing config: the second line lists the configs
        detail = " ".join(lines[:2]) if lines[0].startswith("Config name is missing") else lines[0]
        where = f"{flag} {name}" + (f" --dataset_config {config}" if config else "")
        raise UsageError(f"{where} split {split}: {detail}") from exc


def _split_files(builder: dict, split: str) -> list[Path]:
    """The files on this machine that `datasets` reads for a split (a folder's are found by its rules: its
    README's configs, or the split's name in a file's, or every data file for train), in its order; none
    when they cannot be told here (a hub id, an unknown split: loading then says why)."""
    try:
        data_files = load_dataset_builder(**builder).config.data_files or {}
    except Exception:  # loading the split raises it again, and says which flag
        return []
    return [Path(file) for file in data_files.get(split, []) if os.path.isfile(file)]


def _data_file_problem(file: Path) -> str | None:
    """What makes a data file unreadable before `datasets` reads it: no rows at all, bytes that are not
    UTF-8 text (the builder fails on them, or the rows' checks do, with a traceback naming neither file nor
    line), or a Parquet file whose footer, written last, is missing (a copy cut short)."""
    if file.suffix == ".parquet":
        import pyarrow.parquet

        try:
            pyarrow.parquet.ParquetFile(file)
        except Exception as exc:  # pyarrow's ArrowInvalid and its OSErrors
            return f"is not a whole Parquet file ({str(exc).strip().splitlines()[0]}): copy it again"
        return None
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        return f"is not UTF-8 text: line {line} holds the byte {data[exc.start]:#04x}; save it as UTF-8"
    return None if text.strip() else "is empty: it holds no rows"


def _json_file_problem(path: Path) -> str | None:
    """Where a JSON file stops holding rows: a JSON Lines file at the first line that does not parse, or that
    is not an object (a row), "line N (row R): why" (R counts the rows before it); one JSON document that does
    not parse at its line, or an array at its first item that is not an object. None: it holds rows."""
    text, row = path.read_text(errors="replace"), 0
    try:
        document = json.loads(text)
    except json.JSONDecodeError as whole:
        whole_error = whole
    else:
        if not isinstance(document, list):
            return None  # an object of columns, which `datasets` reads as such
        wrong = next((i for i, item in enumerate(document) if not isinstance(item, dict)), None)
        if wrong is None:
            return None
        return f"item {wrong}: a JSON {json_kind(document[wrong])}, not an object (a row)"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            # a document over several lines fails as JSON Lines at its first line: its own error says where
            if number == 1 and whole_error.lineno > 1:
                return f"line {whole_error.lineno}: {whole_error.msg}"
            return f"line {number} (row {row}): {exc.msg}"
        if not isinstance(value, dict):
            return f"line {number} (row {row}): a JSON {json_kind(value)}, not an object (a row)"
        row += 1
    return None


def _prompts_line(split: str, name: str, files: list[Path], rows: int, used: int) -> str:
    """How many prompts a split has and from which files, said once at start: with several files, each
    file's count (_rows_in), as a folder's every data file may be a split's without its name saying so."""
    counted = f"{used} prompts" if used == rows else f"the first {used} of {rows} prompts"
    if not files:
        return f"{split}: {counted} from {name}"
    if len(files) == 1:
        return f"{split}: {counted} from {_shown_path(files[0], name)}"
    counts = [(file, _rows_in(file)) for file in files]
    each = ", ".join(f"{_shown_path(file, name, 'in')} {'?' if n is None else n}" for file, n in counts)
    return f"{split}: {counted} from {len(files)} files of {name}: {each}"


def _shown_path(file: Path, name: str, within: str = "beside") -> str:
    """A file of the dataset `name` as the user would write it: under `name` (`within`: its path in it)."""
    folder = Path(name).resolve()
    if not file.is_relative_to(folder):
        return str(file)
    inside = file.relative_to(folder)
    return str(inside) if within == "in" else str(Path(name) / inside)


def _rows_in(file: Path) -> int | None:
    """The rows of one data file, as `datasets` reads it alone (None: a kind the single-file builders do not
    read)."""
    if file.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.ParquetFile(file).metadata.num_rows
    if file.suffix == ".jsonl":
        return sum(1 for line in file.read_text().splitlines() if line.strip())
    if file.suffix not in _BUILDERS:
        return None
    return len(load_dataset(_BUILDERS[file.suffix], data_files=str(file), split="train"))


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
    """The model exists, has safetensors weights (pickled ones are never loaded), its files are whole
    (_model_file_problem), prompt + response (`lengths`) fit its positions, and a reward model is a sequence
    classifier (its config says so; a causal LM is not). A hub id must be in the local cache while the hub
    is offline."""
    import huggingface_hub

    _check_local(path, flag)
    if os.path.isdir(path):
        if not list(Path(path).glob("*.safetensors")):
            raise UsageError(
                f"{flag} {path} has no .safetensors weights (pickled .bin weights are not loaded)"
            )
        for file in sorted(Path(path).iterdir()):
            if problem := _model_file_problem(file, Path(path)):
                raise UsageError(f"{flag} {path}: {file.name} {problem}: the copy is damaged; copy it again")
    elif huggingface_hub.constants.HF_HUB_OFFLINE and not _in_hub_cache(path):
        raise UsageError(_not_reachable(flag, path, "folder"))
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


def _in_hub_cache(repo: str) -> bool:
    """Whether a hub id's config is in the local cache."""
    import huggingface_hub

    try:
        return isinstance(huggingface_hub.try_to_load_from_cache(repo, "config.json"), str)
    except ValueError:  # not a repository's name (huggingface_hub's HFValidationError)
        return False


def _model_file_problem(file: Path, folder: Path) -> str | None:
    """What is wrong with a file of a model's folder, read before any model loads, which would fail in
    transformers or vLLM with a traceback naming no file: a JSON file (the config, the tokenizer's files, an
    index) that does not parse, cut short; a safetensors file shorter or longer than its header says; a shard
    an index names, missing."""
    if file.suffix == ".json":
        try:
            index = json.loads(file.read_text())
        except ValueError as exc:
            return f"does not parse ({json_error(exc)})"
        shards = set(index.get("weight_map", {}).values()) if isinstance(index, dict) else set()
        if missing := sorted(shard for shard in shards if not (folder / shard).is_file()):
            return f"names weights that are not there ({', '.join(missing)})"
    if file.suffix == ".safetensors":
        # the format: 8 bytes of header length, the JSON header, then the tensors' bytes at its data_offsets
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little") if size >= 8 else 0
            try:
                header = json.loads(handle.read(length)) if 8 < 8 + length <= size else None
            except ValueError:
                header = None
        if not isinstance(header, dict):
            return f"has no whole safetensors header ({size} bytes)"
        tensors = [entry for key, entry in header.items() if key != "__metadata__"]
        try:
            end = 8 + length + max((int(entry["data_offsets"][1]) for entry in tensors), default=0)
        except (TypeError, KeyError, IndexError, ValueError):
            return "has a header that is not a safetensors header"
        if size != end:
            return f"has {size} bytes, and its header says {end}"
    return None


def _not_a_reward_model(path: str, flag: str) -> str:
    return (
        f"{flag} {path} is not a reward model: it has no score head, which loading would initialise at random"
    )


def _load_tokenizer(path: str, flag: str, trust_remote_code: bool):
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            path, padding_side="left", trust_remote_code=trust_remote_code
        )
    except Exception as exc:  # the tokenizers library raises a bare Exception on a file it cannot read
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UsageError(f"the tokenizer of {flag} {path} does not load: {cause}") from exc
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
