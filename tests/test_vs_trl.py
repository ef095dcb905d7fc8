"""benchmark/vs_trl.py without TRL and without a GPU: the plan (every run gets the same work, and each command parses
as its script or the TRL driver reads it), the differences table (also docs/vs_trl.md's), the executor and the wrapper
of our runs, and the results table and chart on FAKE timings checked against hand-computed numbers."""

import json
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
import trl_driver  # noqa: E402
import vs_trl  # noqa: E402

MODULES = {"online_dpo_async.py": online_dpo_async, "rloo_async.py": rloo_async}


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
    )


@pytest.mark.parametrize("model_size", ["tiny", "pythia-1b"])
def test_plan_gives_every_run_of_a_method_the_same_work(tmp_path, model_size):
    plan = vs_trl.make_plan(vs_trl.parse(["--out_dir", str(tmp_path), "--model_size", model_size]))
    assert [(r.name, r.method, r.side, r.async_level) for r in plan] == [
        ("trl_online_dpo", "online_dpo", "trl", None),
        ("ours_online_dpo_async0", "online_dpo", "ours", 0),
        ("ours_online_dpo_async1", "online_dpo", "ours", 1),
        ("trl_rloo", "rloo", "trl", None),
        ("ours_rloo_async0", "rloo", "ours", 0),
        ("ours_rloo_async1", "rloo", "ours", 1),
    ]
    for method in ("online_dpo", "rloo"):
        runs = [settings(r) for r in plan if r.method == method]
        assert runs[0] == runs[1] == runs[2], method
    first = settings(plan[0])
    assert (first["samples"], first["dtype"], first["engine_dtype"], first["temperature"]) == (
        2,
        "bfloat16",
        "bfloat16",
        0.7,
    )
    if model_size == "tiny":  # the scripts' defaults on the committed tiny task
        assert (first["episodes"], first["prompts_per_step"], first["lengths"], first["lr"]) == (
            12800,
            32,
            (12, 12),
            1e-4,
        )
        assert first["models"][0] == str(ROOT / "benchmark" / "tiny_task" / "sft")
    else:  # speed.py --model_size pythia-1b's models and TLDR's shapes: 30 steps of 64 prompts x 2
        assert (first["episodes"], first["prompts_per_step"], first["lengths"], first["lr"]) == (
            3840,
            64,
            (512, 53),
            3e-6,
        )
        assert first["models"][0] == str(tmp_path.resolve() / "models" / "pythia-1b-prompt512" / "sft")
    overridden = vs_trl.make_plan(
        vs_trl.parse(["--out_dir", str(tmp_path), "--model_size", model_size, "--total_episodes", "640"])
    )
    assert {settings(r)["episodes"] for r in overridden} == {640}


def test_trl_gets_our_prompts_in_our_order():
    queries = [f"q{i}" for i in range(10)]
    rows = trl_driver.ordered_prompts(queries, num_steps=7, batch_size=3, seed=5)
    for step in range(7):
        indices = online_dpo_async.prompt_indices_for_step(step, 10, 3, 5)
        assert rows[3 * step : 3 * step + 3] == [queries[i] for i in indices]


def test_driver_flags_are_required_and_trl_is_not_imported():
    with pytest.raises(SystemExit):
        trl_driver.parse_args(["--trainer", "rloo"])
    plan = vs_trl.make_plan(vs_trl.parse(["--out_dir", "runs/x", "--model_size", "tiny"]))
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
    rloo = vs_trl.differences_table(methods=("rloo",))
    assert "tied pairs" not in rloo and "| RLOO | generation batch |" in rloo and "| both | engine |" in rloo


