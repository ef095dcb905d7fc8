"""The three algorithm files share the method's code by copy, so that each reads alone (data, rewards, evaluation, the
schedule, the generation thread): every top-level block (function, class, constant) that two or three of them define
must be the same text in each. The blocks that differ on purpose are listed with the reason. The plumbing is written
once, in plumbing/: no algorithm file defines a name of its, and each uses few of its names. Also: each file and its
main() stay within a line budget, and the code is formatted (ruff format) and passes the lint (ruff check)."""

import ast
import subprocess
import sys

import pytest
from conftest import ROOT

FILES = ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"]
DIFFERENT = {
    "Args": "each algorithm's flags",
    "ALGORITHM_DOMAINS": "the domains of each algorithm's own flags",
    "completions_per_prompt": "DPO's --num_samples, RLOO's --rloo_k, PPO's one",
    "ROLLOUT_LOGPROBS": "whether rollouts carry the engine's logprobs: DPO's loss does not use them",
    "main": "each algorithm's training loop",
    "Targets": "what RLOO and PPO compute from a rollout before their update: different quantities",
    "step_flops": "each algorithm's FLOPs per phase: its passes over its sequences",
}
# The plumbing names an algorithm file may use at most (plumbing/__init__.py exports them), and the line budgets:
# a file, and its main(), that grow past them have taken in plumbing or lost their reading order.
MOST_PLUMBING_NAMES = 15
# RLOO's 1010: PRIME-RL's objective beside Proximal RLOO (issue 42) and its rows checked (issue 40).
# PPO's 1120: its value model's start path is named once for the run folder's space check and its loader (issue 40).
# All three, +20-30 and main() 130: the domains of the flags the three files share, and what the plumbing needs of
# them passed by name in main() and load_inputs (issue 43: a fork renames a flag without touching plumbing/).
# Then +10 (RLOO +15): packed assignments that said unrelated things at once, one statement a line (issue 43).
LINES = {"online_dpo_async.py": 940, "rloo_async.py": 1075, "ppo_async.py": 1170}
MAIN_LINES = 130


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


def test_shared_blocks_are_the_same_text_in_every_file():
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
    """The plumbing's surface, as an algorithm file sees it: at most MOST_PLUMBING_NAMES distinct names."""
    for name in FILES:
        used = plumbing_names((ROOT / name).read_text())
        print(f"{name}: {len(used)} plumbing names: {', '.join(sorted(used))}")
        assert len(used) <= MOST_PLUMBING_NAMES, (name, sorted(used))


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


def test_each_file_and_its_main_stay_within_their_line_budget():
    for name in FILES:
        source = (ROOT / name).read_text()
        main = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "main")
        lines, main_lines = len(source.splitlines()), main.end_lineno - main.lineno + 1
        print(f"{name}: {lines} lines (at most {LINES[name]}), main() {main_lines} (at most {MAIN_LINES})")
        assert lines <= LINES[name] and main_lines <= MAIN_LINES, (name, lines, main_lines)


def test_the_tiny_task_builder_judges_as_the_files_do():
    """tasks/tiny/build.py keeps its own copy of the tiny task's gold judge (it builds the task without
    importing an algorithm file): the same text as theirs, so the data it labels is judged as the runs judge."""
    builder = top_level_blocks((ROOT / "tasks" / "tiny" / "build.py").read_text())
    assert builder["tiny_gold_score"] == top_level_blocks((ROOT / FILES[0]).read_text())["tiny_gold_score"]


def test_a_one_character_change_in_a_shared_block_is_caught():
    sources = {name: (ROOT / name).read_text() for name in FILES}
    changed = sources["rloo_async.py"].replace(
        "return (mask.cumsum(1) - 1).clamp(min=0)", "return (mask.cumsum(1) - 1).clamp(min=1)"
    )
    assert changed != sources["rloo_async.py"]
    assert drift({**sources, "rloo_async.py": changed}) == ["position_ids_from"]


@pytest.mark.parametrize("command", [["format", "--check", "--diff"], ["check"]])
def test_the_code_is_formatted_and_passes_the_lint(command):
    """ruff over every Python file of the repository: the product code (the algorithm files, plumbing/) with
    pyproject.toml's settings, 110 columns with long lines refused (E501); tests/ and benchmark/ with their ruff.toml,
    120 columns without E501."""
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
