"""GRPO group ids carried in trajectory request ids (the only field verl's router protocol gives)."""

from verl_tide.core.request_ids import group_of, trajectory_request_id


def test_members_of_a_group_share_the_group_and_differ_as_requests():
    a, b = trajectory_request_id("8d49e5bb-bdcb"), trajectory_request_id("8d49e5bb-bdcb")
    assert a != b
    assert group_of(a) == group_of(b) == "8d49e5bb-bdcb"


def test_ids_from_other_agent_loops_are_groups_of_one():
    assert group_of("0123abcd") == "0123abcd"
    plain = trajectory_request_id(None)
    assert group_of(plain) == plain


def test_a_group_id_containing_the_separator_still_round_trips_to_one_group():
    a, b = trajectory_request_id("x.y"), trajectory_request_id("x.y")
    assert group_of(a) == group_of(b) and group_of(a) != group_of(trajectory_request_id("x"))


def test_evaluation_trajectories_are_marked_and_keep_their_group():
    from verl_tide.core.request_ids import EVAL_FIELD, is_eval_prompt, is_eval_request

    ev, tr = trajectory_request_id("g1", is_eval=True), trajectory_request_id("g1")
    assert is_eval_request(ev) and not is_eval_request(tr)
    assert group_of(ev) == "g1" == group_of(tr)
    assert is_eval_request(trajectory_request_id(None, is_eval=True))  # no group: still evaluation
    assert not is_eval_request("tide-eval-without-separator")
    assert is_eval_prompt({EVAL_FIELD: True, "uid": "u"}) and not is_eval_prompt({"uid": "u"})
