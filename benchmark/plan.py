"""The run plan of a command line, to read before renting GPUs: the engine's KV cache and how many of a step's sequences
it holds at once, a predicted time per phase, which side bounds the step, the async speed-up, what the paper's section 4
advises then, and the fewest engines at which training would bound the step on the run's GPUs. Docs:
docs/reproducing.md ("Run plans"); the memory of each GPU: benchmark/memory.py.

    python benchmark/plan.py -- accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 7 \\
        online_dpo_async.py --sft_model_path models/llama-3.1-8b-sft-no-robots ...
    DRY_RUN=1 bash benchmark/no_robots.sh | python benchmark/plan.py     # every experiment of a benchmark script
    python benchmark/plan.py --scripts_page benchmark/plans/runs.md      # every benchmark script's, as one page

The engine's KV cache is vLLM's share of its GPU less the policy's weights in the engine's dtype and a reserve for the
engine's activations and workspace (vLLM's profile forward, its sampler's logits, CUDA graphs, cuBLAS): vLLM's own
accounting. The share is --vllm_gpu_memory_utilization, or, left out, what plumbing.placement.engine_share would give the
run at its start, approximated as: the engine's GPU empty (free = total) and rank 0's GPU holding what memory.py plans
there for the models loaded and its CUDA context (free = total less those; the gradients and optimizer state to come).
Beside vLLM's share the engine's GPU holds the weight push's bucket (plumbing.weights.bucket_bytes: 1 GiB, or the
largest layer, or the snapshot if smaller), whatever the async level; the async level + 2 snapshots alive at once are in
rank 0's pinned host memory (plumbing.placement.snapshot_memory).

A token's KV is layers x KV heads x head dim x 2 (K and V) x the engine's bytes (GPTNeoX has no GQA: KV heads =
attention heads). A sequence is counted at its longest, max_prompt_length + response_length, in whole blocks: vLLM
allocates blocks as a sequence grows, but sequences that run to the response length end needing all of it, and
those it admitted beyond what fits then are preempted and recomputed; it is also the "maximum concurrency" vLLM logs
at its start. It is conservative where vLLM's prefix cache shares the prompt's
blocks among the K samples of one prompt. Sequences in flight = min(KV cache // a sequence's blocks, max_num_seqs,
an engine's completions); waves = ceil(completions / in flight), each wave's sequences starting and ending together.

Engines: --vllm_num_engines E engines of --vllm_tensor_parallel_size P GPUs each, on GPUs of their own after the
training processes' (memory.py counts no engines sharing a GPU but one engine on rank 0's). Each engine generates its
contiguous part of the step's prompts, at most ceil(prompts / E), and the step waits for the largest part. vLLM's
tensor parallelism puts 1/P of the weights and of the KV heads (one KV head where there are fewer than P) on each of an
engine's GPUs, each with its share of its GPU, the reserve and the push's bucket; a decoding step reads each GPU's
shards at once and computes on all P, the all-reduces between them not counted (a floor for P > 1).

Generation G = prefill + decode. Prefill: each completion's prompt (conservative where the prefix cache shares it
among a prompt's K samples) through the policy, forward FLOPs (plumbing.forward_flops: 2 per parameter and
token, no attention term) at the peak x MFU. Decode: each wave takes response_length steps; a step reads the weights
once and each in-flight sequence's KV so far, whose mean over the wave is max_prompt_length + response_length / 2
tokens, at the memory bandwidth, or computes the wave's tokens' forward FLOPs at the peak x MFU, whichever takes longer
(a roofline; decoding is memory-bound but for large waves of small models). Training T: the trainer's FLOPs per process
and step as each script counts them (its own step_flops: scoring, reference, old logprobs, update) at the peak x MFU.
The weight push, evaluation and overheads are not counted. Sync step = G + T; async step = max(G, T); speed-up = sync
/ async.

The engines on the run's GPUs (--gpus, or the command's training processes + E x P; engine_layouts): the same step at
E = 1, 2, ... engines and the training processes on the GPUs left, N' of them, up to the first layout at which training
bounds the step and memory.py's plan fits. The step's prompts stay the same: each process trains N / N' times the
command's share (exact where they divide over N', as a command of that layout needs).
"""

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory  # noqa: E402  (puts the repository on the path)
import plumbing  # noqa: E402

