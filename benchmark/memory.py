"""The memory plan of a run, to read before renting GPUs: for each GPU (training rank 0, the other training ranks, the
engine's), what each part takes, from a script's command line and its accelerate config, and whether the run fits.

    python benchmark/memory.py -- accelerate launch --config_file configs/deepspeed_zero3.yaml --num_processes 7 \\
        online_dpo_async.py --sft_model_path models/llama-3.1-8b-sft-no-robots ...
    DRY_RUN=1 bash benchmark/no_robots.sh | python benchmark/memory.py     # every experiment of a benchmark script
    python benchmark/memory.py --scripts_page benchmark/plans/memory.md    # every benchmark script's, as one page

A model's parameters are counted from its config.json (a local folder), else from the architecture its name names
(ARCHITECTURES: the paper's Pythia, Llama 3.1 8B and Rho-1B models), built on the meta device. The parts follow the
code: the trained models' weights, gradients and AdamW state by ZeRO stage (plumbing.placement.trained_memory); the
reference (fp32, or sharded in the run's precision under ZeRO-3) and the reward model (--dtype) on every rank, the gold
judge on rank 0; the weight push's bucket on the engine's GPU (plumbing.weights.bucket_bytes: 1 GiB, or the largest
layer, or the snapshot if smaller), and async level + 2 weight snapshots in rank 0's pinned host memory
(plumbing.placement.snapshot_memory), shown under the table; --vllm_num_engines E engines of
--vllm_tensor_parallel_size P GPUs each on GPUs of their own after the training processes', each GPU alike (vLLM's
share is of each GPU, and each has a bucket): one column for them; a CUDA context per process and GPU
(plumbing.placement.CUDA_CONTEXT); the activations of one micro-batch (Korthikanti et al. 2022, table 2: 34 s b h bytes
per layer in 16-bit, without the 5 a s^2 b of attention scores that transformers' SDPA attention does not keep; 2 s b h
with gradient checkpointing, plus one layer's), the response logits in fp32 (3 copies), and the largest no-grad
forward of --local_rollout_forward_batch_size sequences. A GPU fits when its total is at most 95 % of it.
"""

import argparse
import dataclasses
import importlib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from plumbing.tidy import write_atomically  # noqa: E402

GIB = 2**30
MARGIN = 0.05  # of each GPU, kept free: allocator slack and what the plan does not count
SCRIPTS = ("online_dpo_async.py", "rloo_async.py", "ppo_async.py")
BUCKET = "the weight push's bucket"  # the weight snapshots themselves are in host memory
# The architectures of the paper's models, by a piece of their hub ids or folder names (published configs).
PYTHIA = dict(model_type="gpt_neox", vocab_size=50304, max_position_embeddings=2048, tie_word_embeddings=False)
LLAMA_3_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32)
LLAMA_3_8B |= dict(num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False)
ARCHITECTURES = {
    "pythia410m": PYTHIA | dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "pythia1b": PYTHIA | dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192),
    "pythia2.8b": PYTHIA
    | dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, intermediate_size=10240),
    "pythia-6.9b": PYTHIA
    | dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=16384),
    "llama-3.1-8b": LLAMA_3_8B,
    "rho-1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048, num_hidden_layers=22, num_attention_heads=32)
    | dict(num_key_value_heads=4, intermediate_size=5632, tie_word_embeddings=False),
}


