"""verl agent loop `tide_env_agent`: a multi-turn trajectory against an environment service.

Registered in verl's agent-loop registry (by `verl_tide.register` when verl imports it). Select
it per row (`agent_name: tide_env_agent`) or for all rows
(`actor_rollout_ref.rollout.agent.default_agent_loop=tide_env_agent`). The row's
`extra_info.tide_env` names the environment: `{"env": "webshop", "task": {...}, "seed": 7}`.
The service URL is `tide.env.url` (or the environment variable `VERL_TIDE_ENV_URL`).

Each turn generates through verl's LLM server client with one request id per trajectory (so
verl's router keeps it on one server and its prefix cache), sends the decoded text as the
action, and appends the observation as a user message (masked out of the loss). It stops on
done, on `tide.env` / multi-turn turn limits, or at the response length; the summed reward
becomes the trajectory's `reward_score`. `/end` is called on every exit path. An environment
failure ends the trajectory, is counted in `EnvAgentLoop.outcomes` and told to CTB's router as
`dropped_failed`. A training trajectory then raises `EnvTrajectoryFailed` (naming the environment and
the session): verl's agent-loop worker marks the GRPO group `failure`, its replay buffer evicts it (trainer
tide's ledger counts it dropped as failed) and refills the batch, so a failed episode is never trained on as
if the policy had scored 0. An evaluation trajectory stays in the batch with reward 0 (a failed task scores
nothing), marked in `extra_fields["tide_env_outcome"]` (`failed`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import Counter
from typing import Any, Optional

from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.utils.profiler import simple_timer
from verl_tide.core.config import TideConfigError, parse_tide_config
from verl_tide.core.request_ids import is_eval_prompt, router_method, trajectory_request_id
from verl_tide.env.client import EnvClient, EnvError

logger = logging.getLogger(__name__)

AGENT_NAME = "tide_env_agent"
URL_ENV_VAR = "VERL_TIDE_ENV_URL"
MAX_DEAD_RANK_RETRIES = 2  # re-sends of one turn after its rollout rank died


class EnvTrajectoryFailed(RuntimeError):
    """A training trajectory's environment failed: verl drops the whole GRPO group as failed and refills it."""


