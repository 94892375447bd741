"""The `verl.plugins` entry point, in fresh processes: what `import verl` registers, and what it must not touch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.verl_process  # fresh Python processes that import verl: 10-30 s each


def _python(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env}
    for key in ("VERL_PLATFORM", "VERL_USE_EXTERNAL_PLUGINS"):
        if key not in env:
            full_env.pop(key, None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=300)


_BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == {name!r}:
            raise ImportError("simulated broken install of " + name)
sys.meta_path.insert(0, Block())
"""


def test_import_verl_registers_trainer_tide(tmp_path):
    proc = _python(
        """
        import verl
        from verl.trainer.ppo.v1 import get_trainer_cls
        cls = get_trainer_cls("tide")
        from verl.trainer.ppo.v1.trainer_base import PPOTrainer
        print(cls.__module__, cls.__name__, issubclass(cls, PPOTrainer))
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verl_tide.trainer.tide TideTrainer True" in proc.stdout


def test_without_the_entry_point_there_is_no_trainer_tide(tmp_path):
    proc = _python(
        """
        import verl
        from verl.trainer.ppo.v1 import get_trainer_cls
        try:
            get_trainer_cls("tide")
        except ValueError as e:
            print("unknown:", e)
        """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert "unknown: Unknown trainer 'tide'" in proc.stdout, proc.stderr[-2000:]


def test_processes_that_build_no_trainer_do_not_import_the_trainer_stack(tmp_path):
    proc = _python(
        """
        import sys, verl
        print("trainer_base" , "verl.trainer.ppo.v1.trainer_base" in sys.modules, "verl_tide.trainer" in sys.modules)
        """,
        tmp_path,
    )
    assert "trainer_base False False" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def test_importing_the_plugin_reassigns_no_attribute_of_verl_vllm_sglang_or_ray(tmp_path):
    proc = _python(
        """
        import importlib, importlib.util, sys
        import verl, ray, vllm  # entry points are off: the plugin is not loaded yet
        import verl.trainer.ppo.v1.trainer_base, verl.workers.rollout.replica, verl.plugin.platform
        PKGS = {"verl", "vllm", "sglang", "ray"}
        if importlib.util.find_spec("sglang") is not None:
            import sglang
        def snapshot():
            return {(name, attr): id(value) for name, mod in list(sys.modules.items())
                    if mod is not None and name.split(".")[0] in PKGS
                    for attr, value in list(vars(mod).items())}
        before = snapshot()
        import os
        os.environ["VERL_PLATFORM"] = "cpu"  # also load the CPU test bed's registrations (its own entry point)
        import verl_tide, verl_tide.register, verl_tide.testing.register, verl_tide.trainer, verl_tide.hydra_callback
        import hydra_plugins.verl_tide_searchpath
        import verl_tide.testing.platform, verl_tide.testing.vllm_cpu, verl_tide.testing.vllm_cpu_engine
        after = snapshot()
        changed = sorted(f"{m}.{a}" for (m, a), i in before.items() if (m, a) in after and after[(m, a)] != i)
        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl.plugin.platform import PlatformRegistry
        print("registered:", get_trainer_cls("tide").__name__, PlatformRegistry.get("cpu").__name__)
        print("checked:", len(before))
        print("changed:", changed)
        """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "registered: TideTrainer CPUTestBedPlatform" in proc.stdout
    checked = int(proc.stdout.split("checked:")[1].split()[0])
    assert checked > 10_000  # the snapshot really covered verl, vllm and ray
    assert "changed: []" in proc.stdout, proc.stdout


def test_trainer_registration_failure_is_loud_and_leaves_stock_verl_working(tmp_path):
    proc = _python(
        _BLOCK.format(name="verl_tide.trainer")
        + """
import verl
from verl.trainer.ppo.v1 import get_trainer_cls
print("stock:", get_trainer_cls("sync").__name__)
try:
    get_trainer_cls("tide")
except ValueError as e:
    print("tide:", e)
""",
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verl-tide: registering trainer 'tide' FAILED" in proc.stderr
    assert "simulated broken install of verl_tide.trainer" in proc.stderr
    assert "stock: " in proc.stdout
    assert "tide: Unknown trainer 'tide'" in proc.stdout


def test_cpu_platform_registration_failure_is_loud(tmp_path):
    proc = _python(_BLOCK.format(name="verl_tide.testing.platform") + "\nimport verl\n", tmp_path, VERL_PLATFORM="cpu")
    assert "verl-tide: registering the CPU test bed platform FAILED" in proc.stderr


@pytest.mark.parametrize("selected, expected", [("", "None"), ("cpu", "CPUTestBedPlatform")])
def test_cpu_platform_is_registered_only_when_selected(tmp_path, selected, expected):
    env = {"VERL_PLATFORM": selected} if selected else {}
    proc = _python(
        """
        import verl
        from verl.plugin.platform import PlatformRegistry
        cls = PlatformRegistry.get("cpu")
        print("cpu platform:", cls.__name__ if cls else None)
        """,
        tmp_path,
        **env,
    )
    assert f"cpu platform: {expected}" in proc.stdout, proc.stderr[-2000:]


def test_the_products_entry_point_imports_nothing_of_the_test_bed(tmp_path):
    """`verl_tide.register` (what a GPU user's processes load) never imports `verl_tide.testing`; the test bed
    registers through its own entry point, and importing trainer `tide`'s package registers nothing."""
    proc = _python(
        """
        import sys, verl
        import verl.trainer.ppo.v1.trainer_base  # the registry: verl_tide.register registers trainer tide now
        import verl_tide.register, verl_tide.trainer
        from verl.trainer.ppo.v1 import get_trainer_cls
        print("tide:", get_trainer_cls("tide").__name__)
        print("testing:", sorted(m for m in sys.modules if m.startswith("verl_tide.testing")))
        """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="tide",  # only the product's entry point, as a user may pick
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tide: TideTrainer" in proc.stdout and "testing: []" in proc.stdout, proc.stdout
    proc = _python(
        """
        import verl_tide.trainer, verl_tide.trainer.tide
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
        print("registered on import:", "tide" in TRAINER_REGISTRY)
        """,
        tmp_path,
        VERL_USE_EXTERNAL_PLUGINS="none",
    )
    assert "registered on import: False" in proc.stdout, proc.stderr[-3000:]
