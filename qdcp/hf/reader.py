"""``QuantizedHFReader``: a DCP ``StorageReader`` over a Hugging Face safetensors directory.

    dcp.load(state, storage_reader=qdcp.QuantizedHFReader(path), planner=qdcp.QuantizedLoadPlanner())

The directory may be in torchao's safetensors layout, in compressed-tensors' layout (its
``config.json`` says ``quant_method: compressed-tensors``), or plain. Quantized entries are
presented as qdcp raw entries (a spec in the metadata, one item per component), so the load
planner fills quantized targets raw (same type bit-exact, or the other family through a raw form),
plain targets with the dequantized values, and DTensor targets at any world size. Items stored as
they are presented are read by byte range (``safe_open(...).get_slice``: each rank reads what it
needs); the few that are not (swizzled scales, packed integers) are computed from their whole
tensors. Nothing is unpickled; torchao entries are rebuilt by torchao's own allow-listed decoder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from torch.futures import Future
from typing import Any, Callable, Mapping

import torch
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from qdcp import spec as qspec
from qdcp.adapters import compressed_tensors as ct
from qdcp.adapters.base import find_adapter
from qdcp.errors import CheckpointFormatError
from qdcp.hf import safetensors_files as stf
from qdcp.hf.ct_layout import read_quantization_config, unpack_int32
from qdcp.hf.torchao_layout import part_name
from qdcp.layouts import Blocked, Replicated
from qdcp.adapters.base import describe_tensor

Getter = Callable[[str], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class _Item:
    """Where one presented item comes from: a file tensor read by range, or computed whole."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    tensor: str | None = None   #: the file tensor holding it as presented
    #: else: computed from file tensors (into the given buffer where it can: it returns what it filled)
    build: Callable[[Getter, torch.Tensor | None], torch.Tensor] | None = None


@dataclasses.dataclass
class _Directory:
    """The tensors of a directory: name -> (file, shape, dtype), and each file's metadata."""

    path: str
    tensors: dict[str, tuple[str, tuple[int, ...], torch.dtype]]
    file_metadata: dict[str, dict[str, str]]
    config: dict

    @classmethod
    def scan(cls, path: str) -> "_Directory":
        from safetensors import safe_open

        tensors, metas = {}, {}
        for name in stf.directory_files(path):
            file = os.path.join(path, name)
            with safe_open(file, "pt") as f:
                metas[name] = f.metadata() or {}
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype = stf.SAFETENSORS_TORCH_DTYPES.get(sl.get_dtype())
                    if dtype is None:
                        raise CheckpointFormatError(f"{file}: tensor {key!r} has dtype {sl.get_dtype()}, "
                                                    f"which qdcp does not read")
                    tensors[key] = (file, tuple(sl.get_shape()), dtype)
        return cls(path, tensors, metas, stf.read_config(path))

    def meta(self, name: str) -> torch.Tensor:
        _, shape, dtype = self.tensors[name]
        return torch.empty(shape, dtype=dtype, device="meta")


