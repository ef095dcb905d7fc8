"""benchmark/speed.py end to end (its table against a by-hand computation from the two runs),
the timeline's bar geometry on a hand-written metrics.jsonl, and the real-shape model builder."""

import importlib
import json
import os
import re
import subprocess
import sys
import threading

import pytest
from conftest import ROOT, read_metrics, run_script

sys.path.insert(0, str(ROOT / "benchmark"))
import plot_timeline  # noqa: E402
import speed  # noqa: E402
from plot_timeline import Bar  # noqa: E402


def table_cells(text: str) -> dict[str, list[str]]:
    """Rows of the printed Markdown tables: first cell -> the other cells."""
    rows = (line.strip("|").split("|") for line in text.splitlines() if line.startswith("| "))
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def by_hand(output_dir) -> dict:
    """Means over steps 2 .. n-2; a step's time runs from its start to the next step's start."""
    train, _ = read_metrics(output_dir)
    timed = range(2, len(train) - 1)
    mean = lambda f: sum(f(train[i]) for i in timed) / len(timed)  # noqa: E731
    return {
        "G": mean(lambda m: m["time/generation"] + m["time/weight_sync"]),
        "T": mean(lambda m: m["time/training"]),
        "push": mean(lambda m: m["time/weight_sync"]),
        "step": (train[timed[-1] + 1]["timeline/step_start"] - train[timed[0]]["timeline/step_start"]) / len(timed),
    }


@pytest.mark.slow
@pytest.mark.benchmark
def test_speed_benchmark_end_to_end(tmp_path):
    """Two 6-step runs; every number of the table equals a by-hand computation from their metrics."""
    out = tmp_path / "speed"
    flags = ["--total_episodes", "96", "--local_micro_batch_size", "8", "--num_eval_prompts", "16"]
    proc = run_script(
        [sys.executable, "benchmark/speed.py", "--out_dir", str(out), "--steps", "0:6", "--", *flags], timeout=300
    )
    sync_args, async_args = (json.loads((out / run / "args.json").read_text()) for run in ("sync", "async"))
    assert (sync_args["async_level"], async_args["async_level"], sync_args["eval_freq"], sync_args["num_steps"]) == (
        0,
        1,
        0,
        6,
    )
    differ = {k for k in sync_args if sync_args[k] != async_args[k]}
    assert differ == {"async_level", "output_dir"}, differ  # the same work, seed included

    s, a = by_hand(out / "sync"), by_hand(out / "async")
    cells = table_cells(proc.stdout)
    assert cells["steps timed"] == ["3", "3"]
    assert [float(x) for x in cells["**G**: generation + weight push (s)"]] == pytest.approx([s["G"], a["G"]], abs=6e-5)
    assert [float(x) for x in cells["**T**: trainer, `time/training` (s)"]] == pytest.approx([s["T"], a["T"]], abs=6e-5)
    assert [float(x) for x in cells["**step**: wall time per step (s)"]] == pytest.approx(
        [s["step"], a["step"]], abs=6e-5
    )
    figure = lambda name: float(re.sub(r"[x%]", "", cells[name][0]))  # noqa: E731
    assert figure("ideal speed-up (G + T) / max(G, T)") == pytest.approx(
        (s["G"] + s["T"]) / max(s["G"], s["T"]), abs=0.006
    )
    assert figure("measured speed-up: sync step / async step") == pytest.approx(s["step"] / a["step"], abs=0.006)
    assert figure("pipeline efficiency: max(G, T) / async step") == pytest.approx(
        100 * max(s["G"], s["T"]) / a["step"], abs=0.06
    )
    assert figure("weight push share of the async step") == pytest.approx(100 * a["push"] / a["step"], abs=0.06)
    assert f"G = {s['G']:.4f} s, T = {s['T']:.4f} s, measured in the synchronous run" in proc.stdout
    assert (out / "speed.md").read_text().strip() in proc.stdout
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sync: CPU use while training" in proc.stdout and "async: CPU use while training" in proc.stdout


def test_speed_refuses_a_used_out_dir(tmp_path):
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "metrics.jsonl").write_text("")
    with pytest.raises(SystemExit, match="already holds"):
        speed.main(["--out_dir", str(tmp_path)])
    for bad in (["--script", "no_such_script.py"], ["--", "--async_level", "2"], ["--prompt_length", "64"]):
        with pytest.raises(SystemExit):
            speed.parse(bad)


