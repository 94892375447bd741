"""CTB as verl's rollout load balancer: every turn's generate request passes through CTB.

verl 0.9.1 loads a router plugin from `actor_rollout_ref.rollout.router_config_path` (a YAML file with
`router_class`: `verl-tide paths router`). verl's `LLMServerClient` calls `acquire_server` before and
`release_server` after each turn of a trajectory (one `request_id` per trajectory), so:

- acquire = a turn boundary: the trajectory is admitted (first turn) or reports its real context
  (`prompt_ids`), and waits here while CTB holds it paused; it is then sent to the rank CTB chose
  (the rank holding its prefix when it has headroom). No in-flight request is ever aborted.
- release = the turn's generation ended; the task waits for its environment, still resident.
- When CTB pauses a trajectory its environment session gets `/pause` (its inactivity timeout stops), and
  `/resume` when CTB resumes it, for agent loops that register it (`register_env_session`; `tide_env_agent` does).
- A trajectory ends when its agent loop says so (`finish`; `tide_env_agent` calls it) or, for agent loops that
  do not, when it has not come back for `idle_finish_s` (its budget released; a return is a new task).

Budgets come from each engine's KV capacity, read from its `/metrics` (vLLM or SGLang), or from
`kv_capacity_tokens` in the YAML. A request CTB cannot place at all (context above every rank's budget) is
routed like stock verl (least in-flight) and counted as `bypassed`, never failed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional

from verl_tide.core.config import parse_tide_config
from verl_tide.core.request_ids import group_of, is_eval_request
from verl_tide.ctb.gate import TaskFailed, TurnGate
from verl_tide.ctb.policy import CTBScheduler, Outcome, TaskState
from verl_tide.ctb.router_metrics import RouterMetrics
from verl_tide.engine_metrics import engine_kv_capacity

logger = logging.getLogger(__name__)
MAX_FINISH_TIMES = 100_000  # groups whose finish time is kept until the trainer asks for it


def _positive_int(config: Mapping[str, Any], key: str, default: int) -> int:
    value = config.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"CTB router: {key} = {value!r}: must be an integer >= 1 (the GRPO group size, "
                         "verl's actor_rollout_ref.rollout.n or rollout.val_kwargs.n)")
    return value


class CTBLoadBalancer:
    """A verl `RequestLoadBalancer` (router plugin) that enforces CTB at turn boundaries."""

    def __init__(self, servers: Mapping[str, Any], config: Mapping[str, Any]):
        raw_ctb = dict(config.get("ctb", {}))
        self.ctb_config = parse_tide_config({"ctb": raw_ctb}).ctb
        self.backend = str(config.get("backend", "vllm"))
        self.idle_finish_s = float(config.get("idle_finish_s", 300.0))
        self.default_capacity = config.get("kv_capacity_tokens")
        self.status_path = config.get("status_path")  # if set, get_status() is written here as JSON
        # GRPO group sizes (verl's rollout.n and rollout.val_kwargs.n): Table 1's completion term is the finished
        # *fraction* of a group; without the size it would count finished siblings and outrank evaluation.
        self.group_size = _positive_int(config, "group_size", 1)
        self.eval_group_size = _positive_int(config, "eval_group_size", self.group_size)
        self.servers: dict[str, Any] = {}
        self.inflight: dict[str, int] = {}
        self.clock = time.monotonic
        self._busy_s: dict[str, float] = {}  # per server: seconds with a request in flight (closed intervals)
        self._busy_since: dict[str, float] = {}  # per server with a request in flight: since when
        # rank-seconds with nothing in flight while no task waited for admission: rollout out of work
        self._idle_rank_s, self._idle_since = 0.0, self.clock()
        self._kv_wait_s = 0.0  # seconds during which work waited for KV budget (CTB's `waiting_for_kv`)
        self._generating_token_s = 0.0  # integral of CTB's `generating_tokens` over time (decode load)
        self._kv_held_peak = 0.0  # the most KV resident tasks held at once since the readiness signals last read it
        self.bypassed: dict[str, str] = {}  # request id -> server, for requests CTB could not place
        # tokens_dropped_failed: what trajectories generated before their environment failed (verl drops their
        # group; those tokens never reach TransferQueue, where the trainer's ledger counts the rest)
        self.counters = {"bypassed": 0, "idle_finished": 0, "tokens_dropped_failed": 0}
        self._turns: dict[str, int] = {}
        self._incarnation: dict[str, int] = {}  # a trajectory admitted again after an idle finish
        self._env_sessions: dict[str, tuple[str, str]] = {}  # request id -> (env service URL, session id)
        self._task_types: dict[str, str] = {}  # request id -> task type (the environment), for the diversity term
        # group -> wall-clock time its latest trajectory finished: when the group became ready (readiness signals)
        self._group_finished_at: dict[str, float] = {}
        self._env_clients: dict[str, Any] = {}
        self.counters.update({"env_paused": 0, "env_resumed": 0, "env_pause_failed": 0, "quarantined": 0,
                              "tasks_moved_off_removed_ranks": 0})
        self.quarantined: dict[str, str] = {}  # server id -> why
        self._assigned: dict[str, str] = {}  # request id -> the rank of its latest turn
        self.turns_served: dict[str, int] = {}  # server id -> turns routed to it, kept after it leaves the pool
        self._pool_s: dict[str, float] = {}  # server id -> seconds it was in the pool (closed spells), kept after
        self._joined_at: dict[str, float] = {}  # server id in the pool -> since when
        self.gate = TurnGate(CTBScheduler(self.ctb_config, {}), on_pause=self._env_pause, on_resume=self._env_resume)
        self.add_servers(dict(servers))
        self.metrics: Optional[RouterMetrics] = None
        self._metrics_task: Optional[asyncio.Task] = None
        metrics_cfg = dict(config.get("metrics") or {})
        if metrics_cfg.get("enabled"):
            self.metrics = RouterMetrics(str(metrics_cfg.get("host", "127.0.0.1")), int(metrics_cfg.get("port", 0)),
                                         float(metrics_cfg.get("interval_s", 5.0)), lambda: self.gate.scheduler,
                                         lambda: list(self.servers), self.backend)

    @classmethod
    def with_config(cls, config: Mapping[str, Any]) -> type:
        """A subclass bound to `config`, for verl's `LLMServerManager(load_balancer_cls=...)`.

        verl builds an injected balancer as `cls(servers=..., max_cache_size=...)`; trainer `tide`
        passes its `tide.ctb` settings this way instead of through a router YAML file.
        """
        bound = dict(config)

        class BoundCTBLoadBalancer(cls):  # type: ignore[misc, valid-type]
            def __init__(self, servers: Mapping[str, Any], **_: Any):
                super().__init__(servers, bound)

        BoundCTBLoadBalancer.__name__ = BoundCTBLoadBalancer.__qualname__ = cls.__name__
        return BoundCTBLoadBalancer

    # ---- verl's RequestLoadBalancer protocol -----------------------------------------------
    def require_acquire_fields(self) -> list[str]:
        return ["prompt_ids", "sampling_params"]

    def require_release_fields(self) -> list[str]:
        return ["request_id"]

    async def acquire_server(self, request_id: str, prompt_ids: Optional[list[int]] = None,
                             sampling_params: Optional[dict[str, Any]] = None, **_: Any) -> tuple[str, Any]:
        self._ensure_metrics_task()
        self._account_clocks()
        if request_id in self.bypassed:
            return self._take(self.bypassed[request_id])
        context = len(prompt_ids or []) + int((sampling_params or {}).get("max_tokens") or 0)
        context = max(context, 1)
        task = self.gate.scheduler.tasks.get(self._tid(request_id))
        try:
            if task is None or task.state is TaskState.DONE:
                if task is not None:  # an idle-finished trajectory came back: admit it as a new task
                    self._incarnation[request_id] = self._incarnation.get(request_id, 0) + 1
                is_eval = is_eval_request(request_id)
                await self.gate.admit(self._tid(request_id), group_id=group_of(request_id), prompt_tokens=context,
                                      group_size=self.eval_group_size if is_eval else self.group_size,
                                      task_type=self._task_types.get(request_id, "default"), is_eval=is_eval)
            rank = await self.gate.before_turn(self._tid(request_id), context)
        except TaskFailed as e:
            server = min(self.inflight, key=self.inflight.get)
            self.bypassed[request_id] = server
            self.counters["bypassed"] += 1
            logger.warning("CTB: %s; routing it to %s without CTB", e, server)
            return self._take(server)
        self._turns[request_id] = self._turns.get(request_id, 0) + 1
        self._assigned[request_id] = rank
        return self._take(rank)

    def release_server(self, server_id: str, request_id: Optional[str] = None) -> None:
        self._account_clocks()
        if server_id in self.inflight and self.inflight[server_id] > 0:
            self.inflight[server_id] -= 1
            if self.inflight[server_id] == 0 and server_id in self._busy_since:
                self._busy_s[server_id] += self.clock() - self._busy_since.pop(server_id)
        task = self.gate.scheduler.tasks.get(self._tid(request_id)) if request_id is not None else None
        if task is None or task.state is TaskState.DONE:
            return
        self.gate.after_turn(self._tid(request_id))
        turn = self._turns.get(request_id, 0)
        asyncio.get_event_loop().call_later(self.idle_finish_s, self._finish_if_idle, request_id, turn)

    def register_env_session(self, request_id: str, env_url: str, session_id: str,
                             task_type: Optional[str] = None) -> None:
        """The trajectory's environment session, to `/pause` and `/resume` with CTB's decisions, and its task type
        (the environment's name): CTB spreads tasks of one type over ranks (`tide.ctb.diversity_penalty`)."""
        self._env_sessions[request_id] = (env_url, session_id)
        if task_type:
            self._task_types[request_id] = str(task_type)

    def finish(self, request_id: str, outcome: str = Outcome.CONSUMED.value, generated_tokens: int = 0) -> None:
        """The trajectory ended (called by verl-tide's agent loops); frees its budget now. A failed one says how
        many tokens it had generated (counted in `tokens_dropped_failed`)."""
        self._account_clocks()
        if outcome == Outcome.DROPPED_FAILED.value:
            self.counters["tokens_dropped_failed"] += int(generated_tokens)
        self.bypassed.pop(request_id, None)
        self._env_sessions.pop(request_id, None)
        self._assigned.pop(request_id, None)
        self._task_types.pop(request_id, None)
        if not is_eval_request(request_id):
            group = group_of(request_id)
            self._group_finished_at.pop(group, None)  # re-inserted last: the oldest entries go first when full
            self._group_finished_at[group] = time.time()
            if len(self._group_finished_at) > MAX_FINISH_TIMES:  # nobody asks (a router plugin in stock verl)
                self._group_finished_at.pop(next(iter(self._group_finished_at)))
        task = self.gate.scheduler.tasks.get(self._tid(request_id))
        if task is not None and task.state is not TaskState.DONE:
            self.gate.finish(self._tid(request_id), Outcome(outcome))
        if self.status_path:
            import json

            with open(self.status_path, "w") as f:
                json.dump(self.get_status(), f)

    def group_finish_times(self, group_ids: list[str]) -> dict[str, float]:
        """Wall-clock (time.time) finish of each group's latest trajectory, for the groups asked; handed out once
        (the trainer's replay buffer stamps a group ready at that time, not when it polls)."""
        return {g: self._group_finished_at.pop(g) for g in group_ids if g in self._group_finished_at}

    def add_servers(self, servers: dict[str, Any]) -> None:
        self._account_clocks()
        for sid, handle in servers.items():
            capacity = self.default_capacity or engine_kv_capacity(sid, self.backend)
            if not capacity:
                raise ValueError(f"CTB router: no KV capacity for server {sid}: its /metrics gave none; set "
                                 "kv_capacity_tokens in the router YAML")
            self.servers[sid], self.inflight[sid] = handle, 0
            self._busy_s.setdefault(sid, 0.0)
            self._joined_at.setdefault(sid, self.clock())
            self.gate.add_rank(sid, int(capacity))

    def remove_servers(self, server_ids: list[str]) -> None:
        self._account_clocks()
        for sid in server_ids:
            if sid in self.servers:
                moved = self.gate.remove_rank(sid)  # its tasks are re-dispatched elsewhere, none lost
                self.counters["tasks_moved_off_removed_ranks"] += len(moved)
                self.servers.pop(sid)
                self.inflight.pop(sid)
                self._busy_s.pop(sid, None)
                self._busy_since.pop(sid, None)
                joined = self._joined_at.pop(sid, None)
                if joined is not None:
                    self._pool_s[sid] = self._pool_s.get(sid, 0.0) + self.clock() - joined
        self.bypassed = {r: s for r, s in self.bypassed.items() if s in self.servers}

    def quarantine(self, server_ids: list[str], reason: str = "") -> list[str]:
        """Take ranks that died or stopped answering out of rotation for good; their tasks are handed
        back to CTB and re-admitted on the remaining ranks (a fresh prefill there). Returns the ranks
        newly quarantined. Idempotent."""
        newly = [sid for sid in server_ids if sid in self.servers]
        if newly and len(newly) >= len(self.servers):
            logger.error("CTB: asked to quarantine every rollout rank (%s); keeping them", newly)
            return []
        self.remove_servers(newly)
        for sid in newly:
            self.quarantined[sid] = reason
            self.counters["quarantined"] += 1
            logger.warning("CTB: rollout rank %s quarantined: %s", sid, reason or "reported dead")
        return newly

    def report_failure(self, request_id: str, reason: str = "") -> list[str]:
        """An agent loop's generate call found its rank dead: quarantine the rank CTB had assigned."""
        sid = self._assigned.get(request_id)
        return self.quarantine([sid], reason) if sid is not None else []

    def get_all_servers(self) -> list[str]:
        return list(self.servers)

    def get_inflight_count(self, server_id: str) -> int:
        return self.inflight.get(server_id, 0)

    def get_total_inflight(self) -> int:
        return sum(self.inflight.values())

    def busy_seconds(self) -> dict[str, float]:
        """Per active server, seconds it has had at least one request in flight since it joined: how much of the
        rollout's capacity its rate used (ERS's `rollout_utilization`; differences between two reads)."""
        now = self.clock()
        return {sid: self._busy_s.get(sid, 0.0) + (now - self._busy_since[sid] if sid in self._busy_since else 0.0)
                for sid in self.servers}

    def pool_seconds(self) -> dict[str, float]:
        """Per server that was ever in the pool, seconds it has been in it (every spell, the open one too): how
        long a replica that joins and leaves (the Actor's, lent by ERS) served rollout."""
        now = self.clock()
        spells = dict(self._pool_s)
        for sid, joined in self._joined_at.items():
            spells[sid] = spells.get(sid, 0.0) + now - joined
        return spells

    def idle_rank_seconds(self) -> float:
        """Rank-seconds, since the router started, that ranks had nothing in flight while no task waited for
        admission: the rollout out of work, waiting for the trainer's next prompts (verl refills one batch per
        step) or for its environments. Trainer `tide` adds it to RWT beside the weight sync, as the simulator
        counts an idle rank under the staleness bound."""
        self._account_clocks()
        return self._idle_rank_s

    def kv_wait_seconds(self) -> float:
        """Seconds, since the router started, during which CTB held work back for KV budget (a task paused, or
        one queued that no rank could hold): the rollout was saturated, and more ranks would have run that work.
        What ERS's split advice reads (`ReadinessSignals.rollout_kv_bound`)."""
        self._account_clocks()
        return self._kv_wait_s

    def rollout_time(self, take_peak: bool = False) -> dict[str, Any]:
        """`busy_seconds`, `idle_rank_seconds`, `kv_wait_seconds` and the time integral of the context of the
        turns in flight (token-seconds: the decode load; CTB's `generating_tokens`) in one read (one Ray call
        per step boundary); and `kv_held_peak`, the most KV the resident tasks held at once (in ranks' worth,
        CTB's `kv_held_ranks`) since the last read with `take_peak` (the readiness signals' reads; the budget
        window's leave it)."""
        self._account_clocks()  # every clock closed at the same instant
        peak = self._kv_held_peak
        if take_peak:
            self._kv_held_peak = self.gate.scheduler.kv_held_ranks
        return {"busy_s": self.busy_seconds(), "idle_rank_s": self._idle_rank_s, "kv_wait_s": self._kv_wait_s,
                "generating_token_s": self._generating_token_s, "kv_held_peak": peak}

    def set_budget_factor(self, factor: float) -> None:
        """Trainer `tide`'s step-boundary planner scales every rank's budget (`ctb/window.py`)."""
        self.gate.set_budget_factor(float(factor))

    def clear_sticky_cache(self) -> dict:
        # After a weight sync every prefix cache is invalid anyway; CTB's budgets still describe
        # the contexts the tasks will re-prefill, so its state is kept.
        return {"cleared_entries": 0, "server_loads": dict(self.inflight)}

    def get_status(self) -> dict:
        s = self.gate.scheduler
        states: dict[str, int] = {}
        for task in s.tasks.values():
            states[task.state.value] = states.get(task.state.value, 0) + 1
        return {
            "servers": dict(self.inflight), "total_inflight": self.get_total_inflight(),
            "active_servers": len(self.servers), "busy_s": self.busy_seconds(),
            "idle_rank_s": self.idle_rank_seconds(), "kv_wait_s": self.kv_wait_seconds(),
            "turns_served": dict(self.turns_served), "pool_s": self.pool_seconds(),
            "ctb": {"ranks": {r: {"usage": x.usage, "budget": x.budget, "base": x.base} for r, x in s.ranks.items()},
                    "budget_factor": s.budgets.factor,
                    "tasks": states, "eval_tasks": sum(1 for t in s.tasks.values() if t.is_eval),
                    **s.counters, **self.counters},
        }

    def get_state(self) -> dict:
        """CTB's checkpointable state (`CTBScheduler.state_dict`) plus the router's own counters."""
        return {"scheduler": self.gate.scheduler.state_dict(), "router": dict(self.counters)}

    def load_state(self, state: dict) -> None:
        self.gate.scheduler.load_state_dict(state.get("scheduler", {}))
        for key, value in state.get("router", {}).items():
            if key in self.counters:
                self.counters[key] = int(value)

    def get_metrics_url(self) -> Optional[str]:
        return self.metrics.url if self.metrics is not None else None

    # ---- helpers ---------------------------------------------------------------------------
    def _ensure_metrics_task(self) -> None:
        # Started from the first request: Ray builds actors outside their event loop.
        if self.metrics is not None and self._metrics_task is None:
            self._metrics_task = asyncio.get_running_loop().create_task(self.metrics.refresh_forever())

    def _account_clocks(self) -> None:
        """Close the interval since the last event (nothing changes between events): ranks with nothing in flight
        while CTB queued no task were out of work; while CTB held work back for KV budget the rollout was
        saturated; the context of the turns in flight is the decode load."""
        now = self.clock()
        scheduler = self.gate.scheduler
        if scheduler.count(TaskState.QUEUED) == 0:
            self._idle_rank_s += (now - self._idle_since) * sum(1 for n in self.inflight.values() if n == 0)
        if scheduler.waiting_for_kv:
            self._kv_wait_s += now - self._idle_since
        self._generating_token_s += (now - self._idle_since) * scheduler.generating_tokens
        self._kv_held_peak = max(self._kv_held_peak, scheduler.kv_held_ranks)
        self._idle_since = now

    def _take(self, server_id: str) -> tuple[str, Any]:
        self._account_clocks()
        if self.inflight[server_id] == 0:
            self._busy_since[server_id] = self.clock()
        self.inflight[server_id] += 1
        self.turns_served[server_id] = self.turns_served.get(server_id, 0) + 1
        return server_id, self.servers[server_id]

    async def _env_pause(self, task_id: tuple[str, int]) -> None:
        await self._env_call(task_id[0], "pause")

    async def _env_resume(self, task_id: tuple[str, int]) -> None:
        await self._env_call(task_id[0], "resume")

    async def _env_call(self, request_id: str, verb: str) -> None:
        target = self._env_sessions.get(request_id)
        if target is None:
            return
        from verl_tide.env.client import EnvClient, EnvError

        url, session_id = target
        client = self._env_clients.get(url) or self._env_clients.setdefault(url, EnvClient(url, max_retries=2))
        try:
            await getattr(client, verb)(session_id)
            self.counters["env_paused" if verb == "pause" else "env_resumed"] += 1
        except EnvError as e:  # the environment may have ended meanwhile; CTB's decision stands
            self.counters["env_pause_failed"] += 1
            logger.warning("CTB: /%s of %s failed: %s", verb, session_id, e)

    def _tid(self, request_id: str) -> tuple[str, int]:
        return request_id, self._incarnation.get(request_id, 0)

    def _finish_if_idle(self, request_id: str, turn: int) -> None:
        task = self.gate.scheduler.tasks.get(self._tid(request_id))
        if task is None or task.state is TaskState.DONE or task.generating or self._turns.get(request_id) != turn:
            return
        self.counters["idle_finished"] += 1
        self.finish(request_id)
