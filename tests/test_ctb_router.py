"""CTB as verl's router plugin (in process): admission, pauses at turn boundaries, idle finish,
bypass of unplaceable requests, server removal. The run inside verl is in test_grpo_e2e.py."""

from __future__ import annotations

import asyncio

import pytest

from verl_tide.ctb.router import CTBLoadBalancer
from verl_tide.testing.eventually import eventually


def _lb(budget_scope="resident", **cfg):
    return CTBLoadBalancer({"s0": "handle0", "s1": "handle1"},
                           {"kv_capacity_tokens": 1000, "idle_finish_s": 0.2,
                            "ctb": {"kv_headroom": 1.0, "budget_scope": budget_scope}, **cfg})


def test_protocol_fields_and_status():
    lb = _lb()
    assert lb.require_acquire_fields() == ["prompt_ids", "sampling_params"]
    assert lb.require_release_fields() == ["request_id"]
    assert lb.get_all_servers() == ["s0", "s1"] and lb.get_total_inflight() == 0
    assert lb.get_status()["ctb"]["ranks"]["s0"] == {"usage": 0, "budget": 1000, "base": 1000}
    assert lb.get_status()["ctb"]["budget_factor"] == 1.0


async def test_sticky_turns_and_a_paused_trajectory_waits_at_its_turn_boundary():
    lb = _lb()
    sid_a, h = await lb.acquire_server("a", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100})
    assert h == f"handle{sid_a[-1]}" and lb.get_inflight_count(sid_a) == 1
    lb.release_server(sid_a, request_id="a")
    sid_b, _ = await lb.acquire_server("b", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100})
    assert sid_b != sid_a  # a holds 700 of s0's 1000 tokens
    lb.release_server(sid_b, request_id="b")
    again, _ = await lb.acquire_server("a", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    assert again == sid_a  # affinity: the rank holding its prefix
    lb.release_server(again, request_id="a")
    # c fits nowhere while a (900) and b (700) are resident: it waits instead of evicting them.
    waiting = asyncio.create_task(lb.acquire_server("c", prompt_ids=[1] * 400, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    lb.finish("b")
    sid_c, _ = await asyncio.wait_for(waiting, 5)
    assert sid_c == sid_b
    assert lb.get_status()["ctb"]["admissions"] == 3


async def test_the_planners_budget_factor_lets_a_waiting_trajectory_in_at_once():
    """Trainer `tide` sets the step-boundary planner's factor on the router (`set_budget_factor`): a trajectory that
    waited for budget starts without waiting for another to end."""
    lb = _lb()
    for rid in ("a", "b"):
        sid, _ = await lb.acquire_server(rid, prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
        lb.release_server(sid, request_id=rid)
    waiting = asyncio.create_task(lb.acquire_server("c", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # 900 + 900 of 2 x 1000
    lb.set_budget_factor(2.0)
    await asyncio.wait_for(waiting, 5)
    status = lb.get_status()["ctb"]
    assert status["budget_factor"] == 2.0 and {r["budget"] for r in status["ranks"].values()} == {2000}


async def test_an_active_budget_lets_waiting_work_in_beside_tasks_that_wait_on_their_environments():
    """`tide.ctb.budget_scope=active` (opt-in): a task waiting on its environment keeps its place and rank, but
    its KV is not charged, so a task that no resident budget holds starts at once; turns in flight are."""
    lb = _lb(budget_scope="active")
    sid_a, _ = await lb.acquire_server("a", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    sid_b, _ = await lb.acquire_server("b", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    lb.release_server(sid_a, request_id="a")  # a waits for its environment; b's turn is still in flight
    sid_c, _ = await asyncio.wait_for(lb.acquire_server("c", prompt_ids=[1] * 600,
                                                        sampling_params={"max_tokens": 100}), 5)
    assert sid_c == sid_a  # b's rank has its turn in flight
    ranks = lb.gate.scheduler.ranks
    assert (ranks[sid_a].usage, ranks[sid_a].active_usage) == (1600, 700)
    lb.release_server(sid_c, request_id="c")  # c waits on its environment too
    back, _ = await asyncio.wait_for(lb.acquire_server("a", prompt_ids=[1] * 800,
                                                       sampling_params={"max_tokens": 100}), 5)
    assert back == sid_a  # a's turn: 900 of 1000 in flight
    # c comes back while a's turn runs: 900 + 700 > 1000, so c (the lower priority) waits for a's turn to end
    again = asyncio.create_task(lb.acquire_server("c", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.02)
    assert not again.done()
    lb.release_server(sid_a, request_id="a")
    assert (await asyncio.wait_for(again, 5))[0] == sid_a  # resumed on the rank that may hold its prefix
    strict = _lb()
    s0, _ = await strict.acquire_server("a", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    s1, _ = await strict.acquire_server("b", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    strict.release_server(s0, request_id="a")
    held = asyncio.create_task(strict.acquire_server("c", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.02)
    assert not held.done()  # resident (the default): a's context stays charged while it waits
    held.cancel()


async def test_evaluation_trajectories_are_admitted_before_waiting_training_ones():
    from verl_tide.core.request_ids import trajectory_request_id

    lb = _lb()
    for rid in ("a", "b"):  # fill both ranks
        sid, _ = await lb.acquire_server(rid, prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
        lb.release_server(sid, request_id=rid)
    train_id, eval_id = trajectory_request_id("g-train"), trajectory_request_id("g-val", is_eval=True)
    train = asyncio.create_task(lb.acquire_server(train_id, prompt_ids=[1] * 600, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.02)
    ev = asyncio.create_task(lb.acquire_server(eval_id, prompt_ids=[1] * 600, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.02)
    assert not train.done() and not ev.done()
    lb.finish("a")  # room for one: the evaluation task goes first although it arrived later
    await asyncio.wait_for(ev, 5)
    await asyncio.sleep(0.05)
    assert not train.done()
    assert lb.get_status()["ctb"]["eval_tasks"] == 1
    lb.finish("b")
    await asyncio.wait_for(train, 5)


async def test_router_state_round_trips():
    lb = _lb()
    sid, _ = await lb.acquire_server("tide-g.1", prompt_ids=[1] * 300)
    lb.release_server(sid, request_id="tide-g.1")
    lb.finish("tide-g.1")
    state = lb.get_state()
    again = _lb()
    again.load_state(state)
    assert again.get_status()["ctb"]["admissions"] == 1 and again.get_status()["ctb"]["consumed"] == 1
    assert again.gate.scheduler.state_dict()["group_probe"] == {"g": 300}


async def test_idle_trajectories_are_finished_and_readmitted_if_they_return():
    lb = _lb()
    sid, _ = await lb.acquire_server("a", prompt_ids=[1] * 500)
    lb.release_server(sid, request_id="a")
    await eventually(lambda: lb.counters["idle_finished"] == 1)  # idle_finish_s = 0.2
    assert lb.get_status()["ctb"]["ranks"][sid]["usage"] == 0
    sid2, _ = await lb.acquire_server("a", prompt_ids=[1] * 600)
    assert lb.get_status()["ctb"]["ranks"][sid2]["usage"] == 600


async def test_unplaceable_request_is_routed_without_ctb_not_failed():
    lb = _lb()
    sid, _ = await lb.acquire_server("huge", prompt_ids=[1] * 5000)
    assert lb.counters["bypassed"] == 1 and sid in ("s0", "s1")
    again, _ = await lb.acquire_server("huge", prompt_ids=[1] * 5100)
    assert again == sid


async def test_removing_a_server_moves_its_trajectories():
    lb = _lb()
    sid, _ = await lb.acquire_server("a", prompt_ids=[1] * 300)
    lb.release_server(sid, request_id="a")
    lb.remove_servers([sid])
    assert lb.get_status()["ctb"]["tasks_moved_off_removed_ranks"] == 1  # ERS closing a rank: counted, not lost
    other, _ = await lb.acquire_server("a", prompt_ids=[1] * 400)
    assert other != sid and lb.get_all_servers() == [other]


def test_missing_capacity_is_a_clear_error():
    with pytest.raises(ValueError, match="no KV capacity for server 127.0.0.1:9"):
        CTBLoadBalancer({"127.0.0.1:9": "h"}, {})


async def test_router_serves_prometheus_metrics_on_loopback():
    import urllib.request

    lb = _lb(metrics={"enabled": True, "interval_s": 0.05})
    try:
        sid, _ = await lb.acquire_server("a", prompt_ids=[1] * 300)
        await eventually(lambda: lb.get_metrics_url() is not None)
        assert lb.get_metrics_url().startswith("http://127.0.0.1:")
        body = ""
        deadline = asyncio.get_running_loop().time() + 10
        while "tide_ctb_rank_tokens" not in body or 'kind="admissions"} 1.0' not in body:  # the exporter's next tick
            assert asyncio.get_running_loop().time() < deadline, body
            body = await asyncio.get_running_loop().run_in_executor(
                None, lambda: urllib.request.urlopen(lb.get_metrics_url(), timeout=10).read().decode())
            await asyncio.sleep(0.05)
    finally:
        lb._metrics_task.cancel()
    assert f'tide_ctb_rank_tokens{{rank="{sid}"}} 300.0' in body
    assert 'tide_ctb_rank_budget_tokens{rank="s0"} 1000.0' in body
    assert 'tide_ctb_decisions_total{kind="admissions"} 1.0' in body


@pytest.mark.parametrize("backend, sample, capacity", [("vllm", "vllm_cpu_0.32_metrics.txt", 16384),
                                                         ("sglang", "sglang_metrics.txt", 500000)])
async def test_budgets_from_the_engines_own_metrics(backend, sample, capacity):
    """A fake engine serves recorded (vLLM-CPU) or documented (SGLang) /metrics; CTB sizes its budget from it."""
    from pathlib import Path

    from aiohttp import web

    text = (Path(__file__).parent / "data" / sample).read_text()
    app = web.Application()
    app.router.add_get("/metrics", lambda request: web.Response(text=text, content_type="text/plain"))
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    address = f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        lb = await asyncio.get_running_loop().run_in_executor(
            None, lambda: CTBLoadBalancer({address: "h"}, {"backend": backend, "ctb": {"kv_headroom": 0.5}}))
    finally:
        await runner.cleanup()
    assert lb.get_status()["ctb"]["ranks"][address]["budget"] == capacity // 2


async def test_busy_seconds_count_the_time_a_rank_has_any_request_in_flight():
    lb = _lb()
    now = [100.0]
    lb.clock = lambda: now[0]
    sid_a, _ = await lb.acquire_server("a", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100})
    now[0] = 101.0
    sid_b, _ = await lb.acquire_server("b", prompt_ids=[1] * 600, sampling_params={"max_tokens": 100})
    assert sid_b != sid_a  # a holds 700 of its rank's 1000 tokens
    now[0] = 102.0
    lb._take(sid_a)  # a second request on a's rank (a bypassed one): the rank's busy time does not count twice
    now[0] = 103.0
    lb.release_server(sid_a, request_id="a")  # one still in flight: a's rank stays busy
    now[0] = 104.0
    assert lb.busy_seconds() == {sid_a: pytest.approx(4.0), sid_b: pytest.approx(3.0)}  # open intervals
    lb.release_server(sid_a)
    now[0] = 106.0
    lb.release_server(sid_b, request_id="b")
    now[0] = 110.0  # both idle from here: not counted
    assert lb.get_status()["busy_s"] == {sid_a: pytest.approx(4.0), sid_b: pytest.approx(5.0)}
    lb.remove_servers([sid_b])
    assert lb.busy_seconds() == {sid_a: pytest.approx(4.0)}


def test_pool_seconds_add_up_every_spell_a_lent_replica_is_in_the_pool():
    """The Actor's replica joins and leaves CTB's pool at each switch; its seconds in the pool are kept after it
    leaves (ERS's `tide/ers/actor_lent_s`)."""
    lb = _lb()
    now = [10.0]
    lb.clock = lambda: now[0]
    lb.add_servers({"actor": "h"})
    now[0] = 13.0
    lb.remove_servers(["actor"])
    now[0] = 20.0
    assert lb.pool_seconds()["actor"] == pytest.approx(3.0)  # gone, not counting
    lb.add_servers({"actor": "h"})
    now[0] = 21.5
    assert lb.get_status()["pool_s"]["actor"] == pytest.approx(4.5)  # the open spell too


async def test_idle_rank_seconds_count_ranks_out_of_work_not_ranks_whose_tasks_wait_for_admission():
    lb = _lb()
    now = [0.0]
    lb.clock = lambda: now[0]
    lb._idle_since = 0.0
    now[0] = 2.0  # nothing dispatched yet: both ranks out of work
    sid_a, _ = await lb.acquire_server("a", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    sid_b, _ = await lb.acquire_server("b", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    now[0] = 3.0
    lb.release_server(sid_a, request_id="a")  # a waits for its environment, still resident
    now[0] = 4.0  # 1 s with a's rank idle and nothing queued
    waiting = asyncio.create_task(lb.acquire_server("c", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # c fits on no rank: queued for admission
    now[0] = 7.0  # a's rank idle, but c waits for admission: not out of work
    lb.release_server(sid_b, request_id="b")
    now[0] = 9.0
    assert lb.idle_rank_seconds() == pytest.approx(2 * 2.0 + 1.0)
    lb.finish("a")  # c is admitted on a's rank
    sid_c, _ = await asyncio.wait_for(waiting, 5)
    assert sid_c == sid_a
    now[0] = 10.0  # b's rank idle for 1 s
    assert lb.rollout_time()["idle_rank_s"] == pytest.approx(5.0 + 1.0)
    assert lb.get_status()["idle_rank_s"] == pytest.approx(6.0)


async def test_kv_wait_and_decode_load_clocks_for_the_split_advice():
    """Seconds work waited for KV budget (a saturated rollout), and token-seconds of the context of the turns in
    flight (the decode load): what ERS's split advice reads. A task waiting for the trainer's allowance is not
    waiting for KV."""
    lb = _lb()
    now = [0.0]
    lb.clock = lambda: now[0]
    lb._idle_since = 0.0
    sid_a, _ = await lb.acquire_server("a", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    sid_b, _ = await lb.acquire_server("b", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100})
    now[0] = 1.0
    lb.release_server(sid_a, request_id="a")  # a waits for its environment: no longer decoding
    now[0] = 3.0
    waiting = asyncio.create_task(lb.acquire_server("c", prompt_ids=[1] * 800, sampling_params={"max_tokens": 100}))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # c fits on no rank: it waits for KV budget
    now[0] = 7.0
    lb.finish("a")  # c is admitted on a's rank and starts its turn
    sid_c, _ = await asyncio.wait_for(waiting, 5)
    now[0] = 8.0
    clocks = lb.rollout_time()
    assert clocks["kv_wait_s"] == pytest.approx(4.0)  # from 3 s to 7 s
    # a decoded 900 tokens of context for 1 s, b for 8 s, c from 7 s to 8 s
    assert clocks["generating_token_s"] == pytest.approx(900 * (1 + 8 + 1))
    assert clocks["kv_held_peak"] == pytest.approx(1.8)  # a and b, then b and c: 900 of a rank's 1000 tokens each
    lb.release_server(sid_b, request_id="b")
    lb.release_server(sid_c, request_id="c")
    lb.gate.scheduler.set_admission_allowance(0)  # the staleness limit: new work waits for the trainer
    blocked = asyncio.create_task(lb.acquire_server("d", prompt_ids=[1] * 50, sampling_params={"max_tokens": 10}))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    now[0] = 20.0
    clocks = lb.rollout_time()
    assert clocks["kv_wait_s"] == pytest.approx(4.0)  # d waits for the allowance, not for KV
    assert clocks["generating_token_s"] == pytest.approx(9000.0)
    # the readiness signals take the peak (the budget window's reads above leave it): the most held at once since
    assert lb.rollout_time(take_peak=True)["kv_held_peak"] == pytest.approx(1.8)
    lb.finish("b")
    lb.finish("c")
    assert lb.rollout_time(take_peak=True)["kv_held_peak"] == pytest.approx(1.8)  # held until they finished
    assert lb.rollout_time(take_peak=True)["kv_held_peak"] == pytest.approx(0.0)  # nothing resident since
    blocked.cancel()


async def _run_trajectory(lb, rid, tokens=100):
    sid, _ = await lb.acquire_server(rid, prompt_ids=[1] * tokens)
    lb.release_server(sid, request_id=rid)
    lb.finish(rid)


async def test_a_nearly_finished_large_group_does_not_outrank_evaluation_through_the_router():
    """Table 1: evaluation > group completion. The completion term is a fraction of the GRPO group, so the
    router must know verl's rollout.n; with 11 of 16 siblings finished a training task still waits behind
    an evaluation task."""
    from verl_tide.core.request_ids import trajectory_request_id

    lb = CTBLoadBalancer({"s0": "handle0"}, {"kv_capacity_tokens": 1000, "idle_finish_s": 30,
                                             "ctb": {"kv_headroom": 1.0}, "group_size": 16, "eval_group_size": 2})
    for _ in range(11):
        await _run_trajectory(lb, trajectory_request_id("g16"))
    blocker = trajectory_request_id("other")
    sid, _ = await lb.acquire_server(blocker, prompt_ids=[1] * 900)
    lb.release_server(sid, request_id=blocker)
    train = asyncio.create_task(lb.acquire_server(trajectory_request_id("g16"), prompt_ids=[1] * 600))
    await asyncio.sleep(0.02)
    ev = asyncio.create_task(lb.acquire_server(trajectory_request_id("val", is_eval=True), prompt_ids=[1] * 600))
    await asyncio.sleep(0.02)
    assert not train.done() and not ev.done()
    tasks = lb.gate.scheduler.tasks
    waiting_train = next(t for t in tasks.values() if t.group_id == "g16" and t.state.value == "queued")
    assert waiting_train.group_size == 16
    assert lb.gate.scheduler.priority(waiting_train) == pytest.approx(100.0 * 11 / 16 + 1e-5 * 600)  # w2, w4
    lb.finish(blocker)
    await asyncio.wait_for(ev, 5)
    await asyncio.sleep(0.05)
    assert not train.done()  # the training task waits although it arrived first


def test_the_router_refuses_a_group_size_that_is_not_a_positive_integer():
    with pytest.raises(ValueError, match="group_size = 0: must be an integer >= 1"):
        _lb(group_size=0)


async def test_the_router_hands_out_each_groups_finish_time_once_and_the_task_type_reaches_ctb():
    import time

    from verl_tide.core.request_ids import trajectory_request_id

    lb = _lb()
    rid = trajectory_request_id("g")
    lb.register_env_session(rid, "http://127.0.0.1:1", "sess", "shop")
    before = time.time()
    sid, _ = await lb.acquire_server(rid, prompt_ids=[1] * 100)
    assert next(iter(lb.gate.scheduler.tasks.values())).task_type == "shop"
    lb.release_server(sid, request_id=rid)
    lb.finish(rid)
    await _run_trajectory(lb, trajectory_request_id("val", is_eval=True))  # evaluation groups are not stamped
    times = lb.group_finish_times(["g", "val", "unknown"])
    assert list(times) == ["g"] and before <= times["g"] <= time.time()
    assert lb.group_finish_times(["g"]) == {}
