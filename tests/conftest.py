"""Shared set-up: every process a test starts (torchrun workers, subprocesses, spawned ranks)
imports qdcp and the test helpers from this checkout, whatever copy the environment installed."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(REPO), str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


# ----------------------------------------------------------------------------- shared fixtures
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def shared_dir(request, tmp_path_factory) -> Path:
    """One directory per test module that every xdist worker of the session sees: torchrun jobs
    write their checkpoints and results there once, and every test of the module reads them."""
    import torchrun_jobs

    return torchrun_jobs.shared_dir(tmp_path_factory, "qdcp_" + request.module.__name__.rsplit(".", 1)[-1])


@pytest.fixture
def hopper():
    """TransformerEngine's classes on CPU (tests/te_cpu.py), as on a Hopper GPU. Tests that build
    for Blackwell enter ``te_cpu.simulate_gpu`` themselves."""
    import te_cpu

    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        yield
