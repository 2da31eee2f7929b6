"""Multi-process tests (issue 4): DTensor / FSDP2 checkpoints saved at N ranks, loaded at M ranks.

Each test spawns real ``torchrun`` jobs (gloo on CPU; nccl with one GPU per rank where CUDA has
enough devices: ``dist_worker.py`` chooses) that run ``tests/dist_worker.py``. A job batches many
checks and writes ``{section: [failures]}``; tests assert on sections. torchrun start-up costs
seconds, so jobs are few and shared: each save job (one per world size) and each load job runs once
per session, under a file lock in the session's base temp directory (shared by pytest-xdist
workers), and every test that needs it reuses its result.

- reshard: every torchao case of ``quantized_cases`` as ``Shard(0)`` (raw and dequantized) and
  ``Replicate()`` DTensors, saved at N in {1, 2, 3, 4} ranks (3 ranks: uneven 86/86/84 rows) and
  loaded at M in {1, 2, 3, 4} into plain Shard(0) DTensors, plain full tensors and same-type
  quantized DTensors; per-tensor-scale formats with each shard quantized on its own.
- FSDP2: ``fully_shard`` model with an NF4 weight and AdamW8bit/AdamW4bit/AdamWFp8 states, through
  ``get_state_dict``/``set_state_dict``, saved at 2 and 3 ranks, loaded at 1 and 3.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("dist_worker.py")
REPO = WORKER.parent.parent
JOB_TIMEOUT_S = 420
RESHARD_WORLDS = (1, 2, 3, 4)
FSDP_SAVE_WORLDS = (2, 3)
FSDP_LOAD_WORLDS = (1, 3)
OK_PER_TENSOR = ("int8_tensor", "float8_tensor_e5m2")
NVFP4_PER_TENSOR = ("nvfp4_per_tensor", "nvfp4_per_tensor_swizzled")


# ----------------------------------------------------------------------------- running jobs

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(command: str, nproc: int, root: Path) -> tuple[int, str, float]:
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": "1",
        # torchao's low-bit optimizers torch.compile their step; on CPU, inductor compiles C++ per
        # shard shape (minutes on 2 cores). Eager runs the same step function.
        "TORCHDYNAMO_DISABLE": env.get("TORCHDYNAMO_DISABLE", "1"),
        "QDCP_WORKER_TIMEOUT": str(JOB_TIMEOUT_S - 30),
        "PYTHONUNBUFFERED": "1",
    })
    for attempt in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(_free_port()), str(WORKER), command, str(root)]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"\n[test_distributed] torchrun killed after {JOB_TIMEOUT_S} s"
        elapsed = time.monotonic() - start
        if proc.returncode != 0 and "address already in use" in out.lower() and attempt < 2:
            continue  # another job took the port between _free_port and torchrun's bind
        return proc.returncode, out, elapsed
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session sees (the session's base temp)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "qdcp_distributed"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _job(shared: Path, root_name: str, command: str, nproc: int) -> dict:
    """Run (once per session) ``command`` at ``nproc`` ranks on ``shared/root_name``; its record."""
    root = shared / root_name
    root.mkdir(exist_ok=True)
    key = f"{command}-{nproc}"
    record_path = root / f"record-{key}.json"
    with _locked(root / f"lock-{key}"):
        if not record_path.exists():
            rc, out, elapsed = _torchrun(command, nproc, root)
            results_path = root / f"results-{key}.json"
            results = json.loads(results_path.read_text()) if results_path.exists() else None
            record = {"rc": rc, "tail": out[-6000:], "seconds": round(elapsed, 1), "results": results}
            record_path.write_text(json.dumps(record))
        return json.loads(record_path.read_text())


def _explain(record: dict, what: str) -> str:
    return f"{what}: torchrun exit {record['rc']} after {record['seconds']} s; output tail:\n{record['tail']}"


def _sections(record: dict, what: str, names, *, require_all: bool = True) -> None:
    """Assert that the job ran to the end and every section in ``names`` had no failure."""
    results = record["results"]
    assert results is not None, _explain(record, f"{what}: the job wrote no results")
    assert not results.get("crash"), _explain(record, f"{what}: the job crashed: {results['crash'][:3]}")
    failed = {}
    for name in names:
        if require_all:
            assert name in results, f"{what}: section {name!r} never ran (sections: {sorted(results)})"
        if results.get(name):
            failed[name] = results[name]
    if failed:
        lines = [f"{name}: {len(msgs)} failure(s)\n    " + "\n    ".join(msgs[:15])
                 for name, msgs in failed.items()]
        pytest.fail(f"{what}:\n" + "\n".join(lines), pytrace=False)


def _reshard_saved(shared: Path, first: int = 1) -> dict[int, dict]:
    """The save jobs at every world size (each once per session), starting from ``first``."""
    order = RESHARD_WORLDS[RESHARD_WORLDS.index(first):] + RESHARD_WORLDS[:RESHARD_WORLDS.index(first)]
    out = {}
    for n in order:
        out[n] = _job(shared, "reshard", "reshard-save", n)
    for n, record in out.items():
        _sections(record, f"save at {n} ranks", ["save_main"])
        assert (shared / "reshard" / f"n{n}" / "main" / ".metadata").exists()
    return out


def _reshard_loaded(shared: Path, m: int) -> dict:
    _reshard_saved(shared, first=m)
    return _job(shared, "reshard", "reshard-load", m)


# ----------------------------------------------------------------------------- reshard

@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_reshard_save(shared_dir, n):
    """Save at N ranks: Shard(0)/Replicate() DTensors of every case, raw and dequantized.

    The ``.metadata`` records one chunk (one storage record) for every replicated component (qmap,
    NF4 table and scaler mean, per-tensor scales, every component of a Replicate() entry), and N
    chunks for row-blocked components of Shard(0) entries.
    """
    record = _job(shared_dir, "reshard", "reshard-save", n)
    _sections(record, f"save at {n} ranks", ["save_main", "metadata"])
    _sections(record, f"save at {n} ranks", [f"save_per_tensor[{c}]" for c in OK_PER_TENSOR + NVFP4_PER_TENSOR],
              require_all=False)


@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_per_tensor_scale_shards_int8_float8_save_outcome(shared_dir, n):
    """Int8/Float8 PerTensor, each shard quantized on its own: the local ``block_size`` is the
    local shape, so the scale is saved as one block per shard. Even shards (N=2, 4) save and load
    exactly (checked in test_reshard_load); the uneven 3-rank split cannot be described by one
    block size and fails at planning with an AlignmentError naming the key."""
    _job(shared_dir, "reshard", "reshard-save", n)
    outcomes = json.loads((shared_dir / "reshard" / f"n{n}" / "per_tensor_outcomes.json").read_text())
    for name in OK_PER_TENSOR:
        if n == 3:
            assert outcomes[name].startswith("error AlignmentError") and "'w'" in outcomes[name], outcomes
        else:
            assert outcomes[name] == "saved", outcomes


@pytest.mark.parametrize("m", RESHARD_WORLDS)
def test_reshard_load(shared_dir, m):
    """Load every checkpoint saved at N in {1, 2, 3, 4} at M ranks.

    - plain Shard(0) DTensor and plain full-tensor targets: bitwise the reference dequantize (each
      source shard dequantized with the library's own dequantize, concatenated), for raw entries
      of every case (NF4: exact through the covering blocks even where M's rows do not fall on
      its scaler blocks), for Replicate() entries and for dequantized entries;
    - same-type quantized Shard(0) targets: buffers bit-identical to the source rows' buffers,
      updated in place; Replicate() targets: bit-identical to the source;
    - dequantized entries into quantized targets: quantized like the target, alone and mixed
      with raw entries in one load (regression: DCP's pre-2.4 key fallback used to put back the
      targets qdcp took over and fail with "Missing key");
    - Int8/Float8 per-tensor-scale shards that qdcp agreed to save: exact values.
    """
    record = _reshard_loaded(shared_dir, m)
    _sections(record, f"load at {m} ranks", [
        *[f"per_tensor[{c}]" for c in OK_PER_TENSOR]], require_all=False)
    _sections(record, f"load at {m} ranks", ["plain_shard", "plain_full", "same_type", "deq_into_quantized",
                                             "mixed"])


@pytest.mark.parametrize("name", NVFP4_PER_TENSOR)
def test_per_tensor_scale_shards_nvfp4_never_load_wrong_values(shared_dir, name):
    for m in (1, 2):
        record = _reshard_loaded(shared_dir, m)
        _sections(record, f"load at {m} ranks", [f"per_tensor[{name}]"], require_all=False)


def test_quantize_on_load_into_sharded_target_uses_global_amax(shared_dir):
    record = _reshard_loaded(shared_dir, 2)
    _sections(record, "load at 2 ranks", ["global_amax"])


# ----------------------------------------------------------------------------- FSDP2

@pytest.mark.parametrize("m", FSDP_LOAD_WORLDS)
def test_fsdp2_nf4_and_low_bit_optimizers_reshard(shared_dir, m):
    """FSDP2 model (NF4 weight, AdamW8bit/AdamW4bit/AdamWFp8 states) saved at 2 and 3 ranks with
    get_state_dict + QuantizedSavePlanner, loaded at M ranks into a fresh FSDP2 model with
    set_state_dict: states stay OptimState*, params and dequantized states equal bitwise, NF4 local
    buffers equal the saved rows', forward output identical, replicated components written once,
    and one more step gives the same params and states as the uninterrupted run."""
    for n in FSDP_SAVE_WORLDS:
        _sections(_job(shared_dir, "fsdp", "fsdp-save", n), f"FSDP2 save at {n} ranks", ["fsdp_save"])
    record = _job(shared_dir, "fsdp", "fsdp-load", m)
    _sections(record, f"FSDP2 load at {m} ranks", ["fsdp_load", "fsdp_step"])
