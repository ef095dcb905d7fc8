#!/usr/bin/env bash
# GSM8k math reasoning: the paper's section 5.2 (table 2, figure 11) and appendix A.3 (tables 10-11).
# docs/reproducing.md, "Reproducing the paper on GPUs".
#
#   bash benchmark/gsm8k.sh [EXPERIMENT...]   run the experiments named (default: all of them)
#   DRY_RUN=1 bash benchmark/gsm8k.sh         print the commands instead
#   TINY=1 bash benchmark/gsm8k.sh            the same commands on tests/fixtures/gsm8k, on a CPU (benchmark/lib.sh)
#
# Experiments:
#   online_dpo  tables 2 and 11, figure 11 right: online DPO on the best and worst of 4 samples,
#               sync (async_level 0) and async (async_level 1)
#   rloo        table 11, figure 11 left: RLOO with k = 4, sync
# The reward is the verifier (1 if the number after the first "#### " equals the label's, else 0): no reward
# model is loaded, there is no gold judge (the evaluation is greedy pass@1 on the test split) and no
# missing-EOS penalty (table 10 has none), so those flags are not given.
set -euo pipefail
BENCH=gsm8k
EXPERIMENTS=(online_dpo rloo)
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
select_experiments "$@"

# GPUs: as the paper (appendix A.3, 4 x L40S 48 GB), 1 generation GPU + 3 training GPUs: table 10's
# batch of 252 prompts is 84 per training GPU = 6 per forward/backward x 14 accumulated (the
# paper's code), 4 completions each.
TRAIN_GPUS=3
LOCAL_MICRO_BATCH_SIZE=6
PROMPTS_PER_GPU=$(exact_div 252 "$TRAIN_GPUS" "table 10's 252 prompts over the training GPUs")
GRADIENT_ACCUMULATION_STEPS=$(exact_div "$PROMPTS_PER_GPU" "$LOCAL_MICRO_BATCH_SIZE" "prompts per GPU over the micro-batch")
# bf16 mixed precision, as the paper's runs
ACCELERATE_CONFIG=configs/deepspeed_zero2.yaml

# Table 10
GSM8K=(
    --task gsm8k
    --dataset_name openai/gsm8k
    --dataset_config main
    --dataset_train_split train
    --dataset_eval_split test
    --num_eval_prompts 1319                  # the whole test split: pass@1 of greedy completions (section 5.2)
    --sft_model_path realtreetune/rho-1b-sft-GSM8K
    --max_prompt_length 512
    --response_length 512
    --total_episodes 516096                  # 129024 prompts x 4 completions = 512 steps of 252 prompts x 4
    --local_micro_batch_size "$LOCAL_MICRO_BATCH_SIZE"
    --gradient_accumulation_steps "$GRADIENT_ACCUMULATION_STEPS"
    --num_mini_batches 1
    --num_ppo_epochs 1
    --learning_rate 3e-6
    --lr_schedule constant                   # table 10: constant (the TLDR and No Robots runs decay linearly)
    --temperature 0.7
    --eval_freq 64                           # 9 evaluations of 512 steps, step 0 and the end included
    --save_freq 0                            # no checkpoints (a positive value makes the run resumable)
    --local_rollout_forward_batch_size 84
    --vllm_dtype bfloat16
    --vllm_gpu_memory_utilization 0.91      # the largest the memory plan fits beside the push's 1 GiB bucket: the whole step in one wave
)
# TINY=1: the local fixture in the real format (configs main/socratic, splits train/test) and the
# tiny task's policy; its prompts are at most 31 tokens of the tiny tokenizer.
TINY_SWAP=(--dataset_name tests/fixtures/gsm8k --sft_model_path tasks/tiny/sft
    --max_prompt_length 32 --response_length 16)

ASYNC_LEVELS=(0 1)
if [[ "$TINY" == 1 ]]; then ASYNC_LEVELS=(1); fi  # async_level 0 runs in rloo's tiny run

for seed in $SEEDS; do
    if wants online_dpo; then
        for async in "${ASYNC_LEVELS[@]}"; do
            # best vs worst of 4 samples (section 4.2, appendix A.3), beta 0.05 (table 10)
            run "online_dpo-rho1b-K4-async$async-s$seed" online_dpo_async.py "$ACCELERATE_CONFIG" "$TRAIN_GPUS" "${GSM8K[@]}" \
                --async_level "$async" --num_samples 4 --loss_type sigmoid --beta 0.05 --seed "$seed"
        done
    fi
    if wants rloo; then
        # k = 4 (table 10: 4 gave RLOO the same results as Kazemnejad et al.'s 8), KL coefficient 0.05 (table 10).
        # The paper's released RLOO config counted its 252 per step in completions (63 prompts x 4,
        # 2048 steps); we follow table 10's 252 prompts for both methods, so they see the same batches.
        run "rloo-rho1b-k4-async0-s$seed" rloo_async.py "$ACCELERATE_CONFIG" "$TRAIN_GPUS" "${GSM8K[@]}" \
            --async_level 0 --rloo_k 4 --kl_coef 0.05 --cliprange 0.2 --no_normalize_advantage --old_logprobs trainer --seed "$seed"
    fi
done
