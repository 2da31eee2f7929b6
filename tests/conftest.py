"""Shared set-up: every process a test starts (torchrun workers, subprocesses, spawned ranks)
imports qdcp and the test helpers from this checkout, whatever copy the environment installed."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
