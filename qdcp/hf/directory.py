"""A Hugging Face safetensors directory as its file headers list it: what the layouts
(:mod:`qdcp.hf.layout`) present and :class:`qdcp.QuantizedHFReader` reads."""

from __future__ import annotations

import dataclasses
import os

import torch
from safetensors import safe_open

from qdcp.errors import CheckpointFormatError
from qdcp.hf import safetensors_files as stf

__all__ = ["HFDirectory"]


@dataclasses.dataclass
class HFDirectory:
    """The tensors of a Hugging Face directory: name -> (file, shape, dtype), each file's
    ``__metadata__``, and its ``config.json`` (``{}`` without one)."""

    path: str
    tensors: dict[str, tuple[str, tuple[int, ...], torch.dtype]]
    file_metadata: dict[str, dict[str, str]]
    config: dict

    @classmethod
    def scan(cls, path: str) -> "HFDirectory":
        """List the tensors of the directory's safetensors files (those its index names, else
        ``model.safetensors``, else every ``*.safetensors``): headers only, no tensor is read."""
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
        """File tensor ``name`` as a tensor on the meta device (its shape and dtype, no data)."""
        _, shape, dtype = self.tensors[name]
        return torch.empty(shape, dtype=dtype, device="meta")

    def tensor(self, name: str) -> torch.Tensor:
        """File tensor ``name``, read whole (for the small tensors a layout reads to present an entry)."""
        with safe_open(self.tensors[name][0], "pt") as f:
            return f.get_tensor(name)
