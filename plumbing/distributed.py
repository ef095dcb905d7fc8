"""3. The training processes: accelerate's process group and Accelerator, DeepSpeed's ZeRO stages, and the
helpers every process calls together (collectives): the frozen models' preparation, the gathers of the
weights, the statistics averaged over the processes and the checks of what each process computed."""

import datetime
import os
import re
import socket
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import psutil
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, parse_flag_from_env

from plumbing.flags import RunArgs
from plumbing.inflight import check_inflight_flags
from plumbing.lora import check_lora_flags


class Processes:
    """The training processes of a run, made first: accelerate's process group (see _process_state) and its
    Accelerator; the dtype of the trainer's models (--dtype auto: bfloat16 on GPUs, as autocast over fp32
    weights for the policy and the reference, and bf16 weights for the reward and gold models) and of the
    engine's. DeepSpeed's config takes the trainer's batch and clipping (`local_micro_batch_size`,
    `gradient_accumulation_steps`, `max_grad_norm`: None, no clipping) as its own."""

    def __init__(
        self,
        args: RunArgs,
        local_micro_batch_size: int,
        gradient_accumulation_steps: int,
        max_grad_norm: float | None,
    ):
        state = _process_state(args.collective_timeout_minutes)
        self.on_gpu = state.device.type == "cuda"
        bf16 = args.dtype == "bfloat16" or (args.dtype == "auto" and self.on_gpu)
        self.dtype = torch.bfloat16 if bf16 else torch.float32
        dtypes = {"auto": self.dtype, "float32": torch.float32, "bfloat16": torch.bfloat16}
        self.engine_dtype = dtypes[args.vllm_dtype]
        self.accelerator = Accelerator(
            gradient_accumulation_steps=gradient_accumulation_steps,
            mixed_precision="bf16" if bf16 else "no",
        )
        # fp32 matmuls on tensor cores
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        # DeepSpeed wants these in its own config
        if (deepspeed := self.accelerator.state.deepspeed_plugin) is not None:
            deepspeed.deepspeed_config["train_micro_batch_size_per_gpu"] = local_micro_batch_size
            deepspeed.deepspeed_config["gradient_accumulation_steps"] = gradient_accumulation_steps
            deepspeed.deepspeed_config["gradient_clipping"] = max_grad_norm or 0.0  # 0: no clipping
        self.is_main = self.accelerator.is_main_process
        self.zero_stage = _zero_stage(self.accelerator)
        check_lora_flags(args, self.zero_stage)  # before any model loads
        check_inflight_flags(args)
        # each process's machine and pid, by rank: what names a process that dies (lost)
        place = (socket.gethostname(), os.getpid())
        self.places = gather_object([place]) if self.accelerator.num_processes > 1 else [place]

    @property
    def evaluates(self) -> bool:
        """Whether this process evaluates: rank 0, and under ZeRO-3 every process, as all take part in the
        sharded frozen models' forward passes."""
        return self.is_main or self.zero_stage == 3

    def broadcast(self, value):
        """Rank 0's `value`, on every process."""
        return broadcast_object_list([value])[0]

    def lost(self, error: BaseException) -> tuple[str, bool] | None:
        """When `error` is a collective that failed because another training process died or stopped answering
        (_lost_peer), the line that says which process of how many, and whether this process says it: rank
        0, or the first process alive if rank 0 is among the dead. None: another error."""
        if len(self.places) < 2 or not _lost_peer(error):
            return None
        here, count = socket.gethostname(), len(self.places)
        # the process that left may still be dying: a killed one is gone in a moment, a failing one exits
        deadline = time.monotonic() + _DYING_SECONDS
        while not (dead := _dead_ranks(self.places, here)) and time.monotonic() < deadline:
            time.sleep(0.1)
        rank = self.accelerator.process_index
        speaks = rank == 0 or (0 in dead and rank == min(set(range(count)) - set(dead)))
        if not dead:  # one that hangs, or one on another machine
            # gloo says "[its source file:line] Read error [address]: Connection reset by peer. This is ..."
            cause = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip()).split(". ")[0].splitlines()[0]
            return f"a training process of {count} stopped answering ({cause})", speaks
        named = ", ".join(f"{r} (pid {self.places[r][1]})" for r in dead)
        return f"training process{'es' if len(dead) > 1 else ''} {named} of {count} died", speaks

    def prepare_frozen(self, model):
        return _prepare_frozen(model, self.accelerator)

    def whole_models(self):
        return _whole_models(self.accelerator)

    def check_scores(self, scores: torch.Tensor, source: str, step: int) -> None:
        """Stop on a NaN or infinite reward before it is paired or turned into advantages, naming the step and
        the `source`: every process sees every score, so all of them stop."""
        check_scores(self.accelerator.gather(scores), source, step)

    def mean(self, stats: dict, step: int, last_checkpoint: str | None) -> dict:
        """A step's statistics (tensors) averaged over the processes. A non-finite loss stops the run before
        any checkpoint has it."""
        means = self.accelerator.reduce(torch.stack(list(stats.values())), "mean").tolist()
        reduced = dict(zip(stats, means))
        if not np.isfinite(reduced["loss"]):
            last = f"; the last good one is {last_checkpoint} (--resume)" if last_checkpoint else ""
            raise RuntimeError(
                f"loss is {reduced['loss']} at step {step}: stopping before it reaches a checkpoint{last}"
            )
        return reduced


