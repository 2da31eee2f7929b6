"""Writing a checkpoint file around the page cache: ``O_DIRECT`` writes straight from the tensors'
memory (Linux; the write pipeline's files where they are fsync'd, :mod:`qdcp.io.pipeline`).

A checkpoint is written once and seldom read back by its writer, so the page-cache copy of a
buffered write is one a save need not make. ``O_DIRECT`` asks that memory address, file offset and
length be multiples of the device's block (:data:`BLOCK` covers every common one), and a tensor's
bytes lie wherever its allocator put them, so each item may start up to ``BLOCK - 1`` bytes after
the previous one ends (zeros between: DCP records each item's offset and length, and readers read
only those), placed so that its large write lands at a file offset congruent to its address. A file
system that refuses ``O_DIRECT`` at open (tmpfs, some FUSE) gets a buffered file instead
(:func:`open_direct` returns None); one that refuses a direct write later (``EINVAL``) has the rest
of that file written buffered.
"""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["BLOCK", "BUFFER_BYTES", "DIRECT_MIN", "DirectFile", "open_direct", "supported"]

#: the alignment of every direct write's address, offset and length (a multiple of the logical
#: block of the devices file systems sit on: 512 bytes or 4 KiB)
BLOCK = 4096
#: small writes are collected into runs of up to this many bytes before they are written
BUFFER_BYTES = 4 << 20
#: writes at least this long go to the disk from their own memory (direct); shorter ones are
#: collected and written buffered
DIRECT_MIN = 1 << 20
#: an item's first bytes are held back (to place the item) for at most this many bytes
_HELD_MAX = 64 << 10


def supported() -> bool:
    """Whether this platform has ``O_DIRECT`` (Linux)."""
    return hasattr(os, "O_DIRECT")


def open_direct(path: str) -> "DirectFile | None":
    """``path`` created (truncated) for writing with ``O_DIRECT``; None where the platform or the
    file system does not offer it (write it the usual way then)."""
    if not supported():
        return None
    cloexec = getattr(os, "O_CLOEXEC", 0)
    buffered = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | cloexec, 0o644)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT | cloexec)
    except OSError as e:
        os.close(buffered)
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return None
        raise
    return DirectFile(fd, buffered)


class _Py_buffer(ctypes.Structure):  # CPython's buffer view (Include/pybuffer.h), stable ABI
    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_Py_buffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_Py_buffer)]


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (read-only buffers too)."""
    b = _Py_buffer()
    _get_buffer(view, ctypes.byref(b), 0)  # PyBUF_SIMPLE
    try:
        return b.buf or 0
    finally:
        _release_buffer(ctypes.byref(b))


def _bytes_view(b) -> memoryview:
    view = memoryview(b)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class DirectFile:
    """A write stream for the pipeline (``write``, ``tell``, ``fileno``), plus :meth:`start_item` /
    :meth:`item_start` to place each item and :meth:`finish` to write what is held. Each large
    write's block-aligned middle goes to the disk from its own memory (a descriptor opened
    ``O_DIRECT``); every other byte (the archive's records, the unaligned ends, the gaps) is
    collected into runs written through a second, buffered descriptor of the same file (a small
    direct write would wait for the disk; the fsync at the end writes these back). ``flush`` writes
    nothing (DCP flushes the stream after every item)."""

    def __init__(self, fd: int, fd_buffered: int) -> None:
        self._fd, self._fd_buffered = fd, fd_buffered
        self._run = bytearray()  # bytes not yet written, from file offset self._run_at
        self._run_at = 0
        self._direct = True
        self._held: list[bytes] | None = None  # the current item's first bytes, not yet placed
        self._held_len = 0
        self._item_start = 0

    # -- the stream
    def fileno(self) -> int:
        return self._fd_buffered

    def tell(self) -> int:
        return self._run_at + len(self._run) + self._held_len

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def write(self, b) -> int:
        view = _bytes_view(b)
        n = view.nbytes
        large = n >= DIRECT_MIN and self._direct
        address = _address(view) if large else 0
        if self._held is not None:
            if large:  # place the item so that this write lands congruent to its memory
                self._place((address - self.tell()) % BLOCK)
            elif self._held_len + n <= _HELD_MAX:
                self._held.append(bytes(view))
                self._held_len += n
                return n
            else:
                self._place(0)
        if large and (address - self.tell()) % BLOCK == 0:
            self._write_direct(view)
        else:
            self._collect(view)
        return n

    # -- items
    def start_item(self) -> None:
        """The next bytes written start an item: it may begin up to ``BLOCK - 1`` bytes further
        on (zeros between), where its first large write lands on a block with its memory."""
        self._place(0)
        self._held, self._held_len = [], 0

    def item_start(self) -> int:
        """The file offset where the item begun by the last :meth:`start_item` starts."""
        self._place(0)
        return self._item_start

    def _place(self, gap: int) -> None:
        if self._held is None:
            return
        held, self._held, self._held_len = self._held, None, 0
        self._run += bytes(gap)
        self._item_start = self._run_at + len(self._run)
        for chunk in held:
            self._run += chunk

    # -- bytes to the file
    def _collect(self, view: memoryview) -> None:
        if view.nbytes >= BUFFER_BYTES:  # large but not placed for a direct write: buffered, uncopied
            self._write_run()
            _pwrite_all(self._fd_buffered, view, self._run_at)
            self._run_at += view.nbytes
            return
        self._run += view
        if len(self._run) >= BUFFER_BYTES:
            self._write_run()

    def _write_run(self) -> None:
        _pwrite_all(self._fd_buffered, memoryview(self._run), self._run_at)
        self._run_at += len(self._run)
        self._run = bytearray()

    def _write_direct(self, view: memoryview) -> None:
        head = -self.tell() % BLOCK
        self._run += view[:head]
        self._write_run()
        middle = (view.nbytes - head) // BLOCK * BLOCK
        try:
            _pwrite_all(self._fd, view[head:head + middle], self._run_at)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False  # refused (a file system's rule, or a write cut short): the rest buffered
        if not self._direct:  # outside the handler: an error of the buffered write is its own
            _pwrite_all(self._fd_buffered, view[head:head + middle], self._run_at)
        self._run_at += middle
        self._run += view[head + middle:]

    def finish(self) -> None:
        """Write every byte still held: the file is then all with the file system (not fsync'd)."""
        self._place(0)
        self._write_run()

    def close(self) -> None:
        """Close the file (without :meth:`finish`: what was not written is dropped)."""
        for fd in (self._fd, self._fd_buffered):
            if fd >= 0:
                os.close(fd)
        self._fd = self._fd_buffered = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done, n = 0, view.nbytes
    while done < n:
        done += os.pwrite(fd, view[done:], offset + done)
