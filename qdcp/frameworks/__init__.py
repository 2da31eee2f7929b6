"""qdcp inside the training frameworks that call DCP themselves (docs/frameworks.md):

- ``switch``: :func:`qdcp.install`, the opt-in switch that makes DCP's own ``save`` / ``async_save``
  / ``load`` (and its consolidation planner) use qdcp's, for frameworks that offer no planner
  option; imports no framework (``import qdcp`` imports it);
- ``torchtitan`` and ``lightning``: recipes for torchtitan's and Lightning's checkpoint seams, each
  importing its framework and imported only by a user of that framework::

    from qdcp.frameworks.torchtitan import QuantizedCheckpointManager
    from qdcp.frameworks.lightning import QuantizedFabricStrategy, QuantizedTrainerStrategy
"""
