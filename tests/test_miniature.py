"""benchmark/miniature.py and benchmark/plot_miniature.py: the plan against the paper's design and the
async level sweep, written out by hand; the results tables against hand computation on hand-written
metrics.jsonl files; the PNGs; skipping finished runs and starting unfinished ones over; and a few runs
of the smoke mode end to end."""

import dataclasses
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_script

sys.path.insert(0, str(ROOT / "benchmark"))
import miniature  # noqa: E402
import plot_miniature  # noqa: E402

PLAN_ARGS = dict(seeds=[1, 2], episodes=6144, learning_rate=1e-4, micro_batch=32, num_evals=3, eval_prompts=512)


def flag_dict(flags: list[str]) -> dict[str, str | bool]:
    """`--a 1 --b --no_c` -> {"a": "1", "b": True, "no_c": True}."""
    out, i = {}, 0
    while i < len(flags):
        assert flags[i].startswith("--"), flags[i]
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            out[flags[i][2:]] = flags[i + 1]
            i += 2
        else:
            out[flags[i][2:]] = True
            i += 1
    return out


def by_name(plan) -> dict:
    return {run.name: run for run in plan}


# ---------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------
def test_plan_runs_are_the_papers_comparisons_and_the_async_level_sweep():
    """Per seed: the N = 1..16 sweep (sync) for the four methods (figure 4), async N = 1 for the three
    algorithm files (figure 1), K = 4 async online DPO (figure 8); and the async level sweep, k = 1, 2, 4, 8
    at N = 1 for online DPO, RLOO, RLOO with PRIME-RL's loss (and its k = 0) and PPO; 38 runs, seed 1's
    before seed 2's."""
    plan = miniature.make_plan(**PLAN_ARGS)
    expected = []
    for seed in (1, 2):
        for method in ("dpo", "bo2", "rloo", "prime_rl", "ppo"):
            expected += [f"{method}_n{n}_sync_s{seed}" for n in ((1,) if method == "prime_rl" else (1, 2, 4, 8, 16))]
            if method != "bo2":
                expected += [f"{method}_n1_async_s{seed}"] + [f"{method}_n1_async{k}_s{seed}" for k in (2, 4, 8)]
        expected.append(f"dpo_n1_async_k4_s{seed}")
    assert [run.name for run in plan] == expected
    assert len(plan) == 76


def test_plan_flags_by_hand():
    """Every run's N, K, async level, lr, seed, episodes, loss and evaluation spacing, written out by hand."""
    runs = by_name(miniature.make_plan(**PLAN_ARGS))
    # (file, N, samples flag and K, async, lr, steps, eval_freq, algorithm flag)
    expected = {
        "dpo_n1_sync_s1": (
            "online_dpo_async.py",
            1,
            ("num_samples", "2"),
            0,
            "0.0001",
            96,
            32,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n2_sync_s1": (
            "online_dpo_async.py",
            2,
            ("num_samples", "2"),
            0,
            "0.0001",
            48,
            16,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n4_sync_s1": (
            "online_dpo_async.py",
            4,
            ("num_samples", "2"),
            0,
            "0.0001",
            24,
            8,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n8_sync_s1": (
            "online_dpo_async.py",
            8,
            ("num_samples", "2"),
            0,
            "0.0001",
            12,
            4,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n16_sync_s2": (
            "online_dpo_async.py",
            16,
            ("num_samples", "2"),
            0,
            "0.0001",
            6,
            2,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n1_async_s2": (
            "online_dpo_async.py",
            1,
            ("num_samples", "2"),
            1,
            "0.0001",
            96,
            32,
            ("loss_type", "sigmoid"),
        ),
        "dpo_n1_async_k4_s1": (
            "online_dpo_async.py",
            1,
            ("num_samples", "4"),
            1,
            "5e-05",
            48,
            16,
            ("loss_type", "sigmoid"),
        ),
        "bo2_n4_sync_s1": (
            "online_dpo_async.py",
            4,
            ("num_samples", "2"),
            0,
            "0.0001",
            24,
            8,
            ("loss_type", "best_of_k_sft"),
        ),
        "bo2_n16_sync_s2": (
            "online_dpo_async.py",
            16,
            ("num_samples", "2"),
            0,
            "0.0001",
            6,
            2,
            ("loss_type", "best_of_k_sft"),
        ),
        "rloo_n1_sync_s1": ("rloo_async.py", 1, ("rloo_k", "2"), 0, "0.0001", 96, 32, ("kl_coef", "0.05")),
        "rloo_n8_sync_s2": ("rloo_async.py", 8, ("rloo_k", "2"), 0, "0.0001", 12, 4, ("kl_coef", "0.05")),
        "rloo_n1_async_s1": ("rloo_async.py", 1, ("rloo_k", "2"), 1, "0.0001", 96, 32, ("kl_coef", "0.05")),
        "ppo_n1_sync_s1": ("ppo_async.py", 1, None, 0, "0.0001", 192, 64, ("kl_coef", "0.05")),
        "ppo_n16_sync_s1": ("ppo_async.py", 16, None, 0, "0.0001", 12, 4, ("kl_coef", "0.05")),
        "ppo_n1_async_s2": ("ppo_async.py", 1, None, 1, "0.0001", 192, 64, ("kl_coef", "0.05")),
        # the async level sweep: N = 1, the same steps at every k
        "dpo_n1_async8_s1": ("online_dpo_async.py", 1, ("num_samples", "2"), 8, "0.0001", 96, 32, ("beta", "0.1")),
        "rloo_n1_async4_s2": ("rloo_async.py", 1, ("rloo_k", "2"), 4, "0.0001", 96, 32, ("loss_type", "proximal_rloo")),
        "prime_rl_n1_sync_s1": ("rloo_async.py", 1, ("rloo_k", "2"), 0, "0.0001", 96, 32, ("loss_type", "prime_rl")),
        "prime_rl_n1_async2_s2": ("rloo_async.py", 1, ("rloo_k", "2"), 2, "0.0001", 96, 32, ("kl_coef", "0.0")),
        "ppo_n1_async8_s1": ("ppo_async.py", 1, None, 8, "0.0001", 192, 64, ("kl_coef", "0.05")),
    }
    for name, (script, n, samples, async_level, lr, steps, eval_freq, (algo_flag, algo_value)) in expected.items():
        run, flags = runs[name], flag_dict(runs[name].flags)
        assert run.script == script, name
        assert flags["num_mini_batches"] == str(n) and flags["async_level"] == str(async_level), name
        assert flags["learning_rate"] == lr and flags["total_episodes"] == "6144", name
        assert flags["seed"] == name[-1] and flags["exp_name"] == name, name
        assert flags["local_micro_batch_size"] == "32" and flags["gradient_accumulation_steps"] == "1", name
        assert flags["num_ppo_epochs"] == "1", name  # T = 1 everywhere: figure 7's T sweep is not in the miniature
        assert flags["eval_freq"] == str(eval_freq) and flags["num_eval_prompts"] == "512", name
        assert flags[algo_flag] == algo_value, name
        if samples is None:
            assert "num_samples" not in flags and "rloo_k" not in flags, name
        else:
            assert flags[samples[0]] == samples[1], name
        assert run.num_steps == steps, name
        assert "output_dir" not in flags and run.argv(Path("/out"))[-2:] == ["--output_dir", f"/out/{name}"]
        if name.startswith("prime_rl"):  # PRIME-RL's objective: mu the engine's logprobs, no KL term, delta 8
            assert (flags["loss_type"], flags["old_logprobs"], flags["kl_coef"], flags["token_ratio_cap"]) == (
                "prime_rl",
                "engine",
                "0.0",
                "8.0",
            )
        elif name.startswith("rloo"):
            assert (flags["loss_type"], flags["old_logprobs"], flags["advantage"]) == (
                "proximal_rloo",
                "trainer",
                "leave_one_out",
            )


