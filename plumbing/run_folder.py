"""2. The run's folder and its logs (its checkpoints: checkpoints.py).

<output_dir> (runs/<run name> by default) holds args.json, metrics.jsonl and TensorBoard's logs (wandb's with
--track), eval_completions/, checkpoints/step_NNNNNN and, at the end, policy/ (docs/checkpoints.md). RunFolder
is made before any model loads: rank 0 locks the folder (_FolderLock), so a second run in it is refused, and
checks it, so a bad --output_dir, --exp_name or --resume, a damaged checkpoint or too little space is said in
one line; it writes the folder once the engine is up (open), so a start stopped by a signal or a failure
leaves none. A checkpoint proves itself by its manifest (checkpoints.py); a full disk stops the run in one
line (_DiskFull). A step's timings and FLOPs (plumbing/timings.py) are logged with its metrics."""

import atexit
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list
from tqdm import tqdm

from plumbing.checkpoints import (
    Progress,
    checkpoint_to_resume,
    checkpoints_in,
    hold_trained_weights_only,
    holds_a_run,
    save_checkpoint,
    save_policy,
    trained_only_kwargs,
)
from plumbing.flags import RunArgs, UsageError
from plumbing.inputs import json_kind
from plumbing.tidy import write_atomically
from plumbing.timings import Laps, pipeline_metrics


class _DiskFull(UsageError):
    """The disk of --output_dir filled up during the run: said in one line (plumbing.run), like bad input,
    once the temporary files are removed."""


