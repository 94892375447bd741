"""`verl-tide check <overrides>`: the job composed as main_ppo composes it, validated before any launch."""

from __future__ import annotations

from pathlib import Path

from verl_tide.cli import main as cli_main

RECIPES = str(Path(__file__).resolve().parent.parent / "recipes")
GOOD_LAYOUT = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.nnodes=1",
               "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"]


def test_check_reports_every_bad_value_unknown_key_and_layout_at_once(capsys):
    rc = cli_main(["check", "+tide=enabled", "tide.ctb.kv_headroom=2", "tide.ctb.kv_hedroom=0.5",
                   "tide.ers.lend_actor=perhaps", "algorithm.adv_estimator=grpo"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "tide.ctb.kv_hedroom: no such key; allowed under tide.ctb:" in out and "kv_headroom" in out
    assert "tide.ctb.kv_headroom = 2: must be 0 < x <= 1" in out
    assert "tide.ers.lend_actor" in out
    assert "actor_rollout_ref.rollout.checkpoint_engine.backend = naive" in out  # the layout, checked too


def test_check_passes_a_good_job_and_the_shipped_recipes(capsys):
    assert cli_main(["check", "+tide=enabled", *GOOD_LAYOUT]) == 0
    assert "OK: the job composes and validates (trainer.v1.trainer_mode = tide)" in capsys.readouterr().out
    for recipe in sorted(p.stem for p in Path(RECIPES).glob("*.yaml")):
        assert cli_main(["check", "--config-path", RECIPES, "--config-name", recipe]) == 0, recipe
    # stock verl without the plugin's subtree composes too (nothing of tide's to check)
    assert cli_main(["check", "algorithm.adv_estimator=grpo"]) == 0
