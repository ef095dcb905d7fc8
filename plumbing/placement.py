"""4a. Where the engines run and what they may take: their GPUs, the cores on a CPU, the memory arithmetic.

Functions of the GPUs a process sees and the run's sizes, no engine started: plumbing/engine.py places its
engines with them, and the planners (benchmark/memory.py, benchmark/plan.py) count a run's memory with the
same ones before any GPU is rented."""

import math
import os
from contextlib import contextmanager
from typing import NamedTuple

import torch

from plumbing.flags import UsageError


# == The engine's GPU, its memory, its cores =================================================================
class Placement(NamedTuple):
    """One engine's GPUs (engine_placements)."""

    devices: str | None  # CUDA_VISIBLE_DEVICES of the engine's processes: its GPUs alone; None: CPU
    shared: bool  # the engine shares training rank 0's GPU
    engine_gpu: int  # its first GPU, as rank 0 numbers its GPUs: the weight push's bucket lives there
    # None on a GPU: the largest share the run leaves (engine_share), at its start
    memory_utilization: float | None


def visible_gpus() -> list[str]:
    if not torch.cuda.is_available():
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def engine_placement(
    mode: str, visible: list[str], num_processes: int, memory_utilization: float | None
) -> Placement:
    """One engine of one GPU (engine_placements): the placement of the paper's runs."""
    placements = engine_placements(
        mode, visible, num_processes, memory_utilization, engines=1, tensor_parallel=1
    )
    return placements[0]


def engine_placements(
    mode: str,
    visible: list[str],
    num_processes: int,
    memory_utilization: float | None,
    engines: int,
    tensor_parallel: int,
) -> list[Placement]:
    """Each engine's GPUs. Training process i of a node uses its visible GPU i; the engines run on rank 0's
    node. With `engines` x `tensor_parallel` GPUs there beyond the N training processes of the node
    (LOCAL_WORLD_SIZE under a launcher; `num_processes` on one node), each engine takes `tensor_parallel` of
    them, in order (the paper's split, for one engine of one GPU); with fewer, the engines share the first
    `tensor_parallel`, rank 0's among them, within one memory budget. Rank 0 keeps the weight snapshots in its
    host memory and copies each pushed one through a bucket on each engine's first GPU, which the engine reads
    by CUDA IPC (docs/gpus.md). A layout that cannot be: a UsageError naming the flags."""
    sizes = f"--vllm_num_engines {engines} x --vllm_tensor_parallel_size {tensor_parallel}"
    if not visible:  # vLLM's CPU backend sizes its KV cache by VLLM_CPU_KVCACHE_SPACE instead
        if tensor_parallel > 1:
            raise UsageError(
                f"--vllm_tensor_parallel_size {tensor_parallel}: no GPU is visible, and an engine on the CPU "
                "runs in one process; use --vllm_num_engines for more engines"
            )
        return [Placement(None, False, 0, memory_utilization or _DEFAULT_SHARE["separate"])] * engines
    local = int(os.environ.get("LOCAL_WORLD_SIZE", num_processes))  # the processes on rank 0's node
    needed = local + engines * tensor_parallel
    separate = len(visible) >= needed if mode == "auto" else mode == "separate"
    nodes = f" on rank 0's node, of {num_processes} in all," if local != num_processes else ""
    if separate and len(visible) < needed:
        one = engines == 1 and tensor_parallel == 1
        engines_need = "the engine" if one else f"{engines * tensor_parallel} engine GPUs ({sizes})"
        fewer = "one training process fewer on that node" if one else "fewer engines or training processes"
        raise UsageError(
            f"--vllm_placement separate: {local} training process(es){nodes} and {engines_need} need "
            f"{needed} GPUs there, {len(visible)} are visible; use --vllm_placement shared or {fewer}"
        )
    if separate:
        firsts = range(local, needed, tensor_parallel)
        return [
            Placement(",".join(visible[first : first + tensor_parallel]), False, first, memory_utilization)
            for first in firsts
        ]
    if tensor_parallel > len(visible):
        raise UsageError(
            f"--vllm_tensor_parallel_size {tensor_parallel}: each engine needs {tensor_parallel} GPUs, "
            f"{len(visible)} are visible on rank 0's node"
        )
    return [Placement(",".join(visible[:tensor_parallel]), True, 0, memory_utilization)] * engines


