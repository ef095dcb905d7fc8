"""The tests' launcher of an algorithm file with a fault injected from outside, so that the method's functions hold
no test code (docs/tests.md#faults). A fake on purpose: it wraps a function of the file or of the plumbing to fail
at a chosen step, and then runs the file as `python <file>` would.

    python tests/fault_launcher.py FAULT SCRIPT [FLAG ...]

FAULT is <where>:<step>:
    generation:N  the generation thread raises as it starts rollout N (prompt_indices_for_step)
    scoring:N     the trainer raises right after scoring step N (plumbing's check of the scores)
    nan_score:N   the first score of step N is NaN, as if the reward model had given it
    nan_loss:N    the loss of step N's updates is NaN (the file's loss function, whichever it has)
    freeze_push:N        the engine's worker is stopped (SIGSTOP) as the weight push of policy version N begins
    freeze_generation:N  the engine's scheduler process is stopped (SIGSTOP) once rollout N's prompts are sent to
                         it, as the generation thread waits for its first step
    kill_generation:N    the engine's worker is killed (SIGKILL) there
Each raised fault says "injected test fault in ... (time T)", T the time.time() it was raised; a signal to the
engine says "injected test fault in the engine: SIGSTOP to ... (time T)".
"""

import contextlib
import functools
import importlib
import os
import signal
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
# The loss function of each file, whose result (or its first element) the nan_loss fault makes NaN.
LOSSES = ("dpo_batch_loss", "proximal_rloo_loss", "ppo_policy_loss")


def inject(fault: str, module) -> None:
    """Wrap the function `fault` names so that it fails at its step."""
    import plumbing.distributed

    where, at = fault.split(":")
    at, seen = int(at), {"step": None}  # the training step the trainer is on, from the check of its scores
    check_scores = plumbing.distributed.check_scores

    def checking_scores(scores, source, step):
        seen["step"] = step
        if where == "scoring" and step == at:
            raise RuntimeError(f"injected test fault in reward scoring at step {step} (time {time.time():.2f})")
        if where == "nan_score" and step == at:
            scores = scores.clone()
            scores[0] = float("nan")
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
            return (out[0] * float("nan"), *out[1:]) if isinstance(out, tuple) else out * float("nan")

        setattr(module, name, nan_loss)
    if where == "freeze_push":
        push = plumbing.engine.Engine.push

        def freezing_push(engine, weights):
            if weights.version == at:
                signal_engine(signal.SIGSTOP, "VLLM::Worker", f"as the weight push of policy version {at} begins")
            return push(engine, weights)

        plumbing.engine.Engine.push = freezing_push
    if where in ("freeze_generation", "kill_generation"):
        sent = (
            (signal.SIGSTOP, "VLLM::EngineCore") if where == "freeze_generation" else (signal.SIGKILL, "VLLM::Worker")
        )
        deadline = plumbing.engine.Engine.deadline

        @contextlib.contextmanager
        def signalling_deadline(engine, kind, index):
            with deadline(engine, kind, index):
                if kind == "rollout" and index == at:
                    llm_engine = engine.llm.llm_engine  # vLLM's LLM.generate sends the prompts, then steps it
                    step = llm_engine.step

                    def signal_then_step():
                        llm_engine.step = step
                        signal_engine(*sent, f"as rollout {at} is generated")
                        return step()

                    llm_engine.step = signal_then_step
                yield

        plumbing.engine.Engine.deadline = signalling_deadline


def signal_engine(sig: signal.Signals, name: str, when: str) -> None:
    """`sig` to the engine's processes called `name` (SIGSTOP: they stop answering but do not die)."""
    targets = [p for p in psutil.Process().children(recursive=True) if p.name() == name]
    for process in targets:
        os.kill(process.pid, sig)
    pids = ", ".join(str(p.pid) for p in targets)
    print(
        f"injected test fault in the engine: {sig.name} to {name} (pid {pids}) {when} (time {time.time():.2f})",
        flush=True,
    )


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
