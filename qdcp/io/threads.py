"""Jobs on threads, as qdcp's writer writes its files and its reader reads them: the caller's thread
among them, each thread with its own state and taking the next job when done, the others stopping
once one job fails."""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Sequence, TypeVar

__all__ = ["run_jobs"]

J = TypeVar("J")
S = TypeVar("S")
R = TypeVar("R")


def run_jobs(jobs: Sequence[J], states: Sequence[S], run: Callable[[S, J, threading.Event], Iterable[R]],
             name: str) -> list[R]:
    """Run every job on ``len(states)`` threads (the caller's and ``len(states) - 1`` named ``name``),
    each with its own state: ``run(state, job, failed)``, which may stop early once ``failed`` is
    set. After a failure no job starts; once every thread has stopped, the error of the first
    failing job (in ``jobs``' order) is raised. Else the results of every job, in ``jobs``' order."""
    failed = threading.Event()
    if len(states) <= 1:
        return [r for job in jobs for r in run(states[0], job, failed)]
    todo: queue.SimpleQueue = queue.SimpleQueue()
    for n, job in enumerate(jobs):
        todo.put((n, job))
    results: dict[int, list[R]] = {}
    errors: dict[int, BaseException] = {}

    def work(state: S) -> None:
        while not failed.is_set():
            try:
                n, job = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[n] = list(run(state, job, failed))
            except BaseException as e:
                errors[n] = e
                failed.set()
                return

    with ThreadPoolExecutor(len(states) - 1, thread_name_prefix=name) as pool:
        others = [pool.submit(work, state) for state in states[1:]]
        work(states[0])
        for f in others:
            f.result()
    if errors:
        raise errors[min(errors)]
    return [r for n in sorted(results) for r in results[n]]
