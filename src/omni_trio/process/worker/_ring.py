"""A shared-memory ring for big chunks: one per edge, from one sending worker to one
reading worker, mapped once and written and read in place.

The ring is a file in :data:`_shm.SHM_DIR` of ``size`` bytes (a multiple of
:data:`ALIGN`), named by the caller with its pipeline's prefix, so
:func:`_shm.sweep` frees it if its owner dies. The :class:`RingWriter` creates it,
hands out slots, and unlinks it when it closes; each :class:`RingReader` maps it by
name and never unlinks it (a mapping outlives the name, so reading after the unlink
still works). No ``multiprocessing.shared_memory`` and no resource tracker: a plain
``open``, ``posix_fallocate`` (which reserves the memory, so a full ``/dev/shm`` fails
the create rather than a later write, with SIGBUS) and ``mmap`` (``_shm.SHM``). A
simulated pipeline's rings are buffers of its one process instead
(``_shm.MemorySegments``): the same ring, the same allocator.

A slot starts at a multiple of :data:`ALIGN` (64 bytes, a cache line) with a 16-byte
header -- the chunk's tag (an opaque u64 the caller derives from its request and
sequence number) and its length, both little-endian u64 -- and the data right after
it; the slot is rounded up to the next multiple of :data:`ALIGN`. :meth:`RingReader.read`
checks both header fields, so a stale or foreign slot is never read as someone else's
chunk; a freed slot's header is overwritten at once (tag 0, size 2**64 - 1), so not
even its own reader can read it again while its bytes are being reused.

The allocator lives in the writer's process alone (the reader frees a slot by telling
the writer, through the caller's own messages). Slots are handed out at the head, one
after the other, wrapping at the end (a slot never straddles it: one that does not fit
before the end starts at offset 0); frees may come in any order, and a freed slot's
space is free again at once, merged with the free space around it. So a slot that is
never freed holds its own bytes and no more: the slots around it are reused while it
stays (a FIFO ring would stop at it). The head goes on from the last slot handed out
to the first free run of space after it that fits, so a reader that frees slots in
order sees them cycle through the whole ring. An empty ring starts again at offset 0,
so a chunk that fits the ring at all fits an empty one.
"""

from __future__ import annotations

import struct
from bisect import bisect_left, bisect_right

from ..._util import final
from . import _shm

__all__ = ["ALIGN", "HEADER", "MIN_SIZE", "RingError", "RingReader", "RingWriter", "slot_bytes"]

#: Slots start at multiples of this (bytes).
ALIGN = 64
_HEADER = struct.Struct("<QQ")  # tag, length of the data
#: The bytes of a slot's header, before its data.
HEADER = _HEADER.size
#: The smallest ring, in bytes: one page.
MIN_SIZE = 4096
_MAX_TAG = 2**64 - 1
_FREED = (0, 2**64 - 1)  # the header of a freed slot: a size no read asks for


class RingError(Exception):
    """A slot does not hold what its reader expected (wrong tag or size), or the ring
    is gone (closed)."""


