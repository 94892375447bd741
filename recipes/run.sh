#!/usr/bin/env bash
# Run a verl-tide recipe with stock verl: recipes/run.sh RECIPE [hydra overrides...]
# e.g. recipes/run.sh tide_grpo_text data.train_files=~/data/gsm8k/train.parquet \
#        data.val_files=~/data/gsm8k/test.parquet actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipe="${1:?usage: recipes/run.sh RECIPE [overrides...]  (RECIPE: $(cd "$here" && ls *.yaml | sed 's/.yaml//' | tr '\n' ' '))}"
shift
exec python -m verl.trainer.main_ppo --config-path "$here" --config-name "$recipe" "$@"
