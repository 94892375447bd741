"""The CPU test bed cleans what a run leaves behind: vLLM's torch.distributed file stores and verl's
checkpoint-copy locks in the temp dir (they piled up by the hundred over test runs), and nothing else."""

from __future__ import annotations

import os
import sys
import tempfile

from verl_tide.testing.testbed import clean_run_files, run_files


def test_what_a_run_left_in_the_temp_dir_goes_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # gettempdir() returns it
    (tmp_path / "vllm_dist_old").write_text("")  # before the run: another run's, kept
    before = run_files()
    assert str(tmp_path / "vllm_dist_old") in before
    (tmp_path / "vllm_dist_0123abcd").write_text("")
    (tmp_path / "vllm_dist_dir").mkdir()
    (tmp_path / "vllm_dist_dir" / "x").write_text("")
    (tmp_path / "ckpt_0badf00d.lock").write_text("")
    (tmp_path / "unrelated.lock").write_text("")
    (tmp_path / "ckpt_not_a_lock").write_text("")
    clean_run_files(before)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_not_a_lock", "unrelated.lock", "vllm_dist_old"]


def test_a_semaphore_another_run_creates_during_the_clean_up_is_not_removed(monkeypatch):
    """pytest's second worker runs another job: a semaphore it creates while this run's clean-up scans /proc
    (before its creator's child opened it) must stay; what this run left goes."""
    import os

    from verl_tide.testing import scratch

    ours, theirs = "/dev/shm/sem.mp-tide-test-ours", "/dev/shm/sem.mp-tide-test-theirs"
    before = run_files()
    open(ours, "w").close()
    real_scan = scratch.shm_in_use

    def scan_while_another_run_starts():
        open(theirs, "w").close()  # created during the scan, not mapped by anyone yet
        return real_scan()

    monkeypatch.setattr(scratch, "shm_in_use", scan_while_another_run_starts)
    try:
        clean_run_files(before)
        assert not os.path.exists(ours) and os.path.exists(theirs)
    finally:
        for path in (ours, theirs):
            if os.path.exists(path):
                os.remove(path)


def test_a_runs_ipc_sockets_and_semaphores_go_with_it_and_nothing_else(tmp_path, monkeypatch):
    import glob
    import os
    import socket

    from verl_tide.testing.testbed import run_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    older_sem = "/dev/shm/sem.mp-tide-test-old"
    open(older_sem, "w").close()  # another run's, before this one: kept
    try:
        with run_scratch() as env:
            ipc_dir = env["VLLM_RPC_BASE_PATH"]
            assert os.path.dirname(ipc_dir) == str(tmp_path) and os.path.isdir(ipc_dir)
            sock = socket.socket(socket.AF_UNIX)  # what a killed vLLM engine leaves: a bound, never unlinked socket
            monkeypatch.chdir(ipc_dir)  # pytest's tmp_path is too long for a socket path
            sock.bind("0544cfd1-4073-4252-9b58-3f149fea0d31")
            sock.close()
            open("/dev/shm/sem.mp-tide-test-new", "w").close()
            (tmp_path / "vllm_dist_new").write_text("")
            (tmp_path / "mine.txt").write_text("")
            monkeypatch.chdir(tmp_path)
        assert not os.path.exists(ipc_dir)
        assert not os.path.exists("/dev/shm/sem.mp-tide-test-new")
        assert os.path.exists(older_sem)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]
    finally:
        for p in glob.glob("/dev/shm/sem.mp-tide-test-*"):
            os.remove(p)


