"""The plumbing the three algorithm files share, none of it the method: the engine's processes, their placement and
the signals and watchdog that stop them; the run folder, checkpoints and resume; metrics logging; the checks of model
files; FLOP counting; the tests' fault hooks. Every function takes plain values, so nothing imports in a circle, and
a fork of an algorithm file uses this module unchanged. What each algorithm does is in its own file (docs/)."""

import ast
import dataclasses
import datetime
import gc
import inspect
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tokenize
import traceback
import uuid
import warnings
import weakref
from collections import Counter
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import numpy as np
import psutil
import torch
import tyro
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, parse_flag_from_env
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

if TYPE_CHECKING:  # vLLM is imported when the engine starts: --help and a bad flag need not wait for it (4 s)
    from vllm import LLM


# == Quiet by default ===================================================================================================
def quiet_known_noise() -> None:
    """Silence, where they are raised, the third-party messages every run printed that are known to be harmless, so that
    stderr shows what matters; ASYNC_RLHF_VERBOSE=1 shows them all. Called when this module loads: the engine's
    processes, spawned, load it again (they import the script) before they import vLLM, and get the same filters."""
    if os.environ.get("ASYNC_RLHF_VERBOSE"):
        return
    import datasets
    import transformers

    # vLLM's Triton dispatcher reads `torch.distributed.reduce_op` when it loads, which torch deprecates: vLLM's
    # code, on its import; nothing of ours uses it
    warnings.filterwarnings("ignore", message="`torch.distributed.reduce_op` is deprecated", category=FutureWarning)
    # torch looks for Triton kernels when vLLM loads; the CPU build has no Triton, and vLLM's CPU backend needs none
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    # DeepSpeed says it found no GPU and uses its CPU accelerator, on every CPU run that imports it (a filter: DeepSpeed
    # sets its logger's level when it loads, after us)
    logging.getLogger("DeepSpeed").addFilter(lambda record: not record.getMessage().startswith("Setting accelerator"))
    # progress bars of every model loaded or saved and of the datasets' caches: seconds each, in every run
    transformers.utils.logging.disable_progress_bar()
    datasets.disable_progress_bars()


quiet_known_noise()


# == Command line =====================================================================================================
def flag_sections(cls: type) -> list[tuple[str, list[tuple[str, str]]]]:
    """The sections of the dataclass `cls`'s body as [(title, [(field, help)])]: a section starts at the first field or
    after a blank line, with a comment line naming it; a field's help is its trailing comment, or the comment lines
    right above it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    sections = []
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign):
            trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            above, line = [], node.lineno - 1
            while line in comments and lines[line - 1].lstrip().startswith("#"):
                above, line = [comments[line], *above], line - 1
            if not sections or not lines[line - 1].strip():
                sections.append((above.pop(0), []))
            sections[-1][1].append((node.target.id, " ".join(above + trailing)))
    return sections


def parse_args(cls: type, doc: str, args: list[str] | None = None):
    """tyro's command line of the dataclass `cls`, its --help in the class's sections (flag_sections) and headed by
    the first paragraph of `doc`. Returns a `cls`."""
    fields = {field.name: field for field in dataclasses.fields(cls)}
    groups = []
    for title, flags in flag_sections(cls):
        members = [
            (
                name,
                Annotated[fields[name].type, tyro.conf.arg(help=text)],
                dataclasses.field(default=fields[name].default),
            )
            for name, text in flags
        ]
        groups.append(dataclasses.make_dataclass(title, members))
    command_line = dataclasses.make_dataclass(
        cls.__name__,
        [
            (
                f"group{i}",
                Annotated[group, tyro.conf.OmitArgPrefixes, tyro.conf.arg(name=group.__name__)],
                dataclasses.field(default_factory=group),
            )
            for i, group in enumerate(groups)
        ],
    )
    description = doc.strip().split("\n\n")[0] + "\n\n" + NONE_FLAGS
    parsed = tyro.cli(command_line, args=args, description=description, use_underscores=True)
    return cls(
        **{name: value for i in range(len(groups)) for name, value in vars(getattr(parsed, f"group{i}")).items()}
    )


NONE_FLAGS = "A flag shown {None}|INT (STR, FLOAT) is optional: left out, it is None, which its text explains."


# == Bad input ========================================================================================================
class UsageError(ValueError):
    """Bad flags or input files: reported in one line, before any model loads."""


@contextmanager
def usage_errors():
    """A UsageError raised in the block ends the process with one line, `error: ...`, and no traceback."""
    try:
        yield
    except UsageError as exc:
        raise SystemExit(f"error: {exc}")


def run(main, args) -> None:
    """main(args). A failure during the run (a NaN score, a dead engine, any exception) ends with its traceback, which
    helps, and then one line saying what failed, last: `error: ...`, exit status 1."""
    try:
        main(args)
    except Exception as exc:
        traceback.print_exc()
        sys.stderr.write(f"error: {exc}\n")
        exit_quickly()
        raise SystemExit(1)
    leave_process_group()


def leave_process_group() -> None:
    """Every process leaves the process group at the end of a run: torch's gloo threads, left running into the
    interpreter's exit after a collective, abort it ("terminate called without an active exception", status -6).
    Only at a clean end: after a failure another process may still wait in a collective."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def check_domains(flags: dict, domains: dict[str, tuple[str, str]]) -> None:
    """Each flag's value in its domain, as the maths of the flag reads it: "> 0", ">= 1", "in [0, 1]", "in (0, 1]" or
    "finite" (every bound finite too); None (an optional flag left out) is not checked. `domains`: flag -> (domain,
    why). A value outside is a UsageError naming the flag, its domain and why."""
    for flag, (domain, why) in domains.items():
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
            raise UsageError(
                f"--{flag} must be {domain if domain != 'finite' else 'a finite number'} ({why}), got {value}"
            )


def check_local(path: str, flag: str) -> None:
    """A path that cannot be a hub id (org/name) must exist: "/nowhere" or "models/x/y" is a missing folder, and saying
    so beats the hub client's complaint about repository names."""
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        if not os.path.exists(os.path.expanduser(path)):
            raise UsageError(f"{flag} {path}: no such file or folder")


