"""Every code block in README.md and docs/ runs as written.

Each page runs in a fresh directory laid out like the repository's root (``examples``, ``scripts``
and ``benchmarks`` linked in), with this checkout's qdcp importable and the ``qdcp`` command on the
PATH. A page's Python blocks run in order in one interpreter, sharing their names, as a reader
following the page would; its bash blocks run where they stand, in the same directory. Python
blocks preceded by ``<!-- docs-test: torchrun N -->`` form one program run under ``torchrun`` with
N ranks. ``json`` / ``text`` blocks are formats, not code: a ``json`` block must parse.

Bash lines that CI itself runs (``.ci/run``: ``bash scripts/demo.sh``, ``bash scripts/test.sh``;
``scripts/setup_venv.sh``: ``pip install``; ``tox``) are checked to be those commands, not re-run.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchrun_jobs import free_port

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"(?:<!-- docs-test: (?P<mark>[^>]*) -->\n)?^```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)^```",
                    re.S | re.M)
_RUN_BY_CI = ("bash scripts/demo.sh", "bash scripts/test.sh", "pip install", "tox")
# pages that run the training frameworks (the ``frameworks`` extra, which CI installs; tox's envs
# for the other torch versions install all of it but torchtitan)
_NEEDS = {"frameworks.md": ("torchtitan", "lightning_fabric", "pytorch_lightning", "accelerate")}


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """``(language, mark, text)`` of every fenced block of ``page``."""
    return [(m["lang"], (m["mark"] or "").strip(), m["body"]) for m in _FENCE.finditer(page.read_text())]


def _bash(text: str) -> str:
    lines = []
    for line in text.splitlines():
        command = line.split("#", 1)[0].strip()
        if command.startswith(_RUN_BY_CI):
            ci = (ROOT / ".ci" / "run").read_text() + (ROOT / "scripts" / "setup_venv.sh").read_text() + \
                (ROOT / "tox.ini").read_text()
            assert command.split()[0] in ci and (not command.startswith("bash") or command in ci), command
            continue
        lines.append(line)
    return "\n".join(lines)


def _program(page_blocks) -> str:
    """One script running a page's unmarked blocks in order."""
    steps = []
    for lang, mark, text in page_blocks:
        if mark:
            continue
        if lang == "python":
            steps.append(f"exec(compile({text!r}, 'block', 'exec'), ns)")
        elif lang == "bash":
            steps.append(f"subprocess.run(['bash', '-euo', 'pipefail', '-c', {_bash(text)!r}], check=True)")
    return "import subprocess\nns = {'__name__': '__main__'}\n" + "\n".join(steps) + "\n"


@pytest.fixture
def page_dir(tmp_path):
    for name in ("examples", "scripts", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "qdcp"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -m qdcp \"$@\"\n")
    shim.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    return tmp_path, env


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_runs_as_written(page, page_dir):
    for module in _NEEDS.get(page.name, ()):
        pytest.importorskip(module, reason=f"{page.name} runs {module} (pip install qdcp[frameworks])")
    cwd, env = page_dir
    found = blocks(page)
    for lang, _, text in found:
        assert lang in ("python", "bash", "json", "text"), f"{page.name}: a ```{lang} block (say what it is)"
        if lang == "json":
            json.loads(text)
    program = _program(found)
    proc = subprocess.run([sys.executable, "-c", program], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"{page.name}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    marked = [(mark, text) for lang, mark, text in found if mark and lang == "python"]
    if marked:
        ranks = {int(mark.split()[1]) for mark, _ in marked}
        assert len(ranks) == 1 and all(m.startswith("torchrun ") for m, _ in marked)
        n = ranks.pop()
        # each rank leaves a marker once the page's last line has run (see _finished)
        done = "\nimport os as _os\nopen(f\"docs-done-{_os.environ['RANK']}\", 'w').close()\n"
        (cwd / "docs_program.py").write_text("\n".join(textwrap.dedent(t) for _, t in marked) + done)
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}",
                               "--master-addr=127.0.0.1", f"--master-port={free_port()}", "docs_program.py"],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
        assert _finished(proc, cwd, n), f"{page.name} (torchrun):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def _finished(proc: subprocess.CompletedProcess, cwd: Path, n: int) -> bool:
    """The program ran to its end on every rank: exit 0, or every rank's end marker written and the
    only failure torch 2.13 + gloo's abort at interpreter exit after a DCP save ("terminate called
    without an active exception", vanilla DCP alike), which comes after the program's last line."""
    if proc.returncode == 0:
        return True
    markers = all((cwd / f"docs-done-{r}").exists() for r in range(n))
    return markers and "terminate called without an active exception" in proc.stderr + proc.stdout


def test_every_page_with_code_is_covered():
    """A new page is picked up; blocks are found (a fence the pattern missed would hide code)."""
    for page in PAGES:
        fences = sum(1 for line in page.read_text().splitlines() if line.startswith("```"))
        assert fences == 2 * len(blocks(page)), page.name
