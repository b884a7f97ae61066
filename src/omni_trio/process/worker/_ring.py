"""A shared-memory ring for big chunks: one per edge, from one sending worker to one
reading worker, mapped once and written and read in place.

The ring is a file in :data:`_shm.SHM_DIR` of ``size`` bytes (a multiple of
:data:`ALIGN`), named by the caller with its pipeline's prefix, so
:func:`_shm.sweep` frees it if its owner dies. The :class:`RingWriter` creates it,
hands out slots, and unlinks it when it closes; each :class:`RingReader` maps it by
name and never unlinks it (a mapping outlives the name, so reading after the unlink
still works). No ``multiprocessing.shared_memory`` and no resource tracker: a plain
``open``, ``posix_fallocate`` (which reserves the memory, so a full ``/dev/shm`` fails
the create rather than a later write, with SIGBUS) and ``mmap``.

A slot starts at a multiple of :data:`ALIGN` (64 bytes, a cache line) with a 16-byte
header -- the chunk's tag (an opaque u64 the caller derives from its request and
sequence number) and its length, both little-endian u64 -- and the data right after
it; the slot is rounded up to the next multiple of :data:`ALIGN`. :meth:`RingReader.read`
checks both header fields, so a stale or foreign slot is never read as someone else's
chunk; a freed slot's header is overwritten at once (tag 0, size 2**64 - 1), so not
even its own reader can read it again while its bytes are being reused.

The allocator lives in the writer's process alone (the reader frees a slot by telling
the writer, through the caller's own messages). It is a FIFO ring: slots are handed
out at the head, one after the other, and space comes back at the tail, once every
slot allocated before it is freed too -- frees may come in any order. A slot never
straddles the end: when the next one does not fit before it, it starts at offset 0
and the space left at the end belongs to the slot before, until that slot is freed.
An empty ring starts again at offset 0, so a chunk that fits the ring at all fits an
empty one.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections import deque

from ..._util import final
from . import _shm

__all__ = ["ALIGN", "HEADER", "MIN_SIZE", "RingError", "RingReader", "RingWriter"]

#: Slots start at multiples of this (bytes).
ALIGN = 64
_HEADER = struct.Struct("<QQ")  # tag, length of the data
#: The bytes of a slot's header, before its data.
HEADER = _HEADER.size
#: The smallest ring, in bytes: one page.
MIN_SIZE = 4096
_MAX_TAG = 2**64 - 1
_FREED = (0, 2**64 - 1)  # the header of a freed slot: a size no read asks for
# Pre-fault the mapping's pages when it is made (Linux), not on the first chunks.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class RingError(Exception):
    """A slot does not hold what its reader expected (wrong tag or size), or the ring
    is gone (closed)."""


def _slot_bytes(nbytes: int) -> int:
    """The bytes a slot for an ``nbytes`` chunk takes: header and data, aligned."""
    return -(-(HEADER + nbytes) // ALIGN) * ALIGN


def _path(name: str) -> str:
    if not name or "/" in name:
        raise ValueError(f"a ring's name must be a non-empty file name, not {name!r}")
    return os.path.join(_shm.SHM_DIR, name)


class _Slot:
    __slots__ = ("freed", "held", "nbytes", "offset")

    def __init__(self, offset: int, held: int, nbytes: int) -> None:
        self.offset = offset
        self.held = held  # the bytes it keeps from the ring, the tail wasted at a wrap included
        self.nbytes = nbytes  # the most data it takes
        self.freed = False


@final
class RingWriter:
    """The sending worker's side: creates the segment, allocates and writes slots,
    and unlinks it at :meth:`close`."""

    def __init__(self, name: str, size: int, segment: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self._map: mmap.mmap | None = segment
        self._slots: deque[_Slot] = deque()  # allocation order; freed ones until the tail passes
        self._live: dict[int, _Slot] = {}  # offset -> not yet freed slot
        self._head = 0  # where the next slot goes, if it fits
        self._in_use = 0

    @classmethod
    def create(cls, name: str, size: int) -> RingWriter:
        """Create and map a ring of ``size`` usable bytes (rounded up to a multiple of
        :data:`ALIGN`) named ``name`` in :data:`_shm.SHM_DIR`.

        Raises:
          ValueError: ``size`` is below :data:`MIN_SIZE`, or ``name`` is no file name.
          FileExistsError: a segment of that name exists already.
          OSError: the shared-memory file system has no room for it.
        """
        if size < MIN_SIZE:
            raise ValueError(f"a ring needs at least {MIN_SIZE} bytes, not {size}")
        size = -(-size // ALIGN) * ALIGN
        path = _path(name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Reserve the memory now: a full /dev/shm fails here, not with SIGBUS at a write.
            os.posix_fallocate(fd, 0, size)
            segment = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, size, segment)

    @property
    def in_use(self) -> int:
        """The bytes the ring cannot hand out now: live slots, freed slots still behind
        a live one, and the end's space skipped at a wrap."""
        return self._in_use

    @property
    def slots(self) -> int:
        """Slots allocated and not freed yet."""
        return len(self._live)

    def capacity_for(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` could ever fit (in an empty ring)."""
        return nbytes >= 0 and _slot_bytes(nbytes) <= self.size

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new slot for a chunk of up to ``nbytes``, or ``None`` if the
        ring has no room for it until earlier slots are freed.

        Raises:
          ValueError: a chunk of ``nbytes`` can never fit this ring.
          RingError: the ring is closed.
        """
        self._segment()
        if nbytes < 0:
            raise ValueError(f"a chunk has a size of at least 0 bytes, not {nbytes}")
        if not self.capacity_for(nbytes):
            raise ValueError(
                f"a chunk of {nbytes} bytes needs a slot of {_slot_bytes(nbytes)} bytes; "
                f"ring {self.name} holds {self.size} bytes"
            )
        need = _slot_bytes(nbytes)
        head = self._head
        if self._slots:
            tail = self._slots[0].offset
            if head > tail:  # one run [tail, head): room at [head, size), then [0, tail)
                if head + need > self.size:
                    if need > tail:
                        return None
                    skipped = self.size - head  # held by the slot before, until it is freed
                    self._slots[-1].held += skipped
                    self._in_use += skipped
                    head = 0
            elif head + need > tail:  # wrapped, [tail, size) and [0, head): room at [head, tail)
                return None
        slot = _Slot(head, need, nbytes)
        self._slots.append(slot)
        self._live[head] = slot
        self._head = head + need
        self._in_use += need
        return head

    def write(self, offset: int, tag: int, data: bytes | bytearray | memoryview) -> None:
        """Write the header (``tag`` and the length of ``data``) and ``data`` into the
        slot at ``offset``.

        Raises:
          ValueError: no slot of this ring is allocated at ``offset``, ``data`` is
              bigger than the slot was allocated for, or ``tag`` is no u64.
          RingError: the ring is closed.
        """
        segment = self._segment()
        slot = self._live.get(offset)
        if slot is None:
            raise ValueError(f"ring {self.name} has no slot allocated at offset {offset}")
        if not 0 <= tag <= _MAX_TAG:
            raise ValueError(f"a tag is an unsigned 64-bit integer, not {tag}")
        with memoryview(data) as view:
            nbytes = view.nbytes
            if nbytes > slot.nbytes:
                raise ValueError(
                    f"{nbytes} bytes do not fit the slot at offset {offset} of ring "
                    f"{self.name}, allocated for {slot.nbytes}"
                )
            start = offset + HEADER
            segment[start : start + nbytes] = view
        _HEADER.pack_into(segment, offset, tag, nbytes)

    def free(self, offset: int) -> None:
        """Give back the slot at ``offset``. Its space is handed out again once every
        slot allocated before it is freed too.

        Raises:
          ValueError: no slot of this ring is allocated at ``offset`` (or it was freed).
        """
        slot = self._live.pop(offset, None)
        if slot is None:
            raise ValueError(f"ring {self.name} has no slot allocated at offset {offset}")
        _HEADER.pack_into(self._segment(), offset, *_FREED)
        slot.freed = True
        slots = self._slots
        while slots and slots[0].freed:
            self._in_use -= slots.popleft().held
        if not slots:
            self._head = 0

    def free_all(self) -> None:
        """Free every slot (the reader is gone)."""
        if self._map is not None:
            for offset in self._live:
                _HEADER.pack_into(self._map, offset, *_FREED)
        self._slots.clear()
        self._live.clear()
        self._head = self._in_use = 0

    def close(self) -> None:
        """Unmap the ring and unlink its name. Idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None
            _shm.unlink(self.name)
        self.free_all()

    def _segment(self) -> mmap.mmap:
        if self._map is None:
            raise RingError(f"ring {self.name} is closed")
        return self._map

    def __repr__(self) -> str:
        return f"<RingWriter {self.name} size={self.size} in_use={self._in_use}>"


@final
class RingReader:
    """The reading worker's side: maps an existing ring by name, reads slots."""

    def __init__(self, name: str, segment: mmap.mmap) -> None:
        self.name = name
        self.size = len(segment)
        self._map: mmap.mmap | None = segment

    @classmethod
    def open(cls, name: str) -> RingReader:
        """Map the ring ``name``, read-only.

        Raises:
          FileNotFoundError: there is no such ring (any more).
          RingError: the file is too small or misshapen to be a ring.
        """
        fd = os.open(_path(name), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < MIN_SIZE or size % ALIGN:
                raise RingError(f"{name} is not a ring: {size} bytes")
            segment = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, segment)

    def read(self, offset: int, tag: int, size: int) -> bytes:
        """Copy out the ``size`` bytes of the chunk ``tag`` in the slot at ``offset``.

        Raises:
          RingError: the slot holds another tag or another size (a stale or foreign
              slot), ``offset`` is no slot of this ring, or the ring is closed.
        """
        segment = self._map
        if segment is None:
            raise RingError(f"ring {self.name} is closed")
        if offset % ALIGN or not 0 <= offset <= self.size - HEADER:
            raise RingError(f"offset {offset} is no slot of ring {self.name}")
        found_tag, found_size = _HEADER.unpack_from(segment, offset)
        if found_tag != tag or found_size != size:
            raise RingError(
                f"the slot at offset {offset} of ring {self.name} holds tag {found_tag:#x} "
                f"({found_size} bytes), not tag {tag:#x} ({size} bytes)"
            )
        start = offset + HEADER
        if start + size > self.size:  # a torn header; a writer never writes one
            raise RingError(f"the slot at offset {offset} of ring {self.name} overruns it")
        return segment[start : start + size]

    def close(self) -> None:
        """Unmap the ring (never unlink it). Idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None

    def __repr__(self) -> str:
        return f"<RingReader {self.name} size={self.size}>"
