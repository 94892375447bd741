"""The resize's failure paths, with the worker groups stood in for (the real path: tests/test_ers_train_state.py)."""

from __future__ import annotations

import os

import pytest

from verl_tide.trainer import actor_group
from verl_tide.trainer.actor_group import ActorGroupLayout, resize_actor_group


class _Group:
    def __init__(self, world_size, log):
        self.world_size, self.log = world_size, log

    def export_train_state(self, path):
        open(os.path.join(path, "state"), "w").write(str(self.world_size))
        self.log.append(("export", self.world_size))

    def import_train_state(self, path):
        self.log.append(("import", self.world_size, open(os.path.join(path, "state")).read()))


@pytest.fixture
def world(monkeypatch):
    log, fail_at = [], set()

    def build(layout, n, gpu_wait_s=300.0):
        log.append(("build", n))
        if n in fail_at:
            raise RuntimeError(f"no placement for {n}")
        return {"actor": _Group(n, log)}, f"pool{n}"

    monkeypatch.setattr(actor_group, "build_actor_group", build)
    monkeypatch.setattr(actor_group, "stop_actor_group", lambda views, pool: log.append(("stop", pool)))
    monkeypatch.setattr(actor_group, "_free_gpus", lambda: 1.0)
    monkeypatch.setattr(actor_group, "_wait_for_gpus", lambda n, timeout_s: None if n <= 1 else
                        (_ for _ in ()).throw(TimeoutError()))
    return log, fail_at


LAYOUT = ActorGroupLayout(class_dict={"actor": None}, actor_role="actor", init_method={"actor": "init_model"})


def test_a_failed_build_rebuilds_the_old_size_from_the_saved_state(world, tmp_path):
    log, fail_at = world
    fail_at.add(2)
    views, pool, times = resize_actor_group(LAYOUT, {"actor": _Group(1, log)}, "pool1", 2, state_root=str(tmp_path))
    assert (times.world_from, times.world_to, views["actor"].world_size, pool) == (1, 1, 1, "pool1")
    assert log == [("export", 1), ("stop", "pool1"), ("build", 2), ("build", 1), ("import", 1, "1")]
    assert os.listdir(tmp_path) == []  # the state directory goes once a group holds the state


def test_when_the_old_size_fails_too_the_error_names_the_kept_state(world, tmp_path):
    log, fail_at = world
    fail_at.update({1, 2})
    with pytest.raises(RuntimeError, match="state saved before it is kept at") as err:
        resize_actor_group(LAYOUT, {"actor": _Group(1, log)}, "pool1", 2, state_root=str(tmp_path))
    kept = str(err.value).rsplit(" ", 1)[-1]
    assert os.path.isfile(os.path.join(kept, "state"))


def test_a_size_the_cluster_cannot_hold_is_refused_before_anything_stops(world, tmp_path):
    log, _ = world
    for n in (0, 3):
        with pytest.raises(ValueError, match=f"resize to {n} GPU"):
            resize_actor_group(LAYOUT, {"actor": _Group(1, log)}, "pool1", n, state_root=str(tmp_path))
    assert log == []
