"""`verl.plugins` entry point: verl imports this module in every process that imports verl.

- Trainer `tide` is registered in verl's TRAINER_REGISTRY as soon as verl imports the
  module that holds the registry (`trainer_base`), so processes that never build a
  trainer (vLLM engines, reward workers) do not pay for importing the trainer stack.
  Likewise the agent loops `tide_env_agent`, `tide_single_turn_agent` and `tide_tool_agent`, when verl
  imports its agent-loop registry.
The CPU test bed (`verl_tide.testing`) registers its platform and vLLM-CPU rollout through an entry point of
its own (`verl_tide.testing.register`); nothing here imports it.
All of it goes through verl's registries; no verl attribute is reassigned.

verl logs entry-point failures at DEBUG only, so every failure here is written to stderr
(Ray forwards workers' stderr to the driver) and kept in `REGISTRATION_ERRORS`.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from types import ModuleType

from verl_tide.import_hooks import when_imported

TRAINER_REGISTRY_MODULE = "verl.trainer.ppo.v1.trainer_base"
AGENT_LOOP_REGISTRY_MODULE = "verl.experimental.agent_loop.agent_loop"

REGISTRATION_ERRORS: list[str] = []


def loudly(what: str, fn: Callable[[], None], reraise: bool) -> None:
    """Run one registration; on failure say so on stderr.

    Inside a post-import hook the error is not re-raised: that would fail verl's own import
    of the registry module and break stock verl along with the plugin.
    """
    try:
        fn()
    except Exception:
        detail = traceback.format_exc()
        REGISTRATION_ERRORS.append(f"{what}: {detail}")
        message = f"verl-tide: {what} FAILED in pid {os.getpid()}; the plugin is not usable here.\n{detail}"
        print(message, file=sys.stderr, flush=True)
        if reraise:
            raise


def _register_trainer(registry: ModuleType) -> None:
    def go() -> None:
        from verl_tide.job_config import TRAINER_MODE
        from verl_tide.trainer.tide import TideTrainer

        registry.register_trainer(TRAINER_MODE)(TideTrainer)

    loudly("registering trainer 'tide'", go, reraise=False)


def _register_env_agent_loop(_: ModuleType) -> None:
    def go() -> None:
        import verl_tide.env.agent_loop  # noqa: F401  (@register("tide_env_agent") runs on import)

    loudly("registering agent loop 'tide_env_agent'", go, reraise=False)

    def stock_variants() -> None:
        import verl_tide.ctb.agent_loops  # noqa: F401  (tide_single_turn_agent, tide_tool_agent)

    loudly("registering agent loops 'tide_single_turn_agent' and 'tide_tool_agent'", stock_variants, reraise=False)


def _register() -> None:
    when_imported(TRAINER_REGISTRY_MODULE, _register_trainer)
    when_imported(AGENT_LOOP_REGISTRY_MODULE, _register_env_agent_loop)


_register()
