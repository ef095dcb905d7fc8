"""2. The run's checkpoints: which one --resume continues from, and whether it is whole (its manifest); how a
checkpoint is written (accelerate's state, Progress, the policy versions still owed) and the final policy.
The run's folder (run_folder.py) calls them; docs/checkpoints.md says what they promise."""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import gather_object
from safetensors.torch import load_file, save_file

from plumbing.flags import UsageError
from plumbing.inputs import json_error, json_kind
from plumbing.tidy import write_atomically

# Flags that may change when a run is resumed; any other must be what the run started with.
_RESUMABLE_CHANGES = {"resume", "output_dir", "track", "wandb_project", "wandb_entity", "save_freq"}
_RESUMABLE_CHANGES |= {"keep_checkpoints", "num_sample_completions", "collective_timeout_minutes"}
_RESUMABLE_CHANGES |= {"engine_timeout_minutes", "vllm_num_engines", "vllm_tensor_parallel_size"}
# 4: manifest.json, each file's size and sha256; 3: the LR schedule steps once a step; 2: the shuffle
# generators in Progress; 1: in files
_CHECKPOINT_FORMAT = 4
_MANIFEST = "manifest.json"  # a checkpoint's files with their sizes and hashes, written last


# == Which checkpoint to resume, and whether it is whole =====================================================
def holds_a_run(output_dir: str) -> bool:
    """Whether a run logged or saved anything there (one stopped while starting left only args.json)."""
    metrics, checkpoints = Path(output_dir, "metrics.jsonl"), Path(output_dir, "checkpoints")
    logged = metrics.exists() and metrics.stat().st_size > 0
    return logged or any(checkpoints.glob("step_*")) or Path(output_dir, "policy").exists()


def checkpoints_in(output_dir: str) -> list[Path]:
    return sorted(
        p for p in Path(output_dir, "checkpoints").glob("step_*") if re.fullmatch(r"step_\d{6}", p.name)
    )


def checkpoint_to_resume(output_dir: str, flags: dict, resume: bool, world_size: int) -> str | None:
    """The checkpoint a run continues from (None: it starts at step 0); two runs never share a folder. Exits
    (0) on --resume of a finished run, whose final policy is saved at the very end. The newest checkpoint
    that its manifest proves intact (_checkpoint_damage): damaged ones are named with what is wrong, in the
    one line that says which the run continues from; with none intact, the error says how to start over. A
    run whose args.json is missing or damaged cannot be checked, with --resume or without (_run_flags)."""
    if not resume:
        if holds_a_run(output_dir):
            if not os.path.exists(os.path.join(output_dir, "args.json")):
                raise UsageError(_without_its_flags(output_dir))
            raise UsageError(
                f"--output_dir {output_dir} holds another run: pass --resume to continue it, or choose "
                "another --output_dir"
            )
        return None
    if os.path.isdir(policy := os.path.join(output_dir, "policy")):
        print(f"--resume: the run in {output_dir} is finished (its final policy is {policy}): nothing to do")
        raise SystemExit(0)
    previous = _run_flags(output_dir)
    if previous is None and holds_a_run(output_dir):
        raise UsageError(_without_its_flags(output_dir))
    if previous is not None:
        changed = [
            f"--{k} {previous.get(k)!r} -> {v!r}"
            for k, v in flags.items()
            if k not in _RESUMABLE_CHANGES and previous.get(k) != v
        ]
        if previous.get("world_size") != world_size:
            changed.append(f"training processes {previous.get('world_size')} -> {world_size}")
        if changed:
            raise UsageError(
                f"--resume: {', '.join(changed)} differ from the run in --output_dir {output_dir}; resume it "
                "with its own flags"
            )
    damaged = []
    for checkpoint in reversed(checkpoints_in(output_dir)):
        if (problem := _checkpoint_damage(checkpoint)) is None:
            if damaged:
                print(f"--resume: {'; '.join(damaged)}: continuing from the newest intact one, {checkpoint}")
            return str(checkpoint)
        damaged.append(f"{checkpoint} is damaged ({problem}; delete it)")
    if damaged:
        raise UsageError(
            f"--resume: no intact checkpoint: {'; '.join(damaged)}; to start the run over, delete "
            f"{Path(output_dir, 'checkpoints')} too and --resume starts at step 0"
        )
    return None


def _run_flags(output_dir: str) -> dict | None:
    """The flags of the run in `output_dir`, from its args.json (None: it has none). One that cannot be read,
    does not parse (cut off by a copy or a disk) or is not a JSON object is a UsageError naming it."""
    path = Path(output_dir, "args.json")
    if not path.exists():
        return None
    try:
        flags = json.loads(path.read_text())
    except OSError as exc:
        problem = f"cannot be read ({exc.strerror})"
    except ValueError as exc:
        problem = f"does not parse ({json_error(exc)})"
    else:
        if isinstance(flags, dict):
            return flags
        problem = f"is a JSON {json_kind(flags)}, not an object of flags"
    raise UsageError(
        f"--resume: {path} {problem}: it holds the run's flags, which a resume must match; restore it from a "
        "copy, or start the run again in another --output_dir"
    )


