"""Bad-input corpus: damaged and hostile checkpoints, each made here from a pristine one.

For every case, loading through ``qdcp.CheckpointReader`` + ``QuantizedLoadPlanner`` into fresh
quantized targets of the same types and into plain targets either raises a clear error (a qdcp error,
or DCP's wrapper around one, naming the damaged key where the damage is key-specific) or loads
exactly the original values; ``qdcp verify`` exits non-zero on every case that changes data; no case
runs code from the file; cases that claim huge sizes run under an address-space limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import os
import pickle
import re
import shutil
import struct
import subprocess
import sys
import warnings
from typing import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import qdcp
import qdcp.cli
from qdcp import spec as qspec
from qdcp.errors import CheckpointFormatError, LoadMismatchError, QdcpError
from qdcp.spec import check_component_bytes
from qdcp.spec import layouts_of as _layouts_from_spec
from quantized_cases import CASE_BY_NAME, SHAPE, assert_same_buffers, bits
from stored_bytes import record_span, resealed

TESTS = os.path.dirname(os.path.abspath(__file__))
QNAMES = ("int8_group32", "nf4", "mx_fp4_swizzled", "optim8bit_signed", "float8_row")
HUGE = 2**40
SEP = qspec.COMPONENT_SEPARATOR
ALL_KEYS = QNAMES + ("bias", "step", "opt")
# a truncated file cuts off whichever items its writer put last (qdcp's writer orders them its own way)
TENSORS = QNAMES + ("bias",)


# ----------------------------------------------------------------------------- pristine checkpoint

def original_state(seed: int = 0) -> dict:
    state = {n: CASE_BY_NAME[n].make(seed + i) for i, n in enumerate(QNAMES)}
    g = torch.Generator().manual_seed(seed + 99)
    state["bias"] = torch.randn(7, generator=g)
    state["step"] = 5 + seed
    state["opt"] = {"lr": 0.125, "betas": [0.9, 0.99]}
    return state


def _save(state: dict, path, variant: str) -> None:
    """``plain``: stock writer, the save planner's checksums in the metadata (the default);
    ``trailer``: qdcp.CheckpointWriter appending an XXH3-64 to each item (planner checksums off);
    ``bare``: stock writer, no checksums at all (torch.save's zip CRCs are all there is)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if variant == "trailer":
            dcp.save(state, storage_writer=qdcp.CheckpointWriter(path),
                     planner=qdcp.QuantizedSavePlanner(checksums=False), no_dist=True)
        else:
            dcp.save(state, checkpoint_id=path, planner=qdcp.QuantizedSavePlanner(checksums=variant == "plain"),
                     no_dist=True)


VARIANTS = ("plain", "trailer", "bare")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    for variant in VARIANTS:
        _save(original_state(0), root / variant, variant)
        _save(original_state(7), root / f"other_{variant}", variant)  # same shapes, other values
    return root


# ----------------------------------------------------------------------------- editing helpers

def read_md(path):
    return pickle.loads((path / ".metadata").read_bytes())


def write_md(path, md) -> None:
    """Write ``md`` as a writer that made it would (its digest resealed: the checks behind it tested)."""
    (path / ".metadata").write_bytes(pickle.dumps(resealed(md)))


def edit_md(path, fn) -> None:
    md = read_md(path)
    fn(md)
    write_md(path, md)


def edit_spec(path, fn) -> None:
    """Rewrite the JSON spec in ``planner_data["__qdcp__"]`` (``fn(doc, md)``), re-pickle plainly."""
    def go(md):
        doc = json.loads(md.planner_data[qspec.PLANNER_DATA_KEY])
        fn(doc, md)
        md.planner_data[qspec.PLANNER_DATA_KEY] = json.dumps(doc)
    edit_md(path, go)


def set_spec_text(path, text) -> None:
    def go(md):
        md.planner_data[qspec.PLANNER_DATA_KEY] = text
    edit_md(path, go)


def data_file(path):
    (name,) = [n for n in os.listdir(path) if n.endswith(".distcp")]
    return path / name


def index_of(md, fqn):
    (idx,) = [i for i in md.storage_data if i.fqn == fqn]
    return idx


def info_of(md, fqn):
    return md.storage_data[index_of(md, fqn)]


def comp(key, name):
    return f"{key}{SEP}{name}"


def record_offset(path, fqn, record: str, frac: float = 0.5) -> int:
    """File offset of a byte inside zip record ``record`` (e.g. "data/0", "data.pkl") of item ``fqn``."""
    md = read_md(path)
    info = info_of(md, fqn)
    with open(data_file(path), "rb") as f:
        f.seek(info.offset)
        start, size = record_span(f.read(info.length), record)
    return info.offset + start + int(size * frac)


def flip(path, offset: int) -> None:
    f = data_file(path)
    raw = bytearray(f.read_bytes())
    raw[offset] ^= 0x5A
    f.write_bytes(bytes(raw))


def truncate(path, at) -> None:
    f = data_file(path)
    raw = f.read_bytes()
    f.write_bytes(raw[: at(raw, read_md(path))])


def append_item(path, payload: bytes, trailer: bool, name="extra.distcp"):
    """Append stored bytes to a data file (``name``); returns the storage info to point an index at."""
    if trailer:
        payload = payload + struct.pack("<Q", xxhash.xxh3_64_intdigest(payload))
    target = path / name
    offset = target.stat().st_size if target.exists() else 0
    with open(target, "ab") as f:
        f.write(payload)
    template = next(iter(read_md(path).storage_data.values()))
    return dataclasses.replace(template, relative_path=name, offset=offset, length=len(payload))


def tensor_bytes(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def has_trailers(path) -> bool:
    return any(i.transform_descriptors for i in read_md(path).storage_data.values())


# ----------------------------------------------------------------------------- the corpus

@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    variants: tuple[str, ...]          # of VARIANTS (see _save)
    mutate: Callable                   # (path, pristine_root) -> None
    key: str | tuple | None = None     # the state-dict key(s) one of which the error must name
    changes_data: bool = True          # verify must exit non-zero
    huge: bool = False                 # run the loads under an address-space limit, in a subprocess
    xfail: str | None = None           # a known qdcp bug (fix outside this change), strict xfail


BOTH = ("plain", "trailer")
TRAILER = ("trailer",)
CASES: list[Case] = []


def case(name, mutate, key=None, variants=BOTH, **kw):
    CASES.append(Case(name, variants, mutate, key, **kw))


# --- truncated data files (several cut points)
def _first_tensor_item_offset(raw, md):
    return info_of(md, comp("int8_group32", "qdata")).offset


case("truncate_empty", lambda p, r: truncate(p, lambda raw, md: 0), key=ALL_KEYS)
case("truncate_at_item_boundary", lambda p, r: truncate(p, _first_tensor_item_offset), key=TENSORS)
case("truncate_mid_int8_qdata", lambda p, r: truncate(
    p, lambda raw, md: info_of(md, comp("int8_group32", "qdata")).offset + 20000), key=TENSORS)
case("truncate_mid_nf4_data", lambda p, r: truncate(
    p, lambda raw, md: info_of(md, comp("nf4", "quantized_data")).offset + 5000), key=TENSORS)
case("truncate_last_byte", lambda p, r: truncate(p, lambda raw, md: len(raw) - 1), key=TENSORS)
case("truncate_half", lambda p, r: truncate(p, lambda raw, md: len(raw) // 2), key=TENSORS)

# --- flipped bytes (several positions, with and without checksums)
for _key, _comp, _rec, _frac in [
    ("int8_group32", "qdata", "data/0", 0.5),
    ("nf4", "quantized_data", "data/0", 0.9),
    ("mx_fp4_swizzled", "scale", "data/0", 0.1),
    ("optim8bit_signed", "codes", "data/0", 0.0),
    ("float8_row", "scale", "data.pkl", 0.5),
    ("nf4", "scaler_mean", "data/0", 0.5),
]:
    case(f"flip_{_key}_{_comp}_{_rec.replace('/', '')}",
         lambda p, r, k=_key, c=_comp, rec=_rec, fr=_frac: flip(p, record_offset(p, comp(k, c), rec, fr)),
         key=_key, variants=VARIANTS)
case("flip_bias_data", lambda p, r: flip(p, record_offset(p, "bias", "data/0", 0.5)), key="bias",
     variants=VARIANTS)
case("flip_object_pickle", lambda p, r: flip(p, record_offset(p, "step", "data.pkl", 0.6)), key="step",
     variants=VARIANTS)

# --- tampered or truncated JSON specs
case("spec_truncated_json", lambda p, r: set_spec_text(p, read_md(p).planner_data["__qdcp__"][:500]))
case("spec_garbage", lambda p, r: set_spec_text(p, "\x00{{{not json"))
case("spec_not_a_string", lambda p, r: set_spec_text(p, {"format": "qdcp"}), variants=TRAILER)
case("spec_deeply_nested", lambda p, r: set_spec_text(p, "[" * 200000 + "]" * 200000), variants=TRAILER)
case("spec_format_other", lambda p, r: edit_spec(p, lambda d, md: d.update(format="safetensors")))
case("spec_version_future", lambda p, r: edit_spec(p, lambda d, md: d.update(version=2)))
case("spec_version_far_future", lambda p, r: edit_spec(p, lambda d, md: d.update(version=10**40)),
     variants=TRAILER)
case("spec_version_zero", lambda p, r: edit_spec(p, lambda d, md: d.update(version=0)), variants=TRAILER)
case("spec_version_string", lambda p, r: edit_spec(p, lambda d, md: d.update(version="1")), variants=TRAILER)
case("spec_version_bool", lambda p, r: edit_spec(p, lambda d, md: d.update(version=True)), variants=TRAILER)
case("spec_entries_not_object", lambda p, r: edit_spec(p, lambda d, md: d.update(entries=[1])), variants=TRAILER)
case("spec_entry_not_object", lambda p, r: edit_spec(p, lambda d, md: d["entries"].update(nf4=[])),
     key="nf4", variants=TRAILER)
case("spec_unknown_type", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"].update(type="evil.module.Tensor")), key="nf4")
case("spec_type_of_other_adapter", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"].update(type="torchao.Int8Tensor")), key="nf4")
case("spec_unknown_storage", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["mx_fp4_swizzled"].update(storage="zip")), key="mx_fp4_swizzled",
    variants=TRAILER)
case("spec_raw_entry_claims_dequantized", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["float8_row"].update(storage="dequantized")), key="float8_row",
    variants=TRAILER)
case("spec_shape_disagrees_with_target", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"].update(shape=[128, 256])), key="int8_group32")
case("spec_negative_dim", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"].update(shape=[-256, 128])), key="int8_group32",
    variants=TRAILER)
case("spec_too_many_dims", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"].update(shape=[1] * 17)), key="int8_group32", variants=TRAILER)
case("spec_unknown_dtype", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["optim8bit_signed"].update(dtype="float128")), key="optim8bit_signed",
    variants=TRAILER)
case("spec_logical_dtype_changed", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"].update(dtype="float16")), key="int8_group32",
    variants=TRAILER)
case("spec_component_dtype_disagrees_with_md", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"]["components"][1].update(dtype="float16")),
    key="int8_group32", variants=TRAILER)
case("spec_component_shape_disagrees_with_layout", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["mx_fp4_swizzled"]["components"][0].update(shape=[256, 128])),
    key="mx_fp4_swizzled", variants=TRAILER)
case("spec_layout_unknown", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"]["components"][0].update(layout={"kind": "spiral"})), key="nf4",
    variants=TRAILER)
case("spec_layout_zero_group", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"]["components"][0].update(layout={"kind": "flat", "group": 0})),
    key="nf4", variants=TRAILER)
case("spec_layout_block_rank", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["float8_row"]["components"][1].update(layout={"kind": "blocked",
                                                                                 "block": [1, 128, 1]})),
    key="float8_row", variants=TRAILER)
case("spec_attr_object_not_allowed", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"]["attrs"].update(
        act_quant_kwargs={"object": "os.system", "fields": {"command": "touch pwned"}})),
    key="int8_group32", variants=TRAILER)
case("spec_attr_enum_not_allowed", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["float8_row"]["attrs"].update(
        kernel_preference={"enum": "subprocess.Popen", "value": "ls"})), key="float8_row", variants=TRAILER)
