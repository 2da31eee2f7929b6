"""How a checkpoint's bytes move: the fast write and read paths under qdcp's storage writer and reader
(:mod:`qdcp.storage` decides what a checkpoint is; stock DCP reads every file written here).

- :mod:`~qdcp.io.pipeline`: one rank's items written into ``thread_count`` files on as many threads.
- :mod:`~qdcp.io.reads`: a load's files read on threads, through reused (pinned) buffers.
- :mod:`~qdcp.io.direct`: large items written around the page cache (the writer's ``direct_io``).
- :mod:`~qdcp.io.torch_save`: a stored torch.save archive read in place, its zip CRCs checked.
- :mod:`~qdcp.io.threads`: jobs run on threads, the first failure raised once every thread stopped.
"""
