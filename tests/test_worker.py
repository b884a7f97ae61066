"""The worker's request bookkeeping, in-process: the races a real process only hits
now and then, made to happen every time."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.process import Last, _shm
from omni_trio.process import _wire as wire
from omni_trio.process.worker import _Worker
from process_engines import relay


@pytest.fixture
def prefix():
    """A shared-memory prefix for the test's segments, all swept afterwards."""
    prefix = _shm.new_prefix()
    yield prefix
    _shm.sweep(prefix)


def make_worker(prefix: str) -> _Worker:
    init = wire.Init(1, "relay", "process_engines:relay", {}, prefix)
    control = wire.FrameWriter(trio.testing.MemorySendStream())
    chunks = wire.FrameWriter(trio.testing.MemorySendStream())
    return _Worker(init, relay(), control, chunks)


def upstream_chunk(prefix: str, request_id: str, seq: int, owner: str | None = None) -> wire.Chunk:
    name = f"{prefix}-0-1-9-{seq}"
    return wire.Chunk(request_id, name, _shm.create(name, owner or request_id, b"chunk"), seq)


def sent(worker: _Worker) -> list[object]:
    """The control frames the worker queued so far, decoded."""
    frames = []
    while True:
        try:
            frame = worker.control._receive.receive_nowait()
        except trio.WouldBlock:
            return frames
        frames.append(wire.DECODE_FROM_WORKER.decode(frame[4:]))


def failure(worker: _Worker, request_id: str) -> str | None:
    errors = [f.error for f in sent(worker) if type(f) is wire.Failed]
    assert len(errors) <= 1
    return errors[0] if errors else None


async def test_a_chunk_taken_as_the_request_is_released_leaves_no_segment(prefix):
    """The engine was already woken with an upstream chunk when Abort and Release
    arrived: its resumed ``io.send`` must not create a segment nobody will free."""
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()  # the engine waits for chunks
        worker.on_notices([upstream_chunk(prefix, "r", 0)])  # wakes it, with a chunk
        worker.handle(wire.Abort("r"), nursery)  # ... and before it runs:
        worker.handle(wire.Release("r"), nursery)
        await trio.testing.wait_all_tasks_blocked()
    assert _shm.listing(f"{prefix}-1-") == []
    assert worker.requests == {}


async def test_chunks_after_the_release_are_dropped(prefix):
    """Data can trail control: a chunk for a released request must not bring it back."""
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        worker.handle(wire.Release("r"), nursery)
        worker.on_notices([upstream_chunk(prefix, "r", 0)])
        await trio.testing.wait_all_tasks_blocked()
    assert worker.requests == {}


