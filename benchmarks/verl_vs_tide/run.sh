#!/usr/bin/env bash
# Stock verl (sync and separate_async) vs +tide=enabled on YOUR cluster: one GRPO job three times with the
# same model, data, steps and GPUs; then one table of goodput and waits (collect.py).
#
#   benchmarks/verl_vs_tide/run.sh [--dry-run] [hydra overrides for all three runs...]
#
# Environment (defaults in brackets):
#   GPUS [8]           GPUs on the node; sync uses all of them colocated, the others split them
#   ROLLOUT_GPUS [4]   of those, the rollout ranks of separate_async and tide
#   STEPS [20]         training steps per run
#   STALENESS [1]      policy versions a trajectory may lag the trainer, for separate_async and tide alike
#                      (verl's max_off_policy_threshold counts versions spanned: verl_tide.job_config.off_policy_threshold)
#   BACKEND [nccl]     checkpoint engine between separate trainer and rollout ranks
#   OUT [verl_vs_tide_out]  logs and results
#   PYTHON [python]    the environment with verl and verl-tide installed
# Pass your usual overrides (data.*, actor_rollout_ref.model.path, batch sizes, agent loop, ...) as arguments.
set -euo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
GPUS=${GPUS:-8}; ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}; STEPS=${STEPS:-20}; BACKEND=${BACKEND:-nccl}
STALENESS=${STALENESS:-1}
THRESHOLD=$("${PYTHON:-python}" -c "from verl_tide.job_config import off_policy_threshold; print(off_policy_threshold($STALENESS))")
OUT=${OUT:-verl_vs_tide_out}
TRAIN_GPUS=$((GPUS - ROLLOUT_GPUS))
common=(trainer.total_training_steps="$STEPS" trainer.logger=[console] trainer.val_before_train=False
        trainer.test_freq=-1 trainer.save_freq=-1 trainer.nnodes=1 "$@")
split=(trainer.n_gpus_per_node="$TRAIN_GPUS" actor_rollout_ref.rollout.nnodes=1
       actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS"
       actor_rollout_ref.rollout.checkpoint_engine.backend="$BACKEND")
declare -A runs
runs[verl_sync]="trainer.v1.trainer_mode=sync trainer.n_gpus_per_node=$GPUS"
# verl 0.9.1's separate_async crashes with hybrid_engine=False (logger.info(flush=True)); its default
# (hybrid replicas on the training GPUs, parameter_sync_step 1) is what runs here.
# One staleness bound for both (verl's own default threshold, 8, would let stock lag 7 versions).
runs[verl_separate_async]="trainer.v1.trainer_mode=separate_async trainer.v1.separate_async.parameter_sync_step=1 trainer.v1.sampler.max_off_policy_threshold=$THRESHOLD ${split[*]}"
runs[tide]="+tide=enabled tide.max_staleness=$STALENESS ${split[*]}"
mkdir -p "$OUT"
for name in verl_sync verl_separate_async tide; do
  # shellcheck disable=SC2206
  cmd=("${PYTHON:-python}" -m verl.trainer.main_ppo ${runs[$name]} "${common[@]}")
  echo "[$name] ${cmd[*]}"
  if [ "$dry" = 0 ]; then
    "${cmd[@]}" 2>&1 | tee "$OUT/$name.log"
  fi
done
if [ "$dry" = 0 ]; then
  "${PYTHON:-python}" "$(dirname "${BASH_SOURCE[0]}")/collect.py" "$OUT"/verl_sync.log "$OUT"/verl_separate_async.log \
    "$OUT"/tide.log --json "$OUT/results.json"
fi