@register(AGENT_NAME)
class EnvAgentLoop(AgentLoopBase):
    outcomes: Counter = Counter()  # per process: completed / failed / end_failed / rank_died
    _clients: dict[tuple[str, int], EnvClient] = {}

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        raw = OmegaConf.select(self.config, "tide", default=None)
        tide = parse_tide_config(OmegaConf.to_container(raw, resolve=True) if raw is not None else {})
        self.env_config = tide.env
        self.url = self.env_config.url or os.environ.get(URL_ENV_VAR)
        if not self.url:
            raise TideConfigError([f"tide.env.url = None: agent loop '{AGENT_NAME}' needs the environment "
                                   f"service URL (set tide.env.url or {URL_ENV_VAR})"])
        self.response_length = self.rollout_config.response_length
        self.max_turns = self.rollout_config.multi_turn.max_assistant_turns or 0

    def _client(self) -> EnvClient:
        key = (self.url, id(asyncio.get_running_loop()))  # an aiohttp session belongs to one event loop
        if key not in self._clients:
            self._clients[key] = EnvClient(self.url, request_timeout_s=self.env_config.request_timeout_s,
                                           max_retries=self.env_config.max_retries,
                                           max_payload_bytes=self.env_config.max_payload_bytes)
        return self._clients[key]

    def _tell_router(self, method: str, *args: Any) -> None:
        """Best effort: when verl routes through verl-tide's CTB router, tell it about this trajectory
        (its environment session; that it ended, so its budget is freed now). Stock routers lack these."""
        call = router_method(self.server_manager, method)
        if call is not None:
            call.remote(*args)

    async def _generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any]) -> Any:
        """One turn. If the rollout rank died under it, have CTB quarantine that rank and re-send the turn
        (the whole context: a fresh prefill on a live rank), so a dead rank loses no trajectory."""
        import ray

        for attempt in range(MAX_DEAD_RANK_RETRIES + 1):
            try:
                return await self.server_manager.generate(request_id=request_id, prompt_ids=prompt_ids,
                                                          sampling_params=sampling_params)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                report = router_method(self.server_manager, "report_failure")
                if report is None or attempt == MAX_DEAD_RANK_RETRIES:
                    raise
                self.outcomes["rank_died"] += 1
                logger.warning("tide_env_agent: rollout rank died during a turn of %s; re-sending (%s)",
                               request_id, type(e).__name__)
                await report.remote(request_id, f"{type(e).__name__} during generate")
        raise AssertionError("unreachable")

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        spec = (kwargs.get("extra_info") or {}).get("tide_env") or {}
        messages = list(kwargs["raw_prompt"])
        client = self._client()
        if self.env_config.max_tokens_per_turn:
            cap = self.env_config.max_tokens_per_turn
            sampling_params = {**sampling_params, "max_tokens": min(cap, sampling_params.get("max_tokens") or cap)}
        metrics: dict[str, Any] = {}
        request_id = trajectory_request_id(kwargs.get("uid"), is_eval_prompt(kwargs))  # group (and eval) for CTB
        session_id: Optional[str] = None
        prompt_ids: list[int] = []
        response_mask: list[int] = []
        logprobs: list[float] = []
        reward, turns, stop, error = 0.0, 0, "failed", ""
        engine_fields: dict[str, Any] = {}  # the engine's per-request fields (policy versions used: min/max_global_steps)
        try:
            start = await client.start(env=spec.get("env"), task=spec.get("task"), seed=spec.get("seed"))
            session_id = start.session_id
            self._tell_router("register_env_session", request_id, self.url, session_id, spec.get("env") or "default")
            messages.append({"role": "user", "content": start.observation})
            prompt_ids = await self.ct_build_initial_tokens(messages)
            while True:
                with simple_timer("generate_sequences", metrics):
                    out = await self._generate(request_id, prompt_ids, sampling_params)
                merge, response_mask, merged_logprobs = await self.ct_merge_assistant_token(
                    prompt_ids, out.token_ids, response_mask, logprobs if (logprobs or out.log_probs) else None,
                    assistant_logprobs=out.log_probs or None)
                prompt_ids, logprobs = merge.token_ids, merged_logprobs or []
                if not engine_fields:
                    engine_fields.update(out.extra_fields)
                elif out.extra_fields.get("max_global_steps") is not None:
                    engine_fields["max_global_steps"] = out.extra_fields["max_global_steps"]
                turns += 1
                action = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": action})
                if len(response_mask) >= self.response_length:
                    stop = "max_length"
                    break
                step = await client.step(session_id, action)
                reward += step.reward
                if step.done:
                    stop = "done"
                    break
                if self.max_turns and turns >= self.max_turns:
                    stop = "max_turns"
                    break
                previous = list(messages)
                messages.append({"role": "user", "content": step.observation})
                merge, new_mask, merged_logprobs = await self.ct_merge_context_msg(
                    previous, messages, prompt_ids, response_mask, logprobs or None)
                if len(new_mask) >= self.response_length:
                    stop = "max_length"
                    break
                prompt_ids, response_mask, logprobs = merge.token_ids, new_mask, merged_logprobs or []
        except EnvError as e:
            stop, error, reward = "failed", f"{type(e).__name__}: {e}", 0.0
            logger.warning("tide_env_agent: environment failed, trajectory marked failed: %s", error)
        finally:
            if session_id is not None:
                try:
                    await client.end(session_id)
                except EnvError as e:
                    self.outcomes["end_failed"] += 1
                    logger.warning("tide_env_agent: /end of %s failed: %s", session_id, e)
        self.outcomes["failed" if stop == "failed" else "completed"] += 1
        self._tell_router("finish", request_id, "dropped_failed" if stop == "failed" else "consumed",
                          sum(response_mask))
        if stop == "failed" and not is_eval_prompt(kwargs):
            raise EnvTrajectoryFailed(f"tide_env_agent: {error}; the GRPO group is dropped as failed")
        if turns == 0:
            # An evaluation trajectory whose environment failed before the first action (a training one
            # raised above). verl needs every row of the batch (policy-version tags from the engine), so
            # the row is kept with a one-token response, reward 0 and outcome "failed".
            if not prompt_ids:
                prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
            out = await self._generate(request_id, prompt_ids, {**sampling_params, "max_tokens": 1})
            merge, response_mask, merged_logprobs = await self.ct_merge_assistant_token(
                prompt_ids, out.token_ids[:1], [], [] if out.log_probs else None,
                assistant_logprobs=out.log_probs[:1] if out.log_probs else None)
            prompt_ids, logprobs = merge.token_ids, merged_logprobs or []
            engine_fields.update(out.extra_fields)
        n_resp = len(response_mask)
        response_ids = prompt_ids[len(prompt_ids) - n_resp:] if n_resp else []
        return AgentLoopOutput(
            prompt_ids=prompt_ids[: len(prompt_ids) - n_resp],
            response_ids=response_ids[: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=logprobs[: self.response_length] if logprobs else None,
            reward_score=reward,
            num_turns=2 * turns + 1,
            metrics=AgentLoopMetrics(generate_sequences=metrics.get("generate_sequences", 0.0)),
            extra_fields={**engine_fields, "tide_env_outcome": stop, "tide_env_error": error,
                          "tide_env_turns": turns, "turn_scores": [], "tool_rewards": []},
        )
