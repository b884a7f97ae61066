"""The worker's request bookkeeping and its reading end of chunk links, in-process:
the races a real process only hits now and then, made to happen every time.

A ``Worker`` is built bare -- no control connection, no listener: the test feeds
it control messages (``handle``) and link frames (``on_link_frame``) as an upstream
worker would send them, reads the ``Ack`` frames it queues on the link, and gives it
fake outgoing links that record what its engine sends downstream.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.process import Last
from omni_trio.process.worker import _framing as framing
from omni_trio.process.worker import _shm
from omni_trio.process.worker import _wire as wire
from omni_trio.process.worker._links import InLink, ring_tag
from omni_trio.process.worker._ring import RingWriter
from omni_trio.process.worker._transport import listen_address
from omni_trio.process.worker._worker import EARLY_WINDOWS, Worker
from process_engines import relay

#: A small window: acknowledgements go in batches of half of it.
WINDOW = 8
#: What a request not running here may have held for its Submit, in chunks.
EARLY = EARLY_WINDOWS * WINDOW
RING_BYTES = 64 * 1024


class FakeOutLink:
    """A downstream link that records what the engine sends on it."""

    def __init__(self, target: int = 2) -> None:
        self.target = target
        self.sent: list[tuple[str, int, bytes]] = []
        self.ended: list[tuple[str, int]] = []
        self.released: list[str] = []
        self.routes: list[tuple[str, bool]] = []
        self.closed = False

    async def send(self, request_id: str, seq: int, view: memoryview, life: int = 0) -> None:
        await trio.lowlevel.checkpoint()
        self.sent.append((request_id, seq, bytes(view)))

    async def end(self, request_id: str, count: int, life: int = 0) -> None:
        await trio.lowlevel.checkpoint()
        self.ended.append((request_id, count))

    def route(self, address: str, gone: bool) -> None:
        self.routes.append((address, gone))

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def close(self) -> None:
        self.closed = True

    def usage(self) -> tuple[int, int, int, int]:
        return 0, 0, 0, 0  # a fake holds nothing


@pytest.fixture
def prefix():
    """A shared-memory prefix for the test's rings, all swept afterwards."""
    prefix = _shm.new_prefix()
    yield prefix
    _shm.sweep(prefix)


def make_worker(
    prefix: str, engine=None, *, window: int = WINDOW, completion_delay: float = 0.0
) -> Worker:
    """Stage 1 of three: it reads stage 0's chunks and sends chunks to stage 2 (a
    :class:`FakeOutLink`, ``worker.outlinks[2, 0]``); ``relay`` by default."""
    init = wire.Init(
        1,
        "talker",
        "process_engines:relay",
        {},
        prefix,
        completion_delay=completion_delay,
        chunks=True,
        listen=True,
        targets=[2],
        window=window,
    )
    worker = Worker(init, relay() if engine is None else engine, framing.FrameWriter(_sink()))
    worker.outlinks = {(2, 0): FakeOutLink(2)}  # type: ignore[dict-item]
    return worker


def _sink() -> trio.testing.MemorySendStream:
    return trio.testing.MemorySendStream()


