"""benchmark/vs_trl.py: the plan (every run gets the same work, and each command parses as its script or the TRL
driver reads it), the machine's choices (how TRL generates, the dtype, the cores), the differences table (also
docs/vs_trl.md's), the executor (pinning, a failed run as a row, a retry reusing finished runs and starting the others
over) and the wrapper of our runs, and the tables and charts on FAKE timings checked against hand-computed numbers;
the committed results are the tables of their JSON. One short TRL run on the HF-generate path where TRL is installed
(CI installs requirements-trl.txt)."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import tyro
from conftest import ROOT, run_script

sys.path.insert(0, str(ROOT / "benchmark"))
import online_dpo_async  # noqa: E402
import rloo_async  # noqa: E402
import timing  # noqa: E402
import trl_driver  # noqa: E402
import vs_trl  # noqa: E402

MODULES = {"online_dpo_async.py": online_dpo_async, "rloo_async.py": rloo_async}
RESULTS = ROOT / "benchmark" / "results" / "vs_trl_tiny_cpu"
CPU = vs_trl.Setup(False, [0, 1], "hf", "float32", "no GPU")


def plan_for(*flags: str, setup: vs_trl.Setup = CPU, out: str = "runs/x") -> list[vs_trl.Run]:
    return vs_trl.make_plan(vs_trl.parse(["--out_dir", out, *flags]), setup)


def settings(run: vs_trl.Run) -> dict:
    """What must be the same in every run of a method, read back from the run's command as its program parses it."""
    if run.side == "trl":
        assert run.argv[1] == "benchmark/trl_driver.py"
        a = trl_driver.parse_args(run.argv[2:])
        samples, prompts = a.num_samples, a.local_micro_batch_size * a.gradient_accumulation_steps
        algorithm = (a.beta,) if a.trainer == "online_dpo" else (a.kl_coef, a.cliprange)
        engine_dtype = a.dtype
    else:
        assert run.argv[1:3] == ["benchmark/vs_trl.py", "--run_script"]
        script, flags = run.argv[3], run.argv[4:]
        a = tyro.cli(MODULES[script].Args, args=flags)
        assert (a.async_level, a.vllm_placement, a.num_mini_batches, a.num_ppo_epochs) == (
            run.async_level,
            "auto",
            1,
            1,
        )
        sizes = MODULES[script].compute_sizes(a, 1)
        samples, prompts = (
            (a.num_samples, sizes.batch_size) if script == "online_dpo_async.py" else (a.rloo_k, sizes.batch_size)
        )
        algorithm = (a.beta,) if script == "online_dpo_async.py" else (a.kl_coef, a.cliprange)
        engine_dtype = a.vllm_dtype
        assert not a.gradient_checkpointing and a.lr_schedule == "linear"
    assert run.env == {vs_trl.PEAK_FILE: str(Path(a.output_dir) / "peak_memory.json")}
    assert Path(a.output_dir).name == run.name and a.seed == run.seed
    return dict(
        episodes=a.total_episodes,
        prompts_per_step=prompts,
        samples=samples,
        lr=a.learning_rate,
        adam_epsilon=a.adam_epsilon,
        algorithm=algorithm,
        temperature=a.temperature,
        dtype=a.dtype,
        engine_dtype=engine_dtype,
        seed=a.seed,
        lengths=(a.max_prompt_length, a.response_length),
        missing_eos_penalty=a.missing_eos_penalty,
        models=(a.sft_model_path, a.reward_model_path, a.dataset_name),
        engine_memory=a.vllm_gpu_memory_utilization,
        eval_prompts=a.num_eval_prompts,
        eval_freq=a.eval_freq,
    )


