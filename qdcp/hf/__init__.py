"""Hugging Face checkpoint directories: export to the layouts inference engines load (torchao's,
compressed-tensors'), and reading such directories through DCP."""

from qdcp.hf.export import ExportError, ExportResult, export
from qdcp.hf.reader import QuantizedHFReader

__all__ = ["export", "ExportResult", "ExportError", "QuantizedHFReader"]
