#!/usr/bin/env bash
# No Robots instruction following at 8B: the paper's section 5.1 (table 1, figure 9) and appendix A.2
# (tables 7-9, figure 10). docs/reproducing.md, "Reproducing the paper on GPUs".
#
#   bash benchmark/no_robots.sh [EXPERIMENT...]   run the experiments named (default: all of them)
#   DRY_RUN=1 bash benchmark/no_robots.sh         print the commands instead
#   TINY=1 bash benchmark/no_robots.sh            the same commands on tests/fixtures/no_robots, on a CPU (benchmark/lib.sh)
#   VLLM_NUM_ENGINES=2 bash benchmark/no_robots.sh  the 8 GPUs as 2 engines + 6 training GPUs, not the paper's 1 + 7
#
# Experiments:
#   online_dpo  tables 1 and 8, figure 9: online DPO, sync (async_level 0) and async (async_level 1)
#   ppo         table 9, figure 10: PPO, sync and async, KL coefficient 0.01
#   lora        not in the paper: async online DPO with a rank-8 LoRA adapter on every linear layer, at ten
#               times the learning rate, on 2 GPUs (1 training + the engine's; ZeRO-2), which the memory
#               plan says it fits (docs/algorithms.md#lora---lora_rank)
#
# The SFT policy and the reward model are yours to train first (tables 5-6), from Meta-Llama-3.1-8B:
# tasks/train_sft.py, then tasks/label_preferences.py (4 completions per prompt including the
# human one, 6 pairs judged by an LLM) and tasks/train_reward.py; their docstrings have the
# commands. Point NO_ROBOTS_SFT and NO_ROBOTS_RM at the results. The win rate against the human
# answers (tables 1, 8, 9) is judged afterwards from each run's eval_completions/ by tasks/llm_judge.py.
set -euo pipefail
BENCH=no_robots
EXPERIMENTS=(online_dpo ppo lora)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
select_experiments "$@"

NO_ROBOTS_SFT="${NO_ROBOTS_SFT:-models/llama-3.1-8b-sft-no-robots}"
NO_ROBOTS_RM="${NO_ROBOTS_RM:-models/llama-3.1-8b-rm-no-robots}"

# GPUs: as the paper, 8 H100s = 1 generation GPU + 7 training GPUs. Table 7's batch of 256 episodes
# divides over 7 processes neither as 256 completions nor as 128 prompts x 2: we train on 252
# episodes per step, the nearest multiple of 7 x 2 (online DPO: 126 prompts x 2 samples, 18 per
# GPU; PPO: 252 prompts x 1, 36 per GPU), and on 100044 = 397 x 252 episodes (table 7: 100000).
# VLLM_NUM_ENGINES=2: two engines of a GPU each and 6 training GPUs, the same step's batch (online DPO:
# 21 prompts per GPU, PPO: 42, in micro-batches of 3), the layout at which the run plan predicts the
# step bound by training, 14.2 s against the paper's layout's 19.8 s (docs/reproducing.md, "Engines for
# No Robots"); its runs are named -e2.
GPUS=8
VLLM_NUM_ENGINES="${VLLM_NUM_ENGINES:-1}"
EPISODES_PER_STEP=252
TOTAL_EPISODES=$((397 * EPISODES_PER_STEP))
case "$VLLM_NUM_ENGINES" in
    1) LOCAL_MICRO_BATCH_SIZE=2 LAYOUT="" ENGINE_FLAGS=() ;;  # prompts per forward/backward on an 80 GB GPU, 512 + 1024 tokens, 8B models
    2) LOCAL_MICRO_BATCH_SIZE=3 LAYOUT="-e2" ENGINE_FLAGS=(--vllm_num_engines 2) ;;
    *) echo "$BENCH: VLLM_NUM_ENGINES is 1 (the paper's layout) or 2, not '$VLLM_NUM_ENGINES'" >&2; exit 2 ;;
esac
TRAIN_GPUS=$((GPUS - VLLM_NUM_ENGINES))
# bf16 mixed precision; ZeRO-2 shards the 8B policy's optimizer state (PPO also trains an 8B value
# model and may need more memory than ZeRO-2 gives: offload the optimizer in the config if so).

# ZeRO-3 and gradient checkpointing: under ZeRO-2 an 8B policy, its fp32 reference and the reward model take 167 GiB
# of each training GPU (python benchmark/memory.py; docs/reproducing.md); sharded, 57 GiB.
ACCELERATE_CONFIG=configs/deepspeed_zero3.yaml