def test_a_run_leaves_another_runs_shared_memory_alone():
    """Two test-bed runs side by side: the one that ends first removes only what no live process uses, so the
    other's vLLM segments and its `tide_shm` weight folder (its sender alive) stay."""
    import mmap
    import os
    import shutil

    from verl_tide.testing.testbed import clean_run_files, run_files

    before = run_files()
    mapped, stale = "/dev/shm/psm_tide_test_mapped", "/dev/shm/psm_tide_test_stale"
    live_weights = f"/dev/shm/verl_tide_weights_{os.getpid()}_tidetest"
    dead_weights = "/dev/shm/verl_tide_weights_999999999_tidetest"
    try:
        for path in (mapped, stale):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        for folder in (live_weights, dead_weights):
            os.makedirs(folder)
            open(os.path.join(folder, "step-1.pt"), "w").close()
        with open(mapped, "r+b") as f:
            view = mmap.mmap(f.fileno(), 4096)  # the other run's engine holds it mapped (fd closed below)
        try:
            clean_run_files(before)
            assert os.path.exists(mapped) and os.path.exists(live_weights)
            assert not os.path.exists(stale) and not os.path.exists(dead_weights)
        finally:
            view.close()
        clean_run_files(before)
        assert not os.path.exists(mapped)
    finally:
        for path in (mapped, stale):
            if os.path.exists(path):
                os.remove(path)
        for folder in (live_weights, dead_weights):
            shutil.rmtree(folder, ignore_errors=True)


def test_a_run_gets_a_temp_dir_of_its_own_for_ray_and_vllm(tmp_path, monkeypatch):
    import os

    from verl_tide.testing.testbed import run_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with run_scratch() as env:
        assert env["TMPDIR"] == env["VLLM_RPC_BASE_PATH"] and os.path.dirname(env["TMPDIR"]) == str(tmp_path)
        os.makedirs(os.path.join(env["TMPDIR"], "ray", "session_x"))
    assert list(tmp_path.iterdir()) == []


def test_step_metrics_survive_a_line_ray_split_in_two():
    from verl_tide.testing.testbed import parse_step_metrics

    prefix = "\x1b[36m(TaskRunnerV1 pid=26769)\x1b[0m "
    output = "\n".join([
        prefix + "step:12 - a:1.0 - b:np.float64(2.5)",
        prefix + "step:13 - a:3.0 ",
        prefix + "- b:4.0 - training/global_step:13 - c:np.int64(5)",
        prefix + "some other line",
        prefix + "- not:6.0",
    ])
    steps = parse_step_metrics(output)
    assert steps == {12: {"a": 1.0, "b": 2.5}, 13: {"a": 3.0, "b": 4.0, "training/global_step": 13.0,
                                                         "c": 5.0}}
    # cut mid-separator, its rest after other processes' lines and tqdm's bar (as Ray forwarded step 4, 2026-12-04)
    output = "\n".join([
        prefix + "step:4 - a:1.0 - b:2.0 -",
        "\x1b[36m(SimpleStorageUnit pid=11995)\x1b[0m 2026-12-04 14:24:40,189 - WARNING - x",
        prefix,
        "Training Progress:  67%|######   | 4/6 [00:35<00:13,  6.68s/it]",
        prefix + " c:3.0 - d:np.float64(4.0)",
        prefix + "step:5 - a:5.0",
        "\x1b[36m(SimpleStorageUnit pid=11995)\x1b[0m - e:9.0",  # another process's line: not step 5's
        prefix + " f:7.0",  # step 5's line was whole: a line of its own
    ])
    assert parse_step_metrics(output) == {4: {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}, 5: {"a": 5.0}}


def test_a_timed_out_job_is_killed_with_every_process_it_started_and_no_other():
    """The launcher kills the job's own tree (its Ray cluster included, even a daemon in a session of its own),
    never another job's processes: `ray stop --force` would stop every Ray cluster on the machine."""
    import subprocess
    import sys
    import time

    import psutil

    from verl_tide.testing.testbed import kill_process_tree

    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\n"
            "time.sleep(600)\n")
    job = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(job.pid).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        (daemon,) = psutil.Process(job.pid).children()
        kill_process_tree(job.pid)
        job.wait(timeout=30)
        assert not daemon.is_running() or daemon.status() == psutil.STATUS_ZOMBIE
        assert other.poll() is None  # another job's process lives on
    finally:
        other.kill()
        other.wait(timeout=30)


def test_a_live_semaphore_stays_though_its_mapping_carries_another_name():
    """glibc maps a semaphore under a temporary name it then links to `sem.mp-*`: the clean-up matches mappings by
    inode, or a starting vLLM engine's semaphore went before its engine core opened it (seen with two workers)."""
    import glob
    import multiprocessing as mp
    import os

    before = run_files()
    lock = mp.get_context("spawn").Lock()  # named until it is collected: a child opens it by name
    new = [p for p in glob.glob("/dev/shm/sem.mp-*") if p not in before]
    assert new
    clean_run_files(before)
    assert all(os.path.exists(p) for p in new), new
    del lock


