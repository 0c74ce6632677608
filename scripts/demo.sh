#!/usr/bin/env bash
# Sets up .venv (torch CPU first, then the project with the extras the demo uses) and runs the
# demo: several Lightning learner processes training one model through a shared directory.
# Arguments go to the demo, e.g. `bash scripts/demo.sh --learners 4` or `--quick`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 first and explicitly: on these machines it is a CPU build on local disk.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[torch,lightning,cli,zstd]"
exec .venv/bin/python examples/demo.py "$@"
