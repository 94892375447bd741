"""Trainer `tide` (verl's V1 trainer registry): `tide.TideTrainer` holds verl's hooks; the modules beside it
hold what each hook delegates to. Importing this package registers the trainer."""

from verl_tide.job_config import check_layout
from verl_tide.trainer.tide import TideNotBuiltError, TideTrainer, ideal_batch

__all__ = ["TideNotBuiltError", "TideTrainer", "check_layout", "ideal_batch"]
