#!/usr/bin/env bash
# Build verl-tide's sdist and wheel (dist/), install the wheel into a clean virtual environment beside verl 0.9.1
# (the CPU set of constraints/cpu.txt), and run `main_ppo +tide=enabled --cfg job` and `verl-tide check` from it,
# outside this checkout (so nothing is imported from the source tree). `make release-check`; a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
PYTHON=${PYTHON:-python3.11}
VENV=${RELEASE_VENV:-.venv-release}
rm -rf "$VENV"
PYTHON="$PYTHON" bash scripts/build-dist.sh
wheel=$(ls dist/verl_tide-*.whl)
VENV="$VENV" VERL_TIDE_WHEEL="$root/$wheel" PYTHON="$PYTHON" bash scripts/setup-venv.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
"$root/$VENV/bin/python" - <<'PY'
import verl_tide, importlib.metadata as md
assert "site-packages" in verl_tide.__file__, verl_tide.__file__  # the wheel, not the checkout
eps = sorted(e.name for e in md.entry_points(group="verl.plugins"))
assert eps == ["tide", "tide_testbed"], eps
print("installed from the wheel:", verl_tide.__file__, "entry points:", eps)
PY
"$root/$VENV/bin/python" -m verl.trainer.main_ppo +tide=enabled algorithm.adv_estimator=grpo --cfg job > cfg.yaml
grep -q "trainer_mode: tide" cfg.yaml && grep -q "^tide:" cfg.yaml
echo "main_ppo +tide=enabled --cfg job: trainer_mode tide and the tide: subtree, from the installed wheel"
"$root/$VENV/bin/verl-tide" check +tide=enabled algorithm.adv_estimator=grpo actor_rollout_ref.rollout.nnodes=1 \
  actor_rollout_ref.rollout.n_gpus_per_node=1 actor_rollout_ref.rollout.checkpoint_engine.backend=nccl
echo "release check passed: $(ls "$root"/dist)"