case("spec_attr_block_size_disagrees", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["int8_group32"]["attrs"].update(block_size=[1, 64])), key="int8_group32",
    variants=TRAILER)
case("spec_attr_nf4_block_size_disagrees", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"]["attrs"].update(block_size=32)), key="nf4", variants=TRAILER)
case("spec_duplicate_component", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"]["components"].append(d["entries"]["nf4"]["components"][0])),
    key="nf4", variants=TRAILER)
case("spec_empty_components", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"]["nf4"].update(components=[])), key="nf4", variants=TRAILER)
case("spec_ghost_entry", lambda p, r: edit_spec(
    p, lambda d, md: d["entries"].update(ghost=d["entries"]["nf4"])), key="ghost", variants=TRAILER)
case("spec_removed", lambda p, r: edit_md(p, lambda md: md.planner_data.pop(qspec.PLANNER_DATA_KEY)))


# --- shapes and dtypes that disagree with the data (spec and item metadata changed consistently)
def _retype_component(key, name, dtype):
    def go(doc, md):
        for c in doc["entries"][key]["components"]:
            if c["name"] == name:
                c["dtype"] = dtype
        md.state_dict_metadata[comp(key, name)].properties.dtype = getattr(torch, dtype)
    return go


def _reshape_component(key, name, shape, layout, chunks=None):
    def go(doc, md):
        for c in doc["entries"][key]["components"]:
            if c["name"] == name:
                c["shape"], c["layout"] = shape, layout
        item = md.state_dict_metadata[comp(key, name)]
        item.size = torch.Size(shape)
        item.chunks = [ChunkStorageMetadata(torch.Size([0] * len(shape)), torch.Size(shape))]
    return go


case("data_dtype_int8_qdata_as_uint8", lambda p, r: edit_spec(
    p, _retype_component("int8_group32", "qdata", "uint8")), key="int8_group32")
case("data_dtype_mx_scale_as_uint8", lambda p, r: edit_spec(
    p, _retype_component("mx_fp4_swizzled", "scale", "uint8")), key="mx_fp4_swizzled", variants=TRAILER)
case("data_dtype_plain_bias_as_float64", lambda p, r: edit_md(
    p, lambda md: setattr(md.state_dict_metadata["bias"].properties, "dtype", torch.float64)), key="bias")
case("data_shape_int8_scale_grown", lambda p, r: edit_spec(p, _reshape_component(
    "int8_group32", "scale", [256, 8], {"kind": "blocked", "block": [1, 16]})), key="int8_group32")
case("data_shape_int8_scale_shrunk", lambda p, r: edit_spec(p, _reshape_component(
    "int8_group32", "scale", [256, 2], {"kind": "blocked", "block": [1, 64]})), key="int8_group32",
    variants=TRAILER)
case("data_shape_nf4_scalers_shrunk", lambda p, r: edit_spec(p, _reshape_component(
    "nf4", "quantized_scalers", [256], {"kind": "flat", "group": 128})), key="nf4", variants=TRAILER)


# --- missing components
def _drop_component_spec(key, name):
    def go(doc, md):
        doc["entries"][key]["components"] = [c for c in doc["entries"][key]["components"] if c["name"] != name]
    return go


def _drop_component_item(key, name, from_spec=False):
    def go(doc, md):
        if from_spec:
            _drop_component_spec(key, name)(doc, md)
        del md.state_dict_metadata[comp(key, name)]
        del md.storage_data[index_of(md, comp(key, name))]
    return go


case("missing_component_in_spec", lambda p, r: edit_spec(p, _drop_component_spec("int8_group32", "zero_point")),
     key="int8_group32")
case("missing_component_item", lambda p, r: edit_spec(p, _drop_component_item("nf4", "quantized_scalers")),
     key="nf4")
case("missing_component_everywhere", lambda p, r: edit_spec(
    p, _drop_component_item("mx_fp4_swizzled", "scale", from_spec=True)), key="mx_fp4_swizzled", variants=TRAILER)
case("missing_storage_record", lambda p, r: edit_md(
    p, lambda md: md.storage_data.pop(index_of(md, comp("optim8bit_signed", "qmap")))), key="optim8bit_signed")
case("missing_plain_tensor", lambda p, r: edit_md(p, lambda md: md.state_dict_metadata.pop("bias")),
     key="bias", variants=TRAILER)
case("missing_data_file", lambda p, r: os.remove(data_file(p)))


# --- duplicate / overlapping / out-of-bounds chunks, holes
def _chunks(fqn, chunks):
    def go(md):
        md.state_dict_metadata[fqn].chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks]
    return go


case("chunk_duplicated", lambda p, r: edit_md(
    p, _chunks(comp("int8_group32", "qdata"), [((0, 0), (256, 128)), ((0, 0), (256, 128))])), key="int8_group32")
case("chunk_out_of_bounds", lambda p, r: edit_md(
    p, _chunks(comp("int8_group32", "qdata"), [((8, 0), (256, 128))])), key="int8_group32")
case("chunk_negative_offset", lambda p, r: edit_md(
    p, _chunks(comp("optim8bit_signed", "codes"), [((-8, 0), (256, 128))])), key="optim8bit_signed",
    variants=TRAILER)
case("chunk_hole_claimed_smaller", lambda p, r: edit_md(
    p, _chunks(comp("int8_group32", "qdata"), [((0, 0), (128, 128))])), key="int8_group32")
case("chunk_none", lambda p, r: edit_md(p, _chunks(comp("nf4", "quantized_data"), [])), key="nf4",
     variants=TRAILER)
case("chunk_wrong_rank", lambda p, r: edit_md(
    p, _chunks(comp("float8_row", "scale"), [((0,), (256,))])), key="float8_row", variants=TRAILER)
case("chunk_plain_claimed_smaller", lambda p, r: edit_md(p, _chunks("bias", [((0,), (5,))])), key="bias")


def _forged_chunks(fqn, pieces, checksums):
    """Replace ``fqn``'s chunks by forged ones whose stored tensors have exactly the claimed shapes
    (rows of the original data), so only a coverage check can tell the damage."""
    def go(path, root):
        md = read_md(path)
        orig = qdcp.read_entry(root / ("trailer" if checksums else "plain"), fqn.split(SEP)[0]) \
            if SEP not in fqn else None
        if orig is None:
            sd = {fqn: torch.empty(tuple(md.state_dict_metadata[fqn].size),
                                   dtype=md.state_dict_metadata[fqn].properties.dtype)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.load(sd, storage_reader=qdcp.CheckpointReader(path), planner=qdcp.QuantizedLoadPlanner(),
                         no_dist=True)
            orig = sd[fqn]
        item = md.state_dict_metadata[fqn]
        del md.storage_data[index_of(md, fqn)]
        item.chunks = []
        for i, (offsets, sizes, src_row) in enumerate(pieces):
            piece = orig.narrow(0, src_row, sizes[0]).clone()
            info = append_item(path, tensor_bytes(piece), checksums)
            md.storage_data[MetadataIndex(fqn, torch.Size(offsets), i)] = info
            item.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
        write_md(path, md)
    return go


for _v in BOTH:
    # rows [0,128) and [64,192) (honest data): 256 rows in all, so a sum-of-volumes check passes,
    # but rows [192,256) are never read
    case(f"chunks_overlap_cancels_hole_{_v}", _forged_chunks(
        comp("optim8bit_signed", "codes"), [((0, 0), (128, 128), 0), ((64, 0), (128, 128), 64)], _v == "trailer"),
        key="optim8bit_signed", variants=(_v,))
    case(f"chunks_plain_hole_{_v}", _forged_chunks("bias", [((0,), (5,), 0)], _v == "trailer"), key="bias",
         variants=(_v,))
    case(f"chunks_plain_overlap_{_v}", _forged_chunks("bias", [((0,), (4,), 0), ((3,), (4,), 3)], _v == "trailer"),
         key="bias", variants=(_v,), changes_data=True)


# --- storage_data offsets / lengths / files pointing elsewhere
def _storage(fqn, **changes):
    def go(md):
        idx = index_of(md, fqn)
        info = md.storage_data[idx]
        md.storage_data[idx] = dataclasses.replace(
            info, **{k: (v(info) if callable(v) else v) for k, v in changes.items()})
    return go


def _swap_storage(a, b):
    def go(md):
        ia, ib = index_of(md, a), index_of(md, b)
        md.storage_data[ia], md.storage_data[ib] = md.storage_data[ib], md.storage_data[ia]
    return go


def _point_to_other_checkpoint(fqn):
    def go(path, root):
        other = root / f"other_{path.name.rsplit('-', 1)[1]}"
        info = info_of(read_md(other), fqn)
        rel = os.path.relpath(data_file(other), path)
        edit_md(path, _storage(fqn, relative_path=rel, offset=info.offset, length=info.length))
    return go


case("storage_offset_shifted", lambda p, r: edit_md(
    p, _storage(comp("int8_group32", "scale"), offset=lambda i: i.offset + 100)), key="int8_group32")
case("storage_length_short", lambda p, r: edit_md(
    p, _storage(comp("nf4", "quantized_data"), length=lambda i: i.length - 10)), key="nf4")
case("storage_length_long", lambda p, r: edit_md(
    p, _storage(comp("nf4", "quantized_data"), length=lambda i: i.length + 100)), key="nf4")
case("storage_swapped_same_shape_other_dtype", lambda p, r: edit_md(
    p, _swap_storage(comp("int8_group32", "scale"), comp("mx_fp4_swizzled", "scale"))), key="int8_group32")
case("storage_swapped_plain_and_component", lambda p, r: edit_md(
    p, _swap_storage("bias", comp("nf4", "nf4"))), key="bias")
case("storage_missing_file", lambda p, r: edit_md(
    p, _storage(comp("float8_row", "qdata"), relative_path="__nope.distcp")), key="float8_row")
case("storage_path_traversal_other_checkpoint", _point_to_other_checkpoint(comp("int8_group32", "qdata")),
     key="int8_group32")
case("storage_absolute_path", lambda p, r: edit_md(
    p, _storage("bias", relative_path="/etc/passwd", offset=0, length=100)), key="bias", variants=TRAILER)
case("storage_unknown_extension", lambda p, r: edit_md(
    p, _storage("bias", transform_descriptors=["evil-zip/1"])), key="bias", variants=TRAILER)
case("storage_checksum_future_version", lambda p, r: edit_md(
    p, _storage("bias", transform_descriptors=["qdcp-checksum/3"])), key="bias", variants=TRAILER)
case("storage_checksum_stripped", lambda p, r: edit_md(
    p, _storage("bias", transform_descriptors=[])), key="bias", variants=TRAILER, changes_data=False)


# --- huge claimed sizes (consistent in spec and item metadata; must not be allocated)
def _huge_entry(doc, md):
    e = doc["entries"]["int8_group32"]
    e["shape"] = [HUGE, 128]
    for c in e["components"]:
        c["shape"] = [HUGE] + c["shape"][1:]
        item = md.state_dict_metadata[comp("int8_group32", c["name"])]
        item.size = torch.Size(c["shape"])
        item.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size(c["shape"]))]


