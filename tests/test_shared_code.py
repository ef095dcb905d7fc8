"""The three algorithm files share the method's code by copy, so that each reads alone (data, rewards, evaluation, the
schedule, the generation thread, the weight push): every top-level block (function, class, constant) that two or
three of them define must be the same text in each. The blocks that differ on purpose are listed with the reason.
The plumbing is written once, in plumbing.py: no algorithm file defines a name of its. Also: the code is formatted
(ruff format) and passes the lint (ruff check)."""

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
}


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
    assert len(shared) > 50, sorted(shared)  # the data, rewards, evaluation, schedule, generation thread and push code
    for name in DIFFERENT:
        assert sum(name in top_level_blocks(s) for s in sources.values()) >= 2, f"{name} is listed but not shared"


def test_the_plumbing_is_written_once():
    """plumbing.py's names are imported, never defined again, and the files call them through the module."""
    plumbing = set(top_level_blocks((ROOT / "plumbing.py").read_text()))
    for name in FILES:
        source = (ROOT / name).read_text()
        assert not plumbing & set(top_level_blocks(source)), (name, sorted(plumbing & set(top_level_blocks(source))))
        assert "\nimport plumbing\n" in source


def test_the_tiny_task_builder_judges_as_the_files_do():
    """benchmark/tiny_task/build.py keeps its own copy of the tiny task's gold judge (it builds the task without
    importing an algorithm file): the same text as theirs, so the data it labels is judged as the runs judge."""
    builder = top_level_blocks((ROOT / "benchmark" / "tiny_task" / "build.py").read_text())
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
    """ruff, with the settings of pyproject.toml (line length 120), over every Python file of the repository."""
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
