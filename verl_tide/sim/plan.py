"""`verl-tide plan`: before a job spends GPU hours, the simulator's prediction for it: verl `sync`, stock
asynchronous verl at each split, `+tide=enabled`, the advised split and the overrides to start with.

The job is read from the overrides a user passes to `main_ppo` (GPUs, batch, group size, response length, turns,
staleness bound, the model from its Hugging Face `config.json`) on top of a workload description in the bench's
schema (turns, tokens per turn, environment latency; `verl_tide/sim/workload.py`). The same `Simulation` and stock
rules as `verl-tide bench` run it (one code path); keys that would change the answer and that the model cannot
represent are refused, naming the key.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from verl_tide.sim.bench import RATIOS, STOCK_SYSTEMS, VERL_SYNC
from verl_tide.sim.cluster import Result, Simulation, SystemSpec
from verl_tide.sim.hardware import Costs, Hardware, load_profile, profile_names
from verl_tide.sim.workload import ModelSpec, Workload, load_workload

# Published figures (NVIDIA H100 / H200 SXM data sheets: dense BF16 989 TFLOPS; HBM3 80 GB at 3.35 TB/s, HBM3e
# 141 GB at 4.8 TB/s); the achieved fractions are the simulator's (docs/simulator-calibration.md).
HARDWARE: dict[str, Hardware] = {
    "h100": Hardware(),
    "h200": replace(Hardware(), name="H200-141GB-SXM", mem_gb=141.0, hbm_tb_s=4.8),
}
PLAN_SYSTEMS = ("verl_separate_async_switch", "verl_fully_async_dynamic")  # the strongest stock rules of the bench
MODELED = {  # keys that change the answer: the values the model represents, and why only those
    "actor_rollout_ref.rollout.tensor_model_parallel_size": (("1",), "rollout ranks are modeled one GPU each (TP=1)"),
    "actor_rollout_ref.rollout.data_parallel_size": (("1",), "rollout ranks are modeled one GPU each (DP=1)"),
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": (("1",), "the trainer is modeled as FSDP "
                                                                           "data parallel"),
    "algorithm.adv_estimator": (("grpo",), "only GRPO is modeled"),
}


class PlanError(ValueError):
    """What `plan` cannot model, naming the key and what it accepts."""


def hardware_named(name: str) -> Hardware:
    """A published profile (`HARDWARE`), a measured one shipped in `sim/profiles/` (the test bed's), or a
    profile YAML of the same schema."""
    if name in HARDWARE:
        return HARDWARE[name]
    try:
        return load_profile(name)
    except (ValueError, OSError) as e:
        raise PlanError(f"--hardware {name!r}: one of {' | '.join([*HARDWARE, *profile_names()])} or a measured "
                        f"profile's YAML ({e})") from None


def parse_overrides(overrides: list[str]) -> dict[str, str]:
    out = {}
    for o in overrides:
        key, sep, value = o.lstrip("+~").partition("=")
        if not sep:
            raise PlanError(f"{o!r}: an override is key=value (as main_ppo takes it)")
        out[key] = value
    return out


def model_from_hf_config(path: str) -> ModelSpec:
    """Parameters and KV bytes per token (bf16) from a Hugging Face `config.json` (a directory or the file)."""
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise PlanError(f"actor_rollout_ref.model.path = {path}: no config.json there; give a local model directory "
                        "or --model-params-b and --kv-bytes-per-token")
    c = json.loads(cfg_path.read_text())
    c = c.get("text_config", c)  # multimodal configs nest the language model's
    try:
        layers, hidden = int(c["num_hidden_layers"]), int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads", heads))
        head_dim = int(c.get("head_dim") or hidden // heads)
        inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    except KeyError as e:
        raise PlanError(f"{cfg_path}: no {e.args[0]}; give --model-params-b and --kv-bytes-per-token") from e
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    params = layers * (attn + 3 * hidden * inter) + vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return ModelSpec(params_b=params / 1e9, kv_bytes_per_token=2 * layers * kv_heads * head_dim * 2)


def job_workload(base: Workload, o: dict[str, str], gpus: int, model: Optional[ModelSpec],
                 steps: Optional[int]) -> Workload:
    """The workload description with what the job's overrides say of it."""
    for key, (allowed, why) in MODELED.items():
        if key in o and o[key] not in allowed:
            raise PlanError(f"{key} = {o[key]}: not modeled ({why}; allowed: {' | '.join(allowed)})")
    w = base
    changes: dict[str, Any] = {}
    if "data.train_batch_size" in o:
        changes.update(groups_per_step=_int(o, "data.train_batch_size"), reference_gpus=gpus)
    if "actor_rollout_ref.rollout.n" in o:
        changes["group_size"] = _int(o, "actor_rollout_ref.rollout.n")
    if "tide.max_staleness" in o:
        changes["max_staleness"] = _int(o, "tide.max_staleness", low=0)
    if "actor_rollout_ref.rollout.multi_turn.max_assistant_turns" in o:
        turns = _int(o, "actor_rollout_ref.rollout.multi_turn.max_assistant_turns")
        changes["turns"] = replace(w.turns, max=min(w.turns.max, turns))
    if "data.max_response_length" in o:
        cap = _int(o, "data.max_response_length")
        changes["action_tokens"] = replace(w.action_tokens, max=min(w.action_tokens.max, cap))
    if model is not None:
        changes["model"] = model
    if steps is not None:
        changes["steps"] = steps
    return replace(w, **changes) if changes else w


def _int(o: dict[str, str], key: str, low: int = 1) -> int:
    try:
        v = int(o[key])
    except ValueError:
        raise PlanError(f"{key} = {o[key]!r}: must be an integer >= {low}") from None
    if v < low:
        raise PlanError(f"{key} = {v}: must be an integer >= {low}")
    return v


def gpus_of(o: dict[str, str], default: Optional[int]) -> int:
    """All the job's GPUs: the trainer's nodes x GPUs plus the standalone rollout's."""
    if "trainer.n_gpus_per_node" in o:
        gpus = int(o.get("trainer.nnodes", "1")) * _int(o, "trainer.n_gpus_per_node")
        gpus += int(o.get("actor_rollout_ref.rollout.nnodes", "0")) * int(
            o.get("actor_rollout_ref.rollout.n_gpus_per_node", "0"))
        return gpus
    if default is None:
        raise PlanError("trainer.n_gpus_per_node: not given; pass the job's GPU layout or --gpus N")
    return default


def plan(w: Workload, gpus: int, hw: Hardware, parameter_sync_step: int = 4) -> dict:
    """Every system the plan compares, each stock one at every split; tide from the best stock split."""
    if gpus < 4:
        raise PlanError(f"GPUs = {gpus}: the plan needs at least 4 (rollout, Actor and Ref ranks)")
    try:
        Costs.of(w.model, hw)
    except ValueError as e:
        raise PlanError(f"actor_rollout_ref.model.path: {e} ({hw.name})") from e
    t0 = time.monotonic()
    runs: dict[str, Result] = {"verl_sync": Simulation(w, gpus, SystemSpec("verl_sync", **VERL_SYNC), hw).run()}
    stock: dict[str, dict[float, Result]] = {}
    for name in PLAN_SYSTEMS:
        rules = {**STOCK_SYSTEMS[name], "parameter_sync_step": parameter_sync_step}
        stock[name] = {r: Simulation(w, gpus, SystemSpec(f"{name}_r{r:.3g}", rollout_ratio=r, **rules), hw).run()
                       for r in RATIOS}
    best_name, best_ratio = max(((n, r) for n in stock for r in stock[n]),
                                key=lambda nr: stock[nr[0]][nr[1]].goodput_tok_s)
    tide_spec = SystemSpec("tide", rollout_ratio=best_ratio, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                           elastic=True)
    tide = Simulation(w, gpus, tide_spec, hw).run()
    best = stock[best_name][best_ratio]
    rollout_gpus = min(gpus - 1, max(1, round(gpus * best_ratio)))
    advice = tide.split_advice
    return {
        "workload": w.name, "gpus": gpus, "hardware": hw.name, "steps": w.steps,
        "model_params_b": round(w.model.params_b, 3), "batch_groups": w.groups_for(gpus), "group_size": w.group_size,
        "predicted_tok_s": {"verl_sync": round(runs["verl_sync"].goodput_tok_s, 1),
                            **{f"{n}_r{r:.3g}": round(res.goodput_tok_s, 1) for n in stock
                               for r, res in stock[n].items()},
                            "tide": round(tide.goodput_tok_s, 1)},
        "best_stock": {"system": best_name, "rollout_ratio": best_ratio, "goodput_tok_s": round(best.goodput_tok_s, 1)},
        "tide": {"rollout_ratio": best_ratio, "goodput_tok_s": round(tide.goodput_tok_s, 1),
                 "vs_best_stock": round(tide.goodput_tok_s / best.goodput_tok_s, 4),
                 "vs_sync": round(tide.goodput_tok_s / runs["verl_sync"].goodput_tok_s, 4)},
        "advised_rollout_ratio": best_ratio if advice is None else round(advice.rollout_ratio, 4),
        "start_overrides": ["+tide=enabled", f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_gpus}",
                            "actor_rollout_ref.rollout.nnodes=1", f"trainer.n_gpus_per_node={gpus - rollout_gpus}",
                            "trainer.nnodes=1", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl"],
        "wall_s": round(time.monotonic() - t0, 1),
    }


def format_plan(p: dict) -> str:
    pred = p["predicted_tok_s"]
    lines = [f"plan: {p['workload']}, {p['gpus']} x {p['hardware']}, model {p['model_params_b']:.2f}B, "
             f"{p['batch_groups']} groups x {p['group_size']} a step, {p['steps']} steps (simulated)",
             f"{'system':<30}" + "".join(f"{r:>9.3g}" for r in RATIOS) + "   (rollout share of the GPUs)"]
    for name in PLAN_SYSTEMS:
        lines.append(f"{name:<30}" + "".join(f"{pred[f'{name}_r{r:.3g}']:>9.0f}" for r in RATIOS))
    lines.append(f"{'verl_sync':<30}{pred['verl_sync']:>9.0f}")
    b, t = p["best_stock"], p["tide"]
    lines.append(f"best stock: {b['system']} at {b['rollout_ratio']:.3g}, {b['goodput_tok_s']:.0f} tok/s")
    lines.append(f"+tide=enabled at {t['rollout_ratio']:.3g}: {t['goodput_tok_s']:.0f} tok/s, "
                 f"{t['vs_best_stock']:.2f}x the best stock, {t['vs_sync']:.2f}x sync")
    lines.append(f"advised split (rollout share): {p['advised_rollout_ratio']:.3g}; start with:")
    lines.append("  " + " ".join(p["start_overrides"]))
    return "\n".join(lines)


def plot_plan(p: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in PLAN_SYSTEMS:
        ax.plot(RATIOS, [p["predicted_tok_s"][f"{name}_r{r:.3g}"] for r in RATIOS], marker="o", label=name)
    ax.axhline(p["predicted_tok_s"]["verl_sync"], color="grey", linestyle=":", label="verl_sync")
    ax.scatter([p["tide"]["rollout_ratio"]], [p["tide"]["goodput_tok_s"]], color="red", zorder=5,
               label="+tide=enabled")
    ax.set_xlabel("rollout share of the GPUs")
    ax.set_ylabel("predicted goodput, tok/s")
    ax.set_title(f"verl-tide plan: {p['workload']}, {p['gpus']} x {p['hardware']} (simulated)", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_probed_environment(w: Workload, url: str, env: Optional[str], episodes: int,
                            tokenizer_path: Optional[str]) -> Workload:
    """`w` with its environment's part (turns, observation tokens, latencies) measured through the environment
    service at `url` (`sim/env_probe.py`); the policy's part (prompt, tokens a turn) stays the workload's."""
    import asyncio

    from verl_tide.sim.env_probe import probe_environment
    from verl_tide.sim.workload import Dist

    try:
        s = asyncio.run(probe_environment(url, episodes=episodes, env=env, tokenizer_path=tokenizer_path))
    except Exception as e:  # the service is the user's: say which URL failed and how
        raise PlanError(f"--env-url {url}: the environment probe failed ({type(e).__name__}: {e})") from None
    return replace(w, **{key: Dist(**d) for key, d in s.environment().items()})


def main(overrides: list[str], workload: str, hardware: str, gpus: Optional[int], steps: Optional[int],
         params_b: Optional[float], kv_bytes: Optional[int], json_path: Optional[str], plot_path: Optional[str],
         env_url: Optional[str] = None, env_name: Optional[str] = None, probe_episodes: int = 16) -> int:
    hw = hardware_named(hardware)
    o = parse_overrides(overrides)
    if (params_b is None) != (kv_bytes is None):
        raise PlanError("--model-params-b and --kv-bytes-per-token go together")
    model = ModelSpec(params_b, kv_bytes) if params_b is not None else (
        model_from_hf_config(o["actor_rollout_ref.model.path"]) if "actor_rollout_ref.model.path" in o else None)
    n = gpus_of(o, gpus)
    w = job_workload(load_workload(workload), o, n, model, steps)
    if env_url:
        path = o.get("actor_rollout_ref.model.path")
        tok = path if path and (Path(path) / "tokenizer_config.json").is_file() else None
        w = with_probed_environment(w, env_url, env_name, probe_episodes, tok)
    psync = int(o.get("trainer.v1.separate_async.parameter_sync_step", "4"))
    p = plan(w, n, hw, psync)
    p["environment"] = {"from": f"probe of {env_url} ({probe_episodes} episodes)" if env_url else f"workload {w.name}",
                        "turns_mean": round(w.turns.mean, 3), "observation_tokens_mean": round(w.observation_tokens.mean, 1),
                        "env_latency_s_mean": round(w.env_latency_s.mean, 4)}
    print(format_plan(p))
    e = p["environment"]
    print(f"environment ({e['from']}): {e['turns_mean']:g} turns, {e['observation_tokens_mean']:g} tokens an observation, "
          f"{e['env_latency_s_mean']:g} s a step")
    if json_path:
        Path(json_path).write_text(json.dumps(p, indent=1))
    if plot_path:
        plot_plan(p, plot_path)
    return 0

