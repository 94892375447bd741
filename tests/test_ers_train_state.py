"""ERS's trainer resize moves the Actor's training state between FSDP groups of different sizes, through verl's FSDP
engine in Ray worker groups on CPU: parameters, Adam's moments and step, and the learning-rate schedule arrive
exactly, and training continues as if the group had never changed size."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = pytest.mark.testbed

TEXTS = ["Question: what is 3 plus 4? Answer: 3 + 4 = 7 #### 7", "what is 12 plus 30",
         "so the total number of apples is 5", "let's think step by step", "7 times 6 is 42", "Answer: 12",
         "first add the tens, then the ones", "the remainder is 3 #### 3"]


@pytest.fixture(scope="module")
def sequences(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    return [tok.encode(t) for t in TEXTS]


def _group(model_path, world_size):
    import verl_tide.register, verl_tide.testing.register  # noqa: F401
    from verl.workers.utils.losses import sft_loss
    from verl_tide.testing.engine import build_training_worker_group
    from verl_tide.testing.resizable_worker import ResizableTrainingWorker

    wg = build_training_worker_group(model_path, world_size=world_size, lr=1e-2, worker_cls=ResizableTrainingWorker)
    wg.set_loss_fn(loss_fn=partial(sft_loss, config=None))
    return wg


def _train(wg, sequences):
    from tensordict.tensorclass import NonTensorData

    from verl.utils import tensordict_utils as tu
    from verl_tide.testing.engine import make_lm_batch

    data = make_lm_batch(sequences)
    tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=NonTensorData([len(s) for s in sequences]))
    out = wg.train_batch(data)
    return out.get() if hasattr(out, "get") else out


def _log_probs(wg, sequences):
    from verl_tide.testing.engine import make_lm_batch

    out = wg.infer_batch(make_lm_batch(sequences))
    out = out.get() if hasattr(out, "get") else out
    return [out["log_probs"][i][: len(s) - 1].float() for i, s in enumerate(sequences)]


def _digest(wg):
    digests = wg.train_state_digest()
    assert all(d == digests[0] for d in digests), "ranks disagree on the full training state"
    return digests[0]


def _close(a, b, atol):
    return all(torch.allclose(x, y, atol=atol, rtol=0) for x, y in zip(a, b))


def test_the_actor_state_moves_down_and_back_up_between_world_sizes(ray_cpu_cluster, tiny_model_path, sequences,
                                                                     tmp_path):
    from verl_tide.testing.engine import stop_training_worker_group

    first, second = sequences[:4], sequences[4:]
    two = _group(str(tiny_model_path), 2)
    _train(two, first)  # Adam's moments and step are non-zero from here
    saved = _digest(two)
    assert any(k.endswith(".exp_avg") for k in saved) and any(k.endswith(".step") for k in saved), sorted(saved)[:8]
    before = _log_probs(two, sequences)
    two.export_train_state(str(tmp_path / "down"))
    _train(two, second)  # what the group would have done without the move
    reference = _log_probs(two, sequences)
    assert not _close(reference, before, 1e-3)  # the second update moves log-probs: the comparisons below can fail
    stop_training_worker_group(two)

    one = _group(str(tiny_model_path), 1)
    fresh = _digest(one)
    assert fresh != saved  # a group that has not loaded holds another state: equality below means the load
    one.import_train_state(str(tmp_path / "down"))
    assert _digest(one) == saved  # every parameter, moment, step and the schedule, bit for bit
    assert _close(_log_probs(one, sequences), before, 1e-6)
    _train(one, second)
    assert _close(_log_probs(one, sequences), reference, 1e-4)  # the same update as the unchanged group made
    after_one = _digest(one)
    one.export_train_state(str(tmp_path / "up"))
    stop_training_worker_group(one)

    two = _group(str(tiny_model_path), 2)
    two.import_train_state(str(tmp_path / "up"))
    assert _digest(two) == after_one
    assert _close(_log_probs(two, sequences), reference, 1e-4)
    stop_training_worker_group(two)


def test_loading_from_a_missing_directory_names_it(ray_cpu_cluster, tiny_model_path, tmp_path):
    from verl_tide.testing.engine import stop_training_worker_group

    one = _group(str(tiny_model_path), 1)
    try:
        with pytest.raises(Exception, match="no saved training state at"):
            one.import_train_state(str(tmp_path / "absent"))
    finally:
        stop_training_worker_group(one)
