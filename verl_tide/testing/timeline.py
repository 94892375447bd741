"""Where a run's wall-clock goes: the trainer's phases and each rollout engine's load, for every system alike.

Issue 24 asks, where tide misses its target, for a per-phase timeline of the trainer and of each rollout rank.
The head-to-head runs stock verl too, so nothing here relies on tide's own instrumentation:

- Trainer: verl's `timing_s/*` of each step (every trainer reports them), laid out in verl's order inside the
  step's `timing_s/step`, which ends just before its evaluation (`timing_s/testing`) and the step's metrics line
  (whose arrival the head-to-head timestamps). A step's mini-batches are merged: one block per phase.
  What the timers do not cover is shown as such ("other in step", "between steps").
- Rollout: each engine's own Prometheus `/metrics` (vLLM: requests running and waiting, KV-cache use, tokens
  generated), polled from outside the job; the engines are found on verl's `LLMServerManager: [...]` line.

The poll costs each engine an HTTP request per interval (1 s; vLLM renders every metric for it, and stock
systems get vLLM's stats turned on, which `+tide=enabled` does anyway: on the test bed tide's demo runs made
558-620 tok/s with a 0.5 s poll against 767-771 in the headline's runs of the same day), so the head-to-head runs it only when asked
(`--timeline`), in runs of their own, never in the headline's.
"""

from __future__ import annotations

import ast
import re
import threading
import time
import urllib.request
from typing import Optional

from verl_tide.engine_metrics import PREFIX_COUNTERS

# verl 0.9.1's fit loop, in order: inside `timing_s/step`, then evaluation after it.
STEP_PHASES = ("switch_to_trainer", "switch_wait", "gen", "reward", "old_log_prob", "ref", "values", "adv",
               "update_critic", "update_actor", "save_checkpoint",
               "tide_eval_collect", "tide_boundary",  # trainer tide's step end, before the sync
               "switch_to_rollout", "update_weights")
ROLLOUT_WAIT_PHASES = ("switch_wait", "gen")  # the trainer waiting for (or, in sync, running) the rollout
_SERVERS = re.compile(r"LLMServerManager: (\[[^\]]*\])")
_VLLM = {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
         "kv_usage": "vllm:kv_cache_usage_perc", "generated": "vllm:generation_tokens_total",
         # the prefix-cache counters CTB reads (`engine_metrics.py`), as the parser names counter samples
         "prefix_queried": PREFIX_COUNTERS["vllm"][0] + "_total", "prefix_hits": PREFIX_COUNTERS["vllm"][1] + "_total"}


def engine_addresses(line: str) -> list[str]:
    """The engine addresses on verl's `LLMServerManager: ['host:port', ...]` line (none on any other line)."""
    m = _SERVERS.search(line)
    if not m:
        return []
    try:
        return [str(a) for a in ast.literal_eval(m.group(1))]
    except (ValueError, SyntaxError):
        return []


def parse_vllm_sample(text: str) -> dict[str, float]:
    """One `/metrics` scrape reduced to the timeline's numbers (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {metric: key for key, metric in _VLLM.items()}
    out = {k: 0.0 for k in _VLLM}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                out[key] += float(sample.value)
    return out


class EnginePoller:
    """Polls every engine it has been told of; `samples[address]` = [(unix time, numbers), ...]."""

    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, dict[str, float]]]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def watch_line(self, line: str) -> None:
        """Feed every output line of the job: engines are added as verl announces them."""
        for address in engine_addresses(line):
            self.samples.setdefault(address, [])
        if self.samples and self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="engine-poller")
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for address in list(self.samples):
                try:
                    with urllib.request.urlopen(f"http://{address}/metrics", timeout=2) as r:
                        text = r.read().decode()
                except OSError:
                    continue  # not up yet, or gone (a restarted rank comes back on a new line)
                self.samples[address].append((time.time(), parse_vllm_sample(text)))
            self._stop.wait(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def trainer_phases(steps: dict[int, dict[str, float]], arrivals: dict[int, float],
                   zero: float) -> list[dict]:
    """Per step: the phases as (name, start s, end s) on the clock that starts at `zero` (the first /start).
    Backward from the metrics line: evaluation, then `timing_s/step` holding the phases in verl's order."""
    out = []
    previous_end = 0.0
    for n in sorted(n for n in steps if n in arrivals):
        m = steps[n]
        end = arrivals[n] - zero
        testing = float(m.get("timing_s/testing", 0.0) or 0.0)
        step_s = float(m.get("timing_s/step", 0.0) or 0.0)
        step_end = end - testing
        step_start = step_end - step_s
        blocks, t = [], step_start
        if step_start > previous_end:
            blocks.append(("between steps", previous_end, step_start))
        for phase in STEP_PHASES:
            d = float(m.get(f"timing_s/{phase}", 0.0) or 0.0)
            if d > 0:
                blocks.append((phase, t, t + d))
                t += d
        if step_end - t > 1e-3:
            blocks.append(("other in step", t, step_end))
        if testing > 0:
            blocks.append(("testing", step_end, end))
        out.append({"step": n, "start_s": step_start, "end_s": end, "blocks": blocks})
        previous_end = end
    return out


