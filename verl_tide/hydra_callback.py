"""Hydra callback declared by `tide/enabled.yaml`: rejects bad `tide.*` values in the driver.

Validation runs when Hydra instantiates its callbacks, right after composing the config and
before it calls verl's `main_ppo.main` (so before `ray.init`): a typo costs seconds, not a
cluster start-up. It has to be the constructor: Hydra turns exceptions raised inside
callback hooks (`on_job_start`, ...) into warnings and runs the job anyway, while an error
while instantiating a callback stops the run.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from verl_tide.config import TideConfig
from verl_tide.job_config import tide_config_from_job


class ValidateTideConfig(Callback):
    def __init__(self, tide: Any = None, trainer_mode: Any = None) -> None:
        job = OmegaConf.create({"tide": tide, "trainer": {"v1": {"trainer_mode": trainer_mode}}})
        self.tide_config: TideConfig = tide_config_from_job(job)
