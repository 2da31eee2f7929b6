"""Adapter for TransformerEngine's grouped tensors (TE 2.20): ``GroupedTensor`` / ``GroupedTensorStorage``.

TE packs the members of a group (MoE experts) into one flat 1-D buffer per kind (rowwise data,
columnwise data, scales, amaxes), each member's scale region padded on its own. qdcp stores a group
*by member*, in the canonical form of the single-tensor TE adapters (:mod:`qdcp.adapters.transformer_engine`),
and never imports TE. Two stored layouts (docs/adapters.md, *TE GroupedTensor*):

- **stacked** (all members share one 2-D shape ``(M, N)``; logical shape ``[n, M, N]``): each member
  component of shape ``s`` and block ``b`` is stored as ``[n, *s]``, ``Blocked((1, *b))``; per-member
  scalars as ``[n, 1, 1]``, ``Blocked((1, 0, 0))``. Member ``i`` is the logical chunk ``[i:i+1]``, so
  any expert-parallel split of dim 0 maps to whole component chunks.
- **members** (varying first and/or last dims; logical shape TE's 2-D ``logical_shape``): member
  ``i``'s components as ``m{i}.C``, replicated (the group loads whole).
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Mapping

import torch

from qdcp.adapters import transformer_engine as qte
from qdcp.adapters.base import Adapter, GroupAdapter, RawInterchangeAdapter, StoredEntry, refuse_unknown
from qdcp.errors import LoadMismatchError, UnsupportedTensorError
from qdcp.layouts import Blocked, Chunk, Layout, Replicated

TYPE_NAME = "transformer_engine.GroupedTensor"
_GROUPED_MODULE = "transformer_engine.pytorch.tensor.grouped_tensor"

# recipe name -> single-tensor adapter of its members (both Float8 recipes give Float8Tensor members)
_FLOAT8 = qte.TEFloat8TensorAdapter()
_SINGLE: dict[str, qte.TEAdapter] = {"mxfp8": qte.TEMXFP8TensorAdapter(), "delayed": _FLOAT8, "current": _FLOAT8,
                                     "blockwise": qte.TEFloat8BlockwiseQTensorAdapter(),
                                     "nvfp4": qte.TENVFP4TensorAdapter()}

# Per-group Float8 buffers that no member references, by recipe (stored beside the members).
_GROUP_EXTRAS = {"delayed": ("amax",), "current": ("amax", "scale")}

# recipe name -> the predicate of TE's Recipe that is true for it
_RECIPE_TESTS = {"mxfp8": "mxfp8", "delayed": "delayed", "current": "float8_current_scaling",
                 "blockwise": "float8_block_scaling", "nvfp4": "nvfp4"}


def _recipe(g) -> str:
    if g.quantizer is None:
        return "none"
    r = g.quantizer._get_compatible_recipe()
    found = next((name for name, test in _RECIPE_TESTS.items() if getattr(r, test)()), None)
    if found is None:
        raise UnsupportedTensorError(f"GroupedTensor with an unknown TE recipe {type(r).__name__}")
    return found


def _member_key(i: int, name: str) -> str:
    return f"m{i}.{name}"


def _stack(views: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """``torch.stack(views)``; as a strided view (no copy, bool True) when the views are evenly
    spaced slices of one storage, as TE's member views of a flat buffer are."""
    v0 = views[0]
    same = all(v.dtype == v0.dtype and v.shape == v0.shape and v.stride() == v0.stride()
               and v.untyped_storage().data_ptr() == v0.untyped_storage().data_ptr() for v in views)
    if same:
        step = views[1].storage_offset() - v0.storage_offset() if len(views) > 1 else v0.numel()
        if step >= v0.numel() and all(v.storage_offset() == v0.storage_offset() + i * step
                                      for i, v in enumerate(views)):
            return torch.as_strided(v0, (len(views), *v0.shape), (step, *v0.stride()),
                                    v0.storage_offset()), True
    return torch.stack(views), False


