"""Checkpoints through fsspec URLs: memory:// and s3:// against a real S3-compatible server (moto)
that the tests start on loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp

import qdcp
from qdcp import QuantizedLoadPlanner, QuantizedSavePlanner
from quantized_cases import CASE_BY_NAME, assert_bitwise_equal, assert_same_buffers

CASES = [CASE_BY_NAME[n] for n in ("int8_group32", "mx_fp4_swizzled", "nf4", "optim8bit_signed")]


def _state(seed):
    s = {c.name: c.make(seed) for c in CASES}
    s["bias"], s["step"] = torch.full((3,), float(seed)), seed
    return s


def _check(loaded, saved):
    for c in CASES:
        assert_same_buffers(loaded[c.name], saved[c.name])
    assert torch.equal(loaded["bias"], saved["bias"]) and loaded["step"] == saved["step"]


def test_memory_url_round_trip_and_describe():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    saved = _state(0)
    dcp.save(saved, checkpoint_id=url, planner=QuantizedSavePlanner())
    loaded = _state(1)
    dcp.load(loaded, checkpoint_id=url, planner=QuantizedLoadPlanner())
    _check(loaded, saved)
    info = qdcp.describe(url)
    assert info["nf4"]["stored_as"] == "raw" and info["bias"]["stored_as"] == "plain"
    # a dequantized copy read through the safe fsspec reader by stock DCP
    url2 = url + "-deq"
    dcp.save(saved, checkpoint_id=url2, planner=QuantizedSavePlanner(dequantize=True))
    plain = {c.name: torch.zeros(saved[c.name].shape, dtype=c.dtype) for c in CASES}
    dcp.load(plain, storage_reader=qdcp.storage_reader(url2), planner=QuantizedLoadPlanner(),
             )
    for c in CASES:
        assert_bitwise_equal(plain[c.name], c.dequantize(saved[c.name]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.2)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_s3_round_trip(s3_endpoint):
    import s3fs
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    bucket = f"qdcp-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    url = f"s3://{bucket}/ckpt"
    saved = _state(0)
    dcp.save(saved, storage_writer=qdcp.storage_writer(url, **opts), planner=QuantizedSavePlanner())
    names = sorted(p.rsplit("/", 1)[1] for p in s3fs.S3FileSystem(**opts).ls(f"{bucket}/ckpt"))
    assert names[0] == ".metadata" and len(names) == 2 and names[1].endswith("_0_0.distcp")
    loaded = _state(1)
    dcp.load(loaded, storage_reader=qdcp.storage_reader(url, **opts),
             planner=QuantizedLoadPlanner())
    _check(loaded, saved)
    assert qdcp.read_metadata(url, **opts).state_dict_metadata["bias"].size == torch.Size([3])


def test_async_save_to_memory_url():
    url = f"memory://qdcp-{uuid.uuid4().hex}"
    saved = _state(0)
    live = _state(0)
    stager = qdcp.QuantizedStager()
    fut = dcp.async_save(live, storage_writer=qdcp.storage_writer(url), planner=QuantizedSavePlanner(),
                         async_stager=stager)
    live["int8_group32"].qdata.zero_()  # training goes on; the checkpoint keeps the staged values
    fut.result()
    stager.close()
    loaded = _state(1)
    dcp.load(loaded, storage_reader=qdcp.storage_reader(url), planner=QuantizedLoadPlanner())
    _check(loaded, saved)
