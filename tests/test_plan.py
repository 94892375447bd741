"""`verl-tide plan`: a user's job read from its main_ppo overrides and a workload description, predicted by the
same simulation `verl-tide bench` runs; what it cannot model refused with the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_tide.cli import main as cli_main
from verl_tide.sim.bench import RATIOS, STOCK_SYSTEMS
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.plan import HARDWARE, PlanError, job_workload, model_from_hf_config, parse_overrides, plan
from verl_tide.sim.workload import load_workload

DATA = Path(__file__).parent / "data"
TINY = str(DATA / "sim_tiny.yaml")


def test_the_model_is_read_from_its_hugging_face_config():
    m = model_from_hf_config(str(DATA / "qwen2_5_7b"))
    assert m.params_b == pytest.approx(7.62, abs=0.05) and m.kv_bytes_per_token == 57344  # Qwen2.5-7B
    with pytest.raises(PlanError, match="actor_rollout_ref.model.path = /nope: no config.json"):
        model_from_hf_config("/nope")


def test_the_jobs_overrides_shape_the_workload_and_the_plan_is_the_bench_simulation(tmp_path):
    o = parse_overrides(["trainer.n_gpus_per_node=6", "actor_rollout_ref.rollout.nnodes=1",
                         "actor_rollout_ref.rollout.n_gpus_per_node=2", "data.train_batch_size=6",
                         "actor_rollout_ref.rollout.n=4", "+tide.max_staleness=2"])
    w = job_workload(load_workload(TINY), o, 8, None, steps=3)
    assert (w.groups_for(8), w.group_size, w.max_staleness, w.steps) == (6, 4, 2, 3)
    p = plan(w, 8, HARDWARE["h100"])
    # the same simulation as verl-tide bench: the best stock system at its split, tide from that split
    best = p["best_stock"]
    rules = {**STOCK_SYSTEMS[best["system"]], "parameter_sync_step": 4}
    again = Simulation(w, 8, SystemSpec("x", rollout_ratio=best["rollout_ratio"], **rules)).run()
    assert round(again.goodput_tok_s, 1) == best["goodput_tok_s"]
    assert best["goodput_tok_s"] == max(v for k, v in p["predicted_tok_s"].items() if k.startswith("verl_") and
                                        k != "verl_sync")
    assert p["tide"]["rollout_ratio"] == best["rollout_ratio"] and p["tide"]["goodput_tok_s"] > 0
    assert len([k for k in p["predicted_tok_s"] if "_r" in k]) == 2 * len(RATIOS)
    assert any(o.startswith("actor_rollout_ref.rollout.n_gpus_per_node=") for o in p["start_overrides"])


def test_the_cli_prints_the_plan_and_writes_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert cli_main(["plan", "--workload", TINY, "--gpus", "8", "--steps", "2", "--hardware", "h200",
                     f"actor_rollout_ref.model.path={DATA / 'qwen2_5_7b'}", "--json", str(out),
                     "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "H200-141GB-SXM" in text and "advised split" in text and "+tide=enabled" in text
    p = json.loads(out.read_text())
    assert p["model_params_b"] == pytest.approx(7.62, abs=0.05) and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args, message", [
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2"], "tensor_model_parallel_size = 2: not modeled"),
    (["algorithm.adv_estimator=gae"], "algorithm.adv_estimator = gae: not modeled"),
    (["--model-params-b", "400", "--kv-bytes-per-token", "100000"], "does not fit"),
    (["--hardware", "tpu"], "--hardware 'tpu': one of h100 | h200 | testbed-cpu"),
    (["data.train_batch_size=zero"], "data.train_batch_size = 'zero': must be an integer >= 1"),
])
def test_what_the_model_cannot_represent_is_refused_naming_the_key(args, message, capsys):
    with pytest.raises(SystemExit):
        cli_main(["plan", "--workload", TINY, "--gpus", "8", "--steps", "1", *args])
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plan", "--workload", TINY])  # no layout and no --gpus
    assert "trainer.n_gpus_per_node: not given" in capsys.readouterr().err
