"""One TRL 1.16 run for benchmark/vs_trl.py: its online DPO trainer (`trl.experimental.online_dpo`) or its RLOO
trainer, synchronous, generating with vLLM in colocate mode (`--generation vllm`, on a GPU) or with transformers'
`generate` (`--generation hf`: TRL's colocate mode cannot load weights into vLLM's CPU backend), on the work vs_trl.py
gives it. The only file that imports trl (`pip install -r requirements-trl.txt`). docs/vs_trl.md.

It writes what our scripts write, under the same names, so that benchmark/timing.py reads both: `args.json`
(`episodes_per_step`, the cores and torch threads it ran on), `metrics.jsonl` (per step: `lr`, `time/generation`,
`time/weight_sync`, `time/scoring`, `time/training`, `time/wait_for_rollouts`, `timeline/step_start`; then
`eval/win_rate`, the tiny task's, of the policy at each evaluation step) and the trainer's peak CUDA memory in the file
named by $PEAK_MEMORY_FILE.
"""

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VLLM_ON_CPU = (
    "--generation vllm needs a GPU: TRL's colocate mode loads weights through each parameter's weight_loader, which "
    "vLLM's CPU backend does not keep (its packed linear layers); use --generation hf"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Every setting is a required flag, named as in our scripts (`--num_samples`: completions per prompt)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainer", required=True, choices=("online_dpo", "rloo"))
    parser.add_argument(
        "--generation", required=True, choices=("vllm", "hf"), help="vllm: TRL's colocate mode; hf: `generate`"
    )
    parser.add_argument(
        "--lr_schedule",
        required=True,
        choices=("trl", "ours"),
        help="trl: TRL's linear decay, step n at 1 - n/N; ours: our scripts', step n at 1 - (n+1)/N",
    )
    for flag in ("output_dir", "sft_model_path", "reward_model_path", "dataset_name"):
        parser.add_argument(f"--{flag}", required=True)
    for flag in (
        "total_episodes",
        "local_micro_batch_size",
        "gradient_accumulation_steps",
        "num_samples",
        "max_prompt_length",
        "response_length",
        "local_rollout_forward_batch_size",
        "num_eval_prompts",
        "eval_freq",
        "seed",
    ):
        parser.add_argument(f"--{flag}", required=True, type=int)
    for flag in ("learning_rate", "adam_epsilon", "temperature", "missing_eos_penalty", "vllm_gpu_memory_utilization"):
        parser.add_argument(f"--{flag}", required=True, type=float)
    parser.add_argument("--dtype", required=True, choices=("bfloat16", "float32"))
    parser.add_argument("--beta", type=float, help="online DPO's beta")
    parser.add_argument("--kl_coef", type=float, help="RLOO's KL coefficient (TRL's `beta`)")
    parser.add_argument("--cliprange", type=float, help="RLOO's ratio clip (TRL's `epsilon`)")
    args = parser.parse_args(argv)
    needed = ("beta",) if args.trainer == "online_dpo" else ("kl_coef", "cliprange")
    if missing := [f"--{flag}" for flag in needed if getattr(args, flag) is None]:
        parser.error(f"--trainer {args.trainer} needs {', '.join(missing)}")
    return args


def ordered_prompts(queries: list[str], num_steps: int, batch_size: int, seed: int) -> list[str]:
    """The prompts of every step in our scripts' order (`prompt_indices_for_step`), one after the other: read in
    order (TRL's samplers set not to shuffle), TRL trains on the same prompts at every step as our runs."""
    from online_dpo_async import prompt_indices_for_step

    return [
        queries[i] for step in range(num_steps) for i in prompt_indices_for_step(step, len(queries), batch_size, seed)
    ]


def eval_steps(num_steps: int, eval_freq: int) -> list[int]:
    """The policy versions our scripts evaluate (their main()): every eval_freq steps, step 0 and the end."""
    return sorted({0, num_steps, *range(0, num_steps, eval_freq or num_steps)})


def evaluate_versions(versions, load, generate, evaluation, args, episodes_per_step, out: Path, tokenizer) -> None:
    """Our scripts' evaluation of each saved policy version, in order: `load(state)` puts it in the engine, then
    `generate` samples one completion per eval prompt with the same per-prompt seeds and temperature as our
    runs, and the tiny task's gold judge compares it with the reference. One metrics line per version."""
    import online_dpo_async as ours

    seeds = [args.seed + i for i in range(len(evaluation.token_ids))]
    for version, state in versions.items():
        load(state)
        start = time.perf_counter()
        call = ("evaluation", version)
        responses, _ = generate(
            call, evaluation.token_ids, 1, args.temperature, args.response_length, tokenizer.eos_token_id, seeds
        )
        generation_time = time.perf_counter() - start
        r_ids, r_mask, _ = ours.truncate_responses(
            responses, args.response_length, tokenizer.eos_token_id, tokenizer.pad_token_id
        )
        texts = [tokenizer.decode(r[m.bool()].tolist()) for r, m in zip(r_ids, r_mask)]
        gold = [ours.tiny_gold_score(q, t) for q, t in zip(evaluation.queries, texts)]
        reference = [ours.tiny_gold_score(q, r) for q, r in zip(evaluation.queries, evaluation.references)]
        line = {
            "step": version,
            "episode": version * episodes_per_step,
            "eval/gold_score": sum(gold) / len(gold),
            "eval/win_rate": sum(ours.win_rates(gold, reference)) / len(gold),
            "time/eval_generation": generation_time,
        }
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"eval step {version}: win rate {line['eval/win_rate']:.4f}", flush=True)


