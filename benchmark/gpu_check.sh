#!/usr/bin/env bash
# The first hour on a GPU machine: the project's GPU checks and benchmarks in one command, at most 25 minutes on one
# H100, every log, table and PNG in OUT_DIR, then a summary table (OUT_DIR/summary.md). docs/gpus.md.
#
#   bash benchmark/gpu_check.sh OUT_DIR            # OUT_DIR must be new or empty
#   bash benchmark/gpu_check.sh --dry_run OUT_DIR  # each stage's time limit and command; nothing run (also DRY_RUN=1)
#
# The stages, in order; one that fails or runs out of time does not stop the later ones:
#   gpus, packages        nvidia-smi and the installed packages' versions
#   test_gpu              pytest tests/test_gpu.py, but for its default-run test: the next three stages are those runs
#   default_dpo, default_rloo, default_ppo
#                         each file with its defaults (the tiny task), as the README's first command
#   separate_dpo          online DPO's default run with the engine on a GPU of its own (only where two GPUs are visible)
#   speed_dpo, speed_rloo, speed_ppo
#                         benchmark/speed.py, sync and async, random Pythia-1b at TLDR's shapes (512 + 53 tokens),
#                         8 steps of 128 completions (64 prompts x 2 samples; PPO: 128 prompts x 1)
#   vs_trl_tiny, vs_trl_1b
#                         benchmark/vs_trl.py with fewer episodes (only where TRL is installed)
# A stage runs for at most its own limit and what is left of the 25 minutes (GPU_CHECK_SECONDS, default 1500); a stage
# that would get less than a minute is not started. The summary gives each stage's exit code (124: out of time), its
# seconds and its key numbers: tests passed, win rate at step 0 and at the end, speed.py's step times.
#
# What $PYTHON (default python3) must import: requirements.txt's stack with vLLM; the scripts import tyro, datasets and
# tensorboardX, speed.py matplotlib, and the test_gpu stage needs pytest. Optional: DeepSpeed (test_gpu's ZeRO-2 and
# ZeRO-3 tests skip without it) and TRL (requirements-trl.txt; the vs_trl stages skip without it). Export what your
# vLLM install needs before (e.g. VLLM_USE_FLASHINFER_SAMPLER=0 where flashinfer is not installed). It runs offline
# (HF_HUB_OFFLINE=1 unless set): every model and data set is local. Disk: the random Pythia-1b models, 8 GB, are built
# once in OUT_DIR/models, which every Pythia stage's models/ links to; they and every run's weights files over 64 MiB
# (final policies, checkpoints) are deleted once used: OUT_DIR keeps logs, metrics, tables and PNGs.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
TOTAL="${GPU_CHECK_SECONDS:-1500}"
GRACE=30     # after its limit a stage gets SIGTERM (the scripts write a checkpoint and stop), SIGKILL this much later
RESERVE=15   # kept for the summary
MIN_STAGE=60 # a stage that would get less is not started
DRY_RUN="${DRY_RUN:-0}"
OUT=""
WHEN=""         # the condition of the next stage, shown by a dry run
STAGE_PID=""    # the stage running now (its `timeout`, which passes signals on to the stage's process group)
INTERRUPTED=0
STAGES=() CODES=() SECONDS_TAKEN=() NUMBERS=()

usage() {
    echo "usage: bash benchmark/gpu_check.sh [--dry_run] OUT_DIR" >&2
    exit 2
}

# == the stages' bookkeeping ==========================================================================================
record() { # record NAME CODE SECONDS NUMBERS
    STAGES+=("$1")
    CODES+=("$2")
    SECONDS_TAKEN+=("$3")
    NUMBERS+=("$4")
}

skip() { record "$1" "-" 0 "$2"; }

