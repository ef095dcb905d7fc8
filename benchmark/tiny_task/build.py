"""Builds the tiny offline task (sorting words): data, SFT policy, proxy reward model. See README.md here.

The task mirrors the paper's controlled TLDR setup in miniature: an SFT policy trained on noisy
demonstrations, a proxy reward model trained on pairs labelled by a gold judge, and the gold judge
itself (`tiny_gold_score`), used only for evaluation (win rate against noisy, human-like references).

    python benchmark/tiny_task/build.py            # ~10 min on 2 CPU cores, writes next to this file
    python benchmark/tiny_task/build.py --quick --out_dir /tmp/tiny   # < 1 min smoke test
"""

import argparse
import json
import math
import os
import random
import shutil
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

WORDS = "ant bat bee cat cow dog eel elk emu fox gnu hen owl pig rat yak".split()
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
FORMAT_TOKENS = ["sort:", "->"]
MIN_WORDS, MAX_WORDS = 3, 8
MAX_PROMPT_LENGTH = 12  # BOS + "sort:" + up to 8 words + "->" = 11 tokens
RESPONSE_LENGTH = 12  # 8 sorted words + EOS = 9 tokens, with room for rambling/duplicates
EOS = "</s>"

# Probabilities of each corruption of the sorted answer (the rest is clean).
SFT_NOISE = {"swap": 0.12, "drop": 0.12, "dup": 0.08, "replace": 0.08, "ramble": 0.20}
REFERENCE_NOISE = {"swap": 0.08, "drop": 0.06, "dup": 0.04, "replace": 0.06, "ramble": 0.06}


def tiny_gold_score(query: str, response: str) -> float:
    """Gold judge of the tiny task: 1.0 iff `response` is the query's words sorted, then "</s>".

    Mean of three parts in [0, 1] (right word in the right place, F1 of the word multiset,
    fraction of adjacent output words in increasing order); minus 1 when there is no "</s>"."""
    target = sorted(query.split()[1:-1])  # "sort: w1 ... wL ->"
    out = response.split()
    stopped = len(out) > 0 and out[-1] == "</s>"
    out = out[:-1] if stopped else out
    in_place = sum(a == b for a, b in zip(out, target)) / len(target)
    common = sum(min(out.count(w), target.count(w)) for w in set(target))
    f1 = 2 * common / (len(out) + len(target))
    ordered = sum(a < b for a, b in zip(out, out[1:])) / max(len(out) - 1, 1)
    score = (in_place + f1 + ordered) / 3
    return score if stopped else score - 1.0


# ---------------------------------------------------------------- task: prompts and noisy answers
def make_query(words: list[str]) -> str:
    return "sort: " + " ".join(words) + " ->"


def sample_words(rng: random.Random) -> list[str]:
    return rng.sample(WORDS, rng.randint(MIN_WORDS, MAX_WORDS))


def corrupt(target: list[str], kind: str, rng: random.Random) -> list[str]:
    """One corruption of a word list; "ramble" keeps talking past the end (no EOS fits)."""
    out = list(target)
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
    elif kind == "ramble":
        out += [rng.choice(WORDS) for _ in range(RESPONSE_LENGTH)]
    return out


def noisy_response(words: list[str], noise: dict[str, float], rng: random.Random) -> str:
    """The sorted answer, corrupted with probability sum(noise); EOS text unless cut at RESPONSE_LENGTH."""
    out = sorted(words)
    u, kind = rng.random(), "clean"
    for k, p in noise.items():
        if u < p:
            kind = k
            break
        u -= p
    out = corrupt(out, kind, rng) + [EOS]
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


def encode(tokenizer, queries: list[str], responses: list[str]):
    """Layout used by the RLHF scripts: query left-padded to MAX_PROMPT_LENGTH, then the response
    right-padded to RESPONSE_LENGTH. Returns input_ids, attention_mask, and a mask of response tokens."""
    pad = tokenizer.pad_token_id
    q = tokenizer(queries, padding="max_length", max_length=MAX_PROMPT_LENGTH, return_tensors="pt")
    r = torch.full((len(responses), RESPONSE_LENGTH), pad)
    for i, text in enumerate(responses):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:RESPONSE_LENGTH]
        r[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    input_ids = torch.cat([q["input_ids"], r], 1)
    response_mask = torch.cat([torch.zeros_like(q["input_ids"]), (r != pad).long()], 1)
    attention_mask = torch.cat([q["attention_mask"], (r != pad).long()], 1)
    return input_ids, attention_mask, response_mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return attention_mask.cumsum(1) - attention_mask  # cumsum - 1 on real tokens, 0 on left pads


def lr_at(step: int, total: int, lr: float, warmup: int = 50) -> float:
    return lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total))


