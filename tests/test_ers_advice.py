"""ERS's split advice (`verl_tide.ers.advice`): more rollout GPUs only where a saturated rollout starves the
trainer, and the split where the slower side is fastest."""

from __future__ import annotations

import dataclasses

import pytest

from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ers.advice import SplitAdvisor, advise_split, rollout_rate_with, weight_kv_tokens

QWEN25_7B = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}


def _signals(**kw) -> ReadinessSignals:
    base = dict(ready_at_start=0, time_per_ready_microbatch=None, tprm_smoothed=None, hol_latency=0.0,
                ready_volume=0, mean_step_time=40.0, generation_deficit=True, consumption_deficit=False,
                rollout_wait_s=0.0, trainer_wait_s=60.0, rollout_capacity_rate=4.0, rollout_utilization=1.0,
                rollout_kv_bound=0.8, rollout_decode_context=None, cycle_s=100.0)
    return ReadinessSignals(**{**base, **kw})


def test_a_kv_bound_rollout_that_starves_the_trainer_gets_the_balanced_split():
    # rollout: 4 seq/s on 4 GPUs (1 per GPU); trainer: 400 sequences in 40 s of work on 12 GPUs (0.833 per GPU)
    a = advise_split(_signals(), rollout_gpus=4, trainer_gpus=12, batch=400)
    # min(k, 0.833 x (16 - k)) is largest at k = 7 (min(7, 7.5) = 7 > 8: min(8, 6.67)); they meet at 7.27
    assert (a.rollout_gpus, a.gpus, a.now_rollout_gpus) == (7, 16, 4)
    assert a.rollout_ratio == pytest.approx(7 / 16)
    assert a.predicted_gain == pytest.approx(7 / 4 - 1)
    assert "KV-bound" in a.reason and "start the job with that split" in a.reason


def test_no_advice_unless_the_trainer_waited_and_the_rollout_was_saturated():
    assert advise_split(_signals(trainer_wait_s=5.0), 4, 12, 400) is None  # the trainer hardly waited
    # busy ranks, no work waiting for KV, decode bound by the weights (small batches): more GPUs make nothing
    latency_bound = _signals(rollout_kv_bound=0.0, rollout_decode_context=20_000.0)
    assert advise_split(latency_bound, 4, 12, 400, weight_kv_tokens=265_000.0) is None
    assert rollout_rate_with(latency_bound, 8, 4, 265_000.0, 0.5) is None
    # the same with the context read above the weights: decode-bound, advised
    decode_bound = _signals(rollout_kv_bound=0.0, rollout_decode_context=400_000.0)
    a = advise_split(decode_bound, 4, 12, 400, weight_kv_tokens=265_000.0)
    assert a.rollout_gpus == 7 and "decode-bound" in a.reason
    assert advise_split(decode_bound, 4, 12, 400, weight_kv_tokens=None) is None  # model unknown: no estimate
    assert advise_split(_signals(rollout_kv_bound=None), 4, 12, 400) is None  # no router clocks
    assert advise_split(_signals(cycle_s=None), 4, 12, 400) is None  # before the first cycle


def test_no_advice_when_the_split_is_already_balanced_or_the_gain_is_small():
    # trainer as fast per GPU as rollout: 8 of 16 already balanced
    assert advise_split(_signals(rollout_capacity_rate=8.0, trainer_wait_s=20.0), 8, 8, 640) is None
    assert advise_split(_signals(), 4, 12, 400, min_gain=0.8) is None  # +75% is below min_gain
    assert advise_split(_signals(), 4, 12, 400, min_gain=0.7) is not None


def test_replicas_round_the_advice_and_the_trainer_keeps_its_minimum():
    a = advise_split(_signals(), rollout_gpus=4, trainer_gpus=12, batch=400, gpus_per_replica=4)
    assert a.rollout_gpus == 8  # 7 rounded to whole replicas of 4 GPUs: min(8, 6.67) beats now's min(4, 10)
    starving = _signals(rollout_capacity_rate=0.4)  # rollout 10x slower: would take every GPU
    assert advise_split(starving, 4, 12, 400, min_trainer_gpus=8).rollout_gpus == 8
    with pytest.raises(ValueError, match="trainer_gpus = 0"):
        advise_split(_signals(), 4, 0, 400)


def test_advice_stands_on_two_of_three_cycles():
    adv = SplitAdvisor()
    a = advise_split(_signals(), 4, 12, 400)
    assert adv.update(a) is None  # one cycle: a cold start's empty buffer looks the same
    assert adv.update(None) is None
    assert adv.update(a) is a  # a starved and a buffered step alternating: stands
    assert adv.update(None) is a
    assert adv.update(a) is a
    assert adv.update(None) is a
    assert adv.update(None) is None  # gone once three of the last four gave none
    with pytest.raises(ValueError, match="confirm = 5, window = 4"):
        SplitAdvisor(confirm=5)


def test_weight_kv_tokens_from_a_hugging_face_config():
    assert weight_kv_tokens(QWEN25_7B) == pytest.approx(7.6e9 / (2 * 28 * 4 * 128), rel=0.01)
    assert weight_kv_tokens({"text_config": QWEN25_7B, "vision_config": {}}) == weight_kv_tokens(QWEN25_7B)
    moe = {**QWEN25_7B, "num_experts": 8, "moe_intermediate_size": 18944}
    assert weight_kv_tokens(moe) > 5 * weight_kv_tokens(QWEN25_7B)  # every expert is read by a large batch
    assert weight_kv_tokens({k: v for k, v in QWEN25_7B.items() if k != "hidden_size"}) is None
    assert weight_kv_tokens({**QWEN25_7B, "num_attention_heads": 0}) is None


def test_the_signals_dataclass_keeps_the_fields_the_advice_reads():
    fields = {f.name for f in dataclasses.fields(ReadinessSignals)}
    assert {"rollout_kv_bound", "rollout_decode_context", "cycle_s"} <= fields


def test_the_advice_cycle_skips_evaluation_cycles_and_says_when_the_standing_split_changes():
    """The one place trainer tide and the simulator take the split advice (`SplitAdviceCycle`)."""
    from verl_tide.ers.advice import SplitAdviceCycle

    cycle = SplitAdviceCycle(eval_in_first_cycle=True)
    assert not cycle.update(_signals(), 4, 12, 400, None, 0.5, eval_next=False)  # an evaluation's cycle: none
    assert cycle.standing is None and cycle.last is None
    assert not cycle.update(_signals(), 4, 12, 400, None, 0.5, eval_next=False)  # one cycle does not decide it
    assert cycle.update(_signals(), 4, 12, 400, None, 0.5, eval_next=True)  # confirmed: the standing split changed
    assert cycle.standing is not None and cycle.last is cycle.standing
    assert not cycle.update(_signals(), 4, 12, 400, None, 0.5, eval_next=False)  # eval cycle: the standing stays
    assert cycle.standing is not None
    assert not cycle.update(_signals(), 0, 12, 400, None, 0.5, eval_next=False)  # no rollout rank: no advice
