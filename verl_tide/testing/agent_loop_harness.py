"""verl's real agent-loop machinery around `tide_env_agent` with the LLM server scripted: tests of the loop's turn
logic and of how environment faults end a trajectory, without an engine (the engine runs in the test-bed jobs)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from verl.experimental.agent_loop.agent_loop import DictConfigWrap
from verl.workers.rollout.replica import TokenOutput
from verl_tide.env.agent_loop import EnvAgentLoop


class ScriptedLLM:
    """Answers each turn with the next scripted text (as tokens), like verl's LLMServerClient.generate."""

    def __init__(self, tokenizer: Any, answers: list[str]):
        self.tokenizer, self.answers, self.calls = tokenizer, list(answers), []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        self.calls.append((request_id, len(prompt_ids)))
        ids = self.tokenizer.encode(self.answers.pop(0)) + [self.tokenizer.eos_token_id]
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids))


def env_agent_loop(tokenizer: Any, llm: Any, url: str, response_length: int = 256, max_turns: int = 0,
                   request_timeout_s: float = 5.0) -> EnvAgentLoop:
    """A `tide_env_agent` loop against the environment service at `url`, no retries."""
    cfg = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"prompt_length": 512, "response_length": response_length,
                                          "multi_turn": {"max_assistant_turns": max_turns, "max_user_turns": 0}}},
        "data": {},
        "tide": {"env": {"url": url, "request_timeout_s": request_timeout_s, "max_retries": 0}},
    })
    return EnvAgentLoop(trainer_config=DictConfigWrap(cfg), server_manager=llm, tokenizer=tokenizer, processor=None,
                        dataset_cls=None, data_config=DictConfigWrap(cfg.data))
