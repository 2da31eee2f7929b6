"""Recipes for the training frameworks that call DCP themselves (docs/frameworks.md).

Each module imports its framework and is imported only by a user of that framework::

    from qdcp.frameworks.torchtitan import QuantizedCheckpointManager
    from qdcp.frameworks.lightning import QuantizedFabricStrategy, QuantizedTrainerStrategy

``import qdcp`` imports none of them.
"""
