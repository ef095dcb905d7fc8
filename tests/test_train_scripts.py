"""tasks/train_sft.py and tasks/train_reward.py: the losses by hand, the data layout, bad input,
and each script end to end on a few rows with a tiny random model."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, TINY, accelerate_launch, save_random_policy, small_config

sys.path.insert(0, str(ROOT / "tasks"))
import train_reward  # noqa: E402
import train_sft  # noqa: E402


def load_builder():
    spec = importlib.util.spec_from_file_location("build", TINY / "build.py")
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build


def random_lm(tokenizer, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(small_config(tokenizer)).eval()


def random_rm(tokenizer, seed=0):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(small_config(tokenizer, num_labels=1)).eval()


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ data layout
def test_layout_is_prompt_left_padded_then_completion_right_padded_with_masks_from_lengths(tokenizer):
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    cow, ant, arrow, sort = (tokenizer.convert_tokens_to_ids(t) for t in ("cow", "ant", "->", "sort:"))
    # pad == EOS (as for Llama-3.1): the appended EOS must still be a real, trained-on token
    data = train_sft.pad_rows(
        [[bos, sort, cow, arrow]],
        [
            [ant, eos],
        ],
        6,
        4,
        pad_token_id=eos,
    )
    assert data.input_ids.tolist() == [[eos, eos, bos, sort, cow, arrow, ant, eos, eos, eos]]
    assert data.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]
    assert data.completion_mask.tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]
    # completions are cut to max_completion_length (a cut completion has lost its EOS)
    cut = train_sft.pad_rows([[bos]], [[cow, ant, cow, eos]], 1, 2, pad)
    assert cut.input_ids.tolist() == [[bos, cow, ant]] and cut.completion_mask.tolist() == [[0, 1, 1]]


def test_eos_is_appended_once_and_the_tiny_builder_keeps_its_layout(tokenizer):
    eos = tokenizer.eos_token_id
    out = train_sft.encode_completions(tokenizer, ["ant cow", "ant cow </s>", ""], append_eos=True)
    assert out == [ids(tokenizer, "ant cow") + [eos], ids(tokenizer, "ant cow") + [eos], [eos]]
    assert train_sft.encode_completions(tokenizer, ["ant cow"], append_eos=False) == [ids(tokenizer, "ant cow")]
    # the tiny task: query left-padded to 12 (with BOS), response as given (its "</s>" marks a stop), right-padded to 12
    build = load_builder()
    data = build.encode(tokenizer, ["sort: cow ant ->"], ["ant cow </s>"])
    query = [tokenizer.bos_token_id] + ids(tokenizer, "sort: cow ant ->")
    response = ids(tokenizer, "ant cow </s>")
    pad = tokenizer.pad_token_id
    assert data.input_ids.tolist() == [[pad] * 7 + query + response + [pad] * 9]
    assert data.completion_mask.tolist() == [[0] * 12 + [1] * 3 + [0] * 9]


def test_long_prompts_are_dropped_and_counted(tokenizer, capsys):
    args = train_sft.Args(
        model_name_or_path="m", dataset_name="d", output_dir="o", max_prompt_length=5, max_completion_length=4
    )
    data = train_sft.encode_sft(
        tokenizer, ["sort: cow ->", "sort: cow ant ape bat ->"], ["cow", "ant ape bat cow"], args
    )
    assert len(data.input_ids) == 1 and "dropped 1 of 2 rows" in capsys.readouterr().out
    with pytest.raises(train_sft.UsageError, match="no prompt fits --max_prompt_length 2"):
        train_sft.encode_sft(tokenizer, ["sort: cow ->"], ["cow"], train_sft.Args("m", "d", "o", max_prompt_length=2))


def test_no_robots_messages_train_on_the_final_assistant_turn_with_the_template_before_it(tokenizer, tmp_path):
    rows = [  # HuggingFaceH4/no_robots' columns
        {
            "prompt": "sort: cow ant ->",
            "prompt_id": "a1",
            "category": "Sort",
            "messages": [
                {"role": "system", "content": "sort:"},
                {"role": "user", "content": "cow ant ->"},
                {"role": "assistant", "content": "ant cow"},
            ],
        },
        {
            "prompt": "sort: bat ->",
            "prompt_id": "b2",
            "category": "Sort",
            "messages": [{"role": "user", "content": "sort: bat ->"}, {"role": "assistant", "content": "bat"}],
        },
    ]
    prompts, completions = train_sft.load_sft_rows(str(write_jsonl(tmp_path / "nr.jsonl", rows)), "train")
    assert completions == ["ant cow", "bat"] and prompts[1] == [{"role": "user", "content": "sort: bat ->"}]
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] + ' ' }}{% endfor %}"
    tok = train_sft.load_tokenizer(str(TINY / "sft"), train_sft.Args("m", "d", "o", chat_template=template))
    data = train_sft.encode_sft(tok, prompts, completions, train_sft.Args("m", "d", "o"))
    first = data.input_ids[0][data.attention_mask[0].bool()].tolist()
    assert first == [tok.bos_token_id] + ids(tok, "sort: cow ant ->") + ids(tok, "ant cow") + [tok.eos_token_id]
    assert data.completion_mask[0][data.attention_mask[0].bool()].tolist() == [0] * 5 + [1] * 3
    # a prompt already rendered with the template (as tasks/label_preferences.py writes them) gets no second BOS
    rendered = tok.apply_chat_template(prompts[0], add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<s>")
    assert train_sft.encode_prompts(tok, [rendered, "sort: cow ->"]) == [
        first[:5],
        [tok.bos_token_id] + ids(tok, "sort: cow ->"),
    ]
    # the built-in template for base models: role tags, assistant prefix at the end
    tok.chat_template = train_sft.TULU_CHAT_TEMPLATE
    chat = prompts[0] + [{"role": "assistant", "content": "ant cow"}, {"role": "user", "content": "x"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert (
        text == "<s><|system|>\nsort:\n<|user|>\ncow ant ->\n<|assistant|>\nant cow</s>\n<|user|>\nx\n<|assistant|>\n"
    )


# ------------------------------------------------------------------------------ SFT loss
def slow_completion_nll(model, prompt: list[int], completion: list[int]) -> tuple[float, int]:
    """Sum of -log p(completion token | everything before it), one unpadded sequence at a time."""
    seq = torch.tensor([prompt + completion])
    logprobs = model(input_ids=seq).logits[0].log_softmax(-1)
    total = sum(-logprobs[len(prompt) + j - 1, tok].item() for j, tok in enumerate(completion))
    return total, len(completion)


def test_sft_loss_is_the_completion_tokens_mean_nll_whatever_the_padding(tokenizer):
    model = random_lm(tokenizer)
    t = lambda text: ids(tokenizer, text)  # noqa: E731
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompts = [[bos] + t("sort: cow ant ape ->"), [bos] + t("sort: cat ->"), [bos] + t("sort: fox dog ->")]
    completions = [t("ant ape cow") + [eos], t("cat") + [eos], t("dog fox dog fox dog") + [eos]]
    data = train_sft.pad_rows(prompts, completions, 8, 7, tokenizer.pad_token_id)  # every row padded on both sides
    with torch.no_grad():
        loss = train_sft.sft_loss(model, *data).item()
        by_hand = [slow_completion_nll(model, p, c) for p, c in zip(prompts, completions)]
        expected = sum(s for s, _ in by_hand) / sum(n for _, n in by_hand)
        assert loss == pytest.approx(expected, rel=1e-5)
        # trimming the all-pad columns changes nothing
        trimmed = train_sft.trim_columns(*data, attention_mask=data.attention_mask)
        assert trimmed[0].shape[1] < data.input_ids.shape[1]
        assert train_sft.sft_loss(model, *trimmed).item() == pytest.approx(loss, rel=1e-5)
        # the check is sharp: with the prompt tokens in the loss it fails
        with_prompt = train_sft.sft_loss(model, data.input_ids, data.attention_mask, data.attention_mask).item()
    assert abs(with_prompt - expected) > 1e-3


# ------------------------------------------------------------------------------ reward model and its loss
def test_reward_is_read_at_the_last_real_token(tokenizer):
    rm = random_rm(tokenizer)
    t = lambda text: ids(tokenizer, text)  # noqa: E731
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prompts = [[bos] + t("sort: cow ant ->"), [bos] + t("sort: cat ->")]
    completions = [t("ant cow") + [eos], t("cat cat cat")]
    data = train_sft.pad_rows(prompts, completions, 6, 5, tokenizer.pad_token_id)
    with torch.no_grad():
        rewards = train_reward.get_reward(rm, data.input_ids, data.attention_mask)
        for row, (p, c) in enumerate(zip(prompts, completions)):
            hidden = rm.model(input_ids=torch.tensor([p + c])).last_hidden_state[0, -1]
            assert rewards[row].item() == pytest.approx(rm.score(hidden).item(), abs=1e-5)
            # what HF's own head returns on the unpadded sequence, and not the reward at another position
            assert rewards[row].item() == pytest.approx(rm(input_ids=torch.tensor([p + c])).logits.item(), abs=1e-5)
            second_last = rm.score(rm.model(input_ids=torch.tensor([p + c])).last_hidden_state[0, -2]).item()
            assert abs(rewards[row].item() - second_last) > 1e-4
        # pad == EOS cannot move the read-out: it goes by the mask, not by ids
        same_ids_eos_pad = train_sft.pad_rows(prompts, completions, 6, 5, eos)
        assert torch.allclose(
            train_reward.get_reward(rm, same_ids_eos_pad.input_ids, same_ids_eos_pad.attention_mask), rewards, atol=1e-6
        )
        wrapped = train_reward.LastTokenReward(rm)
        assert torch.equal(wrapped(data.input_ids, data.attention_mask), rewards)


def test_bradley_terry_loss_and_pair_accuracy_by_hand():
    r_chosen, r_rejected = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([0.0, 0.5, 2.0])
    expected = (math.log(1 + math.exp(-1.0)) + math.log(1 + math.exp(1.0)) + math.log(2.0)) / 3
    assert train_reward.bradley_terry_loss(r_chosen, r_rejected).item() == pytest.approx(expected, rel=1e-6)
    assert train_reward.pair_accuracy(r_chosen, r_rejected) == pytest.approx(1 / 3)  # a tie counts as wrong
    assert math.isnan(train_reward.pair_accuracy(torch.tensor([]), torch.tensor([])))


# ------------------------------------------------------------------------------ schedule and batches
def test_learning_rate_schedules_and_batch_order_by_hand():
    lr_at = train_sft.lr_at
    assert lr_at(0, 100, 1.0, 50, "cosine") == pytest.approx(1 / 50)
    assert lr_at(60, 100, 1.0, 50, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.6)))
    assert lr_at(1, 100, 2.0, 4, "linear") == pytest.approx(2.0 * 0.5 * 0.99)
    assert lr_at(50, 100, 2.0, 0, "linear") == pytest.approx(1.0)
    assert lr_at(99, 100, 3.0, 0, "constant") == 3.0
    # epochs: one seeded shuffle per epoch cut into full batches (10 rows, batches of 4: 2 per epoch, 2 rows skipped)
    epochs = list(train_sft.batch_indices(10, 4, 4, "epochs", seed=0))
    g = torch.Generator().manual_seed(0)
    first, second = torch.randperm(10, generator=g), torch.randperm(10, generator=g)
    assert [b.tolist() for b in epochs] == [
        first[:4].tolist(),
        first[4:8].tolist(),
        second[:4].tolist(),
        second[4:8].tolist(),
    ]
    uniform = list(train_sft.batch_indices(10, 4, 3, "uniform", seed=0))
    g = torch.Generator().manual_seed(0)
    assert all(torch.equal(b, torch.randint(10, (4,), generator=g)) for b in uniform)
    args = train_sft.Args(
        "m",
        "d",
        "o",
        local_micro_batch_size=3,
        gradient_accumulation_steps=2,
        total_steps=None,
        num_train_epochs=2,
        warmup_ratio=0.1,
    )
    assert train_sft.schedule_sizes(25, args, world_size=2) == (
        12,
        4,
        0,
    )  # 2 epochs x 25 // 12 steps, warmup round(0.4)


# ------------------------------------------------------------------------------ bad input
def test_bad_input_is_reported_in_one_line_naming_the_flag_or_file(tokenizer, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(train_sft.UsageError, match=r"--dataset_name .*empty.jsonl has no rows"):
        train_sft.load_sft_rows(str(empty), "train")
    with pytest.raises(train_sft.UsageError, match=r"--dataset_name .*bad.jsonl cannot be read"):
        (tmp_path / "bad.jsonl").write_text("{not json\n")
        train_sft.load_sft_rows(str(tmp_path / "bad.jsonl"), "train")
    with pytest.raises(train_sft.UsageError, match=r"lacks column\(s\) \['completion'\]"):
        train_sft.load_sft_rows(str(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "x"}])), "train")
    with pytest.raises(train_sft.UsageError, match="row 0: `messages` must end with an assistant turn"):
        train_sft.load_sft_rows(
            str(write_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])), "train"
        )
    with pytest.raises(train_sft.UsageError, match="row 1: `completion` must be a string"):
        train_sft.load_sft_rows(
            str(
                write_jsonl(
                    tmp_path / "c.jsonl", [{"prompt": "x", "completion": "y"}, {"prompt": "x", "completion": None}]
                )
            ),
            "train",
        )
    with pytest.raises(train_sft.UsageError, match="--dataset_name .*d.txt: a single file must be one of"):
        train_sft.load_sft_rows(str(write_jsonl(tmp_path / "d.txt", [])), "train")
    with pytest.raises(train_sft.UsageError, match=r"lacks column\(s\) \['rejected'\]"):
        train_reward.load_preference_rows(
            str(write_jsonl(tmp_path / "e.jsonl", [{"prompt": "x", "chosen": "y"}])), "train"
        )
    pairs = write_jsonl(tmp_path / "f.jsonl", [{"prompt": "x", "chosen": "y", "rejected": "z"}])
    with pytest.raises(train_sft.UsageError, match="is a single file, so it has no split 'test'"):
        train_reward.load_eval_rows(train_reward.Args("m", str(pairs), "o"))
    with pytest.raises(train_sft.UsageError, match="chat prompts need a chat template"):
        train_sft.encode_prompts(tokenizer, [[{"role": "user", "content": "x"}]])
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(train_sft.UsageError, match="--output_dir .*notes exists and is not a model folder"):
        train_sft.check_output_dir(str(tmp_path / "notes"))
    with pytest.raises(train_sft.UsageError, match="cannot fill one batch of 8"):
        train_sft.schedule_sizes(
            5, train_sft.Args("m", "d", "o", local_micro_batch_size=4, gradient_accumulation_steps=2), 1
        )


def run_main(script: str, argv: list[str], capsys) -> str:
    """Run a script's `__main__` in this process (the imports are paid once); returns what it printed."""
    import runpy

    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        runpy.run_path(str(ROOT / "tasks" / script), run_name="__main__")
    finally:
        sys.argv = saved
    return capsys.readouterr().out


