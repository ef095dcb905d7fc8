"""1. The command line: the flags, their --help and domains; `run`, an algorithm file's entry point.

`run` parses the flags (`_parse_args`: tyro, --help in the sections of the file's Args), quiets the
third-party messages known to be harmless, and reports a bad input (`UsageError`) in one line, a failure after
its traceback in one last line. `help_if_asked` answers --help before the algorithm file imports torch,
transformers and vLLM (seconds): this module imports none of them, nor does the package (plumbing/__init__.py)
until a name of another module is used."""

import ast
import dataclasses
import gc
import inspect
import io
import logging
import math
import os
import sys
import textwrap
import tokenize
import traceback
import typing
import warnings
from pathlib import Path
from typing import Annotated, Literal

import tyro


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
    """Every process leaves the process group at the end of a run, once all of them are there (a barrier).
    Only at a clean end: after a failure another process may still wait in a collective. Then, where every
    process is on this machine, each ends at once, its output flushed: torch's gloo threads outlive
    destroy_process_group once transformers' auto classes are imported (something keeps the group), and the
    interpreter's exit, meeting them in its static destructors, aborted it now and then ("terminate called
    without an active exception", status -6: 8 of 20 two-process launches, two at a time on two cores; none
    of 20 ended at once). Everything the run writes is closed by then (the logs, the folder's lock, the
    engine's processes). A run across machines exits as usual: the launcher of a machine that ended at once
    closes its rendezvous under the others', which say so."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if os.environ.get("LOCAL_WORLD_SIZE", "1") == os.environ.get("WORLD_SIZE", "1"):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


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
    warnings.filterwarnings("ignore", message=REDUCE_OP_WARNING, category=FutureWarning)
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


REDUCE_OP_WARNING = "`torch.distributed.reduce_op` is deprecated"


# == The flags and their --help ==============================================================================
def flag_sections(cls: type) -> list[tuple[str, list[tuple[str, str]]]]:
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
    """tyro's command line of the dataclass `cls`, its --help in the class's sections (flag_sections) and
    headed by the first paragraph of `doc`. Returns a `cls`."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    # the fields' types as objects: a file that postpones its annotations (`from __future__ import
    # annotations`) leaves them as text
    types = typing.get_type_hints(cls)
    groups = []
    for title, flags in flag_sections(cls):
        members = [
            (
                name,
                Annotated[types[name], tyro.conf.arg(help=text)],
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


def help_if_asked(args_class: type, doc: str) -> None:
    """Answer --help (-h) and exit, as `run` would: called by an algorithm file as a program, right after its
    Args and before it imports torch, transformers and vLLM, so that --help takes a fraction of a second, not
    the seconds they take to load (docs/flags.md)."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        _parse_args(args_class, doc)


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

    # LoRA
    # LoRA's rank r: only a PEFT adapter of this rank on --lora_target_modules trains and travels to the
    # engine; the reference is the policy with it off, no copy of its own (0: the whole policy trains). E.g.
    # --lora_rank 8 --learning_rate 1e-3, about 10x full fine-tuning's rate
    # (docs/algorithms.md#lora---lora_rank)
    lora_rank: int = 0
    lora_alpha: float = 16.0  # LoRA's alpha: the adapter's update B A x is scaled by alpha / rank
    # dropout on the adapter's input in the training passes (> 0: their logprobs are no longer the policy's
    # that sampled, and the first PPO ratio is not 1)
    lora_dropout: float = 0.0
    # the layers that get an adapter: PEFT's all-linear (every linear layer but the output head), or their
    # names, comma-separated (q_proj,v_proj)
    lora_target_modules: str = "all-linear"
    # also save the final policy with its adapter merged into the weights, as policy_merged/ beside the
    # adapter in policy/
    lora_save_merged: bool = False

    # weight updates in flight
    # decode the rollouts a segment of tokens at a time, the next batch's beside the last one's longest
    # completions, each new policy version loaded between two segments as the rollout that needs it joins;
    # every token records the version that sampled it, none more than --async_level versions older than its
    # step (docs/algorithms.md#in-flight-weight-updates---inflight_updates)
    inflight_updates: bool = False
    inflight_segment_tokens: int = 16  # tokens each sequence decodes between two loads of a new version
    # after an update, the tokens decoded before it keep the keys and values the old version computed
    # (keep: PipelineRL's, free) or the new version computes them again (recompute: a prefill of each
    # sequence in flight at each update, and each token's logprob is the new policy's given its prefix)
    inflight_kv: Literal["keep", "recompute"] = "keep"

    # checkpoints
    # checkpoint every this many steps (0: none on a schedule; one is also written on SIGTERM / Ctrl-C)
    save_freq: int = 0
    # the checkpoints kept, the newest; older ones are deleted (never the newest, which --resume reads)
    keep_checkpoints: int = 3
    resume: bool = False  # continue the run in --output_dir from its newest checkpoint (none: start over)


# == The domain of each numeric flag =========================================================================
# The plumbing's own flags (RunArgs): flag -> (domain, why). Each algorithm file adds those of its own flags.
COMMON_DOMAINS = {
    "seed": (">= 0", "numpy's generators take no negative seed"),
    "collective_timeout_minutes": ("> 0", "a time to wait"),
    "vllm_gpu_memory_utilization": ("in (0, 1]", "a share of the GPU"),
    "vllm_num_engines": (">= 1", "a count of engines"),
    "vllm_tensor_parallel_size": (">= 1", "a count of GPUs per engine"),
    "engine_timeout_minutes": ("> 0", "a time to wait"),
    "save_freq": (">= 0", "0 writes no periodic checkpoint"),
    "keep_checkpoints": (">= 1", "the latest checkpoint is the one a resume needs"),
    "lora_rank": (">= 0", "0 trains the whole policy"),
    "lora_alpha": ("> 0", "the adapter's update is scaled by alpha / rank"),
    "lora_dropout": ("in [0, 1]", "a probability"),
    "inflight_segment_tokens": (">= 1", "a segment decodes at least one token"),
}


def check_domains(flags: dict, domains: dict[str, tuple[str, str]]) -> None:
    """Each flag's value in its domain (`domains`: flag -> (domain, why), the algorithm file's; with
    COMMON_DOMAINS, the plumbing's own), as the maths of the flag reads it: "> 0", ">= 1", "in [0, 1]", "in
    (0, 1]" or "finite" (every bound finite too); None (an optional flag left out) is not checked. A value
    outside is a UsageError naming the flag, its domain and why."""
    for flag, (domain, why) in (COMMON_DOMAINS | domains).items():
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
        if not (inside and math.isfinite(value)):
            shown = domain if domain != "finite" else "a finite number"
            raise UsageError(f"--{flag} must be {shown} ({why}), got {value}")
