#!/usr/bin/env bash
# RA2P step time on one GPU (issue 5's GPU variant): a 0.70B random-init Llama (24 layers, hidden 1536),
# rates learned online from 8 micro-batches of 2 x 1024 tokens predict steps of 8 micro-batches of 3 x 1024
# (out of sample), four arrival patterns, each mode run for real, two calibrate-then-predict rounds. Needs torch and transformers only (no verl, no network); a few minutes on an H100/H200.
# Writes benchmarks/results/ra2p_step_<gpu name>.json (override with OUT=path).
set -euo pipefail
cd "$(dirname "$0")/.."
name=$(python -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_'))")
out=${OUT:-benchmarks/results/ra2p_step_${name}.json}
PYTHONPATH=. python benchmarks/ra2p_step.py --device cuda --layers 24 --hidden 1536 --vocab 32000 --seq 1024 \
    --mb-size 2 --micro-batches 8 --test-mb-size 3 --test-micro-batches 8 --repeats 2 --json "$out"
echo "wrote $out"
