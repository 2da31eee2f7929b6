"""Hugging Face checkpoint directories: export to the layouts inference engines load (torchao's,
compressed-tensors'), reading such directories through DCP, and a checkpoint as one safetensors
file (``qdcp convert --to safetensors``)."""

from qdcp.hf.convert import SafetensorsResult, TensorRow, to_safetensors
from qdcp.hf.export import ExportError, ExportResult, export
from qdcp.hf.reader import QuantizedHFReader

__all__ = ["export", "ExportResult", "ExportError", "QuantizedHFReader", "to_safetensors", "SafetensorsResult",
           "TensorRow"]
