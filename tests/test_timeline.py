"""The head-to-head's timeline (`testing/timeline.py`): the trainer's phases laid out from verl's step timers, the
engines found on verl's line and polled over HTTP."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from verl_tide.testing.timeline import (EnginePoller, engine_addresses, engine_load, phase_totals,
                                        pooled_engine_hit_rate, trainer_phases)


def test_phases_fill_each_step_in_verls_order_and_account_for_every_second():
    zero = 1000.0
    steps = {
        1: {"timing_s/step": 5.0, "timing_s/gen": 3.0, "timing_s/old_log_prob": 0.5, "timing_s/update_actor": 1.0,
            "timing_s/update_weights": 0.2},
        2: {"timing_s/step": 2.0, "timing_s/gen": 0.5, "timing_s/update_actor": 1.0, "timing_s/update_weights": 0.5,
            "timing_s/testing": 1.5},
    }
    arrivals = {1: zero + 6.0, 2: zero + 10.0}
    phases = trainer_phases(steps, arrivals, zero)
    first, second = phases
    assert [b[0] for b in first["blocks"]] == ["between steps", "gen", "old_log_prob", "update_actor",
                                               "update_weights", "other in step"]
    assert first["blocks"][0] == ("between steps", 0.0, 1.0)  # the step timer started 1 s after the first /start
    assert first["blocks"][1] == ("gen", 1.0, 4.0)
    assert first["blocks"][-1][1:] == pytest.approx((5.7, 6.0))  # 0.3 s inside the step no timer covers
    # step 2: its evaluation ends at the metrics line; the step timer before it
    assert second["blocks"][-1] == ("testing", 8.5, 10.0)
    assert second["blocks"][0] == ("between steps", 6.0, 6.5)
    totals = phase_totals(phases)
    assert sum(totals.values()) == pytest.approx(10.0)  # the whole clock, first /start to the last line
    assert totals["gen"] == pytest.approx(3.5) and totals["update_actor"] == pytest.approx(2.0)


def test_engine_addresses_come_from_verls_line_only():
    line = "\x1b[36m(TaskRunnerV1 pid=7)\x1b[0m LLMServerManager: ['192.0.2.2:38923', '192.0.2.2:38607']"
    assert engine_addresses(line) == ["192.0.2.2:38923", "192.0.2.2:38607"]
    assert engine_addresses("step:1 - LLMServer: ['x']") == []


def test_engine_load_over_the_clock_window():
    zero = 50.0
    series = [(zero - 1.0, {"running": 5.0, "waiting": 0.0, "kv_usage": 0.0, "generated": 0.0,
                            "prefix_queried": 0.0, "prefix_hits": 0.0})]  # before: left out
    for i in range(5):
        series.append((zero + i, {"running": float(i % 2), "waiting": 1.0, "kv_usage": 0.5, "generated": 10.0 * i,
                                  "prefix_queried": 100.0 + 50.0 * i, "prefix_hits": 90.0 + 10.0 * i}))
    idle = [(zero + i, {**series[1][1], "running": 0.0}) for i in range(3)]  # nothing queried: no hit rate
    loads = engine_load({"a:1": series, "b:2": idle}, zero, end=4.0)
    load = loads["a:1"]
    assert load["busy_share"] == pytest.approx(2 / 5)
    assert load["mean_running"] == pytest.approx(0.4) and load["mean_waiting"] == 1.0
    assert load["tokens_per_s"] == pytest.approx(10.0)
    assert len(load["series"]) == 5
    # from the window's first poll to its last (the 90 hits before the clock's zero are not this run's)
    assert load["prefix_cache_hit_rate"] == pytest.approx(40 / 200)
    assert loads["b:2"]["prefix_cache_hit_rate"] is None
    assert pooled_engine_hit_rate(loads) == pytest.approx(40 / 200)
    assert pooled_engine_hit_rate({}) is None


class _Metrics(BaseHTTPRequestHandler):
    running = 2.0

    def do_GET(self):  # noqa: N802
        body = (f'vllm:num_requests_running{{engine="0"}} {self.running}\n'
                f'vllm:generation_tokens_total{{engine="0"}} 42.0\n').encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_poller_starts_on_verls_line_and_samples_each_engine_until_stopped():
    server = HTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    poller = EnginePoller(interval_s=0.05)
    try:
        poller.watch_line("nothing to see")
        assert poller.samples == {}
        address = f"127.0.0.1:{server.server_address[1]}"
        poller.watch_line(f"LLMServerManager: ['{address}']")
        deadline = time.time() + 10
        while len(poller.samples[address]) < 3 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        poller.stop()
        server.shutdown()
        server.server_close()
    samples = poller.samples[address]
    assert len(samples) >= 3
    assert samples[0][1]["running"] == 2.0 and samples[0][1]["generated"] == 42.0
    count = len(samples)
    time.sleep(0.2)
    assert len(poller.samples[address]) == count  # stopped