def test_plan_keeps_optimizer_updates_fixed_across_n_and_halves_them_for_k4():
    """Section 3.2: N mini-batches per generated batch at equal episodes means 1/N the generations and the
    same number of optimizer updates (so the same linear lr decay); figure 8: K = 4 with half the lr
    trains half the steps on the same episodes."""
    runs = by_name(miniature.make_plan(**PLAN_ARGS))
    for method, updates in (("dpo", 96), ("bo2", 96), ("rloo", 96), ("ppo", 192)):
        for n in (1, 2, 4, 8, 16):
            run = runs[f"{method}_n{n}_sync_s1"]
            assert run.num_steps * n == updates, run.name
    k2, k4 = runs["dpo_n1_async_s1"], runs["dpo_n1_async_k4_s1"]
    assert k4.num_steps * 2 == k2.num_steps and k4.learning_rate * 2 == k2.learning_rate
    assert k4.total_episodes == k2.total_episodes and k4.async_level == k2.async_level == 1
    for method, updates in (("dpo", 96), ("rloo", 96), ("prime_rl", 96), ("ppo", 192)):  # the async level sweep
        for k in ("sync", "async", "async2", "async4", "async8"):
            assert runs[f"{method}_n1_{k}_s1"].num_steps == updates
    # the two seeds differ only in seed and name
    for run in miniature.make_plan(**PLAN_ARGS)[:38]:
        twin = runs[run.name[:-1] + "2"]
        diff = {k for k, v in flag_dict(run.flags).items() if flag_dict(twin.flags)[k] != v}
        assert diff == {"seed", "exp_name"}, run.name


@pytest.mark.parametrize("script", ["online_dpo_async.py", "rloo_async.py", "ppo_async.py"])
def test_plan_spells_out_every_flag_that_defines_a_run(script):
    """No run relies on a default: every field of the file's Args is given, except where output goes
    (--output_dir, added per run), tracking, --resume, how many checkpoints are kept, how many samples are
    printed and how long processes wait for each other and for the engine. The file's parser accepts them, and they are the tiny task's defaults but for what the plan sets on
    purpose."""
    import importlib

    import tyro

    module = importlib.import_module(script[:-3])
    not_defining = {"output_dir", "track", "wandb_project", "wandb_entity", "resume", "keep_checkpoints"}
    # how long processes wait for each other and for the engine: no result
    not_defining |= {"num_sample_completions", "collective_timeout_minutes", "engine_timeout_minutes"}
    # GPU flags added after the reproduction ran; on a CPU their defaults are what it ran with (float32, an engine
    # without CUDA graphs and GPU placement, one engine of one GPU, no recomputation; the memory fraction, given as
    # 0.9, is not used)
    gpu_flags = {"dtype", "vllm_placement", "vllm_enforce_eager", "gradient_checkpointing"}
    gpu_flags |= {"vllm_num_engines", "vllm_tensor_parallel_size"}
    # added after the reproduction ran too: the evaluation prompts of a file of their own; the tiny task's folder
    # has its test split, and left out (None) is what the runs used
    later = {"dataset_eval_file"}
    # and LoRA's (issue 53): left out, --lora_rank 0, the whole policy trains, as the runs did
    later |= {"lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_save_merged", "lora_value_model"}
    # and in-flight updates' (issue 54): off, each batch generated whole, as the runs did
    later |= {"inflight_updates", "inflight_segment_tokens", "inflight_kv"}
    # the file's methods (Best-of-2 is online DPO's with another loss); PRIME-RL's objective sets its loss, its mu and
    # its KL term on purpose too, and GRPO (the corrections sweep's) its loss, advantage, normaliser and KL term
    methods = {"online_dpo_async.py": ["dpo"], "rloo_async.py": ["rloo", "prime_rl", "grpo"], "ppo_async.py": ["ppo"]}
    plans = miniature.make_plan(**PLAN_ARGS) + miniature.make_correction_plan(**PLAN_ARGS)
    for method in methods[script]:
        run = next(r for r in plans if r.method == method)
        given = {k.removeprefix("no_") for k in flag_dict(run.flags)}
        # --loss_normalization is GRPO's alone: the other losses refuse it
        grpo_only = {"loss_normalization"} if script == "rloo_async.py" and method != "grpo" else set()
        fields = {f.name for f in dataclasses.fields(module.Args)}
        assert given == fields - not_defining - gpu_flags - later - grpo_only, method
        parsed, default = vars(tyro.cli(module.Args, args=run.flags)), vars(module.Args())
        for path in (
            "dataset_name",
            "sft_model_path",
            "reward_model_path",
        ):  # relative to the repository root, where runs start
            parsed[path] = str(ROOT / parsed[path])
        on_purpose = {
            "exp_name",
            "total_episodes",
            "async_level",
            "eval_freq",
            "num_eval_prompts",
        }  # seed 1, N = 1, lr 1e-4: the defaults
        if method == "prime_rl":
            on_purpose |= {"loss_type", "old_logprobs", "kl_coef"}
        if method == "grpo":
            on_purpose |= {"loss_type", "advantage", "loss_normalization", "kl_term"}
        if method in ("prime_rl", "grpo"):
            module.check_loss_flags(tyro.cli(module.Args, args=run.flags))
        # spelled out as the reproduction ran, where the defaults now say auto (float32 on a CPU) and None (unused on
        # a CPU)
        resolved_on_cpu = {"vllm_dtype", "vllm_gpu_memory_utilization"}
        # spelled out where the defaults say None: the loss's own (rloo_async.loss_setting), which they are
        resolved_by_loss = {"advantage", "loss_normalization", "kl_term"} if script == "rloo_async.py" else set()
        for name in resolved_by_loss - on_purpose:
            parsed_args = tyro.cli(module.Args, args=run.flags)
            assert module.loss_setting(parsed_args, name) == module.loss_setting(module.Args(), name), (method, name)
        changed = {k for k in default if parsed[k] != default[k]}
        assert changed - resolved_on_cpu - resolved_by_loss == on_purpose - resolved_by_loss, method


