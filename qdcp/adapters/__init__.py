"""Adapters: one per family of quantized tensors, and the registry that finds them.

``base`` states the contract (:class:`Adapter` and the optional protocols); ``torchao``,
``torchao_training``, ``transformer_engine``, ``te_grouped`` and ``compressed_tensors`` hold the
built-in families; ``formats`` the neutral forms two families convert through.
"""

from qdcp.adapters.base import (
    Adapter,
    GroupAdapter,
    OpRegisteringAdapter,
    PicklingAdapter,
    RawInterchangeAdapter,
    StoredEntry,
    adapter_for_type,
    allow_pickled,
    find_adapter,
    register_adapter,
    registered_type_names,
)

__all__ = ["Adapter", "StoredEntry", "RawInterchangeAdapter", "GroupAdapter", "OpRegisteringAdapter",
           "PicklingAdapter", "adapter_for_type", "allow_pickled", "find_adapter", "register_adapter",
           "registered_type_names"]
