"""The CLI on TransformerEngine checkpoints in a process where TE cannot be imported.

TE checkpoints are written here (TE's real classes on CPU); each verb then runs as a user runs it,
``python -m qdcp ...``, in a subprocess in which ``import transformer_engine`` fails. Every TE format
and GroupedTensor layout: ``inspect``, ``verify``, ``convert`` to safetensors raw (the stored
components) and dequantized (bf16, and fp32 computed in fp32), and to a dequantized DCP checkpoint;
outputs equal the reference dequantize bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import te_cpu

if not te_cpu.te_installed():
    pytest.skip("transformer_engine is not installed", allow_module_level=True)
te_cpu.install()

import te_groups  # noqa: E402
import test_transformer_engine as single  # noqa: E402
from qdcp import QuantizedSavePlanner  # noqa: E402
from qdcp.adapters import find_adapter  # noqa: E402
from quantized_cases import bits  # noqa: E402

GROUPS = {"g_mxfp8": ("mxfp8_both", "uniform"), "g_nvfp4": ("nvfp4_both", "vary_first"),
          "g_block2": ("block2_both", "uniform"), "g_delayed": ("delayed_both_e5m2", "vary_last")}

# run the CLI with TransformerEngine made unimportable
_NO_TE = ("import sys; sys.modules['transformer_engine'] = None; from qdcp.cli import main; "
          "sys.exit(main(sys.argv[1:]))")


pytestmark = pytest.mark.usefixtures("hopper")


def cli(*args, ok=True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", _NO_TE, *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One entry per TE single-tensor case and four groups, saved raw; their live tensors."""
    state = {}
    for case in single.CASES:
        with te_cpu.simulate_gpu(case.cap):
            state[case.name] = case.build(0)
    for key, (name, shapes) in GROUPS.items():
        state[key] = te_groups.BY[name].build(1, te_groups.SHAPES[shapes])
    path = tmp_path_factory.mktemp("te_cli") / "ckpt"
    with te_cpu.simulate_gpu(te_cpu.HOPPER):
        dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner(), no_dist=True)
    return path, state


def _reference(t, dtype=None) -> torch.Tensor:
    return find_adapter(t).dequantize(t, dtype)


def test_the_subprocess_really_cannot_import_te():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['transformer_engine'] = None\n"
                           "import transformer_engine"], capture_output=True, text=True)
    assert proc.returncode != 0 and "import of transformer_engine halted" in proc.stderr


def test_inspect_and_verify(saved):
    path, state = saved
    info = json.loads(cli("inspect", path, "--json").stdout)
    assert {k: v["stored_as"] for k, v in info.items()} == {k: "raw" for k in state}
    table = cli("inspect", path).stdout
    assert all(any(line.startswith(f"{k} ") for line in table.splitlines()) for k in state)
    out = cli("verify", path).stdout
    assert out.strip().splitlines()[-1] == f"OK: {len(state)} entries, 0 problems"


def test_convert_to_safetensors_raw_writes_the_stored_components(saved, tmp_path):
    from safetensors import safe_open

    path, state = saved
    cli("convert", path, tmp_path / "raw.safetensors", "--to", "safetensors")
    with safe_open(str(tmp_path / "raw.safetensors"), "pt") as f:
        for key, t in state.items():
            for name, comp in find_adapter(t).components(t).items():
                assert torch.equal(bits(f.get_tensor(f"{key}.__qdcp__.{name}")), bits(comp)), (key, name)


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_convert_to_safetensors_dequantized_equals_the_reference(saved, tmp_path, dtype):
    from safetensors import safe_open

    path, state = saved
    out = tmp_path / "deq.safetensors"
    cli("convert", path, out, "--to", "safetensors", "--dequantize", *(["--dtype", dtype] if dtype else []))
    want_dtype = torch.float32 if dtype else None
    with safe_open(str(out), "pt") as f:
        for key, t in state.items():
            want = _reference(t, want_dtype)
            got = f.get_tensor(key)
            assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), key


def test_convert_to_dequantized_dcp_is_plain_tensors(saved, tmp_path):
    path, state = saved
    out = tmp_path / "portable"
    cli("convert", path, out, "--to", "dcp", "--dequantize")
    target = {k: torch.zeros(_reference(t).shape, dtype=torch.bfloat16) for k, t in state.items()}
    dcp.load(target, checkpoint_id=out)  # stock DCP
    for key, t in state.items():
        assert torch.equal(bits(target[key]), bits(_reference(t))), key


def test_fp32_values_are_computed_in_fp32(saved):
    """A Float8 tensor's fp32 values are fp8 x scale_inv in fp32, not the bf16 dequantize widened."""
    _, state = saved
    t = state["f8_cs_rowwise"]
    exact = t._data.view(torch.float8_e4m3fn).float() * t._scale_inv.float()
    assert torch.equal(bits(_reference(t, torch.float32)), bits(exact))
    assert not torch.equal(_reference(t).float(), exact)  # the bf16 dequantize rounds
