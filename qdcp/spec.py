"""The on-disk description of quantized entries (format version 1; see docs/format.md).

A checkpoint written by :class:`qdcp.QuantizedSavePlanner` carries one JSON document in
``Metadata.planner_data["__qdcp__"]``. It maps each quantized state-dict key to an
:class:`EntrySpec`. This module is the only place that turns that JSON into Python objects, and it
never imports a module or builds an object named by the file: types are strings looked up later in
qdcp's adapter registry, attribute values are plain JSON plus the few tagged forms listed in
:func:`encode_value`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import json
import math
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from qdcp.errors import AlignmentError, CheckpointFormatError
from qdcp.layouts import layout_from_json

FORMAT_NAME = "qdcp"
FORMAT_VERSION = 1
PLANNER_DATA_KEY = "__qdcp__"
COMPONENT_SEPARATOR = ".__qdcp__."

RAW = "raw"
DEQUANTIZED = "dequantized"

# Hard limits a reader enforces before trusting any number in a spec.
MAX_SPEC_BYTES = 256 * 1024 * 1024
MAX_DIMS = 16
MAX_DIM_SIZE = 2**48
MAX_NAME_LEN = 4096

_DTYPES: dict[str, torch.dtype] = {  # the dtypes a spec may name (those this torch has)
    name: getattr(torch, name) for name in (
        "float64 float32 float16 bfloat16 float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu "
        "float4_e2m1fn_x2 int64 int32 int16 int8 uint8 uint16 uint32 uint64 bool int1 int2 int3 int4 int5 int6 "
        "int7 uint1 uint2 uint3 uint4 uint5 uint6 uint7").split()
    if isinstance(getattr(torch, name, None), torch.dtype)
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


def component_fqn(fqn: str, component: str) -> str:
    """The DCP item name under which component ``component`` of entry ``fqn`` is stored."""
    return f"{fqn}{COMPONENT_SEPARATOR}{component}"


def split_item(item_fqn: str) -> tuple[str, str | None]:
    """``(entry key, component)`` of a stored item's name (component None: a plain item)."""
    key, sep, comp = item_fqn.rpartition(COMPONENT_SEPARATOR)
    return (key, comp) if sep else (item_fqn, None)


def describe_item(item_fqn: str) -> str:
    """How errors name a stored item: ``key 'w' (component 'qdata')``, or ``key 'w'``."""
    key, comp = split_item(item_fqn)
    return f"key {key!r}" if comp is None else f"key {key!r} (component {comp!r})"


@contextlib.contextmanager
def no_gc():
    """No cyclic GC passes inside: parsing and planning make many small objects, and a pass over a
    model's live objects every few hundred of them made both 2-4x slower."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise CheckpointFormatError(f"dtype {dtype} cannot be recorded in a qdcp spec") from None


def str_to_dtype(name: str, where: str = "") -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; unknown names raise :class:`CheckpointFormatError`."""
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointFormatError(f"{where}unknown dtype {name!r} in the qdcp spec")
    return _DTYPES[name]


# ----------------------------------------------------------------------------- attribute values

def encode_value(value: Any) -> Any:
    """Encode an adapter attribute as JSON.

    Allowed: None, bool, int, finite float, str, list, dict with str keys, and these tagged forms:
    ``{"tuple": [...]}``, ``{"dtype": "bfloat16"}``, ``{"enum": "ClassName", "value": v}`` and
    ``{"object": "ClassName", "fields": {...}}`` (dataclasses and NamedTuples). Decoding a tagged
    enum or object needs the adapter to name the class in its allowlist.
    """
    if isinstance(value, enum.Enum):  # before str: str-valued enums are common
        return {"enum": type(value).__name__, "value": encode_value(value.value)}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return {"float": repr(value)}
        return value
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_to_str(value)}
    if isinstance(value, torch.Size):
        return {"tuple": [int(v) for v in value]}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # NamedTuple
        return {"object": type(value).__name__,
                "fields": {f: encode_value(getattr(value, f)) for f in value._fields}}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"object": type(value).__name__,
                "fields": {f.name: encode_value(getattr(value, f.name))
                           for f in dataclasses.fields(value)}}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        if len(value) == 1 and next(iter(value)) in ("tuple", "dtype", "float"):
            raise TypeError(f"dict {value!r} collides with a qdcp tag")
        if set(value) in ({"enum", "value"}, {"object", "fields"}):
            raise TypeError(f"dict {value!r} collides with a qdcp tag")
        return {k: encode_value(v) for k, v in value.items()}
    raise TypeError(f"value of type {type(value).__name__} cannot be stored in a qdcp spec")


