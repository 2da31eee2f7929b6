"""Staging: copies of quantized tensors by their inner buffers, for async saves and offloading
(:class:`QuantizedStager`, the ``new_empty`` DCP's default stager needs, copies of tensors that name
their own chunks, :func:`to_device`)."""

from qdcp.staging.new_empty import enable_new_empty, register_new_empty, unregister_new_empty
from qdcp.staging.offload import to_device
from qdcp.staging.stager import QuantizedStager

__all__ = ["QuantizedStager", "to_device", "register_new_empty", "unregister_new_empty", "enable_new_empty"]
