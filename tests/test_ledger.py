"""Goodput ledger: every group ends in exactly one outcome, counted in groups, samples and tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_tide.core.ledger import GoodputLedger, Outcome


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_goodput_counts_only_consumed_tokens_over_wall_clock():
    clock = Clock()
    ledger = GoodputLedger(clock)
    ledger.groups_submitted(3)
    ledger.group_ready("a", samples=2, tokens=100)
    ledger.group_ready("b", samples=2, tokens=300)
    ledger.settle("a", Outcome.CONSUMED)
    ledger.settle("b", Outcome.DROPPED_STALE)
    clock.t += 10.0
    assert ledger.goodput() == pytest.approx(10.0)  # 100 consumed tokens / 10 s; stale tokens do not count
    assert ledger.in_flight_groups == 1  # "c" is still generating
    snap = ledger.snapshot()
    assert snap["tide/ledger/tokens_dropped_stale"] == 300
    assert snap["tide/ledger/samples_consumed"] == 2


def test_a_group_cannot_settle_twice_or_be_ready_twice():
    ledger = GoodputLedger(Clock())
    ledger.groups_submitted(1)
    ledger.group_ready("a", 1, 10)
    with pytest.raises(ValueError, match="reported ready twice"):
        ledger.group_ready("a", 1, 10)
    ledger.settle("a", Outcome.CONSUMED)
    with pytest.raises(ValueError, match="settled twice"):
        ledger.settle("a", Outcome.DROPPED_STALE)
    with pytest.raises(ValueError, match="reported ready twice"):
        ledger.group_ready("a", 1, 10)


def test_a_group_that_failed_before_it_was_ready_keeps_its_partial_counts():
    ledger = GoodputLedger(Clock())
    ledger.groups_submitted(1)
    ledger.settle("x", Outcome.DROPPED_FAILED, samples=1, tokens=42)
    assert ledger.tokens[Outcome.DROPPED_FAILED] == 42
    assert ledger.in_flight_groups == 0


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 500), st.sampled_from([None, *Outcome])), max_size=40))
def test_conservation_submitted_equals_settled_plus_in_flight(groups):
    ledger = GoodputLedger(Clock())
    ledger.groups_submitted(len(groups))
    ready_tokens = 0
    for i, (samples, tokens, outcome) in enumerate(groups):
        ledger.group_ready(i, samples, tokens)
        ready_tokens += tokens
        if outcome is not None:
            ledger.settle(i, outcome)
    assert ledger.settled_groups + ledger.in_flight_groups == len(groups)
    assert sum(ledger.tokens.values()) + ledger.ready_tokens == ready_tokens
    assert ledger.ready_groups == sum(1 for g in groups if g[2] is None)


def test_a_checkpointed_ledger_resumes_its_counts_and_elapsed_time():
    clock = Clock()
    ledger = GoodputLedger(clock)
    ledger.groups_submitted(3)
    ledger.group_ready("a", 2, 100)
    ledger.group_ready("b", 2, 50)
    ledger.settle("a", Outcome.CONSUMED)
    clock.t += 10
    state = ledger.state_dict()
    import json

    state = json.loads(json.dumps(state))  # it is written as JSON
    clock.t += 1000  # the restart took a while: not counted
    resumed = GoodputLedger(clock)
    resumed.load_state_dict(state)
    assert resumed.goodput() == pytest.approx(10.0)
    assert resumed.in_flight_groups == 2 and resumed.ready_groups == 1 and resumed.is_known("b")
    resumed.settle("b", Outcome.DROPPED_STALE)
    assert resumed.tokens[Outcome.DROPPED_STALE] == 50 and resumed.tokens[Outcome.CONSUMED] == 100


def test_the_ledger_check_compares_settled_and_held_groups_with_the_submitted_ones():
    ledger = GoodputLedger(clock=lambda: 0.0)
    ledger.groups_submitted(3)
    ledger.group_ready("a", 2, 10)
    ledger.settle("a", Outcome.CONSUMED)
    assert ledger.check(held=2) is None
    # a group that vanished from the buffer without an outcome, or one held twice: the check says so
    assert "1 groups settled + 1 held in the buffer != 3 submitted" in ledger.check(held=1)
    assert ledger.check(held=3) is not None
    assert ledger.check(held=-1) is not None


def test_an_imbalance_is_a_metric_and_past_the_tolerance_stops_the_job_with_the_counts(capsys):
    """trainer tide's boundary report (`trainer/reporting.ledger_metrics`) against a replay buffer that holds one
    group fewer than the ledger thinks: the metric says -1... +1, and with no tolerance the job stops."""
    from verl_tide.core.ledger import LedgerImbalanceError
    from verl_tide.trainer.reporting import ledger_metrics

    class Buffer:  # what the report reads of trainer tide's replay buffer: groups held in TransferQueue
        stamped = {"at_finish": 3}

        def __init__(self, held: int):
            self.held = held

        def groups_held(self) -> int:
            return self.held

    ledger = GoodputLedger(clock=lambda: 0.0)
    ledger.groups_submitted(3)
    ledger.group_ready("a", 2, 10)
    ledger.settle("a", Outcome.CONSUMED)
    m = ledger_metrics(ledger, Buffer(2), step=1)
    assert m["tide/ledger/imbalance"] == 0 and m["tide/ledger/groups_held"] == 2
    # a group lost without an outcome: submitted 3, settled 1, held 1
    m = ledger_metrics(ledger, Buffer(1), step=2, tolerance=1)
    assert m["tide/ledger/imbalance"] == 1 and "does not balance" in capsys.readouterr().out
    with pytest.raises(LedgerImbalanceError, match=r"step 3: .*1 groups settled \+ 1 held in the buffer != 3 "
                                                   r"submitted.*consumed 1.*tide.ledger_tolerance = 0"):
        ledger_metrics(ledger, Buffer(1), step=3)
