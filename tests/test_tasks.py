"""--task tldr | no_robots | gsm8k: the loaders on the real formats, GSM8k's verifier, the in-run evaluations
(reference perplexity, greedy pass@1) and the eval_completions files, and one short run per task path that
differs from the tiny task's. tests/fixtures holds a few hand-written rows of each dataset, laid out as its
hub repository (column names, split names, and for GSM8k the `main` and `socratic` configs)."""

import importlib
import json
import sys

import pytest
from conftest import ROOT, TINY, run_script, save_random_policy

import plumbing

# A private plumbing name (_write_eval_completions) on purpose: the completions file's rows are checked without a run.

SCRIPTS = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]
FIXTURES = ROOT / "tests" / "fixtures"
# A chat template for the tiny word-level tokenizer; like Llama 3.1's, it writes the BOS token itself.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(request.param.removesuffix(".py"))


@pytest.fixture
def chat_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY / "sft", padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def rows_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def word_ids(tokenizer, text: str) -> list[int]:
    """The tiny tokenizer by hand: one id per whitespace-separated word (<unk> for the unknown ones)."""
    return [tokenizer.convert_tokens_to_ids(word) for word in text.split()]


def load_prompts(script, name: str, split: str, tokenizer, max_prompt_length: int, task="tiny", config=None):
    """The script's load_prompts on a split of --dataset_name `name` in the format of --task `task`."""
    flags = dict(dataset_name=name, task=task, dataset_config=config, max_prompt_length=max_prompt_length)
    return script.load_prompts(script.Args(**flags), split, tokenizer)


# ------------------------------------------------------------------------------------------ loaders
def test_tldr_prompts_are_the_query_column_as_it_is(script, tokenizer):
    for split in ("train", "validation", "test"):
        rows = rows_of(FIXTURES / "tldr" / "data" / f"{split}.jsonl")
        prompts = load_prompts(script, str(FIXTURES / "tldr" / "data"), split, tokenizer, 512, task="tldr")
        assert prompts.queries == [r["query"] for r in rows] and prompts.references == [
            r["reference_response"] for r in rows
        ]
        assert prompts.token_ids == [[tokenizer.bos_token_id, *word_ids(tokenizer, r["query"])] for r in rows]
    assert prompts.queries[0] == (
        "SUBREDDIT: r/dogs\n\nTITLE: Rescue dog will not walk past the mailbox at the end of our street\n\nPOST: We adopted her two weeks ago. "
        "Every walk she stops dead at the same mailbox and pulls to go home. Treats do not help. Is this something we train or wait out?\n\nTL;DR:"
    )
    assert (
        prompts.references[0]
        == " new rescue dog refuses to walk past one mailbox; train it or give her time?<|endoftext|>"
    )


def test_no_robots_prompts_are_the_chat_template_before_the_last_answer_with_one_bos(script, chat_tokenizer):
    prompts = load_prompts(script, str(FIXTURES / "no_robots" / "data"), "train", chat_tokenizer, 512, task="no_robots")
    assert prompts.queries[0] == "<s>user: Write a haiku about the first frost on a vegetable garden.\nassistant:"
    assert (
        prompts.queries[1]
        == "<s>system: You are a patient tutor who explains science to children.\nuser: Why is the sky blue?\nassistant:"
    )
    assert prompts.queries[2] == (  # several turns: everything before the final assistant turn
        "<s>system: Pip is a cheerful chatbot who loves trains.\nuser: What should I do this weekend?\n"
        "assistant: How about a trip on a heritage railway? Many run steam trains on weekends.\nuser: I get bored on long rides.\nassistant:"
    )
    assert prompts.references[1].startswith("Sunlight is made of many colours.")
    assert prompts.references[2] == "Then pick a short line of under an hour, and bring a snack for the view!"
    rows = rows_of(FIXTURES / "no_robots" / "data" / "train.jsonl")
    for ids, text, row in zip(prompts.token_ids, prompts.queries, rows):
        assert ids == [chat_tokenizer.bos_token_id, *word_ids(chat_tokenizer, text.removeprefix("<s>"))]
        assert ids.count(chat_tokenizer.bos_token_id) == 1  # the template's BOS, not a second one from encoding
        assert ids == chat_tokenizer.apply_chat_template(row["messages"][:-1], add_generation_prompt=True)["input_ids"]