# Table 7
NO_ROBOTS=(
    --task no_robots
    --dataset_name HuggingFaceH4/no_robots
    --dataset_train_split train
    --dataset_eval_split test
    --num_eval_prompts 500                   # the whole test split, for the LLM judge
    --sft_model_path "$NO_ROBOTS_SFT"
    --reward_model_path "$NO_ROBOTS_RM"
    --max_prompt_length 512
    --response_length 1024
    --total_episodes "$TOTAL_EPISODES"
    --local_micro_batch_size "$LOCAL_MICRO_BATCH_SIZE"
    --num_mini_batches 1
    --num_ppo_epochs 1
    --learning_rate 8e-7
    --lr_schedule linear                     # decayed linearly to 0 (table 7)
    --temperature 0.7
    --missing_eos_penalty -10.0
    --eval_freq 50                           # 9 evaluations of 397 steps, step 0 and the end included
    --save_freq 0                            # no checkpoints (a positive value makes the run resumable)
    --local_rollout_forward_batch_size 8
    --vllm_dtype bfloat16
    --vllm_gpu_memory_utilization 0.91      # the most the plan fits beside the 1 GiB push bucket: 292 sequences of 1536 tokens, all 252 at once
    --gradient_checkpointing
)
# gradient accumulation: the step's prompts per GPU over the micro-batch
DPO_PROMPTS_PER_GPU=$(exact_div $((EPISODES_PER_STEP / 2)) "$TRAIN_GPUS" "online DPO's prompts per step over the training GPUs")
PPO_PROMPTS_PER_GPU=$(exact_div "$EPISODES_PER_STEP" "$TRAIN_GPUS" "PPO's prompts per step over the training GPUs")
DPO_ACCUMULATION=$(exact_div "$DPO_PROMPTS_PER_GPU" "$LOCAL_MICRO_BATCH_SIZE" "online DPO's prompts per GPU over the micro-batch")
# LoRA: the step's 126 prompts on one training GPU, in micro-batches of 2 (the memory plan: 51.8 of 79 GiB)
LORA_ACCUMULATION=$(exact_div $((EPISODES_PER_STEP / 2)) 2 "online DPO's prompts per step over LoRA's micro-batch")
PPO_ACCUMULATION=$(exact_div "$PPO_PROMPTS_PER_GPU" "$LOCAL_MICRO_BATCH_SIZE" "PPO's prompts per GPU over the micro-batch")

# TINY=1: the local fixture in the real format (chat `messages`, splits train/test), the tiny
# task's reward model, and its policy with a chat template added (the one tasks/train_sft.py's
# `--chat_template tulu` gives a base model), as --task no_robots needs one.
TINY_SFT="$RUNS_DIR/$BENCH/tiny_sft_chat"
TINY_SWAP=(--dataset_name tests/fixtures/no_robots/data --sft_model_path "$TINY_SFT"
    --reward_model_path tasks/tiny/reward --max_prompt_length 48 --response_length 12)
if [[ "$TINY" == 1 && "$DRY_RUN" != 1 ]]; then
    mkdir -p "$RUNS_DIR/$BENCH"
    rm -rf "$TINY_SFT"
    cp -r tasks/tiny/sft "$TINY_SFT"
    python - "$TINY_SFT" <<'EOF'
import ast, json, sys
from pathlib import Path

# TULU_CHAT_TEMPLATE read from tasks/train_sft.py without importing it (and torch)
tree = ast.parse(Path("tasks/train_sft.py").read_text())
template = next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "TULU_CHAT_TEMPLATE")
config_file = Path(sys.argv[1], "tokenizer_config.json")
config = json.loads(config_file.read_text())
config["chat_template"] = template
config_file.write_text(json.dumps(config, indent=2))
EOF
fi

ASYNC_LEVELS=(0 1)
if [[ "$TINY" == 1 ]]; then ASYNC_LEVELS=(1); fi  # async_level 0 runs in the other scripts' tiny runs

for seed in $SEEDS; do
    for async in "${ASYNC_LEVELS[@]}"; do
        if wants online_dpo; then  # beta 0.03 (table 7)
            run "online_dpo-llama8b$LAYOUT-async$async-s$seed" online_dpo_async.py "$ACCELERATE_CONFIG" "$TRAIN_GPUS" \
                "${NO_ROBOTS[@]}" "${ENGINE_FLAGS[@]}" \
                --gradient_accumulation_steps "$DPO_ACCUMULATION" --async_level "$async" --num_samples 2 \
                --loss_type sigmoid --beta 0.03 --seed "$seed"
        fi
        if wants lora && [[ "$async" == 1 ]]; then  # one training GPU and the engine's: CUDA_VISIBLE_DEVICES=0,1
            run "online_dpo-llama8b-lora8-async$async-s$seed" online_dpo_async.py configs/deepspeed_zero2.yaml 1 \
                "${NO_ROBOTS[@]}" --local_micro_batch_size 2 \
                --gradient_accumulation_steps "$LORA_ACCUMULATION" --async_level "$async" --num_samples 2 \
                --loss_type sigmoid --beta 0.03 --lora_rank 8 --lora_alpha 16.0 --lora_dropout 0.0 \
                --lora_target_modules all-linear --learning_rate 8e-6 --seed "$seed"
        fi
        if wants ppo; then  # table 7 but the KL coefficient 0.01 (appendix A.2, "PPO"); value model from the reward model
            run "ppo-llama8b$LAYOUT-async$async-s$seed" ppo_async.py "$ACCELERATE_CONFIG" "$TRAIN_GPUS" \
                "${NO_ROBOTS[@]}" "${ENGINE_FLAGS[@]}" \
                --gradient_accumulation_steps "$PPO_ACCUMULATION" --async_level "$async" \
                --kl_coef 0.01 --no_adaptive_kl --gamma 1.0 --lam 0.95 --no_whiten_rewards \
                --cliprange 0.2 --cliprange_value 0.2 --vf_coef 0.1 --old_logprobs trainer --seed "$seed"
        fi
    done
done