def _huge_replicated(doc, md):
    for c in doc["entries"]["nf4"]["components"]:
        if c["name"] == "nf4":
            c["shape"] = [HUGE]
    item = md.state_dict_metadata[comp("nf4", "nf4")]
    item.size = torch.Size([HUGE])
    item.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([HUGE]))]


def _huge_plain(md):
    item = md.state_dict_metadata["bias"]
    item.size = torch.Size([HUGE])
    item.chunks = [ChunkStorageMetadata(torch.Size([0]), torch.Size([HUGE]))]


case("huge_entry_shape", lambda p, r: edit_spec(p, _huge_entry), key="int8_group32", huge=True)
case("huge_replicated_component", lambda p, r: edit_spec(p, _huge_replicated), key="nf4", huge=True,
     variants=TRAILER)
case("huge_plain_tensor", lambda p, r: edit_md(p, _huge_plain), key="bias", huge=True, variants=TRAILER)
case("huge_storage_length", lambda p, r: edit_md(
    p, _storage(comp("float8_row", "qdata"), length=HUGE)), key="float8_row", huge=True)
case("huge_storage_offset", lambda p, r: edit_md(
    p, _storage(comp("float8_row", "qdata"), offset=HUGE)), key="float8_row", huge=True, variants=TRAILER)
