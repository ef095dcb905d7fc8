"""Bad input gets a one-line error naming the flag or file, before any model loads (SPEC, issue on faults)."""

import importlib
import json
import shutil
import re
import subprocess
import sys

import pytest
from conftest import ROOT, TINY, save_random_policy, small_config

import plumbing
from plumbing.inputs import _check_model, _load_tokenizer, load_reward_model, load_split
from plumbing.flags import COMMON_DOMAINS, UsageError, check_domains

# Private plumbing names (leading underscore) are used here on purpose: the checks of a model's files, a tokenizer
# and a checkpoint are tested one by one, on the bad input each refuses, which a whole run would reach slowly.

SCRIPTS = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]


@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(request.param.removesuffix(".py"))


def test_flag_values_out_of_range_name_the_flag_its_domain_and_why(script):
    for flags, message in [
        ({"async_level": -1}, r"--async_level must be >= 0 \(a count of policy versions\), got -1$"),
        ({"response_length": 0}, r"--response_length must be >= 1 \(a count of tokens\), got 0$"),
        ({"temperature": 0.0}, r"--temperature must be >= 0.01 \(below it vLLM samples at 0.01, .*\), got 0.0$"),
        ({"temperature": 1e-6}, r"--temperature must be >= 0.01 \(.*not at the trainer's temperature\), got 1e-06$"),
        ({"missing_eos_penalty": float("nan")}, r"--missing_eos_penalty must be a finite number \(a score\), got nan$"),
        ({"vllm_gpu_memory_utilization": 1.5}, r"--vllm_gpu_memory_utilization must be in \(0, 1\] .*, got 1.5$"),
        ({"keep_checkpoints": 0}, r"--keep_checkpoints must be >= 1 \(the latest checkpoint is the one a resume"),
        ({"total_episodes": 100}, "change --total_episodes or one of those flags"),
    ]:
        with pytest.raises(script.UsageError, match=message):
            script.compute_sizes(script.Args(**flags), world_size=1)


def test_the_algorithms_own_domains():
    import online_dpo_async as dpo
    import ppo_async as ppo
    import rloo_async as rloo

    for module, flags, message in [
        (dpo, {"num_samples": 1}, "--num_samples must be >= 2 (DPO needs a best and a worst completion), got 1"),
        (dpo, {"beta": -0.1}, "--beta must be > 0 (0 learns nothing, < 0 learns to prefer the rejected completion)"),
        (rloo, {"rloo_k": 1}, "--rloo_k must be >= 2 (the leave-one-out baseline needs another completion"),
        (rloo, {"tis_cap": 0.5}, "--tis_cap must be >= 1"),
        (ppo, {"gamma": 1.01}, "--gamma must be in [0, 1] (a discount), got 1.01"),
        (ppo, {"lam": -0.5}, "--lam must be in [0, 1] (GAE's lambda), got -0.5"),
        (ppo, {"kl_coef": -0.05}, "--kl_coef must be >= 0 (< 0 would reward moving away from the reference)"),
    ]:
        with pytest.raises(module.UsageError, match=re.escape(message)):
            module.compute_sizes(module.Args(**flags), world_size=1)


def numeric_flags(script) -> dict[str, type]:
    import typing

    kinds = {int: int, float: float, int | None: int, float | None: float}
    return {name: kinds[kind] for name, kind in typing.get_type_hints(script.Args).items() if kind in kinds}


def edges(domain: str, kind: type) -> tuple[list, list]:
    """Values just inside and just outside a domain, worked out from its text by a second reading of it."""
    step = 1 if kind is int else 1e-6
    if domain == "finite":
        return [0.0, -1e30, 1e30], [float("nan"), float("inf"), float("-inf")]
    if domain.startswith("in "):
        low, high = (float(x) for x in domain[4:-1].split(", "))
        closed = domain[3] == "["
        inside = [low if closed else low + step, high]
        return inside, [low - step if closed else low, high + step, float("nan")]
    op, bound = domain.split()
    bound = kind(bound)
    if op == ">=":
        return [bound, bound + step, 10**9], [bound - step] + ([float("nan")] if kind is float else [])
    assert op == ">", domain
    return [bound + step], [bound, bound - step] + ([float("nan"), float("inf")] if kind is float else [])


