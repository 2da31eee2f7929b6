"""qdcp's reader reads a checkpoint's data files on several threads (each file's items in order by
one thread) and calls the planner one thread at a time; a failure in any file fails the load as a
one-thread read does: an error naming the key, the targets of an all-or-nothing load untouched,
no thread still writing once the load has returned."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import CheckpointFormatError, ChecksumError, QuantizedLoadPlanner
from quantized_cases import CASE_BY_NAME
from state_dicts import assert_same_state, snapshot
from stored_bytes import flip_stored_bytes, tensor_bytes

FILES = 4


def _state(seed: int) -> dict:
    """Quantized weights of several types, plain tensors and objects: a dozen items over 4 files."""
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": CASE_BY_NAME[name].make(seed + i)
             for i, name in enumerate(["int8_row", "nf4", "mx_fp8", "int8_group32", "nvfp4", "int8_row"])}
    state.update({"bias": torch.randn(3000, generator=g), "idx": torch.arange(77) * (seed + 1),
                  "step": seed, "config": {"lr": 0.1 * seed}})
    return state


def _save(path, seed: int = 0) -> dict:
    state = _state(seed)
    qdcp.save(state, path, storage_options={"thread_count": FILES})
    assert len([n for n in os.listdir(path) if n.endswith(".distcp")]) == FILES
    return state


class WatchingPlanner(QuantizedLoadPlanner):
    """qdcp's planner, noting which threads call it and how many calls are ever in flight at once."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.threads: set[int] = set()
        self.in_flight = self.most_in_flight = 0
        self._watch = threading.Lock()

    def _call(self, fn, *args):
        with self._watch:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            self.threads.add(threading.get_ident())
        try:
            time.sleep(0.002)  # a slow planner: calls from several threads would overlap here
            return fn(*args)
        finally:
            with self._watch:
                self.in_flight -= 1

    def resolve_tensor(self, read_item):
        return self._call(super().resolve_tensor, read_item)

    def commit_tensor(self, read_item, tensor):
        return self._call(super().commit_tensor, read_item, tensor)

    def load_bytes(self, read_item, value):
        return self._call(super().load_bytes, read_item, value)


@pytest.mark.parametrize("atomic", [True, False])
def test_files_are_read_on_several_threads_the_planner_called_by_one_at_a_time(tmp_path, atomic):
    saved = _save(tmp_path / "c")
    target = _state(9)
    planner = WatchingPlanner(atomic=atomic)
    dcp.load(target, storage_reader=qdcp.storage_reader(tmp_path / "c", thread_count=FILES), planner=planner)
    assert_same_state(target, saved)
    assert len(planner.threads) >= 2, "every file was read by one thread"
    assert planner.most_in_flight == 1


@pytest.mark.parametrize("threads", [1, 2, FILES, 8])
def test_any_thread_count_loads_the_same_bits(tmp_path, threads):
    saved = _save(tmp_path / "c")
    target = _state(9)
    qdcp.load(target, tmp_path / "c", storage_options={"thread_count": threads})
    assert_same_state(target, saved)


@pytest.mark.parametrize("key", ["w0", "w1", "w2", "w3", "w4", "w5"])
def test_a_corrupt_item_in_any_file_fails_the_load_leaving_every_target(tmp_path, key):
    saved = _save(tmp_path / "c")
    buffers = qdcp.adapters.find_adapter(saved[key]).inner_buffers(saved[key])
    biggest = max(buffers.values(), key=lambda b: b.numel() * b.element_size())
    flip_stored_bytes(tmp_path / "c", tensor_bytes(biggest)[:64], at=5)
    target = _state(9)
    before = snapshot(target)
    with pytest.raises(ChecksumError, match=rf"key '{key}'"):
        qdcp.load(target, tmp_path / "c", storage_options={"thread_count": FILES})
    time.sleep(0.05)  # a thread still reading would write into the targets after the load returned
    assert_same_state(target, before)


def test_corrupt_items_in_two_files_fail_the_load_naming_one(tmp_path):
    saved = _save(tmp_path / "c")
    changed = {flip_stored_bytes(tmp_path / "c", tensor_bytes(saved[k].qdata)[:64], at=3) for k in ("w0", "w5")}
    assert len(changed) == 2, "the two items are in one file"
    target = _state(9)
    before = snapshot(target)
    with pytest.raises(ChecksumError, match=r"key 'w[05]'"):
        qdcp.load(target, tmp_path / "c", storage_options={"thread_count": FILES})
    assert_same_state(target, before)


def test_a_missing_data_file_fails_the_load_naming_a_key_it_held(tmp_path):
    _save(tmp_path / "c")
    gone = sorted(n for n in os.listdir(tmp_path / "c") if n.endswith(".distcp"))[2]
    os.remove(tmp_path / "c" / gone)
    target = _state(9)
    before = snapshot(target)
    with pytest.raises(CheckpointFormatError, match=rf"key '.*': its data file '{gone}' cannot be opened"):
        qdcp.load(target, tmp_path / "c", storage_options={"thread_count": FILES})
    assert_same_state(target, before)


def test_an_fsspec_url_is_read_on_several_threads():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    saved = _state(0)
    qdcp.save(saved, url, storage_options={"thread_count": FILES})
    target = _state(9)
    planner = WatchingPlanner()
    dcp.load(target, storage_reader=qdcp.storage_reader(url, thread_count=FILES), planner=planner)
    assert_same_state(target, saved)
    assert len(planner.threads) >= 2 and planner.most_in_flight == 1


def test_default_reading_threads(tmp_path):
    """The usable cores (at most 4), as the writer's default, with or without CUDA in use;
    asked-for counts are kept."""
    from qdcp.io.pipeline import default_thread_count

    _save(tmp_path / "c")
    assert qdcp.CheckpointReader(tmp_path / "c").read_threads() == default_thread_count()
    assert qdcp.storage_reader(tmp_path / "c", thread_count=3).read_threads() == 3
