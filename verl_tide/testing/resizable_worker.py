"""verl's bare `TrainingWorker` with ERS's train-state transfer mixed in, for tests of a trainer resize without a
whole PPO job (trainer `tide`'s `TideActorWorker` has the same methods)."""

from __future__ import annotations

from verl.workers.engine_workers import TrainingWorker

from verl_tide.ers.resize_worker import TrainStateTransfer


class ResizableTrainingWorker(TrainStateTransfer, TrainingWorker):
    pass
