"""The rollout side of the simulation: tasks and their GRPO groups, the router (CTB's production scheduler, or
verl's least-loaded sticky routing), the modeled engines (`engine.RolloutRank`), ready sequences grouped into
micro-batches for the trainer, and ranks joining and leaving the rollout role. The simulation's clock, workload,
ledger and readiness tracker are its owner's (`cluster.Simulation`)."""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Optional

from verl_tide.core.ledger import Outcome
from verl_tide.ctb.policy import CTBScheduler, TaskState
from verl_tide.sim.engine import Request, RolloutRank
from verl_tide.sim.records import Group, MicroBatch, Traj

if TYPE_CHECKING:
    from verl_tide.sim.cluster import Simulation


class Rollout:
    def __init__(self, sim: Simulation, ranks: dict[int, RolloutRank], ctb: Optional[CTBScheduler]):
        self.sim = sim
        self.ranks = ranks
        self.ctb = ctb  # None: verl's routing (least-loaded, sticky per trajectory)
        self.assigned: dict[int, int] = {r: 0 for r in ranks}  # verl's routing: trajectories per rank
        self.env: list = []  # heap (time, seq, kind, traj)
        self._seq = 0
        self.trajs: dict[int, Traj] = {}
        self.groups: list[Group] = []
        self.released_train_groups = 0
        self.ready: deque = deque()  # (time, tokens, tid) of sequences whose GRPO group completed
        self.micro_batches: deque[MicroBatch] = deque()
        self.mb_count = 0
        self.eval_pending: list[Group] = []
        self.stats = {"eval_tokens": 0, "eval_failed_sequences": 0, "regenerated_tokens": 0, "generated_tokens": 0}
        self._retired: list[RolloutRank] = []  # ranks that left the rollout role (their hit counts stay)

    # ---- task generation -------------------------------------------------------------------
    def new_group(self, step: int, size: int) -> Group:
        w, rng = self.sim.w, self.sim.rng
        g = Group(len(self.groups), step, size, prompt=w.prompt_tokens.sample_int(rng))
        self.groups.append(g)
        if not g.is_eval:
            self.sim.ledger.groups_submitted(size)
        for _ in range(size):
            n = w.turns.sample_int(rng)
            actions = [w.action_tokens.sample_int(rng) for _ in range(n)]
            obs = [w.observation_tokens.sample_int(rng) for _ in range(n - 1)]
            # a turn's host-side round trip to the engine (0 on the GPU profiles) delays it as the environment does
            host = self.sim.costs.request_overhead_s
            lat = [w.env_latency_s.sample(rng) + host for _ in range(n)]  # every action is an environment step
            tr = Traj(len(self.trajs), g, actions, obs, lat, w.env_start_s.sample(rng) + host, context=g.prompt,
                      trained_tokens=g.prompt + sum(actions) + sum(obs))
            self.trajs[tr.tid] = tr
            self.start(tr)
        return g

    def release_train_groups(self) -> None:
        """Asynchronous systems: groups of step s may start once step s - 1 - max_staleness is consumed."""
        per_step = self.sim.w.groups_for(self.sim.gpus)
        limit_step = self.sim.w.steps - 1 if self.sim.spec.sync else min(
            self.sim.w.steps - 1, self.sim.consumed_steps + self.sim.w.max_staleness)
        while self.released_train_groups < (limit_step + 1) * per_step:
            self.new_group(self.released_train_groups // per_step, self.sim.w.group_size)
            self.released_train_groups += 1

    def release_eval(self) -> list[Group]:
        e = self.sim.w.eval
        self.eval_pending = [self.new_group(-1, e.group_size) for _ in range(e.groups)]
        return self.eval_pending

    @property
    def throttled(self) -> bool:
        return self.released_train_groups < self.sim.w.steps * self.sim.w.groups_for(self.sim.gpus)

    # ---- routing ---------------------------------------------------------------------------
    def start(self, tr: Traj) -> None:
        if self.ctb is not None:
            # As in production: the agent loop starts its environment, then asks the router for its first
            # turn; CTB sees the task (and may hold it) only from then on.
            self.after(tr.start_latency, "ctb_add", tr)
            return
        tr.rank = min(self.ranks, key=lambda r: (self.assigned[r], r))
        self.assigned[tr.rank] += 1
        self.after(tr.start_latency, "turn", tr)

    def after(self, delay: float, kind: str, tr: Traj) -> None:
        self._seq += 1
        heapq.heappush(self.env, (self.sim.t + delay, self._seq, kind, tr))

    def turn_due(self, tr: Traj) -> None:
        if tr.turn == len(tr.actions):  # only its last environment step is outstanding
            tr.pending = False
            return
        if self.ctb is not None:
            if self.ctb.tasks[tr.tid].state is not TaskState.RESIDENT:
                tr.pending = True
                return
            self.ctb.turn_started(tr.tid, tr.context)
        elif tr.rank not in self.ranks:
            tr.rank = min(self.ranks, key=lambda r: (self.assigned[r], r))
            self.assigned[tr.rank] += 1
        tr.pending = False
        req = Request(tr.tid, tr.group.gid, tr.context, tr.actions[tr.turn], tr.group.prompt)
        tr.in_engine = req
        self.ranks[tr.rank].submit(req, self.sim.t)

    def ctb_tick(self) -> None:
        out = self.ctb.tick()
        for d in out.admissions:
            tr = self.trajs[d.task_id]
            tr.rank = d.rank
            self.turn_due(tr)
        for d in out.resumes:
            tr = self.trajs[d.task_id]
            if tr.rank != d.rank:
                self.ranks[tr.rank].forget(tr.tid) if tr.rank in self.ranks else None
            tr.rank = d.rank
            if tr.pending:
                self.turn_due(tr)
        for d in out.failed:
            self.fail(self.trajs[d.task_id])

    def fail(self, tr: Traj) -> None:
        tr.done = True
        tr.group.failed += 1
        if tr.group.is_eval:
            self.stats["eval_failed_sequences"] += 1
        else:
            self.sim.ledger.settle(tr.tid, Outcome.DROPPED_FAILED, samples=1, tokens=tr.generated)
        self.group_progress(tr.group)

    def turn_finished(self, tr: Traj) -> None:
        tr.in_engine = None
        tr.generated += tr.actions[tr.turn]
        self.stats["generated_tokens"] += tr.actions[tr.turn]
        tr.context += tr.actions[tr.turn]
        if self.ctb is not None:
            self.ctb.turn_finished(tr.tid)
        if tr.turn + 1 == len(tr.actions):
            # the last action is an environment step too (its reward and done, or the observation past the response
            # length that ends the episode): the trajectory is complete when that step returns
            self.after(tr.latencies[tr.turn], "final", tr)
            tr.turn += 1  # no action left to generate, whatever routes it meanwhile (turn_due)
            return
        self.after(tr.latencies[tr.turn], "obs", tr)

    def trajectory_finished(self, tr: Traj) -> None:
        """Its last environment step returned: done, its group one closer to ready."""
        tr.done = True
        if tr.rank in self.ranks:
            self.ranks[tr.rank].forget(tr.tid)
        if self.ctb is not None:
            self.ctb.task_finished(tr.tid, Outcome.CONSUMED)
        elif tr.rank in self.assigned:
            self.assigned[tr.rank] -= 1
        tr.group.done += 1
        tr.group.tokens.append(tr.trained_tokens)
        tr.group.finished.append(tr.tid)
        self.group_progress(tr.group)

    def observation(self, tr: Traj) -> None:
        tr.context += tr.observations[tr.turn]
        tr.turn += 1
        win = self.sim.w.context_window
        if win is not None and tr.context > win.max_tokens:
            tr.context = win.keep_tokens  # pruned history: the cached prefix no longer matches
            if tr.rank in self.ranks:
                self.ranks[tr.rank].forget(tr.tid)
        self.turn_due(tr)

    def group_progress(self, g: Group) -> None:
        if g.done + g.failed < g.size:
            return
        if g.is_eval:
            self.stats["eval_tokens"] += sum(g.tokens)
            return
        for tok, tid in zip(g.tokens, g.finished):
            self.sim.ledger.group_ready(tid, 1, tok)
            self.ready.append((self.sim.t, tok, tid))
        self.form_micro_batches()

    def form_micro_batches(self) -> None:
        while len(self.ready) >= self.sim.mb_size:
            seqs = [self.ready.popleft() for _ in range(self.sim.mb_size)]
            self.mb_count += 1
            mb = MicroBatch(self.mb_count, self.sim.t, len(seqs), sum(tok for _, tok, _ in seqs),
                            [tid for _, _, tid in seqs])
            self.micro_batches.append(mb)
            self.sim.tracker.micro_batch_ready(mb.mb_id, mb.sequences, t=self.sim.t)

    # ---- ranks changing role ---------------------------------------------------------------
    def remove_rank(self, rank: int) -> None:
        rr = self.ranks.pop(rank)
        self._retired.append(rr)
        decoded = {id(req): req.action - (target - rr.progress) for target, _, req in rr.decoding}
        for req in rr.abort_all():
            tr = self.trajs[req.task]
            done = max(0, int(decoded.get(id(req), 0)))
            if self.sim.spec.partial_rollout and done < tr.actions[tr.turn]:  # resumed elsewhere with its tokens so far
                tr.actions[tr.turn] -= done
                tr.context += done
                tr.generated += done
                self.stats["generated_tokens"] += done
            else:
                self.stats["regenerated_tokens"] += done  # generated, lost, redone
            tr.in_engine = None
            tr.pending = True
        if self.ctb is not None:
            self.ctb.remove_rank(rank)
        else:
            self.assigned.pop(rank, None)
        for tr in self.trajs.values():  # held turns of the moved tasks go out on resume / re-route
            if tr.rank == rank and not tr.done:
                tr.rank = None if self.ctb is not None else rank
                if self.ctb is None and tr.pending:
                    self.turn_due(tr)

    def add_rank(self, rank: int, ready_at: float, colocated: bool = False) -> None:
        cap = self.sim.costs.kv_capacity_colocated if colocated else self.sim.costs.kv_capacity_tokens
        rr = RolloutRank(rank, cap, self.sim.costs, paused_until=ready_at)
        self.ranks[rank] = rr
        if self.ctb is not None:
            self.ctb.add_rank(rank, rr.kv_capacity)
        else:
            self.assigned[rank] = 0

    def all_ranks_seen(self) -> list[RolloutRank]:
        return [*self.ranks.values(), *self._retired]