@pytest.mark.parametrize("model_size", ["tiny", "pythia-1b"])
def test_plan_gives_every_run_of_a_method_the_same_work(tmp_path, model_size):
    plan = plan_for("--model_size", model_size, out=str(tmp_path))
    assert [(r.name, r.config, r.method, r.side, r.async_level, r.seed) for r in plan] == [
        ("trl_online_dpo_s1", "trl_online_dpo", "online_dpo", "trl", None, 1),
        ("ours_online_dpo_async0_s1", "ours_online_dpo_async0", "online_dpo", "ours", 0, 1),
        ("ours_online_dpo_async1_s1", "ours_online_dpo_async1", "online_dpo", "ours", 1, 1),
        ("trl_rloo_s1", "trl_rloo", "rloo", "trl", None, 1),
        ("ours_rloo_async0_s1", "ours_rloo_async0", "rloo", "ours", 0, 1),
        ("ours_rloo_async1_s1", "ours_rloo_async1", "rloo", "ours", 1, 1),
    ]
    for method in ("online_dpo", "rloo"):
        runs = [settings(r) for r in plan if r.method == method]
        assert runs[0] == runs[1] == runs[2], method
    first = settings(plan[0])
    assert (first["samples"], first["dtype"], first["engine_dtype"], first["temperature"]) == (
        2,
        "float32",  # the CPU setup's
        "float32",
        0.7,
    )
    if model_size == "tiny":  # the scripts' defaults on the committed tiny task, evaluated every 25 steps
        assert (first["episodes"], first["prompts_per_step"], first["lengths"], first["lr"]) == (
            12800,
            32,
            (12, 12),
            1e-4,
        )
        assert (first["eval_prompts"], first["eval_freq"]) == (512, 25)
        assert first["models"][0] == str(ROOT / "tasks" / "tiny" / "sft")
    else:  # speed.py --model_size pythia-1b's models and TLDR's shapes: 30 steps of 64 prompts x 2
        assert (first["episodes"], first["prompts_per_step"], first["lengths"], first["lr"]) == (
            3840,
            64,
            (512, 53),
            3e-6,
        )
        assert first["models"][0] == str(tmp_path.resolve() / "models" / "pythia-1b-prompt512" / "sft")
    overridden = plan_for("--model_size", model_size, "--total_episodes", "640", "--eval_freq", "5", out=str(tmp_path))
    assert {(settings(r)["episodes"], settings(r)["eval_freq"]) for r in overridden} == {(640, 5)}
    gpu = vs_trl.Setup(True, [0, 1], "vllm", "bfloat16", "a GPU")
    assert {(settings(r)["dtype"], settings(r)["engine_dtype"]) for r in plan_for(setup=gpu)} == {("bfloat16",) * 2}


def test_plan_over_seeds_and_schedules():
    """Each seed gets every run, TRL once per schedule; the runs of a seed differ from another seed's in the seed only."""
    plan = plan_for("--model_size", "tiny", "--seeds", "1,3", "--trl_lr_schedules", "trl,ours")
    assert [r.name for r in plan if r.seed == 3] == [
        "trl_online_dpo_s3",
        "trl_online_dpo_lr_ours_s3",
        "ours_online_dpo_async0_s3",
        "ours_online_dpo_async1_s3",
        "trl_rloo_s3",
        "trl_rloo_lr_ours_s3",
        "ours_rloo_async0_s3",
        "ours_rloo_async1_s3",
    ]
    for one, three in zip(plan[:8], plan[8:]):
        assert {**settings(one), "seed": 3} == settings(three)
    schedules = {r.name: trl_driver.parse_args(r.argv[2:]).lr_schedule for r in plan if r.side == "trl"}
    assert schedules["trl_rloo_s1"] == "trl" and schedules["trl_rloo_lr_ours_s1"] == "ours"
    assert {trl_driver.parse_args(r.argv[2:]).generation for r in plan if r.side == "trl"} == {"hf"}
    assert [r.name for r in vs_trl.select(plan, "ours_rloo_async0")] == ["ours_rloo_async0_s1", "ours_rloo_async0_s3"]
    assert [r.name for r in vs_trl.select(plan, "trl_*_s3,ours_rloo_async1_s1")] == [  # in the plan's order
        "ours_rloo_async1_s1",
        "trl_online_dpo_s3",
        "trl_online_dpo_lr_ours_s3",
        "trl_rloo_s3",
        "trl_rloo_lr_ours_s3",
    ]
    with pytest.raises(SystemExit, match="no run named nope"):
        vs_trl.select(plan, "nope")


