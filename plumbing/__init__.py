"""The plumbing the three algorithm files share, none of it the method, in the order of a run's life:

1. flags.py         the flags, their --help and domains; `run`, the entry point
   inputs.py  the checks of the input files: data, model folders, tokenizers
2. run_folder.py    the run's folder: its lock, args.json, the metrics, the space it needs
   checkpoints.py   its checkpoints: which to resume, their manifest, save and load, the final policy
   timings.py       a step's timings and FLOPs, the async pipeline's figures
3. distributed.py   the training processes: accelerate, DeepSpeed, what every process computes together
4. placement.py     where the engines run and what they may take: GPUs, cores, memory arithmetic
   engine.py        the vLLM engines: their processes, their calls (push, generate), their failures
   channel.py       the generation thread and the queues between it and the trainer; the loop's end
   stops.py         what stops a run: the deadline of each call to the engine, the stop signals
   weights.py       the weight push: the policy's snapshots in host memory, a bucket, the proof of each push
   receiver.py      the push's engine side: what vLLM's worker runs to load and prove a version
   lora.py          LoRA: the policy's adapter, the reference with it off, the adapter as a version
   lora_push.py     LoRA's push: the adapter the engine serves, and its proof
   inflight.py      in-flight weight updates: sequences decoded a segment at a time, each token's version
5. watchdog.py      a program of its own that ends the engine's processes if the trainer dies
   tidy.py          nothing left half done: a file written whole, a process group stopped whole

A package, not one module: each part reads alone, and the watchdog runs as its own program, importing
nothing of the rest. Nothing runs at import, and a module loads when one of its names is first used
(`__getattr__` below, PEP 562): the flags' module imports no torch, so that --help answers before torch,
transformers and vLLM load. An algorithm file uses the names below, no others; a fork of one uses this
package unchanged. The package reads only the flags it declares (RunArgs): what else it needs of a file's
flags is passed by name, so that a fork may rename any of them. A name with a leading underscore is its
module's own. What each algorithm does is in its own file (docs/)."""

import importlib

# name -> the module that defines it
_NAMES = {
    "run": "flags",
    "help_if_asked": "flags",
    "RunArgs": "flags",
    "UsageError": "flags",
    "check_domains": "flags",
    "load_split": "inputs",
    "load_tokenizers": "inputs",
    "load_reward_model": "inputs",
    "encode_text": "inputs",
    "same_tokenizer": "inputs",
    "RunFolder": "run_folder",
    "Laps": "timings",
    "forward_flops": "timings",
    "Processes": "distributed",
    "Engine": "engine",
    "Channel": "channel",
    "PolicySnapshots": "weights",
    "add_adapter": "lora",
    "AdapterOff": "lora",
    "Sequence": "inflight",
    "decode_segment": "inflight",
}
__all__ = list(_NAMES)
_MODULES = {"flags", "inputs", "run_folder", "checkpoints", "timings", "distributed", "placement", "engine"}
_MODULES |= {"channel", "stops", "weights", "receiver", "lora", "lora_push", "inflight", "watchdog", "tidy"}


def __getattr__(name: str):
    """A name of the list above, or a module (`plumbing.engine`), loaded as it is first used."""
    if name in _MODULES:
        return importlib.import_module(f"plumbing.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"plumbing.{_NAMES[name]}"), name)
    raise AttributeError(f"module 'plumbing' has no attribute {name!r}")