def grouped_tensor_view(storage):
    """A ``GroupedTensor`` sharing every buffer of a ``GroupedTensorStorage`` (put it in a state dict:
    loading into it fills the storage in place). Needs TE imported (it is, if ``storage`` exists)."""
    mod = sys.modules.get(_GROUPED_MODULE)
    if mod is None:
        raise UnsupportedTensorError("transformer_engine.pytorch.tensor.grouped_tensor is not imported")
    if isinstance(storage, mod.GroupedTensor):
        return storage
    return _clone_with(storage, mod.GroupedTensor, _buffers(storage))


_BUFFER_NAMES = ("rowwise_data", "columnwise_data", "scale_inv", "columnwise_scale_inv", "amax",
                 "columnwise_amax", "scale", "first_dims", "last_dims", "tensor_offsets")


def _buffers(g) -> dict[str, torch.Tensor]:
    """The group's flat buffers (TE's ``get_data_tensors``); a buffer shared by two fields once."""
    # FP8 current scaling: one scale_inv for both directions
    return {name: b for name in _BUFFER_NAMES if (b := getattr(g, name)) is not None
            and not (name == "columnwise_scale_inv" and b is g.scale_inv)}


def _clone_with(g, cls, buffers: Mapping[str, torch.Tensor]):
    """A new ``cls`` group with ``g``'s metadata over ``buffers`` (same keys as :func:`_buffers`)."""
    kw = {name: buffers.get(name) for name in _BUFFER_NAMES}
    if g.columnwise_scale_inv is not None and g.columnwise_scale_inv is g.scale_inv:
        kw["columnwise_scale_inv"] = kw["scale_inv"]  # one buffer for both directions, as in g
    kw["data"] = kw.pop("rowwise_data")
    extra = {"requires_grad": g.requires_grad} if isinstance(g, torch.Tensor) and cls is type(g) else {}
    new = cls(g.logical_shape, g.fake_dtype, num_tensors=g.num_tensors,
              shapes=list(g.tensor_shapes) if g.tensor_shapes is not None else None,
              quantizer=g.quantizer, offsets=list(g.offsets) if g.offsets is not None else None,
              scale_inv_offsets=g.scale_inv_offsets, columnwise_scale_inv_offsets=g.columnwise_scale_inv_offsets,
              with_gemm_swizzled_scales=g._with_gemm_swizzled_scales, row_scaled_nvfp4=g.row_scaled_nvfp4,
              nvfp4_use_4over6=g.nvfp4_use_4over6, nvfp4_e4m3_max=g.nvfp4_e4m3_max, **kw, **extra)
    if g.quantized_tensors is not None:
        new.quantized_tensors = new.split_into_quantized_tensors()
    return new


