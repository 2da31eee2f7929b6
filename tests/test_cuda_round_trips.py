"""Every torchao type of quantized_cases round-trips from CUDA (run by scripts/gpu_check.sh):
raw into the same type on CUDA and on CPU with its bits, into a plain CUDA tensor with the values a
plain CPU target gets, and through the async paths (qdcp.async_save with a QuantizedStager, plain
dcp.async_save with QuantizedSavePlanner) with the source overwritten right after the call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import QuantizedSavePlanner, QuantizedStager
from quantized_cases import CASES, assert_bitwise_equal, assert_same_buffers, inner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu")


def _finished(result) -> None:
    getattr(result, "upload_completion", result).result()


def _overwrite(t: torch.Tensor) -> None:
    """Change every byte of ``t``'s buffers in place (what the next training step does)."""
    with torch.no_grad():
        for b in inner(t).values():
            try:
                b.view(torch.uint8).bitwise_not_()  # every bit of it flipped
            except RuntimeError:  # a buffer whose last dimension is strided
                b.copy_(b.flip(0) if b.dim() else b)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cuda_round_trips(case, tmp_path):
    source = case.make(0).to("cuda")
    want = _cpu(source)
    qdcp.save({"w": source}, tmp_path / "sync")
    same_cuda = {"w": case.make(1).to("cuda")}
    qdcp.load(same_cuda, tmp_path / "sync")
    assert same_cuda["w"].device.type == "cuda"
    assert_same_buffers(_cpu(same_cuda["w"]), want)
    same_cpu = {"w": case.make(1)}
    qdcp.load(same_cpu, tmp_path / "sync")
    assert_same_buffers(same_cpu["w"], want)
    plain_cpu = {"w": torch.empty(source.shape, dtype=case.dtype)}
    plain_cuda = {"w": torch.empty(source.shape, dtype=case.dtype, device="cuda")}
    qdcp.load(plain_cpu, tmp_path / "sync")
    qdcp.load(plain_cuda, tmp_path / "sync")
    assert_bitwise_equal(_cpu(plain_cuda["w"]), plain_cpu["w"])

    stager = QuantizedStager()
    for how in ("qdcp.async_save", "dcp.async_save"):
        live = case.make(0).to("cuda")
        path = tmp_path / how
        if how == "qdcp.async_save":
            result = qdcp.async_save({"w": live}, path, stager=stager)
        else:
            result = dcp.async_save({"w": live}, checkpoint_id=path, planner=QuantizedSavePlanner())
        _overwrite(live)  # after the call returns: the checkpoint holds what was staged
        _finished(result)
        loaded = {"w": case.make(1).to("cuda")}
        qdcp.load(loaded, path)
        assert_same_buffers(_cpu(loaded["w"]), want)
    stager.close()


@pytest.mark.parametrize("files", [1, 3])
def test_cuda_targets_read_through_pinned_buffers_every_item_checked(tmp_path, files):
    """Many items into CUDA targets (each reading thread alternates two pinned buffers, each item
    committed once the next is read; 3 files read on 3 threads, asked for: with CUDA in use the
    default is one): every one bit-exact, in place and all-or-nothing; a flipped byte in any of
    them is a ChecksumError naming its key, the all-or-nothing load leaving the targets as they were."""
    from qdcp import ChecksumError
    from quantized_cases import CASE_BY_NAME
    from stored_bytes import flip_stored_bytes, tensor_bytes

    case = CASE_BY_NAME["int8_row"]
    state = {f"w{i}": case.make(i).to("cuda") for i in range(7)}
    state["bias"] = torch.randn(3000, device="cuda")
    qdcp.save(state, tmp_path / "c", storage_options={"thread_count": files})
    for atomic in (True, False):
        target = {k: (case.make(99).to("cuda") if k != "bias" else torch.zeros(3000, device="cuda")) for k in state}
        qdcp.load(target, tmp_path / "c", atomic=atomic, storage_options={"thread_count": files})
        for k in state:
            assert_same_buffers(_cpu(target[k]), _cpu(state[k])) if k != "bias" else \
                assert_bitwise_equal(_cpu(target[k]), _cpu(state[k]))
    flip_stored_bytes(tmp_path / "c", tensor_bytes(_cpu(state["w3"]).qdata[5:9]), at=3)
    target = {k: (case.make(99).to("cuda") if k != "bias" else torch.zeros(3000, device="cuda")) for k in state}
    before = {k: _cpu(v) for k, v in target.items()}
    with pytest.raises(ChecksumError, match=r"key 'w3'"):
        qdcp.load(target, tmp_path / "c", storage_options={"thread_count": files})
    for k in state:
        assert_same_buffers(_cpu(target[k]), before[k]) if k != "bias" else \
            assert_bitwise_equal(_cpu(target[k]), before[k])
