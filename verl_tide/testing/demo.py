"""`make demo`: one small multi-turn GRPO job, run by stock verl and by `+tide=enabled`, on CPU.

Both runs use the same tiny local model, data, built-in environment (the `tiny_slow` guessing
game: up to 6 turns, heavy-tailed ~0.4 s environment latency per step), number of steps and
2 fake GPUs, with vLLM-CPU rollout:
- stock: `python -m verl.trainer.main_ppo` (trainer_mode sync; both fake GPUs train, then both roll out);
- tide: the same command with `+tide=enabled` (1 fake GPU trains, 1 rolls out, CTB routes every turn).
Goodput is computed the same way for both from verl's own step logs: tokens of the trajectories
that reached an update (`perf/total_num_tokens`) over the summed step wall-clock (`timing_s/step`).
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from verl_tide.testing.testbed import (
    GRPOJob,
    grpo_overrides,
    parse_step_metrics,
    run_main_ppo,
    spawn_env_service,
    tide_overrides,
    with_overrides,
)
from verl_tide.testing.tiny_model import build_tiny_model, write_env_task_parquet

REWARD = "critic/score/mean"
_STEP = re.compile(r"step:(\d+) - ")


def demo_job(work: Path, steps: int, batch: int, n: int, gpus: int = 2, env: str = "tiny_slow",
             seed: int = 0, task: dict | None = None) -> GRPOJob:
    """The demo's job: a tiny local model and `env` tasks (`task`: what /start passes to reset, default the
    guessing game's 1-16; episode seeds from `seed`) written under `work`."""
    model = build_tiny_model(work / "model")
    data = work / "data" if seed == 0 else work / f"data_seed{seed}"
    train = write_env_task_parquet(data / "train.parquet", batch * (steps + 3), env=env, seed=seed * 100_000,
                                   task=task)
    val = write_env_task_parquet(data / "val.parquet", 2, env=env, seed=10_000 + seed * 100_000, task=task)
    return GRPOJob(model_path=str(model), train_file=str(train), val_file=str(val), n_gpus=gpus, steps=steps,
                   train_batch_size=batch, rollout_n=n, prompt_length=128, response_length=96)


# every_part: the engines' KV cache in blocks (128 tokens each on vLLM-CPU): 512 tokens an engine, about two
# resident contexts of up to 240 tokens, where a step's 8 trajectories need about 1,800 in all
EVERY_PART_KV_BLOCKS = 4
VLLM_CPU_BLOCK_TOKENS = 128
EVERY_PART_TEST_FREQ = 3
PRESETS = ("demo", "every_part")


@dataclass(frozen=True)
class PresetJob:
    """A head-to-head job on the test bed, defined once for the benchmarks and the calibration probe: the job, what
    every system runs it with beside its own overrides, the environment's latency scale, tide's default split."""

    job: GRPOJob
    extra: tuple[str, ...]
    latency_scale: float
    tide_rollout_gpus: int
    kv_capacity_tokens: int | None  # each engine's KV cache where the job sets it (None: the engine's own)
    eval_every_steps: int  # verl's trainer.test_freq (0: never)


def preset_job(preset: str, work: Path, steps: int, batch: int | None = None, n: int = 2, gpus: int | None = None,
               seed: int = 0, latency_scale: float | None = None, tide_rollout_gpus: int | None = None) -> PresetJob:
    """`demo`: 2 fake GPUs, no Ref model, 4 prompts a step. `every_part`: every part of tide at once: a Ref model
    with verl's KL loss, 3 fake GPUs with 2 rollout ranks under tide, engines whose KV caches make resident contexts
    contend, the environment's latency doubled (tiny_slow's heavy tail), an evaluation every 3 steps, 6 prompts a
    step (12 samples split over every trainer GPU count 3 fake GPUs allow)."""
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r}: one of {', '.join(PRESETS)}")
    every_part = preset == "every_part"
    gpus = gpus or (3 if every_part else 2)
    job = demo_job(work, steps, batch or (6 if every_part else 4), n, gpus, seed=seed)
    extra: tuple[str, ...] = (f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}") if seed else ()
    if every_part:
        job = replace(job, use_kl_loss=True)
        extra += (f"+actor_rollout_ref.rollout.engine_kwargs.vllm.num_gpu_blocks_override={EVERY_PART_KV_BLOCKS}",
                  f"trainer.test_freq={EVERY_PART_TEST_FREQ}")
    return PresetJob(job, extra, latency_scale if latency_scale is not None else (2.0 if every_part else 1.0),
                     tide_rollout_gpus or (gpus - 1 if every_part else 1),
                     EVERY_PART_KV_BLOCKS * VLLM_CPU_BLOCK_TOKENS if every_part else None,
                     EVERY_PART_TEST_FREQ if every_part else 0)


def env_agent_overrides(env_url: str) -> list[str]:
    """verl-tide's environment agent loop against `env_url`, 8 tokens a turn."""
    return ["actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent", f"+tide.env.url={env_url}",
            "+tide.env.max_tokens_per_turn=8"]


def under_tide(overrides: list[str]) -> list[str]:
    """`+tide=enabled` brings the whole tide: subtree; the agent loop's tide.env.* are then plain overrides."""
    return [o.replace("+tide.env.", "tide.env.") for o in overrides]


