"""What an agent loop tells CTB: which GRPO group a trajectory's request id belongs to, and how to reach
the CTB router's own methods through verl's LLM client.

Why: verl's load-balancer protocol gives the router only a per-trajectory `request_id` (extra
fields would also be forwarded to the engine's `generate`, which rejects unknown ones). CTB needs
the group: its members share a prompt (charged once per rank, resumed on the rank holding that
prefix) and one probe per group measures the first-turn footprint. Agent loops that know the
group (verl passes the prompt's `uid`) name their request ids `tide-<uid>.<unique>`; any other id
is a group of one. Evaluation trajectories are `tide-eval-<uid>.<unique>`: CTB ranks them first
(priority weight w1). Trainer `tide` marks validation prompts with the dataset column `EVAL_FIELD`,
which verl hands to the agent loop with the other prompt fields.
"""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

PREFIX = "tide-"
EVAL_PREFIX = "tide-eval-"
SEP = "."
EVAL_FIELD = "tide_eval"  # prompt field: True for validation prompts


def trajectory_request_id(group_id: Optional[str], is_eval: bool = False) -> str:
    """A fresh request id for one trajectory of `group_id` (a plain unique id when there is none and it is
    not evaluation)."""
    unique = uuid4().hex
    if not group_id and not is_eval:
        return unique
    group = str(group_id or unique).replace(SEP, "_")
    return f"{EVAL_PREFIX if is_eval else PREFIX}{group}{SEP}{unique}"


def group_of(request_id: str) -> str:
    """The GRPO group of a request id made by `trajectory_request_id` (else the id itself)."""
    for prefix in (EVAL_PREFIX, PREFIX):
        if request_id.startswith(prefix) and SEP in request_id:
            return request_id[len(prefix):].rsplit(SEP, 1)[0]
    return request_id


def is_eval_request(request_id: str) -> bool:
    return request_id.startswith(EVAL_PREFIX) and SEP in request_id


def is_eval_prompt(fields: dict) -> bool:
    """Whether the agent loop's prompt fields mark an evaluation prompt."""
    return bool(fields.get(EVAL_FIELD, False))


def router_method(llm_client: Any, name: str) -> Any:
    """The CTB router's method `name` (a Ray actor method) behind verl's LLM client, or None when the job
    routes with verl's stock balancer (which has no such method)."""
    return getattr(getattr(llm_client, "_load_balancer", None), name, None)
