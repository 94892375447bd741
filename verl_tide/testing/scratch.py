"""What one test-bed run leaves behind, and its removal: a temp dir of the run's own, and the run's entries in
the shared /dev/shm that no live process still uses (another run's stay)."""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Optional
from collections.abc import Iterator
from contextlib import contextmanager


# What a test-bed run left in the shared temp dir before runs had one of their own: vLLM's torch.distributed file
# stores, verl's checkpoint-copy locks (kept for runs started without `run_scratch`).
_TMP_LEFTOVERS = ("vllm_dist_*", "ckpt_*.lock")


@contextmanager
def run_scratch() -> Iterator[dict[str, str]]:
    """Environment variables for one test-bed run (a job, a Ray cluster) whose leftovers go when it ends.

    The run gets a temp dir of its own (TMPDIR): Ray's session folder, vLLM's ZMQ IPC sockets (an engine process
    that is killed, as every Ray worker is at shutdown, never unlinks them), its torch.distributed file stores and
    verl's checkpoint-copy locks all land there and go with it, so two runs side by side never touch each
    other's files. /dev/shm is shared: what the run left there goes too, unless a live process still uses it
    (another run's)."""
    before = run_files()
    scratch = tempfile.mkdtemp(prefix="tide-")  # short: a Unix socket path has at most 107 bytes
    try:
        yield {"TMPDIR": scratch, "VLLM_RPC_BASE_PATH": scratch, **compile_cache_env()}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        clean_run_files(before)


def compile_cache_env() -> dict[str, str]:
    """torch's compile cache shared by every run (its default, under the machine's temp dir), as on a user's
    machine, where it stays warm from one job to the next.

    A run's own TMPDIR would otherwise make it cold in every run: vLLM's sampler compiles a small kernel with
    inductor on the first request with log-probs, and inductor keeps its precompiled C++ headers under
    `tempfile.gettempdir()` whatever TORCHINDUCTOR_CACHE_DIR says (torch 2.13 `codecache._HEADER_DIR`), so each
    run rebuilt them in its first step: about 11 s of one core inside the rollout worker, measured. Without
    precompiled headers a warm cache loads the kernel without compiling (5.5 s instead of 16.8 s for a fresh
    process, `docs/testbed.md`). A user's own settings win."""
    import getpass

    return {
        "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": os.environ.get("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "0"),
    }


def run_files() -> set[str]:
    """/dev/shm and the temp-dir entries a run may leave, as they are now (for `clean_run_files` after it)."""
    tmp = tempfile.gettempdir()
    leftovers = {p for pattern in _TMP_LEFTOVERS for p in glob.glob(os.path.join(tmp, pattern))}
    return set(glob.glob("/dev/shm/*")) | leftovers


def clean_run_files(keep: set[str]) -> None:
    """Remove what a run left (`clean_shm`, and vLLM's `vllm_dist_*` stores and verl's `ckpt_*.lock` files in the
    temp dir) that is not in `keep` and that no live process uses.

    What may go is listed before the scan for what is in use: another run (pytest's second worker) creates
    semaphores and segments all the time, and one created between the scan and the removal would go while
    its creator's child had yet to open it (seen: a vLLM engine core failing to start, `SemLock._rebuild`)."""
    candidates = run_files() - keep
    gone = candidates - shm_in_use()
    clean_shm(set(), only=gone)
    tmp = tempfile.gettempdir()
    for pattern in _TMP_LEFTOVERS:
        for path in glob.glob(os.path.join(tmp, pattern)):
            if path not in gone:
                continue
            try:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            except OSError:
                pass


def shm_in_use() -> set[str]:
    """/dev/shm entries a live process has mapped or open, and the weight folders of live `tide_shm` senders
    (named `verl_tide_weights_<pid>_...`): another run's, which a run's clean-up must leave alone."""
    import psutil

    used: set[str] = set()
    # glibc's sem_open maps a temporary file and links it under the semaphore's name, so a live semaphore shows
    # in the maps under the temporary (deleted) name: matched by inode
    inodes: set[int] = set()
    for proc_dir in glob.glob("/proc/[0-9]*"):
        try:
            with open(os.path.join(proc_dir, "maps")) as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0:
                        used.add(line[i:].rstrip("\n").removesuffix(" (deleted)"))
                        fields = line.split()
                        if len(fields) > 4 and fields[4].isdigit():
                            inodes.add(int(fields[4]))
            for fd in os.listdir(os.path.join(proc_dir, "fd")):
                target = os.readlink(os.path.join(proc_dir, "fd", fd))
                if target.startswith("/dev/shm/"):
                    used.add(target)
        except OSError:  # gone meanwhile, or not ours to read
            continue
    for path in glob.glob("/dev/shm/*"):
        try:
            if os.stat(path).st_ino in inodes:
                used.add(path)
        except OSError:
            continue
    for path in glob.glob("/dev/shm/verl_tide_weights_*"):
        match = re.match(r"verl_tide_weights_(\d+)_", os.path.basename(path))
        if match and psutil.pid_exists(int(match.group(1))):
            used.add(path)
    # a file in a used folder keeps the folder
    used |= {os.path.dirname(p) for p in used if os.path.dirname(p) != "/dev/shm"}
    return used


def clean_shm(keep: set[str], only: Optional[set[str]] = None) -> None:
    """Remove vLLM `psm_*` segments, verl weight-bucket files and the named semaphores of killed `multiprocessing`
    processes (`sem.mp-*`: their resource tracker dies with them and never unlinks the names) that a run left in
    /dev/shm (of `only`, when given: entries listed earlier). Unlinking a name leaves processes that hold the
    semaphore unaffected."""
    for path in (glob.glob("/dev/shm/*") if only is None else sorted(p for p in only if p.startswith("/dev/shm/"))):
        name = os.path.basename(path)
        if path not in keep and (name.startswith(("psm_", "verl_", "sem.mp-")) or "weights" in name):
            try:
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            except OSError:
                pass
