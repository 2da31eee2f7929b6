"""DCP's own reader with ``QuantizedLoadPlanner`` into targets on the CPU and, where CUDA is present,
on the GPU: each whole item is checked in a host buffer before it reaches its target
(pinned for a CUDA target, copied on without blocking), and ``dcp.load`` returns with every target
filled, as vanilla's does. Run on CPU by the suite and on CUDA by scripts/gpu_check.sh."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torchao.quantization import Int8Tensor
from torchao.quantization.granularity import PerRow

import qdcp
from qdcp import ChecksumError, QuantizedLoadPlanner
from quantized_cases import assert_bitwise_equal, assert_same_buffers, buffers_diff, raise_inner
from stored_bytes import flip_stored_bytes, tensor_bytes

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {f"w{i}": Int8Tensor.from_hp(torch.randn(1024, 2048, generator=g), PerRow()) for i in range(3)}
    state["big"] = torch.randn(1024, 1024, generator=g).to(torch.bfloat16)  # 2 MiB: hashed in the background
    state["wide"] = torch.randn(512, 1024, generator=g).to(torch.bfloat16)  # into a float32 target
    state["bias"] = torch.randn(3000, generator=g)
    state["step"] = 17
    return state


def _target(device: str) -> dict:
    g = torch.Generator().manual_seed(9)
    target = {f"w{i}": Int8Tensor.from_hp(torch.randn(1024, 2048, generator=g), PerRow()).to(device)
              for i in range(3)}
    target["big"] = torch.zeros(1024, 1024, dtype=torch.bfloat16, device=device)
    target["wide"] = torch.zeros(512, 1024, dtype=torch.float32, device=device)
    target["bias"] = torch.zeros(3000, device=device)
    target["step"] = 0
    return target


def _whole_items(path) -> int:
    """Stored chunks and objects of a one-rank checkpoint: each is read whole."""
    md = FileSystemReader(path).read_metadata().state_dict_metadata
    return sum(len(m.chunks) if isinstance(m, TensorStorageMetadata) else isinstance(m, BytesStorageMetadata)
               for m in md.values())


def _check(target: dict, source: dict) -> None:
    for i in range(3):
        assert_same_buffers(target[f"w{i}"].cpu(), source[f"w{i}"])
    assert_bitwise_equal(target["big"].cpu(), source["big"])
    assert_bitwise_equal(target["wide"].cpu(), source["wide"].float())
    assert_bitwise_equal(target["bias"].cpu(), source["bias"])
    assert target["step"] == 17


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("atomic", [False, True])
def test_dcp_reader_and_planner_fill_device_targets_checked(tmp_path, device, atomic):
    """Quantized, plain and wider targets bit-exact, every stored item hashed by the planner once;
    the plain targets read on another CUDA stream right after ``dcp.load`` returns hold the loaded
    values (the load waited for the copies it left running)."""
    source = _source()
    qdcp.save(source, tmp_path / "c")
    target = _target(device)
    planner = QuantizedLoadPlanner(atomic=atomic)
    dcp.load(target, storage_reader=FileSystemReader(tmp_path / "c"), planner=planner)
    if device == "cuda":
        side = torch.cuda.Stream()  # not told to wait for the current stream: the load must have
        with torch.cuda.stream(side):
            seen = {k: target[k].clone() for k in ("big", "wide", "bias")}
        side.synchronize()
        for k, v in seen.items():
            assert_bitwise_equal(v.cpu(), target[k].cpu())
    _check(target, source)
    assert planner.hashed_items == _whole_items(tmp_path / "c")


@pytest.mark.parametrize("device", DEVICES)
def test_a_corrupt_item_bound_for_the_device_is_refused(tmp_path, device):
    """A flipped byte in a stored item whose target is on the device: a ChecksumError naming its
    key; the all-or-nothing load leaves every target as it was."""
    source = _source()
    qdcp.save(source, tmp_path / "c")
    flip_stored_bytes(tmp_path / "c", tensor_bytes(source["big"][100:110]), at=5)
    target = _target(device)
    before = {k: (v.cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in target.items()}
    with pytest.raises(ChecksumError, match=r"key 'big'"):
        raise_inner(lambda: dcp.load(target, storage_reader=FileSystemReader(tmp_path / "c"),
                                     planner=QuantizedLoadPlanner(atomic=True)))
    for k, v in before.items():
        assert (buffers_diff(target[k].cpu(), v) is None) if isinstance(v, torch.Tensor) else target[k] == v, k


def test_background_hashes_hold_a_bounded_amount_of_host_memory(tmp_path, monkeypatch):
    """Items waiting for their background hash hold at most ``_PENDING_MAX`` bytes: with hashing
    made slower than reading and the cap at 3 MiB, DCP's reader never has more than two 2-MiB items
    waiting (at the default cap every item of this load would be); the load is still exact, and
    a corrupt item is still refused naming its key."""
    from concurrent.futures import ThreadPoolExecutor

    from qdcp import checksums
    from qdcp.planning import verifier

    waiting, most = [0], [0]
    pool = ThreadPoolExecutor(2)

    class SlowPool:  # hashes 0.2 s late; counts the hashes submitted and not yet collected
        def submit(self, fn, data):
            waiting[0] += 1
            most[0] = max(most[0], waiting[0])
            fut = pool.submit(lambda: (time.sleep(0.2), fn(data))[1])
            result = fut.result

            def collected(timeout=None):
                value = result(timeout)
                waiting[0] -= 1
                return value
            fut.result = collected
            return fut

    g = torch.Generator().manual_seed(3)
    source = {f"p{i}": torch.randn(512, 1024, generator=g) for i in range(8)}  # 2 MiB each
    qdcp.save(source, tmp_path / "c")
    monkeypatch.setattr(checksums, "hash_pool", lambda: SlowPool())
    for cap, bound in ((3 << 20, 2), (verifier._PENDING_MAX, 8)):
        monkeypatch.setattr(verifier, "_PENDING_MAX", cap)
        most[0] = 0
        target = {k: torch.zeros_like(v) for k, v in source.items()}
        dcp.load(target, storage_reader=FileSystemReader(tmp_path / "c"), planner=QuantizedLoadPlanner())
        assert all(torch.equal(target[k], source[k]) for k in source)
        assert most[0] == bound, (cap, most[0])
    monkeypatch.setattr(verifier, "_PENDING_MAX", 3 << 20)
    flip_stored_bytes(tmp_path / "c", tensor_bytes(source["p1"][7:9]), at=3)
    with pytest.raises(ChecksumError, match=r"key 'p1'"):
        raise_inner(lambda: dcp.load({k: torch.zeros_like(v) for k, v in source.items()},
                                     storage_reader=FileSystemReader(tmp_path / "c"),
                                     planner=QuantizedLoadPlanner()))
    pool.shutdown()
