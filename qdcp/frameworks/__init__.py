"""qdcp inside the training frameworks that call DCP themselves (docs/frameworks.md): ``switch``
(:func:`qdcp.install`, imports no framework), and ``torchtitan`` and ``lightning``, recipes for
those frameworks' checkpoint seams, each importing its framework and imported only by its users.
"""
