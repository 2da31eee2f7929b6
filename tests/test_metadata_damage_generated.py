"""A damaged ``.metadata`` is refused with qdcp's error, never misread (generated cases).

The rule (docs/troubleshooting.md, "Reading files"; docs/format.md, *Checksums*): a truncated,
garbage or damaged ``.metadata`` gives ``CheckpointFormatError`` (the CLI: one line, exit 2), and
values are never read from the wrong place nor under another key. One bit of a real checkpoint's
``.metadata`` is flipped; reading it whole (``qdcp.consolidate``, what ``qdcp convert`` and the
consolidation tools use) must then raise a qdcp error or give the checkpoint's own entries, bit
for bit, under their own keys. Checkpoints of both sealing paths: ``qdcp.save`` (qdcp's writer
records the checksums and the metadata digest) and ``dcp.save`` + ``QuantizedSavePlanner`` (the
planner does, DCP's writer writes). Without the digest (checkpoints of earlier qdcp) a flip inside
a key's name, which pickle stores once for every place it appears, renamed that entry
consistently: the last damage the structural checks could not see.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import qdcp
from qdcp import QdcpError
from quantized_cases import CASE_BY_NAME, bits
from state_dicts import leaves


@pytest.fixture(scope="module", params=["qdcp.save", "dcp.save"])
def saved(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("metadata_damage")
    state = {"model": {"w": CASE_BY_NAME["int8_row"].make(0), "nf4": CASE_BY_NAME["nf4"].make(1),
                       "b": torch.randn(32, generator=torch.Generator().manual_seed(2)),
                       "mx": CASE_BY_NAME["mx_fp8"].make(3)},
             "step": 3, "opt": {"lr": 0.1, "betas": [0.9, 0.95]}}
    if request.param == "qdcp.save":
        qdcp.save(state, root / "ckpt")
    else:
        dcp.save(state, checkpoint_id=root / "ckpt", planner=qdcp.QuantizedSavePlanner())
    return root, (root / "ckpt" / ".metadata").read_bytes(), dict(leaves(qdcp.consolidate(root / "ckpt")))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(bits(a), bits(b))
    return a == b


@settings(max_examples=120, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
          suppress_health_check=list(HealthCheck))
@given(where=st.floats(0, 1, exclude_max=True), bit=st.integers(0, 7))
def test_a_flipped_bit_in_metadata_is_refused_or_harmless(saved, where, bit):
    root, raw, want = saved
    damaged = root / "damaged"
    shutil.rmtree(damaged, ignore_errors=True)
    shutil.copytree(root / "ckpt", damaged)
    data = bytearray(raw)
    data[int(where * len(data))] ^= 1 << bit
    (damaged / ".metadata").write_bytes(bytes(data))
    try:
        got = dict(leaves(qdcp.consolidate(damaged)))
    except QdcpError:
        return
    except BaseException as e:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
        inner = [f[0] for f in getattr(e, "failures", {}).values()]
        assert inner and all(isinstance(x, QdcpError) for x in inner), f"{type(e).__name__}: {e}"
        return
    assert sorted(got) == sorted(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    assert all(_same(got[k], want[k]) for k in want), [k for k in want if not _same(got[k], want[k])]