def test_the_machine_decides_how_trl_generates_the_dtype_and_the_cores():
    args = lambda *flags: vs_trl.parse(["--out_dir", "x", *flags])  # noqa: E731
    cpu = vs_trl.setup_for(args(), cuda=False, allowed=[0, 1])
    assert (cpu.generation, cpu.dtype, cpu.cores) == ("hf", "float32", [0, 1])
    assert cpu.note == (
        "no GPU: TRL generates with HF generate, the trainers run float32 "
        "(TRL's vLLM colocate mode cannot load weights into vLLM's CPU backend)"
    )
    gpu = vs_trl.setup_for(args(), cuda=True, allowed=[0, 1, 2, 3])
    assert (gpu.generation, gpu.dtype, gpu.cores) == ("vllm", "bfloat16", [0, 1, 2, 3])
    assert vs_trl.setup_for(args("--trl_generation", "hf", "--cores", "1-2"), True, [0, 1, 2, 3])[1:3] == ([1, 2], "hf")
    with pytest.raises(SystemExit, match="--trl_generation vllm needs a GPU"):
        vs_trl.setup_for(args("--trl_generation", "vllm"), cuda=False, allowed=[0, 1])
    with pytest.raises(SystemExit, match="--cores 0-2: this process may use cores 0-1 only"):
        vs_trl.setup_for(args("--cores", "0-2"), cuda=False, allowed=[0, 1])
    assert vs_trl.parse_cores("0-1,4") == [0, 1, 4] and vs_trl.core_list([0, 1, 4]) == "0,1,4"
    assert vs_trl.core_list([2, 3, 4]) == "2-4" and vs_trl.core_list([3]) == "3"


def test_trl_gets_our_prompts_in_our_order():
    queries = [f"q{i}" for i in range(10)]
    rows = trl_driver.ordered_prompts(queries, num_steps=7, batch_size=3, seed=5)
    for step in range(7):
        indices = online_dpo_async.prompt_indices_for_step(step, 10, 3, 5)
        assert rows[3 * step : 3 * step + 3] == [queries[i] for i in indices]
    assert trl_driver.eval_steps(200, 25) == [0, 25, 50, 75, 100, 125, 150, 175, 200]
    assert trl_driver.eval_steps(30, 0) == [0, 30] and trl_driver.eval_steps(10, 4) == [0, 4, 8, 10]


def test_driver_flags_are_required_and_trl_is_not_imported():
    with pytest.raises(SystemExit):
        trl_driver.parse_args(["--trainer", "rloo"])
    plan = plan_for("--model_size", "tiny")
    argv = [w for w in plan[3].argv[2:] if w not in ("--cliprange", "0.2")]
    with pytest.raises(SystemExit):  # RLOO needs its clip range
        trl_driver.parse_args(argv)
    assert "trl" not in sys.modules
    for script in ("online_dpo_async.py", "rloo_async.py", "ppo_async.py", "benchmark/vs_trl.py"):
        assert not re.search(r"^\s*(import|from) trl", (ROOT / script).read_text(), re.M), script


def test_differences_table_lists_what_trl_cannot_set():
    table = vs_trl.differences_table()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:]]
    assert len(rows) == len(vs_trl.DIFFERENCES) and all(len(row) == 5 for row in rows)
    dpo_only = {row[1] for row in rows if row[0] == "online DPO"}
    assert {"logprob temperature", "tied pairs", "gradient accumulation"} <= dpo_only
    schedule = next(row for row in rows if row[1] == "learning-rate schedule")
    assert "1 − (n + 1)/N" in schedule[2] and "1 − n/N" in schedule[3]
    rloo = vs_trl.differences_table(methods=("rloo",))
    assert "tied pairs" not in rloo and "| RLOO | generation batch |" in rloo and "| both | engine |" in rloo


def test_both_schedules_as_the_driver_and_our_scripts_step_them():
    """Ours trains step n at 1 - (n + 1)/N (lr_factor, the driver's --lr_schedule ours); TRL's linear schedule, the
    driver's default, at 1 - n/N: the one-step offset of the differences table, by hand for N = 4."""
    import torch
    from transformers import get_scheduler

    assert [online_dpo_async.lr_factor("linear", n, 4) for n in range(4)] == [0.75, 0.5, 0.25, 0.0]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    trl = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=4)  # what TRL's Trainer builds
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        trl.step()
    assert lrs == [1.0, 0.75, 0.5, 0.25]


