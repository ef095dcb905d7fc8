"""The tiny task: the committed artifacts, and the builder that makes them."""

import json
import sys

import pytest

from conftest import TINY, run_script

import online_dpo_async as dpo


def test_committed_artifacts_are_small_and_in_the_expected_shape(tokenizer):
    size = sum(p.stat().st_size for p in TINY.rglob("*") if p.is_file())
    assert size <= 10 * 2**20, f"tiny task artifacts take {size / 2**20:.1f} MB"
    config = json.loads((TINY / "sft" / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] <= 4 and config["hidden_size"] <= 256
    reward = json.loads((TINY / "reward" / "config.json").read_text())
    assert reward["architectures"] == ["LlamaForSequenceClassification"] and len(reward["id2label"]) == 1
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    for split in ("train", "test"):
        prompts = dpo.load_prompts(str(TINY / "data"), split, tokenizer, dpo.Args.max_prompt_length)
        assert len(prompts.queries) >= 512  # none dropped for length: every query fits the default
        assert all(
            r.endswith(" </s>") or len(tokenizer(r, add_special_tokens=False).input_ids) == dpo.Args.response_length
            for r in prompts.references[:200]
        )


@pytest.mark.slow
def test_builder_runs_end_to_end_in_quick_mode(tmp_path):
    run_script([sys.executable, "benchmark/tiny_task/build.py", "--quick", "--out_dir", str(tmp_path)], timeout=300)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    prompts = dpo.load_prompts(str(tmp_path / "data"), "test", tokenizer, dpo.Args.max_prompt_length)
    assert prompts.queries and all(q.startswith("sort: ") for q in prompts.queries)