GIB = memory.GIB
BANDWIDTH = 3.35e12  # bytes/s: an H100 SXM's HBM3 (NVIDIA's datasheet)
PEAK_FLOPS = 989e12  # FLOP/s: an H100 SXM's dense bf16 (the datasheet's 1979 is with 2:4 sparsity)
MFU = 0.4  # model FLOP utilisation of the trainer's passes, the engine's prefill and its decode FLOPs
# The engine's memory within its share besides the weights and KV cache. vLLM counts its profile forward's peak
# (16,384 tokens on an H100: an 8B Llama's MLP takes 16384 x 2 x 14336 bf16 values, 0.9 GiB, and their product 0.4
# GiB), its sampler's fp32 logits (1024 x 128256 for Llama 3, 0.5 GiB), the CUDA graphs' pool, cuBLAS and NCCL
# workspaces: about 2 GiB for the 8B (vLLM 0.6.5 measured a peak of 1.26 GiB for Llama 3 8B on an H100 with fewer
# tokens and before it counted CUDA graphs: vllm-project/vllm#10511), less for the 1B models, where the reserve errs
# toward fewer sequences.
ENGINE_RESERVE_GIB = 2.0
MAX_NUM_SEQS = 1024  # vLLM's default for its LLM class on a GPU of 70 GiB or more other than an A100
BLOCK_SIZE = 16  # tokens per KV block: vLLM's default on CUDA
MOST_SAMPLES = 64  # the largest K the advice tries
# memory.py's rank-0 parts in GPU memory when the engine starts (plumbing.placement.engine_share's "free once the models
# are loaded"), and those training allocates later (its `to_come`)
SHARED = "training rank 0, shared with the engine"  # memory.py's name of that GPU
LOADED = ("trained models' weights", "reference policy", "reward model", "gold judge (rank 0 only)", "CUDA context")
LOADED += ("frozen base models (LoRA)",)  # under LoRA, in the reference's stead
TO_COME = ("trained models' gradients", "trained models' optimizer state")


class Hardware(NamedTuple):
    gpu_bytes: int
    bandwidth: float  # bytes/s
    peak_flops: float  # FLOP/s
    mfu: float
    engine_reserve: int  # bytes
    max_num_seqs: int
    block_size: int  # tokens


class DecodeStep(NamedTuple):
    read: int  # bytes: the weights and the wave's KV
    memory: float  # seconds to read them
    compute: float  # seconds of the wave's forward FLOPs

    @property
    def seconds(self) -> float:
        return max(self.memory, self.compute)


class Plan(NamedTuple):
    """A run's predicted step. Bytes, FLOPs per process, seconds."""

    run: memory.Run
    sizes: NamedTuple  # the script's Sizes
    fits: bool  # memory.py's plan
    shared: bool  # the engine shares training rank 0's GPU
    share: float
    share_source: str
    kv_cache: int
    kv_token: int
    sequence_tokens: int  # max_prompt_length + response_length in whole blocks
    completions: int  # per step
    per_engine: int  # completions of the largest engine's part of the step
    holds: int  # sequences an engine's KV cache holds
    in_flight: int
    waves: int
    prefill_flops: int
    prefill: float
    decode: float
    full_step: DecodeStep  # a decode step of a full wave
    phase_flops: dict[str, int]
    phases: dict[str, float]
    gpus: int  # the run's: --gpus, or the training processes and the engines' GPUs

    @property
    def generation(self) -> float:
        return self.prefill + self.decode

    @property
    def training(self) -> float:
        return sum(self.phases.values())


