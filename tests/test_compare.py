"""The head-to-head's systems and its one clock (benchmarks/e2e_compare.py), without running a job."""

from __future__ import annotations

import pytest

from verl_tide.testing.compare import best_stock, missing_steps, systems, wall_clock_summary
from verl_tide.testing.testbed import GRPOJob, override_key


def _job(n_gpus: int) -> GRPOJob:
    return GRPOJob(model_path="/m", train_file="/t.parquet", val_file="/v.parquet", n_gpus=n_gpus)


def test_every_split_the_fake_gpus_allow_with_and_without_the_hybrid_switch():
    names = [s.name for s in systems(_job(2))]
    assert names == ["verl sync", "verl colocate_async", "verl separate_async 1T/1R",
                     "verl separate_async 1T/1R + hybrid switch", "verl fully_async 1T/1R + dynamic schedule", "tide",
                     "tide, tide.ers.lend_actor=false"]
    three = [s for s in systems(_job(3)) if "separate_async" in s.name]
    assert sorted({s.rollout_gpus for s in three}) == [1, 2] and len(three) == 4
    for s in three:  # trainer + rollout GPUs = the job's, weights every step, one staleness bound for all
        keys = dict(o.split("=", 1) for o in s.overrides)
        assert int(keys["trainer.n_gpus_per_node"]) + int(keys["actor_rollout_ref.rollout.n_gpus_per_node"]) == 3
        assert keys["trainer.v1.separate_async.parameter_sync_step"] == "1"
        # verl's threshold counts versions spanned: a lag of 1 (the default bound) is 2, as trainer tide's buffer
        assert keys["trainer.v1.sampler.max_off_policy_threshold"] == "2"
    tide, no_lending = systems(_job(2), max_staleness=2)[-2:]
    assert "+tide=enabled" in tide.overrides and "tide.max_staleness=2" in tide.overrides
    assert len({override_key(o) for o in tide.overrides}) == len(tide.overrides)
    # tide as a user gets it (tide.ers.lend_actor left at its default), and beside it tide without lending
    assert not any(override_key(o) == "tide.ers.lend_actor" for o in tide.overrides)
    assert tide.rollout_gpus == 2 and no_lending.rollout_gpus == 1
    assert set(no_lending.overrides) - set(tide.overrides) == {"tide.ers.lend_actor=false"}


def test_verl_fully_async_runs_its_own_entry_point_with_the_dynamic_schedule_and_the_same_bound():
    """verl's fully_async trainer at every split: its entry point, a step of the job's prompts, the weights synced
    every step, hybrid replicas lent by the dynamic schedule's default policy, and the bound every system gets
    (a lag of k versions: staleness_threshold k, samples at most k steps ahead)."""
    job = _job(3)
    fa = [s for s in systems(job, max_staleness=2) if "fully_async" in s.name]
    assert [s.rollout_gpus for s in fa] == [1, 2]
    for s in fa:
        assert s.entry == "verl.experimental.fully_async_policy.fully_async_main" and s.metrics_by_global_step
        keys = dict(o.split("=", 1) for o in s.overrides)
        assert int(keys["trainer.n_gpus_per_node"]) + int(keys["rollout.n_gpus_per_node"]) == 3
        assert keys["async_training.staleness_threshold"] == "2.0"
        assert keys["async_training.trigger_parameter_sync_step"] == "1"
        assert keys["async_training.use_dynamic_resource_scheduling"] == "True"
        assert keys["async_training.dynamic_schedule_policy"] == "default"
        assert keys["actor_rollout_ref.actor.ppo_mini_batch_size"] == str(job.train_batch_size)
        assert keys["rollout.total_rollout_steps"] == str(job.steps * job.train_batch_size)
    from verl_tide.job_config import fully_async_staleness_threshold
    assert fully_async_staleness_threshold(0) == 0.0 and fully_async_staleness_threshold(1) == 1.0