case("huge_metadata_pickle_bytes", lambda p, r: (p / ".metadata").write_bytes(
    b"\x80\x04\x8e" + struct.pack("<Q", HUGE) + b"x" * 64), huge=True, variants=TRAILER)


# --- truncated / garbage / hostile .metadata
class _TouchPayload:
    """Unpickling this creates a file (it would run ``open(path, "w")``)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (open, (self.target, "w"))


class _SystemPayload:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def _md_bytes(fn):
    def go(p, r):
        f = p / ".metadata"
        f.write_bytes(fn(f.read_bytes(), p))
    return go


def pwned_marker(path):
    return path.parent / f"PWNED_{path.name}"


case("metadata_truncated_half", _md_bytes(lambda b, p: b[: len(b) // 2]))
case("metadata_truncated_last_byte", _md_bytes(lambda b, p: b[:-1]), variants=TRAILER)
case("metadata_empty", _md_bytes(lambda b, p: b""), variants=TRAILER)
case("metadata_garbage", _md_bytes(lambda b, p: os.urandom(4096)), variants=TRAILER)
case("metadata_payload_open_creates_file", _md_bytes(lambda b, p: pickle.dumps(_TouchPayload(str(pwned_marker(p))))))
case("metadata_payload_os_system", _md_bytes(lambda b, p: pickle.dumps(_SystemPayload(str(pwned_marker(p))))),
     variants=TRAILER)
case("metadata_payload_inside_metadata", lambda p, r: edit_md(
    p, lambda md: md.planner_data.update(evil=_TouchPayload(str(pwned_marker(p))))))
case("metadata_not_metadata", _md_bytes(lambda b, p: pickle.dumps({"state_dict_metadata": {}})), variants=TRAILER)
case("metadata_missing", lambda p, r: os.remove(p / ".metadata"))
case("metadata_is_directory", lambda p, r: (os.remove(p / ".metadata"), os.mkdir(p / ".metadata")), variants=TRAILER)


# --- non-tensor objects carrying a code-executing pickle (BYTE_IO items)
def _evil_object(fqn, payload_cls):
    def go(path, root):
        buf = io.BytesIO()
        torch.save(payload_cls(str(pwned_marker(path))), buf)
        info = append_item(path, buf.getvalue(), has_trailers(path))
        edit_md(path, lambda md: md.storage_data.__setitem__(index_of(md, fqn), info))
    return go


case("object_payload_open", _evil_object("step", _TouchPayload), key="step")
case("object_payload_os_system", _evil_object("opt.lr", _SystemPayload), key="opt.lr")


CASE_PARAMS = [
    pytest.param(c, v, id=f"{c.name}-{v}" if len(c.variants) > 1 else c.name,
                 marks=[pytest.mark.xfail(strict=True, reason=c.xfail)] if c.xfail else [])
    for c in CASES for v in c.variants
]
CASE_BY_ID = {f"{c.name}-{v}": (c, v) for c in CASES for v in c.variants}


# ----------------------------------------------------------------------------- checking one case

def fresh_targets(kind: str) -> dict:
    """Fresh targets: quantized of the same types (other values), or plain tensors of the logical shape."""
    state = {}
    for i, n in enumerate(QNAMES):
        c = CASE_BY_NAME[n]
        state[n] = c.make(50 + i) if kind == "quantized" else torch.full(SHAPE, 3.0, dtype=c.dtype)
    state["bias"] = torch.full((7,), 3.0)
    state["step"] = -1
    state["opt"] = {"lr": -1.0, "betas": [-1.0, -1.0]}
    return state


def assert_exact(loaded: dict, kind: str) -> None:
    orig = original_state(0)
    for n in QNAMES:
        if kind == "quantized":
            assert_same_buffers(loaded[n], orig[n])
        else:
            expected = CASE_BY_NAME[n].dequantize(orig[n])
            assert loaded[n].dtype == expected.dtype and torch.equal(bits(loaded[n]), bits(expected)), n
    assert torch.equal(bits(loaded["bias"]), bits(orig["bias"]))
    assert loaded["step"] == orig["step"] and loaded["opt"] == orig["opt"]


def root_errors(e: BaseException) -> list[BaseException]:
    """Each rank's own error (on torch 2.11, qdcp's .metadata error rides past DCP's
    ``except Exception`` as the cause of a carrier)."""
    errors = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()] \
        if isinstance(e, CheckpointException) else [e]
    return [err.__cause__ if type(err).__name__ == "_MetadataUnreadable" else err for err in errors]


# DCP's own errors that are clear and name the key (plain tensors go through DCP's default path)
_DCP_CLEAR = ("Size mismatch between saved", "Missing key in checkpoint state_dict")


def _metadata_error(path) -> str | None:
    try:
        qdcp.CheckpointReader(path).read_metadata()
    except QdcpError as e:
        return str(e)
    return None


def assert_clear(e: BaseException, key: str | None, path) -> str:
    for err in root_errors(e):
        msg = f"{type(err).__name__}: {err}"
        # DCP reports a reader's .metadata failure as an AssertionError that quotes qdcp's message
        wrapped = isinstance(err, AssertionError) and "metadata read failed" in str(err) \
            and (_metadata_error(path) or "\0") in str(err)
        ok = isinstance(err, QdcpError) or wrapped or any(s in str(err) for s in _DCP_CLEAR)
        assert ok, f"unclear error: {msg}"
        if key is not None:
            keys = (key,) if isinstance(key, str) else key
            assert any(repr(k) in str(err) or re.search(rf"\b{re.escape(k)}\b", str(err)) and
                       any(d in str(err) for d in _DCP_CLEAR) for k in keys), \
                f"error does not name key {key!r}: {msg}"
        return msg
    raise AssertionError("no error")


def load_into(path, kind: str):
    state = fresh_targets(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=qdcp.CheckpointReader(path), planner=qdcp.QuantizedLoadPlanner(),
                 no_dist=True)
    return state


def verify_rc(path) -> int:
    out = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            return qdcp.cli.main(["verify", str(path)])
        finally:
            logging.disable(logging.NOTSET)


def check(path, c: Case) -> dict:
    """Load into both target kinds and verify; returns what happened (for the report)."""
    marker = pwned_marker(path)
    outcome = {}
    for kind in ("quantized", "plain"):
        try:
            loaded = load_into(path, kind)
        except BaseException as e:  # CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            outcome[kind] = assert_clear(e, c.key, path)
        else:
            assert_exact(loaded, kind)
            outcome[kind] = "exact"
        assert not marker.exists(), "the checkpoint ran code"
    rc = verify_rc(path)
    outcome["verify"] = rc
    assert not marker.exists(), "the checkpoint ran code"
    if c.changes_data:
        assert rc != 0, "qdcp verify accepted a damaged checkpoint"
    return outcome


def make_case(root, tmp_path, c: Case, variant: str):
    path = tmp_path / f"{c.name}-{variant}"
    shutil.copytree(root / variant, path)
    c.mutate(path, root)
    return path


# ----------------------------------------------------------------------------- tests

def test_pristine_loads_exactly_and_verifies(pristine):
    for variant in VARIANTS:
        path = pristine / variant
        for kind in ("quantized", "plain"):
            assert_exact(load_into(path, kind), kind)
        assert verify_rc(path) == 0


def _report(case_id, outcome) -> None:
    if os.environ.get("QDCP_BAD_INPUT_REPORT"):
        with open(os.environ["QDCP_BAD_INPUT_REPORT"], "a") as f:
            f.write(json.dumps({"case": case_id, **outcome}) + "\n")


@pytest.mark.parametrize("c, variant", CASE_PARAMS)
def test_bad_input(pristine, tmp_path, c, variant, request):
    case_id = f"{c.name}-{variant}"
    if c.huge:
        result = request.getfixturevalue("huge_results")[case_id]
        assert result["ok"], result["error"]
        _report(case_id, result["outcome"])
        return
    path = make_case(pristine, tmp_path, c, variant)
    _report(case_id, check(path, c))


_HUGE_SCRIPT = r"""
import json, pathlib, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
sys.path.insert(0, sys.argv[1])
import test_bad_inputs as T
out = {}
for path, case_id in zip(sys.argv[2::2], sys.argv[3::2]):
    c, _ = T.CASE_BY_ID[case_id]
    try:
        out[case_id] = {"ok": True, "outcome": T.check(pathlib.Path(path), c)}
    except BaseException as e:
        out[case_id] = {"ok": False, "error": traceback.format_exc()[-3000:]}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def huge_results(pristine, tmp_path_factory):
    """Checks every huge-size case in one subprocess whose address space is limited to 4 GiB (the
    checkpoints claim terabytes: a loader that believed them would fail there, not pass)."""
    root = tmp_path_factory.mktemp("huge")
    args = []
    for case_id, (c, variant) in CASE_BY_ID.items():
        if c.huge:
            args += [str(make_case(pristine, root, c, variant)), case_id]
    proc = subprocess.run([sys.executable, "-c", _HUGE_SCRIPT, TESTS, *args], capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert lines, f"subprocess died (rc {proc.returncode}): {proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT"):])


