"""A sending worker's chunk links (``OutLink``), in-process, against a fake reading
worker on a real socket: where chunks travel (inline, the ring), the window and the
ring that make a sender wait, and what happens when its reader goes away."""

from __future__ import annotations

import socket
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from omni_trio.process import ReaderUnavailableError, WorkerOptions
from omni_trio.process._options import MIN_RING_BYTES
from omni_trio.process.worker import _framing as framing
from omni_trio.process.worker import _shm
from omni_trio.process.worker import _wire as wire
from omni_trio.process.worker._links import OutLink, ring_tag
from omni_trio.process.worker._ring import HEADER, RingReader
from omni_trio.process.worker._transport import listen_address

pytestmark = pytest.mark.usefixtures("prefix")


@pytest.fixture
def prefix():
    prefix = _shm.new_prefix()
    yield prefix
    _shm.sweep(prefix)


async def settle() -> None:
    """Let frames cross the socket and every task go as far as it can."""
    await trio.testing.wait_all_tasks_blocked(0.01)


class Peer:
    """The reading worker's end of one link: the frames it got, the acks it sends."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._reader = framing.FrameReader(stream, wire.DECODE_TO_READER)
        self._pending: list[object] = []

    async def frames(self, count: int) -> list[object]:
        """The next ``count`` frames."""
        with trio.fail_after(5):
            while len(self._pending) < count:
                self._pending += await self._reader.receive()
        taken, self._pending = self._pending[:count], self._pending[count:]
        return taken

    async def frame(self) -> object:
        return (await self.frames(1))[0]

    async def nothing_more(self) -> None:
        await settle()
        with trio.move_on_after(0.05):
            self._pending += await self._reader.receive()
        assert self._pending == []

    async def ack(self, counts: dict[str, int], slots: list[int] | None = None) -> None:
        await self.stream.send_all(wire.encode(wire.Ack(counts, slots or [])))
        await settle()


class Listener:
    def __init__(self, sock: trio.socket.SocketType) -> None:
        self._sock = sock

    async def accept(self) -> Peer:
        with trio.fail_after(5):
            sock, _ = await self._sock.accept()
        peer = Peer(trio.SocketStream(sock))
        assert await peer.frame() == wire.Hello(0, 1)
        return peer


@asynccontextmanager
async def listening(address: str):
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with sock:
        await sock.bind(address)
        sock.listen(8)
        yield Listener(sock)


@asynccontextmanager
async def sender(prefix: str, **init_fields):
    """Stage 0's worker #1 sending to stage 1, with one ``OutLink``; a reading worker
    listens at ``address`` (its Listener is handed back, unconnected)."""
    init = wire.Init(0, "thinker", "x:y", {}, prefix, chunks=True, targets=[1], **init_fields)
    async with trio.open_nursery() as nursery:
        link = OutLink(init, 1, nursery)
        try:
            yield link, nursery
        finally:
            link.close()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def connected(prefix: str, **init_fields):
    """A sender's link connected to a fake reading worker: ``(link, peer, nursery)``."""
    address = listen_address(prefix, 1, 1)
    async with listening(address) as listener, sender(prefix, **init_fields) as (link, nursery):
        link.route(address, False)
        peer = await listener.accept()
        try:
            yield link, peer, nursery
        finally:
            await peer.stream.aclose()


class Sends:
    """A task sending a request's chunks one by one, counting those sent."""

    def __init__(self, link: OutLink, request_id: str, chunks: list[bytes], first_seq: int = 0):
        self.link, self.request_id, self.chunks = link, request_id, chunks
        self.first_seq = first_seq
        self.done = 0
        self.error: Exception | None = None
        self.finished = trio.Event()

    async def run(self) -> None:
        try:
            for seq, chunk in enumerate(self.chunks, self.first_seq):
                await self.link.send(self.request_id, seq, memoryview(chunk))
                self.done += 1
        except Exception as exc:
            self.error = exc
        finally:
            self.finished.set()


