"""Where Ref runs for a job (tide's Ref replicas, verl's Ref worker group, or both), decided once from the
`tide:` config: trainer `tide` builds its workers by it, and the start-up check (`job_config.check_layout`, in the
driver before Ray starts) refuses what cannot run. Pure: no verl, ray or torch."""

from __future__ import annotations

from dataclasses import dataclass

from verl_tide.core.config import TideConfig, TideConfigError


@dataclass(frozen=True)
class RefLayout:
    pool_wanted: bool  # tide's Ref replicas replace verl's Ref worker group
    beside_verl_ref: bool  # tide's Ref replicas (fixed or elastic) beside verl's Ref worker group
    handoff: bool = False  # RA2P's hand-off: ref log-probs reach the Actor's loss by sample id, not TransferQueue
    # inputs too (verl's Ref role and the Actor's in one process, as tide's worker subclasses): known once verl's
    # worker roles are chosen (`trainer.ref_path.RefPath.choose_worker_roles`)
    inputs_handoff: bool = False

    @property
    def replicas(self) -> bool:
        """tide's Ref replicas exist in the job (in place of verl's Ref or beside it)."""
        return self.pool_wanted or self.beside_verl_ref


def ref_layout(tide: TideConfig, uses_ref: bool, handoff: bool, kl_in_reward: bool = False) -> RefLayout:
    """With tide's own Ref replicas verl must not build its Ref worker group. Split mode keeps verl's Ref worker
    group beside tide's replicas (fixed or elastic): both score shares. verl's Ref stays on the trainer's GPUs
    (colocated) and ERS may lend rollout ranks to Ref replicas (decoupled) when tide.ers.max_ref_ranks >= 1 opts
    in: each holds a whole Ref model beside the engine."""
    ers, ref_ranks = tide.ers, tide.ra2p.ref_ranks
    split = tide.ra2p.mode == "split"
    elastic_ref_only = ers.enabled and ers.min_ref_ranks > 0 and ref_ranks == 0
    if ers.enabled and ers.min_ref_ranks > 0 and not uses_ref:
        raise TideConfigError([f"tide.ers.min_ref_ranks = {ers.min_ref_ranks}: needs a Ref model "
                               "(actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward); set it to 0"])
    if split:
        check_split_mode(tide, handoff)
    if tide.ra2p.mode == "decoupled" and ref_ranks and kl_in_reward:
        raise TideConfigError(["tide.ra2p.mode = 'decoupled' with tide.ra2p.ref_ranks > 0 defers the KL term to "
                               "the Actor's backward, so algorithm.use_kl_in_reward must be false (use "
                               "actor_rollout_ref.actor.use_kl_loss), or set tide.ra2p.mode to auto | colocated"])
    pool_wanted = bool(uses_ref and (ref_ranks or elastic_ref_only) and not split)
    beside = bool(uses_ref and not pool_wanted and (
        (ers.enabled and (ers.max_ref_ranks or 0) >= 1) or (split and (ref_ranks or elastic_ref_only))))
    return RefLayout(pool_wanted, beside, handoff=bool(uses_ref and handoff))


def check_split_mode(tide: TideConfig, handoff: bool) -> None:
    """Split mode: replicas hand their rows to the Actor's loss by sample id, beside verl's Ref role."""
    ers, ra2p = tide.ers, tide.ra2p
    problems = []
    if not handoff:
        problems.append("tide.ra2p.mode = 'split' needs the KL term in the Actor's loss and the hand-off: "
                        "actor_rollout_ref.actor.use_kl_loss = true, algorithm.use_kl_in_reward = false, "
                        "tide.ra2p.zero_copy = true, actor_rollout_ref.actor.strategy fsdp | fsdp2")
    if not ra2p.ref_ranks and not (ers.enabled and (ers.min_ref_ranks or (ers.max_ref_ranks or 0) >= 1)):
        problems.append("tide.ra2p.mode = 'split' needs Ref replicas beside verl's Ref: tide.ra2p.ref_ranks >= 1, "
                        "or ERS (tide.ers.enabled) with tide.ers.min_ref_ranks >= 1 or tide.ers.max_ref_ranks >= 1")
    if problems:
        raise TideConfigError(problems)
