"""2. The run's folder, its checkpoints and its logs.

<output_dir> (runs/<run name> by default) holds args.json, metrics.jsonl and TensorBoard's logs (wandb's with
--track), eval_completions/, checkpoints/step_NNNNNN and, at the end, policy/ (docs/checkpoints.md). RunFolder
is made before any model loads, so a bad --output_dir, --exp_name or --resume is refused in one line, and
written by rank 0 once the engine is up (open), so a start stopped by a signal or a failure leaves none. A
step's timings (Laps) and FLOPs (forward_flops) are logged with its metrics."""

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from plumbing.command_line import UsageError

# Flags that may change when a run is resumed; any other must be what the run started with.
RESUMABLE_CHANGES = {"resume", "output_dir", "track", "wandb_project", "wandb_entity", "save_freq"}
RESUMABLE_CHANGES |= {"keep_checkpoints", "num_sample_completions", "collective_timeout_minutes"}
RESUMABLE_CHANGES |= {"engine_timeout_minutes"}
# 3: the LR schedule steps once a step; 2: the shuffle generators in Progress; 1: in files
CHECKPOINT_FORMAT = 3


class RunFolder:
    """The run's folder (module docstring): its name and path, the checkpoint --resume continues from, the
    metrics' logs (rank 0's), the checkpoints and the final policy."""

    def __init__(self, args, world_size: int):
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.exp_name):
            raise UsageError(
                f"--exp_name {args.exp_name!r} must be a plain name (letters, digits, '_', '.', '-'): it "
                "names the run and its folder runs/<exp_name>__<seed>__<time>"
            )
        self.args, self.logger, self.bar, self.origin, self.episodes_per_step = args, None, None, 0.0, 0
        self.name = name_run(args.exp_name, args.seed)
        self.path = args.output_dir or os.path.join("runs", self.name)
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise UsageError(f"--output_dir {self.path} is a file, not a folder: choose another --output_dir")
        if args.resume and args.output_dir is None:
            raise UsageError("--resume needs --output_dir, the folder of the run to continue")
        self.checkpoint = checkpoint_to_resume(self.path, asdict(args), args.resume, world_size)
        self.last_checkpoint = self.checkpoint  # the newest on disk, which a NaN loss names

    def resume(self, accelerator: Accelerator, scheduler, *more) -> "Progress":
        """Where the run is (Progress), once the objects a checkpoint saves beside accelerate's own (the
        trained weights, the optimizer, the RNGs) are registered in this order: the LR scheduler, Progress and
        the algorithm's own (`more`); all as the checkpoint --resume continues from left them, if any."""
        progress = Progress(self.args.seed)
        accelerator.register_for_checkpointing(scheduler, progress, *more)
        if self.checkpoint:
            accelerator.load_state(self.checkpoint)
            print(f"resuming from {self.checkpoint} (step {progress.step})")
        elif self.args.resume:
            print(f"--resume: no checkpoint in {self.path} yet, starting at step 0")
        return progress

    def open(self, sizes: dict, progress: "Progress", origin: float) -> None:
        """Rank 0 writes args.json (the flags, `sizes`, the git revision) and opens the logs; on resume,
        metrics.jsonl loses what the interrupted run logged after its checkpoint: those steps are trained
        again. `origin`: the time.perf_counter() the timeline counts from (the engine up)."""
        self.origin, self.episodes_per_step = origin, sizes["episodes_per_step"]
        if not PartialState().is_main_process:
            return
        args = self.args
        os.makedirs(self.path, exist_ok=True)
        keep_metrics_before(os.path.join(self.path, "metrics.jsonl"), progress.step, progress.evals_logged)
        run_args = asdict(args) | sizes | {"output_dir": self.path, "git_revision": git_revision()}
        write_atomically(os.path.join(self.path, "args.json"), json.dumps(run_args, indent=2))
        tracking = (args.track, args.wandb_project, args.wandb_entity)
        self.logger = MetricsLogger(self.path, self.name, asdict(args), *tracking)

    def steps(self, start: int, end: int):
        """The steps from `start` to `end`, with rank 0's progress bar, which `log` annotates."""
        shown = PartialState().is_main_process
        self.bar = tqdm(range(start, end), initial=start, total=end, disable=not shown, desc="steps")
        return self.bar

    def log(self, metrics: dict, laps: "Laps", generator: dict, flops: dict, tokens: float) -> None:
        """A training step's line of metrics.jsonl, rank 0's: `metrics` and its timings (pipeline_metrics)."""
        if self.logger is not None:
            timings = pipeline_metrics(laps, generator, self.origin, flops, self.episodes_per_step, tokens)
            self.logger.log(metrics | timings)
            score, kl = f"{metrics['objective/scores']:.3f}", f"{metrics['objective/kl']:.2f}"
            self.bar.set_postfix(lag=metrics["async/lag"], score=score, kl=kl)

    def log_evaluation(
        self, arrived, metrics: dict, rows: list[dict], completions: list[str], prompts
    ) -> None:
        """An evaluation of policy version `arrived.version` (an EvalRollout): its metrics with the time its
        generation took, a sample table (`rows`, printed too) and its `completions` of `prompts` (the eval
        split)."""
        metrics = metrics | {
            "time/eval_generation": arrived.generation_time,
            "timeline/eval_generation_start": arrived.generation_start - self.origin,
        }
        if self.logger is not None:  # under ZeRO-3 every process evaluates; rank 0 logs
            texts = (prompts.queries, completions, prompts.references)
            episode = arrived.version * self.episodes_per_step
            self.logger.log_evaluation(arrived.version, episode, metrics, rows, texts)

    def save_checkpoint(self, accelerator: Accelerator, progress: "Progress", owed: dict[int, list]) -> None:
        """A checkpoint for a trainer about to run step `progress.step` (save_checkpoint), with `owed`."""
        self.last_checkpoint = save_checkpoint(
            accelerator, self.path, progress, owed, self.args.keep_checkpoints
        )

    def stopped(self, step: int) -> None:
        resume = f"; resume from {self.last_checkpoint} with --resume" if self.last_checkpoint else ""
        print(f"stopped before step {step}{resume}")

    def save_policy(self, accelerator: Accelerator, model, tokenizer, prefix: str = "") -> None:
        """The trained policy, as policy/ (save_policy)."""
        save_policy(accelerator, model, tokenizer, os.path.join(self.path, "policy"), prefix)

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, kind, error, trace) -> None:
        self.close()


