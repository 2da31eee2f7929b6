"""The async checkpoint loops of README.md, docs/getting_started.md and docs/fsdp2.md run as
written under torchrun at 2 ranks (and 1) on gloo, beside a training loop's collectives on the default
group (tests/docs_loop_worker.py), and commit every checkpoint they save. Before qdcp.async_save
had a process group of its own, its background collectives met training's on the default group:
the README's loop hung (the job killed at the timeout) or gloo aborted."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchrun_jobs import torchrun

WORKER = Path(__file__).with_name("docs_loop_worker.py")
TIMEOUT_S = 300

#: page -> the checkpoints its loops commit, and the step each one holds (None: not a top-level key)
PAGES = {
    "README.md": {"step_102": 102, "step_105": 105},
    # the page prunes to the last 2 complete: its loop's last, and its dcp.save example's (at step 206)
    "docs/getting_started.md": {"step_206": 206, "step_400": 206},
    "docs/fsdp2.md": {"step_3": None, "step_6": None, "step_9": None, "step_12": None},
}


def _ran_to_the_end(rc: int, out: str, root: Path, n: int) -> bool:
    """Every rank finished the page (see tests/test_docs.py's _finished: torch 2.13 + gloo may abort
    at interpreter exit after a DCP save, after the program's last line)."""
    if not all((root / f"done-{r}.json").exists() for r in range(n)):
        return False
    return rc == 0 or "terminate called without an active exception" in out


@pytest.mark.parametrize("nproc", [2])  # (one process has no collectives to meet: test_docs runs the pages alone)
@pytest.mark.parametrize("page", list(PAGES), ids=lambda p: Path(p).name)
def test_async_loop_runs_as_written_beside_training_collectives(tmp_path, page, nproc):
    import qdcp

    rc, out, seconds = torchrun(WORKER, page, nproc, tmp_path, TIMEOUT_S)
    assert _ran_to_the_end(rc, out, tmp_path, nproc), f"{page}: exit {rc} after {seconds:.0f} s:\n{out[-5000:]}"
    ckpt = tmp_path / "ckpt"
    if page.endswith("getting_started.md"):
        assert sorted(p.name for p in ckpt.iterdir()) == sorted(PAGES[page])
    for name, step in PAGES[page].items():
        path = ckpt / name
        assert (path / ".metadata").is_file(), (name, sorted(p.name for p in ckpt.iterdir()))
        assert not [p.name for p in path.iterdir() if p.name.startswith(".qdcp-save.")], name  # no claim left
        if step is not None:
            got = {"step": 0}
            qdcp.load(got, path, allow_partial_load=True)
            assert got == {"step": step}, name
    keys = [set(qdcp.describe(ckpt / name)) for name in PAGES[page]]
    assert all(k == keys[0] for k in keys), page
    if page.endswith("fsdp2.md"):
        assert {"model.0.weight", "optim.state.0.weight.exp_avg"} <= keys[0], sorted(keys[0])[:10]
