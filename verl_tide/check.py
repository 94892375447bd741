"""`verl-tide check <overrides>`: compose a job's config exactly as `python -m verl.trainer.main_ppo` would and
validate it as trainer `tide` will, without launching anything.

`main_ppo --cfg job` only prints the composed config (Hydra does not build the callback that validates
`tide.*`), and a misspelt key gets Hydra's bare "not in struct"; this reports every bad `tide.*` value and unknown
key with what is allowed, and a layout trainer `tide` cannot run, in a second or two and with no GPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

VERL_CONFIG_MODULE = "verl.trainer.config"  # where main_ppo's @hydra.main(config_path="config") points
VERL_CONFIG_NAME = "ppo_trainer"


@dataclass
class CheckResult:
    problems: list[str] = field(default_factory=list)
    trainer_mode: Optional[str] = None

    @property
    def ok(self) -> bool:
        return not self.problems


def compose(overrides: list[str], config_path: Optional[str] = None, config_name: Optional[str] = None):
    """The job's config as main_ppo composes it (verl-tide's search-path plugin makes `+tide=enabled` visible)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    if config_path:
        init = initialize_config_dir(config_dir=str(Path(config_path).resolve()), version_base=None)
    else:
        init = initialize_config_module(config_module=VERL_CONFIG_MODULE, version_base=None)
    with init:
        return hydra_compose(config_name=config_name or VERL_CONFIG_NAME, overrides=overrides)


def check(overrides: list[str], config_path: Optional[str] = None, config_name: Optional[str] = None) -> CheckResult:
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from verl_tide.core.config import TideConfigError
    from verl_tide.job_config import TRAINER_MODE, check_layout, tide_config_from_job

    result = CheckResult()
    kept = list(overrides)
    while True:  # an unknown key: say which and what its node allows, then check the rest without it
        try:
            cfg = compose(kept, config_path, config_name)
            break
        except HydraException as e:
            bad = _unknown_key(str(e), kept)
            if bad is None:
                result.problems.append(f"composition failed: {e}")
                return result
            kept.remove(bad)
            key = bad.lstrip("+~").split("=", 1)[0]
            result.problems.append(_unknown_key_message(key, kept, config_path, config_name))
    result.trainer_mode = OmegaConf.select(cfg, "trainer.v1.trainer_mode", default=None)
    tide = None
    try:
        tide = tide_config_from_job(cfg)
    except TideConfigError as e:
        result.problems.extend(e.problems)
    if result.trainer_mode == TRAINER_MODE:
        try:
            check_layout(cfg, tide)  # without a valid tide: subtree, the layout alone
        except TideConfigError as e:
            result.problems.extend(e.problems)
    return result


def _unknown_key(message: str, overrides: list[str]) -> Optional[str]:
    """The override Hydra refused because its key does not exist, from its message."""
    m = re.search(r"Could not override '([^']+)'", message) or re.search(r"Key '([^']+)' is not in struct", message)
    if not m:
        return None
    name = m.group(1)
    for o in overrides:
        key = o.lstrip("+~").split("=", 1)[0]
        if key == name or key.endswith("." + name):
            return o
    return None


def _unknown_key_message(key: str, kept: list[str], config_path: Optional[str], config_name: Optional[str]) -> str:
    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = key.rpartition(".")
    try:
        node = OmegaConf.select(compose(kept, config_path, config_name), parent) if parent else None
    except Exception:
        node = None
    if isinstance(node, DictConfig):
        allowed = ", ".join(sorted(str(k) for k in node.keys()))
        return f"{key}: no such key; allowed under {parent}: {allowed}"
    return f"{key}: no such key in the composed config (add it with + only if verl's config has no such node)"


def main(overrides: list[str], config_path: Optional[str], config_name: Optional[str]) -> int:
    result = check(overrides, config_path, config_name)
    if result.ok:
        print(f"OK: the job composes and validates (trainer.v1.trainer_mode = {result.trainer_mode})")
        return 0
    print(f"{len(result.problems)} problem(s) in the job's config:")
    for p in result.problems:
        print(f"  - {p}")
    return 1
