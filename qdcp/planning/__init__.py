"""Planning: what DCP writes and reads for each key (DCP's ``SavePlanner`` / ``LoadPlanner``).

:class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner` subclass DCP's default planners and
behave exactly like them on plain tensors and non-tensor objects. Save: :mod:`~qdcp.planning.save`
(DCP's call order), :mod:`~qdcp.planning.save_entries` (each quantized key's items and spec). Load:
:mod:`~qdcp.planning.load` (DCP's call order), :mod:`~qdcp.planning.key_plans` (each key's action,
from metadata alone), :mod:`~qdcp.planning.actions`, :mod:`~qdcp.planning.shadows` (atomic loads),
:mod:`~qdcp.planning.verifier` (checksums, under DCP's reader).
Both: :mod:`~qdcp.planning.placement` (where a shard's chunk sits).
"""

from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.save import DequantizeChoice, QuantizedSavePlanner

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner", "DequantizeChoice"]