def test_gsm8k_prompts_answers_and_configs(script, tokenizer):
    prompts = load_prompts(script, str(FIXTURES / "gsm8k"), "test", tokenizer, 512, task="gsm8k", config="main")
    assert (
        prompts.queries[0]
        == "[MATH_TASK] Problem:\nA train travels 60 miles in 1.5 hours. What is its average speed in miles per hour?\n\nSolution:"
    )
    assert prompts.references[0] == "Its speed is 60 / 1.5 = <<60/1.5=40>>40 miles per hour.\n#### 40"
    assert prompts.token_ids[0] == [tokenizer.bos_token_id, *word_ids(tokenizer, prompts.queries[0])]
    assert len(prompts.queries) == 3
    socratic = load_prompts(script, str(FIXTURES / "gsm8k"), "train", tokenizer, 512, task="gsm8k", config="socratic")
    assert len(socratic.references) == 1 and socratic.references[0].startswith("How many boxes does she fill? **")
    # --dataset_config works on a local folder as on the hub: the folder's README declares its configs
    with pytest.raises(
        script.UsageError,
        match=r"^--dataset_name \S+gsm8k split train: Config name is missing\. Please pick one among the available configs: \['main', 'socratic'\]$",
    ):
        load_prompts(script, str(FIXTURES / "gsm8k"), "train", tokenizer, 512, task="gsm8k")
    with pytest.raises(
        script.UsageError,
        match=r"^--dataset_name \S+tldr/data --dataset_config main split train: BuilderConfig 'main' not found",
    ):
        load_prompts(script, str(FIXTURES / "tldr" / "data"), "train", tokenizer, 512, task="tldr", config="main")
    with pytest.raises(
        script.UsageError,
        match=r"^--dataset_config main: the single file --dataset_name \S+train.jsonl has no configs$",
    ):
        load_prompts(script, str(FIXTURES / "gsm8k" / "main" / "train.jsonl"), "train", tokenizer, 512, "gsm8k", "main")


def test_missing_columns_and_chat_templates_and_bad_rows_are_one_line_usage_errors(
    script, tokenizer, chat_tokenizer, tmp_path
):
    cases = [
        (
            lambda: load_prompts(
                script, str(FIXTURES / "tldr" / "data"), "validation", chat_tokenizer, 512, task="no_robots"
            ),
            r"--dataset_name \S+tldr/data split validation lacks column\(s\) \['messages'\] of --task no_robots; it has \['id', 'subreddit', ",
        ),
        (
            lambda: load_prompts(script, str(FIXTURES / "no_robots" / "data"), "test", tokenizer, 512, task="gsm8k"),
            r"--dataset_name \S+no_robots/data split test lacks column\(s\) \['question', 'answer'\] of --task gsm8k; it has \['prompt', 'prompt_id', 'messages', 'category'\]",
        ),
        (
            lambda: load_prompts(script, str(FIXTURES / "gsm8k"), "test", tokenizer, 512, task="tldr", config="main"),
            r"lacks column\(s\) \['query', 'reference_response'\] of --task tldr; it has \['question', 'answer'\]",
        ),
        (
            lambda: load_prompts(
                script, str(FIXTURES / "no_robots" / "data"), "test", tokenizer, 512, task="no_robots"
            ),
            rf"--dataset_name \S+no_robots/data split test holds conversations, written with the policy's chat template, and the tokenizer of --sft_model_path {TINY / 'sft'} has none",
        ),
    ]
    # a label needs a match of the verifier's "#### (-?[0-9.,]+)": "####" alone, or followed by a word, is not one
    unlabelled = [
        {"question": "What is 2 + 2?", "answer": answer}
        for answer in ("2 + 2 = 4\n#### 4", "2 + 2 = 4", "2 + 2 = 4\n#### four")
    ]
    (tmp_path / "unlabelled.jsonl").write_text("".join(json.dumps(row) + "\n" for row in unlabelled))
    cases.append(
        (
            lambda: load_prompts(script, str(tmp_path / "unlabelled.jsonl"), "train", tokenizer, 512, task="gsm8k"),
            r"unlabelled.jsonl split train: 2 `answer`\(s\) without a '#### <number>' final answer \(row 1\): not GSM8k's format$",
        )
    )
    (tmp_path / "no_answer.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    cases.append(
        (
            lambda: load_prompts(
                script, str(tmp_path / "no_answer.jsonl"), "train", chat_tokenizer, 512, task="no_robots"
            ),
            r"no_answer.jsonl split train: row 0's `messages` do not end with an assistant turn",
        )
    )
    for load, message in cases:
        with pytest.raises(script.UsageError, match=message) as error:
            load()
        assert "\n" not in str(error.value)


