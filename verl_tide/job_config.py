"""Read the `tide:` subtree out of a composed verl job config (OmegaConf) into a `TideConfig`."""

from __future__ import annotations

from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from verl_tide.core.config import TideConfig, TideConfigError, parse_tide_config
from verl_tide.ra2p.layout import RefLayout, ref_layout

TRAINER_MODE = "tide"


def off_policy_threshold(max_staleness: int) -> int:
    """verl's `trainer.v1.sampler.max_off_policy_threshold` for a bound of `max_staleness` policy versions.

    verl 0.9.1's replay buffer tags a group with the step that submitted it and drops it once
    (step - tag + 1) > threshold, its "versions spanned": a group submitted at step s is rolled out with the
    weights of update s-1, so threshold 1 trains only groups of the step's own submission (no lag) and every group
    submitted a batch ahead is generated, then dropped. A lag of `max_staleness` versions is threshold
    `max_staleness + 1`. Trainer `tide` and the head-to-head's stock systems both take it from here, so the two
    run one bound."""
    if max_staleness < 0:
        raise ValueError(f"max_staleness = {max_staleness}: must be an integer >= 0")
    return max_staleness + 1


def fully_async_staleness_threshold(max_staleness: int) -> float:
    """verl's `fully_async` trainer's `async_training.staleness_threshold` for a bound of `max_staleness` policy
    versions, with a weight sync every step (`trigger_parameter_sync_step=1`).

    verl 0.9.1's rollouter keeps at most `required_samples x (staleness_threshold + 1)` samples generated but not
    yet trained on: a threshold of k lets it run k steps' samples ahead of the trainer, so a sample is trained at
    most k versions after the weights that made it. The head-to-head's systems all take their bound from here and
    `off_policy_threshold`."""
    return float(off_policy_threshold(max_staleness) - 1)


def tide_config_from_job(config: DictConfig) -> TideConfig:
    """Validate `config.tide`; raise `TideConfigError` naming each bad key.

    A job that selects `trainer.v1.trainer_mode=tide` without the subtree is told how to add it.
    """
    raw: Any = OmegaConf.select(config, "tide", default=None)
    if raw is None:
        mode = OmegaConf.select(config, "trainer.v1.trainer_mode", default=None)
        if mode == TRAINER_MODE:
            raise TideConfigError(
                ["tide = <missing>: trainer.v1.trainer_mode=tide needs the tide: subtree; add `+tide=enabled`"]
            )
        return parse_tide_config({})
    if isinstance(raw, DictConfig):
        missing = sorted(OmegaConf.missing_keys(raw))
        if missing:  # `???` in a recipe: a value the user must give
            raise TideConfigError([f"tide.{key} = ??? (missing): set it on the command line, e.g. tide.{key}=..."
                                   for key in missing])
    try:
        container = OmegaConf.to_container(raw, resolve=True) if isinstance(raw, DictConfig) else raw
    except Exception as e:  # an interpolation inside tide: that does not resolve
        raise TideConfigError([f"tide = <unresolvable>: {e}"]) from e
    return parse_tide_config(container)


def uses_ref_model(config: DictConfig) -> bool:
    """verl builds a Ref model (its `need_reference_policy`): a KL loss in the Actor or a KL penalty in the reward."""
    return bool(OmegaConf.select(config, "actor_rollout_ref.actor.use_kl_loss", default=False)) or bool(
        OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False))


def ref_handoff(config: DictConfig, tide: TideConfig) -> bool:
    """RA2P's hand-off outside TransferQueue (`tide.ra2p.zero_copy`): needs the KL term in the Actor's loss, which
    reads it by sample id; a KL penalty in the reward needs ref_log_prob in TransferQueue (the driver's). The
    installed deferred-KL loss is verified on verl's FSDP engines only: others keep verl's path."""
    return bool(tide.ra2p.zero_copy and OmegaConf.select(config, "actor_rollout_ref.actor.use_kl_loss", default=False)
                and not OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False)
                and str(OmegaConf.select(config, "actor_rollout_ref.actor.strategy", default="fsdp")).startswith("fsdp"))


