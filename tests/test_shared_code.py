"""The algorithm files' structure. Each reads alone, method first: its Args, its method, main(), then below one banner
the text every algorithm file shares (sizes, tasks, data, models, rewards, evaluation, the schedule, the generation
thread), written from one source by `python dev/copies.py`: running it changes nothing. Above the banner, a block two
files define alike (RLOO's and PPO's engine logprobs and importance weights) is the same text in each, but for the
blocks that differ on purpose, listed with the reason. The plumbing is written once, in plumbing/: no algorithm file
defines a name of its, and each uses few of its names and members. The method starts early in each file, the shared
text grows only by a decision (its recorded size), and the code is formatted (ruff format) and passes the lint."""

import ast
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from dev import copies

FILES = copies.ALGORITHM_FILES
DIFFERENT = {
    "Args": "each algorithm's flags",
    "ALGORITHM_DOMAINS": "the domains of each algorithm's own flags",
    "completions_per_prompt": "DPO's --num_samples, RLOO's --rloo_k, PPO's one",
    "ROLLOUT_LOGPROBS": "whether rollouts carry the engine's logprobs: DPO's loss does not use them",
    "main": "each algorithm's training loop",
    "Targets": "what RLOO and PPO compute from a rollout before their update: different quantities",
    "step_flops": "each algorithm's FLOPs per phase: its passes over its sequences",
}
# The plumbing names an algorithm file may use at most (plumbing/__init__.py lists them): 19, the 16 a run uses,
# help_if_asked, which answers --help before torch loads, and LoRA's adapter and reference (add_adapter, AdapterOff:
# the method changes with them, so load_models shows them, issue 53). And the members of the plumbing's objects (the processes,
# the run folder, the engine, the snapshots) a file may touch at most: a file that reaches for more has taken in
# plumbing, or the plumbing's objects have grown a surface the files must learn.
MOST_PLUMBING_NAMES = 21
MOST_PLUMBING_MEMBERS = 34
PLUMBING_OBJECTS = ("processes", "folder", "engine", "snapshots")
# The method's section starts before this line of each file (CleanRL's files reach their algorithm after about 190).
METHOD_STARTS_BEFORE = 250
# The shared text's lines (below the banner): growth fails this test until the number is raised in the same commit,
# with the reason beside it, so that growing the text every file carries is a decision. 653: the shared skeleton
# below one banner, its tasks a table (issue 50). 656: LoRA's policy and reference in load_models (issue 53).
# 789: in-flight weight updates, their generation thread and its staleness check (issue 54).
SHARED_TEXT_LINES = 789


def top_level_blocks(source: str) -> dict[str, str]:
    """name -> source text (decorators included) of each top-level def, class and assignment, and `__main__`."""
    blocks = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            name = ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            name = "__main__"
        else:
            continue
        first = node.decorator_list[0] if getattr(node, "decorator_list", None) else node
        lines = source.splitlines()[first.lineno - 1 : node.end_lineno]
        blocks[name] = "\n".join(lines)
    return blocks


def drift(sources: dict[str, str]) -> list[str]:
    """Names of the blocks defined in two or more files, not listed in DIFFERENT, whose text differs."""
    blocks = {name: top_level_blocks(source) for name, source in sources.items()}
    names = {name for b in blocks.values() for name in b} - set(DIFFERENT)
    return sorted(n for n in names if len({b[n] for b in blocks.values() if n in b}) > 1)


def test_blocks_two_files_define_are_the_same_text_in_each():
    sources = {name: (ROOT / name).read_text() for name in FILES}
    assert drift(sources) == []
    shared = set.intersection(*(set(top_level_blocks(s)) for s in sources.values())) - set(DIFFERENT)
    assert len(shared) > 40, sorted(shared)  # the data, models, rewards, evaluation, schedule and generation thread
    for name in DIFFERENT:
        assert sum(name in top_level_blocks(s) for s in sources.values()) >= 2, f"{name} is listed but not shared"


def plumbing_blocks() -> set[str]:
    """The top-level names of every module of plumbing/ (watchdog.py's `__main__` block aside: it is a program)."""
    names = set()
    for path in sorted((ROOT / "plumbing").glob("*.py")):
        names |= set(top_level_blocks(path.read_text())) - ({"__main__"} if path.name == "watchdog.py" else set())
    return names


