"""What a weight push costs through one buffer the size of the snapshot and through the fixed-size bucket the scripts
stream it through (plumbing.weights.WeightBucket), and what of it is the engine's check of what it then holds
(plumbing.weights.WeightReceiver.holds), measured side by side in one run on the engine the scripts start:

    python benchmark/push_cost.py                                   # the tiny task's policy, on a CPU
    python benchmark/push_cost.py --model_path models/pythia-1b --dtype bfloat16 --pushes 10     # on a GPU

Each of `--pushes` versions differs from the last in every tensor; the push (push_weights: the copies into the
buffer, the loads, the checks, the prefix cache's reset) is timed through a buffer that holds the whole snapshot (one
load), then through a bucket of `--bucket_fraction` of the snapshot (or of the largest layer, if larger: several
loads), then the check alone and an empty check (the round trip to the engine's worker). Prints the medians in
milliseconds, the bucket's loads per push, and the bucket push's cost over the whole buffer's.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_path", default=str(ROOT / "benchmark" / "tiny_task" / "sft"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--bucket_fraction", type=float, default=1 / 8)
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from plumbing.command_line import quiet_known_noise
    from plumbing.engine import engine_placement, make_engine, visible_gpus
    from plumbing.weights import (
        SnapshotPlace,
        WeightBucket,
        Weights,
        bucket_chunks,
        checkpoint_names,
        push_weights,
        shared_handle,
        snapshot_bytes,
        snapshot_weights,
    )

    quiet_known_noise()  # as the scripts (plumbing.run)
    dtype = getattr(torch, options.dtype)
    gpus = visible_gpus()
    device = torch.device("cuda", 0) if gpus else None
    model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype).to(device or "cpu")
    placement = engine_placement("shared" if gpus else "auto", gpus, 1, 0.3 if gpus else None)
    if gpus:  # the push's CUDA IPC handle is pickled between our processes, as Engine.start allows it
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llm = make_engine(options.model_path, placement, dtype=options.dtype, max_model_len=64, seed=0)
    folder = tempfile.mkdtemp()
    try:
        names = checkpoint_names(model)
        snapshot = snapshot_bytes(model, names, dtype)
        place = SnapshotPlace(pinned=device is not None, folder=folder)
        whole = WeightBucket(device, folder, least=snapshot)
        bucket = WeightBucket(device, folder, least=int(snapshot * options.bucket_fraction))
        seconds = {"push, whole buffer": [], "push, bucket": [], "check": [], "round trip": []}
        opened = lambda: shared_handle(whole.flat)  # noqa: E731  (allocated at the first push)
        for version in range(1, options.pushes + 1):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3)
            weights = Weights(version, *snapshot_weights(model.state_dict(), names, dtype, place))
            for name, call in [
                ("push, whole buffer", lambda: push_weights(llm, whole, weights)),
                ("push, bucket", lambda: push_weights(llm, bucket, weights)),
                ("check", lambda: llm.collective_rpc("holds", args=(version, opened(), weights.layout))),
                ("round trip", lambda: llm.collective_rpc("holds", args=(version, opened(), []))),
            ]:
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        median = {name: statistics.median(s) for name, s in seconds.items()}
        loads = len(bucket_chunks(weights.layout, bucket.flat.numel()))
        print(f"snapshot {snapshot / 2**20:.2f} MiB; bucket {bucket.flat.numel() * dtype.itemsize / 2**20:.2f} MiB")
        print(", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in median.items()) + f"; {loads} loads a bucket push")
        print(f"push, bucket / push, whole buffer: {median['push, bucket'] / median['push, whole buffer']:.2f}")
    finally:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
