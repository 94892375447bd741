"""Probe (2026-12-04): tide and the best stock mode on the every-part job with verl's
`trainer.v1.separate_async.num_warmup_batches` 1 (default) and 2: does more work in flight at the start shorten
step 1? Usage: python benchmarks/probes/warmup_batches.py [tide "tide wu2" "stock wu2" stock]"""
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from verl_tide.testing.compare import systems, run_system, System
from verl_tide.testing.demo import preset_job
work = Path(tempfile.mkdtemp(prefix="warmup_batches_")); work.mkdir(parents=True, exist_ok=True)
pj = preset_job("every_part", work, 6)
job, extra = pj.job, pj.extra
av = {s.name: s for s in systems(job, 1, tide_rollout_gpus=2)}
wu2 = "trainer.v1.separate_async.num_warmup_batches=2"
plan = [("tide", av["tide"]), ("tide wu2", System("tide wu2", (*av["tide"].overrides, wu2), av["tide"].rollout_gpus)),
        ("stock wu2", System("stock wu2", (*av["verl separate_async 2T/1R + hybrid switch"].overrides, wu2), 1)),
        ("stock", av["verl separate_async 2T/1R + hybrid switch"])]
order = sys.argv[1:] or [n for n, _ in plan]
res = {}
for name in order:
    s = dict(plan)[name]
    r = run_system(s, job, work / name.replace(" ", "_"), 2.0, 1500, extra)
    res[name] = r
    print(name, r.get("goodput_tok_s"), r.get("goodput_after_step1_tok_s"), r.get("wall_s"), flush=True)
    if r["returncode"] == 0:
        for n, st in r["steps"].items():
            print("   ", n, round(st["wall_s"], 1), st.get("stale_dropped_groups"), flush=True)
    json.dump(res, open(work / "warmup_batches.json", "w"), default=str, indent=1)
