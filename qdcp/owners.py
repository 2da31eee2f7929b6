"""Which process owns something on disk, and whether that process still runs.

A claim on a checkpoint path (:mod:`qdcp.storage.claims`) and the scratch files of ``qdcp convert``
/ ``qdcp export`` (:mod:`qdcp.outputs`) record their :class:`Owner`: the host, its boot,
the PID namespace, the PID and the process's start time. On the machine that wrote it (same host
name, boot id and PID namespace), :meth:`Owner.alive` answers for certain: the PID runs and is
the same process (its start time matches; a reused PID does not), and a zombie counts as dead.
From another machine it cannot tell (None).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import socket

__all__ = ["Owner"]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or [] (no /proc)."""
    text = _read(f"/proc/{pid}/stat")
    return text[text.rfind(")") + 2:].split() if ")" in text else []


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks after boot ("" where /proc has none)."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else ""


@functools.lru_cache(maxsize=1)
def _machine() -> tuple[str, str, str]:
    pidns = ""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pass
    return socket.gethostname(), _read("/proc/sys/kernel/random/boot_id"), pidns


@dataclasses.dataclass(frozen=True)
class Owner:
    """A process, as another process (here or elsewhere) can recognise it later."""

    host: str
    boot: str
    pidns: str
    pid: int
    start: str

    @classmethod
    def current(cls) -> "Owner":
        """This process (its PID read now: a forked child is another owner)."""
        host, boot, pidns = _machine()
        return cls(host, boot, pidns, os.getpid(), _start_time(os.getpid()))

    def here(self) -> bool:
        """Whether it ran on this machine, in this PID namespace (so its PID means the same here)."""
        return (self.host, self.boot, self.pidns) == _machine()

    def alive(self) -> bool | None:
        """True: it runs; False: it has ended (or its PID now names another process); None: it ran
        on another machine or in another PID namespace, so this one cannot tell."""
        if not self.here():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # it exists, under another user
        fields = _stat_fields(self.pid)
        if fields and fields[0] in ("Z", "X"):
            return False  # a zombie: killed, not yet reaped by its parent
        return not (self.start and fields and _start_time(self.pid) != self.start)

    def describe(self) -> str:
        """``pid N on host 'H'`` for messages."""
        return f"pid {self.pid} on host {self.host!r}"

    def to_json(self) -> dict:
        """The fields, for a claim file."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Owner":
        """The inverse of :meth:`to_json` (ValueError on anything else)."""
        try:
            return cls(str(data["host"]), str(data["boot"]), str(data["pidns"]), int(data["pid"]), str(data["start"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not an owner record: {data!r}") from e

    def tag(self) -> str:
        """A short form for a file name: ``<machine hash>.<pid>.<start>``; :meth:`from_tag` reads it
        back as an owner that :meth:`alive` can judge on this machine."""
        return f"{_machine_hash(self.host, self.boot, self.pidns)}.{self.pid}.{self.start or 0}"

    @classmethod
    def from_tag(cls, tag: str) -> "Owner | None":
        """The owner a :meth:`tag` names (None: not a tag). One of another machine compares unequal
        in :meth:`here` (its host is unknown), so its liveness is None."""
        m = re.fullmatch(r"([0-9a-f]{8})\.(\d+)\.(\d+)", tag)
        if m is None:
            return None
        host, boot, pidns = _machine()
        start = "" if m.group(3) == "0" else m.group(3)
        if m.group(1) == _machine_hash(host, boot, pidns):
            return cls(host, boot, pidns, int(m.group(2)), start)
        return cls("?", "?", "?", int(m.group(2)), start)


def _machine_hash(host: str, boot: str, pidns: str) -> str:
    return hashlib.blake2s(f"{host}\0{boot}\0{pidns}".encode(), digest_size=4).hexdigest()