def test_plan_bad_sizes_name_the_flag():
    with pytest.raises(
        SystemExit, match="--episodes 6000 must be a multiple of 1024, so that every run has whole steps"
    ):
        miniature.make_plan(**{**PLAN_ARGS, "episodes": 6000})
    with pytest.raises(SystemExit, match="--num_evals 4 does not divide the 6 steps"):
        miniature.make_plan(**{**PLAN_ARGS, "num_evals": 4})


def test_time_estimate_by_hand():
    """start + episodes x (A + B / batches per step, K = 4 counting as 2) + evaluations (step 0 and 3 more)."""
    runs = by_name(miniature.make_plan(**PLAN_ARGS))
    assert miniature.estimate_s(runs["dpo_n1_sync_s1"], 3) == pytest.approx(22 + 6144 * (0.0035 + 0.0042) + 4 * 1.2)
    assert miniature.estimate_s(runs["dpo_n1_async_k4_s1"], 3) == pytest.approx(
        22 + 6144 * (0.0035 + 0.0042 / 2) + 4 * 1.2
    )
    assert miniature.estimate_s(runs["ppo_n4_sync_s2"], 3) == pytest.approx(22 + 6144 * (0.0057 + 0.0050 / 4) + 4 * 1.2)


def test_dry_run_prints_the_plan_and_its_estimate(tmp_path):
    proc = run_script(
        [sys.executable, "benchmark/miniature.py", "--out_dir", str(tmp_path / "m"), "--dry_run"], timeout=60
    )
    plan = miniature.make_plan(**PLAN_ARGS)
    total = sum(miniature.estimate_s(run, 3) for run in plan)
    assert f"76 runs, 0 done; estimated time of the 76 left: {total / 60:.0f} min on 2 quiet CPU cores" in proc.stdout
    # the paper's comparisons fit 90 minutes with room for a busier machine; the async level sweep's 28 runs add
    # about 40 minutes
    papers = [r for r in plan if r.method != "prime_rl" and r.async_level <= 1]
    assert len(papers) == 48 and sum(miniature.estimate_s(run, 3) for run in papers) < 90 * 60 / 1.5
    assert total < 90 * 60
    assert proc.stdout.count("--output_dir") == 76 and not (tmp_path / "m").exists()


# ---------------------------------------------------------------------------------------------
# Skipping finished runs, starting unfinished ones over
# ---------------------------------------------------------------------------------------------
FAKE_SCRIPT = """import json, sys
argv = sys.argv[1:]
out = argv[argv.index("--output_dir") + 1]
open(out + "/args.json", "w").write(json.dumps({"git_revision": "abc123"}))
sys.exit(int(argv[argv.index("--seed") + 1]) - 1)  # seed 1 succeeds, seed 2 fails
"""


def fake_run(tmp_path: Path, seed: int = 1):
    script = tmp_path / "fake_script.py"
    script.write_text(FAKE_SCRIPT)
    run = miniature.make_run(
        "dpo", 1, 0, seed, episodes=64, learning_rate=1e-4, micro_batch=32, num_evals=1, eval_prompts=16
    )
    return dataclasses.replace(run, script=str(script))


def test_execute_starts_an_unfinished_run_over_and_marks_it_finished(tmp_path):
    run, out = fake_run(tmp_path), tmp_path / "out"
    (out / run.name).mkdir(parents=True)
    (out / run.name / "metrics.jsonl").write_text('{"step": 0}\n')  # left by an interrupted run
    assert not miniature.is_finished(run, out)
    wall_s = miniature.execute(run, out, env=None)
    assert not (out / run.name / "metrics.jsonl").exists()
    marker = json.loads((out / run.name / "miniature.json").read_text())
    assert marker["flags"] == run.flags and marker["git_revision"] == "abc123" and marker["wall_s"] == wall_s
    assert marker["argv"][-2:] == ["--output_dir", str(out / run.name)]
    assert miniature.is_finished(run, out)
    # the same name with other flags is not silently reused
    changed = dataclasses.replace(run, flags=[*run.flags[:-1], "999"])
    with pytest.raises(SystemExit, match=f"holds run {run.name} made with other flags"):
        miniature.is_finished(changed, out)