def test_fully_async_steps_are_read_by_their_global_step_and_end_at_their_own_update():
    """verl's fully_async trainer prints, after step k's weight update, a line `step:k` of the rollouter's numbers
    and then the training metrics of step k-1 (`training/global_step:k-1`); the last step's metrics come after
    the run, under the same N. Step k's metrics are the line naming it; step k ended at the first `step:k` line."""
    p = "\x1b[36m(FullyAsyncTrainer pid=1)\x1b[0m "
    lines = [(100.0, p + "step:0 - fully_async/rollouter/active_time:9.0"),
             (110.0, p + "step:1 - fully_async/rollouter/active_time:1.0"),
             (120.0, p + "step:2 - fully_async/rollouter/active_time:1.0"),
             (120.5, p + "step:2 - training/global_step:1.0 - perf/total_num_tokens:1000 - critic/score/mean:0.1"),
             (130.0, p + "step:3 - fully_async/rollouter/active_time:1.0"),
             (130.5, p + "step:3 - training/global_step:2.0 - perf/total_num_tokens:1100 - critic/score/mean:0.2"),
             (140.0, p + "step:3 - training/global_step:3.0 - perf/total_num_tokens:1200 - critic/score/mean:0.3")]
    r = wall_clock_summary(lines, started_unix=90.0, first_request_unix=100.0, by_global_step=True)
    assert sorted(r["steps"]) == [1, 2, 3] and missing_steps(r["steps"], 3) is None
    assert r["tokens"] == 3300 and r["wall_s"] == 30.0  # the clock ends at step 3's update, not its late line
    assert [r["steps"][n]["reward"] for n in (1, 2, 3)] == [0.1, 0.2, 0.3]
    # read as verl's other trainers print (by N), the same lines lose step 2 to the later line of its N
    assert wall_clock_summary(lines, 90.0, 100.0)["tokens"] != 3300


def test_device_busy_is_taken_over_the_benchmarks_clock_not_the_start_up():
    """A fake GPU busy through a 100 s start-up and idle on the clock reads idle; the timeline has each bin."""
    from verl_tide.testing.compare import device_busy_on_clock

    samples = [(0.0, {"gpu0": 0.0}), (100.0, {"gpu0": 50.0}), (110.0, {"gpu0": 50.0}), (120.0, {"gpu0": 55.0})]
    r = device_busy_on_clock(samples, {"gpu0": 0.5}, first_request_unix=100.0, wall_s=20.0, bin_s=10.0)
    assert r["device_busy"] == {"gpu0": 0.5}  # 5 CPU s over 20 s at 0.5 cores
    assert r["device_timeline"]["t_s"] == [0.0, 10.0]
    assert [b["gpu0"] for b in r["device_timeline"]["busy"]] == [0.0, 1.0]


def _line(n: int, tokens: float, reward: float) -> str:
    return f"\x1b[36m(TaskRunnerV1 pid=1)\x1b[0m step:{n} - perf/total_num_tokens:{tokens} - critic/score/mean:{reward}"


def test_goodput_is_tokens_over_the_wall_clock_from_the_first_rollout_request():
    lines = [(100.0, "ray started"), (130.0, "all initialize finished, ready to fit"),
             (150.0, _line(1, 1000, 0.1)), (160.0, "noise"), (170.0, _line(2, 2000, 0.2)), (190.0, _line(3, 2000, 0.3))]
    r = wall_clock_summary(lines, started_unix=95.0, first_request_unix=135.0)
    assert r["startup_s"] == 40.0 and r["wall_s"] == 55.0 and r["tokens"] == 5000
    assert r["goodput_tok_s"] == pytest.approx(5000 / 55)
    assert r["goodput_after_step1_tok_s"] == pytest.approx(4000 / 40)  # step 1's line to the last
    assert [s["wall_s"] for s in r["steps"].values()] == [15.0, 35.0, 55.0]
    assert r["steps"][2]["reward"] == 0.2 and r["steps"][2]["rwt_s"] is None  # stock verl reports no RWT
    assert r["steps"][2]["prefix_cache_hit_rate"] is None


def test_a_run_with_a_missing_step_line_is_no_result():
    from verl_tide.testing.compare import missing_steps

    assert missing_steps({1: {}, 2: {}, 3: {}}, 3) is None
    assert "seen: [1, 3], expected 1..3" in missing_steps({1: {}, 3: {}}, 3)
    assert "expected 1..3" in missing_steps({1: {}, 2: {}}, 3)


