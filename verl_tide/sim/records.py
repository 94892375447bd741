"""What one simulated system is (`SystemSpec`), the tasks it runs (`Group`, `Traj`) and what it reports
(`StepRecord`, `Result`): the simulation's records, apart from the loop that moves them (`cluster.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, Optional

from verl_tide.ers.advice import SplitAdvice
from verl_tide.ra2p.cost import RA2PMode
from verl_tide.sim.engine import Request
from verl_tide.sim.stock import SWITCH_POLICIES



class Consume(str, Enum):
    """How a system's trainer takes ready data (a str: specs and JSON keep the plain name)."""

    GLOBAL = "global"  # the whole batch, then Ref and Actor (verl's V0 async)
    MINI_BATCH = "mini_batch"  # verl V1 separate_async / fully_async: PPO mini-batches as each is ready
    STREAM_SWAP = "stream_swap"  # StreamRL-like: micro-batches streamed, a Ref<->Actor swap each
    RA2P = "ra2p"  # tide


CONSUME_MODES = tuple(c.value for c in Consume)


@dataclass(frozen=True)
class SystemSpec:
    name: str
    sync: bool = False  # verl's synchronous colocated trainer
    rollout_ratio: float = 0.25  # asynchronous: fraction of GPUs that start as rollout ranks
    routing: str = "stock"  # stock | ctb
    consume: Consume = Consume.GLOBAL  # (a plain name is taken too)
    eval_blocks_trainer: bool = True
    elastic: bool = False  # ERS
    hybrid: bool = False  # verl separate_async hybrid replicas: idle trainer GPUs also roll out
    # tide.ers.lend_actor: the Actor's GPUs roll out (verl's hybrid replicas) from job start until the first step
    # can start, then after each update as ERS decides (`ers/lending.py`, through the boundary planner, as trainer
    # tide asks it): preemptively before an evaluation, else when the expected wait pays for the switch
    lend_actor: bool = False
    # ERS resizes the Actor's group, GPUs taken from rollout or given to it (`ers/resize.py`, as trainer tide with
    # tide.ers.resize_trainer); not with lending or hybrid replicas (both roll out on the Actor's GPUs)
    resize_trainer: bool = False
    # with `hybrid`: who decides when the replicas roll out: eager (whenever the trainer waits), or verl's own rule,
    # separate_async (its enable_switch) | fully_async_default (its dynamic schedule) (`sim/stock.py`); a verl
    # rule lends only after a weight sync and takes the replicas back once its threshold of the batch is ready
    hybrid_switch: str = "eager"
    parameter_sync_step: int = 4  # mini_batch: PPO mini-batches per weight sync (verl's default)
    poll_s: float = 0.0  # verl V1's sampler looks for ready data (and validation results) every poll_s (2 s)
    partial_rollout: bool = False  # an aborted request resumes with the tokens it had (verl's async modes)
    micro_batch_per_gpu: int = 8  # sequences per trainer GPU per micro-batch
    max_aggregate: int = 8  # RA2P colocated: micro-batches one Ref load may cover (memory cap)

    def __post_init__(self) -> None:
        if self.routing not in ("stock", "ctb"):
            raise ValueError(f"SystemSpec.routing = {self.routing!r}: must be stock | ctb")
        if self.consume not in CONSUME_MODES:
            raise ValueError(f"SystemSpec.consume = {self.consume!r}: must be {' | '.join(CONSUME_MODES)}")
        object.__setattr__(self, "consume", Consume(self.consume))
        if self.hybrid_switch not in SWITCH_POLICIES:
            raise ValueError(f"SystemSpec.hybrid_switch = {self.hybrid_switch!r}: must be "
                             f"{' | '.join(SWITCH_POLICIES)}")
        if self.parameter_sync_step < 1 or self.poll_s < 0:
            raise ValueError(f"SystemSpec.parameter_sync_step = {self.parameter_sync_step}, poll_s = {self.poll_s}: "
                             "must be >= 1 and >= 0")
        if self.resize_trainer and (self.lend_actor or self.hybrid or not self.elastic):
            raise ValueError(f"SystemSpec {self.name}: resize_trainer needs elastic=True and neither lend_actor nor "
                             "hybrid")
        if not 0 < self.rollout_ratio < 1:
            raise ValueError(f"SystemSpec.rollout_ratio = {self.rollout_ratio}: must be 0 < x < 1")


class MicroBatch(NamedTuple):
    """Ready sequences the trainer takes at once (a GRPO group's sequences may span two)."""

    mb_id: int
    ready_at: float
    sequences: int
    tokens: int
    tids: list


@dataclass
class OpenStep:
    """The asynchronous trainer's step being filled with ready micro-batches."""

    start: float
    ras: int  # micro-batches ready at the step's start
    mode: Optional[RA2PMode]  # RA2P's mode for the step (tide)
    share: float  # split mode: the Ref replicas' share of a pass
    mbs: list[MicroBatch] = field(default_factory=list)


@dataclass(eq=False)
class Group:
    gid: int
    step: int  # train step it belongs to; -1 for evaluation
    size: int
    prompt: int
    done: int = 0
    failed: int = 0
    tokens: list = field(default_factory=list)
    finished: list = field(default_factory=list)  # tids of its trajectories that finished (with `tokens`)

    @property
    def is_eval(self) -> bool:
        return self.step < 0


@dataclass(eq=False)
class Traj:
    tid: int
    group: Group
    actions: list
    observations: list
    latencies: list
    start_latency: float
    context: int
    trained_tokens: int
    turn: int = 0
    rank: Optional[int] = None
    generated: int = 0
    pending: bool = False  # its next turn is due but held (paused by CTB, or no rank yet)
    in_engine: Optional[Request] = None
    done: bool = False


@dataclass
class StepRecord:
    step: int
    start_s: float
    end_s: float
    micro_batches: int
    ready_at_start: int
    mode: str
    rollout_ranks: int
    ref_ranks: int
    plan: str = ""
    moves: list = field(default_factory=list)  # (rank, destination role) applied after this step


@dataclass
class Result:
    system: str
    gpus: int
    rollout_ratio: Optional[float]
    goodput_tok_s: float
    rwt_s: float
    twt_s: float
    kv_hit_rate: float
    step_time_s: float
    makespan_s: float
    consumed_tokens: int
    ledger: dict
    steps: list
    split_advice: Optional[SplitAdvice] = None  # ERS's last standing split advice (tide), None if none stood
    twt_ref_idle_s: float = 0.0  # of twt_s: Ref ranks idle beside the Actor's passes, not waiting for data
    rwt_sync_s: float = 0.0  # of rwt_s: rollout paused by weight syncs; the rest is rollout out of work
    twt_in_step_s: float = 0.0  # of twt_s: the Actor waiting for data inside steps (lending there could use it)

    def row(self) -> dict:
        return {"goodput_tok_s": round(self.goodput_tok_s, 1), "rwt_s": round(self.rwt_s, 1),
                "twt_s": round(self.twt_s, 1), "twt_ref_idle_s": round(self.twt_ref_idle_s, 1),
                "rwt_sync_s": round(self.rwt_sync_s, 1), "twt_in_step_s": round(self.twt_in_step_s, 1),
                "kv_hit_rate": round(self.kv_hit_rate, 4), "step_time_s": round(self.step_time_s, 2)}
