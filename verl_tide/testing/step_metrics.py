"""verl's console-logger step lines (`step:N - key:value - ...`) read back into numbers: what the test bed's
jobs and benchmarks measure a run by."""

from __future__ import annotations

import re
from typing import Optional

_STEP_LINE = re.compile(r"step:(\d+) - (.*)")
_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\([^)]*\)(?:\x1b\[0m)?\s?")


def parse_step_metrics(output: str, key_by: Optional[str] = None) -> dict[int, dict[str, float]]:
    """verl's console-logger lines `step:N - key:value - ...` as {N: {key: value}} (numeric values only; of two
    lines of one N, the later). `key_by`: a metric whose value numbers the line instead of N (a line without it
    is left out): verl's fully_async trainer logs a step's metrics under a later N, naming the step in
    `training/global_step`.

    Ray's log forwarding can split one long line: a line of the same process whose text (after Ray's
    `(Actor pid=...)` prefix) starts with `- ` continues the step line before it (seen once in 24 steps of 6 kB
    metrics lines; the continuation held `.../global_step:13 - `, which a search anywhere in the line took for a
    new step line); so does any line of that process while the step line ends mid-separator (` -`), with other
    processes' lines and tqdm's progress bar in between (seen 2026-12-04: step 4's line cut after 924 characters,
    its rest 10 lines on)."""
    texts: list[tuple[int, str]] = []  # (N, the line's text after `step:N - `), in order
    last: Optional[int] = None  # index into texts
    last_prefix = ""
    for line in output.splitlines():
        prefix_match = _RAY_PREFIX.match(line)
        prefix = prefix_match.group(0) if prefix_match else ""
        rest = line[len(prefix):]
        m = _STEP_LINE.match(rest)  # at the start: a metric such as `training/global_step:13 - ` is no step line
        if m:
            texts.append((int(m.group(1)), m.group(2)))
            last, last_prefix = len(texts) - 1, prefix
            continue
        if last is None:
            continue
        n, text = texts[last]
        cut = text.rstrip().endswith(" -")
        if prefix == last_prefix and (rest.startswith("- ") or cut):
            texts[last] = (n, text.rstrip() + " " + rest.strip())
        elif prefix == last_prefix or not cut:
            last = None
    steps: dict[int, dict[str, float]] = {}
    for n, text in texts:
        metrics = {}
        for item in text.split(" - "):
            key, _, value = item.strip().rpartition(":")
            try:
                metrics[key] = float(re.sub(r"^np\.\w+\((.*)\)$", r"\1", value.strip()))
            except ValueError:
                pass
        if key_by is None:
            steps[n] = metrics
        elif key_by in metrics:
            steps[int(metrics[key_by])] = metrics
    return steps