def contiguous_parts(count: int, parts: int) -> list[slice]:
    """`count` items cut into `parts` contiguous slices, in order, the first `count % parts` one longer."""
    size, longer = divmod(count, parts)
    bounds = [i * size + min(i, longer) for i in range(parts + 1)]
    return [slice(start, stop) for start, stop in zip(bounds, bounds[1:])]


CUDA_CONTEXT = 2**30  # what a process's CUDA context takes on a GPU, about 1 GiB (with the kernels it loads)


def trained_memory(params: int, zero_stage: int, processes: int, bf16: bool) -> dict[str, int]:
    """Bytes per process of the trained models' weights, gradients and AdamW state. Without DeepSpeed: fp32
    weights and gradients (bf16 is autocast), two fp32 moments, 4 + 4 + 8 bytes a parameter. DeepSpeed's bf16
    keeps bf16 weights and gradients and fp32 master weights beside the moments, 2 + 2 + 12 bytes; ZeRO stage
    1 shards the 12 (or 8) among the processes, stage 2 the gradients too, stage 3 the weights too
    (Rajbhandari et al. 2020, section 5)."""
    weights, gradients, state = (2, 2, 12) if zero_stage and bf16 else (4, 4, 8)
    shard = lambda n, stage: params * n // (processes if zero_stage >= stage else 1)  # noqa: E731
    return {
        "weights": shard(weights, 3),
        "gradients": shard(gradients, 2),
        "optimizer state": shard(state, 1),
    }


def snapshot_memory(snapshot: int, async_level: int) -> int:
    """Rank 0's host memory for the weight snapshots of `snapshot` bytes that can be alive at once:
    async_level + 2 (the versions still owed batches, the one just published, one an evaluation may still
    hold), each in a pinned block, which torch's pinned allocator rounds up to a power of two (16 GiB for an
    8B policy's 15 in bf16)."""
    return (async_level + 2) * 2 ** math.ceil(math.log2(snapshot)) if snapshot else 0


# The engine's share of its GPU when --vllm_gpu_memory_utilization is left out: the largest that fits, up to
# vLLM's default on a GPU of its own, and up to 0.3 of one it shares, whose rest training's activations need
# (not counted).
_DEFAULT_SHARE = {"separate": 0.9, "shared": 0.3}
_MIN_SHARE = 0.05  # less holds the weights of no model worth generating with, and no KV cache


def engine_share(
    placement: Placement, rank0: tuple, engine: tuple, to_come: dict[str, int], bucket: int
) -> float:
    """The engine's share of its GPU: --vllm_gpu_memory_utilization if it fits, or (left out) the largest that
    fits up to _DEFAULT_SHARE. The GPUs once the trainer's models are loaded ((free, total) bytes of rank 0's
    and of the engine's, the same on a shared GPU) must hold what training allocates later there (`to_come`:
    name -> bytes), the weight push's bucket (`bucket`: bucket_bytes; the snapshots are in host memory) and
    the engine: vLLM takes its share of its whole GPU, and refuses to start when less is free; each process
    opens a CUDA context on each GPU it uses (the engine's own, rank 0's where it writes the bucket). 5 % of
    each GPU is kept for activations and allocator slack. A GPU that cannot: one line naming what to lower."""
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    asked = placement.memory_utilization
    free, total = rank0
    needed = sum(to_come.values()) + (bucket + 2 * CUDA_CONTEXT if placement.shared else 0)
    parts = ", ".join(f"{name} {gib(n)}" for name, n in to_come.items())
    training = f"training will add {gib(needed)} there ({parts}"
    if placement.shared:
        training += f", the weight push's bucket {gib(bucket)}, CUDA contexts {gib(2 * CUDA_CONTEXT)}"
    what = f"rank 0's GPU has {gib(free)} free once the models are loaded, and {training})"
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
        if largest < _MIN_SHARE:
            beside = f"beside the weight push's bucket of {gib(bucket)}, " if not placement.shared else ""
            share = max(largest, 0)
            raise UsageError(
                f"the engine would get {share} of its GPU, {beside}less than {_MIN_SHARE}: {smaller}"
            )
        return min(largest, _DEFAULT_SHARE["shared" if placement.shared else "separate"])
    if asked <= largest:
        return asked
    if placement.shared:
        if largest >= _MIN_SHARE:
            raise UsageError(
                f"--vllm_gpu_memory_utilization {asked}: the engine would take {gib(asked * total)} of the "
                f"GPU it shares with training; {what}: lower it to at most {largest}, or give the engine a "
                "GPU of its own"
            )
        raise UsageError(f"{what}, beside the engine {gib(asked * total)}: {smaller}")
    raise UsageError(
        f"--vllm_gpu_memory_utilization {asked}: the engine's GPU has {gib(free)} free and the engine would "
        f"take {gib(asked * total)}, beside the weight push's bucket of {gib(bucket)} and the CUDA contexts "
        f"of rank 0 and the engine {gib(2 * CUDA_CONTEXT)}: lower it to at most {largest} (less KV cache)"
    )


