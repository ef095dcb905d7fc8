"""Every command the README and the docs/ pages show in a marked block is run (with smaller sizes) or, for
GPU commands, parsed; the flag list in docs/flags.md and `--help` name every field of Args; the README stays
short and every relative link of the README and docs/ resolves."""

import dataclasses
import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    ROOT,
    SMALL_RUN,
    accelerate_launch,
    check_run,
    run_script,
    shared_run,
    shared_stderr,
    stderr_noise,
)

import online_dpo_async as dpo
import plumbing
from plumbing.flags import COMMON_DOMAINS, RunArgs, _parse_args, flag_sections

# A private plumbing name (leading underscore) on purpose: the grouped --help (_parse_args), with the flag sections
# and the plumbing's own flag domains, is what the docs must show, so the docs are checked against them.

README = (ROOT / "README.md").read_text()
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DOCS = {path: path.read_text() for path in DOC_FILES}


def block(marker: str) -> list[str]:
    """Command lines of the fenced block right after `<!-- marker -->`, comments stripped. The marker is looked
    for in README.md and every docs/*.md: it must be there exactly once, right above its block, wherever the
    block has moved (the tests that run the README's commands run the docs' commands too)."""
    count = sum(text.count(f"<!-- {marker} -->") for text in DOCS.values())
    matches = [m for text in DOCS.values() for m in re.finditer(rf"<!-- {marker} -->\n```bash\n(.*?)```", text, re.S)]
    assert count == 1 and len(matches) == 1, (
        f"<!-- {marker} --> must mark one bash block in README.md or docs/*.md: {count} markers, {len(matches)} blocks"
    )
    return [line.split("  #")[0].strip() for line in matches[0].group(1).strip().splitlines()]


def to_argv(command: str) -> tuple[dict, list[str]]:
    """A README command as this test environment runs it: its env assignments and its argv."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    if words[0].endswith("python"):
        words[0] = sys.executable
    elif words[0].endswith("accelerate") and words[1] == "launch":
        words[:2] = accelerate_launch()  # with a port of its own
    return env, words


@pytest.mark.slow
def test_quickstart_run_command_learns(tmp_path):
    """The README's first command, unchanged but for the output folder: the default tiny run."""
    command = block("run-command")[0].split("&&")[-1].strip()
    env, argv = to_argv(command)
    assert argv[1:] == ["online_dpo_async.py"]
    start = time.perf_counter()
    proc = run_script(argv + ["--output_dir", str(tmp_path)], timeout=900, env=env, all_cores=True)
    print(f"default run took {time.perf_counter() - start:.0f} s")
    assert stderr_noise(proc.stderr) == []  # the progress bar alone: the known third-party messages are silenced
    args, train, evals = check_run(tmp_path, "online_dpo_async.py")
    print(
        "win rate",
        [round(e["eval/win_rate"], 3) for e in evals],
        "ref perplexity",
        [round(e["eval/ref_perplexity"], 3) for e in evals],
    )
    assert evals[-1]["eval/win_rate"] >= evals[0]["eval/win_rate"] + 0.10
    assert evals[-1]["eval/gold_score"] > evals[0]["eval/gold_score"]
    for key in (
        "episode",
        "lr",
        "objective/scores",
        "objective/kl",
        "objective/entropy",
        "objective/rlhf_reward",
        "val/num_eos_tokens",
        "loss/policy",
        "time/generation",
        "time/training",
        "time/weight_sync",
        "time/wait_for_rollouts",
        "time/step",
        "throughput/episodes_per_second",
        "throughput/tokens_per_second",
    ):
        assert key in train[-1], key
    assert train[-1]["episode"] == dpo.Args.total_episodes
    assert any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "policy" / "model.safetensors").exists()


