#!/usr/bin/env bash
# verl-tide's sdist and wheel in dist/, built by setuptools' PEP 517 hooks in a build environment of their own
# (the SPDX `license` string needs setuptools >= 77; a system Python's may be older). `make dist`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
BUILD_VENV=${BUILD_VENV:-.venv-build}
if [ ! -x "$BUILD_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$BUILD_VENV"
fi
"$BUILD_VENV/bin/python" -m pip install -q "setuptools>=77"
rm -rf dist && mkdir -p dist
"$BUILD_VENV/bin/python" -c "from setuptools import build_meta as b; print(b.build_sdist('dist')); print(b.build_wheel('dist'))"