def check_scores(scores: torch.Tensor, source: str, step: int) -> None:
    """A RuntimeError naming the step, the source and the first bad values when a score is NaN or infinite."""
    if bad := (~torch.isfinite(scores)).nonzero().flatten().tolist():
        values = ", ".join(str(scores[i].item()) for i in bad[:4]) + (", ..." if len(bad) > 4 else "")
        raise RuntimeError(
            f"{source} gave nan/inf scores at step {step} ({len(bad)} of {len(scores)} completions: {values})"
        )


_DYING_SECONDS = 3.0  # how long a process another one saw leave a collective may take to be seen dead


def _lost_peer(error: BaseException) -> bool:
    """Whether a collective raised `error` because another process left it: torch's DistError, or the
    RuntimeError gloo raises when a peer's connection closes or a wait times out."""
    text = str(error)
    return isinstance(error, torch.distributed.DistError) or any(
        marker in text
        for marker in ("gloo/transport", "Connection reset by peer", "Connection closed by peer")
    )


def _dead_ranks(places: list[tuple[str, int]], host: str) -> list[int]:
    """The ranks of the processes on `host` (this machine) that have died (a zombie has)."""
    dead = []
    for rank, (machine, pid) in enumerate(places):
        try:
            gone = machine == host and psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            gone = True
        if gone:
            dead.append(rank)
    return dead


def _process_state(timeout_minutes: float) -> PartialState:
    """accelerate's process group and device (made before the Accelerator, which needs the dtype, which needs
    the device), with DeepSpeed's processes counted on CPUs too: accelerate 1.15 picks no backend for them
    there (it picks gloo only under ACCELERATE_USE_CPU, which turns DeepSpeed off), so each would take itself
    for the only process of a group DeepSpeed has already set up. A collective waits `timeout_minutes` for the
    other processes before it fails: ranks 1..N wait in one while rank 0 starts the engine and generates the
    first batch (NCCL's and DeepSpeed's default, 10 minutes, is shorter than an 8B engine's first start with
    its compilation)."""
    timeout = datetime.timedelta(minutes=timeout_minutes)
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED") and not torch.cuda.is_available():
        for lock in release_stale_build_locks():
            what = "no process holds it: a process killed while DeepSpeed built or checked its CPU op left it"
            print(f"removed {lock}, on which every DeepSpeed start would wait forever: {what}")
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"), timeout=timeout)
    if state.distributed_type == "DEEPSPEED" and state.backend is None and torch.distributed.is_initialized():
        state.backend = torch.distributed.get_backend()
        state.num_processes = torch.distributed.get_world_size()
        state.process_index = torch.distributed.get_rank()
        state.local_process_index = int(os.environ.get("LOCAL_RANK", 0))
    if state.num_processes > 1 and state.is_main_process:
        waits = _collective_timeout()
        print(f"{state.num_processes} training processes; a collective waits {waits} for them at most")
    return state


