"""Fake GPUs that idle like GPUs: a hard CPU quota per fake GPU on the CPU test bed (kernel cgroups).

Without budgets every fake GPU shares the machine's cores, so an idle fake GPU's time goes at once to the
others and no scheduler can show accelerator time it saved. With budgets each fake GPU gets a cgroup with a
CPU quota (`cores_per_gpu` cores, a 10 ms period so millisecond decode steps are not distorted) that nobody
else can use while it idles, and one more group holds the host side (driver, Ray's own processes, agent-loop
workers, environment servers, reward). A process joins its group from inside (`place_self`), because Ray sets
a worker's `CUDA_VISIBLE_DEVICES` inside the process after it starts; children (vLLM's engine core) inherit it.

Opt-in: `VERL_TIDE_DEVICE_BUDGETS=<cores per fake GPU>` for a job (`JobBudgets.create` makes its groups and
exports `VERL_TIDE_BUDGET_ROOT`); where no cgroup can be written the job stops with `BudgetError`, never runs
shared silently. Supports the cgroup v1 `cpu` (+ `cpuacct`) hierarchies and the v2 unified one. Test bed only.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

BUDGET_ENV = "VERL_TIDE_DEVICE_BUDGETS"  # cores per fake GPU, e.g. "0.5"
ROOT_ENV = "VERL_TIDE_BUDGET_ROOT"  # the job's group directory (relative to the cpu hierarchy's mount)
HOST_ENV = "VERL_TIDE_HOST_CORES"  # the host side's budget (default: the machine's cores less the fake GPUs')
PERIOD_US = 10_000  # a 10 ms period: a decode step of a few ms is not stretched to 100 ms by a throttle
MIN_QUOTA_US = 1_000  # the kernel's floor
HOST = "host"
PREFIX = "verl-tide"


class BudgetError(RuntimeError):
    """Budgets were asked for and cannot be enforced here (the message says why and what would fix it)."""


@dataclass(frozen=True)
class Hierarchy:
    """Where the kernel's CPU controller is mounted: `cpu` (quota) and `acct` (usage) directories; one for v2."""

    version: int
    cpu: Path
    acct: Path

    def group(self, rel: str) -> tuple[Path, Path]:
        return self.cpu / rel, self.acct / rel


def find_hierarchy(mounts: str = "/proc/self/mounts") -> Hierarchy:
    """The cgroup v1 `cpu` controller (with `cpuacct`, combined or apart), else v2's unified hierarchy with `cpu`."""
    cpu = acct = None
    v2 = None
    for line in Path(mounts).read_text().splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        path, fstype, opts = parts[1], parts[2], set(parts[3].split(","))
        if fstype == "cgroup":
            if "cpu" in opts:
                cpu = Path(path)
            if "cpuacct" in opts:
                acct = Path(path)
        elif fstype == "cgroup2" and "cpu" in _controllers(Path(path)):
            v2 = Path(path)
    if cpu is not None:
        if acct is None:
            raise BudgetError("cgroup v1 `cpu` is mounted but `cpuacct` is not: a device's usage cannot be read")
        return Hierarchy(1, cpu, acct)
    if v2 is not None:
        return Hierarchy(2, v2, v2)
    raise BudgetError(f"{BUDGET_ENV} is set but no cgroup CPU controller is mounted (neither v1 `cpu` nor v2 with "
                      "`cpu` in cgroup.controllers): unset it to run with shared cores")


