"""The tests' two-process run of rloo_async.rloo_update (tests/test_rloo_units.py): each training process takes its
rank's half of a batch that the test wrote, and rank 0 saves the policy after the update, so that the test can compare
it with one optimizer step on the whole batch computed by hand.

    ACCELERATE_USE_CPU=1 accelerate launch --config_file configs/cpu_2proc.yaml tests/two_process_update.py IN OUT

IN (torch.save): the policy's folder, rloo_async.Args' fields, the Batch's and the Targets' fields by name, the
learning rate of plain SGD; OUT: the updated policy's state dict.
"""

import os
import sys
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from transformers import LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rloo_async as rloo  # noqa: E402


def main(inputs: str, output: str) -> None:
    given = torch.load(inputs)
    args = rloo.Args(**given["args"])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.gradient_accumulation_steps)
    sizes = rloo.compute_sizes(args, accelerator.num_processes)
    policy = LlamaForCausalLM.from_pretrained(given["policy"])
    rloo.disable_dropout(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=given["learning_rate"])
    model, optimizer = accelerator.prepare(policy, optimizer)
    completions = sizes.local_batch_size * args.rloo_k
    mine = slice(accelerator.process_index * completions, (accelerator.process_index + 1) * completions)
    batch = rloo.Batch(**{name: tensor[mine] for name, tensor in given["batch"].items()})
    targets = rloo.Targets(**{name: None if t is None else t[mine] for name, t in given["targets"].items()})
    rloo.rloo_update(model, optimizer, accelerator, batch, targets, args, sizes, np.random.default_rng(0))
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), output)
    accelerator.wait_for_everyone()


def leave() -> None:
    """Exit without the interpreter's teardown. Destroying the gloo process group there deadlocks now and then: the
    DDP reducer's release (holding the GIL) joins gloo's thread while it waits for the GIL to free the barrier's
    tensors; gloo's threads left running abort the exit instead. What this run writes is written by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
    leave()
