"""Pure policy modules stay pure: importing them loads no verl, ray, torch or omegaconf."""

from __future__ import annotations

import subprocess
import sys

PURE = ["verl_tide.config", "verl_tide.readiness", "verl_tide.ra2p.cost", "verl_tide.ers.policy", "verl_tide.ctb.policy", "verl_tide.ra2p.batching",
        "verl_tide.ra2p.aggregation"]
HEAVY = ["verl", "ray", "torch", "omegaconf", "hydra", "vllm"]


def test_pure_modules_import_nothing_heavy():
    code = (
        "import sys\n"
        + "".join(f"import {m}\n" for m in PURE)
        + f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
