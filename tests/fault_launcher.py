"""The tests' launcher of an algorithm file with a fault injected from outside, so that the method's functions hold
no test code (docs/tests.md#faults). A fake on purpose: it wraps a function of the file or of the plumbing to fail
at a chosen step, and then runs the file as `python <file>` would.

    python tests/fault_launcher.py FAULT SCRIPT [FLAG ...]

FAULT is <where>:<step>:
    generation:N  the generation thread raises as it starts rollout N (prompt_indices_for_step)
    scoring:N     the trainer raises right after scoring step N (plumbing's check of the scores)
    nan_score:N   the first score of step N is NaN, as if the reward model had given it
    nan_loss:N    the loss of step N's updates is NaN (the file's loss function, whichever it has)
Each raised fault says "injected test fault in ... (time T)", T the time.time() it was raised.
"""

import functools
import importlib
import sys
import time
from pathlib import Path

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
