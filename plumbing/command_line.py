"""1. The command line and the checks of every flag and input file, before any model loads.

`run` is an algorithm file's entry point: it parses the flags (`_parse_args`: tyro, --help in the sections of
the file's Args), quiets the third-party messages known to be harmless, and reports a bad input (`UsageError`)
in one line, a failure after its traceback in one last line."""

import ast
import dataclasses
import gc
import inspect
import io
import json
import logging
import os
import sys
import textwrap
import tokenize
import traceback
import warnings
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import tyro
from datasets import load_dataset, load_dataset_builder
from datasets.exceptions import DatasetGenerationError
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer


class UsageError(ValueError):
    """Bad flags or input files: reported in one line, before any model loads."""


def run(main, args_class: type, doc: str) -> None:
    """main(args) with the flags of `args_class` (_parse_args; --exp_name left out: main's file's name). A
    bad input (UsageError) ends the process with one line, `error: ...`, exit status 1; a failure during the
    run (a NaN score, a dead engine, any exception) with its traceback, which helps, and then one line saying
    what failed, last."""
    try:
        args = _parse_args(args_class, doc)
        args.exp_name = args.exp_name or Path(inspect.getfile(main)).stem
        quiet_known_noise()
        main(args)
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")
    except Exception as exc:
        traceback.print_exc()
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(1)
    finally:
        gc.freeze()  # the exit would garbage-collect the whole heap (seconds); the OS frees it anyway
    _leave_process_group()


def _leave_process_group() -> None:
    """Every process leaves the process group at the end of a run: torch's gloo threads, left running into the
    interpreter's exit after a collective, abort it ("terminate called without an active exception", status
    -6). Only at a clean end: after a failure another process may still wait in a collective."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def quiet_known_noise() -> None:
    """Silence, where they are raised, the third-party messages every run printed that are known to be
    harmless, so that stderr shows what matters; ASYNC_RLHF_VERBOSE=1 shows them all. The engine's processes
    get the same filters from their environment (plumbing.engine.make_engine)."""
    if os.environ.get("ASYNC_RLHF_VERBOSE"):
        return
    import datasets
    import transformers

    # vLLM's Triton dispatcher reads `torch.distributed.reduce_op` when it loads, which torch deprecates:
    # vLLM's code, on its import; nothing of ours uses it
    warnings.filterwarnings("ignore", message=_REDUCE_OP_WARNING, category=FutureWarning)
    # torch looks for Triton kernels when vLLM loads; the CPU build has no Triton, and vLLM's CPU backend
    # needs none
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    # DeepSpeed says it found no GPU and uses its CPU accelerator, on every CPU run that imports it (a filter:
    # DeepSpeed sets its logger's level when it loads, after us)
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: not record.getMessage().startswith("Setting accelerator")
    )
    # datasets' JSON builder logs a file that does not parse before it raises, which _read_split reports in
    # its one line with the file and the line
    logging.getLogger("datasets.packaged_modules.json.json").setLevel(logging.CRITICAL)
    # progress bars of every model loaded or saved and of the datasets' caches: seconds each, in every run
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


_REDUCE_OP_WARNING = "`torch.distributed.reduce_op` is deprecated"


# == The flags and their --help ==============================================================================
def _flag_sections(cls: type) -> list[tuple[str, list[tuple[str, str]]]]:
    """The sections of the dataclass `cls`'s body, and of its dataclass bases' before them, as [(title,
    [(field, help)])]: a section starts at the first field or after a blank line, with a comment line naming
    it; a field's help is its trailing comment, or the comment lines right above it."""
    sections = []
    for klass in [
        k for k in reversed(cls.__mro__) if dataclasses.is_dataclass(k) and "__annotations__" in vars(k)
    ]:
        source = textwrap.dedent(inspect.getsource(klass))
        lines = source.splitlines()
        comments = {
            token.start[0]: token.string.lstrip("#").strip()
            for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type == tokenize.COMMENT
        }
        first = len(sections)
        for node in ast.parse(source).body[0].body:
            if isinstance(node, ast.AnnAssign):
                trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
                above, line = [], node.lineno - 1
                while line in comments and lines[line - 1].lstrip().startswith("#"):
                    above, line = [comments[line], *above], line - 1
                if len(sections) == first or not lines[line - 1].strip():
                    sections.append((above.pop(0), []))
                sections[-1][1].append((node.target.id, " ".join(above + trailing)))
    return sections


