"""The examples run as users run them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from torchrun_jobs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "quickstart.py"), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:2] == ["key", "type"]
    rows = {ln.split()[0]: ln.split() for ln in lines[1:] if ln.split() and ln.split()[0].endswith("weight")}
    assert len(rows) == 6
    for key, row in rows.items():
        assert row[-1] == "0" and row[-2] == "0", f"{key}: reloaded values differ from the library's dequantize"
    assert "bit-identically: True" in proc.stdout


@pytest.mark.multiproc
@pytest.mark.parametrize("api", ["qdcp", "dcp"])
def test_fsdp2_train_resumes_at_another_world_size(tmp_path, api):
    """qdcp.async_save / qdcp.load, and DCP's own calls with only qdcp's planners (the resumed run
    writes its checkpoints again: overwrite=True through either)."""
    def run(n, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               f"--master-port={free_port()}", os.path.join(ROOT, "examples", "fsdp2_train.py"),
               "--dir", str(tmp_path), "--steps", "5", "--ckpt-every", "2", "--api", api, *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout

    run(2)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_2", "step_4"]
    first = os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns
    out = run(4, "--resume")
    assert "resumed from step 4 at world size 4" in out
    assert "identical to the first run: True" in out
    # from step 2: the run writes step_4 again, over the first run's (overwrite=True by either API)
    out = run(4, "--resume", "--resume-step", "2")
    assert "resumed from step 2 at world size 4" in out and "identical to the first run: True" in out
    assert os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns != first  # written again


@pytest.mark.multiproc
def test_demo(tmp_path):
    """The README's first command runs examples/demo.py: FSDP2 training with async checkpoints on 2
    ranks, a resume at 4 ranks with identical losses, the summary and the per-key table."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("  step ")][:3] == ["1/9", "2/9", "3/9"]
    assert sum("written in the background" in ln for ln in out.splitlines()) == 4  # 3 saves, 1 after resuming
    assert "losses identical to the uninterrupted 2-rank run: True" in out
    assert "stored raw (inner buffers + JSON spec): torchao.NF4Tensor, torchao.OptimState8bit" in out
    assert "raw checkpoint reloaded into a quantized model bit-identically: True" in out


def test_custom_adapter_example_through_every_door(tmp_path):
    """examples/custom_adapter.py: the adapter of docs/adapters.md with the planners (same type and
    plain targets), QuantizedStager, to_device, and the CLI with ``--import``."""
    example = os.path.join(ROOT, "examples", "custom_adapter.py")
    proc = subprocess.run([sys.executable, example, "--dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[:4] == [
        "same type, bit-exact: True", "plain float32 target = dequantize: True",
        "async save with QuantizedStager holds the values at the call: True",
        "to_device keeps the parameter and its type: True BlockInt8Tensor"]
    ckpt = str(tmp_path / "sync")
    cli = [sys.executable, "-m", "qdcp", "--import", "custom_adapter"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "examples"),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(cli + ["verify", ckpt, "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0 and "OK: 2 entries, 0 problems" in run.stdout, run.stdout + run.stderr
    without = subprocess.run([sys.executable, "-m", "qdcp", "verify", ckpt, "--quiet"], capture_output=True,
                             text=True, env=env, timeout=300)
    assert without.returncode == 1 and "example.BlockInt8Tensor" in without.stdout
    out = str(tmp_path / "w.safetensors")
    run = subprocess.run(cli + ["convert", ckpt, out, "--to", "safetensors", "--dequantize", "--dtype", "fp32",
                                "--quiet"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import custom_adapter
    finally:
        sys.path.pop(0)
    from safetensors.torch import load_file
    hp = torch.randn(64, 128, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    want = custom_adapter.BlockInt8Tensor.quantize(hp, 32).dequantize(torch.float32)
    assert torch.equal(load_file(out)["w"], want)
