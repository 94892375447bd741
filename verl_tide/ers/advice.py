"""ERS's split advice: how many GPUs rollout should start with, when the split is too small for ERS to fix.

Pure Python. ERS moves ranks between rollout and Ref at the sync boundary; it cannot move the Actor's
data-parallel ranks (verl's FSDP group is fixed for the job), so a job started with too few rollout GPUs
stays rollout-starved: in the simulator, tide from one sweep step below the best split lost up to 59%
(docs/simulator-calibration.md). What ERS can do is say so, with a number, from the same readiness
signals: the split where the slower of the rollout's and the trainer's measured rates is fastest.

Advice is given only when the rollout was saturated: work waited for KV budget for much of its working
time (`ReadinessSignals.rollout_kv_bound`), or decode was bound by the context it reads
(`ReadinessSignals.rollout_decode_context` above the model's weights). A rank with a request in flight is
not a saturated rank: on an environment-bound workload every rank is busy and the trainer still waits, and
more rollout GPUs make nothing more (the reason a version from busy time alone was not shipped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_tide.core.readiness import ReadinessSignals


@dataclass(frozen=True)
class SplitAdvice:
    rollout_gpus: int  # advised rollout GPUs of `gpus`
    gpus: int  # rollout + trainer GPUs of the job
    now_rollout_gpus: int
    predicted_gain: float  # sequences per second at the advised split over now's, minus 1 (the model's, below)
    reason: str

    @property
    def rollout_ratio(self) -> float:
        return self.rollout_gpus / self.gpus


def rollout_rate_with(signals: ReadinessSignals, replicas: int, of: int, weight_kv_tokens: Optional[float],
                      kv_bound_min: float) -> Optional[tuple[float, str]]:
    """Sequences per second `replicas` rollout replicas would make where `of` made the measured rate, and why; None
    unless the rollout was saturated, where the rate grows in proportion to the replicas:

    - KV-bound: work waited for KV budget at least `kv_bound_min` of the working time; it runs on new replicas;
    - decode-bound: a decode iteration reads the weights and the context of the turns in flight
      (`rollout_decode_context` per replica; `weight_kv_tokens`: the weights in KV-token equivalents, weight bytes
      over KV bytes per token, the same per GPU at any tensor parallelism); where the context read is the larger,
      replicas that share it decode in proportion faster (in the simulator, WebShop from 4 to 12 of 32 GPUs made
      3.5x the sequences per second).

    Otherwise (the weights dominate: small batches, a rollout bound by its environments' latency or by the
    staleness limit) more replicas make little more, and the fixed-concurrency estimate of how much (the turns in
    flight finishing sooner by the ratio of the reads) advised 1.7x the rollout GPUs on ScienceBoard for a loss:
    no estimate, no advice."""
    rate = signals.rollout_capacity_rate
    if not rate or replicas < of or of < 1:
        return None
    if signals.rollout_kv_bound is not None and signals.rollout_kv_bound >= kv_bound_min:
        return rate * replicas / of, f"KV-bound: work waited for KV budget {signals.rollout_kv_bound:.0%} of the time"
    context = signals.rollout_decode_context
    if context is not None and weight_kv_tokens and context >= weight_kv_tokens:
        return rate * replicas / of, (f"decode-bound: {context:,.0f} tokens of context in flight per replica, the "
                                      f"weights {weight_kv_tokens:,.0f}")
    return None


def advise_split(signals: ReadinessSignals, rollout_gpus: int, trainer_gpus: int, batch: int,
                 weight_kv_tokens: Optional[float] = None, kv_bound_min: float = 0.5, wait_tolerance: float = 0.1,
                 gpus_per_replica: int = 1, min_trainer_gpus: int = 1, min_gain: float = 0.1) -> Optional[SplitAdvice]:
    """More rollout GPUs, when the last cycle shows the trainer starved and a split with more rollout predicted to
    train at least `min_gain` more sequences per second; else None.

    `trainer_gpus`: GPUs doing the trainer's work (the Actor's and any Ref ranks), assumed to keep their measured
    rate per GPU: `batch` sequences per second of the cycle they did not wait. The rollout's rate at a split is
    `rollout_rate_with`; the advice is the split where the slower side is fastest. A KV-bound replica also
    re-prefills the contexts it paused, so it gets faster per GPU once relieved than the model says."""
    if rollout_gpus < 1 or trainer_gpus < 1 or batch < 1 or gpus_per_replica < 1:
        raise ValueError(f"advise_split: rollout_gpus = {rollout_gpus}, trainer_gpus = {trainer_gpus}, batch = "
                         f"{batch}, gpus_per_replica = {gpus_per_replica}: each must be >= 1")
    cycle_s, twt = signals.cycle_s, signals.trainer_wait_s
    if not cycle_s or twt <= wait_tolerance * cycle_s:
        return None
    per_trainer_gpu = batch / max(cycle_s - twt, wait_tolerance * cycle_s) / trainer_gpus
    gpus, of = rollout_gpus + trainer_gpus, max(1, rollout_gpus // gpus_per_replica)
    now = rollout_rate_with(signals, of, of, weight_kv_tokens, kv_bound_min)
    if now is None:
        return None
    now_rate = min(now[0], per_trainer_gpu * trainer_gpus)
    best, best_rate, why = of, now_rate, now[1]
    for replicas in range(of + 1, (gpus - min_trainer_gpus) // gpus_per_replica + 1):
        rate, why = rollout_rate_with(signals, replicas, of, weight_kv_tokens, kv_bound_min)
        balanced = min(rate, per_trainer_gpu * (gpus - replicas * gpus_per_replica))
        if balanced > best_rate:
            best, best_rate = replicas, balanced
    gain = best_rate / now_rate - 1 if now_rate > 0 else 0.0
    if best == of or gain < min_gain:
        return None
    advised = best * gpus_per_replica
    return SplitAdvice(advised, gpus, rollout_gpus, gain, (
        f"the trainer waited {twt:.1f}s of a {cycle_s:.1f}s cycle while rollout made {signals.rollout_capacity_rate:.2f} "
        f"seq/s on {rollout_gpus} GPU(s) ({why}); the trainer consumes {per_trainer_gpu:.3f} seq/s per GPU. With "
        f"{advised} of {gpus} GPUs for rollout (rollout share {advised / gpus:.3f}) the model predicts "
        f"{gain:+.0%} sequences per second. ERS cannot move the Actor's GPUs: start the job with that split"))


@dataclass
class SplitAdvisor:
    """Advice stands while `confirm` of the last `window` training cycles gave one: one noisy cycle or a cold start's
    empty buffer does not decide it, and a trainer that alternates a starved step with one from buffered data (the
    simulator's ALFWorld from 0.25) keeps it. `standing` is the latest advice given while it stands."""

    confirm: int = 2
    window: int = 4
    standing: Optional[SplitAdvice] = None
    _recent: list[Optional[SplitAdvice]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.confirm <= self.window:
            raise ValueError(f"SplitAdvisor: confirm = {self.confirm}, window = {self.window}: need "
                             "1 <= confirm <= window")

    def update(self, advice: Optional[SplitAdvice]) -> Optional[SplitAdvice]:
        """This cycle's advice (or None); returns the standing advice."""
        self._recent = [*self._recent, advice][-self.window:]
        given = [a for a in self._recent if a is not None]
        self.standing = given[-1] if len(given) >= self.confirm else None
        return self.standing


class SplitAdviceCycle:
    """The split advice once per training cycle, as trainer `tide` and the simulator both take it: none from a
    cycle whose rollout also ran an evaluation (it starves the trainer by design) or that had no rollout rank;
    `standing` is the advisor's (what the metrics report), `last` the latest that ever stood (what a run ends
    with)."""

    def __init__(self, eval_in_first_cycle: bool = False):
        self.advisor = SplitAdvisor()
        self.eval_in_cycle = eval_in_first_cycle
        self.last: Optional[SplitAdvice] = None

    @property
    def standing(self) -> Optional[SplitAdvice]:
        return self.advisor.standing

    def update(self, signals: ReadinessSignals, rollout_gpus: int, trainer_gpus: int, batch: int,
               weight_kv_tokens: Optional[float], kv_bound_min: float, eval_next: bool,
               gpus_per_replica: int = 1) -> bool:
        """This cycle's advice; True when the standing advice changed to a new split (worth a log line)."""
        changed = False
        if not self.eval_in_cycle and rollout_gpus >= 1:
            before = self.advisor.standing
            advice = self.advisor.update(advise_split(signals, rollout_gpus, trainer_gpus, batch, weight_kv_tokens,
                                                      kv_bound_min, gpus_per_replica=gpus_per_replica))
            changed = advice is not None and (before is None or before.rollout_gpus != advice.rollout_gpus)
            self.last = advice or self.last
        self.eval_in_cycle = eval_next
        return changed


def weight_kv_tokens(hf_config: Mapping[str, Any]) -> Optional[float]:
    """The model's weights in KV-token equivalents (parameters over KV elements per token: dtype and tensor
    parallelism cancel), from a Hugging Face config as a dict; None where it lacks the fields of a decoder-only
    transformer. A VLM's `text_config` is used (the vision tower is read once per image, not per decode step);
    a mixture of experts counts every expert (a large decode batch reads them all)."""
    cfg = hf_config.get("text_config") or hf_config
    try:
        h, layers, heads = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        vocab = int(cfg["vocab_size"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or h // heads)
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0)
        ffn = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]) if experts else int(
            cfg["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if min(h, layers, heads, kv_heads, head_dim, vocab, ffn) < 1:
        return None
    attention = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2  # q, o; k, v
    mlp = 3 * h * ffn * max(1, experts)  # gated: gate, up, down
    params = layers * (attention + mlp) + vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    return params / (2 * layers * kv_heads * head_dim)
