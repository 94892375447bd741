"""Typed schema of the `tide:` config subtree and its validation.

Pure Python (no verl, omegaconf or torch): the Hydra callback, the trainer and the
simulator all hand a plain mapping to `parse_tide_config`, so a bad value is rejected
the same way wherever it enters. Every error names the full key, the value given and
what is allowed; all errors of one config are reported together.

Defaults follow the TideRL paper where it gives one (ERS moves at most one rank per
step; CTB priority order eval > group completion > active > context length, Table 1)
and are otherwise conservative. `conf/tide/enabled.yaml` repeats them so that
`--cfg job` shows them; a test keeps the two equal.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

RA2P_MODES = ("auto", "decoupled", "colocated")


class TideConfigError(ValueError):
    """One or more `tide.*` values are invalid; the message lists each as `key = value: allowed`."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid verl-tide config ({len(self.problems)} problem(s)):\n{lines}")

    def __repr__(self) -> str:  # Hydra prints repr() of errors raised while instantiating
        return f"{type(self).__name__}: {self}"


@dataclass(frozen=True)
class Check:
    """A range rule for one numeric field: `ok(value)` and how to say what is allowed."""

    ok: Callable[[Any], bool]
    allowed: str


def _check(ok: Callable[[Any], bool], allowed: str, help: str) -> dict[str, Any]:
    return {"check": Check(ok, allowed), "help": help}


def _help(text: str) -> dict[str, Any]:
    return {"help": text}


@dataclass(frozen=True)
class PriorityWeights:
    """Weights of CTB's pause/resume priority P(t) = w1*eval + w2*G_completion + w3*active + w4*L_context."""

    eval: float = field(default=1000.0, metadata=_check(lambda x: x >= 0, ">= 0", "w1, evaluation tasks"))
    group_completion: float = field(
        default=100.0, metadata=_check(lambda x: x >= 0, ">= 0", "w2, times the GRPO group's finished fraction")
    )
    active: float = field(default=10.0, metadata=_check(lambda x: x >= 0, ">= 0", "w3, task is generating now"))
    context_length: float = field(
        default=1e-5, metadata=_check(lambda x: x >= 0, ">= 0", "w4, per token of current context")
    )


@dataclass(frozen=True)
class CTBConfig:
    """Continuous Task Batching on the rollout ranks (paper Sec. 4, Alg. 1)."""

    enabled: bool = field(default=True, metadata=_help("false gives verl's stock request routing"))
    kv_headroom: float = field(
        default=0.9,
        metadata=_check(lambda x: 0 < x <= 1, "0 < x <= 1", "fraction of a rank's KV capacity CTB may fill"),
    )
    probe_first_turn: bool = field(
        default=True, metadata=_help("probe one task per GRPO group to learn the first-turn footprint")
    )
    env_concurrency: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0 (0 = unlimited)", "cap on active environment sessions")
    )
    budget_scope: Literal["resident", "active"] = field(default="resident", metadata=_help(
        "what a rank's token budget bounds: resident (paper Alg. 1), every resident task's context, also while it "
        "waits on its environment (its prefix stays cached); active, only tasks with a turn in flight or due (a "
        "waiting task's KV is evictable cache: more tasks progress, a returning one may re-prefill). active pays "
        "where re-prefill is cheap, resident where it is dear (docs/ctb.md)"))
    diversity_penalty: float = field(
        default=0.1,
        metadata=_check(lambda x: x >= 0, ">= 0", "penalty per task of the same type already on a rank"),
    )
    max_budget_factor: float = field(default=8.0, metadata=_check(lambda x: x >= 1, ">= 1 (1 = Alg. 1's fixed budget)", (
        "how far the step-boundary planner may scale every rank's token budget past KV capacity x kv_headroom: "
        "doubled while work waits for budget, halved (and capped there) when the engines' prefix-cache hit rate "
        "falls 0.1 below the fixed budget's (ctb/window.py; trainer tide only)")))
    window_interval_s: float = field(default=2.0, metadata=_check(lambda x: x >= 0, ">= 0 (0 = at step boundaries only)", (
        "while the trainer waits for data, the budget window also decides every this many seconds, over the rollout "
        "since it last decided (the cold start, where nothing is ready to train, is the first such wait)")))
    priority: PriorityWeights = field(default_factory=PriorityWeights)


