"""The ``compressed-tensors`` layout (what vLLM and transformers load as ``quant_method:
"compressed-tensors"``), written from raw bits: nothing is requantized.

Per quantized ``<module>.weight``, the format and tensors of docs/export_compressed_tensors.md
(its "Mapping" and "Conventions"). Integer entries with a non-zero zero point are written
asymmetric (channel and group strategies only). Dynamic activation quantization the source states
becomes ``input_activations`` where the library has its args (:func:`input_activations`).
Reading (:meth:`CompressedTensorsLayout.entries`): each module a config group targets is one entry
of a source-only type (:mod:`qdcp.adapters.compressed_tensors`), its parameters as stored.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Mapping, Sequence

import torch

from qdcp.adapters import compressed_tensors as ct
from qdcp.adapters.base import RawInterchangeAdapter, StoredEntry, adapter_for_type, stored_on_meta
from qdcp.adapters.formats import MXFP8_FORMS, NVFP4_ROW16, nvfp4_decode_scale, parse_affine_form
from qdcp.errors import CheckpointFormatError
from qdcp.hf.directory import HFDirectory
from qdcp.hf.layout import ComponentReader, EntryPlan, HFLayout, Item, Presented, Source, UnsupportedEntry, presented
from qdcp.hf.safetensors_files import RowBlocks, TensorOut
from qdcp.layouts import Blocked, Replicated, ceil_div

CT_VERSION = "0.20.0"  # the compressed-tensors release whose layout this writes
_MXFP8 = MXFP8_FORMS[torch.float8_e4m3fn]


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One entry's compressed-tensors scheme: its format, ``weights`` and ``input_activations``
    quantization args."""

    format: str
    weights: str            #: the ``weights`` dict as canonical JSON
    inputs: str = "null"    #: the ``input_activations`` dict as canonical JSON (null: weight-only)

    def to_json(self) -> dict:
        return {"format": self.format, "input_activations": json.loads(self.inputs), "output_activations": None,
                "weights": json.loads(self.weights)}


def _args(**given) -> str:
    """compressed-tensors ``QuantizationArgs`` as canonical JSON."""
    base = {"dynamic": False, "symmetric": True, "group_size": None, "block_structure": None,
            "actorder": None, "observer": None, "observer_kwargs": {}, "scale_dtype": None, "zp_dtype": None}
    return json.dumps({**base, **given}, sort_keys=True)


_ACT_STRATEGIES = {"PerRow": "token", "PerToken": "token", "PerTensor": "tensor"}


def input_activations(attrs: Mapping) -> str:
    """The ``input_activations`` args (canonical JSON) for the dynamic activation quantization a
    torchao tensor's attributes state (FP8 E4M3 or int8 per token or tensor, MXFP8 E4M3); "null"
    (weight-only) where there is none or it has no compressed-tensors args."""
    kwargs, intx = attrs.get("act_quant_kwargs"), attrs.get("activation_quantization")
    name = type(kwargs).__name__
    strategy = _ACT_STRATEGIES.get(type(getattr(kwargs, "granularity", None)).__name__)
    if name == "QuantizeTensorToFloat8Kwargs" and kwargs.float8_dtype == torch.float8_e4m3fn and strategy:
        return _args(num_bits=8, type="float", strategy=strategy, dynamic=True)
    if name == "QuantizeTensorToInt8Kwargs" and strategy and not kwargs.reduce_range:
        return _args(num_bits=8, type="int", strategy=strategy, dynamic=True,
                     symmetric=getattr(kwargs.mapping_type, "name", "") == "SYMMETRIC")
    if intx is not None and str(getattr(intx, "value", intx)).lower() == "int8_asym_per_token":
        return _args(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=False)
    if name == "QuantizeTensorToMXKwargs" and kwargs.elem_dtype == torch.float8_e4m3fn and kwargs.block_size == 32:
        return _args(num_bits=8, type="float", strategy="group", group_size=32, dynamic=True,
                     scale_dtype="torch.uint8")
    return "null"


