#!/bin/bash
# Stock separate_async 1T/2R and tide on the every-part job, each beside the per-process CPU sampler (2026-12-04).
# Run from a checkout with .venv; writes /tmp/probe/{stock1t2r,tide}{.json,.cpu.json}. Then: cpu_report.py.
cd "$(dirname "$0")/../.."
mkdir -p /tmp/probe
for pair in "stock1t2r|verl separate_async 1T/2R" "tide|tide"; do
  slug=${pair%%|*}; sys=${pair#*|}
  rm -f /tmp/probe/$slug.cpu.json.stop
  .venv/bin/python benchmarks/probes/cpu_sampler.py /tmp/probe/$slug.cpu.json &
  sp=$!
  .venv/bin/python benchmarks/e2e_compare.py --preset every_part --only "$sys" --workdir /tmp/probe/w_$slug --json /tmp/probe/$slug.json > /tmp/probe/$slug.out 2>&1
  touch /tmp/probe/$slug.cpu.json.stop; wait $sp
done