def test_a_gold_reward_model_for_gsm8k_is_refused_in_one_line_before_any_model_loads(tmp_path):
    """From the shell (one script: this check is the same text in all three)."""
    import subprocess

    argv = [
        sys.executable,
        "rloo_async.py",
        "--task",
        "gsm8k",
        "--dataset_name",
        str(FIXTURES / "gsm8k"),
        "--dataset_config",
        "main",
        "--gold_judge",
        str(TINY / "reward"),
        "--output_dir",
        str(tmp_path / "run"),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"error: --gold_judge {TINY / 'reward'}: --task gsm8k is evaluated by its verifier (eval/pass@1), not by a gold reward model"
    ]
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ GSM8k's verifier
# OpenAI's grade-school-math checker: the first match of "#### (-?[0-9.,]+)", commas removed, equal as strings
@pytest.mark.parametrize(
    "completion, answer, reward",
    [
        ("She makes 8 * 5 = 40 dollars.\n#### 40", "She makes 8 * 5 = <<8*5=40>>40 dollars.\n#### 40", 1.0),
        ("#### 1020", "#### 1,020", 1.0),  # commas are removed, from the label too
        ("#### 1,020", "#### 1020", 1.0),
        ("#### 1,02,0", "#### 1020", 1.0),  # wherever they are
        ("#### 40 dollars", "#### 40", 1.0),  # what follows the number is not read
        ("#### 5%", "#### 5", 1.0),
        (
            "#### 40\n\nProblem: Ann has 3 cats and buys 4. How many cats?\nSolution: 3 + 4 = 7\n#### 7",
            "#### 40",
            1.0,
        ),  # the first match counts
        ("#### 12\nno, wait\n#### 40", "#### 40", 0.0),
        ("#### 40\nno, wait\n#### 12", "#### 40", 1.0),
        ("So the answer is #### 40", "#### 40", 1.0),  # anywhere in the text
        ("####40", "#### 40", 0.0),  # no space: no match, and so no answer
        ("####   40  ", "#### 40", 0.0),  # more than one space: no match either
        ("####40\n#### 40", "#### 40", 1.0),  # the first MATCH: "####40" is none
        ("The answer is 40.", "#### 40", 0.0),  # no "####": no answer
        ("####", "#### 40", 0.0),
        ("#### 40.", "#### 40", 0.0),  # the period is taken: "40." is not "40"
        ("#### 40.\n", "#### 40.", 1.0),
        ("#### 40.0", "#### 40", 0.0),  # nothing else is normalised
        ("#### $40", "#### 40", 0.0),
        ("#### 4 0", "#### 40", 0.0),  # "4"
        ("#### -5", "#### -5", 1.0),
        ("#### 5", "#### -5", 0.0),
        ("#### - 5", "#### -5", 0.0),
        ("#### \u22125", "#### -5", 0.0),  # Unicode minus: no match
        ("#### -7 degrees", "At midnight it was 4 - 11 = <<4-11=-7>>-7 degrees.\n#### -7", 1.0),
    ],
)
def test_gsm8k_verifier_by_hand(completion, answer, reward):
    for name in SCRIPTS:
        assert importlib.import_module(name.removesuffix(".py")).gsm8k_reward(completion, answer) == reward