def chunk_of(request_id: str, seq: int, size: int) -> bytes:
    return (f"{request_id}:{seq};".encode() * (size // 4 + 1))[:size]


# -- where a chunk travels ------------------------------------------------------------------


async def test_small_chunks_go_inline_and_bigger_ones_through_the_ring(prefix):
    async with connected(prefix, inline_chunk_bytes=4, ring_bytes=MIN_RING_BYTES) as (
        link,
        peer,
        _,
    ):
        for seq, data in enumerate([b"", b"tiny", b"bigger", b"tiny", b"biggest"]):
            await link.send("r", seq, memoryview(data))
        await link.end("r", 5)
        frames = await peer.frames(7)
        ring = frames[2]
        assert isinstance(ring, wire.Ring)  # announced before the first chunk in it
        # Named under its worker's generation: its stage sweeps it when it dies.
        assert ring.name.startswith(f"{prefix}-0-1-")
        big = [frames[3], frames[5]]
        assert frames[:2] == [
            wire.Chunk("r", 0, 0, data=b"", source=0),
            wire.Chunk("r", 1, 4, data=b"tiny", source=0),
        ]
        assert frames[4] == wire.Chunk("r", 3, 4, data=b"tiny", source=0)
        assert frames[6] == wire.Chunk("r", 5, eos=True, source=0)
        reader = RingReader.open(ring.name)
        try:
            for chunk, data in zip(big, [b"bigger", b"biggest"], strict=True):
                assert isinstance(chunk, wire.Chunk)
                assert (chunk.data, chunk.size, chunk.offset >= 0) == (None, len(data), True)
                assert reader.read(chunk.offset, ring_tag("r", chunk.seq), chunk.size) == data
        finally:
            reader.close()
        assert (link.chunks, link.inline, link.bytes) == (5, 3, 21)
    assert _shm.listing(prefix) == [], "the link's ring outlived it"


async def test_with_no_inline_threshold_every_chunk_goes_through_the_ring(prefix):
    async with connected(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as (
        link,
        peer,
        _,
    ):
        await link.send("r", 0, memoryview(b""))
        await link.send("r", 1, memoryview(b"x"))
        ring, *chunks = await peer.frames(3)
        assert isinstance(ring, wire.Ring)
        assert [(c.data, c.offset >= 0) for c in chunks] == [(None, True)] * 2
        assert link.inline == 0


async def test_a_chunk_bigger_than_the_ring_is_refused_naming_both_sizes(prefix):
    async with connected(prefix, ring_bytes=MIN_RING_BYTES) as (link, _, _):
        size = MIN_RING_BYTES + 1
        with pytest.raises(ValueError, match=f"a {size}-byte chunk does not fit the "):
            await link.send("r", 0, memoryview(bytes(size)))
        with pytest.raises(ValueError, match=f"{MIN_RING_BYTES}-byte ring"):
            await link.send("r", 0, memoryview(bytes(size)))


# -- what makes a sender wait ---------------------------------------------------------------


async def test_a_request_has_at_most_a_window_of_chunks_unacknowledged(prefix):
    """The sender says it waits (``Waiting``), and goes on as acknowledgements come;
    another request on the same link has a window of its own."""
    async with connected(prefix, inline_chunk_bytes=1024, window=4) as (link, peer, nursery):
        r = Sends(link, "r", [b"r"] * 6)
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 4
        assert link.waits == 1
        frames = await peer.frames(5)
        assert frames[-1] == wire.Waiting("r")
        await link.send("s", 0, memoryview(b"s"))  # not held by "r"'s window
        assert await peer.frame() == wire.Chunk("s", 0, 1, data=b"s", source=0)
        await peer.ack({"s": 1})
        assert r.done == 4  # another request's acknowledgement
        await peer.ack({"r": 1})
        assert r.done == 5
        await peer.ack({"r": 3})
        assert r.done == 6
        assert [f.seq for f in await peer.frames(3) if isinstance(f, wire.Chunk)] == [4, 5]


async def test_a_request_has_at_most_a_window_of_bytes_unacknowledged_and_one_chunk(prefix):
    async with connected(prefix, inline_chunk_bytes=1024, window_bytes=100) as (
        link,
        peer,
        nursery,
    ):
        r = Sends(link, "r", [bytes(60), bytes(60), bytes(500)])
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 1  # 120 bytes would be over 100
        await peer.ack({"r": 1})
        assert r.done == 2  # the 500-byte chunk waits for the window to be empty ...
        await peer.ack({"r": 1})
        assert r.done == 3  # ... and goes alone: a chunk is never too big for a window
        frames = await peer.frames(5)
        assert [f.size for f in frames if isinstance(f, wire.Chunk)] == [60, 60, 500]


async def test_a_full_ring_makes_its_sender_wait_for_slots(prefix):
    """The reader gives slots back as it reads, oldest first: the sender goes on one
    chunk per slot, around and around the ring, and every chunk reads back whole."""
    size = MIN_RING_BYTES // 4
    count = 12
    async with connected(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as (
        link,
        peer,
        nursery,
    ):
        r = Sends(link, "r", [chunk_of("r", seq, size) for seq in range(count)])
        nursery.start_soon(r.run)
        await settle()
        held = r.done
        assert 1 <= held < 4  # a ring of four chunks' bytes holds fewer, with headers
        assert link.waits == 1
        ring, *chunks = await peer.frames(1 + held)
        assert isinstance(ring, wire.Ring)
        await peer.ack({"r": 1})  # the count alone frees no slot
        assert r.done == held
        reader = RingReader.open(ring.name)
        try:
            for seq in range(count):  # read the oldest, give its slot back
                chunk = chunks[seq]
                sent = chunk_of("r", seq, size)
                assert reader.read(chunk.offset, ring_tag("r", seq), size) == sent
                await peer.ack({}, [chunk.offset])
                assert r.done == min(count, held + seq + 1)  # one more per slot
                chunks += await peer.frames(r.done - len(chunks))
        finally:
            reader.close()
        assert len({c.offset for c in chunks}) < count  # it went around
        assert link.waits >= count - held


async def test_every_request_waiting_for_ring_space_resumes_when_it_is_freed(prefix):
    """Two requests wait for the same full ring: freeing its slots wakes both, not
    just the last one to start waiting."""
    size = MIN_RING_BYTES // 4
    async with connected(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as (
        link,
        peer,
        nursery,
    ):
        r = Sends(link, "r", [bytes(size)] * 5)
        nursery.start_soon(r.run)
        await settle()
        held = r.done
        assert held < 4
        s = Sends(link, "s", [bytes(size)])
        nursery.start_soon(s.run)
        await settle()
        assert s.done == 0
        _, *chunks = await peer.frames(1 + held)
        await peer.ack({"r": held}, [c.offset for c in chunks])
        assert s.done == 1
        assert r.done > held
        # "r" goes on within its half of the ring, as its slots come back.
        with trio.fail_after(5):
            while not r.finished.is_set():
                chunk = await peer.frame()
                await peer.ack({chunk.request_id: 1}, [chunk.offset])
        assert (r.done, s.done, r.error, s.error) == (5, 1, None, None)


# -- the ring's half share ---------------------------------------------------------------------

#: A chunk whose slot is an eighth of a MIN_RING_BYTES ring: half the ring is four.
EIGHTH = MIN_RING_BYTES // 8 - HEADER


def slots(size: int) -> int:
    """A chunk whose slot takes ``size`` bytes of the ring."""
    return size - HEADER


@asynccontextmanager
async def ring_link(prefix: str):
    async with connected(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as linked:
        yield linked


async def test_while_two_requests_are_on_the_ring_neither_takes_more_than_half(prefix):
    async with ring_link(prefix) as (link, peer, nursery):
        await link.send("r", 0, memoryview(bytes(EIGHTH)))
        s = Sends(link, "s", [bytes(EIGHTH)] * 6)
        nursery.start_soon(s.run)
        await settle()
        assert s.done == 4  # half the ring, with three eighths of it free
        r = Sends(link, "r", [bytes(EIGHTH)] * 4, first_seq=1)
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 3  # "r" fills its half too: the ring is full
        _, *chunks = await peer.frames(1 + 1 + 4 + 3)
        of = {rid: [c.offset for c in chunks if c.request_id == rid] for rid in "rs"}
        await peer.ack({"s": 1}, of["s"][:1])
        assert (s.done, r.done) == (5, 3)  # "s" has room in its half again; "r" has not
        await peer.ack({"r": 1}, of["r"][:1])
        assert (s.done, r.done) == (5, 4)
        assert (r.error, s.error) == (None, None)


async def test_a_request_alone_takes_the_whole_ring_and_gives_way_to_the_next(prefix):
    """Alone, a request fills the ring; once another waits for room, the slots that
    come back go to it, until the first is down to its half."""
    async with ring_link(prefix) as (link, peer, nursery):
        r = Sends(link, "r", [bytes(EIGHTH)] * 10)
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 8  # all of it
        s = Sends(link, "s", [bytes(EIGHTH)] * 2)
        nursery.start_soon(s.run)
        await settle()
        assert s.done == 0
        _, *chunks = await peer.frames(1 + 8)
        for done, chunk in enumerate(chunks[:2], 1):
            await peer.ack({"r": 1}, [chunk.offset])
            assert (r.done, s.done) == (8, done)  # not back to "r": it holds 7 eighths
        for chunk in chunks[2:4]:
            await peer.ack({"r": 1}, [chunk.offset])
            assert r.done == 8  # holding four: its half
        await peer.ack({"r": 1}, [chunks[4].offset])
        assert r.done == 9  # holding three: one more


async def test_a_chunk_waiting_for_room_in_its_share_holds_no_other_request_back(prefix):
    async with ring_link(prefix) as (link, peer, nursery):
        for seq in range(6):  # six eighths, then released: their slots come back later
            await link.send("a", seq, memoryview(bytes(EIGHTH)))
        link.release("a")
        r = Sends(link, "r", [bytes(slots(3 * MIN_RING_BYTES // 8))])  # within its half
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 0  # two eighths are free; it needs three
        with trio.fail_after(1):
            await link.send("s", 0, memoryview(bytes(EIGHTH)))  # room for it: it goes
        assert r.done == 0
        _, *chunks, drop, _ = await peer.frames(1 + 6 + 1 + 1)
        assert drop == wire.Drop("a")
        await peer.ack({"a": 3}, [c.offset for c in chunks[:3]])
        assert r.done == 1
        frame = await peer.frame()
        assert (frame.request_id, frame.offset) == ("r", 0)


async def test_a_request_keeps_its_share_between_two_chunks_until_its_stream_ends(prefix):
    """A request is on the ring from its first chunk for it to its end of stream, even
    while it holds no slot: another does not take the whole ring meanwhile."""
    async with ring_link(prefix) as (link, peer, nursery):
        await link.send("s", 0, memoryview(bytes(EIGHTH)))
        _, chunk = await peer.frames(2)
        await peer.ack({"s": 1}, [chunk.offset])  # "s" holds nothing now
        r = Sends(link, "r", [bytes(EIGHTH)] * 8)
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 4
        await link.end("s", 1)
        await settle()
        assert r.done == 8  # alone: all of it


async def test_a_released_request_leaves_the_ring_to_the_other(prefix):
    async with ring_link(prefix) as (link, _, nursery):
        await link.send("s", 0, memoryview(bytes(EIGHTH)))
        r = Sends(link, "r", [bytes(EIGHTH)] * 8)
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 4
        link.release("s")
        await settle()
        assert r.done == 7  # alone: the rest (the released slot comes back when acked)


async def test_a_chunk_bigger_than_half_the_ring_waits_until_its_request_is_alone(prefix):
    async with ring_link(prefix) as (link, peer, nursery):
        await link.send("s", 0, memoryview(bytes(EIGHTH)))
        r = Sends(link, "r", [bytes(slots(5 * MIN_RING_BYTES // 8))])
        nursery.start_soon(r.run)
        await settle()
        assert r.done == 0  # there is room, but it would hold more than half
        _, chunk = await peer.frames(2)
        await peer.ack({"s": 1}, [chunk.offset])
        assert r.done == 1


# -- a reader with no worker ---------------------------------------------------------------


async def test_a_sender_waits_for_a_worker_at_most_its_readers_startup_timeout(prefix, mock_clock):
    """Counted from when the link lost its reader (or started without one): a reader
    back within it gets the chunks that waited; one that is not fails the sends, and
    the ends of stream, naming the reading stage."""
    # Virtual time over real sockets: jump only once every task has waited a real
    # moment, so that bytes in flight arrive before a deadline is jumped to.
    mock_clock.autojump_threshold = 0.05
    assert WorkerOptions().startup_timeout == wire.STARTUP_TIMEOUT  # its fallback
    first, second = listen_address(prefix, 1, 1), listen_address(prefix, 1, 2)
    fields = {
        "inline_chunk_bytes": 1024,
        "target_labels": {1: "stage 1 (talker)"},
        "target_startup_timeouts": {1: 30.0},
    }
    async with sender(prefix, **fields) as (link, nursery), listening(second) as two:
        a = Sends(link, "a", [b"a"])
        nursery.start_soon(a.run)
        await trio.sleep(29)
        assert a.done == 0
        async with listening(first) as one:
            link.route(first, False)
            peer = await one.accept()
            assert await peer.frame() == wire.Chunk("a", 0, 1, data=b"a", source=0)
            assert (a.done, a.error) == (1, None)
        await peer.stream.aclose()  # the reader dies, its address with it
        lost = trio.current_time()
        await trio.sleep(20)
        b = Sends(link, "b", [b"b"])
        nursery.start_soon(b.run)
        await b.finished.wait()
        assert trio.current_time() - lost == pytest.approx(30, abs=0.5)
        assert isinstance(b.error, ReaderUnavailableError)
        message = (
            "stage 1 (talker) has no worker: it did not come back within 30 s (startup_timeout)"
        )
        assert str(b.error) == message
        with pytest.raises(ReaderUnavailableError, match=r"^stage 1 \(talker\) has no worker"):
            await link.end("a", 1)  # at once: it is still gone
        assert trio.current_time() - lost == pytest.approx(30, abs=0.5)
        link.route(second, False)  # back, later: the next chunks go to it
        peer = await two.accept()
        await link.send("c", 0, memoryview(b"c"))
        assert await peer.frames(2) == [
            wire.Lost("a", "stage 1's worker died with its chunks", source=0),  # not released
            wire.Chunk("c", 0, 1, data=b"c", source=0),
        ]
        await peer.stream.aclose()


async def test_a_sender_with_no_reader_waits_for_a_route_and_a_gone_reader_drops(prefix):
    address = listen_address(prefix, 1, 1)
    async with (
        listening(address) as listener,
        sender(prefix, inline_chunk_bytes=1024) as (link, nursery),
    ):
        r = Sends(link, "r", [b"a", b"b"])
        nursery.start_soon(r.run)
        await settle()
        assert (r.done, link.waits) == (0, 1)  # not routed yet
        link.route("", False)  # the stage has no worker right now
        await settle()
        assert r.done == 0
        link.route(address, False)
        peer = await listener.accept()
        assert await peer.frames(2) == [
            wire.Chunk("r", 0, 1, data=b"a", source=0),
            wire.Chunk("r", 1, 1, data=b"b", source=0),
        ]
        link.route("", True)  # gone: there will be no worker again
        assert link.gone
        await link.send("r", 2, memoryview(b"c"))  # dropped, at once
        await link.end("r", 3)
        with pytest.raises(EOFError):  # its connection is closed, nothing more on it
            await peer.frame()
        await peer.stream.aclose()


async def test_the_end_of_a_stream_returns_once_it_is_written(prefix):
    """``end`` returns only when its frame is in the socket: a sender that dies
    right after its completion still delivered its whole stream."""
    big = 1 << 20
    async with connected(prefix, inline_chunk_bytes=big, window_bytes=16 * big, window=64) as (
        link,
        peer,
        nursery,
    ):
        for seq in range(6):  # more than the socket holds: queued in the writer
            await link.send("r", seq, memoryview(bytes(big)))
        ended = trio.Event()

        async def end():
            await link.end("r", 6)
            ended.set()

        nursery.start_soon(end)
        await settle()
        assert not ended.is_set()  # the reader reads nothing: it cannot be written
        frames = await peer.frames(7)
        assert frames[-1] == wire.Chunk("r", 6, eos=True, source=0)
        with trio.fail_after(5):
            await ended.wait()


# -- releases and readers that go away -----------------------------------------------------


async def test_a_released_request_is_dropped_at_its_reader_and_its_acks_ignored(prefix):
    async with connected(prefix, inline_chunk_bytes=1024, window=2) as (link, peer, _):
        await link.send("r", 0, memoryview(b"a"))
        link.release("r")
        link.release("never-sent")  # nothing to tell
        assert await peer.frames(2) == [wire.Chunk("r", 0, 1, data=b"a", source=0), wire.Drop("r")]
        await peer.ack({"r": 1, "unknown": 3})  # late, or never ours: ignored
        await peer.nothing_more()
        assert link.usage() == (0, 0, 0, 0)  # nothing of it is held
        with trio.CancelScope() as released:  # its engine ended after its release, without
            released.cancel()  # a checkpoint: its end of stream is not written again
            await link.end("r", 1)
        await peer.nothing_more()
        assert link.usage() == (0, 0, 0, 0)
        # A reused id starts with a whole window.
        await link.send("r", 0, memoryview(b"a"))
        await link.send("r", 1, memoryview(b"b"))
        assert link.waits == 0


async def test_a_readers_successor_hears_which_requests_went_with_it(prefix):
    """The reading worker dies: the sender drops its ring and waits; connected to the
    next worker, it says first which unreleased requests had chunks in the dead one
    (and a fresh ring replaces the old)."""
    first, second = listen_address(prefix, 1, 1), listen_address(prefix, 1, 2)
    async with (
        listening(first) as one,
        listening(second) as two,
        sender(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as (link, nursery),
    ):
        link.route(first, False)
        peer = await one.accept()
        await link.send("a", 0, memoryview(b"a"))
        await link.send("b", 0, memoryview(b"b"))
        await link.end("ended", 0)
        link.release("b")
        old_ring, *_ = await peer.frames(5)
        assert _shm.listing(prefix) == [old_ring.name]
        await peer.stream.aclose()  # it dies
        await settle()
        assert _shm.listing(prefix) == [], "the dead reader's ring is freed"

        c = Sends(link, "c", [b"c"])
        nursery.start_soon(c.run)
        await settle()
        assert c.done == 0  # no worker to send to
        link.route("", False)  # the orchestrator: it is gone, the next is coming
        link.route(second, False)
        peer = await two.accept()
        lost = "stage 1's worker died with its chunks"
        frames = await peer.frames(4)
        assert frames[:2] == [wire.Lost("a", lost, source=0), wire.Lost("ended", lost, source=0)]
        new_ring = frames[2]
        assert isinstance(new_ring, wire.Ring)
        assert new_ring.name != old_ring.name
        assert _shm.listing(prefix) == [new_ring.name]
        assert c.done == 1
        await peer.stream.aclose()


async def test_closing_a_link_frees_its_ring_and_drops_what_follows(prefix):
    async with connected(prefix, inline_chunk_bytes=0, ring_bytes=MIN_RING_BYTES) as (
        link,
        peer,
        _,
    ):
        await link.send("r", 0, memoryview(b"a"))
        await peer.frames(2)
        assert len(_shm.listing(prefix)) == 1
        link.close()
        assert _shm.listing(prefix) == []
        await link.send("r", 1, memoryview(b"b"))
        assert link.chunks == 1
