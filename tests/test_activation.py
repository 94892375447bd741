"""`+tide=enabled` through verl's real `main_ppo` Hydra app, in fresh subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig

import pytest
import yaml

from verl_tide.core.config import defaults_as_dict

pytestmark = pytest.mark.verl_process  # fresh Python processes that import verl: 10-30 s each

# Stock verl: no .pth processing (-S) hides the editable verl-tide install, so neither the Hydra
# search-path plugin nor `verl_tide` can be imported; VERL_USE_EXTERNAL_PLUGINS=none skips entry points.
_STOCK = (
    "import runpy, sys; sys.path.append({purelib!r}); sys.argv = ['main_ppo'] + sys.argv[1:]; "
    "runpy.run_module('verl.trainer.main_ppo', run_name='__main__')"
)


def _main_ppo(args: list[str], tmp_path, stock: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    if stock:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
        cmd = [sys.executable, "-S", "-c", _STOCK.format(purelib=sysconfig.get_paths()["purelib"]), *args]
    else:
        cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *args]
    # cwd outside the repo: the checkout itself must not be what makes the plugin importable.
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)


def _job(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def stock_job_output(tmp_path_factory):
    return _main_ppo(["--cfg", "job"], tmp_path_factory.mktemp("stock"), stock=True)


def test_stock_baseline_really_lacks_the_plugin(tmp_path):
    # Without the search-path plugin `tide` is no config group: Hydra adds a plain string key.
    job = _job(_main_ppo(["+tide=enabled", "--cfg", "job"], tmp_path, stock=True))
    assert job["tide"] == "enabled"
    assert job["trainer"]["v1"]["trainer_mode"] == "sync"


def test_composing_without_tide_equals_stock_verl(tmp_path, stock_job_output):
    with_plugin = _main_ppo(["--cfg", "job"], tmp_path)
    assert with_plugin.returncode == 0 and stock_job_output.returncode == 0
    assert with_plugin.stdout == stock_job_output.stdout
    assert "tide" not in yaml.safe_load(with_plugin.stdout)


def test_tide_enabled_selects_trainer_and_adds_subtree_only(tmp_path, stock_job_output):
    job = _job(_main_ppo(["+tide=enabled", "--cfg", "job"], tmp_path))
    assert job["trainer"]["v1"]["trainer_mode"] == "tide"
    assert job.pop("tide") == defaults_as_dict()
    stock = _job(stock_job_output)
    stock["trainer"]["v1"]["trainer_mode"] = "tide"
    # The only other verl keys it sets: the one-node weight-sync backend becomes importable (used only if
    # selected), vLLM stats logging goes on (CTB reads KV capacity and hit rates from /metrics), the default
    # agent loop is verl's single-turn loop wrapped to tell CTB when a trajectory ends, and the agent-loop manager.
    rollout = stock["actor_rollout_ref"]["rollout"]
    rollout["checkpoint_engine"]["custom_backend_module"] = "verl_tide.weight_sync"
    rollout["disable_log_stats"] = False
    assert rollout["agent"]["default_agent_loop"] == "single_turn_agent"
    rollout["agent"]["default_agent_loop"] = "tide_single_turn_agent"  # the same loop, its end told to CTB
    # verl's TransferQueue manager, its dispatch not waiting on the agent-loop workers (trainer/dispatch.py)
    assert rollout["agent"].get("agent_loop_manager_class") is None
    rollout["agent"]["agent_loop_manager_class"] = "verl_tide.trainer.dispatch.TideAgentLoopManager"
    assert job == stock  # nothing else of verl's config changed


def test_tide_values_override_on_the_command_line(tmp_path):
    job = _job(_main_ppo(["+tide=enabled", "tide.ctb.kv_headroom=0.5", "tide.ra2p.mode=decoupled", "--cfg", "job"],
                         tmp_path))
    assert job["tide"]["ctb"]["kv_headroom"] == 0.5
    assert job["tide"]["ra2p"]["mode"] == "decoupled"


def test_bad_values_fail_in_the_driver_before_ray_starts(tmp_path):
    proc = _main_ppo(
        ["+tide=enabled", "tide.ctb.kv_headroom=1.5", "tide.ra2p.mode=pipelined", "tide.ers.tau=0",
         "tide.ers.min_batch=64", "tide.ers.ideal_batch=32"],
        tmp_path,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for expected in ("tide.ctb.kv_headroom = 1.5: must be 0 < x <= 1",
                     "tide.ra2p.mode = 'pipelined': must be one of auto | decoupled | colocated | split",
                     "tide.ers.tau = 0: must be > 0",
                     "tide.ers.min_batch = 64: must be <= tide.ers.ideal_batch"):
        assert expected in out, out[-3000:]
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out


def test_a_layout_tide_cannot_run_fails_in_the_driver_before_ray_starts(tmp_path):
    """verl's defaults colocate rollout with the trainer (no rollout ranks, the in-process `naive` weight sync):
    trainer tide refuses them, naming the keys, from the Hydra callback, not after a cluster start-up."""
    proc = _main_ppo(["+tide=enabled", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                      "tide.ers.lend_actor=true", "actor_rollout_ref.actor.use_kl_loss=true", "tide.ra2p.ref_ranks=1"],
                     tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    for expected in ("actor_rollout_ref.rollout.nnodes = 0, n_gpus_per_node = 8: trainer tide runs rollout on its own",
                     "checkpoint_engine.backend = naive", "tide_shm",
                     "data.train_batch_size = 6: must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size = 4",
                     "tide.ers.lend_actor = true with a Ref model on tide's Ref replicas (tide.ra2p.ref_ranks"):
        assert expected in out, out[-3000:]
    assert "ray init kwargs" not in out and "Started a local Ray instance" not in out
    # the same job under another trainer mode is not tide's to refuse
    ok = _main_ppo(["+tide=enabled", "trainer.v1.trainer_mode=sync", "--cfg", "job"], tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_check_layout_accepts_separate_rollout_and_names_each_problem():
    """The check the callback runs in the driver, and trainer `tide` again when it is built (a job that selects
    the trainer without the callback)."""
    from omegaconf import OmegaConf

    from verl_tide.core.config import TideConfigError
    from verl_tide.job_config import check_layout

    def layout(nnodes=1, backend="nccl", tb=8, mb=4, sampler=None):
        return OmegaConf.create({
            "actor_rollout_ref": {"rollout": {"nnodes": nnodes, "n_gpus_per_node": 8,
                                              "checkpoint_engine": {"backend": backend}},
                                  "actor": {"ppo_mini_batch_size": mb}},
            "data": {"train_batch_size": tb}, "trainer": {"v1": {"sampler": {"custom_sampler": sampler}}}})

    check_layout(layout())
    check_layout(layout(backend="tide_shm", sampler={"path": None}))
    with pytest.raises(TideConfigError, match="custom_sampler: trainer tide owns the replay buffer"):
        check_layout(layout(sampler={"path": "my_sampler.py", "name": "S"}))
    with pytest.raises(TideConfigError, match=r"\(3 problem") as e:
        check_layout(layout(nnodes=0, backend="naive", tb=6))
    assert "rollout.nnodes = 0" in str(e.value) and "backend = naive" in str(e.value)
    # where Ref runs, checked before Ray too: decoupled Ref ranks defer the KL term, a KL penalty in the reward
    # cannot wait for the Actor's backward (this raised only once the Ref pool started, after Ray)
    from verl_tide.core.config import parse_tide_config

    kl_reward = OmegaConf.merge(layout(), {"algorithm": {"use_kl_in_reward": True},
                                           "actor_rollout_ref": {"actor": {"use_kl_loss": False}}})
    with pytest.raises(TideConfigError, match="algorithm.use_kl_in_reward must be false"):
        check_layout(kl_reward, parse_tide_config({"ra2p": {"mode": "decoupled", "ref_ranks": 1}}))
    check_layout(kl_reward, parse_tide_config({"ra2p": {"mode": "auto", "ref_ranks": 1}}))


def test_unknown_tide_key_is_rejected_with_allowed_keys(tmp_path):
    proc = _main_ppo(["+tide=enabled", "+tide.ctb.headroom=0.5"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "tide.ctb.headroom = 0.5: unknown key; allowed keys: enabled, kv_headroom" in out
