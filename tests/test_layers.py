"""Pure modules stay pure: importing them loads no verl, ray, torch, omegaconf, hydra or vllm.

`verl_tide/core/` is guarded as a whole (every module in it, found by walking the package, so a module added
there is checked without being listed); the policies beside their mechanisms are listed."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import verl_tide.boundary
import verl_tide.core

POLICIES = ["verl_tide.ra2p.cost", "verl_tide.ra2p.batching", "verl_tide.ra2p.aggregation", "verl_tide.ra2p.layout", "verl_tide.ra2p.stock_cost",
            "verl_tide.ers.policy",
            "verl_tide.ers.advice", "verl_tide.ers.lending", "verl_tide.ers.resize", "verl_tide.ctb.policy",
            "verl_tide.ctb.budgets", "verl_tide.ctb.tasks", "verl_tide.ctb.window"]
HEAVY = ["verl", "ray", "torch", "omegaconf", "hydra", "vllm", "aiohttp", "prometheus_client"]


def _core_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(verl_tide.core.__path__, "verl_tide.core."))


def _boundary_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(verl_tide.boundary.__path__, "verl_tide.boundary."))


def _imports_of(module: str) -> set[str]:
    """The verl_tide modules `module` imports, at any depth of its code (from its source, not by running it)."""
    import ast
    import importlib.util

    tree = ast.parse(open(importlib.util.find_spec(module).origin).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("verl_tide"):
            submodules = {f"{node.module}.{a.name}" for a in node.names}  # `from verl_tide.ers import lending`
            found = {m for m in submodules if importlib.util.find_spec(node.module).submodule_search_locations
                     and importlib.util.find_spec(m) is not None}
            out.update(found or {node.module})
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("verl_tide"))
    return out


def _heavy_after_importing(modules: list[str]) -> list[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return eval(proc.stdout.strip())  # a list literal printed above


def test_the_core_folder_imports_nothing_heavy_module_by_module():
    modules = _core_modules()
    assert {"verl_tide.core.config", "verl_tide.core.readiness", "verl_tide.core.ledger",
            "verl_tide.core.request_ids"} <= set(modules)
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


def test_the_pure_layers_import_nothing_above_them():
    """core/ imports only core/; a policy imports core/ and its own part's policies; the boundary layer imports
    core/, the policies and itself. Nothing pure imports a mechanism, an adapter, the simulator or the test bed."""
    for module in _core_modules():
        assert {m for m in _imports_of(module) if not m.startswith("verl_tide.core")} == set(), module
    for module in POLICIES:
        part = module.rsplit(".", 1)[0]
        above = {m for m in _imports_of(module) if not m.startswith("verl_tide.core")
                 and not (m.startswith(part) and m in POLICIES + [part])}
        assert above <= set(POLICIES) - {module}, (module, above)  # (cost models shared across parts: ers reads ra2p's)
    modules = _boundary_modules()
    assert {"verl_tide.boundary.planner", "verl_tide.boundary.round"} <= set(modules)
    for module in modules:
        above = {m for m in _imports_of(module)
                 if not m.startswith(("verl_tide.core", "verl_tide.boundary")) and m not in POLICIES}
        assert above == set(), (module, above)
        assert _heavy_after_importing([module]) == [], module