def goodput(steps: dict[int, dict[str, float]]) -> dict[str, float]:
    """Consumed tokens per second of step wall-clock, from verl's per-step metrics: over all steps, and
    from step 2 on (step 1 carries one-off costs: lazy engine start-up, the first pipeline fill)."""
    def rate(ns: list[int]) -> tuple[float, float]:
        return (sum(steps[n].get("perf/total_num_tokens", 0.0) for n in ns),
                sum(steps[n].get("timing_s/step", 0.0) for n in ns))

    tokens, seconds = rate(sorted(steps))
    later_tokens, later_seconds = rate([n for n in steps if n > 1])
    return {"tokens": tokens, "seconds": seconds, "goodput_tok_s": tokens / seconds if seconds else 0.0,
            "goodput_after_step1_tok_s": later_tokens / later_seconds if later_seconds else 0.0}


def plot_rewards(curves: dict[str, list[tuple[float, float]]], path: Path, title: str, xlabel: str = "step") -> None:
    """Reward curves, one line per system (matplotlib, headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, curve in curves.items():
        xs, ys = zip(*sorted(curve)) if curve else ((), ())
        ax.plot(xs, ys, marker="o", label=name)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=4, help="prompts per step (data.train_batch_size)")
    ap.add_argument("--n", type=int, default=2, help="trajectories per prompt (GRPO group size)")
    ap.add_argument("--latency-scale", type=float, default=1.0, help="multiply environment latency (0 = none)")
    ap.add_argument("--only", choices=["stock", "tide"], default=None, help="run one side only")
    ap.add_argument("--workdir", default=None, help="keep model, data, logs and results here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write both runs' per-step metrics and goodputs here")
    ap.add_argument("--plot", default=None, help="reward curves PNG (default: WORKDIR/rewards.png)")
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_demo_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building a tiny model and environment tasks in {work}", flush=True)
    job = demo_job(work, args.steps, args.batch, args.n)
    env_proc, env_url = spawn_env_service("--session-timeout", "600", latency_scale=args.latency_scale)
    print(f"[demo] environment service {env_url} (tiny_slow, latency x{args.latency_scale})", flush=True)
    agent = env_agent_overrides(env_url)
    runs = {"stock": with_overrides(grpo_overrides(job), agent),
            "tide": under_tide(with_overrides(grpo_overrides(job), [*agent, *tide_overrides(job, lend_actor=None)]))}
    results: dict[str, dict] = {}
    try:
        for name, overrides in runs.items():
            if args.only and name != args.only:
                continue
            cmd = "python -m verl.trainer.main_ppo" + (" +tide=enabled" if name == "tide" else "")
            print(f"[demo] {name}: {cmd} ({args.steps} steps); log {work / (name + '.log')}", flush=True)

            def progress(line: str, name: str = name) -> None:
                if _STEP.search(line):
                    m = parse_step_metrics(line)
                    for n, metrics in m.items():
                        print(f"[demo] {name}: step {n}/{args.steps} reward {metrics.get(REWARD, float('nan')):.3f} "
                              f"step {metrics.get('timing_s/step', float('nan')):.1f}s", flush=True)
                elif "verl-tide step" in line:
                    text = re.sub(r"\x1b\[[0-9;]*m", "", line).split(")", 1)[-1].strip()
                    print(f"[demo]   {text[:220]}", flush=True)

            run = run_main_ppo(overrides, cwd=work, log_path=work / f"{name}.log", timeout_s=args.timeout,
                               on_line=progress)
            steps = parse_step_metrics(run.output)
            results[name] = {"returncode": run.returncode, "seconds": run.seconds, "steps": steps, **goodput(steps)}
            if run.returncode != 0 or len(steps) != args.steps:
                print(run.output[-4000:], file=sys.stderr)
                print(f"[demo] {name} FAILED (exit {run.returncode}, {len(steps)}/{args.steps} steps)", file=sys.stderr)
                return 1
    finally:
        env_proc.send_signal(signal.SIGTERM)
        env_proc.communicate(timeout=30)

    print()
    print(f"{'run':>6} | {'steps':>5} | {'tokens':>7} | {'step s':>7} | {'goodput tok/s':>13} | "
          f"{'(steps 2+)':>10} | rewards per step")
    for name, r in results.items():
        rewards = " ".join(f"{r['steps'][n].get(REWARD, float('nan')):.3f}" for n in sorted(r["steps"]))
        print(f"{name:>6} | {len(r['steps']):>5} | {r['tokens']:>7.0f} | {r['seconds']:>7.1f} | "
              f"{r['goodput_tok_s']:>13.1f} | {r['goodput_after_step1_tok_s']:>10.1f} | {rewards}")
    if "stock" in results and "tide" in results and results["stock"]["goodput_tok_s"] > 0:
        ratio = results["tide"]["goodput_tok_s"] / results["stock"]["goodput_tok_s"]
        later = results["tide"]["goodput_after_step1_tok_s"] / max(results["stock"]["goodput_after_step1_tok_s"], 1e-9)
        results["goodput_ratio_tide_over_stock"] = ratio
        results["goodput_ratio_after_step1"] = later
        print(f"goodput tide/stock: {ratio:.2f}x")
        print(f"goodput tide/stock from step 2 on: {later:.2f}x")
    plot = Path(args.plot) if args.plot else work / "rewards.png"
    curves = {name: [(n, m.get(REWARD, 0.0)) for n, m in r["steps"].items()]
              for name, r in results.items() if isinstance(r, dict)}
    plot_rewards(curves, plot, f"reward ({REWARD}) per step: stock verl vs +tide=enabled")
    print(f"[demo] reward curves: {plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
