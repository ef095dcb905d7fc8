"""2b. A step's timings and FLOPs: its phases timed one after the other, the async pipeline's figures (how
long each side took, when each began, the throughput) and the matmul FLOPs of a forward pass, from which each
phase's MFU follows (docs/metrics.md)."""

import time

import torch


class Laps:
    """A training step's phases, timed one after the other: `lap(name)` ends phase `name`, begun where the
    previous one ended. The first phase is the wait for the step's rollouts; the others are its training."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.seconds, self.begun = {}, {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self.begun[name], self.last = now - self.last, self.last, now


def pipeline_metrics(
    laps: Laps, generator: dict, origin: float, flops: dict, episodes: int, tokens: float
) -> dict:
    """A step's figures of the async pipeline: the seconds of each phase, the trainer's (`laps`) and the
    generator's (`generator`: name -> (start or None, seconds)); their starts (`timeline/`, seconds since
    `origin`); the FLOPs of the trainer's phases; the throughput of the `episodes` and (response) `tokens`
    trained on."""
    step = time.perf_counter() - laps.start
    training_start = laps.start + next(iter(laps.seconds.values()))
    seconds = {name: s for name, (_, s) in generator.items()} | laps.seconds
    seconds |= {"training": laps.last - training_start, "step": step}
    starts = {"step_start": laps.start, "training_start": training_start}
    starts |= {f"{name}_start": start for name, (start, _) in generator.items() if start is not None}
    return {
        **{f"time/{k}": v for k, v in seconds.items()},
        **{f"flops/{k}": v for k, v in flops.items()},
        **{f"timeline/{k}": v - origin for k, v in starts.items()},
        "throughput/episodes_per_second": episodes / step,
        "throughput/tokens_per_second": tokens / step,
    }


def numel(tensor: torch.Tensor) -> int:
    """A parameter's size, whole: ZeRO-3 leaves each process a shard of it."""
    return getattr(tensor, "ds_numel", tensor.numel())


def forward_flops(model, sequences: int, length: int, logit_positions: int | None = None) -> int:
    """Matmul FLOPs of a forward pass, 2 per parameter and token (Kaplan et al. 2020, no attention term):
    every token through the body, `logit_positions` per sequence (None: all) through the output head, none
    through the input embedding (a lookup). A training pass is 3 forwards' worth, 4 when recomputing
    activations."""
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_params = 0 if head is None else numel(head.weight)
    tied = head is not None and head.weight is embedding
    body = sum(numel(p) for p in model.parameters()) - numel(embedding) - (0 if tied else head_params)
    head_tokens = length if logit_positions is None else logit_positions
    return 2 * sequences * (body * length + head_params * head_tokens)
