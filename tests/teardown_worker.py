"""A job that destroys its process group while an async save is still running, as a user's script
that forgets to wait would: ``torchrun ... teardown_worker.py DOOR ROOT`` (run by
tests/test_async_teardown.py). Each rank writes ``ROOT/outcome-<rank>.json``: what the save's
future raised (the process group is gone, so nothing is gathered). DOOR ``exit``: each rank's script
ends with its save still running, its process group kept."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchao.quantization import Int8Tensor  # noqa: E402
from torchao.quantization.granularity import PerRow  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qdcp  # noqa: E402


def main(door: str, root: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    model = {f"layer{rank}.{i}.weight": Int8Tensor.from_hp(torch.randn(1024, 1024, generator=g), PerRow())
             for i in range(4)}
    group = dist.new_group(backend="gloo")
    path = os.path.join(root, "step_3")
    if door == "exit":  # the script ends with the save running: the interpreter's exit waits for it
        qdcp.async_save({"model": model}, path, stager=qdcp.QuantizedStager(async_staging=True))
        return
    if door == "qdcp":
        result = qdcp.async_save({"model": model}, path, stager=qdcp.QuantizedStager(async_staging=True),
                                 process_group=group)
    else:
        result = dcp.async_save({"model": model}, storage_writer=qdcp.storage_writer(path),
                                planner=qdcp.QuantizedSavePlanner(), process_group=group)
    dist.destroy_process_group()  # the mistake: the save's future not waited on
    upload = getattr(result, "upload_completion", result)
    try:
        upload.result(timeout=120)
        outcome = {"raised": None}
    except BaseException as e:  # noqa: BLE001 (the outcome is the finding)
        outcome = {"raised": type(e).__name__, "message": str(e)[:2000],
                   "trace": "".join(traceback.format_exception(e))[-6000:]}
    with open(os.path.join(root, f"outcome-{rank}.json"), "w") as f:
        json.dump(outcome, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
