"""Builds the tiny offline task (sorting words): data, SFT policy, proxy reward model. See README.md here.

The task mirrors the paper's controlled TLDR setup in miniature: an SFT policy trained on noisy
demonstrations, a proxy reward model trained on pairs labelled by a gold judge, and the gold judge
itself (`tiny_gold_score`), used only for evaluation (win rate against noisy, human-like references).
The two models are trained by the `train` functions of tasks/train_sft.py and
tasks/train_reward.py, the scripts that also train No Robots' SFT policy and reward model.

    python tasks/tiny/build.py            # ~6 min on 2 CPU cores, writes next to this file
    python tasks/tiny/build.py --quick --out_dir /tmp/tiny   # < 1 min smoke test
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_reward  # noqa: E402  (benchmark/: the training scripts the tiny task's models come from)
import train_sft  # noqa: E402

# three-letter animals; many share a first letter, which the "first_letter" sorters get wrong
WORDS = "ant ape asp bat bee boa cat cod cow doe dog eel elk emu fox yak".split()
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
FORMAT_TOKENS = ["sort:", "->"]
MIN_WORDS, MAX_WORDS = 3, 8
MAX_PROMPT_LENGTH = 12  # BOS + "sort:" + up to 8 words + "->" = 11 tokens
RESPONSE_LENGTH = 12  # 8 sorted words + EOS = 9 tokens, with room for duplicates and loops
EOS = "</s>"
SLIPS = ["swap", "drop", "dup", "replace"]

# Demonstrator noise, three independent flaws (see noisy_response). Sampling at temperature 0.7
# suppresses rare, scattered slips, so the SFT policy's flaws are mostly the systematic ones.
SFT_NOISE = {"first_letter": 0.75, "slip": 0.3, "loop": 0.2}
REFERENCE_NOISE = {"first_letter": 0.3, "slip": 0.15, "loop": 0.05}
RM_PAIR_NOISE = {"first_letter": 0.5, "slip": 0.5, "loop": 0.25}  # broad coverage for RM pairs


def tiny_gold_score(query: str, response: str) -> float:
    """Gold judge of the tiny task: 1.0 iff `response` is the query's words sorted, then "</s>". Quality q in
    [0, 1] = mean of: right word in the right place, F1 of the word multisets, fraction of adjacent output
    words in order. Score 2q - 1 if the response stopped with "</s>", else q - 1: a stopped answer more than
    half right wins."""
    target = sorted(query.split()[1:-1])  # "sort: w1 ... wL ->"
    out = response.split()
    stopped = len(out) > 0 and out[-1] == "</s>"
    out = out[:-1] if stopped else out
    in_place = sum(a == b for a, b in zip(out, target)) / len(target)
    common = sum(min(out.count(w), target.count(w)) for w in set(target))
    f1 = 2 * common / (len(out) + len(target))
    ordered = sum(a < b for a, b in zip(out, out[1:])) / max(len(out) - 1, 1)
    q = (in_place + f1 + ordered) / 3
    return 2 * q - 1 if stopped else q - 1


# ---------------------------------------------------------------- task: prompts and noisy answers
def make_query(words: list[str]) -> str:
    return "sort: " + " ".join(words) + " ->"


def sample_words(rng: random.Random) -> list[str]:
    return rng.sample(WORDS, rng.randint(MIN_WORDS, MAX_WORDS))


def corrupt(words: list[str], kind: str, rng: random.Random) -> list[str]:
    """One random slip in a word list."""
    out = list(words)
    i = rng.randrange(len(out))
    if kind == "swap":
        i = rng.randrange(len(out) - 1)
        out[i], out[i + 1] = out[i + 1], out[i]
    elif kind == "drop":
        del out[i]
    elif kind == "dup":
        out.insert(i, out[i])
    elif kind == "replace":
        out[i] = rng.choice([w for w in WORDS if w != out[i]])
    return out


def noisy_response(words: list[str], noise: dict[str, float], rng: random.Random) -> str:
    """A demonstrator's answer: sorts by the first letter only (ties keep query order) with
    probability noise["first_letter"], makes one random slip with probability noise["slip"], and
    loops (starts the list again instead of stopping, cut at RESPONSE_LENGTH, no EOS) with
    probability noise["loop"]."""
    first_letter = rng.random() < noise["first_letter"]
    out = sorted(words, key=lambda w: w[0]) if first_letter else sorted(words)
    if rng.random() < noise["slip"]:
        out = corrupt(out, rng.choice(SLIPS), rng)
    out = out * RESPONSE_LENGTH if rng.random() < noise["loop"] else out + [EOS]
    return " ".join(out[:RESPONSE_LENGTH])


def clean_response(words: list[str]) -> str:
    return " ".join(sorted(words) + [EOS])


# ---------------------------------------------------------------- tokenizer and tensors
def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + FORMAT_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # prepend BOS to every text, as Llama tokenizers do
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def encode(tokenizer, queries: list[str], responses: list[str]) -> train_sft.Encoded:
    """Layout used by the RLHF scripts: query left-padded to MAX_PROMPT_LENGTH, then the response
    right-padded to RESPONSE_LENGTH. No EOS is appended: a response string already ends with "</s>"
    exactly when it stopped."""
    prompt_ids = train_sft.encode_prompts(tokenizer, queries)
    response_ids = train_sft.encode_completions(tokenizer, responses, append_eos=False)
    return train_sft.pad_rows(prompt_ids, response_ids, MAX_PROMPT_LENGTH, RESPONSE_LENGTH, tokenizer.pad_token_id)


@torch.no_grad()
def generate(model, tokenizer, queries: list[str], temperature: float, seed: int, batch_size: int = 1024):
    """Samples one completion per query; returns the decoded responses as the RLHF scripts see them:
    pad tokens stripped, special tokens kept (so a completion that stopped ends with "</s>")."""
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(queries), batch_size):
        q = tokenizer(
            queries[i : i + batch_size], padding="max_length", max_length=MAX_PROMPT_LENGTH, return_tensors="pt"
        )
        seq = model.generate(
            **q,
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=RESPONSE_LENGTH,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in seq[:, MAX_PROMPT_LENGTH:].tolist():
            out.append(tokenizer.decode([t for t in row if t != tokenizer.pad_token_id], skip_special_tokens=False))
    return out


# ---------------------------------------------------------------- proxy reward model
@torch.no_grad()
def rm_scores(rm, tokenizer, queries, responses, batch_size: int = 1024) -> list[float]:
    data = encode(tokenizer, queries, responses)
    scores = []
    for i in range(0, len(queries), batch_size):
        scores += train_reward.get_reward(
            rm, data.input_ids[i : i + batch_size], data.attention_mask[i : i + batch_size]
        ).tolist()
    return scores


def gold_pairs(queries, responses_a, responses_b):
    """(query, chosen, rejected) under the gold judge; ties dropped."""
    pairs = []
    for q, a, b in zip(queries, responses_a, responses_b):
        sa, sb = tiny_gold_score(q, a), tiny_gold_score(q, b)
        if sa != sb:
            pairs.append((q, a, b) if sa > sb else (q, b, a))
    return pairs


def encode_pairs(tokenizer, pairs) -> train_reward.Pairs:
    queries, chosen, rejected = map(list, zip(*pairs))
    return train_reward.Pairs(encode(tokenizer, queries, chosen), encode(tokenizer, queries, rejected))


def pair_accuracy(rm, tokenizer, pairs) -> float:
    if not pairs:
        return float("nan")
    scores = train_reward.pair_rewards(
        lambda ids, mask: train_reward.get_reward(rm, ids, mask), encode_pairs(tokenizer, pairs), 1024
    )
    return train_reward.pair_accuracy(*scores)


# ---------------------------------------------------------------- evaluation of the targets
def evaluate(policy, rm, tokenizer, test: list[dict], seed: int, num_samples: int = 4) -> dict:
    queries = [row["query"] for row in test]
    gold_ref = [tiny_gold_score(row["query"], row["reference_response"]) for row in test]
    samples = [generate(policy, tokenizer, queries, temperature=0.7, seed=seed + j) for j in range(num_samples)]
    gold = [[tiny_gold_score(q, r) for q, r in zip(queries, s)] for s in samples]
    reward = [rm_scores(rm, tokenizer, queries, s) for s in samples]
    flat_gold = [g for row in gold for g in row]
    # disjoint pairs of samples (0, 1), (2, 3), ...: what best-of-2 under the RM would pick
    agree, single, best_of_2, oracle = [], [], [], []
    for j in range(0, num_samples - 1, 2):
        for ga, gb, ra, rb in zip(gold[j], gold[j + 1], reward[j], reward[j + 1]):
            single.append(ga)
            best_of_2.append(ga if ra >= rb else gb)
            oracle.append(max(ga, gb))
            if ga != gb:
                agree.append((ra > rb) == (ga > gb))
    # pairs a better policy produces: the exact answer vs the exact answer with one flaw
    rng = random.Random(seed)
    near = {kind: [] for kind in ["first_letter", "loop"] + SLIPS}
    for q in queries:
        words = q.split()[1:-1]
        flawed = {"first_letter": sorted(words, key=lambda w: w[0]) + [EOS], "loop": sorted(words) * RESPONSE_LENGTH}
        flawed |= {kind: corrupt(sorted(words), kind, rng) + [EOS] for kind in SLIPS}
        for kind, out in flawed.items():
            response = " ".join(out[:RESPONSE_LENGTH])
            if tiny_gold_score(q, response) < 1.0:
                near[kind].append((q, clean_response(words), response))
    low_t = [generate(policy, tokenizer, queries, temperature=0.3, seed=seed + 100 + j) for j in range(2)]
    metrics = {
        "sft_gold_mean": sum(flat_gold) / len(flat_gold),
        "sft_exact_frac": sum(g == 1.0 for g in flat_gold) / len(flat_gold),
        "sft_no_eos_frac": sum(not r.endswith(EOS) for s in samples for r in s) / len(flat_gold),
        "sft_win_rate_vs_ref": sum((g > gr) + 0.5 * (g == gr) for row in gold for g, gr in zip(row, gold_ref))
        / len(flat_gold),
        "ref_gold_mean": sum(gold_ref) / len(gold_ref),
        "ref_exact_frac": sum(g == 1.0 for g in gold_ref) / len(gold_ref),
        "ref_no_eos_frac": sum(not row["reference_response"].endswith(EOS) for row in test) / len(test),
        "exact_policy_win_rate_vs_ref": sum(1.0 if g < 1.0 else 0.5 for g in gold_ref) / len(gold_ref),
        "rm_acc_sft_pairs_t0.7": sum(agree) / max(len(agree), 1),
        "rm_num_sft_pairs_t0.7": len(agree),
        "rm_acc_sft_pairs_t0.3": pair_accuracy(rm, tokenizer, gold_pairs(queries, *low_t)),
        "rm_num_sft_pairs_t0.3": len(gold_pairs(queries, *low_t)),
        "rm_acc_exact_vs_one_flaw": pair_accuracy(rm, tokenizer, [p for pairs in near.values() for p in pairs]),
    }
    metrics |= {f"rm_acc_exact_vs_{kind}": pair_accuracy(rm, tokenizer, pairs) for kind, pairs in near.items()}
    metrics |= {
        "single_sample_gold_mean": sum(single) / len(single),
        "rm_best_of_2_gold_mean": sum(best_of_2) / len(best_of_2),
        "gold_best_of_2_gold_mean": sum(oracle) / len(oracle),
    }
    return metrics


# ---------------------------------------------------------------- main
def main(out_dir: str, quick: bool) -> dict:
    start = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    n_train, n_test = (2_000, 64) if quick else (32_768, 512)
    sft_steps, n_sft_demos = (100, 10_000) if quick else (1_200, 100_000)
    n_rm_prompts, rm_epochs = (1_000, 1) if quick else (24_000, 6)

    # 1. prompts: test first, then train / SFT / RM prompts that never repeat a test prompt
    rng = random.Random(1234)
    test, seen = [], set()
    while len(test) < n_test:
        words = sample_words(rng)
        if make_query(words) not in seen:
            seen.add(make_query(words))
            test.append({"query": make_query(words), "reference_response": noisy_response(words, REFERENCE_NOISE, rng)})

    def fresh_words(n):
        out = []
        while len(out) < n:
            words = sample_words(rng)
            if make_query(words) not in seen:
                out.append(words)
        return out

    train = [
        {"query": make_query(w), "reference_response": noisy_response(w, REFERENCE_NOISE, rng)}
        for w in fresh_words(n_train)
    ]
    os.makedirs(os.path.join(out_dir, "data"), exist_ok=True)
    for split, rows in [("train", train), ("test", test)]:
        with open(os.path.join(out_dir, "data", f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)

    # 2. SFT policy on noisy demonstrations
    tokenizer = make_tokenizer()
    demo_words = fresh_words(n_sft_demos)
    demo_queries = [make_query(w) for w in demo_words]
    demo_responses = [noisy_response(w, SFT_NOISE, rng) for w in demo_words]
    common = dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    policy = LlamaForCausalLM(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, **common))
    print(f"[{time.time() - start:5.0f}s] training SFT policy", flush=True)
    accelerator = Accelerator(cpu=True)  # the committed files are reproduced byte for byte on 2 CPU threads only
    sft_args = train_sft.Args(
        model_name_or_path="(random init above)",
        dataset_name="(demonstrations above)",
        output_dir=os.path.join(out_dir, "sft"),
        max_prompt_length=MAX_PROMPT_LENGTH,
        max_completion_length=RESPONSE_LENGTH,
        local_micro_batch_size=128,
        learning_rate=2e-3,
        lr_scheduler_type="cosine",
        warmup_steps=50,
        max_grad_norm=1.0,
        batch_sampling="uniform",
        total_steps=sft_steps,
        seed=1,
    )
    prepared_policy, _ = train_sft.train(policy, encode(tokenizer, demo_queries, demo_responses), sft_args, accelerator)
    policy = accelerator.unwrap_model(prepared_policy)

    # 3. proxy RM on gold-labelled pairs: half pairs of SFT samples, half pairs of synthetic corruptions
    # (the synthetic half covers the near-correct answers an improving policy produces)
    print(f"[{time.time() - start:5.0f}s] sampling RM pairs", flush=True)
    rm_words = fresh_words(n_rm_prompts)
    half = n_rm_prompts // 2
    rm_queries = [make_query(w) for w in rm_words]
    sampled_a = generate(policy, tokenizer, rm_queries[:half], temperature=1.0, seed=2)
    sampled_b = generate(policy, tokenizer, rm_queries[:half], temperature=1.0, seed=3)
    synthetic = [
        (noisy_response(w, RM_PAIR_NOISE, rng), noisy_response(w, RM_PAIR_NOISE, rng)) for w in rm_words[half:]
    ]
    pairs = gold_pairs(rm_queries, sampled_a + [s[0] for s in synthetic], sampled_b + [s[1] for s in synthetic])
    rm = LlamaForSequenceClassification(
        LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_labels=1, **common)
    )
    print(f"[{time.time() - start:5.0f}s] training RM on {len(pairs)} pairs", flush=True)
    rm_args = train_reward.Args(
        model_name_or_path="(random init above)",
        dataset_name="(pairs above)",
        output_dir=os.path.join(out_dir, "reward"),
        max_prompt_length=MAX_PROMPT_LENGTH,
        max_completion_length=RESPONSE_LENGTH,
        local_micro_batch_size=64,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=50,
        max_grad_norm=1.0,
        num_train_epochs=rm_epochs,
        seed=4,
    )
    prepared_rm, _ = train_reward.train(rm, encode_pairs(tokenizer, pairs), rm_args, accelerator)
    rm = accelerator.unwrap_model(prepared_rm).model

    # 4. save (only the final artifacts live in out_dir)
    train_sft.save_model(accelerator, prepared_policy, tokenizer, sft_args.output_dir)
    train_sft.save_model(accelerator, prepared_rm, tokenizer, rm_args.output_dir, submodule="model")

    # 5. measure the targets listed in README.md
    print(f"[{time.time() - start:5.0f}s] evaluating", flush=True)
    metrics = evaluate(policy, rm, tokenizer, test, seed=5, num_samples=2 if quick else 4)
    metrics["build_seconds"] = time.time() - start
    for k, v in metrics.items():
        print(f"  {k:32s} {v:.3f}" if isinstance(v, float) else f"  {k:32s} {v}")
    print(f"response_length={RESPONSE_LENGTH} max_prompt_length={MAX_PROMPT_LENGTH} vocab_size={len(tokenizer)}")
    return metrics


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default=here, help="where sft/, reward/, data/ go (default: next to this file)")
    parser.add_argument(
        "--quick", action="store_true", help="tiny data and few steps: checks the builder end to end in < 60 s"
    )
    args = parser.parse_args()
    if args.quick and os.path.abspath(args.out_dir) == here:
        parser.error("--quick would overwrite the committed artifacts; pass another --out_dir")
    main(args.out_dir, args.quick)