@dataclass(frozen=True)
class RA2PConfig:
    """Resource-Aware Ref-Actor Pipelining on the trainer (paper Sec. 5.1, App. A)."""

    mode: Literal["auto", "decoupled", "colocated", "split"] = field(
        default="auto", metadata=_help("auto picks per step from the cost model; split: Ref replicas score a share "
                                       "of each Ref pass beside verl's Ref (needs both)")
    )
    hysteresis: float = field(
        default=0.1,
        metadata=_check(lambda x: 0 <= x < 1, "0 <= x < 1", "relative cost margin before auto mode switches"),
    )
    actors_per_ref_rank: int = field(
        default=4, metadata=_check(lambda x: x >= 1, ">= 1", "Actor ranks one decoupled Ref rank serves")
    )
    zero_copy: bool = field(default=True, metadata=_help(
        "hand-off of ref log-probs to the Actor's loss outside TransferQueue: colocated, from verl's Ref role in "
        "the Actor's own process; from Ref replicas, through Ray's shared-memory object store; false: verl's "
        "TransferQueue path (colocated) and serialization through the Ref service actor (decoupled)"))
    max_aggregate: Optional[int] = field(
        default=None,
        metadata=_check(lambda x: x >= 0, ">= 0 or null (null = the rest of the weight-sync window)",
                        "ready GRPO groups one colocated Ref pass scores beyond the mini-batch in training "
                        "(ready-batch aggregation; 0 = a Ref pass per mini-batch, verl's order)"),
    )
    ref_ranks: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0", "Ref replicas on GPUs of their own (decoupled "
                                   "placement); 0 = verl's Ref on the trainer's GPUs")
    )


@dataclass(frozen=True)
class ERSConfig:
    """Elastic Resource Scaling between rollout and Ref at the weight-sync boundary (paper Sec. 5.2)."""

    enabled: bool = field(default=True, metadata=_help("false keeps every rank in its starting role"))
    lend_actor: Literal["auto", True, False] = field(default="auto", metadata=_help(
        "the Actor's GPUs also roll out (verl's hybrid replicas) while the trainer has nothing to train: the cold "
        "start, evaluations, waits after an update, as ERS decides; auto: on unless the job has a Ref model or "
        "actor_rollout_ref.hybrid_engine=false (ers/lending.py: resolve_lend_actor)"))
    lend_kv_bound: float = field(
        default=0.25, metadata=_check(lambda x: 0 <= x <= 1, "0 <= x <= 1",
                                      "after an update, lend the Actor's GPUs only if the rollout waited for KV "
                                      "budget at least this share of its working time (more GPUs would have run "
                                      "that work; 0: whenever the wait pays for the switch)"))
    lend_trials: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0",
                                   "after an update, step cycles ERS tries each way (the Actor's GPUs lent, kept; "
                                   "alternating) before the measured cycle times decide lending instead of the "
                                   "model (lend_kv_bound); 0: the model alone"))
    resize_trainer: bool = field(default=False, metadata=_help(
        "the Actor's training group grows by a rollout replica's GPUs when the trainer bounds the step cycle and "
        "gives them back when rollout does, at the weight-sync boundary (ers/resize.py decides; one node; a Ref "
        "model runs on the Actor's GPUs and moves with them; no tide Ref replicas, critic or lending)"))
    resize_move_s: Optional[float] = field(
        default=None, metadata=_check(lambda x: x >= 0, ">= 0 or null (null = measured at start-up)",
                                      "seconds a trainer resize is assumed to stop training until one is measured "
                                      "(a move must repay it over the steps left)"))
    tau: float = field(
        default=1.0,
        metadata=_check(lambda x: x > 0, "> 0", "head-of-line threshold as a multiple of the mean step time"),
    )
    min_batch: Optional[int] = field(
        default=None,
        metadata=_check(lambda x: x >= 1, ">= 1 or null (null = ideal_batch)",
                        "B_min, smallest trainable batch, in sequences"),
    )
    ideal_batch: Optional[int] = field(
        default=None,
        metadata=_check(lambda x: x >= 1, ">= 1 or null (null = data.train_batch_size x actor_rollout_ref.rollout.n)",
                        "B_ideal, in sequences (the unit of the ready volume)"),
    )
    max_moves_per_step: int = field(
        default=1, metadata=_check(lambda x: x >= 0, ">= 0", "ranks that may change role per step")
    )
    cooldown_steps: int = field(
        default=3, metadata=_check(lambda x: x >= 0, ">= 0", "steps before a moved rank may move back")
    )
    min_rollout_ranks: int = field(default=1, metadata=_check(lambda x: x >= 1, ">= 1", "rollout ranks kept"))
    max_ref_ranks: Optional[int] = field(
        default=None, metadata=_check(lambda x: x >= 0, ">= 0 or null (no cap)", "Ref ranks ERS may create")
    )
    min_ref_ranks: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0",
                                   "elastic ranks kept as Ref while training (evaluation borrows them back)")
    )
    min_ref_gain: float = field(
        default=0.02, metadata=_check(lambda x: 0 <= x < 1, "0 <= x < 1",
                                      "step-time saving RA2P's cost model must predict before a rollout rank "
                                      "moves to Ref")
    )
    split_advice_kv_bound: float = field(
        default=0.5, metadata=_check(lambda x: 0 < x <= 1, "0 < x <= 1",
                                     "share of the rollout's working time work must wait for KV budget before "
                                     "ERS advises more rollout GPUs (tide/ers/advised_rollout_gpus)")
    )


