"""Write the cross-version fixture of the running torch: a raw and a dequantized qdcp checkpoint of
a small state (torchao Int8Tensor, NF4Tensor, MXTensor, NVFP4Tensor, an AdamW8bit-style state, a
plain tensor, an object) and ``expected.safetensors``: every inner buffer and every dequantized
value, as this torch computed them. ``tests/test_versions.py`` loads each version's fixture under
whatever torch runs the tests and compares with those bytes.

    python scripts/make_version_fixture.py            # writes tests/data/torch-<major>.<minor>/
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

import qdcp  # noqa: E402
from version_fixture import fixture_dir, quantized_state  # noqa: E402


def main() -> None:
    out = fixture_dir(torch.__version__)
    shutil.rmtree(out, ignore_errors=True)
    state = quantized_state(0)
    dcp.save(state, checkpoint_id=os.path.join(out, "raw"), planner=qdcp.QuantizedSavePlanner(), no_dist=True)
    dcp.save(state, checkpoint_id=os.path.join(out, "dequantized"),
             planner=qdcp.QuantizedSavePlanner(dequantize=True), no_dist=True)
    expected = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        adapter = qdcp.find_adapter(value)
        if adapter is None:
            expected[key] = value.contiguous()
            continue
        for name, buf in adapter.inner_buffers(value).items():
            expected[f"{key}.{name}"] = buf.contiguous()
        expected[key] = adapter.dequantize(value).contiguous()
    save_file(expected, os.path.join(out, "expected.safetensors"), metadata={"torch": str(torch.__version__)})
    print(f"wrote {out} (torch {torch.__version__})")


if __name__ == "__main__":
    main()
