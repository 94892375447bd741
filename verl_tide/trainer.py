"""The V1 trainer `tide`, registered in verl's TRAINER_REGISTRY.

verl's `TaskRunnerV1` builds it for `trainer.v1.trainer_mode=tide` (set by `+tide=enabled`).
Today it validates the `tide:` subtree and constructs; the readiness-aware loop is not
built yet, so `init()` stops the job and says what is missing instead of silently
running another trainer's loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer

from verl_tide.job_config import TRAINER_MODE, tide_config_from_job

if TYPE_CHECKING:
    from omegaconf import DictConfig

NOT_BUILT_YET = (
    "the readiness-aware training loop (ready micro-batch streaming, staleness bound, weight sync to elastic "
    "ranks), CTB task routing on rollout ranks, RA2P Ref/Actor pipelining and ERS rank scaling"
)


class TideNotBuiltError(NotImplementedError):
    """Raised when a job reaches a part of trainer `tide` that does not exist yet."""


@register_trainer(TRAINER_MODE)
class TideTrainer(PPOTrainer):
    def __init__(self, config: DictConfig):
        self.tide_config = tide_config_from_job(config)
        super().__init__(config)

    def init(self) -> None:
        raise TideNotBuiltError(
            f"verl-tide trainer '{TRAINER_MODE}' was constructed and its config is valid, but {NOT_BUILT_YET} "
            "are not built yet in this release. Nothing was run. To train now, drop `+tide=enabled` "
            "(stock trainer_mode=sync) or set trainer.v1.trainer_mode to sync, colocate_async or separate_async."
        )

    # PPOTrainer's abstract hooks: unreachable while init() refuses to run.
    def on_sample_end(self) -> None:
        raise TideNotBuiltError(f"trainer '{TRAINER_MODE}': the sampling loop is not built yet")

    def on_step_end(self) -> None:
        raise TideNotBuiltError(f"trainer '{TRAINER_MODE}': the step loop is not built yet")