def _without_its_flags(output_dir: str) -> str:
    return (
        f"--output_dir {output_dir} holds a run (its metrics or checkpoints) but not its args.json, which "
        "holds the flags a resume must match: restore args.json to --resume it, or choose another "
        "--output_dir"
    )


def _checkpoint_damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint, as its manifest (_MANIFEST, written last) shows: a file missing, or of
    another size, or another sha256 than it had when written; the manifest itself missing (the checkpoint
    was never finished, or was copied in part: an empty folder, or one without format.json) or unreadable.
    None: nothing. A checkpoint whose format.json says another format is refused."""
    other_version = UsageError(
        f"--resume: {checkpoint} is not a checkpoint of this version (format {_CHECKPOINT_FORMAT}): resume "
        "it with the version that wrote it"
    )
    if not checkpoint.is_dir():
        return "it is a file, not a checkpoint's folder"
    if not (checkpoint / _MANIFEST).exists():
        stated = _read_json(checkpoint / "format.json")
        # formats 1-3 had no manifest: one whose format.json says so is another version's
        if isinstance(stated, dict) and stated.get("format") != _CHECKPOINT_FORMAT:
            raise other_version
        if not any(checkpoint.iterdir()):
            return "it is empty: made, never written"
        if stated is None:
            return f"it has neither a whole format.json nor {_MANIFEST}: not finished, or copied in part"
        return f"{_MANIFEST} is missing: it is written last, and the checkpoint was not finished"
    try:
        files = json.loads((checkpoint / _MANIFEST).read_text())["files"]
        files = {name: (int(file["bytes"]), str(file["sha256"])) for name, file in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{_MANIFEST} does not parse"
    for name, (size, sha256) in files.items():
        if not (file := checkpoint / name).is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, not the {size} written"
        if _file_sha256(file) != sha256:
            return f"{name} is not the file written: its sha256 differs"
    if _read_json(checkpoint / "format.json") != {"format": _CHECKPOINT_FORMAT}:
        raise other_version
    return None


def _write_manifest(folder: str) -> None:
    """`folder`'s manifest: every file under it with its size and sha256, which --resume checks."""
    files = {
        str(file.relative_to(folder)): {"bytes": file.stat().st_size, "sha256": _file_sha256(file)}
        for file in sorted(Path(folder).rglob("*"))
        if file.is_file() and file.name != _MANIFEST
    }
    write_atomically(os.path.join(folder, _MANIFEST), json.dumps({"files": files}, indent=1))


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _read_json(path: Path):
    """A JSON file's value; None if it is missing or does not parse."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# == Writing a checkpoint and the final policy ===============================================================
class Progress:
    """Where the run is: the next step, the evaluations logged, and every process's shuffle generator (its
    state is gathered from all of them, as accelerate saves a registered object from rank 0 only). Saved by
    accelerate with the trainer's state."""

    def __init__(self, seed: int):
        self.step, self.evals_logged = 0, set()
        self.shuffle = np.random.default_rng([seed, PartialState().process_index])

    def state_dict(self) -> dict:
        shuffles = gather_object([self.shuffle.bit_generator.state])
        return {"step": self.step, "evals_logged": sorted(self.evals_logged), "shuffle": shuffles}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.evals_logged = state["step"], set(state["evals_logged"])
        self.shuffle.bit_generator.state = state["shuffle"][PartialState().process_index]


# == Under LoRA: checkpoints of the weights that train ======================================================
def hold_trained_weights_only(accelerator: Accelerator) -> None:
    """Under LoRA (--lora_rank) a checkpoint holds the weights that train, the adapter (PPO's value model
    too, or its adapter and head), not the frozen base model, which the run reloads from its own files:
    accelerate's save hook keeps those of each prepared model's state, and writes the policy's adapter in
    PEFT's format too (save_adapters); its load hook reads them back (load_trained_weights) in accelerate's
    stead. Under DeepSpeed (ZeRO-2), which writes the models itself, save_checkpoint and the run folder's
    resume pass it the same: trained_only_kwargs."""

    def keep_trained(models: list, states: list, output_dir: str) -> None:
        for index, (model, state) in enumerate(zip(models, states)):
            trained = {name for name, p in model.named_parameters() if p.requires_grad}
            states[index] = {name: tensor for name, tensor in state.items() if name in trained}
        save_adapters(accelerator, models, output_dir)

    def load_trained(models: list, input_dir: str) -> None:
        for index, model in enumerate(models):
            name = "model.safetensors" if index == 0 else f"model_{index}.safetensors"
            load_trained_weights(
                load_file(os.path.join(input_dir, name)), model, os.path.join(input_dir, name)
            )
        models.clear()  # loaded: accelerate's own load would want every weight

    accelerator.register_save_state_pre_hook(keep_trained)
    accelerator.register_load_state_pre_hook(load_trained)


