"""Where the cores went between a run's first /start and its last update, by process kind.

    python benchmarks/probes/cpu_report.py SAMPLES.json WALL_S

SAMPLES.json from `cpu_sampler.py` running beside `e2e_compare.py` (see `run_cpu_every_part.sh`); WALL_S the run's
`wall_s` from the compare JSON. Ray actors are named by their class (`ray::Class.method` process titles)."""
import json, re, sys
from collections import defaultdict
d = json.load(open(sys.argv[1])); wall = float(sys.argv[2])
series, names = d["series"], d["names"]
start = d["first_start"]; end = start + wall
def at(t):
    return min(series, key=lambda s: abs(s[0] - t))[1]
a, b = at(start), at(end)
def group(pid):
    cmd = names.get(pid, "")
    if cmd.startswith("ray::"):
        return re.sub(r"[.:].*$", "", cmd[5:].split()[0])
    if "EngineCore" in cmd: return "vllm EngineCore"
    if "env serve" in cmd or "verl-tide env" in cmd or "verl_tide.cli" in cmd: return "env service"
    if "main_ppo" in cmd: return "main_ppo driver"
    if "raylet" in cmd: return "raylet"
    if "gcs_server" in cmd: return "gcs_server"
    if "e2e_compare" in cmd or "e2e_ab" in cmd: return "benchmark"
    return cmd[:30]
tot = defaultdict(float)
for pid, cb in b.items():
    ca = a.get(pid, 0.0)
    if cb - ca > 0.05:
        tot[group(pid)] += cb - ca
s = sum(tot.values())
print(f"window {wall:.1f} s, CPU {s:.1f} s ({s/wall:.2f} cores)")
for k, v in sorted(tot.items(), key=lambda kv: -kv[1]):
    print(f"  {k:40s} {v:7.1f} s  {v/s:5.1%}")