def test_a_record_made_before_rloo_gained_its_loss_flags_is_the_same_run(tmp_path):
    """The committed RLOO runs were recorded before rloo_async.py had --loss_type, --advantage and --token_ratio_cap,
    and before --kl_term and the corrections' flags; the PRIME-RL runs after the first and before the second: a record
    without the newest generations of flags, at the values that run what it ran, is the run; one without them where the
    run sets another value (PRIME-RL's loss), one without an older generation but with a newer, or with any other
    difference is not."""
    plan = by_name(miniature.make_plan(**PLAN_ARGS))
    rloo, prime = plan["rloo_n1_async_s1"], plan["prime_rl_n1_async_s1"]

    def without(flags, names):
        flags = list(flags)
        for flag in names:
            del flags[flags.index(flag) : flags.index(flag) + 2]
        return flags

    first, second = (list(generation) for generation in miniature.ADDED_FLAGS["rloo_async.py"])
    assert "--kl_term" in second and "--correction" in second and "--loss_type" in first
    for run, recorded, same in [
        (rloo, rloo.flags, True),
        (rloo, without(rloo.flags, second), True),
        (rloo, without(rloo.flags, first + second), True),
        (rloo, without(rloo.flags, first), False),
        (rloo, [*without(rloo.flags, first + second)[:-1], "9"], False),
        (prime, without(prime.flags, second), True),
        (prime, without(prime.flags, first + second), False),
        (prime, [f for f in prime.flags if f not in ("--loss_type", "prime_rl")], False),
    ]:
        (tmp_path / run.name).mkdir(exist_ok=True)
        miniature.write_json_atomically(tmp_path / run.name / "miniature.json", {"flags": recorded})
        if same:
            assert miniature.is_finished(run, tmp_path)
        else:
            with pytest.raises(SystemExit, match="made with other flags"):
                miniature.is_finished(run, tmp_path)


def test_execute_failure_leaves_no_marker(tmp_path):
    run, out = fake_run(tmp_path, seed=2), tmp_path / "out"
    with pytest.raises(RuntimeError, match="exited with 1"):
        miniature.execute(run, out, env=None)
    assert not (out / run.name / "miniature.json").exists()


def test_main_skips_finished_runs(tmp_path, monkeypatch):
    out = tmp_path / "out"
    plan = by_name(miniature.make_plan(**PLAN_ARGS))
    done = plan["dpo_n1_sync_s1"]
    (out / done.name).mkdir(parents=True)
    miniature.write_json_atomically(out / done.name / "miniature.json", {"flags": done.flags})
    executed, plotted = [], []
    monkeypatch.setattr(miniature, "execute", lambda run, out_dir, env: executed.append(run.name) or 1.0)
    monkeypatch.setattr(plot_miniature, "main", lambda argv: plotted.append(argv))
    code = miniature.main(["--out_dir", str(out), "--only", "dpo_n1_sync_s1,dpo_n2_sync_s1,ppo_n16_*"])
    assert code == 0
    assert executed == ["dpo_n2_sync_s1", "ppo_n16_sync_s1", "ppo_n16_sync_s2"]
    assert plotted == [[str(out.resolve()), "--out", str(out.resolve() / "plots")]]


# ---------------------------------------------------------------------------------------------
# The plots and the table on hand-written runs
# ---------------------------------------------------------------------------------------------
def write_run(
    runs_dir: Path,
    method: str,
    n: int,
    k: int,
    async_level: int,
    seed: int,
    evals: list[tuple],
    train: list[tuple],
    perplexity_key: str | None = "eval/ref_ppl",
    correction: str | None = None,
    fractions: list[tuple] | None = None,
    lora_rank: int = 0,
) -> None:
    """evals: (step, episode, win rate, perplexity); train: (step, objective/kl, step start, step time);
    fractions: per training step, the correction's (truncated, masked) fractions."""
    name = f"{method}_n{n}_async{async_level}_k{k}" + (f"_{correction}" if correction else "") + f"_s{seed}"
    name += f"_lora{lora_rank}" if lora_rank else ""
    folder = runs_dir / name
    folder.mkdir(parents=True)
    meta = {
        "name": folder.name,
        "method": method,
        "num_mini_batches": n,
        "num_samples": k,
        "async_level": async_level,
        "seed": seed,
        **({"correction": correction} if correction else {}),
        **({"lora_rank": lora_rank} if lora_rank else {}),
    }
    (folder / "miniature.json").write_text(json.dumps(meta))
    lines = [
        {
            "step": s,
            "episode": 64 * (s + 1),
            "async/lag": 0,
            "objective/kl": kl,
            "timeline/step_start": t0,
            "time/step": dt,
        }
        for s, kl, t0, dt in train
    ]
    for line, (truncated, masked) in zip(lines, fractions or []):
        line.update({"policy/correction_truncated_frac": truncated, "policy/correction_masked_frac": masked})
    for step, episode, win, ppl in evals:
        line = {"step": step, "episode": episode, "eval/win_rate": win}
        if perplexity_key:
            line[perplexity_key] = ppl
        lines.insert(min(step + 1, len(lines)), line)  # evaluations arrive between training lines
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def hand_written_runs(runs_dir: Path, perplexity_key: str | None = "eval/ref_ppl") -> None:
    train = [(0, 0.0, 0.5, 1.0), (1, 0.2, 1.5, 1.0), (2, 0.4, 2.5, 1.5), (3, 0.6, 4.0, 1.0)]
    write_run(
        runs_dir,
        "dpo",
        1,
        2,
        0,
        1,
        [(0, 0, 0.40, 1.20), (2, 128, 0.50, 1.25), (4, 256, 0.60, 1.30)],
        train,
        perplexity_key,
    )
    train2 = [(0, 0.0, 0.5, 2.0), (1, 0.4, 2.5, 2.0), (2, 0.8, 4.5, 2.0), (3, 1.0, 6.5, 2.0)]
    write_run(
        runs_dir,
        "dpo",
        1,
        2,
        0,
        2,
        [(0, 0, 0.42, 1.22), (2, 128, 0.56, 1.27), (4, 256, 0.70, 1.40)],
        train2,
        perplexity_key,
    )
    write_run(runs_dir, "dpo", 1, 2, 1, 1, [(0, 0, 0.40, 1.20), (4, 256, 0.58, 1.33)], train, perplexity_key)
    write_run(runs_dir, "ppo", 2, 1, 0, 1, [(0, 0, 0.41, 1.21), (2, 128, 0.52, 1.24)], train[:2], perplexity_key)
    (runs_dir / "unfinished").mkdir()  # no miniature.json: ignored
    (runs_dir / "unfinished" / "metrics.jsonl").write_text("not json\n")


def table_rows(text: str, which: int = 0) -> list[list[str]]:
    """The rows of the text's first Markdown table (`which` = 1: its second), header left out."""
    tables = [[]]
    for line in text.splitlines():
        if line.startswith("| "):
            tables[-1].append([c.strip() for c in line.strip("|").split("|")])
        elif tables[-1] and not line.startswith("|---"):
            tables.append([])
    return tables[which][1:]


