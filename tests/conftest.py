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
    write their checkpoints and results there once, and every test of the module reads them.
    Modules whose jobs share launches name one directory for all of them (``SHARED_DIR``)."""
    import torchrun_jobs

    name = getattr(request.module, "SHARED_DIR", None) or "qdcp_" + request.module.__name__.rsplit(".", 1)[-1]
    return torchrun_jobs.shared_dir(tmp_path_factory, name)


@pytest.fixture
def hopper():
    """TransformerEngine's classes on CPU (tests/te_cpu.py), as on a Hopper GPU. Tests that build
    for Blackwell enter ``te_cpu.simulate_gpu`` themselves."""
    import te_cpu

    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        yield


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3-compatible server (moto) on loopback for the session; its URL. The AWS variables
    point boto at it; :func:`s3_bucket` carries the same settings for processes started earlier."""
    import subprocess
    import sys
    import time
    import urllib.request

    from torchrun_jobs import free_port

    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint) -> tuple[dict, str]:
    """fsspec storage options for :func:`s3_endpoint` (credentials included, for processes started
    before it), and a fresh bucket there."""
    import uuid

    import s3fs

    opts = {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"qdcp-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    return opts, bucket


# ----------------------------------------------------------------------------- scheduling
# The modules that cost most, most expensive first (wall seconds of their slowest tests under
# `pytest -n 2 --durations`, on a busy 2-core machine, at 68ef5d3). They run first, each kept
# together (its module fixtures made once per xdist worker); every other module follows in
# collection order. pytest-xdist's worksteal gives each worker a contiguous half of this order and
# moves the tail of the busier one's queue to the idle one, so the long tests start early and the
# two workers end together on short ones.
_EXPENSIVE_FIRST = (
    "test_rule_generated.py",        # 434 s
    "test_docs.py",                  # 434 s
    "test_storage_commits.py",       # 374 s
    "test_mesh2d.py",                # 298 s
    "test_examples.py",              # 508 s before the demo ran once
    "test_te_distributed.py",        # 218 s
    "test_distributed.py",           # 210 s
    "test_full_disk.py",             # 85 s (a quiet machine)
    "test_te_grouped_distributed.py",  # 154 s
    "test_framework_lightning.py",   # 141 s
    "test_framework_torchtitan.py",  # 127 s
    "test_training_distributed.py",  # 124 s
    "test_save_claims.py",           # 120 s
    "test_framework_accelerate.py",  # 120 s
    "test_te_columns.py",            # 106 s
    "test_fsdp2_rule.py",            # 31 s
    "test_docs_async_loop.py",       # 27 s
)


def pytest_collection_modifyitems(session, config, items) -> None:
    """Run :data:`_EXPENSIVE_FIRST`'s modules first (a stable sort: each module's tests keep their order)."""
    rank = {name: i for i, name in enumerate(_EXPENSIVE_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
