"""The mutation checks' lists against the current files (docs/tests.md#mutation-check): every mutant still applies, so
the lists cannot rot silently; the method's (dev/mutation_check.py) and the plumbing's
(dev/mutation_check_plumbing.py). No mutant is run here."""

import ast
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "dev"))  # the checks are the developers' scripts, which import each other by name
import mutation_check as mc  # noqa: E402
import mutation_check_plumbing as mcp  # noqa: E402

SOURCES = {name: (ROOT / name).read_text() for name in mc.FILES}
PLUMBING_SOURCES = {name: (ROOT / name).read_text() for name in mcp.FILES}


def test_every_mutant_applies_once_to_its_function_and_the_result_compiles():
    problems = []
    for mutant in mc.MUTANTS:
        try:
            mutated = mc.mutated_sources(mutant, SOURCES)
        except ValueError as error:  # no such function, the fragment not there exactly once, shared copies differ
            problems.append(str(error))
            continue
        for name, source in mutated.items():  # a top-level function parses on its own
            start = mc.function_spans(SOURCES[name])[mutant.function][0]
            end = len(source) - (len(SOURCES[name]) - mc.function_spans(SOURCES[name])[mutant.function][1])
            ast.parse(source[start:end], filename=f"{name}: {mutant.function} with {mutant.id}")
    assert not problems, "\n".join(problems)


def test_a_shared_mutant_reaches_the_three_copies_and_a_file_s_own_only_its_copies():
    for mutant in mc.MUTANTS:
        files = mc.touched_files(mutant, SOURCES)
        if mutant.file == mc.SHARED:
            assert files == list(mc.FILES), mutant.id
        else:
            assert mutant.file in files and mutant.function not in mc.METHOD_FUNCTIONS[mc.SHARED], mutant.id


def test_the_list_is_well_formed_and_covers_every_method_function():
    ids = [m.id for m in mc.MUTANTS]
    assert len(ids) == len(set(ids))
    for mutant in mc.MUTANTS:
        assert mutant.file in (*mc.FILES, mc.SHARED) and mutant.note, mutant.id
        assert mutant.original != mutant.replacement, mutant.id
        assert mutant.function in mc.METHOD_FUNCTIONS[mutant.file], mutant.id
    covered = {(m.file, m.function) for m in mc.MUTANTS}
    missing = [(f, name) for f, names in mc.METHOD_FUNCTIONS.items() for name in names if (f, name) not in covered]
    assert not missing, missing


def test_every_test_module_of_the_algorithm_files_is_run_or_left_out_with_its_reason():
    run = {*mc.UNIT_TESTS.values(), *mc.SHARED_TESTS}
    for test in [*run, *mc.LEFT_OUT, *(t.split("::")[0] for t in mc.SUBPROCESS_TESTS)]:
        assert (ROOT / test).is_file(), test
    assert not run & set(mc.LEFT_OUT) and "tests/test_shared_code.py" in mc.LEFT_OUT
    importing = {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if any(name.removesuffix(".py") in path.read_text() for name in mc.FILES)
    }
    assert not importing - run - set(mc.LEFT_OUT), "add them to SHARED_TESTS or LEFT_OUT in dev/mutation_check.py"


def test_every_plumbing_mutant_applies_once_to_its_function_and_the_result_compiles():
    problems = []
    for mutant in mcp.MUTANTS:
        assert mutant.file in mcp.FILES and mutant.note and mutant.original != mutant.replacement, mutant.id
        assert mc.touched_files(mutant, PLUMBING_SOURCES) == [mutant.file], mutant.id
        try:
            mutated = mc.mutated_sources(mutant, PLUMBING_SOURCES)
        except ValueError as error:
            problems.append(str(error))
            continue
        ast.parse(mutated[mutant.file], filename=f"{mutant.file} with {mutant.id}")
    assert not problems, "\n".join(problems)
    assert len({m.id for m in mcp.MUTANTS}) == len(mcp.MUTANTS) >= 35
    # every file of the plumbing the issue names, and the two plans, has mutants
    assert {m.file for m in mcp.MUTANTS} == set(mcp.FILES)


def test_the_plumbing_suite_s_tests_exist():
    for test in [*mcp.TESTS, *(t.split("::")[0] for t in mcp.DESELECTED)]:
        assert (ROOT / test).is_file(), test
    for (file, function), tests in mcp.UNRECORDED.items():
        assert function in mc.function_spans(PLUMBING_SOURCES[file]), function
        for test in tests:
            path, name = test.split("::")
            assert f"def {name}(" in (ROOT / path).read_text(), test


@pytest.mark.parametrize("mutant", [m for m in mcp.MUTANTS if m.function == mc.MODULE], ids=lambda m: m.id)
def test_a_module_level_mutant_changes_code_outside_every_function(mutant):
    start = PLUMBING_SOURCES[mutant.file].index(mutant.original)
    assert not any(a <= start < b for a, b in mc.function_spans(PLUMBING_SOURCES[mutant.file]).values()), mutant.id
