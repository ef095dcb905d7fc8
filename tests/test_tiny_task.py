"""The tiny task: the committed artifacts, the builder that makes them, its gold judge against numbers by hand."""

import importlib.util
import json
import random
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
        prompts = dpo.load_prompts(dpo.Args(dataset_name=str(TINY / "data")), split, tokenizer)
        assert len(prompts.queries) >= 512  # none dropped for length: every query fits the default
        assert all(
            r.endswith(" </s>") or len(tokenizer(r, add_special_tokens=False).input_ids) == dpo.Args.response_length
            for r in prompts.references[:200]
        )


@pytest.fixture(scope="module")
def build():
    spec = importlib.util.spec_from_file_location("build", TINY / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# tiny_gold_score by hand. target = the query's words sorted, out = the response's words before "</s>";
# in_place = words of out in their target place / len(target); f1 = 2 x common words (as multisets) /
# (len(out) + len(target)); ordered = adjacent pairs of out in increasing order / max(len(out) - 1, 1);
# q = (in_place + f1 + ordered) / 3; the score is 2q - 1 if the response ends with "</s>", else q - 1.
GOLD_BY_HAND = [
    # target ant cat fox: in_place 3/3, f1 2 x 3 / (3 + 3) = 1, ordered 2/2; q 1, stopped: 2 - 1
    ("sort: fox ant cat ->", "ant cat fox </s>", 1.0),
    # q 1 as above, never stopped: 1 - 1
    ("sort: fox ant cat ->", "ant cat fox", 0.0),
    # in_place 1/3 (ant), f1 2 x 3 / 6 = 1, ordered 1/2 (ant < fox); q 11/18, stopped: 22/18 - 1
    ("sort: fox ant cat ->", "ant fox cat </s>", 2 / 9),
    # in_place 1/3 (the second cat), f1 2 x 1 / (2 + 3) = 2/5, ordered 0/1; q 11/45, stopped: 22/45 - 1
    ("sort: fox ant cat ->", "cat cat </s>", -23 / 45),
    # in_place 1/3 (ant), f1 2 x 3 / (5 + 3) = 3/4, ordered 4/4; q 25/36, never stopped: 25/36 - 1
    ("sort: fox ant cat ->", "ant bee cat fox yak", -11 / 36),
    # nothing: in_place 0, f1 0 / (0 + 3), ordered 0 / max(-1, 1); q 0, never stopped: 0 - 1
    ("sort: fox ant cat ->", "", -1.0),
    # stopped at once: q 0, 0 - 1
    ("sort: fox ant cat ->", "</s>", -1.0),
    # target ape ape bee: in_place 1/3 (ape), f1 2 x (1 ape + 1 bee) / (2 + 3) = 4/5, ordered 1/1;
    # q 32/45, stopped: 64/45 - 1
    ("sort: ape bee ape ->", "ape bee </s>", 19 / 45),
]


@pytest.mark.parametrize("query, response, score", GOLD_BY_HAND)
def test_gold_judge_by_hand(build, query, response, score):
    assert dpo.tiny_gold_score(query, response) == pytest.approx(score, abs=1e-12)
    assert build.tiny_gold_score(query, response) == pytest.approx(score, abs=1e-12)


def test_the_builders_gold_judge_is_the_scripts(build):
    """The builder labels the reward model's preference pairs by its own copy of the judge runs evaluate by."""
    rng = random.Random(0)
    for _ in range(300):
        query = build.make_query(rng.sample(build.WORDS, rng.randint(3, 6)))
        words = [rng.choice(build.WORDS) for _ in range(rng.randint(0, 8))]
        response = " ".join(words + rng.choice([[], ["</s>"]]))
        assert dpo.tiny_gold_score(query, response) == build.tiny_gold_score(query, response)


@pytest.mark.slow
def test_builder_runs_end_to_end_in_quick_mode(tmp_path):
    run_script([sys.executable, "tasks/tiny/build.py", "--quick", "--out_dir", str(tmp_path)], timeout=300)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(tmp_path / "sft")
    AutoModelForSequenceClassification.from_pretrained(tmp_path / "reward")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "sft")
    prompts = dpo.load_prompts(dpo.Args(dataset_name=str(tmp_path / "data")), "test", tokenizer)
    assert prompts.queries and all(q.startswith("sort: ") for q in prompts.queries)
