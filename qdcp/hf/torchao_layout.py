"""torchao's own safetensors layout (``torchao.prototype.safetensors``), as transformers saves a
torchao-quantized model (docs/export_torchao.md).

An entry ``<module>.<name>`` of a torchao class is stored as its inner tensors
``<module>._<name>_<part>``, and the file's ``__metadata__`` holds, under the entry's key, the JSON
torchao's ``TensorSubclassAttributeJSONEncoder`` writes for it, plus ``tensor_names``; plain tensors
keep their key, with ``{"_type": "Tensor"}``. TransformerEngine's MXFP8 and NVFP4 entries are
written as torchao's ``MXTensor`` / ``NVFP4Tensor`` holding the same bits (through the neutral raw
forms). Reading: entries the metadata describes with a torchao class are rebuilt by torchao's
allow-listed decoder (``object_from_dict``, nothing unpickled).
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Mapping, Sequence

import torch

from qdcp.adapters.base import (
    RawInterchangeAdapter,
    StoredEntry,
    adapter_for_type,
    describe_tensor,
    find_adapter,
    find_type_adapter,
    stored_on_meta,
)
from qdcp.adapters.torchao import granularity_from_block
from qdcp.errors import CheckpointFormatError, UnsupportedTensorError
from qdcp.hf.directory import HFDirectory
from qdcp.hf.layout import (
    ComponentReader,
    EntryPlan,
    Getter,
    HFLayout,
    Item,
    Presented,
    Source,
    UnsupportedEntry,
    presented,
)
from qdcp.hf.safetensors_files import TensorOut

_SAFETENSORS = "torchao.prototype.safetensors.safetensors_utils"
_FORM_BUILDERS = ("torchao.MXTensor", "torchao.NVFP4Tensor")
PLAIN_METADATA = json.dumps({"_type": "Tensor"})


def _torchao(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UnsupportedTensorError(f"the torchao layout needs torchao 0.18+ ({module}.{name}: {e}); "
                                     f"pip install 'qdcp[torchao]'") from None


def part_name(key: str, part: str) -> str:
    """torchao's tensor name for inner tensor ``part`` of entry ``key`` (``m.weight`` -> ``m._weight_qdata``)."""
    module, name = key.rsplit(".", 1)
    return f"{module}._{name}_{part}"


def _inner(t: torch.Tensor, key: str) -> dict[str, torch.Tensor]:
    """The inner tensors torchao's flatten writes for entry ``key`` (``t``), by name: the data names
    present, optional ones first."""
    names = list(getattr(t, "optional_tensor_data_names", None) or []) + list(t.tensor_data_names)
    return {part_name(key, n): getattr(t, n) for n in names if getattr(t, n) is not None}


class TorchAOLayout(HFLayout):
    """``--format torchao``."""

    name = "torchao"

    def instance(self, stored: StoredEntry, key: str) -> torch.Tensor:
        """The torchao tensor holding ``stored``'s bits (components may live on the meta device)."""
        allowed = _torchao(_SAFETENSORS, "ALLOWED_TENSORS_SUBCLASSES")
        adapter = adapter_for_type(stored.type_name, key)
        if stored.type_name.startswith("torchao.") and stored.type_name[len("torchao."):] in allowed:
            return adapter.rebuild(stored)
        offered = adapter.raw_forms_out(stored.type_name, stored.attrs) \
            if isinstance(adapter, RawInterchangeAdapter) else {}
        builders = [b for b in map(find_type_adapter, _FORM_BUILDERS) if isinstance(b, RawInterchangeAdapter)]
        for form, names in offered.items():
            tensors = adapter.to_raw_form(stored.type_name, stored.attrs, form,
                                          {n: stored.components[n] for n in names})
            for builder in builders:
                built = builder.new_from_raw_form(form, tensors, shape=stored.shape, dtype=stored.dtype)
                if built is not None:
                    return built
        raise UnsupportedEntry(f"torchao's safetensors layout holds {', '.join(allowed)}; "
                               f"{stored.type_name} (with these attributes) is none of them and has no "
                               f"exact conversion to one.")

    def plan(self, src: Source, read: ComponentReader) -> EntryPlan:
        if "." not in src.key:
            raise UnsupportedEntry("torchao's layout names inner tensors <module>._<name>_<part>: "
                                   "a key without a module prefix has no such name")
        t = self.instance(stored_on_meta(src.spec), src.key)
        encoder = _torchao(_SAFETENSORS, "TensorSubclassAttributeJSONEncoder")
        tensors = tuple(TensorOut(n, tuple(v.shape), v.dtype) for n, v in _inner(t, src.key).items())
        return EntryPlan(src.key, tensors, {src.key: json.dumps(t, cls=encoder)}, scheme=ao_config(t))

    def plan_plain(self, key, shape, dtype, *, dequantized=False):
        plan = super().plan_plain(key, shape, dtype, dequantized=dequantized)
        if "." not in key:  # torchao's loader splits every listed name at its last "."; unlisted, it is a leftover
            return plan
        return EntryPlan(key, plan.tensors, {key: PLAIN_METADATA}, dequantized=dequantized)

    def produce(self, plan, stored):
        return _inner(self.instance(stored, plan.key), plan.key)

    def file_metadata(self, plans, directory):
        """Every file carries the whole directory's metadata, as ``save_pretrained`` writes its shards
        (transformers' loader merges them with ``dict.update``: the last ``tensor_names`` wins)."""
        out = super().file_metadata(directory, directory)
        out["tensor_names"] = json.dumps([p.key for p in directory if p.metadata])
        return out

    def quantization_config(self, plans: Sequence[EntryPlan]) -> dict | None:
        configs = {p.key.rsplit(".", 1)[0]: p.scheme for p in plans if p.scheme is not None}
        if not configs:
            return None
        config_to_dict = _torchao("torchao.core.config", "config_to_dict")
        distinct = {json.dumps(config_to_dict(c), sort_keys=True) for c in configs.values()}
        if len(distinct) == 1:
            quant_type = next(iter(configs.values()))
        else:
            quant_type = _torchao("torchao.quantization", "FqnToConfig")(configs)
        return {"quant_method": "torchao", "quant_type": {"default": config_to_dict(quant_type)},
                "modules_to_not_convert": None, "include_input_output_embeddings": False,
                "untie_embedding_weights": False}

    @classmethod
    def reads(cls, config: Mapping) -> bool:
        """Every directory: the files' metadata says which entries are torchao's (none: plain)."""
        return True

    def entries(self, directory: HFDirectory) -> list[Presented]:
        """The entries the files' metadata describes with a torchao class, once each (two files
        describing one differently are refused)."""
        described: dict[str, tuple[str, str]] = {}
        for file, meta in directory.file_metadata.items():
            for key in json.loads(meta.get("tensor_names", "[]")):
                first, desc = described.setdefault(key, (file, meta.get(key, "{}")))
                if desc != meta.get(key, "{}"):
                    raise CheckpointFormatError(f"key {key!r}: {first} and {file} describe it differently in their "
                                                f"torchao metadata; which one holds its tensors is unknown")
        return [_presented(directory, key, parsed) for key, (_, desc) in described.items()
                if (parsed := json.loads(desc)).get("_type") not in (None, "Tensor")]


