#!/usr/bin/env bash
# Make the virtual environment $VENV (default .venv; Python 3.11 unless $PYTHON says otherwise) and
# install qdcp with the extras given as $1 under constraints.txt (which pins the CPU build of torch).
# Used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# a regular (not editable) install: no build warnings; the tests import this checkout's qdcp first
"$VENV/bin/python" -m pip install -q -c constraints.txt ".[$1]"
