import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmark" / "tiny_task"
sys.path.insert(0, str(ROOT))
# No network anywhere in the tests; keep the engine's KV cache small.
os.environ.update(
    HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false"
)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY / "sft", padding_side="left")


def small_config(tokenizer, arch: str = "llama", **overrides):
    """A 2-layer, 64-wide model on the tiny vocabulary (head dim 32: vLLM's CPU attention minimum)."""
    from transformers import GPTNeoXConfig, LlamaConfig

    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=128, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    common.update(overrides)
    return LlamaConfig(num_key_value_heads=2, **common) if arch == "llama" else GPTNeoXConfig(**common)


def save_random_policy(tokenizer, path: Path, arch: str = "llama", seed: int = 0) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(small_config(tokenizer, arch)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_script(argv: list[str], timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root; fail with its output if it fails."""
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return proc


def read_metrics(output_dir: Path) -> tuple[list[dict], list[dict]]:
    lines = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if "async/lag" in m], sorted((m for m in lines if "eval/win_rate" in m), key=lambda m: m["step"])


def assert_default_run_learns(script: str, output_dir: Path) -> None:
    """`python <script>` with no flags but the output folder: the tiny task visibly learns."""
    import time

    start = time.perf_counter()
    run_script([sys.executable, script, "--output_dir", str(output_dir)], timeout=900)
    print(f"{script} default run took {time.perf_counter() - start:.0f} s")
    train, evals = read_metrics(output_dir)
    print("win rate", [round(e["eval/win_rate"], 3) for e in evals], "ref ppl", [round(e["eval/ref_ppl"], 3) for e in evals])
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert evals[-1]["eval/gold_score"] > evals[0]["eval/gold_score"]
    assert any((output_dir / "tensorboard").iterdir())
