"""tide's own checkpoint state, beside verl's: `tide_state.json` in each `global_step_N` folder.

Why: verl's checkpoint restores the Actor, the dataloader and TransferQueue (ready and in-flight groups);
a resumed tide job must also continue the goodput ledger, CTB's counters and group probes, ERS's cooldowns,
the ranks' roles, and which samples already carry ref log-probs. Nothing here touches verl.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import MutableMapping
from typing import Any, Optional

from verl_tide.ers.policy import RankMove, Role

logger = logging.getLogger(__name__)

TIDE_STATE = "tide_state.json"


def step_folder(trainer_config: Any, global_steps: int) -> str:
    """The folder verl resumes from (or saves into) for this step, absolute."""
    if trainer_config.resume_mode == "resume_path" and trainer_config.resume_from_path:
        folder = str(trainer_config.resume_from_path)
    else:
        folder = os.path.join(trainer_config.default_local_dir, f"global_step_{global_steps}")
    return folder if os.path.isabs(folder) else os.path.join(os.getcwd(), folder)


def save_state(trainer_config: Any, global_steps: int, state: dict[str, Any]) -> str:
    """Write `state` next to verl's checkpoint of this step; returns the path."""
    path = os.path.join(trainer_config.default_local_dir, f"global_step_{global_steps}", TIDE_STATE)
    with open(path, "w") as f:
        json.dump(state, f)
    return path


def load_state(folder: str) -> Optional[dict[str, Any]]:
    """The state saved in `folder`, or None (with a warning) for a checkpoint another trainer wrote."""
    path = os.path.join(folder, TIDE_STATE)
    if not os.path.exists(path):
        logger.warning("verl-tide: %s has no %s (a checkpoint of another trainer?): counting from zero",
                       folder, TIDE_STATE)
        return None
    with open(path) as f:
        return json.load(f)


def tide_state(global_steps: int, ledger: Any, ctb_state: Optional[dict], ers: Any, roles: MutableMapping[int, Role],
               aggregator: Any) -> dict[str, Any]:
    """What `tide_state.json` holds: the ledger, CTB's router state, ERS's cooldowns, the ranks' roles, and the
    samples already carrying ref log-probs in the checkpointed TransferQueue."""
    return {"global_steps": global_steps, "ledger": ledger.state_dict(), "ctb": ctb_state, "ers": ers.state_dict(),
            "rollout_roles": {str(r): role.value for r, role in roles.items()},
            "ra2p_aggregation": aggregator.state_dict()}


def restore(state: dict[str, Any], ledger: Any, readiness: Any, ers: Any, aggregator: Any, rows_kept: bool) -> None:
    """The ledger (its ready groups back in the readiness tracker: TransferQueue restored them as ready), ERS's
    cooldowns, and RA2P's record of samples scored ahead; with the hand-off (`rows_kept=False`) their rows lived
    in processes that are gone, so they are scored again."""
    ledger.load_state_dict(state["ledger"])
    for uid, (samples, _tokens) in ledger.ready().items():
        readiness.micro_batch_ready(uid, max(samples, 1))
    # (checkpoints before the planner kept ERS's cooldowns under "ers_last_moved")
    ers.load_state_dict(state.get("ers") or {"last_moved": state.get("ers_last_moved", {})})
    aggregation = state.get("ra2p_aggregation", {})
    aggregator.load_state_dict(aggregation if rows_kept else {**aggregation, "scored": []})


def roles_of(state: dict[str, Any]) -> dict[int, Role]:
    return {int(r): Role(role) for r, role in state.get("rollout_roles", {}).items()}


def moves_to_restore(restored: dict[int, Role], roles: MutableMapping[int, Role], have_elastic: bool
                     ) -> list[RankMove]:
    """Replicas start as rollout; ranks that were Ref when the checkpoint was taken switch again (those that
    still exist). Without elastic ranks there is nothing to switch: every rank starts as rollout."""
    moves = [RankMove(rank, Role.ROLLOUT, Role.REF) for rank, role in sorted(restored.items())
             if role is Role.REF and rank in roles]
    if moves and not have_elastic:
        print(f"verl-tide WARNING: the checkpoint had {len(moves)} elastic Ref rank(s), this job has no Ref pool "
              "(tide.ra2p.ref_ranks = 0 or ERS off): every rank starts as rollout", flush=True)
        return []
    return moves