def same_attrs(a: Any, b: Any) -> bool:
    """Whether two encoded attribute values configure the same: equal, with a tuple and a list of
    the same items alike (JSON layouts such as torchao's keep no tuples)."""
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            if set(v) == {"tuple"}:
                return plain(v["tuple"])
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, list):
            return [plain(x) for x in v]
        return v
    return a == b or plain(a) == plain(b)


def decode_value(data: Any, classes: Mapping[str, type] = {}, where: str = "") -> Any:
    """Inverse of :func:`encode_value`; ``classes`` is the adapter's allowlist of enums and records."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode_value(v, classes, where) for v in data]
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{where}bad attribute value {data!r}")
    keys = set(data)
    if keys == {"tuple"} and isinstance(data["tuple"], list):
        return tuple(decode_value(v, classes, where) for v in data["tuple"])
    if keys == {"dtype"}:
        return str_to_dtype(data["dtype"], where)
    if keys == {"float"} and data["float"] in ("inf", "-inf", "nan"):
        return float(data["float"])
    if keys == {"enum", "value"}:
        cls = classes.get(data["enum"]) if isinstance(data["enum"], str) else None
        if cls is None or not issubclass(cls, enum.Enum):
            raise CheckpointFormatError(f"{where}enum {data['enum']!r} is not allowed in this spec")
        try:
            return cls(decode_value(data["value"], classes, where))
        except ValueError:
            raise CheckpointFormatError(f"{where}bad value {data['value']!r} for {cls.__name__}") from None
    if keys == {"object", "fields"} and isinstance(data["fields"], dict):
        cls = classes.get(data["object"]) if isinstance(data["object"], str) else None
        if cls is None or issubclass(cls, enum.Enum):
            raise CheckpointFormatError(f"{where}object type {data['object']!r} is not allowed in this spec")
        fields = {str(k): decode_value(v, classes, where) for k, v in data["fields"].items()}
        try:
            return cls(**fields)
        except TypeError as e:
            raise CheckpointFormatError(f"{where}bad fields for {cls.__name__}: {e}") from None
    return {str(k): decode_value(v, classes, where) for k, v in data.items()}


# ----------------------------------------------------------------------------- entry specs

@dataclasses.dataclass(frozen=True)
class ComponentSpec:
    """One inner buffer of a raw entry: global shape and dtype, and how it shards (its layout)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: dict  # see qdcp.layouts.layout_from_json

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": dtype_to_str(self.dtype),
                "layout": self.layout}


@dataclasses.dataclass(frozen=True)
class EntrySpec:
    """How one quantized state-dict entry is stored.

    ``storage`` is ``"raw"`` (components stored as separate items named by :func:`component_fqn`) or
    ``"dequantized"`` (one plain tensor under the entry's own key, of ``shape`` and ``stored_dtype``).
    ``type`` is the registry name of the adapter that wrote it (e.g. ``"torchao.Int8Tensor"``);
    ``attrs`` is its JSON-encoded configuration; ``info`` holds descriptive facts (recipe, native
    scale layout...) that ``qdcp inspect`` shows and loads never compare.
    """

    fqn: str
    storage: str
    type: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    attrs: dict
    components: tuple[ComponentSpec, ...] = ()
    stored_dtype: torch.dtype | None = None
    info: dict = dataclasses.field(default_factory=dict)
    #: everything but the key, as parsed (entries of one model's layers share it); "" when built in code
    structure: str = dataclasses.field(default="", compare=False, repr=False)

    def component(self, name: str) -> ComponentSpec:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_json(self) -> dict:
        out = {"storage": self.storage, "type": self.type, "shape": list(self.shape),
               "dtype": dtype_to_str(self.dtype), "attrs": self.attrs}
        if self.storage == RAW:
            out["components"] = [c.to_json() for c in self.components]
        else:
            out["stored_dtype"] = dtype_to_str(self.stored_dtype or self.dtype)
        if self.info:
            out["info"] = self.info
        return out