class Upstream:
    """Stage 0's worker as the worker under test sees it: the link its frames come
    on (the ``Ack`` frames owed to it queue there) and its ring."""

    def __init__(self, worker: Worker, prefix: str, *, generation: int = 1) -> None:
        self.worker = worker
        self.link = InLink(_sink(), worker.init.window)
        self.ring_name = f"{prefix}-0-{generation}-ring1-1"
        self.ring: RingWriter | None = None
        self.slots_freed: list[int] = []

    def send(self, *frames: object) -> None:
        for frame in frames:
            self.worker.on_link_frame(self.link, frame)

    def inline(
        self, request_id: str, seq: int, data: bytes = b"chunk", *, life: int = 0
    ) -> wire.Chunk:
        return wire.Chunk(request_id, seq, len(data), data=data, life=life)

    def in_ring(
        self, request_id: str, seq: int, data: bytes = b"chunk", *, tag: int | None = None
    ) -> wire.Chunk:
        """A chunk written into the ring (created, and announced, at the first)."""
        if self.ring is None:
            self.ring = RingWriter.create(self.ring_name, RING_BYTES)
            self.send(wire.Ring(self.ring_name))
        offset = self.ring.allocate(len(data))
        assert offset is not None, "the test's ring is full"
        self.ring.write(offset, ring_tag(request_id, seq) if tag is None else tag, data)
        return wire.Chunk(request_id, seq, len(data), offset=offset)

    def acks(self) -> list[wire.Ack]:
        """The acknowledgements queued since the last call; their ring slots are
        freed, as the sender would."""
        frames = []
        for ack in wire.decode_frames(self.link.writer.take(), wire.DECODE_TO_SENDER):
            for offset in ack.slots:
                assert self.ring is not None
                self.ring.free(offset)
                self.slots_freed.append(offset)
            frames.append(ack)
        return frames

    def acked(self) -> dict[str, int]:
        """The chunks acknowledged since the last call, per request."""
        counts: dict[str, int] = {}
        for ack in self.acks():
            for request_id, count in ack.counts.items():
                counts[request_id] = counts.get(request_id, 0) + count
        return counts

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()


@pytest.fixture
def upstream(prefix):
    """Makes ``Upstream``s of a worker; closes their rings afterwards."""
    made: list[Upstream] = []

    def make(worker: Worker, **kwargs) -> Upstream:
        made.append(Upstream(worker, prefix, **kwargs))
        return made[-1]

    yield make
    for each in made:
        each.close()


def eos(request_id: str, count: int, *, life: int = 0) -> wire.Chunk:
    return wire.Chunk(request_id, count, eos=True, life=life)


def sent(worker: Worker) -> list[object]:
    """The control frames the worker queued so far, decoded."""
    return wire.decode_frames(worker.control.take(), wire.DECODE_FROM_WORKER)


def failures(worker: Worker) -> dict[str, str]:
    return {f.request_id: f.error for f in sent(worker) if type(f) is wire.Failed}


def failure(worker: Worker, request_id: str) -> str | None:
    return failures(worker).get(request_id)


def downstream(worker: Worker) -> FakeOutLink:
    link = worker.outlinks[2, 0]
    assert isinstance(link, FakeOutLink)
    return link


# -- requests and their chunks: the races -------------------------------------------------


async def test_a_chunk_taken_as_the_request_is_released_is_not_passed_on(prefix, upstream):
    """The engine was already woken with an upstream chunk when Abort and Release
    arrived: its resumed ``io.send`` must send nothing more, and the chunk's ring
    slot comes back all the same."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()  # the engine waits for chunks
        chunk = up.in_ring("r", 0)
        up.send(chunk)  # wakes it, with a chunk
        worker.handle(wire.Abort("r"), nursery)  # ... and before it runs:
        worker.handle(wire.Release("r"), nursery)
        await trio.testing.wait_all_tasks_blocked()
    assert downstream(worker).sent == []
    assert downstream(worker).released == ["r"]
    assert up.acks() == [wire.Ack({"r": 1}, [chunk.offset])]
    assert worker.requests == {}


async def test_chunks_after_the_release_are_dropped_and_acknowledged(prefix, upstream):
    """Data can trail control: a chunk for a released request must not bring it back,
    and its sender gets its window and its ring slot back."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        worker.handle(wire.Release("r"), nursery)
        late = up.in_ring("r", 0)
        up.send(late, up.inline("r", 1), eos("r", 2))
        await trio.testing.wait_all_tasks_blocked()
        assert worker.requests == {}
        # each acknowledged at once: no chunk of it will be read here any more, so
        # nothing of it stays owed (waiting for a batch that may never come)
        assert up.acks() == [wire.Ack({"r": 1}, [late.offset]), wire.Ack({"r": 1}, [])]
        assert up.link.owed == 0
    assert downstream(worker).sent == []


