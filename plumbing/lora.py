"""4a. LoRA (--lora_rank), the trainer's side: the policy's adapter, the only weights that train and travel.

The policy is the base model with a PEFT LoRA adapter of rank r on --lora_target_modules (add_adapter), whose
update is B A x scaled by alpha / r; the reference is the same model with the adapter off (AdapterOff), no
copy of its own, so the KL at step 0 is exactly 0. A policy version is its adapter alone (adapter_names): A,
and B already scaled by alpha / r (for_the_engine), so that the engine, told alpha = r (lora_push.py),
scales by exactly 1 and holds bit for bit what the trainer fingerprinted. How a version reaches the engine and
is proven there: lora_push.py. docs/algorithms.md#lora---lora_rank says what LoRA changes
in the method."""

import torch

from plumbing.flags import RunArgs, UsageError

# The ranks vLLM serves (both the GPU's 0.26 and the CPU's 0.32: vllm/config/lora.py, MaxLoRARanks): the
# engine's slots hold the least of them that fits --lora_rank, its rank's A and B padded with zeros.
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# LoRA's flags but its rank, with their defaults: set without --lora_rank, they would do nothing
_SETTINGS = ("lora_alpha", "lora_dropout", "lora_target_modules", "lora_save_merged")
_DEFAULTS = {name: getattr(RunArgs, name) for name in _SETTINGS}


def check_lora_flags(args: RunArgs, zero_stage: int) -> None:
    """LoRA's flags before any model loads: its other flags need a rank; a rank vLLM serves; not under
    ZeRO-3, which shards the frozen base model the adapter is read through and the reference, being the same
    model, would gather at every forward pass (refused, not half-supported)."""
    if not args.lora_rank:
        given = [f"--{name}" for name, default in _DEFAULTS.items() if getattr(args, name) != default]
        if given:
            raise UsageError(f"{', '.join(given)} set LoRA's adapter, which only --lora_rank > 0 adds")
        return
    if args.lora_rank > _VLLM_RANKS[-1]:
        raise UsageError(
            f"--lora_rank {args.lora_rank}: vLLM serves adapters of rank {_VLLM_RANKS[-1]} at most"
        )
    if zero_stage == 3:
        raise UsageError(
            "--lora_rank under DeepSpeed ZeRO-3: the frozen base model would be sharded and gathered at "
            "every forward pass of the policy and of its reference alike; use ZeRO-2 "
            "(configs/deepspeed_zero2.yaml), where the base model is whole and the adapter's optimizer state "
            "is sharded"
        )


def engine_lora_settings(lora_rank: int) -> dict:
    """vLLM's LoRA settings for an engine serving the policy's adapter: one slot (a batch is one version's),
    two adapters in host memory (the new one is added before the old one goes), a rank that holds r."""
    return dict(
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=next(rank for rank in _VLLM_RANKS if rank >= lora_rank),
    )


# == The adapter, the reference ==============================================================================
def add_adapter(model: torch.nn.Module, args: RunArgs, task_type: str = "CAUSAL_LM"):
    """`model` with a PEFT LoRA adapter (LoraConfig: --lora_rank, --lora_alpha, --lora_dropout on
    --lora_target_modules, no bias): its own weights frozen, the adapter's A random and B zero, so that the
    adapted model is `model` itself at step 0. `task_type` SEQ_CLS (PPO's value model): its score head
    trains whole beside the adapter."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules
    if targets != "all-linear":
        # PEFT adapts the names it finds and skips the others: a misspelt one would train nothing, silently
        targets = [name.strip() for name in targets.split(",")]
        linear = sorted(
            {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        )
        if missing := [name for name in targets if name not in linear]:
            raise UsageError(
                f"--lora_target_modules {args.lora_target_modules}: {type(model).__name__} has no linear "
                f"layer named {missing[0]} (its linear layers: {', '.join(linear)}; or all-linear)"
            )
    config = LoraConfig(
        r=args.lora_rank,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type=task_type,
    )
    return get_peft_model(model, config)


class AdapterOff(torch.nn.Module):
    """The reference policy under LoRA: the policy's base model, its adapter switched off for each forward
    pass (PEFT's disable_adapter), in the policy's own memory. The policy is held, not registered: its
    parameters are trained elsewhere, and `parameters()` are the base model's, whose FLOPs a forward pass
    costs."""

    def __init__(self, policy):
        super().__init__()
        self.held = [policy]  # a list: not a submodule

    def forward(self, *args, **kwargs):
        policy = self.held[0]
        with policy.disable_adapter():
            return policy(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return (p for name, p in self.held[0].named_parameters() if not _is_adapter(name))

    def get_input_embeddings(self):
        return self.held[0].get_input_embeddings()

    def get_output_embeddings(self):
        return self.held[0].get_output_embeddings()


def has_adapter(model) -> bool:
    """Whether `model` is a PEFT model, a base model with an adapter (add_adapter)."""
    return hasattr(model, "peft_config")


def engine_scaling(policy) -> float:
    """alpha / r of the policy's adapter: what B is scaled by for the engine (for_the_engine)."""
    config = policy.peft_config["default"]
    return config.lora_alpha / config.r


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def adapter_names(policy) -> dict[str, list[tuple[str, list[int]]]]:
    """A LoRA policy's tensors a version is made of, as checkpoint_names gives a whole policy's: in-memory
    name -> [(its name in a PEFT adapter file, shape)], the adapter's A and B of each adapted layer (PEFT's
    file names drop the adapter's name, `.default`)."""
    return {
        name: [(name.replace(".default.", "."), list(parameter.shape))]
        for name, parameter in policy.named_parameters()
        if _is_adapter(name)
    }


def for_the_engine(tensors, scaling: float):
    """The (name, tensor) pairs of an adapter, B scaled by alpha / r (`scaling`): what the engine holds when
    its adapter's config says alpha = r (lora_push.py's adapter_config)."""
    for name, tensor in tensors:
        yield name, tensor * scaling if ".lora_B." in name else tensor