# when NAME REASON CHECK...: whether stage NAME runs: not where CHECK fails (its note: "skipped: REASON"); a dry run
# prints the stage anyway, with "skipped where REASON"
when() {
    local name="$1" reason="$2"
    shift 2
    WHEN="skipped where $reason"
    if [[ "$DRY_RUN" == 1 ]] || "$@" >/dev/null 2>&1; then return 0; fi
    skip "$name" "skipped: $reason"
    WHEN=""
    return 1
}

two_gpus() { (($("$PYTHON" -c 'import torch; print(torch.cuda.device_count())') >= 2)); }

# stage NAME LIMIT COMMAND...: run COMMAND from the repository root, its output in OUT/NAME.log, for at most LIMIT
# seconds and what is left of the total; record its exit code, seconds and key numbers
stage() {
    local name="$1" limit="$2"
    shift 2
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "# $name: at most $limit s${WHEN:+; $WHEN}"
        printf '%q ' "$@" | sed 's/ $//'
        echo
        WHEN=""
        return
    fi
    WHEN=""
    if [[ "$INTERRUPTED" == 1 ]]; then
        skip "$name" "not started: interrupted"
        return
    fi
    local left=$((TOTAL - RESERVE - GRACE - SECONDS))
    if ((left < MIN_STAGE)); then
        skip "$name" "not started: $((TOTAL - SECONDS)) s of the $TOTAL s left"
        return
    fi
    ((limit <= left)) || limit=$left
    echo "== $name (at most $limit s, log: $OUT/$name.log)"
    local start=$SECONDS code=0
    # in the background, so that a signal to this script reaches the trap at once; timeout puts the stage in a
    # process group of its own and, on its limit or a signal, signals the whole group (the engines included)
    timeout --kill-after="$GRACE" "$limit" "$@" >"$OUT/$name.log" 2>&1 </dev/null &
    STAGE_PID=$!
    while true; do
        wait "$STAGE_PID" && code=0 || code=$?
        kill -0 "$STAGE_PID" 2>/dev/null || break # a trapped signal ends `wait` early: wait on
    done
    STAGE_PID=""
    local seconds=$((SECONDS - start)) numbers
    numbers="$(key_numbers "$name" "$code" "$seconds")"
    record "$name" "$code" "$seconds" "$numbers"
    echo "   exit code $code after $seconds s: $numbers"
    delete_weights "$OUT/$name"
}

on_signal() {
    INTERRUPTED=1
    if [[ -n "$STAGE_PID" ]]; then kill -TERM "$STAGE_PID" 2>/dev/null || true; fi
}

# link_models NAME: the stage's models/ is OUT/models, so the random Pythia-1b models are built once
link_models() {
    [[ "$DRY_RUN" == 1 ]] && return
    mkdir -p "$OUT/models" "$OUT/$1"
    ln -sfn ../models "$OUT/$1/models"
}

# delete_weights FOLDER: its weights files over 64 MiB (a Pythia run's final policy, checkpoints), listed in
# OUT/deleted_weights.txt; not the shared models (find does not follow the models/ link)
delete_weights() {
    [[ -d "$1" ]] || return 0
    find "$1" -type f -size +64M -print -delete >>"$OUT/deleted_weights.txt" 2>&1 || true
}

# == key numbers, read from what each stage wrote =====================================================================
# run_numbers METRICS.JSONL: the win rate at the first and the last evaluation, whether it rose by 0.10 (what
# tests/test_gpu.py asks of a default run), the steps and their mean time from step 2 on
run_numbers() {
    [[ -f "$1" ]] || {
        echo "no metrics.jsonl"
        return
    }
    awk '
        function value(key,   at) {
            at = match($0, "\"" key "\": [-+0-9.eE]+")
            return at ? substr($0, RSTART + length(key) + 4, RLENGTH - length(key) - 4) + 0 : ""
        }
        /"eval\/win_rate"/ {
            step = value("step")
            if (!seen || step < first_step) { first_step = step; first = value("eval/win_rate"); seen = 1 }
            if (step >= last_step) { last_step = step; last = value("eval/win_rate") }
        }
        /"async\/lag"/ {
            steps++
            if (value("step") >= 2 && value("time/step") != "") { timed++; total += value("time/step") }
        }
        END {
            verdict = last - first >= 0.10 ? "learns" : "does NOT rise by 0.10"
            if (seen) printf "win rate %.3f at step %d, %.3f at step %d (%+.3f: %s); ", first, first_step, last,
                last_step, last - first, verdict
            else printf "no evaluation logged; "
            printf "%d steps", steps
            if (timed) printf ", %.3f s each from step 2 on", total / timed
        }' "$1"
}