def test_gsm8k_answers_of_the_fixture_labels_and_completions_against_them(script, tokenizer):
    """The labels of the fixture's main/train split as the verifier reads them (a comma, a unit after the number,
    a negative), and completions against them, all written by hand."""
    prompts = load_prompts(script, str(FIXTURES / "gsm8k"), "train", tokenizer, 512, task="gsm8k", config="main")
    assert [script.gsm8k_answer(answer) for answer in prompts.references] == ["40", "36", "1020", "9", "18", "-7"]
    label = dict(zip(["muffins", "pages", "chickens", "apples", "pens", "temperature"], prompts.references))
    assert (
        label["pens"].endswith("#### 18 dollars")
        and label["chickens"].endswith("#### 1,020")
        and label["temperature"].endswith("#### -7")
    )
    cases = [
        ("pens", "12 + 6 = 18 dollars.\n#### 18", 1.0),
        ("pens", "#### 18 dollars", 1.0),
        ("pens", "#### 18.", 0.0),
        ("pens", "####18", 0.0),
        (
            "pens",
            "#### 18\n\n[MATH_TASK] Problem:\nA box holds 6 eggs. How many eggs are in 5 boxes?\n\nSolution: 6 * 5 = 30\n#### 30",
            1.0,
        ),
        ("pens", "#### 30\n#### 18", 0.0),
        ("chickens", "#### 1,020", 1.0),
        ("chickens", "#### 1020 chickens", 1.0),
        ("chickens", "#### 1.020", 0.0),
        ("temperature", "#### -7", 1.0),
        ("temperature", "#### 7", 0.0),
        ("temperature", "#### -7.", 0.0),
        ("apples", "#### 9 apples.", 1.0),
    ]
    assert [script.gsm8k_reward(completion, label[name]) for name, completion, _ in cases] == [
        reward for _, _, reward in cases
    ]


def number_tokenizer():
    """A word-level tokenizer that can write GSM8k answers (the tiny one cannot)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "<s>", "</s>", "<unk>", "####", "40", "12", "so"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def test_verified_completions_and_pass_at_1_by_hand(script):
    """Token ids -> rewards: decoded without special tokens (an EOS left in would break "#### 40"), each
    completion checked against its own label; pass@1 is their mean."""
    tokenizer = number_tokenizer()
    responses = [[7, 4, 5, 2, 0, 5], [4, 6, 2, 0, 0, 0], [4, 5, 0, 0, 0, 0], [4, 5, 2, 7, 7, 7]]  # EOS = 2, pad = 0
    ids, mask, contain_eos = script.truncate_responses([r[: r.index(0)] if 0 in r else r for r in responses], 6, 2, 0)
    assert contain_eos.tolist() == [True, True, False, True]
    batch = script.Batch(query_ids=None, query_mask=None, response_ids=ids, response_mask=mask, contain_eos=contain_eos)
    answers = ["#### 40", "#### 40", "A.\n#### 40", "#### 12"]
    rewards = script.verify_completions(tokenizer, batch, answers, script.gsm8k_reward)
    assert rewards.tolist() == [
        1.0,
        0.0,
        1.0,
        0.0,
    ]  # a completion cut without EOS is still verified (table 10: no penalty)
    assert rewards.mean().item() == pytest.approx(2 / 4)
    assert script.verify_completions(tokenizer, batch, answers[::-1], script.gsm8k_reward).tolist() == [
        0.0,
        0.0,
        1.0,
        1.0,
    ]  # each against its own label


# ------------------------------------------------------------------------------------------ evaluation helpers
def slow_perplexity(model, prompt: list[int], response: list[int], eos_token_id: int) -> float:
    """One unpadded sequence at a time: exp of the mean negative log-likelihood of the response tokens up to
    and including the first EOS, the prompt's tokens excluded."""
    import torch

    if eos_token_id in response:
        response = response[: response.index(eos_token_id) + 1]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    nll = [-(logits[len(prompt) + t - 1].log_softmax(-1)[token]).item() for t, token in enumerate(response)]
    return float(torch.tensor(nll).mean().exp())


