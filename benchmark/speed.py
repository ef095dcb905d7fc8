"""Speed benchmark: the same run synchronous (`--async_level 0`) and asynchronous (`--async_level 1`),
then one table of how well generation and training overlap, and the timeline of both runs.

    python benchmark/speed.py --out_dir runs/speed -- --total_episodes 6400      # tiny task, CPU
    python benchmark/speed.py --script rloo_async.py --out_dir runs/speed_rloo -- --total_episodes 6400
    python benchmark/speed.py --model_size pythia-410m --out_dir runs/speed_410m \\
        --launch "accelerate launch --config_file configs/multi_gpu.yaml --num_processes 1" -- --vllm_dtype bfloat16

Flags after `--` go to the script, unchanged, in both runs (after the benchmark's own, so they win).
Both runs get the same flags but `--async_level` and `--output_dir`, with `--eval_freq 0` (only the
evaluations at step 0 and at the end remain) on 64 eval prompts, so that the step-0 evaluation ends
before the timed steps. Output: `<out_dir>/sync/`, `<out_dir>/async/` (runs, with `run.log`),
`speed.md` (the table) and `timeline.png`. While each run trains, its processes' threads are
sampled (psutil, once a second) to show which cores the engine and the trainer actually use.

`--model_size` other than `tiny` builds, offline, a randomly initialised GPTNeoX policy and reward
model of that Pythia size and prompts of `--prompt_length` tokens, to time real shapes (on GPUs);
`--models_only` builds them in `<out_dir>/models` and stops, and a later call reuses them.
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot_timeline  # noqa: E402
import timing  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY_TASK = ROOT / "tasks" / "tiny"
SCRIPTS = ("online_dpo_async.py", "rloo_async.py", "ppo_async.py")
# hidden size, layers, attention heads, MLP width of the Pythia suite (Biderman et al. 2023, table 1)
PYTHIA = {"pythia-160m": (768, 12, 12, 3072), "pythia-410m": (1024, 24, 16, 4096), "pythia-1b": (2048, 16, 8, 8192)}
PYTHIA_VOCAB = 50304  # embedding rows of every Pythia model (its tokenizer's 50277 tokens, padded)
TLDR_LENGTHS = (512, 53)  # query and response length of the paper's TLDR runs


# ---------------------------------------------------------------------------------------------
# Real shapes: random Pythia-sized models on the tiny task's word-level tokenizer
# ---------------------------------------------------------------------------------------------
def pythia_config(size: str):
    """GPTNeoX config of a Pythia size (transformers' GPTNeoX defaults are Pythia's: rotary on a
    quarter of each head, parallel residual, untied embeddings) on the tiny task's special tokens."""
    from transformers import GPTNeoXConfig

    hidden, layers, heads, mlp = PYTHIA[size]
    return GPTNeoXConfig(
        vocab_size=PYTHIA_VOCAB,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=mlp,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        num_labels=1,
    )


def filler(i: int) -> str:
    return f"tok{i}"