class Model:
    """A model's size and shape: parameters (as a causal LM, or as a one-label sequence classifier), and what the
    activation estimate needs. Built once per name."""

    seen: dict = {}

    def __new__(cls, name: str, classifier: bool = False):
        if (name, classifier) not in cls.seen:
            cls.seen[name, classifier] = super().__new__(cls)
            cls.seen[name, classifier].build(name, classifier)
        return cls.seen[name, classifier]

    def build(self, name: str, classifier: bool):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

        if Path(name, "config.json").exists():
            config = AutoConfig.from_pretrained(name)
        else:
            known = [key for key in ARCHITECTURES if key in name.lower().replace("_", "-").replace("-1b", "1b")]
            known += [key for key in ARCHITECTURES if key in name.lower()]
            if not known:
                raise SystemExit(f"{name}: no local config.json and no known architecture ({', '.join(ARCHITECTURES)})")
            fields = dict(ARCHITECTURES[known[0]])
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config.num_labels = 1
        with torch.device("meta"):
            auto = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
            model = auto.from_config(config)
        self.module = model  # on the meta device: shapes without memory (benchmark/plan.py counts its FLOPs)
        self.sizes = {name: p.numel() for name, p in model.named_parameters()}  # tied ones once, as pushed
        self.params = sum(self.sizes.values())
        self.hidden, self.layers = config.hidden_size, config.num_hidden_layers
        self.vocab = config.vocab_size
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads  # GPTNeoX: no GQA
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def adapter_parameters(model: Model, rank: int, targets: str) -> int:
    """A LoRA adapter's parameters on `model` (plumbing.lora.add_adapter, PEFT's LoraConfig): r (in + out) for each
    adapted linear layer, every one but the output head (PEFT's all-linear) or those `targets` names."""
    import torch

    head = model.module.get_output_embeddings()
    named = None if targets == "all-linear" else {name.strip() for name in targets.split(",")}
    return sum(
        rank * (module.in_features + module.out_features)
        for name, module in model.module.named_modules()
        if isinstance(module, torch.nn.Linear)
        and module is not head
        and name.rpartition(".")[2] != "score"  # a classifier's head trains whole (PEFT's SEQ_CLS)
        and (named is None or name.rpartition(".")[2] in named)
    )