def test_every_numeric_flag_has_a_domain_and_both_sides_of_each_bound_are_checked(script):
    """A flag added without a domain fails here; every domain is exercised just inside and just outside its bounds.
    check_domains gets the file's domains, as the file passes them, and adds COMMON_DOMAINS (the plumbing's) itself."""
    own = script.SHARED_DOMAINS | script.ALGORITHM_DOMAINS
    domains = COMMON_DOMAINS | own
    numbers = numeric_flags(script)
    assert sorted(numbers) == sorted(domains), (
        "give each numeric flag a domain in COMMON_DOMAINS, SHARED_DOMAINS or ALGORITHM_DOMAINS"
    )
    defaults = vars(script.Args())
    check_domains(defaults, own)  # the defaults are in their domains
    for flag, (domain, why) in domains.items():
        inside, outside = edges(domain, numbers[flag])
        for value in inside:
            check_domains({**defaults, flag: value}, own)
        for value in outside:
            with pytest.raises(UsageError, match=rf"^--{flag} must be .* \({re.escape(why)}\), got "):
                check_domains({**defaults, flag: value}, own)
    check_domains({**defaults, "num_eval_prompts": None}, own)  # an optional flag left out


@pytest.mark.parametrize("flag", ["--loss_type or --old_logprobs", "--lr_schedule"])
def test_an_unknown_choice_is_refused_by_the_parser(script, flag, capsys):
    import tyro

    if flag == "--loss_type or --old_logprobs":
        flag = "--loss_type" if hasattr(script.Args, "loss_type") else "--old_logprobs"
    with pytest.raises(SystemExit):
        tyro.cli(script.Args, args=[flag, "nonsense"], use_underscores=True)
    error = capsys.readouterr().err
    assert "nonsense" in error and flag in error


def test_an_unknown_task_is_refused_naming_the_tasks(script):
    """--task names a row of the TASKS table (a table, not a choice in each file's Args: a task is added in one place),
    checked with every other flag before anything is read."""
    args = script.Args(task="tldr ")
    with pytest.raises(UsageError, match=r"^--task tldr  is none of the tasks, tiny, tldr, no_robots, gsm8k \(docs/"):
        script.compute_sizes(args, 1)
    script.compute_sizes(script.Args(task="gsm8k"), 1)


def test_a_response_beyond_the_models_context_is_refused(tokenizer, tmp_path):
    policy = save_random_policy(tokenizer, tmp_path / "policy")  # 128 positions
    _check_model(str(policy), "--sft_model_path", (12, 116), False)
    with pytest.raises(
        UsageError,
        match=r"--max_prompt_length 12 \+ --response_length 117 exceed the 128-token context of --sft_model_path",
    ):
        _check_model(str(policy), "--sft_model_path", (12, 117), False)


