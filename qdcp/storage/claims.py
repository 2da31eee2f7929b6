"""One save per checkpoint path at a time, across processes and hosts: a claim file.

A save's coordinator (rank 0) creates ``<path>/.qdcp-save.claim`` with an exclusive create (POSIX
``O_EXCL``; fsspec's ``"xb"`` mode, S3's ``If-None-Match: *``) before any data is written, holding
who took it (:class:`~qdcp.storage.owners.Owner`), when, and a token no other save shares. A save
that finds the file held fails with :class:`~qdcp.errors.ConcurrentSaveError` naming the holder.
The holder checks, just before its commit, that the file still holds its token, and removes it
when the save ends (success or failure).

A claim is stale, and the next save clears it, when its process has ended: on the machine that
took it, at once (the PID no longer runs, or runs another program); from another machine, once its
heartbeat is older than :data:`STALE_AFTER_S` (the holder touches the file every
:data:`HEARTBEAT_S` seconds, ``QDCP_CLAIM_HEARTBEAT``; ``QDCP_CLAIM_STALE_AFTER`` sets the limit,
which must be several heartbeats long). An unreadable claim (its
taker died between creating and writing it) is stale after :data:`UNREADABLE_GRACE_S`. Locally a
stale claim is cleared by renaming it aside, checking that what moved is the claim judged stale,
and putting it back otherwise, so two saves clearing one claim cannot both win; on object stores
(no atomic rename) the clear is a read then a delete, and the check at commit is what keeps a
second holder from committing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
import weakref
from typing import Protocol

from qdcp.errors import ConcurrentSaveError
from qdcp.storage.claim_stores import CLAIM_FILE
from qdcp.storage.owners import Owner

__all__ = ["CLAIM_FILE", "HEARTBEAT_S", "STALE_AFTER_S", "PathClaim", "ClaimRecord", "take", "read_record"]

HEARTBEAT_S = float(os.environ.get("QDCP_CLAIM_HEARTBEAT", "5"))
STALE_AFTER_S = float(os.environ.get("QDCP_CLAIM_STALE_AFTER", "60"))
UNREADABLE_GRACE_S = 10.0

_live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # token -> this process's claims


class ClaimStore(Protocol):
    """The few operations a claim needs of a directory (:mod:`qdcp.storage.claim_stores`)."""

    label: str

    def create(self, name: str, data: bytes) -> bool: ...
    def read(self, name: str) -> bytes | None: ...
    def last_beat(self, token: str) -> float | None: ...
    def beat(self, token: str, data: bytes) -> None: ...
    def drop_beat(self, token: str) -> None: ...
    def remove_if_same(self, name: str, data: bytes, aside: str) -> bool: ...


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    """What a claim file holds."""

    token: str
    owner: Owner
    since: float
    what: str

    def dumps(self) -> bytes:
        """The claim file's bytes (JSON)."""
        return json.dumps({"qdcp_claim": 1, "token": self.token, "owner": self.owner.to_json(),
                           "since": self.since, "what": self.what}).encode()

    @classmethod
    def loads(cls, data: bytes) -> "ClaimRecord":
        """The record in a claim file's bytes (ValueError if they are not one)."""
        try:
            doc = json.loads(data)
            return cls(str(doc["token"]), Owner.from_json(doc["owner"]), float(doc["since"]), str(doc["what"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError("not a qdcp claim") from e

    def describe(self) -> str:
        """``<what>, pid N on host 'H', since HH:MM:SS`` for messages."""
        return f"{self.what}, {self.owner.describe()}, since {time.strftime('%H:%M:%S', time.localtime(self.since))}"


def read_record(store: ClaimStore) -> tuple[bytes | None, ClaimRecord | None]:
    """The claim file's bytes (None: no claim) and its record (None: unreadable)."""
    data = store.read(CLAIM_FILE)
    if data is None:
        return None, None
    try:
        return data, ClaimRecord.loads(data)
    except ValueError:
        return data, None


class PathClaim:
    """This save's claim on a path: :meth:`check` before committing, :meth:`release` after."""

    def __init__(self, store: ClaimStore, record: ClaimRecord, cleared: list[ClaimRecord]) -> None:
        self.store, self.record, self.cleared = store, record, cleared
        self.data = record.dumps()
        self.ended = False  #: its save can no longer commit (a write failed): the next save here clears it
        stop = threading.Event()
        beats = threading.Thread(target=_heartbeat, args=(store, record.token, self.data, stop),
                                 name=f"qdcp-claim-{record.token}", daemon=True)
        beats.start()
        # released when the save ends, or when its writer is dropped without ending it
        self._release = weakref.finalize(self, _release, store, record.token, self.data, stop, beats)
        _live[record.token] = self

    @property
    def token(self) -> str:
        """The token this save's file names carry."""
        return self.record.token

    def check(self) -> None:
        """Raise :class:`ConcurrentSaveError` unless the claim file still holds this claim."""
        data, other = read_record(self.store)
        if data != self.data:
            holder = f"it is now held by {other.describe()}" if other is not None else \
                "the claim file is gone" if data is None else "the claim file holds another claim"
            raise ConcurrentSaveError(
                f"this save's claim on {self.store.label!r} was cleared as stale while it ran ({holder}); "
                f"nothing was committed. Its heartbeat stopped for longer than {STALE_AFTER_S:.0f} s "
                f"(QDCP_CLAIM_STALE_AFTER): save again")

    def end(self) -> None:
        """Mark the save as over without removing the claim yet (its files are still to be removed
        by whoever ends it); a later save in this process then clears it as stale."""
        self.ended = True

    def release(self) -> None:
        """Remove the claim file if it is still this claim's (idempotent)."""
        self._release()


def _heartbeat(store: ClaimStore, token: str, data: bytes, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        try:
            store.beat(token, data)
        except Exception:  # noqa: BLE001 (a missed beat only ages the claim)
            pass


def _release(store: ClaimStore, token: str, data: bytes, stop: threading.Event, beats: threading.Thread) -> None:
    stop.set()
    if beats is not threading.current_thread():
        beats.join(timeout=30)  # a beat in flight would write the heartbeat file again after it is dropped
    try:
        store.drop_beat(token)
        store.remove_if_same(CLAIM_FILE, data, f"{CLAIM_FILE}.{token}.release")
    except OSError:
        pass  # a claim that cannot be removed turns stale with its process


def take(store: ClaimStore, what: str) -> PathClaim:
    """Claim ``store``'s path for one save, clearing stale claims; :class:`ConcurrentSaveError`
    naming the holder if another save holds it."""
    record = ClaimRecord(uuid.uuid4().hex[:12], Owner.current(), time.time(), what)
    cleared: list[ClaimRecord] = []
    for _ in range(5):
        if store.create(CLAIM_FILE, record.dumps()):
            return PathClaim(store, record, cleared)
        data, other = read_record(store)
        if data is None:
            continue  # released meanwhile
        why = _stale(store, data, other)
        if why is None:
            raise ConcurrentSaveError(_busy(store, other))
        if other is not None:
            store.drop_beat(other.token)
        if store.remove_if_same(CLAIM_FILE, data, f"{CLAIM_FILE}.{record.token}.stale") and other is not None:
            cleared.append(other)
    raise ConcurrentSaveError(f"{store.label!r}: other saves kept claiming it while this one cleared stale "
                              f"claims; nothing was written. Save again")


def _stale(store: ClaimStore, data: bytes, other: ClaimRecord | None) -> str | None:
    """Why the claim in ``data`` is stale, or None if its save may still run."""
    if other is None:
        beat = store.last_beat("")
        return "unreadable" if beat is not None and time.time() - beat > UNREADABLE_GRACE_S else None
    alive = other.owner.alive()
    if alive is False:
        return "its process has ended"
    if alive and other.owner == Owner.current():
        mine = _live.get(other.token)
        return None if mine is not None and not mine.ended else "its save in this process has ended"
    if alive:
        return None
    beat = store.last_beat(other.token)
    return "no heartbeat" if beat is None or time.time() - beat > STALE_AFTER_S else None


def _busy(store: ClaimStore, other: ClaimRecord | None) -> str:
    holder = other.describe() if other is not None else "a save that is taking it now"
    where = os.path.join(store.label, CLAIM_FILE) if "://" not in store.label else f"{store.label}/{CLAIM_FILE}"
    if other is not None and other.owner.here() is False:
        after = f"once its heartbeat is {STALE_AFTER_S:.0f} s old (QDCP_CLAIM_STALE_AFTER)"
    else:
        after = "as soon as its process has ended"
    return (f"another save holds {store.label!r}: {holder} (claim file {where!r}); this save wrote nothing. "
            f"Wait for that save to finish, or save to another path. A claim whose save was killed is "
            f"cleared by the next save {after}")