def _shape(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or len(value) > MAX_DIMS:
        raise CheckpointFormatError(f"{where}shape must be a list of at most {MAX_DIMS} sizes, got {value!r}")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > MAX_DIM_SIZE:
            raise CheckpointFormatError(f"{where}bad size {v!r} in shape {value!r}")
    return tuple(value)


def _str(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_LEN:
        raise CheckpointFormatError(f"{where}{what} must be a non-empty string, got {value!r}")
    return value


def entry_from_json(fqn: str, data: Any) -> EntrySpec:
    """Parse and check one entry; every malformed field raises :class:`CheckpointFormatError`."""
    structure = repr(data)  # a model's layers share everything but their keys: parse each kind once
    template = _parsed_entries.get(structure)
    if template is None:
        template = _entry_from_json(fqn, data)
        if len(_parsed_entries) < 4096:
            _parsed_entries[structure] = template
    return dataclasses.replace(template, fqn=fqn, structure=structure)


_parsed_entries: dict[str, EntrySpec] = {}


def _entry_from_json(fqn: str, data: Any) -> EntrySpec:
    where = f"key {fqn!r}: "
    if not isinstance(data, dict):
        raise CheckpointFormatError(f"{where}entry spec must be an object")
    storage = data.get("storage")
    if storage not in (RAW, DEQUANTIZED):
        raise CheckpointFormatError(f"{where}storage must be 'raw' or 'dequantized', got {storage!r}")
    type_name = _str(data.get("type"), where, "type")
    shape = _shape(data.get("shape"), where)
    dtype = str_to_dtype(data.get("dtype"), where)
    attrs = data.get("attrs", {})
    if not isinstance(attrs, dict):
        raise CheckpointFormatError(f"{where}attrs must be an object")
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise CheckpointFormatError(f"{where}info must be an object")
    if storage == DEQUANTIZED:
        stored = str_to_dtype(data.get("stored_dtype", data.get("dtype")), where)
        return EntrySpec(fqn, storage, type_name, shape, dtype, attrs, (), stored, info)
    comps_json = data.get("components")
    if not isinstance(comps_json, list) or not comps_json:
        raise CheckpointFormatError(f"{where}a raw entry needs a non-empty components list")
    comps = _components_from_json(comps_json, where)
    return EntrySpec(fqn, storage, type_name, shape, dtype, attrs, comps, None, info)


def _components_from_json(comps_json: list, where: str) -> tuple[ComponentSpec, ...]:
    comps, seen = [], set()
    for c in comps_json:
        if not isinstance(c, dict):
            raise CheckpointFormatError(f"{where}component spec must be an object")
        name = _str(c.get("name"), where, "component name")
        if name in seen:
            raise CheckpointFormatError(f"{where}duplicate component {name!r}")
        seen.add(name)
        layout = c.get("layout")
        if not isinstance(layout, dict):
            raise CheckpointFormatError(f"{where}component {name!r} has no layout")
        comp_shape = _shape(c.get("shape"), f"{where}component {name!r}: ")
        try:
            layout_from_json(layout, comp_shape)
        except CheckpointFormatError as e:
            raise CheckpointFormatError(f"{where}component {name!r}: {e}") from None
        comps.append(ComponentSpec(name, comp_shape, str_to_dtype(c.get("dtype"), where), layout))
    return tuple(comps)


def dumps(entries: Mapping[str, EntrySpec]) -> str:
    """Serialize the checkpoint-level document (format name, version, entries)."""
    doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
           "entries": {fqn: e.to_json() for fqn, e in sorted(entries.items())}}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False)