def engine_shares(placements: list[Placement], to_come: dict[str, int], bucket: int):
    """Each engine's placement with its share of its GPU (engine_share, on the GPUs as they are once the
    trainer's models are loaded), and its GPU's total bytes. Engines that share rank 0's GPU share one budget
    (--vllm_gpu_memory_utilization is each engine's), and their buckets are all there."""
    if placements[0].devices is None:
        return placements, [0] * len(placements)
    rank0 = torch.cuda.mem_get_info(0)
    if placements[0].shared:
        engines, asked = len(placements), placements[0].memory_utilization
        together = placements[0]._replace(memory_utilization=None if asked is None else asked * engines)
        try:
            share = engine_share(together, rank0, rank0, to_come, bucket=engines * bucket)
        except UsageError as error:
            if asked is None or engines == 1:
                raise
            each = f"--vllm_num_engines {engines} at --vllm_gpu_memory_utilization {asked} each"
            raise UsageError(
                f"{each} take {together.memory_utilization:g} of rank 0's GPU: {error}"
            ) from None
        each = asked if asked is not None else int(100 * share / engines) / 100
        if each < _MIN_SHARE:
            raise UsageError(
                f"--vllm_num_engines {engines}: the engines sharing rank 0's GPU would get {each} of it "
                f"each, less than {_MIN_SHARE}: use fewer engines, or give them GPUs of their own"
            )
        return [placement._replace(memory_utilization=each) for placement in placements], [rank0[1]] * engines
    shared, totals = [], []
    for placement in placements:
        gpu = torch.cuda.mem_get_info(placement.engine_gpu)
        share = engine_share(placement, rank0, gpu, to_come, bucket=bucket)
        shared.append(placement._replace(memory_utilization=share))
        totals.append(gpu[1])
    return shared, totals


def engine_line(
    placement: Placement,
    total: int,
    snapshot: int,
    bucket: int,
    snapshots: int,
    flag_given: bool,
    eager: bool,
) -> str:
    """What the engine gets, printed as it starts: its device, its share of its GPU and why, the weight push's
    bucket and the snapshots (`snapshot` bytes each, `snapshots` at most) in host memory, and (on a GPU with
    CUDA graphs) that its first start compiles, which takes minutes."""
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
    beside = f"beside the weight push's bucket of {gib(bucket)} (the snapshots of {gib(snapshot)}: "
    beside += f"{gib(snapshots)} at most, in pinned host memory)"
    line = f"engine: {where}, {placement.memory_utilization} of its {gib(total)} ({why}), {beside}"
    if not eager:  # vLLM compiles (torch.compile) and captures CUDA graphs at its first start on a GPU
        line += "; its first start compiles the model and captures CUDA graphs: minutes "
        line += "(--vllm_enforce_eager skips both, for slower generation)"
    return line


@contextmanager
def on_cores(cores: list[int] | None):
    """Run the block on these cores (None: where it runs now). On Linux affinity belongs to a thread and is
    inherited by the threads and processes it starts; the calling thread gets its own back after."""
    before = os.sched_getaffinity(0)
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def split_cores(device: torch.device, num_processes: int) -> list[int] | None:
    """On a CPU with a core to spare, split the cores as the paper splits GPUs: the first is the engine's (its
    worker, its scheduler and the generation thread, which take turns), the others train, and so do the
    threads started later. Returns the engine's cores (None: no split)."""
    cores = sorted(os.sched_getaffinity(0))
    if device.type == "cpu" and len(cores) > num_processes:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[0]))
        os.sched_setaffinity(0, cores[1:])
        torch.set_num_threads(len(cores) - 1)
        return cores[:1]
    return None
