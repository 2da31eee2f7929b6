"""``qdcp.hf.convert.to_safetensors`` (the library side of ``qdcp convert --to safetensors``) on a
real checkpoint: its named rows are exactly the tensors of the file it wrote, read back with
safetensors; its safety rules are the CLI's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

import qdcp
from qdcp.hf.convert import SafetensorsResult, TensorRow, UnwritableDtype, to_safetensors
from qdcp.outputs import OutputError
from quantized_cases import CASE_BY_NAME, bits, qdcp_save

CASES = {"w_int8": "int8_group32", "w_nf4": "nf4", "w_nvfp4": "nvfp4_per_tensor"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("convert") / "ckpt"
    state = {key: CASE_BY_NAME[case].make(i) for i, (key, case) in enumerate(CASES.items())}
    state.update(bias=torch.randn(5), count=torch.arange(3), step=7)
    qdcp_save(path, state, no_dist=True)
    return path, state


def _header(path) -> tuple[dict, int]:
    """The file's safetensors header as written (tensors in the order their data lies) and its length."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return dict(sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])), n


def _assert_rows_are_the_file(result: SafetensorsResult, out) -> None:
    header, n = _header(out)
    assert [r.name for r in result.rows] == list(header)  # every tensor, in file order
    with safe_open(str(out), "pt") as f:
        for row in result.rows:
            start, stop = header[row.name]["data_offsets"]
            t = f.get_tensor(row.name)
            assert (tuple(t.shape), t.dtype, row.nbytes) == (row.shape, row.dtype, stop - start), row
    assert result.nbytes == os.path.getsize(out) - 8 - n  # the file's data, all of it


def test_raw_rows_name_each_component_as_stored(checkpoint, tmp_path):
    path, state = checkpoint
    out = tmp_path / "raw.safetensors"
    result = to_safetensors(path, out)
    assert (result.out, result.skipped, result.tensors) == (str(out), ("step",), len(result.rows))
    want = [TensorRow("bias", (5,), torch.float32, "bias", None), TensorRow("count", (3,), torch.int64, "count", None)]
    for key in sorted(CASES):
        comps = qdcp.find_adapter(state[key]).components(state[key])
        want += [TensorRow(f"{key}.__qdcp__.{n}", tuple(v.shape), v.dtype, key, n) for n, v in comps.items()]
    assert sorted(result.rows) == sorted(want)
    _assert_rows_are_the_file(result, out)
    with safe_open(str(out), "pt") as f:
        for row in result.rows:
            t = state[row.key]
            value = t if row.component is None else qdcp.find_adapter(t).components(t)[row.component]
            assert torch.equal(bits(f.get_tensor(row.name)), bits(value)), row.name
        assert f.metadata()["producer"] == "qdcp" and set(json.loads(f.metadata()["qdcp"])["entries"]) == set(CASES)


def test_dequantized_rows_are_the_entries_values_in_the_dtype_asked(checkpoint, tmp_path):
    path, state = checkpoint
    out = tmp_path / "deq.safetensors"
    result = to_safetensors(path, out, dequantize=True, dtype=torch.float16)
    assert result.rows == (TensorRow("bias", (5,), torch.float16, "bias", None),
                           TensorRow("count", (3,), torch.int64, "count", None),  # not floating: as stored
                           *(TensorRow(k, tuple(state[k].shape), torch.float16, k, None) for k in sorted(CASES)))
    assert result.skipped == ("step",) and result.nbytes == 5 * 2 + 3 * 8 + 3 * 256 * 128 * 2
    _assert_rows_are_the_file(result, out)
    default = to_safetensors(path, tmp_path / "deq_default.safetensors", dequantize=True)
    with safe_open(str(tmp_path / "deq_default.safetensors"), "pt") as f:
        for key, case in CASES.items():
            want = CASE_BY_NAME[case].dequantize(state[key])
            assert torch.equal(bits(f.get_tensor(key)), bits(want)), key
        assert "qdcp" not in f.metadata()
    assert [r.dtype for r in default.rows[2:]] == [torch.bfloat16] * 3


def test_replaces_only_its_own_file_and_never_its_input(checkpoint, tmp_path):
    path, _ = checkpoint
    out = tmp_path / "w.safetensors"
    to_safetensors(path, out)
    with pytest.raises(OutputError, match="exists; pass --overwrite"):
        to_safetensors(path, out, dequantize=True)
    assert to_safetensors(path, out, dequantize=True, overwrite=True).rows[2].component is None
    mine = tmp_path / "mine.safetensors"
    mine.write_bytes(b"user data")
    with pytest.raises(OutputError, match="is not a safetensors file qdcp wrote"):
        to_safetensors(path, mine, overwrite=True)
    assert mine.read_bytes() == b"user data"
    with pytest.raises(OutputError, match="lies inside the input"):
        to_safetensors(path, path / "inside.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["mine.safetensors", "w.safetensors"]


def test_a_dtype_safetensors_cannot_hold_is_refused_before_writing(tmp_path):
    qdcp_save(tmp_path / "ckpt", {"z": torch.randn(4, dtype=torch.complex64), "w": torch.randn(3)}, no_dist=True)
    with pytest.raises(UnwritableDtype, match=r"tensor 'z' \(key 'z'\): dtype torch.complex64 has no safetensors"):
        to_safetensors(tmp_path / "ckpt", tmp_path / "out" / "z.safetensors")
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    proc = subprocess.run([sys.executable, "-m", "qdcp", "convert", str(tmp_path / "ckpt"), str(tmp_path / "z.st"),
                           "--to", "safetensors"], capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr.count("\n")) == (2, "", 1), proc.stderr  # one line, exit 2
    assert "tensor 'z' (key 'z'): dtype torch.complex64 has no safetensors name" in proc.stderr
    assert not (tmp_path / "z.st").exists()