def ao_config(t: torch.Tensor) -> Any:
    """The torchao config whose ``quantize_`` makes tensors configured like ``t`` (None if none does)."""
    q = importlib.import_module("torchao.quantization")
    name = type(t).__name__
    act = getattr(t, "act_quant_kwargs", None)
    if name == "Int8Tensor":
        g = granularity_from_block(t.block_size, t.shape)
        return q.Int8WeightOnlyConfig(granularity=g) if act is None else \
            q.Int8DynamicActivationInt8WeightConfig(granularity=g)
    if name == "Float8Tensor":
        if act is None:
            return q.Float8WeightOnlyConfig(weight_dtype=t.qdata.dtype)
        return q.Float8DynamicActivationFloat8WeightConfig(
            weight_dtype=t.qdata.dtype, granularity=granularity_from_block(t.block_size, t.shape))
    if name == "IntxUnpackedToInt8Tensor":  # rows are PerAxis(0) in these configs
        g = granularity_from_block(t.block_size, t.shape)
        g = q.PerAxis(0) if type(g).__name__ == "PerRow" else g
        if t.activation_quantization is None:
            return q.IntxWeightOnlyConfig(weight_dtype=t.target_dtype, granularity=g)
        return q.Int8DynamicActivationIntxWeightConfig(weight_dtype=t.target_dtype, weight_granularity=g)
    mx = importlib.import_module("torchao.prototype.mx_formats")
    if name == "MXTensor":
        return mx.MXDynamicActivationMXWeightConfig(block_size=t.block_size, weight_dtype=t.elem_dtype,
                                                    activation_dtype=t.elem_dtype)
    if name == "NVFP4Tensor":
        dynamic = t.per_tensor_scale is not None
        return mx.NVFP4WeightOnlyConfig(use_dynamic_per_tensor_scale=dynamic) if act is None else \
            mx.NVFP4DynamicActivationNVFP4WeightConfig(use_dynamic_per_tensor_scale=dynamic)
    return None


def _presented(d: HFDirectory, key: str, desc: dict) -> Presented:
    """Entry ``key`` that torchao's metadata ``desc`` describes: components read from the file
    tensors holding them as they are, the others computed from the whole entry."""
    object_from_dict = _torchao(_SAFETENSORS, "object_from_dict")
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
    comps = {}
    for name, value in adapter.components(t).items():
        if name in names and value is getattr(t, name):
            item = Item(tuple(value.shape), value.dtype, tensor=names[name])
        else:  # computed from the whole entry (e.g. a swizzled scale, unswizzled)
            def build(get: Getter, out=None, name=name) -> torch.Tensor:
                return adapter.components(instance({p: get(n) for p, n in names.items()}))[name]
            item = Item(tuple(value.shape), value.dtype, build=build)
        comps[name] = (item, layouts[name])
    return presented(key, adapter.type_name(t), t.shape, t.dtype, attrs, comps, names.values())
