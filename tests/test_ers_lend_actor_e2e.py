"""ERS lends the Actor's GPU to rollout (`tide.ers.lend_actor`, on by default without a Ref model; issue 27), end
to end.

`+tide=enabled` with its defaults on the CPU test bed with the demo's environment (tiny_slow, heavy-tailed latency): verl's hybrid
replica beside the Actor rolls out from the start (the cold start) until the step's groups are ready, then
sleeps while the Actor trains, and comes back when verl's switch says the wait is worth it; CTB routes to it
while it is lent; the abort at each switch loses nothing. The unit parts: tests/test_trainer_units.py.
"""

from __future__ import annotations

import pytest

from verl_tide.core.config import TideConfigError
from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_with_env_service, \
    tide_overrides, with_overrides
from verl_tide.testing.tiny_model import write_env_task_parquet
from verl_tide.trainer import lending

STEPS = 3


@pytest.fixture(scope="module")
def lend_run(tiny_model_path, tmp_path_factory):
    data = tmp_path_factory.mktemp("lend_data")
    train = write_env_task_parquet(data / "train.parquet", 24, env="tiny_slow")
    val = write_env_task_parquet(data / "val.parquet", 2, env="tiny_slow", seed=100)
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=2,
                  steps=STEPS, prompt_length=128, response_length=96, ppo_mini_batch_size=2)
    work = tmp_path_factory.mktemp("lend_run")
    run, health = run_with_env_service(lambda url: with_overrides(grpo_overrides(job), [
        *tide_overrides(job, lend_actor=None),  # the default: tide.ers.lend_actor=auto
        "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={url}", "tide.env.max_tokens_per_turn=8", "trainer.test_freq=2"]),
        work, latency_scale=1.0, log_path=work / "main_ppo.log")
    return run, parse_step_metrics(run.output), health


@pytest.fixture(scope="module")
def lend_ref_run(tiny_model_path, tmp_path_factory):
    """Lending beside verl's Ref (asked for: `auto` leaves it off with a Ref model): verl's combined
    actor/rollout/ref worker on the trainer's GPU, as tide's subclass with RA2P's hand-off."""
    from dataclasses import replace

    data = tmp_path_factory.mktemp("lend_ref_data")
    train = write_env_task_parquet(data / "train.parquet", 24, env="tiny_slow")
    val = write_env_task_parquet(data / "val.parquet", 2, env="tiny_slow", seed=100)
    # one mini-batch a step: step 1's KL is then all from before the first update (0: Ref = Actor)
    job = replace(GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=2,
                          steps=STEPS, prompt_length=128, response_length=96), use_kl_loss=True)
    work = tmp_path_factory.mktemp("lend_ref_run")
    run, health = run_with_env_service(lambda url: with_overrides(grpo_overrides(job), [
        *tide_overrides(job, lend_actor=True),
        "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={url}", "tide.env.max_tokens_per_turn=8"]),
        work, latency_scale=1.0, log_path=work / "main_ppo.log")
    return run, parse_step_metrics(run.output), health, job


@pytest.mark.testbed
def test_lending_beside_verls_ref_keeps_the_hand_off_and_the_kl_term(lend_ref_run):
    """The replica on the Actor's GPU rolls out through the cold start; the Ref pass runs in the same worker process
    (tide's subclass of verl's combined role), its rows reach the Actor's deferred-KL loss in process, and the
    update takes its inputs back from there. KL 0 before the first update, above 0 after one that had a
    learning signal; nothing lost."""
    run, steps, health, job = lend_ref_run
    assert run.returncode == 0, run.output[-6000:]
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "verl-tide: ERS may lend the Actor's GPUs to rollout (tide.ers.lend_actor = true, beside verl's Ref" \
        in run.output
    assert "verl-tide: RA2P colocated hand-off (tide.ra2p.zero_copy)" in run.output
    assert steps[1]["tide/ers/actor_lent_turns"] > 0 and steps[1]["timing_s/switch_to_trainer"] > 0, steps[1]
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6), steps[1]  # Ref = Actor before any update
    # once an update had a learning signal (a group whose rewards differ) the Actor has left the Ref
    moved = [n for n in sorted(steps) if steps[n]["critic/advantages/max"] > 0]
    for n in (n for n in sorted(steps) if moved and n > moved[0]):
        assert steps[n]["actor/kl_loss"] > 0, (moved, [steps[k]["actor/kl_loss"] for k in sorted(steps)])
    last = steps[STEPS]
    trained = last["tide/ledger/groups_consumed"] * job.rollout_n
    assert trained == STEPS * job.train_batch_size * job.rollout_n, last
    # one trainer rank: every trained sample's ref row and inputs came from the process, none through a service
    assert last["tide/ra2p/handoff_served_in_process"] == trained and last["tide/ra2p/ref_service_served"] == 0, last
    assert last["tide/ra2p/handoff_inputs_in_process"] == trained, last
    assert last["tide/ra2p/handoff_held"] == last["tide/ra2p/handoff_ids_live"], last
    settled = sum(last[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                           "dropped_failed"))
    assert settled + last["tide/ledger/groups_held"] == last["tide/ledger/groups_submitted"], last
    assert last["tide/ledger/groups_dropped_failed"] == 0, last
    assert health["started"] == health["ended"] + health["sessions"] and health["close_failed"] == 0, health


