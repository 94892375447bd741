"""verl's own agent loops, made known to CTB: `tide_single_turn_agent` and `tide_tool_agent`.

Why: CTB charges a trajectory's context to its rank from its first turn until it ends, but verl's
load-balancer protocol never says when a trajectory ends; verl's `single_turn_agent` and
`tool_agent` just stop calling. Left alone, CTB keeps charging finished trajectories until its
idle timeout and admissions stall. These subclasses (registered in verl's agent-loop registry;
`+tide=enabled` makes `tide_single_turn_agent` the default) run verl's loops unchanged, with the
LLM client wrapped for the trajectory: request ids name the GRPO group (`core/request_ids.py`) and CTB is
told `finish` when the loop returns or fails.
"""

from __future__ import annotations

from typing import Any, Optional

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from verl_tide.core.request_ids import is_eval_prompt, router_method, trajectory_request_id

STOCK_TO_TIDE = {"single_turn_agent": "tide_single_turn_agent", "tool_agent": "tide_tool_agent"}


class _TrajectoryClient:
    """The loop's LLM client for one trajectory: group-naming request ids, remembered for `finish`."""

    def __init__(self, inner: Any, group_id: Optional[str], is_eval: bool = False):
        self._inner, self._group_id, self._is_eval = inner, group_id, is_eval
        self.request_ids: dict[str, str] = {}

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        rid = self.request_ids.get(request_id)
        if rid is None:
            rid = self.request_ids[request_id] = trajectory_request_id(self._group_id, self._is_eval)
        return await self._inner.generate(request_id=rid, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class CTBTrajectoryMixin:
    """Put before a verl agent-loop class: `class X(CTBTrajectoryMixin, SomeAgentLoop)`."""

    server_manager: Any

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        inner = self.server_manager
        client = _TrajectoryClient(inner, kwargs.get("uid"), is_eval_prompt(kwargs))
        self.server_manager = client
        outcome = "dropped_failed"
        try:
            out = await super().run(sampling_params, **kwargs)  # type: ignore[misc]
            outcome = "consumed"
            return out
        finally:
            self.server_manager = inner
            finish = router_method(inner, "finish")
            if finish is not None:  # CTB's router; verl's stock balancers have no `finish`
                for rid in client.request_ids.values():
                    finish.remote(rid, outcome)


@register(STOCK_TO_TIDE["single_turn_agent"])
class TideSingleTurnAgentLoop(CTBTrajectoryMixin, SingleTurnAgentLoop):
    """verl's `single_turn_agent`, with its trajectory's end told to CTB."""


@register(STOCK_TO_TIDE["tool_agent"])
class TideToolAgentLoop(CTBTrajectoryMixin, ToolAgentLoop):
    """verl's `tool_agent`, with group-naming request ids and its trajectory's end told to CTB."""


def warn_about_stock_agent_loop(default_agent_loop: Optional[str], ctb_enabled: bool) -> None:
    """verl's stock loops never tell CTB that a trajectory ended; say which tide loop to use instead."""
    if ctb_enabled and default_agent_loop in STOCK_TO_TIDE:
        print(f"verl-tide WARNING: actor_rollout_ref.rollout.agent.default_agent_loop = {default_agent_loop}: verl's "
              f"loop never tells CTB that a trajectory ended, so CTB charges it until its idle timeout (300 s) and "
              f"admissions can stall; use {STOCK_TO_TIDE[default_agent_loop]} (the same loop, its end told to CTB)",
              flush=True)