def load_tokenizer(path: str, flag: str, trust_remote_code: bool):
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise UsageError(f"the tokenizer of {flag} {path} has no EOS token: completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # safe: masks come from lengths, not from pad ids
    return tokenizer


def not_a_reward_model(path: str, flag: str) -> str:
    return f"{flag} {path} is not a reward model: it has no score head, which loading would initialise at random"


def check_model(path: str, flag: str, lengths: tuple[int, int], trust_remote_code: bool, reward: bool = False):
    """The model exists, has safetensors weights (pickled ones are never loaded), prompt + response (`lengths`) fit
    its positions, and a reward model is a sequence classifier (its config says so; a causal LM is not)."""
    check_local(path, flag)
    if os.path.isdir(path) and not list(Path(path).glob("*.safetensors")):
        raise UsageError(f"{flag} {path} has no .safetensors weights (pickled .bin weights are not loaded)")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {path}: {str(exc).strip().splitlines()[0]}") from exc
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if context and sum(lengths) > context:
        raise UsageError(
            f"--max_prompt_length {lengths[0]} + --response_length {lengths[1]} exceed the {context}-token context of {flag} {path}"
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


# == The run folder and resuming ======================================================================================
def name_run(exp_name: str, seed: int) -> str:
    """<exp_name>__<seed>__<unix time>, as rank 0 sees it: another rank's clock may be in the next second."""
    return broadcast_object_list([f"{exp_name}__{seed}__{int(time.time())}"])[0]


def holds_a_run(output_dir: str) -> bool:
    """Whether a run logged or saved anything there (one stopped while starting left only args.json)."""
    metrics, checkpoints = Path(output_dir, "metrics.jsonl"), Path(output_dir, "checkpoints")
    logged = metrics.exists() and metrics.stat().st_size > 0
    return logged or any(checkpoints.glob("step_*")) or Path(output_dir, "policy").exists()


# Flags that may change when a run is resumed; any other must be what the run started with.
RESUMABLE_CHANGES = {"resume", "output_dir", "track", "wandb_project", "wandb_entity", "save_freq"}
RESUMABLE_CHANGES |= {"keep_checkpoints", "num_sample_completions", "collective_timeout_minutes"}
CHECKPOINT_FORMAT = 3  # 3: the LR schedule steps once a step; 2: the shuffle generators in Progress; 1: in files


def checkpoint_to_resume(output_dir: str, flags: dict, resume: bool, world_size: int) -> str | None:
    """The checkpoint a run continues from (None: it starts at step 0); two runs never share a folder. Exits (0) on
    --resume of a finished run, whose final policy is saved at the very end."""
    if not resume:
        if holds_a_run(output_dir):
            raise UsageError(
                f"--output_dir {output_dir} holds another run: pass --resume to continue it, or choose another --output_dir"
            )
        return None
    if os.path.isdir(policy := os.path.join(output_dir, "policy")):
        if PartialState().is_main_process:
            print(f"--resume: the run in {output_dir} is finished (its final policy is {policy}): nothing to do")
        raise SystemExit(0)
    if os.path.exists(run_file := os.path.join(output_dir, "args.json")):
        previous = json.loads(Path(run_file).read_text())
        changed = [
            f"--{k} {previous.get(k)!r} -> {v!r}"
            for k, v in flags.items()
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
    if not checkpoints:
        return None
    if not (format_file := checkpoints[-1] / "format.json").exists() or json.loads(format_file.read_text()) != {
        "format": CHECKPOINT_FORMAT
    }:
        raise UsageError(
            f"--resume: {checkpoints[-1]} is not a checkpoint of this version (format {CHECKPOINT_FORMAT}): resume it with the version that wrote it"
        )
    return str(checkpoints[-1])


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


def open_run_folder(output_dir: str, run_args: dict, start_step: int, evals_logged: set[int]) -> None:
    """args.json (with the git revision); on resume, metrics.jsonl loses what the interrupted run logged after its
    checkpoint: those steps are trained again."""
    os.makedirs(output_dir, exist_ok=True)
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.exists(metrics):
        kept = []
        for line in Path(metrics).read_text().splitlines():
            logged = json.loads(line)
            is_eval = any(key.startswith("eval/") for key in logged)
            if (logged["step"] in evals_logged) if is_eval else (logged["step"] < start_step):
                kept.append(line + "\n")
        write_atomically(metrics, "".join(kept))
    run_args = {**run_args, "output_dir": output_dir, "git_revision": git_revision()}
    write_atomically(os.path.join(output_dir, "args.json"), json.dumps(run_args, indent=2))


# == Metrics logging ==================================================================================================
class MetricsLogger:
    """metrics.jsonl (one JSON object per line, each with step and episode), TensorBoard, wandb. Written by hand, not
    with accelerate's trackers: `Accelerator.log` gives every backend one step, and wandb drops a row whose step goes
    back, which every evaluation does (it is logged after the training steps that followed it)."""

    def __init__(self, output_dir: str, run_name: str, config: dict, track: bool, project: str, entity: str | None):
        from tensorboardX import SummaryWriter

        self.output_dir = output_dir
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(project=project, entity=entity, name=run_name, config=config, dir=output_dir)
            self.wandb.define_metric("*", step_metric="episode")  # the x-axis of every plot, as TensorBoard's

    def log(self, metrics: dict) -> None:
        self.file.write(json.dumps(metrics) + "\n")
        self.file.flush()
        for key, value in metrics.items():
            if key not in ("step", "episode"):
                self.writer.add_scalar(key, value, metrics["episode"])
        if self.wandb:
            self.wandb.log(metrics)

    def log_samples(self, step: int, episode: int, rows: list[dict]) -> None:
        """A table of sample completions: TensorBoard text, a wandb table, and printed."""
        text = "\n\n".join(" | ".join(f"**{k}**: {v}" for k, v in row.items()) for row in rows)
        self.writer.add_text("samples", text, episode)
        if self.wandb:
            import wandb

            table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
            self.wandb.log({"samples": table, "step": step, "episode": episode})
        for row in rows:
            query = (
                row["query"] if len(row["query"]) <= 80 else "..." + row["query"][-77:]
            )  # what the completion follows
            details = ", ".join(f"{k} {v!r}" for k, v in row.items() if k not in ("query", "response"))
            print(f"  [step {step}] {query!r} -> {row['response']!r} ({details})")

    def log_evaluation(self, step: int, episode: int, metrics: dict, rows: list[dict], texts: tuple) -> None:
        """An evaluation: its metrics and a sample table (both also printed), and `texts` (prompts, completions,
        references) to eval_completions/step_NNNNNN.jsonl."""
        write_eval_completions(self.output_dir, step, episode, *texts)
        self.log_samples(step, episode, rows)
        self.log({"step": step, "episode": episode, **metrics})
        print(f"eval step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/")))

    def close(self) -> None:
        self.file.close()
        self.writer.close()
        if self.wandb:
            self.wandb.finish()


def write_eval_completions(output_dir: str, step: int, episode: int, prompts, completions, references) -> str:
    """eval_completions/step_NNNNNN.jsonl, one row per eval prompt, for judges that run after training
    (benchmark/llm_judge.py); a resumed run replaces a step's file."""
    folder = os.path.join(output_dir, "eval_completions")
    os.makedirs(folder, exist_ok=True)
    rows = [
        dict(step=step, episode=episode, prompt=p, completion=c, reference=r)
        for p, c, r in zip(prompts, completions, references)
    ]
    path = os.path.join(folder, f"step_{step:06d}.jsonl")
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


class Laps:
    """A training step's phases, timed one after the other: `lap(name)` ends phase `name`, begun where the previous
    one ended. The first phase is the wait for the step's rollouts; the others are its training."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds, self.begun = {}, {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.begun[name], self.last = now - self.last, self.last, now


def pipeline_metrics(laps: Laps, generator: dict, origin: float, flops: dict, episodes: int, tokens: float) -> dict:
    """A step's figures of the async pipeline: the seconds of each phase, the trainer's (`laps`) and the generator's
    (`generator`: name -> (start or None, seconds)); their starts (`timeline/`, seconds since `origin`); the FLOPs of
    the trainer's phases; the throughput of the `episodes` and (response) `tokens` trained on."""
    step = time.perf_counter() - laps.start
    training_start = laps.start + next(iter(laps.seconds.values()))
    seconds = {name: s for name, (_, s) in generator.items()} | laps.seconds
    seconds |= {"training": laps.last - training_start, "step": step}
    starts = {"step_start": laps.start, "training_start": training_start}
    starts |= {f"{name}_start": start for name, (start, _) in generator.items() if start is not None}
    return {
        **{f"time/{k}": v for k, v in seconds.items()},
        **{f"flops/{k}": v for k, v in flops.items()},
        **{f"timeline/{k}": v - origin for k, v in starts.items()},
        "throughput/episodes_per_second": episodes / step,
        "throughput/tokens_per_second": tokens / step,
    }


def reduce_statistics(stats: dict, accelerator: Accelerator, step: int, last_checkpoint: str | None) -> dict:
    """A step's statistics (tensors) averaged over the processes. A non-finite loss stops the run before any
    checkpoint has it."""
    reduced = dict(zip(stats, accelerator.reduce(torch.stack(list(stats.values())), "mean").tolist()))
    if not np.isfinite(reduced["loss"]):
        last = f"; the last good one is {last_checkpoint} (--resume)" if last_checkpoint else ""
        raise RuntimeError(f"loss is {reduced['loss']} at step {step}: stopping before it reaches a checkpoint{last}")
    return reduced


def numel(tensor: torch.Tensor) -> int:
    """A parameter's size, whole: ZeRO-3 leaves each process a shard of it."""
    return getattr(tensor, "ds_numel", tensor.numel())


def forward_flops(model, sequences: int, length: int, logit_positions: int | None = None) -> int:
    """Matmul FLOPs of a forward pass, 2 per parameter and token (Kaplan et al. 2020, no attention term): every token
    through the body, `logit_positions` per sequence (None: all) through the output head, none through the input
    embedding (a lookup). A training pass is 3 forwards' worth, 4 when recomputing activations."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_params = 0 if head is None else numel(head.weight)
    tied = head is not None and head.weight is embedding
    body = sum(numel(p) for p in model.parameters()) - numel(embedding) - (0 if tied else head_params)
    return 2 * sequences * (body * length + head_params * (length if logit_positions is None else logit_positions))


# == Checkpoints ======================================================================================================
class Progress:
    """Where the run is: the next step, the evaluations logged, and every process's shuffle generator (its state is
    gathered from all of them, as accelerate saves a registered object from rank 0 only). Saved by accelerate with
    the trainer's state."""

    def __init__(self, seed: int):
        self.step, self.evals_logged = 0, set()
        self.shuffle = np.random.default_rng([seed, PartialState().process_index])

    def state_dict(self) -> dict:
        shuffles = gather_object([self.shuffle.bit_generator.state])
        return {"step": self.step, "evals_logged": sorted(self.evals_logged), "shuffle": shuffles}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evals_logged = state["step"], set(state["evals_logged"])
        self.shuffle.bit_generator.state = state["shuffle"][PartialState().process_index]