def test_a_runs_compile_cache_outlives_its_temp_dir(tmp_path, monkeypatch):
    """torch's compile cache is the machine's, warm from run to run; its precompiled headers (which inductor
    keeps under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says) are off, else every run would rebuild them
    under its own TMPDIR in its first step."""
    import os

    from verl_tide.testing.testbed import run_scratch

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with run_scratch() as env:
        assert not env["TORCHINDUCTOR_CACHE_DIR"].startswith(env["TMPDIR"])
        assert os.path.dirname(env["TORCHINDUCTOR_CACHE_DIR"]) == str(tmp_path)
        assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/opt/cache")  # a user's own settings win
    monkeypatch.setenv("TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS", "1")
    with run_scratch() as env:
        assert env["TORCHINDUCTOR_CACHE_DIR"] == "/opt/cache"
        assert env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "1"


def test_two_jobs_at_once_each_have_their_own_top_level_tmp_files_and_share_its_directories(tmp_path):
    """verl 0.9.1's weight-sync socket is /tmp/rl-colocate-zmq-<ray job id>-..., and every fresh Ray cluster's first
    job id is the same: two jobs side by side (the suite's two workers) met on one socket and crossed weights
    (`private_tmp.py`). Each wrapped job sees only its own top-level /tmp files; directories that existed at
    launch (pytest's temp dirs, the run's scratch, the compile cache) are the shared ones."""
    import subprocess
    import uuid

    from verl_tide.testing import private_tmp

    allowed, why = private_tmp.namespaces_allowed()
    name = f"/tmp/rl-colocate-zmq-test-{uuid.uuid4().hex}.sock"
    script = ("import os, sys, time; tag, name, shared = sys.argv[1:]; open(name, 'w').write(tag); time.sleep(1.0); "
              "print(open(name).read()); open(os.path.join(shared, tag), 'w').write(tag)")
    cmds = [private_tmp.wrap([sys.executable, "-c", script, tag, name, str(tmp_path)]) for tag in ("a", "b")]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # a directory that existed: shared
    if allowed:
        assert [o.strip() for o, _ in outs] == ["a", "b"]  # each read back its own file, not the other's
        assert not os.path.exists(name)  # and it went with the job
    else:  # the machine allows no namespaces: the jobs run as before, and say so
        assert all("no private /tmp for this job" in err for _, err in outs), (why, outs)
        os.remove(name)


def test_without_namespaces_a_job_runs_unchanged_and_says_why(monkeypatch, capsys):
    from verl_tide.testing import private_tmp

    monkeypatch.setattr(private_tmp, "namespaces_allowed", lambda: (False, "unshare: Operation not permitted"))
    assert private_tmp.wrap(["python", "-V"]) == ["python", "-V"]
    assert "no private /tmp for this job (unshare: Operation not permitted)" in capsys.readouterr().err


def test_a_benchmark_stopped_with_sigterm_runs_its_finally_blocks(tmp_path):
    """The benchmarks' mains call `unwind_on_sigterm`: a SIGTERM unwinds like Ctrl-C, so the `finally` that stops a
    job's processes and removes its cgroups runs. Without it, Python exits on SIGTERM and runs none of them."""
    import signal
    import subprocess

    script = tmp_path / "bench.py"
    done = tmp_path / "cleaned"
    script.write_text(
        "import sys, time\n"
        "from verl_tide.testing.testbed import unwind_on_sigterm\n"
        f"if sys.argv[1] == 'unwind': unwind_on_sigterm()\n"
        "try:\n"
        "    print('started', flush=True)\n"
        "    time.sleep(60)\n"
        "finally:\n"
        f"    open({str(done)!r}, 'w').write(sys.argv[1])\n")
    for mode, cleaned in (("unwind", True), ("default", False)):
        done.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        proc.stdout.close()
        assert done.exists() is cleaned, mode
        assert rc == (128 + signal.SIGTERM if cleaned else -signal.SIGTERM)
