"""Exceptions qdcp raises. Each message names the state-dict key and says what to do."""


class QdcpError(Exception):
    """Base class of every error qdcp raises on purpose."""


class CheckpointFormatError(QdcpError, ValueError):
    """The checkpoint's qdcp spec or DCP metadata is malformed, tampered or from a newer qdcp."""


class ChecksumError(CheckpointFormatError):
    """A stored item's bytes do not match the checksum written with them (the data is corrupt)."""


class UnsupportedTensorError(QdcpError, TypeError):
    """A tensor type has no qdcp adapter, or an attribute cannot be stored."""


class AlignmentError(QdcpError, ValueError):
    """A shard boundary does not fall on a block boundary of a quantized component."""


class LoadMismatchError(QdcpError, ValueError):
    """A checkpoint entry cannot be loaded into the target given (shape, missing component, ...)."""


class ReservedKeyError(QdcpError, ValueError):
    """A state-dict key lies in the namespace qdcp names component items with (``<key>.__qdcp__.*``)."""


class StagingError(QdcpError, RuntimeError):
    """A state dict was staged by something that does not understand quantized tensors."""


class ReplicaMismatchError(QdcpError, ValueError):
    """Ranks holding replicas of one chunk hold different bytes (``check_replicas=True``)."""


class ConcurrentSaveError(QdcpError, RuntimeError):
    """Another save holds the checkpoint path (its claim file names it); this save wrote nothing."""


class CheckpointWriteError(QdcpError, OSError):
    """Writing a checkpoint's files failed (disk full, I/O error...); nothing was committed. ``errno``
    is the root cause's, which is also this error's ``__cause__``."""


class CheckpointNotFoundError(QdcpError, FileNotFoundError):
    """There is no checkpoint at the path given to :func:`qdcp.load`: no directory, or no
    ``.metadata`` in it (an empty directory, or a save that did not finish)."""
