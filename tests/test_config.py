"""The `tide:` schema: defaults, the YAML that shows them, and clear errors for bad values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from verl_tide.core.config import TideConfig, TideConfigError, defaults_as_dict, parse_tide_config

ENABLED_YAML = Path(__file__).resolve().parents[1] / "verl_tide" / "conf" / "tide" / "enabled.yaml"


def _error(raw: dict) -> TideConfigError:
    with pytest.raises(TideConfigError) as info:
        parse_tide_config(raw)
    return info.value


def test_empty_subtree_gives_defaults():
    assert parse_tide_config({}) == TideConfig()
    assert parse_tide_config(None) == TideConfig()


def test_enabled_yaml_shows_exactly_the_schema_defaults():
    doc = yaml.safe_load(ENABLED_YAML.read_text())
    assert doc["tide"] == defaults_as_dict()
    assert doc["trainer"]["v1"]["trainer_mode"] == "tide"
    assert ENABLED_YAML.read_text().startswith("# @package _global_")


def test_paper_defaults():
    cfg = TideConfig()
    assert cfg.ers.max_moves_per_step == 1
    assert cfg.ra2p.mode == "auto"
    assert cfg.ers.lend_actor == "auto"  # issue 27: lend by default where the job allows it
    for setting in ("auto", True, False):
        assert parse_tide_config({"ers": {"lend_actor": setting}}).ers.lend_actor is setting
    w = cfg.ctb.priority
    # Table 1 order: eval > nearly complete group > active > long context (up to 100k tokens).
    assert w.eval > w.group_completion * 1.0 > w.active > w.context_length * 100_000


@pytest.mark.parametrize(
    "raw, key, allowed",
    [
        ({"ctb": {"kv_headroom": 0}}, "tide.ctb.kv_headroom = 0", "0 < x <= 1"),
        ({"ctb": {"kv_headroom": 1.5}}, "tide.ctb.kv_headroom = 1.5", "0 < x <= 1"),
        ({"ctb": {"kv_headroom": "high"}}, "tide.ctb.kv_headroom = 'high'", "finite number"),
        ({"ra2p": {"mode": "pipelined"}}, "tide.ra2p.mode = 'pipelined'", "auto | decoupled | colocated | split"),
        ({"ers": {"tau": 0}}, "tide.ers.tau = 0", "> 0"),
        ({"ers": {"tau": -2.0}}, "tide.ers.tau = -2.0", "> 0"),
        ({"ers": {"min_batch": 64, "ideal_batch": 32}}, "tide.ers.min_batch = 64", "<= tide.ers.ideal_batch"),
        ({"ers": {"min_batch": 0}}, "tide.ers.min_batch = 0", ">= 1"),
        ({"ctb": {"enabled": "yes"}}, "tide.ctb.enabled = 'yes'", "true or false"),
        ({"ctb": {"kv_headroom_frac": 0.5}}, "tide.ctb.kv_headroom_frac", "allowed keys: enabled, kv_headroom"),
        ({"erss": {}}, "tide.erss", "allowed keys: max_staleness, staleness_strategy, overlap_eval, max_rank_restarts, sample_poll_s, ledger_tolerance, ctb, ra2p, ers, env, metrics"),
        ({"metrics": {"port": 70000}}, "tide.metrics.port = 70000", "0..65535"),
        ({"max_staleness": True}, "tide.max_staleness = True", "integer"),
        ({"staleness_strategy": "skip"}, "tide.staleness_strategy = 'skip'", "drop | wait"),
        ({"ers": 3}, "tide.ers = 3", "must be a mapping"),
        ({"ers": {"lend_actor": "yes"}}, "tide.ers.lend_actor = 'yes'", "auto | true | false"),
        ({"ers": {"lend_actor": 1}}, "tide.ers.lend_actor = 1", "auto | true | false"),  # 1 == True, not true
    ],
)
def test_bad_value_names_key_value_and_allowed(raw, key, allowed):
    message = str(_error(raw))
    assert key in message
    assert allowed in message


def test_all_problems_reported_together():
    err = _error({"ctb": {"kv_headroom": 2}, "ra2p": {"mode": "x"}, "ers": {"tau": 0}})
    assert len(err.problems) == 3


def test_valid_overrides_are_kept():
    cfg = parse_tide_config({"ctb": {"kv_headroom": 1}, "ra2p": {"mode": "decoupled"},
                             "ers": {"tau": 0.5, "min_batch": 8, "ideal_batch": 8}})
    assert cfg.ctb.kv_headroom == 1.0 and isinstance(cfg.ctb.kv_headroom, float)
    assert cfg.ra2p.mode == "decoupled"
    assert (cfg.ers.tau, cfg.ers.min_batch, cfg.ers.ideal_batch) == (0.5, 8, 8)


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_kv_headroom_accepts_exactly_the_half_open_unit_interval(x):
    ok = x == x and 0 < x <= 1  # NaN fails x == x
    if ok:
        assert parse_tide_config({"ctb": {"kv_headroom": x}}).ctb.kv_headroom == x
    else:
        assert "tide.ctb.kv_headroom" in str(_error({"ctb": {"kv_headroom": x}}))


@given(st.integers(min_value=1, max_value=10_000), st.integers(min_value=1, max_value=10_000))
def test_batch_bounds_ordering(b_min, b_ideal):
    raw = {"ers": {"min_batch": b_min, "ideal_batch": b_ideal}}
    if b_min <= b_ideal:
        assert parse_tide_config(raw).ers.min_batch == b_min
    else:
        assert "B_min <= B_ideal" in str(_error(raw))
