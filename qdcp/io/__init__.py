"""How a checkpoint's bytes move: the fast write and read paths under qdcp's storage writer and reader.

:mod:`qdcp.storage` decides what a checkpoint is (safe ``.metadata``, the commit, the claim, what is
verified); this package only moves bytes, as fast as the machine allows, with the same results as
DCP's own code (stock DCP reads every file written here):

- :mod:`~qdcp.io.pipeline`: one rank's items written into ``thread_count`` files on as many threads,
  torch.save archives without the zip CRC-32s where every item is hashed, device copies ahead of the
  writes, each item hashed as it is written (the writer's ``thread_count`` option).
- :mod:`~qdcp.io.direct`: large items written around the page cache from their own memory
  (``O_DIRECT``; the writer's ``direct_io`` option).
- :mod:`~qdcp.io.torch_save`: a stored torch.save archive read in place (no copy), its zip CRCs
  checked where nothing else checks the bytes.
- :mod:`~qdcp.io.threads`: jobs run on threads, the first failure raised once every thread stopped.
"""
