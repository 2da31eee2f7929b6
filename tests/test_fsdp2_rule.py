"""The generated load-rule cases in real jobs at FSDP2's own sharding, 2 and 3 ranks (tests/fsdp2_rule_worker.py):
every rank's target is what docs/api.md's rule says (tests/rule_oracle.py), per-tensor values (torchao's
per-tensor Int8 / Float8 scale, NF4's scaler mean, NVFP4's per-tensor scale) the whole tensor's, a save the
rule refuses refused on every rank naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import torchrun_jobs

WORKER = Path(__file__).with_name("fsdp2_rule_worker.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("n", (2, 3))  # (one process: the in-process generator, tests/test_rule_generated.py)
def test_generated_cases_at_fsdp2_sharding_follow_the_rule(tmp_path, n):
    rc, out, seconds = torchrun_jobs.torchrun(WORKER, "run", n, tmp_path, 240)
    results_path = tmp_path / f"results-run-{n}.json"
    assert results_path.exists(), f"torchrun exit {rc} after {seconds:.0f} s, no results:\n{out[-4000:]}"
    results = json.loads(results_path.read_text())
    assert not results.get("crash"), results["crash"][:3]
    assert "fsdp2_rule" in results and not results["fsdp2_rule"], "\n".join(results.get("fsdp2_rule", [])[:15])
    assert rc == 0, out[-4000:]
    counts = json.loads((tmp_path / f"outcomes-{n}.json").read_text())
    print(counts)
    assert all(counts.get(k, 0) for k in ("bits", "quantized", "plain")), counts