async def test_chunks_may_arrive_before_their_submit(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.on_notices([upstream_chunk(prefix, "r", 0)])
        assert "r" in worker.requests  # kept for the submit to come
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert _shm.listing(f"{prefix}-1-") == [f"{prefix}-1-1-1-0"]  # passed on
        worker.handle(wire.Release("r"), nursery)
    assert _shm.listing(f"{prefix}-1-") == []


async def test_released_ids_are_remembered_up_to_a_bound_and_a_new_submit_forgets_one(
    monkeypatch, prefix
):
    monkeypatch.setattr("omni_trio.process.worker._REMEMBER_RELEASED", 2)
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        for rid in ("a", "b", "c"):
            worker.release(rid)
        assert list(worker.released) == ["b", "c"]  # "a" forgotten: bounded
        worker.handle(wire.Submit("c", None), nursery)  # "c" is reused: a new life
        assert "c" not in worker.released
        worker.on_notices([upstream_chunk(prefix, "c", 0)])
        await trio.testing.wait_all_tasks_blocked()
        assert _shm.listing(f"{prefix}-1-") == [f"{prefix}-1-1-1-0"]  # it got the chunk
        worker.release_all()
    assert _shm.listing(f"{prefix}-1-") == []


async def test_a_lost_notice_fails_a_request_still_streaming(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        worker.on_notices([upstream_chunk(prefix, "r", 0)])
        await trio.testing.wait_all_tasks_blocked()  # it read and passed on chunk 0
        worker.on_notices([wire.Lost("r", "stage 0 (thinker) lost its worker")])
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == (
            "ChunkLostError: request 'r': stage 0 (thinker) lost its worker"
        )
        worker.release_all()


async def test_a_lost_notice_after_the_end_of_the_stream_changes_nothing(prefix):
    """Every notice arrived before the upstream worker died: what was read is whole."""
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        worker.on_notices([upstream_chunk(prefix, "r", 0), wire.Chunk("r", "", 0, 1, eos=True)])
        worker.on_notices([wire.Lost("r", "gone")])
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [(o.data, o.finished) for o in outputs] == [("CHUNK", False), (None, True)]
        worker.release_all()


async def test_a_lost_notice_before_the_submit_is_kept_for_it(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.on_notices([wire.Lost("r", "gone")])
        worker.handle(wire.Submit("r", None), nursery)
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == "ChunkLostError: request 'r': gone"
        worker.release_all()


async def test_a_chunk_whose_segment_is_gone_fails_its_request(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        chunk = upstream_chunk(prefix, "r", 0)
        _shm.unlink(chunk.key)  # swept with the worker that wrote it
        worker.on_notices([chunk])
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == (
            f"ChunkLostError: request 'r': chunk {chunk.key} is gone "
            f"(the upstream stage lost its worker)"
        )
        worker.release_all()


async def test_a_chunk_of_another_request_is_never_read_as_this_ones(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        chunk = upstream_chunk(prefix, "r", 0, owner="someone-else")
        worker.on_notices([chunk])
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == (
            f"ChunkLostError: request 'r': segment {chunk.key} holds a chunk of "
            f"request 'someone-else'"
        )
        assert not [f for f in sent(worker) if type(f) is wire.Output and f.data]
        worker.release_all()


def test_segment_names_belong_to_one_worker_generation(prefix):
    first = make_worker(prefix)
    second = _Worker(
        wire.Init(1, "relay", "process_engines:relay", {}, prefix, generation=2),
        relay(),
        first.control,
        first.chunks,
    )
    assert first.segment_prefix == f"{prefix}-1-1-"
    assert second.segment_prefix == f"{prefix}-1-2-"


async def test_a_missing_notice_is_an_error_not_a_gap_in_the_data(prefix):
    """Notices carry their place in the request's stream: a reader that sees chunk 1
    without chunk 0, or an end of stream after fewer chunks than were sent, fails."""
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("skips", None), nursery)
        worker.on_notices([upstream_chunk(prefix, "skips", 1)])
        worker.handle(wire.Submit("short", None), nursery)
        worker.on_notices([wire.Chunk("short", "", 0, 2, eos=True)])
        await trio.testing.wait_all_tasks_blocked()
        errors = {f.request_id: f.error for f in sent(worker) if type(f) is wire.Failed}
        assert errors == {
            "skips": "ChunkLostError: request 'skips': chunk 0 of its upstream stage never arrived",
            "short": "ChunkLostError: request 'short': chunk 0 of its upstream stage never arrived",
        }
        worker.release_all()


def sent_chunks(worker: _Worker) -> list[wire.Chunk]:
    """The chunk notices the worker queued for the relay so far, decoded."""
    assert worker.chunks is not None
    frames = []
    while True:
        try:
            frame = worker.chunks._receive.receive_nowait()
        except trio.WouldBlock:
            return frames
        frames.append(wire.DECODE_TO_RELAY.decode(frame[4:]))


def worker_of(prefix: str, engine, completion_delay: float = 0.0) -> _Worker:
    init = wire.Init(0, "thinker", "tests:engine", {}, prefix, completion_delay=completion_delay)
    control = wire.FrameWriter(trio.testing.MemorySendStream())
    chunks = wire.FrameWriter(trio.testing.MemorySendStream())
    return _Worker(init, engine, control, chunks)


async def test_a_last_output_is_the_completion_after_the_stream_end_and_the_delay(
    prefix, autojump_clock
):
    """``yield Last(data)``: data goes out as the completion -- after the end of the
    request's chunk stream and the completion delay, as a bare completion would -- and
    the engine is closed there: what follows the yield never runs, its finally does."""
    events = []

    async def engine(request, io):
        try:
            yield "a"
            yield Last("b")
            events.append("resumed")
            yield "c"
        finally:
            events.append("closed")

    worker = worker_of(prefix, engine, completion_delay=1.0)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        await trio.sleep(0.5)
        assert [(f.data, f.finished) for f in sent(worker)] == [("a", False)]
        assert [c.eos for c in sent_chunks(worker)] == [True]  # the stream's end went first
        assert events == ["closed"]
    assert trio.current_time() == 1.0
    assert [(f.data, f.finished) for f in sent(worker)] == [("b", True)]
    assert events == ["closed"]


async def test_an_engine_without_last_ends_with_a_bare_completion(prefix):
    async def engine(request, io):
        yield "a"
        yield "b"

    worker = worker_of(prefix, engine)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
    frames = sent(worker)
    assert [(f.data, f.finished) for f in frames] == [("a", False), ("b", False), (None, True)]


async def test_an_engine_that_yields_on_after_its_last_fails_its_request(prefix):
    """Closed after ``Last``, an engine that goes on yielding anyway is broken."""

    async def engine(request, io):
        try:
            yield Last("a")
        except GeneratorExit:
            yield "more"

    worker = worker_of(prefix, engine)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
    assert failure(worker, "r") == "RuntimeError: async generator ignored GeneratorExit"


def inline_chunk(request_id: str, seq: int, data: bytes) -> wire.Chunk:
    return wire.Chunk(request_id, "", len(data), seq, data=data)


async def test_small_chunks_travel_inside_their_notices_and_make_no_segment(prefix):
    """At most ``inline_chunk_bytes``: no segment, the bytes in the notice, a seq as
    any chunk's; a bigger chunk still gets its segment, which the release frees."""
    init = wire.Init(1, "relay", "process_engines:relay", {}, prefix, inline_chunk_bytes=4)
    chunks = wire.FrameWriter(trio.testing.MemorySendStream())
    worker = _Worker(init, relay(), wire.FrameWriter(trio.testing.MemorySendStream()), chunks)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        notices = [inline_chunk("r", 0, b""), inline_chunk("r", 1, b"tiny")]
        notices += [upstream_chunk(prefix, "r", 2), wire.Chunk("r", "", 0, 3, eos=True)]
        worker.on_notices(notices)  # the relay engine passes each on
        await trio.testing.wait_all_tasks_blocked()
        outputs = [f for f in sent(worker) if type(f) is wire.Output]
        assert [o.data for o in outputs] == ["", "TINY", "CHUNK", None]
        segment = f"{prefix}-1-1-1-2"
        assert sent_chunks(worker) == [
            inline_chunk("r", 0, b""),
            inline_chunk("r", 1, b"tiny"),
            wire.Chunk("r", segment, 5, 2),
            wire.Chunk("r", "", 0, 3, eos=True),
        ]
        assert worker.requests["r"].segments == [segment]
        assert _shm.listing(f"{prefix}-1-") == [segment]
        worker.release("r")
    assert _shm.listing(f"{prefix}-1-") == []


async def test_a_missing_inline_chunk_is_found_by_its_seq(prefix):
    worker = make_worker(prefix)
    async with trio.open_nursery() as nursery:
        worker.handle(wire.Submit("r", None), nursery)
        worker.on_notices([inline_chunk("r", 0, b"a"), inline_chunk("r", 2, b"c")])
        await trio.testing.wait_all_tasks_blocked()
        assert failure(worker, "r") == (
            "ChunkLostError: request 'r': chunk 1 of its upstream stage never arrived"
        )
        worker.release_all()
