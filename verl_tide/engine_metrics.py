"""Reading the rollout engines' own `/metrics` (vLLM or SGLang) into one shape.

vLLM and SGLang name their prefix-cache and capacity metrics differently; `EngineMetrics` reads either
(hit rate from counter deltas, KV capacity in tokens), so CTB sizes its budgets from the engine's real
capacity and reports the hit rate it achieves. Exporting tide's own metrics is `verl_tide.metrics`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# Per backend: (prefix-cache queried-token counter, hit-token counter, preemption counter).
PREFIX_COUNTERS = {
    "vllm": ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"),
    "sglang": ("sglang:prompt_tokens", "sglang:cached_tokens", None),
}
BACKENDS = tuple(PREFIX_COUNTERS)


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of an engine's `/metrics`, reduced to what CTB needs."""

    backend: str
    prefix_queried_tokens: float
    prefix_hit_tokens: float
    preemptions: Optional[float]
    kv_capacity_tokens: Optional[int]
    kv_usage: Optional[float]  # fraction of the KV cache in use, 0..1

    @classmethod
    def parse(cls, text: str, backend: str) -> EngineMetrics:
        if backend not in PREFIX_COUNTERS:
            raise ValueError(f"backend = {backend!r}: must be one of {' | '.join(BACKENDS)}")
        samples: dict[str, float] = {}
        labels: dict[str, dict[str, str]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[s.name] = samples.get(s.name, 0.0) + s.value  # summed over label sets (ranks)
                labels.setdefault(s.name, dict(s.labels))
        queried, hits, preempt = PREFIX_COUNTERS[backend]

        def counter(name: Optional[str]) -> Optional[float]:
            if name is None:
                return None
            return samples.get(name + "_total", samples.get(name))

        if backend == "vllm":
            info = labels.get("vllm:cache_config_info", {})
            blocks, block = info.get("num_gpu_blocks"), info.get("block_size")
            capacity = int(blocks) * int(block) if blocks and block and blocks != "None" else None
            usage = samples.get("vllm:kv_cache_usage_perc")
        else:
            cap = samples.get("sglang:max_total_num_tokens")
            capacity = int(cap) if cap else None
            usage = samples.get("sglang:token_usage")
        if counter(queried) is None or counter(hits) is None:
            raise ValueError(f"{backend} /metrics: no {queried} / {hits} counters (is the engine's metrics "
                             "endpoint enabled, e.g. SGLang --enable-metrics?)")
        return cls(backend, counter(queried) or 0.0, counter(hits) or 0.0, counter(preempt), capacity, usage)

    @classmethod
    def scrape(cls, base_url: str, backend: str, timeout_s: float = 10.0) -> EngineMetrics:
        """GET `{base_url}/metrics` and parse it (raises OSError / ValueError when it cannot)."""
        import urllib.request

        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return cls.parse(r.read().decode(), backend)


def prefix_hit_rate(before: EngineMetrics, after: EngineMetrics) -> float:
    """Fraction of prompt tokens served from the prefix cache between two scrapes."""
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    return (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried if queried > 0 else 0.0


def engine_kv_capacity(server_address: str, backend: str, timeout_s: float = 10.0) -> Optional[int]:
    """KV capacity in tokens from an engine's `/metrics`; None if it cannot be read."""
    try:
        return EngineMetrics.scrape(f"http://{server_address}", backend, timeout_s).kv_capacity_tokens
    except (OSError, ValueError) as e:
        logger.warning("CTB: could not read the KV capacity of %s: %s", server_address, e)
        return None
