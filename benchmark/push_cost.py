"""What a weight push costs through one buffer the size of the snapshot and through the fixed-size bucket the scripts
stream it through (plumbing.weights.WeightBucket), and what of it is the proof of the push: the engine's comparison
with the bucket (plumbing.receiver.WeightReceiver.holds) and the fingerprints, the trainer's of its own weights
(plumbing.weights.take_snapshot) and the engine's of its parameters (WeightReceiver.fingerprint), measured side by side
in one run on the engines the scripts start; and the push to `--num_engines` engines (plumbing.engine.Engine.push: every
engine through a bucket of its own, loading at the same time, each proven) against the push to one:

    python benchmark/push_cost.py                                   # the tiny task's policy, on a CPU
    python benchmark/push_cost.py --model_path models/pythia-1b --dtype bfloat16 --pushes 10     # on a GPU

Each of `--pushes` versions differs from the last in every tensor; the push (push_weights: the copies into the
buffer, the loads, the checks, the prefix cache's reset) is timed through a buffer that holds the whole snapshot (one
load), then through a bucket of `--bucket_fraction` of the snapshot (or of the largest layer, if larger: several
loads); then the snapshot alone (take_snapshot: the copy and the trainer's fingerprint), the trainer's fingerprint
alone, the engine's, the comparison with the bucket, an empty call (the round trip to the engine's worker), and the
probe each push adds, the trainer's (plumbing.weights.trainer_probe) and the engine's (engine_probe). Prints
the medians in milliseconds, the bucket's loads per push, the bucket push's cost over the whole buffer's, the push to
`--num_engines` engines (the engines share the machine's one GPU, or its CPU, as the engines of a one-GPU run do) over
the push to one, and the fingerprint's rate on one tensor of `--rate_elements` elements, with what it would take for an 8B policy at that rate
(an estimate, arithmetic). With `--lora_rank R`, on an engine of its own serving LoRA adapters, the push of a LoRA
policy's version too (plumbing/lora_push.py: its adapter alone, written as a PEFT folder, served, proven), beside the
full push through the bucket, with both sizes:

    python benchmark/push_cost.py --lora_rank 8
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
    parser.add_argument("--model_path", default=str(ROOT / "tasks" / "tiny" / "sft"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--pushes", type=int, default=20)
    parser.add_argument("--bucket_fraction", type=float, default=1 / 8)
    parser.add_argument("--num_engines", type=int, default=2, help="the engines the push to several is timed on")
    parser.add_argument(
        "--rate_elements", type=int, default=2**26, help="the tensor the fingerprint's rate is timed on"
    )
    parser.add_argument("--lora_rank", type=int, default=0, help="also time a LoRA adapter's push (0: not)")
    options = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from plumbing.flags import RunArgs, quiet_known_noise
    from plumbing.lora import add_adapter as with_adapter
    from plumbing.engine import Engine, make_engine
    from plumbing.placement import engine_placements, visible_gpus
    from plumbing.weights import (
        SnapshotPlace,
        WeightBucket,
        bucket_chunks,
        checkpoint_names,
        engine_probe,
        fingerprint,
        model_snapshot,
        probe_token_ids,
        push_weights,
        shared_handle,
        snapshot_bytes,
        trainer_probe,
    )

    quiet_known_noise()  # as the scripts (plumbing.run)
    dtype = getattr(torch, options.dtype)
    gpus = visible_gpus()
    device = torch.device("cuda", 0) if gpus else None
    model = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype).to(device or "cpu")
    engines = options.num_engines
    share = 0.3 / engines if gpus else None
    placements = engine_placements("shared" if gpus else "auto", gpus, 1, share, engines=engines, tensor_parallel=1)
    if gpus:  # the push's CUDA IPC handle is pickled between our processes, as Engine.start allows it
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    llms = [make_engine(options.model_path, p, dtype=options.dtype, max_model_len=64, seed=0) for p in placements]
    llm = llms[0]
    if options.lora_rank:  # a LoRA policy, and an engine of its own that serves its adapters
        from plumbing.lora import engine_lora_settings

        base = AutoModelForCausalLM.from_pretrained(options.model_path, dtype=dtype)
        lora = with_adapter(base, RunArgs(lora_rank=options.lora_rank))
        lora = lora.to(device or "cpu")
        lora_settings = engine_lora_settings(options.lora_rank)
        lora_llm = make_engine(
            options.model_path, placements[0], dtype=options.dtype, max_model_len=64, seed=0, **lora_settings
        )
        llms.append(lora_llm)
    folder = tempfile.mkdtemp()
    try:
        snapshot = snapshot_bytes(checkpoint_names(model), dtype)
        place = SnapshotPlace(pinned=device is not None, folder=folder)
        whole = WeightBucket(device, folder, least=snapshot)
        bucket = WeightBucket(device, folder, least=int(snapshot * options.bucket_fraction))
        buckets = [WeightBucket(device, folder, least=int(snapshot * options.bucket_fraction)) for _ in llms]
        several = Engine.around(llms[:engines], buckets)
        served = Engine.around([llms[-1]], [None], weights_dir=folder) if options.lora_rank else None
        names = [
            "push, whole buffer",
            "push, bucket",
            f"push, bucket, {engines} engines",
            "snapshot",
            "trainer's fingerprint",
            "engine's fingerprint",
            "comparison with the bucket",
            "round trip",
            "trainer's probe",
            "engine's probe",
            *([f"push, LoRA adapter of rank {options.lora_rank}"] if options.lora_rank else []),
        ]
        seconds = {name: [] for name in names}
        opened = lambda: shared_handle(whole.flat)  # noqa: E731  (allocated at the first push)
        tensors = list(model.state_dict().values())
        probe = probe_token_ids(model.config)
        for version in range(1, options.pushes + 1):
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1e-3)
            weights = model_snapshot(model, version, dtype, place)
            sent = [(name, shape) for name, shape, _ in weights.layout]
            timed = []
            if options.lora_rank:
                with torch.no_grad():
                    for name, parameter in lora.named_parameters():
                        if ".lora_" in name:
                            parameter.add_(1e-3)
                adapter = model_snapshot(lora, version, dtype, place, probed=True)
                timed = [(f"push, LoRA adapter of rank {options.lora_rank}", lambda: served.push(adapter))]
            for name, call in [
                *timed,
                ("push, whole buffer", lambda: push_weights(llm, whole, weights)),
                ("push, bucket", lambda: push_weights(llm, bucket, weights)),
                (f"push, bucket, {engines} engines", lambda: several.push(weights)),
                ("snapshot", lambda: model_snapshot(model, version, dtype, place)),
                ("trainer's fingerprint", lambda: torch.stack([fingerprint(t, dtype) for t in tensors]).tolist()),
                ("engine's fingerprint", lambda: llm.collective_rpc("fingerprint", args=(sent,))),
                ("comparison with the bucket", lambda: llm.collective_rpc("holds", args=(opened(), weights.layout))),
                ("round trip", lambda: llm.collective_rpc("holds", args=(opened(), []))),
                ("trainer's probe", lambda: trainer_probe(model, probe, device or "cpu", 0.0)),
                ("engine's probe", lambda: engine_probe(llm, probe)),
            ]:
                start = time.perf_counter()
                call()
                seconds[name].append(time.perf_counter() - start)
        median = {name: statistics.median(s) for name, s in seconds.items()}
        loads = len(bucket_chunks(weights.layout, bucket.flat.numel()))
        print(f"snapshot {snapshot / 2**20:.2f} MiB; bucket {bucket.flat.numel() * dtype.itemsize / 2**20:.2f} MiB")
        print(", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in median.items()) + f"; {loads} loads a bucket push")
        print(f"push, bucket / push, whole buffer: {median['push, bucket'] / median['push, whole buffer']:.2f}")
        to_several = median[f"push, bucket, {engines} engines"] / median["push, bucket"]
        print(f"push to {engines} engines / push to one, through buckets: {to_several:.2f}")
        if options.lora_rank:
            adapter_bytes = adapter.flat.numel() * dtype.itemsize
            ratio = median[f"push, LoRA adapter of rank {options.lora_rank}"] / median["push, bucket"]
            print(
                f"LoRA adapter of rank {options.lora_rank}: {adapter_bytes / 2**20:.2f} MiB, "
                f"{adapter_bytes / snapshot:.3f} of the snapshot; its push / the full push through the bucket: {ratio:.2f}"
            )
        big = torch.randn(options.rate_elements, device=device or "cpu")  # fp32, rounded to --dtype as the trainer's
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fingerprint(big, dtype).tolist()
            times.append(time.perf_counter() - start)
        rate = options.rate_elements / statistics.median(times)
        print(
            f"fingerprint of {options.rate_elements:,} fp32 elements as {options.dtype}: {rate / 1e6:,.0f} M elements/s;"
            f" at that rate an 8B policy (8.03e9 parameters) would take {8.03e9 / rate:.1f} s a side (an estimate)"
        )
    finally:
        for engine in llms:
            engine.llm_engine.engine_core.shutdown()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
