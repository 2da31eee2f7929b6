"""Hugging Face checkpoint directories: export to the layouts inference engines load (torchao's,
compressed-tensors'), and reading such directories through DCP."""

from qdcp.hf.export import ExportError, ExportResult, export

__all__ = ["export", "ExportResult", "ExportError"]