def test_the_hit_rate_is_the_mean_over_tides_rollout_engines():
    line = _line(1, 1000, 0.1) + " - tide/engine/prefix_hit_rate/0:0.5 - tide/engine/prefix_hit_rate/1:0.7"
    r = wall_clock_summary([(10.0, line)], started_unix=0.0, first_request_unix=5.0)
    assert r["steps"][1]["prefix_cache_hit_rate"] == pytest.approx(0.6)


def test_a_run_without_steps_or_requests_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="nothing to time"):
        wall_clock_summary([(1.0, "no steps")], 0.0, 0.5)
    with pytest.raises(ValueError, match="nothing to time"):
        wall_clock_summary([(1.0, _line(1, 10, 0.0))], 0.0, None)


def test_the_best_stock_system_is_the_fastest_that_is_not_tide():
    results = {"verl sync": {"goodput_tok_s": 100.0}, "verl colocate_async": {"goodput_tok_s": 300.0},
               "tide": {"goodput_tok_s": 500.0}, "tide, tide.ers.lend_actor=false": {"goodput_tok_s": 400.0}}
    assert best_stock(results) == ("verl colocate_async", 300.0)
    with pytest.raises(ValueError, match="no stock verl system"):
        best_stock({"tide": {"goodput_tok_s": 1.0}})


def test_the_every_part_preset_runs_tide_on_two_rollout_ranks_with_a_ref_model_and_no_lending():
    from dataclasses import replace

    job = replace(_job(3), use_kl_loss=True)
    ran = {s.name: s for s in systems(job, tide_rollout_gpus=2)}
    # lending is off by default with a Ref model; asked for, it runs beside verl's Ref; tide at the other split too
    assert [n for n in ran if n.startswith("tide")] == ["tide", "tide 2T/1R", "tide, tide.ers.lend_actor=true"]
    assert set(ran["tide, tide.ers.lend_actor=true"].overrides) - set(ran["tide"].overrides) == \
        {"tide.ers.lend_actor=true"}
    for name, rollout, trainer in (("tide", "2", "1"), ("tide 2T/1R", "1", "2")):
        keys = dict(o.split("=", 1) for o in ran[name].overrides)
        assert keys["actor_rollout_ref.rollout.n_gpus_per_node"] == rollout
        assert keys["trainer.n_gpus_per_node"] == trainer
        assert "+tide=enabled" in ran[name].overrides and ran[name].rollout_gpus == int(rollout)


def test_the_presets_are_defined_once_for_the_benchmarks_and_the_calibration(tmp_path):
    from verl_tide.testing.demo import preset_job

    demo = preset_job("demo", tmp_path / "d", steps=2)
    assert (demo.job.n_gpus, demo.job.train_batch_size, demo.job.use_kl_loss) == (2, 4, False)
    assert (demo.extra, demo.latency_scale, demo.tide_rollout_gpus, demo.kv_capacity_tokens) == ((), 1.0, 1, None)
    every = preset_job("every_part", tmp_path / "e", steps=2, seed=1)
    assert (every.job.n_gpus, every.job.train_batch_size, every.job.use_kl_loss) == (3, 6, True)
    assert (every.latency_scale, every.tide_rollout_gpus, every.eval_every_steps) == (2.0, 2, 3)
    keys = dict(o.split("=", 1) for o in every.extra)
    # the KV cache the job sets is the one the calibration writes into the simulator's profile
    assert int(keys["+actor_rollout_ref.rollout.engine_kwargs.vllm.num_gpu_blocks_override"]) * 128 == \
        every.kv_capacity_tokens
    assert keys["trainer.test_freq"] == "3" and keys["data.seed"] == "1"
    with pytest.raises(ValueError, match="every_part"):
        preset_job("everything", tmp_path / "x", steps=2)