def test_known_third_party_noise_is_silenced_unless_async_rlhf_verbose():
    """The messages every run printed (docs/flags.md), each raised here as its source raises it: importing plumbing
    changes nothing (nothing runs at import); plumbing.flags.quiet_known_noise, which plumbing.run calls,
    silences them and the progress bars of model loading and of datasets; with ASYNC_RLHF_VERBOSE=1 it leaves them."""
    code = """
import logging, warnings
import datasets, transformers
import plumbing
{quiet}
warnings.warn("`torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead", FutureWarning)
logging.getLogger("torch._library.triton").warning("Triton not available, find_triton_kernels = []")
from deepspeed.accelerator import get_accelerator
get_accelerator()
print(transformers.utils.logging.is_progress_bar_enabled(), datasets.is_progress_bar_enabled())
"""
    noise = ["torch.distributed.reduce_op", "Triton not available", "Setting accelerator to CPU"]
    quiet = "plumbing.flags.quiet_known_noise()"
    for called, verbose, shown in [("", "", True), (quiet, "", False), (quiet, "1", True)]:
        env = {**os.environ, "ASYNC_RLHF_VERBOSE": verbose}
        proc = subprocess.run(
            [sys.executable, "-c", code.format(quiet=called)], cwd=ROOT, capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1].split() == [str(shown)] * 2, (called, verbose)
        output = proc.stdout + proc.stderr  # DeepSpeed logs to stdout
        assert [message in output for message in noise] == [shown] * 3, (called, verbose, output)


# The fast tier (docs/tests.md) runs one example of each file; the others are slow.
FAST_EXAMPLES = {".venv/bin/python online_dpo_async.py --async_level 0", ".venv/bin/python rloo_async.py"}
FAST_EXAMPLES |= {".venv/bin/python ppo_async.py"}
# The examples whose runs the run tests of rloo_async.py and ppo_async.py read: the same xdist worker runs both.
SHARED_EXAMPLES = {
    ".venv/bin/python rloo_async.py": "rloo_small",
    ".venv/bin/python rloo_async.py --old_logprobs engine --async_level 2": "rloo_engine",
    ".venv/bin/python ppo_async.py": "ppo_small",
    ".venv/bin/python ppo_async.py --adaptive_kl --kl_target 1.0": "ppo_adaptive",
    ".venv/bin/python ppo_async.py --old_logprobs engine --async_level 2": "ppo_engine",
}


# The LoRA examples, which the LoRA tests run, longer, and check as this test does besides their learning
# (test_lora.test_each_file_learns_with_lora).
RUN_BY_THE_LORA_TESTS = {
    ".venv/bin/python online_dpo_async.py --lora_rank 8 --learning_rate 1e-3",
    ".venv/bin/python ppo_async.py --lora_rank 8 --lora_value_model --learning_rate 1e-3",
}


def example_marks(command: str) -> list:
    marks = [] if command in FAST_EXAMPLES else [pytest.mark.slow]
    return marks + ([pytest.mark.xdist_group(SHARED_EXAMPLES[command])] if command in SHARED_EXAMPLES else [])


def test_the_lora_examples_are_the_commands_the_lora_tests_run():
    """The CPU examples left to the LoRA tests are among the docs' examples (the README's LoRA command too), and
    each is its file's command there, word for word."""
    from test_lora import LORA_COMMANDS

    assert RUN_BY_THE_LORA_TESTS <= set(block("cpu-examples"))
    readme_lora = ".venv/bin/python online_dpo_async.py --lora_rank 8 --learning_rate 1e-3"
    assert readme_lora in RUN_BY_THE_LORA_TESTS and f"\n{readme_lora}\n" in README
    for command in RUN_BY_THE_LORA_TESTS:
        script = next(word for word in command.split() if word.endswith("_async.py"))
        assert command.split() == LORA_COMMANDS[script], command


@pytest.mark.parametrize(
    "command",
    [pytest.param(c, marks=example_marks(c)) for c in block("cpu-examples") if c not in RUN_BY_THE_LORA_TESTS],
)
def test_cpu_example_commands_run(command, tmp_path):
    """Each CPU example with SMALL_RUN's sizes (the run tests of rloo_async.py and ppo_async.py share the runs of their
    plain examples; the LoRA tests run the LoRA examples).
    The two-process one runs as shown, without --output_dir (from an empty folder): both processes must write
    to the one runs/<run name> folder, which a checkpoint shows (each process writes its RNG states there)."""
    env, argv = to_argv(command)
    script = next(word for word in argv if word.endswith("_async.py"))
    if "cpu_2proc" not in command:
        run = shared_run(argv + SMALL_RUN, env)
        check_run(run, script)
        assert stderr_noise(shared_stderr(run)) == []
        return
    argv = [str(ROOT / word) if (ROOT / word).is_file() else word for word in argv]
    run_script(argv + SMALL_RUN + ["--save_freq", "4"], env=env, cwd=tmp_path)
    (run,) = (tmp_path / "runs").iterdir()
    args, _, _ = check_run(run, script)
    assert args["world_size"] == 2 and args["batch_size"] == 16
    assert sorted(p.name for p in (run / "checkpoints" / "step_000004").glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]


