"""DCP's save and load, every rank of a job in one process, storage in memory or in files.

For generated cases that need many jobs: each rank plans with the real planners on its own
DTensors (a ``fake`` process group seen from that rank, as ``benchmarks/planning_scale.py`` does),
the coordinator merges the plans, and each rank's items go to a dict the loads read from, in the
order and with the calls ``dcp.save`` / ``dcp.load`` and ``FileSystemWriter`` /
``FileSystemReader`` make (``/work/shared``'s dcp.md; ``filesystem.py`` ``read_data``): a save's
items are what ``resolve_data`` gives, a load's reads are the saved chunk narrowed to
``storage_offsets`` / ``lengths``, copied into ``resolve_tensor`` and committed.

:func:`save_files` and :func:`load_files` do the same with real files: qdcp's ``CheckpointWriter``
given every rank's plan, and ``dcp.load`` through qdcp's ``CheckpointReader``, rank by rank.
"""

from __future__ import annotations

import contextlib
import io
import random
import sys
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import qdcp

Store = dict[tuple[str, tuple[int, ...]], Any]


@contextlib.contextmanager
def as_rank(rank: int, world: int) -> Iterator[None]:
    """This process is ``rank`` of a ``world``-rank job (a fake process group) inside the block."""
    hook = sys.excepthook  # init_process_group wraps it to prefix the rank, once per group
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def mesh(shape: tuple[int, ...]) -> DeviceMesh:
    """A CPU device mesh of ``shape`` seen from the current (fake) rank."""
    return init_device_mesh("cpu", shape)


def save(states: Callable[[int], dict], world: int, planner: Callable[[], Any]) -> tuple[Metadata, Store]:
    """Save the state dict ``states(rank)`` of every rank; returns the metadata and the items."""
    planners, plans, kept = [], [], []
    for rank in range(world):
        with as_rank(rank, world):
            p = planner()
            state = states(rank)
            p.set_up_planner(state, None, rank == 0)
            plans.append(p.create_local_plan())
            planners.append(p)
            kept.append(state)
    central, metadata = planners[0].create_global_plan(plans)
    store: Store = {}
    for rank, (p, plan) in enumerate(zip(planners, central)):
        final = p.finish_plan(plan)
        for item in final.items:
            data = p.resolve_data(item)
            key = (item.index.fqn, tuple(item.index.offset or ()))
            store[key] = data.getvalue() if isinstance(data, io.BytesIO) else data.detach().clone()
    return getattr(planners[0], "metadata", metadata), store


def load(state: dict, rank: int, world: int, metadata: Metadata, store: Store, planner: Any,
         order: int | None = None) -> None:
    """Load ``state`` (rank ``rank``'s targets) from a :func:`save`, in place; ``order``: the reads
    arrive in an order shuffled with this seed (a reader with several threads commits the items of
    different files in any interleaving), else in the plan's."""
    planner.set_up_planner(state, metadata, rank == 0)
    local = planner.create_local_plan()
    plan = planner.finish_plan(planner.create_global_plan([local])[0])
    reads = list(plan.items)
    if order is not None:
        random.Random(order).shuffle(reads)
    for req in reads:
        data = store[(req.storage_index.fqn, tuple(req.storage_index.offset or ()))]
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(data))
            continue
        for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
            data = data.narrow(dim, o, n)
        target = planner.resolve_tensor(req).detach()
        target.copy_(data)
        planner.commit_tensor(req, target)


def save_files(states: Callable[[int], dict], world: int, planner: Callable[[], Any], path: str,
               **writer_options: Any) -> Metadata:
    """:func:`save` to real files at ``path`` through qdcp's ``CheckpointWriter``, with the calls
    ``dcp.save`` makes of it: one writer plays every rank's part (``write_data`` with each rank's
    final plan and planner) and the coordinator's (``prepare_local_plan``, ``prepare_global_plan``,
    ``finish``). Returns the committed metadata."""
    writer = qdcp.storage_writer(path, **writer_options)
    try:
        planners, plans, kept = [], [], []
        for rank in range(world):
            with as_rank(rank, world):
                p = planner()
                state = states(rank)
                p.set_up_planner(state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
                if rank == 0:
                    writer.set_up_storage_writer(True)
                plan = p.create_local_plan()
                plans.append(writer.prepare_local_plan(plan) if rank == 0 else plan)
                planners.append(p)
                kept.append(state)
        central, metadata = planners[0].create_global_plan(plans)
        central = writer.prepare_global_plan(central)
        results = []
        for rank, (p, plan) in enumerate(zip(planners, central)):
            with as_rank(rank, world):
                fut = writer.write_data(p.finish_plan(plan), p)
                fut.wait()
                results.append(fut.value())
        metadata = getattr(planners[0], "metadata", metadata)
        writer.finish(metadata, results)
        return metadata
    finally:
        writer.abandon()  # as qdcp.save: a save that did not commit leaves no file


def load_files(state: dict, path: str, planner: Any) -> None:
    """``dcp.load`` of the current (fake) rank's ``state`` from the files at ``path`` through qdcp's
    reader (its threads, its checks), this rank alone (``no_dist``: its own plan)."""
    try:
        dcp.load(state, storage_reader=qdcp.storage_reader(path), planner=planner, no_dist=True)
    except CheckpointException as e:  # DCP wraps this rank's error: raise it, as qdcp.load does
        (failure,) = e.failures.values()
        raise (failure[0] if isinstance(failure, tuple) else failure) from e
