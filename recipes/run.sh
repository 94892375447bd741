#!/usr/bin/env bash
# Run a verl-tide recipe with stock verl: recipes/run.sh RECIPE [hydra overrides...]
# e.g. recipes/run.sh tide_grpo_text data.train_files=~/data/gsm8k/train.parquet \
#        data.val_files=~/data/gsm8k/test.parquet actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
recipes="$(cd "$here" && ls *.yaml | sed 's/\.yaml$//' | tr '\n' ' ')"
usage() {
  cat <<USAGE
usage: recipes/run.sh RECIPE [hydra overrides...]

Runs python -m verl.trainer.main_ppo with the recipe's config (GRPO with +tide=enabled) and your overrides.
RECIPE: one of: ${recipes}
e.g.   recipes/run.sh tide_grpo_text data.train_files=~/data/gsm8k/train.parquet \\
         data.val_files=~/data/gsm8k/test.parquet actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct
Docs:  docs/recipes.md
USAGE
}
if [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]]; then
  usage
  exit 0
fi
if [[ $# -lt 1 ]]; then
  usage >&2
  exit 2
fi
recipe="$1"
shift
if [[ ! -f "$here/$recipe.yaml" ]]; then
  echo "recipes/run.sh: no recipe '$recipe'; RECIPE is one of: ${recipes}" >&2
  exit 2
fi
exec python -m verl.trainer.main_ppo --config-path "$here" --config-name "$recipe" "$@"
