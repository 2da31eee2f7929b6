#!/usr/bin/env bash
# The one command that installs qdcp (CPU torch, torchao) into .venv and runs the quickstart demo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints.txt -e '.[torchao]'
exec .venv/bin/python examples/quickstart.py "$@"
