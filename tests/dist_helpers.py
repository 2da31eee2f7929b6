"""Helpers for the jobs every multi-process test repeats: process groups, row chunks, DTensors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta


def init_file_store_group(root: str, rank: int, world: int, backend: str = "gloo") -> None:
    """A process group over a FileStore in ``root`` (no port: tests run in parallel)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(root, "store"), world),
                            rank=rank, world_size=world)


def row_chunks(rows: int, world: int) -> list[tuple[int, int]]:
    """(offset, size) of each rank's rows for Shard(0): torch.chunk sizes, as DTensor does."""
    size = -(-rows // world)
    return [(min(r * size, rows), max(0, min(size, rows - r * size))) for r in range(world)]


def dtensor_from_local(local: torch.Tensor, mesh, placements, shape, dtype: torch.dtype) -> DTensor:
    """A DTensor over ``local`` built from its spec, without view ops (as FSDP2's
    ``_from_local_no_grad``; ``DTensor.from_local`` calls ``view_as``, which some subclasses lack)."""
    stride = torch.empty(shape, device="meta").stride()
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, dtype))
    return DTensor(local, spec, requires_grad=False)


_SCRIPT = '''\
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from dist_helpers import init_file_store_group
{imports}


def main():
    root = sys.argv[1]
    init_file_store_group(root, 0, 1)
{body}
    dist.destroy_process_group()


if __name__ == "__main__":  # the PROCESS checkpointer spawns: guard the entry point
    main()
'''


def run_one_rank_script(root, body: str, *, imports: str = "", timeout: int = 240) -> subprocess.CompletedProcess:
    """Run ``body`` as ``main()`` of a fresh Python process that is the one rank of a gloo group over
    a FileStore in ``root`` (``root`` in the body). ``os``, ``sys``, ``torch``, ``dist``, ``dcp`` and
    ``AsyncCheckpointerType`` are imported, then ``imports``; the entry point is guarded, as DCP's
    PROCESS checkpointer (which spawns) requires. The finished process, its output as text."""
    script = os.path.join(root, "run.py")
    with open(script, "w") as f:
        f.write(_SCRIPT.format(imports=textwrap.dedent(imports).strip(),
                               body=textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")))
    return subprocess.run([sys.executable, script, str(root)], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, PYTHONWARNINGS="ignore"))
