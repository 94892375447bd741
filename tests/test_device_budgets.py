"""Device budgets on the CPU test bed (`testing/device_budgets.py`): a fake GPU's cgroup quota holds, and an idle
fake GPU's budget is not used by another. Needs root and a writable cgroup CPU controller, as CI has."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from verl_tide.testing.device_budgets import (BUDGET_ENV, ROOT_ENV, BudgetError, JobBudgets, UsageSampler,
                                              busy_between, find_hierarchy, group_name, place_self, quota_us,
                                              remove_stale, visible_devices, writable)

BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < {s}: pass\n"


def _busy(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY.format(s=seconds)])


@pytest.fixture
def job():
    jb = JobBudgets.create(n_gpus=2, cores_per_gpu=0.4, host_cores=0.2, total_cores=os.cpu_count())
    try:
        yield jb
    finally:
        jb.remove()
        assert not (jb.hierarchy.cpu / jb.rel).exists() and not (jb.hierarchy.acct / jb.rel).exists()


def test_each_fake_gpu_runs_at_its_budget_and_an_idle_ones_budget_is_not_taken(job):
    # two busy processes, one per fake GPU: each held to its 0.4 cores (they would take a core each unbudgeted)
    a, b = _busy(3.0), _busy(3.0)
    assert job.place(a.pid, [0]) == "gpu0" and job.place(b.pid, [1]) == "gpu1"
    before = {g: job.usage_s(g) for g in job.groups()}
    t0 = time.monotonic()
    a.wait(), b.wait()
    wall = time.monotonic() - t0
    busy = job.busy_fractions(before, wall)
    assert job.budget_cores("gpu0") == pytest.approx(0.4) and set(busy) >= {"gpu0", "gpu1", "host"}
    for g in ("gpu0", "gpu1"):
        assert 0.5 < busy[g] <= 1.1, busy  # at its budget, never past it
    # fake GPU 1 idles (its process sleeps) while 0 computes: 0 still gets only its own 0.4 cores; the sampler's
    # timeline says the same over the busy window and shows gpu0 idle after its process ends
    sampler = UsageSampler(job, interval_s=0.25).start()
    a, b = _busy(2.5), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2.5)"])
    job.place(a.pid, [0]), job.place(b.pid, [1])
    before = {g: job.usage_s(g) for g in job.groups()}
    t0, start = time.monotonic(), time.time()
    a.wait(), b.wait()
    busy = job.busy_fractions(before, time.monotonic() - t0)
    end = time.time()
    time.sleep(1.0)
    sampler.stop()
    assert busy["gpu0"] <= 1.1 and busy["gpu1"] < 0.1, busy
    window = busy_between(sampler.samples, sampler.budgets, start + 0.5, end - 0.2)
    assert 0.5 < window["gpu0"] <= 1.1 and window["gpu1"] < 0.1, window
    assert busy_between(sampler.samples, sampler.budgets, end + 0.1, end + 0.9)["gpu0"] < 0.1
    stat = dict(line.split() for line in (job.hierarchy.cpu / job.rel / "gpu0" / "cpu.stat").read_text().splitlines())
    assert int(stat["nr_throttled"]) > 0  # the kernel held it to the quota (v1 and v2 both count throttled periods)


def test_a_process_places_itself_by_the_devices_ray_gave_it(job, monkeypatch):
    code = ("import os; from verl_tide.testing.device_budgets import place_self; print(place_self())")
    env = {**os.environ, BUDGET_ENV: "0.4", ROOT_ENV: job.rel, "CUDA_VISIBLE_DEVICES": "0,1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "gpu0+1"  # a process holding two fake GPUs gets their summed budget
    assert job.budget_cores("gpu0+1") == pytest.approx(0.8)
    env.pop("CUDA_VISIBLE_DEVICES")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "host"
    assert visible_devices({"CUDA_VISIBLE_DEVICES": "2"}) == [2] and visible_devices({}) == []
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert place_self() is None  # not asked for: nothing happens


def test_budgets_that_cannot_hold_stop_with_an_error_naming_the_setting(tmp_path, monkeypatch):
    with pytest.raises(BudgetError, match=f"{BUDGET_ENV} = 2.0: 2 fake GPUs x 2.0 cores"):
        JobBudgets.create(n_gpus=2, cores_per_gpu=2.0, total_cores=2)
    with pytest.raises(BudgetError, match="must be a number of cores > 0"):
        quota_us(0)
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\n")
    with pytest.raises(BudgetError, match="no cgroup CPU controller is mounted"):
        find_hierarchy(str(mounts))
    monkeypatch.setenv(BUDGET_ENV, "0.5")
    monkeypatch.delenv(ROOT_ENV, raising=False)
    with pytest.raises(BudgetError, match=ROOT_ENV):
        place_self()
    assert group_name([1, 0]) == "gpu0+1" and group_name([]) == "host"


def test_busy_between_interpolates_the_usage_samples_over_any_window():
    samples = [(10.0, {"gpu0": 0.0, "host": 1.0}), (12.0, {"gpu0": 1.0, "host": 1.0}), (14.0, {"gpu0": 1.0, "host": 3.0})]
    budgets = {"gpu0": 0.5, "host": 1.0}
    assert busy_between(samples, budgets, 10.0, 12.0) == {"gpu0": 1.0, "host": 0.0}
    assert busy_between(samples, budgets, 11.0, 13.0) == {"gpu0": 0.5, "host": 0.5}  # half a sample interval each
    assert busy_between(samples, budgets, 12.0, 14.0)["gpu0"] == 0.0
    assert busy_between(samples, budgets, 13.0, 13.0) == {} and busy_between([], budgets, 0.0, 1.0) == {}


def test_auto_budgets_ask_whether_groups_can_be_made_and_leave_none_behind(monkeypatch):
    """`--device-budgets auto` (make demo) budgets only where a probe group can be made; here, as root, it can."""
    import verl_tide.testing.device_budgets as db

    assert writable() is None
    assert not list((find_hierarchy().cpu / db.PREFIX).glob(f"probe-{os.getpid()}*"))

    def unmounted():
        raise BudgetError("no cgroup CPU controller is mounted")

    monkeypatch.setattr(db, "find_hierarchy", unmounted)
    assert "no cgroup CPU controller" in writable()


def test_a_killed_jobs_empty_groups_are_removed_when_the_next_job_starts():
    live = JobBudgets.create(n_gpus=1, cores_per_gpu=0.4, host_cores=0.2, total_cores=os.cpu_count())
    # a launcher that died (pid 2**22 + 7 is above Linux's pid_max) left its groups, a process still in them
    stale = JobBudgets.create(n_gpus=1, cores_per_gpu=0.4, host_cores=0.2, total_cores=os.cpu_count(),
                              job=f"{2 ** 22 + 7}-killed")
    try:
        stale.place(os.getpid(), [0])
        removed = remove_stale()
        assert stale.rel.split("/")[-1] not in removed  # a process is in it
        assert live.rel.split("/")[-1] not in removed  # none in it yet, but its launcher lives
        for base in {stale.hierarchy.cpu, stale.hierarchy.acct}:  # the process leaves (to the root)
            (base / "cgroup.procs").write_text(str(os.getpid()))
        fresh = JobBudgets.create(n_gpus=1, cores_per_gpu=0.4, host_cores=0.2, total_cores=os.cpu_count())
        fresh.remove()
        assert not (stale.hierarchy.cpu / stale.rel).exists()  # its launcher never ran remove(): gone now
        assert (live.hierarchy.cpu / live.rel).exists()
    finally:
        live.remove()
        stale.remove()
