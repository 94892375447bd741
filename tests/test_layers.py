"""Pure modules stay pure: importing them loads no verl, ray, torch, omegaconf, hydra or vllm.

`verl_tide/core/` is guarded as a whole (every module in it, found by walking the package, so a module added
there is checked without being listed); the policies beside their mechanisms are listed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import verl_tide.core

POLICIES = ["verl_tide.ra2p.cost", "verl_tide.ra2p.batching", "verl_tide.ra2p.aggregation", "verl_tide.ra2p.layout", "verl_tide.ra2p.stock_cost",
            "verl_tide.ers.policy",
            "verl_tide.ers.advice", "verl_tide.ers.lending", "verl_tide.ctb.policy",
            "verl_tide.ctb.budgets", "verl_tide.ctb.tasks"]
HEAVY = ["verl", "ray", "torch", "omegaconf", "hydra", "vllm", "aiohttp", "prometheus_client"]


def _core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(verl_tide.core.__path__, "verl_tide.core."))


def _heavy_after_importing(modules: list[str]) -> list[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip())  # a list literal printed above


def test_the_core_folder_imports_nothing_heavy_module_by_module():
    modules = _core_modules()
    assert {"verl_tide.core.config", "verl_tide.core.readiness", "verl_tide.core.ledger",
            "verl_tide.core.request_ids", "verl_tide.core.planner"} <= set(modules)
    for module in modules:  # one interpreter each: a heavy import cannot hide behind another module's
        assert _heavy_after_importing([module]) == [], module


def test_pure_policies_import_nothing_heavy():
    assert _heavy_after_importing(POLICIES) == []


def test_nothing_outside_the_test_bed_imports_it():
    """The product (everything in verl_tide but `testing/`) never imports the CPU test bed: a GPU user's processes
    load none of it. Only `testing/` itself, `tests/` and `benchmarks/` may."""
    import re
    from pathlib import Path

    root = Path(verl_tide.__file__).parent
    pattern = re.compile(r"^\s*(from\s+verl_tide\.testing\b|import\s+verl_tide\.testing\b|from\s+verl_tide\s+import\s+"
                         r"(\w+,\s*)*testing\b)", re.M)
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if "testing" not in p.relative_to(root).parts[:1] and pattern.search(p.read_text())]
    assert not offenders, offenders
    assert pattern.search("    from verl_tide.testing.tiny_model import x\n")  # the check would see one