def phase_totals(phases: list[dict]) -> dict[str, float]:
    """Seconds per phase over the run (the clock's whole span is their sum)."""
    totals: dict[str, float] = {}
    for step in phases:
        for name, start, end in step["blocks"]:
            totals[name] = totals.get(name, 0.0) + max(0.0, end - start)
    return totals


def engine_load(samples: dict[str, list[tuple[float, dict[str, float]]]], zero: float,
                end: float) -> dict[str, dict]:
    """Per engine over [zero, zero + end]: the share of polls with a request running, mean requests running and
    waiting, mean KV use, tokens generated per second, the prefix-cache hit rate (prompt tokens served from the
    cache / prompt tokens queried; None when none was queried), and the series for the plot."""
    out = {}
    for address, series in samples.items():
        window = [(t - zero, s) for t, s in series if 0.0 <= t - zero <= end]
        if len(window) < 2:
            continue
        n = len(window)
        generated = window[-1][1]["generated"] - window[0][1]["generated"]
        span = window[-1][0] - window[0][0]
        queried = window[-1][1]["prefix_queried"] - window[0][1]["prefix_queried"]
        out[address] = {
            "busy_share": sum(1 for _, s in window if s["running"] > 0) / n,
            "mean_running": sum(s["running"] for _, s in window) / n,
            "mean_waiting": sum(s["waiting"] for _, s in window) / n,
            "mean_kv_usage": sum(s["kv_usage"] for _, s in window) / n,
            "tokens_per_s": generated / span if span > 0 else 0.0,
            "prefix_queried_tokens": queried,
            "prefix_cache_hit_rate": (window[-1][1]["prefix_hits"] - window[0][1]["prefix_hits"]) / queried
            if queried > 0 else None,
            "series": [(round(t, 3), s["running"], s["waiting"], round(s["kv_usage"], 4)) for t, s in window],
        }
    return out


def pooled_engine_hit_rate(load: dict[str, dict]) -> float | None:
    """`engine_load`'s engines' prefix-cache hit rate, prompt tokens pooled (the same number for every system:
    stock verl reports none of its own)."""
    queried = sum(e["prefix_queried_tokens"] for e in load.values())
    hits = sum(e["prefix_cache_hit_rate"] * e["prefix_queried_tokens"] for e in load.values()
               if e["prefix_cache_hit_rate"] is not None)
    return hits / queried if queried > 0 else None


PHASE_COLOURS = {"gen": "tab:red", "switch_wait": "tab:orange", "old_log_prob": "tab:blue", "ref": "tab:olive",
                 "adv": "tab:brown", "update_actor": "tab:purple", "update_weights": "tab:green",
                 "testing": "tab:cyan", "other in step": "lightgrey", "between steps": "whitesmoke",
                 "switch_to_trainer": "gold", "switch_to_rollout": "khaki", "reward": "yellow",
                 "tide_eval_collect": "teal", "tide_boundary": "black"}


def plot(results: dict[str, dict], path: str) -> None:
    """One panel per system: the trainer's phases on the top row, each engine's running requests below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = {name: r["timeline"] for name, r in results.items() if r.get("timeline")}
    if not timed:
        return
    span = max(max((s["end_s"] for s in t["trainer"]), default=0.0) for t in timed.values())
    fig, axes = plt.subplots(len(timed), 1, figsize=(13, 1.2 + 1.3 * len(timed)), sharex=True, squeeze=False)
    seen: set[str] = set()
    for ax, (name, t) in zip(axes[:, 0], timed.items()):
        engines = list(t["engines"].items())
        rows = len(engines) + 1
        for step in t["trainer"]:
            for phase, start, end in step["blocks"]:
                ax.broken_barh([(start, end - start)], (rows - 1 + 0.1, 0.8), color=PHASE_COLOURS.get(phase, "grey"),
                               label=None if phase in seen else phase)
                seen.add(phase)
        peak = max((max((r for _, r, _, _ in e["series"]), default=1.0) for _, e in engines), default=1.0) or 1.0
        for i, (address, e) in enumerate(engines):
            base = rows - 2 - i
            xs = [p[0] for p in e["series"]]
            ax.fill_between(xs, base, [base + 0.9 * p[1] / peak for p in e["series"]], step="post", color="tab:red",
                            alpha=0.5)
        ax.set_yticks([rows - 0.5] + [rows - 1.5 - i for i in range(len(engines))])
        ax.set_yticklabels(["trainer"] + [f"engine {i} ({e['busy_share']:.0%} busy)"
                                          for i, (_, e) in enumerate(engines)], fontsize=7)
        ax.set_ylim(0, rows)
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_xlim(0, span)
    axes[-1, 0].set_xlabel("wall-clock s from the first /start (engine rows: requests running, scaled to the "
                           "busiest engine)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for ax in axes[1:, 0]:
        h, l = ax.get_legend_handles_labels()
        handles += h
        labels += l
    fig.legend(handles, labels, loc="upper center", ncol=7, fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=100)
    plt.close(fig)
