"""What a weight push costs, what of it is the copy of the host snapshot into the engine's staging buffer and what the
engine's check of what it then holds (plumbing.WeightReceiver.holds), measured side by side in one run on the engine
the scripts start:

    python benchmark/push_cost.py                                   # the tiny task's policy, on a CPU
    python benchmark/push_cost.py --model_path models/pythia-1b --dtype bfloat16 --pushes 10     # on a GPU

Each of `--pushes` versions differs from the last in every tensor; the push (push_weights: the staging copy, the load,
the check, the prefix cache's reset) is timed, then the direct push (the same from a buffer already on the engine's
device, as when the snapshots lived there), the staging copy alone, the check alone, and an empty check (the round trip
to the engine's worker). Prints the medians in milliseconds, and the push's cost over the direct push's.
"""

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def direct_push(llm, handle: tuple, weights) -> None:
    """push_weights without its staging copy: the engine loads a buffer that holds theta_v already."""
    import plumbing

    loaded = llm.collective_rpc("load_shared_weights", args=(weights.version, handle, weights.layout))[0]
    plumbing.check_loaded(weights.version, loaded, llm.reset_prefix_cache())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_path", default=str(ROOT / "benchmark" / "tiny_task" / "sft"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pushes", type=int, default=20)
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import online_dpo_async as dpo
    import plumbing

    dtype = getattr(torch, options.dtype)
    gpus = plumbing.visible_gpus()
    device = torch.device("cuda", 0) if gpus else None
    model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype).to(device or "cpu")
    placement = plumbing.engine_placement("shared" if gpus else "auto", gpus, 1, 0.3 if gpus else None)
    llm = plumbing.make_engine(options.model_path, placement, dtype=options.dtype, max_model_len=64, seed=0)
    folder = tempfile.mkdtemp()
    try:
        place = plumbing.SnapshotPlace(pinned=device is not None, folder=folder)
        staging = plumbing.StagingBuffer(device, folder)
        names = dpo.checkpoint_names(model)
        seconds = {"push": [], "direct push": [], "staging copy": [], "check": [], "round trip": []}
        staged = lambda: plumbing.shared_handle(staging.flat)  # noqa: E731  (allocated at the first push)
        for version in range(1, options.pushes + 1):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3)
            weights = dpo.Weights(version, *dpo.snapshot_weights(model.state_dict(), names, dtype, place))
            for name, call in [
                ("push", lambda: dpo.push_weights(llm, staging, weights)),
                ("direct push", lambda: direct_push(llm, staged(), weights)),
                ("staging copy", lambda: staging.fill(weights.flat)),
                ("check", lambda: llm.collective_rpc("holds", args=(version, staged(), weights.layout))),
                ("round trip", lambda: llm.collective_rpc("holds", args=(version, staged(), []))),
            ]:
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        median = {name: statistics.median(s) for name, s in seconds.items()}
        print(", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in median.items()))
        print(f"push / direct push: {median['push'] / median['direct push']:.2f}")
    finally:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