def test_the_plumbing_is_written_once():
    """plumbing/'s names are imported, never defined again, and the files call them through the package."""
    plumbing = plumbing_blocks()
    assert {"run", "RunArgs", "RunFolder", "Processes", "Engine", "PolicySnapshots"} <= plumbing
    for name in FILES:
        source = (ROOT / name).read_text()
        assert not plumbing & set(top_level_blocks(source)), (name, sorted(plumbing & set(top_level_blocks(source))))
        assert "\nimport plumbing\n" in source


def plumbing_names(source: str) -> set[str]:
    """The plumbing names a file's code uses: `plumbing.<name>` and `from plumbing import <name>`, read from the
    syntax tree (comments and docstrings do not count)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "plumbing":
            names.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "plumbing":
            names |= {alias.name for alias in node.names}
    return names


def test_each_file_uses_few_plumbing_names():
    """The plumbing's surface, as an algorithm file sees it: at most MOST_PLUMBING_NAMES distinct names, as many as
    the README says."""
    counts = []
    for name in FILES:
        used = plumbing_names((ROOT / name).read_text())
        print(f"{name}: {len(used)} plumbing names: {', '.join(sorted(used))}")
        assert len(used) <= MOST_PLUMBING_NAMES, (name, sorted(used))
        counts.append(len(used))
    said = re.search(r"which each file uses through (\d+) names", " ".join((ROOT / "README.md").read_text().split()))
    assert said and int(said.group(1)) == max(counts), (said and said.group(0), counts)


def test_plumbing_names_in_comments_and_docstrings_are_not_counted():
    source = '''"""Uses plumbing.Engine."""
import plumbing
from plumbing import UsageError

def f():
    """plumbing.RunFolder, in words."""
    return plumbing.run(f)  # and plumbing.Laps in a comment
'''
    assert plumbing_names(source) == {"UsageError", "run"}


def flags_read(source: str) -> set[str]:
    """The fields a module reads from a run's flags: `args.<name>` and `self.args.<name>`, from the syntax tree."""
    read = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in ("args", "self.args"):
            read.add(node.attr)
    return read


def test_the_plumbing_reads_only_its_own_flags():
    """A fork may rename any flag of its file: plumbing/ reads only the flags it declares (RunArgs); what else it
    needs, the files pass by name."""
    sys.path.insert(0, str(ROOT))
    import dataclasses

    from plumbing import RunArgs

    own = {field.name for field in dataclasses.fields(RunArgs)}
    for path in sorted((ROOT / "plumbing").glob("*.py")):
        assert flags_read(path.read_text()) <= own, (path.name, sorted(flags_read(path.read_text()) - own))
    assert flags_read("def f(args):\n    return args.seed, self.args.response_length, x.args") == {
        "seed",
        "response_length",
    }


def test_the_shared_text_is_written_from_one_source():
    """`python dev/copies.py` would change nothing: every file's text below its banner is the source's."""
    assert copies.differing() == {}


def section_lines(source: str) -> list[tuple[int, str]]:
    """(line number, title) of each section header, a comment line `# == <title> ==...`."""
    return [(n, line.strip("#= ")) for n, line in enumerate(source.splitlines(), 1) if line.startswith("# == ")]


def test_each_file_opens_with_its_method():
    """Docstring, Args and its domains, then the method's section before line METHOD_STARTS_BEFORE, main(), then the
    banner; above the banner only the file's own: no name the shared text defines."""
    for name in FILES:
        source = (ROOT / name).read_text()
        own, shared = copies.split(source, name)
        titles = section_lines(own)
        assert [title.split(":")[0] for _, title in titles][:1] == ["Arguments"], titles
        method_line, method_title = titles[1]
        print(f"{name}: the method ({method_title}) starts at line {method_line}")
        assert method_line < METHOD_STARTS_BEFORE, (name, method_line)
        assert titles[-1][1].startswith("main()"), titles
        own_names = set(top_level_blocks(own)) - {"__main__"}  # its --help, before torch loads
        shared_names = set(top_level_blocks(shared))
        assert {"Args", "ALGORITHM_DOMAINS", "main"} <= own_names
        assert not own_names & shared_names, sorted(own_names & shared_names)


