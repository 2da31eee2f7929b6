"""A checkpoint of torchao tensors written by DCP's own ``dcp.save`` (no qdcp planner: each tensor
pickled whole) loads through ``qdcp.load``: into the same type as from a dequantized checkpoint of
the same values, into a plain target as the library's own ``dequantize()``, bitwise. A stored
tensor whose values cannot be computed is a ``CheckpointFormatError`` naming the key, the target
left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers, bits, inner

CASES = ["int8_group32", "float8_row", "nf4", "mx_fp4_swizzled", "nvfp4", "optim8bit_signed", "optim4bit"]


@pytest.mark.parametrize("name", CASES)
def test_a_stock_checkpoint_of_torchao_tensors_loads(tmp_path, name):
    case = CASE_BY_NAME[name]
    source = {"w": case.make(0), "b": torch.arange(3.0)}
    dcp.save(source, checkpoint_id=tmp_path / "stock")
    qdcp.save(source, tmp_path / "dequantized", dequantize=True)
    got, want = ({"w": case.make(1), "b": torch.zeros(3)} for _ in range(2))
    qdcp.load(got, tmp_path / "stock")
    qdcp.load(want, tmp_path / "dequantized")
    assert_same_buffers(got["w"], want["w"])  # quantized like the target from the same values
    plain = {"w": torch.zeros(source["w"].shape, dtype=source["w"].dtype), "b": torch.zeros(3)}
    qdcp.load(plain, tmp_path / "stock")
    assert_bitwise_equal(plain["w"], case.dequantize(source["w"]))
    assert torch.equal(plain["b"], source["b"])


def test_a_stored_tensor_whose_values_cannot_be_computed_names_its_key(tmp_path):
    case = CASE_BY_NAME["int8_group32"]
    good = case.make(0)
    _, ctx = good.__tensor_flatten__()
    damaged = type(good).__tensor_unflatten__({"qdata": good.qdata, "scale": good.scale[:, :3].contiguous()}, ctx,
                                              good.shape, good.stride())  # a scale too short for its blocks
    dcp.save({"layers.0.w": damaged}, checkpoint_id=tmp_path / "stock")
    target = {"layers.0.w": case.make(1)}
    before = {n: bits(t).clone() for n, t in inner(target["layers.0.w"]).items()}
    with pytest.raises(CheckpointFormatError, match=r"key 'layers\.0\.w': the stored chunk is a whole Int8Tensor "
                                                    r"\(pickled by DCP's own save.*cannot be computed"):
        qdcp.load(target, tmp_path / "stock")
    assert all(torch.equal(bits(t), before[n]) for n, t in inner(target["layers.0.w"]).items())


_FRESH = """
import json, sys
import torch
import qdcp
assert not any(m.startswith("torchao") for m in sys.modules), "torchao imported before reading"
path = sys.argv[1]
out = {}
for key in ("w", "nf4"):
    v = qdcp.read_entry(path, key, dequantize=True)
    out[key] = v.float().flatten().tolist()
print(json.dumps(out))
"""


def test_a_process_that_has_not_imported_torchao_reads_them(tmp_path):
    """The CLI and a script with plain targets have not imported torchao: the pickled torchao
    tensors are loaded all the same (their adapter imports torchao from its own modules, as for
    a raw entry; weights-only loading needs torchao's classes allowed), values as dequantize()."""
    import json
    import os
    import subprocess
    import sys

    source = {"w": CASE_BY_NAME["int8_group32"].make(0), "nf4": CASE_BY_NAME["nf4"].make(1)}
    dcp.save(source, checkpoint_id=tmp_path / "stock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(qdcp.__file__)),
                                                         os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _FRESH, str(tmp_path / "stock")], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    for key, case in (("w", "int8_group32"), ("nf4", "nf4")):
        want = CASE_BY_NAME[case].dequantize(source[key]).float().flatten()
        assert torch.equal(torch.tensor(got[key]), want), key
    verify = subprocess.run([sys.executable, "-m", "qdcp", "verify", str(tmp_path / "stock")], capture_output=True,
                            text=True, env=env, timeout=300)
    assert verify.returncode == 0 and "OK: 2 entries, 0 problems" in verify.stdout, verify.stdout + verify.stderr


def test_a_pickled_class_no_adapter_handles_is_refused_unimported(tmp_path):
    """A stored chunk pickled as a class of a module no adapter knows: refused naming the class,
    the module never imported (it writes a file if it is)."""
    import os
    import subprocess
    import sys

    (tmp_path / "evilmod.py").write_text(
        "import pathlib, torch\n"
        f"pathlib.Path({str(tmp_path / 'IMPORTED')!r}).write_text('yes')\n"
        "class Sub(torch.Tensor):\n    pass\n")
    make = ("import sys, torch, torch.distributed.checkpoint as dcp\n"
            f"sys.path.insert(0, {str(tmp_path)!r})\nimport evilmod\n"
            "t = torch.arange(6.0).as_subclass(evilmod.Sub)\n"
            f"dcp.save({{'x': t}}, checkpoint_id={str(tmp_path / 'stock')!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(qdcp.__file__)),
                                                         str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    assert subprocess.run([sys.executable, "-c", make], env=env, timeout=300).returncode == 0
    os.remove(tmp_path / "IMPORTED")
    with pytest.raises(CheckpointFormatError, match=r"key 'x'.*pickled evilmod\.Sub .*no registered qdcp adapter"):
        qdcp.read_entry(tmp_path / "stock", "x")
    assert not (tmp_path / "IMPORTED").exists()
