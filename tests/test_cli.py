"""The qdcp command line on real checkpoints: each verb once as users run it (``python -m qdcp``, a
subprocess: the installed entry point and its exit status; on a terminal for the progress bars), the
rest through ``qdcp.cli.main`` in this process (tests/cli_in_process.py), which is what the entry
point runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from cli_in_process import qdcp_cli
from qdcp import QuantizedSavePlanner
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, bits
from stored_bytes import resealed

CASES = [CASE_BY_NAME[n] for n in ("int8_group32", "mx_fp8_e5m2_swizzled", "nvfp4_per_tensor", "nf4",
                                   "optim4bit")]


def spawn(*args, ok=True) -> subprocess.CompletedProcess:
    """``python -m qdcp ARGS`` in a subprocess."""
    proc = subprocess.run([sys.executable, "-m", "qdcp", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def run(*args, ok=True) -> subprocess.CompletedProcess:
    """``qdcp ARGS`` through ``qdcp.cli.main`` in this process."""
    proc = qdcp_cli(*args)
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    state = {c.name: c.make(i) for i, c in enumerate(CASES)}
    state["bias"] = torch.randn(5)
    state["step"] = 7
    dcp.save(state, checkpoint_id=path, planner=QuantizedSavePlanner())
    return path, state


def test_inspect_table_and_json(checkpoint):
    path, state = checkpoint
    out = spawn("inspect", path).stdout
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["key", "stored", "type"]
    assert any(ln.startswith("nf4 ") and "torchao.NF4Tensor" in ln for ln in lines)
    assert lines[-1].startswith("total")
    info = json.loads(run("inspect", path, "--json").stdout)
    assert info == json.loads(json.dumps(qdcp.describe(path)))
    assert info["step"]["stored_as"] == "object" and info["bias"]["stored_as"] == "plain"


def test_verify_ok_then_detects_truncation(checkpoint, tmp_path):
    path, _ = checkpoint
    proc = run("verify", path)
    assert proc.stdout.strip().endswith("0 problems; every item checked against its recorded checksum")
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = bad / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    proc = run("verify", bad, ok=False)
    assert proc.returncode == 1 and "FAIL" in proc.stdout


def test_verify_detects_chunk_holes(checkpoint, tmp_path):
    import pickle
    import shutil
    path, _ = checkpoint
    bad = tmp_path / "holes"
    shutil.copytree(path, bad)
    md = pickle.loads((bad / ".metadata").read_bytes())
    item = md.state_dict_metadata["int8_group32.__qdcp__.qdata"]
    ch = item.chunks[0]
    item.chunks[0] = type(ch)(offsets=ch.offsets, sizes=torch.Size([ch.sizes[0] - 1, ch.sizes[1]]))
    (bad / ".metadata").write_bytes(pickle.dumps(resealed(md)))  # past the digest: the structural checks
    proc = run("verify", bad, ok=False)
    assert proc.returncode == 1 and "int8_group32.__qdcp__.qdata: chunks cover" in proc.stdout


def test_exit_codes_for_bad_paths(tmp_path):
    assert spawn("verify", tmp_path / "missing", ok=False).returncode == 2
    (tmp_path / "notckpt").mkdir()
    proc = spawn("inspect", tmp_path / "notckpt", ok=False)
    assert proc.returncode == 2 and "no .metadata" in proc.stderr


def test_convert_safetensors_raw_and_dequantized(checkpoint, tmp_path):
    from safetensors import safe_open
    path, state = checkpoint
    out = tmp_path / "raw.safetensors"
    run("convert", path, out, "--to", "safetensors")
    with safe_open(str(out), "pt") as f:
        spec = json.loads(f.metadata()["qdcp"])
        assert set(spec["entries"]) == {c.name for c in CASES}
        for c in CASES:
            adapter = qdcp.find_adapter(state[c.name])
            for name, comp in adapter.components(state[c.name]).items():
                assert torch.equal(bits(f.get_tensor(f"{c.name}.__qdcp__.{name}")), bits(comp))
        assert torch.equal(f.get_tensor("bias"), state["bias"])
    out2 = tmp_path / "deq.safetensors"
    run("convert", path, out2, "--to", "safetensors", "--dequantize")
    with safe_open(str(out2), "pt") as f:
        for c in CASES:
            assert_bitwise_equal(f.get_tensor(c.name), c.dequantize(state[c.name]))
    out3 = tmp_path / "deq16.safetensors"
    run("convert", path, out3, "--to", "safetensors", "--dequantize", "--dtype", "fp16")
    with safe_open(str(out3), "pt") as f:
        assert f.get_tensor("nf4").dtype == torch.float16
    assert run("convert", path, out3, "--to", "safetensors", ok=False).returncode == 2  # exists


def test_convert_to_portable_dcp(checkpoint, tmp_path):
    path, state = checkpoint
    out = tmp_path / "portable"
    run("convert", path, out, "--to", "dcp", "--dequantize")
    target = {c.name: torch.zeros(state[c.name].shape, dtype=c.dtype) for c in CASES}
    target["bias"], target["step"] = torch.zeros(5), 0
    dcp.load(target, checkpoint_id=out)  # stock DCP
    for c in CASES:
        assert_bitwise_equal(target[c.name], c.dequantize(state[c.name]))
    assert target["step"] == 7 and torch.equal(target["bias"], state["bias"])


def test_convert_to_portable_dcp_keeps_the_nesting(tmp_path):
    """The portable checkpoint holds the input's state dict as saved: nested dicts and lists under
    the same keys (it came out flattened: 'model.w', 'lst.0'), each entry's values."""
    state = {"model": {"w": CASES[0].make(0), "b": torch.arange(3.0)}, "lst": [torch.zeros(1), torch.ones(2)],
             "opt": {"lr": 0.1, "betas": [0.9, 0.95]}, "step": 4}
    qdcp.save(state, tmp_path / "nested")
    run("convert", tmp_path / "nested", tmp_path / "portable", "--to", "dcp", "--dequantize")
    got, want = qdcp.consolidate(tmp_path / "portable"), qdcp.consolidate(tmp_path / "nested")
    assert sorted(got) == sorted(want) == sorted(state)
    assert isinstance(got["lst"], list) and isinstance(got["model"], dict)
    assert sorted(qdcp.read_metadata(tmp_path / "portable").state_dict_metadata) == \
        ["lst.0", "lst.1", "model.b", "model.w", "opt.betas", "opt.lr", "step"]
    assert_bitwise_equal(got["model"]["w"], CASES[0].dequantize(state["model"]["w"]))
    assert torch.equal(got["lst"][1], state["lst"][1]) and got["opt"] == state["opt"] and got["step"] == 4


