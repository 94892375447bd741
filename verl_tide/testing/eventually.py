"""Wait for a condition instead of sleeping a fixed time: tests must not depend on the machine's pace."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def eventually(condition: Callable[[], bool], timeout_s: float = 10.0, every_s: float = 0.02) -> None:
    """Return as soon as `condition()` holds; fail with AssertionError after `timeout_s` (a generous bound: only
    a broken behaviour, never a slow machine, reaches it)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition still false after {timeout_s} s")
        await asyncio.sleep(every_s)