async def test_chunks_may_arrive_before_their_submit(prefix, upstream):
    """No engine reads them yet: they are taken at once (copied out of the ring, the
    slot given back) and kept for the submit to come."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        first = up.in_ring("r", 0, b"first")
        up.send(first, up.inline("r", 1, b"second"))
        assert "r" in worker.requests  # kept for the submit to come
        assert up.acks() == [wire.Ack({"r": 1}, [first.offset])]  # the slot, at once
        # The sender reuses the slot: what the request reads is what was sent.
        up.send(up.in_ring("other", 0, b"XXXXX"))
        worker.handle(wire.Submit("r", None), nursery)
        up.send(eos("r", 2))
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [
            ("FIRST", False),
            ("SECOND", False),
            (None, True),
        ]
        assert downstream(worker).sent == [("r", 0, b"first"), ("r", 1, b"second")]
        worker.release_all()


async def test_released_ids_are_remembered_up_to_a_bound_and_a_new_submit_forgets_one(
    monkeypatch, prefix, upstream
):
    monkeypatch.setattr("omni_trio.process.worker._worker.REMEMBER_RELEASED", 2)
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        for rid in ("a", "b", "c"):
            worker.release(rid)
        assert list(worker.released) == ["b", "c"]  # "a" forgotten: bounded
        worker.handle(wire.Submit("c", None), nursery)  # "c" is reused: a new life
        assert "c" not in worker.released
        up.send(up.inline("c", 0))
        await trio.testing.wait_all_tasks_blocked()
        assert downstream(worker).sent == [("c", 0, b"chunk")]  # it got the chunk
        worker.release_all()


async def test_a_reused_id_never_reads_the_chunks_of_its_earlier_life(prefix, upstream):
    """A text-only request "t" (life 1) sent the talker chunks (taken, never submitted
    there); its terminal released it at the thinker, whose ``Drop`` is on its way on
    the link when the id's next life (2) is submitted on the control connection. The
    talker reads only life 2's chunks: its earlier life's, before the submit or
    after, are dropped (and acknowledged)."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        up.send(up.inline("t", 0, b"old", life=1), eos("t", 1, life=1))
        worker.handle(wire.Submit("t", None, life=2), nursery)  # overtook the Drop
        up.send(up.inline("t", 1, b"older", life=1))  # a straggler of life 1
        up.send(wire.Drop("t", life=1), up.inline("t", 0, b"new", life=2), eos("t", 1, life=2))
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [("NEW", False), (None, True)]
        up.link.flush()
        assert up.acked() == {"t": 3}  # both of life 1's, and the one read
        worker.release_all()
        assert worker.released == {"t": 2}


async def test_a_lost_frame_fails_a_request_still_streaming(prefix, upstream):
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(up.inline("r", 0))
        await trio.testing.wait_all_tasks_blocked()  # it read and passed on chunk 0
        up.send(wire.Lost("r", "stage 1's worker died with its chunks"))
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == (
            "ChunkLostError: request 'r': stage 1's worker died with its chunks"
        )
        worker.release_all()


async def test_a_lost_frame_after_the_end_of_the_stream_changes_nothing(prefix, upstream):
    """Every chunk arrived before the loss was noticed: what was read is whole."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(up.inline("r", 0), eos("r", 1))
        up.send(wire.Lost("r", "gone"))
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [("CHUNK", False), (None, True)]
        worker.release_all()


async def test_a_lost_frame_before_the_submit_is_kept_for_it(prefix, upstream):
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        up.send(wire.Lost("r", "gone"))
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == "ChunkLostError: request 'r': gone"
        worker.release_all()


async def test_a_missing_chunk_is_an_error_not_a_gap_in_the_data(prefix, upstream):
    """Chunks carry their place in the request's stream: a reader that sees chunk 1
    without chunk 0, or an end of stream after fewer chunks than were sent, fails."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("skips", None), nursery)
        skipping = up.in_ring("skips", 1)
        up.send(skipping)
        worker.handle(wire.Submit("short", None), nursery)
        up.send(eos("short", 2))
        worker.handle(wire.Submit("gap", None), nursery)
        up.send(up.inline("gap", 0, b"a"), up.inline("gap", 2, b"c"))
        await trio.testing.wait_all_tasks_blocked()
        assert failures(worker) == {
            "skips": "ChunkLostError: request 'skips': chunk 0 of its upstream stage never arrived",
            "short": "ChunkLostError: request 'short': chunk 0 of its upstream stage never arrived",
            "gap": "ChunkLostError: request 'gap': chunk 1 of its upstream stage never arrived",
        }
        assert downstream(worker).sent == [("gap", 0, b"a")]
        worker.release_all()
    up.link.flush()
    assert up.acked() == {"skips": 1, "gap": 2}  # every chunk is given back, read or not
    assert up.slots_freed == [skipping.offset]


