"""benchmark/ helpers on hand-made inputs."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmark"))
import timing  # noqa: E402


def write_run(path, generation, weight_sync, training, step, lag=1, wait=0.0, timeline=False):
    lines = [
        {
            "step": i,
            "episode": i,
            "async/lag": min(i, lag),
            "time/generation": generation,
            "time/weight_sync": weight_sync,
            "time/training": training,
            "time/scoring": 0.1,
            "time/update": training - 0.2,
            "time/wait_for_rollouts": wait,
            "time/step": step,
        }
        for i in range(6)
    ]
    if timeline:  # steps start 1 s apart from step 2 on, so the timed steps (2, 3, 4) take 1 s, not time/step
        for i, m in enumerate(lines):
            m["timeline/step_start"] = 0.5 * i if i < 2 else i - 1.0
    lines.insert(1, {"step": 0, "episode": 0, "eval/win_rate": 0.5})  # evaluation lines are skipped
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_timing_summary_by_hand(tmp_path):
    sync = timing.summarize(write_run(tmp_path / "sync.jsonl", 0.3, 0.1, 0.5, 0.9, lag=0, wait=0.35))
    assert (sync["G"], sync["T"], sync["step"], sync["async_level"], sync["steps"]) == pytest.approx(
        (0.4, 0.5, 0.9, 0, 4)
    )
    assert sync["efficiency"] == pytest.approx(0.5 / 0.9) and sync["push share"] == pytest.approx(0.1 / 0.9)
    assert sync["phases"] == pytest.approx({"time/scoring": 0.1, "time/update": 0.3})
    assert (sync["snapshot and rest"], sync["outside"]) == pytest.approx((0.1, 0.9 - 0.35 - 0.5))
    overlapped = timing.summarize(write_run(tmp_path / "async.jsonl", 0.3, 0.1, 0.5, 0.5))
    assert overlapped["efficiency"] == pytest.approx(1.0)
    timed = timing.summarize(write_run(tmp_path / "timeline.jsonl", 0.3, 0.1, 0.5, 0.5, timeline=True))
    assert (timed["step"], timed["steps"], timed["outside"]) == pytest.approx((1.0, 3, 0.5))
    out = subprocess.run(
        [sys.executable, "benchmark/timing.py", str(tmp_path / "sync.jsonl"), str(tmp_path / "async.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "| ideal speed-up (G + T) / max(G, T) | 1.80x |" in out
        and "| measured speed-up: sync step / async step | 1.80x |" in out
    )
    assert (
        "| pipeline efficiency: max(G, T) / async step | 100.0% |" in out
        and "| weight push share of the async step | 20.0% |" in out
    )
    assert (
        "| **G**: generation + weight push (s) | 0.4000 | 0.4000 |" in out
        and "|   update (s) | 0.3000 | 0.3000 |" in out
    )
    reversed_order = subprocess.run(
        [sys.executable, "benchmark/timing.py", str(tmp_path / "async.jsonl"), str(tmp_path / "sync.jsonl")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "speed-up" not in reversed_order  # the comparison needs the synchronous run first


def test_model_flop_utilisation_by_hand(tmp_path):
    """--peak_tflops adds, per trainer phase, the FLOPs the script logged over the phase's time and the peak:
    scoring 2e12 FLOPs in 0.1 s at a 100 TFLOP/s peak is 20 %; a phase without logged FLOPs gets no row."""
    path = write_run(tmp_path / "run.jsonl", 0.3, 0.1, 0.5, 0.9)
    lines = [json.loads(line) for line in open(path)]
    for m in lines:
        if "async/lag" in m:
            m["flops/scoring"] = 2e12
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    summary = timing.summarize(path)
    assert summary["flops"] == {"time/scoring": 2e12}
    assert (
        timing.utilisation(summary, "time/scoring", 100.0) == "20.0%"
        and timing.utilisation(summary, "time/update", 100.0) == "-"
    )
    out = subprocess.run(
        [sys.executable, "benchmark/timing.py", "--peak_tflops", "100", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "| model FLOP utilisation: scoring | 20.0% |" in out and "utilisation: update" not in out
    )  # no FLOPs logged for it
    assert "utilisation" not in timing.report([path])  # no peak given: no utilisation rows
