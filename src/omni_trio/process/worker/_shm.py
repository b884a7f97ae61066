"""Shared memory in ``/dev/shm``: names, segments, and the sweeper that frees what is
left behind.

Every segment of a pipeline -- the rings its workers create (``_ring``) -- is named
``{prefix}-{stage}-{generation}-...``: the prefix is per pipeline, the generation per
worker of the stage (a restarted worker never reuses a name of its predecessor's).
A segment lives until its worker closes it; when a worker dies, the sweeper unlinks
every segment of that worker, and when the pipeline's block is left, every segment
with its prefix.

Where segments live is a :class:`Segments`: :data:`SHM` (files in :data:`SHM_DIR`,
mapped) for every real worker, :class:`MemorySegments` (buffers of one process) for a
simulation, whose workers share the process and must touch no file.
"""

from __future__ import annotations

import mmap
import os
import secrets
from collections.abc import Iterable
from typing import Protocol, TypeAlias

from ..._util import final

__all__ = [
    "SHM",
    "SHM_DIR",
    "MemorySegments",
    "Segment",
    "Segments",
    "listing",
    "new_prefix",
    "sweep",
    "unlink",
    "worker_name",
]

SHM_DIR = "/dev/shm"
# Pre-fault the mapping's pages when it is made (Linux), not on the first chunks.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Buffer(bytearray):
    """A segment's memory in this process alone (:class:`MemorySegments`)."""

    def close(self) -> None:
        """Nothing to unmap: the memory goes with its last user."""


#: A segment's bytes, mapped: a writable buffer, closed when its user is done with
#: it (the name may outlive it).
Segment: TypeAlias = mmap.mmap | _Buffer


class Segments(Protocol):
    """Where named segments live, by name."""

    def create(self, name: str, size: int) -> Segment:
        """A new segment of ``size`` bytes, reserved now. Raises ``FileExistsError`` if
        ``name`` exists, ``OSError`` if there is no room."""

    def open(self, name: str) -> Segment:
        """Map the existing segment ``name``. Raises ``FileNotFoundError``."""

    def unlink(self, name: str) -> bool:
        """Free ``name`` (a mapping of it lives on); ``False`` if it was gone."""

    def listing(self, prefix: str) -> list[str]:
        """The names that start with ``prefix``, sorted."""

    def size(self, name: str) -> int:
        """Its bytes; 0 if it is gone."""


@final
class _DevShm:
    """Segments as files in :data:`SHM_DIR`, mapped shared: a worker process's."""

    def create(self, name: str, size: int) -> Segment:
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the memory now: a full /dev/shm fails here, not with SIGBUS at a write.
            os.posix_fallocate(fd, 0, size)
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)

    def open(self, name: str) -> Segment:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if not size:
                return _Buffer()  # the ring says what is wrong with it
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def unlink(self, name: str) -> bool:
        return unlink(name)

    def listing(self, prefix: str) -> list[str]:
        return listing(prefix)

    def size(self, name: str) -> int:
        try:
            return os.stat(os.path.join(SHM_DIR, name)).st_size
        except FileNotFoundError:
            return 0

    def __repr__(self) -> str:
        return "SHM"


#: Segments in ``/dev/shm``: every real worker's.
SHM: Segments = _DevShm()


@final
class MemorySegments:
    """Segments as buffers of this process, by name: a simulated pipeline's, whose
    workers are tasks of one Trio run. A name is freed at once; a worker that
    opened it keeps the buffer (as a mapping outlives its file)."""

    def __init__(self) -> None:
        self._segments: dict[str, _Buffer] = {}

    def create(self, name: str, size: int) -> Segment:
        if name in self._segments:
            raise FileExistsError(f"segment {name} exists")
        segment = self._segments[name] = _Buffer(size)
        return segment

    def open(self, name: str) -> Segment:
        try:
            return self._segments[name]
        except KeyError:
            raise FileNotFoundError(f"no segment {name}") from None

    def unlink(self, name: str) -> bool:
        return self._segments.pop(name, None) is not None

    def listing(self, prefix: str) -> list[str]:
        return sorted(name for name in self._segments if name.startswith(prefix))

    def size(self, name: str) -> int:
        segment = self._segments.get(name)
        return 0 if segment is None else len(segment)

    def __repr__(self) -> str:
        return f"<MemorySegments of {len(self._segments)}>"


def new_prefix() -> str:
    """A name prefix unique to one pipeline: ``ot<pid hex><random hex>``."""
    return f"ot{os.getpid():x}{secrets.token_hex(3)}"


def worker_name(prefix: str, stage_id: int, generation: int) -> str:
    """``{prefix}-{stage}-{generation}``: one worker's name, unique to it (a restarted
    worker never gets its predecessor's). Its segments' names, and the address it
    listens on, start with it."""
    return f"{prefix}-{stage_id}-{generation}"


def unlink(name: str) -> bool:
    """Free segment ``name``; ``False`` if it was already gone."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return False
    return True


def listing(prefix: str) -> list[str]:
    """The segments whose names start with ``prefix``."""
    try:
        names: Iterable[str] = os.listdir(SHM_DIR)
    except FileNotFoundError:  # pragma: no cover - no /dev/shm on this system
        return []
    return sorted(name for name in names if name.startswith(prefix))


def sweep(prefix: str, segments: Segments | None = None) -> int:
    """Unlink every segment (of ``segments``, by default :data:`SHM`'s) whose name
    starts with ``prefix``; return how many."""
    if segments is None:
        return sum(unlink(name) for name in listing(prefix))
    return sum(segments.unlink(name) for name in segments.listing(prefix))
