#!/usr/bin/env bash
# Creativity training: GRPO advantages combined with the rarity of each response's solution
# strategy, weight = 1 / frequency^0.7, strategies grouped by a judge.
#
#   bash examples/creativity/creativity_train.sh                     # CPU: tiny model, lexical judge
#   ADV_ESTIMATOR=grpo_weighted_add bash examples/creativity/creativity_train.sh
#
# GPU + GPT-4 variant (the seed's setting):
#   MODEL_PATH=Qwen/Qwen2.5-3B-Instruct JUDGE=openai JUDGE_MODEL=gpt-4 OPENAI_API_KEY=... \
#   N_GPUS=8 ROLLOUT=vllm TRAIN_BATCH_SIZE=128 MAX_RESPONSE_LENGTH=1024 LR=1e-6 STEPS=500 \
#   bash examples/creativity/creativity_train.sh
# (OPENAI_BASE_URL points the judge at any OpenAI-compatible server.)
# Checkpoints: ckpt/${EXPERIMENT_NAME}/global_step_<k>/actor, and ckpt/${EXPERIMENT_NAME}/actor
# links to the last one. With WANDB_API_KEY (or WANDB_MODE) set, metrics go to wandb project
# "Creativity". Extra arguments are passed on as key=value overrides.
set -euo pipefail

ADV_ESTIMATOR=${ADV_ESTIMATOR:-grpo_weighted_mul}   # grpo_weighted_mul | grpo_weighted_add | grpo
MODEL_PATH=${MODEL_PATH:-}                           # empty: the embedded tiny model
JUDGE=${JUDGE:-lexical}                              # lexical (no model) | hf (local model) | openai
JUDGE_MODEL=${JUDGE_MODEL:-}
N_GPUS=${N_GPUS:-0}
ROLLOUT=${ROLLOUT:-transformers}
TRAIN_BATCH_SIZE=${TRAIN_BATCH_SIZE:-8}
ROLLOUT_N=${ROLLOUT_N:-8}
MAX_PROMPT_LENGTH=${MAX_PROMPT_LENGTH:-128}
MAX_RESPONSE_LENGTH=${MAX_RESPONSE_LENGTH:-16}
LR=${LR:-3e-5}
STEPS=${STEPS:-40}
EXPERIMENT_NAME=${EXPERIMENT_NAME:-creativity-${ADV_ESTIMATOR}}
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}

LOGGER="[console]"
if [ -n "${WANDB_API_KEY:-}" ] || [ -n "${WANDB_MODE:-}" ]; then LOGGER="[console,wandb]"; fi

MODEL_ARGS=()
[ -n "$MODEL_PATH" ] && MODEL_ARGS+=("actor_rollout_ref.model.path=$MODEL_PATH")
[ -n "$JUDGE_MODEL" ] && MODEL_ARGS+=("algorithm.judge.model=$JUDGE_MODEL")
CLASSIFY=true
[ "$ADV_ESTIMATOR" = "grpo" ] && CLASSIFY=false

"$PYTHON" -m opentinker.engine.ppo.cli \
    algorithm.adv_estimator="$ADV_ESTIMATOR" \
    algorithm.enable_solution_classification="$CLASSIFY" \
    algorithm.weight_power=0.7 \
    algorithm.classify_only_correct=true \
    algorithm.judge.kind="$JUDGE" \
    data.train_batch_size="$TRAIN_BATCH_SIZE" \
    data.val_batch_size=64 \
    data.max_prompt_length="$MAX_PROMPT_LENGTH" \
    data.max_response_length="$MAX_RESPONSE_LENGTH" \
    actor_rollout_ref.actor.optim.lr="$LR" \
    actor_rollout_ref.actor.ppo_mini_batch_size="$TRAIN_BATCH_SIZE" \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.rollout.name="$ROLLOUT" \
    actor_rollout_ref.rollout.n="$ROLLOUT_N" \
    actor_rollout_ref.rollout.val_n="$ROLLOUT_N" \
    actor_rollout_ref.rollout.val_temperature=1.0 \
    trainer.n_gpus_per_node="$N_GPUS" \
    trainer.project_name=Creativity \
    trainer.experiment_name="$EXPERIMENT_NAME" \
    trainer.default_local_dir="ckpt/${EXPERIMENT_NAME}" \
    trainer.logger="$LOGGER" \
    trainer.total_training_steps="$STEPS" \
    trainer.test_freq=20 \
    "${MODEL_ARGS[@]}" "$@"

LAST=$(ls -d "ckpt/${EXPERIMENT_NAME}"/global_step_* 2>/dev/null | sort -t_ -k3 -n | tail -1)
if [ -n "$LAST" ]; then
    ln -sfn "$(basename "$LAST")/actor" "ckpt/${EXPERIMENT_NAME}/actor"
    echo "checkpoint: ckpt/${EXPERIMENT_NAME}/actor -> $LAST/actor"
fi