def slot_bytes(nbytes: int) -> int:
    """The bytes a slot for an ``nbytes`` chunk takes: header and data, aligned."""
    return -(-(HEADER + nbytes) // ALIGN) * ALIGN


def _check_name(name: str) -> None:
    if not name or "/" in name:
        raise ValueError(f"a ring's name must be a non-empty file name, not {name!r}")


class _Slot:
    __slots__ = ("held", "nbytes")

    def __init__(self, held: int, nbytes: int) -> None:
        self.held = held  # the bytes it keeps from the ring: header and data, aligned
        self.nbytes = nbytes  # the most data it takes


@final
class RingWriter:
    """The sending worker's side: creates the segment, allocates and writes slots,
    and unlinks it at :meth:`close`."""

    def __init__(
        self, name: str, size: int, segment: _shm.Segment, segments: _shm.Segments
    ) -> None:
        self.name = name
        self.size = size
        self._map: _shm.Segment | None = segment
        self._segments = segments
        self._live: dict[int, _Slot] = {}  # offset -> not yet freed slot
        # The free runs of space, apart (two that touch are merged): where each
        # starts, in order, and where it ends.
        self._starts: list[int] = [0]
        self._ends: dict[int, int] = {0: size}
        self._head = 0  # where the next slot goes, if it fits
        self._in_use = 0

    @classmethod
    def create(cls, name: str, size: int, segments: _shm.Segments = _shm.SHM) -> RingWriter:
        """Create and map a ring of ``size`` usable bytes (rounded up to a multiple of
        :data:`ALIGN`) named ``name`` in ``segments`` (by default files in
        :data:`_shm.SHM_DIR`).

        Raises:
          ValueError: ``size`` is below :data:`MIN_SIZE`, or ``name`` is no file name.
          FileExistsError: a segment of that name exists already.
          OSError: the shared-memory file system has no room for it.
        """
        if size < MIN_SIZE:
            raise ValueError(f"a ring needs at least {MIN_SIZE} bytes, not {size}")
        size = -(-size // ALIGN) * ALIGN
        _check_name(name)
        segment = segments.create(name, size)
        return cls(name, size, segment, segments)

    @property
    def in_use(self) -> int:
        """The bytes of the slots allocated and not freed yet (headers and alignment
        included). The rest is free, though maybe not in one run."""
        return self._in_use

    @property
    def slots(self) -> int:
        """Slots allocated and not freed yet."""
        return len(self._live)

    def capacity_for(self, nbytes: int) -> bool:
        """Whether a chunk of ``nbytes`` could ever fit (in an empty ring)."""
        return nbytes >= 0 and slot_bytes(nbytes) <= self.size

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
                f"a chunk of {nbytes} bytes needs a slot of {slot_bytes(nbytes)} bytes; "
                f"ring {self.name} holds {self.size} bytes"
            )
        need = slot_bytes(nbytes)
        offset = self._fit(need)
        if offset is None:
            return None
        self._take(offset, need)
        self._live[offset] = _Slot(need, nbytes)
        self._head = offset + need
        self._in_use += need
        return offset

    def _fit(self, need: int) -> int | None:
        """Where a slot of ``need`` bytes goes: at the head, if the free run it is in
        has room from there; else at the start of the first free run after it, going
        round, that has room."""
        starts, ends, head = self._starts, self._ends, self._head
        after = bisect_right(starts, head)  # the runs from this index start after the head
        if after and head + need <= ends[starts[after - 1]]:
            return head  # (the run before it ends after it: it is free)
        for first, stop in ((after, len(starts)), (0, after)):  # going round
            for index in range(first, stop):
                start = starts[index]
                if ends[start] - start >= need:
                    return start
        return None

    def _take(self, offset: int, need: int) -> None:
        """Take ``[offset, offset + need)`` out of the free run it is in."""
        starts, ends = self._starts, self._ends
        index = bisect_right(starts, offset) - 1
        start = starts[index]
        end = ends.pop(start)
        rest = offset + need
        if offset > start:
            ends[start] = offset
            if rest < end:
                starts.insert(index + 1, rest)
                ends[rest] = end
        elif rest < end:
            starts[index] = rest
            ends[rest] = end
        else:
            del starts[index]

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
        """Give back the slot at ``offset``: its space may be handed out again at once.

        Raises:
          ValueError: no slot of this ring is allocated at ``offset`` (or it was freed).
        """
        slot = self._live.pop(offset, None)
        if slot is None:
            raise ValueError(f"ring {self.name} has no slot allocated at offset {offset}")
        _HEADER.pack_into(self._segment(), offset, *_FREED)
        self._in_use -= slot.held
        if not self._live:
            self._empty()
            return
        starts, ends = self._starts, self._ends
        start, end = offset, offset + slot.held
        index = bisect_left(starts, start)  # the free runs before it end at or before it
        if index < len(starts) and starts[index] == end:  # merged with the run after it
            end = ends.pop(end)
            del starts[index]
        if index and ends[starts[index - 1]] == start:  # ... and the one before it
            ends[starts[index - 1]] = end
        else:
            starts.insert(index, start)
            ends[start] = end

    def _empty(self) -> None:
        self._starts = [0]
        self._ends = {0: self.size}
        self._head = self._in_use = 0

    def free_all(self) -> None:
        """Free every slot (the reader is gone)."""
        if self._map is not None:
            for offset in self._live:
                _HEADER.pack_into(self._map, offset, *_FREED)
        self._live.clear()
        self._empty()

    def close(self) -> None:
        """Unmap the ring and unlink its name. Idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None
            self._segments.unlink(self.name)
        self.free_all()

    def _segment(self) -> _shm.Segment:
        if self._map is None:
            raise RingError(f"ring {self.name} is closed")
        return self._map

    def __repr__(self) -> str:
        return f"<RingWriter {self.name} size={self.size} in_use={self._in_use}>"


@final
class RingReader:
    """The reading worker's side: maps an existing ring by name, reads slots."""

    def __init__(self, name: str, segment: _shm.Segment) -> None:
        self.name = name
        self.size = len(segment)
        self._map: _shm.Segment | None = segment

    @classmethod
    def open(cls, name: str, segments: _shm.Segments = _shm.SHM) -> RingReader:
        """Map the ring ``name`` (of ``segments``, by default :data:`_shm.SHM`),
        read-only.

        Raises:
          FileNotFoundError: there is no such ring (any more).
          RingError: the file is too small or misshapen to be a ring.
        """
        _check_name(name)
        segment = segments.open(name)
        size = len(segment)
        if size < MIN_SIZE or size % ALIGN:
            segment.close()
            raise RingError(f"{name} is not a ring: {size} bytes")
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
        data = segment[start : start + size]
        return data if type(data) is bytes else bytes(data)  # a simulation's bytearray

    def close(self) -> None:
        """Unmap the ring (never unlink it). Idempotent."""
        if self._map is not None:
            self._map.close()
            self._map = None

    def __repr__(self) -> str:
        return f"<RingReader {self.name} size={self.size}>"