def test_scripts_stop_on_bad_input_with_one_line_before_any_model_loads(tmp_path, capsys):
    """The model path is a folder of garbage: only the data error may appear."""
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "model.safetensors").write_text("not weights")
    sft_data = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "x"}])
    with pytest.raises(SystemExit, match=rf"^error: --dataset_name {sft_data} .*lacks column\(s\) \['completion'\]"):
        run_main(
            "train_sft.py",
            [
                "--model_name_or_path",
                str(broken),
                "--dataset_name",
                str(sft_data),
                "--output_dir",
                str(tmp_path / "out"),
            ],
            capsys,
        )
    # and from the command line: exit code 1, one line, no traceback
    rm_data = write_jsonl(tmp_path / "rm.jsonl", [{"prompt": "x", "chosen": "y"}])
    argv = [
        sys.executable,
        "tasks/train_reward.py",
        "--model_name_or_path",
        str(broken),
        "--dataset_name",
        str(rm_data),
        "--output_dir",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert (
        proc.stderr.strip().splitlines()[-1].startswith(f"error: --dataset_name {rm_data} lacks column(s) ['rejected']")
    )
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ end to end
def losses_printed(stdout: str, name: str) -> list[float]:
    """The loss of each `<name> step` line."""
    return [
        float(line.split("loss")[1].split()[0])
        for line in stdout.splitlines()
        if line.strip().startswith(f"{name} step")
    ]


def test_sft_script_end_to_end_learns_a_trivial_completion(tokenizer, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    policy = save_random_policy(tokenizer, tmp_path / "init")
    rows = [
        {"prompt": f"sort: {w} ->", "completion": "ant"}
        for w in ["cow", "bat", "fox", "dog", "cat", "elk", "yak", "emu"]
    ]
    data = write_jsonl(tmp_path / "sft.jsonl", rows)
    out = tmp_path / "sft"
    printed = run_main(
        "train_sft.py",
        [
            "--model_name_or_path",
            str(policy),
            "--dataset_name",
            str(data),
            "--output_dir",
            str(out),
            "--local_micro_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--total_steps",
            "6",
            "--learning_rate",
            "3e-3",
            "--warmup_steps",
            "0",
            "--lr_scheduler_type",
            "constant",
            "--batch_sampling",
            "epochs",
            "--log_every",
            "1",
            "--trim_padding",
        ],
        capsys,
    )
    losses = losses_printed(printed, "sft")
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_args.json"} <= {
        p.name for p in out.iterdir()
    }
    assert not (tmp_path / "sft.tmp").exists()
    # the saved model has learnt it: "ant" then EOS after an unseen prompt
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = tokenizer("sort: ape ->", return_tensors="pt")
    greedy = model.generate(**prompt, do_sample=False, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id)[
        0, prompt.input_ids.shape[1] :
    ]
    assert tokenizer.decode(greedy) == "ant </s>"


def test_reward_script_end_to_end_learns_a_trivial_preference_and_reports_pair_accuracy(tokenizer, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    init = save_random_policy(
        tokenizer, tmp_path / "init"
    )  # a causal LM, as the SFT policy is: the score head starts random
    words = ["cow", "bat", "fox", "dog", "cat", "elk", "yak", "emu"]
    (tmp_path / "prefs").mkdir()
    write_jsonl(
        tmp_path / "prefs" / "train.jsonl",
        [{"prompt": f"sort: {w} ->", "chosen": "ant", "rejected": "bee"} for w in words],
    )
    # 3 pairs the trained model should get right, 1 it should get wrong (the preference flipped)
    test_rows = [{"prompt": f"sort: {w} ->", "chosen": "ant", "rejected": "bee"} for w in ["ape", "asp", "boa"]]
    test_rows.append({"prompt": "sort: cod ->", "chosen": "bee", "rejected": "ant"})
    write_jsonl(tmp_path / "prefs" / "test.jsonl", test_rows)
    out = tmp_path / "rm"
    printed = run_main(
        "train_reward.py",
        [
            "--model_name_or_path",
            str(init),
            "--dataset_name",
            str(tmp_path / "prefs"),
            "--output_dir",
            str(out),
            "--local_micro_batch_size",
            "4",
            "--num_train_epochs",
            "3",
            "--learning_rate",
            "3e-3",
            "--warmup_steps",
            "0",
            "--lr_scheduler_type",
            "constant",
            "--log_every",
            "1",
            "--local_eval_batch_size",
            "3",
        ],
        capsys,
    )
    losses = losses_printed(printed, "rm")
    assert len(losses) == 6 and losses[-1] < 0.5 * losses[0], losses
    results = json.loads((out / "eval_results.json").read_text())
    assert {"config.json", "model.safetensors", "tokenizer.json", "training_args.json"} <= {
        p.name for p in out.iterdir()
    }
    # pair accuracy recomputed by hand from the saved model, one unpadded sequence at a time
    rm = AutoModelForSequenceClassification.from_pretrained(out).eval()
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == tokenizer.pad_token_id
    with torch.no_grad():
        score = lambda p, c: rm(input_ids=tokenizer(f"{p} {c} </s>", return_tensors="pt").input_ids).logits.item()  # noqa: E731
        right = [score(r["prompt"], r["chosen"]) > score(r["prompt"], r["rejected"]) for r in test_rows]
    assert right == [True, True, True, False]
    assert results["num_eval_pairs"] == 4 and results["eval_pair_accuracy"] == 0.75


@pytest.mark.parametrize("module", [train_sft, train_reward])
def test_the_documented_paper_commands_parse(module):
    """Tables 5 and 6 as the docstrings spell them out: every flag exists and holds the table's value."""
    import shlex

    import tyro

    command = module.__doc__.split("accelerate launch", 1)[1].split("\n\n")[0].replace("\\\n", " ")
    words = shlex.split(command)
    args = tyro.cli(module.Args, args=words[words.index(f"tasks/{module.__name__}.py") + 1 :], use_underscores=True)
    world = int(words[words.index("--num_processes") + 1])
    batch = args.local_micro_batch_size * args.gradient_accumulation_steps * world
    if module is train_sft:  # table 5
        assert (
            batch,
            args.learning_rate,
            args.lr_scheduler_type,
            args.warmup_ratio,
            args.weight_decay,
            args.num_train_epochs,
        ) == (128, 5e-6, "linear", 0.03, 0.0, 2)
        assert (
            args.max_prompt_length + args.max_completion_length == 4096
            and args.batch_sampling == "epochs"
            and args.total_steps is None
        )
    else:  # table 6
        assert (batch, args.learning_rate, args.lr_scheduler_type, args.num_train_epochs, args.total_steps) == (
            256,
            3e-6,
            "linear",
            1,
            None,
        )
        assert args.max_prompt_length + args.max_completion_length == 1024


def test_two_processes_train_the_same_reward_model_as_one_with_the_same_micro_batches(tokenizer, tmp_path, capsys):
    """accelerate with 2 CPU processes (DDP over gloo), 2 micro-batches each, against 1 process with 4:
    the same micro-batches, so the same weights if gradients are synchronised across processes."""
    from safetensors.torch import load_file

    from conftest import run_script

    init = save_random_policy(tokenizer, tmp_path / "init")
    (tmp_path / "prefs").mkdir()
    write_jsonl(
        tmp_path / "prefs" / "train.jsonl",
        [
            {"prompt": f"sort: {w} ->", "chosen": "ant cow", "rejected": w}
            for w in ["cow", "bat", "fox", "dog", "cat", "elk", "yak", "emu"]
        ],
    )
    flags = [
        "--model_name_or_path",
        str(init),
        "--dataset_name",
        str(tmp_path / "prefs"),
        "--eval_split",
        "None",
        "--num_train_epochs",
        "3",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "0",
        "--local_micro_batch_size",
        "2",
        "--log_every",
        "1",
    ]
    two = run_script(
        [
            *accelerate_launch(),
            "--config_file",
            "configs/cpu_2proc.yaml",
            "tasks/train_reward.py",
            *flags,
            "--gradient_accumulation_steps",
            "2",
            "--output_dir",
            str(tmp_path / "two"),
        ],
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    one = run_main(
        "train_reward.py", [*flags, "--gradient_accumulation_steps", "4", "--output_dir", str(tmp_path / "one")], capsys
    )
    assert losses_printed(two.stdout, "rm") == pytest.approx(losses_printed(one, "rm"), abs=1e-4)
    a, b = load_file(tmp_path / "one" / "model.safetensors"), load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
