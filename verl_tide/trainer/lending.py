"""ERS lends the Actor's GPUs to rollout (`tide.ers.lend_actor`, on by default where the job allows it): verl's
hybrid replicas on the trainer's GPUs.

Why: the Actor's GPUs have nothing to train until a step's first mini-batch is ready: the cold start, the
waits inside steps that start with too little ready data, evaluations. verl's `separate_async` already
builds a rollout replica beside the Actor (its hybrid engine: weights and KV cache asleep while the Actor
trains) and switches it: rollout until a threshold of the step's prompts are ready, then abort (partial
rollouts resume elsewhere), sleep, train; back to rollout after the update. Trainer `tide` keeps that
mechanism (the sleep/wake path, the abort, the measured switch costs) and gives the decisions to ERS
(`verl_tide/ers/lending.py`, through the boundary planner the simulator calls too): whether to lend after
an update, and how many ready groups bring the Actor back. CTB routes to the replica while it is lent (it
joins and leaves CTB's pool like an elastic rank, its tasks re-dispatched).
Not yet: jobs with a Ref model (the replica sits in verl's combined actor/rollout/ref worker, beside which
RA2P's Ref paths are not built).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

from verl_tide.ers.lending import LendDecision, LendingInputs


def switch_config(config: Any, lend: bool) -> Any:
    """verl's hybrid-switch settings (`trainer.v1.separate_async.hybrid_rollout`), switched on when lending."""
    from verl.trainer.config import HybridRolloutSwitchConfig
    from verl.utils.config import omega_conf_to_dataclass

    if not lend:
        return HybridRolloutSwitchConfig(enable_switch=False)
    block = config.trainer.v1.get("separate_async", {}).get("hybrid_rollout", None)
    base = omega_conf_to_dataclass(block) if block is not None else HybridRolloutSwitchConfig()
    return replace(base, enable_switch=True)


def lent_turns(turns_served: Mapping[str, int], actor_servers: list[str]) -> float:
    """Turns CTB routed to the replicas on the Actor's GPUs since the job started."""
    return float(sum(turns_served.get(s, 0) for s in actor_servers))


def lent_metrics(status: Mapping[str, Any], actor_servers: list[str]) -> dict[str, float]:
    """From CTB's router status: turns routed to the Actor's replicas, and replica-seconds they spent in CTB's
    pool (lent), both since the job started. The seconds say the replica was lent whether or not a turn
    happened to be routed to it in that window (an evaluation that overlaps a step whose data is ready)."""
    pool_s = status.get("pool_s", {})
    return {"tide/ers/actor_lent_turns": lent_turns(status.get("turns_served", {}), actor_servers),
            "tide/ers/actor_lent_s": float(sum(pool_s.get(s, 0.0) for s in actor_servers))}


def lending_inputs(ready_groups: int, groups_per_mini_batch: int, mini_batches: int, switch_cost_s: Any,
                   timing: Mapping[str, float], trained_mini_batches: int, last_step: bool) -> LendingInputs:
    """ERS's lending inputs from what the trainer holds after an update: the groups already sampleable for the
    next step (verl's replay buffer), verl's measured switch round trip, and the Actor's time per mini-batch
    (verl's `update_actor` timer over the mini-batches the step trained)."""
    update_s = float(timing.get("update_actor", 0.0))
    per_mini_batch = update_s / trained_mini_batches if update_s > 0 and trained_mini_batches > 0 else None
    return LendingInputs(ready_units=int(ready_groups), units_per_mini_batch=groups_per_mini_batch,
                         mini_batches=mini_batches, switch_cost_s=switch_cost_s,
                         train_s_per_mini_batch=per_mini_batch, last_step=last_step)


def inputs_after_update(trainer: Any) -> LendingInputs:
    """`lending_inputs` from trainer `tide` after an update (verl 0.9.1's replay buffer and timers)."""
    from verl_tide.trainer import verl_compat

    return lending_inputs(
        trainer.replay_buffer.get_sampleable_count(trainer.global_steps + 1, "train"),
        trainer._groups_per_mini_batch, trainer.parameter_sync_step, verl_compat.switch_round_trip_s(trainer),
        verl_compat.step_timing(trainer), trainer._window_mini_batches,
        trainer.global_steps >= trainer.total_training_steps)


def decision_metrics(lend: LendDecision) -> dict[str, float]:
    """What each step logs of ERS's lending decision (verl's own name for the switch too)."""
    m = {"tide/ers/lend_actor": float(lend.lend), "tide/ers/lend_return_at_groups": float(lend.return_at_units),
         "separate_async/decision/should_switch_to_rollout": float(lend.lend)}
    if lend.expected_wait_s is not None:
        m["tide/ers/lend_expected_wait_s"] = float(lend.expected_wait_s)
    for name, value in (("lend_cycle_lent_s", lend.lent_cycle_s), ("lend_cycle_kept_s", lend.kept_cycle_s)):
        if value is not None:  # the measured step cycles after each answer (ers/lending.py: LendingRecord)
            m[f"tide/ers/{name}"] = float(value)
    return m