def test_on_cores_places_threads_and_processes_started_in_it():
    """The CPU split: what starts inside `on_cores` (the engine's processes, the generation thread) runs
    on the engine's core; the caller, the trainer, gets its own cores back."""
    on_cores = importlib.import_module("plumbing.placement").on_cores  # private: the CPU split it places
    mine = os.sched_getaffinity(0)
    engine = {max(mine)}
    seen = {}
    with on_cores(sorted(engine)):
        thread = threading.Thread(target=lambda: seen.update(thread=os.sched_getaffinity(0)))
        thread.start()
        child = subprocess.run(
            [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], capture_output=True, text=True
        )
    thread.join()
    assert seen["thread"] == engine and json.loads(child.stdout) == sorted(engine)
    assert os.sched_getaffinity(0) == mine
    with on_cores(None):
        assert os.sched_getaffinity(0) == mine


LINES = [
    {
        "step": 0,
        "async/lag": 0,
        "async/version": 0,
        "timeline/step_start": 0.0,
        "time/wait_for_rollouts": 0.5,
        "timeline/training_start": 0.5,
        "time/scoring": 0.1,
        "time/old_logprobs": 0.05,
        "time/reference": 0.2,
        "time/update": 0.3,
        "time/training": 0.7,
        "timeline/weight_sync_start": 0.1,
        "time/weight_sync": 0.0,
        "timeline/generation_start": 0.1,
        "time/generation": 0.4,
    },
    {"step": 0, "eval/win_rate": 0.5, "timeline/eval_generation_start": 0.5, "time/eval_generation": 0.3},
    {
        "step": 1,
        "async/lag": 0,
        "async/version": 0,
        "timeline/step_start": 1.25,
        "time/wait_for_rollouts": 0.0,
        "timeline/training_start": 1.25,
        "time/scoring": 0.1,
        "time/old_logprobs": 0.1,
        "time/reference": 0.1,
        "time/update": 0.4,
        "time/training": 0.7,
        "timeline/weight_sync_start": 1.2,
        "time/weight_sync": 0.05,
        "timeline/generation_start": 1.25,
        "time/generation": 0.3,
    },
    {
        "step": 2,
        "async/lag": 1,
        "async/version": 1,
        "timeline/step_start": 2.0,
        "time/wait_for_rollouts": 0.1,
        "timeline/training_start": 2.1,
        "time/scoring": 0.2,
        "time/old_logprobs": 0.1,
        "time/reference": 0.1,
        "time/update": 0.4,
        "time/training": 0.8,
        "timeline/weight_sync_start": 1.9,
        "time/weight_sync": 0.1,
        "timeline/generation_start": 2.0,
        "time/generation": 0.2,
    },
    {"step": 3, "eval/win_rate": 0.6, "timeline/eval_generation_start": 9.0, "time/eval_generation": 0.3},
]


def test_timeline_bars_by_hand():
    bars = plot_timeline.timeline_bars(LINES, range(0, 2))
    expected = [
        Bar("generation", "generation", 0.1, 0.4, "θ0"),  # no push for version 0
        Bar("training", "wait", 0.0, 0.5),
        Bar("training", "scoring", 0.5, 0.1),
        Bar("training", "old_logprobs", 0.6, 0.05),
        Bar("training", "reference", 0.65, 0.2),
        Bar("training", "update", 0.85, 0.3),
        Bar("training", "snapshot and rest", 1.15, 0.05),  # 0.5 + 0.7 - 1.15
        Bar("training", "step", 0.5, 0.7, "0"),
        Bar("generation", "weight push", 1.2, 0.05),
        Bar("generation", "generation", 1.25, 0.3, "θ0"),  # no wait bar: the batch was there
        Bar("training", "scoring", 1.25, 0.1),
        Bar("training", "old_logprobs", 1.35, 0.1),
        Bar("training", "reference", 1.45, 0.1),
        Bar("training", "update", 1.55, 0.4),  # ends at 1.95 = training_start + training: no rest
        Bar("training", "step", 1.25, 0.7, "1"),
        Bar("generation", "evaluation", 0.5, 0.3, "eval θ0"),  # the eval at 9.0 s is outside the window
    ]
    assert [(b.row, b.kind, b.label) for b in bars] == [(b.row, b.kind, b.label) for b in expected]
    assert [x for b in bars for x in (b.start, b.width)] == pytest.approx(
        [x for b in expected for x in (b.start, b.width)]
    )
    # without old_logprobs (online DPO) the other phases close up; the window follows --steps
    dpo = [{k: v for k, v in m.items() if k != "time/old_logprobs"} for m in LINES]
    bars = plot_timeline.timeline_bars(dpo, range(2, 12))
    training = [b for b in bars if b.row == "training"]
    assert [b.kind for b in training] == ["wait", "scoring", "reference", "update", "snapshot and rest", "step"]
    assert [x for b in training for x in (b.start, b.width)] == pytest.approx(
        [2.0, 0.1, 2.1, 0.2, 2.3, 0.1, 2.4, 0.4, 2.8, 0.1, 2.1, 0.8]
    )
    assert [b.kind for b in bars if b.row == "generation"] == ["weight push", "generation"]
    with pytest.raises(SystemExit, match="--steps 5:7"):
        plot_timeline.timeline_bars(LINES, range(5, 7))