# speed_numbers SPEED.MD: benchmark/speed.py's step times and overlap figures
speed_numbers() {
    [[ -f "$1" ]] || {
        echo "no speed.md"
        return
    }
    awk -F'|' '
        function trim(s) { gsub(/^ +| +$/, "", s); return s }
        /\*\*step\*\*: wall time per step/ { sync = trim($3); async = trim($4) }
        /measured speed-up/ { speedup = trim($3) }
        /pipeline efficiency/ { efficiency = trim($3) }
        /weight push share/ { push = trim($3) }
        END {
            printf "step %s s sync, %s s async (%s); pipeline efficiency %s; weight push %s of the async step",
                sync, async, speedup, efficiency, push
        }' "$1"
}

key_numbers() { # key_numbers NAME CODE SECONDS
    local name="$1" code="$2" seconds="$3" numbers=""
    case "$name" in
        test_gpu) numbers="$(grep -E '[0-9]+ (passed|failed|skipped|errors?|deselected)' "$OUT/$name.log" | tail -n 1 |
            tr -d '=' | sed 's/^ *//; s/ *$//')" ;;
        default_* | separate_*) numbers="$(run_numbers "$OUT/$name/metrics.jsonl")" ;;
        speed_*) numbers="$(speed_numbers "$OUT/$name/speed.md")"$'; '"$name/timeline.png" ;;
        vs_trl_*) numbers="$name/vs_trl.md, $name/vs_trl.png" ;;
        packages) [[ "$code" == 0 ]] && numbers="$(versions "$OUT/$name.log")" || numbers="pip list failed" ;;
        gpus) numbers="$(grep -oE '(Driver|CUDA) Version: [0-9.]+' "$OUT/$name.log" | paste -sd ',' || true)" ;;
    esac
    if [[ "$code" == 124 || "$code" == 137 ]]; then numbers="out of time after $seconds s; $numbers"; fi
    echo "$numbers"
}

# versions PIP_FREEZE: the versions that matter, from `pip list --format freeze`
versions() {
    local name line found
    for name in torch vllm transformers accelerate deepspeed trl pytest; do
        line="$(grep -iE "^$name==" "$1" | head -n 1 || true)"
        found="${line#*==}"
        printf '%s %s; ' "$name" "${found:-not installed}"
    done | sed 's/; $//'
}

summary() {
    local i code lines gpus
    gpus="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sort | uniq -c |
        sed 's/^ *//' | paste -sd ';' || true)"
    lines=("# GPU check, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git -C "$ROOT" rev-parse --short=8 HEAD 2>/dev/null || echo '?')")
    lines+=("" "GPUs: ${gpus:-none seen by nvidia-smi}; $SECONDS s in all (limit $TOTAL s)" "")
    lines+=("| stage | exit code | seconds | key numbers |" "|---|---|---|---|")
    for i in "${!STAGES[@]}"; do
        code="${CODES[i]}"
        [[ "$code" == 124 || "$code" == 137 ]] && code="$code (out of time)"
        lines+=("| ${STAGES[i]} | $code | ${SECONDS_TAKEN[i]} | ${NUMBERS[i]//|//} |")
    done
    printf '%s\n' "${lines[@]}" | tee "$OUT/summary.md"
}