async def test_a_ring_slot_holding_another_requests_chunk_is_never_read_as_this_ones(
    prefix, upstream
):
    """A slot is read only as the chunk its frame names (its tag is the request's and
    the seq's): anything else fails the request, and no byte of it is passed on."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        worker.handle(wire.Submit("s", None), nursery)
        up.send(up.in_ring("r", 0, b"other's", tag=ring_tag("someone-else", 0)))
        up.send(up.in_ring("s", 0, b"next's", tag=ring_tag("s", 1)))
        await trio.testing.wait_all_tasks_blocked()
        errors = failures(worker)
        assert set(errors) == {"r", "s"}
        for request_id in ("r", "s"):
            assert errors[request_id].startswith(f"ChunkLostError: request {request_id!r}: chunk 0")
        assert downstream(worker).sent == []
        assert not [f for f in sent(worker) if type(f) is wire.Output and f.data]
        assert len(up.acks()) == 2  # the slots still come back
        worker.release_all()


async def test_a_chunk_in_a_ring_that_is_gone_fails_its_request(prefix, upstream):
    """The sender died and its ring was swept before the reader mapped it: the
    request that had chunks in it fails (naming the ring), submitted or not yet."""
    worker = make_worker(prefix)
    up = upstream(worker)
    name = f"{prefix}-0-1-ring1-1"
    async with trio.open_nursery() as nursery:
        up.send(wire.Ring(name))  # there is no such ring (any more)
        up.send(wire.Chunk("early", 0, 5, offset=0))
        worker.handle(wire.Submit("early", None), nursery)
        worker.handle(wire.Submit("r", None), nursery)
        up.send(wire.Chunk("r", 0, 5, offset=64))
        await trio.testing.wait_all_tasks_blocked()
        errors = failures(worker)
        assert set(errors) == {"early", "r"}
        for request_id, error in errors.items():
            assert error.startswith(f"ChunkLostError: request {request_id!r}: chunk 0")
            assert name in error
        worker.release_all()


async def test_a_reader_that_mapped_the_ring_still_reads_it_after_it_is_unlinked(prefix, upstream):
    """A dead sender's ring is swept; chunks of it the reader was told of stay
    readable where the reader mapped it."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        chunk = up.in_ring("r", 0, b"kept")
        _shm.unlink(up.ring_name)  # swept with its worker
        up.send(chunk, eos("r", 1))
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [("KEPT", False), (None, True)]
        worker.release_all()


# -- a link that ends ---------------------------------------------------------------------


async def test_a_link_that_ends_fails_nothing_and_what_came_on_it_is_read(prefix, upstream):
    """The upstream worker went away. Its requests still streaming were running there,
    so its stage fails them, naming it (a failure here would race that report and
    blame this stage); whatever it wrote before it went is read, a whole stream
    completes, and other links go on."""
    worker = make_worker(prefix)
    up, other = upstream(worker), upstream(worker, generation=2)
    async with trio.open_nursery() as nursery:
        for request_id in ("mid", "whole", "elsewhere"):
            worker.handle(wire.Submit(request_id, None), nursery)
        up.send(up.inline("mid", 0), up.inline("whole", 0), eos("whole", 1))
        other.send(other.inline("elsewhere", 0))
        await trio.testing.wait_all_tasks_blocked()
        worker.link_closed(up.link)
        other.send(eos("elsewhere", 1))
        await trio.testing.wait_all_tasks_blocked()
        frames = sent(worker)
        assert [f for f in frames if type(f) is wire.Failed] == []
        done = [f.request_id for f in frames if type(f) is wire.Output and f.finished]
        assert sorted(done) == ["elsewhere", "whole"]
        assert up.link.closed
        assert "mid" in worker.requests  # until its stage aborts and releases it
        worker.release_all()


