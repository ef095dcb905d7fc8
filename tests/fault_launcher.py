"""The tests' launcher of an algorithm file with a fault injected from outside, so that the method's functions hold
no test code (docs/tests.md#faults). A fake on purpose: it wraps a function of the file or of the plumbing to fail
at a chosen step, and then runs the file as `python <file>` would.

    python tests/fault_launcher.py FAULT SCRIPT [FLAG ...]

FAULT is <where>:<step>:
    generation:N  the generation thread raises as it starts rollout N (prompt_indices_for_step)
    scoring:N     the trainer raises right after scoring step N (plumbing's check of the scores)
    nan_score:N   the first score of step N is NaN, as if the reward model had given it
    nonfinite_scores:N  the first three scores of step N are NaN, +inf and -inf
    nan_loss:N    the loss of step N's updates is NaN (the file's loss function, whichever it has); inf_loss:N and
                  -inf_loss:N: +inf, -inf
    wrong_copy:V  the push of policy version V finds a wrong value planted in its bucket, after the copy of its first
                  run, in the first element of the run's last tensor (a copy from the host snapshot gone wrong)
    stale_run:V   the push of policy version V finds its second run (its only one: its first) never copied into the
                  bucket: the bucket still holds what the load before it read, an earlier run or version
    permuted:V    the push of policy version V finds two rows of the first q_proj swapped in its bucket (a tensor vLLM
                  fuses, which the element check leaves to the sums): every value kept, two in another order
    swapped_experts:V  the push of policy version V finds the tensors of experts 0 and 1 of its first layer of experts
                  swapped in its bucket: every value kept, the experts in another order
    freeze_push:N        the engine's worker is stopped (SIGSTOP) as the weight push of policy version N begins
    freeze_generation:N  the engine's scheduler process is stopped (SIGSTOP) once rollout N's prompts are sent to
                         it, as the generation thread waits for its first step
    kill_generation:N    the engine's worker is killed (SIGKILL) there (every engine's, with --vllm_num_engines)
    kill_engine:N        the last engine's worker alone is killed there (with --vllm_num_engines 2 or more)
    freeze_evaluation:V  the engine's scheduler process is stopped (SIGSTOP) once the evaluation of policy version V
                         is sent to it (the last, V = the number of steps: after the last step)
    freeze_start:E       engine E's scheduler process is stopped (SIGSTOP) as soon as it is seen, while it starts
Each raised fault says "injected test fault in ... (time T)", T the time.time() it was raised; a signal to the
engine says "injected test fault in the engine: SIGSTOP to ... (time T)"; each planted one says "injected test
fault: ..." as it plants it.
"""

import contextlib
import functools
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# The loss function of each file, whose result (or its first element) the nan_loss fault makes NaN.
LOSSES = ("dpo_batch_loss", "proximal_rloo_loss", "ppo_policy_loss")


