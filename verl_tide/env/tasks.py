"""RL rows (parquet) for the `tide_env_agent` loop: one episode of a served environment a row
(`verl-tide env tasks`)."""

from __future__ import annotations

from pathlib import Path


def write_env_task_parquet(path: str | Path, n: int, env: str = "tiny", seed: int = 0,
                           prompt: str = "Play the game. Answer with one number.",
                           task: dict | None = None, row_task: dict[int, dict] | None = None) -> Path:
    """RL rows for the `tide_env_agent` loop: a system prompt and `extra_info.tide_env` per row (`task`: what
    /start passes to the environment's reset; default the guessing game's range; `row_task`: more fields for
    some rows, by index, e.g. an injected fault)."""
    task = {"low": 1, "high": 16} if task is None else task
    row_task = row_task or {}
    import pandas as pd

    rows = [
        {
            "data_source": f"tide_env/{env}",
            "prompt": [{"role": "system", "content": prompt}],
            "ability": "agent",
            "reward_model": {"style": "env", "ground_truth": ""},
            # (Parquet has no empty struct: an empty task is left out, and /start gets none)
            "extra_info": {"index": i, "tide_env": {"env": env, **({"task": {**task, **row_task.get(i, {})}}
                                                                  if task or row_task.get(i) else {}),
                                                    "seed": seed + i}},
        }
        for i in range(n)
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)
    return path