@dataclass(frozen=True)
class EnvConfig:
    """Client side of the environment service (/start /observation /end /pause /resume)."""

    url: Optional[str] = field(default=None, metadata=_help("base URL of the environment service; null = none"))
    request_timeout_s: float = field(
        default=30.0, metadata=_check(lambda x: x > 0, "> 0", "timeout of every environment call")
    )
    max_retries: int = field(default=3, metadata=_check(lambda x: x >= 0, ">= 0", "retries of transient errors"))
    session_timeout_s: float = field(
        default=240.0, metadata=_check(lambda x: x > 0, "> 0", "inactivity timeout, frozen while paused")
    )
    max_payload_bytes: int = field(
        default=1 << 20, metadata=_check(lambda x: x > 0, "> 0", "largest request or response body")
    )
    max_tokens_per_turn: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0 (0 = no cap)", "generated tokens per action")
    )


@dataclass(frozen=True)
class MetricsConfig:
    """Prometheus exporter of CTB/RA2P/ERS signals."""

    enabled: bool = field(default=True, metadata=_help("serve /metrics"))
    host: str = field(default="127.0.0.1", metadata=_help("bind address; loopback unless you open it"))
    port: int = field(
        default=0, metadata=_check(lambda x: 0 <= x <= 65535, "0..65535 (0 = any free port)", "exporter port")
    )


@dataclass(frozen=True)
class TideConfig:
    """The whole `tide:` subtree."""

    max_staleness: int = field(
        default=1, metadata=_check(lambda x: x >= 0, ">= 0", "policy versions a trajectory may lag the trainer")
    )
    staleness_strategy: Literal["drop", "wait"] = field(
        default="drop", metadata=_help("drop: a group over max_staleness is dropped and counted; wait: the "
                                       "trainer waits for in-flight groups about to exceed it (nothing dropped)")
    )
    overlap_eval: bool = field(
        default=True, metadata=_help("run step i's evaluation during step i+1's rollout on step-i weights "
                                     "(false: verl's blocking validation between steps)")
    )
    max_rank_restarts: int = field(
        default=2, metadata=_check(lambda x: x >= 0, ">= 0", "times a quarantined rollout rank's server is "
                                   "relaunched (in the background; it rejoins at a weight sync); 0 = never")
    )
    sample_poll_s: float = field(
        default=0.2, metadata=_check(lambda x: 0 < x <= 10, "> 0 and <= 10", "seconds between two looks of the "
                                     "trainer's sampler at TransferQueue for ready groups (verl's own: 2 s)")
    )
    ledger_tolerance: int = field(
        default=0, metadata=_check(lambda x: x >= 0, ">= 0", "groups the goodput ledger may be out of balance at a "
                                   "step boundary (settled + held in TransferQueue against submitted) before the "
                                   "job stops with the counts; tide/ledger/imbalance reports it every step")
    )
    ctb: CTBConfig = field(default_factory=CTBConfig)
    ra2p: RA2PConfig = field(default_factory=RA2PConfig)
    ers: ERSConfig = field(default_factory=ERSConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)


