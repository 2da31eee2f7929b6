"""Adapters: one per family of quantized tensors, and the registry that finds them."""

from qdcp.adapters.base import (
    Adapter,
    StoredEntry,
    adapter_for_type,
    find_adapter,
    register_adapter,
    registered_type_names,
)

__all__ = ["Adapter", "StoredEntry", "adapter_for_type", "find_adapter", "register_adapter", "registered_type_names"]