def save_checkpoint(accelerator: Accelerator, output_dir: str, progress: Progress, owed: dict[int, list], keep: int):
    """Everything a resumed run needs to go on exactly: accelerate's `save_state` (the trained weights as safetensors,
    the optimizer, the registered objects such as the scheduler and Progress, RNG states) and the older policy versions
    the generator still owes batches or evaluations (`owed`: version -> [(name, tensor)]), so no engine state is
    needed. Written to a temporary folder, then renamed; then all but the `keep` newest checkpoints are deleted."""
    path = os.path.join(output_dir, "checkpoints", f"step_{progress.step:06d}")
    if accelerator.is_main_process:
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(f"{path}.tmp")
    if accelerator.is_main_process:  # theta_step itself is the policy's weights
        for version, tensors in owed.items():
            tensors = {name: tensor.cpu().clone() for name, tensor in tensors}
            save_file(tensors, os.path.join(f"{path}.tmp", f"version_{version:06d}.safetensors"))
        Path(f"{path}.tmp", "format.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT}))
        follow_umask(f"{path}.tmp")
        shutil.rmtree(path, ignore_errors=True)
        os.replace(f"{path}.tmp", path)
        written = sorted(
            p for p in Path(output_dir, "checkpoints").glob("step_*") if re.fullmatch(r"step_\d{6}", p.name)
        )
        for old in written[:-keep]:  # the newest, just written, is the one a resume reads
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def follow_umask(path: str) -> None:
    """Give the files under `path` the permissions the umask allows, as any file the run writes: safetensors (and so
    save_pretrained and save_state) creates its files with 0600, which another user of a shared cluster cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for file in [Path(path)] if os.path.isfile(path) else Path(path).rglob("*"):
        if file.is_file():
            os.chmod(file, 0o666 & ~mask)


def load_owed_version(checkpoint: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint, f"version_{version:06d}.safetensors"))


def save_policy(accelerator: Accelerator, model, tokenizer, path: str, prefix: str = "") -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: no half-written model. `prefix`: the
    policy's submodule in `model` (PPO's `policy.`)."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        policy = accelerator.unwrap_model(model)
        policy = getattr(policy, prefix.rstrip(".")) if prefix else policy
        shutil.rmtree(tmp := f"{path}.tmp", ignore_errors=True)
        policy.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        follow_umask(tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    accelerator.wait_for_everyone()


# == DeepSpeed ===========================================================================================================
def process_state(timeout_minutes: float) -> PartialState:
    """accelerate's process group and device (made before the Accelerator, which needs the dtype, which needs the
    device), with DeepSpeed's processes counted on CPUs too: accelerate 1.15 picks no backend for them there (it picks
    gloo only under ACCELERATE_USE_CPU, which turns DeepSpeed off), so each would take itself for the only process of a
    group DeepSpeed has already set up. A collective waits `timeout_minutes` for the other processes before it fails:
    ranks 1..N wait in one while rank 0 starts the engine and generates the first batch (NCCL's and DeepSpeed's
    default, 10 minutes, is shorter than an 8B engine's first start with its compilation)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), timeout=timeout)
    if state.distributed_type == "DEEPSPEED" and state.backend is None and torch.distributed.is_initialized():
        state.backend = torch.distributed.get_backend()
        state.num_processes, state.process_index = torch.distributed.get_world_size(), torch.distributed.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", 0))
    if state.num_processes > 1 and state.is_main_process:
        print(f"{state.num_processes} training processes; a collective waits {collective_timeout()} for them at most")
    return state


def collective_timeout() -> datetime.timedelta | None:
    """How long a collective of the default process group waits, as its backend holds it (None: no group)."""
    if not torch.distributed.is_initialized():
        return None
    group = torch.distributed.distributed_c10d._get_default_group()
    device = torch.device("cuda") if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout


def zero_stage(accelerator: Accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else plugin.zero_stage


def prepare_frozen(model, accelerator: Accelerator):
    """A frozen model (reference, reward model) on the training device. Under ZeRO-3 transformers loads every model
    sharded across the processes: DeepSpeed's engine, without an optimizer, then gathers a layer at a time for its
    forward passes (as TRL prepares its reference models), in the dtype of the run's mixed precision. All processes
    must run those forward passes together."""
    model = model.to(accelerator.device).eval().requires_grad_(False)
    if zero_stage(accelerator) != 3:
        # accelerate's autocast does nothing under DeepSpeed (1.15), whose bf16 runs the policy on bf16 parameters
        # (buffers, such as the rotary frequencies, stay fp32): a frozen model runs on the same, or the reference's
        # logprobs would not be the policy's at step 0
        if accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "bf16":
            for parameter in model.parameters():
                parameter.data = parameter.data.to(torch.bfloat16)
        return model
    import deepspeed

    bf16 = accelerator.mixed_precision == "bf16"
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}}
    engine = deepspeed.initialize(model=model, config=config)[0]
    model.deepspeed_engine = engine  # its gathering hooks live as long as the model
    return model