def test_plot_timeline_writes_png(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(m) + "\n" for m in LINES))
    run_script(
        [
            sys.executable,
            "benchmark/plot_timeline.py",
            str(path),
            str(path),
            "--out",
            str(tmp_path / "t.png"),
            "--steps",
            "0:3",
            "--title",
            "x",
        ]
    )
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for bad in ("3", "4:2", "a:b"):
        with pytest.raises(SystemExit, match="--steps must be A:B"):
            plot_timeline.parse_steps(bad)
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"step": 0, "async/lag": 0, "time/generation": 0.1}) + "\n")
    with pytest.raises(SystemExit, match="old.jsonl: training lines without the timeline"):
        plot_timeline.plot([str(old)], str(tmp_path / "old.png"))


@pytest.mark.parametrize(
    "size,total,non_embedding",
    [
        ("pythia-160m", 162_322_944, 85_056_000),
        ("pythia-410m", 405_334_016, 302_311_424),
        ("pythia-1b", 1_011_781_632, 805_736_448),
    ],
)
def test_pythia_shapes_have_pythias_parameter_counts(size, total, non_embedding):
    """The published Pythia parameter counts (total, and without the input and output embeddings)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(speed.pythia_config(size))
    count = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    assert (type(model).__name__, count, count - embeddings) == ("GPTNeoXForCausalLM", total, non_embedding)


def test_build_models_small_shape(tmp_path, monkeypatch, tokenizer):
    """The builder's folders load as the scripts load them; the tokenizer covers the vocabulary and keeps
    the tiny task's ids; every prompt is exactly --prompt_length tokens."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    monkeypatch.setitem(speed.PYTHIA, "pythia-test", (64, 2, 2, 128))
    folder = speed.build_models("pythia-test", 20, tmp_path)
    assert (
        folder == tmp_path / "pythia-test-prompt20" and speed.build_models("pythia-test", 20, tmp_path) == folder
    )  # reused
    policy = AutoModelForCausalLM.from_pretrained(folder / "sft")
    reward = AutoModelForSequenceClassification.from_pretrained(folder / "reward", num_labels=1)
    assert (folder / "sft" / "model.safetensors").exists() and reward.config.num_labels == 1
    big = AutoTokenizer.from_pretrained(folder / "sft")
    assert len(big) == policy.config.vocab_size == speed.PYTHIA_VOCAB
    assert (big.pad_token_id, big.bos_token_id, big.eos_token_id) == (
        policy.config.pad_token_id,
        policy.config.bos_token_id,
        policy.config.eos_token_id,
    )
    query = "sort: cow ant ape ->"
    assert big(query).input_ids == tokenizer(query).input_ids
    assert big.decode([6, speed.PYTHIA_VOCAB - 1, 2]) == f"ant tok{speed.PYTHIA_VOCAB - 1} </s>"
    for split, count in (("train", 4096), ("test", 512)):
        rows = [json.loads(line) for line in (folder / "data" / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == count and {len(ids) for ids in big([r["query"] for r in rows]).input_ids} == {20}
        assert all(r["query"].endswith("->") and r["reference_response"] for r in rows)
    with pytest.raises(SystemExit, match="--prompt_length 8 is shorter"):
        speed.write_prompts(tmp_path / "short", 8)


def test_models_only_builds_the_models_and_runs_nothing(tmp_path, monkeypatch):
    """--models_only (benchmark/gpu_check.sh builds the Pythia models while the GPU does other work): the models in
    <out_dir>/models, no run; a later call with the same out_dir finds them (build_models reuses them); the tiny task
    has none to build."""
    monkeypatch.setitem(speed.PYTHIA, "pythia-test", (64, 2, 2, 128))
    speed.main(["--model_size", "pythia-test", "--prompt_length", "20", "--out_dir", str(tmp_path), "--models_only"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]
    folder = tmp_path / "models" / "pythia-test-prompt20"
    assert sorted(p.name for p in folder.iterdir()) == ["data", "reward", "sft"]
    built = (folder / "sft" / "model.safetensors").stat().st_mtime_ns
    assert speed.build_models("pythia-test", 20, tmp_path / "models") == folder
    assert (folder / "sft" / "model.safetensors").stat().st_mtime_ns == built
    with pytest.raises(SystemExit):
        speed.parse(["--models_only"])