def build_tokenizer(folder: Path) -> None:
    """The tiny task's word-level tokenizer, its vocabulary grown with dummy words `tokN` to the
    model's vocab size, so every id the random policy samples decodes to a word and back."""
    spec = json.loads((TINY_TASK / "sft" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab.update({filler(i): i for i in range(len(vocab), PYTHIA_VOCAB)})
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text((TINY_TASK / "sft" / "tokenizer_config.json").read_text())


def write_prompts(folder: Path, prompt_length: int, limits=(("train", 4096), ("test", 512))) -> None:
    """The tiny task's prompts, each prefixed with dummy words to exactly `prompt_length` tokens (with BOS)."""
    import random

    rng = random.Random(0)
    folder.mkdir(parents=True)
    for split, limit in limits:
        with open(TINY_TASK / "data" / f"{split}.jsonl") as src, open(folder / f"{split}.jsonl", "w") as dst:
            for line, _ in zip(src, range(limit)):
                row = json.loads(line)
                pad = prompt_length - 1 - len(row["query"].split())
                if pad < 0:
                    raise SystemExit(
                        f"--prompt_length {prompt_length} is shorter than a tiny-task prompt ({prompt_length - pad})"
                    )
                row["query"] = " ".join([filler(rng.randrange(22, PYTHIA_VOCAB)) for _ in range(pad)] + [row["query"]])
                dst.write(json.dumps(row) + "\n")


def build_models(size: str, prompt_length: int, folder: Path, seed: int = 0) -> Path:
    """Random policy (`sft/`) and reward model (`reward/`) of a Pythia size with the tokenizer, and the
    prompts (`data/`), in `folder` (reused when already there). Built in a temporary folder and renamed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    done = folder / f"{size}-prompt{prompt_length}"
    if (done / "data" / "test.jsonl").exists():
        return done
    tmp = done.with_name(done.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    write_prompts(tmp / "data", prompt_length)
    torch.manual_seed(seed)
    for name, auto in (("sft", AutoModelForCausalLM), ("reward", AutoModelForSequenceClassification)):
        auto.from_config(pythia_config(size)).save_pretrained(tmp / name)  # safetensors
        build_tokenizer(tmp / name)
    tmp.rename(done)
    return done


# ---------------------------------------------------------------------------------------------
# Which cores the engine and the trainer really use
# ---------------------------------------------------------------------------------------------
TICK = os.sysconf("SC_CLK_TCK")


def thread_stats(pid: int) -> dict[int, tuple[float, int]]:
    """CPU seconds and current core of each thread of a process (from /proc: one read per thread)."""
    stats = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        stats[int(tid)] = ((int(fields[11]) + int(fields[12])) / TICK, int(fields[36]))
    return stats


def busy_per_core() -> dict[int, float]:
    """CPU seconds each core has been busy since boot (/proc/stat: all but idle and iowait)."""
    busy = {}
    for line in open("/proc/stat"):
        if line.startswith("cpu") and line[3].isdigit():
            name, *ticks = line.split()
            busy[int(name[3:])] = (sum(map(int, ticks[:8])) - int(ticks[3]) - int(ticks[4])) / TICK
    return busy


def watch(proc: subprocess.Popen, output_dir: Path, interval: float = 1.0) -> dict:
    """Sample the run's process tree until it exits. While it trains (after the warm-up steps, until
    its last step), each thread's CPU time since the last sample is added to the core it is on.
    Processes named `VLLM::*` and their children are the engine; the others the trainer. What the
    cores did besides is other processes' work: on a shared machine, it slows the run down."""
    usage = defaultdict(lambda: {"cores": defaultdict(float), "allowed": set()})  # (role, pid, name) -> ...
    last, seconds, num_steps, before = {}, 0.0, None, time.monotonic()
    busy, last_busy = defaultdict(float), busy_per_core()
    metrics = output_dir / "metrics.jsonl"
    while proc.poll() is None:
        time.sleep(interval)
        now = time.monotonic()
        if num_steps is None and (output_dir / "args.json").exists():
            num_steps = json.loads((output_dir / "args.json").read_text())["num_steps"]
        done = sum('"async/lag"' in line for line in open(metrics)) if metrics.exists() else 0
        training = num_steps is not None and timing.WARMUP <= done < num_steps
        try:
            root = psutil.Process(proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for p in tree:
            try:
                name, stats = p.name(), thread_stats(p.pid)
                role = "engine" if any(a.name().startswith("VLLM::") for a in (p, *p.parents())) else "trainer"
            except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError):
                continue
            entry = usage[role, p.pid, name]
            for tid, (cpu, core) in stats.items():
                if training and cpu > last.get(tid, cpu):
                    entry["cores"][core] += cpu - last[tid]
                    try:
                        entry["allowed"] |= os.sched_getaffinity(tid)  # of the threads that ran
                    except OSError:
                        pass
                last[tid] = cpu
        seconds, before = seconds + (now - before if training else 0), now
        for core, ticks in (now_busy := busy_per_core()).items():
            busy[core] += (ticks - last_busy.get(core, ticks)) if training else 0
        last_busy = now_busy
    ours = defaultdict(float)
    for u in usage.values():
        for core, cpu in u["cores"].items():
            ours[core] += cpu
    return {
        "seconds": seconds,
        "others": {core: max(busy[core] - ours[core], 0.0) for core in sorted(busy)},
        "processes": {
            key: value for key, value in usage.items() if sum(value["cores"].values()) > 0.01 * max(seconds, 1)
        },
    }


def format_usage(label: str, usage: dict) -> str:
    lines = [
        f"{label}: CPU use while training ({usage['seconds']:.0f} s sampled), per process: cores used (CPU-s per s), cores allowed"
    ]
    for (role, pid, name), u in sorted(usage["processes"].items()):
        busy = ", ".join(f"core {c}: {s / max(usage['seconds'], 1e-9):.2f}" for c, s in sorted(u["cores"].items()))
        lines.append(f"  {role:<8} {name:<16} pid {pid:<7} {busy:<28} allowed {sorted(u['allowed'])}")
    others = ", ".join(f"core {c}: {s / max(usage['seconds'], 1e-9):.2f}" for c, s in usage["others"].items())
    return "\n".join(lines + [f"  other processes on the machine: {others}"])


# ---------------------------------------------------------------------------------------------
def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="flags after -- go to the script")
    parser.add_argument(
        "--script", default="online_dpo_async.py", help=f"algorithm file to time: {', '.join(SCRIPTS)} or a fork of one"
    )
    parser.add_argument("--out_dir", default="runs/speed", help="where the two runs, speed.md and timeline.png go")
    parser.add_argument(
        "--model_size",
        default="tiny",
        choices=("tiny", *PYTHIA),
        help="tiny: the committed tiny task; else random models of that Pythia size",
    )
    parser.add_argument(
        "--prompt_length",
        type=int,
        default=None,
        help=f"prompt tokens with a Pythia size (default {TLDR_LENGTHS[0]}, TLDR's)",
    )
    parser.add_argument(
        "--launch",
        default=shlex.quote(sys.executable),
        help='command that starts the script, e.g. "accelerate launch --config_file configs/multi_gpu.yaml --num_processes 1"',
    )
    parser.add_argument(
        "--models_only",
        action="store_true",
        help="build the random models of --model_size in <out_dir>/models and stop (a later call with that out_dir "
        "reuses them)",
    )
    parser.add_argument("--steps", default="0:12", help="steps A to B-1 drawn in timeline.png")
    parser.add_argument(
        "--peak_tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak (989 for an H100 SXM): adds the model FLOP utilisation of each trainer phase",
    )
    args = parser.parse_args(own)
    if not (ROOT / args.script).is_file():
        parser.error(f"--script {args.script}: no such file (relative to the repository root)")
    if args.model_size == "tiny" and (args.prompt_length is not None or args.models_only):
        parser.error("--prompt_length and --models_only need --model_size other than tiny")
    if fixed := {"--async_level", "--output_dir"} & {flag.split("=")[0] for flag in extra}:
        parser.error(
            f"{', '.join(sorted(fixed))} after --: the benchmark sets --async_level (0, then 1) and --output_dir (from --out_dir)"
        )
    return args, extra