class TEGroupedTensorAdapter(Adapter, GroupAdapter, RawInterchangeAdapter):
    """TE ``GroupedTensor`` and ``GroupedTensorStorage``, stored by member (see module docstring)."""

    type_names = (TYPE_NAME,)
    # members keyed <key><i> (GroupAdapter.member_key's default), as TE GroupedLinear names them

    def matches(self, cls):
        return qte.is_te_class(cls, ("GroupedTensor", "GroupedTensorStorage"))

    # ------------------------------------------------------------------ members
    def members(self, t) -> list:
        """Member views into the flat buffers, always as tensor classes (``quantizer.internal``
        would give storage classes); loading into them fills ``t`` in place."""
        if t.quantizer is not None and getattr(t.quantizer, "internal", False):
            g = t.copy()
            g.quantizer = copy.copy(t.quantizer)
            g.quantizer.internal = False
            return g.split_into_quantized_tensors()
        return t.split_into_quantized_tensors()

    @staticmethod
    def _shapes(t) -> list[tuple[int, ...]]:
        if t.tensor_shapes is not None:
            return [tuple(int(x) for x in s) for s in t.tensor_shapes]
        return [tuple(m.shape) for m in t.split_into_quantized_tensors()]

    @staticmethod
    def _stacked(t, shapes) -> bool:
        return t.first_dims is None and t.last_dims is None and len(shapes[0]) == 2 \
            and all(s == shapes[0] for s in shapes)

    def _logical_shape(self, t) -> tuple[int, ...]:
        """``t``'s shape; for a ``GroupedTensorStorage`` the shape its ``GroupedTensor`` would have."""
        if isinstance(t, torch.Tensor):
            return tuple(t.shape)
        shapes = self._shapes(t)
        if self._stacked(t, shapes):
            return (t.num_tensors, *shapes[0])
        if all(s == shapes[0] for s in shapes) and len(shapes[0]) == 1:
            return (t.num_tensors, shapes[0][0])
        return tuple(t.logical_shape)

    # ------------------------------------------------------------------ description
    def attributes(self, t):
        recipe = _recipe(t)
        shapes = self._shapes(t)
        stacked = self._stacked(t, shapes)
        attrs: dict[str, Any] = {"recipe": recipe, "layout": "stacked" if stacked else "members",
                                 "uniform_first_dim": t.first_dims is None,
                                 "uniform_last_dim": t.last_dims is None,
                                 "swizzled": bool(t._with_gemm_swizzled_scales)}
        if stacked:
            attrs["member_shape"] = list(shapes[0])
        else:
            attrs["num_tensors"] = int(t.num_tensors)
            attrs["member_shapes"] = [list(s) for s in shapes]
            attrs["logical_shape"] = list(self._logical_shape(t))
        if recipe != "none":
            attrs["member"] = _SINGLE[recipe].attributes(self.members(t)[0])
        return attrs

    def component_names(self, t):
        return list(self.layouts(t))

    def _group(self, t):
        """``t``'s recipe, members, member shapes and the group-only buffers (:data:`_GROUP_EXTRAS`) it holds."""
        recipe = _recipe(t)
        extras = [n for n in _GROUP_EXTRAS.get(recipe, ()) if getattr(t, n) is not None]
        return recipe, self.members(t), self._shapes(t), extras

    def layouts(self, t):
        recipe, members, shapes, extras = self._group(t)
        out: dict[str, Layout] = {}
        if self._stacked(t, shapes):
            first = members[0]
            for name, lay in ({"data": Blocked((1,) * first.ndim)} if recipe == "none"
                              else _SINGLE[recipe].layouts(first)).items():
                out[name] = Blocked((1, *lay.block)) if isinstance(lay, Blocked) else Blocked((1, 0, 0))
            return out | dict.fromkeys(extras, Blocked((1, 0, 0)))
        if recipe == "none" and all(len(s) == 1 and s == shapes[0] for s in shapes):
            return {"data": Blocked((1, 1))}  # 1-D members: [n, L]
        per = [self._member_parts(recipe, m) for m in members]
        return {k: Replicated(tuple(v.shape)) for k, v in _by_member(t, per, extras).items()}

    # ------------------------------------------------------------------ components
    @staticmethod
    def _member_parts(recipe, member, native: bool = False) -> dict[str, torch.Tensor]:
        """A member's canonical components (``native``: those its buffers hold as they are)."""
        if recipe == "none":
            return {"data": member}
        return _SINGLE[recipe].native_components(member) if native else _SINGLE[recipe].components(member)

    def _collect(self, t, native: bool) -> dict[str, torch.Tensor]:
        recipe, members, shapes, extras = self._group(t)
        per = [self._member_parts(recipe, m, native) for m in members]
        if not (self._stacked(t, shapes) or (recipe == "none" and len(shapes[0]) == 1)):
            return _by_member(t, per, extras)
        out: dict[str, torch.Tensor] = {}
        for name in per[0]:
            views = [p[name] for p in per]
            if views[0].ndim < len(shapes[0]):  # per-member scalar (1,) -> (1, 1)
                views = [v.reshape(1, 1) for v in views]
            stacked, is_view = _stack(views)
            if is_view or not native:
                out[name] = stacked
        return out | {name: getattr(t, name).view(-1, 1, 1) for name in extras}

    def components(self, t):
        return self._collect(t, native=False)

    def native_components(self, t):
        out = self._collect(t, native=True)
        if _recipe(t) == "delayed" and t.columnwise_scale_inv is not None and t.scale_inv is not None:
            # copy_into also fills the separate columnwise scale_inv
            out = {k: v for k, v in out.items() if k != "scale_inv" and not k.endswith(".scale_inv")}
        return out

    def copy_into(self, target, components):
        recipe = _recipe(target)
        names = set(self.component_names(target))
        refuse_unknown("GroupedTensor", components, names)
        members = self.members(target)
        stacked = self._stacked(target, self._shapes(target)) or (recipe == "none" and "data" in names)
        per: list[dict[str, torch.Tensor]] = [{} for _ in members]
        for name, value in components.items():
            if name in _GROUP_EXTRAS.get(recipe, ()):
                getattr(target, name).copy_(value.reshape(-1))
            elif stacked:
                for i in range(len(members)):
                    per[i][name] = value[i]
            else:
                i, comp = name[1:].split(".", 1)
                per[int(i)][comp] = value
        for member, comps in zip(members, per):
            if not comps:
                continue
            if recipe == "none":
                with torch.no_grad():
                    member.copy_(comps["data"].reshape(member.shape))
            else:
                _SINGLE[recipe].copy_into(member, comps)
        if any(n == "scale_inv" or n.endswith(".scale_inv") for n in components):
            self.members_loaded(target)

    def members_loaded(self, t) -> None:
        """Delayed scaling keeps a second (n,) columnwise ``scale_inv`` equal to the rowwise one,
        which members do not reference when rowwise data exists: copy it over."""
        csi, si = t.columnwise_scale_inv, t.scale_inv
        if csi is not None and si is not None and csi is not si and _recipe(t) == "delayed":
            csi.copy_(si)

    # ------------------------------------------------------------------ stager / offload
    def inner_buffers(self, t):
        return _buffers(t)

    def from_inner_buffers(self, t, buffers):
        expected = set(_buffers(t))
        if set(buffers) != expected:
            raise LoadMismatchError(f"GroupedTensor: expected buffers {sorted(expected)}, got {sorted(buffers)}")
        return _clone_with(t, type(t), buffers)

    # ------------------------------------------------------------------ values
    def dequantize(self, t, dtype=None):
        return self._dequantize(self.attributes(t), self._logical_shape(t), dtype or t.fake_dtype,
                                self.components(t))

    dequantize_stored = qte.TEAdapter.dequantize_stored  # each member's plain-torch math: needs no TE

    def _dequantize(self, attrs, shape, dtype, comps) -> torch.Tensor:
        recipe = attrs["recipe"]
        single = _SINGLE.get(recipe)
        extras = _GROUP_EXTRAS.get(recipe, ())

        def one(member_comps, member_shape):
            if recipe == "none":
                return member_comps["data"].to(dtype)
            return single.dequantize_stored(
                StoredEntry(single.type_names[0], attrs["member"], tuple(member_shape), dtype, member_comps), dtype)

        if attrs["layout"] == "stacked" or (recipe == "none" and "member_shapes" not in attrs):
            n = shape[0]
            if n == 0:
                return torch.empty(shape, dtype=dtype)
            mshape = tuple(attrs.get("member_shape", shape[1:]))
            outs = [one({k: v[i] for k, v in comps.items() if k not in extras}, mshape) for i in range(n)]
            return torch.stack(outs).reshape(shape)
        logical = tuple(attrs["logical_shape"])
        if tuple(shape) != logical:
            raise UnsupportedTensorError(
                f"a GroupedTensor with varying member shapes loads whole (logical shape {logical}), "
                f"not a chunk of shape {tuple(shape)}")
        outs = []
        for i, ms in enumerate(attrs["member_shapes"]):
            prefix = f"m{i}."
            outs.append(one({k[len(prefix):]: v for k, v in comps.items() if k.startswith(prefix)}, ms))
        if not attrs["uniform_first_dim"] and not attrs["uniform_last_dim"]:
            return torch.cat([o.reshape(-1) for o in outs]).reshape(logical)
        if not attrs["uniform_last_dim"]:
            return torch.cat(outs, dim=1)
        return torch.cat(outs, dim=0).reshape(logical)

    def rebuild(self, stored):
        raise UnsupportedTensorError(
            "a TransformerEngine GroupedTensor cannot be rebuilt from a checkpoint alone: it needs TE "
            "quantizers of its recipe, which a checkpoint does not carry. Load it into a GroupedTensor "
            "(dcp.load with QuantizedLoadPlanner), or read its values: qdcp.read_entry(path, key, "
            "dequantize=True).")

    def quantize_unsupported(self, target):
        return ("qdcp does not quantize into a TransformerEngine GroupedTensor (that needs TE's CUDA "
                "quantize kernels, which qdcp does not drive); only raw loads of the same recipe and "
                "member format fill one. Load into a plain tensor and quantize it with TE's quantizer.")

    quantize_like = qte.TEAdapter.quantize_like  # raises what quantize_unsupported says

    # ------------------------------------------------------------------ members <-> group
    def member_chunk(self, attrs: Mapping[str, Any], shape, index: int) -> Chunk | None:
        """Logical chunk of member ``index`` in a stored group of logical ``shape`` (stacked only)."""
        if attrs.get("layout") != "stacked" or not 0 <= index < shape[0]:
            return None
        return (index,) + (0,) * (len(shape) - 1), (1,) + tuple(shape[1:])

    def raw_load_sources(self, target, source_type, source_attrs):
        if source_type != TYPE_NAME:
            return None
        recipe = source_attrs.get("recipe")
        if self.matches(type(target)):  # group -> group of another swizzle / Float8 recipe
            t_attrs = self.attributes(target)
            if not _compatible(t_attrs, source_attrs):
                return None
            extras = set(_GROUP_EXTRAS.get(recipe, ())) & set(_GROUP_EXTRAS.get(t_attrs["recipe"], ()))
            return [n for n in self.component_names(target)
                    if n not in _GROUP_EXTRAS.get(t_attrs["recipe"], ()) or n in extras]
        # one member of a stacked group -> a single TE tensor (per-member keys weight0..n-1)
        single = next((a for a in _SINGLE.values() if a.matches(type(target))
                       and type(target).__name__ == a.cls_name), None)
        if single is None or source_attrs.get("layout") != "stacked" or _SINGLE.get(recipe) is not single:
            return None  # not a stacked group of this format's members
        if target.ndim != len(source_attrs["member_shape"]):  # the planner matched the shapes
            return None
        if single.attributes(target) != source_attrs.get("member"):
            return None
        return single.component_names(target)

    def raw_load(self, target, source_type, source_attrs, components):
        if self.matches(type(target)):
            self.copy_into(target, components)
            return
        single = next(a for a in _SINGLE.values() if a.matches(type(target)))
        comps = {}
        for name, value in components.items():
            if value.shape[0] != 1:
                raise LoadMismatchError(f"a single tensor takes one member of a group, got {value.shape[0]}")
            comps[name] = value[0]
        single.copy_into(target, comps)


def _by_member(g, per: list[dict[str, torch.Tensor]], extras: list[str]) -> dict[str, torch.Tensor]:
    """The *members* layout: member ``i``'s components as ``m{i}.C``, then the group's ``extras``."""
    out = {_member_key(i, name): value for i, p in enumerate(per) for name, value in p.items()}
    return out | {name: getattr(g, name) for name in extras}


def _compatible(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Same member bits in another native layout (GEMM swizzle, delayed vs current Float8)."""
    fam = {"delayed": "float8", "current": "float8"}
    keys = set(a) | set(b)
    for k in keys - {"swizzled", "recipe"}:
        if a.get(k) != b.get(k):
            return False
    return fam.get(a["recipe"], a["recipe"]) == fam.get(b["recipe"], b["recipe"])


def builtin_adapters() -> list[Adapter]:
    return [TEGroupedTensorAdapter()]
