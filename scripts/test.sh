#!/usr/bin/env bash
# Sets up .venv (torch CPU first, then the project with every extra) and runs
# ruff (lint + format check), mypy over gradientmail_core, the whole test suite (on two workers, the
# 25 slowest tests listed at the end), and the quick
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
# Spread over two workers (pytest-xdist; most multi-process tests wait on their processes more
# than they compute); GM_TEST_WORKERS=0 runs it in this one process. docs/testing.md says what runs.
.venv/bin/python -m pytest -q --durations=25 -n "${GM_TEST_WORKERS:-2}" --dist loadscope "$@"
.venv/bin/python scripts/mutants.py --quick -j 2
