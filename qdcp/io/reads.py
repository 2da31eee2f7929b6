"""How qdcp's reader reads a load's files: on up to ``thread_count`` threads (:func:`read_files`), each
with its own :class:`Lane` of reused memory, a whole chunk bound for CUDA read into one of two pinned
buffers and copied without blocking while the next item is read (:meth:`Lane.copy_later`)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

import torch

from qdcp.io.threads import run_jobs

__all__ = ["Lane", "lanes_for", "read_files"]

# a whole chunk bound for CUDA, up to this size over the reading threads, goes through the pinned
# buffers (at most twice this size pinned in all)
PINNED_MAX = 256 << 20


class Lane:
    """One reading thread's memory, kept from load to load: a scratch buffer, two pinned buffers for
    CUDA targets (with their copies in flight), and the commit of the item whose copy still runs."""

    def __init__(self) -> None:
        self.calls: Any = None
        self.scratch: torch.Tensor | None = None
        self.pinned: list[torch.Tensor | None] = [None, None]
        self.copied: list[Any] = [None, None]
        self.slot = 1
        self.pinned_max = PINNED_MAX
        self.pending: Callable[[], None] | None = None
        self.devices: set[int] = set()  # the CUDA devices of the targets it copied into (this load)

    def buffer(self, length: int, pinned: bool = False) -> torch.Tensor:
        """``length`` bytes of reused memory: the scratch buffer, or the other pinned one once its copy ended."""
        if pinned:
            self.slot = 1 - self.slot
            if self.copied[self.slot] is not None:
                self.copied[self.slot].synchronize()
            buf = self.pinned[self.slot]
            if buf is None or buf.numel() < length:
                self.pinned[self.slot] = None
                buf = self.pinned[self.slot] = torch.empty(max(length, 1 << 20), dtype=torch.uint8, pin_memory=True)
            return buf[:length]
        if self.scratch is None or self.scratch.numel() < length:
            self.scratch = None
            self.scratch = torch.empty(max(length, 1 << 20), dtype=torch.uint8)
        return self.scratch[:length]

    def note_target(self, target: torch.Tensor) -> None:
        if target.device.type == "cuda":
            self.devices.add(target.device.index if target.device.index is not None else torch.cuda.current_device())

    def copy_later(self, target: torch.Tensor, tensor: torch.Tensor, commit: Callable[[], None]) -> None:
        """Copy pinned ``tensor`` into ``target`` without blocking; ``commit`` runs after the next item."""
        target.copy_(tensor, non_blocking=True)
        with torch.cuda.device(target.device):
            copied = self.copied[self.slot] = torch.cuda.Event()
            copied.record()
        self.finish_pending()
        self.pending = commit

    def finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending()


def lanes_for(kept: list[Lane], threads: int, calls: Any) -> list[Lane]:
    """``threads`` of the reader's ``kept`` lanes (more made as needed), set up for one load."""
    while len(kept) < threads:
        kept.append(Lane())
    for lane in kept[:threads]:
        lane.calls, lane.pending, lane.devices = calls, None, set()
        lane.pinned_max = PINNED_MAX // threads
    return kept[:threads]


def read_files(files: Sequence[Any], lanes: list[Lane], read_file: Callable[[Lane, Any, threading.Event], None]
               ) -> None:
    """``read_file(lane, file, failed)`` for every file on ``len(lanes)`` threads (:func:`run_jobs`),
    then every copy left running committed; the CUDA copies have ended when this returns."""
    # a new thread's current CUDA device is 0: the others take the caller's (no context made on 0)
    device = torch.cuda.current_device() if len(lanes) > 1 and torch.cuda.is_initialized() else None

    def read(lane: Lane, job: Any, failed: threading.Event) -> tuple:
        if device is not None:
            torch.cuda.set_device(device)
        read_file(lane, job, failed)
        return ()

    try:
        run_jobs(files, lanes, read, "qdcp-read")
        for lane in lanes:
            lane.finish_pending()
    finally:
        if device is not None:  # the other threads' copies ran on their own streams: ended here
            for index in sorted({d for lane in lanes for d in lane.devices}):
                torch.cuda.synchronize(index)
        for lane in lanes:
            lane.calls, lane.pending = None, None
