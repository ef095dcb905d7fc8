"""4b. The push of a LoRA policy version (lora.py): the adapter alone, as a PEFT adapter folder in RAM,
which the engine serves under the version's id (push_adapter). Each push is proven as a full one is
(weights.py): the adapter the engine's LoRA slot holds is the version's, the fingerprint of what the slot
holds (receiver.py's WeightReceiver.adapter_fingerprint) is the trainer's, and the engine's logprobs on the
probe, computed with it, are the trainer's. The previous version's adapter is then dropped (drop_adapter):
the generation thread pushes a version once the batches of the last are generated, so one is served at a
time."""

import json
import math
import os
import shutil

from plumbing.weights import Weights, engine_probe, probe_gap, views


# == The push, and its proof =================================================================================
def adapter_config(weights: Weights) -> dict:
    """The adapter_config.json of a pushed version, PEFT's format, which vLLM reads: its rank, alpha = rank
    (B comes scaled: lora.py's for_the_engine), the modules it adapts, as its file names them."""
    rank = next(shape[0] for name, shape, _ in weights.layout if ".lora_A." in name)
    modules = sorted({name.split(".lora_")[0].rpartition(".")[2] for name, _, _ in weights.layout})
    return dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=rank,
        lora_alpha=rank,
        target_modules=modules,
        lora_dropout=0.0,
        bias="none",
    )


def write_adapter(folder: str, weights: Weights) -> str:
    """The version `weights` as a PEFT adapter folder in the RAM-backed `folder`, written whole under a
    temporary name and then renamed: the engine never reads a half-written adapter. Returns its path."""
    from safetensors.torch import save_file

    path = os.path.join(folder, f"adapter-{weights.version:06d}")
    shutil.rmtree(partial := f"{path}.partial", ignore_errors=True)
    os.makedirs(partial)
    tensors = {name: tensor.contiguous() for name, tensor in views(weights.flat, weights.layout)}
    save_file(tensors, os.path.join(partial, "adapter_model.safetensors"))
    with open(os.path.join(partial, "adapter_config.json"), "w") as file:
        json.dump(adapter_config(weights), file)
    shutil.rmtree(path, ignore_errors=True)  # a version pushed again (the tests' planted faults)
    os.replace(partial, path)
    return path