def _controllers(mount: Path) -> list[str]:
    try:
        return (mount / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise BudgetError(f"cannot write {value!r} to {path}: {e}. Device budgets need root and a writable cgroup "
                          f"CPU controller; unset {BUDGET_ENV} to run with shared cores") from e


def quota_us(cores: float) -> int:
    if not cores > 0:
        raise BudgetError(f"{BUDGET_ENV} = {cores!r}: must be a number of cores > 0 (e.g. 0.5)")
    return max(MIN_QUOTA_US, int(round(cores * PERIOD_US)))


def group_name(devices: list[int]) -> str:
    """A process holding fake GPUs 0 and 1 runs in `gpu0+1` with their summed quota."""
    return "gpu" + "+".join(str(d) for d in sorted(devices)) if devices else HOST


@dataclass
class JobBudgets:
    """One job's groups: `<mount>/verl-tide/<job>/{gpu0, gpu1, ..., host}` (each job its own root: every Ray
    cluster numbers its GPUs from 0)."""

    hierarchy: Hierarchy
    rel: str
    cores_per_gpu: float
    host_cores: float

    @classmethod
    def create(cls, n_gpus: int, cores_per_gpu: float, host_cores: Optional[float] = None,
               total_cores: Optional[float] = None, job: Optional[str] = None) -> JobBudgets:
        """Make the job's root and the host group. The budgets together are at most the machine's cores."""
        total = float(total_cores if total_cores is not None else os.cpu_count() or 1)
        host = total - n_gpus * cores_per_gpu if host_cores is None else host_cores
        if n_gpus < 1 or host <= 0 or n_gpus * cores_per_gpu + host > total + 1e-9:
            raise BudgetError(f"{BUDGET_ENV} = {cores_per_gpu}: {n_gpus} fake GPUs x {cores_per_gpu} cores + host "
                              f"{host:g} must fit in the machine's {total:g} cores with host > 0")
        h = find_hierarchy()
        remove_stale(h)
        # the launcher's pid in the name: its groups are never stale while it lives (remove_stale)
        jb = cls(h, f"{PREFIX}/{job or f'{os.getpid()}-{uuid.uuid4().hex[:8]}'}", cores_per_gpu, host)
        for d in {h.cpu, h.acct}:
            try:
                (d / jb.rel).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise BudgetError(f"cannot create the job's cgroup {d / jb.rel}: {e}; device budgets need root and a "
                                  f"writable cgroup CPU controller (unset {BUDGET_ENV} to run shared)") from e
        if h.version == 2:
            for parent in (h.cpu, h.cpu / PREFIX, h.cpu / jb.rel):
                _write(parent / "cgroup.subtree_control", "+cpu")
        # a quota is a ceiling, not a guarantee: the job's groups outweigh whatever runs outside them
        if h.version == 1:
            _write(h.cpu / jb.rel / "cpu.shares", "262144")
        else:
            _write(h.cpu / jb.rel / "cpu.weight", "10000")
        jb._make(HOST, host)
        return jb

    @classmethod
    def attach(cls, root: str, cores_per_gpu: float) -> JobBudgets:
        """A process of a running job (a Ray worker): the job's groups from `VERL_TIDE_BUDGET_ROOT`."""
        return cls(find_hierarchy(), root, cores_per_gpu, 0.0)

    def _make(self, name: str, cores: float) -> str:
        rel = f"{self.rel}/{name}"
        cpu, acct = self.hierarchy.group(rel)
        for d in {cpu, acct}:
            d.mkdir(exist_ok=True)
        q = quota_us(cores)
        if self.hierarchy.version == 1:
            # period before quota: the kernel checks quota against the parent's with the new period
            _write(cpu / "cpu.cfs_period_us", str(PERIOD_US))
            _write(cpu / "cpu.cfs_quota_us", str(q))
        else:
            _write(cpu / "cpu.max", f"{q} {PERIOD_US}")
        return rel

    def place(self, pid: int, devices: list[int]) -> str:
        """Put process `pid` (all its threads) in the group of `devices` (host when none); returns the group."""
        name = group_name(devices)
        rel = self._make(name, self.cores_per_gpu * len(devices)) if devices else f"{self.rel}/{HOST}"
        cpu, acct = self.hierarchy.group(rel)
        for d in {cpu, acct}:
            _write(d / "cgroup.procs", str(pid))
        return name

    def groups(self) -> list[str]:
        base = self.hierarchy.cpu / self.rel
        return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.exists() else []

    def usage_s(self, name: str) -> float:
        """CPU seconds the group's processes used (cpuacct.usage on v1, cpu.stat usage_usec on v2)."""
        _, acct = self.hierarchy.group(f"{self.rel}/{name}")
        if self.hierarchy.version == 1:
            return int((acct / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (acct / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def budget_cores(self, name: str) -> float:
        cpu, _ = self.hierarchy.group(f"{self.rel}/{name}")
        if self.hierarchy.version == 1:
            return int((cpu / "cpu.cfs_quota_us").read_text()) / int((cpu / "cpu.cfs_period_us").read_text())
        quota, period = (cpu / "cpu.max").read_text().split()
        return int(quota) / int(period)

    def pids(self, name: str) -> list[int]:
        cpu, _ = self.hierarchy.group(f"{self.rel}/{name}")
        return [int(p) for p in (cpu / "cgroup.procs").read_text().split()]

    def busy_fractions(self, since: dict[str, float], wall_s: float) -> dict[str, float]:
        """Each group's usage since `since` (a `usage_s` snapshot) over its budget for `wall_s`: the test bed's
        "GPU utilisation"."""
        if wall_s <= 0:
            return {}
        return {g: (self.usage_s(g) - since.get(g, 0.0)) / (self.budget_cores(g) * wall_s) for g in self.groups()}

    def remove(self, timeout_s: float = 10.0) -> None:
        """Move every process left back to the hierarchy's root, then delete the job's groups (leaves first)."""
        deadline = time.monotonic() + timeout_s
        for base in {self.hierarchy.cpu, self.hierarchy.acct}:
            job = base / self.rel
            if not job.exists():
                continue
            for d in sorted((p for p in job.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [job]:
                while True:
                    for pid in (d / "cgroup.procs").read_text().split() if (d / "cgroup.procs").exists() else []:
                        try:
                            (base / "cgroup.procs").write_text(pid)
                        except OSError:
                            pass  # exited meanwhile
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
            try:
                (base / PREFIX).rmdir()  # the last job's: cgroup directories go by rmdir, never by unlinking files
            except OSError:
                pass  # another job's groups are still there


def writable() -> Optional[str]:
    """None where this process can make budgeted groups (a probe job's root made and removed), else why not: what
    `--device-budgets auto` asks before it budgets a run."""
    try:
        JobBudgets.create(1, 0.1, host_cores=0.1, total_cores=1.0, job=f"probe-{os.getpid()}").remove()
    except (BudgetError, OSError) as e:
        return str(e)
    return None


def remove_stale(h: Optional[Hierarchy] = None) -> list[str]:
    """Delete the groups of jobs that left no process behind (a launcher killed before its cleanup ran); returns
    their names. A job with a process still in any of its groups is left alone."""
    h = h or find_hierarchy()
    base = h.cpu / PREFIX
    removed = []
    for job in sorted(base.iterdir()) if base.exists() else []:
        if not job.is_dir():
            continue
        owner = job.name.split("-", 1)[0]
        if owner.isdigit() and _alive(int(owner)):
            continue  # its launcher lives (it may not have started any process yet)
        groups = [job, *(p for p in job.rglob("*") if p.is_dir())]
        if any((g / "cgroup.procs").read_text().strip() for g in groups if (g / "cgroup.procs").exists()):
            continue
        JobBudgets(h, f"{PREFIX}/{job.name}", 0.0, 0.0).remove()
        removed.append(job.name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def visible_devices(env: Optional[dict] = None) -> list[int]:
    """The fake GPUs Ray gave this process (its `CUDA_VISIBLE_DEVICES`); none for host-side processes."""
    value = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES", "").strip()
    return [int(x) for x in value.split(",") if x.strip().isdigit()]


_PLACED: set[tuple[int, str, tuple[int, ...]]] = set()  # (pid, job, fake GPUs) this process already joined


def place_self(devices: Optional[list[int]] = None) -> Optional[str]:
    """Join this job's group for this process's fake GPUs (or host), and size torch's threads to the budget.
    A no-op unless the job asked for budgets; raises `BudgetError` where they cannot be enforced."""
    cores, root = os.environ.get(BUDGET_ENV), os.environ.get(ROOT_ENV)
    if not cores:
        return None
    if not root:
        raise BudgetError(f"{BUDGET_ENV} is set but {ROOT_ENV} is not: start the job with the test bed's launcher "
                          "(`testing/testbed.run_main_ppo`), which makes the job's groups")
    devs = visible_devices() if devices is None else devices
    placed = (os.getpid(), root, tuple(sorted(devs)))
    if placed in _PLACED:  # verl asks the platform for its backend more than once per worker: place it once
        return group_name(devs)
    jb = JobBudgets.attach(root, float(cores))
    name = jb.place(os.getpid(), devs)
    _PLACED.add(placed)
    try:
        cmd = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:80]
    except OSError:
        cmd = "?"
    print(f"verl-tide device budget: pid {os.getpid()} ({cmd}) in {name} "
          f"({jb.budget_cores(name) if devs else 'host'} cores)", file=sys.stderr, flush=True)
    if devs:
        threads = max(1, int(float(cores) * len(devs) + 0.5))
        try:
            import torch

            torch.set_num_threads(threads)
        except Exception:  # torch absent (a host-side helper): nothing to size
            pass
    return name


def n_gpus_of(overrides: list[str]) -> int:
    """The job's fake GPUs, from its `ray_kwargs.ray_init.num_gpus` override."""
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key == "ray_kwargs.ray_init.num_gpus":
            return int(value)
    raise BudgetError(f"{BUDGET_ENV} is set but the job names no `+ray_kwargs.ray_init.num_gpus`: the fake GPUs to "
                      "budget are unknown")


@dataclass
class UsageSampler:
    """Each group's CPU usage every `interval_s` while a job runs (a thread of the launcher), so busy fractions can
    be taken over any window of the job (the benchmark's clock, not its start-up) and laid out as a timeline."""

    jb: JobBudgets
    interval_s: float = 1.0
    samples: list = field(default_factory=list)  # (unix time, {group: CPU seconds used so far})
    budgets: dict = field(default_factory=dict)  # group -> cores
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: Optional[threading.Thread] = None

    def start(self) -> "UsageSampler":
        self._thread = threading.Thread(target=self._run, name="tide-usage-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        usage = {}
        for g in self.jb.groups():
            try:
                usage[g] = self.jb.usage_s(g)
                self.budgets.setdefault(g, self.jb.budget_cores(g))
            except (OSError, ValueError, KeyError):
                pass  # a group made or removed between the listing and the read
        self.samples.append((time.time(), usage))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()


def busy_between(samples: list, budgets: dict[str, float], t0: float, t1: float) -> dict[str, float]:
    """Each group's CPU use from `t0` to `t1` (usage interpolated between the samples around each) over its budget
    for that time; a group first seen after `t0` counts from zero."""
    if t1 <= t0 or not samples:
        return {}

    def at(t: float, g: str) -> float:
        before = [(ts, u[g]) for ts, u in samples if g in u and ts <= t]
        after = [(ts, u[g]) for ts, u in samples if g in u and ts >= t]
        if not before:
            return 0.0 if not after or after[0][0] > t else after[0][1]
        if not after:
            return before[-1][1]
        (ta, ua), (tb, ub) = before[-1], after[0]
        return ua if tb == ta else ua + (ub - ua) * (t - ta) / (tb - ta)

    return {g: (at(t1, g) - at(t0, g)) / (budgets[g] * (t1 - t0)) for g in sorted(budgets) if budgets[g] > 0}


def summary(busy: dict[str, float], jb: JobBudgets) -> str:
    return f"verl-tide device budgets in {jb.rel} (busy = CPU used / budget over the job's clock): " + ", ".join(
        f"{g} {jb.budget_cores(g):.2f} cores busy {b:.0%}" for g, b in sorted(busy.items()))
