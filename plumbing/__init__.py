"""The plumbing the three algorithm files share, none of it the method, in the order of a run's life:

1. command_line.py  the flags, their --help and domains, the checks of the input files; `run`, the entry point
2. run_folder.py    the run's folder: resume, args.json, the metrics and their timings, checkpoints
3. distributed.py   the training processes: accelerate, DeepSpeed, what every process computes together
4. engine.py        the vLLM engine: its GPU and cores, its processes, the generation thread, the signals
   weights.py       the weight push: the policy's snapshots in host memory, a bucket, the proof of each push
5. watchdog.py      a program of its own that ends the engine's processes if the trainer dies

A package, not one module: each part reads alone, and the watchdog runs as its own program, importing
nothing of the rest. Nothing runs at import. An algorithm file uses the names below, no others; a fork of one
uses this package unchanged. The package reads only the flags it declares (RunArgs): what else it needs of a
file's flags is passed by name, so that a fork may rename any of them. A name with a leading underscore is its
module's own. What each algorithm does is in its own file (docs/)."""

from plumbing.command_line import (
    RunArgs,
    UsageError,
    check_domains,
    encode_text,
    load_reward_model,
    load_split,
    load_tokenizers,
    run,
    same_tokenizer,
)
from plumbing.distributed import Processes
from plumbing.engine import Engine
from plumbing.run_folder import Laps, RunFolder, forward_flops
from plumbing.weights import PolicySnapshots

__all__ = [
    "run",
    "RunArgs",
    "UsageError",
    "check_domains",
    "load_split",
    "load_tokenizers",
    "load_reward_model",
    "encode_text",
    "same_tokenizer",
    "RunFolder",
    "Laps",
    "forward_flops",
    "Processes",
    "Engine",
    "PolicySnapshots",
]
