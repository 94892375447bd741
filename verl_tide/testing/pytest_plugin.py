"""pytest fixtures of the CPU test bed. Enable with `pytest_plugins = ["verl_tide.testing.pytest_plugin"]`.

Expensive things are built once per session (tiny model, data) or once per module (a Ray
cluster); every Ray cluster started here is shut down, and /dev/shm is cleaned after it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from verl_tide.testing.testbed import spawn_env_service  # noqa: F401  (re-exported for tests)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from verl_tide.testing.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_path))


@pytest.fixture(scope="session")
def grpo_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from verl_tide.testing.tiny_model import write_gsm8k_style_parquet

    root = tmp_path_factory.mktemp("grpo_data")
    return {
        "train": write_gsm8k_style_parquet(root / "train.parquet", 16, seed=0),
        "val": write_gsm8k_style_parquet(root / "val.parquet", 4, seed=1),
    }


@pytest.fixture(scope="module")
def ray_cpu_cluster() -> Iterator[None]:
    """A local Ray cluster with 2 fake GPUs and the CPU test bed's environment in every process."""
    import ray

    from verl_tide.testing.platform import TEST_BED_ENV, register_cpu_platform
    from verl_tide.testing.testbed import run_scratch

    with run_scratch() as scratch_env:
        env = {**TEST_BED_ENV, **scratch_env}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        register_cpu_platform()  # this process imported verl before VERL_PLATFORM was set
        ray.init(num_cpus=8, num_gpus=2, include_dashboard=False, runtime_env={"env_vars": env})
        try:
            yield
        finally:
            ray.shutdown()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@pytest.fixture(scope="module")
def env_service_url() -> Iterator[str]:
    """The reference environment server for a test module; stopped (SIGTERM) afterwards."""
    import signal

    proc, url = spawn_env_service("--session-timeout", "600")
    try:
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