def activations(model: Model, sequences: int, length: int, logits: int, checkpointing: bool, bytes_: int) -> int:
    """One micro-batch's activations kept for the backward pass (Korthikanti et al. 2022, table 2, in 16-bit; x2 in
    fp32) and its response logits in fp32 (the logits, their temperature-scaled copy, the log-softmax's)."""
    per_layer = sequences * length * model.hidden * 34 * bytes_ // 2
    kept = (
        (model.layers * 2 * sequences * length * model.hidden * bytes_ // 2 + per_layer)
        if checkpointing
        else model.layers * per_layer
    )
    return kept + 3 * 4 * sequences * logits * model.vocab


def no_grad_forward(model: Model, sequences: int, length: int, logits: int, bytes_: int) -> int:
    """The peak of a no-grad forward pass: one layer's activations and the logits in fp32."""
    layer = sequences * length * model.hidden * 34 * bytes_ // 2
    return layer + 3 * 4 * sequences * logits * model.vocab


class Run(NamedTuple):
    """A command line, read: its script (imported), the script's flags, the launch's, and the models they name."""

    script: str
    module: ModuleType
    args: object  # the script's Args
    processes: int
    engines: int  # --vllm_num_engines
    tensor_parallel: int  # --vllm_tensor_parallel_size: each engine's GPUs
    stage: int  # DeepSpeed ZeRO's, 0 without it
    deepspeed: bool
    bf16: bool
    engine_bytes: int  # a parameter's in the engine's dtype
    samples: int  # completions per prompt
    policy: Model
    reward: Model | None
    gold: Model | None
    value: Model | None  # PPO's


def read_command(command: list[str]) -> Run:
    """An accelerate launch command line (or `python SCRIPT ...`), read."""
    import tyro
    from accelerate.commands.config.config_args import load_config_from_file

    at = next(i for i, word in enumerate(command) if Path(word).name in SCRIPTS)
    launcher, script, flags = command[:at], Path(command[at]).name, command[at + 1 :]
    module = importlib.import_module(script.removesuffix(".py"))
    args = tyro.cli(with_engine_layout(module.Args), args=flags, use_underscores=True)
    for flag in ENGINE_LAYOUT:
        if getattr(args, flag) < 1:
            raise SystemExit(f"{script}: --{flag} must be >= 1 (a count), got {getattr(args, flag)}")
    config = (
        load_config_from_file(launcher[launcher.index("--config_file") + 1]) if "--config_file" in launcher else None
    )
    processes = int(launcher[launcher.index("--num_processes") + 1]) if "--num_processes" in launcher else 1
    deepspeed = bool(config and config.deepspeed_config)
    stage = config.deepspeed_config.get("zero_stage", 0) if deepspeed else 0
    bf16 = args.dtype == "bfloat16" or args.dtype == "auto"  # on GPUs, auto is bf16
    engine_bytes = {"auto": 2 if bf16 else 4, "float32": 4, "bfloat16": 2}[args.vllm_dtype]
    samples = getattr(args, "num_samples", getattr(args, "rloo_k", 1))
    policy = Model(args.sft_model_path)
    reward = None if args.task == "gsm8k" else Model(args.reward_model_path, classifier=True)
    gold = None if args.gold_judge == "tiny" else Model(args.gold_judge, classifier=True)
    value = (reward or Model(args.sft_model_path, classifier=True)) if script == "ppo_async.py" else None
    check_tensor_parallel(policy, args.vllm_tensor_parallel_size, script)
    return Run(
        script=script,
        module=module,
        args=args,
        processes=processes,
        engines=args.vllm_num_engines,
        tensor_parallel=args.vllm_tensor_parallel_size,
        stage=stage,
        deepspeed=deepspeed,
        bf16=bf16,
        engine_bytes=engine_bytes,
        samples=samples,
        policy=policy,
        reward=reward,
        gold=gold,
        value=value,
    )


# The engines' layout: E engines of P GPUs each (vLLM's tensor parallelism), the scripts' flags of these names
ENGINE_LAYOUT = ("vllm_num_engines", "vllm_tensor_parallel_size")


def with_engine_layout(args_class: type) -> type:
    """The script's Args, with ENGINE_LAYOUT's flags (default 1) where it does not have them yet."""
    fields = {field.name for field in dataclasses.fields(args_class)}
    missing = [(flag, int, dataclasses.field(default=1)) for flag in ENGINE_LAYOUT if flag not in fields]
    return dataclasses.make_dataclass("Args", missing, bases=(args_class,)) if missing else args_class


def check_tensor_parallel(model: Model, tensor_parallel: int, script: str) -> None:
    """vLLM splits each layer's attention heads over an engine's P GPUs, and its KV heads too, or copies each KV head
    onto P / KV heads of them where there are fewer than P."""
    heads, kv_heads = model.heads, model.kv_heads
    if heads % tensor_parallel or (
        kv_heads % tensor_parallel if kv_heads >= tensor_parallel else tensor_parallel % kv_heads
    ):
        raise SystemExit(
            f"{script}: --vllm_tensor_parallel_size {tensor_parallel}: vLLM splits the policy's {heads} attention "
            f"heads ({kv_heads} KV heads) over each engine's GPUs, and these do not split {tensor_parallel} ways"
        )


def plan(command: list[str], gpu_bytes: int, gpus: int | None) -> dict:
    """Per GPU: its parts in bytes. `command`: an accelerate launch command line (or `python SCRIPT ...`)."""
    return memory_plan(read_command(command), gpu_bytes, gpus)


def memory_plan(run: Run, gpu_bytes: int, gpus: int | None) -> dict:
    """Per GPU: its parts in bytes; rank 0's host memory for the weight snapshots; a one-line summary of the run."""
    import plumbing

    args, script, processes, stage, bf16 = run.args, run.script, run.processes, run.stage, run.bf16
    samples, policy, reward, gold, value = run.samples, run.policy, run.reward, run.gold, run.value
    shard = processes if stage == 3 else 1
    L, R, micro = args.max_prompt_length + args.response_length, args.response_length, args.local_micro_batch_size
    lora = args.lora_rank > 0
    if lora and stage == 3:
        raise SystemExit(f"{script}: --lora_rank under ZeRO-3 is refused by the run (plumbing/lora.py)")
    if lora:  # the adapters and heads train; the base models are frozen, whole, in DeepSpeed's dtype or fp32
        adapter = adapter_parameters(policy, args.lora_rank, args.lora_target_modules)
        frozen = policy.params
        trained, pushed = adapter, adapter
        if value and getattr(args, "lora_value_model", False):
            trained += adapter_parameters(value, args.lora_rank, args.lora_target_modules) + value.hidden
            frozen += value.params - value.hidden
        elif value:
            trained += value.params
    else:
        trained, pushed, frozen = policy.params + (value.params if value else 0), policy.params, 0
    training = plumbing.placement.trained_memory(trained, stage, processes, bf16)
    rank = {f"trained models' {part}": n for part, n in training.items()}
    if lora:  # no reference: the policy with its adapter off
        rank["frozen base models (LoRA)"] = frozen * (2 if run.deepspeed and bf16 else 4)
    else:
        rank["reference policy"] = policy.params * (2 if stage and bf16 else 4) // shard  # DeepSpeed's bf16 parameters
    if reward:
        rank["reward model"] = reward.params * (2 if bf16 else 4) // shard
    act = 2 if bf16 else 4
    sequences = {"online_dpo_async.py": 2 * micro, "rloo_async.py": micro * samples, "ppo_async.py": micro}[script]
    rank["activations of a micro-batch"] = activations(policy, sequences, L, R + 1, args.gradient_checkpointing, act)
    if value:
        rank["activations of a micro-batch"] += activations(value, micro, L, 0, args.gradient_checkpointing, act)
    forward = args.local_rollout_forward_batch_size
    rank["largest no-grad forward"] = max(
        no_grad_forward(policy, forward, L, R + 1, act), no_grad_forward(reward, forward, L, 0, act) if reward else 0
    )
    rank["CUDA context"] = plumbing.placement.CUDA_CONTEXT
    rank0 = dict(rank)
    if gold:
        rank0["gold judge (rank 0 only)"] = gold.params * 2
    snapshot = pushed * run.engine_bytes
    # under LoRA the adapter travels as a folder in host memory, which vLLM reads into its own share: no bucket
    bucket = 0 if lora else plumbing.weights.bucket_bytes(policy.sizes, run.engine_bytes)
    engine_gpus = run.engines * run.tensor_parallel
    gpus = gpus or processes + engine_gpus
    utilization = args.vllm_gpu_memory_utilization
    if gpus >= processes + engine_gpus:  # the engines' GPUs of their own, each alike
        engine = {"engine (vLLM's share)": int((utilization or 0.9) * gpu_bytes)} | ({BUCKET: bucket} if bucket else {})
        if bucket:
            engine["rank 0's CUDA context (it writes the bucket)"] = plumbing.placement.CUDA_CONTEXT
        engine["engine's CUDA context"] = plumbing.placement.CUDA_CONTEXT
        result = {"training rank 0": rank0, engine_column(run): engine}
    elif engine_gpus == 1:
        rank0 |= {"engine (vLLM's share)": int((utilization or 0.3) * gpu_bytes)} | ({BUCKET: bucket} if bucket else {})
        rank0["engine's CUDA context"] = plumbing.placement.CUDA_CONTEXT
        result = {"training rank 0, shared with the engine": rank0}
    else:
        raise SystemExit(
            f"{script}: --vllm_num_engines {run.engines} x --vllm_tensor_parallel_size {run.tensor_parallel} "
            f"engine GPUs beside {processes} training process(es) need {processes + engine_gpus} GPUs, --gpus "
            f"gives {gpus}: the plan counts engines on GPUs of their own, or one engine on rank 0's GPU"
        )
    if processes > 1:
        result["training ranks 1 ..."] = rank
    summary = f"{script}: {policy.params / 1e9:.2f}B policy, {processes} training process(es)"
    summary += f", ZeRO-{stage}" if stage else ", no ZeRO" if not run.deepspeed else ""
    if lora:
        summary += f", LoRA rank {args.lora_rank} ({adapter / 1e6:.1f}M adapter parameters)"
    if engine_gpus > 1:
        summary += f", {run.engines} engine(s) of {run.tensor_parallel} GPU(s)"
    summary += (
        f", micro-batch {micro} x {L} tokens, async level {args.async_level}, {gpus} GPUs of {gpu_bytes / GIB:.0f} GiB"
    )
    pinned = plumbing.placement.snapshot_memory(snapshot, args.async_level)
    host = {f"weight snapshots, pinned ({args.async_level + 2})": pinned}
    return {"summary": summary, "gpus": result, "host": host}


def engine_column(run: Run) -> str:
    """The name of the engines' GPUs in a plan: each holds the same (vLLM's share is of each GPU of an engine, and
    each engine GPU has the push's bucket)."""
    if run.engines * run.tensor_parallel == 1:
        return "engine's GPU"
    return f"each engine GPU ({run.engines} x {run.tensor_parallel})"


def table(result: dict, gpu_bytes: int) -> tuple[str, bool]:
    """Markdown: one column per GPU, one row per part (GiB), the total and whether it fits."""
    columns = list(result["gpus"])
    parts = list(dict.fromkeys(part for gpu in result["gpus"].values() for part in gpu))
    lines = [f"{result['summary']}", "", "| GiB | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for part in parts:
        cells = [f"{result['gpus'][c][part] / GIB:.1f}" if part in result["gpus"][c] else "" for c in columns]
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    totals = [sum(result["gpus"][c].values()) for c in columns]
    fits = all(total <= (1 - MARGIN) * gpu_bytes for total in totals)
    lines.append("| **total** | " + " | ".join(f"**{t / GIB:.1f}**" for t in totals) + " |")
    left = [f"{((1 - MARGIN) * gpu_bytes - t) / GIB:+.1f}" for t in totals]
    lines.append(f"| left of {100 * (1 - MARGIN):.0f} % of the GPU | " + " | ".join(left) + " |")
    host = ", ".join(f"{part} {n / GIB:.1f} GiB" for part, n in result["host"].items())
    lines += ["", f"rank 0's host memory: {host}", "", f"fits: {'yes' if fits else 'NO'}"]
    return "\n".join(lines), fits


def plans(lines: list[str], gpu_bytes: int, gpus: int | None) -> list[tuple[list[str], str, bool]]:
    """The plan of each command line, those with the same table together: (the runs' names, the table, fits)."""
    grouped = {}
    for line in (line for line in lines if line.strip() and not line.startswith("#")):
        words = shlex.split(line)
        text, fits = table(plan(words, gpu_bytes, gpus), gpu_bytes)
        name = words[words.index("--exp_name") + 1].split("__")[0] if "--exp_name" in words else "plan"
        grouped.setdefault((text, fits), []).append(name)
    return [(names, text, fits) for (text, fits), names in grouped.items()]


# == The plans of every benchmark script, as a page of their own ==============================================
BENCHMARKS = ("tldr", "no_robots", "gsm8k")


def script_commands(bench: str, **env: str) -> list[str]:
    """The command lines benchmark/<bench>.sh runs, as it prints them with DRY_RUN=1 (and `env`'s variables)."""
    proc = subprocess.run(
        ["bash", f"benchmark/{bench}.sh"],
        cwd=ROOT,
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SystemExit(f"error: DRY_RUN=1 bash benchmark/{bench}.sh failed: {proc.stderr.strip()}")
    return proc.stdout.splitlines()


def write_page(path: Path, text: str) -> None:
    """`text` to `path`, whole or not at all, its folder made if need be."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text)


def scripts_page(gpu_bytes: int) -> str:
    """The memory plan of every experiment of every benchmark script, a section per script (docs/reproducing.md
    links it and says what the plans show)."""
    sections = [
        "# Memory plans of the benchmark scripts",
        "",
        "Written by `python benchmark/memory.py --scripts_page benchmark/plans/memory.md` from each script's",
        f"commands (`DRY_RUN=1`), GPUs of {gpu_bytes / GIB:g} GiB; what the plans show and why the scripts set what",
        "they set: [docs/reproducing.md](../../docs/reproducing.md#memory-plans). A test fails when this page",
        "differs from what the tool writes today.",
    ]
    for bench in BENCHMARKS:
        results = plans(script_commands(bench), gpu_bytes, None)
        shown = "\n".join(f"{', '.join(f'`{name}`' for name in names)}:\n\n{text}\n" for names, text, _ in results)
        sections += ["", f"## {bench}.sh", "", shown.strip()]
    return "\n".join(sections) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu_gib", type=float, default=79.0, help="memory of each GPU (an H100 80GB: 79.0 GiB)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs of the node (default: training + engines x P)")
    parser.add_argument("--scripts_page", type=Path, help="write every benchmark script's plans to this page")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="after --: one command line (else: read from stdin)")
    options = parser.parse_args(argv)
    if options.scripts_page:
        write_page(options.scripts_page, scripts_page(int(options.gpu_gib * GIB)))
        return 0
    command = options.command[1:] if options.command[:1] == ["--"] else options.command
    lines = [shlex.join(command)] if command else sys.stdin.read().splitlines()
    results = plans(lines, int(options.gpu_gib * GIB), options.gpus)
    for names, text, _ in results:
        print(f"{', '.join(f'`{name}`' for name in names)}:\n\n{text}\n")
    return 0 if all(fits for _, _, fits in results) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
