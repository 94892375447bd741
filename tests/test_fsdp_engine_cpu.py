"""verl's FSDP training engine, in a Ray worker group on CPU with the plugin loaded."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = pytest.mark.testbed


def _hf_token_log_probs(model_path, sequences):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(input_ids=ids).logits[0, :-1]
            out.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[0, 1:, None])[:, 0])
    return out


def _engine_token_log_probs(wg, sequences):
    from verl_tide.testing.engine import make_lm_batch

    output = wg.infer_batch(make_lm_batch(sequences))
    output = output.get() if hasattr(output, "get") else output
    log_probs = output["log_probs"]
    # Position t holds log p(token t+1 | ...); the last position wraps around and is not a prediction.
    return [log_probs[i][: len(seq) - 1].float() for i, seq in enumerate(sequences)]


@pytest.fixture(scope="module")
def sequences(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    texts = ["Question: what is 3 plus 4? Answer: 3 + 4 = 7 #### 7", "what is 12 plus 30",
             "so the total number of apples is 5", "let's think step by step"]
    return [tok.encode(t) for t in texts]


@pytest.fixture(scope="module")
def worker_group(ray_cpu_cluster, tiny_model_path):
    import verl_tide.register, verl_tide.testing.register  # noqa: F401  (the plugin and test bed, in the driver too)
    from verl_tide.testing.engine import build_training_worker_group

    return build_training_worker_group(str(tiny_model_path), world_size=2, lr=1e-2)


def test_world_size_two_on_gloo(worker_group):
    assert worker_group.world_size == 2


def test_fsdp_log_probs_match_plain_transformers_forward(worker_group, tiny_model_path, sequences):
    expected = _hf_token_log_probs(tiny_model_path, sequences)
    got = _engine_token_log_probs(worker_group, sequences)
    for e, g in zip(expected, got):
        assert g.shape == e.shape
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)


def test_a_training_step_moves_log_probs(worker_group, sequences):
    """One verl update at lr 1e-2 changes the tiny model's log-probs by far more than the
    tolerance the end-to-end test uses for rollout-vs-actor agreement after a weight sync."""
    from tensordict.tensorclass import NonTensorData

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import sft_loss
    from verl_tide.testing.engine import make_lm_batch

    before = _engine_token_log_probs(worker_group, sequences)
    worker_group.set_loss_fn(loss_fn=partial(sft_loss, config=None))
    data = make_lm_batch(sequences)
    tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=NonTensorData([len(s) for s in sequences]))
    out = worker_group.train_batch(data)
    out = out.get() if hasattr(out, "get") else out
    after = _engine_token_log_probs(worker_group, sequences)
    shift = max((a - b).abs().max().item() for a, b in zip(after, before))
    assert shift > 0.05, shift
    # sft_loss minimizes NLL: the trained sequences got more likely.
    assert sum(a.sum() for a in after) > sum(b.sum() for b in before)