# == the stages =======================================================================================================
main() {
    while (($#)); do
        case "$1" in
            --dry_run) DRY_RUN=1 ;;
            -*) usage ;;
            *)
                [[ -z "$OUT" ]] || usage
                OUT="$(realpath -m "$1")"
                ;;
        esac
        shift
    done
    [[ -n "$OUT" ]] || usage
    cd "$ROOT"
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}" PYTHONUNBUFFERED=1
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "# gpu_check.sh --dry_run: the stages in order, each with its time limit (and, in all, $TOTAL s); nothing is run"
    else
        if [[ -e "$OUT" && -n "$(ls -A "$OUT")" ]]; then
            echo "OUT_DIR $OUT is not empty: pick a new one" >&2
            exit 2
        fi
        mkdir -p "$OUT"
        trap on_signal INT TERM
    fi
    local launch="$PYTHON -m accelerate.commands.launch --config_file configs/multi_gpu.yaml --num_processes 1"
    local pythia=(--model_size pythia-1b --launch "$launch" --peak_tflops 989 --)
    local batch=(--total_episodes 1024 --local_micro_batch_size 16)

    stage gpus 30 nvidia-smi
    stage packages 60 "$PYTHON" -m pip list --format freeze
    if when test_gpu "pytest is not installed" "$PYTHON" -m pytest --version; then
        stage test_gpu 600 "$PYTHON" -m pytest -q -rA --durations 0 -p no:cacheprovider tests/test_gpu.py \
            -k "not test_default_run_learns_on_one_gpu"
    fi
    stage default_dpo 180 "$PYTHON" online_dpo_async.py --output_dir "$OUT/default_dpo"
    stage default_rloo 180 "$PYTHON" rloo_async.py --output_dir "$OUT/default_rloo"
    stage default_ppo 240 "$PYTHON" ppo_async.py --output_dir "$OUT/default_ppo"
    if when separate_dpo "fewer than two GPUs are visible" two_gpus; then
        stage separate_dpo 180 "$PYTHON" online_dpo_async.py --vllm_placement separate --output_dir "$OUT/separate_dpo"
    fi
    link_models speed_dpo
    stage speed_dpo 360 "$PYTHON" benchmark/speed.py --script online_dpo_async.py --out_dir "$OUT/speed_dpo" \
        "${pythia[@]}" "${batch[@]}" --gradient_accumulation_steps 4 --num_samples 2
    link_models speed_rloo
    stage speed_rloo 300 "$PYTHON" benchmark/speed.py --script rloo_async.py --out_dir "$OUT/speed_rloo" \
        "${pythia[@]}" "${batch[@]}" --gradient_accumulation_steps 4 --rloo_k 2
    link_models speed_ppo
    stage speed_ppo 300 "$PYTHON" benchmark/speed.py --script ppo_async.py --out_dir "$OUT/speed_ppo" \
        "${pythia[@]}" "${batch[@]}" --gradient_accumulation_steps 8
    if when vs_trl_tiny "TRL is not installed" "$PYTHON" -c "import trl"; then
        stage vs_trl_tiny 420 "$PYTHON" benchmark/vs_trl.py --model_size tiny --out_dir "$OUT/vs_trl_tiny" \
            --total_episodes 3200
    fi
    if when vs_trl_1b "TRL is not installed" "$PYTHON" -c "import trl"; then
        link_models vs_trl_1b
        stage vs_trl_1b 600 "$PYTHON" benchmark/vs_trl.py --model_size pythia-1b --out_dir "$OUT/vs_trl_1b" \
            --total_episodes 1024
    fi
    [[ "$DRY_RUN" == 1 ]] && return 0

    rm -rf "$OUT/models"
    find "$OUT" -maxdepth 2 -type l -name models -delete
    echo
    summary
    [[ "$INTERRUPTED" == 0 ]] || exit 130
    for code in "${CODES[@]}"; do [[ "$code" == 0 || "$code" == - ]] || exit 1; done
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then main "$@"; fi