def test_readme_section_shows_the_command_and_the_table(tmp_path):
    """docs/vs_trl.md (the README's Documentation list links it) shows the commands and the differences table."""
    readme = (ROOT / "README.md").read_text()
    assert "(docs/vs_trl.md)" in readme
    section = (ROOT / "docs" / "vs_trl.md").read_text()
    assert vs_trl.differences_table() in section
    assert "has not been run on a GPU" in section
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    for command in (c.split("  #")[0] for c in commands if c.startswith("python benchmark/vs_trl.py")):
        words = shlex.split(command)
        args = vs_trl.parse(words[2:])
        vs_trl.make_plan(args, vs_trl.setup_for(args, cuda="--trl_generation vllm" in command, allowed=[0, 1]))
    layout = readme[readme.index("## Layout") :]
    assert "requirements-trl.txt" in layout and "benchmark/vs_trl.py" in layout
    assert "trl==1.16.0" in (ROOT / "requirements-trl.txt").read_text()
    test_command = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```", readme, re.S).group(1)
    assert "--no-deps -r requirements-cpu.txt -r requirements-trl.txt" in test_command


def test_requirements_trl_pins_nothing_against_requirements_cpu():
    """Installed with --no-deps beside requirements-cpu.txt (the README's test command): every package both pin has
    the same version there."""
    pins = lambda name: dict(  # noqa: E731
        line.split("==") for line in (ROOT / name).read_text().splitlines() if "==" in line and not line.startswith("#")
    )
    cpu, trl = pins("requirements-cpu.txt"), pins("requirements-trl.txt")
    assert "trl" in trl and {name: trl[name] for name in trl if name in cpu} == {
        name: cpu[name] for name in trl if name in cpu
    }


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_script(
        [sys.executable, "benchmark/vs_trl.py", "--dry_run", "--model_size", "tiny", "--out_dir", str(out)], timeout=120
    )
    assert proc.stdout.startswith("no GPU: TRL generates with HF generate")
    args = vs_trl.parse(["--out_dir", str(out), "--model_size", "tiny"])
    for run in vs_trl.make_plan(args, vs_trl.setup_for(args, False, sorted(os.sched_getaffinity(0)))):
        assert shlex.join(run.argv) in proc.stdout
    assert vs_trl.differences_table() in proc.stdout
    assert not out.exists()
    bad = subprocess.run(
        [sys.executable, "benchmark/vs_trl.py", "--dry_run", "--out_dir", str(out), "--runs", "nope"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "no run named nope" in bad.stderr


def test_our_runs_go_through_the_wrapper(tmp_path):
    """`--run_script` runs the algorithm file as `python FILE FLAGS` would and writes the peak memory file at exit."""
    peak = tmp_path / "peak.json"
    proc = run_script(
        [sys.executable, "benchmark/vs_trl.py", "--run_script", "rloo_async.py", "--help"],
        timeout=120,
        env={vs_trl.PEAK_FILE: str(peak)},
    )
    assert "--rloo_k" in proc.stdout
    assert json.loads(peak.read_text()) == {"max_memory_allocated": None}  # no CUDA here


# FAKE per-step timings: (episodes per step, [step wall times], generation, weight sync, trainer, scoring, wait)
FAKE = {
    "trl_online_dpo": (128, [2.0] * 8, 0.9, 0.1, 1.0, 0.2, 1.0),
    "ours_online_dpo_async0": (128, [1.6, 1.6, 5.0, 1.2, 1.2, 2.4, 1.6, 1.6], 0.5, 0.05, 1.0, 0.2, 0.55),
    "ours_online_dpo_async1": (128, [1.0, 3.0, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0], 0.5, 0.05, 0.9, 0.2, 0.05),
    "trl_rloo": (128, [4.0] * 8, 2.0, 0.1, 1.9, 0.3, 2.1),
    "ours_rloo_async0": (128, [2.0] * 8, 0.8, 0.05, 1.1, 0.3, 0.85),
    "ours_rloo_async1": (128, [1.6] * 8, 0.8, 0.05, 1.5, 0.3, 0.05),
}


def write_fake_run(folder: Path, episodes_per_step, step_times, generation, push, trainer, scoring, wait, win_rate):
    folder.mkdir(parents=True)
    starts = [sum(step_times[:i]) for i in range(len(step_times))]
    lines = [
        {
            "step": i,
            "async/lag": 0,
            "time/generation": generation,
            "time/weight_sync": push,
            "time/training": trainer,
            "time/scoring": scoring,
            "time/wait_for_rollouts": wait,
            "timeline/step_start": start,
        }
        for i, start in enumerate(starts)
    ]
    evals = [(0, 0.4), (len(lines), win_rate)]
    lines += [{"step": s, "episode": s * episodes_per_step, "eval/win_rate": w} for s, w in evals]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "args.json").write_text(json.dumps({"episodes_per_step": episodes_per_step, "torch_threads": 2}))
    (folder / "peak_memory.json").write_text(json.dumps({"max_memory_allocated": 3 * vs_trl.GIB}))


def fake_results(tmp_path: Path, seeds=(1,)) -> list[dict]:
    plan = plan_for("--model_size", "tiny", "--seeds", ",".join(map(str, seeds)), out=str(tmp_path))
    results = []
    for i, run in enumerate(plan):
        write_fake_run(tmp_path / run.name, *FAKE[run.config], win_rate=0.5 + i / 100)
        results.append(vs_trl.collect(run, tmp_path / run.name, gpu_peak_gib=10.0 + i))
    return results


def test_results_table_and_chart_on_fake_timings(tmp_path):
    results = fake_results(tmp_path)
    # timed steps: 3 .. 6 (two warm-up steps, step 2 after the evaluation of step 0, the last has no next start);
    # episodes/s = 128 / mean step time
    by_hand = {
        "trl_online_dpo": 64.0,
        "ours_online_dpo_async0": 80.0,
        "ours_online_dpo_async1": 128.0,
        "trl_rloo": 32.0,
        "ours_rloo_async0": 64.0,
        "ours_rloo_async1": 80.0,
    }
    ratios = {
        "trl_online_dpo": 1.0,
        "ours_online_dpo_async0": 1.25,
        "ours_online_dpo_async1": 2.0,
        "trl_rloo": 1.0,
        "ours_rloo_async0": 2.0,
        "ours_rloo_async1": 2.5,
    }
    assert {r["config"]: r["episodes_per_s"] for r in results} == pytest.approx(by_hand)
    rows = vs_trl.configs(results)
    assert vs_trl.speedups(rows) == pytest.approx(ratios)
    # the median step: 1.4 s for ours async 0 (steps of 1.2, 1.2, 2.4, 1.6 s) against TRL's 2.0 s; the mean elsewhere
    assert vs_trl.speedups(rows, "episodes_per_s_median") == pytest.approx(
        ratios | {"ours_online_dpo_async0": 2.0 / 1.4}
    )
    table = vs_trl.summary_table(rows, win_rate=True)
    cells = {
        row[0]: row[1:]
        for row in ([c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:])
    }
    assert cells["ours online DPO, async 1"] == [
        "ours: vLLM engine",
        "1 of 1",
        "2.00",
        "2.00",
        "128.0",
        "1.000",
        "1.000",
        "0.500",
        "0.050",
        "0.900",
        "0.200",
        "0.050",
        "3.0",
        "12.0",
        "0.520",
        "0.520-0.520",
    ]
    assert cells["TRL RLOO"][:5] == ["TRL: HF generate", "1 of 1", "1.00", "1.00", "32.0"]
    assert cells["ours RLOO, async 1"][2:5] == ["2.50", "2.50", "80.0"]
    assert cells["ours online DPO, async 0"][2:8] == ["1.25", "1.43", "80.0", "1.600", "1.400", "0.500"]
    assert "win rate" not in vs_trl.summary_table(rows, win_rate=False)
    bars = vs_trl.plot(rows, str(tmp_path / "vs_trl.png"), "FAKE timings")
    assert [(h, a) for _, h, a in bars] == [
        (pytest.approx(by_hand[r["config"]]), f"{ratios[r['config']]:.2f}x") for r in rows
    ]
    assert (tmp_path / "vs_trl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_seeds_are_averaged_and_a_failed_run_is_a_row(tmp_path):
    """Two seeds: a setting's numbers are the means over its finished seeds, its final win rate's range their min and
    max; a failed seed counts in "seeds" and lists its error; columns no run has a number for (memory on a CPU) go."""
    results = fake_results(tmp_path, seeds=(1, 2))  # seed 2's win rates are 0.06 above seed 1's
    plan = plan_for("--model_size", "tiny", "--seeds", "1,2", out=str(tmp_path))
    failed = plan.index(next(r for r in plan if r.name == "ours_rloo_async1_s2"))
    results[failed] = vs_trl.failed(plan[failed], "exit 1: RuntimeError: | boom")
    rows = {r["config"]: r for r in vs_trl.configs(results)}
    dpo = rows["ours_online_dpo_async0"]
    assert (dpo["seeds"], dpo["runs"]) == ([1, 2], 2)
    assert (dpo["win_rate"], *dpo["win_rate_range"]) == pytest.approx((0.54, 0.51, 0.57))
    assert dpo["curve"][0] == (0, 0.4, 0.4, 0.4) and dpo["curve"][1] == pytest.approx((1024, 0.54, 0.51, 0.57))
    rloo = rows["ours_rloo_async1"]
    assert (rloo["seeds"], rloo["win_rate"], rloo["episodes_per_s"]) == ([1], 0.55, pytest.approx(80.0))
    for r in results:
        r["gpu_peak_gib"] = r["trainer_peak_gib"] = None
    table = vs_trl.summary_table(vs_trl.configs(results), win_rate=True)
    assert "| ours RLOO, async 1 | ours: vLLM engine | 1 of 2 | 2.50 | 2.50 | 80.0 |" in table
    assert "0.510-0.570" in table and "peak" not in table
    every = vs_trl.runs_table(results, win_rate=True)
    assert "| ours RLOO, async 1 | 2 | - | - | exit 1: RuntimeError: \\| boom |" in every
    assert "| TRL online DPO | 2 | 64.0 | 0.560 | - |" in every
    curves = vs_trl.curve_table(vs_trl.configs(results))
    assert curves.splitlines()[0] == "| run | 0 | 1024 |" and "| ours online DPO, async 0 | 0.400 | 0.540 |" in curves
    drawn = vs_trl.plot_curves(vs_trl.configs(results), str(tmp_path / "curves.png"), "FAKE")
    assert drawn["ours online DPO, async 0"] == [(0, 0.4), (1024, pytest.approx(0.54))]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timing_leaves_out_the_steps_an_evaluation_slows(tmp_path):
    """Our runs evaluate in the run: the timing leaves out the three steps from each evaluated step on, in every run
    alike. 10 steps, evaluations at 0, 3 and the end: steps 6, 7 and 8 are timed (9 is the last)."""
    lines = [{"step": i, "async/lag": 0, "timeline/step_start": float(i * i)} for i in range(10)]
    for m in lines:
        m |= {"time/generation": 0.1, "time/weight_sync": 0.0, "time/training": 0.2, "time/wait_for_rollouts": 0.1}
    lines += [{"step": s, "episode": s, "eval/win_rate": 0.5} for s in (0, 3, 10)]
    assert vs_trl.shadowed_steps(lines) == {0, 1, 2, 3, 4, 5, 10, 11, 12}
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = timing.summarize(str(path), leave_out=vs_trl.shadowed_steps(lines))
    assert summary["steps"] == 3 and summary["step"] == pytest.approx((13 + 15 + 17) / 3)  # (i+1)^2 - i^2 = 2i + 1
    assert summary["step_median"] == 15
    assert timing.summarize(str(path))["step"] == pytest.approx(sum(2 * i + 1 for i in range(2, 9)) / 7)


def test_report_is_a_function_of_its_json(tmp_path):
    """vs_trl.md from the JSON as written and as read back: the same text; it says how TRL generated, on which cores,
    with how many threads, and how the speed was measured."""
    results = fake_results(tmp_path)
    data = {
        "model_size": "tiny",
        "work": vs_trl.work_for(vs_trl.parse(["--out_dir", "x", "--model_size", "tiny"])),
        "setup": CPU._asdict(),
        "results": results,
        "configs": vs_trl.configs(results),
    }
    text = vs_trl.report(data)
    assert text == vs_trl.report(json.loads(json.dumps(data)))
    assert text.startswith("tiny: TRL 1.16 (HF generate) and ours, the same work, on CPU cores 0-1\n")
    assert (
        "Every run was pinned to the same 2 cores, 0-1: TRL's trainer with 2 torch threads on them, generation and "
        "training taking turns; ours split them as the scripts do: the engine on core 0, the trainer on core 1 "
        "(1 torch thread)."
    ) in text
    assert vs_trl.summary_table(data["configs"], True) in text and vs_trl.differences_table() in text


def test_committed_results_are_the_tables_of_their_json():
    """benchmark/results/vs_trl_tiny_cpu: vs_trl.md is the report of vs_trl.json, and docs/vs_trl.md shows its tables;
    at least 3 seeds of each of the six settings finished (TRL on our schedule: seed 1, the offset's test), at the
    scripts' tiny defaults, all 512 eval prompts."""
    data = json.loads((RESULTS / "vs_trl.json").read_text())
    assert (RESULTS / "vs_trl.md").read_text() == vs_trl.report(data)
    assert (RESULTS / "vs_trl_curves.png").stat().st_size < 150_000
    docs = (ROOT / "docs" / "vs_trl.md").read_text()
    assert vs_trl.summary_table(data["configs"], True) in docs and vs_trl.curve_table(data["configs"]) in docs
    assert (data["work"]["total_episodes"], data["work"]["num_eval_prompts"]) == (12800, 512)
    assert all(len(r["seeds"]) >= 3 for r in data["configs"] if not r["config"].endswith("_lr_ours"))
    assert [r["config"] for r in data["configs"] if len(r["seeds"]) >= 3] == [
        "trl_online_dpo",
        "ours_online_dpo_async0",
        "ours_online_dpo_async1",
        "trl_rloo",
        "ours_rloo_async0",
        "ours_rloo_async1",
    ]
    assert not data["setup"]["cuda"] and data["setup"]["generation"] == "hf"
    assert "/work" not in json.dumps(data) and "/tmp" not in json.dumps(data)


def test_executor_pins_reuses_and_survives_a_failure(tmp_path):
    """Stand-in commands (FAKE timings) through run_or_reuse: each runs on the cores given; a failing one is a row
    with its error line and leaves its folder unfinished; the next start reuses the finished run and starts the
    unfinished one over; a folder holding another command's run stops the benchmark."""
    staged = tmp_path / "staged"
    write_fake_run(staged, *FAKE["ours_rloo_async1"], win_rate=0.6)
    (staged / "peak_memory.json").unlink()
    core = sorted(os.sched_getaffinity(0))[-1:]
    setup = CPU._replace(cores=core)
    code = (
        "import json, os, shutil, sys; shutil.copytree(sys.argv[1], sys.argv[3], dirs_exist_ok=True); "
        "open(os.environ['PEAK_MEMORY_FILE'], 'w').write(json.dumps({'max_memory_allocated': 2 ** 30})); "
        "open(os.path.join(sys.argv[3], 'cores'), 'w').write(json.dumps(sorted(os.sched_getaffinity(0))))"
    )

    def stand_in(name: str, argv: list[str]) -> vs_trl.Run:
        folder = tmp_path / "out" / name
        env = {vs_trl.PEAK_FILE: str(folder / "peak_memory.json")}
        return vs_trl.Run(name, name, "rloo", "ours", 1, 1, "FAKE", [*argv, "--output_dir", str(folder)], env, "FAKE")

    good = stand_in("good", [sys.executable, "-c", code, str(staged)])
    failing = 'import sys; print("step 3"); print("RuntimeError: the engine died", file=sys.stderr); sys.exit(3)'
    bad = stand_in("bad", [sys.executable, "-c", failing])
    first = [vs_trl.run_or_reuse(run, setup, timeout=60) for run in (bad, good)]
    assert first[0]["error"] == "exit 3: RuntimeError: the engine died" and first[0]["episodes_per_s"] is None
    assert first[1]["error"] is None and first[1]["episodes_per_s"] == pytest.approx(80.0)
    assert (first[1]["trainer_peak_gib"], first[1]["win_rate"]) == pytest.approx((1.0, 0.6))
    assert json.loads((tmp_path / "out" / "good" / "cores").read_text()) == core
    assert not (tmp_path / "out" / "bad" / vs_trl.DONE).exists()

    (tmp_path / "out" / "good" / "cores").write_text("[]")  # a rerun would write it again
    fixed = bad._replace(argv=[sys.executable, "-c", code, str(staged), "--output_dir", str(tmp_path / "out" / "bad")])
    second = [vs_trl.run_or_reuse(run, setup, timeout=60) for run in (fixed, good)]
    assert second[1] == first[1] and (tmp_path / "out" / "good" / "cores").read_text() == "[]"  # reused
    assert second[0]["error"] is None and (tmp_path / "out" / "bad" / vs_trl.DONE).exists()  # started over

    other = good._replace(argv=[sys.executable, "-c", "pass", "--output_dir", str(tmp_path / "out" / "good")])
    with pytest.raises(SystemExit, match="holds a run of another command"):
        vs_trl.run_or_reuse(other, setup, timeout=60)
    slow = stand_in("slow", [sys.executable, "-c", "import time; time.sleep(60)"])
    assert "still running after" in vs_trl.run_or_reuse(slow, setup, timeout=1)["error"]


@pytest.mark.slow
def test_a_short_trl_run_on_the_cpu(tmp_path):
    """TRL's online DPO through the driver on the HF-generate path, 8 steps, on our schedule, started by vs_trl.py on
    the worker's core: the step timings and the learning rates our scripts would log, the policy of steps 0, 4 and 8
    evaluated by our engine on all 512 eval prompts, step 0 exactly as our run of seed 1 evaluated it."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install --no-deps -r requirements-trl.txt)")
    out = tmp_path / "out"
    command = [sys.executable, "benchmark/vs_trl.py", "--model_size", "tiny", "--out_dir", str(out)]
    command += ["--runs", "trl_online_dpo_lr_ours_s1", "--trl_lr_schedules", "ours"]
    command += ["--total_episodes", "512", "--eval_freq", "4"]
    run_script(command, timeout=300)
    folder = out / "trl_online_dpo_lr_ours_s1"
    lines = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "async/lag" in m]
    assert [m["step"] for m in steps] == list(range(8))
    assert [m["lr"] for m in steps] == pytest.approx([1e-4 * (1 - (n + 1) / 8) for n in range(8)])
    assert all(m["time/generation"] > 0 and m["time/weight_sync"] == 0 for m in steps)
    evals = {m["step"]: m["eval/win_rate"] for m in lines if "eval/win_rate" in m}
    assert sorted(evals) == [0, 4, 8]
    ours = RESULTS.parent / "miniature" / "runs" / "dpo_n1_sync_s1" / "metrics.jsonl"  # seed 1, 512 eval prompts
    ours_step0 = next(m for m in map(json.loads, ours.read_text().splitlines()) if m.get("eval/win_rate") is not None)
    assert ours_step0["step"] == 0 and evals[0] == ours_step0["eval/win_rate"]
    run_args = json.loads((folder / "args.json").read_text())
    assert run_args["cores"] == sorted(os.sched_getaffinity(0)) and run_args["torch_threads"] == len(run_args["cores"])
    data = json.loads((out / "vs_trl.json").read_text())
    assert [r["name"] for r in data["results"]] == ["trl_online_dpo_lr_ours_s1"] and not data["results"][0]["error"]
    assert data["results"][0]["steps_timed"] == 1  # step 3: 0-2 and 4-6 from an evaluation on, 7 is the last