@contextmanager
def whole_models(accelerator: Accelerator):
    """A context in which models load whole, not sharded by ZeRO-3 (accelerate tells transformers to shard every model
    it loads): the gold judge, which only rank 0 runs."""
    if zero_stage(accelerator) != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def gathered_tensors(accelerator: Accelerator, module, names):
    """The tensors of a module's state named in `names`, (name, tensor), where they are. Under ZeRO-3 the parameters are
    gathered a transformer layer at a time, each valid while the iteration is on its layer: never a whole copy of the
    model, never through the CPU, and never a parameter not asked for (PPO's value model). Every process must go through
    the whole iteration, as each gather is collective."""
    if zero_stage(accelerator) != 3:
        yield from ((name, tensor) for name, tensor in module.state_dict().items() if name in names)
        return
    import deepspeed

    layers = {}
    for name, parameter in module.named_parameters():
        if name in names:
            layer = re.match(r"(.*?\.\d+)\.", name)  # model.layers.3. ...: the 4th layer
            layers.setdefault(layer.group(1) if layer else name, []).append((name, parameter))
    for group in layers.values():
        with deepspeed.zero.GatheredParameters([parameter for _, parameter in group]):
            yield from group
    yield from ((name, buffer) for name, buffer in module.named_buffers() if name in names)


def full_shapes(module) -> dict[str, torch.Size]:
    """The shape of every tensor of a module's state, whole (ZeRO-3 keeps each parameter's in `ds_shape`)."""
    shapes = {name: getattr(p, "ds_shape", p.shape) for name, p in module.named_parameters()}
    return shapes | {name: buffer.shape for name, buffer in module.named_buffers()}


def snapshot_sizes(module, names: dict[str, str]) -> dict[str, int]:
    """The elements of each tensor of one weight snapshot: the tensors `names` of `module`, whole, under their
    checkpoint names. From the shapes, not from `state_dict()`, whose tensors ZeRO-3 leaves empty (it would count 0)."""
    shapes = full_shapes(module)
    return {names[name]: math.prod(shapes[name]) for name in names}


def snapshot_bytes(module, names: dict[str, str], dtype: torch.dtype) -> int:
    """The bytes of one weight snapshot in `dtype` (snapshot_sizes)."""
    return sum(snapshot_sizes(module, names).values()) * dtype.itemsize


class EngineRoom(NamedTuple):
    """What the engine must leave room for on the GPUs (engine_share), and the weight push's bytes it prints."""

    to_come: dict[str, int]  # what training allocates on rank 0's GPU once the engine is up: name -> bytes
    snapshot: int  # one weight snapshot's bytes, in host memory
    bucket: int  # the push's bucket on the engine's GPU (bucket_bytes)


def injected_fault(where: str, step: int) -> bool:
    """Fault injection, used only by the tests: ASYNC_RLHF_TEST_FAULT=<where>:<step>."""
    return os.environ.get("ASYNC_RLHF_TEST_FAULT") == f"{where}:{step}"


# == The engine's GPU and cores =======================================================================================
class Placement(NamedTuple):
    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's processes: its GPU alone; None: CPU
    shared: bool  # the engine shares training rank 0's GPU
    engine_gpu: int  # the engine's GPU, as rank 0 numbers its GPUs: the weight push's bucket lives there
    memory_utilization: float | None  # None on a GPU: the largest share the run leaves (engine_share), at its start


def visible_gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def engine_placement(mode: str, visible: list[str], num_processes: int, memory_utilization: float | None) -> Placement:
    """Training process i of a node uses its visible GPU i; the engine runs on rank 0's node. With an (N+1)-th GPU
    there, for the N training processes of the node (LOCAL_WORLD_SIZE under a launcher; `num_processes` on one node),
    the engine takes it (the paper's split); with fewer, it shares rank 0's within its memory budget. Rank 0 keeps
    the weight snapshots in its host memory and copies each pushed one through a bucket on the engine's GPU, which the
    engine reads by CUDA IPC (docs/gpus.md)."""
    if not visible:  # vLLM's CPU backend sizes its KV cache by VLLM_CPU_KVCACHE_SPACE instead
        return Placement(None, False, 0, memory_utilization or DEFAULT_SHARE["separate"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))  # the processes on rank 0's node
    separate = len(visible) > local if mode == "auto" else mode == "separate"
    if separate and len(visible) <= local:
        nodes = f" on rank 0's node, of {num_processes} in all," if local != num_processes else ""
        raise UsageError(
            f"--vllm_placement separate: {local} training process(es){nodes} and the engine need {local + 1} GPUs "
            f"there, {len(visible)} are visible; use --vllm_placement shared or one training process fewer on that node"
        )
    if separate:
        return Placement(visible[local], False, local, memory_utilization)
    return Placement(visible[0], True, 0, memory_utilization)


CUDA_CONTEXT = 2**30  # what a process's CUDA context takes on a GPU, about 1 GiB (with the kernels it loads)


def trained_memory(params: int, zero_stage: int, processes: int, bf16: bool) -> dict[str, int]:
    """Bytes per process of the trained models' weights, gradients and AdamW state. Without DeepSpeed: fp32 weights
    and gradients (bf16 is autocast), two fp32 moments, 4 + 4 + 8 bytes a parameter. DeepSpeed's bf16 keeps bf16 weights
    and gradients and fp32 master weights beside the moments, 2 + 2 + 12 bytes; ZeRO stage 1 shards the 12 (or 8)
    among the processes, stage 2 the gradients too, stage 3 the weights too (Rajbhandari et al. 2020, section 5)."""
    weights, gradients, state = (2, 2, 12) if zero_stage and bf16 else (4, 4, 8)
    shard = lambda n, stage: params * n // (processes if zero_stage >= stage else 1)  # noqa: E731
    return {"weights": shard(weights, 3), "gradients": shard(gradients, 2), "optimizer state": shard(state, 1)}


def snapshot_memory(snapshot: int, async_level: int) -> int:
    """Rank 0's host memory for the weight snapshots of `snapshot` bytes that can be alive at once: async_level + 2 (the
    versions still owed batches, the one just published, one an evaluation may still hold), each in a pinned block,
    which torch's pinned allocator rounds up to a power of two (16 GiB for an 8B policy's 15 in bf16)."""
    return (async_level + 2) * 2 ** math.ceil(math.log2(snapshot)) if snapshot else 0


# The engine's share of its GPU when --vllm_gpu_memory_utilization is left out: the largest that fits, up to vLLM's
# default on a GPU of its own, and up to 0.3 of one it shares, whose rest training's activations need (not counted).
DEFAULT_SHARE = {"separate": 0.9, "shared": 0.3}
MIN_SHARE = 0.05  # less holds the weights of no model worth generating with, and no KV cache