def test_table_against_hand_computation(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    hand_written_runs(runs_dir)
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert "ref. perplexity (final eval)" in text
    # dpo sync N=1: final win rates 0.60, 0.70 -> mean 0.650, range 0.600-0.700; perplexities 1.30, 1.40 -> 1.350;
    # training time: end of step 3 = 4.0 + 1.0 = 5.0 and 6.5 + 2.0 = 8.5 -> 6.75
    # dpo async N=1: 0.58, 1.33, 5.0;  ppo N=2 (two steps): 0.52, 1.24, end of step 1 = 1.5 + 1.0 = 2.5
    assert table_rows(text) == [
        ["online DPO", "1", "2", "0", "2", "0.650", "0.600 - 0.700", "1.350", "6.8"],
        ["online DPO", "1", "2", "1", "1", "0.580", "0.580 - 0.580", "1.330", "5.0"],
        ["PPO", "2", "1", "0", "1", "0.520", "0.520 - 0.520", "1.240", "2.5"],
    ]
    rows, use_perplexity = plot_miniature.summarise(plot_miniature.read_runs(runs_dir))
    assert use_perplexity
    # the seed-averaged learning curve and its wall-time axis: version v exists at the end of step v - 1
    assert rows[0]["episodes"] == [0, 128, 256]
    assert rows[0]["curve"] == pytest.approx([0.41, 0.53, 0.65])
    assert rows[0]["times"] == pytest.approx([0.0, (2.5 + 4.5) / 2, (5.0 + 8.5) / 2])
    assert rows[0]["kl_min"] == 1.30 and rows[0]["kl_max"] == 1.40


def test_async_level_sweep_table_and_figure_against_hand_computation(tmp_path):
    """Runs beyond async level 1 make the sweep's table (after the first, which keeps the paper's comparisons): per
    method at N = 1 every k, with the seeds' range of the win rate and of the KL proxy; and its figure."""
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    hand_written_runs(runs_dir)
    train = [(0, 0.0, 0.5, 1.0), (1, 0.2, 1.5, 1.0)]
    write_run(runs_dir, "dpo", 1, 2, 4, 1, [(0, 0, 0.40, 1.20), (2, 128, 0.55, 1.45)], train)
    write_run(runs_dir, "prime_rl", 1, 2, 0, 1, [(0, 0, 0.40, 1.20), (2, 128, 0.50, 1.50)], train)
    write_run(runs_dir, "prime_rl", 1, 2, 0, 2, [(0, 0, 0.40, 1.20), (2, 128, 0.54, 1.60)], train)
    write_run(runs_dir, "prime_rl", 1, 2, 4, 1, [(0, 0, 0.40, 1.20), (2, 128, 0.45, 1.70)], train)
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert [r[:4] for r in table_rows(text)] == [
        ["online DPO", "1", "2", "0"],
        ["online DPO", "1", "2", "1"],
        ["PPO", "2", "1", "0"],
    ]
    # dpo k = 0: win 0.60, 0.70; perplexity 1.30, 1.40; k = 1, 4: one seed each; prime_rl k = 0: 0.50, 0.54 and 1.50,
    # 1.60; training time: the end of the last step, 2.5 s for the two-step runs
    assert table_rows(text, 1) == [
        ["online DPO", "0", "2", "0.650", "0.600 - 0.700", "1.350", "1.300 - 1.400", "6.8"],
        ["online DPO", "1", "1", "0.580", "0.580 - 0.580", "1.330", "1.330 - 1.330", "5.0"],
        ["online DPO", "4", "1", "0.550", "0.550 - 0.550", "1.450", "1.450 - 1.450", "2.5"],
        ["RLOO, PRIME-RL's loss", "0", "2", "0.520", "0.500 - 0.540", "1.550", "1.500 - 1.600", "2.5"],
        ["RLOO, PRIME-RL's loss", "4", "1", "0.450", "0.450 - 0.450", "1.700", "1.700 - 1.700", "2.5"],
    ]
    # the README's summary: win rate (perplexity) per k, an empty cell where a method has no run
    assert table_rows(
        plot_miniature.staleness_summary(*plot_miniature.summarise(plot_miniature.read_runs(runs_dir)))
    ) == [
        ["online DPO", "0.650 (1.35)", "0.580 (1.33)", "0.550 (1.45)"],
        ["RLOO, PRIME-RL's loss", "0.520 (1.55)", "", "0.450 (1.70)"],
    ]
    data = (out / "win_rate_vs_async_level.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_table_falls_back_to_objective_kl_and_says_so(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    hand_written_runs(runs_dir, perplexity_key=None)
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert (
        "mean objective/kl, last quarter of steps" in text
        and "reference perplexity not logged, under one name, by every run" in text
    )
    # last quarter of 4 steps = the last step: seed 1 0.6, seed 2 1.0 -> 0.800; ppo: 2 steps -> last one, 0.2
    rows = table_rows(text)
    assert [r[7] for r in rows] == ["0.800", "0.600", "0.200"]


def test_perplexity_key_newer_name_first_and_never_mixed(tmp_path):
    line = lambda **keys: {"evals": [{"step": 1, "eval/win_rate": 0.5, **keys}]}  # noqa: E731
    both, old, new = (
        line(**{"eval/ref_ppl": 9.9, "eval/ref_perplexity": 1.3}),
        line(**{"eval/ref_ppl": 1.2}),
        line(**{"eval/ref_perplexity": 1.3}),
    )
    assert (
        plot_miniature.perplexity_key([both]) == "eval/ref_perplexity"
        and plot_miniature.kl_proxy(both, "eval/ref_perplexity") == 1.3
    )
    assert plot_miniature.perplexity_key([both, old]) == "eval/ref_ppl"
    assert plot_miniature.perplexity_key([old, new]) is None  # two different averages: fall back to objective/kl


def test_pngs_are_written_atomically(tmp_path):
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    hand_written_runs(runs_dir)
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    names = sorted(p.name for p in out.iterdir())
    assert names == ["learning_curves.png", "results.md", "win_rate_vs_kl.png", "win_rate_vs_time.png"]  # no .tmp left
    for name in names:
        if name.endswith(".png"):
            data = (out / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name


def test_copy_runs_keeps_the_table_and_drops_local_paths(tmp_path):
    """--copy_runs: the copies give the same table, and the record's argv (local paths) is left out."""
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    hand_written_runs(runs_dir)
    record = runs_dir / "dpo_n1_async0_k2_s1" / "miniature.json"
    record.write_text(json.dumps({**json.loads(record.read_text()), "argv": ["/somewhere/python", "x.py"]}))
    plot_miniature.main([str(runs_dir), "--out", str(out), "--copy_runs"])
    assert sorted(p.name for p in (out / "runs").iterdir()) == sorted(
        p.name for p in runs_dir.iterdir() if p.name != "unfinished"
    )
    copied = json.loads((out / "runs" / "dpo_n1_async0_k2_s1" / "miniature.json").read_text())
    assert "argv" not in copied and copied["seed"] == 1
    plot_miniature.main([str(out / "runs"), "--out", str(tmp_path / "again")])
    assert (tmp_path / "again" / "results.md").read_text() == (out / "results.md").read_text()


def test_committed_results_are_the_table_of_the_committed_runs():
    """benchmark/results/miniature: results.md is the tables computed from the committed runs, docs/reproducing.md
    shows them and the README the staleness summary, and the runs are the driver's whole plan with the flags it gives them (the
    RLOO runs recorded before its loss flags: miniature.ADDED_FLAGS)."""
    results = ROOT / "benchmark" / "results" / "miniature"
    rows, use_perplexity = plot_miniature.summarise(plot_miniature.read_runs(results / "runs"))
    assert (results / "results.md").read_text() == plot_miniature.results_text(rows, use_perplexity)
    readme, reproducing = (ROOT / "README.md").read_text(), (ROOT / "docs" / "reproducing.md").read_text()
    assert reproducing.split("<!-- miniature-results -->\n", 1)[1].startswith(
        plot_miniature.table(rows, use_perplexity)
    )
    staleness = plot_miniature.staleness_table(rows, use_perplexity)
    assert reproducing.split("<!-- staleness-results -->\n", 1)[1].startswith(staleness)
    assert readme.split("<!-- staleness-results -->\n", 1)[1].startswith(
        plot_miniature.staleness_summary(rows, use_perplexity)
    )
    plan = by_name(miniature.make_plan(**PLAN_ARGS))
    records = {f.name: json.loads((f / "miniature.json").read_text()) for f in (results / "runs").iterdir()}
    assert sorted(records) == sorted(plan)
    for name, record in records.items():
        assert miniature.same_flags(record["flags"], plan[name]), name
        assert record["script"] == plan[name].script and "argv" not in record, name


def test_corrections_plan_is_ppo_and_grpo_at_each_level_without_and_with_each_correction():
    """The corrections sweep, level by level (k = 8, 16, 4, 2, 0: where PPO diverged first), seed by seed, PPO's runs
    then GRPO's, each first with the trainer's pi_old and no correction, then with the engine's logprobs and each
    correction; PPO's uncorrected runs are the async level sweep's (the same names and flags, so --reuse takes them)."""
    plan = miniature.make_correction_plan(**PLAN_ARGS)
    corrections = ["", "_tis", "_sequence_tis", "_sequence_mask", "_icepop", "_geo_mask", "_decoupled"]
    expected = [
        f"{method}_n1_{'sync' if k == 0 else f'async{k}'}{c}_s{seed}"
        for k in (8, 16, 4, 2, 0)
        for seed in (1, 2)
        for method in ("ppo", "grpo")
        for c in corrections
    ]
    assert [run.name for run in plan] == expected and len(plan) == 140
    for run in plan:
        flags = flag_dict(run.flags)
        assert flags["old_logprobs"] == ("engine" if run.correction else "trainer"), run.name
        assert flags["correction"] == (run.correction or "tis"), run.name  # tis: the file's default, unused
        assert flags["async_level"] == str(run.async_level) and flags["num_mini_batches"] == "1", run.name
        assert run.method != "grpo" or (flags["loss_type"], flags["kl_term"]) == ("grpo", "k3_loss"), run.name
    sweep = by_name(miniature.make_plan(**PLAN_ARGS))
    for name in ("ppo_n1_sync_s1", "ppo_n1_async2_s2", "ppo_n1_async4_s1", "ppo_n1_async8_s2"):
        assert by_name(plan)[name].flags == sweep[name].flags


def test_reuse_copies_a_finished_run_with_the_same_flags_and_nothing_else(tmp_path):
    """--reuse: a run finished in the other folder with the run's flags is copied (its record and metrics) into
    out_dir, over an unfinished one of the same name; one finished there with other flags, or not finished, is not."""
    plan = by_name(miniature.make_correction_plan(**PLAN_ARGS))
    same, other, unfinished = plan["ppo_n1_async8_s1"], plan["ppo_n1_async8_s2"], plan["ppo_n1_async4_s1"]
    source, out = tmp_path / "source", tmp_path / "out"
    for run, flags in [(same, same.flags), (other, [*other.flags[:-1], "999"])]:
        (source / run.name).mkdir(parents=True)
        miniature.write_json_atomically(source / run.name / "miniature.json", {"flags": flags})
        (source / run.name / "metrics.jsonl").write_text(f'{{"step": 0, "run": "{run.name}"}}\n')
    (source / unfinished.name).mkdir()
    (source / unfinished.name / "metrics.jsonl").write_text("{}\n")
    (out / same.name).mkdir(parents=True)
    (out / same.name / "metrics.jsonl").write_text("left by a run that was stopped\n")
    assert miniature.reuse(same, source, out)
    assert (out / same.name / "metrics.jsonl").read_text() == '{"step": 0, "run": "ppo_n1_async8_s1"}\n'
    assert miniature.is_finished(same, out)
    assert not miniature.reuse(other, source, out) and not (out / other.name).exists()
    assert not miniature.reuse(unfinished, source, out) and not (out / unfinished.name).exists()


def test_corrections_table_and_summary_against_hand_computation(tmp_path):
    """Runs with a correction make the corrections sweep's table (and no paper table or async level sweep of their
    own): per method, correction and k, the seeds' mean win rate and ranges, and the fractions truncated and masked
    averaged over the steps, then over the seeds; its summary, a line per correction; and its figure."""
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    train = [(0, 0.0, 0.5, 1.0), (1, 0.2, 1.5, 1.0)]
    write_run(runs_dir, "ppo", 1, 1, 8, 1, [(0, 0, 0.40, 1.20), (2, 64, 0.10, 9.00)], train)
    write_run(runs_dir, "ppo", 1, 1, 8, 2, [(0, 0, 0.40, 1.20), (2, 64, 0.50, 1.50)], train)
    for seed, win, fractions in [(1, 0.60, [(0.0, 0.1), (0.2, 0.3)]), (2, 0.62, [(0.1, 0.0), (0.1, 0.0)])]:
        evals = [(0, 0, 0.40, 1.20), (2, 64, win, 1.30)]
        write_run(runs_dir, "ppo", 1, 1, 8, seed, evals, train, correction="icepop", fractions=fractions)
    write_run(
        runs_dir,
        "ppo",
        1,
        1,
        2,
        1,
        [(0, 0, 0.40, 1.20), (2, 64, 0.58, 1.40)],
        train,
        correction="icepop",
        fractions=[(0.0, 0.0), (0.0, 0.5)],
    )
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert text.startswith("The corrections sweep (N = 1):")
    # none at k = 8: (0.10 + 0.50) / 2 = 0.300, perplexity (9.0 + 1.5) / 2 = 5.25; icepop at k = 8: 0.610,
    # truncated ((0 + 0.2) / 2 + (0.1 + 0.1) / 2) / 2 = 0.1, masked ((0.1 + 0.3) / 2 + 0) / 2 = 0.1
    assert table_rows(text) == [
        ["PPO", "none (trainer's pi_old)", "8", "2", "0.300", "0.100 - 0.500", "5.250", "1.500 - 9.000", "", ""],
        ["PPO", "icepop", "2", "1", "0.580", "0.580 - 0.580", "1.400", "1.400 - 1.400", "0.000", "0.250"],
        ["PPO", "icepop", "8", "2", "0.610", "0.600 - 0.620", "1.300", "1.300 - 1.300", "0.100", "0.100"],
    ]
    rows, use_perplexity = plot_miniature.summarise(plot_miniature.read_runs(runs_dir))
    assert table_rows(plot_miniature.correction_summary(rows, use_perplexity)) == [
        ["PPO", "none (trainer's pi_old)", "", "0.300 (5.25)"],
        ["PPO", "icepop", "0.580 (1.40)", "0.610 (1.30)"],
    ]
    assert sorted(p.name for p in out.glob("*.png")) == ["corrections_vs_async_level.png"]


def test_a_corrections_sweep_with_synchronous_runs_shows_its_own_table_and_figure_alone(tmp_path):
    """Its uncorrected run at k = 0 is also a paper comparison's (PPO, N = 1, sync): the sweep's folder still shows the
    corrections' table and figure alone, not the paper's table and figures of that one run."""
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    train = [(0, 0.0, 0.5, 1.0), (1, 0.2, 1.5, 1.0)]
    write_run(runs_dir, "ppo", 1, 1, 0, 1, [(0, 0, 0.40, 1.20), (2, 64, 0.60, 1.30)], train)
    evals = [(0, 0, 0.40, 1.20), (2, 64, 0.61, 1.30)]
    write_run(runs_dir, "ppo", 1, 1, 8, 1, evals, train, correction="icepop", fractions=[(0.0, 0.1), (0.0, 0.1)])
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert text.startswith("The corrections sweep (N = 1):") and len(table_rows(text)) == 2
    assert sorted(p.name for p in out.glob("*.png")) == ["corrections_vs_async_level.png"]


def test_committed_corrections_results_are_the_table_of_their_runs():
    """benchmark/results/corrections: results.md is the tables computed from the committed runs of the corrections
    sweep, docs/reproducing.md shows their summary, and each run is the corrections plan's run of its name with the
    flags the driver gives it (those reused from the async level sweep: recorded before the corrections' flags)."""
    results = ROOT / "benchmark" / "results" / "corrections"
    rows, use_perplexity = plot_miniature.summarise(plot_miniature.read_runs(results / "runs"))
    assert plot_miniature.correction_rows(rows)
    assert (results / "results.md").read_text() == plot_miniature.results_text(rows, use_perplexity)
    reproducing = (ROOT / "docs" / "reproducing.md").read_text()
    assert reproducing.split("<!-- corrections-results -->\n", 1)[1].startswith(
        plot_miniature.correction_summary(rows, use_perplexity)
    )
    plan = by_name(miniature.make_correction_plan(**PLAN_ARGS))
    records = {f.name: json.loads((f / "miniature.json").read_text()) for f in (results / "runs").iterdir()}
    assert set(records) <= set(plan)
    for name, record in records.items():
        assert miniature.same_flags(record["flags"], plan[name]), name
        assert record["script"] == plan[name].script and "argv" not in record, name


def test_lora_plan_is_each_files_async_run_in_full_and_with_an_adapter_at_ten_times_the_learning_rate():
    """The LoRA study, seed by seed, method by method: the async level sweep's N = 1, k = 1 run (the same name and
    flags, so --reuse takes it), then the same run with a rank-8 adapter on every linear layer (alpha 16, no dropout)
    at ten times the learning rate, every LoRA flag spelled out."""
    plan = miniature.make_lora_plan(**PLAN_ARGS)
    expected = [
        f"{m}_n1_async{lora}_s{seed}" for seed in (1, 2) for m in ("dpo", "rloo", "ppo") for lora in ("", "_lora8")
    ]
    assert [run.name for run in plan] == expected
    sweep = by_name(miniature.make_plan(**PLAN_ARGS))
    for run in plan:
        flags = flag_dict(run.flags)
        if run.lora_rank:
            assert (flags["lora_rank"], flags["lora_alpha"], flags["lora_dropout"]) == ("8", "16.0", "0.0"), run.name
            assert flags["lora_target_modules"] == "all-linear" and "no_lora_save_merged" in flags, run.name
            full = sweep[run.name.replace("_lora8", "")]
            assert float(flags["learning_rate"]) == 10 * full.learning_rate, run.name
            lora_flags = {"lora_rank", "lora_alpha", "lora_dropout", "lora_target_modules", "no_lora_save_merged"}
            others = {
                key: value for key, value in flags.items() if key not in lora_flags | {"learning_rate", "exp_name"}
            }
            assert others == {k: v for k, v in flag_dict(full.flags).items() if k not in {"learning_rate", "exp_name"}}
        else:
            assert run.flags == sweep[run.name].flags and "lora_rank" not in flags, run.name


def test_lora_table_against_hand_computation(tmp_path):
    """Runs with an adapter beside full fine-tuning's make the LoRA study's table alone: per method the final win rate
    of each, seeds averaged, with their range and reference perplexity, and LoRA's difference; no figure."""
    runs_dir, out = tmp_path / "runs", tmp_path / "plots"
    train = [(0, 0.0, 0.5, 1.0), (1, 0.2, 1.5, 1.0)]
    for seed, (full, lora) in enumerate([(0.60, 0.64), (0.62, 0.58)], start=1):
        write_run(runs_dir, "dpo", 1, 2, 1, seed, [(0, 0, 0.40, 1.20), (2, 64, full, 1.30)], train)
        write_run(runs_dir, "dpo", 1, 2, 1, seed, [(0, 0, 0.40, 1.20), (2, 64, lora, 1.50)], train, lora_rank=8)
    plot_miniature.main([str(runs_dir), "--out", str(out)])
    text = (out / "results.md").read_text()
    assert text.startswith("LoRA against full fine-tuning (N = 1, async level 1):")
    assert "| online DPO | 0.610 (0.600-0.620; 1.30) | 0.610 (0.580-0.640; 1.50) | +0.000 |" in text
    assert list(out.glob("*.png")) == []


def test_committed_lora_results_are_the_table_of_their_runs():
    """benchmark/results/lora: results.md is the LoRA study's table computed from its committed runs, docs/reproducing.md
    shows it, and each run is the LoRA plan's run of its name with the flags the driver gives it."""
    results = ROOT / "benchmark" / "results" / "lora"
    rows, use_perplexity = plot_miniature.summarise(plot_miniature.read_runs(results / "runs"))
    assert len(plot_miniature.lora_rows(rows)) == 6
    assert (results / "results.md").read_text() == plot_miniature.results_text(rows, use_perplexity)
    reproducing = (ROOT / "docs" / "reproducing.md").read_text()
    shown = plot_miniature.lora_table(rows, use_perplexity)
    assert reproducing.split("<!-- lora-results -->\n", 1)[1].startswith(shown)
    plan = by_name(miniature.make_lora_plan(**PLAN_ARGS))
    records = {f.name: json.loads((f / "miniature.json").read_text()) for f in (results / "runs").iterdir()}
    assert set(records) == set(plan)
    for name, record in records.items():
        assert miniature.same_flags(record["flags"], plan[name]), name


def test_readme_k4_commands_are_the_runs_the_readme_describes(tmp_path, capsys):
    """The two extra K = 4 runs that docs/reproducing.md describes: the full learning rate (1e-4, 48 steps) and
    the full steps (5e-5, 96 steps of 12288 episodes), seed 1, otherwise the plan's K = 4 run."""
    page = (ROOT / "docs" / "reproducing.md").read_text()
    lines = [line for line in page.splitlines() if "--out_dir runs/k4_full" in line and line.startswith("python ")]
    expected = [
        miniature.make_run("dpo", 1, 1, 1, 6144, 1e-4, 32, 3, 512, num_samples=4),
        miniature.make_run("dpo", 1, 1, 1, 12288, 5e-5, 32, 3, 512, num_samples=4),
    ]
    assert len(lines) == len(expected)
    for line, run in zip(lines, expected):
        argv = shlex.split(line.split("#")[0])[2:]
        argv[argv.index("--out_dir") + 1] = str(tmp_path)
        assert miniature.main([*argv, "--dry_run"]) == 0
        printed = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
        assert (
            printed[2 : printed.index("--output_dir")] == run.flags
            and run.num_steps == {6144: 48, 12288: 96}[run.total_episodes]
        )


def test_plot_bad_input_is_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmark/plot_miniature.py", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode != 0
        and proc.stderr.strip() == f"error: runs_dir {tmp_path} holds no finished run (no <run>/miniature.json)"
    )


# ---------------------------------------------------------------------------------------------
# End to end: a few runs of the smoke mode, through the real algorithm files, then the plots
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.benchmark
def test_smoke_mode_end_to_end(tmp_path):
    """Three runs of the smoke plan through the real algorithm files (about a minute and a half on 2 quiet cores), then
    a re-run that skips them: two files, sync and async, N = 16 and K = 4 with its halved lr, and a line of the async
    level sweep, RLOO with PRIME-RL's loss at k = 2."""
    out = tmp_path / "mini"
    only = "dpo_n1_async_k4_s1,ppo_n16_sync_s1,prime_rl_n1_async2_s1"
    run_script(
        [sys.executable, "benchmark/miniature.py", "--out_dir", str(out), "--smoke", "--only", only], timeout=600
    )
    smoke = by_name(
        miniature.make_plan(seeds=[1], episodes=32, learning_rate=1e-4, micro_batch=1, num_evals=1, eval_prompts=16)
    )
    for name in only.split(","):
        args = json.loads((out / name / "args.json").read_text())
        marker = json.loads((out / name / "miniature.json").read_text())
        assert marker["flags"] == smoke[name].flags and marker["git_revision"] == args["git_revision"] != "unknown"
        assert args["num_steps"] == smoke[name].num_steps and args["num_mini_batches"] == smoke[name].num_mini_batches
    assert json.loads((out / "dpo_n1_async_k4_s1" / "args.json").read_text())["learning_rate"] == 5e-5
    prime = [json.loads(line) for line in (out / "prime_rl_n1_async2_s1" / "metrics.jsonl").read_text().splitlines()]
    lags = [m["async/lag"] for m in prime if "async/lag" in m]
    assert len(lags) == 16 and lags[:3] == [0, 1, 2] and set(lags[2:]) == {2}
    text = (out / "plots" / "results.md").read_text()
    assert [r[:4] for r in table_rows(text)] == [["online DPO", "1", "4", "1"], ["PPO", "16", "1", "0"]]
    assert [r[:3] for r in table_rows(text, 1)] == [["RLOO, PRIME-RL's loss", "2", "1"]]
    assert all(
        (out / "plots" / f).stat().st_size > 0
        for f in ("win_rate_vs_kl.png", "win_rate_vs_time.png", "learning_curves.png", "win_rate_vs_async_level.png")
    )
    # a second invocation skips them
    proc = run_script(
        [sys.executable, "benchmark/miniature.py", "--out_dir", str(out), "--smoke", "--only", only], timeout=120
    )
    assert "3 runs, 3 done" in proc.stdout and "] /" not in proc.stdout