def release_stale_build_locks(root: str | None = None) -> list[str]:
    """Remove the build locks of DeepSpeed's ops that no process holds; returns their paths. On CPUs
    DeepSpeed builds (or, once built, checks) its shared-memory op through torch's JIT extensions at every
    start, under a lock file in the extensions' folder (`root`: TORCH_EXTENSIONS_DIR, or torch's default),
    on which torch waits with no deadline (torch.utils.file_baton.FileBaton.wait). Its holder keeps the
    file open until it removes it, so a lock no process has open was left by a process killed in between (a
    Ctrl-C during a first start, a test's timeout): without this, every later DeepSpeed start on the machine
    waits forever. Only a lock whose inode is the one seen before the search is removed: ranks starting
    together may find the same stale lock, and one must not remove the new one another has taken since."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(root or os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    locks = {}
    for lock in root.glob("*/deepspeed*/lock"):
        with suppress(FileNotFoundError):
            locks[lock.resolve()] = lock.stat().st_ino
    if not locks:
        return []
    held = set()
    for process in psutil.process_iter():
        with suppress(psutil.Error):
            held.update(Path(file.path) for file in process.open_files())
    removed = []
    for lock, inode in locks.items():
        with suppress(FileNotFoundError):
            if lock not in held and lock.stat().st_ino == inode:
                lock.unlink()
                removed.append(str(lock))
    return removed


def _collective_timeout() -> datetime.timedelta | None:
    """How long a collective of the default process group waits, as its backend holds it (None: no group)."""
    if not torch.distributed.is_initialized():
        return None
    group = torch.distributed.distributed_c10d._get_default_group()
    device = torch.device("cuda") if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout


def _zero_stage(accelerator: Accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else plugin.zero_stage


def _prepare_frozen(model, accelerator: Accelerator):
    """A frozen model (reference, reward model) on the training device. Under ZeRO-3 transformers loads every
    model sharded across the processes: DeepSpeed's engine, without an optimizer, then gathers a layer at a
    time for its forward passes (as TRL prepares its reference models), in the dtype of the run's mixed
    precision. All processes must run those forward passes together."""
    model = model.to(accelerator.device).eval().requires_grad_(False)
    if _zero_stage(accelerator) != 3:
        # accelerate's autocast does nothing under DeepSpeed (1.15), whose bf16 runs the policy on bf16
        # parameters (buffers, such as the rotary frequencies, stay fp32): a frozen model runs on the same, or
        # the reference's logprobs would not be the policy's at step 0
        if accelerator.state.deepspeed_plugin is not None and accelerator.mixed_precision == "bf16":
            for parameter in model.parameters():
                parameter.data = parameter.data.to(torch.bfloat16)
        return model
    import deepspeed

    bf16 = accelerator.mixed_precision == "bf16"
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": bf16},
    }
    engine = deepspeed.initialize(model=model, config=config)[0]
    model.deepspeed_engine = engine  # its gathering hooks live as long as the model
    return model


@contextmanager
def _whole_models(accelerator: Accelerator):
    """A context in which models load whole, not sharded by ZeRO-3 (accelerate tells transformers to shard
    every model it loads): the gold judge, which only rank 0 runs."""
    if _zero_stage(accelerator) != 3:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        accelerator.state.deepspeed_plugin.set_deepspeed_weakref()


def gathered_tensors(accelerator: Accelerator, module, names):
    """The tensors of a module's state named in `names`, (name, tensor), where they are. Under ZeRO-3 the
    parameters are gathered a transformer layer at a time, each valid while the iteration is on its layer:
    never a whole copy of the model, never through the CPU, and never a parameter not asked for (PPO's value
    model). Every process must go through the whole iteration, as each gather is collective."""
    if _zero_stage(accelerator) != 3:
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
