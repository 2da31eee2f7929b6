#!/usr/bin/env bash
# The one command that runs the whole test suite: makes .venv (Python 3.11), installs qdcp with
# its test and frameworks extras under constraints.txt (CPU torch), runs the linter (ruff), then pytest with xdist. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh test,frameworks
# TransformerEngine's pure-Python wheel (tests load its real classes on CPU; see tests/te_cpu.py);
# --no-deps: its declared dependencies pull CUDA packages
"${VENV:-.venv}/bin/python" -m pip install -q --no-deps transformer-engine==2.20.2
# the linter first ([tool.ruff] in pyproject.toml: pyflakes, pycodestyle, sorted imports)
"${VENV:-.venv}/bin/ruff" check .
exec "${VENV:-.venv}/bin/python" -m pytest -n 2 --dist worksteal "$@"
