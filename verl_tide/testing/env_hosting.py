"""A registered environment hosted by the reference server for a test, and unregistered afterwards."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from verl_tide.env.envs import ENVIRONMENTS, PRESETS
from verl_tide.env.server import EnvServer, ServerConfig


@asynccontextmanager
async def hosted(name: str, clock: Callable[[], float] = time.monotonic,
                 **config: object) -> AsyncIterator[tuple[EnvServer, str]]:
    """Serve the environment registered as `name` (the server's default, no latency); yields (server, URL);
    stops the server and takes `name` out of the registry on exit (tests register under their own names)."""
    server = EnvServer(ServerConfig(**{"latency_scale": 0.0, "default_env": name, **config}), clock=clock)
    try:
        yield server, await server.start()
    finally:
        await server.stop()
        ENVIRONMENTS.pop(name, None)
        PRESETS.pop(name, None)
