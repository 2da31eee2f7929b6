"""At 2 ranks under torchrun: ``qdcp.async_save`` raises what is known at the call on every rank,
before staging (``torchrun ... async_call_errors_worker.py all ROOT``, run by
tests/test_async_call_errors.py). Each rank writes ``ROOT/outcome-<rank>.json``: per scenario, the
error each rank's call raised (type, message), then whether a good save and a training collective
went through after it."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import qdcp  # noqa: E402
from quantized_cases import CASE_BY_NAME  # noqa: E402

INT8 = CASE_BY_NAME["int8_row"]


def _call(state, path, **kwargs) -> dict:
    try:
        result = qdcp.async_save(state, path, **kwargs)
    except Exception as e:  # noqa: BLE001 (the outcome is the finding)
        return {"raised": type(e).__name__, "message": str(e)}
    result.result(timeout=120)
    return {"raised": None}


def main(root: str) -> None:
    faulthandler.dump_traceback_later(int(os.environ.get("QDCP_WORKER_TIMEOUT", "200")), exit=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"model": {f"layer{rank}.weight": INT8.make(rank)}, "step": 3}
    out = {}
    exists = os.path.join(root, "exists")
    qdcp.save(state, exists)
    out["exists"] = _call(state, exists)
    bad = {"model": {"w.__qdcp__.qdata": torch.ones(2)}} if rank == 1 else state
    out["bad_on_rank_1"] = _call(bad, os.path.join(root, "bad"))
    out["bad_dir_made"] = os.path.exists(os.path.join(root, "bad"))
    out["good_after"] = _call(state, os.path.join(root, "good"))
    total = torch.ones(1)
    dist.all_reduce(total)
    out["all_reduce_after"] = total.item()
    group = qdcp.checkpoint_group()  # made by the first async_save, reused since
    out["checkpoint_group"] = {"reused": group is qdcp.checkpoint_group(), "backend": dist.get_backend(group),
                               "is_default": group is dist.group.WORLD, "size": dist.get_world_size(group)}
    with open(os.path.join(root, f"outcome-{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[2])
