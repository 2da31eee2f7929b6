"""Planning: what DCP writes and reads for each key (DCP's ``SavePlanner`` / ``LoadPlanner``).

:class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner` subclass DCP's default planners and
behave exactly like them on plain tensors and non-tensor objects. One job per module:

- :mod:`~qdcp.planning.save`: the save planner, DCP's side of a save (call order, plans, item data).
- :mod:`~qdcp.planning.save_entries`: what each quantized key is saved as (raw or dequantized), its
  spec and its items' data; the ranks' specs merged.
- :mod:`~qdcp.planning.load`: the load planner, DCP's side of a load (call order, reads, commits).
- :mod:`~qdcp.planning.key_plans`: which load action each target key gets, from metadata alone.
- :mod:`~qdcp.planning.actions`: the load actions, one class per way of loading.
- :mod:`~qdcp.planning.shadows`: atomic loads (reads land in shadows, copied in only when all pass).
- :mod:`~qdcp.planning.placement`: where a shard's chunk sits in the logical tensor (shared).
- :mod:`~qdcp.dcp_copies`: DCP's own logic reproduced (a few reads, the save plans' riders and plan caching).
"""

from qdcp.planning.load import QuantizedLoadPlanner
from qdcp.planning.save import DequantizeChoice, QuantizedSavePlanner

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner", "DequantizeChoice"]