def engine_share(placement: Placement, rank0: tuple, engine: tuple, to_come: dict[str, int], bucket: int) -> float:
    """The engine's share of its GPU: --vllm_gpu_memory_utilization if it fits, or (left out) the largest that fits up
    to DEFAULT_SHARE. The GPUs once the trainer's models are loaded ((free, total) bytes of rank 0's and of the
    engine's, the same on a shared GPU) must hold what training allocates later there (`to_come`: name -> bytes), the
    weight push's bucket (`bucket`: bucket_bytes; the snapshots are in host memory) and the engine: vLLM takes its
    share of its whole GPU, and refuses to start when less is free; each process opens a CUDA context on each GPU it
    uses (the engine's own, rank 0's where it writes the bucket).
    5 % of each GPU is kept for activations and allocator slack. A GPU that cannot: one line naming what to lower."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    asked = placement.memory_utilization
    free, total = rank0
    needed = sum(to_come.values()) + (bucket + 2 * CUDA_CONTEXT if placement.shared else 0)
    parts = ", ".join(f"{name} {gib(n)}" for name, n in to_come.items())
    training = f"training will add {gib(needed)} there ({parts}"
    training += (
        f", the weight push's bucket {gib(bucket)}, CUDA contexts {gib(2 * CUDA_CONTEXT)})" if placement.shared else ")"
    )
    what = f"rank 0's GPU has {gib(free)} free once the models are loaded, and {training}"
    smaller = "lower the model size, give the engine a GPU of its own, or shard the models (DeepSpeed ZeRO-3)"
    if placement.shared:
        largest = int(100 * (free - needed - 0.05 * total) / total) / 100
    else:
        if needed + 0.05 * total > free:
            raise UsageError(f"{what}: {smaller}")
        free, total = engine
        # vLLM wants its share free once its own CUDA context is open, beside rank 0's there
        largest = int(100 * (free - bucket - 2 * CUDA_CONTEXT - 0.05 * total) / total) / 100
    if asked is None:
        if largest < MIN_SHARE:
            beside = f"beside the weight push's bucket of {gib(bucket)}, " if not placement.shared else ""
            raise UsageError(
                f"the engine would get {max(largest, 0)} of its GPU, {beside}less than {MIN_SHARE}: {smaller}"
            )
        return min(largest, DEFAULT_SHARE["shared" if placement.shared else "separate"])
    if asked <= largest:
        return asked
    if placement.shared:
        if largest >= MIN_SHARE:
            raise UsageError(
                f"--vllm_gpu_memory_utilization {asked}: the engine would take {gib(asked * total)} of the GPU it shares with training; {what}: lower it to at most {largest}, or give the engine a GPU of its own"
            )
        raise UsageError(f"{what}, beside the engine {gib(asked * total)}: {smaller}")
    raise UsageError(
        f"--vllm_gpu_memory_utilization {asked}: the engine's GPU has {gib(free)} free and the engine would take {gib(asked * total)}, beside the weight push's bucket of {gib(bucket)} and the CUDA contexts of rank 0 and the engine {gib(2 * CUDA_CONTEXT)}: lower it to at most {largest} (less KV cache)"
    )


def engine_line(
    placement: Placement, total: int, snapshot: int, bucket: int, snapshots: int, flag_given: bool, eager: bool
) -> str:
    """What the engine gets, printed as it starts: its device, its share of its GPU and why, the weight push's bucket
    and the snapshots (`snapshot` bytes each, `snapshots` at most) in host memory, and (on a GPU with CUDA graphs) that its first start compiles, which
    takes minutes."""
    gib = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"  # noqa: E731
    if placement.devices is None:
        return f"engine: on the CPU; weight snapshots of {gib(snapshot)} each"
    where = (
        f"GPU {placement.engine_gpu}, shared with training rank 0"
        if placement.shared
        else f"GPU {placement.engine_gpu} of its own"
    )
    why = (
        "--vllm_gpu_memory_utilization"
        if flag_given
        else "the largest share the run leaves (--vllm_gpu_memory_utilization)"
    )
    beside = f"beside the weight push's bucket of {gib(bucket)} (the snapshots of {gib(snapshot)}: {gib(snapshots)} at most, in pinned host memory)"
    line = f"engine: {where}, {placement.memory_utilization} of its {gib(total)} ({why}), {beside}"
    if not eager:  # vLLM compiles (torch.compile) and captures CUDA graphs at its first start on a GPU
        line += "; its first start compiles the model and captures CUDA graphs: minutes (--vllm_enforce_eager skips both, for slower generation)"
    return line


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


def split_cores(device: torch.device, num_processes: int) -> list[int] | None:
    """On a CPU with a core to spare, split the cores as the paper splits GPUs: the first is the engine's (its worker,
    its scheduler and the generation thread, which take turns), the others train, and so do the threads started
    later. Returns the engine's cores (None: no split)."""
    cores = sorted(os.sched_getaffinity(0))
    if device.type == "cpu" and len(cores) > num_processes:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[0]))
        os.sched_setaffinity(0, cores[1:])
        torch.set_num_threads(len(cores) - 1)
        return cores[:1]
    return None


# == The engine's processes, their watchdog, signals ==================================================================
def make_engine(model: str, placement: Placement, **llm_kwargs) -> "LLM":
    """The engine runs in its own processes (vLLM's default): generation does not share the trainer's interpreter
    lock, and models vLLM serves through its Transformers backend (GPTNeoX on CPUs) do not patch the trainer's
    classes. The children inherit the environment set here."""
    from vllm import LLM

    env = dict(os.environ)
    # an `accelerate launch`'s torch.distributed variables: the engine would join our group
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    # Spawned, never forked: a fork of a process that has touched CUDA (even torch.cuda.is_available() without NVML)
    # dies with "CUDA error: initialization error". vLLM forks unless it sees CUDA initialised; on CPUs it spawns.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # the worker imports WeightReceiver from this module
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    if placement.devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = placement.devices
    else:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's default reserves far more
        if not os.environ.get("ASYNC_RLHF_VERBOSE"):
            # vLLM's CPU worker binds its memory to its core's NUMA node, as the core split asks, and says so in a C++
            # warning, which no Python filter reaches: the engine's processes log C++ errors only
            os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # it warns at every push that rotary caches are not pushed
    try:
        return LLM(
            model=model,
            gpu_memory_utilization=placement.memory_utilization,
            use_tqdm_on_load=False,
            logprobs_mode="processed_logprobs",  # logprobs after temperature, like the trainer's
            load_format="safetensors",
            worker_extension_cls=f"{Path(__file__).stem}.WeightReceiver",
            **llm_kwargs,
        )
    finally:
        os.environ.clear()
        os.environ.update(env)


class SnapshotPlace(NamedTuple):
    """Where the weight snapshots live: host memory, so that the engine's device holds none of them, only the push's
    bucket (WeightBucket; docs/gpus.md). Beside a GPU engine (`pinned`) pinned memory, which the push copies
    from at the bus's full speed; beside a CPU engine shared memory, a file in the RAM-backed `folder`."""

    pinned: bool
    folder: str | None

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return shared_memory_buffer(self.folder, "snapshot", numel, dtype)


