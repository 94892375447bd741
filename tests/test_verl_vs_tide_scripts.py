"""The GPU comparison scripts (benchmarks/verl_vs_tide/): the three commands, and the table from logs."""

from __future__ import annotations

import pytest

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent / "benchmarks" / "verl_vs_tide"


@pytest.mark.verl_process
def test_dry_run_composes_and_validates_three_comparable_jobs_from_a_recipe():
    env = {**os.environ, "GPUS_PER_NODE": "8", "ROLLOUT_GPUS": "2", "STEPS": "5", "PYTHON": sys.executable}
    out = subprocess.run(["bash", str(HERE / "run.sh"), "--dry-run", "data.train_batch_size=64",
                          "tide.env.url=http://127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    commands = {line.split("]")[0].lstrip("["): line for line in out.stdout.splitlines() if " -m verl.trainer" in line}
    assert set(commands) == {"verl_sync", "verl_separate_async_switch", "tide"}
    for name, line in commands.items():  # every job from the recipe, composed and validated without launching
        assert "--config-name tide_grpo_env_service" in line
        assert f"[{name}] OK: the job composes and validates" in out.stdout
        assert "data.train_batch_size=64" in line and "trainer.total_training_steps=5" in line
    assert "trainer.n_gpus_per_node=8" in commands["verl_sync"] and "trainer_mode=sync" in commands["verl_sync"]
    for name in ("verl_separate_async_switch", "tide"):
        assert "trainer.n_gpus_per_node=6" in commands[name]
        assert "actor_rollout_ref.rollout.n_gpus_per_node=2" in commands[name]
        assert "checkpoint_engine.backend=nccl" in commands[name]
    assert "enable_switch=true" in commands["verl_separate_async_switch"]
    for name in ("verl_sync", "verl_separate_async_switch"):  # stock: the recipe without tide/enabled.yaml
        assert "~tide" in commands[name] and "++tide.env.url=" in commands[name]
    # one staleness bound: a lag of one version is tide.max_staleness=1 and verl's threshold 2 (versions spanned)
    assert "tide.max_staleness=1" in commands["tide"]
    assert "trainer.v1.sampler.max_off_policy_threshold=2" in commands["verl_separate_async_switch"]
    # a bad value is caught in the dry run, every job still attempted and reported
    bad = subprocess.run(["bash", str(HERE / "run.sh"), "--dry-run", "tide.ctb.kv_headroom=3"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stdout.count("tide.ctb.kv_headroom = 3: must be 0 < x <= 1") == 3
    assert "[tide] FAILED (exit 1)" in bad.stdout and "[verl_sync] FAILED (exit 1)" in bad.stdout


def _log(path: Path, steps: list[tuple[float, float]]) -> None:
    path.write_text("\n".join(f"(TaskRunnerV1 pid=1) step:{i + 1} - perf/total_num_tokens:{tok} - "
                              f"timing_s/step:{sec} - timing_s/gen:{sec / 2} - timing_s/ref:{sec / 10 * (i + 1)} - "
                              f"timing_s/update_actor:{sec / 4}" for i, (tok, sec) in enumerate(steps)))


@pytest.mark.verl_process
def test_collect_prints_goodput_per_system_and_the_ratio(tmp_path):
    _log(tmp_path / "verl_sync.log", [(1000, 10.0), (1000, 10.0)])
    _log(tmp_path / "tide.log", [(1000, 4.0), (1000, 4.0)])
    out = subprocess.run([sys.executable, str(HERE / "collect.py"), str(tmp_path / "verl_sync.log"),
                          str(tmp_path / "tide.log"), "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "2.50x" in out.stdout  # 250 tok/s vs 100 tok/s
    systems = json.loads((tmp_path / "r.json").read_text())["systems"]
    assert systems["verl_sync"]["goodput_tok_s"] == 100.0 and systems["tide"]["gen_wait_s"] == 2.0
    # verl's Ref stage and Actor update per step (means over the steps): 1.0 and 2.0 s -> 1.5 s; 2.5 s
    assert systems["verl_sync"]["ref_s"] == 1.5 and systems["verl_sync"]["update_actor_s"] == 2.5
    assert "ref s" in out.stdout and "update s" in out.stdout


@pytest.mark.verl_process
def test_collect_refuses_a_log_without_step_lines(tmp_path):
    (tmp_path / "tide.log").write_text("Traceback ...")
    out = subprocess.run([sys.executable, str(HERE / "collect.py"), str(tmp_path / "tide.log")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "trainer.logger=[console]" in out.stderr


def test_the_ra2p_step_gpu_variant_runs_a_half_to_one_and_a_half_billion_parameter_model():
    """Issue 5's GPU variant (benchmarks/ra2p_step_gpu.sh): the model its flags build is 0.5-1.5B parameters
    (counted on torch's meta device; nothing is allocated), and the script is valid bash."""
    import argparse
    import re
    import shlex

    import torch

    script = HERE.parent / "ra2p_step_gpu.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=30).returncode == 0
    command = re.search(r"ra2p_step\.py (.*?)--json", script.read_text().replace("\\\n", " "), re.S).group(1)
    flags = dict(zip(*[iter(shlex.split(command))] * 2))
    args = argparse.Namespace(device="meta", layers=int(flags["--layers"]), hidden=int(flags["--hidden"]),
                              vocab=int(flags["--vocab"]), seq=int(flags["--seq"]))
    sys.path.insert(0, str(HERE.parent))
    try:
        from ra2p_step import build
    finally:
        sys.path.pop(0)
    with torch.device("meta"):
        model = build(args, seed=0)
    params = sum(p.numel() for p in model.parameters())
    assert 0.5e9 <= params <= 1.5e9, params
    assert flags["--device"] == "cuda"