class RunFolder:
    """The run's folder (module docstring): its name and path, its lock (rank 0's), the checkpoint --resume
    continues from, the metrics' logs (rank 0's), the checkpoints and the final policy."""

    def __init__(self, args: RunArgs, processes, trained: list[str], async_level: int):
        """Before any model loads, the run's name and folder, which rank 0 claims (claim) for the run's
        `processes` (plumbing.Processes): `trained` are the models a checkpoint holds with their optimizer
        state (the policy's first), from which, with the `async_level` policy versions the engine may be
        behind, it estimates the space the run needs."""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.exp_name):
            raise UsageError(
                f"--exp_name {args.exp_name!r} must be a plain name (letters, digits, '_', '.', '-'): it "
                "names the run and its folder runs/<exp_name>__<seed>__<time>"
            )
        self.args, self.logger, self.bar, self.origin, self.episodes_per_step = args, None, None, 0.0, 0
        self.name = _name_run(args.exp_name, args.seed)
        self.path = args.output_dir or os.path.join("runs", self.name)
        self.lock, claimed = None, None
        if processes.is_main:
            try:
                claimed = self.claim(processes, trained, async_level)
            except (UsageError, SystemExit) as exc:  # every process stops with it
                claimed = exc
        claimed = processes.broadcast(claimed)
        if isinstance(claimed, BaseException):
            raise claimed
        self.checkpoint = claimed
        self.last_checkpoint = self.checkpoint  # the newest on disk, which a NaN loss names

    def claim(self, processes, trained: list[str], async_level: int) -> str | None:
        """Rank 0's checks of the folder, which it locks first (_FolderLock: writable, and no other run in
        it): the run it holds, and the checkpoint --resume continues from (checkpoint_to_resume), with a
        line for a cut-off last line of metrics.jsonl, which is dropped, and one for the temporary files a
        run killed while writing them left, which go; and the free space, against the run's own estimate of
        what its checkpoints and final policy need (_check_space). Returns the checkpoint."""
        args, path = self.args, self.path
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"--output_dir {path} is a file, not a folder: choose another --output_dir")
        if args.resume and args.output_dir is None:
            raise UsageError("--resume needs --output_dir, the folder of the run to continue")
        if args.resume and not os.path.exists(os.path.join(path, "args.json")) and not holds_a_run(path):
            raise UsageError(
                f"--resume: --output_dir {path} holds no run (no args.json): check the folder, or leave out "
                "--resume to start a new run"
            )
        self.lock = _FolderLock(path)
        try:
            world_size = processes.accelerator.num_processes
            checkpoint = checkpoint_to_resume(path, asdict(args), args.resume, world_size)
            if (cut := _metrics_lines(os.path.join(path, "metrics.jsonl"))[1]) is not None:
                print(
                    f"--resume: the last line of metrics.jsonl was cut off ({len(cut)} characters): dropped"
                )
            if args.resume and (left := _remove_temporary_files(path)):
                print(
                    f"--resume: removed {', '.join(left)}, left half-written by a run killed while writing it"
                )
            with processes.whole_models():  # no ZeRO-3 partitioning, whose collectives rank 1 is not in
                parameters = [_parameter_count(model, args.trust_remote_code) for model in trained]
            deepspeed, engine_bytes = processes.zero_stage > 0, processes.engine_dtype.itemsize
            each = _checkpoint_bytes(parameters, engine_bytes, async_level, deepspeed)
            at_most = args.keep_checkpoints + 1 if args.save_freq else 1  # the kept ones and a new one
            count = max(0, at_most - len(checkpoints_in(path)))
            _check_space(path, each, count, final_policy=4 * parameters[0])
        except BaseException:
            self.lock.release()
            raise
        return checkpoint

    def resume(self, accelerator: Accelerator, scheduler, *more) -> "Progress":
        """Where the run is (Progress), once the objects a checkpoint saves beside accelerate's own (the
        trained weights, the optimizer, the RNGs) are registered in this order: the LR scheduler, Progress and
        the algorithm's own (`more`); all as the checkpoint --resume continues from left them, if any."""
        progress = Progress(self.args.seed)
        accelerator.register_for_checkpointing(scheduler, progress, *more)
        if self.args.lora_rank:  # checkpoints of the adapter, not of the frozen base model
            hold_trained_weights_only(accelerator)
        if self.checkpoint:
            accelerator.load_state(self.checkpoint, **self.trained_only(accelerator, saving=False))
        if not accelerator.is_main_process:  # what it says is rank 0's, once for the run
            return progress
        if self.checkpoint:
            print(f"resuming from {self.checkpoint} (step {progress.step})")
        elif self.args.resume:
            print(f"--resume: no checkpoint in {self.path} yet, starting at step 0")
        return progress

    def open(self, sizes: dict, progress: "Progress", origin: float, episodes_per_step: int) -> None:
        """Rank 0 writes args.json (the flags, `sizes`, the git revision) and opens the logs; on resume,
        metrics.jsonl loses what the interrupted run logged after its checkpoint: those steps are trained
        again. `origin`: the time.perf_counter() the timeline counts from (the engine up);
        `episodes_per_step`: the completions a step trains on, which count a step's episode."""
        self.origin, self.episodes_per_step = origin, episodes_per_step
        if not PartialState().is_main_process:
            return
        args, metrics = self.args, os.path.join(self.path, "metrics.jsonl")
        with self.writing("args.json and the logs"):
            _keep_metrics_before(metrics, progress.step, progress.evals_logged)
            run_args = asdict(args) | sizes | {"output_dir": self.path, "git_revision": _git_revision()}
            write_atomically(os.path.join(self.path, "args.json"), json.dumps(run_args, indent=2))
            tracking = (args.track, args.wandb_project, args.wandb_entity)
            self.logger = _MetricsLogger(self.path, self.name, asdict(args), *tracking)

    def steps(self, start: int, end: int):
        """The steps from `start` to `end`, with rank 0's progress bar, which `log` annotates."""
        shown = PartialState().is_main_process
        self.bar = tqdm(range(start, end), initial=start, total=end, disable=not shown, desc="steps")
        return self.bar

    def log(self, metrics: dict, laps: "Laps", generator: dict, flops: dict, tokens: float) -> None:
        """A training step's line of metrics.jsonl, rank 0's: `metrics` and its timings
        (pipeline_metrics)."""
        if self.logger is not None:
            timings = pipeline_metrics(laps, generator, self.origin, flops, self.episodes_per_step, tokens)
            with self.writing("metrics.jsonl"):
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
            with self.writing(f"eval_completions/step_{arrived.version:06d}.jsonl and metrics.jsonl"):
                self.logger.log_evaluation(arrived.version, episode, metrics, rows, texts)

    def save_checkpoint(self, accelerator: Accelerator, progress: "Progress", owed: dict[int, list]) -> None:
        """A checkpoint for a trainer about to run step `progress.step` (save_checkpoint), with `owed`."""
        with self.writing(f"checkpoints/step_{progress.step:06d}"):
            keep, trained_only = self.args.keep_checkpoints, self.trained_only(accelerator, saving=True)
            self.last_checkpoint = save_checkpoint(accelerator, self.path, progress, owed, keep, trained_only)

    def trained_only(self, accelerator: Accelerator, saving: bool) -> dict:
        """DeepSpeed's arguments that leave the frozen weights out of a checkpoint under LoRA (none
        otherwise)."""
        return trained_only_kwargs(accelerator, saving) if self.args.lora_rank else {}

    def stopped(self, step: int) -> None:
        """Rank 0 says where the run stopped and what resumes it."""
        if PartialState().is_main_process:
            resume = f"; resume from {self.last_checkpoint} with --resume" if self.last_checkpoint else ""
            print(f"stopped before step {step}{resume}")

    def save_policy(self, accelerator: Accelerator, model, tokenizer, prefix: str = "") -> None:
        """The trained policy, as policy/ (save_policy; under LoRA its adapter, and with --lora_save_merged
        the adapter merged into the base model as policy_merged/)."""
        merged = os.path.join(self.path, "policy_merged") if self.args.lora_save_merged else None
        with self.writing("policy/"):
            save_policy(accelerator, model, tokenizer, os.path.join(self.path, "policy"), prefix, merged)

    @contextmanager
    def writing(self, what: str):
        """Writes `what` into the folder: a full disk (_disk_full) stops the run with one line naming the path
        and the flag (_DiskFull), once the temporary files are removed, so that the --resume that follows has
        the space they took."""
        try:
            yield
        except Exception as exc:
            if not _disk_full(exc, self.path):
                raise
            _remove_temporary_files(self.path)
            then = f"continues from {self.last_checkpoint}" if self.last_checkpoint else "starts the run over"
            raise _DiskFull(
                f"no space left on the device of --output_dir {self.path} (writing {what}): free some, and "
                f"--resume {then}"
            ) from exc

    def close(self) -> None:
        """The logs, closed; the folder's lock, released (on every process but rank 0: nothing)."""
        try:
            if self.logger is not None:
                with self.writing("the logs"):
                    self.logger.close()
        finally:
            if self.lock is not None:
                self.lock.release()

    def __enter__(self) -> "RunFolder":
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is None:
            self.close()
            return
        with suppress(Exception):  # the logs of a run that failed, on a full disk maybe: its error is the one
            self.close()