# -- acknowledgements: the sender's window --------------------------------------------------


async def test_chunks_are_acknowledged_as_the_engine_reads_them_in_batches(prefix, upstream):
    """Half a window at a time; a ring slot at once (with what else is owed)."""
    held = trio.Event()

    async def reads_when_told(request, io):
        await held.wait()
        async for chunk in io:
            yield len(chunk)

    worker = make_worker(prefix, reads_when_told)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(*(up.inline("r", seq) for seq in range(WINDOW // 2 + 1)))
        await trio.testing.wait_all_tasks_blocked()
        assert up.acks() == []  # unread: nothing is acknowledged
        held.set()
        await trio.testing.wait_all_tasks_blocked()
        assert up.acks() == [wire.Ack({"r": WINDOW // 2}, [])]  # one still owed
        ring = up.in_ring("r", WINDOW // 2 + 1)
        up.send(ring)
        await trio.testing.wait_all_tasks_blocked()
        assert up.acks() == [wire.Ack({"r": 2}, [ring.offset])]
        worker.release_all()


async def test_a_waiting_sender_is_answered_at_once(prefix, upstream):
    """``Waiting``: what is owed goes now; if nothing is, the next chunk read is
    acknowledged at once."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(up.inline("r", 0))
        await trio.testing.wait_all_tasks_blocked()
        assert up.acks() == []
        up.send(wire.Waiting("r"))
        assert up.acks() == [wire.Ack({"r": 1}, [])]
        up.send(wire.Waiting("r"))  # nothing owed now ...
        assert up.acks() == []
        up.send(up.inline("r", 1))
        await trio.testing.wait_all_tasks_blocked()
        assert up.acks() == [wire.Ack({"r": 1}, [])]  # ... so the next one goes at once
        worker.release_all()


async def test_a_waiting_sender_is_answered_whatever_else_is_owed(prefix, upstream):
    """Two requests share a link: ``Waiting`` for one is not answered by the other's
    acknowledgements. The sender of "a" waits for "a"'s, and "a"'s chunks are fewer
    than half a window (its window's bytes are full): were they held back for a
    batch, neither side would move again."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("a", None), nursery)
        worker.handle(wire.Submit("b", None), nursery)
        up.send(up.inline("b", 0))
        await trio.testing.wait_all_tasks_blocked()  # "b"'s acknowledgement is owed
        up.send(wire.Waiting("a"))
        up.send(up.inline("a", 0))
        await trio.testing.wait_all_tasks_blocked()
        assert up.acked().get("a") == 1

        up.send(wire.Waiting("a"))  # nothing owed at all
        up.send(up.inline("b", 1))
        await trio.testing.wait_all_tasks_blocked()
        up.send(up.inline("a", 1))
        await trio.testing.wait_all_tasks_blocked()
        assert up.acked().get("a") == 1
        worker.release_all()


async def test_chunks_no_engine_reads_are_taken_and_acknowledged_on_arrival(prefix, upstream):
    """A text-only request's talker is never submitted: its chunks -- more than a
    window of them -- must not hold its sender up; they are acknowledged as they come
    (in batches; a ring slot at once), and its sender's ``Drop`` forgets them."""
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery():
        count = 3 * WINDOW
        up.send(*(up.inline("text", seq) for seq in range(count)))
        assert up.acked() == {"text": count}  # no engine read them
        for seq in range(count, count + 3):
            chunk = up.in_ring("text", seq)
            up.send(chunk)
            assert up.acks() == [wire.Ack({"text": 1}, [chunk.offset])]
        up.send(up.inline("text", count + 3), eos("text", count + 4), wire.Drop("text"))
        assert worker.requests == {}
        assert "text" in worker.released
        up.send(up.inline("text", count + 4))  # trailing: dropped, and acknowledged
        assert worker.requests == {}
        up.link.flush()
        assert up.acked() == {"text": 2}
        await trio.testing.wait_all_tasks_blocked()
    assert sent(worker) == []


async def test_a_drop_for_a_request_submitted_here_is_left_to_its_release(prefix, upstream):
    worker = make_worker(prefix)
    up = upstream(worker)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(up.inline("r", 0), wire.Drop("r"), eos("r", 1))
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [("CHUNK", False), (None, True)]
        assert "r" in worker.requests  # its engine ended; its release is to come
        worker.handle(wire.Release("r"), nursery)
        assert worker.requests == {}


async def test_an_unexpected_frame_on_a_link_is_a_protocol_error(prefix, upstream):
    worker = make_worker(prefix)
    up = upstream(worker)
    with pytest.raises(wire.ProtocolError, match="unexpected Hello on a chunk link"):
        up.send(wire.Hello(0, 1))


# -- what the engine sends, and its outputs -------------------------------------------------


async def test_a_last_output_is_the_completion_after_the_stream_end_and_the_delay(
    prefix, autojump_clock
):
    """``yield Last(data)``: data goes out as the completion -- after the end of the
    request's chunk stream and the completion delay, as a bare completion would -- and
    the engine is closed there: what follows the yield never runs, its finally does."""
    events = []

    async def engine(request, io):
        try:
            await io.send(b"x")
            yield "a"
            yield Last("b")
            events.append("resumed")
            yield "c"
        finally:
            events.append("closed")

    worker = make_worker(prefix, engine, completion_delay=1.0)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.sleep(0.5)
        assert [(f.data, f.finished) for f in sent(worker)] == [("a", False)]
        assert downstream(worker).ended == [("r", 1)]  # the stream's end went first
        assert events == ["closed"]
    assert trio.current_time() == 1.0
    assert [(f.data, f.finished) for f in sent(worker)] == [("b", True)]
    assert events == ["closed"]


async def test_an_engine_without_last_ends_with_a_bare_completion(prefix):
    async def engine(request, io):
        yield "a"
        yield "b"

    worker = make_worker(prefix, engine)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
    frames = sent(worker)
    assert [(f.data, f.finished) for f in frames] == [("a", False), ("b", False), (None, True)]
    assert downstream(worker).ended == [("r", 0)]


async def test_an_engine_that_yields_on_after_its_last_fails_its_request(prefix):
    """Closed after ``Last``, an engine that goes on yielding anyway is broken."""

    async def engine(request, io):
        try:
            yield Last("a")
        except GeneratorExit:
            yield "more"

    worker = make_worker(prefix, engine)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
    assert failure(worker, "r") == "RuntimeError: async generator ignored GeneratorExit"


async def test_each_chunk_goes_to_every_downstream_stage_with_its_seq(prefix):
    async def engine(request, io):
        await io.send(b"one")
        await io.send(bytearray(b"two"))
        await io.send(memoryview(b"three"))
        yield "done"

    worker = make_worker(prefix, engine)
    worker.init.targets = [2, 3]
    worker.outlinks = {(2, 0): FakeOutLink(2), (3, 0): FakeOutLink(3)}  # type: ignore[dict-item]
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
    for link in worker.outlinks.values():
        assert isinstance(link, FakeOutLink)
        assert link.sent == [("r", 0, b"one"), ("r", 1, b"two"), ("r", 2, b"three")]
        assert link.ended == [("r", 3)]


async def test_a_route_reaches_the_link_to_its_stage_only(prefix):
    worker = make_worker(prefix)
    worker.init.targets = [2, 3]
    worker.outlinks = {(2, 0): FakeOutLink(2), (3, 0): FakeOutLink(3)}  # type: ignore[dict-item]
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Route(3, "\0somewhere"), nursery)
        worker.handle(wire.Route(2, "", gone=True), nursery)
        worker.handle(wire.Route(7, "\0not-a-target"), nursery)  # not ours: ignored
    assert [link.routes for link in worker.outlinks.values()] == [
        [("", True)],
        [("\0somewhere", False)],
    ]


async def test_a_request_sends_its_chunks_to_its_replica_downstream(prefix):
    """``Submit.replicas`` picks the link of each downstream stage's replica that runs
    the request: a request's chunks go there, another request's to its own."""

    async def engine(request, io):
        await io.send(request.inputs.encode())
        yield "done"

    worker = make_worker(prefix, engine)
    replica_1 = FakeOutLink(2)
    worker.outlinks[2, 1] = replica_1  # type: ignore[assignment]
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("a", "to one", replicas={2: 1}), nursery)
        worker.handle(wire.Submit("b", "to zero"), nursery)
    assert replica_1.sent == [("a", 0, b"to one")]
    assert downstream(worker).sent == [("b", 0, b"to zero")]
    assert replica_1.ended == [("a", 1)]
    worker.release("a")
    assert "a" in replica_1.released
    assert "a" in downstream(worker).released


async def test_an_engine_is_held_while_its_outputs_wait_to_be_written(prefix):
    """The control connection is bounded: an engine whose outputs outrun it waits at
    its ``yield`` while more than ``high_water`` bytes are queued, and goes on as
    they are written."""
    size = 256 * 1024
    yielded = []
    done = trio.Event()

    async def engine(request, io):
        for i in range(16):
            yielded.append(i)
            yield "x" * size
        done.set()

    worker = make_worker(prefix, engine)  # its control writer is not running
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        queued = worker.control.queued
        assert 1 << 20 < queued <= (1 << 20) + 2 * size  # held at the high-water mark
        assert len(yielded) < 16
        nursery.start_soon(worker.control.run)
        with trio.fail_after(5):
            await done.wait()
        await trio.testing.wait_all_tasks_blocked()
        worker.control.close()
    assert worker.control.queued == 0


# -- every table is bounded, and freed -------------------------------------------------------


async def test_chunks_held_for_a_request_not_running_here_are_bounded(prefix, upstream):
    """A request not running here may have EARLY_WINDOWS windows of chunks taken and
    held for its Submit; one more, and what it held is dropped (acknowledged, as every chunk is):
    a Submit of it fails, saying so, rather than read a stream with a hole."""
    worker = make_worker(prefix)
    up = upstream(worker)
    worker.inlinks.add(up.link)
    async with trio.open_nursery() as nursery:
        up.send(*(up.inline("early", seq, life=1) for seq in range(EARLY)))
        report = worker.report(1)
        assert (report.requests, report.chunks_held) == (1, EARLY)
        assert report.chunk_bytes_held == 5 * EARLY
        assert report.chunks_waiting == EARLY
        up.send(up.inline("early", EARLY, life=1), up.inline("early", EARLY + 1, life=1))
        assert worker.requests == {}
        up.send(eos("early", EARLY + 2, life=1), wire.Drop("early", life=1))
        assert worker.report(2) == wire.Pong(2)  # every table empty
        assert up.acked() == {"early": EARLY + 2}
        worker.handle(wire.Submit("early", None, life=1), nursery)
        await trio.testing.wait_all_tasks_blocked()
    assert failure(worker, "early") == (
        "ChunkLostError: request 'early': its chunks were dropped before its Submit: more "
        f"than {EARLY} chunks or {1 << 20} bytes of it came while it was not running here"
    )
    assert downstream(worker).sent == []


async def test_what_a_dead_sender_fed_requests_not_running_here_goes_with_it(prefix, upstream):
    """A text-only request's talker is never submitted it, and the thinker that sent
    its chunks died before its ``Drop``: nothing else would free them. They go with
    the link -- a whole stream or a cut one; a Submit of one after all fails, saying
    so. A request running here, and the id's next life fed by the thinker's
    successor, are not touched."""
    worker = make_worker(prefix)
    up, successor = upstream(worker), upstream(worker, generation=2)
    worker.inlinks.update((up.link, successor.link))
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("running", None, life=1), nursery)
        up.send(up.inline("running", 0, life=1))
        up.send(up.inline("whole", 0, life=2), eos("whole", 1, life=2))
        up.send(up.inline("cut", 0, life=3))
        await trio.testing.wait_all_tasks_blocked()
        assert set(worker.requests) == {"running", "whole", "cut"}
        worker.link_closed(up.link)
        assert set(worker.requests) == {"running"}
        assert worker.report(1).chunks_held == 0
        successor.send(successor.inline("whole", 0, b"again", life=4))  # the id's next life
        worker.handle(wire.Submit("cut", None, life=3), nursery)  # its Submit came after all
        worker.handle(wire.Submit("whole", None, life=4), nursery)
        successor.send(eos("whole", 1, life=4))
        await trio.testing.wait_all_tasks_blocked()
        frames = sent(worker)
        assert {f.request_id: f.error for f in frames if type(f) is wire.Failed} == {
            "cut": "ChunkLostError: request 'cut': its chunks were dropped before its Submit: "
            "the upstream worker that sent them went away"
        }
        whole = [(f.data, f.finished) for f in frames if f.request_id == "whole"]
        assert whole == [("AGAIN", False), (None, True)]
        assert "running" in worker.requests  # its stage fails it, naming the dead worker
        worker.release_all()
        assert worker.report(2) == wire.Pong(2)


async def test_a_sender_waiting_for_a_request_that_ended_here_is_answered_and_forgotten(
    prefix, upstream
):
    """The acknowledgements owed for a request that ends here go at once; a
    ``Waiting`` that crossed its release is answered and leaves nothing behind."""
    worker = make_worker(prefix)
    up = upstream(worker)
    worker.inlinks.add(up.link)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        up.send(up.inline("r", 0))
        await trio.testing.wait_all_tasks_blocked()  # read: its acknowledgement is owed
        assert (up.acked(), worker.report(1).acks_owed) == ({}, 1)
        worker.handle(wire.Release("r"), nursery)
        assert up.acked() == {"r": 1}
        up.send(wire.Waiting("r"))  # the sender's wait crossed the release
        assert worker.report(2) == wire.Pong(2)


async def test_a_worker_that_stops_holds_nothing(prefix, upstream):
    """Its shutdown releases every request -- running, or held for a Submit -- and
    gives every chunk back (a ring slot too), on every link."""

    async def never_reads(request, io):
        await trio.sleep_forever()
        yield  # pragma: no cover

    worker = make_worker(prefix, never_reads)
    up = upstream(worker)
    worker.inlinks.add(up.link)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        chunk = up.in_ring("r", 0)
        up.send(chunk, up.inline("r", 1), up.inline("text", 0))
        await trio.testing.wait_all_tasks_blocked()
        report = worker.report(1)
        assert (report.requests, report.chunks_waiting, report.chunks_held) == (2, 3, 1)
        worker.close()
        assert worker.report(2) == wire.Pong(2)
        assert up.link.closed
        up.acks()  # what it gave back before the link closed
    assert up.slots_freed == [chunk.offset]


# -- names ----------------------------------------------------------------------------------


def test_listen_addresses_belong_to_one_worker_generation(prefix):
    """A restarted worker never listens where its predecessor did (its successor's
    senders cannot reach a dead worker's socket by mistake); the address is an
    abstract one, so nothing is left on disk."""
    assert listen_address(prefix, 1, 1) != listen_address(prefix, 1, 2)
    assert listen_address(prefix, 1, 1) != listen_address(prefix, 2, 1)
    assert listen_address(prefix, 1, 1).startswith("\0")
