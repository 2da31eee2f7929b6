#!/usr/bin/env bash
# The one command that installs qdcp (CPU torch, torchao) into .venv and runs the quickstart demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh torchao
exec .venv/bin/python examples/quickstart.py "$@"
