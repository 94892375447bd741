"""The CTB router's own Prometheus `/metrics`, for CTB used as a router plugin in stock verl (trainer `tide`
exports the same numbers from the trainer): per-rank tokens and budgets, task states, decisions, outcomes, and
each engine's prefix-cache hit rate since start-up, refreshed every `interval_s`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from verl_tide.engine_metrics import EngineMetrics


class RouterMetrics:
    def __init__(self, host: str, port: int, interval_s: float, scheduler: Callable[[], Any],
                 servers: Callable[[], list[str]], backend: str):
        from verl_tide.metrics import TideMetrics

        self.exporter, server = TideMetrics.start(host, port, who="CTB router")
        self.url = f"http://{host}:{server.server_address[1]}/metrics"
        self.interval_s, self.scheduler, self.servers, self.backend = interval_s, scheduler, servers, backend
        self._first: dict[str, EngineMetrics] = {}  # each engine's counters at its first scrape
        self.exporter.update_from_ctb(scheduler())

    def _hit_rates(self) -> dict[str, float]:
        from verl_tide.engine_metrics import prefix_hit_rate

        rates = {}
        for sid in self.servers():
            try:
                now = EngineMetrics.scrape(f"http://{sid}", self.backend, timeout_s=5)
            except (OSError, ValueError):
                continue
            rates[sid] = prefix_hit_rate(self._first.setdefault(sid, now), now)
        return rates

    async def refresh_forever(self) -> None:
        while True:
            self.exporter.update_from_ctb(self.scheduler())
            rates = await asyncio.get_running_loop().run_in_executor(None, self._hit_rates)
            self.exporter.update_hit_rates(rates)
            await asyncio.sleep(self.interval_s)
