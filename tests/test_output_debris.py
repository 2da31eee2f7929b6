"""A killed ``qdcp convert`` / ``qdcp export`` leaves scratch beside its output; the next run of
the same command removes what a killed run of its own left, puts back an export that
``--overwrite`` had moved aside, and touches nothing else.

Commands run as a user types them (``python -m qdcp ...``) and are killed with SIGKILL while their
scratch exists (or, for the window between export's two renames, at that rename).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import qdcp
from qdcp.owners import Owner

ROOT = Path(__file__).resolve().parent.parent
KILLER = Path(__file__).with_name("cli_killer.py")
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]), PYTHONWARNINGS="ignore")


def _values(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4_000_000, generator=g), "b": torch.full((8,), float(seed))}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("debris")
    for seed in (1, 2):
        qdcp.save(_values(seed), root / f"ckpt{seed}")
    return {seed: root / f"ckpt{seed}" for seed in (1, 2)}


def _argv(verb: str, ckpt: Path, out: Path, *extra: str) -> list[str]:
    how = {"safetensors": ["convert", "--to", "safetensors"], "torch": ["convert", "--to", "torch"],
           "export": ["export", "--format", "torchao"]}[verb]
    return [how[0], str(ckpt), str(out), *how[1:], "--quiet", *extra]


def _qdcp(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qdcp", *argv], capture_output=True, text=True, env=ENV,
                          timeout=300)


def _scratch(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith(".qdcp-"))


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qdcp", *argv], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def _kill_while_writing(runs: dict[str, tuple[list[str], Path]], timeout: float = 240) -> dict[str, list[str]]:
    """Start ``qdcp argv`` for every ``(argv, out)`` of ``runs`` at once (their imports overlap),
    SIGKILL each as soon as its scratch appears beside ``out``; what each left. A run that finished
    between two looks (its scratch lives for the write only) is started again, its output removed."""
    procs = {k: _start(argv) for k, (argv, _) in runs.items()}
    deadline, left, retries = time.time() + timeout, {}, 0
    while len(left) < len(runs):
        for k, (argv, out) in runs.items():
            if k in left:
                continue
            if _scratch(out.parent):
                os.kill(procs[k].pid, signal.SIGKILL)
                procs[k].wait()
                left[k] = _scratch(out.parent)
            elif procs[k].poll() is not None:
                assert procs[k].returncode == 0 and retries < 5, (k, procs[k].returncode)
                retries += 1
                shutil.rmtree(out) if out.is_dir() else out.unlink()
                procs[k] = _start(argv)
        assert time.time() < deadline
        time.sleep(0.001)
    return left


def _others(parent: Path, out: Path) -> dict[str, bytes]:
    """Files a rerun must not touch: the user's, another output's scratch left by an ended run, and
    this output's scratch of a run still going (this test's own process)."""
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    dead = Owner.current().tag().split(".")[0] + f".{int(ended.stdout)}.0"
    from qdcp import outputs

    names = {"notes.txt": b"mine", f".qdcp-convert-00000000-{dead}-abcdef.safetensors.tmp": b"another output's"}
    for name, data in names.items():
        (parent / name).write_bytes(data)
    live = Path(outputs.new_file("convert", out, ".safetensors.tmp"))
    live.write_bytes(b"a run still going")
    return {n: (parent / n).read_bytes() for n in [*names, live.name]}


def test_the_next_run_removes_what_a_killed_run_left(tmp_path, ckpts):
    """``convert --to safetensors``, ``convert --to torch`` and ``export``, each killed while writing
    (the three at once), then run again: the scratch of the killed run is gone, nothing else is."""
    verbs = {"safetensors": "model.safetensors", "torch": "model.pt", "export": "model"}
    outs = {verb: tmp_path / verb / name for verb, name in verbs.items()}
    for out in outs.values():
        out.parent.mkdir()
    left = _kill_while_writing({verb: (_argv(verb, ckpts[1], out), out) for verb, out in outs.items()})
    assert all(left[verb] and not out.exists() for verb, out in outs.items()), left
    others = {verb: _others(out.parent, out) for verb, out in outs.items()}
    reruns = {verb: subprocess.Popen([sys.executable, "-m", "qdcp", *_argv(verb, ckpts[1], out)], env=ENV,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for verb, out in outs.items()}
    for verb, out in outs.items():
        assert reruns[verb].wait(300) == 0, reruns[verb].stderr.read()
        reruns[verb].stderr.close()
        assert {n: (out.parent / n).read_bytes() for n in others[verb]} == others[verb]  # untouched
        assert sorted(os.listdir(out.parent)) == sorted([out.name, *others[verb]])  # the killed run's scratch is gone
        values = load_file(out / "model.safetensors") if verb == "export" else \
            torch.load(out) if verb == "torch" else load_file(out)
        assert torch.equal(values["w"], _values(1)["w"]), verb


def test_an_export_killed_between_its_renames_is_put_back(tmp_path, ckpts):
    """``export --overwrite`` moves the old export aside, then the new one in: killed in between,
    the destination is absent. The next export to it (here without ``overwrite``, so it is refused)
    puts the old one back first and removes the killed run's scratch; ``--overwrite`` then replaces it."""
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "model"
    qdcp.export(ckpts[1], out, format="torchao")
    old = {n: (out / n).read_bytes() for n in os.listdir(out)}
    killed = subprocess.run([sys.executable, str(KILLER), "2", *_argv("export", ckpts[2], out, "--overwrite")],
                            env=ENV, capture_output=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not out.exists()
    (aside,) = [n for n in _scratch(parent) if n.startswith(".qdcp-replaced-")]
    assert {n: (parent / aside / "dir" / n).read_bytes() for n in os.listdir(parent / aside / "dir")} == old
    with pytest.raises(qdcp.ExportError, match="exists; pass --overwrite"):  # the old export is back, and kept
        qdcp.export(ckpts[2], out, format="torchao")
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == old
    assert _scratch(parent) == []
    assert _qdcp(_argv("export", ckpts[2], out, "--overwrite")).returncode == 0
    assert torch.equal(load_file(out / "model.safetensors")["w"], _values(2)["w"])
    assert sorted(os.listdir(parent)) == ["model"]