# == Naming, resuming ========================================================================================
def name_run(exp_name: str, seed: int) -> str:
    """<exp_name>__<seed>__<unix time>, as rank 0 sees it: another rank's clock may be in the next second."""
    return broadcast_object_list([f"{exp_name}__{seed}__{int(time.time())}"])[0]


def holds_a_run(output_dir: str) -> bool:
    """Whether a run logged or saved anything there (one stopped while starting left only args.json)."""
    metrics, checkpoints = Path(output_dir, "metrics.jsonl"), Path(output_dir, "checkpoints")
    logged = metrics.exists() and metrics.stat().st_size > 0
    return logged or any(checkpoints.glob("step_*")) or Path(output_dir, "policy").exists()


def checkpoints_in(output_dir: str) -> list[Path]:
    return sorted(
        p for p in Path(output_dir, "checkpoints").glob("step_*") if re.fullmatch(r"step_\d{6}", p.name)
    )


def checkpoint_to_resume(output_dir: str, flags: dict, resume: bool, world_size: int) -> str | None:
    """The checkpoint a run continues from (None: it starts at step 0); two runs never share a folder. Exits
    (0) on --resume of a finished run, whose final policy is saved at the very end."""
    if not resume:
        if holds_a_run(output_dir):
            raise UsageError(
                f"--output_dir {output_dir} holds another run: pass --resume to continue it, or choose "
                "another --output_dir"
            )
        return None
    if os.path.isdir(policy := os.path.join(output_dir, "policy")):
        if PartialState().is_main_process:
            print(
                f"--resume: the run in {output_dir} is finished (its final policy is {policy}): nothing to do"
            )
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
                f"--resume: {', '.join(changed)} differ from the run in --output_dir {output_dir}; resume it "
                "with its own flags"
            )
    if not (checkpoints := checkpoints_in(output_dir)):
        return None
    format_file = checkpoints[-1] / "format.json"
    if not format_file.exists() or json.loads(format_file.read_text()) != {"format": CHECKPOINT_FORMAT}:
        raise UsageError(
            f"--resume: {checkpoints[-1]} is not a checkpoint of this version (format {CHECKPOINT_FORMAT}): "
            "resume it with the version that wrote it"
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


def keep_metrics_before(metrics: str, start_step: int, evals_logged: set[int]) -> None:
    """metrics.jsonl without the training steps from `start_step` on and the evaluations not in
    `evals_logged`."""
    if not os.path.exists(metrics):
        return
    kept = []
    for line in Path(metrics).read_text().splitlines():
        logged = json.loads(line)
        is_eval = any(key.startswith("eval/") for key in logged)
        if (logged["step"] in evals_logged) if is_eval else (logged["step"] < start_step):
            kept.append(line + "\n")
    write_atomically(metrics, "".join(kept))


# == Checkpoints =============================================================================================
class Progress:
    """Where the run is: the next step, the evaluations logged, and every process's shuffle generator (its
    state is gathered from all of them, as accelerate saves a registered object from rank 0 only). Saved by
    accelerate with the trainer's state."""

    def __init__(self, seed: int):
        self.step, self.evals_logged = 0, set()
        self.shuffle = np.random.default_rng([seed, PartialState().process_index])

    def state_dict(self) -> dict:
        shuffles = gather_object([self.shuffle.bit_generator.state])
        return {"step": self.step, "evals_logged": sorted(self.evals_logged), "shuffle": shuffles}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evals_logged = state["step"], set(state["evals_logged"])
        self.shuffle.bit_generator.state = state["shuffle"][PartialState().process_index]


def save_checkpoint(
    accelerator: Accelerator, output_dir: str, progress: Progress, owed: dict[int, list], keep: int
):
    """Everything a resumed run needs to go on exactly: accelerate's `save_state` (the trained weights as
    safetensors, the optimizer, the registered objects such as the scheduler and Progress, RNG states) and the
    older policy versions the generator still owes batches or evaluations (`owed`: version -> [(name,
    tensor)]), so no engine state is needed. Written to a temporary folder, then renamed; then all but the
    `keep` newest checkpoints are deleted. Returns its path."""
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
        for old in checkpoints_in(output_dir)[:-keep]:  # the newest, just written, is the one a resume reads
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def follow_umask(path: str) -> None:
    """Give the files under `path` the permissions the umask allows, as any file the run writes: safetensors
    (and so save_pretrained and save_state) creates its files with 0600, which another user of a shared
    cluster cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for file in [Path(path)] if os.path.isfile(path) else Path(path).rglob("*"):
        if file.is_file():
            os.chmod(file, 0o666 & ~mask)


def load_owed_version(checkpoint: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint, f"version_{version:06d}.safetensors"))


def save_policy(accelerator: Accelerator, model, tokenizer, path: str, prefix: str = "") -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: no half-written model. `prefix`:
    the policy's submodule in `model` (PPO's `policy.`)."""
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


# == Logging =================================================================================================
class MetricsLogger:
    """metrics.jsonl (one JSON object per line, each with step and episode), TensorBoard, wandb. Written by
    hand, not with accelerate's trackers: `Accelerator.log` gives every backend one step, and wandb drops a
    row whose step goes back, which every evaluation does (it is logged after the training steps that followed
    it)."""

    def __init__(
        self, output_dir: str, run_name: str, config: dict, track: bool, project: str, entity: str | None
    ):
        from tensorboardX import SummaryWriter

        self.output_dir = output_dir
        self.file = open(os.path.join(output_dir, "metrics.jsonl"), "a")
        self.writer = SummaryWriter(os.path.join(output_dir, "tensorboard"))
        self.wandb = None
        if track:
            import wandb

            self.wandb = wandb.init(
                project=project, entity=entity, name=run_name, config=config, dir=output_dir
            )
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
            query = row["query"] if len(row["query"]) <= 80 else "..." + row["query"][-77:]  # what it follows
            details = ", ".join(f"{k} {v!r}" for k, v in row.items() if k not in ("query", "response"))
            print(f"  [step {step}] {query!r} -> {row['response']!r} ({details})")

    def log_evaluation(self, step: int, episode: int, metrics: dict, rows: list[dict], texts: tuple) -> None:
        """An evaluation: its metrics and a sample table (both also printed), and `texts` (prompts,
        completions, references) to eval_completions/step_NNNNNN.jsonl."""
        write_eval_completions(self.output_dir, step, episode, *texts)
        self.log_samples(step, episode, rows)
        self.log({"step": step, "episode": episode, **metrics})
        print(
            f"eval step {step}: "
            + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if k.startswith("eval/"))
        )

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
    """A training step's phases, timed one after the other: `lap(name)` ends phase `name`, begun where the
    previous one ended. The first phase is the wait for the step's rollouts; the others are its training."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds, self.begun = {}, {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.begun[name], self.last = now - self.last, self.last, now


def pipeline_metrics(
    laps: Laps, generator: dict, origin: float, flops: dict, episodes: int, tokens: float
) -> dict:
    """A step's figures of the async pipeline: the seconds of each phase, the trainer's (`laps`) and the
    generator's (`generator`: name -> (start or None, seconds)); their starts (`timeline/`, seconds since
    `origin`); the FLOPs of the trainer's phases; the throughput of the `episodes` and (response) `tokens`
    trained on."""
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


def numel(tensor: torch.Tensor) -> int:
    """A parameter's size, whole: ZeRO-3 leaves each process a shard of it."""
    return getattr(tensor, "ds_numel", tensor.numel())


def forward_flops(model, sequences: int, length: int, logit_positions: int | None = None) -> int:
    """Matmul FLOPs of a forward pass, 2 per parameter and token (Kaplan et al. 2020, no attention term):
    every token through the body, `logit_positions` per sequence (None: all) through the output head, none
    through the input embedding (a lookup). A training pass is 3 forwards' worth, 4 when recomputing
    activations."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_params = 0 if head is None else numel(head.weight)
    tied = head is not None and head.weight is embedding
    body = sum(numel(p) for p in model.parameters()) - numel(embedding) - (0 if tied else head_params)
    head_tokens = length if logit_positions is None else logit_positions
    return 2 * sequences * (body * length + head_params * head_tokens)
