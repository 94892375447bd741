"""Hydra callback declared by `tide/enabled.yaml`: rejects bad `tide.*` values in the driver.

Hydra runs `on_job_start` before the task function, i.e. before verl's `main_ppo.main`
calls `ray.init`, so a typo costs seconds, not a cluster start-up.
"""

from __future__ import annotations

from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from verl_tide.job_config import tide_config_from_job


class ValidateTideConfig(Callback):
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        tide_config_from_job(config)