def test_every_training_process_gets_rank_0s_run_name(tmp_path):
    """The default --output_dir is runs/<run name>, and the name holds the time: each process must take rank 0's,
    even when its clock is already in the next second (here rank 1's is made one second ahead). Args().exp_name is
    None: plumbing.run names the run after its file, as here."""
    probe = tmp_path / "probe.py"
    probe.write_text(f"""import importlib, os, sys, time, types
sys.path.insert(0, {str(ROOT)!r})
from accelerate import Accelerator
import plumbing
accelerator = Accelerator()
if accelerator.process_index == 1:
    plumbing.run_folder.time = types.SimpleNamespace(time=lambda: time.time() + 1)
for name in ("online_dpo_async", "rloo_async", "ppo_async"):
    args = importlib.import_module(name).Args()
    assert args.exp_name is None
    line = f"{{name}} rank {{accelerator.process_index}}: {{plumbing.run_folder._name_run(name, args.seed)}}\\n"
    os.write(1, line.encode())  # one write a line: the two processes share the pipe
plumbing.flags._leave_process_group()  # as a run ends
""")
    proc = run_script(
        accelerate_launch("--config_file", "configs/cpu_2proc.yaml", str(probe)),
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    names = {}
    for script, _, name in re.findall(r"([a-z_]+) rank (\d): ([a-z_]+__1__\d{10})\n", proc.stdout):
        names.setdefault(script, set()).add(name)
    assert sorted(names) == ["online_dpo_async", "ppo_async", "rloo_async"] and all(
        len(n) == 1 for n in names.values()
    ), proc.stdout


def test_the_readme_s_gpu_command_runs_dry():
    """The README's one GPU command is a benchmark script's experiment: printed with DRY_RUN=1 (the tiny mode runs it,
    tests/test_benchmark_scripts.py), it is accelerate launches of online DPO at async levels 0 and 1."""
    block = re.search(r"## GPUs\n\n```bash\n(.*?)```", README, re.S).group(1).splitlines()
    assert block[0] == "pip install -r requirements.txt"
    command = shlex.split(block[1].split("  #")[0])
    proc = subprocess.run(command, cwd=ROOT, env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    runs = proc.stdout.splitlines()
    assert runs and all(r.startswith("accelerate launch") and " online_dpo_async.py " in r for r in runs)
    assert {r.split("--async_level ")[1].split()[0] for r in runs} == {"0", "1"}


def test_gpu_commands_parse():
    """No GPU here: check that the configs load and the script's flags parse as written (docs/gpus.md's launch
    block)."""
    import tyro
    from accelerate.commands.config.config_args import load_config_from_file

    gpus = DOCS[ROOT / "docs" / "gpus.md"]
    match = re.search(r"## Launching\n\n```bash\n(.*?)```", gpus, re.S)
    lines = match.group(1).splitlines()
    one_gpu = shlex.split(lines[1].split("  #")[0].replace(" ...", ""))
    assert (
        one_gpu[:2] == ["python", "online_dpo_async.py"]
        and tyro.cli(dpo.Args, args=one_gpu[2:]).vllm_placement == "auto"
    )
    # auto: one GPU is shared with the one training process; 8 GPUs give 7 training processes and the engine its own
    assert plumbing.placement.engine_placement("auto", ["0"], 1, None).shared
    assert not plumbing.placement.engine_placement("auto", [str(i) for i in range(8)], 7, None).shared
    commands = [line for line in lines if line.startswith("accelerate launch")]
    assert len(commands) == 3
    for command in commands:
        words = shlex.split(command.replace(" ...", ""))
        config = load_config_from_file(words[words.index("--config_file") + 1])
        assert config.distributed_type in ("MULTI_GPU", "DEEPSPEED")
        flags = words[words.index("online_dpo_async.py") + 1 :]
        assert tyro.cli(dpo.Args, args=flags).async_level == 1


HELP: dict[str, str] = {}


def help_text(script: str) -> str:
    """What `python <script> --help` prints, run once per script and session."""
    if script not in HELP:
        HELP[script] = run_script([sys.executable, script, "--help"], timeout=120).stdout
    return HELP[script]


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*_async.py")))
def test_every_flag_is_documented_in_help_and_readme(script):
    module = importlib.import_module(script.removesuffix(".py"))
    help_output = help_text(script)
    flags = (ROOT / "docs" / "flags.md").read_text()
    for field in dataclasses.fields(module.Args):
        assert re.search(rf"--{field.name}(?!\w)", help_output), f"{script} --help misses --{field.name}"
        assert f"| `--{field.name}`" in flags, f"docs/flags.md flag list misses --{field.name} of {script}"


def readme_layout() -> dict[str, str]:
    """The README's Layout block: each listed path (a folder's files indented under it) -> what it says of it."""
    block = README.split("## Layout")[1].split("```\n")[1]
    listed, folder = {}, ""
    for line in block.splitlines():
        name, _, said = line.partition("#")
        indented, name = name.startswith("  "), name.strip()
        if not indented:
            folder = name if name.endswith("/") else ""
        listed[folder + name if indented else name] = said.strip()
    return listed


def test_the_readme_layout_names_every_folder_and_module_and_what_each_is_for():
    """Every top-level folder and file the repository tracks but the project's own dotfiles, and every plumbing
    module, is in the README's Layout with a word on what it is for; every path it lists exists."""
    listed = readme_layout()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    top = {path.split("/")[0] + ("/" if "/" in path else "") for path in tracked if not path.startswith(".")}
    top |= {path.split("/")[0] + "/" for path in listed if "/" in path}  # folders not yet committed
    said_together = " ".join(f"{name} {said}" for name, said in listed.items())
    missing = sorted(name for name in top if name not in said_together)
    assert not missing, f"the README's Layout does not say what these are for: {missing}"
    modules = sorted(p.name for p in (ROOT / "plumbing").glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if f"plumbing/{m}" not in listed] == []
    assert all(said for said in listed.values()), [name for name, said in listed.items() if not said]
    assert [name for name in listed if not (ROOT / name.rstrip("/")).exists()] == []


def test_every_test_the_promises_table_names_exists_and_every_test_file_is_in_it():
    """docs/tests.md's table of promises names tests that exist, each in the file its row names, and names every test
    file of tests/."""
    table = DOCS[ROOT / "docs" / "tests.md"].split("<!-- promises -->\n")[1].split("<!-- end of promises -->")[0]
    named_files = set()
    for row in table.splitlines()[2:]:
        tests = row.split(" | ")[-1]
        for part in re.split(r"; ", tests):
            files = re.findall(r"`(test_\w+\.py)`", part)
            names = [n for n in re.findall(r"`(test_\w+)`", part) if not n.endswith(".py")]
            assert files, f"a row of docs/tests.md's promises names no test file: {row[:80]}"
            named_files |= set(files)
            for name in names:
                holders = [
                    f for f in files if re.search(rf"^(async )?def {name}\(", (ROOT / "tests" / f).read_text(), re.M)
                ]
                assert holders, f"docs/tests.md names {name} in {files}, which define no such test"
    assert named_files == {p.name for p in (ROOT / "tests").glob("test_*.py")}


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, -1, -2, ... for repeats."""
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", strip_code_blocks(text), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def strip_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def test_every_relative_link_resolves():
    """Links and images of README.md and docs/*.md that are not URLs point at files that exist, and an
    #anchor at a heading of the page it names."""
    assert len(DOC_FILES) > 1, "docs/ holds no page"
    broken = []
    for path, text in DOCS.items():
        for target in re.findall(r"\]\(([^()\s]+)\)", strip_code_blocks(text)):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked.read_text()):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def docs_commands() -> list[str]:
    """Every command line of the docs/ pages' bash blocks (continuation lines joined), comments stripped."""
    commands = []
    for path in sorted((ROOT / "docs").glob("*.md")):
        for body in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
            for line in body.replace("\\\n", " ").strip().splitlines():
                commands.append(line.split("  #")[0].strip())
    return commands


@pytest.mark.parametrize("command", docs_commands())
def test_docs_commands_run_dry_or_name_flags_their_script_has(command, tmp_path):
    """A docs page's command that cannot run here whole: a benchmark shell script runs with DRY_RUN=1 (it prints its
    GPU commands, which tests/test_benchmark_scripts.py checks further), a Python one with --dry_run where it has
    one; the memory plan runs as shown (it loads no model), a pipe through bash; any other names a script that
    exists and flags its --help lists."""
    if command.startswith("pip install"):
        assert all((ROOT / word).is_file() for word in command.split() if word.endswith(".txt"))
        return
    if " -m pytest " in command:  # docs/tests.md's: this is what runs them; the marker they select is registered
        markers = re.findall(r'-m "not (\w+)"', command)
        assert all(f'"{marker}: ' in (ROOT / "pyproject.toml").read_text() for marker in markers), markers
        assert (ROOT / command.split()[-1]).is_dir()
        return
    if "|" in command or "benchmark/memory.py" in command:
        path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"  # `python` is this interpreter
        run_script(["bash", "-c", command.replace("python ", f"{sys.executable} ")], env={"PATH": path}, timeout=300)
        return
    env, argv = to_argv(command)
    if argv[0] == "bash":
        run_script(argv, env={**env, "DRY_RUN": "1"}, timeout=120)
        return
    script = next(word for word in argv if word.endswith(".py"))
    assert (ROOT / script).is_file(), script
    if "--dry_run" in argv:
        argv = [str(tmp_path / "out") if previous == "--out_dir" else word for previous, word in zip(["", *argv], argv)]
        run_script(argv, env=env, timeout=300)
        return
    ours = argv[argv.index(script) + 1 :]
    ours = ours[: ours.index("--")] if "--" in ours else ours  # after "--": the training script's flags
    flags = [word.split("=")[0] for word in ours if word.startswith("--")]
    for flag in flags:
        assert flag in help_text(script), f"{script} --help does not list {flag}"


def test_the_flag_list_in_the_docs_is_the_code_s():
    """docs/flags.md's list of the flags is what dev/flags_doc.py writes from each file's Args and domains: a flag
    added, its comment or default changed, or a domain changed, without rewriting the page fails here."""
    proc = run_script([sys.executable, "dev/flags_doc.py", "--check"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_flag_list_has_each_flag_s_values_default_domain_and_text():
    """The generated rows, read back: a flag in every file is one row; one whose text differs per file, a row
    each naming its file; a domain with its reason; a default path relative to the repository."""
    from dev.flags_doc import flag_list

    text = flag_list()
    assert "| `--seed` | int | `1` | >= 0: numpy's generators take no negative seed | seed of the prompt order" in text
    assert (
        "| `--beta` | float | `0.1` | > 0: 0 learns nothing, \\< 0 learns to prefer the rejected completion |" in text
    )
    assert text.count("| `--total_episodes` (`") == 3 and "| `--dataset_name` | str | `tasks/tiny/data` |" in text
    assert "| `--vllm_dtype` | `auto` \\| `float32` \\| `bfloat16` | `auto` |  |" in text
    assert "| `--num_eval_prompts` | int or None | `None` | >= 1:" in text
    assert "| `--rloo_k` (`rloo_async.py`) | int | `2` |" in text
    headings = re.findall(r"^### (.+)$", text, re.M)
    assert headings == [
        "run",
        "the engine",
        "trainer numerics and memory",
        "LoRA",
        "weight updates in flight",
        "checkpoints",
        "data and models",
        "batch sizes",
        "optimisation",
        "generation",
        "online DPO (`online_dpo_async.py`)",
        "RLOO (`rloo_async.py`)",
        "PPO (`ppo_async.py`)",
        "evaluation",
    ]


SCRIPTS = {name: importlib.import_module(name) for name in ("online_dpo_async", "rloo_async", "ppo_async")}
ALGORITHM_SECTIONS = {"online_dpo_async": "online DPO", "rloo_async": "RLOO", "ppo_async": "PPO"}
# RunArgs' sections (plumbing/flags.py), first in every file; then each file's own
RUN_SECTIONS = ["run", "the engine", "trainer numerics and memory", "LoRA", "weight updates in flight", "checkpoints"]
# shared flags whose text says what differs between the algorithms: completions per prompt, the value model
SAID_PER_FILE = {"total_episodes", "local_rollout_forward_batch_size", "learning_rate", "reward_model_path"}


@dataclasses.dataclass
class Example:
    # first
    a: int = 1  # a's help

    # second (with a note)
    # b's help, on
    # two lines
    b: str | None = None
    c: bool = False  # c's


def test_flag_sections_read_the_titles_and_helps_of_the_class_body():
    assert flag_sections(Example) == [
        ("first", [("a", "a's help")]),
        ("second (with a note)", [("b", "b's help, on two lines"), ("c", "c's")]),
    ]
    assert _parse_args(Example, "Doc.\n\nMore.", ["--b", "x", "--c"]) == Example(1, "x", True)


@dataclasses.dataclass
class Extended(Example):
    # third
    d: float = 0.5  # d's


def test_flag_sections_put_the_base_classes_sections_first():
    """As RunArgs' sections come before each file's Args' own."""
    assert [title for title, _ in flag_sections(Extended)] == [
        "first",
        "second (with a note)",
        "third",
    ]
    assert _parse_args(Extended, "Doc.", ["--d", "2", "--a", "3"]) == Extended(a=3, d=2.0)


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_grouped_command_line_reads_flags_as_tyro_reads_the_flat_args(name):
    import tyro

    module = SCRIPTS[name]
    for flags in [[], ["--seed", "3", "--track", "--output_dir", "x", "--num_eval_prompts", "8"], ["--resume"]]:
        expected = tyro.cli(module.Args, args=flags, use_underscores=True)
        assert _parse_args(module.Args, module.__doc__, flags) == expected


def test_help_is_grouped_the_same_way_in_the_three_files_and_says_what_every_flag_means():
    """--help's groups are RunArgs' sections, then Args' own, in the same order in the three files (the algorithm's
    own section is named after it); a flag the files share has the same section and text (except SAID_PER_FILE);
    every flag has a text, an optional one says what None means, and one whose domain starts at 0 says what 0
    means."""
    run_sections = [title for title, _ in flag_sections(RunArgs)]
    assert run_sections == RUN_SECTIONS
    sections = {name: flag_sections(module.Args) for name, module in SCRIPTS.items()}
    titles = {name: [title for title, _ in s] for name, s in sections.items()}
    for name, names in titles.items():
        batch_sizes = len(RUN_SECTIONS) + 1  # the section's title says what an episode is, per file
        assert names[:batch_sizes] + names[batch_sizes + 1 :] == RUN_SECTIONS + [
            "data and models (local folders or files, or hub ids)",
            "optimisation",
            "generation",
            ALGORITHM_SECTIONS[name],
            "evaluation",
        ]
        assert names[batch_sizes].startswith("batch sizes (in prompts; each gets "), names[batch_sizes]
    where = {}  # flag -> {(section index, help)}
    for name, module in SCRIPTS.items():
        domains = COMMON_DOMAINS | module.SHARED_DOMAINS | module.ALGORITHM_DOMAINS
        for index, (title, flags) in enumerate(sections[name]):
            for flag, text in flags:
                assert text, f"{name} --{flag} has no help"
                default = {f.name: f.default for f in dataclasses.fields(module.Args)}[flag]
                if default is None:
                    assert "(None: " in text, f"{name} --{flag}: what does None mean?"
                if domains.get(flag, ("",))[0] == ">= 0" and flag != "seed":
                    assert "0: " in text, f"{name} --{flag}: what does 0 mean?"
                if title != ALGORITHM_SECTIONS[name]:
                    where.setdefault(flag, set()).add((index, None if flag in SAID_PER_FILE else text))
    assert {flag: w for flag, w in where.items() if len(w) > 1} == {}
    for name in SCRIPTS:
        total_episodes = dict(sections[name][len(RUN_SECTIONS) + 1][1])["total_episodes"]
        assert "a multiple of the completions per step" in total_episodes, total_episodes


@pytest.mark.parametrize("script", sorted(p.name for p in ROOT.glob("*_async.py")))
def test_help_shows_each_section_as_a_box_of_its_flags(script):
    boxes = re.findall(r"╭─ ([^\n]+?) options ─+╮\n(.*?)╰", help_text(script), re.S)
    shown = [(title, re.findall(r"^│ --(\w+)", body, re.M)) for title, body in boxes if title != "options"]
    module = SCRIPTS[script.removesuffix(".py")]
    sections = flag_sections(module.Args)
    assert shown == [(title, [flag for flag, _ in flags]) for title, flags in sections]
    assert "{None}|INT (STR, FLOAT) is optional" in help_text(script)


# Paths of other projects that the docs and comments cite (they name no file here): PRIME-RL's page on its
# asynchronous objective, the paper's code's TRL configs; and the tiny task's folder before it moved, which the
# committed miniature runs recorded (benchmark/miniature.py reads it as tasks/tiny/).
OTHER_PATHS = {
    "docs/async.md",
    "configs/onlinedpo_pythia410m_tldr_4gpu.yml",
    "configs/onlinedpo_pythia410m_tldr_vllm_4gpu.yml",
    "configs/rloo_pythia410m_tldr.yml",
    "configs/ppo_pythia410m_tldr.yml",
    "configs/onlinedpo_rho1b_gsm8k_4a100s_async.yml",
    "benchmark/tiny_task/",
}
REPO_PATH = re.compile(r"(?<![\w/.-])((?:benchmark|tasks|plumbing|tests|docs|configs)/[\w./-]*+)(?![<{*])")


def missing_repo_paths(text: str) -> list[str]:
    """The paths into this repository's folders that a text names and that do not exist (a placeholder such as
    `runs/<run>/` or a glob is not a path)."""
    named = [match.group(1).rstrip(".-") for match in REPO_PATH.finditer(text)]
    return [path for path in named if path not in OTHER_PATHS and not (ROOT / path).exists()]


def test_every_path_the_docs_scripts_and_comments_name_exists():
    """A moved or renamed file leaves no stale path behind: in the README, docs/, the tasks' READMEs, the code
    (--help is its Args' comments), the benchmark scripts, the tests and the configs."""
    texts = [ROOT / "README.md", ROOT / ".ci" / "run", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md"))]
    for pattern in ("*.py", "*/*.py", "*/*/*.py", "*/*.sh", "*/*.md", "*/*/*.md", "*/ruff.toml", "configs/*"):
        texts += [path for path in sorted(ROOT.glob(pattern)) if not {".venv", ".vllm_gpu"} & set(path.parts)]
    texts.remove(Path(__file__))  # this file names a missing path on purpose, below
    stale = [
        f"{path.relative_to(ROOT)}: {missing}" for path in texts for missing in missing_repo_paths(path.read_text())
    ]
    assert not stale, "paths that name no file:\n" + "\n".join(stale)
    assert missing_repo_paths("see benchmark/train_sft.py and tasks/tiny/sft") == ["benchmark/train_sft.py"]


def test_the_picture_of_the_layout_is_what_the_code_imports():
    """docs/import_graph.svg, which the README's Layout shows, is what dev/import_graph.py draws from the code
    now; and the layout's rules hold: the plumbing and the tasks import nothing of the other folders, the algorithm
    files only the plumbing."""
    from dev import import_graph

    imports, runs = import_graph.dependencies()
    assert "(docs/import_graph.svg)" in README
    assert (ROOT / "docs" / "import_graph.svg").read_text() == import_graph.draw(imports, runs), (
        "run python dev/import_graph.py"
    )
    assert {target for source, target in imports if source == import_graph.METHOD} == {"plumbing/"}
    assert not {target for source, target in imports if source in ("plumbing/", "tasks/")}
    assert len(imports[(import_graph.METHOD, "plumbing/")]) == 3
