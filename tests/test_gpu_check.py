"""benchmark/gpu_check.sh without a GPU. Its dry run names every stage and runs nothing, and each command it prints
parses as its program reads it, with flags that exist and files that exist, at the shapes the check promises. Its real
mode, with a stand-in for $PYTHON (this file run as a program: it writes at once what each stage's program would),
runs the dry run's commands in order, goes on past a failing stage, reads each stage's numbers into the summary and
deletes the weights it does not keep."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["gpus", "packages", "test_gpu", "default_dpo", "default_rloo", "default_ppo", "separate_dpo"]
STAGES += ["speed_dpo", "speed_rloo", "speed_ppo", "vs_trl_tiny", "vs_trl_1b"]
CONDITIONAL = {
    "test_gpu": "pytest is not installed",
    "separate_dpo": "fewer than two GPUs are visible",
    "vs_trl_tiny": "TRL is not installed",
    "vs_trl_1b": "TRL is not installed",
}
ALGORITHMS = {"online_dpo_async.py", "rloo_async.py", "ppo_async.py"}


def gpu_check(out: Path, *flags: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmark/gpu_check.sh", *flags, str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": "python3", "DRY_RUN": "0", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dry_run(out: Path, *flags: str, env: dict | None = None) -> list[tuple[str, int, str, list[str]]]:
    """(stage, time limit, condition, argv) of each stage the dry run prints."""
    proc = gpu_check(out, *flags, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("# gpu_check.sh --dry_run") and "in all, 1500 s" in lines[0], lines[0]
    stages = []
    for header, command in zip(lines[1::2], lines[2::2]):
        match = re.fullmatch(r"# (\w+): at most (\d+) s(?:; skipped where (.+))?", header)
        assert match and not command.startswith("#"), (header, command)
        stages.append((match.group(1), int(match.group(2)), match.group(3), shlex.split(command)))
    return stages


def test_dry_run_prints_every_stage_and_runs_nothing(tmp_path):
    """`--dry_run`, and DRY_RUN=1 (how tests/test_docs.py runs a docs page's shell commands), print the same stages,
    their conditions shown; no output folder is made. A stage's limit leaves the whole within 25 minutes only with the
    total's deadline, which the real mode keeps (tested below)."""
    out = tmp_path / "out"
    stages = dry_run(out, "--dry_run")
    assert [name for name, *_ in stages] == STAGES
    assert {name: condition for name, _, condition, _ in stages if condition} == CONDITIONAL
    assert all(0 < limit <= 600 for _, limit, _, _ in stages)
    assert dry_run(out, env={"DRY_RUN": "1"}) == stages
    assert not out.exists()
    relative = dry_run(Path("gpu_check_out"), "--dry_run")  # a relative OUT_DIR: from where the script was started
    assert relative[3][3][-1] == str(ROOT / "gpu_check_out" / "default_dpo")
    for bad in ([], ["a", "b"], ["--dry"]):
        proc = subprocess.run(["bash", "benchmark/gpu_check.sh", *bad], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 2 and "usage:" in proc.stderr


def check_files(words: list[str], out: Path) -> None:
    """Every word naming a file of the repository (a script, a config, a model folder) names one that exists; outputs
    go to OUT_DIR; a word of several (speed.py's --launch) is checked word by word."""
    for word in words:
        if word.startswith(str(out)) or word.startswith("-") or " " in word or "/" not in word and "." not in word:
            continue
        if re.fullmatch(r"[\w./-]+\.(py|yaml|sh)", word) or "/" in word:
            assert (ROOT / word).exists(), f"{word}: no such file or folder in the repository"


def parse_algorithm(script: str, flags: list[str], world_size: int = 1):
    """The flags as the script reads them (plumbing.command_line.parse_args: an unknown flag or a bad value stops it)
    and its sizes (compute_sizes: every domain, and the episodes must divide into steps)."""
    import importlib

    from plumbing.command_line import parse_args

    module = importlib.import_module(script.removesuffix(".py"))
    args = parse_args(module.Args, module.__doc__, flags)
    return args, module.compute_sizes(args, world_size)


def test_every_command_parses_as_its_program_reads_it_and_names_files_that_exist(tmp_path):
    """Each stage's command: its files exist; an algorithm file's flags parse and its sizes check; speed.py's and
    vs_trl.py's own flags parse, and so does every command they would start, at the shapes the check promises
    (Pythia-1b, 512 + 53 tokens, 128 completions a step, enough steps for the timing); the accelerate config of
    --launch loads; pytest's -k names tests of the file it runs. Each run writes where the summary reads it."""
    from accelerate.commands.config.config_args import load_config_from_file

    sys.path.insert(0, str(ROOT / "benchmark"))
    import speed
    import trl_driver
    import vs_trl

    out = tmp_path.resolve() / "out"  # the script resolves OUT_DIR
    for name, _, _, argv in dry_run(out, "--dry_run"):
        check_files(argv, out)
        if argv == ["nvidia-smi"] or argv[1:3] == ["-m", "pip"]:
            continue
        assert argv[0] == "python3", argv  # $PYTHON
        words = argv[1:]
        if words[:2] == ["-m", "pytest"]:
            test_file = (ROOT / next(word for word in words if word.endswith(".py"))).read_text()
            selected = re.findall(r"test_\w+", words[words.index("-k") + 1])
            assert selected and all(f"def {test}(" in test_file for test in selected), selected
            continue
        script, flags = words[0], words[1:]
        if script in ALGORITHMS:
            args, sizes = parse_algorithm(script, flags)
            assert args.output_dir == str(out / name) and args.task == "tiny"
            assert name.startswith("default_") or args.vllm_placement == "separate"
        elif script == "benchmark/speed.py":
            own, extra = speed.parse(flags)
            assert Path(own.out_dir) == out / name and (own.model_size, own.prompt_length) == ("pythia-1b", None)
            launch = shlex.split(own.launch)
            check_files(launch, out)
            assert launch[:3] == ["python3", "-m", "accelerate.commands.launch"] and launch[-2:] == [
                "--num_processes",
                "1",
            ]
            assert load_config_from_file(launch[launch.index("--config_file") + 1]).distributed_type == "MULTI_GPU"
            # what speed.py adds for a Pythia size (TLDR's lengths), then the flags after --, then its own two
            lengths = [
                "--max_prompt_length",
                str(speed.TLDR_LENGTHS[0]),
                "--response_length",
                str(speed.TLDR_LENGTHS[1]),
            ]
            for k in (0, 1):
                run = ["--eval_freq", "0", "--num_eval_prompts", "64", *lengths, *extra, "--async_level", str(k)]
                args, sizes = parse_algorithm(own.script, run + ["--output_dir", str(out / name / "sync")])
                assert (args.max_prompt_length, args.response_length) == (512, 53)
                assert sizes.episodes_per_step == 128 and sizes.num_steps == 8, sizes
                prompts = {"ppo_async.py": 128}.get(own.script, 64)  # 64 prompts x 2 samples; PPO: 128 x 1
                assert sizes.batch_size == prompts and args.local_micro_batch_size == 16
        elif script == "benchmark/vs_trl.py":
            own = vs_trl.parse(flags)
            assert Path(own.out_dir) == out / name and own.model_size in ("tiny", "pythia-1b")
            if own.model_size != "tiny":  # the stage's models/ is the one OUT_DIR/models the script links there
                assert vs_trl.models_folder(own).parent == out / name / "models"
            plan = vs_trl.make_plan(own)
            assert len(plan) == 6
            for run in plan:
                check_files(run.argv[1:], out)
                if run.side == "trl":
                    trl_driver.parse_args(run.argv[2:])
                    continue
                assert run.argv[1:3] == ["benchmark/vs_trl.py", "--run_script"]
                _, sizes = parse_algorithm(run.argv[3], run.argv[4:])
                assert sizes.num_steps >= 8, (run.name, sizes)  # the timing leaves out two steps and the last
        else:
            raise AssertionError(f"stage {name}: no check for {script}")


# ---------------------------------------------------------------------------------------------------------------------
# The real mode, with this file standing in for $PYTHON
def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def write_lines(path: Path, lines: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def weights_file(path: Path) -> None:
    """A 65 MiB file (sparse), as a final policy of the Pythia runs is larger than 64 MiB."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(65 * 2**20)


# the stand-in default runs: the win rate at step 0 and at the end, by file; PPO's run fails
WIN_RATES = {"online_dpo_async.py": (0.4, 0.525), "rloo_async.py": (0.45, 0.5), "ppo_async.py": (0.3, 0.6)}


def default_run_lines(script: str) -> list[dict]:
    first, last = WIN_RATES[script]
    train = [{"step": s, "async/lag": min(s, 1), "time/step": 0.1 * (s + 1)} for s in range(8)]
    return [{"step": 0, "eval/win_rate": first}, *train, {"step": 8, "eval/win_rate": last}]


def timed_lines(async_level: int, step_time: float) -> list[dict]:
    """Training lines with what benchmark/timing.py reads."""
    return [
        {
            "step": s,
            "async/lag": min(s, async_level),
            "timeline/step_start": s * step_time,
            "time/generation": 0.5,
            "time/weight_sync": 0.25,
            "time/training": 1.0,
            "time/wait_for_rollouts": step_time - 1.0,
            "time/step": step_time,
        }
        for s in range(8)
    ]


def stand_in_python(argv: list[str]) -> int:
    """$PYTHON in the real-mode test: notes its argv in $FAKE_CALLS and writes at once what the program would."""
    with open(os.environ["FAKE_CALLS"], "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    if argv[:2] == ["-m", "pip"]:
        print("torch==2.11.0\nvllm==0.26.0\npytest==9.2.0")
    elif argv[:2] == ["-m", "pytest"]:
        print(
            "pytest 9.2.0" if "--version" in argv else "=== 5 passed, 3 skipped, 3 deselected in 301.20s (0:05:01) ==="
        )
    elif argv[0] == "-c":  # the two conditions: two GPUs, TRL
        if "trl" in argv[1]:
            return 0 if os.environ["FAKE_TRL"] == "1" else 1
        print(os.environ["FAKE_GPUS"])
    elif argv[0] in ALGORITHMS:
        out = Path(value(argv, "--output_dir"))
        write_lines(out / "metrics.jsonl", default_run_lines(argv[0]))
        weights_file(out / "policy" / "model.safetensors")
        return 3 if argv[0] == "ppo_async.py" else 0
    elif argv[0] == "benchmark/speed.py":
        sys.path.insert(0, str(ROOT / "benchmark"))
        import timing

        out = Path(value(argv, "--out_dir"))
        weights_file(out / "models" / "pythia-1b-prompt512" / "sft" / "model.safetensors")
        for run, k, step_time in (("sync", 0, 2.0), ("async", 1, 1.25)):
            write_lines(out / run / "metrics.jsonl", timed_lines(k, step_time))
            weights_file(out / run / "policy" / "model.safetensors")
        (out / "speed.md").write_text(timing.report([str(out / r / "metrics.jsonl") for r in ("sync", "async")]) + "\n")
    elif argv[0] == "benchmark/vs_trl.py":
        (Path(value(argv, "--out_dir")) / "vs_trl.md").parent.mkdir(parents=True, exist_ok=True)
    return 0


@pytest.mark.parametrize("gpus, trl", [(1, False), (2, True)])
def test_real_mode_runs_the_dry_runs_commands_and_sums_them_up(gpus, trl, tmp_path):
    """Every stage's command as the dry run printed it, in order, the skipped ones left out; a failing stage (PPO's
    default run) does not stop the later ones, and the check's exit code is then 1; the summary holds each stage's exit
    code and numbers (the win rates, speed.py's table), also in summary.md; the Pythia models are built once in
    OUT_DIR/models and every weights file over 64 MiB is gone at the end."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import timing

    out, calls = tmp_path.resolve() / "out", tmp_path / "calls.jsonl"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} "$@"\n')
    python.chmod(0o755)
    env = {"PYTHON": str(python), "FAKE_CALLS": str(calls), "FAKE_GPUS": str(gpus), "FAKE_TRL": str(int(trl))}
    planned = dry_run(out, "--dry_run", env=env)
    proc = gpu_check(out, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    skipped = {"separate_dpo"} if gpus == 1 else set()
    skipped |= set() if trl else {"vs_trl_tiny", "vs_trl_1b"}
    ran = [json.loads(line) for line in calls.read_text().splitlines()]
    ran = [argv for argv in ran if argv[0] != "-c" and argv != ["-m", "pytest", "--version"]]
    expected = [argv[1:] for name, _, _, argv in planned if name not in skipped and argv[0] == str(python)]
    assert ran == expected

    summary = (out / "summary.md").read_text()
    assert summary.strip() in proc.stdout
    rows = {}
    for line in summary.splitlines():
        if line.startswith("| ") and not line.startswith("| stage "):
            stage, code, seconds, numbers = (cell.strip() for cell in line.strip("|").split("|"))
            rows[stage] = (code, numbers)
    assert list(rows) == STAGES
    assert rows["packages"] == (
        "0",
        "torch 2.11.0; vllm 0.26.0; transformers not installed; accelerate not installed; "
        "deepspeed not installed; trl not installed; pytest 9.2.0",
    )
    assert rows["test_gpu"] == ("0", "5 passed, 3 skipped, 3 deselected in 301.20s (0:05:01)")
    mean = sum(0.1 * (s + 1) for s in range(2, 8)) / 6
    assert rows["default_dpo"] == (
        "0",
        f"win rate 0.400 at step 0, 0.525 at step 8 (+0.125: learns); 8 steps, {mean:.3f} s each from step 2 on",
    )
    assert rows["default_rloo"][1].startswith("win rate 0.450 at step 0, 0.500 at step 8 (+0.050: does NOT rise")
    assert rows["default_ppo"][0] == "3"
    sync, async_ = (timing.summarize(str(out / "speed_dpo" / run / "metrics.jsonl")) for run in ("sync", "async"))
    figures = timing.compare(sync, async_)
    speed = (
        f"step {sync['step']:.4f} s sync, {async_['step']:.4f} s async ({figures['measured speed-up']:.2f}x); "
        f"pipeline efficiency {figures['pipeline efficiency']:.1%}; weight push {figures['push share']:.1%} of the "
        "async step"
    )
    for name in ("speed_dpo", "speed_rloo", "speed_ppo"):
        assert rows[name] == ("0", f"{speed}; {name}/timeline.png")
    for name in skipped:
        assert rows[name][0] == "-" and rows[name][1].startswith("skipped: ")
    assert not (out / "models").exists() and not list(out.glob("*/models"))
    assert [p for p in out.rglob("*") if p.is_file() and p.stat().st_size > 64 * 2**20] == []
    deleted = (out / "deleted_weights.txt").read_text().split()
    assert str(out / "default_dpo" / "policy" / "model.safetensors") in deleted
    assert str(out / "speed_ppo" / "async" / "policy" / "model.safetensors") in deleted
    assert gpu_check(out, env=env).returncode == 2  # OUT_DIR is not empty now


if __name__ == "__main__":
    sys.exit(stand_in_python(sys.argv[1:]))
