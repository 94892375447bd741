"""Each recipe in recipes/ composes against verl 0.9.1's real `main_ppo` and passes what the job checks
before it starts: the `tide:` schema, trainer `tide`'s layout rules, and verl's own dataclass configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.verl_process  # fresh Python processes that import verl: 10-30 s each

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
NAMES = sorted(p.stem for p in RECIPES.glob("tide_*.yaml"))
REQUIRED = ["data.train_files=/data/train.parquet", "data.val_files=/data/val.parquet",
            "actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct"]
EXTRA = {"tide_grpo_tool_agent": ["actor_rollout_ref.rollout.multi_turn.tool_config_path=/cfg/tools.yaml"],
         "tide_grpo_env_service": ["tide.env.url=http://127.0.0.1:8000"],
         "tide_grpo_gym": ["tide.env.url=http://127.0.0.1:8765"]}


def _compose(name: str, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    cmd = ["bash", str(RECIPES / "run.sh"), name, *REQUIRED, *EXTRA.get(name, []), *extra, "--cfg", "job"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def test_there_are_text_tool_env_and_vlm_recipes():
    assert NAMES == ["tide_grpo_env_service", "tide_grpo_gym", "tide_grpo_text", "tide_grpo_tool_agent",
                     "tide_grpo_vlm"]


@pytest.mark.parametrize("name", NAMES)
def test_recipe_composes_and_passes_the_start_up_checks(name, tmp_path):
    proc = _compose(name, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = yaml.safe_load(proc.stdout)
    assert job["trainer"]["v1"]["trainer_mode"] == "tide"

    from omegaconf import OmegaConf
    from verl.utils.config import omega_conf_to_dataclass

    from verl_tide.job_config import tide_config_from_job
    from verl_tide.job_config import check_layout

    cfg = OmegaConf.create(job)
    tide_config_from_job(cfg)  # raises TideConfigError naming any bad key
    check_layout(cfg)  # rollout on its own ranks, non-naive weight sync, batch a multiple of the mini-batch
    for node in ("actor_rollout_ref.rollout", "actor_rollout_ref.actor", "actor_rollout_ref.rollout.multi_turn"):
        omega_conf_to_dataclass(OmegaConf.select(cfg, node))  # verl's own schema: unknown keys raise here
    agent = job["actor_rollout_ref"]["rollout"]["agent"]["default_agent_loop"]
    expected = {"tide_grpo_tool_agent": "tide_tool_agent", "tide_grpo_env_service": "tide_env_agent",
                "tide_grpo_gym": "tide_env_agent",
                "tide_grpo_text": "tide_single_turn_agent", "tide_grpo_vlm": "tide_single_turn_agent"}
    assert agent == expected[name]


def test_run_sh_without_a_recipe_lists_them(tmp_path):
    proc = subprocess.run(["bash", str(RECIPES / "run.sh")], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.startswith("usage: recipes/run.sh RECIPE")
    for name in NAMES:
        assert name in proc.stderr
    helped = subprocess.run(["bash", str(RECIPES / "run.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "docs/recipes.md" in helped.stdout