def parse_tide_config(raw: Optional[Mapping[str, Any]], prefix: str = "tide") -> TideConfig:
    """Build a `TideConfig` from a plain mapping, or raise `TideConfigError` naming every bad key."""
    problems: list[str] = []
    cfg = _build(TideConfig, raw if raw is not None else {}, prefix, problems)
    _check_cross_fields(cfg, prefix, problems)
    if problems:
        raise TideConfigError(problems)
    return cfg


def defaults_as_dict() -> dict[str, Any]:
    """The default `tide:` subtree as plain data (what `enabled.yaml` must show)."""
    return dataclasses.asdict(TideConfig())


def _check_cross_fields(cfg: TideConfig, prefix: str, problems: list[str]) -> None:
    ers = cfg.ers
    if ers.min_batch is not None and ers.ideal_batch is not None and ers.min_batch > ers.ideal_batch:
        problems.append(
            f"{prefix}.ers.min_batch = {ers.min_batch}: must be <= {prefix}.ers.ideal_batch "
            f"(= {ers.ideal_batch}); B_min <= B_ideal"
        )
    if ers.resize_trainer and ers.lend_actor is True:
        problems.append(f"{prefix}.ers.resize_trainer = true with {prefix}.ers.lend_actor = true: a lent replica "
                        f"lives in the Actor's processes, which a resize rebuilds; set one of them false")
    if ers.resize_trainer and not ers.enabled:
        problems.append(f"{prefix}.ers.resize_trainer = true with {prefix}.ers.enabled = false: set ers.enabled true")
    if ers.resize_trainer and (cfg.ra2p.ref_ranks > 0 or ers.min_ref_ranks > 0 or ers.max_ref_ranks):
        problems.append(f"{prefix}.ers.resize_trainer = true with tide's Ref replicas ({prefix}.ra2p.ref_ranks, "
                        f"{prefix}.ers.min_ref_ranks, {prefix}.ers.max_ref_ranks): not built; set them 0")
    if ers.max_ref_ranks is not None and ers.min_ref_ranks > ers.max_ref_ranks:
        problems.append(
            f"{prefix}.ers.min_ref_ranks = {ers.min_ref_ranks}: must be <= {prefix}.ers.max_ref_ranks "
            f"(= {ers.max_ref_ranks})"
        )


def _build(cls: type, raw: Any, path: str, problems: list[str]) -> Any:
    if not isinstance(raw, Mapping):
        problems.append(f"{path} = {raw!r}: must be a mapping with keys {_names(cls)}")
        return cls()
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            problems.append(f"{path}.{key} = {raw[key]!r}: unknown key; allowed keys: {_names(cls)}")
    values: dict[str, Any] = {}
    for name, f in known.items():
        if name not in raw:
            continue
        value = _coerce(hints[name], raw[name], f"{path}.{name}", problems)
        check: Optional[Check] = f.metadata.get("check")
        if value is not _INVALID and value is not None and check is not None and not check.ok(value):
            problems.append(f"{path}.{name} = {raw[name]!r}: must be {check.allowed} ({f.metadata['help']})")
            value = _INVALID
        if value is not _INVALID:
            values[name] = value
    return cls(**values)


_INVALID = object()


def _coerce(tp: Any, value: Any, path: str, problems: list[str]) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Union:  # Optional[X]
        if value is None:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(inner, value, path, problems)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):  # 1 == True, but 1 is not true
            return value
        problems.append(f"{path} = {value!r}: must be one of {' | '.join(map(_literal_text, args))}")
        return _INVALID
    if tp is bool:
        if isinstance(value, bool):
            return value
        problems.append(f"{path} = {value!r}: must be true or false")
        return _INVALID
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        problems.append(f"{path} = {value!r}: must be an integer")
        return _INVALID
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        problems.append(f"{path} = {value!r}: must be a finite number")
        return _INVALID
    if tp is str:
        if isinstance(value, str):
            return value
        problems.append(f"{path} = {value!r}: must be a string")
        return _INVALID
    raise TypeError(f"schema type {tp!r} at {path} is not supported")  # a bug in this module, not user input


def _literal_text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))
