"""Overlapped evaluation (`verl_tide/evaluation.py`): the pieces that need no verl run. The run inside
verl (trainer `tide`, test_freq=1) is in test_tide_trainer_e2e.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from verl_tide.core.request_ids import EVAL_FIELD
from verl_tide.evaluation import EvalMarkedLoader, OverlappedEvaluation, overlapped_evaluation


class _Trainer:
    def __init__(self):
        self.global_steps = 4
        self.replay_buffer = "train buffer"
        self.tokenizer = "tok"


def test_validation_sees_its_own_buffer_and_the_step_it_evaluates_while_training_moves_on():
    release = threading.Event()
    seen = {}

    def validate(view):
        release.wait(5)
        seen.update(step=view.global_steps, buffer=view.replay_buffer, tok=view.tokenizer)
        return {"val-core/reward": 0.5}

    trainer, clock = _Trainer(), iter([10.0, 13.0, 14.5]).__next__
    ev = OverlappedEvaluation(validate, make_buffer=lambda: "val buffer", clock=clock)
    ev.start(trainer, step=4)
    trainer.global_steps = 5  # the next step trains meanwhile
    assert ev.pending_step == 4
    with pytest.raises(RuntimeError, match="still running"):
        ev.start(trainer, step=5)
    release.set()
    m = ev.collect()
    assert seen == {"step": 4, "buffer": "val buffer", "tok": "tok"}
    assert trainer.replay_buffer == "train buffer"
    assert m == {"val-core/reward": 0.5, "tide/eval/model_step": 4.0, "tide/eval/overlapped_s": 3.0,
                 "tide/eval/trainer_wait_s": 1.5}
    assert ev.collect() == {} and ev.pending_step is None
    ev.close()


def test_an_evaluation_error_reaches_the_trainer_and_clears_the_slot():
    def validate(view):
        raise ValueError("reward worker died")

    ev = OverlappedEvaluation(validate, make_buffer=lambda: None)
    ev.start(_Trainer(), step=1)
    with pytest.raises(ValueError, match="reward worker died"):
        ev.collect()
    ev.start(_Trainer(), step=2)  # the next evaluation may start
    with pytest.raises(ValueError):
        ev.collect()
    ev.close()


def test_validation_prompts_carry_the_evaluation_column():
    loader = [{"raw_prompt": np.array(["a", "b"], dtype=object)}, {"raw_prompt": np.array(["c"], dtype=object)}]
    marked = EvalMarkedLoader(loader)
    batches = list(marked)
    assert len(marked) == 2
    assert [list(b[EVAL_FIELD]) for b in batches] == [[True, True], [True]]


def test_evaluation_overlaps_only_when_wanted_and_rewards_run_on_reward_workers(capsys):
    asked = []

    def workers(handles):
        return lambda: asked.append(1) or handles

    args = (lambda view: {}, lambda: 0.0, lambda: None)
    assert overlapped_evaluation(False, workers(["w"]), *args) is None and not asked  # not even asked
    assert overlapped_evaluation(True, workers(None), *args) is None
    assert "reward.num_workers = 0" in capsys.readouterr().out
    assert isinstance(overlapped_evaluation(True, workers(["w"]), *args), OverlappedEvaluation)