class QuantizedHFReader(StorageReader):
    """A DCP ``StorageReader`` over a Hugging Face safetensors directory (torchao's layout,
    compressed-tensors', or plain); use it with :class:`qdcp.QuantizedLoadPlanner`."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._items: dict[str, _Item] = {}
        self._dir: _Directory | None = None

    # --- StorageReader
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isdir(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """Present the directory to DCP: quantized entries as qdcp raw entries, the rest plain."""
        self._dir = d = _Directory.scan(self.path)
        specs: dict[str, qspec.EntrySpec] = {}
        items: dict[str, _Item] = {}
        presented = _ct_entries(d) if _is_ct(d.config) else _torchao_entries(d)
        consumed: set[str] = set()
        for spec, comps, used in presented:
            specs[spec.fqn] = spec
            consumed |= used
            items.update({qspec.component_fqn(spec.fqn, n): item for n, item in comps.items()})
        for name, (_, shape, dtype) in d.tensors.items():
            if name not in consumed:
                items[name] = _Item(shape, dtype, tensor=name)
        self._items = items
        sd_md = {fqn: TensorStorageMetadata(TensorProperties(dtype=i.dtype), torch.Size(i.shape),
                                            [ChunkStorageMetadata(torch.Size([0] * len(i.shape)), torch.Size(i.shape))])
                 for fqn, i in items.items()}
        return Metadata(state_dict_metadata=sd_md, planner_data={qspec.PLANNER_DATA_KEY: qspec.dumps(specs)},
                        storage_data={})

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self._dir is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Read each requested part into the planner's buffer: by byte range where the item is a
        file tensor, else from the item computed whole (straight into the buffer when the part is
        the item, else once per plan)."""
        from safetensors import safe_open

        handles: dict[str, Any] = {}
        built: dict[str, torch.Tensor] = {}
        with contextlib.ExitStack() as files:
            def handle(name: str):
                file = self._dir.tensors[name][0]
                if file not in handles:
                    handles[file] = files.enter_context(safe_open(file, "pt"))
                return handles[file]

            def whole(name: str) -> torch.Tensor:
                return handle(name).get_tensor(name)

            for req in plan.items:
                fqn = req.storage_index.fqn
                item = self._items[fqn]
                region = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
                target = planner.resolve_tensor(req).detach()
                if item.tensor is not None:
                    value = handle(item.tensor).get_slice(item.tensor)[region] if region else whole(item.tensor)
                    target.copy_(value.reshape(target.shape))
                elif fqn not in built and tuple(req.lengths) == item.shape and target.is_contiguous() \
                        and target.dtype == item.dtype:
                    value = item.build(whole, target)
                    if value.data_ptr() != target.data_ptr():
                        target.copy_(value.reshape(target.shape))
                else:
                    if fqn not in built:
                        built[fqn] = item.build(whole, None)
                    target.copy_(built[fqn][region].reshape(target.shape))
                planner.commit_tensor(req, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut


# ----------------------------------------------------------------------------- torchao's layout

def _torchao_entries(d: _Directory) -> list:
    """Entries of torchao's layout: those in any file's ``tensor_names`` with a torchao class,
    once each (transformers and qdcp write the whole directory's metadata into every file; two
    files describing one entry differently are refused)."""
    described: dict[str, tuple[str, str]] = {}
    for file, meta in d.file_metadata.items():
        for key in json.loads(meta.get("tensor_names", "[]")):
            desc = meta.get(key, "{}")
            if key in described and described[key][1] != desc:
                raise CheckpointFormatError(f"key {key!r}: {described[key][0]} and {file} describe it differently "
                                            f"in their torchao metadata; which one holds its tensors is unknown")
            described.setdefault(key, (file, desc))
    out = []
    for key, (_, desc) in described.items():
        parsed = json.loads(desc)
        if parsed.get("_type") not in (None, "Tensor"):
            out.append(_torchao_entry(d, key, parsed))
    return out


def _torchao_entry(d: _Directory, key: str, desc: dict):
    from torchao.prototype.safetensors.safetensors_utils import object_from_dict

    names = {p: part_name(key, p) for p in desc.get("_tensor_data_names", [])}
    missing = [n for n in names.values() if n not in d.tensors]
    if missing:
        raise CheckpointFormatError(f"key {key!r}: torchao's metadata names tensors {missing} the files lack")

    def instance(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return object_from_dict({"_type": desc["_type"], "_data": {**desc.get("_data", {}), **tensors}})

    t = instance({p: d.meta(n) for p, n in names.items()})
    adapter = find_adapter(t)
    if adapter is None:
        raise CheckpointFormatError(f"key {key!r}: no qdcp adapter for torchao's {desc['_type']}")
    attrs, layouts = describe_tensor(t, adapter, key)
    comps = adapter.components(t)
    items = {}
    for name, value in comps.items():
        if name in names and value is getattr(t, name):
            items[name] = _Item(tuple(value.shape), value.dtype, tensor=names[name])
        else:  # computed from the whole entry (e.g. a swizzled scale, unswizzled)
            def build(get: Getter, out=None, name=name) -> torch.Tensor:
                return adapter.components(instance({p: get(n) for p, n in names.items()}))[name]
            items[name] = _Item(tuple(value.shape), value.dtype, build=build)
    spec = qspec.EntrySpec(key, qspec.RAW, adapter.type_name(t), tuple(t.shape), t.dtype, attrs,
                           tuple(qspec.ComponentSpec(n, items[n].shape, items[n].dtype, layouts[n].to_json())
                                 for n in comps))
    return spec, items, set(names.values())


# ----------------------------------------------------------------------------- compressed-tensors

def _is_ct(config: Mapping) -> bool:
    qc = config.get("quantization_config") or config.get("compression_config")
    return isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors"


def _matches(module: str, patterns) -> bool:
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == module or p in ("Linear", "nn.Linear"):  # class targets: every quantized module
            return True
    return False


#: quantization_status values: "compressed" stores the format's codes; the others dense weights (with
#: the quantization parameters beside them): "decompressed" is what transformers saves after a
#: loaded model decompressed itself, "frozen" / "initialized" / "calibration" a model saved before
#: compression
_CT_STATUSES = ("compressed", "decompressed", "frozen", "initialized", "calibration")
_UNPACKED = ("naive-quantized", "float-quantized", "int-quantized")
_E4M3, _INTEGERS = (torch.float8_e4m3fn,), (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_DENSE = "a 16-bit or wider floating dtype"
#: per format, the stored dtype of each parameter (``_DENSE``: any of those), required ones first
_CT_DTYPES = {
    "nvfp4-pack-quantized": {"weight_packed": (torch.uint8,), "weight_scale": _E4M3, "weight_global_scale": _DENSE},
    "mxfp8-quantized": {"weight": _E4M3, "weight_scale": (torch.uint8, torch.float8_e8m0fnu)},
    "naive-quantized": {"weight": _E4M3 + (torch.int8,), "weight_scale": _DENSE, "weight_zero_point": _INTEGERS},
    "float-quantized": {"weight": _E4M3, "weight_scale": _DENSE},
    "int-quantized": {"weight": (torch.int8,), "weight_scale": _DENSE, "weight_zero_point": _INTEGERS},
    "pack-quantized": {"weight_packed": (torch.int32,), "weight_scale": _DENSE, "weight_shape": _INTEGERS,
                       "weight_zero_point": (torch.int32,)},
}
_REQUIRED = {"nvfp4-pack-quantized": 3, "mxfp8-quantized": 2, "pack-quantized": 3}


def _is_dense(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize >= 2


def _ct_entries(d: _Directory) -> list:
    """The quantized entries of a compressed-tensors directory: each module a config group targets
    that holds quantization parameters, read as the format's codes where ``quantization_status`` is
    ``compressed`` (or absent and the stored dtypes are codes), else left as the dense tensors they
    are. A module whose stored dtypes contradict the status, or codes no group targets, are refused."""
    qc = read_quantization_config(d.config)
    status = qc.get("quantization_status")
    if status is not None and status not in _CT_STATUSES:
        raise CheckpointFormatError(f"{d.path}: compressed-tensors quantization_status {status!r} is not one qdcp "
                                    f"reads ({', '.join(_CT_STATUSES)})")
    out, seen = [], set()
    for group in (qc.get("config_groups") or {}).values():
        fmt = group.get("format") or qc.get("format")
        weights = group.get("weights") or {}
        for module in _ct_modules(d, group.get("targets"), qc.get("ignore")):
            if module not in seen and _ct_compressed(d, module, status):
                out.append(_ct_entry(d, module, fmt, weights))
            seen.add(module)
    _refuse_unread_codes(d, set().union(*(used for _, _, used in out)), status)
    return out


def _ct_modules(d: _Directory, targets, ignore) -> list[str]:
    """Modules holding quantization parameters (``weight_scale`` or ``weight_packed``) that
    ``targets`` name and ``ignore`` does not."""
    found = {n.rsplit(".", 1)[0] for n in d.tensors if n.endswith((".weight_scale", ".weight_packed"))}
    return sorted(m for m in found if _matches(m, targets) and not _matches(m, ignore))


def _ct_compressed(d: _Directory, module: str, status: str | None) -> bool:
    """Whether ``module``'s tensors are the format's codes (True) or its dense weight (False), as
    ``quantization_status`` says (absent: as the stored dtypes say); a status the stored dtypes
    contradict is refused."""
    weight = d.tensors.get(f"{module}.weight")
    dense = weight is not None and _is_dense(weight[2]) and f"{module}.weight_packed" not in d.tensors
    if status is None or dense == (status != "compressed"):
        return not dense
    if dense:
        stored, fix = f"a dense {weight[2]} weight", "'decompressed' if these are the model's dense weights"
    else:
        stored = f"{weight[2]} codes" if weight is not None else "packed codes (weight_packed)"
        fix = "'compressed' if these are the format's codes"
    raise CheckpointFormatError(f"key {module + '.weight'!r}: the config's quantization_status is {status!r} but "
                                f"the directory stores {stored}: qdcp cannot tell what it holds and does not "
                                f"load it (set quantization_status to {fix})")


def _refuse_unread_codes(d: _Directory, consumed: set[str], status: str | None) -> None:
    """Refuse codes no entry reads (a module no config group targets): loaded as plain tensors
    they would be wrong values."""
    for name, (_, _, dtype) in d.tensors.items():
        if name in consumed:
            continue
        module = name.rsplit(".", 1)[0]
        codes = name.endswith(".weight_packed") or (
            name.endswith(".weight") and not _is_dense(dtype) and f"{module}.weight_scale" in d.tensors)
        if codes:
            raise CheckpointFormatError(
                f"key {module + '.weight'!r}: {name!r} holds compressed-tensors codes ({dtype}) but no config group "
                f"that reads them targets module {module!r} (quantization_status {status!r}); "
                f"qdcp will not load them as plain values")


def _check_ct_dtypes(d: _Directory, key: str, module: str, fmt: str, weights: Mapping) -> None:
    """Every parameter the format needs is there with the dtype its codes or scales must have."""
    expected = dict(_CT_DTYPES[fmt])
    if fmt == "naive-quantized" and weights.get("type") in ("float", "int"):
        expected["weight"] = _E4M3 if weights["type"] == "float" else (torch.int8,)
    for i, (part, allowed) in enumerate(expected.items()):
        name = f"{module}.{part}"
        if name not in d.tensors:
            if i < _REQUIRED.get(fmt, 2):
                raise CheckpointFormatError(f"key {key!r}: a {fmt} module stores {name!r}; the directory lacks it")
            continue
        dtype = d.tensors[name][2]
        if not (_is_dense(dtype) if allowed == _DENSE else dtype in allowed):
            want = allowed if allowed == _DENSE else " or ".join(map(str, allowed))
            raise CheckpointFormatError(
                f"key {key!r}: {name!r} is stored as {dtype}, but {fmt} stores it as {want}: qdcp cannot tell "
                f"what it holds (a model re-saved under a config it no longer matches?); it is not loaded")


def _ct_entry(d: _Directory, module: str, fmt: str, weights: Mapping):
    """One quantized module's entry, its parameters checked against what ``fmt`` stores."""
    key = f"{module}.weight"
    if fmt not in _CT_DTYPES:
        raise CheckpointFormatError(f"key {key!r}: compressed-tensors format {fmt!r} is not read by qdcp "
                                    f"({', '.join(_CT_DTYPES)} are)")
    _check_ct_dtypes(d, key, module, fmt, weights)
    t = {part: f"{module}.{part}" for part in ("weight_packed", "weight_scale", "weight_global_scale",
                                                "weight_shape", "weight_zero_point")}
    if fmt == "nvfp4-pack-quantized":
        n, half = d.tensors[t["weight_packed"]][1]
        comps = {"weight_packed": (Blocked((1, 2)), t["weight_packed"]),
                 "weight_scale": (Blocked((1, 16)), t["weight_scale"]),
                 "weight_global_scale": (Replicated((1,)), t["weight_global_scale"])}
        return _ct_spec(d, key, ct.NVFP4, (n, half * 2), torch.bfloat16, {}, comps)
    if fmt == "mxfp8-quantized":
        comps = {"weight": (Blocked((1, 1)), key), "weight_scale": (Blocked((1, 32)), t["weight_scale"])}
        return _ct_spec(d, key, ct.MXFP8, d.tensors[key][1], torch.bfloat16, {}, comps)
    asymmetric = not weights.get("symmetric", True) or t["weight_zero_point"] in d.tensors
    is_int = weights.get("type") == "int" or (key in d.tensors and d.tensors[key][2] == torch.int8)
    if asymmetric and not (is_int and (fmt in _UNPACKED or weights.get("strategy") in ("channel", "group"))):
        raise CheckpointFormatError(f"key {key!r}: asymmetric compressed-tensors weights are read as integers "
                                    f"(packed per channel or group, or unpacked); this is {fmt}, "
                                    f"{weights.get('type')} {weights.get('strategy')}")
    if asymmetric and t["weight_zero_point"] not in d.tensors:
        raise CheckpointFormatError(f"key {key!r}: an asymmetric scheme without {t['weight_zero_point']!r}")
    if fmt in _UNPACKED:
        return _ct_unpacked(d, key, t, weights, asymmetric)
    return _ct_packed(d, key, t, weights, asymmetric)


def _ct_unpacked(d: _Directory, key: str, t: Mapping[str, str], weights: Mapping, asymmetric: bool):
    """naive / float / int-quantized: the codes stored as they are (FP8 E4M3 or int8)."""
    scale = d.meta(t["weight_scale"])
    shape = d.tensors[key][1]
    kind = ct.INT if d.tensors[key][2] == torch.int8 else ct.FLOAT
    block = _ct_block(weights, shape, tuple(scale.shape))
    layout = _scale_layout(block, shape, scale)
    comps = {"weight": (Blocked((1, 1)), key), "weight_scale": (layout, t["weight_scale"])}
    attrs = {"block": list(block)}
    if kind == ct.INT:
        attrs["bits"] = int(weights.get("num_bits", 8))
    if asymmetric:
        comps["weight_zero_point"] = (layout, t["weight_zero_point"])
        attrs["symmetric"] = False
    return _ct_spec(d, key, kind, shape, scale.dtype, attrs, comps)


def _ct_packed(d: _Directory, key: str, t: Mapping[str, str], weights: Mapping, asymmetric: bool):
    """pack-quantized: int4 / int8 codes packed in int32 words (zero points packed along N)."""
    from safetensors import safe_open

    with safe_open(d.tensors[t["weight_shape"]][0], "pt") as f:
        shape = tuple(int(s) for s in f.get_tensor(t["weight_shape"]).tolist())
    bits = int(weights.get("num_bits", 4))
    if bits not in (4, 8) or len(shape) != 2:
        raise CheckpointFormatError(f"key {key!r}: pack-quantized {bits}-bit weights of shape {shape} are not read "
                                    f"by qdcp (2-D, 4 or 8 bits are)")
    scale = d.meta(t["weight_scale"])
    block = _ct_block(weights, shape, tuple(scale.shape))
    packed, zero, layout = t["weight_packed"], t["weight_zero_point"], _scale_layout(block, shape, scale)
    comps = {"weight": (Blocked((1, 1)), lambda get, out: unpack_int32(get(packed), bits, shape[1], out)),
             "weight_scale": (layout, t["weight_scale"])}
    attrs, built = {"block": list(block), "bits": bits}, {"weight": (shape, torch.int8)}
    if asymmetric:  # zero points packed along N, one column per group
        comps["weight_zero_point"] = (layout, lambda get, out: unpack_int32(get(zero).t(), bits, shape[0]).t())
        attrs["symmetric"], built["weight_zero_point"] = False, (tuple(scale.shape), torch.int8)
    spec, items, used = _ct_spec(d, key, ct.INT, shape, scale.dtype, attrs, comps, built=built)
    return spec, items, used | {packed, t["weight_shape"]} | ({zero} if asymmetric else set())


def _ct_block(weights: Mapping, shape, scale_shape) -> tuple[int, int]:
    n, k = shape
    strategy = weights.get("strategy")
    if strategy == "tensor" or scale_shape in ((1,), (1, 1)):
        return (n, k)
    if strategy == "channel":
        return (1, k)
    if strategy == "group":
        return (1, int(weights["group_size"]))
    if strategy == "block":
        return tuple(int(b) for b in weights["block_structure"])
    raise CheckpointFormatError(f"compressed-tensors strategy {strategy!r} is not read by qdcp")


def _scale_layout(block, shape, scale):
    return Replicated(tuple(scale.shape)) if tuple(block) == tuple(shape) else Blocked(tuple(block))


def _ct_spec(d: _Directory, key: str, type_name: str, shape, dtype, attrs, comps, built=None):
    items, specs = {}, []
    for name, (layout, source) in comps.items():
        if callable(source):
            cshape, cdtype = built[name]
            items[name] = _Item(cshape, cdtype, build=source)
        else:
            _, cshape, cdtype = d.tensors[source]
            items[name] = _Item(cshape, cdtype, tensor=source)
        specs.append(qspec.ComponentSpec(name, items[name].shape, items[name].dtype, layout.to_json()))
    spec = qspec.EntrySpec(key, qspec.RAW, type_name, tuple(shape), dtype, dict(attrs), tuple(specs))
    return spec, items, {c for _, c in comps.values() if isinstance(c, str)}
