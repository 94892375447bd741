#!/usr/bin/env bash
# Stock verl against +tide=enabled on YOUR cluster: one recipe's GRPO job three times, with the same model, data,
# steps and GPUs (stock `sync`, stock `separate_async` with its hybrid switch, tide), then one table of goodput and
# waits (collect.py). Every run is attempted and reported, whatever the others did.
#
#   benchmarks/verl_vs_tide/run.sh [--dry-run] [hydra overrides for all three runs...]
#
#   --dry-run   compose and validate the three jobs' configs (verl-tide check: every bad tide.* value, unknown
#               key and layout), print the commands, launch nothing (no Ray, no GPU needed)
#
# Environment (defaults in brackets):
#   RECIPE [tide_grpo_env_service]  a recipe of recipes/ (GRPO on vLLM; its tide: block is dropped for stock runs)
#   NNODES [1]           trainer nodes; sync colocates rollout on them
#   GPUS_PER_NODE [8]    GPUs per node
#   ROLLOUT_NNODES [1]   of the nodes, rollout nodes of separate_async and tide (sync uses NNODES+ROLLOUT_NNODES)
#   ROLLOUT_GPUS [4]     rollout GPUs per rollout node (on one node: the rest train)
#   STEPS [20]           training steps per run
#   STALENESS [1]        policy versions a trajectory may lag the trainer, for separate_async and tide alike
#                        (verl's max_off_policy_threshold counts versions spanned: verl_tide.job_config.off_policy_threshold)
#   BACKEND [nccl]       checkpoint engine between separate trainer and rollout ranks
#   OUT [verl_vs_tide_out]  logs and results
#   PYTHON [python]      the environment with verl and verl-tide installed
# Pass your usual overrides (data.*, actor_rollout_ref.model.path, tide.env.url, batch sizes, ...) as arguments.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipes="$(cd "$here/../../recipes" && pwd)"
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,23p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0; fi
PY=${PYTHON:-python}
RECIPE=${RECIPE:-tide_grpo_env_service}
NNODES=${NNODES:-1}; GPUS_PER_NODE=${GPUS_PER_NODE:-8}; ROLLOUT_NNODES=${ROLLOUT_NNODES:-1}
ROLLOUT_GPUS=${ROLLOUT_GPUS:-4}; STEPS=${STEPS:-20}; BACKEND=${BACKEND:-nccl}; STALENESS=${STALENESS:-1}
OUT=${OUT:-verl_vs_tide_out}
if [ ! -f "$recipes/$RECIPE.yaml" ]; then
  echo "run.sh: RECIPE=$RECIPE: no such recipe; one of: $(cd "$recipes" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')" >&2
  exit 2
fi
THRESHOLD=$("$PY" -c "from verl_tide.job_config import off_policy_threshold; print(off_policy_threshold($STALENESS))") || exit 2
if [ "$NNODES" = 1 ] && [ "$ROLLOUT_NNODES" -ge 1 ]; then
  # one node shared: ROLLOUT_GPUS roll out, the rest train
  TRAIN_NODES=1; TRAIN_GPUS=$((GPUS_PER_NODE - ROLLOUT_GPUS)); ROLL_NODES=1; SYNC_NODES=1
else
  TRAIN_NODES=$NNODES; TRAIN_GPUS=$GPUS_PER_NODE; ROLL_NODES=$ROLLOUT_NNODES; SYNC_NODES=$((NNODES + ROLLOUT_NNODES))
fi
recipe=(--config-path "$recipes" --config-name "$RECIPE")
common=(trainer.total_training_steps="$STEPS" trainer.logger=[console] trainer.val_before_train=False
        trainer.test_freq=-1 trainer.save_freq=-1 "$@")
split=(trainer.nnodes="$TRAIN_NODES" trainer.n_gpus_per_node="$TRAIN_GPUS"
       actor_rollout_ref.rollout.nnodes="$ROLL_NODES" actor_rollout_ref.rollout.n_gpus_per_node="$ROLLOUT_GPUS"
       actor_rollout_ref.rollout.checkpoint_engine.backend="$BACKEND")
# stock runs: the recipe without `tide: enabled` (its tide: block stays as data the environment agent loop reads)
stock=("~tide" trainer.v1.sampler.max_off_policy_threshold="$THRESHOLD")
declare -A runs
runs[verl_sync]="${stock[*]} trainer.v1.trainer_mode=sync trainer.nnodes=$SYNC_NODES trainer.n_gpus_per_node=$GPUS_PER_NODE actor_rollout_ref.rollout.nnodes=0"
# the strongest stock asynchronous mode in this project's comparisons: hybrid replicas lent by verl's switch
runs[verl_separate_async_switch]="${stock[*]} trainer.v1.trainer_mode=separate_async actor_rollout_ref.hybrid_engine=true trainer.v1.separate_async.hybrid_rollout.enable_switch=true ${split[*]}"
runs[tide]="tide.max_staleness=$STALENESS ${split[*]}"
mkdir -p "$OUT"
declare -A status
for name in verl_sync verl_separate_async_switch tide; do
  # shellcheck disable=SC2206
  overrides=(${runs[$name]} "${common[@]}")
  if [ "$name" != tide ]; then  # without tide/enabled.yaml, a user's tide.* key (tide.env.url, ...) is new data
    for i in "${!overrides[@]}"; do
      case "${overrides[$i]}" in tide.*) overrides[$i]="++${overrides[$i]}";; esac
    done
  fi
  echo "[$name] $PY -m verl.trainer.main_ppo ${recipe[*]} ${overrides[*]}"
  if [ "$dry" = 1 ]; then
    "$PY" -m verl_tide.cli check "${recipe[@]}" "${overrides[@]}" 2>&1 | sed "s/^/[$name] /"
    status[$name]=${PIPESTATUS[0]}
  else
    "$PY" -m verl.trainer.main_ppo "${recipe[@]}" "${overrides[@]}" 2>&1 | tee "$OUT/$name.log"
    status[$name]=${PIPESTATUS[0]}
  fi
done
failed=0
for name in verl_sync verl_separate_async_switch tide; do
  echo "[$name] $([ "${status[$name]}" = 0 ] && echo ok || echo "FAILED (exit ${status[$name]})")"
  [ "${status[$name]}" = 0 ] || failed=1
done
if [ "$dry" = 0 ]; then
  logs=()
  for name in verl_sync verl_separate_async_switch tide; do [ -s "$OUT/$name.log" ] && logs+=("$OUT/$name.log"); done
  [ ${#logs[@]} -gt 0 ] && "$PY" "$here/collect.py" "${logs[@]}" --json "$OUT/results.json" || failed=1
fi
exit $failed