def test_missing_models_and_pickled_weights_are_refused(script, tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    with pytest.raises(UsageError, match=f"^--reward_model_path {tmp_path}/nowhere: no such file or folder$"):
        _check_model(str(tmp_path / "nowhere"), "--reward_model_path", (12, 12), False)
    model = AutoModelForCausalLM.from_config(small_config(tokenizer))
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # the pickled format
    with pytest.raises(UsageError, match="--sft_model_path .*bin has no .safetensors weights"):
        _check_model(str(tmp_path / "bin"), "--sft_model_path", (12, 12), False)
    assert script.Args().trust_remote_code is False


# (a file of the tiny policy's folder, what a copy cut short or a hand did to it, what the line says of it)
DAMAGED_MODEL_FILES = [
    ("model.safetensors", "cut in half", "has {half} bytes, and its header says {size}"),
    ("model.safetensors", "grown by 10 bytes", "has {grown} bytes, and its header says {size}"),
    ("model.safetensors", "cut to 100 bytes", "has no whole safetensors header (100 bytes)"),
    ("config.json", "cut after its first line", "does not parse (line 2: Expecting property name enclosed in double quotes)"),
    ("tokenizer.json", "cut after its first line", "does not parse (line 2: Expecting property name enclosed in double quotes)"),
    ("generation_config.json", "cut after its first line", "does not parse (line 2: Expecting property name enclosed in double quotes)"),
    ("model.safetensors.index.json", "naming a second shard", "names weights that are not there (model-00002-of-00002.safetensors)"),
]  # fmt: skip


@pytest.mark.parametrize("name, damage, problem", DAMAGED_MODEL_FILES)
def test_a_damaged_file_of_a_model_folder_is_named_before_any_model_loads(name, damage, problem, tmp_path):
    """plumbing's _check_model, which every run calls on each model folder its flags name before anything loads: the
    file and what is wrong with it, where transformers, tokenizers or vLLM would fail with a traceback naming none
    (a safetensors file's size against its header: 8 bytes, the header, the tensors' bytes)."""
    policy = tmp_path / "policy"
    shutil.copytree(TINY / "sft", policy)
    file = policy / name
    size = (policy / "model.safetensors").stat().st_size
    if name.endswith(".safetensors"):
        data = file.read_bytes()
        cut = {"cut in half": data[: size // 2], "cut to 100 bytes": data[:100]}
        file.write_bytes(cut.get(damage, data + b"\0" * 10))
    elif damage == "naming a second shard":
        shards = ["model.safetensors", "model-00002-of-00002.safetensors"]
        file.write_text(json.dumps({"weight_map": {"a.weight": shards[0], "b.weight": shards[1]}}))
    else:
        file.write_text(file.read_text().splitlines()[0] + "\n")
    said = problem.format(half=size // 2, grown=size + 10, size=size)
    with pytest.raises(UsageError) as error:
        _check_model(str(policy), "--reward_model_path", (12, 12), False)
    assert str(error.value) == f"--reward_model_path {policy}: {name} {said}: the copy is damaged; copy it again"
    _check_model(str(TINY / "sft"), "--reward_model_path", (12, 12), False)  # the whole folder passes


def test_a_tokenizer_that_does_not_load_is_named_in_one_line(tmp_path):
    """Its files parse, but the tokenizers library cannot make a tokenizer of them: a bare Exception from Rust."""
    policy = tmp_path / "policy"
    shutil.copytree(TINY / "sft", policy)
    (policy / "tokenizer.json").write_text(json.dumps({"model": {"type": "nothing of the kind"}}))
    with pytest.raises(UsageError, match=rf"^the tokenizer of --sft_model_path {policy} does not load: \S"):
        _load_tokenizer(str(policy), "--sft_model_path", False)


def test_a_hub_id_neither_local_nor_in_the_cache_is_named_while_offline(tmp_path, monkeypatch):
    """A model and a dataset named by a hub id that is not on this machine: one line saying so and how to get it, not
    the hub client's message (the tests run offline, HF_HUB_OFFLINE=1). A model whose config the local cache holds
    (its layout built here: refs/main naming a snapshot) goes on to load from it."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UsageError) as error:
        _check_model("EleutherAI/pythia-14m", "--sft_model_path", (12, 12), False)
    assert str(error.value) == (
        "--sft_model_path EleutherAI/pythia-14m is not a local folder and not in the local cache, and the hub is "
        "offline (HF_HUB_OFFLINE=1): download it once where the hub is reachable, or give a local folder"
    )
    with pytest.raises(UsageError) as error:
        split_of("trl-lib/tldr")
    assert str(error.value) == (
        "--dataset_name trl-lib/tldr is not a local file or folder and not in the local cache, and the hub is offline "
        "(HF_HUB_OFFLINE=1): download it once where the hub is reachable, or give a local file or folder"
    )
    repo = tmp_path / "hub" / "models--someone--tiny"
    shutil.copytree(TINY / "sft", repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    _check_model("someone/tiny", "--sft_model_path", (12, 12), False)


def test_a_tokenizer_without_eos_is_refused_and_one_without_pad_pads_with_eos(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    json.dump({**config, "pad_token": None}, open(tmp_path / "tok" / "tokenizer_config.json", "w"))
    no_pad = _load_tokenizer(str(tmp_path / "tok"), "--sft_model_path", False)
    assert no_pad.pad_token_id == no_pad.eos_token_id == tokenizer.eos_token_id
    json.dump({**config, "pad_token": None, "eos_token": None}, open(tmp_path / "tok" / "tokenizer_config.json", "w"))
    with pytest.raises(UsageError, match="the tokenizer of --sft_model_path .*tok has no EOS token"):
        _load_tokenizer(str(tmp_path / "tok"), "--sft_model_path", False)


def split_of(name: str, split: str = "train", evaluation: bool = False, dataset_eval_file: str | None = None):
    """plumbing's load_split, which the three files call, on --dataset_name `name` as the tiny task reads it."""
    import online_dpo_async as dpo

    return load_split(
        name, None, split, dpo.TASKS["tiny"].columns, task="tiny", evaluation=evaluation, eval_file=dataset_eval_file
    )


def test_datasets_of_an_unknown_kind_or_split_name_the_flag(tmp_path):
    (tmp_path / "prompts.txt").write_text("sort: a ->\n")
    with pytest.raises(UsageError, match="--dataset_name .*prompts.txt: a single file must be one of"):
        split_of(str(tmp_path / "prompts.txt"))
    with pytest.raises(UsageError, match="--dataset_name .* split validation"):
        split_of(str(TINY / "data"), "validation")
    with pytest.raises(UsageError, match=f"^--dataset_name {tmp_path}/nowhere: no such file or folder$"):
        split_of(str(tmp_path / "nowhere"))


def test_an_output_dir_holding_a_run_needs_resume_with_the_same_flags(script, tmp_path):
    flags = vars(script.Args(output_dir=str(tmp_path)))
    resume = plumbing.checkpoints.checkpoint_to_resume
    assert resume(str(tmp_path), flags, False, world_size=1) is None  # empty: a fresh run
    (tmp_path / "args.json").write_text(json.dumps({**flags, "world_size": 1}))
    (tmp_path / "metrics.jsonl").write_text("")
    assert resume(str(tmp_path), flags, False, world_size=1) is None  # a run stopped while starting: not a run
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "episode": 0, "eval/win_rate": 0.5}\n')
    with pytest.raises(UsageError, match=f"--output_dir {tmp_path} holds another run: pass --resume"):
        resume(str(tmp_path), flags, False, world_size=1)
    resumed = {**flags, "resume": True}
    assert resume(str(tmp_path), resumed, True, world_size=1) is None  # no checkpoint yet: starts over
    for name in ("step_000004", "step_000012", "step_000008.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    # an empty checkpoint folder is one never written: named and skipped, not taken for another version's
    with pytest.raises(UsageError, match=r"step_000012 is damaged \(it is empty: made, never written; delete it\)"):
        resume(str(tmp_path), resumed, True, world_size=1)
    # a checkpoint of an older version (another format, and no manifest) is refused in one line
    (tmp_path / "checkpoints" / "step_000012" / "format.json").write_text('{"format": 3}')
    with pytest.raises(UsageError, match=r"step_000012 is not a checkpoint of this version"):
        resume(str(tmp_path), resumed, True, world_size=1)
    (tmp_path / "checkpoints" / "step_000012" / "format.json").write_text('{"format": 4}')
    plumbing.checkpoints._write_manifest(str(tmp_path / "checkpoints" / "step_000012"))
    assert resume(str(tmp_path), resumed, True, world_size=1) == str(tmp_path / "checkpoints" / "step_000012")
    with pytest.raises(
        UsageError,
        match=r"--resume: --learning_rate .* -> 0\.5, training processes 1 -> 2 differ",
    ):
        resume(str(tmp_path), {**resumed, "learning_rate": 0.5}, True, world_size=2)


@pytest.mark.parametrize(
    "name, flags, line",
    [
        (
            "online_dpo_async.py",
            ["--beta", "-1"],
            "--beta must be > 0 (0 learns nothing, < 0 learns to prefer the rejected completion), got -1.0",
        ),
        (  # PRIME-RL's objective without the engine's logprobs (its mu): refused right after the sizes are checked
            "rloo_async.py",
            ["--loss_type", "prime_rl", "--sft_model_path", "/nowhere/policy"],
            "--loss_type prime_rl's mu is the engine's logprobs: add --old_logprobs engine",
        ),
        (
            "ppo_async.py",
            [],
            "--output_dir {run} holds another run: pass --resume to continue it, or choose another --output_dir",
        ),
    ],
)
def test_the_command_line_prints_one_line_and_writes_nothing(name, flags, line, tmp_path):
    """From the shell: exit 1, one line on stderr, no traceback, well before a model could have loaded, and nothing
    written to --output_dir (the PPO case's folder holds another run's metrics, which stay as they were)."""
    run = tmp_path / "run"
    if not flags:
        run.mkdir()
        (run / "args.json").write_text("{}")
        (run / "metrics.jsonl").write_text('{"step": 0, "episode": 0, "eval/win_rate": 0.5}\n')
    before = sorted(p.name for p in tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, name, "--output_dir", str(run), *flags], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: " + line.format(run=run)]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def tree(folder) -> dict[str, bytes | None]:
    """Every path under `folder`, with a file's contents."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


@pytest.mark.parametrize(
    "name, flags, line",
    [
        (
            "online_dpo_async.py",
            ["--output_dir", "{file}"],
            "--output_dir {file} is a file, not a folder: choose another --output_dir",
        ),
        (
            "rloo_async.py",
            ["--exp_name", "../x"],
            "--exp_name '../x' must be a plain name (letters, digits, '_', '.', '-'): it names the run and its folder "
            "runs/<exp_name>__<seed>__<time>",
        ),
        (
            "ppo_async.py",
            ["--exp_name", "a/b"],
            "--exp_name 'a/b' must be a plain name (letters, digits, '_', '.', '-'): it names the run and its folder "
            "runs/<exp_name>__<seed>__<time>",
        ),
    ],
)
def test_an_output_dir_that_is_a_file_and_an_exp_name_that_is_a_path_are_refused(name, flags, line, tmp_path):
    """From the shell, in a fresh working folder: exit 1, one line on stderr, and nothing written in the folder or
    beside it (no runs/, no run folder where the name's path would lead; the file given as --output_dir unchanged)."""
    work = tmp_path / "work"
    work.mkdir()
    file = work / "notes.txt"
    file.write_text("not a run folder\n")
    before = tree(tmp_path)
    proc = subprocess.run(
        [sys.executable, str(ROOT / name), *(flag.format(file=file) for flag in flags)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: " + line.format(file=file)]
    assert tree(tmp_path) == before and not (work / "runs").exists()


def not_a_reward_model(flag: str, path) -> str:
    return f"{flag} {path} is not a reward model: it has no score head, which loading would initialise at random"


def test_a_causal_lm_is_not_a_reward_model_and_the_tiny_reward_model_is(tmp_path):
    """From the config, before any weights load: the tiny SFT policy is a causal LM, the tiny reward model a sequence
    classifier; a config that names no architecture cannot be told and is left to the check at load time."""
    lengths = (12, 12)
    _check_model(str(TINY / "reward"), "--reward_model_path", lengths, False, reward=True)
    _check_model(str(TINY / "sft"), "--sft_model_path", lengths, False)  # a policy need not be a classifier
    for flag in ("--reward_model_path", "--gold_judge"):
        with pytest.raises(UsageError, match=f"^{re.escape(not_a_reward_model(flag, TINY / 'sft'))}$"):
            _check_model(str(TINY / "sft"), flag, lengths, False, reward=True)
    unnamed = tmp_path / "unnamed"
    shutil.copytree(TINY / "sft", unnamed)
    config = json.loads((unnamed / "config.json").read_text())
    (unnamed / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    _check_model(str(unnamed), "--reward_model_path", lengths, False, reward=True)


def test_at_load_time_a_score_head_initialised_at_random_is_refused():
    """The check of a hub id that was not in the cache before it loaded: the head among the missing weights."""
    reward_model = load_reward_model(str(TINY / "reward"), "--gold_judge", use_safetensors=True)
    assert reward_model.score.weight.shape == (1, 128)
    with pytest.raises(UsageError, match=f"^--gold_judge {TINY / 'sft'} is not a reward model"):
        load_reward_model(str(TINY / "sft"), "--gold_judge", use_safetensors=True)


@pytest.mark.parametrize(
    "flag, name", [("--reward_model_path", "online_dpo_async.py"), ("--gold_judge", "ppo_async.py")]
)
def test_an_sft_policy_as_reward_model_or_gold_judge_is_refused_in_one_line(flag, name, tmp_path):
    """From the shell (the check is the same text in all three files): exit 1, one line naming the flag, no run folder."""
    proc = subprocess.run(
        [sys.executable, name, flag, "tasks/tiny/sft", "--output_dir", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {not_a_reward_model(flag, 'tasks/tiny/sft')}"]
    assert not (tmp_path / "run" / "args.json").exists() and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------ data
def rows_file(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


SORT = {"query": "sort: cat ant ->", "reference_response": "ant cat </s>"}
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
# (--task, the bad row (row 1, after a good one), the column and what is wrong with it)
BAD_ROWS = [
    ("tiny", {**SORT, "query": 5}, "query", "int 5 is not text"),
    ("tiny", {"query": SORT["query"]}, "reference_response", "missing (null)"),  # no such key in the row
    ("tiny", {**SORT, "query": ""}, "query", "'' is empty"),
    ("tldr", {**SORT, "reference_response": " \n"}, "reference_response", "' \\n' is empty"),
    ("tldr", {**SORT, "query": ["sort: cat ->"]}, "query", "list ['sort: cat ->'] is not text"),
    ("gsm8k", {"question": 7, "answer": "#### 7"}, "question", "int 7 is not text"),
    ("no_robots", {"messages": "Hi"}, "messages", "str 'Hi' is not a list of messages"),
    ("no_robots", {"messages": [CHAT[0], {"role": "assistant"}]}, "messages", "message 1, dict {'role': 'assistant'}, "
     "is not {'role': text, 'content': text}"),
    ("no_robots", {"messages": [CHAT[0], {**CHAT[1], "content": ""}]}, "messages", "message 1's content '' is empty"),
    # an empty chat prompt: no conversation, or a turn of white space only
    ("no_robots", {"messages": []}, "messages", "list [] is not a list of messages"),
    ("no_robots", {"messages": [{**CHAT[0], "content": " \n"}, CHAT[1]]}, "messages", "message 0's content ' \\n' is empty"),
]  # fmt: skip


@pytest.mark.parametrize("task, bad, column, problem", BAD_ROWS)
def test_every_row_read_is_checked_naming_the_file_split_row_and_column(task, bad, column, problem, tmp_path):
    """plumbing.load_split, which every file's load_prompts calls: the columns' types, no empty prompt or reference,
    in one line naming the file, the split, the row and the column (a tokenizer would fail on the value with a
    traceback naming none of them; an empty evaluation prompt divided by zero mid-run)."""
    import online_dpo_async as dpo

    good = {
        "tiny": SORT,
        "tldr": SORT,
        "gsm8k": {"question": "2 + 2?", "answer": "#### 4"},
        "no_robots": {"messages": CHAT},
    }
    name = rows_file(tmp_path / "rows.jsonl", [good[task], bad])
    with pytest.raises(UsageError) as error:
        load_split(name, None, "train", dpo.TASKS[task].columns, task=task)
    assert str(error.value) == f"--dataset_name {name} split train, row 1, column {column}: {problem}"


def test_the_evaluation_split_is_checked_as_far_as_it_is_read(tmp_path):
    """The evaluation prompts of --dataset_eval_file: a bad row past --num_eval_prompts is not read."""
    import online_dpo_async as dpo

    train = rows_file(tmp_path / "train.jsonl", [SORT])
    evaluation = rows_file(tmp_path / "eval.jsonl", [SORT, SORT, {**SORT, "query": " "}])
    columns = dpo.TASKS["tiny"].columns
    dataset, where = load_split(
        train, None, "test", columns, task="tiny", evaluation=True, eval_file=evaluation, num_prompts=2
    )
    assert (len(dataset), where) == (2, f"--dataset_eval_file {evaluation}")
    with pytest.raises(UsageError, match=rf"^--dataset_eval_file {evaluation}, row 2, column query: ' ' is empty$"):
        load_split(train, None, "test", columns, task="tiny", evaluation=True, eval_file=evaluation)


def test_one_file_for_both_splits_is_refused_unless_the_evaluation_has_a_file_of_its_own(tmp_path):
    """A single file serves every split name: the evaluation would run on the training prompts."""
    train = rows_file(tmp_path / "train.jsonl", [SORT, {**SORT, "query": "sort: dog ->"}])
    evaluation = rows_file(tmp_path / "eval.jsonl", [{**SORT, "query": "sort: eel ->"}])
    with pytest.raises(UsageError) as error:
        split_of(train, "test", evaluation=True)
    assert str(error.value) == (
        f"--dataset_name {train} is one file, which would serve the evaluation split too: the evaluation would run on "
        "the training prompts; give its prompts as another file, --dataset_eval_file"
    )
    assert len(split_of(train, "train")[0]) == 2  # for training it is what it was
    dataset, _ = split_of(train, "test", evaluation=True, dataset_eval_file=evaluation)
    assert dataset["query"] == ["sort: eel ->"]
    dataset, _ = split_of(
        str(TINY / "data"), "test", evaluation=True, dataset_eval_file=evaluation
    )  # with a folder too
    assert dataset["query"] == ["sort: eel ->"]
    with pytest.raises(UsageError, match=f"^--dataset_eval_file {train} is --dataset_name: evaluate on other prompts$"):
        split_of(train, "test", evaluation=True, dataset_eval_file=train)
    with pytest.raises(UsageError, match="^--dataset_eval_file .*tasks/tiny/data is not a file: give one file"):
        split_of(train, "test", evaluation=True, dataset_eval_file=str(TINY / "data"))


def test_a_file_that_does_not_parse_is_named_with_its_line(tmp_path):
    """A .jsonl cut off by a kill or a full disk, a bad line in the middle, a .json document cut off, and a dataset
    folder with one such file: the file and its line (the row for JSON Lines), not the builder's chained tracebacks."""
    lines = [json.dumps(SORT)] * 3
    (tmp_path / "cut.jsonl").write_text("\n".join(lines) + "\n" + lines[0][:25])
    (tmp_path / "middle.jsonl").write_text(lines[0] + "\n\n" + lines[0] + "\n{'query': 1}\n" + lines[0] + "\n")
    (tmp_path / "document.json").write_text(json.dumps([SORT, SORT], indent=1)[:-30])
    (tmp_path / "folder" / "data").mkdir(parents=True)
    shutil.copy(tmp_path / "cut.jsonl", tmp_path / "folder" / "data" / "train.jsonl")
    for name, where in [
        ("cut.jsonl", "line 4 (row 3): Unterminated string starting at"),
        ("middle.jsonl", "line 4 (row 2): Expecting property name enclosed in double quotes"),
        ("document.json", "line 8: Unterminated string starting at"),
    ]:
        with pytest.raises(UsageError) as error:
            split_of(str(tmp_path / name))
        assert str(error.value) == f"--dataset_name {tmp_path / name}: {tmp_path / name} does not parse at {where}"
    with pytest.raises(UsageError) as error:
        split_of(str(tmp_path / "folder"))
    file = tmp_path / "folder" / "data" / "train.jsonl"
    assert (
        str(error.value)
        == f"--dataset_name {tmp_path / 'folder'}: {file} does not parse at line 4 (row 3): Unterminated string starting at"
    )


def test_data_files_that_cannot_be_read_are_named_before_the_builder_reads_them(tmp_path):
    """Bytes that are not UTF-8 (a file saved as Latin-1: the builder reads them, and the rows' check fails in pyarrow
    with a traceback naming neither file nor line), a file with no rows (the builder's StopIteration and an empty
    `error:`), a Parquet file cut short (its footer, written last, missing), alone or among a folder's files."""
    good = json.dumps(SORT)
    (tmp_path / "latin1.jsonl").write_bytes(
        f"{good}\n{good}\n".encode() + '{"query": "sort: café ->"}\n'.encode("latin-1")
    )
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n \n")
    import pyarrow
    import pyarrow.parquet

    pyarrow.parquet.write_table(pyarrow.table({"query": [SORT["query"]] * 50}), tmp_path / "whole.parquet")
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.jsonl").write_text(good + "\n")
    shutil.copy(tmp_path / "latin1.jsonl", tmp_path / "folder" / "b.jsonl")
    for name, file, problem in [
        ("latin1.jsonl", "latin1.jsonl", "is not UTF-8 text: line 3 holds the byte 0xe9; save it as UTF-8"),
        ("empty.jsonl", "empty.jsonl", "is empty: it holds no rows"),
        ("blank.jsonl", "blank.jsonl", "is empty: it holds no rows"),
        ("cut.parquet", "cut.parquet", "is not a whole Parquet file (Parquet magic bytes not found in footer. Either "
         "the file is corrupted or this is not a parquet file.): copy it again"),
        ("folder", "folder/b.jsonl", "is not UTF-8 text: line 3 holds the byte 0xe9; save it as UTF-8"),
    ]:  # fmt: skip
        with pytest.raises(UsageError) as error:
            split_of(str(tmp_path / name))
        assert str(error.value) == f"--dataset_name {tmp_path / name}: {tmp_path / file} {problem}"


def test_a_json_value_that_is_not_a_row_is_named_with_its_line_and_row(tmp_path):
    """A line of a JSON Lines file that parses, but to an array, a string or a number, not an object: the builder says
    "Column() changed from object to string in row 0", naming a row that is not the one; the line here is the file's
    (blank lines counted), the row the rows before it. A .json document, an array of rows: the item."""
    good = json.dumps(SORT)
    for value, kind in [('["sort: a ->", "a </s>"]', "array"), ('"sort: a ->"', "string"), ("7", "number")]:
        (tmp_path / "rows.jsonl").write_text(f"{good}\n\n{good}\n{value}\n{good}\n")
        with pytest.raises(UsageError) as error:
            split_of(str(tmp_path / "rows.jsonl"))
        assert str(error.value) == (
            f"--dataset_name {tmp_path / 'rows.jsonl'}: {tmp_path / 'rows.jsonl'} does not parse at line 4 (row 2): a "
            f"JSON {kind}, not an object (a row)"
        )
    (tmp_path / "rows.json").write_text(json.dumps([SORT, "sort: a ->", SORT], indent=1))
    with pytest.raises(UsageError) as error:
        split_of(str(tmp_path / "rows.json"))
    assert str(error.value) == (
        f"--dataset_name {tmp_path / 'rows.json'}: {tmp_path / 'rows.json'} does not parse at item 1: a JSON string, not "
        "an object (a row)"
    )


def test_each_split_says_once_how_many_prompts_it_has_and_from_which_files(tmp_path, capsys, monkeypatch):
    """A folder's every data file is the train split's when no name says otherwise (`datasets`' rules): the line says
    how many prompts each gave, in the order the split holds them; one file is named with its path as given; the
    evaluation's first --num_eval_prompts are counted against all; a process other than rank 0 says nothing."""
    folder = tmp_path / "data"
    folder.mkdir()
    for name, count in [("part1.jsonl", 3), ("part2.jsonl", 2), ("notes.jsonl", 1)]:
        rows_file(folder / name, [{**SORT, "query": f"sort: {name} {i} ->"} for i in range(count)])
    with open(folder / "part1.jsonl", "a") as part:
        part.write("\n \n")  # blank lines, which are no rows
    dataset, _ = split_of(str(folder))
    assert len(dataset) == 6 and dataset["query"][0] == "sort: notes.jsonl 0 ->"
    assert capsys.readouterr().out.splitlines() == [
        f"train: 6 prompts from 3 files of {folder}: notes.jsonl 1, part1.jsonl 3, part2.jsonl 2"
    ]
    train = rows_file(tmp_path / "train.jsonl", [SORT] * 3)
    split_of(train)
    split_of(str(TINY / "data"), "test", evaluation=True, dataset_eval_file=train)
    import online_dpo_async as dpo

    folder_name, columns = str(TINY / "data"), dpo.TASKS["tiny"].columns
    load_split(folder_name, None, "test", columns, "tiny", evaluation=True, eval_file=train, num_prompts=2)
    assert capsys.readouterr().out.splitlines() == [
        f"train: 3 prompts from {train}",
        f"test: 3 prompts from {train}",
        f"test: the first 2 of 3 prompts from {train}",
    ]
    monkeypatch.chdir(ROOT)
    split_of("tasks/tiny/data")  # a folder named relative to the working folder, one file for its split
    assert capsys.readouterr().out.splitlines() == ["train: 32768 prompts from tasks/tiny/data/train.jsonl"]
    monkeypatch.setenv("RANK", "1")
    split_of(str(folder))
    assert capsys.readouterr().out == ""


# ------------------------------------------------------------------------------------------ settings
def test_a_task_without_a_gold_judge_says_at_start_that_no_win_rate_is_logged(capsys, tmp_path):
    """`--gold_judge tiny`, the default, judges the tiny task only: --task tldr or no_robots with it logs no
    eval/win_rate, which load_inputs says in one line before anything loads (docs/tasks.md says why this is not
    refused: No Robots is judged afterwards, as the paper's LLM judge does); with a reward model as the judge, or
    on the tiny task, nothing is said."""
    import online_dpo_async as dpo

    line = (
        "--task tldr with --gold_judge tiny logs no eval/win_rate: pass a reward model as --gold_judge, or judge "
        "eval_completions/ afterwards (docs/tasks.md)"
    )
    train, evaluation = rows_file(tmp_path / "train.jsonl", [SORT]), rows_file(tmp_path / "eval.jsonl", [SORT])
    sizes = dict(local_micro_batch_size=1, total_episodes=2, dataset_name=train, dataset_eval_file=evaluation)
    for flags, said in [
        ({"task": "tldr"}, [line]),
        ({"task": "tldr", "gold_judge": str(TINY / "reward")}, []),
        ({}, []),
    ]:
        args = dpo.Args(**sizes, **flags)
        dpo.load_inputs(args, dpo.compute_sizes(args, world_size=1))
        assert [out for out in capsys.readouterr().out.splitlines() if "eval/win_rate" in out] == said


@pytest.mark.parametrize(
    "name, flags, line",
    [
        (
            "online_dpo_async.py",
            ["--temperature", "1e-6"],
            "--temperature must be >= 0.01 (below it vLLM samples at 0.01, not at the trainer's temperature), got 1e-06",
        ),
        (  # the engines' layout, checked before any model loads (docs/gpus.md)
            "rloo_async.py",
            ["--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "2"],
            "--vllm_tensor_parallel_size 2: no GPU is visible, and an engine on the CPU runs in one process; use "
            "--vllm_num_engines for more engines",
        ),
        (
            "ppo_async.py",
            ["--dataset_name", "{data}/cut.jsonl"],
            "--dataset_name {data}/cut.jsonl: {data}/cut.jsonl does not parse at line 2 (row 1): Unterminated string "
            "starting at",
        ),
        (  # a copy of the tiny policy, its 2,652,680 bytes of weights cut in half
            "online_dpo_async.py",
            ["--sft_model_path", "{data}/policy"],
            "--sft_model_path {data}/policy: model.safetensors has 1326340 bytes, and its header says 2652680: the copy "
            "is damaged; copy it again",
        ),
    ],
)
def test_bad_data_and_settings_get_one_line_from_the_shell_and_nothing_written(name, flags, line, tmp_path):
    """As a user meets them: exit 1, the one `error:` line (no builder's log, no traceback), before any model loads,
    and no run folder (a bad row takes the same way out as the file that does not parse: a UsageError of
    load_split's)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "cut.jsonl").write_text(json.dumps(SORT) + "\n" + json.dumps(SORT)[:25])
    shutil.copytree(TINY / "sft", data / "policy")
    weights = (data / "policy" / "model.safetensors").read_bytes()
    (data / "policy" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    run = tmp_path / "run"
    argv = [sys.executable, name, *(flag.format(data=data) for flag in flags), "--output_dir", str(run)]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == ["error: " + line.format(data=data)]
    assert not run.exists()