@pytest.mark.testbed
def test_the_actors_replica_rolls_out_through_the_cold_start_then_trains(lend_run):
    run, steps, _ = lend_run
    assert run.returncode == 0, run.output[-6000:]
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    first = steps[1]
    # Before step 1's update the Actor's GPU served turns (CTB routed to it) while the trainer waited for ready
    # groups; then it switched to training (verl's abort + sleep, timed).
    assert first["tide/ers/actor_lent_turns"] > 0, first
    assert first["timing_s/switch_wait"] > 0 and first["timing_s/switch_to_trainer"] > 0, first
    assert "Lending hybrid engine to generation until" in run.output
    assert "verl-tide: ERS may lend the Actor's GPUs to rollout (tide.ers.lend_actor = auto)" in run.output
    for n in steps:
        assert steps[n]["timing_s/update_actor"] > 0  # and the Actor trained every step
        assert steps[n]["tide/ers/ranks_rollout"] == 1  # the lent replica is not one of ERS's rollout ranks
    lent = [steps[n]["tide/ers/actor_lent_turns"] for n in sorted(steps)]
    assert lent == sorted(lent)  # cumulative


@pytest.mark.testbed
def test_ers_decides_whether_an_evaluation_borrows_the_actors_gpu(lend_run):
    """trainer.test_freq=2: ERS decides at step 2's boundary whether the evaluation after it gets the hybrid
    replica (verl's on_validate_begin would switch it to rollout for every validation)."""
    run, steps, _ = lend_run
    assert "tide/eval/model_step" in steps[3] or any(k.startswith("val-core/") for k in steps[STEPS]), steps[STEPS]
    # At step 2's boundary ERS decided for the evaluation after it (tide.overlap_eval runs it during step 3's
    # rollout): lend preemptively unless a mini-batch was ready, in which case the Actor trains beside the
    # evaluation and verl's validation hook must not lend the replica anyway. Which of the two happens is the
    # machine's pace; each is checked. After the last step ERS never lends (verl's hook lends it for the final,
    # blocking validation).
    lent = steps[2]["tide/ers/lend_actor"]
    assert lent == steps[2]["separate_async/decision/should_switch_to_rollout"], steps[2]
    decided = next(line for line in run.output.splitlines() if "verl-tide step 2: ERS " in line)
    if lent:
        assert "ERS lends the Actor's GPU (eval: generation dominates" in decided, decided
        # lent between step 2's report and step 3's: the replica was in CTB's pool for a while (whether a turn
        # was routed to it in that window is the machine's pace, so turns are not asserted)
        assert steps[3]["tide/ers/actor_lent_s"] > steps[2]["tide/ers/actor_lent_s"], (steps[2], steps[3])
    else:
        assert "ERS keeps the Actor's GPU (" in decided and "a mini-batch can train" in decided, decided
        assert steps[3]["tide/ers/actor_lent_s"] == steps[2]["tide/ers/actor_lent_s"], (steps[2], steps[3])
    assert steps[3]["tide/ers/lend_actor"] == 0.0 and "verl-tide step 3: ERS keeps the Actor's GPU (the last step" \
        in run.output
    for n in steps:  # the Actor came back at one mini-batch (2 groups) or more, never beyond the step's 4
        assert 2 <= steps[n]["tide/ers/lend_return_at_groups"] <= 4, steps[n]
    lent_s = [steps[n]["tide/ers/actor_lent_s"] for n in sorted(steps)]
    assert lent_s == sorted(lent_s) and lent_s[0] >= first_wait(steps), lent_s


def first_wait(steps: dict) -> float:
    """Step 1's wait for ready groups, which the replica spent lent (it was in CTB's pool from the start)."""
    return steps[1]["timing_s/switch_wait"]


@pytest.mark.testbed
def test_nothing_is_lost_at_the_switches(lend_run):
    run, steps, health = lend_run
    for n in sorted(steps):
        m = steps[n]
        settled = sum(m[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                            "dropped_failed"))
        assert settled + m["tide/ledger/groups_held"] == m["tide/ledger/groups_submitted"], m
        assert m["tide/ledger/groups_dropped_failed"] == 0, m  # an aborted turn resumed elsewhere, not failed
        assert m["tide/ctb/bypassed"] == 0, m
    # every episode the job started ended, or is still open (in flight when the job stopped)
    assert health["started"] == health["ended"] + health["sessions"] and health["close_failed"] == 0, health
    assert "WARNING: " not in "\n".join(line for line in run.output.splitlines() if "verl-tide step" in line)