# ----------------------------------------------------------------------------- spec fuzzing

def _pristine_doc() -> dict:
    entries = {}
    for i, n in enumerate(QNAMES + ("int8_dynamic_act", "nvfp4_per_tensor_swizzled")):
        t = CASE_BY_NAME[n].make(i)
        adapter = qdcp.find_adapter(t)
        attrs = {k: qspec.encode_value(v) for k, v in adapter.attributes(t).items()}
        comps = adapter.components(t)
        layouts = adapter.layouts(t)
        entries[n] = {"storage": "raw", "type": adapter.type_name(t), "shape": list(SHAPE),
                      "dtype": qspec.dtype_to_str(t.dtype), "attrs": attrs,
                      "components": [{"name": c, "shape": list(layouts[c].component_shape(SHAPE)),
                                      "dtype": qspec.dtype_to_str(v.dtype), "layout": layouts[c].to_json()}
                                     for c, v in comps.items()]}
    entries["deq"] = {"storage": "dequantized", "type": "torchao.Int8Tensor", "shape": [3, 4],
                      "dtype": "bfloat16", "attrs": {}, "stored_dtype": "float32"}
    return {"format": "qdcp", "version": 1, "entries": entries}


PRISTINE_DOC = _pristine_doc()

_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-3, max_value=300),
    st.sampled_from([0, 1, 2, 16, 17, 32, 2**31, 2**48, 2**48 + 1, 2**63, 2**64, -1, -(2**63)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["raw", "dequantized", "blocked", "flat", "replicated", "bfloat16", "uint8", "int4",
                     "float4_e2m1fn_x2", "float8_e8m0fnu", "bool", "torchao.NF4Tensor", "torchao.MXTensor",
                     "torchao.Int8Tensor", "os.system", "", "qdata", "scale", "tuple", "dtype", "enum",
                     "object", "fields", "kind", "block", "group", "KernelPreference"]),
    st.text(max_size=8),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(
        st.sampled_from(["kind", "block", "group", "tuple", "dtype", "enum", "value", "object", "fields",
                         "name", "shape", "layout", "x"]), inner, max_size=4)),
    max_leaves=12)


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(PRISTINE_DOC) if p]