def test_mechanisms_say_what_acted_over_a_run():
    from verl_tide.testing.compare import mechanisms

    steps = {1: {"ctb_pauses": 2.0, "ctb_resumes": 1.0, "ra2p_decoupled": 0.0, "ra2p_split": 1.0, "ers_moves": 1.0,
                 "ers_ref_ranks": 1.0, "prefix_cache_hit_rate": 0.5},
             2: {"ctb_pauses": 5.0, "ctb_resumes": 5.0, "ra2p_decoupled": 1.0, "ra2p_split": 0.0, "ers_moves": 1.0,
                 "ers_ref_ranks": 0.0, "prefix_cache_hit_rate": None}}
    assert mechanisms(steps) == {"ctb_pauses": 5.0, "ctb_resumes": 5.0, "ra2p_decoupled_steps": 1.0,
                                 "ra2p_split_steps": 1.0, "ers_moves": 2.0, "ers_steps_with_ref_ranks": 1.0,
                                 "prefix_cache_hit_rate_mean": 0.5}
    assert mechanisms({}) == {}


def test_attribution_adds_tide_with_verls_sampler_poll_and_it_is_not_stock():
    from verl_tide.testing.compare import POLL_AS_VERL, is_tide

    by_name = {s.name: s for s in systems(_job(2), attribution=True)}
    poll = by_name[POLL_AS_VERL]
    assert set(poll.overrides) - set(by_name["tide"].overrides) == {"tide.sample_poll_s=2.0"}
    assert is_tide(POLL_AS_VERL) and POLL_AS_VERL not in {s.name for s in systems(_job(2))}
    # and stock verl with the same 0.2 s poll through verl's custom-sampler keys: a what-if, never "best stock"
    fast = by_name["what-if: verl colocate_async, 0.2 s poll"]
    keys = dict(o.split("=", 1) for o in fast.overrides)
    assert keys["trainer.v1.sampler.custom_sampler.name"] == "FastPollReplayBufferAsync"
    assert set(by_name["verl colocate_async"].overrides) < set(fast.overrides)
    from verl.utils.import_utils import load_extern_type

    cls = load_extern_type(keys["trainer.v1.sampler.custom_sampler.path"], "FastPollReplayBufferAsync")
    # built with the keyword arguments verl passes a custom sampler (trainer_base._build_replay_buffer)
    buffer = cls(trainer_mode="colocate_async", trainer_config={}, max_off_policy_threshold=1,
                 max_off_policy_strategy="drop", sampler_kwargs={}, refill_fn=None)
    assert buffer.poll_interval == 0.2
    results = {"verl sync": {"goodput_tok_s": 100.0}, "what-if: verl sync, 0.2 s poll": {"goodput_tok_s": 150.0},
               "tide": {"goodput_tok_s": 200.0}}
    assert best_stock(results) == ("verl sync", 100.0)


def test_repeats_alternate_the_order_and_report_the_median_run_with_the_spread():
    from verl_tide.testing.compare import over_repeats, run_order

    assert run_order(["a", "b", "c"], 0) == ["a", "b", "c"] and run_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    runs = [{"returncode": 0, "goodput_tok_s": g, "goodput_after_step1_tok_s": g * 2, "startup_s": 90.0, "id": i}
            for i, g in enumerate([300.0, 100.0, 200.0])]
    r = over_repeats(runs)
    # pooled: the mean of the rounds; the steps and curves of the round nearest it
    assert r["goodput_tok_s"] == 200.0 and r["goodput_after_step1_tok_s"] == 400.0 and r["id"] == 2
    assert r["goodput_runs"] == [300.0, 100.0, 200.0] and (r["goodput_min"], r["goodput_max"]) == (100.0, 300.0)
    two = over_repeats(runs[:2])
    assert two["goodput_tok_s"] == 200.0 and two["pooled"] == "mean of 2 round(s)"  # not the lower of two
    assert over_repeats([runs[0], {"returncode": 1, "error": "x"}])["returncode"] == 1  # a failure is not hidden


def test_only_picks_a_whole_name_alone_and_otherwise_every_name_containing_it():
    from verl_tide.testing.compare import chosen

    names = [s.name for s in systems(_job(2))]
    assert chosen(names, ["verl sync"]) == ["verl sync"]  # not colocate_async / separate_async
    assert chosen(names, ["tide"]) == ["tide"]
    assert chosen(names, ["separate_async"]) == ["verl separate_async 1T/1R",
                                                 "verl separate_async 1T/1R + hybrid switch"]
    assert chosen(names, None) == names and chosen(names, ["nothing"]) == []