# == Naming ==================================================================================================
def _name_run(exp_name: str, seed: int) -> str:
    """<exp_name>__<seed>__<unix time>, as rank 0 sees it: another rank's clock may be in the next second."""
    return broadcast_object_list([f"{exp_name}__{seed}__{int(time.time())}"])[0]


class _FolderLock:
    """The run folder's lock, run.lock, held by the process that writes the folder (rank 0) from its first
    check to the run's end: an fcntl lock, and in the file the holder's pid and host, so that a second run or
    a second --resume in the folder is refused naming that process. The lock dies with its process: a file
    left by a process that is gone (kill -9) is taken over. The file, and the folders made for it while
    still empty, go when the lock is released or its process exits."""

    def __init__(self, folder: str):
        self.path, self.made = os.path.join(folder, "run.lock"), []
        parent = os.path.abspath(folder)
        while not os.path.exists(parent):  # the folders makedirs makes, removed with the lock if left empty
            self.made.append(parent)
            parent = os.path.dirname(parent)
        try:
            os.makedirs(folder, exist_ok=True)
            self.fd = self.take(folder)
        except OSError as exc:
            self.remove_made_folders()
            raise UsageError(
                f"--output_dir {folder} is not writable ({exc.strerror}): choose another --output_dir"
            ) from exc
        atexit.register(self.release)

    def take(self, folder: str) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.holder(fd) or "another process"
                os.close(fd)
                self.remove_made_folders()
                raise UsageError(
                    f"--output_dir {folder} is in use by {holder}, which holds {self.path}: wait for that "
                    "run to end, or choose another --output_dir"
                ) from None
            with suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(fd), os.stat(self.path)):
                    break
            os.close(fd)  # its holder removed the file as this process opened it: lock the new one
        if left := self.holder(fd):
            print(f"--output_dir {folder}: {self.path} was left by {left}, which is gone: taking it over")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
        return fd

    @staticmethod
    def holder(fd: int) -> str | None:
        """Who holds (or held) a lock file, as it says: "process <pid> on <host>"."""
        try:
            holder = json.loads(os.pread(fd, 4096, 0))
            return f"process {holder['pid']} on {holder['host']}"
        except (ValueError, KeyError, TypeError):
            return None

    def release(self) -> None:
        if self.fd is None:
            return
        with suppress(FileNotFoundError):
            if os.path.samestat(os.fstat(self.fd), os.stat(self.path)):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None
        self.remove_made_folders()

    def remove_made_folders(self) -> None:
        for folder in self.made:  # the deepest first
            try:
                os.rmdir(folder)
            except OSError:
                return


