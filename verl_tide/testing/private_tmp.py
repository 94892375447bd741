"""Each test-bed job gets a /tmp of its own for the files it creates there, sharing every directory that exists.

Why: verl 0.9.1 moves weights into a vLLM worker through a ZMQ socket at a fixed path,
`/tmp/rl-colocate-zmq-{ray job id}-replica-{r}-rank-{k}.sock` (`vllm_rollout.ServerAdapter` sends,
`vLLMColocateWorkerExtension._get_zmq_handle` receives), and every fresh Ray cluster's first job id is
`01000000`. Two jobs on one host with Ray clusters of their own (the suite's two pytest workers) use the same
path: the sender removes the file and binds anew, so a receiver of one job can connect to the other job's sender
and take its weights, or wait for ever (seen 2026-12-03: the stock GRPO job's first weight update hung beside
the lending job until its 900 s limit; its vLLM worker loaded weights only 10 minutes later, while a third job
was syncing). A container per job, as clusters run verl, gives each
its own /tmp; on the test bed a mount namespace does (`unshare --mount`, root or CAP_SYS_ADMIN).

How: in the job's own mount namespace, a tmpfs goes over /tmp and every directory /tmp held at launch is bound
back into it (the run's scratch dir, pytest's temp dirs, torch's compile cache: shared as before). Top-level
files the job creates in /tmp (the sockets) are its own and go with it. Where namespaces are not allowed the job
runs as before, and the launcher says so.

    python -m verl_tide.testing.private_tmp -- CMD ARGS...   (run under `unshare --mount --propagation private`)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import subprocess
import sys

MS_BIND, MS_REC = 4096, 16384


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc().mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  data.encode() if data else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} -> {target}: {os.strerror(err)}")


def isolate_tmp(tmp: str = "/tmp") -> list[str]:
    """In a private mount namespace: a fresh tmpfs on `tmp` with every directory it held bound back.
    Returns the names bound back."""
    real = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)  # the shared /tmp, still reachable under the tmpfs
    names = sorted(e.name for e in os.scandir(tmp) if e.is_dir(follow_symlinks=False))
    _mount("tmpfs", tmp, "tmpfs", 0, "mode=1777")
    for name in names:
        os.mkdir(os.path.join(tmp, name))
        _mount(f"/proc/self/fd/{real}/{name}", os.path.join(tmp, name), None, MS_BIND | MS_REC)
    os.close(real)
    return names


@functools.lru_cache(maxsize=1)
def namespaces_allowed() -> tuple[bool, str]:
    """Whether this machine lets the test bed give a job its own mount namespace (and why not)."""
    try:
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"unshare: {e}"
    return proc.returncode == 0, proc.stderr.strip()


def wrap(cmd: list[str]) -> list[str]:
    """`cmd` run with a /tmp of its own where the machine allows it, unchanged (with a line saying so) where not."""
    allowed, why = namespaces_allowed()
    if not allowed:
        print(f"verl-tide test bed: no private /tmp for this job ({why}); two jobs at once may cross their weight "
              "syncs (verl 0.9.1's fixed ZMQ socket paths)", file=sys.stderr, flush=True)
        return cmd
    return ["unshare", "--mount", "--propagation", "private", sys.executable, "-m", __name__, "--", *cmd]


def main(argv: list[str]) -> None:
    if not argv or argv[0] != "--" or len(argv) < 2:
        raise SystemExit("usage: python -m verl_tide.testing.private_tmp -- CMD ARGS...")
    isolate_tmp()
    cmd = argv[1:]
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