# ---------------------------------------------------------------- SFT policy
def train_sft(model, tokenizer, queries, responses, steps: int, batch_size: int, lr: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    input_ids, attention_mask, response_mask = encode(tokenizer, queries, responses)
    model.train()
    for step in range(steps):
        idx = torch.randint(len(queries), (batch_size,), generator=g)
        ids, mask, resp = input_ids[idx], attention_mask[idx], response_mask[idx]
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
        loss = (nll * resp[:, 1:].flatten()).sum() / resp[:, 1:].sum()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"  sft step {step:5d}  loss {loss.item():.4f}", flush=True)
    model.eval()


@torch.no_grad()
def generate(model, tokenizer, queries: list[str], temperature: float, seed: int, batch_size: int = 1024):
    """Samples one completion per query; returns the decoded responses as the RLHF scripts see them:
    pad tokens stripped, special tokens kept (so a completion that stopped ends with "</s>")."""
    torch.manual_seed(seed)
    out = []
    for i in range(0, len(queries), batch_size):
        q = tokenizer(queries[i : i + batch_size], padding="max_length", max_length=MAX_PROMPT_LENGTH, return_tensors="pt")
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
def rm_score(rm, input_ids, attention_mask) -> torch.Tensor:
    """Score = head output at the last real (non-pad) token of query+response."""
    hidden = rm.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask)).last_hidden_state
    last = (attention_mask * torch.arange(attention_mask.shape[1])).argmax(1)
    return rm.score(hidden[torch.arange(len(last)), last]).squeeze(-1)


@torch.no_grad()
def rm_scores(rm, tokenizer, queries, responses, batch_size: int = 1024) -> list[float]:
    out = []
    for i in range(0, len(queries), batch_size):
        ids, mask, _ = encode(tokenizer, queries[i : i + batch_size], responses[i : i + batch_size])
        out += rm_score(rm, ids, mask).tolist()
    return out


def gold_pairs(queries, responses_a, responses_b):
    """(query, chosen, rejected) under the gold judge; ties dropped."""
    pairs = []
    for q, a, b in zip(queries, responses_a, responses_b):
        sa, sb = tiny_gold_score(q, a), tiny_gold_score(q, b)
        if sa != sb:
            pairs.append((q, a, b) if sa > sb else (q, b, a))
    return pairs


