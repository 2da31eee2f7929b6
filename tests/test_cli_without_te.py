"""The CLI on TransformerEngine checkpoints in a process where TE cannot be imported.

TE checkpoints are written here (TE's real classes on CPU); each verb then runs as a user runs it,
``python -m qdcp ...``, in a subprocess in which ``import transformer_engine`` fails. Every TE format
and GroupedTensor layout: ``inspect``, ``verify``, ``convert`` to safetensors raw (the stored
components) and dequantized (bf16, and fp32 computed in fp32), and to a dequantized DCP checkpoint;
outputs equal the reference dequantize bit for bit. The verbs run one after another in one such
subprocess (``qdcp.cli.main`` once per command line, as the entry point runs it), started once for
the module: each interpreter start costs seconds on the CI's 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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

# run CLI command lines (a JSON list of argv lists) with TransformerEngine made unimportable; print
# a JSON list of [exit status, stdout, stderr], one per command line
_NO_TE = """
import contextlib, io, json, sys
sys.modules['transformer_engine'] = None
from qdcp.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    answers.append([rc, out.getvalue(), err.getvalue()])
sys.stdout.write(json.dumps(answers))
"""


pytestmark = pytest.mark.usefixtures("hopper")


def _commands(path, out) -> dict[str, list[str]]:
    """Every command line the tests check, by name (``out``: a directory for their outputs)."""
    return {"inspect-json": ["inspect", path, "--json"], "inspect": ["inspect", path], "verify": ["verify", path],
            "raw": ["convert", path, out / "raw.safetensors", "--to", "safetensors"],
            "deq-None": ["convert", path, out / "deq.safetensors", "--to", "safetensors", "--dequantize"],
            "deq-fp32": ["convert", path, out / "deq32.safetensors", "--to", "safetensors", "--dequantize",
                         "--dtype", "fp32"],
            "portable": ["convert", path, out / "portable", "--to", "dcp", "--dequantize"]}


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


@pytest.fixture(scope="module")
def ran(saved, tmp_path_factory) -> tuple[Path, dict[str, subprocess.CompletedProcess]]:
    """Every command of :func:`_commands`, run in one subprocess without TE; the outputs' directory
    and each command's answer (each must exit 0)."""
    path, _ = saved
    out = tmp_path_factory.mktemp("te_cli_out")
    commands = _commands(path, out)
    proc = subprocess.run([sys.executable, "-c", _NO_TE, json.dumps([[str(a) for a in argv]
                                                                     for argv in commands.values()])],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    answers = {}
    for (name, argv), (rc, stdout, stderr) in zip(commands.items(), json.loads(proc.stdout), strict=True):
        answers[name] = subprocess.CompletedProcess(argv, rc, stdout, stderr)
        assert rc == 0, (name, stdout[-2000:] + stderr[-3000:])
    return out, answers


def _reference(t, dtype=None) -> torch.Tensor:
    return find_adapter(t).dequantize(t, dtype)


def test_the_subprocess_really_cannot_import_te():
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.modules['transformer_engine'] = None\n"
                           "import transformer_engine"], capture_output=True, text=True)
    assert proc.returncode != 0 and "import of transformer_engine halted" in proc.stderr


def test_inspect_and_verify(saved, ran):
    _, state = saved
    _, answers = ran
    info = json.loads(answers["inspect-json"].stdout)
    assert {k: v["stored_as"] for k, v in info.items()} == {k: "raw" for k in state}
    table = answers["inspect"].stdout
    assert all(any(line.startswith(f"{k} ") for line in table.splitlines()) for k in state)
    out = answers["verify"].stdout
    assert out.strip().splitlines()[-1].startswith(f"OK: {len(state)} entries, 0 problems; ")


def test_convert_to_safetensors_raw_writes_the_stored_components(saved, ran):
    from safetensors import safe_open

    _, state = saved
    out, _ = ran
    with safe_open(str(out / "raw.safetensors"), "pt") as f:
        for key, t in state.items():
            for name, comp in find_adapter(t).components(t).items():
                assert torch.equal(bits(f.get_tensor(f"{key}.__qdcp__.{name}")), bits(comp)), (key, name)


@pytest.mark.parametrize("dtype", [None, "fp32"])
def test_convert_to_safetensors_dequantized_equals_the_reference(saved, ran, dtype):
    from safetensors import safe_open

    _, state = saved
    out = ran[0] / ("deq32.safetensors" if dtype else "deq.safetensors")
    want_dtype = torch.float32 if dtype else None
    with safe_open(str(out), "pt") as f:
        for key, t in state.items():
            want = _reference(t, want_dtype)
            got = f.get_tensor(key)
            assert got.dtype == want.dtype and torch.equal(bits(got), bits(want)), key


def test_convert_to_dequantized_dcp_is_plain_tensors(saved, ran):
    _, state = saved
    out = ran[0] / "portable"
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