# == The space the run needs, a full disk ====================================================================
def _parameter_count(path: str, trust_remote_code: bool) -> int:
    """The parameters of the model at `path` (a folder or a hub id), counted on the meta device from its
    config: no weight is read. 0 when its config cannot be read (load_inputs then names the path), or the
    model cannot be built from it there (its loading then says why): no estimate."""
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return 0
    architecture = getattr(transformers, (config.architectures or [""])[0], None)
    try:
        with torch.device("meta"):
            if architecture is None:
                auto = transformers.AutoModelForCausalLM
                model = auto.from_config(config, trust_remote_code=trust_remote_code)
            else:
                model = architecture._from_config(config)
    except Exception:
        return 0
    return sum(p.numel() for p in model.parameters())


def _checkpoint_bytes(trained: list[int], engine_bytes: int, async_level: int, deepspeed: bool) -> int:
    """A checkpoint's size by the run's own estimate: the `trained` models' parameters (the policy's first)
    as fp32 weights and AdamW's two fp32 moments, 12 bytes a parameter (16 under DeepSpeed, which also
    saves its own copy of the weights); and up to async_level + 1 older policies the generator still owes a
    batch or an evaluation, at the engine's `engine_bytes` a parameter."""
    return sum(trained) * (16 if deepspeed else 12) + trained[0] * engine_bytes * (async_level + 1)


def _check_space(output_dir: str, checkpoint: int, count: int, final_policy: int) -> None:
    """`count` more checkpoints of `checkpoint` bytes and the final policy fit in `output_dir`'s free space,
    or the run is refused, saying how much is missing."""
    needed, free = count * checkpoint + final_policy, shutil.disk_usage(output_dir).free
    if needed > free:
        raise UsageError(
            f"--output_dir {output_dir} has {_size_text(free)} free, and this run would write about "
            f"{_size_text(needed)} there: {count} checkpoint(s) of {_size_text(checkpoint)} at once "
            "(--keep_checkpoints and the one being written) and its final policy, "
            f"{_size_text(final_policy)}; free some space, choose another --output_dir, or lower "
            "--keep_checkpoints"
        )