def loads(text: Any) -> dict[str, EntrySpec]:
    """Parse the checkpoint-level document; refuses other formats and future versions."""
    if not isinstance(text, str):
        raise CheckpointFormatError(f"the qdcp spec must be a JSON string, got {type(text).__name__}")
    if len(text) > MAX_SPEC_BYTES:
        raise CheckpointFormatError(f"the qdcp spec is {len(text)} bytes, over the {MAX_SPEC_BYTES} limit")
    with no_gc():
        return _loads(text)


def _loads(text: str) -> dict[str, EntrySpec]:
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CheckpointFormatError(f"the qdcp spec is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CheckpointFormatError("the qdcp spec does not start with format 'qdcp'")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointFormatError(f"the qdcp spec has no integer version: {version!r}")
    if version > FORMAT_VERSION:
        raise CheckpointFormatError(
            f"this checkpoint uses qdcp format version {version}; this qdcp reads up to "
            f"{FORMAT_VERSION}. Upgrade qdcp to load it.")
    if version < 1:
        raise CheckpointFormatError(f"bad qdcp format version {version}")
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        raise CheckpointFormatError("the qdcp spec has no entries object")
    return {str(fqn): entry_from_json(str(fqn), e) for fqn, e in entries.items()}


# ----------------------------------------------------------------------------- well-formed entries
# Everything a loader checks about a stored entry before reading its data, in one place: the
# planner, the reader, `qdcp verify` and the CLI call these.

def read_specs(metadata: Any) -> dict[str, EntrySpec]:
    """The qdcp entry specs recorded in a checkpoint's DCP ``Metadata`` ({} for a plain checkpoint)."""
    data = getattr(metadata, "planner_data", None)
    if not isinstance(data, dict) or PLANNER_DATA_KEY not in data:
        return {}
    return loads(data[PLANNER_DATA_KEY])


def layouts_of(entry: EntrySpec) -> dict[str, Any]:
    """Each component's layout, checked: the layout must derive the shape the spec records."""
    out = {}
    for c in entry.components:
        layout = layout_from_json(c.layout, c.shape)
        try:
            derived = layout.component_shape(entry.shape)
        except (AlignmentError, CheckpointFormatError) as e:
            raise CheckpointFormatError(f"key {entry.fqn!r}: component {c.name!r}: {e}") from None
        if tuple(derived) != tuple(c.shape):
            raise CheckpointFormatError(
                f"key {entry.fqn!r}: component {c.name!r} is recorded as {tuple(c.shape)} but its "
                f"layout gives {tuple(derived)} for logical shape {entry.shape}")
        out[c.name] = layout
    return out


def check_component_bytes(entry: EntrySpec) -> None:
    """Refuse a raw entry whose components claim more bytes than any quantized format needs
    (4x the logical tensor, plus 1 MiB): a file must not make the loader allocate without bound."""
    logical = math.prod(entry.shape) * entry.dtype.itemsize
    claimed = sum(math.prod(c.shape) * c.dtype.itemsize for c in entry.components)
    if claimed > 4 * logical + (1 << 20):
        raise CheckpointFormatError(
            f"key {entry.fqn!r}: components claim {claimed} bytes for a logical tensor of {logical} "
            f"bytes; the spec is corrupt or hostile")


def stored_components(state_dict_metadata: Mapping[str, Any]) -> dict[str, set[str]]:
    """Entry key -> the names of the component items the checkpoint stores for it."""
    out: dict[str, set[str]] = {}
    for item_fqn in state_dict_metadata:
        owner, name = split_item(item_fqn)
        if name is not None:
            out.setdefault(owner, set()).add(name)
    return out


def entry_keys(state_dict_metadata: Mapping[str, Any], specs: Mapping[str, EntrySpec]) -> list[str]:
    """The state-dict keys of a checkpoint's entries, in its items' order: every item's key, the
    component items a spec lists (``<key>.__qdcp__.<name>``) folded into their entry's key; then
    the keys of spec entries with no item stored."""
    owner = {component_fqn(e.fqn, c.name): e.fqn for e in specs.values() for c in e.components}
    keys = dict.fromkeys(owner.get(k, k) for k in state_dict_metadata)
    keys.update(dict.fromkeys(specs))
    return list(keys)


def check_items(entry: EntrySpec, state_dict_metadata: Mapping[str, Any], stored: set[str],
                key: str | None = None) -> None:
    """Every component item the spec lists exists with exactly its shape and dtype, and no item
    is stored that it does not list (``stored``: the names :func:`stored_components` found for
    the entry). ``key`` names the target in errors when it is not the entry's own key."""
    key = key if key is not None else entry.fqn
    for c in entry.components:
        item = state_dict_metadata.get(component_fqn(entry.fqn, c.name))
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointFormatError(f"key {key!r}: component {c.name!r} is missing from the checkpoint")
        if tuple(item.size) != tuple(c.shape) or item.properties.dtype != c.dtype:
            raise CheckpointFormatError(
                f"key {key!r}: component {c.name!r} is stored as {tuple(item.size)} "
                f"{item.properties.dtype} but its spec says {c.shape} {c.dtype}")
    unlisted = stored - {c.name for c in entry.components}
    if unlisted:
        raise CheckpointFormatError(
            f"key {key!r}: the checkpoint stores components {sorted(unlisted)} that its spec does "
            f"not list; the spec is damaged")


# ----------------------------------------------------------------------------- chunk geometry

def check_chunk_geometry(md: Any) -> None:
    """Refuse metadata whose chunks do not tile their items exactly (:func:`chunk_problems`)."""
    problems = chunk_problems(md.state_dict_metadata or {})
    if problems:
        fqn, problem = problems[0]
        raise CheckpointFormatError(f"{describe_item(fqn)}: {problem}; the checkpoint's metadata is corrupt")


def chunk_problems(state_dict_metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(item fqn, problem)`` for every tensor item whose chunks do not tile it exactly: a bad
    size, a chunk of the wrong rank or outside its bounds, overlapping chunks, holes. DCP's planners
    trust these numbers (an overlap can hide a hole, and a hole leaves target elements unread)."""
    problems = []
    for fqn, item in state_dict_metadata.items():
        chunks = getattr(item, "chunks", None)
        if chunks is not None:
            problems.extend((fqn, p) for p in _tiling_problems(tuple(item.size), chunks))
    return problems


def _tiling_problems(size: tuple, chunks) -> list[str]:
    if any(not isinstance(d, int) or d < 0 for d in size):
        return [f"bad size {size} in the checkpoint's metadata"]
    boxes, problems, covered = [], [], 0
    for ch in chunks:
        o, n = tuple(ch.offsets), tuple(ch.sizes)
        if len(o) != len(size) or len(n) != len(size) or any(
                not isinstance(a, int) or not isinstance(b, int) or a < 0 or b < 0 or a + b > d
                for a, b, d in zip(o, n, size)):
            problems.append(f"a chunk at {o} of size {n} does not fit in its tensor of size {size}")
        elif math.prod(n):
            covered += math.prod(n)
            boxes.append((o, n))
    problems += _overlaps(boxes)
    if not problems and covered != math.prod(size):
        problems.append(f"chunks cover {covered} of its {math.prod(size)} elements (holes or overlaps)")
    return problems


def _overlaps(boxes: list) -> list[str]:
    """Overlapping pairs among non-empty boxes: a sweep along dim 0 (cheap for real shardings)."""
    boxes.sort()
    active: list = []
    budget = 10_000_000
    for o, n in boxes:
        active = [(ao, an) for ao, an in active if not o or ao[0] + an[0] > o[0]]
        for ao, an in active:
            budget -= 1
            if all(a < c + e and c < a + b for a, b, c, e in zip(o, n, ao, an)):
                return [f"chunks at {ao} and {o} overlap"]
        if budget < 0:
            return ["too many overlapping chunks to check"]
        active.append((o, n))
    return []