def test_readme_section_shows_the_command_and_the_table(tmp_path):
    """docs/vs_trl.md (the README's Documentation list links it) shows the commands and the differences table."""
    readme = (ROOT / "README.md").read_text()
    assert "(docs/vs_trl.md)" in readme
    section = (ROOT / "docs" / "vs_trl.md").read_text()
    assert vs_trl.differences_table() in section
    assert "has not been run on a GPU yet" in section
    commands = re.search(r"```bash\n(.*?)```", section, re.S).group(1).strip().splitlines()
    for command in (c.split("  #")[0] for c in commands if c.startswith("python benchmark/vs_trl.py")):
        words = shlex.split(command)
        vs_trl.make_plan(vs_trl.parse(words[2:]))
    layout = readme[readme.index("## Layout") :]
    assert "requirements-trl.txt" in layout and "benchmark/vs_trl.py" in layout
    assert "trl==1.16.0" in (ROOT / "requirements-trl.txt").read_text()


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    out = tmp_path / "out"
    proc = run_script(
        [sys.executable, "benchmark/vs_trl.py", "--dry_run", "--model_size", "tiny", "--out_dir", str(out)], timeout=120
    )
    for run in vs_trl.make_plan(vs_trl.parse(["--out_dir", str(out), "--model_size", "tiny"])):
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
    "trl_online_dpo": (128, [2.0] * 6, 0.9, 0.1, 1.0, 0.2, 1.0),
    "ours_online_dpo_async0": (128, [1.6] * 6, 0.5, 0.05, 1.0, 0.2, 0.55),
    "ours_online_dpo_async1": (128, [1.0, 3.0, 1.0, 1.0, 1.0, 1.0], 0.5, 0.05, 0.9, 0.2, 0.05),
    "trl_rloo": (128, [4.0] * 6, 2.0, 0.1, 1.9, 0.3, 2.1),
    "ours_rloo_async0": (128, [2.0] * 6, 0.8, 0.05, 1.1, 0.3, 0.85),
    "ours_rloo_async1": (128, [1.6] * 6, 0.8, 0.05, 1.5, 0.3, 0.05),
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
    lines += [{"step": 0, "eval/win_rate": 0.4}, {"step": len(lines), "eval/win_rate": win_rate}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "args.json").write_text(json.dumps({"episodes_per_step": episodes_per_step}))
    (folder / "peak_memory.json").write_text(json.dumps({"max_memory_allocated": 3 * vs_trl.GIB}))


def test_results_table_and_chart_on_fake_timings(tmp_path):
    plan = vs_trl.make_plan(vs_trl.parse(["--out_dir", str(tmp_path), "--model_size", "tiny"]))
    results = []
    for i, run in enumerate(plan):
        write_fake_run(tmp_path / run.name, *FAKE[run.name], win_rate=0.5 + i / 100)
        results.append(vs_trl.collect(run, tmp_path / run.name, gpu_peak_gib=10.0 + i))
    # timed steps: 2 .. 4 (two warm-up steps, the last has no next start); episodes/s = 128 / mean step time
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
    assert {r["name"]: r["episodes_per_s"] for r in results} == pytest.approx(by_hand)
    assert vs_trl.speedups(results) == pytest.approx(ratios)
    table = vs_trl.results_table(results, win_rate=True)
    cells = {
        row[0]: row[1:]
        for row in ([c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines()[2:])
    }
    assert cells["ours online DPO, async 1"] == [
        "2.00",
        "128.0",
        "1.000",
        "0.500",
        "0.050",
        "0.900",
        "0.200",
        "0.050",
        "3.0",
        "12.0",
        "0.520",
    ]
    assert cells["TRL RLOO"][:2] == ["1.00", "32.0"] and cells["ours RLOO, async 1"][:2] == ["2.50", "80.0"]
    assert "win rate" not in vs_trl.results_table(results, win_rate=False)
    bars = vs_trl.plot(results, str(tmp_path / "vs_trl.png"), "FAKE timings")
    assert [(h, a) for _, h, a in bars] == [(pytest.approx(by_hand[r.name]), f"{ratios[r.name]:.2f}x") for r in plan]
    assert (tmp_path / "vs_trl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_executor_runs_a_command_and_reports_failure(tmp_path):
    """A stand-in command that writes what a run writes (FAKE timings), its peak memory where $PEAK_MEMORY_FILE says."""
    staged, folder = tmp_path / "staged", tmp_path / "fake"
    write_fake_run(staged, *FAKE["ours_rloo_async1"], win_rate=0.6)
    (staged / "peak_memory.json").unlink()
    code = (
        "import json, os, shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True); "
        "open(os.environ['PEAK_MEMORY_FILE'], 'w').write(json.dumps({'max_memory_allocated': 2 ** 30})); print('ran')"
    )
    env = {vs_trl.PEAK_FILE: str(folder / "peak_memory.json")}
    run = vs_trl.Run("fake", "rloo", "ours", 1, [sys.executable, "-c", code, str(staged), str(folder)], env, "FAKE")
    gpu_peak = vs_trl.execute(run, folder, interval=0.05)
    assert "ran" in (folder / "run.log").read_text()
    r = vs_trl.collect(run, folder, gpu_peak)
    assert (r["episodes_per_s"], r["trainer_peak_gib"], r["win_rate"]) == pytest.approx((80.0, 1.0, 0.6))
    failing = run._replace(argv=[sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(SystemExit, match="exited with 3"):
        vs_trl.execute(failing, tmp_path / "failing", interval=0.05)