def test_a_sitting_cut_short_reports_the_runs_it_kept(tmp_path):
    """`e2e_compare.py --report-partial`: each system with the rounds it finished, steps numbered again."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e_compare.py"
    spec = importlib.util.spec_from_file_location("e2e_compare", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def run(goodput: float) -> dict:
        return {"returncode": 0, "goodput_tok_s": goodput, "goodput_after_step1_tok_s": goodput, "startup_s": 1.0,
                "wall_s": 5.0, "tokens": 5 * goodput, "mechanisms": {},
                "steps": {"1": {"reward": 0.5, "wall_s": 2.0}, "2": {"reward": 0.7, "wall_s": 5.0}}}

    partial = tmp_path / "p.json"
    partial.write_text(json.dumps({"preset": "demo", "device_budgets": {"cores_per_gpu": 0.5},
                                   "runs": {"verl sync": [run(200.0)], "tide": [run(300.0)],
                                            "verl colocate_async": [], "verl fully_async 1T/1R + dynamic schedule":
                                            [{"returncode": -6, "error": "hung"}]}}))
    later = tmp_path / "q.json"  # a second sitting under the same budgets
    later.write_text(json.dumps({"preset": "demo", "device_budgets": {"cores_per_gpu": 0.5},
                                 "runs": {"tide": [run(340.0)]}}))
    out = tmp_path / "out.json"
    assert mod.main(["--report-partial", str(partial), "--report-partial", str(later), "--workdir", str(tmp_path / "w"),
                     "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["failed_runs"] == {"verl fully_async 1T/1R + dynamic schedule": [{"returncode": -6, "error": "hung"}]}
    assert "verl fully_async 1T/1R + dynamic schedule" not in report
    assert report["tide"]["goodput_runs"] == [300.0, 340.0] and report["tide"]["goodput_tok_s"] == 320.0
    assert report["verl sync"]["goodput_runs"] == [200.0] and "verl colocate_async" not in report
    assert report["best_stock"]["tide"] == {"system": "verl sync", "ratio": 1.6}
    assert report["device_budgets"] == {"cores_per_gpu": 0.5} and "cut_short" in report
    assert (tmp_path / "w" / "rewards_by_step.png").exists() and (tmp_path / "w" / "rewards_by_wall_s.png").exists()
    other = tmp_path / "r.json"
    other.write_text(json.dumps({"preset": "demo", "device_budgets": {"cores_per_gpu": 0.7}, "runs": {}}))
    with pytest.raises(SystemExit, match="different device budgets"):
        mod.main(["--report-partial", str(partial), "--report-partial", str(other), "--workdir", str(tmp_path / "w")])


def test_a_job_that_hangs_after_its_last_step_is_stopped_and_counted_not_failed(tmp_path):
    """verl's fully_async entry point can stay up after its last step (seen on the every-part job): the run stops
    it `exit_grace_s` after the last step's line and keeps the result; a job hanging before its last step still
    times out as a failure."""
    import time

    from verl_tide.testing.testbed import run_main_ppo

    (tmp_path / "hangs_after.py").write_text("import time\nprint('step:2 - x', flush=True)\ntime.sleep(600)\n")
    (tmp_path / "hangs_before.py").write_text("import time\nprint('step:1 - x', flush=True)\ntime.sleep(600)\n")
    (tmp_path / "exits.py").write_text("print('step:2 - x', flush=True)\n")
    env = {"PYTHONPATH": str(tmp_path)}
    last = lambda line: "step:2 - " in line  # noqa: E731
    t0 = time.monotonic()
    r = run_main_ppo([], tmp_path, timeout_s=60, extra_env=env, module="hangs_after", done=last, exit_grace_s=1)
    assert (r.returncode, r.stopped_after_done) == (0, True) and time.monotonic() - t0 < 30
    assert "stopped" in r.output
    r = run_main_ppo([], tmp_path, timeout_s=3, extra_env=env, module="hangs_before", done=last, exit_grace_s=1)
    assert (r.returncode, r.stopped_after_done) == (-9, False)
    r = run_main_ppo([], tmp_path, timeout_s=60, extra_env=env, module="exits", done=last, exit_grace_s=30)
    assert (r.returncode, r.stopped_after_done) == (0, False)