def _mutate(doc, path, op, value):
    node = doc
    for k in path[:-1]:
        node = node[k]
    last = path[-1]
    if op == "set":
        node[last] = value
    elif op == "delete":
        if isinstance(node, dict):
            del node[last]
        else:
            node.pop(last)
    elif op == "duplicate" and isinstance(node, list):
        node.append(json.loads(json.dumps(node[last])))
    elif op == "scale" and isinstance(node[last], int) and not isinstance(node[last], bool):
        node[last] = node[last] * (value if isinstance(value, int) and not isinstance(value, bool) else 2)


@settings(max_examples=int(os.environ.get("QDCP_FUZZ_EXAMPLES", "400")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(ALL_PATHS), st.sampled_from(["set", "delete", "duplicate", "scale"]),
                          _values), min_size=1, max_size=4))
def test_fuzz_spec_parser(mutations):
    doc = json.loads(json.dumps(PRISTINE_DOC))
    for path, op, value in mutations:
        try:
            _mutate(doc, path, op, value)
        except (KeyError, IndexError, TypeError, AttributeError):
            pass  # the path no longer exists after an earlier mutation
    text = json.dumps(doc)
    try:
        entries = qspec.loads(text)
        for fqn, entry in entries.items():
            adapter = qdcp.adapters.base.adapter_for_type(entry.type, fqn)
            for v in entry.attrs.values():
                qspec.decode_value(v, adapter.attribute_classes(), f"key {fqn!r}: ")
            if entry.storage == qspec.RAW:
                _layouts_from_spec(entry)
                check_component_bytes(entry)
    except (CheckpointFormatError, LoadMismatchError):
        pass
