"""DCP planners for quantized tensors: :class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner`.

Both subclass DCP's default planners and behave exactly like them on plain tensors and non-tensor
objects. The save side is :mod:`qdcp.save_planner`; the load side is :mod:`qdcp.load_planner` (the
DCP adapter), :mod:`qdcp.load_planning` (which action each target key gets) and
:mod:`qdcp.load_actions` (the actions); :mod:`qdcp.placement` is shared.
"""

from qdcp.load_planner import QuantizedLoadPlanner
from qdcp.save_planner import DequantizeChoice, QuantizedSavePlanner

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner", "DequantizeChoice"]
