"""Multi-process tests: DTensor / FSDP2 checkpoints saved at N ranks, loaded at M ranks.

Each test spawns real ``torchrun`` jobs (gloo on CPU; nccl with one GPU per rank where CUDA has
enough devices: ``dist_worker.py`` chooses) that run ``tests/dist_worker.py``. A job batches many
checks and writes ``{section: [failures]}``; tests assert on sections. torchrun start-up costs
seconds, so jobs are few and shared: each save job (one per world size) and each load job runs once
per session, under a file lock in the session's base temp directory (shared by pytest-xdist
workers), and every test that needs it reuses its result. Where both a reshard and an FSDP2 job run
at the same world size (saves at 2 and 3 ranks, loads at 1 and 3), they share one launch; every
load runs in processes of its own, after every save.

- reshard: every torchao case of ``quantized_cases`` as ``Shard(0)`` (raw and dequantized) and
  ``Replicate()`` DTensors, saved at N in {1, 2, 3, 4} ranks (3 ranks: uneven 86/86/84 rows) and
  loaded at M in {1, 2, 3, 4} into plain Shard(0) DTensors, plain full tensors and same-type
  quantized DTensors; per-tensor-scale formats with each shard quantized on its own.
- FSDP2: ``fully_shard`` model with an NF4 weight and AdamW8bit/AdamW4bit/AdamWFp8 states, through
  ``get_state_dict``/``set_state_dict``, saved at 2 and 3 ranks, loaded at 1 and 3.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchrun_jobs

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).with_name("dist_worker.py")
JOB_TIMEOUT_S = 420
RESHARD_WORLDS = (1, 2, 3, 4)
FSDP_SAVE_WORLDS = (2, 3)
FSDP_LOAD_WORLDS = (1, 3)
OK_PER_TENSOR = ("int8_tensor", "float8_tensor_e5m2")
NVFP4_PER_TENSOR = ("nvfp4_per_tensor", "nvfp4_per_tensor_swizzled")


# ----------------------------------------------------------------------------- running jobs

# the reshard and FSDP2 commands write and read their own directories (n<N>/, fsdp_n<N>/) of one root
_worker = torchrun_jobs.Worker(WORKER.name, timeout_s=JOB_TIMEOUT_S, together={
    2: [("reshard-save", "fsdp-save", "fsdp-limits")],
    3: [("reshard-save", "fsdp-save"), ("reshard-load", "fsdp-load")],
    1: [("reshard-load", "fsdp-load")],
})


def _job(shared: Path, command: str, nproc: int) -> dict:
    """Run (once per session) ``command`` at ``nproc`` ranks on ``shared/dist``; its record."""
    if command.endswith("-load"):  # a load reads what every save wrote: all of them first
        _reshard_saved(shared, first=nproc if nproc in RESHARD_WORLDS else 1)
    return _worker(shared / "dist", command, nproc)


_sections = torchrun_jobs.check_sections


def _reshard_saved(shared: Path, first: int = 1) -> dict[int, dict]:
    """The save jobs at every world size (each once per session), starting from ``first``."""
    order = RESHARD_WORLDS[RESHARD_WORLDS.index(first):] + RESHARD_WORLDS[:RESHARD_WORLDS.index(first)]
    out = {}
    for n in order:
        out[n] = _job(shared, "reshard-save", n)
    for n, record in out.items():
        _sections(record, f"save at {n} ranks", ["save_main"])
        assert (shared / "dist" / f"n{n}" / "main" / ".metadata").exists()
    for n in FSDP_SAVE_WORLDS:  # the FSDP2 saves (in the reshard saves' launches there), checked by their test
        _job(shared, "fsdp-save", n)
    return out


def _reshard_loaded(shared: Path, m: int) -> dict:
    return _job(shared, "reshard-load", m)


# ----------------------------------------------------------------------------- reshard

@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_reshard_save(shared_dir, n):
    """Save at N ranks: Shard(0)/Replicate() DTensors of every case, raw and dequantized.

    The ``.metadata`` records one chunk (one storage record) for every replicated component (qmap,
    NF4 table and scaler mean, per-tensor scales, every component of a Replicate() entry), and N
    chunks for row-blocked components of Shard(0) entries.
    """
    record = _job(shared_dir, "reshard-save", n)
    _sections(record, f"save at {n} ranks", ["save_main", "metadata"])
    _sections(record, f"save at {n} ranks", [f"save_per_tensor[{c}]" for c in OK_PER_TENSOR + NVFP4_PER_TENSOR],
              require_all=False)


@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_direct_writes_at_n_ranks(shared_dir, n):
    """Drawn states (plain tensors of four dtypes and Int8Tensor weights, Shard(0) or Replicate(),
    each rank's shard 0.5-3 MiB) saved at N ranks by ``qdcp.async_save`` (each rank's upload writes
    its large items straight from its staging buffers) and by ``qdcp.save`` (buffered): the same
    items byte for byte, gaps only in the direct one, read back at N ranks bit-exact by ``qdcp.load``
    and DCP's reader with the planner (the worker's section); here, at one rank, into whole plain
    and quantized tensors: the global values bitwise, and ``qdcp verify`` passes."""
    import torch

    import qdcp
    from cli_in_process import qdcp_cli
    from quantized_cases import CASE_BY_NAME

    record = _job(shared_dir, "reshard-save", n)
    _sections(record, f"save at {n} ranks", ["direct_writes"])
    out = shared_dir / "dist" / f"n{n}"
    for case in range(3):
        path = out / f"direct{case}"
        full = torch.load(out / f"direct{case}-expected.pt", weights_only=True)
        plain = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in full.items() if isinstance(v, torch.Tensor)}
        quantized = {k: CASE_BY_NAME["int8_row"].from_hp(torch.zeros(v["qdata"].shape) + 1)
                     for k, v in full.items() if isinstance(v, dict)}
        qdcp.load({**plain, **quantized}, path)
        for k, t in plain.items():
            assert torch.equal(t, full[k]) and t.dtype == full[k].dtype, k
        for k, t in quantized.items():  # per-row scales: the stacked shards' components, bit for bit
            assert torch.equal(t.qdata, full[k]["qdata"]) and torch.equal(t.scale, full[k]["scale"]), k
        verified = qdcp_cli("verify", path)
        assert verified.returncode == 0, verified.stdout + verified.stderr


@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_generated_rule_cases_at_n_ranks(shared_dir, n):
    """The generated load-rule cases (tests/rule_ranks.py) in a real job of N processes: drawn
    types, layouts of the N ranks (1-D, 2-D, FSDP2 x TP, HSDP, uneven) and targets, saved with
    ``dcp.save`` + ``QuantizedSavePlanner``, ``qdcp.save`` or ``qdcp.async_save`` and loaded with
    ``dcp.load`` + ``QuantizedLoadPlanner`` (DCP's reader or qdcp's) or ``qdcp.load`` at another
    layout; every rank's target is what docs/api.md's rule says (the worker's section), refusals
    are every rank's and name the key, and rank 0 reads each checkpoint back whole with no other
    rank taking part (``read_entry``, ``consolidate``, ``qdcp verify``)."""
    record = _job(shared_dir, "reshard-save", n)
    _sections(record, f"save at {n} ranks", ["rule_generated"])
    counts = json.loads((shared_dir / "dist" / f"n{n}" / "rule_outcomes.json").read_text())
    checked = {k: counts.get(k, 0) for k in ("bits", "quantized", "plain", "read without a target")}
    assert all(checked.values()), f"at {n} ranks the drawn cases checked too little: {counts}"


@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_one_rank_of_a_job_saves_and_loads_alone(shared_dir, n):
    """One rank of an N-rank job, the others waiting: ``qdcp.save`` / ``async_save`` / ``load``
    with ``no_dist=True`` and ``qdcp.consolidate`` / ``read_entry`` (no collective) return, bit
    for bit (the worker's section; without no_dist a save from one rank waits for the others, as
    DCP's does; consolidate hung that way before it read alone)."""
    record = _job(shared_dir, "reshard-save", n)
    _sections(record, f"save at {n} ranks", ["rank_alone"])


@pytest.mark.parametrize("n", RESHARD_WORLDS)
def test_per_tensor_scale_shards_int8_float8_save_outcome(shared_dir, n):
    """Int8/Float8 PerTensor, each shard quantized on its own: a shard's one scale is the whole
    tensor's (docs/api.md, *Per tensor*), so shards that hold different ones are refused at planning
    naming the key, whatever the cut (even at N=2, 4; uneven at N=3); one rank saves."""
    _job(shared_dir, "reshard-save", n)
    outcomes = json.loads((shared_dir / "dist" / f"n{n}" / "per_tensor_outcomes.json").read_text())
    for name in OK_PER_TENSOR:
        if n > 1:
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
    - Int8/Float8 per-tensor-scale shards that qdcp agreed to save: exact values (a refusal fails).
    """
    record = _reshard_loaded(shared_dir, m)
    _sections(record, f"load at {m} ranks", ["plain_shard", "plain_full", "same_type", "deq_into_quantized",
                                             "mixed", *[f"per_tensor[{c}]" for c in OK_PER_TENSOR]])


@pytest.mark.parametrize("name", NVFP4_PER_TENSOR)
def test_per_tensor_scale_shards_nvfp4_never_load_wrong_values(shared_dir, name):
    for m in (1, 2):
        record = _reshard_loaded(shared_dir, m)
        _sections(record, f"load at {m} ranks", [f"per_tensor[{name}]"])


def test_quantize_on_load_into_sharded_target_uses_global_amax(shared_dir):
    record = _reshard_loaded(shared_dir, 2)
    _sections(record, "load at 2 ranks", ["global_amax"])


# ----------------------------------------------------------------------------- FSDP2

def test_fsdp2_known_limits_are_as_the_docs_say(shared_dir):
    """docs/fsdp2.md's known limits at 2 ranks: FSDP2 over a weight-only Int8Tensor fails in torchao
    (``aten.split``), AdamW8bit over bf16 FSDP2 parameters fails at its step; the docs' workarounds
    (``ignored_params``, fp32 parameters with a bf16 ``MixedPrecisionPolicy``) train, and their
    weights and optimizer states round-trip through ``qdcp.save`` / ``qdcp.load`` bit-exact."""
    _sections(_job(shared_dir, "fsdp-limits", 2), "FSDP2 known limits at 2 ranks", ["fsdp_limits"])


@pytest.mark.parametrize("m", FSDP_LOAD_WORLDS)
def test_fsdp2_nf4_and_low_bit_optimizers_reshard(shared_dir, m):
    """FSDP2 model (NF4 weight, AdamW8bit/AdamW4bit/AdamWFp8 states) saved at 2 and 3 ranks with
    get_state_dict + QuantizedSavePlanner, loaded at M ranks into a fresh FSDP2 model with
    set_state_dict: states stay OptimState*, params and dequantized states equal bitwise, NF4 local
    buffers equal the saved rows', forward output identical, replicated components written once,
    and one more step gives the same params and states as the uninterrupted run. The plain
    ``dcp.async_save`` (DCP's default stager) of the same state, with the next step run before
    its upload finishes, writes data files byte-identical to ``dcp.save``'s."""
    for n in FSDP_SAVE_WORLDS:
        _sections(_job(shared_dir, "fsdp-save", n), f"FSDP2 save at {n} ranks",
                  ["fsdp_save", "fsdp_async_default_stager"])
    record = _job(shared_dir, "fsdp-load", m)
    _sections(record, f"FSDP2 load at {m} ranks", ["fsdp_load", "fsdp_step"])