def train_rm(rm, tokenizer, pairs, epochs: int, batch_size: int, lr: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    queries, chosen, rejected = zip(*pairs)
    ids_c, mask_c, _ = encode(tokenizer, list(queries), list(chosen))
    ids_r, mask_r, _ = encode(tokenizer, list(queries), list(rejected))
    opt = torch.optim.AdamW(rm.parameters(), lr=lr, weight_decay=0.0)
    steps = epochs * (len(pairs) // batch_size)
    rm.train()
    for step in range(steps):
        if step % (len(pairs) // batch_size) == 0:
            perm = torch.randperm(len(pairs), generator=g)
        idx = perm[(step % (len(pairs) // batch_size)) * batch_size :][:batch_size]
        # chosen and rejected in one forward pass
        ids = torch.cat([ids_c[idx], ids_r[idx]])
        mask = torch.cat([mask_c[idx], mask_r[idx]])
        r_chosen, r_rejected = rm_score(rm, ids, mask).chunk(2)
        loss = -F.logsigmoid(r_chosen - r_rejected).mean()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.parameters(), 1.0)
        opt.step()
        if step % 200 == 0 or step == steps - 1:
            acc = (r_chosen > r_rejected).float().mean().item()
            print(f"  rm step {step:5d}  loss {loss.item():.4f}  acc {acc:.3f}", flush=True)
    rm.eval()


def pair_accuracy(rm, tokenizer, pairs) -> float:
    if not pairs:
        return float("nan")
    queries, chosen, rejected = map(list, zip(*pairs))
    rc, rr = rm_scores(rm, tokenizer, queries, chosen), rm_scores(rm, tokenizer, queries, rejected)
    return sum(c > r for c, r in zip(rc, rr)) / len(pairs)


# ---------------------------------------------------------------- evaluation of the targets
def evaluate(policy, rm, tokenizer, test: list[dict], seed: int) -> dict:
    queries = [row["query"] for row in test]
    refs = [row["reference_response"] for row in test]
    a = generate(policy, tokenizer, queries, temperature=0.7, seed=seed)
    b = generate(policy, tokenizer, queries, temperature=0.7, seed=seed + 1)
    gold_a = [tiny_gold_score(q, r) for q, r in zip(queries, a)]
    gold_b = [tiny_gold_score(q, r) for q, r in zip(queries, b)]
    gold_ref = [tiny_gold_score(q, r) for q, r in zip(queries, refs)]
    rm_a, rm_b = rm_scores(rm, tokenizer, queries, a), rm_scores(rm, tokenizer, queries, b)
    best_of_2 = [ga if ra >= rb else gb for ga, gb, ra, rb in zip(gold_a, gold_b, rm_a, rm_b)]
    n = len(queries)
    non_tied = [(ra > rb) == (ga > gb) for ga, gb, ra, rb in zip(gold_a, gold_b, rm_a, rm_b) if ga != gb]
    # pairs a better policy produces: the exact answer vs a single corruption of it
    rng = random.Random(seed)
    near = []
    for q in queries:
        target = q.split()[1:-1]
        kind = rng.choice(list(SFT_NOISE))
        near.append((q, clean_response(target), " ".join((corrupt(sorted(target), kind, rng) + [EOS])[:RESPONSE_LENGTH])))
    low_t = generate(policy, tokenizer, queries, temperature=0.3, seed=seed + 2)
    low_t2 = generate(policy, tokenizer, queries, temperature=0.3, seed=seed + 3)
    return {
        "sft_gold_mean": sum(gold_a + gold_b) / (2 * n),
        "sft_exact_frac": sum(g == 1.0 for g in gold_a + gold_b) / (2 * n),
        "sft_no_eos_frac": sum(not r.endswith(EOS) for r in a + b) / (2 * n),
        "sft_win_rate_vs_ref": sum((g > gr) + 0.5 * (g == gr) for g, gr in zip(gold_a, gold_ref)) / n,
        "ref_gold_mean": sum(gold_ref) / n,
        "ref_exact_frac": sum(g == 1.0 for g in gold_ref) / n,
        "exact_policy_win_rate_vs_ref": sum(1.0 if g < 1.0 else 0.5 for g in gold_ref) / n,
        "rm_acc_sft_pairs_t0.7": sum(non_tied) / max(len(non_tied), 1),
        "rm_num_sft_pairs_t0.7": len(non_tied),
        "rm_acc_sft_pairs_t0.3": pair_accuracy(rm, tokenizer, gold_pairs(queries, low_t, low_t2)),
        "rm_acc_exact_vs_one_corruption": pair_accuracy(rm, tokenizer, gold_pairs(*zip(*near))),
        "best_of_2_gold_mean": sum(best_of_2) / n,
        "single_sample_gold_mean": sum(gold_a) / n,
        "oracle_best_of_2_gold_mean": sum(max(ga, gb) for ga, gb in zip(gold_a, gold_b)) / n,
    }


# ---------------------------------------------------------------- main
def main(out_dir: str, quick: bool) -> dict:
    start = time.time()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    n_train, n_test = (2_000, 64) if quick else (32_768, 512)
    sft_steps, n_sft_demos = (150, 10_000) if quick else (3_000, 200_000)
    n_rm_prompts, rm_epochs = (1_000, 1) if quick else (24_000, 2)

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

    train = [{"query": make_query(w), "reference_response": noisy_response(w, REFERENCE_NOISE, rng)} for w in fresh_words(n_train)]
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
    train_sft(policy, tokenizer, demo_queries, demo_responses, steps=sft_steps, batch_size=64, lr=2e-3, seed=1)

    # 3. proxy RM on gold-labelled pairs: half pairs of SFT samples, half pairs of synthetic corruptions
    # (the synthetic half covers the near-correct answers an improving policy produces)
    print(f"[{time.time() - start:5.0f}s] sampling RM pairs", flush=True)
    rm_words = fresh_words(n_rm_prompts)
    half = n_rm_prompts // 2
    rm_queries = [make_query(w) for w in rm_words]
    sampled_a = generate(policy, tokenizer, rm_queries[:half], temperature=1.0, seed=2)
    sampled_b = generate(policy, tokenizer, rm_queries[:half], temperature=1.0, seed=3)
    synthetic = [(noisy_response(w, SFT_NOISE, rng), noisy_response(w, SFT_NOISE, rng)) for w in rm_words[half:]]
    pairs = gold_pairs(rm_queries, sampled_a + [s[0] for s in synthetic], sampled_b + [s[1] for s in synthetic])
    rm = LlamaForSequenceClassification(LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_labels=1, **common))
    print(f"[{time.time() - start:5.0f}s] training RM on {len(pairs)} pairs", flush=True)
    train_rm(rm, tokenizer, pairs, epochs=rm_epochs, batch_size=64, lr=1e-3, seed=4)

    # 4. save (only the final artifacts live in out_dir)
    for name, model in [("sft", policy), ("reward", rm)]:
        path = os.path.join(out_dir, name)
        shutil.rmtree(path, ignore_errors=True)
        model.save_pretrained(path, safe_serialization=True)
        tokenizer.save_pretrained(path)

    # 5. measure the targets listed in README.md
    print(f"[{time.time() - start:5.0f}s] evaluating", flush=True)
    metrics = evaluate(policy, rm, tokenizer, test, seed=5)
    metrics["build_seconds"] = time.time() - start
    for k, v in metrics.items():
        print(f"  {k:32s} {v:.3f}")
    print(f"response_length={RESPONSE_LENGTH} max_prompt_length={MAX_PROMPT_LENGTH} vocab_size={len(tokenizer)}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out_dir", default=os.path.dirname(os.path.abspath(__file__)), help="where sft/, reward/, data/ go")
    parser.add_argument("--quick", action="store_true", help="tiny data and few steps: checks the builder end to end in < 60 s")
    args = parser.parse_args()
    main(args.out_dir, args.quick)