def ref_layout_of(config: DictConfig, tide: TideConfig) -> RefLayout:
    """Where Ref runs for this job (`ra2p.layout`); a layout that cannot run raises `TideConfigError`."""
    return ref_layout(tide, uses_ref_model(config), ref_handoff(config, tide),
                      kl_in_reward=bool(OmegaConf.select(config, "algorithm.use_kl_in_reward", default=False)))


def lend_actor(config: DictConfig, tide: TideConfig) -> tuple[bool, str]:
    """Whether the job's Actor GPUs get verl's hybrid replica (`tide.ers.lend_actor` against the layout), and why;
    an explicit `true` the layout cannot honour raises `TideConfigError`. verl's own tests for a Ref model
    (`need_reference_policy`) and for hybrid replicas (`separate_async`: `hybrid_engine`, default true)."""
    from verl_tide.ers.lending import resolve_lend_actor

    hybrid = OmegaConf.select(config, "actor_rollout_ref.hybrid_engine", default=True)
    return resolve_lend_actor(tide.ers.lend_actor, uses_ref_model(config), True if hybrid is None else bool(hybrid),
                              ref_layout_of(config, tide).replicas, tide.ers.resize_trainer)


def resize_blockers(config: DictConfig) -> list[str]:
    """What in a verl job keeps ERS from resizing the Actor's group (`tide.ers.resize_trainer`), key by key."""
    out = []
    critic = OmegaConf.select(config, "critic.enable", default=None)
    if critic is None:  # verl's `need_critic` (0.9.1): GAE needs one
        critic = OmegaConf.select(config, "algorithm.adv_estimator", default="grpo") == "gae"
    nodes = (OmegaConf.select(config, "trainer.nnodes", default=1),
             OmegaConf.select(config, "actor_rollout_ref.rollout.nnodes", default=1))
    if critic:
        out.append("a critic (critic.enable or algorithm.adv_estimator = gae): it shares the Actor's pool")
    if nodes != (1, 1):
        out.append(f"trainer.nnodes = {nodes[0]}, actor_rollout_ref.rollout.nnodes = {nodes[1]}: the resize is "
                   f"built for one node")
    return [f"tide.ers.resize_trainer = true with {b}" for b in out]


def check_layout(config: DictConfig, tide: Optional[TideConfig] = None) -> None:
    """Refuse job layouts trainer `tide` cannot run, naming the key and what it accepts (with `tide`, also a
    `tide.ers.lend_actor = true` the layout cannot honour)."""
    problems = []
    if tide is not None:  # where Ref runs (split mode, elastic Ref ranks) and the lending it allows
        for check in (ref_layout_of, lend_actor):
            try:
                check(config, tide)
            except TideConfigError as e:
                problems.extend(p for p in e.problems if p not in problems)
        if tide.ers.resize_trainer:
            problems.extend(resize_blockers(config))
    rollout = config.actor_rollout_ref.rollout
    if int(rollout.nnodes or 0) < 1 or int(rollout.n_gpus_per_node or 0) < 1:
        problems.append(
            f"actor_rollout_ref.rollout.nnodes = {rollout.nnodes}, n_gpus_per_node = {rollout.n_gpus_per_node}: "
            "trainer tide runs rollout on its own ranks; set both >= 1")
    if rollout.checkpoint_engine.backend == "naive":
        problems.append(
            "actor_rollout_ref.rollout.checkpoint_engine.backend = naive: rollout ranks are separate from the "
            "trainer; use nccl | nixl | mooncake | hccl (GPU clusters) or tide_shm (one node, also CPU)")
    tb, mb = int(config.data.train_batch_size), int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    if mb < 1 or tb % mb:
        problems.append(f"data.train_batch_size = {tb}: must be a multiple of "
                        f"actor_rollout_ref.actor.ppo_mini_batch_size = {mb}")
    sampler = config.trainer.v1.sampler
    custom = sampler.get("custom_sampler", None)
    if custom is not None and custom.get("path"):
        problems.append("trainer.v1.sampler.custom_sampler: trainer tide owns the replay buffer; leave it unset")
    if problems:
        raise TideConfigError(problems)