def test_the_shared_text_grows_only_by_a_decision():
    lines = len(copies.shared_text().splitlines())
    print(f"the shared text: {lines} lines (recorded: {SHARED_TEXT_LINES})")
    assert lines <= SHARED_TEXT_LINES, "raise SHARED_TEXT_LINES in this commit, with the reason"


@pytest.mark.parametrize("name", FILES)
def test_help_answers_before_torch_transformers_and_vllm_load(name):
    """`--help` is answered right after the file's Args (plumbing.help_if_asked), before its heavy imports: none of
    torch, transformers, vLLM, datasets or accelerate is imported (`python -X importtime` lists every module a process
    imports). How long it takes is a benchmark's (benchmark/help_time.py), not a test's."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", name, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--total_episodes" in proc.stdout, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "tyro" in imported
    heavy = {"torch", "transformers", "vllm", "datasets", "accelerate", "numpy"}
    assert not {module.split(".")[0] for module in imported} & heavy


def plumbing_members(source: str) -> set[str]:
    """The members of the plumbing's objects a file's code touches: `<object>.<member>` for the names the files give
    them (PLUMBING_OBJECTS), read from the syntax tree."""
    members = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in PLUMBING_OBJECTS:
            members.add(f"{node.value.id}.{node.attr}")
    return members


def test_each_file_touches_few_plumbing_members():
    for name in FILES:
        used = plumbing_members((ROOT / name).read_text())
        print(f"{name}: {len(used)} members of the plumbing's objects: {', '.join(sorted(used))}")
        assert len(used) <= MOST_PLUMBING_MEMBERS, (name, sorted(used))
    assert plumbing_members("engine.push(w)\nfolder.log(m)\nengine.push(v)\nother.x") == {"engine.push", "folder.log"}


def test_the_tiny_task_builder_judges_as_the_files_do():
    """tasks/tiny/build.py keeps its own copy of the tiny task's gold judge (it builds the task without
    importing an algorithm file): the same text as theirs, so the data it labels is judged as the runs judge."""
    builder = top_level_blocks((ROOT / "tasks" / "tiny" / "build.py").read_text())
    assert builder["tiny_gold_score"] == top_level_blocks((ROOT / FILES[0]).read_text())["tiny_gold_score"]


def test_a_one_character_change_in_a_copy_is_caught_and_rewritten(tmp_path):
    """A copy changed by one character differs from the source (`--check` fails, naming it); `dev/copies.py` rewrites
    it, and says so; a same-named block above the banners that differs between two files is drift too."""
    for name in FILES:
        shutil.copy(ROOT / name, tmp_path / name)
    copy = tmp_path / FILES[1]
    copy.write_text(
        copy.read_text().replace("return (mask.cumsum(1) - 1).clamp(min=0)", "return (mask.cumsum(1) - 1).clamp(min=1)")
    )
    assert copies.differing(tmp_path) == {FILES[1]: 2}
    assert copies.rewrite(tmp_path) == {FILES[1]: 2}
    assert copies.differing(tmp_path) == {}
    assert (tmp_path / FILES[1]).read_text() == (ROOT / FILES[1]).read_text()
    sources = {name: (ROOT / name).read_text() for name in FILES}
    changed = sources["ppo_async.py"].replace(
        "torch.exp(old_logps - engine_logps)", "torch.exp(engine_logps - old_logps)"
    )
    assert changed != sources["ppo_async.py"]
    assert drift({**sources, "ppo_async.py": changed}) == ["truncated_is_weights"]


def test_the_copies_command_checks_and_says_what_it_changed():
    proc = subprocess.run([sys.executable, "dev/copies.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith(f"is {FILES[0]}'s"), proc.stdout + proc.stderr


@pytest.mark.parametrize("command", [["format", "--check", "--diff"], ["check"]])
def test_the_code_is_formatted_and_passes_the_lint(command):
    """ruff over every Python file of the repository: the product code (the algorithm files, plumbing/) with
    pyproject.toml's settings, 110 columns with long lines refused (E501); tests/ and benchmark/ with their ruff.toml,
    120 columns without E501."""
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