def push_adapter(llm, weights: Weights, path: str):
    """Serve the version `weights` (an adapter) on the running engine `llm`: its folder `path` (write_adapter)
    added under the version's id and moved into the engine's LoRA slot, then proven (_check_adapter_loaded):
    what the slot holds, on each of the engine's workers together (combined_slots), and the probe, generated
    with it. Returns its LoRARequest, which every generation of this version names. The base model's weights
    do not change, and vLLM's prefix cache keys each block by the adapter that computed it
    (vllm/v1/core/kv_cache_utils.py, _gen_lora_extra_hash_keys): no cache to reset."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(lora_name=f"policy-{weights.version}", lora_int_id=weights.version, lora_path=path)
    llm.llm_engine.add_lora(request)
    sent = [name for name, _, _ in weights.layout]
    held = llm.collective_rpc("adapter_fingerprint", args=(weights.version, sent))
    probed = None
    if weights.probe is not None:
        probed = engine_probe(llm, weights.probe.token_ids, lora_request=request)
    _check_adapter_loaded(weights, combined_slots(held), probed)
    return request


def combined_slots(workers: list[dict]) -> dict:
    """What an engine's LoRA slots hold (WeightReceiver.adapter_fingerprint), from each of its workers': one,
    or under vLLM's tensor parallelism one per GPU. A matrix of a layer the workers hold alike (replicated:
    the same sums, bit for bit) counts once; one each holds a part of (sharded) counts the sum of its parts,
    as weights.combined_fingerprints adds a full push's; the slot is the version's only if every worker's
    is."""
    if len(workers) == 1:
        return workers[0]
    held = {}
    for layer in workers[0]["held"]:
        sums = []
        for matrix in (slice(0, 2), slice(2, 4)):  # A's two sums, then B's
            parts = [worker["held"][layer][matrix] for worker in workers]
            alike = all(part == parts[0] for part in parts)
            sums += parts[0] if alike else [sum(part[i] for part in parts) for i in (0, 1)]
        held[layer] = sums
    slot = workers[0]["slot"] if all(worker["slot"] == workers[0]["slot"] for worker in workers) else None
    return workers[0] | {"held": held, "slot": slot}


def drop_adapter(llm, request) -> None:
    """The engine forgets an older version's adapter (its LoRARequest); its folder is the caller's."""
    llm.llm_engine.remove_lora(request.lora_int_id)


def adapter_fingerprints(weights: Weights, into: dict[str, str]) -> dict[str, list[float]]:
    """The trainer's fingerprint of an adapter version by the engine's LoRA layer each tensor goes into
    (`into`: tensor name -> layer, the worker's): the sums and sums of squares of the A's, then of the B's,
    sent into it, added, as vLLM fuses q/k/v and gate/up into one layer whose slot holds each part's A and B
    (sums compose: weights.fingerprint); and how many elements each of those sums covers."""
    sums: dict[str, list[float]] = {}
    for name, shape, _ in weights.layout:
        total, squares = weights.fingerprint[name]
        part = 0 if ".lora_A." in name else 3
        layer = sums.setdefault(into[name], [0.0] * 6)  # A: sum, squares, elements; B: the same
        layer[part] += total
        layer[part + 1] += squares
        layer[part + 2] += math.prod(shape)
    return sums


# The engine's sums differ from the trainer's by float64's rounding alone (weights.py, _FINGERPRINT_RTOL).
_ADAPTER_RTOL = 1e-10


def _check_adapter_loaded(weights: Weights, held: dict, probed: list | None) -> None:
    """Stop the run unless the engine serves the version `weights` after its push, naming it and what
    differs: its LoRA slot holds the adapter of this version (`held`: WeightReceiver.adapter_fingerprint),
    every adapted layer the trainer's A and B (their fingerprints, each within float64's rounding of the
    trainer's: sqrt(elements x sum of squares) x 1e-10 for a sum), no other layer of the slot holds any
    weight, and its logprobs on the probe, computed with the adapter, are the trainer's within the probe's
    tolerance (`probed`: engine_probe). Otherwise it would go on sampling another policy, silently (the
    failure verl's issue 7495 shows)."""
    version = weights.version
    trainer = adapter_fingerprints(weights, held["into"])
    differ = []
    for layer, sums in trainer.items():
        engine = held["held"].get(layer)
        if engine is None:
            differ.append(f"{layer}: no such LoRA layer in the engine")
            continue
        for matrix, ours, theirs in (("A", 0, 0), ("B", 3, 2)):  # the engine's: A's two sums, then B's
            total, squares, elements = sums[ours : ours + 3]
            held_total, held_squares = engine[theirs : theirs + 2]
            if (
                abs(held_total - total) > _ADAPTER_RTOL * math.sqrt(elements * squares)
                or abs(held_squares - squares) > _ADAPTER_RTOL * squares
            ):
                differ.append(
                    f"{layer}: {matrix}'s sum {held_total:.9g} and sum of squares {held_squares:.9g} in the "
                    f"engine's slot, {total:.9g} and {squares:.9g} in the trainer's"
                )
    others = sorted(layer for layer, sums in held["held"].items() if layer not in trainer and any(sums))
    if held["slot"] != version:
        what = f"no LoRA slot holds its adapter (the slots hold {held['slots']})"
    elif differ:
        what = f"{len(differ)} of {len(trainer)} adapted layers differ from the trainer's, first {differ[0]}"
    elif others:
        what = f"its slot holds weights in a layer the adapter has none in, {others[0]}"
    elif probed is not None and (gap := probe_gap(weights.probe, probed)) > weights.probe.tolerance:
        allowed = weights.probe.tolerance
        what = (
            f"its logprobs on the probe are {gap:.3g} from the trainer's on average, more than the "
            f"{allowed:.3g} its dtype allows"
        )
    else:
        return
    raise RuntimeError(f"the engine does not serve policy version {version}'s adapter after its push: {what}")
