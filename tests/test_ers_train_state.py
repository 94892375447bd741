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


def _layout(model_path):
    import ray

    import verl_tide.register, verl_tide.testing.register  # noqa: F401
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.workers.utils.losses import sft_loss
    from verl_tide.testing.engine import training_worker_config
    from verl_tide.testing.resizable_worker import ResizableTrainingWorker
    from verl_tide.trainer.actor_group import ActorGroupLayout

    worker = RayClassWithInitArgs(ray.remote(ResizableTrainingWorker), config=training_worker_config(model_path, lr=1e-2))
    return ActorGroupLayout(class_dict={"actor": worker}, actor_role="actor", init_method={"actor": "reset"},
                            wg_kwargs={"device_name": "cpu"},
                            after_init=lambda views: views["actor"].set_loss_fn(loss_fn=partial(sft_loss, config=None)))


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
    """verl's colocated worker class over 2 fake GPUs, resized to 1 and back to 2 at a boundary."""
    from verl_tide.trainer.actor_group import build_actor_group, resize_actor_group, stop_actor_group

    layout = _layout(str(tiny_model_path))
    first, second = sequences[:4], sequences[4:]
    views, pool = build_actor_group(layout, 2)
    two = views["actor"]
    assert two.world_size == 2
    _train(two, first)  # Adam's moments and step are non-zero from here
    saved = _digest(two)
    assert any(k.endswith(".exp_avg") for k in saved) and any(k.endswith(".step") for k in saved), sorted(saved)[:8]
    before = _log_probs(two, sequences)

    views, pool, down = resize_actor_group(layout, views, pool, 1)
    one = views["actor"]
    assert one.world_size == 1 and (down.world_from, down.world_to) == (2, 1) and down.total_s > 0
    assert _digest(one) == saved  # every parameter, moment, step and the schedule, bit for bit
    assert _close(_log_probs(one, sequences), before, 1e-6)
    _train(one, second)
    after_one = _digest(one)
    trained_on_one = _log_probs(one, sequences)
    assert not _close(trained_on_one, before, 1e-3)  # the update moved log-probs: the comparisons can fail

    views, pool, up = resize_actor_group(layout, views, pool, 2)
    two = views["actor"]
    assert two.world_size == 2 and (up.world_from, up.world_to) == (1, 2)
    assert _digest(two) == after_one
    assert _close(_log_probs(two, sequences), trained_on_one, 1e-6)

    # The same two updates on a group that never changed size: the resized one trained as it would have.
    stop_actor_group(views, pool)
    views, pool = build_actor_group(layout, 2)
    fixed = views["actor"]
    assert _digest(fixed) != saved  # a fresh group holds another state: the equalities above mean the loads
    _train(fixed, first)
    _train(fixed, second)
    assert _close(_log_probs(fixed, sequences), trained_on_one, 1e-4)
    with pytest.raises(Exception, match="no saved training state at"):
        fixed.import_train_state(str(tmp_path / "absent"))
    with pytest.raises(ValueError, match="resize to 3 GPU"):  # two fake GPUs in this cluster: refused before a stop
        resize_actor_group(layout, views, pool, 3, gpu_wait_s=2.0)
    assert _close(_log_probs(fixed, sequences), trained_on_one, 1e-4)  # the group still answers
    stop_actor_group(views, pool)