def test_convert_to_torch_counts_the_entries_a_list_holds(tmp_path):
    """'wrote N entries' counts what DCP stores as entries: each tensor of a list (a list of plain
    values is one entry); it counted a list once. CheckpointEntries.nbytes of an unknown key is a
    KeyError naming it (it was 0)."""
    state = {"model": {"w": CASES[0].make(0)}, "lst": [torch.zeros(1), torch.ones(2), torch.ones(3)],
             "betas": [0.9, 0.95], "step": 1}
    qdcp.save(state, tmp_path / "c")
    proc = run("convert", tmp_path / "c", tmp_path / "c.pt", "--to", "torch")
    entries = qdcp.CheckpointEntries(tmp_path / "c")
    assert len(entries.keys()) == 6 and "wrote 6 entries" in proc.stdout, proc.stdout
    with pytest.raises(KeyError, match="'nope' is not in the checkpoint"):
        entries.nbytes("nope")


def _on_a_terminal(*args) -> tuple[int, str]:
    """Run the CLI with its stderr on a pseudo-terminal (as in an interactive shell); exit, stderr."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    main_fd, sub_fd = pty.openpty()
    fcntl.ioctl(sub_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a 120-column terminal
    proc = subprocess.Popen([sys.executable, "-m", "qdcp", *map(str, args)], stdout=subprocess.DEVNULL,
                            stderr=sub_fd, close_fds=True)
    os.close(sub_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    os.close(main_fd)
    return proc.wait(timeout=300), b"".join(chunks).decode(errors="replace")


def test_long_work_shows_progress_on_a_terminal_only(checkpoint, tmp_path):
    path, _ = checkpoint
    rc, err = _on_a_terminal("convert", path, tmp_path / "a.safetensors", "--to", "safetensors", "--dequantize")
    assert rc == 0 and "convert:" in err and "%|" in err  # tqdm's bar (bytes of the entries)
    rc, err = _on_a_terminal("verify", path)
    assert rc == 0 and "verify:" in err and "%|" in err
    skipped = "qdcp: skipped non-tensor entry 'step' (safetensors holds tensors only)"
    rc, err = _on_a_terminal("convert", path, tmp_path / "b.safetensors", "--to", "safetensors", "--quiet")
    assert rc == 0 and err.strip() == skipped
    proc = run("convert", path, tmp_path / "c.safetensors", "--to", "safetensors")  # not a terminal (a StringIO)
    assert proc.stderr.strip() == skipped


def test_help_and_import_qdcp_import_no_torch():
    """``qdcp --help`` (any verb's too) and ``import qdcp`` import no torch: the help is instant; the
    verbs and qdcp's names import what they need at their first use."""
    import os
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    probe = ("import sys, contextlib, io\n"
             "import qdcp, qdcp.cli\n"
             "for argv in (['--help'], ['convert', '--help'], ['export', '--help']):\n"
             "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
             "        qdcp.cli.main(argv)\n"
             "    assert 'usage: qdcp' in out.getvalue(), out.getvalue()\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    env = {**os.environ, "PYTHONPATH": repo}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=repo)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
    probe = "import qdcp; print(qdcp.QuantizedSavePlanner.__module__, len(qdcp.registered_type_names()) > 10)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=repo)
    assert done.stdout.split() == ["qdcp.planning.save", "True"], (done.stdout, done.stderr)