# The push's bucket on the engine's device (WeightBucket), unless the snapshot is smaller or a load unit larger: 1.3 %
# of an H100's 79 GiB, where the whole snapshot it replaces (an 8B policy in bf16, 15 GiB) took 19 %, now KV cache.
# Still it holds Llama 3.1 8B's embedding whole (0.98 GiB in bf16), or two of its decoder layers, so that an 8B push
# is 18 loads, not hundreds: each load walks all of vLLM's layers (docs/gpus.md).
BUCKET_BYTES = 2**30


def load_unit(name: str) -> str:
    """The part of the model a snapshot tensor is pushed with, in one load: its numbered layer (`model.layers.3`) or
    else its module (`lm_head`). vLLM's reload processes a layer (fuses q/k/v and gate/up, repacks on a CPU) once all
    its weights came in one load: a layer split between two loads is processed half empty, and generates zeros."""
    parts = name.split(".")
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: numbered[0] + 1]) if numbered else name.rpartition(".")[0]


def bucket_bytes(sizes: dict[str, int], element_size: int, least: int = BUCKET_BYTES) -> int:
    """The push's bucket for a snapshot of these tensors (`sizes`: checkpoint name -> elements): `least` bytes, or the
    largest load unit if larger, or the whole snapshot if smaller."""
    units = Counter()
    for name, numel in sizes.items():
        units[load_unit(name)] += numel
    return min(sum(sizes.values()), max(least // element_size, *units.values())) * element_size


class Chunk(NamedTuple):
    start: int  # the snapshot's elements [start, end) it copies into the bucket
    end: int
    layout: list  # (name, shape, offset in the bucket) of each tensor in it


def bucket_chunks(layout: list, capacity: int) -> list[Chunk]:
    """A snapshot (`layout`: (name, shape, offset) of each tensor, in order, packed) cut into runs of whole load units
    (load_unit) of at most `capacity` elements, in order: each run fills the bucket once."""
    units, last = {}, None  # unit -> its tensors, in the snapshot's order
    for name, shape, offset in layout:
        if (unit := load_unit(name)) in units and unit != last:
            raise RuntimeError(f"{name}: the tensors of {unit} are not together in the snapshot")
        units.setdefault(unit, []).append((name, shape, offset))
        last = unit
    chunks = []
    for unit, tensors in units.items():
        (_, _, start), (_, shape, offset) = tensors[0], tensors[-1]
        end = offset + math.prod(shape)
        if end - start > capacity:
            raise RuntimeError(f"{unit}: {end - start} elements, a bucket of {capacity}")
        if chunks and end - chunks[-1].start <= capacity:
            chunks[-1] = chunks[-1]._replace(end=end, layout=chunks[-1].layout + tensors)
        else:
            chunks.append(Chunk(start=start, end=end, layout=tensors))
    return [
        chunk._replace(layout=[(name, shape, offset - chunk.start) for name, shape, offset in chunk.layout])
        for chunk in chunks
    ]


class Filled(NamedTuple):
    handle: tuple  # the bucket, for the engine's worker (shared_handle)
    layout: list  # (name, shape, offset in the bucket) of the tensors it holds now


class WeightBucket:
    """The push's buffer on the engine's device, where its worker opens it (shared_handle): a push copies the host
    snapshot into it a run of whole load units at a time (bucket_chunks), and the worker loads each run before the
    next overwrites it. GPU memory of `device`, which CUDA IPC shares; on a CPU (`device` None) one more shared-memory
    file in `folder`, so that CPU runs take the GPU's push path but for the device. Of bucket_bytes (`least`: the
    production's BUCKET_BYTES, the tests' smaller), allocated at the first push and kept: the engine's device holds
    that, whatever the model's size and the async level."""

    def __init__(self, device: torch.device | None, folder: str | None, least: int = BUCKET_BYTES):
        self.device, self.folder, self.least, self.flat = device, folder, least, None

    def fill(self, snapshot: torch.Tensor, layout: list):
        """Yields each run of `snapshot` (SnapshotPlace.buffer; `layout`: its tensors) copied into the bucket, as the
        handle and layout the worker loads it by; the next run is copied when the caller asks for it."""
        if self.flat is None:
            sizes = {name: math.prod(shape) for name, shape, _ in layout}
            numel = bucket_bytes(sizes, snapshot.element_size(), self.least) // snapshot.element_size()
            self.flat = (
                torch.empty(numel, dtype=snapshot.dtype, device=self.device)
                if self.device is not None
                else shared_memory_buffer(self.folder, "bucket", numel, snapshot.dtype)
            )
        if self.flat.dtype != snapshot.dtype:
            raise RuntimeError(f"a snapshot of {snapshot.dtype} for a bucket of {self.flat.dtype}")
        handle = shared_handle(self.flat)
        for chunk in bucket_chunks(layout, self.flat.numel()):
            self.flat[: chunk.end - chunk.start].copy_(snapshot[chunk.start : chunk.end])
            if self.flat.is_cuda:  # the engine's process reads it without our stream
                torch.cuda.current_stream(self.flat.device).synchronize()
            yield Filled(handle=handle, layout=chunk.layout)


def shared_memory_buffer(folder: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer in a file of the RAM-backed `folder` that another process can map (shared_handle); the file goes with
    the buffer."""
    path = os.path.join(folder, f"{kind}-{uuid.uuid4().hex}")
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    flat.shared_path = path  # for shared_handle
    weakref.finalize(flat, remove_file, path)
    return flat


def remove_file(path: str) -> None:
    with suppress(FileNotFoundError):  # the weights folder may be gone already, at the end of a run
        os.unlink(path)


def shared_handle(flat: torch.Tensor) -> tuple:
    """What the engine's worker needs to open a shared buffer (open_shared): ("cuda", CUDA IPC handle) or ("cpu",
    path, dtype, elements)."""
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return ("cuda", reduce_tensor(flat)[1])
    return ("cpu", flat.shared_path, str(flat.dtype).removeprefix("torch."), flat.numel())


def shared_views(flat: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    return {name: flat[offset : offset + math.prod(shape)].view(shape) for name, shape, offset in layout}


def open_shared(handle: tuple) -> torch.Tensor:
    """The buffer a shared_handle names, in the engine's worker: the same memory, not a copy."""
    if handle[0] == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        arguments = list(handle[1])
        arguments[6] = 0  # the buffer's GPU, this process's only one
        return rebuild_cuda_tensor(*arguments)
    _, path, dtype, numel = handle
    return torch.from_file(path, shared=True, size=numel, dtype=getattr(torch, dtype))


def check_loaded(version: int, chunks: list[dict], cache_reset: bool | None) -> None:
    """Stop the run when the engine does not hold what it was sent (`chunks`: WeightReceiver.holds after each load of
    the push, in order), or kept its prefix cache, KV computed with the old weights: it would go on generating with a
    stale policy, silently."""
    loaded = {
        "version": chunks[-1]["version"] if chunks else None,
        "compared": sum(chunk["compared"] for chunk in chunks),
        "differ": [name for chunk in chunks for name in chunk["differ"]],
    }
    if loaded["differ"]:
        what = f"{len(loaded['differ'])} of {loaded['compared']} tensors compared differ, e.g. {loaded['differ'][:2]}"
    elif not loaded["compared"]:
        what = "no tensor could be compared"
    elif loaded["version"] != version:
        what = f"it loaded version {loaded['version']}"
    elif cache_reset is False:
        what = "its prefix cache was not reset"
    else:
        return
    raise RuntimeError(f"the engine does not hold policy version {version} after its push: {what}")


class WeightReceiver:
    """Added to vLLM's worker (`worker_extension_cls`): it loads the tensors of a weight snapshot that the trainer
    copied into the push's bucket, GPU memory shared by CUDA IPC on a GPU, shared memory on a CPU (WeightBucket), with
    no file and no further copy, through the model's own loader (which fuses q/k/v and gate/up and reorders GPTNeoX's
    q/k/v as for a checkpoint); the copy is in place, so CUDA graphs see it. Then it compares what it holds with what
    it was sent. The tests read the engine's parameters and GPU memory through it after a push."""

    def load_shared_weights(self, version: int, handle: tuple, layout: list) -> dict:
        """Load tensors of theta_version from the buffer `handle` names (shared_handle), `layout`: (name, shape,
        offset) of each tensor in it, whole load units (bucket_chunks): the model's other layers keep what they hold.
        Returns what `holds` says of it."""
        flat = open_shared(handle)
        # vLLM warns of every layer a load leaves out, which a push a bucket at a time does by design; holds checks
        # what was sent instead
        quiet = [
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}") for name in ("inplace", "layerwise")
        ]
        levels = [logger.level for logger in quiet]
        try:
            for logger in quiet:
                logger.setLevel(logging.ERROR)
            self.reload_weights(weights_iterator=iter(shared_views(flat, layout).items()))
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
        if flat.is_cuda:
            torch.cuda.synchronize()  # loaded before the next run of the push overwrites the bucket
        else:
            self.repack_tied_heads()
        return self.holds(version, handle, layout)

    def repack_tied_heads(self) -> None:
        """Repack each output embedding tied to the input embedding, on a CPU. vLLM's CPU layers keep a packed copy of
        their weight for their matmuls, which the reload redoes for the layers whose weights it loads, but a tied head
        (`tie_word_embeddings`: Llama 3.2, Qwen2.5) loads none of its own: it would go on generating with the old head
        (vllm-cpu 0.32; tests/test_engine.py)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        modules = list(self.model_runner.model.modules())
        inputs = {id(m.weight) for m in modules if not isinstance(m, ParallelLMHead) and hasattr(m, "weight")}
        for head in (m for m in modules if isinstance(m, ParallelLMHead) and id(m.weight) in inputs):
            head.quant_method.process_weights_after_loading(head)

    def holds(self, version: int, handle: tuple, layout: list) -> dict:
        """What the engine holds against the buffer `handle` names: every parameter the loader keeps under a sent
        tensor's name, compared element for element (an embedding padded to a multiple of the vocabulary: its first
        rows). The fused ones (q/k/v, gate/up) are not compared, being concatenations, nor the weights vLLM's CPU layers
        repack and leave empty: a push that delivered nothing, or another version, shows in the others. Returns the
        version, how many tensors were compared and the names of those that differ (check_loaded reads it)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model, compared, differ = self.model_runner.model, 0, []
        sent = shared_views(open_shared(handle), layout)
        # GPT-2's Conv1D weights are sent (in, out) and loaded transposed: a square one (attn.c_proj) would differ. vLLM
        # versions that transpose inside their loader, with no method of their own for it: those are not compared
        if (transpose := getattr(getattr(model, "transformer", None), "_transpose_conv1d", None)) is not None:
            sent = dict(transpose(sent.items()))
        elif type(model).__name__.startswith("GPT2"):
            sent = {n: t for n, t in sent.items() if not n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))}
        if (mapper := getattr(model, "hf_to_vllm_mapper", None)) is not None:  # models whose names vLLM changes
            rename = getattr(mapper, "map_name", None) or mapper._map_name
            renamed = [(rename(name), tensor) for name, tensor in sent.items()]
            fused = {name for name, count in Counter(name for name, _ in renamed).items() if count > 1}  # q, k, v
            sent = {name: tensor for name, tensor in renamed if name not in fused}
        padded = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)}
        for name, parameter in model.named_parameters():
            if (tensor := sent.get(name)) is None:
                continue
            rows = name in padded and parameter.shape[1:] == tensor.shape[1:] and len(parameter) >= len(tensor)
            if not (parameter.shape == tensor.shape or rows):
                continue
            compared += 1
            if not torch.equal(parameter.data[: len(tensor)], tensor):
                differ.append(name)
        return {"version": version, "compared": compared, "differ": differ}

    def parameter_copies(self) -> bytes:
        """Every parameter of the engine's model (as vLLM names and fuses them), copied to the CPU, as the bytes of a
        safetensors file (safetensors.torch.load reads them back; vLLM's messages would turn tensors into lists)."""
        from safetensors.torch import save

        return save({name: p.detach().cpu().contiguous() for name, p in self.model_runner.model.named_parameters()})

    def cuda_memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()


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


