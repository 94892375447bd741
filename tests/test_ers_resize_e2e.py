"""ERS resizes the Actor's training group in a running `+tide=enabled` job on the CPU test bed: started at a bad
split (one fake GPU training four PPO epochs a step, two rolling out), the trainer bounds the step cycle; ERS
releases a rollout replica at a weight-sync boundary and rebuilds the Actor's FSDP group over two fake GPUs with its
state carried (verl's worker groups, its FSDP engine, torch DCP), and training goes on with nothing lost."""

from __future__ import annotations

import re

import pytest

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_with_env_service, \
    tide_overrides, with_overrides
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed

STEPS = 6


def test_a_trainer_bound_job_moves_a_rollout_gpu_into_the_actor_group_and_trains_on(tiny_model_path,
                                                                                    tmp_path_factory):
    work = tmp_path_factory.mktemp("tide_resize")
    train = write_env_task_parquet(work / "train.parquet", 48, env="tiny_slow")
    val = write_env_task_parquet(work / "val.parquet", 2, env="tiny_slow", seed=100)
    # 4 prompts x 2 trajectories a step, 2 mini-batches of 4 sequences: Actor sizes 1, 2 and 4 split them.
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=3, steps=STEPS,
                  prompt_length=128, response_length=96, ppo_mini_batch_size=2)
    run, health = run_with_env_service(lambda url: with_overrides(grpo_overrides(job), [
        *tide_overrides(job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
        f"tide.env.url={url}", "tide.env.max_tokens_per_turn=8", "ray_kwargs.ray_init.num_cpus=24",
        "actor_rollout_ref.actor.ppo_epochs=4",  # the trainer's work, not rollout's, bounds the cycle
        # the first move's cost as a user who measured it would state it (the measured one is used after)
        "tide.ers.resize_trainer=true", "tide.ers.resize_move_s=1"]), work, timeout_s=900,
        log_path=work / "main_ppo.log")
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]

    moves = re.findall(r"ERS resized the Actor's group (\d) -> (\d) GPU\(s\) after step (\d+) in ([\d.]+) s "
                       r"\(state out [\d.]+, old group stopped [\d.]+, new group built ([\d.]+), state in [\d.]+; "
                       r"rollout rank\(s\) \[(\d)\] released", run.output)
    assert len(moves) == 1, re.findall(r"ERS trainer resize: .*", run.output)
    a0, a1, at, cost, built, rank = moves[0]
    at = int(at)
    assert (a0, a1, rank) == ("1", "2", "1") and at < STEPS - 1  # the highest rollout rank goes first
    assert float(cost) >= float(built) > 0
    assert "the trainer bounds the cycle" in re.search(rf"verl-tide step {at}: ERS trainer resize: (.*)",
                                                       run.output).group(1)
    for n, m in steps.items():
        moved = n > at
        assert m["tide/ers/actor_gpus"] == (2 if moved else 1), (n, m)
        assert m["tide/ers/ranks_rollout"] == (1 if moved else 2) and m["tide/ctb/ranks"] == (1 if moved else 2)
        assert "actor/pg_loss" in m  # the Actor trained every step, before the move and after it
    after = steps[at + 1]
    assert after["tide/ers/resize_total_s"] == pytest.approx(float(cost) - after["tide/ers/resize_rollout_s"],
                                                             abs=0.06)
    # the measured cost is what the next decisions weigh a move against
    assert steps[STEPS]["tide/ers/resize_move_s"] == pytest.approx(float(cost), abs=0.06)
    # the step cycles after the move are logged beside those before it
    cycles = re.findall(rf"verl-tide step (\d+): step cycle ([\d.]+) s on 2 Actor GPU\(s\).*before the resize to 2, "
                        rf"([\d.]+) s on 1", run.output)
    assert [int(c[0]) for c in cycles] == list(range(at + 1, min(at + 3, STEPS) + 1)), cycles
    assert float(cycles[0][1]) > float(cost)  # the cycle that held the resize

    # nothing lost across the move: every group settled or in flight, none failed, a batch trained each step
    last = steps[STEPS]
    settled = sum(last[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                           "dropped_failed"))
    assert settled + last["tide/ledger/groups_held"] == last["tide/ledger/groups_submitted"]
    assert last["tide/ledger/groups_consumed"] == STEPS * job.train_batch_size
    assert last["tide/ledger/groups_dropped_failed"] == 0, last
    assert health["close_failed"] == 0, health
