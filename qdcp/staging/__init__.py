"""Staging: copies of quantized tensors by their inner buffers, for async saves and offloading.

- :mod:`~qdcp.staging.stager`: :class:`QuantizedStager`, DCP's ``AsyncStager`` for ``dcp.async_save``
  (reused, pinned where CUDA is present, buffers).
- :mod:`~qdcp.staging.new_empty`: a same-size ``new_empty`` for classes whose library lacks one, so
  DCP's own default stager works on them too.
- :mod:`~qdcp.staging.chunked`: copies of tensors that name their own chunks (DCP's
  ``_Checkpointable``).
- :mod:`~qdcp.staging.offload`: :func:`to_device`, moving a quantized parameter with its buffers.
"""

from qdcp.staging.new_empty import enable_new_empty, register_new_empty, unregister_new_empty
from qdcp.staging.offload import to_device
from qdcp.staging.stager import QuantizedStager

__all__ = ["QuantizedStager", "to_device", "register_new_empty", "unregister_new_empty", "enable_new_empty"]