def main(argv: list[str]) -> None:
    args, extra = parse(argv)
    steps = plot_timeline.parse_steps(args.steps)
    out = Path(args.out_dir).resolve()
    runs = {"sync": out / "sync", "async": out / "async"}
    for run in runs.values():
        if (run / "metrics.jsonl").exists():
            raise SystemExit(
                f"--out_dir {args.out_dir} already holds {run / 'metrics.jsonl'}: the scripts append to it; pick another --out_dir"
            )
    common = ["--eval_freq", "0", "--num_eval_prompts", "64"]
    if args.model_size != "tiny":
        prompt_length = args.prompt_length or TLDR_LENGTHS[0]
        print(f"building random {args.model_size} models, prompts of {prompt_length} tokens ...", flush=True)
        models = build_models(args.model_size, prompt_length, out / "models")
        if args.models_only:
            print(f"built {models}")
            return
        common += [
            "--sft_model_path",
            str(models / "sft"),
            "--reward_model_path",
            str(models / "reward"),
            "--dataset_name",
            str(models / "data"),
            "--max_prompt_length",
            str(prompt_length),
            "--response_length",
            str(TLDR_LENGTHS[1]),
        ]
    usages = {}
    for (name, run), k in zip(runs.items(), (0, 1)):
        run.mkdir(parents=True, exist_ok=True)
        argv_run = [
            *shlex.split(args.launch),
            args.script,
            *common,
            *extra,
            "--async_level",
            str(k),
            "--output_dir",
            str(run),
        ]
        print(f"[{name}] {shlex.join(argv_run)}", flush=True)
        start = time.perf_counter()
        with open(run / "run.log", "w") as log:
            proc = subprocess.Popen(argv_run, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            usages[name] = watch(proc, run)
        if proc.returncode:
            raise SystemExit(f"[{name}] {args.script} exited with {proc.returncode}; see {run / 'run.log'}")
        print(f"[{name}] done in {time.perf_counter() - start:.0f} s", flush=True)
    table = timing.report([str(run / "metrics.jsonl") for run in runs.values()], args.peak_tflops)
    (out / "speed.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'speed.md'}")
    for name, usage in usages.items():
        print(format_usage(name, usage))
    paths = [str(run / "metrics.jsonl") for run in runs.values()]
    if all(plot_timeline.has_timeline(timing.read_lines(path)) for path in paths):
        title = (
            f"{Path(args.script).name}, {args.model_size}: the same steps synchronous (top) and asynchronous (bottom)"
        )
        plot_timeline.plot(paths, str(out / "timeline.png"), steps, title)
        print(f"wrote {out / 'timeline.png'}")
    else:
        print(f"no timeline.png: {args.script} does not log the timeline/* keys")


if __name__ == "__main__":
    main(sys.argv[1:])