def test_reference_perplexity_against_a_slow_loop(script, tokenizer, tmp_path):
    """evaluate's eval/ref_perplexity (the paper's KL proxy): the reference policy's perplexity of each completion over
    its tokens up to and including the first EOS, the prompt's excluded, averaged over the completions. Each completion
    evaluated alone gives its own perplexity; the three together (in forward passes of 2) the mean of theirs."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(save_random_policy(tokenizer, tmp_path / "ref", seed=3)).eval()
    eos = tokenizer.eos_token_id
    prompts = [[1, 4, 12, 6, 5], [1, 4, 9, 14, 13, 20, 5], [1, 4, 5]]
    responses = [[12, 6, eos, 9, 9], [13, 14, 20, 9, 10, 11], [eos]]  # garbage after EOS; cut without EOS; EOS only
    # --task tldr without a reward model or a gold judge: of the model-based metrics, evaluate computes only this one
    args = script.Args(task="tldr", max_prompt_length=8, response_length=6, local_rollout_forward_batch_size=2)
    models = script.Models(tokenizer, model, None, None, None, None)

    def ref_perplexity(rows: list[int]) -> float:
        evaluation = script.Prompts([prompts[i] for i in rows], [f"q{i}" for i in rows], [f"r{i}" for i in rows])
        metrics, _, _ = script.evaluate([responses[i] for i in rows], evaluation, models, args, torch.device("cpu"))
        return metrics["eval/ref_perplexity"]

    slow = [slow_perplexity(model, p, r, eos) for p, r in zip(prompts, responses)]
    assert [ref_perplexity([i]) for i in range(3)] == pytest.approx(slow, rel=1e-5)
    assert ref_perplexity([0, 1, 2]) == pytest.approx(sum(slow) / 3, rel=1e-5)
    # a version that also counted the prompt's tokens would give another number
    with_prompt_tokens = slow_perplexity(model, prompts[0][:1], prompts[0][1:] + responses[0], eos)
    assert abs(with_prompt_tokens - slow[0]) > 1e-3


def test_learning_rate_schedules(script):
    # as the paper's loops, stepped at the top of each of the 4 steps: they train at 3/4, 1/2, 1/4 and 0 of the rate
    assert [script.lr_factor("linear", step, 4) for step in range(4)] == [0.75, 0.5, 0.25, 0.0]
    assert [script.lr_factor("constant", step, 4) for step in range(4)] == [1.0] * 4


def test_the_optimizer_is_the_paper_codes(script):
    """AdamW as transformers' Trainer builds it in the paper's code: torch's betas, epsilon 1e-8, weight decay 0 by
    default; with --weight_decay, every trained weight decays but the biases and the LayerNorm / RMSNorm weights. One
    step on zero gradients moves each weight by exactly lr x decay x itself, or not at all."""
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM

    assert (script.Args.adam_epsilon, script.Args.weight_decay, script.Args.max_grad_norm) == (1e-8, 0.0, 1.0)
    small = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    neox = GPTNeoXForCausalLM(GPTNeoXConfig(**small, tie_word_embeddings=False))
    llama = LlamaForCausalLM(LlamaConfig(**small, tie_word_embeddings=False))
    decayed = {  # by hand: the weights of the embeddings, the attention and MLP matrices and the head
        neox: ["gpt_neox.embed_in.weight", "gpt_neox.layers.0.attention.query_key_value.weight",
               "gpt_neox.layers.0.attention.dense.weight", "gpt_neox.layers.0.mlp.dense_h_to_4h.weight",
               "gpt_neox.layers.0.mlp.dense_4h_to_h.weight", "lm_head.weight"],
        llama: ["model.embed_tokens.weight", *(f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkvo"),
                *(f"model.layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")), "lm_head.weight"],
    }  # fmt: skip
    for model, names in decayed.items():
        optimizer = script.make_optimizer(model, script.Args(learning_rate=0.5, weight_decay=0.1))
        assert (optimizer.defaults["betas"], optimizer.defaults["eps"]) == ((0.9, 0.999), 1e-8)
        for p in model.parameters():
            torch.nn.init.uniform_(p.data, 0.5, 1.5)  # no weight 0 (transformers starts the biases at 0)
            p.grad = torch.zeros_like(p)
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        optimizer.step()
        for name, p in model.named_parameters():
            factor = 1 - 0.5 * 0.1 if name in names else 1.0
            torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7, msg=name)
        assert len(before) > len(names)  # the biases and norms were there, and kept
        no_decay = script.make_optimizer(model, script.Args())
        assert [group["weight_decay"] for group in no_decay.param_groups] == [0.0, 0]


def test_eval_completions_are_written_atomically_one_file_per_step(tmp_path):
    write_eval_completions = plumbing.run_folder._write_eval_completions
    first = write_eval_completions(str(tmp_path), 3, 96, ["p1", "p2"], ["c1", "c2"], ["r1", "r2"])
    assert first == str(tmp_path / "eval_completions" / "step_000003.jsonl")
    assert rows_of(tmp_path / "eval_completions" / "step_000003.jsonl") == [
        {"step": 3, "episode": 96, "prompt": "p1", "completion": "c1", "reference": "r1"},
        {"step": 3, "episode": 96, "prompt": "p2", "completion": "c2", "reference": "r2"},
    ]
    write_eval_completions(str(tmp_path), 3, 96, ["p1"], ["again"], ["r1"])  # a resumed run evaluating step 3 again
    assert sorted(p.name for p in (tmp_path / "eval_completions").iterdir()) == ["step_000003.jsonl"]
    assert [r["completion"] for r in rows_of(tmp_path / "eval_completions" / "step_000003.jsonl")] == ["again"]


def test_a_chat_templated_text_gets_one_bos_from_a_judges_tokenizer(chat_tokenizer):
    """plumbing.encode_text, which every script's score_texts encodes a judge's texts with."""
    assert plumbing.encode_text(chat_tokenizer, "<s>user: sort: cat ->\nassistant: cat </s>") == [
        1,
        3,
        4,
        12,
        5,
        3,
        12,
        2,
    ]
    assert plumbing.encode_text(chat_tokenizer, "sort: cat -> cat </s>") == [
        1,
        4,
        12,
        5,
        12,
        2,
    ]  # a plain text gets its BOS as before


# ------------------------------------------------------------------------------------------ whole runs
def eval_lines(output_dir):
    lines = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if any(k.startswith("eval/") for k in m)], [m for m in lines if "async/lag" in m]


@pytest.mark.slow
def test_gsm8k_run_verifier_rewards_greedy_pass_at_1_and_reference_perplexity(tokenizer, tmp_path):
    """PPO on the GSM8k fixture: no reward model is loaded (a path that does not exist is never read; the value
    model starts from the policy), evaluation is greedy and scored by the verifier, and the eval completions
    and metrics match a by-hand recomputation with transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    import ppo_async as ppo

    policy = save_random_policy(tokenizer, tmp_path / "policy", seed=1)
    out = tmp_path / "run"
    run_script(
        [
            sys.executable,
            "ppo_async.py",
            "--task",
            "gsm8k",
            "--dataset_name",
            str(FIXTURES / "gsm8k"),
            "--dataset_config",
            "main",
            "--sft_model_path",
            str(policy),
            "--reward_model_path",
            str(tmp_path / "no_such_model"),
            "--max_prompt_length",
            "40",
            "--response_length",
            "16",
            "--total_episodes",
            "4",
            "--local_micro_batch_size",
            "2",
            "--eval_freq",
            "0",
            "--lr_schedule",
            "constant",
            "--output_dir",
            str(out),
        ]
    )
    evals, train = eval_lines(out)
    assert [e["step"] for e in evals] == [0, 2] and len(train) == 2
    assert all(0 <= m["objective/scores"] <= 1 for m in train)
    assert [m["lr"] for m in train] == [ppo.Args.learning_rate] * 2  # table 10's constant schedule
    for e in evals:
        assert not {"eval/scores", "eval/win_rate", "eval/gold_score"} & set(e)
        rows = rows_of(out / "eval_completions" / f"step_{e['step']:06d}.jsonl")
        test_rows = rows_of(FIXTURES / "gsm8k" / "main" / "test.jsonl")
        assert [r["prompt"] for r in rows] == [ppo.GSM8K_PROMPT.format(question=t["question"]) for t in test_rows]
        assert [r["reference"] for r in rows] == [t["answer"] for t in test_rows]
        assert all(r["step"] == e["step"] and r["episode"] == e["episode"] == e["step"] * 2 for r in rows)
        assert e["eval/pass@1"] == pytest.approx(
            sum(ppo.gsm8k_reward(r["completion"], r["reference"]) for r in rows) / len(rows)
        )
    # step 0: the policy is still the SFT (= reference) model; its greedy completions and their perplexity by hand
    model = AutoModelForCausalLM.from_pretrained(policy).eval()
    prompts = load_prompts(ppo, str(FIXTURES / "gsm8k"), "test", tokenizer, 40, task="gsm8k", config="main")
    greedy, perplexities = [], []
    for prompt in prompts.token_ids:
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=16,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        greedy.append(tokenizer.decode(ids[: ids.index(2) + 1] if 2 in ids else ids, skip_special_tokens=True))
        perplexities.append(slow_perplexity(model, prompt, ids, tokenizer.eos_token_id))
    assert [r["completion"] for r in rows_of(out / "eval_completions" / "step_000000.jsonl")] == greedy
    assert evals[0]["eval/ref_perplexity"] == pytest.approx(sum(perplexities) / len(perplexities), rel=1e-4)