def pack_int32(values: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """compressed-tensors' ``pack-quantized`` int32 words: ``values + 2**(bits-1)`` (a bit flip of the
    two's complement byte or nibble), ``32 // bits`` a word along the last dim from the least
    significant bit, zero padded. ``out``: a uint8 buffer of at least the packed bytes, reused."""
    if bits not in (4, 8):
        raise ValueError(f"pack_int32: {bits}-bit integers are not written (4 and 8 are)")
    u = values.contiguous().view(torch.uint8)
    pad = -u.shape[-1] % (32 // bits)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    shape = (*u.shape[:-1], u.shape[-1] * bits // 8)
    packed = torch.empty(shape, dtype=torch.uint8) if out is None else out.reshape(-1)[: math.prod(shape)].view(shape)
    if bits == 8:
        return torch.bitwise_xor(u, 0x80, out=packed).view(torch.int32)
    torch.bitwise_left_shift(u[..., 1::2], 4, out=packed)
    packed.bitwise_or_(u[..., 0::2] & 0xF).bitwise_xor_(0x88)
    return packed.view(torch.int32)


def packed_rows(values: torch.Tensor, bits: int) -> RowBlocks:
    """:func:`pack_int32` of 2-D ``values``, made about 1 MiB of rows at a time in one reused buffer."""
    n, k = values.shape
    words = ceil_div(k, 32 // bits)
    rows = max(1, (1 << 20) // max(1, words * 4))
    buffer = torch.empty(min(rows, n) * words * 4, dtype=torch.uint8)
    return RowBlocks((n, words), torch.int32, lambda a, b: pack_int32(values[a:b], bits, buffer), rows)


def unpack_int32(words: torch.Tensor, bits: int, length: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int8 values, ``length`` along the last dim (into ``out`` where given)."""
    b = words.contiguous().view(torch.uint8)
    if bits not in (4, 8):
        raise ValueError(f"unpack_int32: {bits}-bit integers are not read (4 and 8 are)")
    shape = (*b.shape[:-1], length)
    if out is None:
        out = torch.empty(shape, dtype=torch.int8)
    u = out.view(torch.uint8)
    if bits == 8:
        torch.bitwise_xor(b[..., :length], 0x80, out=u)
        return out
    if length % 2 == 0:
        pairs = u.view(*shape[:-1], length // 2, 2)
        torch.bitwise_and(b[..., : length // 2], 0xF, out=pairs[..., 0])
        torch.bitwise_right_shift(b[..., : length // 2], 4, out=pairs[..., 1])
    else:
        u.copy_(torch.stack([b & 0xF, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)[..., :length])
    return out.sub_(8)


def strategy_of(block: tuple[int, int], shape: tuple[int, ...]) -> dict:
    """The ``weights`` args stating a scale per ``block`` of a 2-D ``shape``: ``strategy`` tensor,
    channel, group (``group_size``) or block (``block_structure``). Inverse: :func:`block_of`."""
    n, k = shape
    if block == (n, k):
        return {"strategy": "tensor"}
    if block == (1, k):
        return {"strategy": "channel"}
    if block[0] == 1:
        return {"strategy": "group", "group_size": block[1]}
    return {"strategy": "block", "block_structure": list(block)}


def block_of(weights: Mapping, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> tuple[int, int]:
    """The block of ``shape`` each scale covers, as the ``weights`` args' strategy states it (a
    single scale: the whole tensor). Inverse of :func:`strategy_of`."""
    n, k = shape
    strategy = weights.get("strategy")
    if strategy == "tensor" or tuple(scale_shape) in ((1,), (1, 1)):
        return (n, k)
    if strategy == "channel":
        return (1, k)
    if strategy == "group":
        return (1, int(weights["group_size"]))
    if strategy == "block":
        return tuple(int(b) for b in weights["block_structure"])
    raise CheckpointFormatError(f"compressed-tensors strategy {strategy!r} is not read by qdcp")


class CompressedTensorsLayout(HFLayout):
    """``--format compressed-tensors``."""

    name = "compressed-tensors"

    def _form(self, stored: StoredEntry, key: str) -> tuple[str, dict[str, torch.Tensor]]:
        adapter = adapter_for_type(stored.type_name, key)
        offered = adapter.raw_forms_out(stored.type_name, stored.attrs) \
            if isinstance(adapter, RawInterchangeAdapter) else {}
        for form, names in offered.items():
            if form in (NVFP4_ROW16, _MXFP8) or parse_affine_form(form):
                comps = {n: stored.components[n] for n in names if n in stored.components}
                return form, adapter.to_raw_form(stored.type_name, stored.attrs, form, comps)
        raise UnsupportedEntry(f"compressed-tensors holds NVFP4, MXFP8 (E4M3), FP8 E4M3 and symmetric int8 / "
                               f"int4 weights; {stored.type_name} with these attributes states none of them "
                               f"(offers {sorted(offered) or 'no raw form'})")

    def plan(self, src: Source, read: ComponentReader) -> EntryPlan:
        if len(src.shape) != 2 or not src.key.endswith(".weight"):
            raise UnsupportedEntry("compressed-tensors stores 2-D <module>.weight entries only")
        stored = stored_on_meta(src.spec)
        form, t = self._form(stored, src.key)
        if "zero_point" in t:  # symmetric or not: the zero points (small) decide, read them now
            logical = math.prod(src.shape)
            small = [c.name for c in src.spec.components if math.prod(c.shape) < logical]
            _, t = self._form(dataclasses.replace(stored, components={**stored.components, **read(small)}), src.key)
            if t["zero_point"].is_meta:
                _, t = self._form(dataclasses.replace(stored, components=read(list(stored.components))), src.key)
        if stored.components.keys() & {"act_pre_scale", "act_quant_scale"}:
            raise UnsupportedEntry("its activation pre-scale / static activation scale has no compressed-tensors "
                                   "form (the layer's output depends on it)")
        module, inputs = src.key[: -len(".weight")], input_activations(stored.attrs)
        scheme = _scheme_of(form, t, src.shape, inputs)
        tensors = _tensors(form, t, src.shape, inputs)  # on the meta device but the small zero points
        return EntryPlan(src.key, tuple(TensorOut(f"{module}.{n}", tuple(v.shape), v.dtype)
                                        for n, v in tensors.items()), scheme=scheme)

    def produce(self, plan: EntryPlan, stored: StoredEntry) -> dict[str, torch.Tensor | RowBlocks]:
        form, t = self._form(stored, plan.key)
        module = plan.key[: -len(".weight")]
        inputs = input_activations(stored.attrs)
        return {f"{module}.{n}": v for n, v in _tensors(form, t, stored.shape, inputs).items()}

    def quantization_config(self, plans: Sequence[EntryPlan]) -> dict | None:
        groups: dict[Scheme, list[str]] = {}
        for p in plans:
            if p.scheme is not None:
                groups.setdefault(p.scheme, []).append(p.key[: -len(".weight")])
        if not groups:
            return None
        config_groups = {f"group_{i}": {**scheme.to_json(), "targets": sorted(modules)}
                         for i, (scheme, modules) in enumerate(groups.items())}
        formats = {s.format for s in groups}
        fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
        return {"quant_method": "compressed-tensors", "format": fmt,
                "quantization_status": "compressed", "config_groups": config_groups, "ignore": [],
                "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {},
                "transform_config": {}, "version": CT_VERSION}

    @classmethod
    def reads(cls, config: Mapping) -> bool:
        """A directory whose config's ``quantization_config`` says ``quant_method: compressed-tensors``."""
        return _quantization_config(config) is not None

    def entries(self, directory: HFDirectory) -> list[Presented]:
        """Each module a config group targets that holds quantization parameters, as codes where
        ``quantization_status`` (else the stored dtypes) says so; codes no group reads, or dtypes
        contradicting the status, are refused."""
        d = directory
        qc = _quantization_config(d.config)  # what layout_of chose this layout by
        status = qc.get("quantization_status")
        if status is not None and status not in _STATUSES:
            raise CheckpointFormatError(f"{d.path}: compressed-tensors quantization_status {status!r} is not one "
                                        f"qdcp reads ({', '.join(_STATUSES)})")
        out, seen = [], set()
        for group in (qc.get("config_groups") or {}).values():
            fmt = group.get("format") or qc.get("format")
            weights = group.get("weights") or {}
            for module in _modules(d, group.get("targets"), qc.get("ignore")):
                if module not in seen and _compressed(d, module, status):
                    out.append(_entry(d, module, fmt, weights))
                seen.add(module)
        _refuse_unread_codes(d, set().union(*(e.consumed for e in out)), status)
        return out


def _scheme_of(form: str, t: Mapping[str, torch.Tensor], shape, inputs: str) -> Scheme:
    """The entry's scheme, its format the one the library's ``infer_module_format`` picks (raises
    :class:`UnsupportedEntry` where there is none)."""
    if form == NVFP4_ROW16:  # weight-only
        return Scheme("nvfp4-pack-quantized", _args(num_bits=4, type="float", strategy="tensor_group", group_size=16,
                                                     scale_dtype="torch.float8_e4m3fn"))
    if form == _MXFP8:
        return Scheme("mxfp8-quantized", _args(num_bits=8, type="float", strategy="group", group_size=32,
                                               scale_dtype="torch.uint8"), inputs)
    kind, block = parse_affine_form(form)
    strategy = strategy_of(block, shape)
    if kind == "float8":
        if t["data"].dtype != torch.float8_e4m3fn:
            raise UnsupportedEntry(f"compressed-tensors FP8 is E4M3; this entry holds {t['data'].dtype}")
        fmt = "naive-quantized" if inputs == "null" else "float-quantized"
        return Scheme(fmt, _args(num_bits=8, type="float", **strategy), inputs)
    bits = {"int8": 8, "int4": 4}.get(kind)
    if bits is None or strategy["strategy"] == "block":
        raise UnsupportedEntry(f"compressed-tensors packs int8 and int4 per tensor, channel or group; "
                               f"this entry is {kind} with blocks of {block}")
    zero = _zero_points(t)
    if zero is not None and inputs == "null" and strategy["strategy"] == "tensor":
        raise UnsupportedEntry("compressed-tensors packs the zero points of channel and group ints; this "
                               "entry is asymmetric per tensor")
    weights = _args(num_bits=bits, type="int", symmetric=zero is None, **strategy)
    return Scheme("pack-quantized" if inputs == "null" else "int-quantized", weights, inputs)


def _zero_points(t: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """An int entry's zero points where any is non-zero (asymmetric), else None (symmetric)."""
    zero = t.get("zero_point")
    return zero if zero is not None and bool(torch.count_nonzero(zero)) else None


def _tensors(form: str, t: Mapping[str, torch.Tensor], shape, inputs: str) -> dict[str, torch.Tensor | RowBlocks]:
    """The entry's tensors from its form, bits carried over (of meta components: what a plan lists)."""
    if form == NVFP4_ROW16:
        return {"weight_packed": t["data"], "weight_scale": t["scale"].view(torch.float8_e4m3fn),
                "weight_global_scale": (1.0 / nvfp4_decode_scale(t["amax"])).reshape(1)}
    if form == _MXFP8:
        return {"weight": t["data"].view(torch.float8_e4m3fn), "weight_scale": t["scale"].view(torch.uint8)}
    kind, block = parse_affine_form(form)
    scale = t["scale"].reshape(1) if block == tuple(shape) else t["scale"]
    if kind == "float8":
        return {"weight": t["data"], "weight_scale": scale}
    zero = _zero_points(t)
    if inputs != "null":
        out = {"weight": t["data"], "weight_scale": scale}
        if zero is not None:
            out["weight_zero_point"] = zero.reshape(scale.shape)
        return out
    bits = 8 if kind == "int8" else 4
    out = {"weight_packed": packed_rows(t["data"], bits), "weight_scale": scale,
           "weight_shape": torch.tensor(list(shape), dtype=torch.int64)}
    if zero is not None:  # packed along the output dim, as the library packs them
        out["weight_zero_point"] = pack_int32(zero.t(), bits).t().contiguous()
    return out


def _quantization_config(config: Mapping) -> dict | None:
    """The config's compressed-tensors ``quantization_config`` (or ``compression_config``), or None."""
    qc = config.get("quantization_config") or config.get("compression_config")
    return qc if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors" else None


# ----------------------------------------------------------------------------- reading a directory

def _matches(module: str, patterns) -> bool:
    """Whether a config group's ``targets`` (or ``ignore``) name ``module``."""
    for p in patterns or ():
        if p.startswith("re:"):
            if re.match(p[3:], module):
                return True
        elif p == module or p in ("Linear", "nn.Linear"):  # class targets: every quantized module
            return True
    return False


#: quantization_status values: "compressed" stores the format's codes; the others dense weights
#: (quantization parameters beside them), saved after decompression or before compression
_STATUSES = ("compressed", "decompressed", "frozen", "initialized", "calibration")
_UNPACKED = ("naive-quantized", "float-quantized", "int-quantized")
_E4M3, _INTEGERS = (torch.float8_e4m3fn,), (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
_DENSE = "a 16-bit or wider floating dtype"
#: per format, the stored dtype of each parameter (``_DENSE``: any of those), required ones first:
#: what :func:`_tensors` writes, and what others write (fp8 / e8m0 scales, wider shapes)
_READ_DTYPES = {
    "nvfp4-pack-quantized": {"weight_packed": (torch.uint8,), "weight_scale": _E4M3, "weight_global_scale": _DENSE},
    "mxfp8-quantized": {"weight": _E4M3, "weight_scale": (torch.uint8, torch.float8_e8m0fnu)},
    "naive-quantized": {"weight": _E4M3 + (torch.int8,), "weight_scale": _DENSE, "weight_zero_point": _INTEGERS},
    "float-quantized": {"weight": _E4M3, "weight_scale": _DENSE},
    "int-quantized": {"weight": (torch.int8,), "weight_scale": _DENSE, "weight_zero_point": _INTEGERS},
    "pack-quantized": {"weight_packed": (torch.int32,), "weight_scale": _DENSE, "weight_shape": _INTEGERS,
                       "weight_zero_point": (torch.int32,)},
}
_REQUIRED = {"nvfp4-pack-quantized": 3, "mxfp8-quantized": 2, "pack-quantized": 3}
_PARAMETERS = ("weight_packed", "weight_scale", "weight_global_scale", "weight_shape", "weight_zero_point")


def _allowed_dtypes(fmt: str, weights: Mapping) -> dict:
    expected = dict(_READ_DTYPES[fmt])
    if fmt == "naive-quantized" and weights.get("type") in ("float", "int"):
        expected["weight"] = _E4M3 if weights["type"] == "float" else (torch.int8,)
    return expected


def _is_dense(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize >= 2


def _modules(d: HFDirectory, targets, ignore) -> list[str]:
    """Modules holding quantization parameters (``weight_scale`` or ``weight_packed``) that
    ``targets`` name and ``ignore`` does not."""
    found = {n.rsplit(".", 1)[0] for n in d.tensors if n.endswith((".weight_scale", ".weight_packed"))}
    return sorted(m for m in found if _matches(m, targets) and not _matches(m, ignore))


def _compressed(d: HFDirectory, module: str, status: str | None) -> bool:
    """Whether ``module`` stores codes (True) or its dense weight, as ``quantization_status`` (else
    the stored dtypes) says; a status the stored dtypes contradict is refused."""
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


def _refuse_unread_codes(d: HFDirectory, consumed: set[str], status: str | None) -> None:
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


def _check_dtypes(d: HFDirectory, key: str, module: str, fmt: str, weights: Mapping) -> None:
    """Every parameter the format needs is there with the dtype its codes or scales must have."""
    for i, (part, allowed) in enumerate(_allowed_dtypes(fmt, weights).items()):
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


def _entry(d: HFDirectory, module: str, fmt: str, weights: Mapping) -> Presented:
    """One quantized module's entry, its parameters checked against what ``fmt`` stores."""
    key = f"{module}.weight"
    if fmt not in _READ_DTYPES:
        raise CheckpointFormatError(f"key {key!r}: compressed-tensors format {fmt!r} is not read by qdcp "
                                    f"({', '.join(_READ_DTYPES)} are)")
    _check_dtypes(d, key, module, fmt, weights)
    names = {part: f"{module}.{part}" for part in _PARAMETERS}
    if fmt == "nvfp4-pack-quantized":
        n, half = d.tensors[names["weight_packed"]][1]
        comps = {"weight_packed": (Blocked((1, 2)), names["weight_packed"]),
                 "weight_scale": (Blocked((1, 16)), names["weight_scale"]),
                 "weight_global_scale": (Replicated((1,)), names["weight_global_scale"])}
        return _presented(d, key, ct.NVFP4, (n, half * 2), torch.bfloat16, {}, comps)
    if fmt == "mxfp8-quantized":
        comps = {"weight": (Blocked((1, 1)), key), "weight_scale": (Blocked((1, 32)), names["weight_scale"])}
        return _presented(d, key, ct.MXFP8, d.tensors[key][1], torch.bfloat16, {}, comps)
    asymmetric = not weights.get("symmetric", True) or names["weight_zero_point"] in d.tensors
    is_int = weights.get("type") == "int" or (key in d.tensors and d.tensors[key][2] == torch.int8)
    if asymmetric and not (is_int and (fmt in _UNPACKED or weights.get("strategy") in ("channel", "group"))):
        raise CheckpointFormatError(f"key {key!r}: asymmetric compressed-tensors weights are read as integers "
                                    f"(packed per channel or group, or unpacked); this is {fmt}, "
                                    f"{weights.get('type')} {weights.get('strategy')}")
    if asymmetric and names["weight_zero_point"] not in d.tensors:
        raise CheckpointFormatError(f"key {key!r}: an asymmetric scheme without {names['weight_zero_point']!r}")
    return _codes(d, key, names, weights, asymmetric, packed=fmt not in _UNPACKED)


def _codes(d: HFDirectory, key: str, names: Mapping[str, str], weights: Mapping, asymmetric: bool,
           packed: bool) -> Presented:
    """naive / float / int-quantized: the codes stored as they are (FP8 E4M3 or int8);
    pack-quantized: int4 / int8 codes packed in int32 words (zero points packed along N)."""
    if packed:
        shape = tuple(int(s) for s in d.tensor(names["weight_shape"]).tolist())
        kind, bits = ct.INT, int(weights.get("num_bits", 4))
        if bits not in (4, 8) or len(shape) != 2:
            raise CheckpointFormatError(f"key {key!r}: pack-quantized {bits}-bit weights of shape {shape} are not "
                                        f"read by qdcp (2-D, 4 or 8 bits are)")
    else:
        shape, bits = d.tensors[key][1], int(weights.get("num_bits", 8))
        kind = ct.INT if d.tensors[key][2] == torch.int8 else ct.FLOAT
    scale = d.meta(names["weight_scale"])
    block = block_of(weights, shape, tuple(scale.shape))
    layout = Replicated(tuple(scale.shape)) if tuple(block) == tuple(shape) else Blocked(tuple(block))
    comps = {"weight": (Blocked((1, 1)), key), "weight_scale": (layout, names["weight_scale"])}
    attrs = {"block": list(block), **({"bits": bits} if kind == ct.INT else {})}
    if asymmetric:
        comps["weight_zero_point"] = (layout, names["weight_zero_point"])
        attrs["symmetric"] = False
    if not packed:
        return _presented(d, key, kind, shape, scale.dtype, attrs, comps)
    word, zero = names["weight_packed"], names["weight_zero_point"]

    def codes(get, out):
        return unpack_int32(get(word), bits, shape[1], out)

    def zeros(get, out):  # packed along N, one column per group
        return unpack_int32(get(zero).t(), bits, shape[0]).t()

    _check_packed(d, key, word, (shape[0], ceil_div(shape[1], 32 // bits)), bits, shape)
    comps["weight"] = (Blocked((1, 1)), Item(shape, torch.int8, build=codes))
    if asymmetric:
        _check_packed(d, key, zero, (ceil_div(shape[0], 32 // bits), scale.shape[-1]), bits, tuple(scale.shape))
        comps["weight_zero_point"] = (layout, Item(tuple(scale.shape), torch.int8, build=zeros))
    used = {word, names["weight_shape"]} | ({zero} if asymmetric else set())
    return _presented(d, key, ct.INT, shape, scale.dtype, attrs, comps, used)


def _check_packed(d: HFDirectory, key: str, name: str, want: tuple[int, int], bits: int, of) -> None:
    """Refuse a packed tensor whose shape is not what ``bits``-bit codes of ``of`` pack into."""
    got = d.meta(name)
    if tuple(got.shape) != tuple(want) or got.dtype != torch.int32:
        raise CheckpointFormatError(
            f"key {key!r}: {name.rsplit('.', 1)[1]} is {tuple(got.shape)} {got.dtype}, but {bits}-bit codes of "
            f"{tuple(of)} pack into {tuple(want)} int32 words: the directory's config (num_bits) and its tensors "
            f"disagree")


def _presented(d: HFDirectory, key: str, type_name: str, shape, dtype, attrs, comps, used=()) -> Presented:
    """The entry from ``{component: (layout, file tensor name | built Item)}``; ``used``: file
    tensors consumed besides those named."""
    named = {c for _, c in comps.values() if isinstance(c, str)}
    items = {n: (Item(*d.tensors[c][1:], tensor=c) if isinstance(c, str) else c, layout)
             for n, (layout, c) in comps.items()}
    return presented(key, type_name, shape, dtype, attrs, items, named | set(used))