def kv_per_token(model: memory.Model, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """Bytes of one token's keys and values over all layers, on each of an engine's GPUs: vLLM splits the KV heads
    over them, or gives each GPU one where there are fewer KV heads than GPUs."""
    return model.layers * max(1, model.kv_heads // tensor_parallel) * model.head_dim * 2 * dtype_bytes


def phase_flops(run: memory.Run, sizes: NamedTuple) -> dict[str, int]:
    """The trainer's FLOPs per process and step, by phase: the script's own `step_flops` (what its main logs), on
    memory.py's meta-device models, with run.samples completions per prompt (the advice tries other K)."""
    module, policy = run.module, run.policy.module  # the reference policy has the policy's shape
    samples = {"online_dpo_async.py": "num_samples", "rloo_async.py": "rloo_k"}.get(run.script)
    args = dataclasses.replace(run.args, **{samples: run.samples}) if samples else run.args
    reward = None if run.reward is None else run.reward.module
    models = module.Models(
        None, ref_policy=policy, reward_model=reward, reward_tokenizer=None, gold_model=None, gold_tokenizer=None
    )
    trained = module.PolicyAndValue(policy, run.value.module) if run.script == "ppo_async.py" else policy
    return module.step_flops(trained, models, sizes, args)


def push_bucket(run: memory.Run) -> int:
    """The push's bucket on the engine's GPU: none under LoRA, whose adapter travels as a folder in host memory."""
    return 0 if run.args.lora_rank else plumbing.weights.bucket_bytes(run.policy.sizes, run.engine_bytes)


def pushed_bytes(run: memory.Run) -> int:
    """A policy version's bytes: the whole policy's, or under LoRA its adapter's (memory.adapter_parameters)."""
    args = run.args
    pushed = memory.adapter_parameters(run.policy, args.lora_rank, args.lora_target_modules) if args.lora_rank else 0
    return (pushed or run.policy.params) * run.engine_bytes


def engine_share(run: memory.Run, plan: dict, gpu_bytes: int) -> tuple[float, str]:
    """The engine's share of its GPU and where it comes from: the flag, or plumbing.placement.engine_share on the GPUs as
    the module docstring approximates them."""
    if run.args.vllm_gpu_memory_utilization is not None:
        return run.args.vllm_gpu_memory_utilization, "--vllm_gpu_memory_utilization"
    shared = SHARED in plan["gpus"]
    rank0 = plan["gpus"][SHARED if shared else "training rank 0"]
    rank0_gpu = (gpu_bytes - sum(rank0.get(part, 0) for part in LOADED), gpu_bytes)
    to_come = {part.removeprefix("trained models' "): rank0[part] for part in TO_COME}
    placement = plumbing.placement.Placement(
        devices="0", shared=shared, engine_gpu=0 if shared else run.processes, memory_utilization=None
    )
    engine_gpu = rank0_gpu if shared else (gpu_bytes, gpu_bytes)
    bucket = push_bucket(run)
    try:
        share = plumbing.placement.engine_share(placement, rank0_gpu, engine_gpu, to_come, bucket=bucket)
    except plumbing.UsageError as error:
        raise SystemExit(f"{run.script}: the run would not start: {error}") from None
    return share, "left out: the largest the run leaves, plumbing.placement.engine_share"


def predict(run: memory.Run, sizes: NamedTuple, share: float, hardware: Hardware) -> dict:
    """An engine's KV cache, its waves and the step's predicted phases (see the module docstring). `sizes`: the step's,
    whose batch run.processes share (their FLOPs are those of sizes.world_size's processes, rescaled)."""
    args, policy, gpus = run.args, run.policy, run.tensor_parallel
    P, R = args.max_prompt_length, args.response_length
    shard = policy.params * run.engine_bytes // gpus  # the weights on each of an engine's GPUs
    kv_cache = int(share * hardware.gpu_bytes) - shard - hardware.engine_reserve
    kv_token = kv_per_token(policy, run.engine_bytes, gpus)
    blocks = -(-(P + R) // hardware.block_size)
    completions = sizes.batch_size * run.samples
    per_engine = -(-sizes.batch_size // run.engines) * run.samples  # E contiguous parts of the prompts
    holds = max(kv_cache, 0) // (kv_token * hardware.block_size) // blocks
    in_flight = min(holds, hardware.max_num_seqs, per_engine)
    if in_flight == 0:
        on = f" on each of an engine's {gpus} GPUs" if gpus > 1 else ""
        raise SystemExit(
            f"{run.script}: vLLM's share {share} of {hardware.gpu_bytes / GIB:.1f} GiB leaves no KV cache for one "
            f"sequence of {P + R} tokens beside {shard / GIB:.1f} GiB of weights{on} and the reserve: vLLM would not "
            "start; raise --vllm_gpu_memory_utilization"
        )
    waves = -(-per_engine // in_flight)
    flop_rate = hardware.peak_flops * hardware.mfu
    mean_context = P + R / 2

    def decode_step(sequences: int) -> DecodeStep:
        """One decoding step of an engine, its GPUs reading their shards and computing at once."""
        read = shard + int(sequences * kv_token * mean_context)
        compute = plumbing.forward_flops(policy.module, sequences, 1) / (gpus * flop_rate)
        return DecodeStep(read=read, memory=read / hardware.bandwidth, compute=compute)

    full, last = decode_step(in_flight), decode_step(per_engine - (waves - 1) * in_flight)
    decode = R * ((waves - 1) * full.seconds + last.seconds)
    prefill_flops = plumbing.forward_flops(policy.module, per_engine, P, 1)
    flops = {phase: n * sizes.world_size // run.processes for phase, n in phase_flops(run, sizes).items()}
    return dict(
        kv_cache=kv_cache,
        kv_token=kv_token,
        sequence_tokens=blocks * hardware.block_size,
        completions=completions,
        per_engine=per_engine,
        holds=holds,
        in_flight=in_flight,
        waves=waves,
        prefill_flops=prefill_flops,
        prefill=prefill_flops / (gpus * flop_rate),
        decode=decode,
        full_step=full,
        phase_flops=flops,
        phases={phase: n / flop_rate for phase, n in flops.items()},
    )


def make_plan(command: list[str], hardware: Hardware, gpus: int | None) -> Plan:
    """A command line's plan; a command the script would refuse, or whose engine would not start, exits saying why."""
    run = memory.read_command(command)
    try:
        sizes = run.module.compute_sizes(run.args, run.processes)
    except plumbing.UsageError as error:
        raise SystemExit(f"{run.script}: {error}") from None
    return plan_run(run, sizes, hardware, gpus)


def plan_run(run: memory.Run, sizes: NamedTuple, hardware: Hardware, gpus: int | None) -> Plan:
    """The plan of a run read (memory.read_command) whose step has `sizes`, its batch over run.processes."""
    memory_plan = memory.memory_plan(run, hardware.gpu_bytes, gpus)
    share, source = engine_share(run, memory_plan, hardware.gpu_bytes)
    with_share = run._replace(args=dataclasses.replace(run.args, vllm_gpu_memory_utilization=share))
    fits = memory.table(memory.memory_plan(with_share, hardware.gpu_bytes, gpus), hardware.gpu_bytes)[1]
    predicted = predict(run, sizes, share, hardware)
    shared = SHARED in memory_plan["gpus"]
    gpus = gpus or run.processes + run.engines * run.tensor_parallel
    return Plan(
        run=run, sizes=sizes, fits=fits, shared=shared, share=share, share_source=source, gpus=gpus, **predicted
    )


def engine_layouts(plan: Plan, hardware: Hardware) -> list[Plan | str]:
    """The run on its GPUs (plan.gpus) with 1, 2, ... engines of --vllm_tensor_parallel_size GPUs each and the
    training processes on the GPUs left, the step's batch the same, up to the first layout at which training bounds
    the step and the memory plan fits: each layout's plan, or why it cannot be."""
    run, layouts = plan.run, []
    for engines in range(1, (plan.gpus - 1) // run.tensor_parallel + 1):
        processes = plan.gpus - engines * run.tensor_parallel
        args = dataclasses.replace(run.args, vllm_num_engines=engines)
        layout = run._replace(args=args, engines=engines, processes=processes)
        try:
            layouts.append(plan_run(layout, plan.sizes, hardware, plan.gpus))
        except SystemExit as refused:
            layouts.append(str(refused).removeprefix(f"{run.script}: "))
            continue
        if layouts[-1].fits and layouts[-1].training > layouts[-1].generation:
            break
    return layouts


def advice(plan: Plan, hardware: Hardware) -> str:
    """Which side bounds the step and the paper's section 4 remedy, with how far it goes before the other side bounds
    the step."""
    G, T = plan.generation, plan.training
    if G >= T:
        epochs = plan.run.args.num_ppo_epochs
        per_epoch = plan.phases["update"] / epochs
        most = epochs + int((G - T) / per_epoch)
        how_far = (
            f"up to T = {most} keeps training within generation's time"
            if most > epochs
            else f"T = {epochs + 1} would already make training bound the step"
        )
        return (
            f"generation bounds the step: G = {G / T:.1f} x T, the trainer idles {1 - T / G:.0%} of an async step. "
            f"The paper's section 4.1: take more updates per batch, T (--num_ppo_epochs, now {epochs}; each adds "
            f"{per_epoch:.2f} s of training): {how_far}. More updates per batch raised the win rate per episode, at a "
            "higher KL."
        )
    text = (
        f"training bounds the step: T = {T / G:.1f} x G, the engine idles {1 - G / T:.0%} of an async step. "
        "The paper's section 4.2: sample more completions per prompt, K, and train online DPO on the best and worst "
        "of them: generation (and scoring) grows about K/2-fold while training stays the same; with K = 4 the paper "
        "halved the learning rate and the steps, at a higher KL."
    )
    if plan.run.script == "ppo_async.py":
        return text + " (ppo_async.py draws one completion per prompt: the remedy is online DPO's.)"
    if plan.run.script == "rloo_async.py":
        return text + " (rloo_async.py trains on all K samples: its training grows with K as its generation does.)"
    now = samples = plan.run.samples
    while samples < MOST_SAMPLES:
        more = predict(plan.run._replace(samples=samples + 1), plan.sizes, plan.share, hardware)
        if more["prefill"] + more["decode"] > sum(more["phases"].values()):
            break
        samples += 1
    if samples == MOST_SAMPLES:
        return text + " No K levels the two: scoring every sample with the reward model grows faster than generation."
    if samples == now:
        return text + f" K = {now + 1} (--num_samples, now {now}) would already make generation bound the step."
    return text + f" Up to K = {samples} (--num_samples, now {now}) keeps generation within training's time."


# Mean completion lengths, as fractions of --response_length, at which a plan shows the step with in-flight updates;
# the scripts' page shows the middle one.
INFLIGHT_FRACTIONS = (0.25, 0.5, 0.75)


def inflight_step(plan: Plan, f: float) -> tuple[float, float]:
    """Generation and the async step with in-flight updates (--inflight_updates), modelled: whole-batch generation
    decodes each wave for response_length steps, waiting for its longest completion; in flight, the engine fills the
    places of the completions that end with the next batch's, so it decodes about as many steps as the completions
    hold tokens per place: a fraction f of the decode time where they average f of response_length (a step's cost a
    full wave's). Not counted: each segment's own cost (a request, its partial KV block computed again; it is what
    makes the mode slower on the tiny task on a CPU, docs/speed.md) and the wait for each version: an upper bound
    on the gain."""
    generation = plan.prefill + f * plan.decode
    return generation, max(generation, plan.training)


def inflight_report(plan: Plan) -> str:
    """In-flight updates' step at each of INFLIGHT_FRACTIONS (inflight_step), against the async step's."""
    async_step, cells = max(plan.generation, plan.training), []
    for f in INFLIGHT_FRACTIONS:
        generation, step = inflight_step(plan, f)
        cells.append(f"f = {f}: G = {generation:.2f} s, async step {step:.2f} s ({async_step / step:.2f}x)")
    return (
        "In-flight updates (--inflight_updates; an upper bound, segments' own cost aside), if the completions average "
        "a fraction f of the response length: " + "; ".join(cells) + "."
    )


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def report(plan: Plan, hardware: Hardware) -> str:
    """Markdown: the engine's KV cache, the predicted phases, the bound and the advice."""
    run, args, full = plan.run, plan.run.args, plan.full_step
    P, R = args.max_prompt_length, args.response_length
    snapshot = pushed_bytes(run)
    host = plumbing.placement.snapshot_memory(snapshot, args.async_level)
    bucket = push_bucket(run)
    engines, gpus = run.engines, run.tensor_parallel
    if plan.shared:
        where = (
            "the engine shares rank 0's GPU: the async step assumes the two do not contend for it, an upper bound "
            "on the speed-up"
        )
    elif engines * gpus == 1:
        where = "the engine on a GPU of its own"
    else:
        where = f"{engines} engine(s) of {gpus} GPU(s) each, on GPUs of their own, each generating 1/{engines} of it"
    engine_gpu = "the engine's GPU" if engines * gpus == 1 else "each engine GPU"
    # each of an engine's GPUs holds 1/P of its weights and of its KV heads (vLLM's tensor parallelism)
    kv_heads = max(1, run.policy.kv_heads // gpus)
    of_gpus = "" if gpus == 1 else f" / {gpus} GPUs"
    sequences = (
        f"{plan.in_flight} of the step's {plan.completions}"
        if engines == 1
        else f"{plan.in_flight} of an engine's {plan.per_engine}, the step's {plan.completions} over {engines}"
    )
    lines = [
        f"{run.script}: {run.policy.params / 1e9:.2f}B policy, {run.processes} training process(es); a step: "
        f"{plan.sizes.batch_size} prompts x {run.samples} = {plan.completions} completions of {P} + {R} tokens; "
        f"{where}; memory plan (benchmark/memory.py): {'fits' if plan.fits else 'does NOT fit'}",
        "",
        "| the engine's KV cache | |" if gpus == 1 else f"| an engine's KV cache, on each of its {gpus} GPUs | |",
        "|---|---|",
        f"| vLLM's share of its GPU | {gib(plan.share * hardware.gpu_bytes)}: {plan.share} of "
        f"{hardware.gpu_bytes / GIB:.1f} GiB ({plan.share_source}) |",
        f"| policy weights | {gib(run.policy.params * run.engine_bytes // gpus)}: {run.policy.params:,} parameters x "
        f"{run.engine_bytes} bytes{of_gpus} |",
        f"| activations and workspace (reserve) | {gib(hardware.engine_reserve)} |",
        f"| **KV cache** | **{gib(plan.kv_cache)}** |",
        f"| KV per token | {gib(plan.kv_token)}: {run.policy.layers} layers x {kv_heads} KV heads x "
        f"{run.policy.head_dim} head dim x 2 (K and V) x {run.engine_bytes} bytes |",
        f"| KV per sequence | {gib(plan.kv_token * plan.sequence_tokens)}: {P + R} tokens, in "
        f"{plan.sequence_tokens // hardware.block_size} blocks of {hardware.block_size} |",
        f"| sequences the KV cache holds | {plan.holds} |",
        f"| **sequences in flight** | **{sequences}** (at most {hardware.max_num_seqs}, vLLM's max_num_seqs) |",
        f"| **waves** | **{plan.waves}** |",
        "",
        f"Weight snapshots of {gib(snapshot)}{' (the LoRA adapter)' if args.lora_rank else ''}: async level + 2 = "
        f"{args.async_level + 2} in rank 0's pinned host memory ({gib(host)}); "
        + (
            f"{engine_gpu} holds the push's bucket beside vLLM's share ({gib(bucket)})."
            if bucket
            else "the adapter reaches the engine as a folder in host memory, which vLLM reads into its share."
        ),
        "",
        "| predicted time per step | s | from |",
        "|---|---|---|",
        f"| **G**: generation{'' if engines == 1 else ' (each engine)'} | **{plan.generation:.2f}** "
        "| prefill + decode |",
        f"| prefill | {plan.prefill:.2f} | {plan.prefill_flops / 1e12:,.0f} TFLOP{of_gpus} |",
        f"| decode | {plan.decode:.2f} | {plan.waves} wave(s) x {R} steps; a full wave's step reads "
        f"{full.read / 1e9:.1f} GB{'' if gpus == 1 else ' a GPU'}: {1e3 * full.memory:.2f} ms (its FLOPs: "
        f"{1e3 * full.compute:.2f} ms) |",
        f"| **T**: training (each process) | **{plan.training:.2f}** | {' + '.join(plan.phases)} |",
    ]
    for phase, seconds in plan.phases.items():
        lines.append(f"| {phase} | {seconds:.2f} | {plan.phase_flops[phase] / 1e12:,.0f} TFLOP |")
    G, T = plan.generation, plan.training
    lines += [
        f"| step, sync: G + T | {G + T:.2f} | |",
        f"| step, async: max(G, T) | {max(G, T):.2f} | |",
        f"| **async speed-up** | **{(G + T) / max(G, T):.2f}x** | sync / async |",
        "",
        inflight_report(plan),
        "",
        advice(plan, hardware),
        "",
        layouts_report(plan, engine_layouts(plan, hardware)),
    ]
    return "\n".join(lines)


def training_bound(layouts: list[Plan | str]) -> Plan | None:
    """The layout of the fewest engines at which training bounds the step and the memory plan fits, if any."""
    return next((p for p in layouts if not isinstance(p, str) and p.fits and p.training > p.generation), None)


def fewest_engines(plan: Plan, layouts: list[Plan | str]) -> str:
    """The fewest engines at which training bounds the step on the run's GPUs, with the predicted step, against the
    command's own."""
    step = max(plan.generation, plan.training)
    if (best := training_bound(layouts)) is not None:
        flags = f"--vllm_num_engines {best.run.engines} and {best.run.processes} training processes"
        return (
            f"The fewest engines at which training bounds the step on these {plan.gpus} GPUs: **{best.run.engines}** "
            f"({flags}), a step of **{best.training:.2f} s** (this command's: {step:.2f} s, "
            f"{step / best.training:.2f}x)"
        )
    possible = [p for p in layouts if not isinstance(p, str) and p.fits]
    if not possible:
        return f"No layout of engines and training processes on these {plan.gpus} GPUs fits"
    best = min(possible, key=lambda p: max(p.generation, p.training))
    return (
        f"At no number of engines on these {plan.gpus} GPUs does training bound the step in a layout that fits; "
        f"the shortest step that fits is at {best.run.engines} engine(s), {max(best.generation, best.training):.2f} s "
        f"(this command's: {step:.2f} s)"
    )


def layouts_report(plan: Plan, layouts: list[Plan | str]) -> str:
    """Markdown: the run's GPUs split between engines and training, E = 1, 2, ... (engine_layouts), and the fewest
    engines at which training bounds the step."""
    gpus = plan.run.tensor_parallel
    if not layouts:
        return f"The run's {plan.gpus} GPU(s) leave none to an engine of {gpus} GPU(s) of its own beside a training process."
    lines = [
        f"The engines on the run's {plan.gpus} GPUs, {gpus} GPU(s) each, and training on those left (the step's "
        f"{plan.sizes.batch_size} prompts the same; a training process's FLOPs grow as the processes are fewer):",
        "",
        "| engines | training processes | in flight / an engine's completions | waves | G (s) | T (s) "
        "| async step (s) | bound | memory plan |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for engines, p in enumerate(layouts, 1):
        if isinstance(p, str):
            lines.append(f"| {engines} | {plan.gpus - engines * gpus} | | | | | | | {p} |")
            continue
        G, T = p.generation, p.training
        lines.append(
            f"| {engines} | {p.run.processes} | {p.in_flight} / {p.per_engine} | {p.waves} | {G:.2f} | {T:.2f} "
            f"| {max(G, T):.2f} | {'generation' if G >= T else 'training'} | {'fits' if p.fits else 'does NOT fit'} |"
        )
    return "\n".join([*lines, "", fewest_engines(plan, layouts) + "."])


def assumptions(hardware: Hardware) -> str:
    """Markdown: every assumption with its value and the flag that changes it."""
    rows = [
        ("GPU memory", f"{hardware.gpu_bytes / GIB:.1f} GiB", "--gpu_gib"),
        ("memory bandwidth", f"{hardware.bandwidth / 1e12:.2f} TB/s", "--bandwidth"),
        ("peak FLOP/s, dense bf16", f"{hardware.peak_flops / 1e12:.0f} TFLOP/s", "--peak_flops"),
        ("model FLOP utilisation (training, prefill, decode's FLOPs)", f"{hardware.mfu:.2f}", "--mfu"),
        ("the engine's activations and workspace", gib(hardware.engine_reserve), "--engine_reserve_gib"),
        ("vLLM's max_num_seqs", f"{hardware.max_num_seqs}", "--max_num_seqs"),
        ("vLLM's KV block", f"{hardware.block_size} tokens", "--block_size"),
    ]
    lines = ["| assumption | value | flag |", "|---|---|---|"]
    return "\n".join(lines + [f"| {what} | {value} | `{flag}` |" for what, value, flag in rows])


def plans(lines: list[str], hardware: Hardware, gpus: int | None) -> list[tuple[list[str], Plan, str]]:
    """The plan of each command line, those with the same report together: (the runs' names, a plan, the report)."""
    grouped = {}
    for line in (line for line in lines if line.strip() and not line.startswith("#")):
        words = shlex.split(line)
        plan = make_plan(words, hardware, gpus)
        text = report(plan, hardware)
        name = words[words.index("--exp_name") + 1].split("__")[0] if "--exp_name" in words else "plan"
        grouped.setdefault(text, (plan, []))[1].append(name)
    return [(names, plan, text) for text, (plan, names) in grouped.items()]


def summary(results: list[tuple[list[str], Plan, str]], hardware: Hardware) -> str:
    """Markdown: one row per plan, with its engines and the fewest at which training would bound its step
    (engine_layouts). benchmark/gpu_check.py reads the first nine columns."""
    lines = [
        "| runs | in flight / an engine's completions | waves | G (s) | T (s) | sync: G + T (s) | async: max (s) "
        "| speed-up | bound | engines x GPUs | training bounds it from: engines, step (s) "
        f"| in flight, f = {INFLIGHT_FRACTIONS[1]}: async (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for names, plan, _ in results:
        G, T = plan.generation, plan.training
        best = training_bound(engine_layouts(plan, hardware))
        fewest = "none" if best is None else f"{best.run.engines}, {best.training:.2f}"
        inflight = inflight_step(plan, INFLIGHT_FRACTIONS[1])[1]
        lines.append(
            f"| {', '.join(f'`{name}`' for name in names)} | {plan.in_flight} / {plan.per_engine} | {plan.waves} "
            f"| {G:.2f} | {T:.2f} | {G + T:.2f} | {max(G, T):.2f} | {(G + T) / max(G, T):.2f}x "
            f"| {'generation' if G >= T else 'training'} | {plan.run.engines} x {plan.run.tensor_parallel} | {fewest} "
            f"| {inflight:.2f} ({max(G, T) / inflight:.2f}x) |"
        )
    return "\n".join(lines)


def scripts_page(hardware: Hardware) -> str:
    """The run plan of every experiment of every benchmark script, and of No Robots on two engines, under the
    assumptions' table (docs/reproducing.md links it and says what the plans show)."""
    sections = [
        "# Run plans of the benchmark scripts",
        "",
        "Written by `python benchmark/plan.py --scripts_page benchmark/plans/runs.md` from each script's commands",
        "(`DRY_RUN=1`); what the plans show, and the layouts compared by hand:",
        "[docs/reproducing.md](../../docs/reproducing.md#run-plans). A test fails when this page differs from what",
        "the tool writes today.",
        "",
        assumptions(hardware),
    ]
    variants = [(bench, {}) for bench in memory.BENCHMARKS] + [("no_robots", {"VLLM_NUM_ENGINES": "2"})]
    for bench, env in variants:
        shown = summary(plans(memory.script_commands(bench, **env), hardware, None), hardware)
        prefix = "".join(f"{name}={value} " for name, value in env.items())
        sections += [
            "",
            f"## {prefix}{bench}.sh",
            "",
            f"`{prefix}DRY_RUN=1 bash benchmark/{bench}.sh | python benchmark/plan.py`:",
            "",
            shown,
        ]
    return "\n".join(sections) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu_gib", type=float, default=79.0, help="memory of each GPU (an H100 80GB: 79.0 GiB)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the node (default: the run's)")
    parser.add_argument("--bandwidth", type=float, default=BANDWIDTH, help="GPU memory bandwidth, bytes/s (H100 SXM)")
    parser.add_argument("--peak_flops", type=float, default=PEAK_FLOPS, help="dense bf16 FLOP/s (H100 SXM)")
    parser.add_argument("--mfu", type=float, default=MFU, help="model FLOP utilisation of training and prefill")
    parser.add_argument("--engine_reserve_gib", type=float, default=ENGINE_RESERVE_GIB, help="engine's workspace")
    parser.add_argument("--max_num_seqs", type=int, default=MAX_NUM_SEQS, help="vLLM's most sequences in flight")
    parser.add_argument("--block_size", type=int, default=BLOCK_SIZE, help="vLLM's KV block, tokens")
    parser.add_argument("--scripts_page", type=Path, help="write every benchmark script's run plans to this page")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: one command line (else: read from stdin)")
    options = parser.parse_args(argv)
    hardware = Hardware(
        gpu_bytes=int(options.gpu_gib * GIB),
        bandwidth=options.bandwidth,
        peak_flops=options.peak_flops,
        mfu=options.mfu,
        engine_reserve=int(options.engine_reserve_gib * GIB),
        max_num_seqs=options.max_num_seqs,
        block_size=options.block_size,
    )
    if options.scripts_page:
        memory.write_page(options.scripts_page, scripts_page(hardware))
        return 0
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    lines = [shlex.join(command)] if command else sys.stdin.read().splitlines()
    results = plans(lines, hardware, options.gpus)
    print(f"{assumptions(hardware)}\n")
    for names, _, text in results:
        print(f"{', '.join(f'`{name}`' for name in names)}:\n\n{text}\n")
    print(summary(results, hardware))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