def save_adapters(accelerator: Accelerator, models: list, output_dir: str) -> None:
    """Beside accelerate's state, rank 0 writes each PEFT model's adapter again in PEFT's own format,
    `policy_adapter/` (adapter_config.json and adapter_model.safetensors), which PEFT and vLLM load onto the
    base model as they are."""
    if not accelerator.is_main_process:
        return
    for model in models:
        for module in accelerator.unwrap_model(model).modules():
            if hasattr(module, "peft_config") and hasattr(module, "save_pretrained"):
                module.save_pretrained(os.path.join(output_dir, "policy_adapter"), safe_serialization=True)


def trained_only_kwargs(accelerator: Accelerator, saving: bool) -> dict:
    """What DeepSpeed's save_checkpoint (`saving`) or load_checkpoint is passed under LoRA (a run of
    hold_trained_weights_only): the frozen weights left out, and read back by load_trained_weights."""
    if accelerator.state.deepspeed_plugin is None:
        return {}
    if saving:
        return dict(exclude_frozen_parameters=True)
    return dict(custom_load_fn=lambda src, dst: load_trained_weights(src, dst, "the checkpoint's model file"))


def load_trained_weights(state: dict, model: torch.nn.Module, where: str) -> None:
    """Load a checkpoint's weights that train (hold_trained_weights_only) into `model`: exactly those, each
    of the model's trainable parameters and nothing else, or the resume stops in one line naming the first
    that differs (a checkpoint of another adapter, or of a run without LoRA)."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, extra = sorted(trained - state.keys()), sorted(state.keys() - trained)
    if missing or extra:
        first = f"it lacks {missing[0]}" if missing else f"it holds {extra[0]}, which does not train"
        raise UsageError(
            f"--resume: {where} does not hold this run's trained weights ({len(trained)} tensors): {first}; "
            "resume it with the flags (--lora_rank, --lora_target_modules) of the run that wrote it"
        )
    model.load_state_dict(state, strict=False)


def save_checkpoint(
    accelerator: Accelerator,
    output_dir: str,
    progress: Progress,
    owed: dict[int, list],
    keep: int,
    trained_only: dict,
):
    """Everything a resumed run needs to go on exactly: accelerate's `save_state` (the trained weights as
    safetensors, the optimizer, the registered objects such as the scheduler and Progress, RNG states) and the
    older policy versions the generator still owes batches or evaluations (`owed`: version -> [(name,
    tensor)]), so no engine state is needed. Written to a temporary folder, then renamed; then all but the
    `keep` newest checkpoints are deleted. Its manifest, written last, lists every file with its size and
    sha256 (_write_manifest). `trained_only`: DeepSpeed's own under LoRA (trained_only_kwargs). Returns its
    path."""
    path = os.path.join(output_dir, "checkpoints", f"step_{progress.step:06d}")
    if accelerator.is_main_process:
        shutil.rmtree(f"{path}.tmp", ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(f"{path}.tmp", **trained_only)
    accelerator.wait_for_everyone()  # every process's files are written before rank 0 lists them
    if accelerator.is_main_process:  # theta_step itself is the policy's weights
        for version, tensors in owed.items():
            tensors = {name: tensor.cpu().clone() for name, tensor in tensors}
            save_file(tensors, os.path.join(f"{path}.tmp", f"version_{version:06d}.safetensors"))
        Path(f"{path}.tmp", "format.json").write_text(json.dumps({"format": _CHECKPOINT_FORMAT}))
        _follow_umask(f"{path}.tmp")
        _write_manifest(f"{path}.tmp")  # last: a checkpoint without one was not finished
        shutil.rmtree(path, ignore_errors=True)
        os.replace(f"{path}.tmp", path)
        for old in checkpoints_in(output_dir)[:-keep]:  # the newest, just written, is the one a resume reads
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def _follow_umask(path: str) -> None:
    """Give the files under `path` the permissions the umask allows, as any file the run writes: safetensors
    (and so save_pretrained and save_state) creates its files with 0600, which another user of a shared
    cluster cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for file in [Path(path)] if os.path.isfile(path) else Path(path).rglob("*"):
        if file.is_file():
            os.chmod(file, 0o666 & ~mask)


def load_owed_version(checkpoint: str, version: int) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint, f"version_{version:06d}.safetensors"))


def save_policy(
    accelerator: Accelerator, model, tokenizer, path: str, prefix: str = "", merged: str | None = None
) -> None:
    """save_pretrained (safetensors) into a temporary folder, then rename: no half-written model. `prefix`:
    the policy's submodule in `model` (PPO's `policy.`). A LoRA policy writes its adapter alone, PEFT's
    format (adapter_config.json, adapter_model.safetensors), which PEFT and vLLM load onto the base model;
    and with `merged`, a folder there of the base model with the adapter merged into its weights."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        state_dict = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
        policy = accelerator.unwrap_model(model)
        policy = getattr(policy, prefix.rstrip(".")) if prefix else policy
        _save_pretrained(policy, state_dict, tokenizer, path)
        if merged is not None:  # last: merging changes the policy's own weights
            _save_pretrained(policy.merge_and_unload(), None, tokenizer, merged)
    accelerator.wait_for_everyone()


def _save_pretrained(model, state_dict: dict | None, tokenizer, path: str) -> None:
    shutil.rmtree(tmp := f"{path}.tmp", ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _follow_umask(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