@pytest.mark.slow
def test_no_robots_run_chat_prompts_completions_file_and_reward_model_win_rate(chat_tokenizer, tmp_path):
    """Online DPO on the No Robots fixture with a chat-templated policy, the tiny reward model as proxy and as
    gold judge: the eval completions file is what tasks/llm_judge.py reads."""
    policy = save_random_policy(chat_tokenizer, tmp_path / "policy", seed=2)
    out = tmp_path / "run"
    run_script(
        [
            sys.executable,
            "online_dpo_async.py",
            "--task",
            "no_robots",
            "--dataset_name",
            str(FIXTURES / "no_robots" / "data"),
            "--sft_model_path",
            str(policy),
            "--gold_judge",
            str(TINY / "reward"),
            "--max_prompt_length",
            "48",
            "--response_length",
            "16",
            "--total_episodes",
            "8",
            "--local_micro_batch_size",
            "2",
            "--eval_freq",
            "0",
            "--output_dir",
            str(out),
        ]
    )
    evals, train = eval_lines(out)
    assert [e["step"] for e in evals] == [0, 2] and len(train) == 2
    test_rows = rows_of(FIXTURES / "no_robots" / "data" / "test.jsonl")
    for e in evals:
        assert 0 <= e["eval/win_rate"] <= 1 and e["eval/ref_perplexity"] >= 1 and 1 <= e["eval/response_length"] <= 16
        assert "eval/pass@1" not in e and "eval/scores" in e
        rows = rows_of(out / "eval_completions" / f"step_{e['step']:06d}.jsonl")
        assert [r["reference"] for r in rows] == [t["messages"][-1]["content"] for t in test_rows]
        assert all(r["step"] == e["step"] and r["episode"] == e["episode"] == e["step"] * 4 for r in rows)
        assert all("</s>" not in r["completion"] and "<pad>" not in r["completion"] for r in rows)
    assert rows[0]["prompt"] == "<s>user: Rewrite this more politely: Send me the report now.\nassistant:"
    assert rows[1]["prompt"] == (
        "<s>system: Answer in one sentence.\nuser: Summarize: The town council voted to close Main Street to cars on Sundays "
        "so that markets and musicians can use it.\nassistant:"
    )
