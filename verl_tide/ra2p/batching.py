"""RA2P's micro-batch planning (paper Sec. 5.1, "Micro-Batch Dispatching"). Pure Python.

- Early micro-batches are accumulated until they hold enough tokens to saturate every DP rank;
  the final micro-batch is kept as small as possible, to shorten the pipeline-flush bubble.
- Colocated mode: sequences go to DP ranks in zig-zag (snake) order of decreasing length,
  so every rank gets nearly the same token load.
- Decoupled mode: the sequences are fed longest first, so the last one into the pipeline is the
  smallest and the last rank finishes its backward as early as possible.
"""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(seq_lens: Sequence[int], dp_ranks: int, tokens_per_rank: int) -> list[list[int]]:
    """Group ready sequences (by index) into micro-batches.

    Every micro-batch but the last holds at least `dp_ranks * tokens_per_rank` tokens when enough
    remain (so all ranks are busy); the last one holds the `dp_ranks` shortest sequences (one per
    rank), or fewer if there are fewer sequences.
    """
    if dp_ranks < 1 or tokens_per_rank < 1:
        raise ValueError(f"dp_ranks = {dp_ranks}, tokens_per_rank = {tokens_per_rank}: both must be >= 1")
    if any(n <= 0 for n in seq_lens):
        raise ValueError("every sequence length must be > 0")
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    if not order:
        return []
    final = order[-dp_ranks:] if len(order) > dp_ranks else order
    rest = order[: len(order) - len(final)]
    target = dp_ranks * tokens_per_rank
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for i in rest:
        current.append(i)
        tokens += seq_lens[i]
        if tokens >= target and len(current) >= dp_ranks:
            batches.append(current)
            current, tokens = [], 0
    if current:  # too few tokens to saturate on their own: fold into the previous batch
        if batches:
            batches[-1].extend(current)
        else:
            batches.append(current)
    batches.append(final)
    return batches


def zigzag_partition(seq_lens: Sequence[int], dp_ranks: int) -> list[list[int]]:
    """Colocated dispatch: longest first, dealt to ranks 0..k-1, k-1..0, 0..k-1, ... (equal counts +-1)."""
    if dp_ranks < 1:
        raise ValueError(f"dp_ranks = {dp_ranks}: must be >= 1")
    order = sorted(range(len(seq_lens)), key=lambda i: (-seq_lens[i], i))
    parts: list[list[int]] = [[] for _ in range(dp_ranks)]
    for pos, i in enumerate(order):
        lap, off = divmod(pos, dp_ranks)
        parts[off if lap % 2 == 0 else dp_ranks - 1 - off].append(i)
    return parts


def smallest_last(indices: Sequence[int], seq_lens: Sequence[int]) -> list[int]:
    """Decoupled feed order: longest first, so the final sequence into the pipeline is the smallest."""
    return sorted(indices, key=lambda i: (-seq_lens[i], i))


def load_spread(parts: Sequence[Sequence[int]], seq_lens: Sequence[int]) -> tuple[int, int]:
    """(max, min) token load over the partitions."""
    loads = [sum(seq_lens[i] for i in p) for p in parts]
    return max(loads), min(loads)
