"""benchmark/gpu_check.sh without a GPU. Every part's limits add up to at most its deadline and its dry run prints them;
each command parses as its program reads it, with flags and files that exist, at the shapes the check promises, and
every GPU test is in a part. Part 1 runs with a stand-in for $PYTHON (this file run as a program: it writes at once
what each stage's program would; speed.py and plan.py run for real on what it wrote) and leaves two files, its results
packed without weights. Fake parts (tiny stages from a JSON file, GPU_CHECK_FAKE_PARTS) are cut by their limits and the
deadline, and stopped by a signal: the part still ends with its summary and its archive. --next reads the ledger;
--record unpacks a part's results beside it and adds its row."""

import importlib.metadata
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmark"))
import gpu_check  # noqa: E402
import timing  # noqa: E402

# A private plumbing name (_parse_args) on purpose: the GPU check's parts are planned from the flags as the files
# parse them.

ALGORITHMS = {"online_dpo_async.py", "rloo_async.py", "ppo_async.py"}
STABLE_FILE = "tasks/tiny/README.md"  # committed, and no part of the fake parts' work changes it


def check(*flags: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmark/gpu_check.sh", *flags],
        cwd=ROOT,
        env={**os.environ, "DRY_RUN": "0", **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dry_run(number: int, out: Path, env: dict | None = None) -> tuple[int, list[tuple[int, list[tuple]]]]:
    """(the header's sum of limits, [(step limit, [(stage, limit, cold estimate, estimate, argv words)])]) of a part's
    dry run."""
    proc = check("--part", str(number), "--dry_run", str(out), env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"# part {number}: "), lines[0]
    total = int(
        re.fullmatch(r"# at most 540 s, 30 of them kept for packing; the steps' limits add up to (\d+) s", lines[1])[1]
    )
    steps, i = [], 2
    while i < len(lines) and lines[i].startswith("## step"):
        steps.append((int(re.match(r"## step \d+: at most (\d+) s", lines[i])[1]), []))
        i += 1
        while i < len(lines) and (
            stage := re.fullmatch(r"# (\w+): at most (\d+) s, cold estimate (\d+) s \(estimate (.+)\)", lines[i])
        ):
            steps[-1][1].append((stage[1], int(stage[2]), int(stage[3]), stage[4], lines[i + 1]))
            i += 2
    assert lines[i:] and lines[-1].startswith("# the stages write in a new temporary folder"), lines[i:]
    return total, steps


def test_every_parts_limits_add_up_to_its_deadline_as_its_dry_run_prints_them(tmp_path):
    """Each part: its steps' limits (a step's: its longest stage's, its stages side by side) add up to at most the
    540 s deadline less the 30 s kept for packing; every stage has a limit and an estimate beside it, whose high end,
    its cold estimate on the fresh machine a loan starts, is within the limit; the dry run (also
    DRY_RUN=1, as tests/test_docs.py runs docs' commands) prints them and makes nothing. Part 1 holds what answers the
    first questions: the push on GPTNeoX with CUDA graphs and on eager Llama, the default online DPO run, online DPO's
    Pythia-1b speed and its plan."""
    assert gpu_check.SECONDS == 540 and gpu_check.PACK_SECONDS == 30
    out = tmp_path / "out"
    for number, part in gpu_check.PARTS.items():
        steps = part.steps(gpu_check.Context("python3", tmp_path))
        limits = [max(stage.limit for stage in step) for step in steps]
        assert sum(limits) <= gpu_check.SECONDS - gpu_check.PACK_SECONDS, (number, limits)
        assert all(stage.limit > 0 and re.match(r"\d+-\d+ s: ", stage.estimate) for step in steps for stage in step)
        # on the fresh machine every loan starts (vLLM's first compile of each model), each stage within its limit
        cold = [(stage.name, gpu_check.cold_seconds(stage), stage.limit) for step in steps for stage in step]
        assert all(seconds <= limit for _, seconds, limit in cold), (number, cold)
        total, printed = dry_run(number, out)
        assert total == sum(limits) and [limit for limit, _ in printed] == limits
        assert [(name, seconds, limit) for _, stages in printed for name, limit, seconds, *_ in stages] == cold
        names = [[name for name, *_ in stages] for _, stages in printed]
        assert names == [[stage.name for stage in step] for step in steps]
        assert dry_run(number, out, env={"DRY_RUN": "1"}) == (total, printed)
    assert not out.exists()
    part_1 = [stage for step in gpu_check.PARTS[1].steps(gpu_check.Context("python3", tmp_path)) for stage in step]
    assert [stage.name for stage in part_1] == [
        "gpus",
        "packages",
        "default_dpo",
        "push",
        "models",
        "speed_dpo",
        "plan_dpo",
    ]
    push = next(stage for stage in part_1 if stage.name == "push")
    assert push.after == "default_dpo" and push.argv[-2:] == [
        f"{gpu_check.PUSH}[gptneox-cuda_graphs]",
        f"{gpu_check.PUSH}[llama-eager]",
    ]
    # part 4 ends with two engines sharing the GPU, beside the plan (which uses none)
    assert [stage.name for stage in gpu_check.PARTS[4].steps(gpu_check.Context("python3", tmp_path))[-1]] == [
        "plan_ppo",
        "two_engines",
    ]
    for bad in (["--part", "9", "x"], ["--part", "1"], ["--next", "--part", "1"], ["--record", "x"], []):
        proc = check(*bad)
        assert proc.returncode != 0 and "error:" in proc.stderr, (bad, proc.stderr)


def check_files(words: list[str], work: Path) -> None:
    """Every word naming a file of the repository names one that exists (outputs go to the work folder)."""
    for word in words:
        if word.startswith(str(work)) or word.startswith("-") or " " in word or "::" in word:
            continue
        if re.fullmatch(r"[\w./-]+\.(py|yaml|sh)", word) or "/" in word:
            assert (ROOT / word).exists(), f"{word}: no such file or folder in the repository"


def parse_algorithm(script: str, flags: list[str], world_size: int = 1):
    """The flags as the script reads them (an unknown flag or a bad value stops it) and its sizes."""
    import importlib

    from plumbing.flags import _parse_args

    module = importlib.import_module(script.removesuffix(".py"))
    args = _parse_args(module.Args, module.__doc__, flags)
    return args, module.compute_sizes(args, world_size)


def test_every_command_parses_as_its_program_reads_it_and_every_gpu_test_is_in_a_part(tmp_path):
    """Each stage's command: its files exist; a default run's flags parse, the tiny task with an eager engine; speed.py's
    and vs_trl.py's own flags parse, and so does every command they would start, at the shapes the check promises
    (Pythia-1b, 512 + 53 tokens, 128 completions a step, 8 steps for the timing); the accelerate config of --launch
    loads; pytest's node ids name tests of tests/test_gpu.py, and every test there but the default-run one (the
    default runs are stages of their own) is in a part."""
    from accelerate.commands.config.config_args import load_config_from_file

    import speed
    import trl_driver
    import vs_trl

    work = tmp_path.resolve()
    test_file = (ROOT / gpu_check.TEST_GPU).read_text()
    tested = set()
    for number, part in gpu_check.PARTS.items():
        for stage in (stage for step in part.steps(gpu_check.Context("python3", work)) for stage in step):
            if isinstance(stage.argv, gpu_check.Later):
                assert stage.kind == "plan"  # made from speed.py's log: test_part_1_... runs it
                continue
            argv = stage.argv
            check_files(argv, work)
            if argv[0] == "nvidia-smi" or argv[1:] == ["benchmark/gpu_check.py", "--versions"]:
                continue
            assert argv[0] == "python3", argv  # $PYTHON
            words = argv[1:]
            if words[:2] == ["-m", "pytest"]:
                for node in (word for word in words if "::" in word):
                    path, test = node.split("::")
                    name, _, case = test.partition("[")
                    assert path == gpu_check.TEST_GPU and f"def {name}(" in test_file, node
                    assert (
                        not case
                        or f'id="{case[:-1]}"' in test_file
                        or re.search(rf"\[.*\b{case[:-1]}\b.*\]", test_file)
                    )
                    tested.add(name)
                continue
            script, flags = words[0], words[1:]
            if script in ALGORITHMS:
                args, _ = parse_algorithm(script, flags)
                assert args.output_dir == str(work / stage.name) and args.task == "tiny" and args.vllm_enforce_eager
                two = gpu_check.TWO if stage.name == "two_engines" else []  # two engines on one GPU
                assert flags == ["--vllm_enforce_eager", "--output_dir", str(work / stage.name), *two]  # the defaults
                assert args.vllm_num_engines == (2 if two else 1)
            elif script == "benchmark/speed.py" and "--models_only" in flags:
                own, extra = speed.parse(flags)
                assert (Path(own.out_dir), own.model_size, extra) == (work, "pythia-1b", [])
            elif script == "benchmark/speed.py":
                own, extra = speed.parse(flags)
                assert Path(own.out_dir) == work / stage.name and (own.model_size, own.prompt_length) == (
                    "pythia-1b",
                    None,
                )
                assert stage.models  # its models/ is the one the models stage built
                launch = shlex.split(own.launch)
                check_files(launch, work)
                assert launch[:3] == ["python3", "-m", "accelerate.commands.launch"]
                assert launch[-2:] == ["--num_processes", "1"]
                assert load_config_from_file(launch[launch.index("--config_file") + 1]).distributed_type == "MULTI_GPU"
                lengths = [
                    "--max_prompt_length",
                    str(speed.TLDR_LENGTHS[0]),
                    "--response_length",
                    str(speed.TLDR_LENGTHS[1]),
                ]
                for k in (0, 1):
                    run = ["--eval_freq", "0", "--num_eval_prompts", "64", *lengths, *extra, "--async_level", str(k)]
                    args, sizes = parse_algorithm(own.script, run + ["--output_dir", str(work / stage.name / "sync")])
                    assert (args.max_prompt_length, args.response_length, args.vllm_enforce_eager) == (512, 53, True)
                    assert sizes.episodes_per_step == 128 and sizes.num_steps == 8, sizes
                    prompts = {"ppo_async.py": 128}.get(own.script, 64)  # 64 prompts x 2 samples; PPO: 128 x 1
                    assert sizes.batch_size == prompts and args.local_micro_batch_size == 16
            elif script == "benchmark/vs_trl.py":
                own = vs_trl.parse(flags)
                assert Path(own.out_dir) == work / stage.name and own.model_size in ("tiny", "pythia-1b")
                if own.model_size != "tiny":  # the stage's models/ is the part's
                    assert vs_trl.models_folder(own).parent == work / stage.name / "models" and stage.models
                plan = vs_trl.make_plan(own)
                plan = vs_trl.select(plan, own.runs)
                assert len(plan) == (3 if own.runs else 6)
                for run in plan:
                    check_files(run.argv[1:], work)
                    if run.side == "trl":
                        trl_driver.parse_args(run.argv[2:])
                        continue
                    assert run.argv[1:3] == ["benchmark/vs_trl.py", "--run_script"]
                    _, sizes = parse_algorithm(run.argv[3], run.argv[4:])
                    # the timing leaves out two steps and the last
                    assert sizes.num_steps >= (5 if own.model_size != "tiny" else 8), (run.name, sizes)
            else:
                raise AssertionError(f"part {number}, stage {stage.name}: no check for {script}")
    in_file = set(re.findall(r"^def (test_\w+)\(", test_file, re.M))
    assert in_file - tested == {"test_default_run_learns_on_one_gpu"}


# ---------------------------------------------------------------------------------------------------------------------
# Part 1 with a stand-in for $PYTHON
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


WIN_RATES = (0.4, 0.525)  # the stand-in default run's first and last evaluation


def default_run(out: Path) -> None:
    train = [{"step": s, "async/lag": min(s, 1), "time/step": 0.1 * (s + 1)} for s in range(8)]
    write_lines(
        out / "metrics.jsonl",
        [{"step": 0, "eval/win_rate": WIN_RATES[0]}, *train, {"step": 8, "eval/win_rate": WIN_RATES[1]}],
    )
    (out / "args.json").write_text(json.dumps({"num_steps": 8}))
    for step in (0, 4, 8):
        write_lines(out / "eval_completions" / f"step_{step:06d}.jsonl", [{"query": "q", "response": "r"}])
    weights_file(out / "policy" / "model.safetensors")


def timed_lines(async_level: int, step_time: float) -> list[dict]:
    """Training lines with what benchmark/timing.py and plot_timeline.py read."""
    lines = []
    for s in range(8):
        start = s * step_time
        times = {"time/generation": 0.5, "time/weight_sync": 0.25, "time/training": 1.0}
        times |= {"time/wait_for_rollouts": step_time - 1.0, "time/step": step_time}
        times |= {"time/scoring": 0.25, "time/reference": 0.25, "time/update": 0.4}
        flops = {"flops/scoring": 5e13, "flops/reference": 5e13, "flops/update": 2e14}
        timeline = {"timeline/step_start": start, "timeline/training_start": start + step_time - 1.0}
        timeline |= {"timeline/generation_start": start, "timeline/weight_sync_start": start + 0.5}
        lag = min(s, async_level)
        lines.append({"step": s, "async/lag": lag, "async/version": s - lag, **times, **flops, **timeline})
    return lines


VLLM_START = (
    "INFO [core.py:100] init engine (profile, create kv cache, warmup model) took 71.25 s (compilation: 40.10 s)"
)


def stand_in_python(argv: list[str]) -> int:
    """$PYTHON: notes its argv in $FAKE_CALLS and writes at once what the program would. gpu_check.py, speed.py and
    plan.py run for real (speed.py starts its runs with this stand-in, as --launch names $PYTHON)."""
    if "FAKE_CALLS" in os.environ:
        with open(os.environ["FAKE_CALLS"], "a") as calls:
            calls.write(json.dumps(argv) + "\n")
    real = argv[:1] in (["benchmark/gpu_check.py"], ["benchmark/plan.py"], ["benchmark/speed.py"])
    if real and "--models_only" not in argv or argv[:1] and argv[0].endswith("/gpu_check.py"):
        os.execv(sys.executable, [sys.executable, *argv])
    if argv[:2] == ["-m", "pytest"]:
        print("engine start (gpt_neox, CUDA graphs): 83.4 s")
        print(VLLM_START)
        print("engine start (llama, eager): 12.0 s")
        print("=== 1 failed, 1 passed in 151.20s (0:02:31) ===")  # a failing stage: the later ones still run
        return 1
    elif argv[0] in ALGORITHMS:
        default_run(Path(value(argv, "--output_dir")))
    elif argv[0] == "benchmark/speed.py":  # --models_only: the configs plan.py reads, and what speed.py reuses
        import speed

        folder = Path(value(argv, "--out_dir")) / "models" / "pythia-1b-prompt512"
        for name in ("sft", "reward"):
            speed.pythia_config("pythia-1b").save_pretrained(folder / name)
            weights_file(folder / name / "model.safetensors")
        write_lines(folder / "data" / "test.jsonl", [{"query": "q"}])
    elif argv[:2] == ["-m", "accelerate.commands.launch"]:  # a run of speed.py's
        out, k = Path(value(argv, "--output_dir")), int(value(argv, "--async_level"))
        (out / "args.json").write_text(json.dumps({"num_steps": 8}))
        write_lines(out / "metrics.jsonl", timed_lines(k, 2.0 if k == 0 else 1.25))
        weights_file(out / "policy" / "model.safetensors")
        print(f"INFO init engine (profile, create kv cache, warmup model) took {25.0 + k:.2f} s")  # eager: no compile
    elif argv == ["ignore-sigterm"]:  # a stage that only SIGKILL stops
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(60)
    elif argv[:1] == ["write-run"]:  # a fake stage's run folder, for --record
        default_run(Path(argv[1]))
        (Path(argv[1]) / "long.log").write_text("x" * (gpu_check.RECORDED_FILE_BYTES + 1000))
    return 0


def stand_in(tmp_path: Path) -> dict:
    """The environment of a check run with the stand-in: $PYTHON, and an nvidia-smi that lists one H100."""
    python, bin_ = tmp_path / "python", tmp_path / "bin"
    python.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} "$@"\n')
    bin_.mkdir()
    (bin_ / "nvidia-smi").write_text("#!/bin/sh\necho '0, NVIDIA H100 80GB HBM3, 81559 MiB, 580.65.06'\n")
    for path in (python, bin_ / "nvidia-smi"):
        path.chmod(0o755)
    return {"PYTHON": str(python), "FAKE_CALLS": str(tmp_path / "calls.jsonl"), "PATH": f"{bin_}:{os.environ['PATH']}"}


def summary_rows(text: str) -> dict[str, tuple[str, str, str]]:
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 6 and cells[0] not in ("stage", "---"):
            rows[cells[0]] = (cells[1], cells[2], cells[5])
    return rows


def test_part_1_with_a_stand_in_leaves_two_files_its_results_packed_without_weights(tmp_path):
    """The stages in order, as the dry run printed them (push after the default run logged a step); a failing stage
    (the push tests) does not stop the later ones and fails the part (exit code 1); OUT_DIR holds summary.md and
    results.tgz only, the archive every log, metrics.jsonl, args.json, evaluation sample, speed.md and the timeline,
    no weights or models, nothing over 16 MiB; the summary holds each stage's result and numbers: the win rates, the
    engine starts, speed.py's table (real, from the stand-in's metrics) and plan.py's prediction against it."""
    env, out = stand_in(tmp_path), tmp_path / "out"
    _, planned = dry_run(1, out, env=env)
    proc = check("--part", "1", str(out), env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.md"]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    work = re.search(r"the stages write in (\S+)", proc.stdout)[1]
    expected = {}
    for _, stages in planned:
        for name, *_, line in stages:
            if name == "plan_dpo":  # its command is built from speed.py's log: below
                continue
            words = shlex.split(line.replace(tempfile_prefix(1), work))
            while "=" in words[0]:  # OMP_NUM_THREADS=4: the models stage's environment
                words.pop(0)
            if words[0] == env["PYTHON"]:
                expected[name] = words[1:]
    started = [argv for argv in calls if "--part" not in argv and argv[1:2] != ["accelerate.commands.launch"]]
    assert sorted(map(json.dumps, started[:-1])) == sorted(map(json.dumps, expected.values()))
    at = {name: started.index(argv) for name, argv in expected.items()}
    assert at["default_dpo"] < at["push"] < at["speed_dpo"] and at["models"] < at["speed_dpo"]  # push: after a step
    async_run = [argv for argv in calls if argv[1:2] == ["accelerate.commands.launch"]][-1]
    assert async_run[-4:] == ["--async_level", "1", "--output_dir", f"{work}/speed_dpo/async"]
    hardware = ["--gpus", "1", "--gpu_gib", "79.6", "--bandwidth", "3.35e+12"]  # the stand-in nvidia-smi's H100
    assert started[-1] == ["benchmark/plan.py", *hardware, "--", env["PYTHON"], *async_run]

    summary = (out / "summary.md").read_text()
    assert summary.strip() in proc.stdout
    rows = summary_rows(summary)
    assert list(rows) == ["gpus", "packages", "default_dpo", "push", "models", "speed_dpo", "plan_dpo"]
    assert {name: result for name, (result, _, _) in rows.items() if result != "passed"} == {"push": "failed"}, summary
    assert "| device | H100: NVIDIA H100 80GB HBM3, 81559 MiB |" in summary and "| result | failed: push |" in summary
    assert rows["packages"][2].startswith(f"torch {importlib.metadata.version('torch')}; vllm ")  # this interpreter's
    mean = sum(0.1 * (s + 1) for s in range(2, 8)) / 6
    assert (
        rows["default_dpo"][2]
        == f"win rate 0.400 at step 0, 0.525 at step 8 (+0.125); 8 steps, {mean:.3f} s each from step 2 on"
    )
    assert rows["push"][1:] == (
        "1",
        "1 failed, 1 passed; engine start (gpt_neox, CUDA graphs): 83.4 s; engine start (llama, eager): 12.0 s; "
        "vLLM's engine starts: 71.2 s (compilation 40.1 s)",
    )
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(tmp_path / "results", filter="data")
    sync, async_ = (timing.summarize(f"{tmp_path}/results/speed_dpo/{run}/metrics.jsonl") for run in ("sync", "async"))
    figures = timing.compare(sync, async_)
    assert rows["speed_dpo"][2].startswith(
        f"step {sync['step']:.3f} s sync, {async_['step']:.3f} s async ({figures['measured speed-up']:.2f}x); "
        f"max(G, T) / async step {figures['pipeline efficiency']:.1%}; weight push {figures['push share']:.1%} of the "
        "async step; MFU (async, of 989 TFLOP/s): scoring 20.2%, reference 20.2%, update 50.6%; the sync run's engine "
        "start (eager): 25.0 s; speed_dpo/timeline.png"
    ), rows["speed_dpo"]
    predicted = re.fullmatch(
        r"predicted: G ([\d.]+) s, T ([\d.]+) s, step ([\d.]+) s sync, ([\d.]+) s async \(\w+-bound\); (.*)",
        rows["plan_dpo"][2],
    )
    assert predicted and rows["plan_dpo"][0] == "passed", rows["plan_dpo"]
    error = (float(predicted[4]) - async_["step"]) / async_["step"]
    assert predicted[5].startswith(
        f"measured (speed_dpo): G {sync['G']:.2f} s, T {sync['T']:.2f} s, step {sync['step']:.2f} s sync"
    )
    assert predicted[5].endswith(
        f"the prediction's error on the async step {error:+.0%}, on the sync step "
        f"{(float(predicted[3]) - sync['step']) / sync['step']:+.0%}"
    )

    with tarfile.open(out / "results.tgz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert all(m.isfile() and m.size < 16 * 2**20 for m in members.values())
    assert not [name for name in members if re.search(r"(^|/)(models|policy|checkpoints)/|\.safetensors$", name)]
    for name in (
        "gpus.log",
        "packages.log",
        "push.log",
        "plan_dpo.log",
        "default_dpo/metrics.jsonl",
        "default_dpo/args.json",
        "default_dpo/eval_completions/step_000004.jsonl",
        "speed_dpo/speed.md",
        "speed_dpo/timeline.png",
        "speed_dpo/sync/metrics.jsonl",
        "speed_dpo/async/run.log",
        "deleted_weights.txt",
    ):
        assert name in members, name
    assert not Path(work).exists()  # the work folder, models and all, is gone


def test_key_numbers_of_a_cut_speed_run_of_skipped_tests_and_of_vs_trl(tmp_path):
    """A speed stage cut before its async run: the sync run's step alone; a pytest stage with a skipped test fails
    unless its stage allows skips (the two-GPU test on one GPU); vs_trl.py's results: episodes per second, ours
    against TRL's, and the peak memory."""
    stage = gpu_check.Stage("speed_x", 10, "1-2 s: x", [], "speed")
    write_lines(tmp_path / "speed_x" / "sync" / "metrics.jsonl", timed_lines(0, 2.0))
    write_lines(tmp_path / "speed_x" / "async" / "metrics.jsonl", timed_lines(1, 1.25)[:2])
    numbers, problem = gpu_check.speed_numbers(tmp_path, stage)
    assert numbers.startswith("async: ") and "timing needs at least 4" in numbers and problem is None
    assert numbers.endswith("; sync only: step 2.000 s")
    (tmp_path / "tests.log").write_text("engine start (llama, eager): 9.5 s\n=== 1 passed, 1 skipped in 12.00s ===\n")
    tests = gpu_check.Stage("tests", 10, "1-2 s: x", [], "pytest")
    assert gpu_check.pytest_numbers(tmp_path, tests) == (
        "1 passed, 1 skipped; engine start (llama, eager): 9.5 s",
        "a test skipped: a condition the part needs is missing",
    )
    assert gpu_check.pytest_numbers(tmp_path, tests._replace(skips=True))[1] is None
    result = dict(side="ours", method="rloo", gpu_peak_gib=None)
    results = [
        dict(name="trl_rloo", side="trl", method="rloo", episodes_per_s=10.0, gpu_peak_gib=30.25),
        {**result, "name": "ours_rloo_async0", "episodes_per_s": 12.0},
        {**result, "name": "ours_rloo_async1", "episodes_per_s": 15.0, "gpu_peak_gib": 40.0},
    ]
    (tmp_path / "vs").mkdir()
    (tmp_path / "vs" / "vs_trl.json").write_text(json.dumps({"work": {}, "results": results}))
    assert gpu_check.vs_trl_numbers(tmp_path, stage._replace(name="vs", kind="vs_trl")) == (
        "trl_rloo 10.0 episodes/s, GPU peak 30.2 GiB; ours_rloo_async0 12.0 episodes/s (1.20x TRL's); "
        "ours_rloo_async1 15.0 episodes/s (1.50x TRL's), GPU peak 40.0 GiB; vs/vs_trl.md",
        None,
    )
    failed = {**result, "name": "ours_rloo_async2", "episodes_per_s": None, "error": "the engine died"}
    (tmp_path / "vs" / "vs_trl.json").write_text(json.dumps({"work": {}, "results": [*results, failed]}))
    numbers, problem = gpu_check.vs_trl_numbers(tmp_path, stage._replace(name="vs", kind="vs_trl"))
    assert "; ours_rloo_async2 failed: the engine died; vs/vs_trl.md" in numbers
    assert problem == "run(s) ours_rloo_async2 failed"


def tempfile_prefix(number: int) -> str:
    import tempfile

    return str(Path(tempfile.gettempdir(), f"gpu_check-part{number}-XXXXXXXX"))


# ---------------------------------------------------------------------------------------------------------------------
# Fake parts: deadlines, signals, --next and --record
def fake_parts(tmp_path: Path, parts: dict, pack_seconds: int = 1, min_stage: int = 1) -> dict:
    """The environment that puts these fake parts in place of the real ones (gpu_check.FAKE_PARTS)."""
    path = tmp_path / "fake_parts.json"
    path.write_text(json.dumps({"pack_seconds": pack_seconds, "min_stage": min_stage, "parts": parts}))
    return {gpu_check.FAKE_PARTS: str(path)}


def fake_stage(name: str, limit: int, *argv: str) -> dict:
    return {"name": name, "limit": limit, "argv": list(argv)}


def test_a_deadline_cuts_stages_and_the_part_still_ends_with_its_summary_and_archive(tmp_path):
    """A stage that ignores SIGTERM is killed at its limit; one whose key numbers cannot be read fails; the next step's
    stage is cut at the part's deadline (--seconds less the packing's time); the one after is not started; the part
    ends within its seconds, with its two files."""
    python = [sys.executable, __file__]
    steps = [
        [
            fake_stage("stubborn", 1, *python, "ignore-sigterm"),
            fake_stage("quick", 1, "true"),
            {**fake_stage("silent", 1, "true"), "kind": "run"},  # a run that wrote no metrics
        ],
        [fake_stage("long", 60, "sleep", "30")],
        [fake_stage("too_late", 10, "true")],
    ]
    env = fake_parts(tmp_path, {"1": {"title": "deadlines", "steps": steps}})
    out, start = tmp_path / "out", time.monotonic()
    proc = check("--part", "1", "--seconds", "4", str(out), env=env, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - start < 4 + 3, proc.stdout + proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.md"]
    rows = summary_rows((out / "summary.md").read_text())
    assert list(rows) == ["stubborn", "quick", "silent", "long", "too_late"]  # as the part lists them
    assert rows["stubborn"][:2] == ("cut", "-9") and rows["stubborn"][2].startswith("cut by its limit after 1 s")
    assert rows["quick"][:2] == ("passed", "0")
    assert rows["silent"][:2] == ("failed", "0") and rows["silent"][2].startswith("its key numbers could not be read")
    assert rows["long"][:2] == ("cut", "-15") and rows["long"][2].startswith("cut by the part's deadline after ")
    assert rows["too_late"][:2] == ("not started", "-")
    assert re.fullmatch(r"[01] s left before the part's deadline", rows["too_late"][2])
    with tarfile.open(out / "results.tgz") as tar:
        assert sorted(tar.getnames()) == ["long.log", "quick.log", "silent.log", "stubborn.log"]


def test_a_part_stopped_by_sigterm_still_writes_its_summary_and_archive(tmp_path):
    """SIGTERM to the check (a loan's end, or `timeout` at the deadline) while a stage runs: the stage's process
    group gets it too, the later stages are not started, summary.md and results.tgz are written, nothing is left
    running, and the exit code says SIGTERM (143)."""
    steps = [[fake_stage("sleeps", 60, "sleep", "30")], [fake_stage("later", 60, "true")]]
    env = fake_parts(tmp_path, {"1": {"title": "a signal", "steps": steps}})
    out = tmp_path / "out"
    proc = subprocess.Popen(
        ["bash", "benchmark/gpu_check.sh", "--part", "1", str(out)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == "sleep"]:
            assert time.monotonic() < deadline, "the stage did not start"
            time.sleep(0.05)
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert not psutil.wait_procs(family, timeout=5)[1], "processes left behind"
    assert sorted(p.name for p in out.iterdir()) == ["results.tgz", "summary.md"]
    summary = (out / "summary.md").read_text()
    rows = summary_rows(summary)
    assert rows["sleeps"][0] == "stopped" and rows["sleeps"][2].startswith("stopped by the part's SIGTERM")
    assert rows["later"] == ("not started", "-", "the part got SIGTERM")
    assert "| result | stopped by SIGTERM |" in summary
    with tarfile.open(out / "results.tgz") as tar:
        assert tar.getnames() == ["sleeps.log"]


TWO_PARTS = {
    "1": {
        "title": "one",
        "depends": [STABLE_FILE],
        "steps": [[fake_stage("run", 30, sys.executable, __file__, "write-run", "{out}/run")]],
    },
    "2": {"title": "two", "depends": ["tasks/tiny/"], "steps": [[fake_stage("other", 30, "true")]]},
}


def ledger_with(tmp_path: Path, rows: list[list[str]]) -> Path:
    """The repository's ledger (its explanation and its header) with these rows."""
    ledger = tmp_path / "results" / "ledger.md"
    ledger.parent.mkdir(parents=True, exist_ok=True)
    text = gpu_check.LEDGER.read_text()
    ledger.write_text(text + "".join("| " + " | ".join(row) + " |\n" for row in rows))
    return ledger


def test_next_reads_the_ledger_and_a_part_is_due_again_when_its_code_changed(tmp_path, monkeypatch):
    """The first part without a passing row at its code hash now: none (the repository's ledger: nothing has run),
    a failed row, a pass at other code (changed since) leave it due; a pass at its code moves on."""
    monkeypatch.setenv(gpu_check.FAKE_PARTS, fake_parts(tmp_path, TWO_PARTS)[gpu_check.FAKE_PARTS])
    parts = gpu_check.settings().parts
    codes = {n: gpu_check.code_hash(n, part, gpu_check.tree_files(ROOT, part.depends)) for n, part in parts.items()}
    assert gpu_check.ledger_rows(gpu_check.LEDGER) == []
    row = lambda part, result, code: ["2026-11-28", part, "abcd1234", code, "H100", result, "run 0", "", "13", "x"]  # noqa: E731
    cases = [
        ([], 1, "it has not run on a GPU yet"),
        ([row("1", "failed", codes[1])], 1, f"it has not passed at its code ({codes[1]}) yet"),
        (
            [row("1", "passed", "0123456789ab")],
            1,
            "it passed at commit abcd1234 (code 0123456789ab), and its code has changed since",
        ),
        ([row("1", "passed", codes[1])], 2, "it has not run on a GPU yet"),
        ([row("1", "passed", codes[1]), row("2", "passed", codes[2])], None, "every part has passed at its code"),
    ]
    for rows, number, why in cases:
        found, text = gpu_check.next_part(parts, ledger_with(tmp_path, rows), ROOT)
        assert found == number and text.startswith(why), (rows, found, text)
    proc = check("--next", "--ledger", str(ledger_with(tmp_path, cases[3][0])), env=fake_parts(tmp_path, TWO_PARTS))
    assert (
        proc.stdout.splitlines()[0] == "part 2: two" and "bash benchmark/gpu_check.sh --part 2 OUT_DIR" in proc.stdout
    )
    proc = check("--next")  # the repository's parts and ledger
    assert proc.returncode == 0 and proc.stdout.startswith("part 1: ") and "has not run on a GPU yet" in proc.stdout


def test_the_code_hash_follows_a_parts_files_and_stages_only(tmp_path):
    """A part's hash changes with a file it depends on (a path, "folder/*.py", "folder/"), with its stages' limits
    and commands, not with another file, a compiled one, or an estimate; from a commit (git's blob ids) it is the same
    as from the working tree."""
    root = tmp_path / "repo"
    for path in ("a.py", "lib/x.py", "lib/deep/y.py", "data/z.json", "other.py"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
    stage = gpu_check.Stage("s", 10, "1-2 s: x", ["true"], "none")
    part = gpu_check.Part("p", lambda c: [[stage]], ("a.py", "lib/*.py", "data/"))
    code = lambda p=part: gpu_check.code_hash(1, p, gpu_check.tree_files(root, p.depends))  # noqa: E731
    first = code()
    assert sorted(gpu_check.tree_files(root, part.depends)) == ["a.py", "data/z.json", "lib/x.py"]
    for path in ("other.py", "lib/deep/y.py", "lib/notes.txt", "lib/__pycache__/x.cpython-311.pyc"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("changed")
        assert code() == first, path
    assert code(part._replace(steps=lambda c: [[stage._replace(estimate="3-4 s: y")]])) == first
    assert code(part._replace(steps=lambda c: [[stage._replace(limit=11)]])) != first
    assert code(part._replace(steps=lambda c: [[stage._replace(argv=["false"])]])) != first
    for path in ("a.py", "lib/x.py", "data/z.json", "data/new.bin"):
        (root / path).write_text(f"{path} changed")
        assert code() != first, path
        first = code()
    patterns = ("tasks/tiny/", "plumbing/*.py", "configs/multi_gpu.yaml")
    changed = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all", "--", "tasks/tiny", "plumbing", "configs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    changed = {line[3:] for line in changed.splitlines()}
    committed = gpu_check.commit_files(ROOT, "HEAD", patterns)
    in_tree = gpu_check.tree_files(ROOT, patterns)
    unchanged = {path for path in committed.keys() | in_tree.keys() if path not in changed}
    assert len(unchanged) > 10 and all(committed.get(path) == in_tree.get(path) for path in unchanged)


def test_record_unpacks_a_parts_results_beside_the_ledger_and_adds_its_row(tmp_path, monkeypatch):
    """A part's two files recorded: its results unpacked next to the ledger (the summary, metrics, the first and last
    evaluation samples, a long log cut to its head and tail; no weights), a row with the date, part, commit, code,
    device, result, exit codes, key numbers and device minutes; --next then names the part after it. The same results
    twice, and results whose code is not HEAD's, are refused."""
    env = fake_parts(tmp_path, TWO_PARTS)
    out = tmp_path / "out"
    assert check("--part", "1", str(out), env=env).returncode == 0
    ledger = ledger_with(tmp_path, [])
    proc = check("--record", str(out), "--device_minutes", "12.5", "--ledger", str(ledger), env=env)
    assert proc.returncode == 0, proc.stderr
    rows = gpu_check.ledger_rows(ledger)
    commit = subprocess.run(
        ["git", "rev-parse", "--short=8", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    info = json.loads(re.search(r"<!-- gpu_check (.*) -->", (out / "summary.md").read_text())[1])
    folder = f"part1-{info['date'][:10]}-{commit}"
    assert rows == [
        {
            "date": info["date"][:10],
            "part": "1",
            "commit": commit,
            "code": info["code"],
            "device": "no GPU seen",
            "result": "passed",
            "exit codes": "run 0",
            "key numbers": "",
            "minutes": "12.5",
            "results": f"[{folder}]({folder}/summary.md)",
        }
    ]
    recorded = ledger.parent / folder
    files = sorted(p.relative_to(recorded).as_posix() for p in recorded.rglob("*") if p.is_file())
    assert files == [
        "deleted_weights.txt",  # the run's final policy
        "run.log",
        "run/args.json",
        "run/eval_completions/step_000000.jsonl",
        "run/eval_completions/step_000008.jsonl",
        "run/long.log",
        "run/metrics.jsonl",
        "summary.md",
    ]
    assert (recorded / "run" / "long.log").stat().st_size < gpu_check.RECORDED_FILE_BYTES + 100
    monkeypatch.setenv(gpu_check.FAKE_PARTS, env[gpu_check.FAKE_PARTS])
    assert gpu_check.next_part(gpu_check.settings().parts, ledger, ROOT)[0] == 2
    again = check("--record", str(out), "--device_minutes", "1", "--ledger", str(ledger), env=env)
    assert again.returncode != 0 and "exists" in again.stderr
    summary = (out / "summary.md").read_text()
    (out / "summary.md").write_text(summary.replace(f'"code": "{info["code"]}"', '"code": "000000000000"'))
    other = check("--record", str(out), "--device_minutes", "1", "--ledger", str(ledger), env=env)
    assert other.returncode != 0 and "ran code 000000000000" in other.stderr
    assert len(gpu_check.ledger_rows(ledger)) == 1


def test_docs_list_each_parts_stages():
    """docs/gpus.md's table of the parts names each part's stages, in order, as the code runs them."""
    text = (ROOT / "docs" / "gpus.md").read_text()
    for number, part in gpu_check.PARTS.items():
        names = [stage.name for step in part.steps(gpu_check.Context("python3", Path("w"))) for stage in step]
        row = re.search(rf"^\| {number} \| .* \| (.*) \|$", text, re.M)
        assert row and re.findall(r"`(\w+)`", row[1]) == names, (number, row and row[1])


if __name__ == "__main__":
    sys.exit(stand_in_python(sys.argv[1:]))
