"""The shared-memory ring (``process._ring``): slots written and read in place, an
allocator that goes round the ring and reuses a freed slot's space at once (a slot
never freed holds its own bytes, no more), checks that keep a stale or foreign slot
from being read."""

from __future__ import annotations

import array
import hashlib
import itertools
import os
import random
import subprocess
import sys
import textwrap

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from omni_trio.process.worker import _shm
from omni_trio.process.worker._ring import (
    ALIGN,
    HEADER,
    MIN_SIZE,
    RingError,
    RingReader,
    RingWriter,
)


def slot_bytes(nbytes: int) -> int:
    return -(-(HEADER + nbytes) // ALIGN) * ALIGN


@pytest.fixture
def prefix():
    prefix = _shm.new_prefix()
    yield prefix
    assert _shm.listing(prefix) == [], "a test left a ring behind"


@pytest.fixture
def ring(prefix):
    writer = RingWriter.create(f"{prefix}-ring", 4096)
    reader = RingReader.open(writer.name)
    yield writer, reader
    reader.close()
    writer.close()


def fill(nbytes: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(nbytes)


# -- writing and reading ------------------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 4096, 1024 * 1024])
@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview"])
def test_a_chunk_reads_back_as_written(prefix, nbytes, kind):
    data = fill(nbytes, seed=nbytes)
    if kind == "bytearray":
        chunk = bytearray(data)
    elif kind == "memoryview":  # a window into the middle of a bigger buffer
        chunk = memoryview(b"<" * 100 + data + b">" * 100)[100 : 100 + nbytes]
    else:
        chunk = data
    with_room = 2 * 1024 * 1024
    writer = RingWriter.create(f"{prefix}-ring", with_room)
    reader = RingReader.open(writer.name)
    try:
        offset = writer.allocate(len(data))
        assert offset is not None
        assert offset % ALIGN == 0
        writer.write(offset, 7, chunk)
        assert reader.read(offset, 7, nbytes) == data
        assert writer.in_use == slot_bytes(nbytes)
        assert writer.slots == 1
    finally:
        reader.close()
        writer.close()


def test_a_typed_buffer_counts_bytes_not_items(ring):
    writer, reader = ring
    doubles = array.array("d", [1.5, -2.0, 3.25])
    offset = writer.allocate(len(doubles) * doubles.itemsize)
    writer.write(offset, 1, memoryview(doubles))
    assert reader.read(offset, 1, 24) == doubles.tobytes()


def test_writing_more_than_the_slot_was_allocated_for_is_refused(ring):
    writer, reader = ring
    offset = writer.allocate(100)
    neighbour = writer.allocate(100)
    writer.write(neighbour, 2, b"n" * 100)
    with pytest.raises(ValueError, match=r"101 bytes do not fit the slot at offset 0 .* for 100"):
        writer.write(offset, 1, b"x" * 101)
    writer.write(offset, 1, b"x" * 50)  # less is fine: the header says how much
    assert reader.read(offset, 1, 50) == b"x" * 50
    assert reader.read(neighbour, 2, 100) == b"n" * 100


READER = textwrap.dedent(
    """
    import hashlib, sys
    from omni_trio.process.worker._ring import RingError, RingReader
    reader = RingReader.open(sys.argv[1])
    print("ready", flush=True)
    for line in sys.stdin:
        offset, tag, size = map(int, line.split())
        try:
            print(hashlib.sha256(reader.read(offset, tag, size)).hexdigest(), flush=True)
        except RingError as exc:
            print(f"RingError: {exc}", flush=True)
    reader.close()
    """
)


def test_a_reader_in_another_process_reads_what_the_writer_wrote_after_it_mapped(prefix):
    writer = RingWriter.create(f"{prefix}-ring", 4 * 1024 * 1024)
    child = subprocess.Popen(
        [sys.executable, "-c", READER, writer.name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"

        def ask(offset, tag, size):
            child.stdin.write(f"{offset} {tag} {size}\n")
            child.stdin.flush()
            return child.stdout.readline().strip()

        for round_ in range(3):  # the same mapping sees each new write
            data = fill(1024 * 1024 + round_, seed=round_)
            offset = writer.allocate(len(data))
            tag = 2**64 - 1 - round_
            writer.write(offset, tag, data)
            assert ask(offset, tag, len(data)) == hashlib.sha256(data).hexdigest()
            assert ask(offset, tag - 1, len(data)).startswith("RingError: the slot at offset")
            writer.free(offset)
    finally:
        child.stdin.close()
        assert child.wait(10) == 0
        child.stdout.close()
        writer.close()


def test_reading_still_works_after_the_writer_unlinked(prefix):
    writer = RingWriter.create(f"{prefix}-ring", 4096)
    reader = RingReader.open(writer.name)
    offset = writer.allocate(5)
    writer.write(offset, 3, b"still")
    writer.close()
    assert _shm.listing(prefix) == []
    assert reader.read(offset, 3, 5) == b"still"
    reader.close()
    with pytest.raises(FileNotFoundError):
        RingReader.open(writer.name)


# -- the allocator ------------------------------------------------------------------------


def test_chunks_cycle_through_the_ring_many_times(ring):
    writer, reader = ring
    rng = random.Random(1)
    window = []  # (offset, tag, data), oldest first
    offsets = []
    for tag in range(400):
        data = fill(rng.choice([0, 1, 63, 200, 700, 1500]), seed=tag)
        while (offset := writer.allocate(len(data))) is None:
            old_offset, old_tag, old_data = window.pop(0)
            assert reader.read(old_offset, old_tag, len(old_data)) == old_data
            writer.free(old_offset)
        writer.write(offset, tag, data)
        window.append((offset, tag, data))
        offsets.append(offset)
        assert writer.in_use <= writer.size
    for offset, tag, data in window:
        assert reader.read(offset, tag, len(data)) == data
        writer.free(offset)
    assert writer.in_use == 0
    assert writer.slots == 0
    wraps = sum(later < earlier for earlier, later in itertools.pairwise(offsets))
    assert wraps > 10, "the test must go round the ring several times"


def test_space_freed_behind_a_live_slot_is_reused_at_once(ring):
    """A slot that is never freed holds its own bytes and no more: the space around
    it comes back as it is freed, neighbours merged into one run."""
    writer, _ = ring
    quarter = 1024 - HEADER  # four slots of 1024 bytes fill the ring
    offsets = [writer.allocate(quarter) for _ in range(4)]
    assert offsets == [0, 1024, 2048, 3072]
    assert writer.allocate(0) is None
    writer.free(2048)
    writer.free(1024)
    assert (writer.slots, writer.in_use) == (2, 2048)
    assert writer.allocate(2048 + 1 - HEADER) is None  # 2048 free bytes, not 2112
    assert writer.allocate(2048 - HEADER) == 1024  # the two freed slots, as one run
    writer.free(1024)
    writer.free(3072)  # merged with the run before it
    assert writer.allocate(3072 - HEADER) == 1024
    assert writer.allocate(0) is None
    writer.free(0)
    writer.free(1024)
    assert writer.in_use == 0
    assert writer.allocate(writer.size - HEADER) == 0  # the whole ring again


def test_a_reader_that_frees_in_order_sees_the_slots_go_round(ring):
    """The head goes on after the last slot, not back to the first free space: with
    every slot freed as soon as the next is made, the ring is used all the way round."""
    writer, _ = ring
    offsets = [writer.allocate(1000 - HEADER)]
    for _ in range(10):
        offsets.append(writer.allocate(1000 - HEADER))
        writer.free(offsets[-2])
    assert offsets == [0, 1024, 2048, 3072] * 2 + [0, 1024, 2048]


def test_freeing_the_earliest_slot_lets_the_head_wrap_into_it(ring):
    writer, reader = ring
    quarter = 1024 - HEADER
    offsets = [writer.allocate(quarter) for _ in range(4)]
    writer.free(offsets[0])
    assert writer.allocate(quarter + 1) is None  # needs 1088 bytes; 1024 are free
    assert writer.allocate(quarter) == 0
    writer.write(0, 9, b"wrapped")
    writer.write(offsets[1], 10, b"neighbour")
    assert reader.read(0, 9, 7) == b"wrapped"
    assert reader.read(offsets[1], 10, 9) == b"neighbour"


def test_a_slot_that_does_not_fit_before_the_end_wraps_and_the_end_stays_free(ring):
    writer, _ = ring
    quarter = 1024 - HEADER
    a, b, c = (writer.allocate(quarter) for _ in range(3))
    writer.free(a)
    writer.free(b)
    assert writer.in_use == 1024
    # 1088 bytes do not fit the 1024 at the end: the slot goes to offset 0
    assert writer.allocate(quarter + 1) == 0
    assert writer.in_use == 1024 + 1088
    assert writer.allocate(quarter) == 3072  # the end is still free, for a smaller one
    writer.free(c)
    writer.free(3072)
    assert writer.in_use == 1088
    assert writer.allocate(1024 - HEADER) == 1088


def test_a_full_ring_has_room_again_after_a_free(ring):
    writer, _ = ring
    first = writer.allocate(2000)
    second = writer.allocate(2000)
    assert writer.allocate(2000) is None
    writer.free(first)
    assert writer.allocate(2000) == first
    writer.free(second)


def test_a_chunk_that_can_never_fit_is_refused_with_both_sizes(ring):
    writer, _ = ring
    biggest = writer.size - HEADER
    assert writer.capacity_for(biggest)
    assert not writer.capacity_for(biggest + 1)
    assert not writer.capacity_for(-1)
    with pytest.raises(ValueError, match=r"4081 bytes needs a slot of 4160 bytes; .* holds 4096"):
        writer.allocate(biggest + 1)
    with pytest.raises(ValueError, match="at least 0 bytes"):
        writer.allocate(-1)
    assert writer.slots == 0
    assert writer.allocate(biggest) == 0


def test_free_all_forgets_every_slot(ring):
    writer, _ = ring
    offsets = [writer.allocate(500) for _ in range(5)]
    writer.free_all()
    assert (writer.in_use, writer.slots) == (0, 0)
    with pytest.raises(ValueError, match=f"no slot allocated at offset {offsets[1]}"):
        writer.free(offsets[1])
    assert writer.allocate(writer.size - HEADER) == 0


# -- errors -------------------------------------------------------------------------------


def test_a_slot_with_another_tag_or_size_is_not_read(ring):
    writer, reader = ring
    offset = writer.allocate(10)
    writer.write(offset, 0xABC, b"0123456789")
    with pytest.raises(RingError, match=r"holds tag 0xabc \(10 bytes\), not tag 0xabd \(10 b"):
        reader.read(offset, 0xABD, 10)
    with pytest.raises(RingError, match=r"not tag 0xabc \(9 bytes\)"):
        reader.read(offset, 0xABC, 9)
    with pytest.raises(RingError, match="offset 1 is no slot"):
        reader.read(1, 0xABC, 10)
    with pytest.raises(RingError, match="offset 4096 is no slot"):
        reader.read(4096, 0xABC, 10)


def test_a_freed_and_reused_slot_is_not_read_as_its_old_chunk(ring):
    writer, reader = ring
    offset = writer.allocate(100)
    writer.write(offset, 1, b"a" * 100)
    writer.free(offset)
    assert writer.allocate(100) == offset
    writer.write(offset, 2, b"b" * 100)
    with pytest.raises(RingError):
        reader.read(offset, 1, 100)


def test_a_freed_slot_is_not_read_even_with_its_own_tag(ring):
    writer, reader = ring
    first, second = writer.allocate(100), writer.allocate(100)
    writer.write(first, 1, b"a" * 100)
    writer.write(second, 2, b"b" * 100)
    writer.free(second)  # freed, its space not reused yet
    with pytest.raises(RingError, match=r"holds tag 0x0 \(18446744073709551615 bytes\)"):
        reader.read(second, 2, 100)
    writer.free_all()
    with pytest.raises(RingError):
        reader.read(first, 1, 100)


def test_misuse_of_the_writer_is_refused(ring):
    writer, _ = ring
    with pytest.raises(ValueError, match="no slot allocated at offset 64"):
        writer.free(64)
    with pytest.raises(ValueError, match="no slot allocated at offset 0"):
        writer.write(0, 1, b"")
    offset = writer.allocate(10)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        writer.write(offset, 2**64, b"")
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        writer.write(offset, -1, b"")
    writer.free(offset)
    with pytest.raises(ValueError, match="no slot allocated at offset 0"):
        writer.free(offset)


def test_creating_a_ring(prefix):
    with pytest.raises(ValueError, match=f"at least {MIN_SIZE} bytes, not 100"):
        RingWriter.create(f"{prefix}-small", 100)
    with pytest.raises(ValueError, match="non-empty file name"):
        RingWriter.create(f"{prefix}/x", 4096)
    writer = RingWriter.create(f"{prefix}-ring", 4097)
    assert writer.size == 4096 + ALIGN
    assert os.stat(os.path.join(_shm.SHM_DIR, writer.name)).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        RingWriter.create(writer.name, 4096)
    assert _shm.listing(prefix) == [writer.name]  # the failed create left it alone
    reader = RingReader.open(writer.name)
    assert reader.size == writer.size
    reader.close()
    assert _shm.listing(prefix) == [writer.name]  # a reader never unlinks
    writer.close()
    assert _shm.listing(prefix) == []


def test_a_ring_bigger_than_the_shared_memory_fails_at_create_not_at_a_write(prefix):
    stats = os.statvfs(_shm.SHM_DIR)
    too_big = stats.f_blocks * stats.f_frsize + 1024 * 1024  # refused before any allocation
    with pytest.raises(OSError, match="No space left"):
        RingWriter.create(f"{prefix}-huge", too_big)
    assert _shm.listing(prefix) == []


def test_a_file_that_is_no_ring_is_refused(prefix):
    path = os.path.join(_shm.SHM_DIR, f"{prefix}-odd")
    with open(path, "wb") as file:
        file.write(b"x" * 100)
    try:
        with pytest.raises(RingError, match="is not a ring: 100 bytes"):
            RingReader.open(f"{prefix}-odd")
    finally:
        os.unlink(path)
    with pytest.raises(FileNotFoundError):
        RingReader.open(f"{prefix}-missing")


def test_close_is_idempotent_and_a_closed_ring_is_gone(prefix):
    writer = RingWriter.create(f"{prefix}-ring", 4096)
    reader = RingReader.open(writer.name)
    offset = writer.allocate(3)
    writer.write(offset, 1, b"abc")
    reader.close()
    reader.close()
    with pytest.raises(RingError, match="is closed"):
        reader.read(offset, 1, 3)
    writer.close()
    writer.close()
    assert _shm.listing(prefix) == []
    assert (writer.in_use, writer.slots) == (0, 0)
    with pytest.raises(RingError, match="is closed"):
        writer.allocate(3)
    with pytest.raises(RingError, match="is closed"):
        writer.write(offset, 1, b"abc")


# -- any interleaving ---------------------------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Random allocations, writes, reads and frees (in any order) against a model of
    the live slots: they never overlap, and each reads back its own chunk."""

    @initialize(size=st.sampled_from([4096, 4096 + 64 * 7, 3 * 4096]))
    def create(self, size):
        self.prefix = _shm.new_prefix()
        self.writer = RingWriter.create(f"{self.prefix}-ring", size)
        self.reader = RingReader.open(self.writer.name)
        self.allocated = {}  # offset -> nbytes allocated for
        self.written = {}  # offset -> (tag, data)
        self.tags = 0

    @rule(data=st.data())
    def allocate(self, data):
        ring = self.writer
        nbytes = data.draw(
            st.one_of(st.integers(0, 300), st.integers(0, ring.size)), label="nbytes"
        )
        if not ring.capacity_for(nbytes):
            with pytest.raises(ValueError, match=f"a chunk of {nbytes} bytes"):
                ring.allocate(nbytes)
            return
        empty = not self.allocated and ring.in_use == 0
        offset = ring.allocate(nbytes)
        if offset is None:
            assert not empty, "an empty ring refused a chunk that fits it"
            # Refused only if no free run between the live slots has room for it.
            assert max(self.free_runs()) < slot_bytes(nbytes)
            return
        if empty:
            assert offset == 0
        assert offset not in self.allocated
        self.allocated[offset] = nbytes

    def free_runs(self):
        """The lengths of the runs of space between the live slots (and the ends)."""
        runs, end = [], 0
        for offset in sorted(self.allocated):
            runs.append(offset - end)
            end = offset + slot_bytes(self.allocated[offset])
        return [*runs, self.writer.size - end]

    @precondition(lambda self: len(self.allocated) > len(self.written))
    @rule(data=st.data())
    def write(self, data):
        offset = data.draw(st.sampled_from(sorted(self.allocated.keys() - self.written.keys())))
        nbytes = data.draw(st.integers(0, self.allocated[offset]), label="written")
        self.tags += 1
        chunk = random.Random(self.tags).randbytes(nbytes)
        self.writer.write(offset, self.tags, chunk)
        self.written[offset] = (self.tags, chunk)

    @precondition(lambda self: self.written)
    @rule(data=st.data())
    def read(self, data):
        offset = data.draw(st.sampled_from(sorted(self.written)))
        tag, chunk = self.written[offset]
        assert self.reader.read(offset, tag, len(chunk)) == chunk
        with pytest.raises(RingError):
            self.reader.read(offset, tag + 1, len(chunk))

    @precondition(lambda self: self.allocated)
    @rule(data=st.data())
    def free(self, data):
        offset = data.draw(st.sampled_from(sorted(self.allocated)))
        self.writer.free(offset)
        del self.allocated[offset]
        if offset in self.written:
            tag, chunk = self.written.pop(offset)
            with pytest.raises(RingError):
                self.reader.read(offset, tag, len(chunk))
        with pytest.raises(ValueError, match="no slot allocated"):
            self.writer.free(offset)

    @rule()
    def free_everything(self):
        for offset in sorted(self.allocated, reverse=True):  # the earliest is not first
            self.writer.free(offset)
        self.allocated.clear()
        self.written.clear()
        self.assert_empty_and_whole()

    def assert_empty_and_whole(self):
        ring = self.writer
        assert (ring.in_use, ring.slots) == (0, 0)
        biggest = ring.size - HEADER
        assert ring.allocate(biggest) == 0
        ring.write(0, 2**64 - 1, b"z" * biggest)
        assert self.reader.read(0, 2**64 - 1, biggest) == b"z" * biggest
        ring.free(0)

    @invariant()
    def live_slots_are_apart_and_read_back(self):
        if not hasattr(self, "writer"):
            return
        ring = self.writer
        end = 0
        for offset in sorted(self.allocated):
            assert offset % ALIGN == 0
            assert offset >= end, "two live slots overlap"
            end = offset + slot_bytes(self.allocated[offset])
            assert end <= ring.size
        for offset, (tag, chunk) in self.written.items():
            assert self.reader.read(offset, tag, len(chunk)) == chunk
        assert ring.slots == len(self.allocated)
        assert sum(map(slot_bytes, self.allocated.values())) == ring.in_use <= ring.size

    def teardown(self):
        if not hasattr(self, "writer"):
            return
        try:
            for offset in list(self.allocated):
                self.writer.free(offset)
            self.assert_empty_and_whole()
        finally:
            self.reader.close()
            self.writer.close()
        assert _shm.listing(self.prefix) == []


TestRingMachine = RingMachine.TestCase
