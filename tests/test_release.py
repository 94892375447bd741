"""The release artefacts: the wheel carries what `+tide=enabled` needs outside this checkout (the Hydra plugin, the
config groups, the simulator's presets, both entry points). The clean-venv install is `make release-check`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_wheel_carries_the_plugin_its_configs_and_both_entry_points(tmp_path):
    code = ("from setuptools import build_meta as b; import os; os.chdir(%r); "
            "print(b.build_wheel(%r))" % (str(ROOT), str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = tmp_path / out.stdout.strip().splitlines()[-1]
    assert wheel.name.startswith("verl_tide-0.1.0-")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("verl_tide/conf/tide/enabled.yaml", "verl_tide/conf/router/ctb.yaml",
                   "verl_tide/sim/workloads/webshop.yaml", "hydra_plugins/verl_tide_searchpath/__init__.py",
                   "verl_tide/register.py", "verl_tide/testing/register.py"):
        assert any(n.endswith(needed) for n in names), needed
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "tide = verl_tide.register" in entry_points and "tide_testbed = verl_tide.testing.register" in entry_points
    assert "verl-tide = verl_tide.cli:main" in entry_points
    assert not any(n.startswith("tests/") for n in names)