def inject(fault: str, module) -> None:
    """Wrap the function `fault` names so that it fails at its step or push."""
    import torch

    import plumbing.distributed

    where, at = fault.split(":")
    at, seen = int(at), {"step": None}  # the training step the trainer is on, from the check of its scores
    value = {"inf_loss": float("inf"), "-inf_loss": float("-inf")}.get(where, float("nan"))
    where = "nan_loss" if where.endswith("inf_loss") else where
    check_scores = plumbing.distributed.check_scores

    def checking_scores(scores, source, step):
        seen["step"] = step
        if where == "scoring" and step == at:
            raise RuntimeError(f"injected test fault in reward scoring at step {step} (time {time.time():.2f})")
        if where == "nan_score" and step == at:
            scores = scores.clone()
            scores[0] = float("nan")
        if where == "nonfinite_scores" and step == at:
            scores = scores.clone()
            scores[:3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
        return check_scores(scores, source, step)

    plumbing.distributed.check_scores = checking_scores
    if where == "generation":
        prompt_indices_for_step = module.prompt_indices_for_step

        @functools.wraps(prompt_indices_for_step)
        def failing(step, *args):
            if step == at:
                raise RuntimeError(f"injected test fault in generation at rollout {step} (time {time.time():.2f})")
            return prompt_indices_for_step(step, *args)

        module.prompt_indices_for_step = failing
    if where == "nan_loss":
        name = next(name for name in LOSSES if hasattr(module, name))
        loss_function = getattr(module, name)

        @functools.wraps(loss_function)
        def nan_loss(*args, **kwargs):
            out = loss_function(*args, **kwargs)
            if seen["step"] != at:
                return out
            # the value itself, in the graph: a finite loss times inf is -inf or NaN where it is negative or 0
            return (out[0] * 0 + value, *out[1:]) if isinstance(out, tuple) else out * 0 + value

        setattr(module, name, nan_loss)
    if where == "freeze_push":
        push = plumbing.engine.Engine.push

        def freezing_push(engine, weights, keep_cache=False):
            if weights.version == at:
                signal_engine(signal.SIGSTOP, "VLLM::Worker", f"as the weight push of policy version {at} begins")
            return push(engine, weights, keep_cache)

        plumbing.engine.Engine.push = freezing_push
    if where in ("freeze_generation", "kill_generation", "kill_engine", "freeze_evaluation"):
        freezes = where in ("freeze_generation", "freeze_evaluation")
        sent = (signal.SIGSTOP, "VLLM::EngineCore") if freezes else (signal.SIGKILL, "VLLM::Worker")
        generate = plumbing.engine.Engine.generate
        wanted = ("evaluation" if where == "freeze_evaluation" else "rollout", at)

        def signalling_generate(engine, prompts, params, call):
            if call == wanted:
                llm_engine = engine.llms[0].llm_engine  # vLLM's LLM.generate sends the prompts, then steps it
                step = llm_engine.step
                last = [p for p in engine.engine_processes if engine.engine_of[p.pid] == len(engine.llms) - 1]
                among = last if where == "kill_engine" else None

                def signal_then_step():
                    llm_engine.step = step
                    signal_engine(*sent, f"as {call[0]} {at} is generated", among)
                    return step()

                llm_engine.step = signal_then_step
            return generate(engine, prompts, params, call)

        plumbing.engine.Engine.generate = signalling_generate

    if where == "freeze_start":
        make_engine, started = plumbing.engine.make_engine, []

        def freezing_start(*args, **kwargs):
            if len(started) == at:
                before = {process.pid for process in psutil.Process().children(recursive=True)}
                threading.Thread(target=stop_the_new_scheduler, args=(before,), daemon=True).start()
            started.append(True)
            return make_engine(*args, **kwargs)

        plumbing.engine.make_engine = freezing_start

    if where in ("wrong_copy", "stale_run", "permuted", "swapped_experts"):
        import plumbing.weights

        plumbing.weights.WeightBucket.fill = faulty_fill(plumbing.weights.WeightBucket.fill, where, at)


def stop_the_new_scheduler(before: set[int]) -> None:
    """SIGSTOP to the engine scheduler process that is not among `before`, once it is seen (its start frozen)."""
    while True:
        for process in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if process.pid not in before and process.name() == "VLLM::EngineCore":
                    signal_engine(signal.SIGSTOP, "VLLM::EngineCore", "as it starts", [process])
                    return
        time.sleep(0.05)


def signal_engine(sig: signal.Signals, name: str, when: str, among: list | None = None) -> None:
    """`sig` to the engine's processes called `name` (SIGSTOP: they stop answering but do not die), `among` these
    processes (None: all this process started)."""
    among = psutil.Process().children(recursive=True) if among is None else among
    targets = [p for p in among if p.name() == name]
    for process in targets:
        os.kill(process.pid, sig)
    pids = ", ".join(str(p.pid) for p in targets)
    print(
        f"injected test fault in the engine: {sig.name} to {name} (pid {pids}) {when} (time {time.time():.2f})",
        flush=True,
    )


def faulty_fill(fill, fault: str, version: int):
    """WeightBucket.fill, but for the push of policy `version`: a wrong value planted in the bucket after the copy
    of its first run ("wrong_copy"), or its second run (its only one: its first) never copied ("stale_run"), the
    bucket and its header left as the load before found them; or elements moved within what a run holds, every
    value kept ("permuted", "swapped_experts": out_of_order). A fake on purpose: the faults a bug in the copy from
    the host snapshot, or a loader holding a layout the check does not know of, would make, which the engine's
    check after the push must name."""

    import plumbing.weights

    def filled_runs(bucket, weights):
        runs, run, planted = fill(bucket, weights), 0, False
        while True:
            left = None if bucket.flat is None else (bucket.flat.clone(), bucket.header.clone())
            try:
                filled = next(runs)
            except StopIteration:
                return
            count = len(plumbing.weights.bucket_chunks(weights.layout, bucket.flat.numel()))
            if weights.version == version and fault == "wrong_copy" and run == 0:
                name, _, offset = filled.layout[-1]
                bucket.flat[offset] += 1.0
                print(f"injected test fault: a wrong value planted in {name} of version {version}'s bucket")
            if weights.version == version and fault == "stale_run" and run == min(1, count - 1):
                bucket.flat.copy_(left[0])
                bucket.header.copy_(left[1])
                print(f"injected test fault: run {run} of version {version} never copied into the bucket")
            if weights.version == version and fault in ("permuted", "swapped_experts") and not planted:
                if (what := out_of_order(bucket.flat, filled.layout, fault)) is not None:
                    planted = True
                    print(f"injected test fault: {what} in version {version}'s bucket")
            run += 1
            yield filled

    return filled_runs


def out_of_order(flat, layout: list, fault: str) -> str | None:
    """Moves elements within the tensors of `layout` in the buffer `flat`, every value kept, so that every sum is the
    same: rows 0 and 1 of the first q_proj ("permuted"), or the tensors of experts 0 and 1 of the first layer of
    experts swapped ("swapped_experts"). Returns what it did, or None where `layout` has no such tensor."""
    import plumbing.weights

    views = dict(plumbing.weights.views(flat, layout))
    if fault == "permuted":
        name = next((name for name in views if name.endswith("q_proj.weight")), None)
        if name is None:
            return None
        rows = views[name]
        rows[[0, 1]] = rows[[1, 0]]
        return f"rows 0 and 1 of {name} swapped"
    first = [name for name in views if ".experts.0." in name]
    if not first:
        return None
    layer = first[0].partition(".experts.0.")[0]
    for name in (name for name in first if name.startswith(f"{layer}.experts.0.")):
        other = views[name.replace(".experts.0.", ".experts.1.")]
        kept = views[name].clone()
        views[name].copy_(other)
        other.copy_(kept)
    return f"experts 0 and 1 of {layer} swapped"


def main() -> None:
    fault, script, *flags = sys.argv[1:]
    sys.path.insert(0, str(ROOT))
    import plumbing

    module = importlib.import_module(Path(script).stem)
    inject(fault, module)
    sys.argv = [script, *flags]
    plumbing.run(module.main, module.Args, module.__doc__)


if __name__ == "__main__":
    main()
