"""ERS resizes the Actor's training group in a running `+tide=enabled` job on the CPU test bed: at a weight-sync
boundary a rollout replica's fake GPU joins the Actor's FSDP group (rebuilt with its state carried: verl's worker
groups, its FSDP engine, torch DCP), with nothing lost; a checkpoint taken there resumes at the start split."""

from __future__ import annotations

import re

import pytest

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, tide_overrides, with_overrides
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed

STEPS = 8
SAVED_AT = 6  # a checkpoint while the Actor holds the rollout GPU (it moves after step 3 and stays)


@pytest.mark.timeout(2400)  # two jobs: the resizing one and its resume
def test_the_actor_group_takes_a_rollout_gpu_and_a_checkpoint_resumes_at_the_start_split(tiny_model_path,
                                                                                         tmp_path_factory):
    """The job starts trainer-bound (one fake GPU training four PPO epochs a step, two rolling out, an environment
    that answers at once): ERS moves a rollout replica's fake GPU into the Actor's group, which is rebuilt with its
    state carried, and the job trains on at two Actor GPUs with nothing lost. A checkpoint saved there resumes at
    the split the job started with."""
    from verl_tide.testing.testbed import run_with_env_service

    work = tmp_path_factory.mktemp("tide_resize")
    train = write_env_task_parquet(work / "train.parquet", 64, env="tiny_slow")
    val = write_env_task_parquet(work / "val.parquet", 2, env="tiny_slow", seed=100)
    # 4 prompts x 2 trajectories a step, 2 mini-batches of 4 sequences: Actor sizes 1, 2 and 4 split them.
    ckpt = work / "ckpt"
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=3, steps=STEPS,
                  prompt_length=128, response_length=96, ppo_mini_batch_size=2, default_local_dir=str(ckpt))

    def overrides(job: GRPOJob, url: str, *extra: str) -> list[str]:
        return with_overrides(grpo_overrides(job), [
            *tide_overrides(job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
            f"tide.env.url={url}", "tide.env.max_tokens_per_turn=8", "ray_kwargs.ray_init.num_cpus=24",
            "actor_rollout_ref.actor.ppo_epochs=4",  # the trainer's work, not rollout's, bounds the cycle
            "tide.ers.resize_trainer=true", *extra])

    # the first move's cost as a user who measured it would state it (the measured one is used after)
    run, health = run_with_env_service(lambda url: overrides(job, url, "tide.ers.resize_move_s=1",
                                                             f"trainer.save_freq={SAVED_AT}"),
                                       work, timeout_s=900, log_path=work / "main_ppo.log")
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]

    moves = re.findall(r"ERS resized the Actor's group (\d) -> (\d) GPU\(s\) after step (\d+) in ([\d.]+) s "
                       r"\(state out [\d.]+, old group stopped [\d.]+, new group built ([\d.]+), state in [\d.]+; "
                       r"rollout rank\(s\) \[(\d)\] released ([\d.]+)\)", run.output)
    assert len(moves) == 1, re.findall(r"ERS trainer resize: .*", run.output)
    up_from, up_to, up_at, up_cost, up_built, up_rank, _ = moves[0]
    up_at = int(up_at)
    assert (up_from, up_to, up_rank) == ("1", "2", "1") and up_at < SAVED_AT  # the highest rollout rank goes first
    assert float(up_cost) >= float(up_built) > 0
    assert "the trainer bounds the cycle" in re.search(rf"verl-tide step {up_at}: ERS trainer resize: (.*)",
                                                       run.output).group(1)
    for n, m in steps.items():
        two = n > up_at
        assert m["tide/ers/actor_gpus"] == (2 if two else 1), (n, m)
        assert m["tide/ers/ranks_rollout"] == (1 if two else 2) and m["tide/ctb/ranks"] == (1 if two else 2), (n, m)
        assert "actor/pg_loss" in m  # the Actor trained every step, at both sizes
    assert steps[STEPS]["tide/ers/resizes"] == 1
    # the measured cost is what the next decisions weigh a move against
    assert steps[up_at + 1]["tide/ers/resize_move_s"] == pytest.approx(float(up_cost), abs=0.06)
    # the step cycles after the move are logged beside those before it
    cycles = re.findall(r"verl-tide step (\d+): step cycle ([\d.]+) s on 2 Actor GPU\(s\).*before the resize to 2, "
                        r"([\d.]+) s on 1", run.output)
    assert [int(c[0]) for c in cycles] == list(range(up_at + 1, min(up_at + 3, STEPS) + 1)), cycles
    assert float(cycles[0][1]) > float(up_cost)  # the cycle that held the resize

    # nothing lost across the move: every group settled or in flight, none failed, a batch trained each step
    last = steps[STEPS]
    settled = sum(last[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                           "dropped_failed"))
    assert settled + last["tide/ledger/groups_held"] == last["tide/ledger/groups_submitted"]
    assert last["tide/ledger/groups_consumed"] == STEPS * job.train_batch_size
    assert last["tide/ledger/groups_dropped_failed"] == 0 and health["close_failed"] == 0, (last, health)

    # The checkpoint of step 6, written while the Actor had two fake GPUs, resumes at the split the job started
    # with: verl's per-rank files are of two ranks, the re-sharding copy beside them loads at one.
    assert steps[SAVED_AT]["tide/ers/actor_gpus"] == 2
    assert (ckpt / f"global_step_{SAVED_AT}" / "actor" / "tide_train_state").is_dir()
    resumed_job = GRPOJob(**{**job.__dict__, "steps": SAVED_AT + 2})
    second, _ = run_with_env_service(lambda url: overrides(
        resumed_job, url, "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={ckpt / f'global_step_{SAVED_AT}'}"), work, timeout_s=900,
        log_path=work / "resumed.log")
    assert second.returncode == 0, second.output[-6000:]
    resumed = parse_step_metrics(second.output)
    assert sorted(resumed) == [SAVED_AT + 1, SAVED_AT + 2], second.output[-3000:]
    assert f"verl-tide: resumed from step {SAVED_AT}" in second.output
    assert re.search(r"the Actor's state loaded at 1 rank\(s\) from .*tide_train_state", second.output)
    for m in resumed.values():
        assert m["tide/ers/actor_gpus"] == 1 and "actor/pg_loss" in m, m
    assert resumed[SAVED_AT + 2]["tide/ledger/groups_consumed"] == (SAVED_AT + 2) * job.train_batch_size
