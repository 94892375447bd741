"""verl's own agent loops wrapped for CTB: group-naming request ids, and `finish` when the loop ends."""

from __future__ import annotations

import asyncio

import pytest

from verl_tide.core.request_ids import group_of
from verl_tide.ctb.agent_loops import CTBTrajectoryMixin


class _Remote:
    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def remote(self, *args):
        self.calls.append((self.name, *args))


class FakeBalancer:
    def __init__(self):
        self.calls = []
        self.finish = _Remote(self.calls, "finish")


class FakeClient:
    def __init__(self):
        self._load_balancer = FakeBalancer()
        self.seen = []

    async def generate(self, request_id, **kwargs):
        self.seen.append(request_id)
        return "tokens"


class TwoTurnLoop:
    """Stands in for a verl loop: one request id per trajectory, reused every turn, as verl's loops do."""

    def __init__(self, client, fail=False):
        self.server_manager, self.fail = client, fail

    async def run(self, sampling_params, **kwargs):
        await self.server_manager.generate(request_id="abc", prompt_ids=[1], sampling_params=sampling_params)
        if self.fail:
            raise RuntimeError("tool crashed")
        await self.server_manager.generate(request_id="abc", prompt_ids=[1, 2], sampling_params=sampling_params)
        return "output"


class Wrapped(CTBTrajectoryMixin, TwoTurnLoop):
    pass


def test_turns_share_one_group_naming_id_and_ctb_hears_the_end():
    client = FakeClient()
    loop = Wrapped(client)
    assert asyncio.run(loop.run({}, uid="group-7")) == "output"
    assert len(set(client.seen)) == 1 and group_of(client.seen[0]) == "group-7"
    assert client._load_balancer.calls == [("finish", client.seen[0], "consumed")]
    assert loop.server_manager is client  # the wrapper lives for one trajectory only


def test_a_failing_loop_still_frees_its_budget_as_failed():
    client = FakeClient()
    with pytest.raises(RuntimeError, match="tool crashed"):
        asyncio.run(Wrapped(client, fail=True).run({}, uid="g"))
    assert client._load_balancer.calls == [("finish", client.seen[0], "dropped_failed")]


def test_with_a_stock_balancer_nothing_is_called():
    client = FakeClient()
    del client._load_balancer.finish
    assert asyncio.run(Wrapped(client).run({}, uid="g")) == "output"


def test_the_variants_are_registered_in_verls_agent_loop_registry():
    import verl_tide.ctb.agent_loops  # noqa: F401
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    assert _agent_loop_registry["tide_single_turn_agent"]["_target_"].endswith("TideSingleTurnAgentLoop")
    assert _agent_loop_registry["tide_tool_agent"]["_target_"].endswith("TideToolAgentLoop")