def our_engine(args: argparse.Namespace, policy, dtype):
    """Our scripts' engine (plumbing.engine.make_engine, loaded from --sft_model_path; on a CPU in this process, on
    its first core) and a `load(state)` that pushes a state dict of `policy` into it as our scripts push (checked
    against what the engine holds): the evaluation of the HF-generate path. Returns the engine, `load`, `close()`."""
    import torch

    from plumbing.engine import make_engine
    from plumbing.placement import engine_placement, visible_gpus
    from plumbing.weights import SnapshotPlace, WeightBucket, checkpoint_names, push_weights, take_snapshot

    visible = visible_gpus()
    placement = engine_placement("shared" if visible else "auto", visible, 1, args.vllm_gpu_memory_utilization)
    if not visible:  # after training, on a CPU: the engine in this process starts 15 s sooner than in its own two
        first_core = str(sorted(os.sched_getaffinity(0))[0])
        os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=first_core)
    llm = make_engine(
        args.sft_model_path,
        placement,
        dtype=args.dtype,
        max_model_len=args.max_prompt_length + args.response_length,
        enforce_eager=True,
        seed=args.seed,
    )
    folder = tempfile.mkdtemp(prefix="trl-eval-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    device = torch.device("cuda", int(placement.engine_gpu)) if placement.devices is not None else None
    bucket, place, names = WeightBucket(device, folder), SnapshotPlace(visible != [], folder), checkpoint_names(policy)
    pushes = itertools.count(1)

    def load(state: dict) -> None:
        push_weights(llm, bucket, take_snapshot(next(pushes), state.items(), names, dtype, place, policy))

    def close() -> None:
        llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(folder, ignore_errors=True)

    return llm, load, close


def main(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from torch.optim.lr_scheduler import LambdaLR
    from torch.utils.data import SequentialSampler
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import online_dpo_async as ours
    import plumbing
    from plumbing.flags import quiet_known_noise

    if args.generation == "vllm" and not torch.cuda.is_available():
        raise SystemExit(f"error: {VLLM_ON_CPU}")
    if args.generation == "vllm":  # TRL's colocated engine samples as ours do: without FlashInfer where it is absent
        import importlib.util

        from plumbing.engine import sampler_settings

        os.environ.update(sampler_settings(os.environ, importlib.util.find_spec("flashinfer") is not None))
    from trl import RLOOConfig, RLOOTrainer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    quiet_known_noise()  # as our scripts (plumbing.run)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the cores this process may use (vs_trl.py pins each run to the same ones): a torch thread on each, as
    # generation and training take turns on them
    cores = sorted(os.sched_getaffinity(0))
    torch.set_num_threads(len(cores))
    bf16 = args.dtype == "bfloat16"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True  # as our scripts
    K, prompts_per_step = args.num_samples, args.local_micro_batch_size * args.gradient_accumulation_steps
    episodes_per_step = prompts_per_step * K
    num_steps = args.total_episodes // episodes_per_step
    if num_steps * episodes_per_step != args.total_episodes:
        raise SystemExit(
            f"--total_episodes {args.total_episodes} is not a multiple of the episodes per step, {episodes_per_step}"
        )
    run_facts = {"episodes_per_step": episodes_per_step, "num_steps": num_steps, "cores": cores}
    run_facts["torch_threads"] = torch.get_num_threads()
    (out / "args.json").write_text(json.dumps({**vars(args), **run_facts}, indent=2))

    tokenizer = AutoTokenizer.from_pretrained(args.sft_model_path)
    # the prompts as our scripts read them: the tiny task's format, those over --max_prompt_length dropped
    ours_args = ours.Args(dataset_name=args.dataset_name, max_prompt_length=args.max_prompt_length)
    train = ours.load_prompts(ours_args, "train", tokenizer)
    queries = ordered_prompts(train.queries, num_steps, prompts_per_step, args.seed)
    # TRL's online DPO encodes the prompts it generates from with `generate` without special tokens; starting each
    # with the BOS token's text gives it the ids our scripts train on (the reward below encodes the rest)
    with_bos = args.trainer == "online_dpo" and args.generation == "hf" and tokenizer.bos_token is not None
    dataset = Dataset.from_dict({"prompt": [tokenizer.bos_token + q for q in queries] if with_bos else queries})
    # fp32 weights under bf16 autocast for the policy (and TRL's reference, a copy of it); bf16 weights for the reward model
    policy = AutoModelForCausalLM.from_pretrained(args.sft_model_path, dtype=torch.float32, use_safetensors=True).to(
        device
    )
    reward_model = plumbing.load_reward_model(
        args.reward_model_path,
        "--reward_model_path",
        dtype=torch.bfloat16 if bf16 else torch.float32,
        use_safetensors=True,
    )
    ours.disable_dropout(reward_model)
    reward_model.to(device).eval().requires_grad_(False)
    # our optimizer at our default weight decay, 0 (TRL's default would be fused AdamW, the same with no decay)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, eps=args.adam_epsilon, weight_decay=0.0)
    scheduler = None  # TRL's: lr_scheduler_type="linear" below
    if args.lr_schedule == "ours":
        scheduler = LambdaLR(optimizer, partial(ours.lr_factor, "linear", num_steps=num_steps))
    timings = {"generation": 0.0, "weight_sync": 0.0, "scoring": 0.0}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def reward(prompts, completions, completion_ids, **kwargs):
        """Our scripts' reward: the reward model on prompt + completion up to its first EOS (ids as our scripts
        encode them) and the fixed --missing_eos_penalty score without EOS (TRL's own penalty subtracts instead)."""
        start = time.perf_counter()
        q_ids, q_mask = ours.left_pad(
            tokenizer(list(prompts), add_special_tokens=not with_bos).input_ids,
            args.max_prompt_length,
            tokenizer.pad_token_id,
        )
        r_ids, r_mask, eos = ours.truncate_responses(
            [list(map(int, c)) for c in completion_ids],
            args.response_length,
            tokenizer.eos_token_id,
            tokenizer.pad_token_id,
        )
        batch = ours.Batch(*(t.to(device) for t in (q_ids, q_mask, r_ids, r_mask, eos)))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            scores = ours.score_completions(
                reward_model, tokenizer, tokenizer, batch, args.local_rollout_forward_batch_size
            )
        scores = ours.apply_missing_eos_penalty(scores, batch.contain_eos, args.missing_eos_penalty).tolist()
        timings["scoring"] += time.perf_counter() - start
        return scores

    def timed(obj, name: str, key: str) -> None:
        method = getattr(obj, name)

        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return method(*a, **kw)
            finally:
                sync()
                timings[key] += time.perf_counter() - start

        setattr(obj, name, wrapper)

    to_evaluate = set(eval_steps(num_steps, args.eval_freq)) if args.num_eval_prompts else set()
    versions = {}  # policy version -> its weights on the CPU, evaluated after training (outside the timed steps)

    def keep_version(version: int) -> None:
        if version in to_evaluate:
            versions[version] = {name: t.detach().to("cpu", copy=True) for name, t in policy.state_dict().items()}

    class StepTimer(TrainerCallback):
        """One line per optimizer step in our metric names. TRL's trainer generates, then trains: it waits for its
        rollouts while it generates them (`time/wait_for_rollouts` = generation + weight sync), as ours at --async_level 0."""

        def on_train_begin(self, *a, **kw):
            keep_version(0)
            self.run_start = time.perf_counter()

        def on_step_begin(self, *a, **kw):
            self.start = time.perf_counter()
            self.lr = optimizer.param_groups[0]["lr"]  # this step's (the scheduler steps after the update)
            timings.update(dict.fromkeys(timings, 0.0))

        def on_step_end(self, _args, state, *a, **kw):
            sync()
            end, g = time.perf_counter(), timings["generation"] + timings["weight_sync"]
            step = state.global_step - 1
            line = {
                "step": step,
                "episode": (step + 1) * episodes_per_step,
                "lr": self.lr,
                "async/lag": 0,
                "async/version": step,
                "time/generation": timings["generation"],
                "time/weight_sync": timings["weight_sync"],
                "time/scoring": timings["scoring"],
                "time/wait_for_rollouts": g,
                "time/training": end - self.start - g,
                "time/step": end - self.start,
                "timeline/step_start": self.start - self.run_start,
            }
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
            keep_version(state.global_step)

    common = dict(  # TrainingArguments fields, set to our scripts' values
        output_dir=str(out / "trl"),
        max_steps=num_steps,
        per_device_train_batch_size=args.local_micro_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        adam_epsilon=args.adam_epsilon,
        lr_scheduler_type="linear",
        warmup_steps=0,
        max_grad_norm=1.0,  # our scripts' --max_grad_norm default (the paper's runs clipped at 1.0)
        bf16=bf16,
        fp16=False,
        use_cpu=device.type == "cpu",
        seed=args.seed,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        gradient_checkpointing=False,
        disable_dropout=True,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=args.generation == "vllm",
    )
    if args.generation == "vllm":
        common |= dict(vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_gpu_memory_utilization)
    if args.trainer == "online_dpo":

        class InOrder(OnlineDPOTrainer):
            def _get_train_sampler(self, *a, **kw):
                return SequentialSampler(self.train_dataset)

        config = OnlineDPOConfig(
            **common,
            beta=args.beta,
            loss_type="sigmoid",
            max_new_tokens=args.response_length,
            max_length=args.max_prompt_length + args.response_length,
            missing_eos_penalty=None,
        )
        trainer = InOrder(
            model=policy,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            optimizers=(optimizer, scheduler),
            callbacks=[StepTimer()],
        )
        if args.generation == "vllm":
            llm, push = trainer.llm, trainer._move_model_to_vllm
            timed(trainer, "_move_model_to_vllm", "weight_sync")
    else:
        # TRL's RLOO batch sizes count completions, ours prompts
        common["per_device_train_batch_size"] = args.local_micro_batch_size * K
        if args.generation == "vllm":
            common["vllm_max_model_length"] = args.max_prompt_length + args.response_length
        config = RLOOConfig(
            **common,
            num_generations=K,
            beta=args.kl_coef,
            epsilon=args.cliprange,
            num_iterations=1,
            normalize_advantages=False,
            shuffle_dataset=False,
            max_completion_length=args.response_length,
        )
        trainer = RLOOTrainer(
            model=policy,
            reward_funcs=[reward],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            optimizers=(optimizer, scheduler),
            callbacks=[StepTimer()],
        )
        if args.generation == "vllm":
            llm, push = trainer.vllm_generation.llm, trainer.vllm_generation.sync_weights
            timed(trainer.vllm_generation, "sync_weights", "weight_sync")
    # what TRL generates with: its colocated engine, or the policy's own `generate` (no weights to sync)
    timed(llm if args.generation == "vllm" else policy, "generate", "generation")
    trainer.train()
    if peak_file := os.environ.get("PEAK_MEMORY_FILE"):
        peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
        Path(peak_file).write_text(json.dumps({"max_memory_allocated": peak}))
    if not versions:
        return

    # TRL evaluates nothing during training: the policy versions our runs evaluate, after training, as our scripts
    # evaluate them (the same eval prompts, the same engine's sampling with the same per-prompt seeds and temperature,
    # the tiny task's gold judge against the references). HF-generate runs get our scripts' engine for it.
    eval_args = dataclasses.replace(ours_args, num_eval_prompts=args.num_eval_prompts)
    evaluation = ours.load_prompts(eval_args, "test", tokenizer, evaluation=True)
    evaluate = partial(
        evaluate_versions, versions, evaluation=evaluation, args=args, episodes_per_step=episodes_per_step, out=out
    )
    if args.generation == "vllm":

        def load(state: dict) -> None:
            policy.load_state_dict(state)
            push()

        evaluate(load=load, generate=partial(ours.generate, plumbing.Engine.around([llm], [None])), tokenizer=tokenizer)
        return
    engine_dtype = torch.bfloat16 if bf16 else torch.float32
    llm, load, close = our_engine(args, policy, engine_dtype)
    try:
        evaluate(load=load, generate=partial(ours.generate, plumbing.Engine.around([llm], [None])), tokenizer=tokenizer)
    finally:
        close()


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