def _parse_args(cls: type, doc: str, args: list[str] | None = None):
    """tyro's command line of the dataclass `cls`, its --help in the class's sections (_flag_sections) and
    headed by the first paragraph of `doc`. Returns a `cls`."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    groups = []
    for title, flags in _flag_sections(cls):
        members = [
            (
                name,
                Annotated[fields[name].type, tyro.conf.arg(help=text)],
                dataclasses.field(default=fields[name].default),
            )
            for name, text in flags
        ]
        groups.append(dataclasses.make_dataclass(title, members))
    sections = [
        (
            f"group{i}",
            Annotated[group, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=group.__name__)],
            dataclasses.field(default_factory=group),
        )
        for i, group in enumerate(groups)
    ]
    description = doc.strip().split("\n\n")[0] + "\n\n" + _NONE_FLAGS
    parsed = tyro.cli(
        dataclasses.make_dataclass(cls.__name__, sections),
        args=args,
        description=description,
        use_underscores=True,
    )
    return cls(
        **{
            name: value
            for i in range(len(groups))
            for name, value in vars(getattr(parsed, f"group{i}")).items()
        }
    )


_NONE_FLAGS = "A flag shown {None}|INT (STR, FLOAT) is optional: left out, it is None, as its text explains."


@dataclasses.dataclass
class RunArgs:
    """The plumbing's flags, which each algorithm file's Args extends with the method's: the run, the engine,
    the checkpoints (docs/flags.md)."""

    # run
    # runs are named <exp_name>__<seed>__<unix time> (None: the algorithm file's name)
    exp_name: str | None = None
    seed: int = 1  # seed of the prompt order, the sampling, the initialisation: same seed and flags, same run
    # the run's folder: metrics, TensorBoard logs, checkpoints, final policy (None: runs/<run name>)
    output_dir: str | None = None
    track: bool = False  # also log to Weights & Biases (WANDB_MODE=offline on machines without network)
    wandb_project: str = "async-rlhf"  # Weights & Biases project, with --track
    wandb_entity: str | None = None  # Weights & Biases team or user, with --track (None: wandb's default)
    # in minutes: how long a training process waits for the others in a collective before failing (ranks 1..N
    # wait while rank 0 starts the engine, which compiles on a GPU, and generates the first batch)
    collective_timeout_minutes: float = 60.0
    trust_remote_code: bool = False  # allow model repositories to run their own code

    # the engine
    vllm_dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # the engine's weights (auto: --dtype's)
    # GPU of the engine: separate = the one after the N training GPUs (the paper's split), shared = rank 0's,
    # within --vllm_gpu_memory_utilization; auto = separate when N + 1 GPUs are visible (docs/gpus.md)
    vllm_placement: Literal["auto", "separate", "shared"] = "auto"
    # the engine's share of its GPU's memory (None: the largest the run leaves, at most 0.9 of a GPU of its
    # own and 0.3 of a shared one; printed at start)
    vllm_gpu_memory_utilization: float | None = None
    vllm_enforce_eager: bool = False  # run the engine without CUDA graphs (always so on CPUs)
    # engines, each generating its contiguous part of every batch, each loaded with every policy version
    # (docs/gpus.md#several-engines---vllm_num_engines)
    vllm_num_engines: int = 1
    # GPUs of each engine, vLLM's tensor parallelism: with N training processes and N + engines x this GPUs
    # visible, each engine gets GPUs of its own after the training GPUs; with fewer, they share the first
    vllm_tensor_parallel_size: int = 1
    # in minutes: how long the engine may take to answer a call (a weight push, a rollout, an evaluation)
    # before it counts as frozen and the run stops with a checkpoint; a call may take 10 times the slowest of
    # its kind so far if longer, and the engine's start and the first call of each kind, which may compile,
    # 5 minutes more on a CPU and 30 on a GPU, said at start (docs/checkpoints.md#a-frozen-or-dead-engine)
    engine_timeout_minutes: float = 5.0

    # trainer numerics and memory
    # dtype of the trainer's models (auto: bfloat16 on GPUs): bf16 autocast over fp32 weights for the trained
    # models and the reference policy, bf16 weights for the reward and gold models
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # recompute activations in the backward pass: less memory, ~1/3 more compute
    gradient_checkpointing: bool = False

    # checkpoints
    # checkpoint every this many steps (0: none on a schedule; one is also written on SIGTERM / Ctrl-C)
    save_freq: int = 0
    # the checkpoints kept, the newest; older ones are deleted (never the newest, which --resume reads)
    keep_checkpoints: int = 3
    resume: bool = False  # continue the run in --output_dir from its newest checkpoint (none: start over)


# == The domain of each numeric flag =========================================================================
# The plumbing's own flags (RunArgs): flag -> (domain, why). Each algorithm file adds those of its own flags.
_COMMON_DOMAINS = {
    "seed": (">= 0", "numpy's generators take no negative seed"),
    "collective_timeout_minutes": ("> 0", "a time to wait"),
    "vllm_gpu_memory_utilization": ("in (0, 1]", "a share of the GPU"),
    "vllm_num_engines": (">= 1", "a count of engines"),
    "vllm_tensor_parallel_size": (">= 1", "a count of GPUs per engine"),
    "engine_timeout_minutes": ("> 0", "a time to wait"),
    "save_freq": (">= 0", "0 writes no periodic checkpoint"),
    "keep_checkpoints": (">= 1", "the latest checkpoint is the one a resume needs"),
}


def check_domains(flags: dict, domains: dict[str, tuple[str, str]]) -> None:
    """Each flag's value in its domain (`domains`: flag -> (domain, why), the algorithm file's; with
    _COMMON_DOMAINS, the plumbing's own), as the maths of the flag reads it: "> 0", ">= 1", "in [0, 1]", "in
    (0, 1]" or "finite" (every bound finite too); None (an optional flag left out) is not checked. A value
    outside is a UsageError naming the flag, its domain and why."""
    for flag, (domain, why) in (_COMMON_DOMAINS | domains).items():
        value = flags[flag]
        if value is None:
            continue
        if domain == "finite":
            inside = True
        elif domain.startswith("in "):
            low, high = (float(x) for x in domain[4:-1].split(", "))
            inside = (low <= value if domain[3] == "[" else low < value) and value <= high
        else:
            op, bound = domain.split()
            inside = value > float(bound) if op == ">" else value >= float(bound)
        if not (inside and np.isfinite(value)):
            shown = domain if domain != "finite" else "a finite number"
            raise UsageError(f"--{flag} must be {shown} ({why}), got {value}")


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


def _json_kind(value) -> str:
    """The JSON name of a parsed value's type, as an error says what it found."""
    kinds = {dict: "object", list: "array", str: "string", bool: "true/false", type(None): "null"}
    return kinds.get(type(value), "number")


def _json_error(error: ValueError) -> str:
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
        return f"item {wrong}: a JSON {_json_kind(document[wrong])}, not an object (a row)"
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
            return f"line {number} (row {row}): a JSON {_json_kind(value)}, not an object (a row)"
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
            return f"does not parse ({_json_error(exc)})"
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
