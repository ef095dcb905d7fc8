# Shared by benchmark/tldr.sh, benchmark/no_robots.sh and benchmark/gsm8k.sh (sourced, not run).
#
# Environment:
#   TINY=1      tiny-override mode: the same commands with the tiny task's models or the task's local
#               fixture swapped in, 2 steps each, run with plain `python` on a CPU (what the tests run)
#   DRY_RUN=1   print each command (one line, shell-quoted) instead of running it
#   RUNS_DIR    where runs go (default runs/, or runs/tiny/ with TINY=1): RUNS_DIR/<benchmark>/<run name>/
#   SEEDS       seeds to run, e.g. "1 2 3" (default 1)
#
# A run's name carries the git revision (with -dirty for uncommitted changes); args.json records
# the full revision too. A run whose folder holds a finished run (its final policy) is skipped, so a
# sweep that stopped can be started again. Two experiments that need the very same command (e.g.
# a sweep's N = 1 point and the algorithm comparison) run it once.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

TINY="${TINY:-0}"
DRY_RUN="${DRY_RUN:-0}"
SEEDS="${SEEDS:-1}"
if [[ "$TINY" == 1 ]]; then RUNS_DIR="${RUNS_DIR:-runs/tiny}"; else RUNS_DIR="${RUNS_DIR:-runs}"; fi
REV="$(git rev-parse --short=8 HEAD 2>/dev/null || echo nogit)"
if [[ "$REV" != nogit ]] && ! git diff --quiet HEAD -- 2>/dev/null; then REV="$REV-dirty"; fi

# Tiny mode: 2 steps of 2 prompts per mini-batch (x N mini-batches x K samples), evaluated at step 0
# and at the end on 4 prompts, float32 engine (the CPU's). The benchmark adds its own swaps in TINY_SWAP.
TINY_STEPS=2
TINY_MICRO=2
TINY_SWAP=()
if [[ "$TINY" == 1 ]]; then export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1; fi  # local files only

# select_experiments NAME... : the experiments named on the command line (default: all of EXPERIMENTS)
select_experiments() {
    SELECTED=("$@")
    if [[ ${#SELECTED[@]} -eq 0 ]]; then SELECTED=("${EXPERIMENTS[@]}"); fi
    local name
    for name in "${SELECTED[@]}"; do
        if [[ " ${EXPERIMENTS[*]} " != *" $name "* ]]; then
            echo "unknown experiment '$name'; $BENCH has: ${EXPERIMENTS[*]}" >&2
            exit 2
        fi
    done
}

wants() { [[ " ${SELECTED[*]} " == *" $1 "* ]]; }

# exact_div A B: A / B, or stop naming the setting that does not divide
exact_div() {
    if (($1 % $2 != 0)); then
        echo "$BENCH: $1 does not divide by $2 ($3)" >&2
        exit 2
    fi
    echo $(($1 / $2))
}

# last_value FLAG ARGS...: the value of the last FLAG in ARGS (tyro keeps the last one), or empty
last_value() {
    local flag="$1" value="" i
    shift
    local args=("$@")
    for ((i = 0; i < ${#args[@]} - 1; i++)); do
        if [[ "${args[i]}" == "$flag" ]]; then value="${args[i + 1]}"; fi
    done
    echo "$value"
}

declare -A RUN_OF_COMMAND=()

# run NAME SCRIPT ACCELERATE_CONFIG NUM_PROCESSES FLAGS...
#   real mode:  accelerate launch --config_file ACCELERATE_CONFIG --num_processes NUM_PROCESSES SCRIPT FLAGS...
#               (on NUM_PROCESSES + 1 GPUs: the training processes take GPUs 0..N-1, the engine GPU N)
#   TINY=1:     python SCRIPT FLAGS... TINY_SWAP... <tiny sizes>; later flags override earlier ones
run() {
    local name="$1" script="$2" config="$3" nproc="$4"
    shift 4
    local flags=("$@")
    local run_name="${name}__${REV}"
    local out="$RUNS_DIR/$BENCH/$run_name"
    local launcher=(accelerate launch --config_file "$config" --num_processes "$nproc")
    if [[ "$TINY" == 1 ]]; then
        local n k
        n="$(last_value --num_mini_batches "${flags[@]}")"
        k="$(last_value --num_samples "${flags[@]}")"
        [[ -n "$k" ]] || k="$(last_value --rloo_k "${flags[@]}")"
        [[ -n "$k" ]] || k=1  # PPO: one completion per prompt
        launcher=(python)
        flags+=("${TINY_SWAP[@]}"
            --total_episodes $((TINY_STEPS * TINY_MICRO * n * k)) --local_micro_batch_size "$TINY_MICRO"
            --gradient_accumulation_steps 1 --eval_freq 0 --num_eval_prompts 4 --vllm_dtype float32)
    fi
    # the same experiment asked for twice (names aside) runs once
    local key="$script ${flags[*]}"
    if [[ -n "${RUN_OF_COMMAND[$key]:-}" ]]; then
        echo "# $run_name: same command as ${RUN_OF_COMMAND[$key]}, not run again"
        return
    fi
    RUN_OF_COMMAND[$key]="$run_name"
    local cmd=("${launcher[@]}" "$script" "${flags[@]}" --exp_name "$run_name" --output_dir "$out")
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '%q ' "${cmd[@]}" | sed 's/ $//'
        echo
        return
    fi
    if [[ -f "$out/policy/model.safetensors" ]]; then
        echo "# $run_name: finished run in $out, skipped"
        return
    fi
    mkdir -p "$RUNS_DIR/$BENCH"
    echo "# $run_name -> $out (log: $out.log)"
    "${cmd[@]}" 2>&1 | tee "$out.log"  # a failed run stops the script (pipefail)
}
