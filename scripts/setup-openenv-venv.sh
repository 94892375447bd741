#!/usr/bin/env bash
# Create .venv-openenv: openenv-core 0.3.0 with exactly the set in constraints/openenv.txt, plus what
# verl-tide's environment service needs to host an OpenEnv environment there (aiohttp; verl-tide itself from
# this checkout on PYTHONPATH, as `verl_tide.env` imports nothing heavier). openenv-core pulls gradio and
# fastmcp, which the CPU test bed's lock does not carry, so OpenEnv servers get their own environment, as they
# get their own container in practice. `make openenv-venv` runs it when the lock or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${OPENENV_VENV:-.venv-openenv}
PYTHON=${PYTHON:-python3.11}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q 'pip==26.3'
if [ "${RESOLVE:-0}" = 1 ]; then  # maintainers: re-resolve the lock from the loose set
  "${PIP[@]}" install -q 'openenv-core==0.3.0' 'aiohttp'
  "${PIP[@]}" freeze --exclude-editable | grep -v '^pip==' > constraints/openenv.txt
fi
"${PIP[@]}" install -q --no-deps -r constraints/openenv.txt
PYTHONPATH=. "$VENV/bin/python" -c "
import importlib.metadata as md
from openenv.core.env_server import create_app  # noqa: F401
import verl_tide.env.server  # noqa: F401
print('openenv venv ready: openenv-core', md.version('openenv-core'))"