def is_resource_tracker(process: psutil.Process) -> bool:
    return "multiprocessing.resource_tracker" in " ".join(process.cmdline())


def started_processes(before: set[int]) -> list[psutil.Process]:
    """Children of this process not in `before`, but for Python's resource tracker (multiprocessing starts it here for
    the engine: it must outlive the engine to clean up after it)."""
    started = []
    for process in psutil.Process().children(recursive=True):
        try:
            if process.pid not in before and not is_resource_tracker(process):
                started.append(process)
        except psutil.Error:
            pass
    return started


def release_shared_memory(paths: list[str]) -> None:
    """Unlink the message queues (psm_*) and the semaphores (sem.mp-*) of the engine's processes, dead now: killed by
    their shutdown's timeout or by a fault, they could not (vLLM's scheduler unlinks its queue only after its worker
    exits, seconds later). Python's resource tracker is told, or it would unlink them again at exit with a "leaked
    shared_memory (semaphore) objects" warning, after the run's last line. A file still mapped is left."""
    from multiprocessing import resource_tracker

    for path in release_orphaned_shared_memory(paths):
        name = os.path.basename(path)
        kind = "shared_memory" if name.startswith("psm_") else "semaphore"
        resource_tracker.unregister("/" + name.removeprefix("sem."), kind)  # the names Python registered


def mapped_inodes(folder: str = "/dev/shm", pids: list[int] | None = None) -> set[int]:
    """The inodes of the files in `folder` that these processes (None: any process) map. By inode, not name: glibc
    creates a named semaphore under a temporary name and then links it to its own, so the maps show the temporary
    name, deleted."""
    maps_files = Path("/proc").glob("[0-9]*/maps") if pids is None else [Path(f"/proc/{pid}/maps") for pid in pids]
    inodes = set()
    for maps in maps_files:
        try:
            inodes.update(int(line.split()[4]) for line in maps.read_text().splitlines() if f" {folder}/" in line)
        except OSError:
            pass  # a process gone, or not ours
    return inodes


def shared_memory_files(processes: list[psutil.Process], folder: str = "/dev/shm") -> list[str]:
    """The message queues (psm_*) and multiprocessing's named semaphores (sem.mp-*) in `folder` that these processes
    map: what their resource trackers would unlink at exit."""
    inodes = mapped_inodes(folder, [process.pid for process in processes])
    paths = [p for pattern in ("psm_*", "sem.mp-*") for p in Path(folder).glob(pattern)]
    return sorted(str(p) for p in paths if p.exists() and p.stat().st_ino in inodes)


