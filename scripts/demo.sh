#!/usr/bin/env bash
# The one command that installs qdcp (CPU torch, torchao) into .venv and runs the demo (examples/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh torchao
exec "${VENV:-.venv}/bin/python" examples/demo.py "$@"
