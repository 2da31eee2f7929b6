"""The examples run as users run them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from torchrun_jobs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.multiproc
def test_fsdp2_train_resumes_at_another_world_size(tmp_path):
    """DCP's own calls with only qdcp's planners (``--api dcp``): trained at 2 ranks, resumed at 4
    from the newest checkpoint and from step 2 (the resumed run writes its checkpoints again:
    overwrite=True). The same example through ``qdcp.async_save`` / ``qdcp.load`` (the default
    ``--api qdcp``) runs in the demo (2 ranks, resumed at 4 from step 6, writing step 9 again:
    test_demo) and in test_one_rank.py (1 rank, resumed at 1 and 2 from step 2, writing steps 4
    and 6 again), with the same checks of the losses."""
    def run(n, *extra):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
               f"--master-port={free_port()}", os.path.join(ROOT, "examples", "fsdp2_train.py"),
               "--dir", str(tmp_path), "--steps", "5", "--ckpt-every", "2", "--api", "dcp", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout

    run(2)
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("step_")) == ["step_2", "step_4"]
    first = os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns
    out = run(4, "--resume")
    assert "resumed from step 4 at world size 4" in out
    assert "identical to the first run: True" in out
    # from step 2: the run writes step_4 again, over the first run's (overwrite=True)
    out = run(4, "--resume", "--resume-step", "2")
    assert "resumed from step 2 at world size 4" in out and "identical to the first run: True" in out
    assert os.stat(tmp_path / "step_4" / ".metadata").st_mtime_ns != first  # written again


DEMO_WAIT_S = 1200  # .ci/run's demo: its install and run, beside the suite's


def _demo_output(tmp_path) -> str:
    """examples/demo.py's stdout: the file ``QDCP_DEMO_OUTPUT`` names where .ci/run runs the demo
    beside the suite (the README's first command, in its own fresh environment: it runs once; its
    exit status lands in the file ``QDCP_DEMO_STATUS`` names when it ends), else the demo run here."""
    recorded = os.environ.get("QDCP_DEMO_OUTPUT")
    if recorded:
        status = os.environ.get("QDCP_DEMO_STATUS")
        if status:
            deadline = time.monotonic() + DEMO_WAIT_S
            while not os.path.exists(status):
                assert time.monotonic() < deadline, f"the demo .ci/run started did not end in {DEMO_WAIT_S} s"
                time.sleep(1)
            with open(status) as f:
                code = f.read().strip()
        with open(recorded) as f:
            out = f.read()
        assert not status or code == "0", f"the demo exited {code}:\n{out[-3000:]}"
        return out
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "demo.py"), "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.multiproc
def test_demo(tmp_path):
    """The README's first command runs examples/demo.py: FSDP2 training with async checkpoints on 2
    ranks (``qdcp.async_save``), a resume at 4 ranks from step 6 (``qdcp.load``; step 9 written
    again) with identical losses, the summary, and examples/quickstart.py's per-key table: six
    torchao types whose reloaded values equal the library's dequantize."""
    out = _demo_output(tmp_path)
    assert out.rstrip().splitlines()[-1].startswith("done in "), out[-3000:]
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("  step ")][:3] == ["1/9", "2/9", "3/9"]
    assert sum("written in the background" in ln for ln in out.splitlines()) == 4  # 3 saves, 1 after resuming
    assert "losses identical to the uninterrupted 2-rank run: True" in out
    assert "stored raw (inner buffers + JSON spec): torchao.NF4Tensor, torchao.OptimState8bit" in out
    # the quickstart's table
    lines = out.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["key", "type"])
    rows = {ln.split()[0]: ln.split() for ln in lines[header + 1:] if ln.split() and ln.split()[0].endswith("weight")}
    assert len(rows) == 6
    for key, row in rows.items():
        assert row[-1] == "0" and row[-2] == "0", f"{key}: reloaded values differ from the library's dequantize"
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
