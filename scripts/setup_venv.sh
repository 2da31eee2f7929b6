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
# qdcp's wheel first, into a directory of this call's own: setuptools builds in the checkout's
# build/, so two installs at once (.ci/run makes the demo's and the suite's environments together)
# take turns there (flock, where the system has it); then a regular (not editable) install of that
# wheel with its extras: no build warnings; the tests import this checkout's qdcp first
wheels=$(mktemp -d "${TMPDIR:-/tmp}/qdcp-wheel.XXXXXX")
trap 'rm -rf "$wheels"' EXIT
mkdir -p build
(
  if command -v flock >/dev/null; then flock 9; fi
  "$VENV/bin/python" -m pip wheel -q --no-deps -w "$wheels" .
) 9> build/.qdcp-build.lock
wheel=$(ls "$wheels"/qdcp-*.whl)
"$VENV/bin/python" -m pip install -q -c constraints.txt "$wheel[$1]"
# pip keeps an installed qdcp of the same version: this checkout's replaces it
"$VENV/bin/python" -m pip install -q --force-reinstall --no-deps "$wheel"
