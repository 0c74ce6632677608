#!/usr/bin/env bash
# Sets up .venv (torch CPU first, then the project with every extra) and runs
# ruff (lint + format check), mypy over gradientmail_core, the whole test suite, and the quick
# subset of scripts/mutants.py (deliberate breaks of the code the tests must catch; about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 first and explicitly: on these machines it is a CPU build on local disk.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[s3,torch,lightning,accelerate,transformers,mlx,jax,keras,zstd,cli,dev]"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy gradientmail_core
.venv/bin/python -m pytest -q --durations=25 "$@"
.venv/bin/python scripts/mutants.py --quick -j 2
