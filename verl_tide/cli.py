"""`verl-tide` command line: `env serve | tasks | check`, `check <overrides>`, `paths router`, `bench`."""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter  # every --help shows the defaults
    parser = argparse.ArgumentParser(prog="verl-tide", formatter_class=fmt,
                                     description="verl-tide: TideRL's readiness-aware scheduling for verl 0.9.x")
    sub = parser.add_subparsers(dest="group", required=True)
    env = sub.add_parser("env", formatter_class=fmt, help="environment service").add_subparsers(dest="command",
                                                                                              required=True)

    serve = env.add_parser("serve", formatter_class=fmt, help="run the reference environment server")
    serve.add_argument("--env", default="tiny", help="default environment or preset for /start without 'env'")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless you mean otherwise)")
    serve.add_argument("--port", type=int, default=8765, help="port to listen on")
    serve.add_argument("--session-timeout", type=float, default=240.0, help="inactivity timeout (s), frozen while paused")
    serve.add_argument("--step-timeout", type=float, default=20.0,
                       help="longest environment reset/step (s) before an error; keep below tide.env.request_timeout_s")
    serve.add_argument("--max-sessions", type=int, default=1024, help="open episodes at once; /start beyond it is refused")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    serve.add_argument("--latency-scale", type=float, default=1.0, help="multiply environment latencies (0 = none)")
    serve.add_argument("--gym", default=None, metavar="ENV_ID",
                       help="also serve this Gymnasium environment (and make it the default): docs/environment-service.md")
    serve.add_argument("--gym-kwargs", default="{}", help="JSON keyword arguments for gymnasium.make")
    serve.add_argument("--gym-actions", default="", help="comma-separated action names of a Discrete space, in order")
    serve.add_argument("--gym-parser", default=None, metavar="MODULE:FUNC", help="(reply, action_space) -> action")
    serve.add_argument("--gym-formatter", default=None, metavar="MODULE:FUNC", help="(observation, env) -> text")
    serve.add_argument("--invalid-action-penalty", type=float, default=0.1,
                       help="reward subtracted for a reply the parser cannot read")
    serve.add_argument("--openenv", default=None, metavar="URL",
                       help="also serve the OpenEnv server at URL (and make it the default), one WebSocket an episode")
    serve.add_argument("--openenv-action-field", default="message", help="the action field the reply goes into")
    serve.add_argument("--openenv-observation-field", default=None,
                       help="the observation field shown to the model (default: the whole observation as JSON)")
    serve.add_argument("--openenv-env", default=None, metavar="MODULE:FACTORY",
                       help="host this OpenEnv Environment class (or factory) here, without OpenEnv's server")
    serve.add_argument("--openenv-action", default=None, metavar="MODULE:CLASS",
                       help="its Action model (with --openenv-env); the reply goes into --openenv-action-field")

    tasks = env.add_parser("tasks", formatter_class=fmt,
                           help="write RL rows (parquet) for the tide_env_agent loop: one episode each")
    tasks.add_argument("--env", required=True, help="the environment name the server serves (e.g. FrozenLake-v1)")
    tasks.add_argument("--n", type=int, required=True, help="rows (episodes)")
    tasks.add_argument("--out", required=True, help="parquet file to write")
    tasks.add_argument("--seed", type=int, default=0, help="first episode's seed (row i gets seed + i)")
    tasks.add_argument("--prompt", default="Play the game. Each turn, answer with one action.",
                       help="the system prompt of every row (the environment's first observation follows it)")

    check = env.add_parser("check", formatter_class=fmt, help="conformance checks against a running server")
    check.add_argument("url", help="the environment service's base URL, e.g. http://127.0.0.1:8765")
    check.add_argument("--env", default=None, help="environment to start (default: the server's default)")
    check.add_argument("--timeout-check-max", type=float, default=10.0,
                       help="check pause/timeout semantics only if the server's timeout is at most this (s)")

    paths = sub.add_parser("paths", formatter_class=fmt, help="print the path of a file shipped with verl-tide")
    paths.add_argument("what", choices=["router"], help="router: the CTB router YAML for rollout.router_config_path")
    paths.add_argument("--group-size", type=int, default=None, metavar="N",
                       help="write a copy for your job instead: group_size N (your actor_rollout_ref.rollout.n; CTB's "
                            "group-completion priority needs it) and eval_group_size --eval-group-size, to --out")
    paths.add_argument("--eval-group-size", type=int, default=None, metavar="N",
                       help="with --group-size: actor_rollout_ref.rollout.val_kwargs.n (default: 1)")
    paths.add_argument("--out", default="ctb_router.yaml", help="with --group-size: the file to write")

    chk = sub.add_parser("check", formatter_class=fmt,
                         help="compose a job's config as main_ppo would and validate it as trainer tide will, "
                              "without launching anything (bad tide.* values, unknown keys, layouts)")
    chk.add_argument("overrides", nargs="*", help="the overrides you pass to main_ppo, e.g. +tide=enabled ...")
    chk.add_argument("--config-path", default=None,
                     help="a config directory (as main_ppo's --config-path, e.g. recipes); default: verl's own")
    chk.add_argument("--config-name", default=None, help="the config in it (default: verl's ppo_trainer)")

    pl = sub.add_parser("plan", formatter_class=fmt,
                        help="predict a job's goodput under verl sync, stock async at each split and +tide=enabled "
                             "(simulated), with the split to start at and its overrides")
    pl.add_argument("overrides", nargs="*",
                    help="the job's main_ppo overrides it reads: trainer.nnodes/n_gpus_per_node, rollout "
                         "nnodes/n_gpus_per_node, data.train_batch_size, actor_rollout_ref.rollout.n, "
                         "data.max_response_length, ...multi_turn.max_assistant_turns, tide.max_staleness, "
                         "actor_rollout_ref.model.path (a local directory with config.json)")
    pl.add_argument("--workload", default="webshop",
                    help="the environment's shape: a preset (webshop | alfworld | osworld | sciboard; testbed_demo "
                         "with --hardware testbed-cpu) or a workload YAML in the bench's schema (turns, tokens per "
                         "turn, environment latency)")
    pl.add_argument("--hardware", default="h100",
                    help="h100 | h200 (published figures), testbed-cpu (the CPU test bed's fake GPU, measured by "
                         "benchmarks/testbed_calibrate.py), or a measured profile's YAML")
    pl.add_argument("--gpus", type=int, default=None, help="all GPUs, when the overrides give no layout")
    pl.add_argument("--steps", type=int, default=None, help="steps to simulate (default: the workload's)")
    pl.add_argument("--model-params-b", type=float, default=None, help="the model's parameters (billions), "
                    "instead of reading actor_rollout_ref.model.path")
    pl.add_argument("--kv-bytes-per-token", type=int, default=None, help="with --model-params-b: KV cache bytes "
                    "per token (2 x layers x KV heads x head dim x 2 bytes)")
    pl.add_argument("--env-url", default=None, metavar="URL",
                    help="measure the environment's turns, observation tokens and latencies through its running "
                         "environment service (verl-tide env serve, or yours behind the same protocol) instead of "
                         "taking them from --workload")
    pl.add_argument("--env-name", default=None, help="with --env-url: the environment /start asks for")
    pl.add_argument("--probe-episodes", type=int, default=16, help="with --env-url: episodes to play")
    pl.add_argument("--json", default=None, metavar="PATH", help="write the prediction as JSON")
    pl.add_argument("--plot", default=None, metavar="PATH", help="write goodput by split as a PNG")

    bench = sub.add_parser("bench", formatter_class=fmt,
                           help="simulate stock verl baselines and TideRL on a modeled GPU cluster")
    bench.add_argument("--workload", default="webshop",
                       help="a preset (webshop | alfworld | osworld | sciboard) or a workload YAML file")
    bench.add_argument("--gpus", type=int, default=32, help="GPUs in the simulated cluster (>= 4)")
    bench.add_argument("--steps", type=int, default=None, help="training steps (default: the workload's)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the sampled workload (tasks, turns, latencies)")
    bench.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    bench.add_argument("--plot", default=None, metavar="PATH", help="write goodput and waits as a PNG")
    bench.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    bench.add_argument("--min-batch", type=int, default=None, metavar="SEQUENCES",
                       help="also run tide with ERS's elastic batch, tide.ers.min_batch = SEQUENCES (1 to B_ideal), "
                            "as system tide_min_batch (steps train fewer sequences when little is ready)")
    bench.add_argument("--ablation", action="store_true",
                       help="also add RA2P, ERS and CTB one at a time to the best StreamRL-like system (paper Table 2)")

    args = parser.parse_args(argv)
    if args.group == "bench":
        from verl_tide.sim.bench import BenchError
        from verl_tide.sim.bench import main as run_bench
        from verl_tide.sim.workload import WorkloadError

        if args.gpus < 4:
            parser.error(f"--gpus {args.gpus}: must be >= 4 (rollout, actor and Ref ranks each need GPUs)")
        if args.steps is not None and args.steps < 1:
            parser.error(f"--steps {args.steps}: must be >= 1")
        try:
            return run_bench(args.workload, args.gpus, args.json, args.plot, args.seed, args.steps, args.quiet,
                             args.min_batch, args.ablation)
        except (WorkloadError, BenchError) as e:
            parser.error(str(e))
    if args.group == "plan":
        from verl_tide.sim.plan import PlanError, main as run_plan
        from verl_tide.sim.workload import WorkloadError

        if args.steps is not None and args.steps < 1:
            parser.error(f"--steps {args.steps}: must be >= 1")
        if args.probe_episodes < 1:
            parser.error(f"--probe-episodes {args.probe_episodes}: must be >= 1")
        try:
            return run_plan(args.overrides, args.workload, args.hardware, args.gpus, args.steps, args.model_params_b,
                            args.kv_bytes_per_token, args.json, args.plot, args.env_url, args.env_name,
                            args.probe_episodes)
        except (PlanError, WorkloadError) as e:
            parser.error(str(e))
    if args.group == "check":
        from verl_tide.check import main as run_check

        return run_check(args.overrides, args.config_path, args.config_name)
    if args.group == "paths":
        from importlib.resources import files

        shipped = files("verl_tide") / "conf" / "router" / "ctb.yaml"
        if args.group_size is None:
            print("verl-tide: this file has group_size: 1; for GRPO write one with your rollout.n: "
                  "verl-tide paths router --group-size N --out FILE", file=sys.stderr)
            print(shipped)
            return 0
        for flag, value in (("--group-size", args.group_size), ("--eval-group-size", args.eval_group_size)):
            if value is not None and value < 1:
                parser.error(f"{flag} {value}: must be an integer >= 1 (your actor_rollout_ref.rollout.n)")
        import re
        from pathlib import Path

        text = shipped.read_text()
        text = re.sub(r"(?m)^group_size: \d+", f"group_size: {args.group_size}", text)
        text = re.sub(r"(?m)^eval_group_size: \d+", f"eval_group_size: {args.eval_group_size or 1}", text)
        out = Path(args.out).resolve()
        out.write_text(text)
        print(out)
        return 0
    if args.command == "tasks":
        from verl_tide.env.tasks import write_env_task_parquet

        if args.n <= 0:
            parser.error(f"--n {args.n}: must be > 0")
        print(write_env_task_parquet(args.out, args.n, env=args.env, seed=args.seed, prompt=args.prompt, task={}))
        return 0
    if args.command == "serve":
        from verl_tide.env.envs import ENVIRONMENTS, PRESETS
        from verl_tide.env.server import ServerConfig, serve as run_server

        if args.gym:
            import json

            from verl_tide.env.gym_adapter import load_callable, register_gym_environment

            try:
                gym_kwargs = json.loads(args.gym_kwargs)
                if not isinstance(gym_kwargs, dict):
                    raise ValueError("not a JSON object")
                args.env = register_gym_environment(
                    args.gym, gym_kwargs, action_names=[a for a in args.gym_actions.split(",") if a],
                    parser=load_callable(args.gym_parser) if args.gym_parser else None,
                    formatter=load_callable(args.gym_formatter) if args.gym_formatter else None,
                    invalid_action_penalty=args.invalid_action_penalty)
            except ImportError as e:
                parser.error(f"--gym needs gymnasium (pip install gymnasium) or an importable parser/formatter: {e}")
            except (KeyError, ValueError, AttributeError) as e:
                parser.error(f"--gym {args.gym!r} / --gym-kwargs / --gym-parser / --gym-formatter: {e}")
        if args.openenv:
            from verl_tide.env.openenv_bridge import register_openenv_environment

            try:
                args.env = register_openenv_environment(args.openenv, action_field=args.openenv_action_field,
                                                        observation_field=args.openenv_observation_field)
            except ValueError as e:
                parser.error(f"--openenv: {e}")
        if bool(args.openenv_env) != bool(args.openenv_action):
            parser.error("--openenv-env and --openenv-action go together (the Environment and its Action model)")
        if args.openenv_env:
            from verl_tide.env.gym_adapter import load_callable
            from verl_tide.env.openenv_host import register_openenv_object

            try:
                args.env = register_openenv_object(
                    load_callable(args.openenv_env), load_callable(args.openenv_action),
                    action_field=args.openenv_action_field, observation_field=args.openenv_observation_field,
                    invalid_action_penalty=args.invalid_action_penalty)
            except (ImportError, AttributeError, TypeError, ValueError) as e:
                parser.error(f"--openenv-env {args.openenv_env!r} / --openenv-action {args.openenv_action!r}: {e}")
        if args.env not in PRESETS and args.env not in ENVIRONMENTS:
            parser.error(f"--env {args.env!r}: allowed: {', '.join(sorted(set(PRESETS) | set(ENVIRONMENTS)))}")
        if min(args.session_timeout, args.step_timeout, args.max_sessions, args.max_body_bytes) <= 0 \
                or args.latency_scale < 0:
            parser.error("--session-timeout, --step-timeout, --max-sessions and --max-body-bytes must be > 0; "
                         "--latency-scale >= 0")
        run_server(ServerConfig(host=args.host, port=args.port, default_env=args.env,
                                session_timeout_s=args.session_timeout, step_timeout_s=args.step_timeout,
                                max_sessions=args.max_sessions,
                                max_body_bytes=args.max_body_bytes, latency_scale=args.latency_scale))
        return 0
    from verl_tide.env.conformance import format_table, run_checks

    results = asyncio.run(run_checks(args.url, env=args.env, timeout_check_max_s=args.timeout_check_max))
    print(format_table(results))
    return 1 if any(r.status == "FAIL" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
