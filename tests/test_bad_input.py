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
from plumbing.command_line import (
    COMMON_DOMAINS,
    UsageError,
    check_domains,
    check_model,
    load_reward_model,
    load_split,
    load_tokenizer,
)

SCRIPTS = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]


@pytest.fixture(params=SCRIPTS)
def script(request):
    return importlib.import_module(request.param.removesuffix(".py"))


def test_flag_values_out_of_range_name_the_flag_its_domain_and_why(script):
    for flags, message in [
        ({"async_level": -1}, r"--async_level must be >= 0 \(a count of policy versions\), got -1$"),
        ({"response_length": 0}, r"--response_length must be >= 1 \(a count of tokens\), got 0$"),
        ({"temperature": 0.0}, r"--temperature must be > 0 \(logprobs divide logits by it\), got 0.0$"),
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
    check_domains gets the file's own domains, as the file passes them, and adds COMMON_DOMAINS itself."""
    own = script.ALGORITHM_DOMAINS
    domains = COMMON_DOMAINS | own
    numbers = numeric_flags(script)
    assert sorted(numbers) == sorted(domains), "give each numeric flag a domain in COMMON_DOMAINS or ALGORITHM_DOMAINS"
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


@pytest.mark.parametrize("flag", ["--task", "--loss_type or --old_logprobs", "--lr_schedule"])
def test_an_unknown_choice_is_refused_by_the_parser(script, flag, capsys):
    import tyro

    if flag == "--loss_type or --old_logprobs":
        flag = "--loss_type" if hasattr(script.Args, "loss_type") else "--old_logprobs"
    with pytest.raises(SystemExit):
        tyro.cli(script.Args, args=[flag, "nonsense"], use_underscores=True)
    error = capsys.readouterr().err
    assert "nonsense" in error and flag in error


def test_a_response_beyond_the_models_context_is_refused(tokenizer, tmp_path):
    policy = save_random_policy(tokenizer, tmp_path / "policy")  # 128 positions
    check_model(str(policy), "--sft_model_path", (12, 116), False)
    with pytest.raises(
        UsageError,
        match=r"--max_prompt_length 12 \+ --response_length 117 exceed the 128-token context of --sft_model_path",
    ):
        check_model(str(policy), "--sft_model_path", (12, 117), False)


def test_missing_models_and_pickled_weights_are_refused(script, tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    with pytest.raises(UsageError, match=f"^--reward_model_path {tmp_path}/nowhere: no such file or folder$"):
        check_model(str(tmp_path / "nowhere"), "--reward_model_path", (12, 12), False)
    model = AutoModelForCausalLM.from_config(small_config(tokenizer))
    model.config.save_pretrained(tmp_path / "bin")
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")  # the pickled format
    with pytest.raises(UsageError, match="--sft_model_path .*bin has no .safetensors weights"):
        check_model(str(tmp_path / "bin"), "--sft_model_path", (12, 12), False)
    assert script.Args().trust_remote_code is False


def test_a_tokenizer_without_eos_is_refused_and_one_without_pad_pads_with_eos(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "tok")
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    json.dump({**config, "pad_token": None}, open(tmp_path / "tok" / "tokenizer_config.json", "w"))
    no_pad = load_tokenizer(str(tmp_path / "tok"), "--sft_model_path", False)
    assert no_pad.pad_token_id == no_pad.eos_token_id == tokenizer.eos_token_id
    json.dump({**config, "pad_token": None, "eos_token": None}, open(tmp_path / "tok" / "tokenizer_config.json", "w"))
    with pytest.raises(UsageError, match="the tokenizer of --sft_model_path .*tok has no EOS token"):
        load_tokenizer(str(tmp_path / "tok"), "--sft_model_path", False)


def test_datasets_of_an_unknown_kind_or_split_name_the_flag(tmp_path):
    """plumbing's load_split, which the three files call."""
    (tmp_path / "prompts.txt").write_text("sort: a ->\n")
    with pytest.raises(UsageError, match="--dataset_name .*prompts.txt: a single file must be one of"):
        load_split(str(tmp_path / "prompts.txt"), "train")
    with pytest.raises(UsageError, match="--dataset_name .* split validation"):
        load_split(str(TINY / "data"), "validation")
    with pytest.raises(UsageError, match=f"^--dataset_name {tmp_path}/nowhere: no such file or folder$"):
        load_split(str(tmp_path / "nowhere"), "train")


def test_an_output_dir_holding_a_run_needs_resume_with_the_same_flags(script, tmp_path):
    flags = vars(script.Args(output_dir=str(tmp_path)))
    resume = plumbing.run_folder.checkpoint_to_resume
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
    # a checkpoint of an older version (no format.json, or another format) is refused in one line
    with pytest.raises(UsageError, match=r"step_000012 is not a checkpoint of this version \(format 3\)"):
        resume(str(tmp_path), resumed, True, world_size=1)
    (tmp_path / "checkpoints" / "step_000012" / "format.json").write_text('{"format": 2}')
    with pytest.raises(UsageError, match=r"step_000012 is not a checkpoint of this version"):
        resume(str(tmp_path), resumed, True, world_size=1)
    (tmp_path / "checkpoints" / "step_000012" / "format.json").write_text('{"format": 3}')
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
    check_model(str(TINY / "reward"), "--reward_model_path", lengths, False, reward=True)
    check_model(str(TINY / "sft"), "--sft_model_path", lengths, False)  # a policy need not be a classifier
    for flag in ("--reward_model_path", "--gold_judge"):
        with pytest.raises(UsageError, match=f"^{re.escape(not_a_reward_model(flag, TINY / 'sft'))}$"):
            check_model(str(TINY / "sft"), flag, lengths, False, reward=True)
    unnamed = tmp_path / "unnamed"
    shutil.copytree(TINY / "sft", unnamed)
    config = json.loads((unnamed / "config.json").read_text())
    (unnamed / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "architectures"}))
    check_model(str(unnamed), "--reward_model_path", lengths, False, reward=True)


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
        [sys.executable, name, flag, "benchmark/tiny_task/sft", "--output_dir", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [f"error: {not_a_reward_model(flag, 'benchmark/tiny_task/sft')}"]
    assert not (tmp_path / "run" / "args.json").exists() and not (tmp_path / "run").exists()