def test_lending_is_on_by_default_where_the_layout_allows_and_refused_naming_the_key_where_not():
    from omegaconf import OmegaConf

    from verl_tide.core.config import parse_tide_config
    from verl_tide.job_config import check_layout, lend_actor

    def job(setting=None, tide_raw=None, **keys):
        raw = {"actor_rollout_ref": {"hybrid_engine": keys.get("hybrid", True),
                                     "actor": {"use_kl_loss": keys.get("kl_loss", False)}},
               "algorithm": {"use_kl_in_reward": keys.get("kl_reward", False)}}
        tide = dict(tide_raw or {})
        if setting is not None:
            tide["ers"] = {**tide.get("ers", {}), "lend_actor": setting}
        return OmegaConf.create(raw), parse_tide_config(tide)

    assert lend_actor(*job()) == (True, "tide.ers.lend_actor = auto")
    assert lend_actor(*job(True)) == (True, "tide.ers.lend_actor = true")
    assert lend_actor(*job(False)) == (False, "tide.ers.lend_actor = false")
    assert lend_actor(*job(False, kl_loss=True))[0] is False
    # a Ref model on the trainer's GPUs only (verl's): auto leaves lending off, true lends beside verl's Ref
    for keys in ({"kl_loss": True}, {"kl_reward": True}):
        on, why = lend_actor(*job(**keys))
        assert on is False and why.startswith("tide.ers.lend_actor = auto, off: the job has a Ref model"), why
        assert lend_actor(*job(True, **keys)) == (
            True, "tide.ers.lend_actor = true, beside verl's Ref (its combined actor/rollout/ref worker)")
    # tide's Ref replicas (fixed, elastic, split) or no hybrid engine: off under auto, refused for true
    replicas = ({"ra2p": {"ref_ranks": 1}}, {"ers": {"min_ref_ranks": 1}}, {"ers": {"max_ref_ranks": 2}},
                {"ra2p": {"mode": "split", "ref_ranks": 1}})
    for tide_raw in replicas:
        on, why = lend_actor(*job(tide_raw=tide_raw, kl_loss=True))
        assert on is False and "a Ref model on tide's Ref replicas" in why, why
        with pytest.raises(TideConfigError, match="tide.ers.lend_actor = true with a Ref model on tide's Ref"):
            lend_actor(*job(True, tide_raw=tide_raw, kl_loss=True))
    on, why = lend_actor(*job(hybrid=False))
    assert on is False and why.startswith("tide.ers.lend_actor = auto, off: the job has actor_rollout_ref.hybrid_engine")
    with pytest.raises(TideConfigError, match="tide.ers.lend_actor = true with actor_rollout_ref.hybrid_engine = false"):
        lend_actor(*job(True, hybrid=False))
    # the driver's layout check (the Hydra callback, before Ray starts) refuses it too
    config, tide = job(True, tide_raw={"ra2p": {"ref_ranks": 1}}, kl_loss=True)
    layout = OmegaConf.merge(config, {"data": {"train_batch_size": 4}, "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 2}, "rollout": {"nnodes": 1, "n_gpus_per_node": 1,
                                                         "checkpoint_engine": {"backend": "tide_shm"}}},
        "trainer": {"v1": {"sampler": {}}}})
    check_layout(layout)  # without the tide config: the layout alone is fine
    with pytest.raises(TideConfigError, match="tide.ers.lend_actor = true with a Ref model on tide's Ref replicas"):
        check_layout(layout, tide)
    assert lending.lent_turns({"a": 3, "b": 4, "c": 1}, ["a", "c", "z"]) == 4.0
    status = {"turns_served": {"a": 3, "b": 4}, "pool_s": {"a": 2.5, "b": 9.0}}
    # ERS's inputs from what the trainer holds: verl's update_actor timer over the mini-batches trained
    got = lending.lending_inputs(1, 2, 4, 0.5, {"update_actor": 6.0}, 3, last_step=False)
    assert (got.ready_units, got.units_per_mini_batch, got.mini_batches, got.switch_cost_s) == (1, 2, 4, 0.5)
    assert got.train_s_per_mini_batch == 2.0
    assert lending.lending_inputs(0, 2, 4, None, {}, 3, last_step=True).train_s_per_mini_batch is None
    assert lending.lent_metrics(status, ["a"]) == {"tide/ers/actor_lent_turns": 3.0, "tide/ers/actor_lent_s": 2.5}
