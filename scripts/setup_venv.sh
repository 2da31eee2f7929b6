#!/usr/bin/env bash
# Make .venv (Python 3.11 unless $PYTHON says otherwise) and install qdcp with the extras given as
# $1 under constraints.txt (which pins the CPU build of torch). Used by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints.txt -e ".[$1]"