def _size_text(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _disk_full(error: BaseException, path: str) -> bool:
    """Whether `error` came from a full disk under `path`: an OSError saying so (no space, or over quota)
    anywhere in its chain; or, as some writers lose the error's number (torch.save), no space left there."""
    chain = []
    while error is not None and error not in chain:
        chain.append(error)
        error = error.__cause__ or error.__context__
    if any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in chain):
        return True
    if any("No space left on device" in str(e) or "Disk quota exceeded" in str(e) for e in chain):
        return True  # safetensors'
    with suppress(OSError):
        return shutil.disk_usage(path).free < 2**20
    return False


def _remove_temporary_files(output_dir: str) -> list[str]:
    """The *.tmp files and folders the run writes before it renames them (write_atomically,
    save_checkpoint, save_policy), in the folder and its subfolders (checkpoints/, eval_completions/),
    removed: what a full disk or a kill left half-written, which no run reads. Returns their paths in the
    folder."""
    removed = []
    for temporary in sorted([*Path(output_dir).glob("*.tmp"), *Path(output_dir).glob("*/*.tmp")]):
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        removed.append(str(temporary.relative_to(output_dir)))
    return removed


def _git_revision() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, stderr=subprocess.DEVNULL, text=True
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _keep_metrics_before(metrics: str, start_step: int, evals_logged: set[int]) -> None:
    """metrics.jsonl without the training steps from `start_step` on and the evaluations not in
    `evals_logged`, and without a last line cut off (_metrics_lines)."""
    if not os.path.exists(metrics):
        return
    kept = []
    for line in _metrics_lines(metrics)[0]:
        logged = json.loads(line)
        is_eval = any(key.startswith("eval/") for key in logged)
        if (logged["step"] in evals_logged) if is_eval else (logged["step"] < start_step):
            kept.append(line + "\n")
    write_atomically(metrics, "".join(kept))


def _metrics_lines(metrics: str) -> tuple[list[str], str | None]:
    """The lines of metrics.jsonl (none if it is missing), and apart its last one when a kill or a full disk
    cut it off (it is not JSON). A line before the last that is not JSON, and one that is JSON but not a
    metrics record (an object with an integer step), is a UsageError naming it."""
    try:
        lines = Path(metrics).read_text(errors="replace").splitlines() if os.path.exists(metrics) else []
    except OSError as exc:
        raise UsageError(f"--resume: {metrics} cannot be read ({exc.strerror}): mend or delete it") from None
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return lines[:-1], line
            raise UsageError(f"--resume: {metrics} line {number} is not JSON ({exc.msg}): mend or delete it")
        if not (isinstance(record, dict) and type(record.get("step")) is int):
            kind = json_kind(record)
            what = "an object without an integer step" if kind == "object" else f"a JSON {kind}"
            raise UsageError(
                f"--resume: {metrics} line {number} is not a metrics record (a JSON object with its step), "
                f"it is {what}: mend or delete it"
            )
    return lines, None


# == Logging =================================================================================================
class _MetricsLogger:
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
        _write_eval_completions(self.output_dir, step, episode, *texts)
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


def _write_eval_completions(
    output_dir: str, step: int, episode: int, prompts, completions, references
) -> str:
    """eval_completions/step_NNNNNN.jsonl, one row per eval prompt, for judges that run after training
    (tasks/llm_judge.py); a resumed run replaces a step's file."""
    folder = os.path.join(output_dir, "eval_completions")
    os.makedirs(folder, exist_ok=True)
    rows = [
        dict(step=step, episode=episode, prompt=p, completion=c, reference=r)
        for p, c, r in zip(prompts, completions, references)
    ]
    path = os.path.join(folder, f"step_{step:06d}.jsonl")
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path
