"""Hydra callback declared by `tide/enabled.yaml`: rejects bad `tide.*` values and job layouts
trainer `tide` cannot run (`check_layout`) in the driver.

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

from verl_tide.core.config import TideConfig
from verl_tide.job_config import TRAINER_MODE, check_layout, tide_config_from_job


class ValidateTideConfig(Callback):
    def __init__(self, tide: Any = None, trainer_mode: Any = None, layout: Any = None) -> None:
        """`layout`: the keys of verl's config that `check_layout` reads, at their paths (interpolated by
        `tide/enabled.yaml`), so a layout trainer `tide` cannot run is refused before Ray starts too."""
        job = OmegaConf.create({"tide": tide, "trainer": {"v1": {"trainer_mode": trainer_mode}}})
        self.tide_config: TideConfig = tide_config_from_job(job)
        if trainer_mode == TRAINER_MODE and layout is not None:
            plain = OmegaConf.to_container(layout, resolve=True) if OmegaConf.is_config(layout) else layout
            check_layout(OmegaConf.create(plain), self.tide_config)