def release_orphaned_shared_memory(
    paths: list[str] | None = None, folder: str = "/dev/shm", min_age: float = 60
) -> list[str]:
    """Unlink the message queues (psm_*) and multiprocessing's named semaphores (sem.mp-*) that no process maps any
    more: what a run killed together with its resource trackers (SIGKILL to its process group, the out-of-memory
    killer) leaves in RAM until the machine reboots (400 MiB an engine). `paths`: these (an engine's own), of any age;
    None: every such file of ours in `folder` unchanged for `min_age` seconds (a queue in use is written to, a newer
    one may belong to a run still starting). Returns what was unlinked."""
    mapped = mapped_inodes(folder)
    if paths is None:
        paths = [str(p) for pattern in ("psm_*", "sem.mp-*") for p in Path(folder).glob(pattern)]
        paths = [p for p in paths if os.stat(p).st_uid == os.getuid() and time.time() - os.stat(p).st_mtime > min_age]
    released = []
    for path in paths:
        try:
            if os.stat(path).st_ino not in mapped:
                os.unlink(path)
                released.append(path)
        except OSError:
            pass  # gone, or not ours
    return released


# The watchdog (`python -c`, with the functions start_watchdog lists), started before the engine. It watches the
# trainer's children (a second apart) and the shared memory files they and the trainer map, and blocks reading a pipe
# whose only write end the trainer holds. If the trainer dies, however it dies (kill -9 of it or of its process group
# included, during the engine's start too), the pipe closes: it then kills those children, which would live on
# re-parented to init (an engine holding its GPU), removes the weights folder, lets the trainer's resource tracker
# (if alive) unlink what it knows of and unlinks the rest of those files, unmapped now. Its input, a line each: the
# weights folder as JSON, then "done" when the trainer stopped its engine itself (it exits).
WATCHDOG = """
trainer, watched, trackers, files, folder, received = psutil.Process(os.getppid()), {}, {}, set(), None, b""
while True:
    if select.select([0], [], [], 1.0)[0]:
        if not (data := os.read(0, 65536)):
            break  # the trainer is dead: its end of the pipe closed
        *lines, received = (received + data).split(b"\\n")
        if b"done" in lines:
            sys.exit()
        folder = json.loads(lines[-1])["folder"] if lines else folder
    try:
        for process in trainer.children(recursive=True):
            if process.pid != os.getpid() and process.pid not in watched and process.pid not in trackers:
                (trackers if is_resource_tracker(process) else watched)[process.pid] = process
        watched = {pid: process for pid, process in watched.items() if process.is_running()}
        files.update(shared_memory_files([trainer, *watched.values()]))
    except psutil.Error:
        pass  # the trainer is gone, or a child: the pipe says so next
kill_process_trees(list(watched.values()))
if folder:
    shutil.rmtree(folder, ignore_errors=True)
psutil.wait_procs(list(trackers.values()), timeout=5)
release_orphaned_shared_memory(sorted(files))
"""


def start_watchdog() -> subprocess.Popen:
    """A process of its own session (a Ctrl-C to the terminal does not reach it) that cleans up after a trainer that
    died without doing so (WATCHDOG). Its stdin takes the weights folder (start_engine writes it), then "done"."""
    functions = [dead_processes, kill_process_trees, is_resource_tracker, mapped_inodes, shared_memory_files]
    functions += [release_orphaned_shared_memory]
    code = "\n".join(["import json, os, select, shutil, sys, time", "from pathlib import Path", "import psutil"])
    code += "\n" + "\n".join(inspect.getsource(function) for function in functions) + WATCHDOG
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, start_new_session=True, text=True)


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
        self.received, self.starting, self.weights_dir, self.watchdog = [], True, None, None
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.starting:
            os.write(2, f"\n{name} while starting: stopping the engine and exiting\n".encode())
            watchdog = self.watchdog.pid if self.watchdog else None  # it goes on to clean up after the exit
            kill_process_trees([process for process in started_processes(set()) if process.pid != watchdog])
            if self.weights_dir is not None:
                shutil.rmtree(self.weights_dir, ignore_errors=True)
            gc.freeze()  # see exit_quickly
            raise SystemExit(128 + signum)
        os.write(2, f"\n{name}: writing a checkpoint at the end of this step, then exiting\n".encode())
        self.received.append(signum)
        signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)


class Engine(NamedTuple):
    llm: "LLM"
    processes: list[psutil.Process]
    shared_memory: list[str]  # the files in /dev/shm it maps
    weights_dir: str  # a RAM-backed folder for the weights (CPUs)
    bucket: WeightBucket  # the push's, on the engine's device: what of the weight snapshots it holds
    watchdog: subprocess.Popen
    started: float  # time.perf_counter() once it was up: the timeline's origin


def start_engine(model: str, placement: Placement, signals: StopSignals, cores: list[int] | None, **llm_kwargs):
    """Rank 0's engine, started on `cores` (None: anywhere), after a watchdog that ends its processes if the trainer
    dies. `llm_kwargs` go to vLLM's LLM."""
    watchdog = signals.watchdog = start_watchdog()
    with on_cores(cores):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        if placement.devices is not None:  # the push's CUDA IPC handle is pickled, between our processes
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        llm = make_engine(model, placement, **llm_kwargs)
        processes = started_processes(before)
        ram = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        remove_stale_weights_folders(ram)
        release_orphaned_shared_memory()  # what runs killed with their watchdog left
        weights_dir = signals.weights_dir = tempfile.mkdtemp(prefix=f"policy-weights-{os.getpid()}-", dir=ram)
        watchdog.stdin.write(json.dumps({"folder": weights_dir}) + "\n")
        watchdog.stdin.flush()
    shared_memory = shared_memory_files(processes)
    bucket = WeightBucket(torch.device("cuda", placement.engine_gpu) if placement.devices else None, weights_dir)
    return Engine(
        llm=llm,
        processes=processes,
        shared_memory=shared_memory,
        weights_dir=weights_dir,
        bucket=bucket,
        watchdog=watchdog,
        started=time.perf_counter(),
    )


def stop_engine(engine: Engine | None, thread, stop) -> None:
    """Stop the generation thread (`stop`: its event) and the engine; the engine holds nothing to save, so nothing
    waits on its exit."""
    stop.set()
    if engine is None:
        return
    thread.join(timeout=1)  # it finishes the batch it is generating, or the engine's shutdown ends it
    engine.llm.llm_engine.engine_core.shutdown(timeout=1)
    thread.join(timeout=5)  # a daemon: a thread stuck on a dead engine does not keep the process alive
    # The engine's worker outlives its scheduler process, killed after 1 s, by seconds (a garbage collection), and
    # their message queues stay in shared memory: end both.
    kill_process_trees(engine.processes)
    release_shared_memory(engine.shared_memory)
    shutil.rmtree(engine.weights_dir, ignore_errors=True)
    engine.watchdog.stdin.write("done\n")  # nothing is left for it to clean up: it exits
    engine.watchdog.stdin.close()
    try:
        engine.watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def exit_quickly() -> None:
    """The interpreter's exit would garbage-collect the whole heap (seconds on a CPU); the OS frees it anyway."""
    gc.freeze()
